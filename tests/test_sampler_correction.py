"""Importance sampling for a sampler/trainer mismatch (GRPOConfig.sampler_is_cap and
sampler_correction; grpo.algorithms.sampler_correction): the four modes and the ESS against plain
loops, and through real trainer updates."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from grpo import GRPOConfig, GRPOTrainer, PolicyOutput
from grpo.algorithms.sampler_correction import (
    SAMPLER_CORRECTIONS,
    ImportanceSums,
    corrected_weights,
    effective_sample_size,
    importance_statistics,
    importance_sums,
    importance_weights,
    is_per_row,
)
from grpo.engine.backends import OptimizerStepResult
from grpo.grpo_objective import STAT_NAMES
from grpo.metrics import StepCounts, reduce_across_ranks
from grpo.policies import CategoricalMLP, DistributionPolicy
from grpo.update.loop import UpdateStatistics
from tests.conftest import WordPolicy


class HotSampler(DistributionPolicy):
    """A categorical policy whose sampler runs at temperature ``tau`` (a stand-in for vLLM or a
    quantised generator: same weights, other numbers) and reports its own log-probs."""

    def __init__(self, tau: float) -> None:
        torch.manual_seed(0)
        super().__init__(CategoricalMLP(3, 4, (8,)))
        self.tau = tau

    def sampler_log_probs(self, states: Tensor) -> Tensor:
        return torch.log_softmax(self.net.net(states) / self.tau, -1)  # (B, K)

    def generate_actions_with_log_probs(
        self, states: Any, num_actions_per_state: int, **kwargs: Any
    ) -> tuple[Tensor, PolicyOutput]:
        table = self.sampler_log_probs(states)
        actions = torch.multinomial(table.exp(), num_actions_per_state, replacement=True)  # (B, G)
        return actions, PolicyOutput(table.gather(1, actions).reshape(-1))


def reward(states: Tensor, actions: Tensor) -> Tensor:
    return actions.float() + states[:, 0]


CFG = dict(group_size=4, batch_size=4, kl_coeff=0.0, learning_rate=0.05, seed=0)


def test_weights_and_metrics_match_an_independent_computation() -> None:
    policy = HotSampler(tau=3.0)
    cap = 1.05  # the weights of this small net are within ~10 % of 1: a cap they cross
    trainer = GRPOTrainer(GRPOConfig(**CFG, num_epochs_per_update=2, sampler_is_cap=cap), policy, reward)
    states = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    batch = trainer.collect(states)
    assert batch.sampler_log_probs is not None
    assert batch.old_log_probs is not None
    with torch.no_grad():  # independent: the trainer's log-probs and the sampler's, same weights
        flat = states.repeat_interleave(4, 0)
        actions = batch.actions.reshape(-1, 1)
        mine = torch.log_softmax(policy.net.net(flat), -1).gather(1, actions).squeeze(1)
        theirs = policy.sampler_log_probs(flat).gather(1, actions).squeeze(1)
    torch.testing.assert_close(batch.old_log_probs[:, 0], mine)  # old: the trainer's own forward
    torch.testing.assert_close(batch.sampler_log_probs[:, 0], theirs)
    raw = torch.exp(mine - theirs)
    assert float(raw.max()) > cap  # the cap is active in this example
    stats = trainer.update(batch, trainer.advantages(batch))
    # two epochs: the first sees exactly these weights; the second the same old log-probs
    expected_mean = float(raw.clamp(max=cap).mean())
    assert float(stats["sampler/is_weight_mean"]) == pytest.approx(expected_mean, rel=1e-6)
    assert float(stats["sampler/is_frac_capped"]) == pytest.approx(float((raw > cap).float().mean()))


def test_the_policy_term_is_weighted_in_the_update() -> None:
    """One optimizer step from the same state: the corrected update equals the uncorrected one
    whose advantages were multiplied by the (clamped) weights, as pg is linear in A at ratio 1."""
    cap = 1.05
    states = torch.randn(4, 3, generator=torch.Generator().manual_seed(2))
    corrected = HotSampler(tau=3.0)
    trainer = GRPOTrainer(GRPOConfig(**CFG, sampler_is_cap=cap), corrected, reward)
    batch = trainer.collect(states)
    adv = trainer.advantages(batch)
    assert batch.sampler_log_probs is not None
    with torch.no_grad():
        old = corrected.evaluate_actions(batch.states, batch.actions, group_size=4).log_probs
        weights = torch.exp(old - batch.sampler_log_probs[:, 0]).clamp(max=cap)
    scaled = adv.values * weights
    trainer.update(batch, adv)

    plain = HotSampler(tau=3.0)  # same initial weights
    plain_batch = dataclasses.replace(batch, old_log_probs=None, sampler_log_probs=None)
    GRPOTrainer(GRPOConfig(**CFG), plain, reward).update(plain_batch, adv._replace(values=scaled))
    for a, b in zip(corrected.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-6)


def test_no_mismatch_gives_weights_of_one_and_the_plain_update() -> None:
    runs = []
    for cap in (2.0, None):
        policy = HotSampler(tau=1.0)  # the sampler is the trainer: weights exactly 1
        trainer = GRPOTrainer(GRPOConfig(**CFG, num_epochs_per_update=2, sampler_is_cap=cap), policy, reward)
        m = trainer.step(torch.randn(4, 3, generator=torch.Generator().manual_seed(3)))
        runs.append(([p.detach().clone() for p in policy.parameters()], m))
    (p_cap, m_cap), (p_plain, m_plain) = runs
    assert m_cap["sampler/is_weight_mean"] == pytest.approx(1.0, abs=1e-6)
    assert m_cap["sampler/is_frac_capped"] == 0.0
    assert "sampler/is_weight_mean" not in m_plain
    for a, b in zip(p_cap, p_plain, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_a_policy_without_sampler_log_probs_is_refused_at_construction() -> None:
    with pytest.raises(
        TypeError, match=r"WordPolicy has no generate_actions_with_log_probs.*sampler_is_cap=None"
    ):
        GRPOTrainer(GRPOConfig(**CFG, sampler_is_cap=2.0), WordPolicy(), reward)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), "2"])
def test_cap_must_be_positive(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"sampler_is_cap.*expected a number > 0"):
        GRPOConfig(**CFG, sampler_is_cap=bad)


# ---- the pure functions against plain loops ---------------------------------------------------
def loop_weights(old: Tensor, sampler: Tensor, mask: Tensor, mode: str, cap: float) -> list[list[float]]:
    """The weights of ``mode`` by a plain loop over rows and tokens, in Python floats."""
    out = []
    for i in range(old.shape[0]):
        valid = [t for t in range(old.shape[1]) if mask[i, t]]
        gaps = {t: float(old[i, t]) - float(sampler[i, t]) for t in valid}
        s = sum(gaps.values())
        row = [0.0] * old.shape[1]
        for t in valid:
            if mode == "token_truncate":
                row[t] = min(math.exp(gaps[t]), cap)
            elif mode == "token_mask":
                row[t] = math.exp(gaps[t]) if math.exp(gaps[t]) <= cap else 0.0
            elif mode == "sequence_truncate":
                row[t] = math.exp(min(s, math.log(cap)))  # min(exp(s), C) without overflow
            else:
                row[t] = math.exp(s) if s <= math.log(cap) else 0.0
        out.append(row)
    return out


def loop_ess(values: list[float]) -> float:
    if not values:
        return math.nan
    sq = sum(w * w for w in values)
    return 0.0 if sq == 0 else sum(values) ** 2 / (len(values) * sq)


def loop_units(weights: list[list[float]], mask: Tensor, per_row: bool) -> list[float]:
    rows = range(mask.shape[0])
    if per_row:
        return [max(weights[i][t] for t in range(mask.shape[1]) if mask[i, t]) for i in rows if mask[i].any()]
    return [weights[i][t] for i in rows for t in range(mask.shape[1]) if mask[i, t]]


def random_case(seed: int, *, spread: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    """float64 log-probs (N, T) and a mask of random lengths (rows of length 0 and T included)."""
    g = torch.Generator().manual_seed(seed)
    n, t = int(torch.randint(1, 7, (1,), generator=g)), int(torch.randint(1, 8, (1,), generator=g))
    old = -torch.rand(n, t, generator=g, dtype=torch.float64) * 3
    sampler = old - spread * torch.randn(n, t, generator=g, dtype=torch.float64)
    lengths = torch.randint(0, t + 1, (n,), generator=g)
    lengths[0] = t
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return old, sampler, mask


@pytest.mark.parametrize("mode", SAMPLER_CORRECTIONS)
@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("cap", [0.5, 1.0, 2.0, 1e30])
def test_each_mode_equals_a_plain_loop(mode: Any, seed: int, cap: float) -> None:
    old, sampler, mask = random_case(seed, spread=0.1 + seed / 4)
    out = corrected_weights(old, sampler, mask, mode=mode, cap=cap)
    expected = loop_weights(old, sampler, mask, mode, cap)
    torch.testing.assert_close(out.weights, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0)
    assert torch.equal(out.weights, importance_weights(old, sampler, mask, mode=mode, cap=cap))
    # capped: the (token's or row's) ratio exceeded C, on valid steps only
    gaps = torch.where(mask, old - sampler, 0.0)
    ratio = gaps.sum(-1, keepdim=True).exp().expand_as(gaps) if is_per_row(mode) else gaps.exp()
    assert torch.equal(out.capped, (ratio > cap) & mask)
    units = loop_units(expected, mask, is_per_row(mode))
    ess = float(effective_sample_size(out.weights, mask, per_row=is_per_row(mode)))
    assert ess == pytest.approx(loop_ess(units), rel=1e-12, nan_ok=True)


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_truncate"])
def test_a_cap_never_reached_changes_nothing(mode: Any) -> None:
    old, sampler, mask = random_case(3)
    w = importance_weights(old, sampler, mask, mode=mode, cap=1e30)
    gaps = torch.where(mask, old - sampler, 0.0)
    raw = gaps.sum(-1, keepdim=True).exp().expand_as(gaps) if is_per_row(mode) else gaps.exp()
    torch.testing.assert_close(w, torch.where(mask, raw, 0.0), rtol=1e-14, atol=0)


@pytest.mark.parametrize("mode", SAMPLER_CORRECTIONS)
def test_all_padding_gives_zero_weights_and_no_ess(mode: Any) -> None:
    old = torch.full((3, 4), float("nan"))  # padding may hold anything
    mask = torch.zeros(3, 4, dtype=torch.bool)
    out = corrected_weights(old, old, mask, mode=mode, cap=2.0)
    assert torch.equal(out.weights, torch.zeros(3, 4))
    assert not out.capped.any()
    assert math.isnan(float(effective_sample_size(out.weights, mask, per_row=is_per_row(mode))))
    stats = importance_statistics(importance_sums(out, mask, per_row=is_per_row(mode)))
    assert stats.weight_mean == stats.frac_capped == 0.0
    assert math.isnan(stats.ess)


def test_padding_values_never_leak() -> None:
    old, sampler, mask = random_case(5)
    garbage_old = torch.where(mask, old, float("inf"))
    garbage_sampler = torch.where(mask, sampler, float("nan"))
    for mode in SAMPLER_CORRECTIONS:
        clean = corrected_weights(old, sampler, mask, mode=mode, cap=1.5)
        dirty = corrected_weights(garbage_old, garbage_sampler, mask, mode=mode, cap=1.5)
        assert torch.equal(clean.weights, dirty.weights)
        assert torch.equal(clean.capped, dirty.capped)


@pytest.mark.parametrize("cap", [0.7, 2.0])
def test_one_token_rows_make_sequence_modes_token_modes(cap: float) -> None:
    old, sampler, _ = random_case(7)
    old, sampler = old[:, :1], sampler[:, :1]
    mask = torch.ones_like(old, dtype=torch.bool)
    for kind in ("truncate", "mask"):
        tok = importance_weights(old, sampler, mask, mode=f"token_{kind}", cap=cap)  # type: ignore[arg-type]
        seq = importance_weights(old, sampler, mask, mode=f"sequence_{kind}", cap=cap)  # type: ignore[arg-type]
        torch.testing.assert_close(tok, seq, rtol=1e-14, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_extreme_gaps_do_not_overflow(dtype: torch.dtype) -> None:
    """Rows of 50 tokens with gaps of +-200 per token: exp of the row's sum is far beyond float64."""
    t = 50
    old = torch.zeros(4, t, dtype=dtype)
    sampler = torch.stack([torch.full((t,), -200.0), torch.full((t,), 200.0), torch.zeros(t), torch.zeros(t)])
    sampler = sampler.to(dtype)
    mask = torch.ones(4, t, dtype=torch.bool)
    mask[3, 1:] = False
    cap = 2.0
    for mode in SAMPLER_CORRECTIONS:
        w = importance_weights(old, sampler, mask, mode=mode, cap=cap)
        assert bool(torch.isfinite(w).all()), mode
        big = cap if mode.endswith("truncate") else 0.0
        assert bool((w[0] == big).all()), mode  # ratio e^200 per token, e^10000 per row
        assert bool((w[1] <= 1e-80).all()), mode  # e^-200 per token (0 in float32), e^-10000 per row
        assert bool((w[2] == 1.0).all()), mode
        assert float(w[3, 0]) == 1.0
        assert bool((w[3, 1:] == 0).all()), mode
        ess = effective_sample_size(w, mask, per_row=is_per_row(mode))
        assert 0.0 <= float(ess) <= 1.0


