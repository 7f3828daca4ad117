"""PyTorch FSDP2 (`grpo.engine.fsdp`) on 2 CPU processes (gloo) against one process.

One module-scoped fixture runs the one-process references (`grpo.engine.backends.LocalBackend` on the
whole global batch) and spawns the 2 workers once (`tests.fsdp_toys.fsdp_worker`); the tests
read the results.

Tolerance: the FSDP run sums the same float32 terms in other orders (each rank's gradient is
reduce-scattered and added; the norm is summed from per-shard norms; other matmul shapes), so
gradients agree to a few float32 ulps (~1e-7 relative), not bitwise. Adam divides by
``sqrt(v) + eps``, which turns an ulp-level difference of a tiny gradient entry into a larger
relative difference of its update (bounded by ``lr`` per step), so the weights after 5 steps at
lr 1e-2 are compared with an absolute tolerance of 5e-6. Measured: 3.0e-8 (MLP, policy) and
7.0e-7 (tiny Qwen2); the weights move by ~0.03, 6,000x the tolerance. The weights cannot tell a
sum of the ranks' gradients from their average (every step is clipped, which divides by the
norm, and Adam is nearly scale-free too): the gradient norm before clipping (relative 1e-5;
measured 1e-7) does, and is checked on both ranks at every step (an average fails it by 2x).
The whole Adam moments are compared within 1e-8 (measured 6e-10).

Trainer level (`trainer_run`, `tests.fsdp_toys.trainer_worker`): ``GRPOTrainer(GRPOConfig(fsdp=True))``
on 2 processes, each stepping on its shard of every global batch, against ONE process without
FSDP on the whole batches (the data-parallel tests' policies, which sample by inverse CDF of the
given noise, so both layouts draw the same actions; the one process draws its mini-batches as the
ranks do, `tests.fsdp_toys.ShardedPlan`). Scenarios: ``bandit`` (categorical_mlp) and ``seq`` (a
user nn.Module, masked T-token actions) with 2 epochs x 2 mini-batches x 2 micro-batches per rank,
the KL term (frozen whole reference copy) and every step clipped, 5 steps; ``lm``, the tiny Qwen2
through `grpo.llm.CausalLMPolicy` (generation with ``synced_gpus``, chunked log-probs inside
`grpo.engine.fsdp.run_as_forward`), KL and clipping, 3 steps, the completions seeded per prompt.
Rewards are equal (the same samples) and the gradient norm before clipping within 1e-5 relative
at every step (measured <= 5e-6). The weights after the steps are compared within `TRAINER_ATOL`:
1e-5 (bandit, measured 1.8e-7), 5e-5 (lm, measured 4.8e-6: 5 of 20,480 entries above 1e-6, the
99th percentile 3e-8) and 1e-3 (seq, measured 9.9e-5). The seq figure is not FSDP's: data
parallelism without FSDP gives the same 9.9e-5 against one process. It is AdamW's first step,
``lr * g / (|g| + eps)``, on a gradient entry that is 0 in exact arithmetic (GRPO's advantages
sum to 0 in a group: a logit whose token every sample of a group chose gets a rounding-noise
gradient, here 3.6e-11): two summation orders give two noise values and the entry moves
``0.05 * 3.6e-11 / 1e-8 = 1.8e-4`` in the first optimizer step in one run and not in the other;
the other entries agree to 1e-7. Checkpoints: saved under FSDP after 3 steps (rank 0 writes the
gathered weights and optimizer state), loaded into fresh FSDP trainers, 2 more steps equal the
uninterrupted 5 bitwise; the same checkpoint continues on one process (within the bandit
tolerance) and a one-process checkpoint continues under FSDP.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor

from grpo.engine.backends import LocalBackend
from grpo.engine.fsdp import default_units, shard_policy
from grpo.engine.optim import default_optimizer
from tests.distributed_toys import launch, params, run_steps
from tests.fsdp_toys import (
    CKPT_AT,
    KINDS,
    LM_PROMPTS,
    LM_STEPS,
    LR,
    MAX_NORM,
    STEPS,
    TRAINER_SCENARIOS,
    WORLD,
    build_lm_trainer,
    build_trainer,
    fsdp_worker,
    lm_steps,
    mlp,
    reference,
    scheduler,
    tiny_lm,
    trainer_data,
    trainer_worker,
    write_tiny_lm,
)

ATOL = 5e-6  # weights after 5 Adam steps, FSDP vs one process (see the module docstring)
STATE_ATOL = 1e-8  # Adam moments (measured 6e-10)
#: GRPOTrainer(fsdp=True) on 2 processes vs one process, weights after the steps (module docstring)
TRAINER_ATOL = {"bandit": 1e-5, "seq": 1e-3, "lm": 5e-5}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("fsdp")
    lm = tiny_lm()
    ref = {kind: reference(kind, lm) for kind in KINDS}
    launch(fsdp_worker, out, world=WORLD, timeout=120.0)
    ranks = [torch.load(out / f"fsdp-rank{r}.pt", weights_only=False) for r in range(WORLD)]
    return {"ref": ref, "ranks": ranks}


def max_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("kind", list(KINDS))
def test_two_sharded_processes_equal_one_process_on_the_global_batch(run: dict[str, Any], kind: str) -> None:
    ref = run["ref"][kind]
    r0, r1 = run["ranks"]
    assert r1[f"{kind}_weights"] == {}  # the full weights are gathered to rank 0 only
    err = max_diff(r0[f"{kind}_weights"], ref["weights"])
    assert err <= ATOL, f"{kind}: max |FSDP - one process| = {err:.3g} > {ATOL}"
    moved = max_diff(ref["weights"], ref["init"])
    assert moved > 1e-2  # training moved the weights: the comparison has teeth
    for s in range(STEPS):
        want = ref["steps"][s]
        for got in (r0[f"{kind}_steps"][s], r1[f"{kind}_steps"][s]):
            assert got[2] == 1.0
            assert got[0] == pytest.approx(want[0], rel=1e-5), f"step {s}: grad norm"
            assert got[1] == pytest.approx(want[1], rel=1e-5, abs=1e-7), f"step {s}: loss"
        assert want[0] > MAX_NORM  # every step was clipped


def test_every_rank_holds_the_same_full_weights(run: dict[str, Any]) -> None:
    r0, r1 = run["ranks"]
    for k, v in r0["mlp_weights_all"].items():
        assert torch.equal(v, r1["mlp_weights_all"][k]), k
        assert torch.equal(v, r0["mlp_weights"][k]), k


def test_units_are_the_layers_and_the_root(run: dict[str, Any]) -> None:
    r0 = run["ranks"][0]
    assert r0["units"] == 3 + 1  # 3 linear layers + the root
    assert r0["policy_units"] == 2 + 1  # CategoricalMLP's 2 linear layers + the root
    assert r0["lm_units"] == r0["lm_chunked_units"] == 2 + 1  # 2 decoder layers + the root


@pytest.mark.parametrize("kind", list(KINDS))
def test_whole_optimizer_state_equals_one_process_state(run: dict[str, Any], kind: str) -> None:
    want = run["ref"][kind]["state"]
    got = run["ranks"][0][f"{kind}_state"]
    assert run["ranks"][1][f"{kind}_state"]["optimizer"] == {}
    assert got["scheduler"] == want["scheduler"]
    opt_got, opt_want = got["optimizer"], want["optimizer"]
    assert opt_got["param_groups"] == opt_want["param_groups"]  # integer keys, torch's format
    assert opt_got["state"].keys() == opt_want["state"].keys()
    worst = 0.0
    for i, st in opt_want["state"].items():
        assert opt_got["state"][i].keys() == st.keys()
        assert float(opt_got["state"][i]["step"]) == float(st["step"]) == STEPS
        for k in ("exp_avg", "exp_avg_sq"):
            assert opt_got["state"][i][k].shape == st[k].shape
            worst = max(worst, (opt_got["state"][i][k] - st[k]).abs().max().item())
    assert worst <= STATE_ATOL


def test_a_snapshot_of_the_shards_restores_weights_and_state_bitwise(run: dict[str, Any]) -> None:
    for r in run["ranks"]:
        assert r["rollback_moved"]
        assert r["rollback_weights"]
        assert r["rollback_state"]


def test_a_non_finite_loss_on_one_rank_skips_the_step_on_both(run: dict[str, Any]) -> None:
    for r in run["ranks"]:
        _, loss, applied = r["nan_step"]
        assert applied == 0.0
        assert math.isnan(loss)
        assert r["nan_weights_kept"]
        assert r["nan_state_kept"]
        assert r["nan_grads_cleared"]


def test_state_round_trip_continues_bitwise(run: dict[str, Any]) -> None:
    r0, r1 = run["ranks"]
    for r in (r0, r1):
        assert r["resumed_same"]
        assert r["lr_after_load"] == r["lr_original"]
        assert r["empty_state"] == {}
        assert r["empty_after_load"] == 0
    # the state read back from the fresh model is the one that was loaded
    loaded, saved = r0["loaded_state"]["optimizer"], r0["mlp_state"]["optimizer"]
    assert loaded["param_groups"] == saved["param_groups"]
    for i, st in saved["state"].items():
        for k, v in st.items():
            assert torch.equal(loaded["state"][i][k], v), (i, k)


def test_a_one_process_checkpoint_resumes_on_fsdp(run: dict[str, Any]) -> None:
    r0, r1 = run["ranks"]
    one = r0["one"]
    for r in (r0, r1):
        for k, v in one["weights"].items():
            assert torch.equal(r["from_one"]["weights"][k], v), k
        assert r["from_one_lr"] == [g["lr"] for g in one["state"]["optimizer"]["param_groups"]]
    got = r0["from_one"]["state"]
    assert got["scheduler"] == one["state"]["scheduler"]
    assert got["optimizer"]["param_groups"] == one["state"]["optimizer"]["param_groups"]
    for i, st in one["state"]["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(got["optimizer"]["state"][i][k], v), (i, k)


def test_an_fsdp_checkpoint_resumes_on_one_process(run: dict[str, Any]) -> None:
    r0 = run["ranks"][0]
    module = mlp()
    module.load_state_dict(r0["mlp_weights"])
    params = list(module.parameters())
    opt = default_optimizer(params, LR, 0.01)
    backend = LocalBackend(params, opt, scheduler(opt), MAX_NORM)
    backend.load_state_dict(r0["mlp_state"])  # FSDP's whole state, as saved by rank 0
    assert opt.param_groups[0]["lr"] == r0["mlp_state"]["optimizer"]["param_groups"][0]["lr"]
    for i, p in enumerate(params):
        for k, v in r0["mlp_state"]["optimizer"]["state"][i].items():
            assert torch.equal(opt.state[p][k], v), (i, k)


def test_an_optimizer_state_of_another_model_is_refused_on_every_rank(run: dict[str, Any]) -> None:
    for r in run["ranks"]:
        assert "saved for another model" in r["wrong_state"]


def test_metrics_and_step_counts_are_checked_across_ranks(run: dict[str, Any]) -> None:
    for r in run["ranks"]:
        assert r["metrics"] == {"loss/policy": 3.0, "time/generate": 10.0}
        assert "different numbers of optimizer steps" in r["same_steps_error"]


# ---- one process, no process group ------------------------------------------------------------------
def test_a_policy_without_a_module_is_refused_with_the_way_out() -> None:
    class Table:
        def get_parameters(self) -> dict[str, Tensor]:
            return {"w": torch.zeros(3, requires_grad=True)}

    with pytest.raises(TypeError, match=r"Table.*nn\.Module.*GRPOConfig\(fsdp=False\)"):
        shard_policy(Table(), torch.device("cpu"))


def test_sharding_needs_a_process_group() -> None:
    if torch.distributed.is_initialized():  # pragma: no cover - another test left one
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(RuntimeError, match="torchrun"):
        shard_policy(torch.nn.Linear(2, 2), torch.device("cpu"))


def test_default_units_leave_tied_weights_to_the_root() -> None:
    lin = torch.nn.Linear(3, 3)
    emb = torch.nn.Embedding(3, 3)
    emb.weight = lin.weight  # tied
    seq = torch.nn.Sequential(torch.nn.Linear(3, 3), emb, torch.nn.Tanh(), lin)
    assert default_units(seq) == [seq[0]]


# ==== trainer level: GRPOTrainer(GRPOConfig(fsdp=True)) on 2 processes vs one process ============
@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process without FSDP on each whole global batch (saving a checkpoint after CKPT_AT
    steps of the bandit), then `tests.fsdp_toys.trainer_worker` on 2 processes with fsdp=True."""
    out = tmp_path_factory.mktemp("fsdp-trainer")
    write_tiny_lm(out / "lm")
    ref: dict[str, Any] = {}
    for name in TRAINER_SCENARIOS:
        tr = build_trainer(name, fsdp=False)
        d = trainer_data(name)
        init = params(tr)
        metrics = run_steps(tr, d, slice(None), range(CKPT_AT))
        at_ckpt = params(tr)
        if name == "bandit":
            tr.save_checkpoint(out / "ckpt-one")
        metrics += run_steps(tr, d, slice(None), range(CKPT_AT, STEPS))
        reference = {k: v.detach().clone() for k, v in tr.state_dict()["reference_policy"].items()}
        ref[name] = {
            "init": init,
            "params": params(tr),
            "at_ckpt": at_ckpt,
            "metrics": metrics,
            "reference": reference,
        }
    tr = build_lm_trainer(out / "lm", fsdp=False)
    init = params(tr)
    metrics = lm_steps(tr, LM_PROMPTS, range(LM_STEPS))
    ref["lm"] = {"init": init, "params": params(tr), "metrics": metrics}
    launch(trainer_worker, out, world=WORLD, timeout=150.0)
    ranks = [torch.load(out / f"trainer-rank{r}.pt", weights_only=False) for r in range(WORLD)]
    return {"ref": ref, "ranks": ranks, "out": out}


