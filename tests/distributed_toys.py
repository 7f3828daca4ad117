"""Toy problems and a process launcher for the data-parallel tests (CPU, gloo).

Sampling is made independent of the process layout: each policy samples by inverse CDF from
uniform ``noise`` passed through ``trainer.step(states, noise=...)``, and the noise of the global
batch is sharded exactly like the states. So W processes on shards and one process on the whole
batch see the same states, the same actions and the same rewards, and their updates must agree.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import Tensor, nn

from grpo import GRPOConfig, GRPOTrainer, PolicyOutput
from grpo.policies import CategoricalMLP, DistributionPolicy

OBS, ARMS, VOCAB, T = 4, 3, 3, 3
STEPS = 5


class NoiseCategorical(DistributionPolicy):
    """`categorical_mlp` whose ``generate_actions`` samples arm ``a`` by inverse CDF of ``noise``.

    States are (B, OBS + 1); the last column is a reward gate, not seen by the network.
    ``poison``: log-probs of states with gate == -1 are NaN during the update (non-finite test).
    """

    def __init__(self) -> None:
        super().__init__(CategoricalMLP(OBS, ARMS, hidden=(8,)))

    def distribution(self, states: Any) -> Any:
        return super().distribution(states[..., :OBS])

    def generate_actions(self, states: Any, num_actions_per_state: int, **kw: Any) -> Tensor:
        cdf = self.distribution(states).probs.cumsum(-1)  # (B, A)
        noise: Tensor = kw["noise"]  # (B, G)
        return torch.searchsorted(cdf, noise.contiguous()).clamp(max=ARMS - 1)

    def generate_actions_with_log_probs(
        self, states: Any, num_actions_per_state: int, **kw: Any
    ) -> tuple[Tensor, PolicyOutput]:
        actions = self.generate_actions(states, num_actions_per_state, **kw)  # (B, G)
        out = DistributionPolicy.evaluate_actions(
            self, states, actions.reshape(-1), group_size=num_actions_per_state
        )
        return actions, PolicyOutput(out.log_probs)

    def evaluate_actions(self, states: Any, actions: Any, **kw: Any) -> PolicyOutput:
        out = super().evaluate_actions(states, actions, **kw)
        if bool((states[:, OBS] == -1).any()):
            return PolicyOutput(out.log_probs * torch.nan, entropy=out.entropy)
        return out


class SeqPolicy(nn.Module):
    """Actions are T-token sequences; a state's last column is its length L in {1..T}.

    log-probs (N, T) with mask ``t < L``: the number of valid steps differs between states.
    """

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(OBS, T * VOCAB)

    def _logits(self, states: Tensor) -> Tensor:
        return self.net(states[:, :OBS]).view(-1, T, VOCAB)

    def generate_actions(self, states: Tensor, num_actions_per_state: int, **kw: Any) -> Tensor:
        g = num_actions_per_state
        cdf = self._logits(states).softmax(-1).cumsum(-1)  # (B, T, V)
        cdf = cdf.unsqueeze(1).expand(-1, g, -1, -1).contiguous()  # (B, G, T, V)
        noise: Tensor = kw["noise"]  # (B, G, T)
        return torch.searchsorted(cdf, noise.unsqueeze(-1).contiguous()).squeeze(-1).clamp(max=VOCAB - 1)

    def get_log_probabilities(self, states: Tensor, actions: Tensor) -> PolicyOutput:
        logp = self._logits(states).log_softmax(-1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        mask = torch.arange(T) < states[:, OBS : OBS + 1]
        return PolicyOutput(logp, mask=mask)

    def get_parameters(self) -> dict[str, Tensor]:
        return dict(self.named_parameters())


def bandit_reward(states: Tensor, actions: Tensor) -> Tensor:
    """Gate * score of the arm: score = states[:, :OBS] @ W; gate 0 makes every group zero-variance."""
    w = torch.linspace(-1.0, 1.0, OBS * ARMS).view(OBS, ARMS)
    score = (states[:, :OBS] @ w).gather(-1, actions.view(-1, 1)).squeeze(-1)
    return states[:, OBS] * score


def seq_reward(states: Tensor, actions: Tensor) -> Tensor:
    """Fraction of the valid tokens equal to 1, plus the first token's index / VOCAB."""
    mask = torch.arange(T) < states[:, OBS : OBS + 1]
    hits = ((actions == 1) & mask).sum(-1) / mask.sum(-1)
    return hits + actions[:, 0] / VOCAB


