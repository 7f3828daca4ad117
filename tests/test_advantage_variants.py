"""Advantage variants vs plain-loop float64 references; config recipes; trainer wiring (issue 3)."""

from __future__ import annotations

import math
import re
import statistics

import pytest
import torch

from grpo.advantage_estimator import AdvantageEstimator
from grpo.algorithms.advantages import (
    ADVANTAGE_BASELINES,
    ADVANTAGE_SCALES,
    AdvantageNormalisation,
    RunningMeanStd,
    normalise_scores,
    whiten,
)
from grpo.config import GRPOConfig
from grpo.policies import categorical_mlp
from grpo.trainer import GRPOTrainer
from grpo.update.loop import global_normaliser

D = torch.float64
EPS = 1e-6


def uneven_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # groups: 0 (4 members), 1 (1 member), 2 (3 equal rewards), 3 (5 members)
    ids = torch.tensor([0, 0, 0, 0, 1, 2, 2, 2, 3, 3, 3, 3, 3])
    r = torch.randn(13, generator=g, dtype=D)
    r[5:8] = 0.7
    return r, ids, 4


def loop_advantages(r, ids, baseline, scale, history=()):
    """Independent reference: lists and the statistics module, one sample at a time."""
    r = [float(x) for x in r]
    ids = [int(i) for i in ids]
    allvals = [*history, *r]
    out = []
    for i, x in enumerate(r):
        members = [r[j] for j in range(len(r)) if ids[j] == ids[i]]
        others = [r[j] for j in range(len(r)) if ids[j] == ids[i] and j != i]
        equal = max(members) == min(members)
        if baseline == "group":
            b = sum(members) / len(members)
        elif baseline == "leave_one_out":
            b = sum(others) / len(others) if others else 0.0
        elif baseline == "batch":
            b = sum(r) / len(r)
        elif baseline == "running":
            b = sum(allvals) / len(allvals)
        else:
            b = 0.0
        if scale == "group":
            d = (statistics.stdev(members) if len(members) > 1 else 0.0) + EPS
        elif scale == "batch":
            d = statistics.stdev(r) + EPS
        elif scale == "running":
            d = statistics.stdev(allvals) + EPS
        else:
            d = 1.0
        zero = equal and (baseline in ("group", "leave_one_out") or scale == "group")
        out.append(0.0 if zero else (x - b) / d)
    return torch.tensor(out, dtype=D)


@pytest.mark.parametrize("scale", ADVANTAGE_SCALES)
@pytest.mark.parametrize("baseline", ADVANTAGE_BASELINES)
def test_every_baseline_and_scale_matches_loop(baseline, scale):
    r, ids, k = uneven_batch()
    history = [0.3, -1.2, 2.0, 0.1]
    running = RunningMeanStd()
    running.update(torch.tensor(history, dtype=D))
    got = normalise_scores(r, ids, k, AdvantageNormalisation(baseline, scale, EPS), running=running)
    assert torch.allclose(got, loop_advantages(r, ids, baseline, scale, history), atol=1e-12, rtol=1e-10)
    # a singleton group never gets its raw reward under group sources
    if baseline in ("group", "leave_one_out") or scale == "group":
        assert float(got[4]) == 0.0
        assert torch.equal(got[5:8], torch.zeros(3, dtype=D))


def test_rloo_is_rescaled_group_centering():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.5], dtype=D)
    ids = torch.tensor([0, 0, 0, 0, 1, 1])
    loo = normalise_scores(r, ids, 2, AdvantageNormalisation("leave_one_out", "none"))
    grp = normalise_scores(r, ids, 2, AdvantageNormalisation("group", "none"))
    assert torch.allclose(loo[:4], grp[:4] * 4 / 3)
    assert torch.allclose(loo[4:], grp[4:] * 2)


def test_running_stats_merge_equals_one_pass_and_round_trips():
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(n, generator=g, dtype=D) * 3 + 5 for n in (7, 1, 20)]
    rs = RunningMeanStd()
    for c in chunks:
        rs.update(c)
    allv = torch.cat(chunks)
    assert float(rs.mean) == pytest.approx(float(allv.mean()), rel=1e-12)
    assert float(rs.std) == pytest.approx(float(allv.std()), rel=1e-12)
    est = AdvantageEstimator(baseline="running", scale="running")
    est(allv, torch.zeros(28, dtype=torch.long), 1)
    state = est.state_dict()
    assert set(state) == {"reward.count", "reward.mean", "reward.m2"}
    est2 = AdvantageEstimator(baseline="running", scale="running")
    est2.load_state_dict(state)
    x = torch.randn(5, generator=g, dtype=D)
    ids = torch.zeros(5, dtype=torch.long)
    assert torch.equal(est(x, ids, 1).advantages, est2(x, ids, 1).advantages)
    with pytest.raises(KeyError, match="missing"):
        RunningMeanStd().load_state_dict({"count": torch.tensor(1.0)})


