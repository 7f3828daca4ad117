"""Async rollouts (`grpo.generation.async_rollouts`, `grpo.training.prefetch`): policy versions,
the default sampler correction, k = 0 equal to the synchronous step, exactly-once data on resume.

`CopyEngine` is a real engine with its own copy of the weights that generates when a batch is
submitted (so the staleness arithmetic is exact and fast to test); the worker-process engine is
tested in tests/test_generation_worker.py.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
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


@pytest.mark.slow
def test_sigkill_at_random_points_neither_skips_nor_repeats_a_batch(tmp_path: Any) -> None:
    """A real async run (a generation worker one step ahead, a checkpoint every step) killed with
    SIGKILL at random moments and resumed each time: the steps recorded in the run's file (which
    a resume truncates to its checkpoint) trained on the data positions 0, 1, 2, ... in order,
    each once, as an uninterrupted `PromptBatches` deals them."""
    import json
    import random
    import signal
    import subprocess
    import sys
    import time

    from grpo.llm import PromptBatches
    from grpo.llm.tiny import build_tiny_model, build_tiny_tokenizer
    from tests.data.async_kill_run import RECORDS

    model_dir = tmp_path / "model"
    build_tiny_model(str(model_dir), build_tiny_tokenizer(str(model_dir)), hidden=16, layers=1)
    out, steps, rng = tmp_path / "run", 30, random.Random(0)
    cmd = [sys.executable, "tests/data/async_kill_run.py", str(model_dir), str(out), str(steps), "1"]
    kills = 0
    for attempt in range(8):
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if attempt < 3:  # kill at a random moment after this attempt has trained a step
            _wait_for_a_new_step(out / "metrics.jsonl", proc)
            time.sleep(rng.uniform(0.0, 0.15))
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                kills += 1
        _, err = proc.communicate(timeout=300)
        if proc.returncode == 0:
            break
        assert proc.returncode == -signal.SIGKILL, err[-3000:]
    assert proc.returncode == 0, err[-2000:]
    assert kills >= 2
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    dealt = PromptBatches(RECORDS, 2, shuffle=True, seed=0, epochs=None)
    expected = [[float(s["id"]) for s in next(dealt)] for _ in range(steps)]
    assert [[r["data/id0"], r["data/id1"]] for r in records] == expected


def _wait_for_a_new_step(metrics: Any, proc: Any, timeout: float = 120.0) -> None:
    """Until the run's JSONL file holds one more record than when the attempt started (or the
    process ended)."""
    import time

    def count() -> int:
        return len(metrics.read_text().splitlines()) if metrics.exists() else 0

    start, t0 = count(), time.monotonic()
    while proc.poll() is None and count() <= start and time.monotonic() - t0 < timeout:
        time.sleep(0.02)
