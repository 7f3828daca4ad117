"""`GRPOConfig`: every knob of the trainer, validated at construction, with help text per field.

Names follow seed 002 (``group_size``, ``batch_size``, ``num_epochs_per_update``, ``clip_epsilon``,
``kl_coeff``, ...). ``print(config)`` shows every resolved value and the derived quantities.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from grpo.algorithms.advantages import (
    ADVANTAGE_BASELINES,
    ADVANTAGE_SCALES,
    REWARD_COMBINATIONS,
    AdvantageBaseline,
    AdvantageScale,
    RewardCombination,
)
from grpo.algorithms.aggregation import AGGREGATIONS, Aggregation
from grpo.algorithms.kl import KL_ESTIMATORS, KLEstimator
from grpo.algorithms.loss_plugins import loss_plugin
from grpo.algorithms.mini_batches import StepsPerEpoch, divisors, mini_batch_for_count
from grpo.algorithms.policy_losses import POLICY_LOSSES, PolicyLossName
from grpo.algorithms.sampler_correction import SAMPLER_CORRECTIONS, SamplerCorrection
from grpo.runtime.spellings import SpelledFields, Spelling, read_spellings, unknown_names_message
from grpo.runtime.threads import SMALL_POLICY_ELEMENTS, NumThreads

KLPenalty = Literal["loss", "reward", "advantage"]
KL_PENALTIES: tuple[str, ...] = ("loss", "reward", "advantage")
LRScheduleName = Literal["constant", "linear", "cosine"]  # grpo.engine.lr_schedules builds them
LR_SCHEDULES: tuple[str, ...] = ("constant", "linear", "cosine")
DistributedMode = Literal["auto", "off"]  # grpo.engine.distributed.setup_distributed reads them
DISTRIBUTED_MODES: tuple[str, ...] = ("auto", "off")

__all__ = [
    "SPELLINGS",
    "GRPOConfig",
    "optimizer_steps_per_step",
]

NonFinitePolicy = Literal["skip", "raise"]
NON_FINITE_POLICIES: tuple[str, ...] = ("skip", "raise")
InvalidRewardPolicy = Literal["raise", "drop_groups"]
INVALID_REWARD_POLICIES: tuple[str, ...] = ("raise", "drop_groups")
GenerationEngineName = Literal["hf", "worker", "vllm"]
GENERATION_ENGINES: tuple[str, ...] = ("hf", "worker", "vllm")
ASYNC_DEFAULT_IS_CAP = 2.0
"""The importance-weight cap of the sampler correction when ``async_staleness >= 1`` and
``sampler_is_cap`` is None."""


def _recipe_citation(name: str) -> str:
    from grpo.algorithms.recipes import RECIPES

    return RECIPES[name].citation if name in RECIPES else "(unknown recipe)"


def _is_exactly_one(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == 1.0


def _is_positive_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _is_finite(v: float) -> bool:
    """``v`` is finite (an int too large for a float is not: it cannot be used as one)."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _divisor_list(n: int) -> str:
    """The divisors of ``n`` for a message (``[1, 2, 4]``; "its divisors" when too many to search)."""
    return str(divisors(n) or "its divisors")


def _help(text: str) -> dict[str, str]:
    return {"help": text}


def _example(name: str) -> str:
    """`` Valid: e.g. <default> (the default).`` for a field whose default is a number, else ""."""
    default = _DEFAULTS.get(name)
    if not isinstance(default, (int, float)) or isinstance(default, bool):
        return ""
    return f" Valid: e.g. {name}={default!r} (the default)."


def _mini_batch_for_count(num_mini_batches: Any, others: Mapping[str, Any]) -> int | None:
    """``num_mini_batches`` (optimizer steps per epoch) as ``mini_batch_size``
    (`grpo.algorithms.mini_batches.mini_batch_for_count`; None: None)."""
    if num_mini_batches is None:
        return None
    if isinstance(num_mini_batches, bool) or not isinstance(num_mini_batches, int) or num_mini_batches < 1:
        raise ValueError(f"num_mini_batches={num_mini_batches!r} is not allowed: expected an integer >= 1.")
    if not _is_positive_int(others["batch_size"]):
        return None  # GRPOConfig refuses the batch size itself
    return mini_batch_for_count(others["batch_size"], num_mini_batches)


def _hint(field_name: str, origin: str) -> Spelling:
    """Another library's name, offered by "did you mean" only (its values or meaning differ)."""
    return Spelling(field_name, origin, accepted=False)


