"""train() with checkpoints and resume (needs grpo.state.checkpoint; skipped until it exists)."""

from __future__ import annotations

import csv
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, TensorDataset

from grpo.metrics.sinks import CSVSink, JSONLSink, PeriodicSink, read_jsonl
from grpo.training.callbacks import Callback
from grpo.training.loop import TrainState, iter_state_batches, resume_problem
from tests.loop_toys import bandit_states, correct_arm, make_trainer, params_of

pytest.importorskip("grpo.state.checkpoint")

SCHEDULE = {"lr_schedule": "cosine", "warmup_steps": 2, "total_steps": 12, "kl_coeff": 0.05}


class Saved(Callback):
    def __init__(self) -> None:
        self.events: list[tuple[int, Path]] = []

    def on_checkpoint(self, state: TrainState, path: Path) -> None:
        self.events.append((state.step, path))

    def on_step_end(self, state: TrainState, metrics: Mapping[str, float]) -> None:
        pass


def test_checkpoint_every_freq_steps_and_at_the_end(tmp_path: Path) -> None:
    trainer = make_trainer(checkpoint_freq=2)
    saved = Saved()
    run = trainer.train(
        bandit_states(8), num_steps=5, checkpoint_dir=tmp_path, callbacks=[saved], progress=False
    )
    assert [s for s, _ in saved.events] == [2, 4, 5]
    assert [p for _, p in saved.events] == run.checkpoints
    assert all(p.exists() for p in run.checkpoints)
    assert len(set(run.checkpoints)) == 3


def test_no_duplicate_final_checkpoint(tmp_path: Path) -> None:
    trainer = make_trainer(checkpoint_freq=2)
    run = trainer.train(bandit_states(8), num_steps=4, checkpoint_dir=tmp_path, progress=False)
    assert len(run.checkpoints) == 2


def test_resume_continues_exactly(tmp_path: Path) -> None:
    states = bandit_states(10)
    straight = make_trainer(**SCHEDULE)
    full = straight.train(states, num_steps=6, progress=False)

    first = make_trainer(**SCHEDULE, checkpoint_freq=3)
    first.train(states, num_steps=3, checkpoint_dir=tmp_path, progress=False)
    resumed = make_trainer(**SCHEDULE, checkpoint_freq=3)
    run = resumed.train(states, num_steps=6, checkpoint_dir=tmp_path, resume_from=tmp_path, progress=False)
    assert run.resumed_from is not None
    assert [r["step"] for r in run.history] == [4.0, 5.0, 6.0]
    for key in ("reward/mean", "optim/lr", "kl/ref", "grad/norm"):
        assert [r[key] for r in run.history] == [r[key] for r in full.history[3:]], key
    for p, q in zip(params_of(straight), params_of(resumed), strict=True):
        assert torch.equal(p, q)


# ---- resuming with a DataLoader and other sources ------------------------------------------------
class Seen:
    """A reward that records the states of each step (first of each group of G = 4 copies)."""

    def __init__(self) -> None:
        self.steps: list[Tensor] = []

    def __call__(self, states: Tensor, actions: Tensor) -> Tensor:
        self.steps.append(states[::4].clone())
        return correct_arm(states, actions)


def _stack(items: list[Any]) -> Tensor:
    return torch.stack([x[0] if isinstance(x, (tuple, list)) else x for x in items])


def shuffled_loader(kind: str, seeded: bool = True) -> DataLoader[Any]:
    """20 states in batches of 4 (5 batches per epoch), shuffled: by the loader's generator, by a
    RandomSampler's own generator, or by a DistributedSampler (seed + epoch)."""
    ds = TensorDataset(bandit_states(20, seed=5))
    g = torch.Generator().manual_seed(0) if seeded else None
    if kind == "generator":
        return DataLoader(ds, batch_size=4, shuffle=True, generator=g, collate_fn=_stack)
    if kind == "sampler":
        return DataLoader(ds, batch_size=4, sampler=RandomSampler(ds, generator=g), collate_fn=_stack)
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0)
    return DataLoader(ds, batch_size=4, sampler=sampler, collate_fn=_stack)