def test_clipping_whitening_and_order_match_loop():
    r, ids, k = uneven_batch(1)
    mask = torch.zeros(13, 6, dtype=torch.bool)
    lengths = [1, 6, 3, 2, 5, 4, 6, 1, 2, 3, 6, 5, 4]
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    est = AdvantageEstimator(reward_clip=0.8, whiten_advantages=True, advantage_clip=1.5)
    got = est(r, ids, k, mask=mask).advantages
    clipped = r.clamp(-0.8, 0.8)
    a = loop_advantages(clipped, ids, "group", "group")
    steps = [float(a[i]) for i in range(13) for _ in range(lengths[i])]  # one entry per valid step
    mu, sd = statistics.fmean(steps), statistics.stdev(steps)
    expected = torch.tensor([min(max((float(x) - mu) / (sd + 1e-8), -1.5), 1.5) for x in a], dtype=D)
    assert torch.allclose(got, expected, atol=1e-12)
    assert got.dtype == D
    # whitening (N, T) advantages counts valid steps only and zeroes the rest
    a2 = torch.randn(13, 6, dtype=D)
    w2 = whiten(a2, mask)
    vals = a2[mask]
    assert torch.allclose(w2[mask], (vals - vals.mean()) / (vals.std() + 1e-8))
    assert torch.equal(w2[~mask], torch.zeros(int((~mask).sum()), dtype=D))


def test_reward_components_sum_vs_per_component():
    g = torch.Generator().manual_seed(2)
    ids = torch.arange(3).repeat_interleave(4)
    acc = torch.randint(0, 2, (12,), generator=g).to(D)
    comps = {"acc": acc, "fmt": torch.rand(12, generator=g, dtype=D)}
    w = {"acc": 1.0, "fmt": 0.25}
    total = comps["acc"] * 1.0 + comps["fmt"] * 0.25
    summed = AdvantageEstimator()(total, ids, 3, components=comps, weights=w).advantages
    assert torch.allclose(summed, loop_advantages(total, ids, "group", "group"))
    per = AdvantageEstimator(reward_combination="per_component")(total, ids, 3, components=comps, weights=w)
    expected = 1.0 * loop_advantages(comps["acc"], ids, "group", "group") + 0.25 * loop_advantages(
        comps["fmt"], ids, "group", "group"
    )
    assert torch.allclose(per.advantages, expected)


def test_kl_penalty_in_reward_enters_as_per_step_return():
    g = torch.Generator().manual_seed(3)
    ids = torch.arange(2).repeat_interleave(3)
    r = torch.randn(6, generator=g, dtype=D)
    pen = torch.rand(6, 4, generator=g, dtype=D) * 0.1
    mask = torch.ones(6, 4, dtype=torch.bool)
    mask[0, 2:] = False
    got = AdvantageEstimator()(r, ids, 2, mask=mask, kl_penalty=pen).advantages
    assert got.shape == (6, 4)
    ret = torch.zeros(6, 4, dtype=D)
    for i in range(6):
        for t in range(4):
            ret[i, t] = float(r[i]) - sum(float(pen[i, u]) for u in range(t, 4) if mask[i, u])
    for i in range(6):
        members = [j for j in range(6) if ids[j] == ids[i]]
        totals = [float(ret[j, 0]) for j in members]
        mu, sd = statistics.fmean(totals), statistics.stdev(totals)
        for t in range(4):
            exp = (float(ret[i, t]) - mu) / (sd + EPS) if mask[i, t] else 0.0
            assert float(got[i, t]) == pytest.approx(exp, abs=1e-12)


def test_drop_zero_variance_groups_keep_mask_and_fraction():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0], dtype=D)
    ids = torch.tensor([0, 0, 1, 1, 2, 2])
    res = AdvantageEstimator(drop_zero_variance_groups=True)(r, ids, 3)
    assert res.keep.tolist() == [False, False, True, True, False, False]
    assert float(res.stats["advantage/frac_dropped_groups"]) == pytest.approx(2 / 3)


