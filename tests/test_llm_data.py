"""grpo.llm.data and map-style datasets in train(): every file format, `datasets.Dataset` objects,
missing-column errors, the seeded order against a plain `random.Random` loop, exact positions
(`start=`, `state_dict`) across epoch boundaries, and train() resumed against an uninterrupted run."""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from grpo import GRPOConfig, GRPOTrainer
from grpo.llm.data import PromptBatches, PromptDataset, ShuffledRecords
from grpo.training.sources import describe_source, iter_state_batches, resume_problem, state_sequence
from tests.conftest import WordPolicy

datasets = pytest.importorskip("datasets")

ROWS = [{"question": f"q{i}", "answer": WordPolicy.vocab[i % 4], "level": i} for i in range(6)]
EXPECTED = [{"prompt": r["question"], "answer": r["answer"], "level": r["level"]} for r in ROWS]


@pytest.fixture(autouse=True)
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`datasets.load_dataset` caches under the test's directory, not ~/.cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


def reference_orders(n: int, seed: int, epochs: int) -> list[list[int]]:
    """Epoch e's order: list(range(n)) after the (e+1)-th shuffle of one Random(seed)."""
    rng, out = random.Random(seed), []
    for _ in range(epochs):
        order = list(range(n))
        rng.shuffle(order)
        out.append(order)
    return out


# ---- loading ----------------------------------------------------------------------------------
def _write_files(d: Path) -> dict[str, Path]:
    table = datasets.Dataset.from_list(ROWS)
    files = {s: d / f"data{s}" for s in (".jsonl", ".json", ".parquet", ".csv", ".tsv")}
    files[".jsonl"].write_text("".join(json.dumps(r) + "\n" for r in ROWS) + "\n")
    files[".json"].write_text(json.dumps(ROWS))
    table.to_parquet(str(files[".parquet"]))
    table.to_csv(str(files[".csv"]), index=False)
    table.to_csv(str(files[".tsv"]), index=False, sep="\t")
    files["lines.json"] = d / "lines.json"  # JSON Lines under a .json name
    files["lines.json"].write_text("\n".join(json.dumps(r) for r in ROWS))
    table.save_to_disk(str(d / "saved"))
    datasets.DatasetDict({"train": table.select([0]), "test": table}).save_to_disk(str(d / "splits"))
    return files


def test_every_format_and_a_dataset_object_give_the_same_records(tmp_path: Path) -> None:
    files = _write_files(tmp_path)
    loaded = {name: PromptDataset.load(path, prompt_column="question") for name, path in files.items()}
    loaded["Dataset"] = PromptDataset(datasets.Dataset.from_list(ROWS), prompt_column="question")
    loaded["load(Dataset)"] = PromptDataset.load(datasets.Dataset.from_list(ROWS), "question")
    loaded["save_to_disk"] = PromptDataset.load(tmp_path / "saved", prompt_column="question")
    loaded["split"] = PromptDataset.load(tmp_path / "splits", prompt_column="question", split="test")
    for name, data in loaded.items():
        assert list(data) == EXPECTED, name
        assert data.column_names == ["answer", "level"], name
    kept = PromptDataset.load(files[".parquet"], prompt_column="question", columns=["answer"])
    assert kept[0] == {"prompt": "q0", "answer": "red"}
    assert PromptDataset.load(tmp_path / "splits", "question")[:] == EXPECTED[:1]  # split="train"


def test_missing_columns_are_named_with_the_columns_present(tmp_path: Path) -> None:
    files = _write_files(tmp_path)
    present = r"its columns are \['answer', 'level', 'question'\]"
    with pytest.raises(KeyError, match=rf"Dataset has no prompt column 'prompt'; {present}"):
        PromptDataset(datasets.Dataset.from_list(ROWS))
    with pytest.raises(
        KeyError, match=rf"no column 'solution' \(asked for in columns=\['answer', 'solution'\]\); {present}"
    ):
        PromptDataset.load(files[".parquet"], prompt_column="question", columns=["answer", "solution"])
    with pytest.raises(KeyError, match=rf"record 0 has no prompt column 'text'; {present}"):
        PromptDataset.load(files[".jsonl"], prompt_column="text")
    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b"}]
    with pytest.raises(KeyError, match=r"record 1 has no column 'answer' .*its columns are \['prompt'\]"):
        PromptDataset(rows, columns=["answer"])
    assert PromptDataset(rows).column_names == ["answer"]  # not asked for: optional
    with pytest.raises(KeyError, match=r"has no split 'validation'; its splits are \['test', 'train'\]"):
        PromptDataset.load(tmp_path / "splits", "question", split="validation")
    with pytest.raises(TypeError, match=r"for a DatasetDict pass one split"):
        PromptDataset(datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}), "question")
    with pytest.raises(TypeError, match=r"use PromptDataset.load\(path\)"):
        PromptDataset(str(files[".jsonl"]))
    (tmp_path / "data.txt").write_text("q0\n")
    with pytest.raises(ValueError, match=r"cannot tell its format from the suffix '.txt'"):
        PromptDataset.load(tmp_path / "data.txt")
    with pytest.raises(FileNotFoundError, match=r"datasets.load_dataset\(name, split='train'\)"):
        PromptDataset.load(tmp_path / "absent.parquet")