#: The one alias table of `GRPOConfig`: every other name of a field, read by
#: `GRPOConfig.from_dict`, `GRPOConfig.recipe`, config files and ``grpo-train``'s flags when
#: accepted, offered by "did you mean" (`grpo.runtime.spellings.did_you_mean`) always.
SPELLINGS: dict[str, Spelling] = {
    # seed 003's grpo-train flags and TRL's names: the same knob, the same values
    "num_generations": Spelling("group_size", "seed 003"),
    "kl_coef": Spelling("kl_coeff", "seed 003"),
    "clip_range": Spelling("clip_epsilon", "seed 003"),
    "save_steps": Spelling("checkpoint_freq", "seed 003"),
    "clip_range_high": Spelling("clip_epsilon_high", "grpo-train"),
    "num_iterations": Spelling("num_epochs_per_update", "TRL"),
    "recipe": Spelling("recipe_name", "grpo-train"),
    "async": Spelling("async_staleness", "grpo-train"),
    "engine": Spelling("generation_engine", "grpo-train"),
    # seed 001's (AgileRL's) names: values mapped
    "adv_norm": Spelling(
        "advantage_scale",
        "seed 001",
        {"mean_std": "group", "mean_only": "none"},
        Literal["mean_std", "mean_only"],
    ),
    "use_kl_advantage_shaping": Spelling("kl_penalty", "seed 001", {True: "advantage", False: None}, bool),
    # grpo's own earlier fields, folded into the one field of their concept
    "normalize_advantages": Spelling(
        "advantage_scale", "grpo 0.2", {True: "group", False: "none"}, bool, field_wins=True
    ),
    "num_mini_batches": Spelling("mini_batch_size", "grpo 0.2 / PPO", _mini_batch_for_count, int | None),
    # other libraries' names (TRL, OpenRLHF, verl, stable-baselines3, rsl_rl), common short forms
    **{n: _hint("learning_rate", "common") for n in ("lr", "learning_rate_init")},
    "wd": _hint("weight_decay", "common"),
    **{n: _hint("kl_coeff", "TRL / OpenRLHF") for n in ("beta", "kl_beta", "init_kl_coef")},
    **{n: _hint("entropy_coeff", "stable-baselines3") for n in ("ent_coef", "entropy_coef")},
    **{n: _hint("group_size", "OpenRLHF / verl") for n in ("n_samples_per_prompt", "rollout_n")},
    **{n: _hint("clip_epsilon", "TRL / OpenRLHF") for n in ("epsilon", "eps_clip", "cliprange")},
    **{n: _hint("clip_epsilon_high", "TRL / verl") for n in ("epsilon_high", "clip_ratio_high")},
    **{n: _hint("num_epochs_per_update", "PPO") for n in ("ppo_epochs", "n_epochs", "num_epochs", "epochs")},
    **{n: _hint("max_grad_norm", "common") for n in ("grad_clip", "max_norm", "clip_grad_norm")},
    **{n: _hint("lr_schedule", "transformers") for n in ("lr_scheduler_type", "lr_scheduler", "scheduler")},
    "desired_kl": _hint("adaptive_lr_kl", "rsl_rl"),
    **{n: _hint("warmup_steps", "transformers") for n in ("warmup", "num_warmup_steps")},
    "loss_type": _hint("loss_aggregation", "TRL"),
    "scale_rewards": _hint("advantage_scale", "TRL"),
}


def optimizer_steps_per_step(batch_size: int, mini_batch_size: int | None, num_epochs_per_update: int) -> int:
    """Optimizer steps of one trainer step: E * B / M (E epochs over the batch of B states, M states
    per optimizer step; ``mini_batch_size`` None: M = B). The one place this number is computed."""
    return num_epochs_per_update * (
        batch_size // (batch_size if mini_batch_size is None else mini_batch_size)
    )


