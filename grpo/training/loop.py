"""The training loop around `GRPOTrainer.step`: data, progress, evaluation, sinks, callbacks, checkpoints.

`GRPOTrainer.train` delegates here. One iteration::

    states  = next batch from the source                      # time/data
    metrics = trainer.step(states)                            # every key of step(), optim/lr too
    metrics += throughput/*, time/data
    every eval_every steps: metrics += evaluate(eval_states, **eval_options)  # eval/*; on_eval
    on_metrics (callbacks may add keys); sinks.write(metrics, step); on_step_end
    progress bar / log line
    every config.checkpoint_freq steps: save_checkpoint; on_checkpoint
    stop when step_count == num_steps, a callback called state.stop(), or the source ran out

``num_steps`` is the step count at which training ends (``trainer.step_count`` counts steps run
before, including those restored by ``resume_from``), so the same call with ``resume_from=``
finishes a run where the uninterrupted run would have.

The parts of a run, each in its module (their public names are importable from here too):

* `grpo.training.sources`: what ``states_source`` may be (a list / Tensor, an iterable such as a
  ``DataLoader``, an iterator, a callable), how each is drawn, and how a resumed run draws the
  batches an uninterrupted run draws (`iter_state_batches`, `resume_problem`);
* `grpo.training.evaluation`: `evaluate`, on forked RNG streams, so evaluating never changes
  what training samples; `train` evaluates with the fixed seed ``config.seed`` (0 when None) and
  the `EvalOptions` given as ``eval_options`` (group size, temperature, pass@k / maj@k);
* `grpo.training.progress`: the report (`training_summary`, the start and end lines, the tqdm
  bar or progress log lines).

Under torchrun, a list / Tensor source is drawn in global batches of ``world_size *
batch_size`` states and each rank steps on its shard (`grpo.engine.distributed.rank_batches`); an
iterable, iterator or callable source yields each rank's own batches and is used as is (so a
source that is already sharded, like ``grpo-train``'s, is not sharded again). Only the main
process logs the run summary, writes to the sinks and shows progress.

Everything `train` reports goes through `logging`, on the main process, terminal or not: on the
logger ``grpo.progress`` (INFO) a start line (what runs, where, how long: `start_line`), a
progress line every ``log_every`` steps (or the tqdm bar, on stderr), a line for every
evaluation, and an end line (`end_line`: where and why it stopped). Where logging was never
configured, these lines go to stderr for the run; ``progress=False`` silences them. The resolved
config and the whole plan (`training_summary`) are logged at DEBUG, resumes and checkpoints at
INFO, on the logger ``grpo.training.loop``.

The loop knows the trainer only through `grpo.training.callbacks.TrainerLike`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import logging
import os
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from typing_extensions import Unpack

from grpo.engine.distributed import get_world_size, is_main_process, rank_batches
from grpo.engine.lr_schedules import schedule_length_problem
from grpo.metrics.sinks import format_metrics
from grpo.rollout.dynamic_sampling import DRAWS_COMPONENT, DrawCounter
from grpo.runtime.threads import intra_op_threads
from grpo.training.callbacks import HOOKS, TrainerLike, TrainState
from grpo.training.evaluation import EvalOptions, check_eval_options, evaluate
from grpo.training.prefetch import PrefetchedBatches
from grpo.training.progress import EVAL_KEYS, ProgressReport, report_visible, training_summary
from grpo.training.progress import Progress as Progress
from grpo.training.progress import end_line as end_line
from grpo.training.progress import progress_logger as progress_logger
from grpo.training.progress import start_line as start_line
from grpo.training.sources import describe_source as describe_source
from grpo.training.sources import iter_state_batches, num_states, resume_problem, state_sequence

if TYPE_CHECKING:
    from grpo.config import GRPOConfig

__all__ = [
    "EvalOptions",
    "TrainOptions",
    "TrainState",
    "TrainerLike",
    "TrainingLoopMixin",
    "evaluate",
    "iter_state_batches",
    "resume_problem",
    "train",
    "training_summary",
]

logger = logging.getLogger(__name__)


class TrainOptions(TypedDict, total=False):
    """The keyword options of `train` (and `GRPOTrainer.train`), each optional; `train` documents
    them."""

    eval_states: Any
    eval_every: int | None
    eval_options: EvalOptions | None
    callbacks: Sequence[Any]
    sinks: Sequence[Any]
    checkpoint_dir: str | os.PathLike[str] | None
    resume_from: str | os.PathLike[str] | None
    progress: Progress
    log_every: int | None


class TrainingLoopMixin:
    """`GRPOTrainer.evaluate` and `GRPOTrainer.train`: the loop's entry points on the trainer (a
    `TrainerLike`)."""

    def evaluate(
        self: TrainerLike, states: Any, *, seed: int | None = None, **generate_kwargs: Any
    ) -> dict[str, float]:
        """Mean reward of G sampled actions per state; no update, no weight change, RNGs untouched.

        Returns ``eval/reward/{mean,std,min,max}``, ``eval/reward/<component>/mean`` and
        ``time/eval`` over all ``n * G`` samples, run with the step's intra-op threads; see
        `grpo.training.evaluation.evaluate`.
        """
        with intra_op_threads(self.step_threads):
            return evaluate(self, states, seed=seed, **generate_kwargs)

    def train(
        self: TrainerLike, states_source: Any, num_steps: int, **options: Unpack[TrainOptions]
    ) -> TrainState:
        """Run steps until ``step_count == num_steps``, with progress, evaluation, sinks and
        checkpoints; the options (`TrainOptions`: ``eval_states``, ``eval_every``,
        ``eval_options``, ``callbacks``, ``sinks``, ``checkpoint_dir``, ``resume_from``,
        ``progress``, ``log_every``) are those of `grpo.training.loop.train`, which documents
        them. Returns its `TrainState` (history, eval history, checkpoints, stop reason).
        """
        return train(self, states_source, num_steps, **options)


def train(
    trainer: TrainerLike, states_source: Any, num_steps: int, **options: Unpack[TrainOptions]
) -> TrainState:
    """Run ``trainer.step`` until ``trainer.step_count == num_steps``, with progress, evaluation, sinks,
    callbacks and checkpoints (`GRPOTrainer.train` calls this; the module docstring tells the rest).

    Args:
        trainer: the trainer (`grpo.GRPOTrainer`, or any `TrainerLike`).
        states_source: a list / Tensor of states, an iterable of batches (a ``DataLoader``), an
            iterator or a callable (`grpo.training.sources`: how each is drawn and resumed; with
            ``checkpoint_dir`` or ``resume_from`` one that cannot resume exactly warns).
        num_steps: the step count at which to stop (total: steps done and restored count too).

    Options (``**options``, the keys of `TrainOptions`):
        eval_states: states to evaluate on (`evaluate`) every ``eval_every`` steps.
        eval_every: evaluation period in steps (needs ``eval_states``).
        eval_options: `EvalOptions` of each evaluation (group size, temperature, pass@k, maj@k;
            None = defaults), checked before the first step; ``eval_history`` records G and T.
        callbacks: `grpo.training.callbacks.Callback` objects; they run on every process.
        sinks: `grpo.metrics.sinks` writers; each gets every step's record (names in
            docs/metrics.md), on the main process only; flushed, not closed, at the end.
        checkpoint_dir: save a checkpoint here every ``config.checkpoint_freq`` steps and at the
            end (``trainer.save_checkpoint``).
        resume_from: a checkpoint (directory) to load before training.
        progress: True = a tqdm bar (stderr) on a terminal or in a notebook, periodic log lines
            otherwise; ``'bar'`` / ``'log'`` forces one; False = none.
        log_every: steps between progress log lines (default: a twentieth of the steps to run).

    Returns:
        The `TrainState`: ``history`` (one record per step), ``eval_history``, ``checkpoints``,
        ``stop_reason``.
    """
    _check_option_names(options)
    eval_states, eval_every = options.get("eval_states"), options.get("eval_every")
    progress, log_every = options.get("progress", True), options.get("log_every")
    checkpoint_dir, resume_from = options.get("checkpoint_dir"), options.get("resume_from")
    _check_arguments(num_steps, eval_states, eval_every, progress, log_every)
    eval_options = _checked_eval_options(trainer, options.get("eval_options"), eval_states)
    _check_checkpointing(trainer, checkpoint_dir, resume_from)
    callbacks, sinks = _checked_hooks(options.get("callbacks", ()), options.get("sinks", ()))
    if not is_main_process():  # under torchrun only rank 0 logs (metrics are already global)
        sinks, progress = [], False
    state = TrainState(trainer=trainer, num_steps=num_steps)
    run = _Run(
        config=trainer.config,
        state=state,
        num_steps=num_steps,
        eval_states=eval_states,
        eval_every=eval_every,
        eval_options=eval_options,
        callbacks=callbacks,
        sinks=sinks,
        checkpoint_dir=checkpoint_dir,
    )
    _resume_and_plan(run, states_source, resume_from)
    batches = _prefetched(run, _open_source(run, states_source, resume_from), states_source)
    _call(callbacks, "on_train_start", state)
    _run_reported(run, batches, progress, log_every)
    _finish(run)
    return state


@dataclasses.dataclass
class _Run:
    """One `train` call, as every phase reads it: the config as the call began, its arguments
    (sinks and callbacks checked) and the step of the last checkpoint written."""

    config: GRPOConfig
    state: TrainState
    num_steps: int
    eval_states: Any
    eval_every: int | None
    eval_options: EvalOptions
    callbacks: list[Any]
    sinks: list[Any]
    checkpoint_dir: str | os.PathLike[str] | None
    last_saved: int | None = None
    prefetched: PrefetchedBatches | None = None

    @property
    def trainer(self) -> TrainerLike:
        return self.state.trainer


# ---- checks, before any step ----------------------------------------------------------------
def _is_positive_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _check_option_names(options: Mapping[str, Any]) -> None:
    """Refuse a keyword that is not a `TrainOptions` key, naming the closest one."""
    known = TrainOptions.__annotations__
    for name in options:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise TypeError(
                f"train() got an unexpected keyword argument {name!r}; {hint}options: {sorted(known)}."
            )


def _check_arguments(
    num_steps: int, eval_states: Any, eval_every: int | None, progress: Progress, log_every: int | None
) -> None:
    """Refuse a bad ``num_steps``, ``eval_every`` (or one without ``eval_states``), ``log_every``
    or ``progress``."""
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 0:
        raise ValueError(f"train(num_steps={num_steps!r}) is not allowed: expected an integer >= 0.")
    if eval_every is not None and not _is_positive_int(eval_every):
        raise ValueError(
            f"train(eval_every={eval_every!r}) is not allowed: expected an integer >= 1 or None."
        )
    if (eval_states is None) != (eval_every is None):
        given, missing = (
            ("eval_states", "eval_every=N") if eval_every is None else ("eval_every", "eval_states=")
        )
        raise ValueError(f"train() got {given} but not {missing}; evaluation needs both (or neither).")
    if log_every is not None and not _is_positive_int(log_every):
        raise ValueError(f"train(log_every={log_every!r}) is not allowed: expected an integer >= 1 or None.")
    if progress not in (True, False, "bar", "log"):
        raise ValueError(f"train(progress={progress!r}) is not allowed: choose True, False, 'bar' or 'log'.")


def _checked_eval_options(trainer: TrainerLike, options: EvalOptions | None, eval_states: Any) -> EvalOptions:
    """The evaluation's options (defaults when None), refused before any step when they are not
    an `EvalOptions`, come without ``eval_states``, or do not fit the trainer (`check_eval_options`)."""
    if options is None:
        return EvalOptions()
    if not isinstance(options, EvalOptions):
        raise TypeError(
            f"train(eval_options=...) takes a grpo.training.evaluation.EvalOptions, got "
            f"{type(options).__name__}; e.g. eval_options=EvalOptions(group_size=8, ks=(1, 8))."
        )
    if eval_states is None:
        raise ValueError("train() got eval_options but no eval_states / eval_every; evaluation needs both.")
    check_eval_options(trainer, options)
    return options


def _check_checkpointing(
    trainer: TrainerLike,
    checkpoint_dir: str | os.PathLike[str] | None,
    resume_from: str | os.PathLike[str] | None,
) -> None:
    """Refuse ``config.checkpoint_freq`` without a ``checkpoint_dir``, a ``checkpoint_dir`` that
    cannot hold checkpoints, and checkpoints the trainer cannot save (`TrainerLike.check_checkpointable`)."""
    freq = trainer.config.checkpoint_freq
    if freq is not None and checkpoint_dir is None:
        raise ValueError(
            f"GRPOConfig.checkpoint_freq={freq} but train() got no checkpoint_dir; "
            f"pass checkpoint_dir=... or set checkpoint_freq=None."
        )
    if checkpoint_dir is not None:
        _check_checkpoint_dir(Path(checkpoint_dir))
    if (checkpoint_dir or resume_from) is not None:
        trainer.check_checkpointable("train(checkpoint_dir=..., resume_from=...)")


def _check_checkpoint_dir(path: Path) -> None:
    """Refuse, before any step, a ``checkpoint_dir`` that cannot hold checkpoints: an existing
    file (or one of its parents is a file), or a directory this process cannot write to."""
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                what = "is a file" if p == path else f"lies under {str(p)!r}, which is a file"
                raise ValueError(
                    f"train(checkpoint_dir={str(path)!r}): the path {what}, so no checkpoint could be "
                    f"saved there (checkpoints are directories). Pass a directory path, e.g. "
                    f"{str(path.with_suffix('')) + '_checkpoints'!r}, or remove the file."
                )
            if not os.access(p, os.W_OK | os.X_OK):
                raise PermissionError(
                    f"train(checkpoint_dir={str(path)!r}): {str(p)!r} is not writable by this process, "
                    f"so no checkpoint could be saved there. Choose a writable directory."
                )
            return


def _checked_hooks(callbacks: Sequence[Any], sinks: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """The callbacks and sinks as lists, refusing a callback without any hook and a sink without
    ``write``."""
    for cb in callbacks:
        if not any(callable(getattr(cb, h, None)) for h in HOOKS):
            raise TypeError(
                f"callback {type(cb).__name__} has none of the hooks {HOOKS}; subclass "
                f"grpo.training.callbacks.Callback and override the ones you need."
            )
    for s in sinks:
        if not callable(getattr(s, "write", None)):
            raise TypeError(
                f"sink {type(s).__name__} has no write(metrics, step) method; use one of "
                f"grpo.metrics.sinks (JSONLSink, CSVSink, TensorBoardSink, WandbSink, LoggingSink)."
            )
    return list(callbacks), list(sinks)


def _call(objs: Sequence[Any], hook: str, *args: Any) -> None:
    for obj in objs:
        fn = getattr(obj, hook, None)
        if callable(fn):
            fn(*args)


# ---- plan and resume --------------------------------------------------------------------------
def _resume_and_plan(run: _Run, states_source: Any, resume_from: str | os.PathLike[str] | None) -> None:
    """Warn when the learning-rate schedule does not fit ``num_steps``, load ``resume_from``, log
    the plan (DEBUG, main process) and give the sinks the run's config."""
    cfg, trainer = run.config, run.trainer
    problem = schedule_length_problem(
        cfg.lr_schedule, cfg.total_steps, cfg.optimizer_steps_per_step, run.num_steps
    )
    if problem is not None:
        warnings.warn(problem, UserWarning, stacklevel=3)  # at train()'s caller
    if resume_from is not None:
        _resume(run.state, resume_from, run.sinks)
    if is_main_process():  # once per run, not once per process
        summary = training_summary(
            trainer,
            run.num_steps,
            states_source,
            eval_every=run.eval_every,
            num_eval_states=None if run.eval_states is None else num_states(run.eval_states),
            checkpoint_dir=run.checkpoint_dir,
        )
        logger.debug("training configuration:\n%s", summary)
    config_dict = cfg.to_dict()
    for s in run.sinks:
        if callable(getattr(s, "log_config", None)):
            s.log_config(config_dict)


