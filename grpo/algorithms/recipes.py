"""Named recipes for `GRPOConfig.recipe(name, **overrides)`: published defaults, with sources.

Each recipe sets only what its paper states (or what defines the method); everything else keeps
the `GRPOConfig` default, and any field can be overridden. ``print(config)`` shows every resolved
value. Where a paper does not publish a value the recipe needs, the note says so. Values use the
field names only (no other spelling); a count of optimizer steps per epoch, which depends on the
caller's batch size, is ``"mini_batch_size": StepsPerEpoch(k)`` (`grpo.algorithms.mini_batches`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from grpo.algorithms.mini_batches import StepsPerEpoch

__all__ = ["RECIPES", "Recipe", "recipe_values"]


class Recipe(NamedTuple):
    citation: str
    values: dict[str, Any]
    notes: str = ""


RECIPES: dict[str, Recipe] = {
    "deepseek_math": Recipe(
        "Shao et al. 2024, DeepSeekMath (arXiv:2402.03300), GRPO, Sec. 4.1-4.2",
        {
            "group_size": 64,  # "sample 64 outputs for each question"
            "batch_size": 16,  # "training batch size is 1024" samples = 16 questions x 64
            "learning_rate": 1e-6,
            "kl_coeff": 0.04,
            "kl_estimator": "k3",
            "kl_penalty": "loss",
            "num_epochs_per_update": 1,  # "a single update following each exploration stage"
            "clip_epsilon": 0.2,
            "advantage_baseline": "group",
            "advantage_scale": "group",
            "loss_aggregation": "seq-mean-token-mean",  # 1/G sum_i 1/|o_i| sum_t
            "policy_loss": "clip",
        },
        "Max generation length 1024 (a generation setting, not a loss one).",
    ),
    "dr_grpo": Recipe(
        "Liu et al. 2025, Understanding R1-Zero-Like Training: A Critical Perspective "
        "(arXiv:2503.20783), Dr. GRPO",
        {
            "advantage_baseline": "group",
            "advantage_scale": "none",  # no std normalisation
            "loss_aggregation": "seq-mean-token-sum-norm",  # no 1/|o_i|: constant normaliser
            "kl_coeff": 0.0,
            "clip_epsilon": 0.2,
            "policy_loss": "clip",
            "learning_rate": 1e-6,
            "group_size": 8,
        },
        "loss_normaliser must be given (the generation budget, e.g. max_new_tokens): "
        "GRPOConfig.recipe('dr_grpo', loss_normaliser=...).",
    ),
    "dapo": Recipe(
        "Yu et al. 2025, DAPO (arXiv:2503.14476), Sec. 3 and 4.1",
        {
            "clip_epsilon": 0.2,
            "clip_epsilon_high": 0.28,  # clip-higher
            "drop_zero_variance_groups": True,  # dynamic sampling filter (no resampling here)
            "loss_aggregation": "token-mean",  # token-level policy gradient loss
            "kl_coeff": 0.0,  # KL term removed
            "policy_loss": "clip",
            "learning_rate": 1e-6,
            "group_size": 16,
            "batch_size": 512,  # prompts per rollout
            "mini_batch_size": 32,  # 16 gradient updates per rollout
        },
        "Overlong reward shaping is a reward, not a loss setting; resampling after the filter is "
        "up to the data loader.",
    ),
    "gspo": Recipe(
        "Zheng et al. 2025, Group Sequence Policy Optimization (arXiv:2507.18071)",
        {
            "policy_loss": "gspo",
            "clip_epsilon": 3e-4,
            "clip_epsilon_high": 4e-4,
            "loss_aggregation": "seq-mean-token-mean",  # 1/G sum_i of the sequence objective
            "kl_coeff": 0.0,
            "advantage_baseline": "group",
            "advantage_scale": "group",
        },
    ),
    "cispo": Recipe(
        "MiniMax 2025, MiniMax-M1 (arXiv:2506.13585), Sec. 3.1, CISPO",
        {
            "policy_loss": "cispo",
            "clip_epsilon": 1.0,  # "no lower bound on the IS weight"
            "clip_epsilon_high": 0.28,  # not published; DAPO's eps_high, override as needed
            "loss_aggregation": "token-mean",  # normalised by the total tokens of the batch
            "kl_coeff": 0.0,
            "advantage_baseline": "group",
            "advantage_scale": "group",
        },
        "The paper tunes only eps_high of the IS clip and does not publish it; 0.28 is a "
        "placeholder to override.",
    ),
    "small_policy": Recipe(
        "grpo's own preset for small policies (bandits, classic control): measured in "
        "benchmarks/RESULTS.md, section 'Small policies'",
        {
            "learning_rate": 5e-3,  # a small network, not a language model (3e-4 / 1e-6)
            "adaptive_lr_kl": 0.03,  # lower the rate while a step's KL > 0.06 (grpo.update.adaptive_lr)
            "adaptive_lr_max": 5e-3,  # ... never above the start (rising made Acrobot less reliable)
            "num_epochs_per_update": 10,  # reuse each rollout (PPO's 10 epochs)
            "mini_batch_size": StepsPerEpoch(4),  # 4 optimizer steps per epoch: 40 per rollout when 4
            # divides batch_size (a group is never split: else the finer split, grpo.algorithms.mini_batches)
            "kl_coeff": 0.0,
            "clip_epsilon": 0.2,
            "loss_aggregation": "token-mean",  # each env step weighs the same
            "gamma": 0.99,  # per-step rewards: returns-to-go
            "reward_shift_z": 4.0,  # restart on a changed task (grpo.training.reward_shift)
        },
        "Not from a paper: chosen so that every bandit and classic-control task of "
        "benchmarks/learning.py learns without tuning; batch_size and group_size stay yours. "
        "The learning rate starts at 5e-3 and falls (to 1e-5 at the least) while optimizer steps "
        "move the policy more than the KL band allows, so a 64x64 MLP on a few samples per "
        "step is not over-driven by the rate a few learned logits need. An overridden "
        "learning_rate is also the ceiling (adaptive_lr_max) unless that is overridden too. "
        "A settled policy whose rewards fall (the task changed) restarts from its starting "
        "weights (reward_shift_z; not with FSDP or DeepSpeed).",
    ),
    "finetune_success": Recipe(
        "grpo's own starting point for fine-tuning a pretrained (behaviour-cloned) control policy on "
        "a binary success reward (examples/robot_finetune.py): chosen by the sweep in "
        "benchmarks/RESULTS.md, section 'Robot fine-tuning on success'",
        {
            "learning_rate": 3e-4,  # a fixed rate: the pretrained policy is already near the goal
            "batch_size": 2,  # B = 2 starts an update: twice the updates of B = 4 per env step
            "num_epochs_per_update": 4,  # each rollout reused 4 times ...
            "mini_batch_size": StepsPerEpoch(4),  # ... one group a step (never split): 8 a rollout
            "clip_epsilon": 0.2,
            "clip_epsilon_high": 0.28,  # clip-higher (DAPO): rare successes may gain probability faster
            "kl_coeff": 0.0,
            "loss_aggregation": "token-mean",  # with per-step credit (EpisodeRewards): no length bias
            "gamma": 0.99,  # per-step credit: a success sooner is worth more
            "group_size": 8,
            "drop_zero_variance_groups": True,  # dynamic sampling: all-fail / all-succeed groups ...
            "max_sampling_draws": 4,  # ... replaced by new starts, at most 4 draws a step
        },
        "Not from a paper. Chosen among 6 settings on MetaWorld push-v3 (BC 0.32), 3 seeds each at "
        "60k env steps, by the mean success over seeds: B = 2 (0.55, range 0.48-0.64) ahead of B = 4 "
        "(0.48, 0.32-0.58), 10 or 20 epochs (0.53, 0.49), no back-fill (0.54) and no back-fill with "
        "10 epochs (0.48); the seed spread (std 0.07-0.28) is as large as these differences, and "
        "seeds 3 and 4 of B = 2 (0.46, 0.16) bring its mean to 0.45 (5 seeds): the best of the "
        "3-seed sweep, not a setting shown better than the others. A second sweep on drawer-open-v3 "
        "(3 seeds at 40k) found learning rate 1e-3 and G = 4 or 16 worse, and 1e-4, sigma 0.1 or "
        "0.5 and clip-higher off within the spread. Use it with per-step credit "
        "(grpo.gym.EpisodeRewards() on an env wrapped in grpo.gym.EndOnSuccess): a whole-episode "
        "reward with token-mean weighs the failures' long episodes over the successes' short ones "
        "(grpo.gym.success.LengthBiasWarning). No adaptive rate: small_policy's falls to its 1e-5 "
        "floor on a pretrained policy. The exploration noise is the policy's (the example sets "
        "sigma = 0.3). Back-fill needs a source of starts: trainer.step(seeds, more_states=...) or train().",
    ),
    "tiny_lm": Recipe(
        "grpo's own preset for tiny causal LMs trained from scratch, single- and multi-turn "
        "(grpo.llm.tiny, examples/llm_multiturn.py): measured in benchmarks/RESULTS.md, section "
        "'Multi-turn starting point'",
        {
            "learning_rate": 3e-3,  # a few-layer model with random weights, not a pretrained LM
            "kl_coeff": 0.0,  # no reference worth staying near: its weights are random
            "entropy_coeff": 0.01,  # keeps a group's episodes apart while the rewards are sparse
        },
        "Not from a paper: the setting that learned both multi-turn tasks of "
        "benchmarks/multiturn_recipe.py on every seed measured. A pretrained model (LoRA or full) "
        "wants a rate near 1e-6..1e-5 and usually the KL term: start from the defaults or a "
        "paper's recipe there, not from this one.",
    ),
}


def recipe_values(name: str) -> dict[str, Any]:
    """A copy of the recipe's field values; unknown names raise with the list of known ones."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose one of {sorted(RECIPES)}.")
    return dict(RECIPES[name].values)