def make_data(kind: str, world: int, local_b: int, group: int, gates: list[float]) -> dict[str, Tensor]:
    """Global states (STEPS, W*b, OBS+1) and noise, rank r's shard being rows [r*b, (r+1)*b).

    ``gates[r]``: rank r's last state column for the bandit (1 normal, 0 zero variance, -1 poison
    at step 2); for the sequence task the length column is T on rank 0 and 1 elsewhere.
    """
    gen = torch.Generator().manual_seed(123)
    n = world * local_b
    obs = torch.randn(STEPS, n, OBS, generator=gen)
    last = torch.ones(STEPS, n, 1)
    for r in range(world):
        rows = slice(r * local_b, (r + 1) * local_b)
        if kind == "bandit":
            last[:, rows] = 1.0 if gates[r] == -1 else gates[r]
            if gates[r] == -1:
                last[2, rows] = -1.0
        else:
            last[:, rows] = float(T) if r == 0 else 1.0
    noise_shape = (STEPS, n, group) if kind == "bandit" else (STEPS, n, group, T)
    return {"states": torch.cat([obs, last], -1), "noise": torch.rand(noise_shape, generator=gen)}


SCENARIOS: dict[str, dict[str, Any]] = {
    # deferred normaliser (one optimizer step, mask unknown before the forward) + micro-batches
    "bandit_deferred": {"kind": "bandit", "gates": [1, 1], "cfg": {"micro_batch_size": 2}},
    # normaliser known at collection (2 epochs) + KL to a reference; rank 1 all zero variance
    "bandit_zero_var": {
        "kind": "bandit",
        "gates": [1, 0],
        "cfg": {"num_epochs_per_update": 2, "kl_coeff": 0.1},
    },
    # rank 1's groups all dropped from the loss (issue 3's drop_zero_variance_groups): its loss mask
    # is empty, and it must add 0 (not a clamped 1) to the global token count
    "bandit_drop": {
        "kind": "bandit",
        "gates": [1, 0],
        "cfg": {"drop_zero_variance_groups": True, "kl_coeff": 0.1},
    },
    # a NaN gradient on rank 1 at step 2: every rank skips that optimizer step
    "bandit_poison": {"kind": "bandit", "gates": [1, -1], "cfg": {}},
    # token-mean over variable lengths, rank 0 has 3x the tokens of rank 1 (global count matters)
    "seq_deferred": {"kind": "seq", "gates": [1, 1], "cfg": {"micro_batch_size": 2}},
    "seq_known": {"kind": "seq", "gates": [1, 1], "cfg": {"num_epochs_per_update": 2, "kl_coeff": 0.1}},
    "seq_mean": {"kind": "seq", "gates": [1, 1], "cfg": {"loss_aggregation": "seq-mean-token-mean"}},
    # the adaptive learning rate reads the KL of all ranks' tokens (rank 0 has 3x rank 1's)
    "seq_adaptive_lr": {
        "kind": "seq",
        "gates": [1, 1],
        "cfg": {"num_epochs_per_update": 3, "adaptive_lr_kl": 2e-3, "adaptive_lr_max": 0.5},
    },
}
LOCAL_B, GROUP = 4, 4


def build(name: str, batch_size: int, **extra: Any) -> GRPOTrainer:
    """A seeded trainer for scenario ``name`` (same initial weights on every process)."""
    sc = SCENARIOS[name]
    torch.manual_seed(0)
    policy: Any = NoiseCategorical() if sc["kind"] == "bandit" else SeqPolicy()
    reward = bandit_reward if sc["kind"] == "bandit" else seq_reward
    cfg = {"kl_coeff": 0.0, "learning_rate": 0.05, "max_grad_norm": 0.5, **sc["cfg"], **extra}
    cfg["micro_batch_size"] = cfg.get("micro_batch_size") if batch_size == LOCAL_B else None
    config = GRPOConfig(group_size=GROUP, batch_size=batch_size, seed=0, **cfg)
    return GRPOTrainer(config, policy, reward)


def data(name: str, world: int = 2) -> dict[str, Tensor]:
    sc = SCENARIOS[name]
    return make_data(sc["kind"], world, LOCAL_B, GROUP, sc["gates"])


def params(trainer: GRPOTrainer) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in trainer.policy.get_parameters().items()}


def train_state(trainer: GRPOTrainer) -> dict[str, Any]:
    """What the state_dict round trip saves: weights, optimizer state, shuffler state, step."""
    assert trainer.optimizer is not None
    return {
        "policy": {k: v.detach().clone() for k, v in trainer.policy.get_parameters().items()},
        "optimizer": trainer.optimizer.state_dict(),
        "generator": trainer.generator.get_state(),
        "step_count": trainer.step_count,
    }