# ---- config ---------------------------------------------------------------------------------
def test_recipes_resolve_published_values_and_print():
    dapo = GRPOConfig.recipe("dapo", batch_size=8, mini_batch_size=2)
    assert (dapo.clip_epsilon, dapo.clip_epsilon_high, dapo.kl_coeff) == (0.2, 0.28, 0.0)
    assert dapo.drop_zero_variance_groups
    assert dapo.loss_aggregation == "token-mean"
    text = str(dapo)
    assert re.search(r"recipe_name\s+= 'dapo'", text)
    assert "arXiv:2503.14476" in text
    dm = GRPOConfig.recipe("deepseek_math")
    assert (dm.kl_coeff, dm.group_size, dm.learning_rate, dm.loss_aggregation) == (
        0.04,
        64,
        1e-6,
        "seq-mean-token-mean",
    )
    gspo = GRPOConfig.recipe("gspo")
    assert (gspo.policy_loss, gspo.clip_epsilon, gspo.clip_epsilon_high) == ("gspo", 3e-4, 4e-4)
    cispo = GRPOConfig.recipe("cispo")
    assert (cispo.policy_loss, cispo.clip_epsilon) == ("cispo", 1.0)
    dr = GRPOConfig.recipe("dr_grpo", loss_normaliser=512)
    assert (dr.advantage_scale, dr.loss_aggregation) == ("none", "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match=r"loss_normaliser.*max_new_tokens"):
        GRPOConfig.recipe("dr_grpo")
    with pytest.raises(ValueError, match="unknown recipe 'ppo'; choose one of"):
        GRPOConfig.recipe("ppo")
    with pytest.raises(TypeError, match=r"unknown field klcoef=0\.1 \(did you mean kl_coeff=0\.1\?\)"):
        GRPOConfig.recipe("dapo", klcoef=0.1)


def test_config_validation_messages():
    with pytest.raises(ValueError, match="advantage_baseline='mean' is not allowed"):
        GRPOConfig(advantage_baseline="mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"dual_clip_c=1\.0 is not allowed"):
        GRPOConfig(dual_clip=True, dual_clip_c=1.0)
    with pytest.raises(ValueError, match="dual clip applies to the 'clip' and 'gspo'"):
        GRPOConfig(dual_clip=True, policy_loss="sapo")
    with pytest.raises(ValueError, match=r"clip_epsilon=1\.5 is not allowed"):
        GRPOConfig(clip_epsilon=1.5)
    assert GRPOConfig(clip_epsilon=1.0).clip_epsilon == 1.0  # no lower bound
    assert GRPOConfig.from_dict({"normalize_advantages": False}).advantage_scale == "none"


# ---- trainer wiring -------------------------------------------------------------------------
def bandit_reward(states, actions):
    return (actions == 1).to(torch.float32)


def run_step(cfg, states, reward=bandit_reward, **kw):
    torch.manual_seed(0)
    policy = categorical_mlp(3, 2, (8,))
    trainer = GRPOTrainer(cfg, policy, reward, **kw)
    metrics = trainer.step(states)
    return trainer, policy, metrics


STATES = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))


def test_extension_points_equal_builtin_variants():
    base = {"group_size": 4, "batch_size": 4, "seed": 1, "kl_coeff": 0.1, "mini_batch_size": 2}
    _, p_builtin, _ = run_step(GRPOConfig(**base, policy_loss="reinforce", kl_estimator="k1"), STATES)

    def my_loss(logp, logp_old, adv, mask):
        return -adv.unsqueeze(-1) * logp

    def my_kl(logp, logp_ref):
        return logp - logp_ref

    calls = []

    def my_adv(scores, group_ids, num_groups):
        calls.append(scores.shape)
        return normalise_scores(scores, group_ids, num_groups)

    _, p_user, _ = run_step(GRPOConfig(**base), STATES, loss_fn=my_loss, kl_fn=my_kl, advantage_fn=my_adv)
    assert calls == [(16,)]
    for a, b in zip(p_builtin.parameters(), p_user.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-7)


def test_dropped_groups_leave_the_loss():
    cfg = {"group_size": 4, "batch_size": 4, "seed": 1, "kl_coeff": 0.0, "entropy_coeff": 0.5}
    const = lambda s, a: torch.ones(a.shape[0])  # noqa: E731  every group has zero variance
    torch.manual_seed(0)
    before = [p.clone() for p in categorical_mlp(3, 2, (8,)).parameters()]
    _, p_drop, m = run_step(GRPOConfig(**cfg, drop_zero_variance_groups=True), STATES, const)
    assert m["advantage/frac_dropped_groups"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, p_drop.parameters(), strict=True))
    _, p_keep, _ = run_step(GRPOConfig(**cfg), STATES, const)  # the entropy bonus still trains
    assert not all(torch.equal(a, b) for a, b in zip(before, p_keep.parameters(), strict=True))


