"""What each process of the 2-process FSDP2 tests runs (module level: spawn pickles it by name).

A hand-written update loop drives a backend directly (the trainer is not involved): per optimizer
step, the loss normaliser ``C`` (the number of valid rows of the whole global batch) is made
global with ``backend.global_sum``, then each micro-batch's loss is this process's share of the
global mean, ``sum_{i in rank r} mask_i * l_i / C``. The same loop runs on one process with
`grpo.engine.backends.LocalBackend` over the whole global batch; the two must agree.

Scenarios (`KINDS`):

* ``mlp``: an MLP (three linear layers: three FSDP units + the root), 2 micro-batches per step;
* ``policy``: `grpo.policies.categorical_mlp` scored with ``evaluate_actions``, which runs
  ``CategoricalMLP.net`` directly (never a forward of the root or of ``CategoricalMLP``): the
  linear layers are the units, so it works all the same;
* ``lm``: a tiny Qwen2 causal LM from `grpo.llm.tiny` (tied input/output embeddings; each decoder
  layer one unit), scored through the root's forward;
* ``lm_chunked``: the same LM scored as `grpo.llm.CausalLMPolicy`'s chunked path does (backbone
  ``model.model(...)``, then ``lm_head.weight`` directly) inside `grpo.engine.fsdp.run_as_forward`.
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from grpo.engine.backends import LocalBackend
from grpo.engine.optim import default_optimizer

WORLD = 2
STEPS = 5
MICRO = 2  # micro-batches per optimizer step
B = 6  # rows per process and micro-batch
OBS, OUT = 6, 4
MAX_NORM = 0.05  # below every step's gradient norm: every step is clipped
LR = 1e-2
SEQ, LLM_B = 8, 2  # LLM: tokens per sequence, sequences per process
GROUP = 3  # policy: actions per state


# ---- models -------------------------------------------------------------------------------------
def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(OBS, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, OUT))


def tiny_lm() -> nn.Module:
    from grpo.llm.tiny import build_tiny_model, build_tiny_tokenizer

    with tempfile.TemporaryDirectory(prefix="grpo-fsdp-lm-") as d:
        tok = build_tiny_tokenizer(d)
        model: nn.Module = build_tiny_model(d, tok, arch="qwen2", hidden=32, layers=2, heads=4)
    return model


def scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.5 * s))


# ---- data: global batches, cut into per-process rows ---------------------------------------------
def mlp_data(steps: int = STEPS + 2) -> dict[str, Tensor]:
    """x (S, MICRO, W*B, OBS), y (S, MICRO, W*B, OUT), mask (S, MICRO, W*B): unequal numbers of
    valid rows on the two processes, so only a global normaliser gives the one-process update."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps, MICRO, WORLD * B, OBS, generator=g)
    y = torch.randn(steps, MICRO, WORLD * B, OUT, generator=g)
    mask = torch.rand(steps, MICRO, WORLD * B, generator=g) < 0.7
    mask[:, :, B:] &= torch.rand(steps, MICRO, B, generator=g) < 0.6  # fewer valid rows on rank 1
    return {"x": x, "y": y, "mask": mask.float()}