def test_token_truncate_is_todays_formula_bitwise() -> None:
    """The weights the update used before the modes existed: exp(old - sampler).clamp(max=cap)."""
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(64, 33, generator=g) * 5
    sampler = old + 0.3 * torch.randn(64, 33, generator=g)
    mask = torch.rand(64, 33, generator=g) > 0.2
    out = corrected_weights(old, sampler, mask, mode="token_truncate", cap=1.1)
    raw = torch.exp(old - sampler)
    assert torch.equal(out.weights[mask], raw.clamp(max=1.1)[mask])
    sums = importance_sums(out, mask, per_row=False)
    mf = mask.float()
    assert torch.equal(sums.weight_sum, (raw.clamp(max=1.1) * mf).sum())
    assert torch.equal(sums.capped, ((raw > 1.1) * mf).sum())


def test_ess_against_the_formula_and_its_bounds() -> None:
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(1, 5, dtype=torch.bool)
    assert float(effective_sample_size(torch.full((1, 5), 0.7), mask)) == pytest.approx(1.0, abs=1e-7)
    one = torch.tensor([[3.0, 0.0, 0.0, 0.0, 0.0]])
    assert float(effective_sample_size(one, mask)) == pytest.approx(1 / 5)
    assert float(effective_sample_size(torch.zeros(1, 5), mask)) == 0.0
    for _ in range(20):
        w = torch.rand(4, 6, generator=g, dtype=torch.float64) ** 3 + 1e-3
        m = torch.rand(4, 6, generator=g) > 0.3
        m[0, 0] = True
        values = w[m].tolist()
        ess = float(effective_sample_size(w, m))
        assert ess == pytest.approx(sum(values) ** 2 / (len(values) * sum(v * v for v in values)), rel=1e-12)
        assert 1 / len(values) <= ess <= 1.0
    # per row: a row is one unit weighted by its (shared) weight, however many valid steps it has
    rows = torch.tensor([[2.0, 2.0, 2.0], [1.0, 0.0, 0.0], [5.0, 5.0, 5.0]])
    m = torch.tensor([[True, True, True], [True, False, False], [False, False, False]])
    assert float(effective_sample_size(rows, m, per_row=True)) == pytest.approx(9 / (2 * 5))
    assert float(effective_sample_size(rows, m)) == pytest.approx(49 / (4 * 13))


