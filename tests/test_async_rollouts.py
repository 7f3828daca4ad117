"""Async rollouts (`grpo.generation.async_rollouts`, `grpo.training.prefetch`): policy versions,
the default sampler correction, k = 0 equal to the synchronous step, exactly-once data on resume.

`CopyEngine` is a real engine with its own copy of the weights that generates when a batch is
submitted (so the staleness arithmetic is exact and fast to test); the worker-process engine is
tested in tests/test_generation_worker.py.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from grpo import GRPOConfig, GRPOTrainer
from grpo.generation import Generated, InProcessEngine, ReadyGeneration
from grpo.policies import DistributionPolicy
from grpo.policy_base import PolicyModel
from grpo.training.callbacks import Callback, TrainState
from tests.conftest import bandit_policy


class CopyEngine:
    """Generates with its own copy of the policy, at submission; `sync` loads the weights."""

    owns_weights = True

    def __init__(self, policy: DistributionPolicy) -> None:
        self.copy = copy.deepcopy(policy)
        self._version = 0
        self.syncs = 0
        self.last_sync_seconds = 0.0

    @property
    def version(self) -> int:
        return self._version

    def submit(
        self, states: Any, num_actions_per_state: int, *, with_log_probs: bool, **kw: Any
    ) -> ReadyGeneration:
        with torch.no_grad():
            actions, logp = self.copy.generate_actions_with_log_probs(states, num_actions_per_state)
        return ReadyGeneration(Generated(states, actions, logp, self._version))

    def sync(self, policy: PolicyModel, version: int) -> None:
        self.copy.load_state_dict(policy.state_dict())  # type: ignore[attr-defined]
        self._version = version
        self.syncs += 1

    def close(self) -> None:
        return None


def reward(states: Tensor, actions: Tensor) -> Tensor:
    return (actions == 3).float()


class Batches(Iterator[Tensor]):
    """A checkpointed source: batch k is a (4, 1) tensor filled with k."""

    def __init__(self) -> None:
        self.position = 0

    def __next__(self) -> Tensor:
        self.position += 1
        return torch.full((4, 1), float(self.position - 1))

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


class Seen(Callback):
    """Records, per step, the batch id trained on and the policy versions that sampled it."""

    def __init__(self) -> None:
        self.batches: list[int] = []
        self.versions: list[list[int]] = []

    def on_step_end(self, state: TrainState, metrics: Any) -> None:
        batch = state.trainer.last_batch  # type: ignore[attr-defined]
        self.batches.append(int(batch.states[0, 0]))
        self.versions.append(sorted(set(batch.policy_versions.tolist())))


def trainer(k: int, engine: Any = "copy", **kw: Any) -> GRPOTrainer:
    torch.manual_seed(0)
    policy = bandit_policy(6)
    eng = CopyEngine(policy) if engine == "copy" else engine
    cfg = GRPOConfig(group_size=4, batch_size=4, learning_rate=0.1, seed=0, async_staleness=k, **kw)
    return GRPOTrainer(cfg, policy, reward, engine=eng)


def test_an_explicit_in_process_engine_is_bitwise_the_default() -> None:
    torch.manual_seed(0)
    a_policy = bandit_policy(6)
    b_policy = copy.deepcopy(a_policy)
    cfg = GRPOConfig(group_size=4, batch_size=4, learning_rate=0.1, seed=0, num_epochs_per_update=2)
    a = GRPOTrainer(cfg, a_policy, reward)
    b = GRPOTrainer(cfg, b_policy, reward, engine=InProcessEngine(b_policy))
    states = torch.zeros(4, 1)
    for _ in range(3):
        torch.manual_seed(1)
        ma = a.step(states)
        torch.manual_seed(1)
        mb = b.step(states)
        assert {k: v for k, v in ma.items() if not k.startswith("time/")} == {
            k: v for k, v in mb.items() if not k.startswith("time/")
        }
    assert torch.equal(a_policy.net.logits, b_policy.net.logits)  # type: ignore[union-attr]


def test_k0_with_an_engine_of_its_own_equals_the_synchronous_step() -> None:
    """k = 0: each batch is generated after the previous update, by the same numbers."""
    a, b = trainer(0, engine=None), trainer(0)
    torch.manual_seed(1)
    a.train(torch.zeros(8, 1), 4, progress=False)
    torch.manual_seed(1)
    seen = Seen()
    b.train(torch.zeros(8, 1), 4, progress=False, callbacks=[seen])
    assert torch.equal(a.policy.net.logits, b.policy.net.logits)  # type: ignore[attr-defined]
    assert seen.versions == [[0], [1], [2], [3]]  # always the current weights


@pytest.mark.parametrize("k", [1, 2])
def test_each_batch_is_sampled_by_weights_at_most_k_steps_old_and_corrected(k: int) -> None:
    t, seen = trainer(k), Seen()
    state = t.train(Batches(), 6, progress=False, callbacks=[seen])
    assert seen.batches == [0, 1, 2, 3, 4, 5]
    assert seen.versions == [[max(0, s - k)] for s in range(6)]  # submitted k steps ahead
    assert [r["async/staleness"] for r in state.history] == [min(s, k) for s in range(6)]
    assert all(r["async/sync_seconds"] == 0.0 for r in state.history)  # the engine's own figure
    # the behaviour log-probs are the trainer's; the weights are the ratio to the sampler's
    weights = [r["sampler/is_weight_mean"] for r in state.history]
    assert weights[0] == 1.0  # step 0: sampled by the weights it trains
    assert all(w != 1.0 for w in weights[k + 1 :])  # stale batches are reweighted
    assert t.config.effective_sampler_is_cap == 2.0  # on by default


def test_a_step_takes_its_prefetched_batch_in_order() -> None:
    """A Tensor batch is matched by value (the trainer moves Tensors to its device each time);
    another batch than the next prefetched one is refused before any weight changes."""
    t = trainer(1)
    t.prefetch(torch.zeros(4, 1))
    t.prefetch(torch.ones(4, 1))
    t.step(torch.zeros(4, 1))  # an equal Tensor, not the same object
    assert t.last_batch is not None
    assert torch.equal(t.last_batch.states, torch.zeros(4, 1))
    before = t.policy.net.logits.detach().clone()  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="not the next prefetched batch"):
        t.step(torch.full((4, 1), 2.0))
    assert torch.equal(t.policy.net.logits, before)  # type: ignore[attr-defined]


def test_an_in_process_engine_refuses_async() -> None:
    with pytest.raises(ValueError, match="engine with its own copy of the weights"):
        trainer(1, engine=None)


class LaggingEngine(CopyEngine):
    """Reports actions as sampled by the version before its last sync."""

    def submit(
        self, states: Any, num_actions_per_state: int, *, with_log_probs: bool, **kw: Any
    ) -> ReadyGeneration:
        gen = super().submit(states, num_actions_per_state, with_log_probs=with_log_probs).result()
        return ReadyGeneration(Generated(gen.states, gen.actions, gen.log_probs, max(0, self.version - 1)))


def test_a_stale_batch_without_the_correction_is_refused() -> None:
    torch.manual_seed(0)
    policy = bandit_policy(6)
    t = GRPOTrainer(
        GRPOConfig(group_size=4, batch_size=4, seed=0), policy, reward, engine=LaggingEngine(policy)
    )
    t.step(torch.zeros(4, 1))  # version 0 sampled by version 0
    before = policy.net.logits.detach().clone()  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="sampled by policy version 0, but the trainer is at version 1"):
        t.step(torch.zeros(4, 1))
    assert torch.equal(policy.net.logits, before)  # type: ignore[union-attr]  # no weight changed


@pytest.mark.parametrize("k", [1, 3])
def test_a_resumed_async_run_neither_skips_nor_repeats_a_batch(k: int, tmp_path: Any) -> None:
    """Checkpoints hold the source at the batches trained, not at those drawn ahead."""
    first, seen_a = trainer(k, checkpoint_freq=2), Seen()
    source = Batches()
    first.register_checkpoint_state("data", source)
    first.train(source, 5, checkpoint_dir=tmp_path, progress=False, callbacks=[seen_a])
    assert source.position == 5  # drawn ahead, then put back at the end of the run
    second, seen_b = trainer(k, checkpoint_freq=2), Seen()
    source_b = Batches()
    second.register_checkpoint_state("data", source_b)
    # resume from step 4's checkpoint (written while k batches were drawn ahead)
    second.train(
        source_b,
        9,
        resume_from=tmp_path / "step-00000004",
        checkpoint_dir=tmp_path / "b",
        progress=False,
        callbacks=[seen_b],
    )
    assert seen_a.batches == [0, 1, 2, 3, 4]
    assert seen_b.batches == [4, 5, 6, 7, 8]  # step 4 is redone after the checkpoint of step 4


def _comparable(record: dict[str, float]) -> dict[str, float | str]:
    """A step record without its timings (the only keys that differ between equal runs), NaN as
    the string "nan" (equal to itself)."""
    timed = ("time/", "throughput/", "async/sync_seconds")
    return {k: "nan" if v != v else v for k, v in record.items() if not k.startswith(timed)}


@pytest.mark.parametrize(("k", "resume_at"), [(1, 3), (2, 3), (3, 4)])
def test_a_resumed_async_run_is_the_uninterrupted_one_bit_for_bit(
    k: int, resume_at: int, tmp_path: Any
) -> None:
    """The checkpoint holds the k generations drawn ahead (sampled by versions r-k .. r-1); the
    resumed run trains on exactly them, so its batches, versions, records and weights are the
    uninterrupted run's. Before the checkpoint held them, the resumed run sampled batches r ..
    r+k-1 again with version r (``async/staleness`` 0 where the uninterrupted run had k)."""
    runs = []
    for resume in (None, tmp_path / "a" / f"step-{resume_at:08d}"):
        t, seen, source = trainer(k, checkpoint_freq=1, checkpoint_keep_last=None), Seen(), Batches()
        t.register_checkpoint_state("data", source)
        out = tmp_path / ("a" if resume is None else "b")
        state = t.train(source, 8, checkpoint_dir=out, resume_from=resume, progress=False, callbacks=[seen])
        runs.append((seen, [_comparable(r) for r in state.history], t.policy.state_dict()))
    (seen_a, records_a, weights_a), (seen_b, records_b, weights_b) = runs
    assert seen_b.batches == seen_a.batches[resume_at:]
    assert seen_b.versions == seen_a.versions[resume_at:]
    assert [r["async/staleness"] for r in records_a[resume_at:]] == [float(k)] * (8 - resume_at)
    assert records_b == records_a[resume_at:]
    assert weights_b.keys() == weights_a.keys()
    assert all(torch.equal(weights_a[n], weights_b[n]) for n in weights_a)


def _script_env() -> dict[str, str]:
    """The environment of a script run as a subprocess: this checkout's ``grpo`` first on the
    path (a script's own directory comes first otherwise, and ``grpo`` would be the installed one)."""
    import os

    root = str(Path(__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}


def _run_killed(
    cmd: list[str], out: Any, *, kills: int, seed: int, steps: int, after_record: bool = False
) -> int:
    """Run ``cmd`` (`tests/data/async_kill_run.py`) until it finishes, killing the first ``kills``
    attempts with SIGKILL at a random point (seeded): once the attempt has checkpointed a randomly
    drawn step before the last two, after a random 0-50 ms more (a kill point chosen by step, not
    by time, so that a fast machine does not finish the run before the kill); the number of kills
    that landed. ``after_record``: once the run's JSONL file holds that step's record instead,
    after a random 0-150 ms more: the record is written just before the step's checkpoint, so the
    kill lands while that checkpoint is written or early in the next step."""
    import random
    import signal
    import subprocess

    rng, landed = random.Random(seed), 0
    latest = out / "checkpoints" / "latest"
    for attempt in range(kills + 3):
        start, started = _checkpointed_step(latest), _line_count(out / "starts.txt")
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_script_env()
        )
        if attempt < kills and start < steps - 2:
            step = rng.randint(start + 1, steps - 2)
            if after_record:
                _wait_for_a_record(out, proc, step, started)
            else:
                _wait_for_a_checkpoint(latest, proc, step)
            time.sleep(rng.uniform(0.0, 0.15 if after_record else 0.05))
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                landed += 1
        _, err = proc.communicate(timeout=300)
        if proc.returncode == 0:
            return landed
        assert proc.returncode == -signal.SIGKILL, err[-3000:]
    raise AssertionError(f"the run did not finish after {kills + 3} attempts")


def _checkpointed_step(latest: Path) -> int:
    """The step of the checkpoint ``latest`` names (``step-00000005`` -> 5); 0 before the first."""
    try:
        return int(latest.read_text().strip().rsplit("-", 1)[1])
    except (OSError, ValueError, IndexError):
        return 0


def _wait_for_a_checkpoint(latest: Path, proc: Any, step: int, timeout: float = 300.0) -> None:
    """Until ``latest`` names a checkpoint of step ``step`` or later (or the process ended)."""
    t0 = time.monotonic()
    while proc.poll() is None and _checkpointed_step(latest) < step and time.monotonic() - t0 < timeout:
        time.sleep(0.005)


def _line_count(path: Path) -> int:
    """The number of lines of ``path`` (0 while it does not exist)."""
    return len(path.read_text().splitlines()) if path.exists() else 0


def _wait_for_a_record(out: Path, proc: Any, step: int, started: int, timeout: float = 300.0) -> None:
    """Until this attempt has started training (``out/starts.txt`` holds more than ``started``
    lines: its resume has truncated the JSONL file to its checkpoint) and the run's JSONL file holds
    ``step`` records, or the process ended. Without the first wait, the records an earlier killed
    attempt wrote after its last checkpoint could satisfy the count before this attempt began."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and _line_count(out / "starts.txt") <= started and time.monotonic() < deadline:
        time.sleep(0.005)
    while proc.poll() is None and _line_count(out / "metrics.jsonl") < step and time.monotonic() < deadline:
        time.sleep(0.005)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _run_output(out: Any) -> tuple[list[dict[str, float]], list[Any], dict[str, Tensor]]:
    """A finished run's step records (without timings), per-step completions and final weights."""
    import json

    from safetensors.torch import load_file

    records = [_comparable(json.loads(line)) for line in (out / "metrics.jsonl").read_text().splitlines()]
    completions = [
        json.loads((out / "completions" / f"step-{r['step']:.0f}.json").read_text()) for r in records
    ]
    latest = (out / "checkpoints" / "latest").read_text().strip()
    return records, completions, load_file(out / "checkpoints" / latest / "policy.safetensors")


@pytest.mark.parametrize(
    ("k", "steps", "kills", "after_record"),
    [
        (1, 6, 1, False),
        pytest.param(1, 10, 3, True, marks=pytest.mark.slow, id="1-10-3-after_record"),
        pytest.param(2, 10, 3, False, marks=pytest.mark.slow),
    ],
)
def test_a_worker_run_killed_at_random_points_resumes_bit_for_bit(
    k: int, steps: int, kills: int, after_record: bool, tmp_path: Any
) -> None:
    """A tiny causal LM with a real generation worker k steps ahead, a checkpoint every step,
    killed with SIGKILL at random moments (seeded) and resumed each time, equals the uninterrupted
    run: the same step records (``async/staleness`` included), the same completions (token ids
    and texts, with the versions that sampled them) at every step, the same final weights; and
    no worker process outlives its trainer. Both runs trained on the data positions 0, 1, 2, ...
    in order, each once, as an uninterrupted `PromptBatches` deals them (the records carry the
    prompts' ids). The kills land early in a step, or (``after_record``) while a step's checkpoint
    is written or early in the next step (see `_run_killed`)."""
    import sys

    from grpo.llm import PromptBatches
    from grpo.llm.tiny import build_tiny_model, build_tiny_tokenizer
    from tests.data.async_kill_run import RECORDS

    model_dir = tmp_path / "model"
    build_tiny_model(str(model_dir), build_tiny_tokenizer(str(model_dir)), hidden=16, layers=1)
    outs = (tmp_path / "uninterrupted", tmp_path / "killed")
    cmds = [
        [sys.executable, "tests/data/async_kill_run.py", str(model_dir), str(o), str(steps), str(k)]
        for o in outs
    ]
    assert _run_killed(cmds[0], outs[0], kills=0, seed=0, steps=steps) == 0
    landed = _run_killed(cmds[1], outs[1], kills=kills, seed=k, steps=steps, after_record=after_record)
    assert landed >= 1
    starts = [int(s) for s in (outs[1] / "starts.txt").read_text().split()]
    assert any(0 < s < steps for s in starts), starts  # resumed from a checkpoint, then trained
    (records_a, completions_a, weights_a), (records_b, completions_b, weights_b) = map(_run_output, outs)
    assert [r["step"] for r in records_b] == list(range(1, steps + 1))
    dealt = PromptBatches(RECORDS, 2, shuffle=True, seed=0, epochs=None)
    expected = [[float(s["id"]) for s in next(dealt)] for _ in range(steps)]
    assert [[r["data/id0"], r["data/id1"]] for r in records_a] == expected
    assert [r["async/staleness"] for r in records_a[k:]] == [float(k)] * (steps - k)
    assert records_b == records_a
    assert completions_b == completions_a
    assert weights_b.keys() == weights_a.keys()
    assert all(torch.equal(weights_a[n], weights_b[n]) for n in weights_a)
    pids = [int(p) for out in outs for p in (out / "worker_pids.txt").read_text().split()]
    assert len(pids) >= 2 + landed
    deadline = time.monotonic() + 30
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, pids)), [p for p in pids if _alive(p)]