def _resume(state: TrainState, resume_from: str | os.PathLike[str], sinks: Sequence[Any]) -> None:
    """Load the checkpoint into the trainer; the sinks continue the run's output after its step."""
    trainer = state.trainer
    state.resumed_from = Path(trainer.load_checkpoint(resume_from))
    logger.info("resumed from %s at step %d", state.resumed_from, trainer.step_count)
    for s in sinks:  # the run's files go on (records after the checkpoint are dropped)
        if callable(getattr(s, "resume", None)):
            s.resume(trainer.step_count)


def _open_source(run: _Run, states_source: Any, resume_from: str | os.PathLike[str] | None) -> Iterator[Any]:
    """This rank's batches from the trainer's step count on (`grpo.training.sources`); with
    checkpoints (``checkpoint_dir`` or ``resume_from``) a warning when the source cannot resume
    exactly."""
    trainer = run.trainer
    own_state = _registered(trainer, states_source)
    if run.checkpoint_dir is not None or resume_from is not None:
        problem = resume_problem(states_source, registered=own_state)
        if problem is not None:  # at the caller of train()'s caller (GRPOTrainer.train's)
            warnings.warn(f"train() cannot resume exactly: {problem}", UserWarning, stacklevel=4)
    world = get_world_size() if trainer.distributed is not None else 1  # batch_size is per rank
    source = state_sequence(states_source)  # a datasets.Dataset: a sequence of records, like a list
    return rank_batches(
        source,
        iter_state_batches(
            source, run.config.batch_size * world, start=_batches_drawn(trainer), own_state=own_state
        ),
    )