@pytest.mark.parametrize("mode", SAMPLER_CORRECTIONS)
def test_sums_add_up_over_micro_batches(mode: Any) -> None:
    """The update sums each micro-batch's ImportanceSums: the statistics of the sum equal those of
    the whole batch (a ratio per micro-batch would not)."""
    old, sampler, mask = random_case(11, spread=1.5)
    per_row = is_per_row(mode)
    whole = importance_sums(corrected_weights(old, sampler, mask, mode=mode, cap=1.3), mask, per_row=per_row)
    parts = [
        importance_sums(
            corrected_weights(old[r], sampler[r], mask[r], mode=mode, cap=1.3), mask[r], per_row=per_row
        )
        for r in (slice(0, 1), slice(1, None))
    ]
    summed = ImportanceSums(*(a + b for a, b in zip(*parts, strict=True)))
    a, b = importance_statistics(whole), importance_statistics(summed)
    assert a.weight_mean == pytest.approx(b.weight_mean, rel=1e-12)
    assert a.frac_capped == pytest.approx(b.frac_capped, rel=1e-12)
    assert a.ess == pytest.approx(b.ess, rel=1e-12, nan_ok=True)
    expected = loop_weights(old, sampler, mask, mode, 1.3)
    valid = [expected[i][t] for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]
    assert a.weight_mean == pytest.approx(sum(valid) / len(valid), rel=1e-12)
    assert a.ess == pytest.approx(loop_ess(loop_units(expected, mask, per_row)), rel=1e-12)


