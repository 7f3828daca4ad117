"""Policy losses, KL, entropy and aggregation vs plain-loop float64 references (issue 3)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo.algorithms.aggregation import AGGREGATIONS, aggregate, aggregation_normaliser
from grpo.algorithms.kl import kl_estimate, kl_return_to_go
from grpo.algorithms.policy_losses import cispo_loss, clip_loss, gspo_loss, reinforce_loss, sapo_loss
from grpo.grpo_objective import GRPOObjective

D = torch.float64
C_NORM = 7.0
EPS_LO, EPS_HI = 0.2, 0.28
# (name, GRPOObjective kwargs)
LOSSES = [
    ("clip", {"policy_loss": "clip"}),
    ("dual_clip", {"policy_loss": "clip", "dual_clip_c": 3.0}),
    ("gspo", {"policy_loss": "gspo"}),
    ("cispo", {"policy_loss": "cispo"}),
    ("sapo", {"policy_loss": "sapo", "sapo_tau_pos": 1.0, "sapo_tau_neg": 1.05}),
    ("reinforce", {"policy_loss": "reinforce"}),
]


def random_inputs(n: int = 6, t: int = 5, seed: int = 0, spread: float = 0.6):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, t, generator=g, dtype=D) * 3 - 0.05
    old = logp + (torch.rand(n, t, generator=g, dtype=D) - 0.5) * 2 * spread
    ref = logp + (torch.rand(n, t, generator=g, dtype=D) - 0.5)
    adv = torch.randn(n, generator=g, dtype=D)
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    mask[-1] = False  # one sample with no valid step (must not count in seq-mean modes)
    ent = torch.rand(n, t, generator=g, dtype=D)
    return logp, old, ref, adv, mask, ent


# ---- plain-loop references -------------------------------------------------------------------
def clipf(x, lo, hi):
    return min(max(x, lo), hi)


def ref_step_loss(name, lp, lo_, a):
    """Per-step loss of token-level losses; lp is a 0-d tensor carrying grad, the rest floats."""
    r = torch.exp(lp - lo_)
    if name in ("clip", "dual_clip"):
        rv = float(r.detach())
        clipped_val = clipf(rv, 1 - EPS_LO, 1 + EPS_HI)
        unclipped = r * a
        clipped = (r * 0 + clipped_val) * a if clipped_val != rv else r * a
        obj = unclipped if float(unclipped.detach()) <= float(clipped.detach()) else clipped
        loss = -obj
        if name == "dual_clip" and a < 0 and float(loss.detach()) > -3.0 * a:
            loss = lp * 0 - 3.0 * a
        return loss
    if name == "cispo":
        w = clipf(float(r.detach()), 1 - EPS_LO, 1 + EPS_HI)
        return -w * a * lp
    if name == "sapo":
        tau = 1.0 if a > 0 else 1.05
        return -(4.0 / tau) * torch.sigmoid(tau * (r - 1)) * a
    if name == "reinforce":
        return -a * lp
    raise AssertionError(name)


def ref_objective(name, agg, logp, old, ref, adv, mask, ent, kl_est, kl_coeff, ent_coeff):
    """Loop over samples and steps; returns a scalar that autograd differentiates w.r.t. logp."""
    n, t = logp.shape
    seqs = [i for i in range(n) if any(bool(mask[i, j]) for j in range(t))]
    tokens = sum(int(mask[i, j]) for i in range(n) for j in range(t))
    total = logp.sum() * 0
    for i in seqs:
        a = float(adv[i])
        valid = [j for j in range(t) if mask[i, j]]
        ni = len(valid)
        seq_sum = logp.sum() * 0
        if name == "gspo":
            s = torch.exp(sum(logp[i, j] - old[i, j] for j in valid) / ni)
            sv = float(s.detach())
            cv = clipf(sv, 1 - EPS_LO, 1 + EPS_HI)
            obj = min(sv * a, cv * a)
            seq_loss = -(s * a) if obj == sv * a else -(s * 0 + cv * a)
            seq_sum = seq_sum + ni * seq_loss  # the sequence loss on each of its n_i steps
        for j in valid:
            step = logp[i, j] * 0
            if name != "gspo":
                step = step + ref_step_loss(name, logp[i, j], float(old[i, j]), a)
            d = float(ref[i, j]) - logp[i, j]
            k = {"k1": -d, "k2": d * d / 2, "k3": torch.exp(d) - d - 1}[kl_est]
            step = step + kl_coeff * k - ent_coeff * float(ent[i, j])
            seq_sum = seq_sum + step
        if agg == "token-mean":
            total = total + seq_sum / tokens
        elif agg == "seq-mean-token-mean":
            total = total + seq_sum / ni / len(seqs)
        elif agg == "seq-mean-token-sum":
            total = total + seq_sum / len(seqs)
        else:
            total = total + seq_sum / (len(seqs) * C_NORM)
    return total


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize(("name", "kw"), LOSSES)
def test_objective_matches_loop(name, kw, agg):
    for seed, kl_est in ((0, "k3"), (1, "k1"), (2, "k2")):
        logp, old, ref, adv, mask, ent = random_inputs(seed=seed)
        obj = GRPOObjective(
            clip_epsilon=EPS_LO, clip_epsilon_high=EPS_HI, kl_coeff=0.1, kl_estimator=kl_est,
            entropy_coeff=0.01, aggregation=agg, loss_normaliser=C_NORM, **kw,
        )  # fmt: skip
        x = logp.clone().requires_grad_(True)
        out = obj(x, old, adv, mask, obj.normaliser(mask), logp_ref=ref, entropy=ent)
        (g,) = torch.autograd.grad(out.loss, x)
        y = logp.clone().requires_grad_(True)
        expected = ref_objective(name, agg, y, old, ref, adv, mask, ent, kl_est, 0.1, 0.01)
        (g_ref,) = torch.autograd.grad(expected, y)
        assert torch.allclose(out.loss, expected, atol=1e-12, rtol=1e-10), (name, agg, kl_est)
        assert torch.allclose(g, g_ref, atol=1e-12, rtol=1e-10), (name, agg, kl_est)


def test_cispo_keeps_gradient_on_clipped_tokens_and_clip_loses_it():
    logp = torch.tensor([[-1.0, -1.0]], dtype=D, requires_grad=True)
    old = torch.tensor([[-2.0, -1.0]], dtype=D)  # ratio e ~ 2.72 (clipped) and 1
    adv = torch.tensor([1.0], dtype=D)
    (g_cispo,) = torch.autograd.grad(cispo_loss(logp, old, adv, eps_high=0.28).loss.sum(), logp)
    assert torch.allclose(g_cispo, torch.tensor([[-1.28, -1.0]], dtype=D))
    (g_clip,) = torch.autograd.grad(clip_loss(logp, old, adv, eps_high=0.28).loss.sum(), logp)
    assert torch.allclose(g_clip, torch.tensor([[0.0, -1.0]], dtype=D))


def test_dual_clip_caps_negative_advantage_loss():
    logp = torch.tensor([[0.0]], dtype=D)
    old = torch.tensor([[-3.0]], dtype=D)  # ratio e^3 ~ 20
    out = clip_loss(logp, old, torch.tensor([-1.0], dtype=D), dual_clip_c=3.0)
    assert float(out.loss) == pytest.approx(3.0)  # min(20.09, 3)
    assert float(clip_loss(logp, old, torch.tensor([-1.0], dtype=D)).loss) == pytest.approx(math.exp(3))


def test_gspo_ratio_is_geometric_mean_of_valid_token_ratios():
    logp = torch.tensor([[-1.0, -2.0, -9.0]], dtype=D)
    old = torch.tensor([[-1.5, -1.9, 0.0]], dtype=D)
    mask = torch.tensor([[True, True, False]])
    out = gspo_loss(logp, old, torch.tensor([1.0], dtype=D), mask)
    expected = math.exp(((-1.0 + 1.5) + (-2.0 + 1.9)) / 2)
    assert torch.allclose(out.ratio, torch.full((1, 3), expected, dtype=D))


def test_sapo_gate_matches_paper_formula_and_is_plain_pg_on_policy():
    r = torch.tensor([[0.5, 1.0, 1.7]], dtype=D)
    logp = torch.log(r).requires_grad_(True)
    old = torch.zeros(1, 3, dtype=D)
    for a, tau in ((1.0, 1.0), (-1.0, 1.05)):
        out = sapo_loss(logp, old, torch.tensor([a], dtype=D), tau_pos=1.0, tau_neg=1.05)
        expected = -(4 / tau) * torch.sigmoid(tau * (r - 1)) * a
        assert torch.allclose(out.loss, expected)
        (g,) = torch.autograd.grad(out.loss.sum(), logp)
        assert float(g[0, 1]) == pytest.approx(-a)  # df/dr = 4 s (1 - s) = 1 at r = 1


# ---- micro-batch invariance ------------------------------------------------------------------
@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize(("name", "kw"), LOSSES)
def test_gradient_independent_of_minibatch_split(name, kw, agg):
    g = torch.Generator().manual_seed(3)
    n, t, f = 16, 9, 4
    feats = torch.randn(n, t, f, generator=g, dtype=D)
    w0 = torch.randn(f, generator=g, dtype=D) * 0.3
    old = -torch.nn.functional.softplus(feats @ w0) + 0.3 * torch.randn(n, t, generator=g, dtype=D)
    ref = old + 0.2 * torch.randn(n, t, generator=g, dtype=D)
    adv = torch.randn(n, generator=g, dtype=D)
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    obj = GRPOObjective(kl_coeff=0.05, entropy_coeff=0.01, aggregation=agg, loss_normaliser=C_NORM, **kw)
    z = obj.normaliser(mask)  # over the whole optimizer step

    def grad(rows):
        w = w0.clone().requires_grad_(True)
        logp = -torch.nn.functional.softplus(feats[rows] @ w)
        out = obj(logp, old[rows], adv[rows], mask[rows], z, logp_ref=ref[rows])
        return torch.autograd.grad(out.loss, w)[0]

    full = grad(torch.arange(n))
    accumulated = sum(grad(torch.arange(k, k + 4)) for k in range(0, n, 4))
    assert torch.allclose(full, accumulated, atol=1e-6, rtol=0)
    assert full.abs().sum() > 0


# ---- properties -----------------------------------------------------------------------------
finite = st.floats(-5.0, 0.0, allow_nan=False)


@st.composite
def batches(draw):
    n = draw(st.integers(1, 4))
    t = draw(st.integers(1, 4))
    vals = draw(st.lists(finite, min_size=3 * n * t, max_size=3 * n * t))
    x = torch.tensor(vals, dtype=D).reshape(3, n, t)
    adv = torch.tensor(draw(st.lists(st.floats(-10, 10), min_size=n, max_size=n)), dtype=D)
    bits = draw(st.lists(st.booleans(), min_size=n * t, max_size=n * t))
    mask = torch.tensor(bits).reshape(n, t)
    return x[0], x[1], x[2], adv, mask


@settings(max_examples=40, deadline=None, derandomize=True)
@given(batches(), st.sampled_from(LOSSES), st.sampled_from(AGGREGATIONS))
def test_property_finite_and_zero_advantage_gives_zero_policy_gradient(b, loss, agg):
    logp, old, ref, adv, mask = b
    obj = GRPOObjective(kl_coeff=0.1, aggregation=agg, loss_normaliser=3.0, **loss[1])
    x = logp.clone().requires_grad_(True)
    out = obj(x, old, adv, mask, obj.normaliser(mask), logp_ref=ref)
    (g,) = torch.autograd.grad(out.loss, x)
    assert torch.isfinite(out.loss)
    assert torch.isfinite(g).all()
    pol = GRPOObjective(aggregation=agg, loss_normaliser=3.0, **loss[1])
    x = logp.clone().requires_grad_(True)
    out0 = pol(x, old, torch.zeros_like(adv), mask, pol.normaliser(mask))
    (g0,) = torch.autograd.grad(out0.loss, x)
    assert torch.equal(g0, torch.zeros_like(g0))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(batches(), st.sampled_from(LOSSES), st.sampled_from(AGGREGATIONS))
def test_property_ratio_one_gives_closed_form(b, loss, agg):
    logp, _, _, adv, mask = b
    name, kw = loss
    obj = GRPOObjective(aggregation=agg, loss_normaliser=3.0, **kw)
    out = obj(logp, logp.clone(), adv, mask, obj.normaliser(mask))
    n_i = mask.sum(-1).to(D)
    has = n_i > 0
    # per-sample sum over valid steps of the per-step loss at ratio 1
    if name in ("clip", "dual_clip", "gspo"):
        per_sample_sum = -adv * n_i
    elif name == "sapo":
        tau = torch.full_like(adv, 1.05).masked_fill(adv > 0, 1.0)
        per_sample_sum = -(2.0 / tau) * adv * n_i
    else:  # cispo, reinforce: -A logp
        per_sample_sum = -adv * torch.where(mask, logp, 0.0).sum(-1)
    s = max(int(has.sum()), 1)
    expected = {
        "token-mean": per_sample_sum.sum() / max(float(n_i.sum()), 1.0),
        "seq-mean-token-mean": (per_sample_sum[has] / n_i[has]).sum() / s,
        "seq-mean-token-sum": per_sample_sum.sum() / s,
        "seq-mean-token-sum-norm": per_sample_sum.sum() / (s * 3.0),
    }[agg]
    assert float(out.loss) == pytest.approx(float(expected), abs=1e-9, rel=1e-9)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("seed", [0, 1])
def test_kl_estimators_match_closed_form_kl_of_categoricals(estimator, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(6, generator=g, dtype=D) * 0.5, 0)  # the policy (sampled)
    q = torch.softmax(torch.randn(6, generator=g, dtype=D) * 0.5, 0)  # the reference
    kl_pq = float((p * (p / q).log()).sum())
    a = torch.multinomial(p, 200_000, replacement=True, generator=g)
    est = kl_estimate(p.log()[a], q.log()[a], estimator)
    mean, se = float(est.mean()), float(est.std()) / math.sqrt(est.numel())
    if estimator == "k2":  # biased: E[k2] = E_p[(log p/q)^2] / 2, equal to KL to second order
        target = float((p * (p / q).log() ** 2).sum()) / 2
        assert abs(target - kl_pq) < 0.1 * kl_pq
    else:
        target = kl_pq
    assert abs(mean - target) < 3 * se, (estimator, mean, target, se)
    if estimator == "k3":  # the reversed-ratio k3 some trainers ship is measurably biased here
        d = q.log()[a] - p.log()[a]
        reversed_k3 = torch.exp(-d) + d - 1
        assert abs(float(reversed_k3.mean()) - kl_pq) > 3 * float(reversed_k3.std()) / math.sqrt(a.numel())


def test_kl_return_to_go_loop():
    g = torch.Generator().manual_seed(0)
    pen = torch.rand(3, 5, generator=g, dtype=D)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    out = kl_return_to_go(pen, mask)
    for i in range(3):
        for t in range(5):
            assert float(out[i, t]) == pytest.approx(sum(float(pen[i, u]) for u in range(t, 5) if mask[i, u]))


_SHIFT = torch.tensor([[0.5, -0.5, 0.6], [-0.7, 0.5, -0.5], [0.5, 0.8, -0.5], [-0.5, 0.5, 0.5]], dtype=D)


# ---- gradcheck ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fn",
    [
        lambda lp, old, a, m: clip_loss(lp, old, a, m, eps_low=0.2, eps_high=0.28).loss,
        lambda lp, old, a, m: clip_loss(lp, old, a, m, dual_clip_c=3.0).loss,
        lambda lp, old, a, m: gspo_loss(lp, old, a, m, eps_low=0.2, eps_high=0.28).loss,
        # CISPO's weight is a stop-gradient: finite differences see it move unless it is clipped,
        # so the check runs where every ratio is outside [0.9, 1.1] (old shifted by +-0.5 below).
        lambda lp, old, a, m: cispo_loss(lp, lp.detach() + _SHIFT, a, m, eps_low=0.1, eps_high=0.1).loss,
        lambda lp, old, a, m: sapo_loss(lp, old, a, m).loss,
        lambda lp, old, a, m: reinforce_loss(lp, old, a, m).loss,
        lambda lp, old, a, m: kl_estimate(lp, old, "k1"),
        lambda lp, old, a, m: kl_estimate(lp, old, "k2"),
        lambda lp, old, a, m: kl_estimate(lp, old, "k3"),
    ],
    ids=["clip", "dual_clip", "gspo", "cispo", "sapo", "reinforce", "k1", "k2", "k3"],
)
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_gradcheck(fn, agg):
    logp, old, _, adv, mask, _ = random_inputs(n=4, t=3, seed=5, spread=0.15)
    z = aggregation_normaliser(mask, agg, constant=2.0)

    def f(lp):
        return aggregate(fn(lp, old, adv, mask), mask, agg, z)

    assert torch.autograd.gradcheck(f, (logp.clone().requires_grad_(True),))


def test_entropy_mc_estimate_value_and_gradient():
    from grpo.grpo_objective import entropy_bonus

    lp = torch.tensor([[-0.5, -2.0]], dtype=D, requires_grad=True)
    h = entropy_bonus(lp)
    assert torch.allclose(h, torch.tensor([[0.5, 2.0]], dtype=D))
    (g,) = torch.autograd.grad(h.sum(), lp)
    assert torch.allclose(g, -lp.detach())  # score-function estimate: -logp * grad logp


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="loss_normaliser"):
        GRPOObjective(aggregation="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="policy_loss must be one of"):
        GRPOObjective(policy_loss="ppo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dual_clip_c must be > 1"):
        GRPOObjective(dual_clip_c=0.5)
    obj = GRPOObjective(loss_fn=lambda lp, old, a, m: lp.sum())
    x = torch.zeros(2, 3, requires_grad=True)
    with pytest.raises(ValueError, match=r"loss_fn returned \(\); expected a per-step loss"):
        obj(x, x.detach(), torch.zeros(2), torch.ones(2, 3, dtype=torch.bool), 1.0)


# ---- the "clip" twin (grpo.algorithms.clip_twin) against the composed path ----------------------
def _composed(**kw):
    """The same objective on the composed (autograd) path: the twin turned off."""
    return GRPOObjective(clip_twin=False, **kw)


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("kl_est", ["k1", "k2", "k3"])
@pytest.mark.parametrize(
    ("entropy_kind", "kl_coeff", "with_ref", "dual"),
    [
        ("mc", 0.1, True, None),  # Monte Carlo entropy estimate: its gradient -logp grad(logp)
        ("exact_grad", 0.1, True, 3.0),  # exact entropy that carries gradient of its own
        ("exact_const", 0.0, True, None),  # KL for metrics only, no KL term
        ("mc", 0.1, False, 3.0),  # no reference
    ],
)
def test_clip_twin_equals_composed_path(agg, kl_est, entropy_kind, kl_coeff, with_ref, dual):
    logp, old, ref, adv, mask, ent = random_inputs(seed=3, spread=1.5)
    old[0, 0] = logp[0, 0] - 30.0  # a log-ratio beyond the clamp (20): no gradient through it
    kw = {
        "clip_epsilon": EPS_LO, "clip_epsilon_high": EPS_HI, "kl_coeff": kl_coeff, "kl_estimator": kl_est,
        "entropy_coeff": 0.01, "aggregation": agg, "loss_normaliser": C_NORM, "dual_clip_c": dual,
    }  # fmt: skip
    results = []
    for obj in (GRPOObjective(**kw), _composed(**kw)):
        x = logp.clone().requires_grad_(True)
        h = ent.clone().requires_grad_(entropy_kind == "exact_grad")
        out = obj(
            x, old, adv, mask, obj.normaliser(mask),
            logp_ref=ref if with_ref else None, entropy=None if entropy_kind == "mc" else h,
        )  # fmt: skip
        inputs = [x, h] if entropy_kind == "exact_grad" else [x]
        grads = torch.autograd.grad(out.loss, inputs)
        results.append((out, grads))
    (twin, g_twin), (composed, g_composed) = results
    torch.testing.assert_close(twin.loss, composed.loss, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(twin.stats, composed.stats, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(twin.extremes, composed.extremes, atol=0, rtol=0)
    for a, b in zip(g_twin, g_composed, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    assert float(g_twin[0][0, 0]) == pytest.approx(
        float(
            (kl_coeff * _kl_grad(kl_est, logp, ref)[0, 0] if with_ref else 0.0)
            + _ent_grad(entropy_kind, logp)[0, 0]
        )
        * float(_weight(agg, mask)[0, 0]),
        abs=1e-12,
    )


def _kl_grad(est, logp, ref):
    d = ref - logp
    return {"k1": torch.ones_like(d), "k2": -d, "k3": 1 - torch.exp(d)}[est]


def _ent_grad(kind, logp):
    return 0.01 * logp if kind == "mc" else torch.zeros_like(logp)


def _weight(agg, mask):
    m = mask.to(D)
    seqs = float(mask.any(-1).sum())
    if agg == "token-mean":
        return m / m.sum()
    if agg == "seq-mean-token-mean":
        return m / m.sum(-1, keepdim=True).clamp(min=1) / seqs
    return m / seqs / (C_NORM if agg == "seq-mean-token-sum-norm" else 1.0)


def test_entropy_estimate_gradient_in_the_objective_is_minus_logp_times_coefficient():
    """MC entropy bonus alone: d loss / d logp = +c_H logp / Z on valid steps (loss = -c_H H)."""
    logp = torch.tensor([[-0.5, -2.0], [-1.0, -3.0]], dtype=D, requires_grad=True)
    mask = torch.tensor([[True, True], [True, False]])
    obj = GRPOObjective(entropy_coeff=0.5)
    out = obj(logp, logp.detach(), torch.zeros(2, dtype=D), mask, 3.0)
    (g,) = torch.autograd.grad(out.loss, logp)
    want = torch.tensor([[-0.25, -1.0], [-0.5, 0.0]], dtype=D) / 3.0
    torch.testing.assert_close(g, want, atol=1e-15, rtol=0)
    assert float(out.loss.detach()) == pytest.approx(-0.5 * (0.5 + 2.0 + 1.0) / 3.0)  # -c_H * mean(-logp)
    assert float(out.entropy) == pytest.approx((0.5 + 2.0 + 1.0) / 3.0)


def test_large_inputs_take_the_dot_product_statistics_and_agree() -> None:
    """Above `STACK_LIMIT` elements the statistics are per-row dot products, not one matrix product:
    same stats, extremes, loss and gradient as the composed path."""
    from grpo.algorithms.objective_statistics import STACK_LIMIT

    n, t = 300, 128
    assert n * t > STACK_LIMIT
    logp, old, ref, adv, mask, _ = random_inputs(n=n, t=t, seed=5, spread=1.0)
    kw = {"clip_epsilon": EPS_LO, "clip_epsilon_high": EPS_HI, "kl_coeff": 0.1, "entropy_coeff": 0.01}
    results = []
    for obj in (GRPOObjective(**kw), _composed(**kw)):
        x = logp.clone().requires_grad_(True)
        out = obj(x, old, adv, mask, obj.normaliser(mask), logp_ref=ref)
        results.append((out, torch.autograd.grad(out.loss, x)[0]))
    (twin, g_twin), (composed, g_composed) = results
    torch.testing.assert_close(twin.stats, composed.stats, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(twin.extremes, composed.extremes, atol=0, rtol=0)
    torch.testing.assert_close(g_twin, g_composed, atol=1e-12, rtol=1e-10)
    m = mask.to(D)
    ratio = torch.exp(logp - old)
    assert float(twin.sums["steps"]) == float(m.sum())
    assert float(twin.sums["ratio"]) == pytest.approx(float((ratio * m).sum()), rel=1e-12)
    assert float(twin.sums["ratio_max"]) == pytest.approx(float(ratio[mask].max()), rel=1e-12)
    assert float(twin.sums["ratio_min"]) == pytest.approx(float(ratio[mask].min()), rel=1e-12)


@pytest.mark.parametrize(("n", "t"), [(6, 5), (300, 128)])  # small and large statistics paths
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_non_contiguous_inputs_give_the_same_result(n, t, agg):
    """Log-probs and masks sliced or transposed out of bigger tensors (as an LLM policy may return
    them) give exactly what their contiguous copies give."""
    logp, old, ref, adv, mask, ent = random_inputs(n=n, t=t, seed=7)
    obj = GRPOObjective(kl_coeff=0.1, entropy_coeff=0.01, aggregation=agg)

    def run(transform):
        x = transform(logp).requires_grad_(True)
        m = transform(mask)
        out = obj(
            x, transform(old), adv, m, obj.normaliser(m), logp_ref=transform(ref), entropy=transform(ent)
        )
        return out, torch.autograd.grad(out.loss, x)[0]

    strided, g_strided = run(lambda a: a.T.contiguous().T)  # same values, column-major strides
    plain, g_plain = run(lambda a: a.clone())
    torch.testing.assert_close(strided.stats, plain.stats, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(strided.extremes, plain.extremes, atol=0, rtol=0)
    torch.testing.assert_close(g_strided, g_plain, atol=1e-15, rtol=1e-12)


@pytest.mark.parametrize(("n", "t"), [(6, 5), (300, 128)])  # small and large statistics paths
@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize(
    ("kl_est", "entropy_kind", "dual", "dtype"),
    [
        ("k3", "exact_grad", None, torch.float64),
        ("k1", "mc", 3.0, torch.float64),
        ("k2", "exact_const", None, torch.float32),
    ],
)
def test_on_policy_shortcut_is_bitwise_the_general_path(n, t, agg, kl_est, entropy_kind, dual, dtype):
    """``on_policy=True`` (the trainer's first optimizer step, old = logp.detach()) skips the ratio
    work; loss, statistics, extremes and gradients are exactly those of the general path."""
    logp, _old, ref, adv, mask, ent = (
        x.to(dtype) if x.is_floating_point() else x for x in random_inputs(n, t, 11)
    )
    obj = GRPOObjective(
        kl_coeff=0.1, kl_estimator=kl_est, entropy_coeff=0.01, aggregation=agg, loss_normaliser=C_NORM,
        dual_clip_c=dual,
    )  # fmt: skip
    outs = []
    for shortcut in (True, False):
        x = logp.clone().requires_grad_(True)
        h = ent.clone().requires_grad_(entropy_kind == "exact_grad")
        out = obj(
            x, x.detach(), adv.float(), mask, obj.normaliser(mask), logp_ref=ref,
            entropy=None if entropy_kind == "mc" else h, on_policy=shortcut,
        )  # fmt: skip
        inputs = [x, h] if entropy_kind == "exact_grad" else [x]
        outs.append((out, torch.autograd.grad(out.loss, inputs)))
    (fast, g_fast), (slow, g_slow) = outs
    assert torch.equal(fast.loss, slow.loss)
    assert torch.equal(fast.stats, slow.stats)
    assert torch.equal(fast.extremes, slow.extremes)
    for a, b in zip(g_fast, g_slow, strict=True):
        assert torch.equal(a, b)
    assert float(fast.sums["ratio_max"]) == 1.0
    assert float(fast.sums["clip_low"]) == float(fast.sums["clip_high"]) == 0.0


# ---- importance weights of a sampler/trainer mismatch (GRPOConfig.sampler_is_cap) ---------------
@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("on_policy", [False, True])
def test_is_weights_scale_the_policy_term_only(agg, on_policy):
    logp, old, ref, adv, mask, _ent = random_inputs(seed=13, spread=1.0)
    if on_policy:
        old = logp.clone()
    w_is = torch.rand(logp.shape, generator=torch.Generator().manual_seed(1), dtype=D) * 2
    kw = {"clip_epsilon": EPS_LO, "clip_epsilon_high": EPS_HI, "kl_coeff": 0.1, "entropy_coeff": 0.01,
          "aggregation": agg, "loss_normaliser": C_NORM}  # fmt: skip
    results = []
    for obj in (GRPOObjective(**kw), _composed(**kw)):
        x = logp.clone().requires_grad_(True)
        out = obj(x, old, adv, mask, obj.normaliser(mask), logp_ref=ref, is_weights=w_is, on_policy=on_policy)
        results.append((out, torch.autograd.grad(out.loss, x)[0]))
        ones = obj(x, old, adv, mask, obj.normaliser(mask), logp_ref=ref, is_weights=torch.ones_like(w_is),
                   on_policy=on_policy)  # fmt: skip
        plain = obj(x, old, adv, mask, obj.normaliser(mask), logp_ref=ref, on_policy=on_policy)
        assert torch.equal(ones.loss, plain.loss)  # weights of 1 change nothing
        assert torch.equal(ones.stats, plain.stats)
    (twin, g_twin), (composed, g_composed) = results
    torch.testing.assert_close(twin.loss, composed.loss, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(twin.stats, composed.stats, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(g_twin, g_composed, atol=1e-12, rtol=1e-10)
    # by hand: weighted policy term + unweighted KL and entropy estimate, aggregated
    r = torch.exp((logp - old).clamp(-20, 20))
    a = adv[:, None]
    pg = -torch.minimum(r * a, r.clamp(1 - EPS_LO, 1 + EPS_HI) * a)
    d = ref - logp
    per_step = w_is * pg + 0.1 * (torch.exp(d) - d - 1) - 0.01 * -logp
    expected = (per_step * _weight(agg, mask)).sum()
    assert float(twin.loss.detach()) == pytest.approx(float(expected), rel=1e-10, abs=1e-12)


# ---- a log-ratio clamp tighter than the clip bounds (regression: the twin ignored it) ------
def test_binding_log_ratio_clamp_twin_value_and_gradient_are_the_documented_ones():
    """logp = -1.0, logp_old = -1.15, A = 1, eps = 0.2, c = 0.1: the log-ratio 0.15 is clamped to
    0.1 before the clip (docs/algorithms.md), so the loss is -exp(0.1) with zero gradient."""
    logp = torch.tensor([[-1.0]], dtype=D, requires_grad=True)
    old = torch.tensor([[-1.15]], dtype=D)
    mask = torch.ones(1, 1, dtype=torch.bool)
    for obj in (
        GRPOObjective(clip_epsilon=0.2, log_ratio_clamp=0.1),
        _composed(clip_epsilon=0.2, clip_epsilon_high=0.2, log_ratio_clamp=0.1),
    ):
        out = obj(logp, old, torch.ones(1, dtype=D), mask, 1.0)
        (grad,) = torch.autograd.grad(out.loss, [logp])
        assert float(out.loss.detach()) == pytest.approx(-math.exp(0.1), abs=1e-12)
        assert float(grad) == 0.0
    # A < 0 with the ratio below the clip: the clamp at -c binds before 1 - eps_low
    out = GRPOObjective(clip_epsilon=0.2, log_ratio_clamp=0.1)(
        logp, torch.tensor([[-0.7]], dtype=D), -torch.ones(1, dtype=D), mask, 1.0
    )
    (grad,) = torch.autograd.grad(out.loss, [logp])
    assert float(out.loss.detach()) == pytest.approx(math.exp(-0.1), abs=1e-12)
    assert float(grad) == 0.0


@pytest.mark.parametrize("clamp", [0.02, 0.1, 0.15, 0.25])
@pytest.mark.parametrize("dual", [None, 1.1, 3.0])
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_clip_twin_equals_composed_and_loop_with_a_binding_log_ratio_clamp(clamp, dual, agg):
    logp, old, ref, adv, mask, _ = random_inputs(seed=11, spread=0.4)
    kw = {
        "clip_epsilon": EPS_LO, "clip_epsilon_high": EPS_HI, "kl_coeff": 0.05, "kl_estimator": "k3",
        "aggregation": agg, "loss_normaliser": C_NORM, "dual_clip_c": dual, "log_ratio_clamp": clamp,
    }  # fmt: skip
    results = []
    for obj in (GRPOObjective(**kw), _composed(**kw)):
        x = logp.clone().requires_grad_(True)
        out = obj(x, old, adv, mask, obj.normaliser(mask), logp_ref=ref)
        results.append((out, torch.autograd.grad(out.loss, [x])[0]))
    (twin, g_twin), (composed, g_composed) = results
    torch.testing.assert_close(twin.loss, composed.loss, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(twin.stats, composed.stats, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(g_twin, g_composed, atol=1e-12, rtol=1e-10)
    # a plain loop over steps: l = -min(r A, clip(r) A), r = exp(clamp(logp - old, -c, c)), dual cap
    x = logp.clone().requires_grad_(True)
    z = float(GRPOObjective(**kw).normaliser(mask))
    total = torch.zeros((), dtype=D)
    for i in range(logp.shape[0]):
        n_i = max(int(mask[i].sum()), 1)
        for t in range(logp.shape[1]):
            if not mask[i, t]:
                continue
            r = torch.exp(torch.clamp(x[i, t] - old[i, t], -clamp, clamp))
            a = adv[i]
            pg = -torch.minimum(r * a, torch.clamp(r, 1 - EPS_LO, 1 + EPS_HI) * a)
            if dual is not None and a < 0:
                pg = torch.minimum(pg, -dual * a)
            d = torch.clamp(ref[i, t] - x[i, t], -clamp, clamp)
            step = pg + 0.05 * (torch.exp(d) - d - 1)
            w = 1.0 / n_i if agg == "seq-mean-token-mean" else 1.0
            total = total + w * step
    loop = total / z
    torch.testing.assert_close(twin.loss, loop, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(g_twin, torch.autograd.grad(loop, [x])[0], atol=1e-12, rtol=1e-10)


# ---- clip_epsilon = 1: no lower bound (issue 24: the twin raised "math domain error") -------
def test_clip_epsilon_one_hand_values_no_lower_bound() -> None:
    """logp = -1, logp_old = 0, A = -1: rho = e^-1. eps_low = 1 gives l = -A rho = e^-1 with
    gradient e^-1 (the ratio is kept at any value); eps_low = 0.5 clips it at 0.5, gradient 0."""
    logp = torch.tensor([[-1.0]], dtype=D, requires_grad=True)
    old, adv, mask = torch.zeros(1, 1, dtype=D), -torch.ones(1, dtype=D), torch.ones(1, 1, dtype=torch.bool)
    for eps_low, value, grad in ((1.0, math.exp(-1.0), math.exp(-1.0)), (0.5, 0.5, 0.0)):
        for obj in (
            GRPOObjective(clip_epsilon=eps_low, clip_epsilon_high=0.2),
            _composed(clip_epsilon=eps_low, clip_epsilon_high=0.2),
        ):
            out = obj(logp, old, adv, mask, 1.0)
            (g,) = torch.autograd.grad(out.loss, [logp])
            assert float(out.loss.detach()) == pytest.approx(value, abs=1e-12)
            assert float(g) == pytest.approx(grad, abs=1e-12)
            assert float(out.sums["clip_low"]) == (0.0 if eps_low == 1.0 else 1.0)


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("eps_high", [EPS_HI, 1e9], ids=["eps_high=0.28", "eps_high=1e9"])
@pytest.mark.parametrize("dual", [None, 3.0], ids=["no_dual", "dual=3"])
def test_clip_epsilon_one_equals_the_formula_without_lower_bound(agg, eps_high, dual):
    """Twin and composed paths vs a plain loop of l = -min(rho A, clip(rho, 0, 1 + eps_high) A)
    (capped at -c A for A < 0 with the dual clip), loss and gradient, off-policy ratios far below 1."""
    logp, old, _, adv, mask, _ = random_inputs(seed=7, spread=3.0)
    rho = torch.exp(logp - old)
    assert bool(((rho < 0.2) & (adv[:, None] < 0) & mask).any())  # where any eps_low < 0.8 would clip
    kw = {
        "clip_epsilon": 1.0, "clip_epsilon_high": eps_high, "aggregation": agg, "loss_normaliser": C_NORM,
        "dual_clip_c": dual,
    }  # fmt: skip
    x = logp.clone().requires_grad_(True)
    total = torch.zeros((), dtype=D)
    for i in range(logp.shape[0]):
        n_i = max(int(mask[i].sum()), 1)
        for t in range(logp.shape[1]):
            if mask[i, t]:
                r, a = torch.exp(x[i, t] - old[i, t]), adv[i]
                step = -torch.minimum(r * a, torch.clamp(r, 0.0, 1.0 + eps_high) * a)
                if dual is not None and a < 0:
                    step = torch.minimum(step, -dual * a)
                total = total + step / (n_i if agg == "seq-mean-token-mean" else 1)
    loop = total / float(GRPOObjective(**kw).normaliser(mask))
    (g_loop,) = torch.autograd.grad(loop, [x])
    for obj in (GRPOObjective(**kw), _composed(**kw)):
        y = logp.clone().requires_grad_(True)
        out = obj(y, old, adv, mask, obj.normaliser(mask))
        (g,) = torch.autograd.grad(out.loss, [y])
        torch.testing.assert_close(out.loss, loop, atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(g, g_loop, atol=1e-12, rtol=1e-10)
        assert float(out.sums["clip_low"]) == 0.0