def lm_data(steps: int = STEPS) -> dict[str, Tensor]:
    """ids (S, W*LLM_B, SEQ) token ids, adv (S, W*LLM_B) advantages, mask (S, W*LLM_B, SEQ-1)."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(4, 55, (steps, WORLD * LLM_B, SEQ), generator=g)
    adv = torch.randn(steps, WORLD * LLM_B, generator=g)
    lengths = torch.randint(2, SEQ, (steps, WORLD * LLM_B, 1), generator=g)
    mask = (torch.arange(SEQ - 1) < lengths).float()
    return {"ids": ids, "adv": adv, "mask": mask}


def mlp_loss(module: nn.Module, d: dict[str, Tensor], s: int, k: int, rows: slice) -> Tensor:
    """``sum_i mask_i * ||f(x_i) - y_i||^2`` over ``rows`` of micro-batch k of step s (not yet
    divided by the normaliser)."""
    err: Tensor = (module(d["x"][s, k, rows]) - d["y"][s, k, rows]).square().sum(-1)  # (b,)
    return (err * d["mask"][s, k, rows]).sum()


def lm_loss(module: nn.Module, d: dict[str, Tensor], s: int, k: int, rows: slice) -> Tensor:
    """Policy-gradient surrogate ``-sum_{i,t} mask * adv_i * log p(tok_{t+1} | tok_<=t)``."""
    ids = d["ids"][s, rows]
    logits = module(input_ids=ids).logits[:, :-1].float()  # (b, SEQ-1, V)
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return -(d["adv"][s, rows, None] * logp * d["mask"][s, rows]).sum()


def lm_chunked_loss(module: nn.Module, d: dict[str, Tensor], s: int, k: int, rows: slice) -> Tensor:
    """`lm_loss` from the backbone's hidden states and the LM head's weight (no root forward)."""
    from grpo.engine.fsdp import run_as_forward

    ids = d["ids"][s, rows]
    lm: Any = module

    def score() -> Tensor:
        hidden = lm.model(input_ids=ids).last_hidden_state[:, :-1]  # (b, SEQ-1, H)
        logits = (hidden @ lm.lm_head.weight.T).float()  # (b, SEQ-1, V)
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return -(d["adv"][s, rows, None] * logp * d["mask"][s, rows]).sum()

    return run_as_forward(module, score)


def policy_data(steps: int = STEPS) -> dict[str, Tensor]:
    """states (S, W*B, OBS), actions (S, W*B, G) arms, adv (S, W*B, G), mask (S, W*B, G) ones."""
    g = torch.Generator().manual_seed(3)
    states = torch.randn(steps, WORLD * B, OBS, generator=g)
    actions = torch.randint(0, OUT, (steps, WORLD * B, GROUP), generator=g)
    adv = torch.randn(steps, WORLD * B, GROUP, generator=g)
    return {"states": states, "actions": actions, "adv": adv, "mask": torch.ones(steps, WORLD * B, GROUP)}


def policy_loss(module: nn.Module, d: dict[str, Tensor], s: int, k: int, rows: slice) -> Tensor:
    """``-sum_{i,g} adv * log pi(a_ig | s_i)`` with the policy's own ``evaluate_actions``."""
    policy: Any = module
    out = policy.evaluate_actions(d["states"][s, rows], d["actions"][s, rows].reshape(-1), group_size=GROUP)
    logp: Tensor = out.log_probs
    return -(d["adv"][s, rows].reshape(-1) * logp).sum()


def categorical_policy() -> nn.Module:
    from grpo.policies import categorical_mlp

    torch.manual_seed(0)
    policy: nn.Module = categorical_mlp(OBS, OUT, hidden=(16,))
    return policy


def count(d: dict[str, Tensor], s: int, rows: slice) -> Tensor:
    """Valid entries of step s in ``rows`` (summed over the micro-batches)."""
    m = d["mask"][s]  # MLP: (MICRO, W*B); LM: (W*LLM_B, SEQ-1); policy: (W*B, G)
    return m[:, rows].sum() if "x" in d else m[rows].sum()


LossFn = Callable[[nn.Module, dict[str, Tensor], int, int, slice], Tensor]


def one_step(
    module: nn.Module,
    backend: Any,
    d: dict[str, Tensor],
    s: int,
    rows: slice,
    loss_fn: LossFn,
    micro: int,
    poison: bool = False,
) -> Any:
    """One optimizer step on ``rows`` of step s's global batch; ``poison``: NaN loss here."""
    backend.zero_grad()
    c = backend.global_sum(count(d, s, rows)).clamp(min=1.0)
    for k in range(micro):
        loss = loss_fn(module, d, s, k, rows) / c
        if poison:
            loss = loss * torch.nan
        backend.backward(loss, last=k == micro - 1)
    return backend.optimizer_step()


def results(res: Any) -> list[float]:
    return [res.grad_norm, res.loss, float(res.applied)]