def _max_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [*TRAINER_SCENARIOS, "lm"])
def test_trainer_on_two_sharded_processes_equals_one_process(trainer_run: dict[str, Any], name: str) -> None:
    ref = trainer_run["ref"][name]
    r0, r1 = (r[name] for r in trainer_run["ranks"])
    assert r0["sharded"]
    assert r1["sharded"]
    assert r1["params"] == {}  # trainer.state_dict() gathers the full weights to rank 0 only
    err = _max_diff(r0["params"], ref["params"])
    assert err <= TRAINER_ATOL[name], f"{name}: max |FSDP - one process| = {err:.3g} > {TRAINER_ATOL[name]}"
    assert _max_diff(ref["params"], ref["init"]) > 100 * TRAINER_ATOL[name]  # the comparison has teeth
    max_norm = 0.5 if name == "lm" else TRAINER_SCENARIOS[name][1]["max_grad_norm"]
    for s, want in enumerate(ref["metrics"]):
        for r in (r0, r1):
            got = r["metrics"][s]
            # the same samples and rewards (sampling does not depend on the process layout) ...
            for k in ("reward/mean", "reward/std"):
                assert got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-7), (s, k)
            # ... and the global gradient norm before clipping: a sum over ranks, not an average
            assert got["grad/norm"] == pytest.approx(want["grad/norm"], rel=1e-5), (s, "grad/norm")
        assert want["grad/norm"] > max_norm  # clipping was active