def _rank_metrics(old: Tensor, sampler: Tensor, mask: Tensor, mode: Any, others: Tensor) -> dict[str, float]:
    """One process's update metrics (`UpdateStatistics.finish`) for its rows; ``others``: the
    other process's stacked sums, what `Backend.global_sum` adds."""
    stats = UpdateStatistics(with_is=True)
    stats.add_is(importance_sums(corrected_weights(old, sampler, mask, mode=mode, cap=1.3), mask,
                                 per_row=is_per_row(mode)))  # fmt: skip
    objective = torch.zeros(len(STAT_NAMES), dtype=torch.float64)
    objective[STAT_NAMES.index("steps")] = float(mask.sum())
    stats.add_objective(objective)
    stats.add_extremes(torch.full((2,), -math.inf))
    stats.add_step(OptimizerStepResult(grad_norm=1.0, loss=0.0, applied=True))
    out, steps = stats.finish(lambda mine: mine + others)
    assert steps == float(mask.sum())
    return {k: v for k, v in out.items() if k.startswith("sampler/")}


@pytest.mark.parametrize("mode", SAMPLER_CORRECTIONS)
def test_two_processes_reduce_to_the_statistics_of_the_whole_batch(mode: Any) -> None:
    """Rows split over two processes: each logs its mean weight and fraction capped over its own
    valid steps (reduced weighted by valid steps) and the ESS of the global sums (equal on both):
    the reduced values are the whole batch's, by the plain loop."""
    old, sampler, mask = random_case(2, spread=1.5)
    old, sampler, mask = torch.cat([old, old + 0.1]), torch.cat([sampler, sampler]), torch.cat([mask, mask])
    rows = (slice(0, 3), slice(3, None))
    sums = [
        torch.stack(list(importance_sums(corrected_weights(old[r], sampler[r], mask[r], mode=mode, cap=1.3),
                                         mask[r], per_row=is_per_row(mode))))
        for r in rows
    ]  # fmt: skip
    local = [_rank_metrics(old[r], sampler[r], mask[r], mode, sums[1 - k]) for k, r in enumerate(rows)]
    assert local[0]["sampler/ess"] == local[1]["sampler/ess"]
    counts = [StepCounts(samples=3.0, groups=1.0, valid_steps=float(mask[r].sum())) for r in rows]
    gathered: list[Tensor] = []
    reduce_across_ranks(local[1], counts[1], lambda t: gathered.append(t) or t[None])  # type: ignore[func-returns-value]
    glob = reduce_across_ranks(local[0], counts[0], lambda t: torch.stack([t, gathered[0]]))
    expected = loop_weights(old, sampler, mask, mode, 1.3)
    valid = [expected[i][t] for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]
    assert glob["sampler/is_weight_mean"] == pytest.approx(sum(valid) / len(valid), rel=1e-6)
    gaps = torch.where(mask, old - sampler, 0.0)
    ratio = gaps.sum(-1, keepdim=True).exp().expand_as(gaps) if is_per_row(mode) else gaps.exp()
    assert glob["sampler/is_frac_capped"] == pytest.approx(float((ratio > 1.3)[mask].double().mean()))
    assert glob["sampler/ess"] == pytest.approx(
        loop_ess(loop_units(expected, mask, is_per_row(mode))), rel=1e-6
    )