def _batches_drawn(trainer: TrainerLike) -> int:
    """Batches of the source drawn by the trainer's steps so far: one a step, plus those dynamic
    sampling drew to back-fill (`grpo.rollout.dynamic_sampling.DrawCounter`, checkpointed)."""
    counter = trainer.stateful_components().get(DRAWS_COMPONENT)
    return trainer.step_count + (counter.extra if isinstance(counter, DrawCounter) else 0)


def _prefetched(run: _Run, batches: Iterator[Any], states_source: Any) -> Iterator[Any]:
    """With ``async_staleness = k >= 1``: the batches drawn and their generation submitted k steps
    ahead (`grpo.training.prefetch`), else ``batches`` as they are."""
    k = run.config.async_staleness
    if k == 0:
        return batches
    own = states_source if _registered(run.trainer, states_source) else None
    run.prefetched = PrefetchedBatches(run.trainer, batches, k, run.num_steps, own)
    return run.prefetched


def _registered(trainer: TrainerLike, source: Any) -> bool:
    """Whether ``source`` is one of the trainer's checkpointed components."""
    return any(obj is source for obj in trainer.stateful_components().values())


# ---- the loop body ----------------------------------------------------------------------------
def _run_reported(run: _Run, batches: Iterator[Any], progress: Progress, log_every: int | None) -> None:
    """The start line, the steps (`_run_steps`) with the progress report, the final checkpoint
    and the end line."""
    trainer = run.trainer
    with report_visible(progress is not False):  # the report reaches stderr if logging is unset
        report = ProgressReport(progress, trainer.step_count, run.num_steps, log_every, run.config.kl_coeff)
        report.say(
            start_line(trainer, run.num_steps, eval_every=run.eval_every, checkpoint_dir=run.checkpoint_dir)
        )
        t_start = time.perf_counter()
        _run_steps(run, batches, report)
        _final_checkpoint(run)
        report.say(end_line(run.state, time.perf_counter() - t_start))