# ---- the scenarios --------------------------------------------------------------------------------
# kind -> (data, loss, micro-batches per step, rows per process)
KINDS: dict[str, tuple[Callable[[], dict[str, Tensor]], LossFn, int, int]] = {
    "mlp": (mlp_data, mlp_loss, MICRO, B),
    "policy": (policy_data, policy_loss, 1, B),
    "lm": (lm_data, lm_loss, 1, LLM_B),
    "lm_chunked": (lm_data, lm_chunked_loss, 1, LLM_B),
}


def model(kind: str, lm: nn.Module | None = None) -> nn.Module:
    """A fresh model of ``kind`` (the LMs: a copy of ``lm``, or a new tiny one)."""
    if kind == "mlp":
        return mlp()
    if kind == "policy":
        return categorical_policy()
    return copy.deepcopy(lm) if lm is not None else tiny_lm()


# ---- one process: the reference -------------------------------------------------------------------
def reference(kind: str, lm: nn.Module | None = None) -> dict[str, Any]:
    """The one-process run on the whole global batch: steps' results, weights, optimizer state."""
    module = model(kind, lm)
    data_fn, loss_fn, micro, _ = KINDS[kind]
    d = data_fn()
    params = [p for p in module.parameters() if p.requires_grad]
    init = {k: v.detach().clone() for k, v in module.state_dict().items()}
    opt = default_optimizer(params, LR, 0.01)
    backend = LocalBackend(params, opt, scheduler(opt), MAX_NORM)
    steps = [results(one_step(module, backend, d, s, slice(None), loss_fn, micro)) for s in range(STEPS)]
    weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return {"init": init, "steps": steps, "weights": weights, "state": copy.deepcopy(backend.state_dict())}


# ---- the 2 processes ------------------------------------------------------------------------------
def _sharded(model: nn.Module, sync: Any) -> tuple[nn.Module, Any]:
    from grpo.engine.fsdp import FSDPBackend, shard_policy

    module = shard_policy(model, torch.device("cpu"))
    params = [p for p in module.parameters() if p.requires_grad]
    opt = default_optimizer(params, LR, 0.01)
    return module, FSDPBackend(module, params, opt, scheduler(opt), MAX_NORM, sync)


