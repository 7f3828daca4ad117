"""What `grpo.training.loop.train` reports while it runs: the plan, a start line, progress (a tqdm
bar or periodic log lines), an end line.

Everything goes through `logging`: the run's report (start line, progress lines, every
evaluation, end line) on `progress_logger` (``grpo.progress``, INFO) on the main process, and the
whole plan (`training_summary`) at DEBUG on ``grpo.training.loop``, the logger of `train`'s own
messages. Configure logging (e.g. ``logging.basicConfig(level=logging.INFO)``) to see them; where
it was never configured, `report_visible` sends the report to stderr for the run. The tqdm bar
writes to stderr.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import os
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any, Literal

from grpo.metrics.sinks import format_metrics
from grpo.runtime.extras import install_hint
from grpo.training.callbacks import TrainerLike, TrainState
from grpo.training.sources import describe_source

__all__ = [
    "EVAL_KEYS",
    "Progress",
    "ProgressReport",
    "end_line",
    "progress_logger",
    "report_visible",
    "start_line",
    "training_summary",
]

#: `train`'s own messages (the plan at DEBUG, resumes, checkpoints) keep the loop's logger name
logger = logging.getLogger("grpo.training.loop")
progress_logger = logging.getLogger("grpo.progress")
"""The run's report: a start line, progress lines, every evaluation, an end line (`train`)."""

Progress = bool | Literal["bar", "log"]

_BAR_KEYS = {
    "reward/mean": "reward",
    "kl/ref": "kl",
    "eval/reward/mean": "eval",
    "throughput/tokens_per_s": "tok_s",  # when a callback adds it (grpo-train does)
}
_LOG_KEYS = ("reward/mean", "reward/std", "kl/ref", "policy/entropy", "grad/norm", "eval/reward/mean")
EVAL_KEYS = ("eval/reward/mean", "eval/reward/std", "eval/reward/min", "eval/reward/max")
"""The keys of an evaluation's report line."""


def _shown(keys: Any, kl_coeff: float) -> Any:
    """``keys`` (a tuple, or a dict of short names) with ``kl/ref`` replaced by ``kl/old`` when
    there is no KL term (``kl/ref`` is then 0 on every step; ``kl/old`` shows how far each update
    moves the policy)."""
    if kl_coeff != 0:
        return keys
    if isinstance(keys, dict):
        return {("kl/old" if k == "kl/ref" else k): v for k, v in keys.items()}
    return tuple("kl/old" if k == "kl/ref" else k for k in keys)


def _plan(trainer: TrainerLike, num_steps: int) -> tuple[int, int, int, str]:
    """(trainable parameters, start step, steps to run, "S samples, K optimizer steps")."""
    cfg = trainer.config
    start = trainer.step_count
    todo = max(num_steps - start, 0)
    work = f"{todo * cfg.samples_per_step:,} samples, {todo * cfg.optimizer_steps_per_step:,} optimizer steps"
    return sum(int(p.numel()) for p in trainer.params), start, todo, work


def training_summary(
    trainer: TrainerLike,
    num_steps: int,
    source: Any = None,
    *,
    eval_every: int | None = None,
    num_eval_states: int | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
) -> str:
    """The resolved config (``str(config)``, derived quantities included) and the run's plan."""
    cfg = trainer.config
    n_params, start, todo, work = _plan(trainer, num_steps)
    lines = [
        str(cfg),
        "Run:",
        f"  policy             = {type(trainer.policy).__name__} ({n_params:,} trainable parameters)",
        f"  reward_model       = {type(trainer.reward_model).__name__}",
        f"  device             = {trainer.device}",
        f"  optimizer          = {type(trainer.optimizer).__name__ if trainer.optimizer else None}",
        f"  lr schedule        = {_schedule_text(trainer)}",
        f"  steps              = {start} -> {num_steps} ({todo} to run, {work})",
    ]
    if source is not None:
        lines.append(f"  states source      = {describe_source(source)}")
    if eval_every is not None:
        lines.append(f"  evaluation         = every {eval_every} steps on {num_eval_states} states")
    if checkpoint_dir is not None:
        freq = cfg.checkpoint_freq
        lines.append(
            f"  checkpoints        = {checkpoint_dir} "
            + (f"every {freq} steps and at the end" if freq else "at the end")
        )
    return "\n".join(lines)


def _schedule_text(trainer: TrainerLike) -> str:
    sched = trainer.scheduler
    if sched is None:
        return "none (constant learning rate)"
    lambdas = getattr(sched, "lr_lambdas", None)
    if lambdas:
        return repr(lambdas[0])
    return type(sched).__name__