def _run_steps(run: _Run, batches: Iterator[Any], report: ProgressReport) -> None:
    """Step, evaluate when due, publish the record, checkpoint when due; until ``num_steps``, a
    callback's `TrainState.stop` or the end of the source. The bar is closed after."""
    state, trainer = run.state, run.trainer
    try:
        while trainer.step_count < run.num_steps and not state.should_stop:
            record = _step(run, batches)
            if record is None:
                break
            step = trainer.step_count
            _evaluate_if_due(run, record, step, report)
            _publish(run, record, step, report)
            _checkpoint_if_due(run, step)
        if state.stop_reason is None:
            state.stop_reason = f"reached num_steps={run.num_steps}"
    except BaseException:
        report.close()
        _drop_prefetched_after_error(run)
        raise
    report.close()
    _drop_prefetched(run)  # async rollouts: the batches drawn ahead go back to the source


def _step(run: _Run, batches: Iterator[Any]) -> dict[str, float] | None:
    """``trainer.step`` on the next batch, its record with the loop's keys (``time/data``,
    ``throughput/*``; ``optim/lr`` is step()'s own); None (and a stop) when the source ran out."""
    trainer = run.trainer
    t0 = time.perf_counter()
    try:
        states = next(batches)
    except StopIteration:
        run.state.stop(f"the states source ran out after step {trainer.step_count}")
        return None
    t1 = time.perf_counter()
    if run.config.max_sampling_draws > 1:  # dynamic sampling back-fills from the same source
        record = trainer.step(states, more_states=lambda: next(batches, None))
    else:
        record = trainer.step(states)
    t2 = time.perf_counter()
    record["time/data"] = t1 - t0
    iteration = max(record["time/data"] + record.get("time/step", t2 - t1), 1e-12)
    n_states = num_states(states)
    if n_states is not None:
        record["throughput/samples_per_s"] = n_states * run.config.group_size / iteration
    record["throughput/steps_per_s"] = 1.0 / iteration
    return record