def _full(backend: Any) -> dict[str, Tensor]:
    """The whole weights on every rank."""
    full: dict[str, Tensor] = backend.gathered_model_state_dict(rank0_only=False)
    return full


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Bitwise equality of two (possibly nested) state dicts."""
    if a.keys() != b.keys():
        return False
    for k, v in a.items():
        w = b[k]
        if isinstance(v, dict):
            if not isinstance(w, dict) or not _same(v, w):
                return False
        elif isinstance(v, Tensor):
            if not isinstance(w, Tensor) or not torch.equal(v, w):
                return False
        elif v != w:
            return False
    return True


def fsdp_worker(rank: int, world: int, out: Path) -> None:
    """Every scenario of KINDS for STEPS optimizer steps on this rank's rows; after the MLP's, a
    rollback, a non-finite step and state round trips. Writes ``fsdp-rank{r}.pt``."""
    from grpo.engine.distributed import DistributedSync, init_from_env
    from grpo.engine.fsdp import is_fsdp_sharded
    from grpo.metrics import StepCounts
    from grpo.update.rollback import UpdateSnapshot

    # before the process group exists: under torch.distributed, transformers' save_pretrained
    # writes on rank 0 only, and build_tiny_model loads back what it saved
    lm = tiny_lm()
    init_from_env(torch.device("cpu"))
    sync = DistributedSync(torch.device("cpu"))
    res: dict[str, Any] = {}

    # MLP with 2 micro-batches per step; rank 1 starts from other weights: shard_policy
    # broadcasts rank 0's
    d = mlp_data()
    rows = slice(rank * B, (rank + 1) * B)
    module, backend = _sharded(mlp(seed=rank), sync)
    res["units"] = sum(is_fsdp_sharded(m) for m in module.modules())
    res["mlp_steps"] = [results(one_step(module, backend, d, s, rows, mlp_loss, MICRO)) for s in range(STEPS)]
    weights = backend.gathered_model_state_dict()  # {} on rank 1
    res["mlp_weights"] = weights
    res["mlp_weights_all"] = _full(backend)
    state = copy.deepcopy(backend.state_dict())  # as torch's, it may alias live tensors ("step")
    res["mlp_state"] = state

    # metrics: one all-gather, each by its declared reduction (shares summed, slowest time)
    counts = StepCounts(samples=4.0, groups=1.0, valid_steps=4.0 * (rank + 1))
    res["metrics"] = backend.reduce_metrics({"loss/policy": rank + 1.0, "time/generate": 10.0 - rank}, counts)
    res["same_steps_error"] = None
    try:
        backend.check_same_optimizer_steps(num_groups=4 if rank == 0 else 2, mini_batch_size=2)
    except ValueError as e:
        res["same_steps_error"] = str(e)

    # rollback: a snapshot of the shards taken before a step restores them bitwise
    snap = UpdateSnapshot()
    snap.capture(backend.params, backend.optimizer, backend.scheduler)
    moved = one_step(module, backend, d, STEPS, rows, mlp_loss, MICRO)
    changed = _full(backend)
    res["rollback_moved"] = moved.applied and not _same(changed, res["mlp_weights_all"])
    snap.restore()
    snap.release()
    res["rollback_weights"] = _same(_full(backend), res["mlp_weights_all"])
    res["rollback_state"] = _same(backend.state_dict(), state)

    # a NaN loss on rank 1 only: both ranks skip, nothing changes
    bad = one_step(module, backend, d, STEPS, rows, mlp_loss, MICRO, poison=rank == 1)
    res["nan_step"] = results(bad)
    res["nan_weights_kept"] = _same(_full(backend), res["mlp_weights_all"])
    res["nan_state_kept"] = _same(backend.state_dict(), state)
    res["nan_grads_cleared"] = all(p.grad is None for p in backend.params)

    # state round trip: a fresh model (other weights) gets the full weights and optimizer state
    # (rank 0's, broadcast; rank 1 passes {}), then one more step equals the original's bitwise
    fresh, fresh_backend = _sharded(mlp(seed=5), sync)
    fresh_backend.load_model_state_dict(weights)
    fresh_backend.load_state_dict(state)
    res["lr_after_load"] = [g["lr"] for g in fresh_backend.optimizer.param_groups]
    res["lr_original"] = [g["lr"] for g in backend.optimizer.param_groups]
    res["loaded_state"] = copy.deepcopy(fresh_backend.state_dict())
    one_step(module, backend, d, STEPS + 1, rows, mlp_loss, MICRO)
    one_step(fresh, fresh_backend, d, STEPS + 1, rows, mlp_loss, MICRO)
    res["resumed_same"] = _same(_full(backend), _full(fresh_backend))
    # a state saved before any optimizer step: empty, loads as empty
    _, empty_backend = _sharded(mlp(), sync)
    empty = empty_backend.state_dict()
    res["empty_state"] = empty["optimizer"]["state"]
    empty_backend.load_state_dict(empty)
    res["empty_after_load"] = len(empty_backend.optimizer.state)

    # a one-process checkpoint (LocalBackend's optimizer.state_dict(), integer keys) resumes on
    # FSDP: rank 0 holds it, rank 1 passes {}; reading it back gives it again
    one = reference("mlp") if rank == 0 else {"weights": {}, "state": {}}
    _, from_one = _sharded(mlp(seed=7), sync)
    from_one.load_model_state_dict(one["weights"])
    from_one.load_state_dict(one["state"])
    res["from_one"] = {"weights": _full(from_one), "state": copy.deepcopy(from_one.state_dict())}
    res["from_one_lr"] = [g["lr"] for g in from_one.optimizer.param_groups]
    if rank == 0:
        res["one"] = one
    # a state of another model is refused on every rank (no rank waits for the others)
    try:
        _sharded(categorical_policy(), sync)[1].load_state_dict(state)
    except ValueError as e:
        res["wrong_state"] = str(e)

    # the other scenarios: STEPS optimizer steps each
    for kind in ("policy", "lm", "lm_chunked"):
        data_fn, loss_fn, micro, b = KINDS[kind]
        d = data_fn()
        rows = slice(rank * b, (rank + 1) * b)
        module, backend = _sharded(model(kind, lm), sync)
        res[f"{kind}_units"] = sum(is_fsdp_sharded(m) for m in module.modules())
        steps = [one_step(module, backend, d, s, rows, loss_fn, micro) for s in range(STEPS)]
        res[f"{kind}_steps"] = [results(r) for r in steps]
        res[f"{kind}_weights"] = backend.gathered_model_state_dict()
        res[f"{kind}_state"] = copy.deepcopy(backend.state_dict())

    torch.save(res, out / f"fsdp-rank{rank}.pt")


# ==== trainer level: GRPOTrainer(GRPOConfig(fsdp=True)) on 2 processes vs one process ============
# The data-parallel tests' machinery (tests.distributed_toys: policies that sample by inverse CDF of
# `noise`, build/data/params/run_steps/launch) drives GRPOTrainer itself: each rank steps on its
# shard of the global batch with fsdp=True, one process steps on the whole batch without it.

#: name -> (distributed_toys scenario, config overrides). Per rank: 2 mini-batches of MINI groups,
#: micro-batches of 1 group (2 per optimizer step); one process: 2 mini-batches of W*MINI groups.
TRAINER_SCENARIOS: dict[str, tuple[str, dict[str, Any]]] = {
    # categorical_mlp (NoiseCategorical) x 2 epochs, KL to the frozen reference copy, every optimizer
    # step clipped (max_grad_norm below the gradient norms)
    "bandit": (
        "bandit_deferred",
        {"num_epochs_per_update": 2, "kl_coeff": 0.1, "max_grad_norm": 0.05, "reference_update_freq": 2},
    ),
    # a user nn.Module policy with T-token actions and masks (token-mean over unequal lengths: rank 0
    # has 3x the tokens of rank 1), 2 epochs, KL, clipped
    "seq": ("seq_known", {"max_grad_norm": 0.05}),
}
MINI = 2  # groups per optimizer step on one rank
CKPT_AT = 3  # the checkpoint test saves after this many steps
LM_PROMPTS = ["1+2=", "ab", "hello x", "q?"]  # the global batch of the LLM scenario (2 per rank)
LM_STEPS = 3


class ShardedPlan:
    """One process's update plan drawing the mini-batches as W processes do.

    Each rank shuffles its own b = B / W groups (`grpo.update.plan.UpdatePlan`: one
    ``randperm(b)`` per epoch from the trainer's generator, the same draw on every rank: one seed)
    and takes MINI of them per optimizer step; the data-parallel optimizer step is the union of
    the ranks' mini-batches. This plan makes one process on the whole batch take exactly those
    unions (positions ``perm[k] + r * b`` for every rank r), one micro-batch each; the order of
    the groups inside a step only changes how float sums round.
    """

    def __init__(self, plan: Any, world: int) -> None:
        self.plan = plan
        self.world = world

    def __getattr__(self, name: str) -> Any:
        return getattr(self.plan, name)

    def optimizer_steps(self, num_groups: int, group_size: int | None, group_ids: Tensor) -> Any:
        from grpo.update.plan import MicroBatch, OptimizerStep, rows_of

        plan = self.plan
        local, mb = num_groups // self.world, plan.mini_batch_size // self.world
        if mb >= local:
            yield from plan.optimizer_steps(num_groups, group_size, group_ids)
            return
        first = True
        for _ in range(plan.num_epochs):
            order = torch.randperm(local, generator=plan.generator)
            for start in range(0, local, mb):
                groups = torch.cat([order[start : start + mb] + r * local for r in range(self.world)])
                rows = rows_of(groups, group_size, group_ids)
                yield OptimizerStep(groups, rows, (MicroBatch(groups, rows, last=True),), on_policy=first)
                first = False


def build_trainer(name: str, *, fsdp: bool) -> Any:
    """Scenario ``name``'s trainer: this rank's (``fsdp=True``, LOCAL_B states per step) or the one
    process's on the whole global batch (W * LOCAL_B states, `ShardedPlan`)."""
    from tests.distributed_toys import LOCAL_B, build

    base, cfg = TRAINER_SCENARIOS[name]
    scale = 1 if fsdp else WORLD
    tr: Any = build(base, LOCAL_B * scale, mini_batch_size=MINI * scale, micro_batch_size=1, fsdp=fsdp, **cfg)
    if not fsdp:
        plan = ShardedPlan(tr.plan, WORLD)
        tr.plan = plan
        tr._update.plan = plan
    return tr


def trainer_data(name: str) -> dict[str, Tensor]:
    from tests.distributed_toys import data

    return data(TRAINER_SCENARIOS[name][0], WORLD)


def seeded_lm_policy(model: Any, tokenizer: Any) -> Any:
    """A `grpo.llm.CausalLMPolicy` whose completions of a prompt depend on the prompt and
    ``step_seed`` only (the torch RNG is seeded per prompt and ``generate`` runs one prompt at a
    time), not on the process or the other prompts of the batch: 2 processes on shards and one
    process on the whole batch sample the same completions. Chunked log-probs (8 tokens a chunk)."""
    import zlib

    from grpo.llm import CausalLMPolicy, SamplingSettings

    class Seeded(CausalLMPolicy):
        def generate_actions(self, states: Any, num_actions_per_state: int, **kwargs: Any) -> Any:
            step = int(kwargs.pop("step_seed", 0))
            out: list[Any] = []
            for s in states:
                torch.manual_seed(step * 7919 + zlib.crc32(str(s).encode()))
                out += super().generate_actions([s], num_actions_per_state, **kwargs)
            return out

    return Seeded(model, tokenizer, SamplingSettings(max_new_tokens=4), logprob_chunk_size=8)


def build_lm_trainer(model_dir: Path, *, fsdp: bool) -> Any:
    """The tiny Qwen2 of ``model_dir`` as a CausalLMPolicy; KL on (a frozen whole copy), clipped."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo import GRPOConfig, GRPOTrainer
    from grpo.llm import RewardFunctions
    from tests.llm_distributed_toys import char_score

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    per_rank = len(LM_PROMPTS) // WORLD
    config = GRPOConfig(
        group_size=3, batch_size=per_rank if fsdp else len(LM_PROMPTS), learning_rate=1e-2,
        kl_coeff=0.05, max_grad_norm=0.5, seed=0, fsdp=fsdp,
    )  # fmt: skip
    return GRPOTrainer(config, seeded_lm_policy(model, tok), RewardFunctions(char_score))


def lm_steps(tr: Any, prompts: list[str], steps: range) -> list[dict[str, float]]:
    return [tr.step(prompts, step_seed=s) for s in steps]


def write_tiny_lm(directory: Path) -> None:
    """The tiny Qwen2 (tied embeddings) and its tokenizer, saved in ``directory``."""
    from grpo.llm.tiny import build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer(directory)
    build_tiny_model(directory, tok, arch="qwen2", hidden=32, layers=2, heads=4)


def trainer_worker(rank: int, world: int, out: Path) -> None:
    """Every TRAINER_SCENARIOS entry for STEPS steps with GRPOConfig(fsdp=True) on this rank's shard
    (the bandit saving a checkpoint after CKPT_AT steps), resumes from that checkpoint and from the
    one-process checkpoint ``out/ckpt-one``, then the LLM scenario and ``save_pretrained``.
    Writes ``trainer-rank{r}.pt``."""
    from grpo.engine.distributed import barrier
    from grpo.engine.fsdp import is_fsdp_sharded
    from tests.distributed_toys import LOCAL_B, run_steps

    rows = slice(rank * LOCAL_B, (rank + 1) * LOCAL_B)
    res: dict[str, Any] = {}
    for name in TRAINER_SCENARIOS:
        tr = build_trainer(name, fsdp=True)
        d = trainer_data(name)
        metrics = run_steps(tr, d, rows, range(CKPT_AT))
        if name == "bandit":
            tr.save_checkpoint(out / "ckpt-fsdp")  # every rank: the gather is a collective
        metrics += run_steps(tr, d, rows, range(CKPT_AT, STEPS))
        state = tr.state_dict()  # gathered: rank 0 full, rank 1 {}
        res[name] = {
            "params": state["policy"],
            "reference": {k: v.detach().clone() for k, v in state["reference_policy"].items()},
            "optimizer": state["optimizer"],
            "metrics": metrics,
            "sharded": is_fsdp_sharded(tr.backend.module),
            "local": {k: tuple(v.to_local().shape) for k, v in tr.policy.get_parameters().items()},
            "reference_whole": all(not hasattr(p, "to_local") for p in tr.reference_policy.parameters()),
        }
    barrier()

    # resume: a fresh FSDP trainer from the FSDP checkpoint, and from one saved by one process
    for src in ("ckpt-fsdp", "ckpt-one"):
        tr = build_trainer("bandit", fsdp=True)
        tr.load_checkpoint(out / src)
        res[f"{src}-step"] = tr.step_count
        run_steps(tr, trainer_data("bandit"), rows, range(CKPT_AT, STEPS))
        res[f"{src}-resumed"] = tr.state_dict()["policy"]

    # trainer.state_dict() round trip: rank 1 holds {} for the policy and optimizer, rank 0's load;
    # weights that do not fit (checked on rank 0) are refused on every rank
    tr = build_trainer("bandit", fsdp=True)
    run_steps(tr, trainer_data("bandit"), rows, range(1))
    state = tr.state_dict()
    tr.load_state_dict(state)
    res["round_trip"] = tr.state_dict()["policy"]
    res["round_trip_saved"] = state["policy"]
    if rank == 0:
        state["policy"] = dict(list(state["policy"].items())[1:])
    try:
        tr.load_state_dict(state)
    except Exception as e:  # CheckpointError
        res["wrong_weights"] = f"{type(e).__name__}: {e}"

    # a checkpoint of another policy is refused on every rank (none hangs)
    tr = build_trainer("seq", fsdp=True)
    try:
        tr.load_checkpoint(out / "ckpt-fsdp")
    except Exception as e:  # CheckpointError
        res["wrong_ckpt"] = f"{type(e).__name__}: {e}"

    # an optimizer built before sharding would update the old, unsharded tensors: refused
    from grpo import GRPOConfig, GRPOTrainer
    from tests.distributed_toys import bandit_reward

    policy: Any = categorical_policy()
    try:
        config = GRPOConfig(group_size=4, batch_size=LOCAL_B, kl_coeff=0.0, fsdp=True)
        GRPOTrainer(config, policy, bandit_reward, optimizer=torch.optim.SGD(policy.parameters(), lr=0.1))
    except ValueError as e:
        res["optimizer_given"] = str(e)

    # the tiny HF causal LM through CausalLMPolicy (chunked log-probs inside run_as_forward,
    # generation with synced_gpus)
    tr = build_lm_trainer(out / "lm", fsdp=True)
    per_rank = len(LM_PROMPTS) // world
    metrics = lm_steps(tr, LM_PROMPTS[rank * per_rank : (rank + 1) * per_rank], range(LM_STEPS))
    state = tr.state_dict()
    res["lm"] = {
        "params": state["policy"],
        "metrics": metrics,
        "sharded": tr.policy.is_partitioned,
    }
    tr.policy.save_pretrained(str(out / "lm-saved"))  # every rank; rank 0 writes
    # the trainer's checkpoint of a CausalLMPolicy (its trainable parameters; the LM head tied to
    # the embeddings) loads into a fresh FSDP trainer; one more step of each is the same
    tr.save_checkpoint(out / "ckpt-lm")
    fresh = build_lm_trainer(out / "lm", fsdp=True)
    fresh.load_checkpoint(out / "ckpt-lm")
    loaded = fresh.state_dict()
    res["lm"]["reloaded"] = loaded["policy"]
    res["lm"]["reloaded_optimizer"] = loaded["optimizer"]
    res["lm"]["optimizer"] = state["optimizer"]
    prompts = LM_PROMPTS[rank * per_rank : (rank + 1) * per_rank]
    lm_steps(tr, prompts, range(LM_STEPS, LM_STEPS + 1))
    lm_steps(fresh, prompts, range(LM_STEPS, LM_STEPS + 1))
    res["lm"]["continued"] = tr.state_dict()["policy"]
    res["lm"]["continued_fresh"] = fresh.state_dict()["policy"]
    torch.save(res, out / f"trainer-rank{rank}.pt")
