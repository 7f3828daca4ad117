"""`CompletionsTable`: every N steps, what the policy sampled and how it was scored, per sample.

A callback of `GRPOTrainer.train`: on every ``every``-th step it writes one row per sample of the
step (the main process's samples under torchrun) to a JSONL file and/or a W&B table::

    {"step": 10, "group": 0, "prompt": "1+2=", "completion": "3<eos>", "reward/exact": 1.0,
     "reward/format": 0.5, "reward": 1.1, "advantage": 0.87}

``reward/<name>`` is each component's unweighted reward (a `grpo.reward_model_base.CombinedReward` or the LLM
`grpo.llm.RewardFunctions`; absent with a single reward), ``reward`` the total reward the
advantages were computed from, ``advantage`` the sample's advantage (for per-step advantages
(N, T): their mean over the sample's valid steps). Rows are group-major: the G samples of group 0,
then group 1, ...

It reads the step's batch and advantages from ``trainer.last_batch`` / ``trainer.last_advantages``
(kept by `GRPOTrainer.step`). Text comes from `sample_text` (or ``to_text``): a string as it is,
a record's ``"prompt"``, a chat as ``role: content`` lines, a Tensor as its list, anything else
``str()`` (a `grpo.llm.Completion` is its text), so the table works for any policy.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from grpo.engine.distributed import is_main_process
from grpo.runtime.extras import install_hint
from grpo.training.callbacks import Callback, TrainState

__all__ = ["CompletionsTable", "sample_text", "table_rows"]


def sample_text(x: Any) -> str:
    """A state or action as text: a string as it is; a mapping's ``"prompt"`` (a `grpo.llm.data`
    record); a chat (a list of ``{"role", "content"}`` dicts) as ``role: content`` lines; a Tensor
    as its nested list; anything else ``str(x)`` (a `grpo.llm.Completion` is its text)."""
    if isinstance(x, str):
        return x
    if isinstance(x, Mapping) and "prompt" in x:
        return sample_text(x["prompt"])
    if isinstance(x, (list, tuple)) and x and all(isinstance(m, Mapping) and "content" in m for m in x):
        return "\n".join(f"{m.get('role', '')}: {m['content']}" for m in x)
    if isinstance(x, Tensor):
        return str(x.tolist())
    return str(x)


def table_rows(
    batch: Any,
    advantages: Tensor,
    step: int,
    *,
    max_samples: int | None = None,
    to_text: Callable[[Any], str] = sample_text,
) -> list[dict[str, Any]]:
    """One dict per sample of ``batch`` (an `grpo.rollout.batch.ExperienceBatch`), in its
    group-major order: ``step``, ``group``, ``prompt`` (``to_text`` of its flat state),
    ``completion`` (``to_text`` of its action), ``reward/<name>`` per reward component, ``reward``
    and ``advantage``.

    ``advantages``: (N,), or (N, T) per step, reduced to the mean over the sample's valid steps
    (``batch.mask``; all T when it is None). ``max_samples``: only the first ones (None = all N).
    """
    n = batch.num_samples if max_samples is None else min(max_samples, batch.num_samples)
    per_sample = _per_sample(advantages, batch.mask)
    columns: dict[str, list[Any]] = {
        "group": batch.group_ids[:n].tolist(),
        "prompt": [to_text(s) for s in batch.flat_states[:n]],
        "completion": [to_text(a) for a in batch.actions[:n]],
        **{f"reward/{k}": v[:n].tolist() for k, v in batch.reward_components.items()},
        "reward": batch.rewards[:n].tolist(),
        "advantage": per_sample[:n].tolist(),
    }
    return [{"step": step, **{k: v[i] for k, v in columns.items()}} for i in range(n)]


def _per_sample(advantages: Tensor, mask: Tensor | None) -> Tensor:
    """(N,) advantages as they are; (N, T): the mean over each sample's valid steps."""
    a = advantages.detach().double().cpu()
    if a.dim() == 1:
        return a
    if mask is None:
        return a.mean(dim=1)
    m = mask.to(device="cpu", dtype=a.dtype)
    return (a * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)