def load_train_state(trainer: GRPOTrainer, state: dict[str, Any]) -> None:
    assert trainer.optimizer is not None
    with torch.no_grad():
        for k, p in trainer.policy.get_parameters().items():
            p.copy_(state["policy"][k])
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.generator.set_state(state["generator"])
    trainer.step_count = state["step_count"]


def run_steps(
    trainer: GRPOTrainer, d: dict[str, Tensor], rows: slice, steps: range
) -> list[dict[str, float]]:
    return [trainer.step(d["states"][s, rows], noise=d["noise"][s, rows]) for s in steps]


# ---- launching W processes ---------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world: int, port: int, fn: Callable[[int, int, Path], None], out: str) -> None:
    os.setpgid(0, 0)  # this worker and what it starts (a compiler, say) form one process group
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    try:
        fn(rank, world, Path(out))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    # Done and results written: leave without interpreter teardown, where gloo's C++ threads can
    # abort the process ("terminate called without an active exception", SIGABRT) after all the
    # work is done (pytorch/pytorch#190489 and related reports).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(
    fn: Callable[[int, int, Path], None],
    out: Path,
    world: int = 2,
    timeout: float = 90.0,
    *,
    on_timeout: Callable[[float], str] | None = None,
) -> None:
    """Run ``fn(rank, world, out)`` on ``world`` spawned processes; the trainer joins the group
    from the torchrun-style environment variables set here. Each worker leads its own process
    group; after ``timeout`` every worker is killed with everything it started (a compiler, a
    launcher's workers), and `TimeoutError` says so, with ``on_timeout(start time)``'s note.

    A worker killed by SIGABRT (gloo's teardown abort, see `_entry`) gets the whole launch rerun
    once; any other failure, or a second abort, fails the test.
    """
    try:
        _launch_once(fn, out, world, timeout, on_timeout)
    except mp.ProcessExitedException as e:
        if e.signal_name != "SIGABRT":
            raise
        warnings.warn(f"distributed workers aborted ({e}); rerunning once", RuntimeWarning, stacklevel=2)
        _launch_once(fn, out, world, timeout, on_timeout)


def _launch_once(
    fn: Callable[[int, int, Path], None],
    out: Path,
    world: int,
    timeout: float,
    on_timeout: Callable[[float], str] | None,
) -> None:
    started = time.time()
    args = (world, free_port(), fn, str(out))
    ctx = mp.start_processes(_entry, args=args, nprocs=world, join=False, start_method="spawn")
    pids = [p.pid for p in ctx.processes if p.pid is not None]
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for pid in pids:
                    kill_tree(pid)
                note = "" if on_timeout is None else " " + on_timeout(started)
                raise TimeoutError(
                    f"distributed workers did not finish within {timeout} s (deadlock?); killed with "
                    f"their process groups.{note}"
                )
    finally:
        for pid in pids:  # leftovers of a failed run: a worker's compiler outlives torch's terminate()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc; empty where /proc is missing)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int, wait: float = 10.0) -> None:
    """SIGKILL ``pid``, every process below it and their process groups (torchrun starts each
    worker in a session of its own; a worker's compiler runs in the worker's group), never the
    test process's own group; then wait up to ``wait`` s until they are gone (files closed)."""
    own = os.getpgrp()
    pids = [pid, *_descendants(pid)]
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            group = os.getpgid(p)
            if group != own:
                os.killpg(group, signal.SIGKILL)
            os.kill(p, signal.SIGKILL)
    deadline = time.monotonic() + wait
    while any(is_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def is_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return state not in ("Z", "X")


def tmpdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="grpo-dist-"))