@pytest.mark.multiprocess
def test_the_reference_refreshed_from_the_sharded_policy_equals_one_process(
    trainer_run: dict[str, Any],
) -> None:
    """reference_update_freq=2: after step 4 the whole reference copy on every rank holds the
    gathered policy weights, as the one-process reference does (within the weights' tolerance)."""
    ref = trainer_run["ref"]["bandit"]
    assert _max_diff(ref["reference"], ref["init"]) > 100 * TRAINER_ATOL["bandit"]  # it was refreshed
    for r in trainer_run["ranks"]:
        err = _max_diff(r["bandit"]["reference"], ref["reference"])
        assert err <= TRAINER_ATOL["bandit"], err


@pytest.mark.multiprocess
def test_trainer_shards_the_policy_and_keeps_the_reference_whole(trainer_run: dict[str, Any]) -> None:
    ref = trainer_run["ref"]["bandit"]["params"]
    r0, r1 = (r["bandit"] for r in trainer_run["ranks"])
    assert r0["reference_whole"]
    assert r1["reference_whole"]
    for k, full in ref.items():  # every weight's rows are split between the ranks (torch.chunk)
        rows = [len(c) for c in torch.arange(full.shape[0]).chunk(WORLD)]
        assert [r0["local"][k], r1["local"][k]] == [(n, *full.shape[1:]) for n in rows], k