def _saved_async_run(k: int, tmp_path: Path) -> tuple[GRPOTrainer, Path]:
    """A run of 5 steps (k ahead) checkpointed every step; the trainer and step 2's checkpoint."""
    t, source = trainer(k, checkpoint_freq=1, checkpoint_keep_last=None), Batches()
    t.register_checkpoint_state("data", source)
    t.train(source, 5, checkpoint_dir=tmp_path, progress=False)
    return t, tmp_path / "step-00000002"


def test_a_tampered_pending_generation_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    """A checkpoint is untrusted: a pending generation's bad field is one CheckpointError naming
    it, raised before the trainer changes (its weights and step count stay)."""
    import json

    from grpo.state.checkpoint import CheckpointError

    _, ckpt = _saved_async_run(1, tmp_path)
    meta = json.loads((ckpt / "state.json").read_text())
    assert meta["tree"]["components"]["async_rollouts"]["pending"][0]["version"] == 1
    meta["tree"]["components"]["async_rollouts"]["pending"][0]["version"] = -1
    (ckpt / "state.json").write_text(json.dumps(meta))
    fresh = trainer(1)
    fresh.register_checkpoint_state("data", Batches())
    before = {n: p.clone() for n, p in fresh.policy.state_dict().items()}  # type: ignore[attr-defined]
    with pytest.raises(
        CheckpointError, match=r"async_rollouts\.pending\[0\]\.version: must be an integer >= 0"
    ):
        fresh.load_checkpoint(ckpt)
    assert fresh.step_count == 0
    assert all(torch.equal(p, before[n]) for n, p in fresh.policy.state_dict().items())  # type: ignore[attr-defined]