# ---- what each of the 2 processes runs (module level: spawn pickles it by name) ------------------
def worker_main(rank: int, world: int, out: Path) -> None:
    """Every scenario for STEPS steps on this rank's shard, plus resume and error cases.

    Writes ``rank{r}.pt``; rank 0 alone writes ``from2.pt``, the training state after 3 steps.
    """
    from grpo.engine.distributed import barrier, is_main_process, reseed_other_ranks
    from grpo.policies import categorical_mlp

    rows = slice(rank * LOCAL_B, (rank + 1) * LOCAL_B)
    res: dict[str, Any] = {}
    for name in SCENARIOS:
        tr = build(name, LOCAL_B)
        d = data(name, world)
        metrics = []
        for s in range(STEPS):
            if name == "bandit_deferred" and s == 3 and is_main_process():
                torch.save(train_state(tr), out / "from2.pt")
            metrics.append(tr.step(d["states"][s, rows], noise=d["noise"][s, rows]))
        res[name] = {"params": params(tr), "metrics": metrics, "non_finite": tr.non_finite_steps}
    barrier()

    # resume on 2 processes from the state a single process saved after 3 steps
    tr = build("bandit_deferred", LOCAL_B)
    load_train_state(tr, torch.load(out / "from1.pt", weights_only=True))
    torch.manual_seed(7)  # the same restored RNG state on both ranks, as after loading a checkpoint
    reseed_other_ranks(seed=0, step=tr.step_count)
    res["draw_after_resume"] = torch.rand(3)
    run_steps(tr, data("bandit_deferred", world), rows, range(3, STEPS))
    res["resume_from1"] = params(tr)

    # rank 1 passes one state fewer: the same single optimizer step, so it works and equals one
    # process on the union of the states (rows 0..LOCAL_B + LOCAL_B - 2 of the global batch)
    tr = build("bandit_deferred", LOCAL_B)
    d = data("bandit_deferred", world)
    b = LOCAL_B - rank
    short = slice(rank * LOCAL_B, rank * LOCAL_B + b)
    res["short_metrics"] = run_steps(tr, d, short, range(STEPS))
    res["short"] = params(tr)

    # with mini-batches of 2 states, rank 1's single state gives 1 optimizer step, rank 0's 4 give
    # 2: every rank must raise, none may hang
    tr = build("bandit_deferred", LOCAL_B, mini_batch_size=2, micro_batch_size=None)
    b = LOCAL_B if rank == 0 else 1
    try:
        tr.step(d["states"][0, rank * LOCAL_B : rank * LOCAL_B + b], noise=d["noise"][0, :b])
    except ValueError as e:
        res["unequal"] = str(e)

    # a different policy on rank 1
    torch.manual_seed(0)
    policy = categorical_mlp(OBS, ARMS, hidden=(8,) if rank == 0 else (9,))
    try:
        GRPOTrainer(GRPOConfig(group_size=GROUP, batch_size=LOCAL_B, kl_coeff=0.0), policy, bandit_reward)
    except ValueError as e:
        res["layout"] = str(e)
    # GRPOTrainer.train on a Tensor source: each rank steps on its share of each global batch, and
    # only rank 0 writes to sinks
    seen: list[int] = []

    def reward(states: Tensor, actions: Tensor) -> Tensor:
        seen.extend(int(i) for i in states[:, 0].unique().tolist())
        return (actions == 0).float()

    class Sink:
        writes = 0

        def write(self, metrics: Any, step: int) -> None:
            Sink.writes += 1

        def flush(self) -> None: ...

        def close(self) -> None: ...

    source = torch.cat([torch.arange(16.0).unsqueeze(1), torch.zeros(16, OBS - 1)], 1)
    torch.manual_seed(0)
    tr = GRPOTrainer(
        GRPOConfig(group_size=GROUP, batch_size=2, kl_coeff=0.0, seed=0),
        categorical_mlp(OBS, ARMS, hidden=(8,)),
        reward,
    )
    tr.train(source, 2, sinks=[Sink()], progress=False)
    res["train_seen"], res["train_writes"] = sorted(set(seen)), Sink.writes
    torch.save(res, out / f"rank{rank}.pt")


def checkpoint_worker(rank: int, world: int, out: Path) -> None:
    """With `GRPOTrainer.save_checkpoint` / `load_checkpoint` (grpo/state/checkpoint/): every rank
    saves after 3 steps into ``ckpt2`` and goes on to STEPS; then a fresh trainer resumes from
    ``ckpt1``, saved by one process after 3 steps. Writes ``ckpt-rank{r}.pt``."""
    from grpo.engine.distributed import barrier

    rows = slice(rank * LOCAL_B, (rank + 1) * LOCAL_B)
    d = data(CHECKPOINT_SCENARIO, world)
    tr = build(CHECKPOINT_SCENARIO, LOCAL_B)
    run_steps(tr, d, rows, range(3))
    tr.save_checkpoint(out / "ckpt2")  # type: ignore[attr-defined]
    barrier()
    run_steps(tr, d, rows, range(3, STEPS))
    res: dict[str, Any] = {"uninterrupted": params(tr)}

    tr = build(CHECKPOINT_SCENARIO, LOCAL_B)
    tr.load_checkpoint(out / "ckpt1")  # type: ignore[attr-defined]
    res["step_count"] = tr.step_count
    run_steps(tr, d, rows, range(3, STEPS))
    res["resumed_from1"] = params(tr)
    torch.save(res, out / f"ckpt-rank{rank}.pt")


#: KL on (the reference policy is saved too), 2 epochs (optimizer state of several steps)
CHECKPOINT_SCENARIO = "bandit_zero_var"
