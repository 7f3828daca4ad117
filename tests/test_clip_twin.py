"""The "clip" twin (`grpo.algorithms.clip_twin.clip_objective_twin`) equals the readable composed
path (`GRPOObjective.composed`) on random cases: values, statistics and gradients, float64.

The cases cover the edge settings: rows with no valid step (and batches with none at all), a
single token, a single sample, clip-higher (eps_low != eps_high), eps_low = 1 (no lower bound),
the dual clip, a binding log-ratio clamp, KL on / off / for metrics only / folded into the
advantages with each estimator, entropy off / estimated / exact with and without a gradient,
per-sample and per-step advantages, importance weights, the on-policy shortcut, every
aggregation, and micro-batching (the step's normaliser, micro-batch losses and gradients summed).
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo.algorithms.aggregation import AGGREGATIONS
from grpo.grpo_objective import GRPOObjective

D = torch.float64
ATOL, RTOL = 1e-12, 1e-10

SETTINGS = st.fixed_dictionaries(
    {
        "clip_epsilon": st.sampled_from([0.1, 0.2, 1.0]),
        "clip_epsilon_high": st.sampled_from([None, 0.28, 5.0]),
        "dual_clip_c": st.sampled_from([None, 1.5, 3.0]),
        "log_ratio_clamp": st.sampled_from([20.0, 0.3]),
        "kl_coeff": st.sampled_from([0.0, 0.05]),
        "kl_estimator": st.sampled_from(["k1", "k2", "k3"]),
        "kl_in_advantage": st.booleans(),
        "entropy_coeff": st.sampled_from([0.0, 0.01]),
        "aggregation": st.sampled_from(AGGREGATIONS),
        "loss_normaliser": st.just(7.0),  # the constant C of "seq-mean-token-sum-norm"
    }
)
CASES = st.fixed_dictionaries(
    {
        "seed": st.integers(0, 2**31 - 1),
        "n": st.integers(1, 6),
        "t": st.integers(1, 5),
        "empty_rows": st.integers(0, 6),  # rows with no valid step (all of them when >= n)
        "with_ref": st.booleans(),
        "entropy": st.sampled_from(["estimate", "exact", "exact_grad"]),
        "per_step_adv": st.booleans(),
        "is_weights": st.booleans(),
        "on_policy": st.booleans(),
        "micro_batches": st.integers(1, 3),
    }
)


def _inputs(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(case["seed"])
    n, t = case["n"], case["t"]
    logp = -torch.rand(n, t, generator=g, dtype=D) * 3 - 0.05
    old = logp.clone() if case["on_policy"] else logp + torch.randn(n, t, generator=g, dtype=D)
    adv_shape = (n, t) if case["per_step_adv"] else (n,)
    mask = torch.rand(n, t, generator=g) < 0.7
    mask[: case["empty_rows"]] = False
    return {
        "logp": logp,
        "old": old,
        "ref": logp + torch.randn(n, t, generator=g, dtype=D) * 0.5,
        "adv": torch.randn(adv_shape, generator=g, dtype=D),
        "mask": mask,
        "entropy": torch.rand(n, t, generator=g, dtype=D),
        "is_weights": torch.rand(n, t, generator=g, dtype=D) * 2,
    }


def _run(
    obj: GRPOObjective, case: dict[str, Any], x: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Loss, stats (summed), extremes (merged) and gradients over the case's micro-batches."""
    logp = x["logp"].clone().requires_grad_(True)
    ent = x["entropy"].clone().requires_grad_(case["entropy"] == "exact_grad")
    z = obj.normaliser(x["mask"])  # the whole optimizer step's normaliser
    loss = stats = extremes = None
    for rows in torch.arange(case["n"]).tensor_split(case["micro_batches"]):
        if len(rows) == 0:
            continue
        out = obj(
            logp[rows], x["old"][rows], x["adv"][rows], x["mask"][rows], z,
            logp_ref=x["ref"][rows] if case["with_ref"] else None,
            entropy=None if case["entropy"] == "estimate" else ent[rows],
            on_policy=case["on_policy"], is_weights=x["is_weights"][rows] if case["is_weights"] else None,
        )  # fmt: skip
        loss = out.loss if loss is None else loss + out.loss
        stats = out.stats if stats is None else stats + out.stats
        extremes = out.extremes if extremes is None else torch.maximum(extremes, out.extremes)
    assert loss is not None
    wrt = [logp, ent] if case["entropy"] == "exact_grad" else [logp]
    raw = torch.autograd.grad(loss, wrt, allow_unused=True)
    grads = [torch.zeros_like(w) if g is None else g for g, w in zip(raw, wrt, strict=True)]
    assert stats is not None
    assert extremes is not None
    return loss.detach(), stats, extremes, grads


@settings(max_examples=120, deadline=None)
@given(kw=SETTINGS, case=CASES)
def test_clip_twin_equals_the_composed_path_on_random_cases(kw: dict[str, Any], case: dict[str, Any]) -> None:
    twin, readable = GRPOObjective(**kw), GRPOObjective(clip_twin=False, **kw)
    assert twin.uses_clip_twin
    assert not readable.uses_clip_twin
    x = _inputs(case)
    loss_t, stats_t, ext_t, grads_t = _run(twin, case, x)
    loss_r, stats_r, ext_r, grads_r = _run(readable, case, x)
    torch.testing.assert_close(loss_t, loss_r, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(stats_t, stats_r, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(ext_t, ext_r, atol=ATOL, rtol=RTOL)
    for a, b in zip(grads_t, grads_r, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)
    # micro-batching changes nothing: the readable path on the whole batch at once
    if case["micro_batches"] > 1:
        loss_1, stats_1, _, grads_1 = _run(readable, {**case, "micro_batches": 1}, x)
        torch.testing.assert_close(loss_t, loss_1, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(stats_t, stats_1, atol=ATOL, rtol=RTOL)
        for a, b in zip(grads_t, grads_1, strict=True):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


def test_the_twin_runs_only_for_the_builtin_clip_loss() -> None:
    """`uses_clip_twin`: the built-in "clip" loss with the built-in KL and entropy terms; any other
    loss, a user loss_fn or kl_fn, or ``clip_twin=False`` runs `GRPOObjective.composed`."""
    assert GRPOObjective().uses_clip_twin
    assert GRPOObjective(dual_clip_c=3.0, kl_coeff=0.1, entropy_coeff=0.01).uses_clip_twin
    assert not GRPOObjective(clip_twin=False).uses_clip_twin
    for name in ("gspo", "cispo", "sapo", "reinforce"):
        assert not GRPOObjective(policy_loss=name).uses_clip_twin
    assert not GRPOObjective(loss_fn=lambda lp, old, a, m: -a[:, None] * lp).uses_clip_twin
    assert not GRPOObjective(kl_fn=lambda lp, ref: lp - ref).uses_clip_twin