def test_more_pending_generations_than_the_staleness_are_refused(tmp_path: Path) -> None:
    from grpo.state.checkpoint import CheckpointError

    _, ckpt = _saved_async_run(2, tmp_path)
    fresh = trainer(1)
    fresh.register_checkpoint_state("data", Batches())
    with pytest.raises(CheckpointError, match="2 pending generations, but async_staleness=1 keeps at most 1"):
        fresh.load_checkpoint(ckpt)


def test_a_resume_that_draws_other_states_is_refused(tmp_path: Path) -> None:
    """The pending generation was sampled for other states than the resumed run draws: refused
    at the draw, before the step trains on it."""
    _, ckpt = _saved_async_run(1, tmp_path)
    other, source = trainer(1), Batches()
    other.register_checkpoint_state("data", source)
    other.load_checkpoint(ckpt)
    source.position = 7  # a source that does not stand where the checkpoint said
    with pytest.raises(RuntimeError, match="drew other states than the ones the checkpoint's pending"):
        other.prefetch(next(source))


def test_a_synchronous_trainer_drops_the_pending_generations_with_a_warning(tmp_path: Path) -> None:
    """k = 0 resumes an async checkpoint (the batches drawn ahead are sampled again), and an async
    trainer loads a state without the component (a synchronous run's, or an older checkpoint)."""
    _, ckpt = _saved_async_run(1, tmp_path)
    sync = trainer(0, engine=CopyEngine(bandit_policy(6)))
    sync.register_checkpoint_state("data", Batches())
    with pytest.warns(RuntimeWarning, match="holds 1 generation"):
        sync.load_checkpoint(ckpt)
    assert sync.step_count == 2
    state = sync.state_dict()
    assert "async_rollouts" not in state["components"]
    again = trainer(1)
    again.register_checkpoint_state("data", Batches())
    again.load_state_dict(state)
    assert again.step_count == 2
    assert again.collector.engine.state_dict() == {"pending": []}  # type: ignore[attr-defined]


