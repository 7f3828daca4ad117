"""Metric sinks: where the metrics of each step go (files, TensorBoard, Weights & Biases, logging).

A sink is any object with ``write(metrics, step)`` and ``close()`` (the `MetricSink` Protocol);
``log_config(config)`` is optional. `GRPOTrainer.train` calls ``write`` once per step with that
step's record (every key of ``GRPOTrainer.step`` plus what the loop adds, named as in
docs/metrics.md), and ``close`` at the end. A sink works as well in a hand-written loop::

    with JSONLSink("run/metrics.jsonl") as sink:
        for _ in range(100):
            m = trainer.step(states)
            sink.write(m, trainer.step_count)

Always available: `JSONLSink`, `CSVSink`, `LoggingSink`, and `PeriodicSink`, which passes every
N-th step (and the last) to another sink. `TensorBoardSink` needs the
``tensorboard`` package (the ``logging`` extra), `WandbSink` needs ``wandb`` (the ``wandb``
extra; `grpo.runtime.extras.install_hint` gives the command); both are imported only when the sink is built.
"""

from __future__ import annotations

import csv
import importlib
import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any, Protocol, runtime_checkable

from grpo.runtime.extras import install_hint

__all__ = [
    "CSVSink",
    "JSONLSink",
    "LoggingSink",
    "MetricSink",
    "PeriodicSink",
    "TensorBoardSink",
    "WandbSink",
    "format_metrics",
    "read_jsonl",
]

logger = logging.getLogger(__name__)


