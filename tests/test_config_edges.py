"""Every documented edge value of every `GRPOConfig` knob, through real updates (issue 24).

The values come from the help texts in grpo/config.py, docs/training.md and docs/algorithms.md
("exactly 1 = no lower bound", "None = ...", "0 = no reference policy", each Literal choice, the
smallest allowed sizes). Each case builds a `GRPOTrainer` on a tiny real policy, runs two real
``step()`` calls, mostly with two or more optimizer steps per update (where the ratio leaves 1 and
the clip and stale data act: ``clip_epsilon=1`` crashed only there), and checks that every step
moved the weights (or, where the value means "no update", did not), that they stay finite, and
that the metrics are finite. Validation alone is tested in tests/test_config.py.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from torch import Tensor, nn

from grpo import GRPOConfig, GRPOTrainer, PolicyOutput
from grpo.algorithms.policy_losses import clip_loss
from grpo.policies import categorical_mlp
from grpo.reward_model_base import CombinedReward

pytestmark = pytest.mark.usefixtures("one_thread")

D, K, T = 4, 3, 3  # state dimension, arms, steps per sample of the multi-step policy
W = torch.randn(D, K, generator=torch.Generator().manual_seed(0))  # arm a pays (x @ W)[a]
# G = 4 actions for B = 2 states, two epochs: two optimizer steps per update
SMALL: dict[str, Any] = {"group_size": 4, "batch_size": 2, "num_epochs_per_update": 2, "seed": 0}
# metrics that are NaN by definition when not measured (docs/metrics.md)
NOT_MEASURED = frozenset({"optim/update_ratio"})


def bandit_reward(states: Tensor, actions: Tensor) -> Tensor:
    return (states @ W).gather(1, actions.long()[:, None]).squeeze(1)


def constant_reward(states: Tensor, actions: Tensor) -> Tensor:
    return torch.ones(actions.shape[0])


def arm_zero_reward(states: Tensor, actions: Tensor) -> Tensor:
    return (actions == 0).float()


class ArmPolicy(nn.Module):
    """README's quick-start policy (a plain Protocol policy, not a `DistributionPolicy`); its log-probs
    carry no entropy, so the entropy term is the Monte Carlo estimate."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, K))

    def generate_actions(self, states: Tensor, num_actions_per_state: int, **kwargs: Any) -> Tensor:
        probs = torch.softmax(self.net(states), -1)
        return torch.multinomial(probs, num_actions_per_state, replacement=True)

    def get_log_probabilities(self, states: Tensor, actions: Tensor) -> Tensor:
        logp = torch.log_softmax(self.net(states), -1)
        return logp.gather(1, actions[:, None]).squeeze(1)

    def get_parameters(self) -> dict[str, Tensor]:
        return dict(self.named_parameters())