@pytest.mark.parametrize("kind", ["generator", "sampler", "distributed"])
@pytest.mark.parametrize("split", [3, 5])  # mid-epoch, and at the end of the first epoch
def test_shuffled_dataloader_resumes_bitwise(tmp_path: Path, kind: str, split: int) -> None:
    """6 steps straight vs `split` steps, a checkpoint, a new process's objects (fresh trainer,
    fresh DataLoader) resuming to 6: the same batches at every step and bitwise equal weights.
    Before the fix the resumed run re-fed the first batches of its loader (max |weight diff| 0.026)."""
    seen_straight, seen_resumed = Seen(), Seen()
    straight = make_trainer(reward=seen_straight, **SCHEDULE)
    full = straight.train(shuffled_loader(kind), num_steps=6, progress=False)

    first = make_trainer(reward=seen_resumed, **SCHEDULE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a seeded loader resumes exactly: no warning
        first.train(shuffled_loader(kind), num_steps=split, checkpoint_dir=tmp_path, progress=False)
        resumed = make_trainer(reward=seen_resumed, **SCHEDULE)
        run = resumed.train(
            shuffled_loader(kind), num_steps=6, checkpoint_dir=tmp_path, resume_from=tmp_path, progress=False
        )
    assert [r["step"] for r in run.history] == [float(s) for s in range(split + 1, 7)]
    assert len(seen_straight.steps) == len(seen_resumed.steps) == 6
    for a, b in zip(seen_straight.steps, seen_resumed.steps, strict=True):
        assert torch.equal(a, b)
    epochs = [torch.cat(seen_straight.steps[:5]), seen_straight.steps[5]]
    assert sorted(epochs[0][:, 0].tolist()) == sorted(bandit_states(20, seed=5)[:, 0].tolist())
    assert [r["reward/mean"] for r in run.history] == [r["reward/mean"] for r in full.history[split:]]
    for p, q in zip(params_of(straight), params_of(resumed), strict=True):
        assert torch.equal(p, q)


def test_each_epoch_of_a_seeded_loader_has_its_own_order() -> None:
    """Epoch e is seeded with seed + e: epochs differ, and epoch 0 is the loader's own first order."""
    loader = shuffled_loader("generator")
    own_first = [b.clone() for b in shuffled_loader("generator")]
    batches = iter_state_batches(loader, 4)
    epoch0 = [next(batches) for _ in range(5)]
    epoch1 = [next(batches) for _ in range(5)]
    assert all(torch.equal(a, b) for a, b in zip(epoch0, own_first, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(epoch0, epoch1, strict=True))
    again = iter_state_batches(shuffled_loader("generator"), 4, start=7)  # epoch 1, batch 2
    assert torch.equal(next(again), epoch1[2])


def test_unseeded_shuffled_dataloader_warns_once_with_the_fix(tmp_path: Path) -> None:
    trainer = make_trainer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(shuffled_loader("generator", seeded=False), 2, checkpoint_dir=tmp_path, progress=False)
    messages = [str(w.message) for w in caught if "resume" in str(w.message)]
    assert len(messages) == 1
    assert "DataLoader whose RandomSampler shuffles without a seeded generator" in messages[0]
    assert "generator=torch.Generator().manual_seed(0)" in messages[0]
    assert "register_checkpoint_state" in messages[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no checkpoint, no resume: nothing to warn about
        trainer.train(shuffled_loader("generator", seeded=False), 4, progress=False)


def test_iterator_source_warns_when_checkpointing(tmp_path: Path) -> None:
    trainer = make_trainer()
    batches = (bandit_states(4, seed=s) for s in range(3))
    with pytest.warns(UserWarning, match=r"an iterator \(generator\), which cannot be repositioned"):
        trainer.train(batches, 2, checkpoint_dir=tmp_path, progress=False)
    assert resume_problem(iter([1])) is not None
    assert resume_problem(bandit_states(4)) is None
    assert resume_problem([1, 2]) is None
    assert resume_problem(lambda n: bandit_states(n)) is None
    assert resume_problem(shuffled_loader("sampler", seeded=False)) is not None
    assert resume_problem(DataLoader(bandit_states(8), batch_size=4)) is None  # no shuffling


class StatefulBatches:
    """A data source that keeps its own position: state_dict / load_state_dict."""

    def __init__(self) -> None:
        self.data = bandit_states(12, seed=9)
        self.position = 0

    def __iter__(self) -> Iterator[Tensor]:
        while self.position < 3:
            self.position += 1
            yield self.data[(self.position - 1) * 4 : self.position * 4]
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.position = int(state["position"])


def test_registered_stateful_source_resumes_from_its_own_state(tmp_path: Path) -> None:
    seen_straight, seen_resumed = Seen(), Seen()
    straight = make_trainer(reward=seen_straight)
    straight.train(StatefulBatches(), num_steps=5, progress=False)

    first = make_trainer(reward=seen_resumed)
    source = StatefulBatches()
    first.register_checkpoint_state("data", source)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first.train(source, num_steps=2, checkpoint_dir=tmp_path, progress=False)
        resumed, fresh = make_trainer(reward=seen_resumed), StatefulBatches()
        resumed.register_checkpoint_state("data", fresh)
        resumed.train(fresh, num_steps=5, checkpoint_dir=tmp_path, resume_from=tmp_path, progress=False)
    assert fresh.position == 2  # restored at 2: batch 3 of the first pass, then batches 1-2 of the next
    for a, b in zip(seen_straight.steps, seen_resumed.steps, strict=True):
        assert torch.equal(a, b)
    for p, q in zip(params_of(straight), params_of(resumed), strict=True):
        assert torch.equal(p, q)


def test_a_checkpoint_dir_that_is_a_file_is_refused_before_any_step(tmp_path: Path) -> None:
    from tests.reliability_toys import make_trainer as _make

    trainer = _make()
    before = [p.detach().clone() for p in trainer.params]
    target = tmp_path / "run.ckpt"
    target.write_text("not a directory")
    for bad in (target, target / "sub"):
        with pytest.raises(
            ValueError, match=r"checkpoint_dir=.*(is a file|which is a file).*Pass a directory"
        ):
            trainer.train(torch.randn(8, 4), num_steps=3, checkpoint_dir=bad, progress=False)
    assert trainer.step_count == 0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.params, strict=True))


def test_resume_continues_the_sinks_files(tmp_path: Path) -> None:
    """A run checkpoints at step 2 and goes on to step 3, then stops (as if it crashed before
    its next checkpoint). Resumed from the step-2 checkpoint to step 5, the JSONL and CSV files
    hold steps 1-5 once each (step 3 of the first run dropped: it is trained again), with the
    values of a straight run to step 5."""
    states = bandit_states(10)
    straight = make_trainer(**SCHEDULE)
    full = straight.train(states, num_steps=5, progress=False)

    jsonl, table = tmp_path / "run" / "metrics.jsonl", tmp_path / "run" / "metrics.csv"
    first = make_trainer(**SCHEDULE, checkpoint_freq=2)
    with JSONLSink(jsonl) as j, CSVSink(table) as c:
        run = first.train(states, num_steps=3, checkpoint_dir=tmp_path / "ckpt", sinks=[j, c], progress=False)
    assert [r["step"] for r in read_jsonl(jsonl)] == [1.0, 2.0, 3.0]
    step2 = run.checkpoints[0]
    resumed = make_trainer(**SCHEDULE, checkpoint_freq=2)
    with JSONLSink(jsonl) as j, CSVSink(table) as c:  # the same paths, as a restarted script builds them
        resumed.train(
            states, num_steps=5, checkpoint_dir=tmp_path / "ckpt", resume_from=step2,
            sinks=[PeriodicSink(j, 1), c], progress=False,
        )  # fmt: skip
    records = read_jsonl(jsonl)
    assert [r["step"] for r in records] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert [r["reward/mean"] for r in records] == [r["reward/mean"] for r in full.history]
    with table.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["step"]) for r in rows] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert [float(r["reward/mean"]) for r in rows] == [r["reward/mean"] for r in full.history]


def test_a_new_run_starts_its_files_anew(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1.0, "old": 1.0}\n', encoding="utf-8")
    JSONLSink(path).close()  # nothing written yet: the old file is untouched until the first record
    assert read_jsonl(path) == [{"step": 1.0, "old": 1.0}]
    with JSONLSink(path) as sink:
        sink.write({"reward/mean": 0.5}, 1)
    assert read_jsonl(path) == [{"step": 1.0, "reward/mean": 0.5}]