@dataclass
class GRPOConfig(SpelledFields):
    """Configuration of `GRPOTrainer`. Invalid values raise `ValueError` saying what is allowed.

    ``GRPOConfig(...)`` takes the field names; a keyword that is no field is refused with the field
    meant (`grpo.runtime.spellings.SpelledFields`). `GRPOConfig.from_dict` and `GRPOConfig.recipe`
    also read the other spellings of `SPELLINGS` (seed 001's ``adv_norm``, seed 003's ``kl_coef``).
    """

    spellings: ClassVar[Mapping[str, Spelling]] = SPELLINGS

    group_size: int = field(
        default=8,
        metadata=_help(
            "G: actions sampled per state. Advantages compare each action with the others of its "
            "group, so G must be >= 2."
        ),
    )
    batch_size: int = field(
        default=8,
        metadata=_help(
            "B: states per step (what train() draws from a source). step(states) uses all the "
            "states it is given."
        ),
    )
    mini_batch_size: int | None = field(
        default=None,
        metadata=_help(
            "States (groups) per optimizer step; None = the whole batch, one optimizer step per "
            "epoch. Must divide batch_size. A group is never split. (num_mini_batches=k, PPO's "
            "count of optimizer steps per epoch, is read as the largest divisor of batch_size "
            "<= batch_size / k; see SPELLINGS.)"
        ),
    )
    micro_batch_size: int | None = field(
        default=None,
        metadata=_help(
            "States per forward/backward pass inside an optimizer step (gradient accumulation, for "
            "memory); None = mini_batch_size. Must divide mini_batch_size. Does not change the "
            "update: the loss normaliser counts the whole optimizer step."
        ),
    )
    learning_rate: float = field(
        default=3e-4, metadata=_help("Learning rate of the default AdamW optimizer (> 0).")
    )
    weight_decay: float = field(
        default=0.0, metadata=_help("Weight decay of the default AdamW optimizer (>= 0).")
    )
    num_epochs_per_update: int = field(
        default=1,
        metadata=_help(
            "Passes over each step's experience (PPO epochs, mu in DeepSeekMath). Epochs after "
            "the first reuse the same rollouts with the ratio to the behaviour policy."
        ),
    )
    clip_epsilon: float = field(
        default=0.2,
        metadata=_help(
            "eps_low: the ratio is clipped below at 1 - clip_epsilon (0 < eps < 1; exactly 1 = no "
            "lower bound, as CISPO uses for its IS weight)."
        ),
    )
    clip_epsilon_high: float | None = field(
        default=None,
        metadata=_help(
            "eps_high: the ratio is clipped above at 1 + clip_epsilon_high; None = clip_epsilon. "
            "DAPO's clip-higher uses 0.28 with clip_epsilon 0.2."
        ),
    )
    kl_coeff: float = field(
        default=0.04,
        metadata=_help(
            "beta: weight of KL(pi || pi_ref) in the loss (DeepSeekMath: 0.04). 0 = no reference "
            "policy is built or run."
        ),
    )
    kl_estimator: KLEstimator = field(
        default="k3",
        metadata=_help(
            "Estimator of KL(pi_theta || pi_ref) on the policy's samples: 'k1' = log r, "
            "'k2' = (log r)^2/2, 'k3' = exp(-log r) + log r - 1 with r = pi/pi_ref (unbiased, >= 0)."
        ),
    )
    entropy_coeff: float = field(
        default=0.0,
        metadata=_help(
            "Weight of the entropy bonus (exact when the policy provides entropy, else a Monte "
            "Carlo estimate). >= 0."
        ),
    )
    advantage_eps: float = field(default=1e-6, metadata=_help("eps in A = (r - mean) / (std + eps) (> 0)."))
    gamma: float = field(
        default=1.0,
        metadata=_help(
            "Discount of per-step rewards (a reward model returning (N, T)): each step is credited "
            "with its return-to-go G_t = r_t + gamma * G_{t+1}, compared across its group at the "
            "same t. In [0, 1]; unused when the reward is one number per sample."
        ),
    )
    loss_aggregation: Aggregation = field(
        default="token-mean",
        metadata=_help(
            "How per-step losses become one number: 'token-mean' (mean over every valid step of "
            "the optimizer step), 'seq-mean-token-mean' (mean over steps of each sample, then "
            "over samples), 'seq-mean-token-sum' (sum over steps, mean over samples) or "
            "'seq-mean-token-sum-norm' (sum over steps / loss_normaliser, mean over samples; "
            "Dr. GRPO). See docs/algorithms.md."
        ),
    )
    log_ratio_clamp: float = field(
        default=20.0,
        metadata=_help("Log-ratios are clamped to [-c, c] before exp, for numerical safety (> 0)."),
    )
    max_grad_norm: float | None = field(
        default=1.0,
        metadata=_help("Clip the global gradient norm to this value; None = no clipping (> 0)."),
    )
    device: str = field(
        default="cpu",
        metadata=_help("'cpu', 'cuda', 'cuda:N', or 'auto' (cuda when available)."),
    )
    reference_update_freq: int | None = field(
        default=None,
        metadata=_help(
            "Refresh the frozen reference snapshot from the policy every N steps; None = never "
            "(the reference stays the starting policy, as in DeepSeekMath)."
        ),
    )
    checkpoint_freq: int | None = field(
        default=None,
        metadata=_help("Save a checkpoint every N steps in GRPOTrainer.train(); None = never."),
    )
    seed: int | None = field(
        default=None,
        metadata=_help(
            "Seed Python, NumPy and torch at trainer construction, and the minibatch shuffler. "
            "None = leave the global RNGs alone."
        ),
    )
    # --- training loop: learning-rate schedule ---
    lr_schedule: LRScheduleName = field(
        default="constant",
        metadata=_help(
            "Learning-rate schedule after warmup: 'constant', 'linear' (decay to "
            "lr_min_ratio * learning_rate at total_steps) or 'cosine'. Formulas in "
            "grpo.engine.lr_schedules; stepped once per optimizer step."
        ),
    )
    warmup_steps: int = field(
        default=0,
        metadata=_help(
            "W: optimizer steps of linear warmup; step s < W uses learning_rate * (s + 1) / (W + 1). "
            "0 = no warmup (>= 0)."
        ),
    )
    total_steps: int | None = field(
        default=None,
        metadata=_help(
            "S: optimizer steps over which 'linear'/'cosine' decay (required for them, > "
            "warmup_steps); usually num_steps * optimizer_steps_per_step. Ignored by 'constant'."
        ),
    )
    lr_min_ratio: float = field(
        default=0.0,
        metadata=_help("Final learning rate of 'linear'/'cosine' as a fraction of learning_rate, in [0, 1]."),
    )
    adaptive_lr_kl: float | None = field(
        default=None,
        metadata=_help(
            "κ: adapt the learning rate to keep each optimizer step's KL(π_old ‖ π_θ) near κ: "
            "divided by 1.5 when above 2κ, times 1.5 when below κ/2, within [adaptive_lr_min, "
            "adaptive_lr_max], starting at learning_rate (rsl_rl's 'adaptive' schedule; rule in "
            "grpo.update.adaptive_lr). Needs more than one optimizer step per update. None = off (> 0)."
        ),
    )
    adaptive_lr_min: float = field(
        default=1e-5, metadata=_help("Smallest learning rate adaptive_lr_kl may set (> 0).")
    )
    adaptive_lr_max: float = field(
        default=1e-2, metadata=_help("Largest learning rate adaptive_lr_kl may set (>= adaptive_lr_min).")
    )

    reward_shift_z: float | None = field(
        default=None,
        metadata=_help(
            "z: restart from the starting weights when the mean reward "
            "falls more than z standard deviations of its fast average while the policy stands still "
            "(mean kl/old < reward_shift_kl over 10 steps): a non-stationary task changed (rule in "
            "grpo.training.reward_shift). Needs more than one optimizer step per update. None = off (> 0)."
        ),
    )
    reward_shift_kl: float = field(
        default=1e-3,
        metadata=_help(
            "Mean kl/old over 10 steps below which reward_shift_z counts the policy as settled (> 0)."
        ),
    )

    # --- algorithm variants ---
    recipe_name: str | None = field(
        default=None,
        metadata=_help("Set by GRPOConfig.recipe(name): the named preset these values started from."),
    )
    advantage_baseline: AdvantageBaseline = field(
        default="group",
        metadata=_help(
            "b in A = (r - b) / d: 'group' mean (GRPO), 'leave_one_out' mean of the other group "
            "members (RLOO), 'batch' mean, 'running' mean over all steps so far, or 'none' (0)."
        ),
    )
    advantage_scale: AdvantageScale = field(
        default="group",
        metadata=_help(
            "d in A = (r - b) / d: 'group' std + eps (GRPO), 'batch' std + eps, 'running' std + "
            "eps, or 'none' (1: A = r - mean_group, seed 002's formula, Dr. GRPO). "
            "(normalize_advantages=True/False and seed 001's adv_norm='mean_std'/'mean_only' read "
            "as 'group'/'none'; see SPELLINGS.)"
        ),
    )
    reward_clip: float | None = field(
        default=None,
        metadata=_help("Clip rewards to [-c, c] before computing advantages (ROLL reward_clip); None = off."),
    )
    advantage_clip: float | None = field(
        default=None,
        metadata=_help(
            "Clip advantages to [-c, c] after normalising/whitening (ROLL advantage_clip); None = off."
        ),
    )
    whiten_advantages: bool = field(
        default=False,
        metadata=_help(
            "Whiten advantages over the valid steps of the whole batch: (A - mean) / std "
            "(ROLL whiten_advantages)."
        ),
    )
    drop_zero_variance_groups: bool = field(
        default=False,
        metadata=_help(
            "Drop groups whose rewards are all equal from the loss (their GRPO advantage is 0) and "
            "from the loss normaliser (DAPO dynamic-sampling filter; max_sampling_draws > 1 also "
            "refills the batch). Logged as advantage/frac_dropped_groups."
        ),
    )
    max_sampling_draws: int = field(
        default=1,
        metadata=_help(
            "Dynamic sampling with back-fill (with drop_zero_variance_groups=True; DAPO, verl's "
            "filter_groups): a step draws up to this many batches of states until it holds B groups "
            "with mixed rewards (max > min in the group), the first B found in draw order. At the "
            "cap it trains on the mixed groups found, topped up with all-equal groups that "
            "drop_zero_variance_groups leaves out of the loss, and warns. Needs a source of states: "
            "train(), or step(states, more_states=...). 1 = no back-fill. Logged as sampling/*."
        ),
    )
    reward_combination: RewardCombination = field(
        default="sum",
        metadata=_help(
            "With reward components: 'sum' normalises the weighted sum sum_k w_k r_k; "
            "'per_component' normalises each component, then sums: A = sum_k w_k A(r_k)."
        ),
    )
    policy_loss: PolicyLossName = field(
        default="clip",
        metadata=_help(
            "'clip' (GRPO/PPO token-level clipped surrogate), 'gspo' (sequence-level ratio), "
            "'cispo' (clipped stop-gradient IS weight x log-prob), 'sapo' (soft sigmoid gate), "
            "'reinforce' (-A log-prob, no ratio)."
        ),
    )
    dual_clip: bool = field(
        default=False,
        metadata=_help(
            "Dual clip for negative advantages: the loss of a step with A < 0 is capped at "
            "dual_clip_c * |A| ('clip' and 'gspo' losses)."
        ),
    )
    dual_clip_c: float = field(default=3.0, metadata=_help("The dual-clip constant c (> 1; 3 is usual)."))
    sapo_tau_pos: float = field(
        default=1.0, metadata=_help("SAPO gate temperature for A > 0 (> 0; paper default 1.0).")
    )
    sapo_tau_neg: float = field(
        default=1.05, metadata=_help("SAPO gate temperature for A <= 0 (> 0; paper default 1.05).")
    )
    kl_penalty: KLPenalty = field(
        default="loss",
        metadata=_help(
            "Where the KL to the reference enters: 'loss' (kl_coeff * KL term in the loss, "
            "DeepSeekMath), 'reward' (a per-step penalty kl_coeff * KL(old || ref) subtracted "
            "from the reward before the advantage; see docs/algorithms.md) or 'advantage' "
            "(KL-based advantage shaping, the seed's use_kl_advantage_shaping=True: each step's "
            "advantage becomes A - kl_coeff * sg(KL_t) with the kl_estimator on the current "
            "policy, before the policy loss clips; no KL term in the loss)."
        ),
    )
    mask_truncated_completions: bool = field(
        default=False,
        metadata=_help(
            "DAPO's overlong filtering: a sample whose action did not end (an LLM completion cut at "
            "the token limit: action.truncated is True) contributes no gradient: its loss-mask row "
            "is zeroed at collection, so it leaves the loss and the loss normaliser. Its reward "
            "still counts in its group's advantage baseline (as in TRL and DAPO)."
        ),
    )
    loss_normaliser: float | None = field(
        default=None,
        metadata=_help(
            "The constant C of loss_aggregation='seq-mean-token-sum-norm' (Dr. GRPO: the "
            "generation budget, e.g. max_new_tokens). Required for that mode; > 0."
        ),
    )
    use_liger_loss: bool = field(
        default=False,
        metadata=_help(
            "Compute the update's loss with Liger-Kernel's fused linear GRPO loss "
            "(grpo.llm.liger.LigerGRPOLoss: the policy's last hidden states and LM head weight, "
            "chunked; pip install liger-kernel) instead of log-probs + the objective. Needs a "
            "policy with lm_head_inputs (grpo.llm.CausalLMPolicy) and the settings Liger computes "
            "(grpo.llm.liger.liger_config_problems names the others). Not reported with it: "
            "loss/policy, loss/kl, loss/entropy, kl/old, policy/entropy, ratio/*, the split "
            "clip/frac_low / clip/frac_high (clip/frac gives their sum)."
        ),
    )

    # --- reliability: non-finite values, invalid rewards, reward timeouts, checkpoints ---
    non_finite: NonFinitePolicy = field(
        default="skip",
        metadata=_help(
            "What a NaN/inf loss or gradient does (or a NaN/inf learning rate or weight decay of "
            "the optimizer, or weights an optimizer step made NaN/inf): 'skip' = the whole update "
            "of that step is undone (weights and optimizer state bitwise as before the step), "
            "counted in optim/non_finite_steps, with a warning; 'raise' = undo the same way, then "
            "raise FloatingPointError. Weights made NaN/inf by an update of a single optimizer "
            "step cannot be undone (no copy is kept) and always raise (grpo/update/guard.py)."
        ),
    )
    invalid_rewards: InvalidRewardPolicy = field(
        default="raise",
        metadata=_help(
            "What a NaN/inf/None reward does: 'raise' = ValueError naming the samples; "
            "'drop_groups' = the groups holding such samples are left out of the step (reported as "
            "reward/dropped_groups); a step where every group is invalid still raises."
        ),
    )
    reward_timeout: float | None = field(
        default=None,
        metadata=_help(
            "Seconds one reward call may take before RewardTimeoutError is raised (> 0); None = no "
            "limit. The call runs in a helper thread, which cannot be stopped: it finishes in the "
            "background."
        ),
    )
    generation_engine: GenerationEngineName = field(
        default="hf",
        metadata=_help(
            "Who samples the actions (grpo.generation): 'hf' = the trainer's own policy, in the "
            "trainer's process (Hugging Face generate for a language model; today's synchronous "
            "step); 'worker' = a copy of the policy in its own process that receives the trainable "
            "weights after each update through shared memory (a language model: only the LoRA "
            "weights move for a LoRA policy); 'vllm' = vLLM in the trainer's process (CUDA: pip "
            "install 'torch-grpo[vllm]'; CPU: vLLM's CPU build, docs/llm.md 'Installing vLLM'). "
            "docs/llm.md, Generation engines."
        ),
    )
    async_staleness: int = field(
        default=0,
        metadata=_help(
            "Async rollouts: train() submits each batch's generation this many steps before the "
            "step that trains on it, so the engine generates while the trainer updates. A batch "
            "is then sampled by the weights of at most K steps ago; each sample carries that "
            "policy version, the behaviour log-probs are the trainer's own (current weights) and "
            "each term is weighted by the importance ratio to the generating version "
            "(sampler_correction; cap sampler_is_cap, 2 when None). 0 = synchronous (bitwise "
            "today's step). >= 1 needs an engine with its own weights ('worker', 'vllm'). A resumed "
            "run neither skips nor repeats a batch."
        ),
    )
    sampler_is_cap: float | None = field(
        default=None,
        metadata=_help(
            "Truncated importance sampling for a sampler whose numbers differ from the trainer's "
            "(vLLM, a quantised or differently batched generator): the policy's "
            "generate_actions_with_log_probs reports the sampler's log-probs of its actions, the "
            "trainer computes its own behaviour log-probs with the same weights, and the policy "
            "term of each step is weighted by min(exp(logp_old - logp_sampler), cap) (no gradient; "
            "metrics sampler/is_weight_mean, sampler/is_frac_capped). > 0, typically 2. None = off: "
            "the sampler's log-probs, when given, are the behaviour log-probs."
        ),
    )
    sampler_correction: SamplerCorrection = field(
        default="token_truncate",
        metadata=_help(
            "How sampler_is_cap's cap C corrects the mismatch (used when a cap is in effect: "
            "sampler_is_cap, or 2 with async_staleness >= 1; unused otherwise), "
            "with d = logp_old - logp_sampler per valid token and s = its sum over the sample: "
            "'token_truncate' w = min(exp(d), C); 'token_mask' w = exp(d), or 0 where exp(d) > C; "
            "'sequence_truncate' w = min(exp(s), C) for every token of the sample; "
            "'sequence_mask' w = exp(s), or 0 for the whole sample where exp(s) > C. The *_mask "
            "modes drop the policy term of what exceeds C instead of shrinking it (metric "
            "sampler/is_frac_capped counts it; sampler/ess is the effective sample size). See "
            "grpo/algorithms/sampler_correction.py."
        ),
    )
    flush_denormals: bool = field(
        default=True,
        metadata=_help(
            "During step(), CPU float arithmetic reads and writes subnormal numbers (|x| < 1.2e-38 "
            "in float32) as 0, as TensorFlow does in its CPU threads; the thread's setting is restored "
            "after the step. A near-deterministic policy makes such numbers (probabilities, their "
            "gradients) and CPU arithmetic on them is many times slower, so without this a "
            "converging run slows down. Changes values only below that magnitude. False = leave "
            "the setting (torch.set_flush_denormal) alone."
        ),
    )
    num_threads: NumThreads = field(
        default="auto",
        metadata=_help(
            "Intra-op threads (torch.set_num_threads) while step(), train_on_batch(), update() and "
            "evaluate() run; the caller's count is restored afterwards. 'auto': 1 when the policy "
            "runs on CPU and its weights (frozen ones included) hold at most "
            f"grpo.runtime.threads.SMALL_POLICY_ELEMENTS ({SMALL_POLICY_ELEMENTS:,}) elements, else torch's "
            "setting is left alone: a small policy's ops are too small to gain from threads, and "
            "beside another busy process each parallel op waits for a descheduled thread (steps "
            "2-4x slower, single steps up to 9x; docs/training.md, Threads). An int >= 1: that many "
            "threads. None: leave torch's setting alone."
        ),
    )
    checkpoint_keep_last: int | None = field(
        default=3,
        metadata=_help(
            "save_checkpoint() keeps the newest K checkpoints of a directory and deletes older ones "
            "(>= 1); None = keep all."
        ),
    )

    # --- scaling out (torch.distributed) ---
    distributed: DistributedMode = field(
        default="auto",
        metadata=_help(
            "'auto': under torchrun (or with a process group already initialised) train data-"
            "parallel: each process steps on its own states, gradients and metrics are reduced "
            "across processes (see docs/scaling.md); one process otherwise. 'off': never "
            "communicate, each process trains alone. Batch sizes are per process."
        ),
    )
    deepspeed: str = field(
        default="auto",
        metadata=_help(
            "DeepSpeed ZeRO-1/2/3 for the backward pass and optimizer step (the 'deepspeed' extra: "
            "pip install 'torch-grpo[deepspeed]'; see grpo.engine.deepspeed and docs/scaling.md). "
            "'auto': when "
            "accelerate launch was configured for DeepSpeed (ACCELERATE_USE_DEEPSPEED=true), its "
            "DeepSpeed config; otherwise off. 'off': never. Any other value: the path of a "
            "DeepSpeed JSON config."
        ),
    )
    fsdp: bool = field(
        default=False,
        metadata=_help(
            "Shard the policy's weights, gradients and optimizer state over the torchrun processes "
            "with PyTorch FSDP2 (torch.distributed.fsdp.fully_shard); nn.Module policies only "
            "(the Hugging Face causal-LM policy included). See docs/scaling.md."
        ),
    )

    @classmethod
    def recipe(cls, name: str, **overrides: Any) -> GRPOConfig:
        """A named preset with its paper's published defaults, then ``overrides``.

        Names: see `grpo.algorithms.recipes.RECIPES` ("deepseek_math", "dr_grpo", "dapo", "gspo", "cispo",
        grpo's own "small_policy" for bandits and classic control, and "tiny_lm" for tiny causal
        LMs trained from scratch, e.g. multi-turn on `grpo.llm.tiny`).
        """
        from grpo.algorithms.recipes import recipe_values

        values = recipe_values(name)
        context = {**_DEFAULTS, **values, **overrides}  # num_mini_batches reads the final batch_size
        try:
            overrides = read_spellings(overrides, SPELLINGS, context)
            values = read_spellings(values, SPELLINGS, context)
            steps = values.get("mini_batch_size")
            if isinstance(steps, StepsPerEpoch) and "mini_batch_size" not in overrides:
                b = context["batch_size"]  # not a positive integer: GRPOConfig says so below
                values["mini_batch_size"] = steps.mini_batch_size(b) if _is_positive_int(b) else None
        except ValueError as e:
            raise ValueError(f"GRPOConfig.recipe({name!r}): {e}") from None
        unknown = {k: v for k, v in overrides.items() if k not in _DEFAULTS}
        if unknown:
            message = unknown_names_message(unknown, list(_DEFAULTS), SPELLINGS)
            raise TypeError(
                f"GRPOConfig.recipe({name!r}) got unknown field{'s' * (len(unknown) > 1)} {message}"
            )
        if (  # a recipe whose adaptive rate only falls from its start: so does the caller's start
            "learning_rate" in overrides
            and "adaptive_lr_max" not in overrides
            and "adaptive_lr_max" in values  # (a recipe without it: nothing to follow)
            and values.get("adaptive_lr_max") == values.get("learning_rate")
        ):
            values["adaptive_lr_max"] = overrides["learning_rate"]
        values.update(overrides)
        values["recipe_name"] = name
        return cls(**values)

    def __post_init__(self) -> None:
        # the order of the checks is the order in which errors are reported
        self._check_counts()
        self._check_step_sizes()
        self._check_loss_settings()
        self._check_batch_division()
        self._check_lr_schedule()
        self._check_adaptive_lr()
        self._check_reward_shift()
        self._check_variants()
        self._check_liger()
        self._check_reliability()
        self._check_parallelism()

    # ---- validation helpers ---------------------------------------------------------------
    def _bad(self, name: str, allowed: str, extra: str = "") -> ValueError:
        return ValueError(f"GRPOConfig.{name}={getattr(self, name)!r} is not allowed: {allowed}.{extra}")

    def _check_int(self, name: str, minimum: int, optional: bool = False) -> None:
        v = getattr(self, name)
        if v is None and optional:
            return
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise self._bad(name, f"expected an integer >= {minimum}" + (" or None" if optional else ""))

    def _check_float(
        self, name: str, lo: float, lo_inclusive: bool, hi: float | None = None, *, finite: bool = False
    ) -> None:
        v = getattr(self, name)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v == v
        if ok:
            ok = (v >= lo if lo_inclusive else v > lo) and (hi is None or v < hi)
            ok = ok and (not finite or _is_finite(v))
        if not ok:
            rng = f"{'>=' if lo_inclusive else '>'} {lo}" + (f" and < {hi}" if hi else "")
            raise self._bad(name, f"expected a {'finite ' if finite else ''}number {rng}", _example(name))

    def _check_bool(self, name: str) -> None:
        if not isinstance(getattr(self, name), bool):
            raise self._bad(name, "expected True or False")

    def _check_choice(self, name: str, choices: tuple[str, ...]) -> None:
        if getattr(self, name) not in choices:
            raise self._bad(name, f"choose one of {choices}")

    # ---- validation, by topic --------------------------------------------------------------
    def _check_counts(self) -> None:
        """group_size, the batch sizes, the update and checkpoint frequencies and the seed."""
        if isinstance(self.group_size, int) and not isinstance(self.group_size, bool) and self.group_size < 2:
            raise self._bad(
                "group_size",
                "GRPO needs group_size >= 2",
                " The advantage of an action is its reward relative to the other actions sampled "
                "for the same state; a group of one has nothing to compare with (its advantage "
                "would always be 0). Use group_size=2 or more (8 is typical).",
            )
        self._check_int("group_size", 2)
        self._check_int("batch_size", 1)
        self._check_int("mini_batch_size", 1, optional=True)
        self._check_int("micro_batch_size", 1, optional=True)
        self._check_int("num_epochs_per_update", 1)
        self._check_int("reference_update_freq", 1, optional=True)
        self._check_int("checkpoint_freq", 1, optional=True)
        if self.seed is not None:
            self._check_int("seed", 0)

    def _check_step_sizes(self) -> None:
        """learning_rate, weight_decay and the clip range."""
        # finite: one optimizer step with an infinite learning rate or weight decay makes every
        # weight inf/NaN (the update guard would undo it, but the run could never train)
        self._check_float("learning_rate", 0.0, False, finite=True)
        self._check_float("weight_decay", 0.0, True, finite=True)
        if not _is_exactly_one(self.clip_epsilon):  # 1.0 = no lower bound (CISPO's IS weight)
            try:
                self._check_float("clip_epsilon", 0.0, False, 1.0)
            except ValueError as e:
                raise ValueError(f"{e} Exactly 1 is allowed too: no lower bound on the ratio.") from None
        if self.clip_epsilon_high is not None:
            self._check_float("clip_epsilon_high", 0.0, False)

    def _check_loss_settings(self) -> None:
        """The coefficients and estimators of the loss, gamma, gradient clipping and the device."""
        # finite: inf makes every loss non-finite (kl_coeff, entropy_coeff) or every advantage 0
        # (advantage_eps), so nothing would ever train
        self._check_float("kl_coeff", 0.0, True, finite=True)
        self._check_float("entropy_coeff", 0.0, True, finite=True)
        self._check_float("advantage_eps", 0.0, False, finite=True)
        g = self.gamma
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0.0 <= g <= 1.0:
            raise self._bad(
                "gamma", "expected a number in [0, 1] (1 = undiscounted)", " Valid: e.g. gamma=0.99"
            )
        self._check_float("log_ratio_clamp", 0.0, False)
        if self.max_grad_norm is not None:
            self._check_float("max_grad_norm", 0.0, False)
        self._check_choice("kl_estimator", KL_ESTIMATORS)
        self._check_choice("loss_aggregation", AGGREGATIONS)
        if not isinstance(self.device, str) or not (
            self.device in ("cpu", "cuda", "auto", "mps") or self.device.startswith("cuda:")
        ):
            raise self._bad("device", "expected 'cpu', 'cuda', 'cuda:N', 'mps' or 'auto'")

    def _check_batch_division(self) -> None:
        """The mini-batch divides the batch and the micro-batch divides the mini-batch."""
        mb = self.resolved_mini_batch_size
        if self.batch_size % mb:
            raise self._bad(
                "mini_batch_size",
                f"it must divide batch_size={self.batch_size} so that every optimizer step sees whole groups",
                f" Valid values: {_divisor_list(self.batch_size)} (or None for the whole batch).",
            )
        micro = self.resolved_micro_batch_size
        if mb % micro:
            raise self._bad(
                "micro_batch_size",
                f"it must divide mini_batch_size={mb}",
                f" Valid values: {_divisor_list(mb)} (or None for no accumulation).",
            )

    def _check_lr_schedule(self) -> None:
        """Training loop: the learning-rate schedule."""
        self._check_choice("lr_schedule", LR_SCHEDULES)
        self._check_int("warmup_steps", 0)
        self._check_int("total_steps", 1, optional=True)
        decays = self.lr_schedule != "constant"
        if decays and (self.total_steps is None or self.total_steps <= self.warmup_steps):
            raise self._bad(
                "total_steps",
                f"lr_schedule={self.lr_schedule!r} decays until total_steps, which must be > "
                f"warmup_steps={self.warmup_steps}",
                f" Set it to the run's optimizer steps: num_steps * optimizer_steps_per_step "
                f"(= num_steps * {self.optimizer_steps_per_step}).",
            )
        if not (
            isinstance(self.lr_min_ratio, (int, float))
            and not isinstance(self.lr_min_ratio, bool)
            and 0.0 <= self.lr_min_ratio <= 1.0
        ):
            raise self._bad("lr_min_ratio", "expected a number in [0, 1]")

    def _check_reward_shift(self) -> None:
        """reward_shift_kl and reward_shift_z."""
        self._check_float("reward_shift_kl", 0.0, False, finite=True)
        if self.reward_shift_z is not None:
            self._check_float("reward_shift_z", 0.0, False, finite=True)
            if self.optimizer_steps_per_step < 2:
                raise self._bad(
                    "reward_shift_z",
                    f"it tells a settled policy by kl/old, which is exactly 0 with one optimizer step "
                    f"per update (optimizer_steps_per_step={self.optimizer_steps_per_step})",
                    " Use num_epochs_per_update > 1 or mini_batch_size < batch_size, or reward_shift_z=None.",
                )

    def _check_reliability(self) -> None:
        """Reliability checks: non-finite values, invalid rewards, timeouts, threads, checkpoints."""
        self._check_choice("non_finite", NON_FINITE_POLICIES)
        self._check_choice("invalid_rewards", INVALID_REWARD_POLICIES)
        if self.reward_timeout is not None:
            self._check_float("reward_timeout", 0.0, False)
        if self.sampler_is_cap is not None:
            self._check_float("sampler_is_cap", 0.0, False)
        self._check_choice("sampler_correction", SAMPLER_CORRECTIONS)
        self._check_choice("generation_engine", GENERATION_ENGINES)
        self._check_int("async_staleness", 0)
        self._check_bool("flush_denormals")
        threads = self.num_threads
        if not (threads is None or threads == "auto" or _is_positive_int(threads)):
            raise self._bad(
                "num_threads",
                "expected 'auto', an integer >= 1 or None",
                " Valid: e.g. num_threads='auto' (the default: 1 thread for a small CPU policy), "
                "num_threads=2, or num_threads=None (leave torch.set_num_threads alone).",
            )
        self._check_int("checkpoint_keep_last", 1, optional=True)

    def _check_parallelism(self) -> None:
        """distributed, fsdp and deepspeed."""
        self._check_choice("distributed", DISTRIBUTED_MODES)
        self._check_bool("fsdp")
        if not isinstance(self.deepspeed, str) or not self.deepspeed:
            raise self._bad("deepspeed", "expected 'auto', 'off' or the path of a DeepSpeed JSON config")

    def _check_adaptive_lr(self) -> None:
        """Validation of adaptive_lr_kl and its bounds."""
        self._check_float("adaptive_lr_min", 0.0, False, finite=True)
        self._check_float("adaptive_lr_max", 0.0, False, finite=True)
        if self.adaptive_lr_max < self.adaptive_lr_min:
            raise self._bad(
                "adaptive_lr_max",
                f"it must be >= adaptive_lr_min={self.adaptive_lr_min}",
                " Valid: e.g. adaptive_lr_min=1e-5, adaptive_lr_max=1e-2.",
            )
        if self.adaptive_lr_kl is None:
            return
        self._check_float("adaptive_lr_kl", 0.0, False, finite=True)
        if not self.adaptive_lr_min <= self.learning_rate <= self.adaptive_lr_max:
            raise self._bad(
                "learning_rate",
                f"with adaptive_lr_kl it is the starting learning rate and must lie in "
                f"[adaptive_lr_min, adaptive_lr_max] = [{self.adaptive_lr_min}, {self.adaptive_lr_max}]",
                " Set learning_rate inside the bounds, or widen them.",
            )
        if self.optimizer_steps_per_step < 2:
            raise self._bad(
                "adaptive_lr_kl",
                "it adapts the learning rate to how far the policy moved since the update's first "
                "optimizer step, and this config makes one optimizer step per update "
                f"(num_epochs_per_update={self.num_epochs_per_update}, "
                f"mini_batch_size={self.resolved_mini_batch_size} of batch_size={self.batch_size})",
                " Use num_epochs_per_update >= 2 or mini_batch_size < batch_size, or adaptive_lr_kl=None.",
            )

    def _check_liger(self) -> None:
        """use_liger_loss: a bool, and only with the settings Liger's loss computes."""
        self._check_bool("use_liger_loss")
        if not self.use_liger_loss:
            return
        plugin = loss_plugin("liger")  # registered by grpo.llm.liger; if not yet, the trainer checks
        problems = plugin.problems(self) if plugin is not None else []
        if problems:
            raise self._bad(
                "use_liger_loss",
                "Liger's fused GRPO loss does not compute " + "; ".join(problems),
                " Change those settings or set use_liger_loss=False.",
            )

    def _check_variants(self) -> None:
        """Validation of the `# --- algorithm variants ---` fields."""
        self._check_choice("advantage_baseline", ADVANTAGE_BASELINES)
        self._check_choice("advantage_scale", ADVANTAGE_SCALES)
        self._check_choice("reward_combination", REWARD_COMBINATIONS)
        self._check_choice("policy_loss", POLICY_LOSSES)
        self._check_choice("kl_penalty", KL_PENALTIES)
        for name in (
            "whiten_advantages",
            "drop_zero_variance_groups",
            "dual_clip",
            "mask_truncated_completions",
        ):
            self._check_bool(name)
        for name in ("reward_clip", "advantage_clip", "loss_normaliser"):
            if getattr(self, name) is not None:
                self._check_float(name, 0.0, False)
        self._check_float("sapo_tau_pos", 0.0, False)
        self._check_float("sapo_tau_neg", 0.0, False)
        self._check_float("dual_clip_c", 1.0, False)
        if self.loss_aggregation == "seq-mean-token-sum-norm" and self.loss_normaliser is None:
            raise self._bad(
                "loss_normaliser",
                "loss_aggregation='seq-mean-token-sum-norm' divides every sample's token sum by this "
                "constant, so it must be set",
                " Use the generation budget, e.g. GRPOConfig(loss_normaliser=max_new_tokens) "
                "(Dr. GRPO); never the padded length of a batch, which changes from batch to batch.",
            )
        if self.kl_penalty == "advantage" and self.kl_coeff == 0:
            raise self._bad(
                "kl_penalty",
                "KL-based advantage shaping subtracts kl_coeff * KL from the advantages, and "
                "kl_coeff=0 makes it a no-op (no reference policy is even built)",
                " Set kl_coeff > 0 (e.g. 0.04), or kl_penalty='loss'.",
            )
        self._check_int("max_sampling_draws", 1)
        if self.max_sampling_draws > 1 and not self.drop_zero_variance_groups:
            raise self._bad(
                "max_sampling_draws",
                "back-fill replaces the groups drop_zero_variance_groups drops, and it is off",
                " Set drop_zero_variance_groups=True (dynamic sampling), or max_sampling_draws=1.",
            )
        if self.max_sampling_draws > 1 and self.async_staleness > 0:
            raise self._bad(
                "max_sampling_draws",
                "back-fill draws states while the step runs, but async rollouts "
                f"(async_staleness={self.async_staleness}) generate each batch steps ahead",
                " Use async_staleness=0 with dynamic sampling, or max_sampling_draws=1.",
            )
        if self.dual_clip and self.policy_loss not in ("clip", "gspo"):
            raise self._bad(
                "dual_clip", f"dual clip applies to the 'clip' and 'gspo' losses, not {self.policy_loss!r}"
            )

    # ---- derived quantities -------------------------------------------------------------
    @property
    def effective_sampler_is_cap(self) -> float | None:
        """The sampler correction's cap: ``sampler_is_cap``, or `ASYNC_DEFAULT_IS_CAP` with
        ``async_staleness >= 1`` (the correction is on by default for async rollouts)."""
        if self.sampler_is_cap is None and self.async_staleness > 0:
            return ASYNC_DEFAULT_IS_CAP
        return self.sampler_is_cap

    @property
    def resolved_mini_batch_size(self) -> int:
        """States per optimizer step: mini_batch_size, or batch_size when it is None."""
        return self.batch_size if self.mini_batch_size is None else self.mini_batch_size

    @property
    def resolved_micro_batch_size(self) -> int:
        """States per forward/backward pass."""
        return self.resolved_mini_batch_size if self.micro_batch_size is None else self.micro_batch_size

    @property
    def resolved_clip_epsilon_high(self) -> float:
        return self.clip_epsilon if self.clip_epsilon_high is None else self.clip_epsilon_high

    @property
    def samples_per_step(self) -> int:
        """N = batch_size * group_size."""
        return self.batch_size * self.group_size

    @property
    def optimizer_steps_per_step(self) -> int:
        """num_epochs_per_update * batch_size / mini_batch_size."""
        return optimizer_steps_per_step(self.batch_size, self.mini_batch_size, self.num_epochs_per_update)

    def derived(self) -> dict[str, Any]:
        return {
            "samples_per_step": self.samples_per_step,
            "optimizer_steps_per_step": self.optimizer_steps_per_step,
            "clip_range": (1.0 - self.clip_epsilon, 1.0 + self.resolved_clip_epsilon_high),
            "micro_batches_per_optimizer_step": self.resolved_mini_batch_size
            // self.resolved_micro_batch_size,
            **({"recipe_source": _recipe_citation(self.recipe_name)} if self.recipe_name else {}),
        }

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain JSON-friendly values."""
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        derived = self.derived()
        width = max(len(name) for name in [*(f.name for f in dataclasses.fields(self)), *derived])
        lines = ["GRPOConfig("]
        for f in dataclasses.fields(self):
            lines.append(f"  {f.name:<{width}} = {getattr(self, f.name)!r}")
        lines.append("  # derived")
        for k, v in derived.items():
            lines.append(f"  {k:<{width}} = {v!r}")
        lines.append(")")
        return "\n".join(lines)


_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