class StepPolicy(nn.Module):
    """T actions per sample, one linear head per step; sample i is 1 + (its first action) steps long,
    so samples have 1..T valid steps (a mask) and per-step rewards are (N, T)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.head = nn.Linear(D, T * K)

    def _logp(self, states: Tensor) -> Tensor:
        return torch.log_softmax(self.head(states).view(-1, T, K), -1)  # (n, T, K)

    def generate_actions(self, states: Tensor, num_actions_per_state: int, **kwargs: Any) -> Tensor:
        b, g = states.shape[0], num_actions_per_state
        probs = self._logp(states).detach().exp().reshape(b * T, K)
        return torch.multinomial(probs, g, replacement=True).view(b, T, g).transpose(1, 2)  # (B, G, T)

    def get_log_probabilities(self, states: Tensor, actions: Tensor) -> PolicyOutput:
        logp = self._logp(states).gather(-1, actions[..., None]).squeeze(-1)  # (N, T)
        return PolicyOutput(logp, mask=step_mask(actions))

    def get_parameters(self) -> dict[str, Tensor]:
        return dict(self.named_parameters())


def step_mask(actions: Tensor) -> Tensor:
    return torch.arange(T)[None, :] <= actions[:, :1]  # (N, T): 1 + a_0 valid steps


def step_reward(states: Tensor, actions: Tensor) -> Tensor:
    """(N, T): the bandit pay of each step's action, 0 after the sample's last step."""
    pay = (states @ W).gather(1, actions.long())
    return pay * step_mask(actions)


class Run(NamedTuple):
    weights: list[Tensor]  # flat weights before, after step 1, after step 2
    metrics: list[dict[str, float]]
    trainer: GRPOTrainer


def flat(policy: Any) -> Tensor:
    return torch.cat([p.detach().reshape(-1).cpu().clone() for p in policy.get_parameters().values()])


def states(seed: int, b: int = 2) -> Tensor:
    return torch.randn(b, D, generator=torch.Generator().manual_seed(seed))


def two_steps(config: GRPOConfig, policy: Any = None, reward: Any = bandit_reward, **kwargs: Any) -> Run:
    if policy is None:
        torch.manual_seed(0)
        policy = categorical_mlp(D, K, (8,))
    trainer = GRPOTrainer(config, policy, reward, **kwargs)
    weights, metrics = [flat(policy)], []
    for seed in (10, 11):
        metrics.append(trainer.step(states(seed, config.batch_size)))
        weights.append(flat(policy))
    return Run(weights, metrics, trainer)


def assert_finite_metrics(run: Run, not_measured: frozenset[str] = NOT_MEASURED) -> None:
    for i, m in enumerate(run.metrics):
        bad = {k: v for k, v in m.items() if k not in not_measured and not math.isfinite(v)}
        assert not bad, f"step {i + 1}: non-finite metrics {bad}"


def assert_trains(run: Run) -> None:
    """Both steps changed the weights, which stay finite, and every metric is finite."""
    w0, w1, w2 = run.weights
    assert bool(torch.isfinite(w2).all())
    assert not torch.equal(w0, w1), "step 1 left the weights unchanged"
    assert not torch.equal(w1, w2), "step 2 left the weights unchanged"
    assert all(m["optim/non_finite_steps"] == 0.0 for m in run.metrics)
    assert_finite_metrics(run)


# Each documented edge value, with SMALL's two optimizer steps per update unless the case sets the
# split itself. Ids name the value.
EDGE_VALUES = [
    # --- sizes: the smallest allowed, and every way of splitting an update ---
    pytest.param({"group_size": 2}, id="group_size=2"),
    pytest.param({"batch_size": 1}, id="batch_size=1"),
    pytest.param({"num_epochs_per_update": 1, "num_mini_batches": 2}, id="num_epochs_per_update=1"),
    pytest.param({"batch_size": 4, "mini_batch_size": 1}, id="mini_batch_size=1"),
    pytest.param({"batch_size": 4, "mini_batch_size": 4}, id="mini_batch_size=batch_size"),
    pytest.param({"batch_size": 4, "num_mini_batches": 4}, id="num_mini_batches=batch_size"),
    pytest.param({"batch_size": 3, "num_mini_batches": 5}, id="num_mini_batches>batch_size"),
    pytest.param({"batch_size": 4, "num_mini_batches": 2, "micro_batch_size": 1}, id="micro_batch_size=1"),
    pytest.param(
        {"num_epochs_per_update": 3, "batch_size": 2, "num_mini_batches": 2}, id="epochs=3xminibatches=2"
    ),
    # --- the clip ---
    pytest.param({"clip_epsilon": 1.0}, id="clip_epsilon=1"),
    pytest.param(
        {"clip_epsilon": 1.0, "num_epochs_per_update": 1, "num_mini_batches": 2},
        id="clip_epsilon=1-minibatches",
    ),
    pytest.param({"clip_epsilon": 1.0, "clip_epsilon_high": 0.28}, id="clip_epsilon=1-high=0.28"),
    pytest.param({"clip_epsilon": 1.0, "clip_epsilon_high": 1e9}, id="clip_epsilon=1-high=1e9"),
    pytest.param({"clip_epsilon": 1.0, "clip_epsilon_high": math.inf}, id="clip_epsilon=1-high=inf"),
    pytest.param({"clip_epsilon": 1.0, "dual_clip": True}, id="clip_epsilon=1-dual_clip"),
    pytest.param({"clip_epsilon": 1.0, "log_ratio_clamp": 1e-3}, id="clip_epsilon=1-log_ratio_clamp=1e-3"),
    pytest.param({"clip_epsilon": 1e-6}, id="clip_epsilon=1e-6"),
    pytest.param({"clip_epsilon_high": None}, id="clip_epsilon_high=None"),
    pytest.param({"clip_epsilon_high": 1e9}, id="clip_epsilon_high=1e9"),
    pytest.param({"clip_epsilon_high": math.inf}, id="clip_epsilon_high=inf"),
    pytest.param({"dual_clip": True, "dual_clip_c": 1.0001}, id="dual_clip_c=1.0001"),
    pytest.param({"dual_clip": True, "policy_loss": "gspo"}, id="dual_clip-gspo"),
    pytest.param({"log_ratio_clamp": 1e-3}, id="log_ratio_clamp=1e-3"),
    pytest.param({"log_ratio_clamp": math.inf}, id="log_ratio_clamp=inf"),
    # --- every policy loss, with and without a lower bound ---
    *[
        pytest.param({"policy_loss": name}, id=f"policy_loss={name}")
        for name in ("clip", "gspo", "cispo", "sapo", "reinforce")
    ],
    *[
        pytest.param({"policy_loss": name, "clip_epsilon": 1.0}, id=f"policy_loss={name}-clip_epsilon=1")
        for name in ("gspo", "cispo")
    ],
    pytest.param({"policy_loss": "sapo", "sapo_tau_pos": 1e-3, "sapo_tau_neg": 1e3}, id="sapo_tau=1e-3,1e3"),
    # --- KL and entropy terms ---
    pytest.param({"kl_coeff": 0.0}, id="kl_coeff=0"),
    *[pytest.param({"kl_coeff": 0.5, "kl_estimator": e}, id=f"kl_estimator={e}") for e in ("k1", "k2", "k3")],
    *[
        pytest.param(
            {"kl_coeff": 0.5, "kl_estimator": e, "kl_penalty": "reward"}, id=f"kl_penalty=reward-{e}"
        )
        for e in ("k1", "k2", "k3")
    ],
    pytest.param({"kl_coeff": 0.0, "kl_penalty": "reward"}, id="kl_penalty=reward-kl_coeff=0"),
    pytest.param({"kl_coeff": 0.5, "log_ratio_clamp": math.inf}, id="kl_coeff-log_ratio_clamp=inf"),
    pytest.param({"kl_coeff": 0.5, "reference_update_freq": 1}, id="reference_update_freq=1"),
    pytest.param({"kl_coeff": 0.5, "reference_update_freq": None}, id="reference_update_freq=None"),
    pytest.param({"entropy_coeff": 0.0}, id="entropy_coeff=0"),
    pytest.param({"entropy_coeff": 0.1}, id="entropy_coeff=0.1"),
    # --- advantages ---
    pytest.param({"normalize_advantages": False}, id="normalize_advantages=False"),
    pytest.param({"advantage_eps": 1e-12}, id="advantage_eps=1e-12"),
    *[
        pytest.param({"advantage_baseline": b}, id=f"advantage_baseline={b}")
        for b in ("group", "leave_one_out", "batch", "running", "none")
    ],
    pytest.param({"advantage_baseline": "leave_one_out", "group_size": 2}, id="leave_one_out-group_size=2"),
    *[
        pytest.param({"advantage_scale": s}, id=f"advantage_scale={s}")
        for s in ("group", "batch", "running", "none")
    ],
    pytest.param({"reward_clip": 1e-3}, id="reward_clip=1e-3"),
    pytest.param({"advantage_clip": 1e-3}, id="advantage_clip=1e-3"),
    pytest.param({"whiten_advantages": True}, id="whiten_advantages=True"),
    pytest.param({"whiten_advantages": True, "batch_size": 1, "group_size": 2}, id="whiten-one_group_of_2"),
    pytest.param({"drop_zero_variance_groups": True}, id="drop_zero_variance_groups=True"),
    pytest.param({"gamma": 0.0}, id="gamma=0-scalar_reward"),
    # --- aggregation ---
    *[
        pytest.param({"loss_aggregation": a, "loss_normaliser": 5.0}, id=f"loss_aggregation={a}")
        for a in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
    ],
    # --- optimizer, schedule, safety nets ---
    pytest.param({"max_grad_norm": None}, id="max_grad_norm=None"),
    pytest.param({"max_grad_norm": 1e-8}, id="max_grad_norm=1e-8"),
    pytest.param({"weight_decay": 0.1}, id="weight_decay=0.1"),
    pytest.param(
        {"lr_schedule": "linear", "total_steps": 8, "lr_min_ratio": 1.0}, id="linear-lr_min_ratio=1"
    ),
    pytest.param({"lr_schedule": "cosine", "total_steps": 8}, id="cosine-lr_min_ratio=0"),
    pytest.param(
        {"lr_schedule": "cosine", "warmup_steps": 3, "total_steps": 4}, id="total_steps=warmup_steps+1"
    ),
    pytest.param({"warmup_steps": 100}, id="warmup_steps=100"),
    pytest.param({"adaptive_lr_kl": 1e-9}, id="adaptive_lr_kl=1e-9"),
    pytest.param({"adaptive_lr_kl": 1e3}, id="adaptive_lr_kl=1e3"),
    pytest.param({"reward_shift_z": 1e-6, "reward_shift_kl": 1e3}, id="reward_shift_z=1e-6"),
    pytest.param({"reward_shift_z": None}, id="reward_shift_z=None"),
    pytest.param({"seed": None}, id="seed=None"),
    pytest.param({"non_finite": "raise"}, id="non_finite=raise"),
    pytest.param({"non_finite": "skip"}, id="non_finite=skip"),
    pytest.param({"invalid_rewards": "drop_groups"}, id="invalid_rewards=drop_groups"),
    pytest.param({"reward_timeout": 60.0}, id="reward_timeout=60"),
    pytest.param({"reward_timeout": None}, id="reward_timeout=None"),
    pytest.param({"sampler_is_cap": 1e-3}, id="sampler_is_cap=1e-3"),
    pytest.param({"sampler_is_cap": 2.0}, id="sampler_is_cap=2"),
    pytest.param({"flush_denormals": False}, id="flush_denormals=False"),
    pytest.param({"distributed": "off"}, id="distributed=off"),
    pytest.param({"deepspeed": "off"}, id="deepspeed=off"),
    pytest.param({"num_threads": "auto"}, id="num_threads=auto"),
    pytest.param({"num_threads": 1}, id="num_threads=1"),
    pytest.param({"num_threads": 2}, id="num_threads=2"),
    pytest.param({"num_threads": None}, id="num_threads=None"),
]


@pytest.mark.parametrize("overrides", EDGE_VALUES)
def test_edge_value_trains_through_two_steps(overrides: dict[str, Any]) -> None:
    run = two_steps(GRPOConfig.from_dict({**SMALL, "learning_rate": 1e-2, **overrides}))  # spellings too
    assert_trains(run)


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({"gamma": 0.0}, id="gamma=0"),
        pytest.param({"gamma": 1.0}, id="gamma=1"),
        pytest.param({"gamma": 1.0, "clip_epsilon": 1.0}, id="gamma=1-clip_epsilon=1"),
        pytest.param({"kl_coeff": 0.5, "kl_penalty": "reward"}, id="kl_penalty=reward"),
        pytest.param({"whiten_advantages": True}, id="whiten_advantages=True"),
        pytest.param({"advantage_scale": "batch"}, id="advantage_scale=batch"),
        pytest.param({"policy_loss": "gspo", "clip_epsilon": 1.0}, id="gspo-clip_epsilon=1"),
        *[
            pytest.param({"loss_aggregation": a, "loss_normaliser": float(T)}, id=f"loss_aggregation={a}")
            for a in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
        ],
    ],
)
def test_per_step_rewards_edge_value_trains(overrides: dict[str, Any]) -> None:
    """(N, T) rewards over samples of 1..T valid steps: gamma and the aggregations act per step."""
    config = GRPOConfig(**{**SMALL, "batch_size": 4, "learning_rate": 1e-2, **overrides})
    assert_trains(two_steps(config, StepPolicy(), step_reward))


@pytest.mark.parametrize("entropy_coeff", [0.0, 0.1], ids=lambda c: f"entropy_coeff={c}")
@pytest.mark.parametrize("clip_epsilon", [0.2, 1.0], ids=lambda e: f"clip_epsilon={e}")
def test_protocol_policy_with_the_monte_carlo_entropy_estimate_trains(
    entropy_coeff: float, clip_epsilon: float
) -> None:
    config = GRPOConfig(
        **{**SMALL, "learning_rate": 1e-2, "entropy_coeff": entropy_coeff, "clip_epsilon": clip_epsilon}
    )
    assert_trains(two_steps(config, ArmPolicy()))


@pytest.mark.parametrize("combination", ["sum", "per_component"], ids=lambda c: f"reward_combination={c}")
def test_reward_combination_trains(combination: str) -> None:
    reward = CombinedReward({"pay": bandit_reward, "arm0": arm_zero_reward}, weights={"arm0": 0.5})
    run = two_steps(
        GRPOConfig(**{**SMALL, "learning_rate": 1e-2, "reward_combination": combination}), reward=reward
    )
    assert_trains(run)
    assert {"reward/pay/mean", "reward/arm0/mean"} <= set(run.metrics[-1])


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("deepseek_math", {}),
        ("dr_grpo", {"loss_normaliser": 4.0}),
        ("dapo", {"mini_batch_size": 1}),
        ("gspo", {}),
        ("cispo", {}),
        ("cispo", {"policy_loss": "clip"}),  # CISPO's clip_epsilon=1 with the PPO clip: issue 24
        ("small_policy", {"num_epochs_per_update": 2}),
        ("tiny_lm", {}),
    ],
    ids=[
        "deepseek_math",
        "dr_grpo",
        "dapo",
        "gspo",
        "cispo",
        "cispo-policy_loss=clip",
        "small_policy",
        "tiny_lm",
    ],
)
def test_recipe_trains(name: str, overrides: dict[str, Any]) -> None:
    sizes = {"group_size": 4, "batch_size": 2, "num_epochs_per_update": 2, "learning_rate": 1e-2, "seed": 0}
    if name == "small_policy":
        sizes.pop("num_epochs_per_update")
    config = GRPOConfig.recipe(name, **{**sizes, **overrides})
    assert_trains(two_steps(config))


# ---- values whose meaning can be checked beyond "it trains" ---------------------------------------


def test_clip_epsilon_one_never_clips_low_and_equals_the_composed_clip_loss() -> None:
    """No lower bound: with ratios far below 1 - 0.2 nothing counts as clipped low, and the fused
    path moves the weights exactly as the composed `clip_loss` with eps_low = 1 does."""
    kw = {
        **SMALL,
        "num_epochs_per_update": 4,
        "learning_rate": 0.5,
        "clip_epsilon": 1.0,
        "clip_epsilon_high": 0.2,
    }
    fused = two_steps(GRPOConfig(**kw))
    assert_trains(fused)
    assert min(m["ratio/min"] for m in fused.metrics) < 0.5  # the bound 1 - 0.2 would have bound
    assert all(m["clip/frac_low"] == 0.0 for m in fused.metrics)

    def loss_fn(logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor) -> Tensor:
        return clip_loss(logp, old, adv, mask, eps_low=1.0, eps_high=0.2).loss

    composed = two_steps(GRPOConfig(**kw), loss_fn=loss_fn)
    for a, b in zip(fused.weights, composed.weights, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    bounded = two_steps(GRPOConfig(**{**kw, "clip_epsilon": 0.2}))
    assert max(m["clip/frac_low"] for m in bounded.metrics) > 0.0  # the same run with a bound clips


def test_clip_epsilon_high_none_is_clip_epsilon() -> None:
    a = two_steps(GRPOConfig(**SMALL, learning_rate=0.1, clip_epsilon=0.1, clip_epsilon_high=None))
    b = two_steps(GRPOConfig(**SMALL, learning_rate=0.1, clip_epsilon=0.1, clip_epsilon_high=0.1))
    assert torch.equal(a.weights[-1], b.weights[-1])


def test_micro_batch_size_does_not_change_the_update() -> None:
    base = {**SMALL, "batch_size": 4, "mini_batch_size": 2, "learning_rate": 0.1, "kl_coeff": 0.1}
    whole = two_steps(GRPOConfig(**base, micro_batch_size=None))
    split = two_steps(GRPOConfig(**base, micro_batch_size=1))
    torch.testing.assert_close(whole.weights[-1], split.weights[-1], atol=1e-6, rtol=1e-5)


def test_kl_coeff_zero_builds_no_reference_and_a_positive_one_does() -> None:
    assert two_steps(GRPOConfig(**SMALL, kl_coeff=0.0)).trainer.reference_policy is None
    run = two_steps(GRPOConfig(**SMALL, kl_coeff=0.5, learning_rate=0.1))
    assert run.trainer.reference_policy is not None
    assert run.metrics[-1]["kl/ref"] > 0.0  # the reference stayed the starting policy


def test_reference_update_freq_one_copies_the_policy_after_every_step() -> None:
    run = two_steps(GRPOConfig(**SMALL, kl_coeff=0.5, learning_rate=0.1, reference_update_freq=1))
    assert torch.equal(flat(run.trainer.reference_policy), run.weights[-1])
    never = two_steps(GRPOConfig(**SMALL, kl_coeff=0.5, learning_rate=0.1, reference_update_freq=None))
    assert torch.equal(flat(never.trainer.reference_policy), never.weights[0])


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({}, id="defaults"),
        pytest.param({"kl_coeff": 0.0, "entropy_coeff": 0.0}, id="kl_coeff=0"),
        pytest.param({"clip_epsilon": 1.0}, id="clip_epsilon=1"),
        pytest.param(
            {"drop_zero_variance_groups": True, "entropy_coeff": 0.1}, id="drop_zero_variance-entropy"
        ),
    ],
)
def test_equal_rewards_in_every_group_leave_the_weights_unchanged(overrides: dict[str, Any]) -> None:
    """Every advantage is exactly 0 (docs/training.md, "When learning stalls"): no policy gradient,
    and the KL gradient at the reference is 0; dropped groups leave no loss at all."""
    run = two_steps(GRPOConfig(**{**SMALL, "learning_rate": 0.1, **overrides}), reward=constant_reward)
    assert torch.equal(run.weights[0], run.weights[-1])
    assert all(m["reward/frac_zero_std"] == 1.0 for m in run.metrics)
    if overrides.get("drop_zero_variance_groups"):
        # no valid step is left, so there is no ratio: min / max are NaN (not the empty reduction's +-inf)
        assert all(m["advantage/frac_dropped_groups"] == 1.0 for m in run.metrics)
        assert all(math.isnan(m["ratio/min"]) and math.isnan(m["ratio/max"]) for m in run.metrics)
        assert all(m["loss/total"] == 0.0 for m in run.metrics)
        assert_finite_metrics(run, NOT_MEASURED | {"ratio/min", "ratio/max"})
    else:
        assert_finite_metrics(run)


def test_a_decay_to_lr_min_ratio_zero_stops_the_updates_at_total_steps() -> None:
    """linear, total_steps=1, lr_min_ratio=0: optimizer step 0 has the full rate, every later one 0."""
    run = two_steps(
        GRPOConfig(**SMALL, learning_rate=0.1, lr_schedule="linear", total_steps=1, lr_min_ratio=0.0)
    )
    w0, w1, w2 = run.weights
    assert not torch.equal(w0, w1)
    assert torch.equal(w1, w2)
    assert run.trainer.optimizer.param_groups[0]["lr"] == 0.0


def test_adaptive_lr_with_equal_bounds_keeps_the_rate() -> None:
    run = two_steps(
        GRPOConfig(**SMALL, learning_rate=0.1, adaptive_lr_kl=1e-9, adaptive_lr_min=0.1, adaptive_lr_max=0.1)
    )
    assert_trains(run)
    assert all(m["optim/adaptive_lr"] == pytest.approx(0.1) for m in run.metrics)


def test_drop_groups_trains_on_the_valid_groups_and_refuses_a_step_with_none() -> None:
    def half_nan(s: Tensor, a: Tensor) -> Tensor:
        r = bandit_reward(s, a)
        r[: len(r) // 2] = math.nan  # the first group
        return r

    run = two_steps(GRPOConfig(**SMALL, learning_rate=0.1, invalid_rewards="drop_groups"), reward=half_nan)
    assert_trains(run)
    assert all(m["reward/dropped_groups"] == 1.0 for m in run.metrics)

    torch.manual_seed(0)
    policy = categorical_mlp(D, K, (8,))
    before = flat(policy)
    trainer = GRPOTrainer(
        GRPOConfig(**SMALL, invalid_rewards="drop_groups"),
        policy,
        lambda s, a: torch.full((a.shape[0],), math.nan),
    )
    with pytest.raises(ValueError, match=r"in every one of the 2 groups, so nothing is left to train on"):
        trainer.step(states(10))
    assert torch.equal(flat(policy), before)


def test_seed_zero_twice_gives_equal_weights() -> None:
    a = two_steps(GRPOConfig(**{**SMALL, "learning_rate": 0.1, "seed": 0}))
    b = two_steps(GRPOConfig(**{**SMALL, "learning_rate": 0.1, "seed": 0}))
    assert torch.equal(a.weights[-1], b.weights[-1])


@pytest.mark.parametrize("keep_last", [1, None], ids=lambda k: f"checkpoint_keep_last={k}")
def test_checkpoint_freq_one_and_keep_last(tmp_path: Path, keep_last: int | None) -> None:
    torch.manual_seed(0)
    policy = categorical_mlp(D, K, (8,))
    config = GRPOConfig(**SMALL, learning_rate=0.1, checkpoint_freq=1, checkpoint_keep_last=keep_last)
    trainer = GRPOTrainer(config, policy, bandit_reward)
    before = flat(policy)
    trainer.train(lambda b: states(3, b), num_steps=3, checkpoint_dir=tmp_path, progress=False)
    assert not torch.equal(flat(policy), before)
    kept = sorted(p.name for p in tmp_path.glob("step-*"))
    assert kept == [f"step-{s:08d}" for s in ((3,) if keep_last == 1 else (1, 2, 3))]


def test_gamma_is_unused_with_one_reward_per_sample() -> None:
    """gamma discounts per-step rewards only: with one reward per sample, 0 and 1 train alike."""
    zero = two_steps(GRPOConfig(**{**SMALL, "learning_rate": 0.1, "gamma": 0.0}))
    one = two_steps(GRPOConfig(**{**SMALL, "learning_rate": 0.1, "gamma": 1.0}))
    assert torch.equal(zero.weights[-1], one.weights[-1])
    per_step = [
        two_steps(
            GRPOConfig(**{**SMALL, "batch_size": 4, "learning_rate": 0.1, "gamma": g}),
            StepPolicy(),
            step_reward,
        )
        for g in (0.0, 1.0)
    ]
    assert not torch.equal(per_step[0].weights[-1], per_step[1].weights[-1])  # (N, T) rewards: it acts