@pytest.mark.multiprocess
def test_trainer_fsdp_checkpoint_resumes_fsdp_bitwise(trainer_run: dict[str, Any]) -> None:
    r0, r1 = trainer_run["ranks"]
    assert r0["ckpt-fsdp-step"] == r1["ckpt-fsdp-step"] == CKPT_AT
    for k, v in r0["bandit"]["params"].items():  # saved at step 3, loaded, 2 steps == 5 steps
        assert torch.equal(r0["ckpt-fsdp-resumed"][k], v), k
    ckpts = trainer_run["out"] / "ckpt-fsdp"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", f"step-{CKPT_AT:08d}"]  # rank 0 wrote


@pytest.mark.multiprocess
def test_trainer_one_process_checkpoint_resumes_on_fsdp(trainer_run: dict[str, Any]) -> None:
    r0 = trainer_run["ranks"][0]
    assert r0["ckpt-one-step"] == CKPT_AT
    err = _max_diff(r0["ckpt-one-resumed"], trainer_run["ref"]["bandit"]["params"])
    assert err <= TRAINER_ATOL["bandit"]


@pytest.mark.multiprocess
def test_trainer_fsdp_checkpoint_resumes_on_one_process(trainer_run: dict[str, Any]) -> None:
    ref = trainer_run["ref"]["bandit"]
    tr = build_trainer("bandit", fsdp=False)
    with pytest.warns(UserWarning, match="config differs in .*fsdp"):
        tr.load_checkpoint(trainer_run["out"] / "ckpt-fsdp")
    assert tr.step_count == CKPT_AT
    assert _max_diff(params(tr), ref["at_ckpt"]) <= TRAINER_ATOL["bandit"]  # full weights were saved
    assert tr.optimizer is not None
    assert all(float(st["step"]) == CKPT_AT * 4 for st in tr.optimizer.state.values())  # 4 per update
    run_steps(tr, trainer_data("bandit"), slice(None), range(CKPT_AT, STEPS))
    assert _max_diff(params(tr), ref["params"]) <= TRAINER_ATOL["bandit"]
    assert _max_diff(params(tr), trainer_run["ranks"][0]["bandit"]["params"]) <= TRAINER_ATOL["bandit"]