@runtime_checkable
class MetricSink(Protocol):
    """Receives one flat ``{name: float}`` record per step.

    Optional methods `grpo.training.loop.train` calls when present: ``log_config(config)`` once
    at the start, ``resume(step)`` when it resumes a run at ``step`` (before any record: continue
    the run's output, dropping records after ``step``), ``flush()`` at the end."""

    def write(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class _Sink:
    """Context-manager plumbing and a no-op ``log_config`` shared by the ready sinks."""

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Record the run's configuration (no-op unless the backend has a place for it)."""

    def write(self, metrics: Mapping[str, float], step: int) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def flush(self) -> None:
        """Push buffered records to the backend (the file sinks write through already)."""

    def close(self) -> None:
        """Flush and release the backend."""

    def __enter__(self) -> _Sink:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _record(metrics: Mapping[str, float], step: int) -> dict[str, float]:
    """``{'step': step, **metrics}`` with every value a float (``step`` first)."""
    out: dict[str, float] = {"step": float(step)}
    for k, v in metrics.items():
        if k != "step":
            out[k] = float(v)
    return out


class JSONLSink(_Sink):
    """One JSON object per step and line: ``{"step": 3.0, "reward/mean": 0.41, ...}``.

    Each line is flushed when written, so a crashed run keeps every finished step. Non-finite
    values are written as ``NaN`` / ``Infinity`` (read back by Python's ``json`` and `read_jsonl`).
    The file is opened at the first record: a new run starts it anew; after `resume` (which
    ``train(resume_from=...)`` calls) the run's file goes on.

    Args:
        path: the file; parent directories are created.
        append: add to an existing file instead of starting a new one.
    """

    def __init__(self, path: str | os.PathLike[str], *, append: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._mode = "a" if append else "w"
        self._file: Any = None

    def resume(self, step: int) -> None:
        """Continue the run's file after ``step``: its records up to ``step`` stay, later ones
        (written after the checkpoint the run resumes from, and about to be written again) go."""
        kept = [r for r in read_jsonl(self.path) if r.get("step", 0.0) <= step] if self.path.exists() else []
        _replace(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self._mode = "a"

    def write(self, metrics: Mapping[str, float], step: int) -> None:
        if self._file is None:
            self._file = self.path.open(self._mode, encoding="utf-8")
        self._file.write(json.dumps(_record(metrics, step)) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None and not self._file.closed:
            self._file.close()


def _replace(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: a crash leaves the old
    file or the new one, never half of it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8", newline="")
    os.replace(tmp, path)


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, float]]:
    """The records of a `JSONLSink` file, in order (blank lines skipped)."""
    out: list[dict[str, float]] = []
    with Path(path).open(encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i} is not a JSON object ({e}); is this a JSONLSink file?") from e
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{i} holds {type(rec).__name__}, expected a JSON object.")
            out.append(rec)
    return out


class CSVSink(_Sink):
    """A CSV table, one row per step, one column per metric (``step`` first).

    Columns are the union of the keys seen so far; a step without a key (e.g. ``eval/*`` between
    evaluations) leaves the cell empty. When a later step brings a new key, the file is rewritten
    once with the wider header, so the file is always a valid table. The file is opened at the
    first record: a new run starts it anew; after `resume` (which ``train(resume_from=...)``
    calls) the run's table goes on.

    Args:
        path: the file; parent directories are created.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._columns: list[str] = []
        self._known: set[str] = set()
        self._rows: list[dict[str, str]] = []  # the resumed run's rows, written at the first record
        self._file: Any = None
        self._writer: Any = None

    def resume(self, step: int) -> None:
        """Continue the run's table after ``step``: its rows up to ``step`` stay (later ones,
        written after the checkpoint the run resumes from, go), with its columns."""
        if not self.path.exists():
            return
        with self.path.open(encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
            columns = list(reader.fieldnames or [])
        self._rows = [r for r in rows if float(r.get("step") or 0.0) <= step]
        self._columns, self._known = columns, set(columns)

    def write(self, metrics: Mapping[str, float], step: int) -> None:
        rec = _record(metrics, step)
        if self._file is None or not self._known.issuperset(rec):
            self._widen([k for k in rec if k not in self._known])
        self._writer.writerow(rec)
        self._file.flush()

    def _widen(self, new: list[str]) -> None:
        """(Re)write the file with ``new`` columns appended to the header (earlier rows kept)."""
        if self._file is not None:
            self._file.close()
            with self.path.open(encoding="utf-8", newline="") as f:
                self._rows = list(csv.DictReader(f))
        self._columns.extend(new)
        self._known.update(new)
        self._file = self.path.open("w", encoding="utf-8", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=self._columns, restval="")
        self._writer.writeheader()
        self._writer.writerows(self._rows)
        self._rows = []

    def close(self) -> None:
        if self._file is not None and not self._file.closed:
            self._file.close()


_DEFAULT_LOG_KEYS = ("reward/mean", "reward/std", "kl/ref", "policy/entropy", "grad/norm", "eval/reward/mean")


def format_metrics(metrics: Mapping[str, float], keys: tuple[str, ...] | None = None) -> str:
    """``'reward/mean=0.412 kl/ref=0.0031 ...'`` for ``keys`` present in ``metrics`` (4 significant
    digits); all keys when ``keys`` is None."""
    names = list(metrics) if keys is None else [k for k in keys if k in metrics]
    return " ".join(f"{k}={_fmt(float(metrics[k]))}" for k in names)


def _fmt(v: float) -> str:
    if not math.isfinite(v):
        return str(v)
    return f"{v:.4g}"


class LoggingSink(_Sink):
    """Python `logging`: one line per ``every`` steps with the chosen keys.

    Args:
        logger: the logger (default: ``logging.getLogger('grpo.metrics')``).
        level: the level of each line (default INFO).
        keys: metric names to show; None = reward, KL, entropy, grad norm and eval reward.
        every: log every N-th step (>= 1).
    """

    def __init__(
        self,
        logger: logging.Logger | None = None,
        *,
        level: int = logging.INFO,
        keys: tuple[str, ...] | None = None,
        every: int = 1,
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"LoggingSink(every={every!r}) is not allowed: expected an integer >= 1.")
        self.logger = logger if logger is not None else logging.getLogger("grpo.metrics")
        self.level = level
        self.keys = _DEFAULT_LOG_KEYS if keys is None else tuple(keys)
        self.every = every

    def write(self, metrics: Mapping[str, float], step: int) -> None:
        if step % self.every == 0:
            self.logger.log(self.level, "step %d: %s", step, format_metrics(metrics, self.keys))


class PeriodicSink(_Sink):
    """Pass every ``every``-th step's record to ``sink``, and the last step's.

    ``write(metrics, step)`` forwards the record when ``step`` is a multiple of ``every``; any other
    record is held (replacing the one held before) and written by `flush` or `close`, so the last
    step of a run reaches ``sink`` too (`GRPOTrainer.train` flushes its sinks at the end of
    training). ``log_config``, ``flush`` and ``close`` go to ``sink`` when it has them.

    Args:
        sink: the sink to write to (anything with ``write(metrics, step)``).
        every: the period in steps (>= 1; 1 passes every record).
    """

    def __init__(self, sink: Any, every: int) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"PeriodicSink(every={every!r}) is not allowed: expected an integer >= 1.")
        if not callable(getattr(sink, "write", None)):
            raise TypeError(
                f"PeriodicSink needs a sink with write(metrics, step); got {type(sink).__name__}."
            )
        self.sink = sink
        self.every = every
        self._held: tuple[dict[str, float], int] | None = None

    def log_config(self, config: Mapping[str, Any]) -> None:
        fn = getattr(self.sink, "log_config", None)
        if callable(fn):
            fn(config)

    def write(self, metrics: Mapping[str, float], step: int) -> None:
        if step % self.every == 0:
            self._held = None
            self.sink.write(metrics, step)
        else:
            self._held = (dict(metrics), step)

    def resume(self, step: int) -> None:
        """Pass the resume to ``sink`` (when it has ``resume``); nothing is held."""
        self._held = None
        fn = getattr(self.sink, "resume", None)
        if callable(fn):
            fn(step)

    def flush(self) -> None:
        """Write the held record (if any), then flush ``sink``."""
        if self._held is not None:
            metrics, step = self._held
            self._held = None
            self.sink.write(metrics, step)
        fn = getattr(self.sink, "flush", None)
        if callable(fn):
            fn()

    def close(self) -> None:
        """`flush`, then close ``sink``."""
        self.flush()
        fn = getattr(self.sink, "close", None)
        if callable(fn):
            fn()


def _require(module: str, extra: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{what} needs the '{module.split('.')[0]}' package, which is not installed: "
            f"{install_hint(extra)}"
        ) from e


class TensorBoardSink(_Sink):
    """TensorBoard scalars (``torch.utils.tensorboard.SummaryWriter``), one per metric and step.

    Needs ``tensorboard`` (the ``logging`` extra). ``log_config`` stores the config as a
    text summary.

    Args:
        log_dir: the run's directory (``tensorboard --logdir`` its parent).
        **writer_kwargs: passed to ``SummaryWriter``.
    """

    def __init__(self, log_dir: str | os.PathLike[str], **writer_kwargs: Any) -> None:
        _require("tensorboard", "logging", "TensorBoardSink")
        tb = _require("torch.utils.tensorboard", "logging", "TensorBoardSink")
        self.writer = tb.SummaryWriter(log_dir=str(log_dir), **writer_kwargs)

    def log_config(self, config: Mapping[str, Any]) -> None:
        text = "\n".join(f"    {k} = {v!r}" for k, v in config.items())
        self.writer.add_text("config", text)

    def write(self, metrics: Mapping[str, float], step: int) -> None:
        for k, v in metrics.items():
            if k != "step":
                self.writer.add_scalar(k, float(v), global_step=step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink(_Sink):
    """Weights & Biases: ``wandb.log(metrics, step=step)``.

    Needs ``wandb`` (the ``wandb`` extra). Starts a run with ``wandb.init(**init_kwargs)``
    unless ``run`` is given; ``log_config`` updates ``run.config``; ``close`` finishes a run this
    sink started.

    Args:
        run: an existing ``wandb`` run to log into; None = start one.
        **init_kwargs: passed to ``wandb.init`` (``project=``, ``name=``, ``mode='offline'``, ...).
    """

    def __init__(self, run: Any = None, **init_kwargs: Any) -> None:
        wandb = _require("wandb", "wandb", "WandbSink")
        self._owns_run = run is None
        self.run = wandb.init(**init_kwargs) if run is None else run

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.run.config.update(dict(config), allow_val_change=True)

    def write(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log({k: float(v) for k, v in metrics.items() if k != "step"}, step=step)

    def close(self) -> None:
        if self._owns_run:
            self.run.finish()