class ProgressReport:
    """A tqdm bar (terminal / notebook) or periodic log lines (files, CI)."""

    def __init__(
        self, mode: Progress, start: int, total: int, log_every: int | None, kl_coeff: float = 0.0
    ) -> None:
        self.bar: Any = None
        self.bar_keys, self.log_keys = _shown(_BAR_KEYS, kl_coeff), _shown(_LOG_KEYS, kl_coeff)
        self.log_every = max(1, log_every if log_every is not None else max(1, (total - start) // 20))
        self.total = total
        self.enabled = mode is not False
        self._t_last = time.perf_counter()
        self._step_last = start
        if mode is False or mode == "log":
            return
        interactive = mode == "bar" or _stdout_is_terminal() or "ipykernel" in sys.modules
        if not interactive:
            return
        try:
            tqdm = importlib.import_module("tqdm.auto").tqdm
        except ImportError:
            if mode == "bar":
                raise ImportError(
                    f"train(progress='bar') needs tqdm, which is not installed: {install_hint('logging')}"
                ) from None
            logger.info(
                "tqdm is not installed (%s); logging progress lines instead.", install_hint("logging")
            )
            return
        self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, desc="GRPO")

    def update(self, record: Mapping[str, float], step: int) -> None:
        """After step ``step``: advance the bar (its postfix from ``record``), or log a progress
        line every ``log_every`` steps and at the last."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(
                {short: f"{record[k]:.4g}" for k, short in self.bar_keys.items() if k in record},
                refresh=False,
            )
            return
        if step % self.log_every == 0 or step == self.total:
            now = time.perf_counter()
            rate = (step - self._step_last) / max(now - self._t_last, 1e-12)
            self._t_last, self._step_last = now, step
            self.say(
                f"step {step}/{self.total} ({rate:.3g} steps/s): {format_metrics(record, self.log_keys)}"
            )

    def say(self, line: str) -> None:
        """A report line (`progress_logger`, INFO); above a bar, without breaking it."""
        if not self.enabled:
            return
        if self.bar is not None:  # cleared while the line is logged, so the two do not mix
            self.bar.clear()
            progress_logger.info("%s", line)
            self.bar.refresh()
        else:
            progress_logger.info("%s", line)

    def close(self) -> None:
        """Close the bar (if any); later lines are logged without it."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _stdout_is_terminal() -> bool:
    try:
        return bool(sys.stdout.isatty())
    except (AttributeError, ValueError):
        return False


@contextlib.contextmanager
def report_visible(enabled: bool) -> Iterator[None]:
    """While ``train`` runs, `progress_logger`'s lines reach stderr even where logging was never
    configured: when no handler would receive them, one (``%(message)s`` to stderr, INFO) is
    attached for the run and removed after it. Configured logging is left alone."""
    if not enabled or progress_logger.hasHandlers():
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    level = progress_logger.level
    progress_logger.addHandler(handler)
    progress_logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        progress_logger.removeHandler(handler)
        progress_logger.setLevel(level)


def start_line(
    trainer: TrainerLike,
    num_steps: int,
    *,
    eval_every: int | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
) -> str:
    """One line: what runs, where, how long (the whole plan: `training_summary`, at DEBUG)."""
    n_params, start, _, work = _plan(trainer, num_steps)
    parts = [
        f"grpo: training {type(trainer.policy).__name__} ({n_params:,} parameters) on {trainer.device}",
        f"steps {start} -> {num_steps} ({work})",
    ]
    if eval_every is not None:
        parts.append(f"evaluation every {eval_every} steps")
    if checkpoint_dir is not None:
        parts.append(f"checkpoints in {checkpoint_dir}")
    return ", ".join(parts)


def end_line(state: TrainState, seconds: float) -> str:
    """One line: where and why the run stopped, how long it took, the reward's way."""
    done = state.history
    line = f"grpo: stopped at step {state.trainer.step_count} ({state.stop_reason}) after {seconds:.1f} s"
    if done and "reward/mean" in done[0]:
        line += f"; reward/mean {_short(done[0]['reward/mean'])} -> {_short(done[-1]['reward/mean'])}"
    if state.eval_history:
        last = state.eval_history[-1]
        line += (
            f"; eval/reward/mean {_short(last.get('eval/reward/mean', math.nan))} at step {last['step']:.0f}"
        )
    if state.checkpoints:
        line += f"; last checkpoint {state.checkpoints[-1]}"
    return line


def _short(v: float) -> str:
    return f"{v:.4g}"