def _evaluate_if_due(run: _Run, record: dict[str, float], step: int, report: ProgressReport) -> None:
    """Every ``eval_every`` steps: `evaluate` (with the step's threads, the seed ``config.seed``
    and ``eval_options``), merged into the step's record and the eval history (with the group size
    and temperature it sampled at); ``on_eval``; a report line."""
    if run.eval_every is None or step % run.eval_every != 0:
        return
    trainer, options = run.trainer, run.eval_options
    eval_seed = 0 if run.config.seed is None else run.config.seed
    with intra_op_threads(trainer.step_threads):  # as the steps run
        ev = evaluate(trainer, run.eval_states, seed=eval_seed, **options.as_kwargs())
    record.update(ev)
    settings = {"group_size": float(options.resolved_group_size(run.config))}
    if options.temperature is not None:
        settings["temperature"] = float(options.temperature)
    run.state.eval_history.append({"step": float(step), **settings, **ev})
    _call(run.callbacks, "on_eval", run.state, ev)
    report.say(f"step {step}/{run.num_steps}: {format_metrics(ev, EVAL_KEYS)}")


def _publish(run: _Run, record: dict[str, float], step: int, report: ProgressReport) -> None:
    """The step's record to ``on_metrics`` (which may add keys: before anything sees it), the
    history, the sinks, ``on_step_end`` and the progress report."""
    _call(run.callbacks, "on_metrics", run.state, record)
    run.state.history.append(record)
    for s in run.sinks:
        s.write(record, step)
    _call(run.callbacks, "on_step_end", run.state, record)
    report.update(record, step)