# ---- order and positions -----------------------------------------------------------------------
def test_batches_follow_one_seeded_stream_of_orders() -> None:
    data = PromptDataset([f"p{i}" for i in range(7)])
    orders = reference_orders(7, seed=3, epochs=3)
    expected = [[f"p{i}" for i in order[j : j + 3]] for order in orders for j in (0, 3, 6)]
    got = [[r["prompt"] for r in b] for b in data.batches(3, seed=3, epochs=3)]
    assert got == expected
    assert got == [[r["prompt"] for r in b] for b in data.batches(3, seed=3, epochs=3)]  # reproducible
    assert got != [[r["prompt"] for r in b] for b in data.batches(3, seed=4, epochs=3)]
    dropped = [[r["prompt"] for r in b] for b in data.batches(3, seed=3, epochs=3, drop_last=True)]
    assert dropped == [b for k, b in enumerate(expected) if k % 3 != 2]
    plain = [[r["prompt"] for r in b] for b in data.batches(3, shuffle=False, epochs=2)]
    assert plain == [["p0", "p1", "p2"], ["p3", "p4", "p5"], ["p6"]] * 2
    assert data.num_batches(3, epochs=3) == 9 == data.batches(3, epochs=3).num_batches


@pytest.mark.parametrize("drop_last", [False, True])
def test_batches_resume_exactly_at_every_position(drop_last: bool) -> None:
    data = PromptDataset([f"p{i}" for i in range(7)])
    settings: dict[str, Any] = {"seed": 5, "epochs": 3, "drop_last": drop_last}
    straight = list(data.batches(3, **settings))
    for k in range(len(straight) + 1):  # every position, epoch boundaries included
        assert list(data.batches(3, start=k, **settings)) == straight[k:], k
        first = data.batches(3, **settings)
        for _ in range(k):
            next(first)
        saved = first.state_dict()
        assert saved["position"] == k
        again = data.batches(3, **settings)
        next(again)  # somewhere else, and past epoch 0: the order stream is replayed
        again.load_state_dict(saved)
        assert list(again) == straight[k:], k
    endless = data.batches(3, epochs=None, seed=5, drop_last=drop_last, start=len(straight) - 1)
    assert next(endless) == straight[-1]
    fourth = reference_orders(7, seed=5, epochs=4)[3]  # epoch 3: the stream's 4th shuffle
    assert next(endless) == [{"prompt": f"p{i}"} for i in fourth[:3]]


def test_a_position_saved_with_other_settings_is_refused_unchanged() -> None:
    data = PromptDataset([f"p{i}" for i in range(7)])
    state = data.batches(3, seed=1, start=2).state_dict()
    other = data.batches(4, seed=2)
    with pytest.raises(
        ValueError, match=r"saved with batch_size=3, seed=1, but these batches have batch_size=4, seed=2"
    ):
        other.load_state_dict(state)
    assert other.position == 0
    with pytest.raises(ValueError, match=r"start=4 must be an integer >= 0 and <= 3"):
        data.batches(3, start=4)
    with pytest.raises(ValueError, match=r"7 records do not fill one batch of 8 with drop_last=True"):
        data.batches(8, drop_last=True)


def test_shuffled_view_is_the_epochs_in_their_seeded_orders() -> None:
    data = PromptDataset([f"p{i}" for i in range(5)])
    view = data.shuffled(seed=2, epochs=3)
    assert isinstance(view, ShuffledRecords)
    orders = reference_orders(5, seed=2, epochs=3)
    assert [r["prompt"] for r in view] == [f"p{i}" for order in orders for i in order]
    assert view[-1] == view[14]
    assert view[3:6] == [view[3], view[4], view[5]]
    batches = [[r["prompt"] for r in b] for b in data.batches(5, seed=2, epochs=3)]
    assert [[r["prompt"] for r in view[i : i + 5]] for i in (0, 5, 10)] == batches  # same orders