def test_bad_arguments_are_named() -> None:
    x, m = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"mode='seq' is unknown; choose one of \('token_truncate'"):
        importance_weights(x, x, m, mode="seq", cap=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"cap must be > 0, got cap=0.0"):
        importance_weights(x, x, m, mode="token_mask", cap=0.0)
    with pytest.raises(ValueError, match=r"one shape \(N, T\); got \(2, 3\), \(2, 2\)"):
        importance_weights(x, x[:, :2], m, mode="token_mask", cap=2.0)
    with pytest.raises(
        ValueError, match=r"GRPOConfig.sampler_correction='sequence' is not allowed: choose one of"
    ):
        GRPOConfig(**CFG, sampler_is_cap=2.0, sampler_correction="sequence")  # type: ignore[arg-type]


# ---- every mode through a real trainer update -------------------------------------------------
T_STEPS, K_CHOICES = 3, 4


class StepSampler(nn.Module):
    """T = 3 categorical steps per action (row i has 1 + a_i0 % 3 valid steps: padding), each from
    its own head of a linear layer; the sampler runs at temperature ``tau`` and reports its own
    per-step log-probs with the mask."""

    def __init__(self, tau: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(3, T_STEPS * K_CHOICES).double()
        self.tau = tau

    def table(self, states: Tensor, tau: float = 1.0) -> Tensor:
        return torch.log_softmax(self.net(states).view(-1, T_STEPS, K_CHOICES) / tau, -1)  # (n, T, K)

    @staticmethod
    def mask(actions: Tensor) -> Tensor:
        return torch.arange(T_STEPS)[None, :] < (1 + actions[:, 0] % T_STEPS)[:, None]  # (n, T)

    def output(self, table: Tensor, actions: Tensor) -> PolicyOutput:
        m = self.mask(actions)
        return PolicyOutput(table.gather(-1, actions[..., None]).squeeze(-1).masked_fill(~m, 0.0), m)

    def generate_actions_with_log_probs(
        self, states: Tensor, num_actions_per_state: int, **kwargs: Any
    ) -> tuple[Tensor, PolicyOutput]:
        g, table = num_actions_per_state, self.table(states, self.tau)
        flat = torch.multinomial(table.exp().reshape(-1, K_CHOICES), g, replacement=True)  # (B*T, G)
        actions = flat.view(-1, T_STEPS, g).permute(0, 2, 1)  # (B, G, T)
        return actions, self.output(table.repeat_interleave(g, 0), actions.reshape(-1, T_STEPS))

    def generate_actions(self, states: Tensor, num_actions_per_state: int, **kwargs: Any) -> Tensor:
        return self.generate_actions_with_log_probs(states, num_actions_per_state)[0]

    def get_log_probabilities(self, states: Tensor, actions: Tensor) -> PolicyOutput:
        return self.output(self.table(states), actions)

    def get_parameters(self) -> dict[str, Tensor]:
        return dict(self.named_parameters())


def steps_reward(states: Tensor, actions: Tensor) -> Tensor:
    return actions.double().sum(-1) + states[:, 0]


@pytest.mark.parametrize(("mode", "cap"), [("token_truncate", 1.2), ("token_mask", 1.2),
                                           ("sequence_truncate", 1.5), ("sequence_mask", 1.5)])  # fmt: skip
def test_the_update_follows_the_hand_computed_weighted_gradient(mode: Any, cap: float) -> None:
    """One SGD step at ratio 1 (float64): the parameter change is -lr times the gradient of
    -(1/Z) sum_it m_it w_it A_i logp_it, with w from the plain loop; a masked row adds nothing."""
    lr, states = 0.5, torch.randn(4, 3, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    policy = StepSampler(tau=3.0)
    start = [p.detach().clone() for p in policy.parameters()]
    config = GRPOConfig(
        group_size=4, batch_size=4, kl_coeff=0.0, learning_rate=lr, seed=0, max_grad_norm=None,
        micro_batch_size=1, sampler_is_cap=cap, sampler_correction=mode,
    )  # fmt: skip
    trainer = GRPOTrainer(config, policy, steps_reward, optimizer=torch.optim.SGD(policy.parameters(), lr=lr))
    batch = trainer.collect(states)
    adv = trainer.advantages(batch)
    flat, actions = states.repeat_interleave(4, 0), batch.actions.reshape(-1, T_STEPS)
    with torch.no_grad():  # independent: the trainer's and the sampler's log-probs, same weights
        old = policy.get_log_probabilities(flat, actions).log_probs
        sampler = policy.output(policy.table(flat, 3.0), actions).log_probs
    mask = StepSampler.mask(actions)
    assert batch.sampler_log_probs is not None
    torch.testing.assert_close(batch.sampler_log_probs, sampler, rtol=1e-12, atol=1e-12)
    w = torch.tensor(loop_weights(old, sampler, mask, mode, cap), dtype=torch.float64)
    assert bool(corrected_weights(old, sampler, mask, mode=mode, cap=cap).capped.any())  # the cap acts
    if mode.endswith("mask"):
        assert bool(((w == 0) & mask).any())  # something is masked

    metrics = trainer.update(batch, adv)

    reference = StepSampler(tau=3.0)  # the same start: the hand-computed gradient
    logp = reference.get_log_probabilities(flat, actions).log_probs
    loss = -(mask * w * adv.values[:, None] * logp).sum() / mask.sum()
    grads = torch.autograd.grad(loss, list(reference.parameters()))
    for p0, p1, g in zip(start, policy.parameters(), grads, strict=True):
        torch.testing.assert_close((p0 - p1.detach()) / lr, g, rtol=1e-9, atol=1e-12)
    units = loop_units(w.tolist(), mask, is_per_row(mode))
    capped = corrected_weights(old, sampler, mask, mode=mode, cap=cap).capped
    # (update() returns its metrics as float32 tensors)
    assert float(metrics["sampler/is_weight_mean"]) == pytest.approx(float(w[mask].mean()), rel=1e-6)
    assert float(metrics["sampler/is_frac_capped"]) == pytest.approx(float(capped[mask].double().mean()))
    assert float(metrics["sampler/ess"]) == pytest.approx(loop_ess(units), rel=1e-6)


def test_masked_rows_contribute_no_gradient() -> None:
    """sequence_mask with a cap every row exceeds: the policy term is 0, so nothing moves (no KL
    or entropy term) and the ESS is 0."""
    policy = StepSampler(tau=3.0)
    start = [p.detach().clone() for p in policy.parameters()]
    config = GRPOConfig(
        group_size=4, batch_size=4, kl_coeff=0.0, learning_rate=0.5, seed=0, max_grad_norm=None,
        sampler_is_cap=1e-30, sampler_correction="sequence_mask",
    )  # fmt: skip
    trainer = GRPOTrainer(
        config, policy, steps_reward, optimizer=torch.optim.SGD(policy.parameters(), lr=0.5)
    )
    metrics = trainer.step(torch.randn(4, 3, generator=torch.Generator().manual_seed(4), dtype=torch.float64))
    for a, b in zip(start, policy.parameters(), strict=True):
        assert torch.equal(a, b.detach())
    assert metrics["sampler/is_frac_capped"] == 1.0
    assert metrics["sampler/is_weight_mean"] == metrics["sampler/ess"] == 0.0
