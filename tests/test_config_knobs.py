"""The seed's remaining config knobs: mask_truncated_completions (a truncated sample contributes
no gradient, its reward still counts in its group: the trainer's update against a plain loop),
KL-based advantage shaping (the pure function and the objective, both paths, values and gradients
against plain loops) and the seed's names adv_norm / use_kl_advantage_shaping."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor

from grpo import GRPOConfig, GRPOTrainer
from grpo.advantage_estimator import AdvantageEstimator, uniform_group_ids
from grpo.algorithms.kl import kl_shaped_advantages
from grpo.experience_collector import truncated_actions
from grpo.grpo_objective import GRPOObjective
from grpo.policy_base import PolicyOutput

V, T_MAX = 5, 3


@dataclass(frozen=True)
class Seq:
    """A multi-step action that may have been cut at the length limit."""

    tokens: tuple[int, ...]
    truncated: bool


class SeqPolicy:
    """Independent tokens from one softmax over V; a sequence is truncated when it has T_MAX
    tokens (as a completion cut at max_new_tokens). Actions are fixed per call (cycled), so the
    update is exactly reproducible."""

    def __init__(self, actions: list[Seq]) -> None:
        self.logits = torch.tensor([0.3, -0.2, 0.1, 0.0, 0.5], dtype=torch.float64, requires_grad=True)
        self.actions = actions

    def generate_actions(self, states: list[Any], g: int, **kwargs: Any) -> list[list[Seq]]:
        return [self.actions[i * g : (i + 1) * g] for i in range(len(states))]

    def get_log_probabilities(self, states: Any, actions: list[Seq]) -> PolicyOutput:
        lp_all = torch.log_softmax(self.logits, 0)
        rows = [
            torch.stack([lp_all[t] for t in a.tokens] + [lp_all[0]] * (T_MAX - len(a.tokens)))
            for a in actions
        ]
        mask = torch.tensor([[j < len(a.tokens) for j in range(T_MAX)] for a in actions])
        return PolicyOutput(torch.stack(rows) * mask, mask)

    def get_parameters(self) -> dict[str, Tensor]:
        return {"logits": self.logits}

    def train(self) -> None: ...

    def eval(self) -> None: ...

    def to(self, device: Any) -> SeqPolicy:
        return self


ACTIONS = [
    Seq((1,), False), Seq((2, 3, 4), True), Seq((0, 1), False), Seq((4, 4, 4), True),  # group 0
    Seq((3, 2, 1), True), Seq((2,), False), Seq((1, 0), False), Seq((0, 0, 0), True),  # group 1
]  # fmt: skip
REWARDS = [1.0, 3.0, 0.0, 2.0, 5.0, 1.0, 2.0, 0.5]


def _reward(states: list[Any], actions: list[Seq]) -> list[float]:
    return [REWARDS[ACTIONS.index(a)] for a in actions]


def _sgd_update(mask_truncated: bool) -> Tensor:
    """-(the trainer's gradient) of one step with SGD(lr=1), no clipping, A = r - group mean."""
    policy = SeqPolicy(ACTIONS)
    cfg = GRPOConfig(
        group_size=4, batch_size=2, kl_coeff=0.0, advantage_scale="none", max_grad_norm=None,
        mask_truncated_completions=mask_truncated,
    )  # fmt: skip
    trainer = GRPOTrainer(cfg, policy, _reward, optimizer=torch.optim.SGD([policy.logits], lr=1.0))
    before = policy.logits.detach().clone()
    trainer.step(["s0", "s1"])
    return policy.logits.detach() - before


def _loop_gradient(drop_truncated: bool) -> Tensor:
    """The gradient of the token-mean loss -A_i logp_it (on-policy: ratio 1) over the kept rows,
    with A_i = r_i - mean of ALL its group's rewards (truncated ones included), by a plain loop."""
    logits = torch.tensor([0.3, -0.2, 0.1, 0.0, 0.5], dtype=torch.float64, requires_grad=True)
    lp_all = torch.log_softmax(logits, 0)
    total, count = torch.zeros((), dtype=torch.float64), 0
    for i, a in enumerate(ACTIONS):
        group = REWARDS[(i // 4) * 4 : (i // 4) * 4 + 4]
        adv = REWARDS[i] - sum(group) / 4
        if drop_truncated and a.truncated:
            continue
        for tok in a.tokens:
            total = total - adv * lp_all[tok]
            count += 1
    (grad,) = torch.autograd.grad(total / count, logits)
    return grad


def test_mask_truncated_completions_gives_truncated_rows_no_gradient() -> None:
    masked = _sgd_update(True)
    torch.testing.assert_close(masked, -_loop_gradient(drop_truncated=True), atol=1e-12, rtol=1e-10)
    plain = _sgd_update(False)
    torch.testing.assert_close(plain, -_loop_gradient(drop_truncated=False), atol=1e-12, rtol=1e-10)
    assert not torch.allclose(masked, plain)


def test_truncated_actions_reads_the_flag_and_the_collector_refuses_actions_without_it() -> None:
    flags = truncated_actions(ACTIONS, torch.device("cpu"))
    assert flags is not None
    assert flags.tolist() == [a.truncated for a in ACTIONS]
    assert truncated_actions(["a", "b"], torch.device("cpu")) is None
    assert truncated_actions(torch.zeros(2, 1), torch.device("cpu")) is None

    class Plain(SeqPolicy):
        def generate_actions(self, states: list[Any], g: int, **kwargs: Any) -> list[list[Any]]:
            return [[(1,)] * g for _ in states]

    cfg = GRPOConfig(group_size=2, batch_size=1, kl_coeff=0.0, mask_truncated_completions=True)
    trainer = GRPOTrainer(cfg, Plain(ACTIONS), lambda s, a: [0.0] * len(a))
    with pytest.raises(TypeError, match=r"mask_truncated_completions=True\) needs actions .*'truncated'"):
        trainer.step(["s"])
    with pytest.raises(ValueError, match=r"mask_truncated_completions=1 is not allowed"):
        GRPOConfig(mask_truncated_completions=1)  # type: ignore[arg-type]


def _k3(lp: float, ref: float) -> float:
    d = ref - lp
    return math.exp(d) - d - 1.0


def test_kl_shaped_advantages_against_a_loop() -> None:
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(4, generator=g, dtype=torch.float64)
    logp = -torch.rand(4, 3, generator=g, dtype=torch.float64) * 3
    ref = -torch.rand(4, 3, generator=g, dtype=torch.float64) * 3
    from grpo.algorithms.kl import kl_estimate

    kl = kl_estimate(logp, ref, "k3")
    out = kl_shaped_advantages(adv, kl, 0.1)
    for i in range(4):
        for t in range(3):
            expect = float(adv[i]) - 0.1 * _k3(float(logp[i, t]), float(ref[i, t]))
            assert abs(float(out[i, t]) - expect) < 1e-12
    per_step = adv[:, None].expand(4, 3).clone()
    torch.testing.assert_close(kl_shaped_advantages(per_step, kl, 0.1), out, atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"must be \(n,\) or \(n, T\)"):
        kl_shaped_advantages(adv[:3], kl, 0.1)


@pytest.mark.parametrize("loss", ["clip", "reinforce"])  # the fused path and the composed one
def test_objective_with_kl_shaping_against_a_loop(loss: str) -> None:
    g = torch.Generator().manual_seed(1)
    n, t, beta, eps = 4, 3, 0.3, 0.2
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    logp0 = -torch.rand(n, t, generator=g, dtype=torch.float64) * 2
    old = (logp0 + 0.3 * torch.randn(n, t, generator=g, dtype=torch.float64)).detach()
    ref = (logp0 + 0.5 * torch.randn(n, t, generator=g, dtype=torch.float64)).detach()
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    obj = GRPOObjective(kl_coeff=beta, policy_loss=loss, clip_epsilon=eps, kl_in_advantage=True)  # type: ignore[arg-type]
    logp = logp0.clone().requires_grad_(True)
    out = obj(logp, old, adv, mask, obj.normaliser(mask), logp_ref=ref)
    (grad,) = torch.autograd.grad(out.loss, logp)

    x = logp0.clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    for i in range(n):
        for j in range(t):
            if not mask[i, j]:
                continue
            a = float(adv[i]) - beta * _k3(float(x.detach()[i, j]), float(ref[i, j]))  # detached KL
            if loss == "clip":
                r = torch.exp(x[i, j] - old[i, j])
                total = total - torch.minimum(r * a, r.clamp(1 - eps, 1 + eps) * a)
            else:
                total = total - a * x[i, j]
    expect = total / int(mask.sum())
    (expect_grad,) = torch.autograd.grad(expect, x)
    torch.testing.assert_close(out.loss.detach(), expect.detach(), atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(grad, expect_grad, atol=1e-12, rtol=1e-10)
    assert float(out.stats[0]) == float(out.policy_loss)  # no KL term in the loss
    assert float(out.sums["kl_ref"]) > 0.0  # the KL is still reported


def test_kl_shaping_from_config_and_the_seed_names() -> None:
    cfg = GRPOConfig.from_dict({"kl_coeff": 0.05, "use_kl_advantage_shaping": True})
    assert cfg.kl_penalty == "advantage"
    obj = GRPOObjective.from_config(cfg)
    assert obj.kl_in_advantage
    assert obj.loss_kl_coeff == 0.0
    assert obj.kl_coeff == 0.05
    assert GRPOConfig.from_dict({"use_kl_advantage_shaping": False}).kl_penalty == "loss"
    with pytest.raises(ValueError, match=r"kl_penalty='advantage' is not allowed.*kl_coeff > 0"):
        GRPOConfig(kl_coeff=0.0, kl_penalty="advantage")
    with pytest.raises(ValueError, match=r"use_kl_advantage_shaping=True means kl_penalty='advantage'"):
        GRPOConfig.from_dict({"use_kl_advantage_shaping": True, "kl_penalty": "reward"})
    with pytest.raises(TypeError, match=r"seed 001's spelling of kl_penalty: pass kl_penalty='advantage'"):
        GRPOConfig(use_kl_advantage_shaping=True)  # type: ignore[call-arg]


def test_adv_norm_mean_only_centres_and_mean_std_scales() -> None:
    r = torch.tensor([1.0, 3.0, 0.0, 2.0, 5.0, 1.0, 2.0, 0.5])
    ids = uniform_group_ids(2, 4, torch.device("cpu"))
    mean_only = GRPOConfig.from_dict({"adv_norm": "mean_only"})
    assert mean_only.advantage_scale == "none"
    adv = AdvantageEstimator.from_config(mean_only)(r, ids, 2).advantages
    expect = r - r.view(2, 4).mean(1).repeat_interleave(4)
    torch.testing.assert_close(adv.float(), expect)
    mean_std = GRPOConfig.from_dict({"adv_norm": "mean_std", "normalize_advantages": True})
    assert mean_std.advantage_scale == "group"
    assert GRPOConfig.recipe("dapo", adv_norm="mean_only").advantage_scale == "none"
    with pytest.raises(
        ValueError, match=r"adv_norm='mean' is not allowed: choose one of \['mean_std', 'mean_only'\]"
    ):
        GRPOConfig.from_dict({"adv_norm": "mean"})
    with pytest.raises(ValueError, match=r"adv_norm='mean_only' means advantage_scale='none'"):
        GRPOConfig.from_dict({"adv_norm": "mean_only", "advantage_scale": "group"})
    with pytest.raises(
        ValueError,
        match=r"adv_norm='mean_std' means advantage_scale='group' .*, "
        r"but normalize_advantages=False \(advantage_scale='none'\) was given too",
    ):
        GRPOConfig.from_dict({"normalize_advantages": False, "adv_norm": "mean_std"})