# ---- train() with a datasets.Dataset --------------------------------------------------------------
G, B = 2, 4


class RecordPolicy(WordPolicy):
    """`WordPolicy` drawing from the global torch RNG, which checkpoints restore."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = None  # type: ignore[assignment]


class SeenRecords:
    """Reward 1 for the record's answer word; keeps the prompts of each step."""

    def __init__(self) -> None:
        self.steps: list[list[str]] = []

    def __call__(self, states: list[dict[str, Any]], actions: list[str]) -> Tensor:
        self.steps.append([s["prompt"] for s in states[::G]])
        return torch.tensor([float(a == s["answer"]) for s, a in zip(states, actions, strict=True)])


def record_trainer(seen: SeenRecords, checkpoint_freq: int | None) -> GRPOTrainer:
    torch.manual_seed(0)
    config = GRPOConfig(
        group_size=G, batch_size=B, seed=0, learning_rate=0.5, checkpoint_freq=checkpoint_freq
    )
    return GRPOTrainer(config, RecordPolicy(), seen)


def _run(
    source: Any, steps: int, ckpt: Path | None = None, resume: bool = False
) -> tuple[SeenRecords, Tensor]:
    seen = SeenRecords()
    trainer = record_trainer(seen, None if ckpt is None else 3)
    if isinstance(source, PromptBatches):
        trainer.register_checkpoint_state("data", source)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "cannot resume exactly" warning
        trainer.train(
            source, steps, checkpoint_dir=ckpt, resume_from=ckpt if resume else None, progress=False
        )
    return seen, trainer.policy.logits.detach().clone()


SOURCES = {
    "Dataset": lambda: datasets.Dataset.from_list(ROWS).rename_column("question", "prompt"),
    "PromptDataset": lambda: PromptDataset(ROWS, prompt_column="question"),
    "shuffled": lambda: PromptDataset(ROWS, prompt_column="question").shuffled(seed=1, epochs=4),
    "batches": lambda: PromptDataset(ROWS, prompt_column="question").batches(
        B, seed=1, epochs=None, drop_last=True
    ),
}


@pytest.mark.parametrize("kind", list(SOURCES))
def test_train_on_records_resumes_like_an_uninterrupted_run(tmp_path: Path, kind: str) -> None:
    straight, params = _run(SOURCES[kind](), 7)
    _run(SOURCES[kind](), 3, tmp_path)  # 3 steps of 4 of 6 records: past the first epoch
    resumed, resumed_params = _run(SOURCES[kind](), 7, tmp_path, resume=True)
    assert resumed.steps == straight.steps[3:]
    assert torch.equal(resumed_params, params)
    if kind in ("Dataset", "PromptDataset"):  # cycled in file order, wrapping around
        assert straight.steps[:2] == [["q0", "q1", "q2", "q3"], ["q4", "q5", "q0", "q1"]]
    if kind == "shuffled":  # a new seeded order each pass
        orders = reference_orders(6, seed=1, epochs=2)
        assert [p for step in straight.steps[:3] for p in step] == [f"q{i}" for o in orders for i in o]


def test_map_style_sources_are_described_and_resume_without_warning() -> None:
    ds = datasets.Dataset.from_list(EXPECTED)
    assert describe_source(ds) == "Dataset of 6 states (cycled)"
    assert resume_problem(ds) is None
    view = state_sequence(ds)
    assert len(view) == 6
    assert view[-1] == EXPECTED[-1]
    assert view[1:3] == EXPECTED[1:3]
    batches = iter_state_batches(ds, 4, start=1)
    assert next(batches) == [EXPECTED[i] for i in (4, 5, 0, 1)]
    with pytest.raises(TypeError, match=r"DatasetDict of the splits \['test', 'train'\]; pass one split"):
        iter_state_batches(datasets.DatasetDict({"train": ds, "test": ds}), 4)


def test_a_stream_of_records_is_refused_with_the_fix() -> None:
    stream = datasets.Dataset.from_list(EXPECTED).to_iterable_dataset()
    with pytest.raises(
        TypeError, match=r"yielded a dict with keys \['answer', 'level', 'prompt'\].*collate_fn=list"
    ):
        next(iter_state_batches(stream, 4))
    batched = iter_state_batches(DataLoader(stream, batch_size=4, collate_fn=list), 4)
    assert next(batched) == EXPECTED[:4]
