"""Metric sinks: what each writes, read back with an independent reader."""

from __future__ import annotations

import csv
import importlib.util
import json
import logging
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from grpo.metrics.sinks import (
    CSVSink,
    JSONLSink,
    LoggingSink,
    MetricSink,
    PeriodicSink,
    TensorBoardSink,
    WandbSink,
    read_jsonl,
)


def test_jsonl_one_object_per_line(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "m.jsonl"
    with JSONLSink(path) as sink:
        assert isinstance(sink, MetricSink)
        sink.write({"reward/mean": 0.5, "kl/ref": 0.25}, step=1)
        sink.write({"reward/mean": float("nan"), "step": 99.0}, step=2)
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    assert json.loads(lines[0]) == {"step": 1.0, "reward/mean": 0.5, "kl/ref": 0.25}
    second = json.loads(lines[1])
    assert second["step"] == 2.0  # the step argument wins over a 'step' key
    assert math.isnan(second["reward/mean"])
    assert read_jsonl(path)[0] == {"step": 1.0, "reward/mean": 0.5, "kl/ref": 0.25}


def test_jsonl_append_and_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    with JSONLSink(path) as sink:
        sink.write({"a": 1.0}, 1)
    with JSONLSink(path, append=True) as sink:
        sink.write({"a": 2.0}, 2)
    assert [r["a"] for r in read_jsonl(path)] == [1.0, 2.0]
    with JSONLSink(path) as sink:
        sink.write({"a": 3.0}, 3)
    assert [r["a"] for r in read_jsonl(path)] == [3.0]


def test_jsonl_lines_are_flushed_before_close(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    sink = JSONLSink(path)
    sink.write({"a": 1.0}, 1)
    assert read_jsonl(path) == [{"step": 1.0, "a": 1.0}]
    sink.close()


def test_read_jsonl_rejects_garbage(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": 1}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 is not a JSON object"):
        read_jsonl(path)


def test_csv_widens_header_when_new_keys_arrive(tmp_path: Path) -> None:
    path = tmp_path / "m.csv"
    with CSVSink(path) as sink:
        sink.write({"reward/mean": 0.5, "kl/ref": 0.125}, 1)
        sink.write({"reward/mean": 0.75, "kl/ref": 0.25, "eval/reward/mean": 0.875}, 2)
        sink.write({"reward/mean": 1.0, "kl/ref": 0.5}, 3)
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
        f.seek(0)
        header = next(csv.reader(f))
    assert header == ["step", "reward/mean", "kl/ref", "eval/reward/mean"]
    assert rows == [
        {"step": "1.0", "reward/mean": "0.5", "kl/ref": "0.125", "eval/reward/mean": ""},
        {"step": "2.0", "reward/mean": "0.75", "kl/ref": "0.25", "eval/reward/mean": "0.875"},
        {"step": "3.0", "reward/mean": "1.0", "kl/ref": "0.5", "eval/reward/mean": ""},
    ]


def test_logging_sink_every_and_keys(caplog: pytest.LogCaptureFixture) -> None:
    sink = LoggingSink(keys=("reward/mean", "kl/ref"), every=2)
    with caplog.at_level(logging.INFO, logger="grpo.metrics"):
        for step in (1, 2, 3, 4):
            sink.write({"reward/mean": step / 4, "kl/ref": 0.001, "grad/norm": 3.0}, step)
    msgs = [r.getMessage() for r in caplog.records if r.name == "grpo.metrics"]
    assert msgs == ["step 2: reward/mean=0.5 kl/ref=0.001", "step 4: reward/mean=1 kl/ref=0.001"]


def test_logging_sink_rejects_bad_every() -> None:
    with pytest.raises(ValueError, match=r"LoggingSink\(every=0\) is not allowed: expected an integer >= 1"):
        LoggingSink(every=0)


def test_tensorboard_scalars_read_back(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path / "tb")
    sink.log_config({"group_size": 4})
    for step in (1, 2, 3):
        sink.write({"reward/mean": step * 0.5, "step": float(step)}, step)
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    events = acc.Scalars("reward/mean")
    assert [(e.step, e.value) for e in events] == [(1, 0.5), (2, 1.0), (3, 1.5)]
    assert "step" not in acc.Tags()["scalars"]


def test_wandb_missing_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now fails, as when not installed
    with pytest.raises(
        ImportError, match=r"WandbSink needs the 'wandb' package.*pip install -e '\.\[wandb\]'"
    ):
        WandbSink(project="x", mode="disabled")


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb not installed")
def test_wandb_disabled_run_logs() -> None:
    with WandbSink(project="grpo-test", mode="disabled") as sink:
        sink.log_config({"group_size": 4})
        sink.write({"reward/mean": 0.5}, 1)


def test_tensorboard_missing_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as when not installed
    with pytest.raises(ImportError, match=r"pip install -e '\.\[logging\]'"):
        TensorBoardSink(tmp_path)


class ListSink:
    """Records every call it gets."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.calls.append(("config", dict(config)))

    def write(self, metrics: Mapping[str, float], step: int) -> None:
        self.calls.append(("write", (step, dict(metrics))))

    def flush(self) -> None:
        self.calls.append(("flush", None))

    def close(self) -> None:
        self.calls.append(("close", None))


def test_periodic_sink_writes_every_nth_step_and_the_last_on_flush() -> None:
    inner = ListSink()
    sink = PeriodicSink(inner, 3)
    assert isinstance(sink, MetricSink)
    sink.log_config({"group_size": 4})
    for step in range(1, 8):
        sink.write({"m": float(step)}, step)
    writes = [c[1] for c in inner.calls if c[0] == "write"]
    assert writes == [(3, {"m": 3.0}), (6, {"m": 6.0})]  # step 7 is held
    sink.flush()
    sink.flush()  # nothing held any more: written once
    sink.close()
    assert inner.calls == [
        ("config", {"group_size": 4}),
        ("write", (3, {"m": 3.0})),
        ("write", (6, {"m": 6.0})),
        ("write", (7, {"m": 7.0})),  # the held record, by the first flush
        ("flush", None),
        ("flush", None),
        ("flush", None),  # close flushes, then closes
        ("close", None),
    ]


def test_periodic_sink_holds_a_copy_and_drops_a_held_record_at_the_next_period() -> None:
    inner = ListSink()
    sink = PeriodicSink(inner, 2)
    record = {"m": 1.0}
    sink.write(record, 1)
    record["m"] = 99.0  # the caller reuses its dict: the held record is a copy
    sink.close()
    assert [c[1] for c in inner.calls if c[0] == "write"] == [(1, {"m": 1.0})]
    inner = ListSink()
    sink = PeriodicSink(inner, 2)
    sink.write({"m": 1.0}, 1)
    sink.write({"m": 2.0}, 2)  # step 1 was not the last: never written
    sink.close()
    assert [c[1][0] for c in inner.calls if c[0] == "write"] == [2]


def test_periodic_sink_wraps_a_bare_writer_and_rejects_bad_arguments(tmp_path: Path) -> None:
    steps: list[int] = []

    class Bare:  # write only: no flush, close or log_config
        def write(self, metrics: Mapping[str, float], step: int) -> None:
            steps.append(step)

    with PeriodicSink(Bare(), 1) as sink:
        sink.log_config({})
        sink.write({}, 1)
        sink.write({}, 2)
    assert steps == [1, 2]
    for every in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match=r"PeriodicSink\(every=.*\) is not allowed"):
            PeriodicSink(Bare(), every)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"PeriodicSink needs a sink with write\(metrics, step\); got int"):
        PeriodicSink(3, 2)


def test_periodic_sink_in_train_writes_the_last_step(tmp_path: Path) -> None:
    from tests.loop_toys import bandit_states, make_trainer

    path = tmp_path / "m.jsonl"
    with JSONLSink(path) as jsonl:
        make_trainer().train(bandit_states(4), num_steps=5, sinks=[PeriodicSink(jsonl, 2)], progress=False)
    assert [r["step"] for r in read_jsonl(path)] == [2.0, 4.0, 5.0]  # train() flushes at the end