def test_kl_in_reward_gives_per_step_advantages_and_no_kl_loss():
    cfg = GRPOConfig(group_size=4, batch_size=4, seed=1, kl_coeff=0.5, kl_penalty="reward")
    trainer, _, m = run_step(cfg, STATES)
    assert trainer.objective.kl_coeff == 0.0
    assert trainer.reference_policy is not None
    assert m["loss/kl"] == 0.0
    batch = trainer.collect(STATES)
    adv = trainer.advantages(batch)
    assert adv.values.shape == (16, 1)
    assert math.isfinite(float(adv.values.sum()))


@pytest.mark.parametrize("kl_coeff", [0.0, 0.1])  # 0: mask unknown before the forwards (deferred Z)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_trainer_micro_batches_with_dropped_groups_equal_full_batch(agg, kl_coeff):
    def reward(states, actions):  # group 0 always 1 (dropped), others depend on the action
        return torch.where(states[:, 0] > 10, 1.0, (actions == 1).float())

    states = STATES.clone()
    states[0, 0] = 11.0
    params = []
    for micro in (None, 1):
        cfg = GRPOConfig(
            group_size=4, batch_size=4, seed=3, kl_coeff=kl_coeff, entropy_coeff=0.1,
            loss_aggregation=agg, loss_normaliser=5.0, drop_zero_variance_groups=True,
            micro_batch_size=micro, learning_rate=0.01, max_grad_norm=None,
        )  # fmt: skip
        _, policy, m = run_step(cfg, states, reward)
        assert m["advantage/frac_dropped_groups"] == 0.25
        params.append([p.detach().clone() for p in policy.parameters()])
    for a, b in zip(*params, strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_dropped_rows_leave_the_normaliser():
    def reward(states, actions):
        return torch.where(states[:, 0] > 10, 1.0, (actions == 1).float())

    states = STATES.clone()
    states[0, 0] = 11.0
    cfg = GRPOConfig(group_size=4, batch_size=4, seed=3, kl_coeff=0.1, drop_zero_variance_groups=True)
    trainer, _, _ = run_step(cfg, states, reward)
    batch = trainer.collect(states)
    adv = trainer.advantages(batch)
    assert batch.mask is not None
    assert adv.keep is not None
    loss_mask = batch.mask & adv.keep.unsqueeze(-1)
    z = global_normaliser(trainer.backend, trainer.objective, loss_mask)
    assert float(z) == 12.0  # 16 one-step samples, the 4 of group 0 dropped


# ---- per-step credit -------------------------------------------------------------------------
@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_discounted_returns_match_a_loop(gamma: float) -> None:
    from grpo.algorithms.advantages import discounted_returns

    g = torch.Generator().manual_seed(0)
    r = torch.randn(5, 7, generator=g)
    mask = torch.rand(5, 7, generator=g) > 0.3
    got = discounted_returns(r, mask, gamma)
    for i in range(5):
        running = 0.0
        for t in range(6, -1, -1):
            if mask[i, t]:
                running = float(r[i, t]) + gamma * running
                assert float(got[i, t]) == pytest.approx(running, abs=1e-12)
            else:
                assert float(got[i, t]) == 0.0
    with pytest.raises(ValueError, match=r"gamma must be in \[0, 1\]"):
        discounted_returns(r, mask, 1.5)


@pytest.mark.parametrize("scale", [True, False])
def test_per_step_group_advantages_match_a_loop_and_ignore_reward_shifts(scale: bool) -> None:
    from grpo.algorithms.advantages import per_step_group_advantages

    g = torch.Generator().manual_seed(1)
    n, t, k = 12, 6, 3
    ret = torch.randn(n, t, generator=g, dtype=torch.float64)
    mask = torch.rand(n, t, generator=g) > 0.25
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2])[torch.randperm(n, generator=g)]
    ret[ids == 2] = 1.5  # a group with equal returns: exactly 0
    got = per_step_group_advantages(ret, mask, ids, k, scale=scale)
    for i in range(n):
        for s in range(t):
            members = [j for j in range(n) if ids[j] == ids[i] and mask[j, s]]
            vals = torch.tensor([float(ret[j, s]) for j in members], dtype=torch.float64)
            if not mask[i, s] or len(members) < 2 or bool((vals == vals[0]).all()):
                assert float(got[i, s]) == 0.0
                continue
            want = float(ret[i, s]) - float(vals.mean())
            if scale:
                want /= float(vals.std()) + 1e-6
            assert float(got[i, s]) == pytest.approx(want, abs=1e-12)
    shifted = per_step_group_advantages(ret + 3.0, mask, ids, k, scale=scale)
    torch.testing.assert_close(shifted, got, atol=1e-12, rtol=0)