# ---- checkpoints and the end ------------------------------------------------------------------
def _checkpoint_if_due(run: _Run, step: int) -> None:
    """Every ``config.checkpoint_freq`` steps: a checkpoint in ``checkpoint_dir``."""
    freq = run.config.checkpoint_freq
    if run.checkpoint_dir is not None and freq is not None and step % freq == 0:
        _checkpoint(run, run.checkpoint_dir)
        run.last_saved = step


def _final_checkpoint(run: _Run) -> None:
    """A checkpoint of the last step, unless it was just written or no step ran."""
    if run.checkpoint_dir is not None and run.trainer.step_count != run.last_saved and run.state.history:
        _checkpoint(run, run.checkpoint_dir)


def _checkpoint(run: _Run, directory: str | os.PathLike[str]) -> None:
    """A checkpoint of the trained steps (with async rollouts: a checkpointed source at the
    position of the batches trained, not of those drawn ahead)."""
    with contextlib.nullcontext() if run.prefetched is None else run.prefetched.at_trained_position():
        path = Path(run.trainer.save_checkpoint(directory))
    run.state.checkpoints.append(path)
    logger.info("step %d: checkpoint saved to %s", run.state.step, path)
    _call(run.callbacks, "on_checkpoint", run.state, path)


def _drop_prefetched(run: _Run) -> None:
    """Async rollouts: the batches drawn ahead and not trained are put back (a checkpointed
    source) and their generations dropped, so a later run draws them again."""
    if run.prefetched is not None:
        dropped = run.prefetched.close()
        run.trainer.discard_prefetched()
        if dropped:
            logger.debug("dropped %d batch(es) generated ahead and not trained on", dropped)


def _drop_prefetched_after_error(run: _Run) -> None:
    """`_drop_prefetched` while a step's error propagates: the source goes back all the same, and
    an error dropping the generations (the engine that failed the step, e.g. a dead generation
    worker, fails again) is logged, not raised: the step's error is the one the run reports."""
    try:
        _drop_prefetched(run)
    except Exception as e:
        logger.debug("dropping the prefetched generations after the error failed too: %s", e)


def _finish(run: _Run) -> None:
    """Flush the sinks (they stay open) and call ``on_train_end``."""
    for s in run.sinks:
        if callable(getattr(s, "flush", None)):
            s.flush()
    _call(run.callbacks, "on_train_end", run.state)