class CompletionsTable(Callback):
    """Every ``every`` steps, the step's samples as a table (`table_rows`) to a JSONL file and/or
    a W&B run; on the main process only.

    Args:
        path: the JSONL file (one line per sample and logged step; non-finite numbers as
            ``NaN`` / ``Infinity``, like `grpo.metrics.sinks.JSONLSink`). When training starts,
            lines of steps after the trainer's step count are dropped (a fresh run empties the
            file; a resumed run goes on after its checkpoint's step). None = no file.
        every: log on steps whose count is a multiple of ``every`` (>= 1).
        wandb_run: a ``wandb`` run (``WandbSink(...).run``, ``wandb.run``) to log a
            ``wandb.Table`` into, under ``key`` at the step's count; None = no W&B.
        key: the W&B key of the table.
        max_samples: only the first samples of each logged step (group-major: whole groups
            first); None = all N.
        to_text: state or action -> str (default `sample_text`).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        every: int = 10,
        wandb_run: Any = None,
        key: str = "completions",
        max_samples: int | None = None,
        to_text: Callable[[Any], str] = sample_text,
    ) -> None:
        _check_arguments(path, every, wandb_run, max_samples, to_text)
        self.path = None if path is None else Path(path)
        self.every = every
        self.wandb_run = wandb_run
        self.key = key
        self.max_samples = max_samples
        self.to_text = to_text
        self._wandb = _import_wandb() if wandb_run is not None else None

    def on_train_start(self, state: TrainState) -> None:
        if not hasattr(state.trainer, "last_batch") or not hasattr(state.trainer, "last_advantages"):
            raise TypeError(
                f"CompletionsTable reads trainer.last_batch and trainer.last_advantages, which "
                f"{type(state.trainer).__name__} does not have; use it with grpo.GRPOTrainer."
            )
        if self.path is not None and is_main_process():
            _keep_until(self.path, state.step)

    def on_step_end(self, state: TrainState, metrics: Mapping[str, float]) -> None:
        step = state.step
        if step % self.every != 0 or not is_main_process():
            return
        trainer: Any = state.trainer
        batch, adv = trainer.last_batch, trainer.last_advantages
        if batch is None or adv is None:
            return
        rows = table_rows(batch, adv.values, step, max_samples=self.max_samples, to_text=self.to_text)
        if self.path is not None:
            with self.path.open("a", encoding="utf-8") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        if self._wandb is not None and rows:
            columns = list(rows[0])
            table = self._wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])
            self.wandb_run.log({self.key: table}, step=step)


def _check_arguments(
    path: str | os.PathLike[str] | None,
    every: int,
    wandb_run: Any,
    max_samples: int | None,
    to_text: Callable[[Any], str],
) -> None:
    """ValueError / TypeError naming the first bad argument of `CompletionsTable`."""
    if path is None and wandb_run is None:
        raise ValueError(
            "CompletionsTable got neither path= nor wandb_run=, so it would write nothing; pass "
            "path='completions.jsonl' and/or wandb_run=WandbSink(...).run."
        )
    if not _positive_int(every):
        raise ValueError(f"CompletionsTable(every={every!r}) is not allowed: expected an integer >= 1.")
    if max_samples is not None and not _positive_int(max_samples):
        raise ValueError(
            f"CompletionsTable(max_samples={max_samples!r}) is not allowed: expected an integer >= 1 "
            f"or None (all samples)."
        )
    if not callable(to_text):
        raise TypeError(f"CompletionsTable(to_text={to_text!r}) must be a callable: state or action -> str.")
    if wandb_run is not None and not callable(getattr(wandb_run, "log", None)):
        raise TypeError(
            f"CompletionsTable(wandb_run=...) needs a wandb run (with .log), got "
            f"{type(wandb_run).__name__}; pass WandbSink(...).run or wandb.init(...)."
        )


def _positive_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _import_wandb() -> Any:
    """``wandb``, or an ImportError with the command that installs the extra."""
    try:
        return importlib.import_module("wandb")
    except ImportError as e:
        raise ImportError(
            f"CompletionsTable(wandb_run=...) needs the 'wandb' package, which is not installed: "
            f"{install_hint('wandb')}"
        ) from e


def _keep_until(path: Path, step: int) -> None:
    """Drop the lines of ``path`` whose step is after ``step`` (all of them at step 0)."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        return
    lines: Sequence[str] = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)