@pytest.mark.multiprocess
def test_trainer_checkpoint_of_another_policy_is_refused_on_every_rank(trainer_run: dict[str, Any]) -> None:
    for r in trainer_run["ranks"]:
        assert r["wrong_ckpt"].startswith("CheckpointError"), r["wrong_ckpt"]
        # rank 0's weights lack a tensor: rank 0 finds it, every rank raises
        assert r["wrong_weights"].startswith("CheckpointError"), r["wrong_weights"]
        assert "missing ['net.net.0.weight']" in r["wrong_weights"]


@pytest.mark.multiprocess
def test_trainer_state_dict_round_trip_under_fsdp(trainer_run: dict[str, Any]) -> None:
    r0, r1 = trainer_run["ranks"]
    assert r1["round_trip"] == r1["round_trip_saved"] == {}
    for k, v in r0["round_trip_saved"].items():
        assert torch.equal(r0["round_trip"][k], v), k


@pytest.mark.multiprocess
def test_trainer_refuses_what_fsdp_does_not_support(trainer_run: dict[str, Any]) -> None:
    for r in trainer_run["ranks"]:
        assert "Pass optimizer=None" in r["optimizer_given"]


@pytest.mark.multiprocess
def test_save_pretrained_under_fsdp_writes_the_full_weights(trainer_run: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(str(trainer_run["out"] / "lm-saved"), dtype=torch.float32)
    got = dict(saved.named_parameters())
    trained = trainer_run["ranks"][0]["lm"]["params"]
    assert trained.keys() == got.keys()
    for k, v in trained.items():
        assert torch.equal(got[k].detach(), v), k


@pytest.mark.multiprocess
def test_trainer_checkpoint_of_the_causal_lm_resumes_under_fsdp(trainer_run: dict[str, Any]) -> None:
    lm = trainer_run["ranks"][0]["lm"]
    for k, v in lm["params"].items():  # the trainable parameters' names (tied LM head: one entry)
        assert torch.equal(lm["reloaded"][k], v), k
    saved, loaded = lm["optimizer"], lm["reloaded_optimizer"]
    assert loaded["param_groups"] == saved["param_groups"]
    for i, st in saved["state"].items():
        for k, v in st.items():
            assert torch.equal(loaded["state"][i][k], v), (i, k)
    for k, v in lm["continued"].items():
        assert torch.equal(lm["continued_fresh"][k], v), k