def test_completions_round_trip_exactly_and_bad_ids_are_refused() -> None:
    """`generation_state` / `restored_generation` on Completions: the same ids, texts, flags,
    log-probs (a `PolicyOutput` with its mask) and version; lengths that do not add up, or a
    negative id, are a ValueError naming the field."""
    from grpo.generation.pending_state import generation_state, restored_generation
    from grpo.llm.policy import Completion
    from grpo.policy_base import PolicyOutput

    groups = [
        [
            Completion(torch.tensor([5, 6]), torch.tensor([7, 8, 2]), "ab", True, 0.7, 1),
            Completion(torch.tensor([5, 6]), torch.tensor([9]), "c", False),
        ]
    ]
    lp = PolicyOutput(
        torch.tensor([[-0.5, -1.0, -2.0], [-0.25, 0.0, 0.0]]), torch.tensor([[1, 1, 1], [1, 0, 0]]).bool()
    )
    state = generation_state(Generated([{"prompt": "x"}], groups, lp, 3))
    assert state is not None
    tensors = [v for v in (*state.values(), *state["log_probs"].values()) if isinstance(v, Tensor)]
    n, p, t, t_max = 2, 2 + 2, 3 + 1, 3  # samples, prompt and completion ids in all, longest
    assert sum(v.numel() * v.element_size() for v in tensors) == 8 * (p + t + 2 * n) + 5 * n * t_max
    back = restored_generation(state, "p")
    assert back.version == 3
    assert back.states_digest == state["states_digest"]
    fields = ("text", "finished", "temperature", "min_new_tokens", "loss_mask")
    for c, d in zip(back.actions[0], groups[0], strict=True):
        assert torch.equal(c.prompt_ids, d.prompt_ids)
        assert torch.equal(c.token_ids, d.token_ids)
        assert [getattr(c, f) for f in fields] == [getattr(d, f) for f in fields]
    assert isinstance(back.log_probs, PolicyOutput)
    assert torch.equal(back.log_probs.log_probs, lp.log_probs)
    assert torch.equal(back.log_probs.mask, lp.mask)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"p\.token_ids: must be an int64 Tensor of shape \(5,\)"):
        restored_generation({**state, "token_lengths": torch.tensor([3, 2])}, "p")
    with pytest.raises(ValueError, match=r"p\.prompt_ids: token ids must lie in \[0, 2\*\*31\)"):
        restored_generation({**state, "prompt_ids": torch.tensor([5, -6, 5, 6])}, "p")
    bad = {**state["log_probs"], "log_probs": torch.full((2, 3), float("nan"))}
    with pytest.raises(ValueError, match=r"p\.log_probs: must hold no NaN"):
        restored_generation({**state, "log_probs": bad}, "p")
