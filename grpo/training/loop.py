"""The training loop around `GRPOTrainer.step`: data, progress, evaluation, sinks, callbacks, checkpoints.

`GRPOTrainer.train` delegates here. One iteration::

    states  = next batch from the source                      # time/data
    metrics = trainer.step(states)                            # every key of step()
    metrics += optim/lr, throughput/*, time/data
    every eval_every steps: metrics += evaluate(eval_states)  # eval/*, time/eval; on_eval
    on_metrics (callbacks may add keys); sinks.write(metrics, step); on_step_end
    progress bar / log line
    every config.checkpoint_freq steps: save_checkpoint; on_checkpoint
    stop when step_count == num_steps, a callback called state.stop(), or the source ran out

``num_steps`` is the step count at which training ends (``trainer.step_count`` counts steps run
before, including those restored by ``resume_from``), so the same call with ``resume_from=``
finishes a run where the uninterrupted run would have.

Sources of states (what ``states_source`` may be):

* a list / sequence of states or a Tensor ``(n, ...)``: cycled in ``config.batch_size`` chunks,
  wrapping around; chunk ``k`` holds items ``k*B ... k*B + B - 1`` (mod n), where ``k`` is the
  trainer's step count, so a resumed run draws the same states as an uninterrupted one;
* a callable: called once per step as ``source(batch_size)`` if it takes an argument, else
  ``source()``; it returns one batch of states;
* an iterable (e.g. a ``torch.utils.data.DataLoader``): each item is one batch, passed to
  ``step`` as is; restarted when exhausted (a new epoch). An *iterator* (a generator, ``iter(x)``)
  is used once: training stops when it runs out.

Resuming (``resume_from=``, or a second ``train`` call on the same trainer): batch ``k`` of the
source is the one fed at step ``k`` (steps counted from the trainer's first step), and a resumed
run feeds exactly the batches the uninterrupted run feeds when the source can be replayed:

* a list / Tensor: always (chunk ``k`` is a function of ``k``);
* a source with ``state_dict()`` / ``load_state_dict()`` (e.g. torchdata's
  ``StatefulDataLoader``) registered with ``trainer.register_checkpoint_state(name, source)``
  before ``train``: its own state, saved in the trainer's checkpoint, says where it is; ``train``
  iterates it as it is;
* a map-style ``DataLoader``: ``train`` runs epoch ``e`` after seeding its order: each
  ``torch.Generator`` of the loader and of its sampler is re-seeded with ``seed + e`` (``seed`` is
  the generator's seed when ``train`` first saw it, so epoch 0 is the loader's own first order)
  and ``sampler.set_epoch(e)`` is called when the sampler has it (``DistributedSampler``). On
  resume the ``k mod len(loader)`` batches already fed in the current epoch are loaded again and
  dropped. Exact when the order comes from such a generator, ``set_epoch`` or no shuffling at
  all; an unseeded shuffle (``shuffle=True`` without ``generator=``) is not;
* any other iterable: its first ``k`` batches (across passes) are drawn and dropped, which is
  exact when every pass yields the same batches;
* an iterator (a generator, ``iter(x)``) cannot be repositioned: it continues from where it is;
* a callable: called again; exact when it draws only from the process-global RNG streams
  (Python, NumPy, torch), which the checkpoint restores.

Batches drawn only to be dropped are drawn on forked RNG streams, so dropping them changes no
random number of the run. ``train`` with ``checkpoint_dir`` or ``resume_from`` warns once when
its source cannot resume exactly, naming the source and the fix.

Evaluation (`evaluate`) samples G actions per eval state and scores them, without log-probs,
gradients or any weight change, under the trainer's reward settings (``config.reward_timeout``,
``config.invalid_rewards``). It runs on forked RNG streams (torch, Python, NumPy), so
evaluating never changes what training samples; `train` evaluates with the fixed seed
``config.seed`` (0 when None), so successive evaluations share random numbers.

Everything `train` reports goes through `logging` (logger ``grpo.training.loop``): the run
summary once at INFO on the main process, and with ``progress='log'`` the periodic progress
lines; configure logging (e.g. ``logging.basicConfig(level=logging.INFO)``) to see them. The
tqdm bar writes to stderr.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import itertools
import logging
import math
import os
import random
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

from grpo.engine.distributed import get_world_size, is_main_process, rank_batches
from grpo.engine.lr_schedules import schedule_length_problem
from grpo.experience_collector import ExperienceCollector, select_rows
from grpo.metrics.sinks import format_metrics
from grpo.runtime.extras import install_hint
from grpo.runtime.threads import intra_op_threads
from grpo.training.callbacks import HOOKS, TrainerLike, TrainState

__all__ = [
    "TrainState",
    "TrainerLike",
    "evaluate",
    "iter_state_batches",
    "resume_problem",
    "train",
    "training_summary",
]

logger = logging.getLogger(__name__)
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
_EVAL_KEYS = ("eval/reward/mean", "eval/reward/std", "eval/reward/min", "eval/reward/max")


def _shown(keys: Any, kl_coeff: float) -> Any:
    """``keys`` (a tuple, or a dict of short names) with ``kl/ref`` replaced by ``kl/old`` when
    there is no KL term (``kl/ref`` is then 0 on every step; ``kl/old`` shows how far each update
    moves the policy)."""
    if kl_coeff != 0:
        return keys
    if isinstance(keys, dict):
        return {("kl/old" if k == "kl/ref" else k): v for k, v in keys.items()}
    return tuple("kl/old" if k == "kl/ref" else k for k in keys)


# ---- sources of states ---------------------------------------------------------------------
def _num_states(states: Any) -> int | None:
    if isinstance(states, Tensor):
        return int(states.shape[0]) if states.dim() > 0 else None
    if isinstance(states, Sequence) and not isinstance(states, (str, bytes)):
        return len(states)
    return None


def _wants_argument(fn: Callable[..., Any]) -> bool:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = list(sig.parameters.values())
    return any(p.kind in positional for p in params) or any(
        p.kind is inspect.Parameter.VAR_POSITIONAL for p in params
    )


def describe_source(source: Any) -> str:
    """A short human description of a states source (for the run summary)."""
    if isinstance(source, Tensor):
        return f"Tensor {tuple(source.shape)} (cycled)"
    if isinstance(source, Sequence) and not isinstance(source, (str, bytes)):
        return f"{type(source).__name__} of {len(source)} states (cycled)"
    if isinstance(source, Iterator):
        return f"iterator {type(source).__name__} (used once)"
    if isinstance(source, Iterable):
        return f"iterable {type(source).__name__} (one batch per item, restarted when exhausted)"
    if callable(source):
        return f"callable {getattr(source, '__name__', type(source).__name__)}"
    return type(source).__name__


def iter_state_batches(
    source: Any, batch_size: int, start: int = 0, *, own_state: bool = False
) -> Iterator[Any]:
    """Batches of states from ``source`` (see the module docstring for each kind of source).

    Args:
        source: a sequence / Tensor of states, an iterable or iterator of batches, or a callable.
        batch_size: B, states per batch for sequences and for a callable taking an argument.
        start: index of the first batch to yield (the trainer's step count, for resuming): the
            chunk of a sequence / Tensor, the epoch and position of a map-style ``DataLoader``,
            the number of batches of another iterable to draw and drop. An iterator and a
            callable are used as they are.
        own_state: the source restores its own position (an iterable with ``state_dict`` /
            ``load_state_dict`` registered with ``register_checkpoint_state``): iterate it as is.
    """
    if isinstance(source, (str, bytes, Mapping)):
        raise TypeError(
            f"states_source is a {type(source).__name__}; expected a list of states, a Tensor "
            f"(n, ...), an iterable of batches (e.g. a DataLoader) or a callable returning a batch."
        )
    if isinstance(source, Tensor):
        n = int(source.shape[0]) if source.dim() > 0 else 0
        if n == 0:
            raise ValueError(f"states_source is a Tensor of shape {tuple(source.shape)}; it holds no states.")
        return _cycle_tensor(source, n, batch_size, start)
    if isinstance(source, Sequence):
        if len(source) == 0:
            raise ValueError("states_source is an empty sequence; give at least one state.")
        return _cycle_sequence(source, batch_size, start)
    if isinstance(source, Iterator):
        return source
    if isinstance(source, Iterable):
        if own_state:
            return _repeat_iterable(source)
        if isinstance(source, DataLoader) and not isinstance(source.dataset, IterableDataset):
            return _replay_loader(source, start)
        return _skip_batches(_repeat_iterable(source), start)
    if callable(source):
        return _call_source(source, batch_size)
    raise TypeError(
        f"states_source of type {type(source).__name__} is not supported; expected a list of "
        f"states, a Tensor (n, ...), an iterable of batches (e.g. a DataLoader) or a callable."
    )


def _cycle_tensor(source: Tensor, n: int, batch_size: int, start: int) -> Iterator[Tensor]:
    k = start
    offsets = torch.arange(batch_size)
    while True:
        begin = (k * batch_size) % n
        if begin + batch_size <= n:
            yield source[begin : begin + batch_size]
        else:
            yield source[((begin + offsets) % n).to(source.device)]
        k += 1


def _cycle_sequence(source: Sequence[Any], batch_size: int, start: int) -> Iterator[list[Any]]:
    n = len(source)
    k = start
    while True:
        begin = (k * batch_size) % n
        yield [source[(begin + j) % n] for j in range(batch_size)]
        k += 1


def _repeat_iterable(source: Iterable[Any]) -> Iterator[Any]:
    while True:
        empty = True
        for item in source:
            empty = False
            yield item
        if empty:
            raise ValueError(
                f"states_source ({type(source).__name__}) yielded no batch; an iterable source "
                f"must yield at least one batch of states per pass."
            )


def _skip_batches(batches: Iterator[Any], n: int) -> Iterator[Any]:
    """``batches`` without its first ``n`` items, drawn on forked RNG streams when first asked."""
    if n:
        with _forked_rng(torch.device("cpu"), None):
            for _ in range(n):
                next(batches)
    yield from batches


#: the seed each DataLoader generator had when train() first saw it (epoch e is seeded seed + e)
_BASE_SEEDS: weakref.WeakKeyDictionary[torch.Generator, int] = weakref.WeakKeyDictionary()


def _loader_samplers(loader: DataLoader[Any]) -> list[Any]:
    """The objects that decide a DataLoader's order: its batch sampler when it is not torch's
    own ``BatchSampler``, and the sampler of indices."""
    batch_sampler = loader.batch_sampler
    if batch_sampler is None:
        return [loader.sampler]
    if isinstance(batch_sampler, BatchSampler):
        return [batch_sampler.sampler]
    inner = getattr(batch_sampler, "sampler", None)
    return [batch_sampler] if inner is None else [batch_sampler, inner]


def _loader_generators(loader: DataLoader[Any]) -> list[torch.Generator]:
    found: list[torch.Generator] = []
    for obj in [loader, *_loader_samplers(loader)]:
        g = getattr(obj, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not h for h in found):
            found.append(g)
    return found


def _seed_epoch(loader: DataLoader[Any], epoch: int) -> None:
    """Make epoch ``epoch``'s order a function of ``epoch``: re-seed each generator of the loader
    and its samplers with ``seed + epoch`` and call ``set_epoch`` where a sampler has it."""
    for g in _loader_generators(loader):
        base = _BASE_SEEDS.setdefault(g, g.initial_seed())
        g.manual_seed((base + epoch) % 2**64)
    for sampler in _loader_samplers(loader):
        set_epoch = getattr(sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)


def _replay_loader(loader: DataLoader[Any], start: int) -> Iterator[Any]:
    """A map-style DataLoader from batch ``start``: epoch ``start // len``, position
    ``start % len``, each epoch seeded by `_seed_epoch`; restarted when exhausted."""
    per_epoch = len(loader)
    epoch, offset = divmod(start, per_epoch) if per_epoch else (0, 0)
    while True:
        _seed_epoch(loader, epoch)
        yielded = 0
        if offset:  # the batches the run fed before it was interrupted, drawn and dropped
            with _forked_rng(torch.device("cpu"), None):
                it = iter(loader)
                yielded = sum(1 for _ in itertools.islice(it, offset))
            offset = 0
        else:
            it = iter(loader)
        for item in it:
            yielded += 1
            yield item
        if not yielded:
            raise ValueError(
                f"states_source ({type(loader).__name__}) yielded no batch; an iterable source "
                f"must yield at least one batch of states per pass."
            )
        epoch += 1


def _registered(trainer: TrainerLike, source: Any) -> bool:
    """Whether ``source`` is one of the trainer's checkpointed components."""
    components = getattr(trainer, "stateful_components", None)
    if not callable(components):
        return False
    return any(obj is source for obj in components().values())


_REGISTER = (
    "or give it state_dict()/load_state_dict() (e.g. torchdata's StatefulDataLoader) and call "
    "trainer.register_checkpoint_state('data', source) before train()"
)


def resume_problem(source: Any, *, registered: bool = False) -> str | None:
    """Why a resumed `train` would not feed the batches an uninterrupted run feeds, and the fix;
    None when it would (see the module docstring)."""
    if registered or isinstance(source, (Tensor, str, bytes, Mapping)):
        return None
    if isinstance(source, Sequence):
        return None
    name = type(source).__name__
    if isinstance(source, Iterator):
        return (
            f"the states source is an iterator ({name}), which cannot be repositioned: a resumed run "
            f"continues from wherever it is (a new one starts again at its first batch), not at the "
            f"batch the interrupted run would have fed next. Pass a list or Tensor of states, or a "
            f"DataLoader with a seeded generator, {_REGISTER}."
        )
    if not isinstance(source, DataLoader):
        return None  # an iterable replayed by skipping (exact when each pass repeats) or a callable
    if isinstance(source.dataset, IterableDataset):
        return (
            f"the states source is a DataLoader over an IterableDataset "
            f"({type(source.dataset).__name__}); train() resumes it by drawing and dropping the "
            f"batches already fed, which is exact only if the dataset yields the same batches on "
            f"every pass. Use a map-style dataset with a seeded generator, {_REGISTER}."
        )
    for sampler in _loader_samplers(source):
        deterministic = isinstance(sampler, (SequentialSampler, Sequence))
        if deterministic or callable(getattr(sampler, "set_epoch", None)):
            continue
        if hasattr(sampler, "generator"):
            if isinstance(sampler.generator, torch.Generator):
                continue
            return (
                f"the states source is a DataLoader whose {type(sampler).__name__} shuffles without a "
                f"seeded generator, so a resumed run cannot redraw the order of the current epoch and "
                f"feeds other batches than the uninterrupted run. Fix: "
                f"DataLoader(..., shuffle=True, generator=torch.Generator().manual_seed(0)), {_REGISTER}."
            )
        return (
            f"the states source is a DataLoader whose sampler {type(sampler).__name__} has neither a "
            f"torch.Generator attribute `generator` nor set_epoch(epoch), so train() cannot make each "
            f"epoch's order repeat after a resume. Give the sampler one of them, {_REGISTER}."
        )
    return None


def _call_source(source: Callable[..., Any], batch_size: int) -> Iterator[Any]:
    with_arg = _wants_argument(source)
    while True:
        yield source(batch_size) if with_arg else source()


# ---- evaluation ----------------------------------------------------------------------------
@contextmanager
def _forked_rng(device: torch.device, seed: int | None) -> Iterator[None]:
    """Run the body on copies of every RNG stream; the streams are as before afterwards."""
    py_state = random.getstate()
    np_state = np.random.get_state()
    cuda = list(range(torch.cuda.device_count())) if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=cuda):
            if seed is not None:
                random.seed(seed)
                np.random.seed(seed)
                torch.manual_seed(seed)
            yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


def _chunks(states: Any, size: int) -> Iterator[Any]:
    n = _num_states(states)
    if n is None:
        raise TypeError(
            f"eval states must be a sequence of states or a Tensor (n, ...), got {type(states).__name__}."
        )
    if n == 0:
        raise ValueError("eval states are empty; give at least one state to evaluate on.")
    for i in range(0, n, size):
        yield states[i : i + size]


class _EvalCollector(ExperienceCollector):
    """The collector of `evaluate`: with ``invalid_rewards='drop_groups'`` a chunk in which every
    group holds an invalid reward is dropped whole (counted in ``dropped_groups``) instead of
    raising as a training step does; `evaluate` raises only when no group of the whole evaluation
    is left."""

    def _drop_invalid_groups(
        self, states: Any, flat_states: Any, actions: Any, rewards: Tensor, comps: dict[str, Tensor]
    ) -> tuple[Any, Any, Any, Tensor, dict[str, Tensor], Tensor | None]:
        if bool(torch.isnan(rewards).view(-1, self.group_size).any(1).all()):
            none = torch.zeros(0, dtype=torch.long, device=rewards.device)
            return (
                select_rows(states, none),
                select_rows(flat_states, none),
                select_rows(actions, none),
                rewards[:0],
                {k: v[:0] for k, v in comps.items()},
                none,
            )
        return super()._drop_invalid_groups(states, flat_states, actions, rewards, comps)


def evaluate(
    trainer: TrainerLike, states: Any, *, seed: int | None = None, **generate_kwargs: Any
) -> dict[str, float]:
    """Mean reward of G sampled actions per state, with no update and no weight change.

    Samples ``config.group_size`` actions for each state (in chunks of ``config.batch_size``
    states), scores them with the reward model, and returns over all ``n * G`` samples::

        eval/reward/{mean,std,min,max}, eval/reward/<component>/mean, time/eval

    The reward is called as in training: with ``config.reward_timeout``, and with
    ``config.invalid_rewards='drop_groups'`` a group holding a None/NaN/inf reward is left out of
    every ``eval/reward/*`` value and counted in ``eval/reward/dropped_groups`` (present only with
    that setting); a `ValueError` when every group is invalid. With ``'raise'`` an invalid reward
    raises.

    No log-probs are computed and no gradient is taken. The RNG streams (torch, Python, NumPy)
    are forked: afterwards they are exactly as before, so evaluating does not change training.

    Args:
        trainer: the trainer whose policy and reward model are evaluated.
        states: a sequence of n states or a Tensor (n, ...).
        seed: seed the forked streams with this value (None = continue from the current state
            without advancing it).
        **generate_kwargs: passed to ``policy.generate_actions``.
    """
    t0 = time.perf_counter()
    trainer.check_lockstep(states)  # ZeRO-3: all ranks must run the same forwards
    cfg = trainer.config
    drop_groups = cfg.invalid_rewards == "drop_groups"
    collector = _EvalCollector(
        trainer.policy,
        trainer.reward_model,
        cfg.group_size,
        trainer.device,
        reference_policy=None,
        record_old_log_probs=False,
        invalid_rewards=cfg.invalid_rewards,
        reward_timeout=cfg.reward_timeout,
    )
    was_training = getattr(trainer.policy, "training", None)
    rewards: list[Tensor] = []
    comps: dict[str, list[Tensor]] = {}
    dropped = 0
    try:
        with _forked_rng(trainer.device, seed), torch.no_grad():
            for chunk in _chunks(states, cfg.batch_size):
                batch = collector.collect(chunk, **generate_kwargs)
                dropped += batch.dropped_groups
                rewards.append(batch.rewards.detach().double())
                for k, v in batch.reward_components.items():
                    comps.setdefault(k, []).append(v.detach().double())
    finally:
        if was_training is True:
            trainer.policy.train()
    r = torch.cat(rewards)
    if r.numel() == 0:
        raise ValueError(
            f"every one of the {dropped} evaluation groups holds an invalid reward (None, NaN or inf), "
            f"so nothing is left to evaluate (GRPOConfig.invalid_rewards='drop_groups'). Fix the reward."
        )
    values = [r.mean(), r.std() if r.numel() > 1 else r.new_zeros(()), r.min(), r.max()]
    names = ["eval/reward/mean", "eval/reward/std", "eval/reward/min", "eval/reward/max"]
    for k, parts in comps.items():
        names.append(f"eval/reward/{k}/mean")
        values.append(torch.cat(parts).mean())
    out = dict(zip(names, torch.stack(values).cpu().tolist(), strict=True))
    if drop_groups:
        out["eval/reward/dropped_groups"] = float(dropped)
    out["time/eval"] = time.perf_counter() - t0
    return out


# ---- summary and progress ------------------------------------------------------------------
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


class _Progress:
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
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _stdout_is_terminal() -> bool:
    try:
        return bool(sys.stdout.isatty())
    except (AttributeError, ValueError):
        return False


@contextlib.contextmanager
def _report_visible(enabled: bool) -> Iterator[None]:
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


# ---- the loop ------------------------------------------------------------------------------
def _is_positive_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _check_hooks(callbacks: Sequence[Any], sinks: Sequence[Any]) -> None:
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


def _call(objs: Sequence[Any], hook: str, *args: Any) -> None:
    for obj in objs:
        fn = getattr(obj, hook, None)
        if callable(fn):
            fn(*args)


def _require_method(trainer: TrainerLike, name: str, why: str) -> Callable[..., Any]:
    fn = getattr(trainer, name, None)
    if not callable(fn):
        raise RuntimeError(
            f"{why} needs GRPOTrainer.{name}(), which this version of grpo does not have "
            f"(checkpoints come with grpo.state.checkpoint). Upgrade grpo, or drop {why}."
        )
    method: Callable[..., Any] = fn
    return method


def train(
    trainer: TrainerLike,
    states_source: Any,
    num_steps: int,
    *,
    eval_states: Any = None,
    eval_every: int | None = None,
    callbacks: Sequence[Any] = (),
    sinks: Sequence[Any] = (),
    checkpoint_dir: str | os.PathLike[str] | None = None,
    resume_from: str | os.PathLike[str] | None = None,
    progress: Progress = True,
    log_every: int | None = None,
) -> TrainState:
    """Run ``trainer.step`` until ``trainer.step_count == num_steps``, with progress, evaluation,
    sinks, callbacks and checkpoints (`GRPOTrainer.train` calls this).

    Args:
        trainer: the trainer (`grpo.GRPOTrainer`, or any `TrainerLike`).
        states_source: a list / Tensor of states (cycled in ``batch_size`` chunks), an iterable of
            batches such as a ``DataLoader`` (restarted each epoch), an iterator (used once), or a
            callable returning a batch (``source(batch_size)`` or ``source()``). Each kind resumes
            at the trainer's step count as the module docstring says (a DataLoader: seed it with
            ``generator=``); with ``checkpoint_dir`` or ``resume_from``, a source that cannot
            resume exactly gets a `UserWarning` naming the fix (`resume_problem`).
        num_steps: the step count at which to stop (total, counting steps already done and those
            restored by ``resume_from``).
        eval_states: states to evaluate on (`evaluate`) every ``eval_every`` steps.
        eval_every: evaluation period in steps (needs ``eval_states``).
        callbacks: `grpo.training.callbacks.Callback` objects (hooks ``on_train_start``, ``on_eval``,
            ``on_metrics``, ``on_step_end``, ``on_checkpoint``, ``on_train_end``); they run on
            every process.
        sinks: `grpo.metrics.sinks` writers; each gets every step's record (names in
            docs/metrics.md), on the main process only. They are flushed, not closed, at the end
            (wrap one in `grpo.metrics.sinks.PeriodicSink` to write every N-th step and the last).
        checkpoint_dir: save a checkpoint here every ``config.checkpoint_freq`` steps and at the
            end (``trainer.save_checkpoint``).
        resume_from: a checkpoint (directory) to load before training.
        progress: True = a tqdm bar (stderr) on a terminal or in a notebook, periodic log lines
            otherwise; ``'bar'`` / ``'log'`` forces one; False = none.
        log_every: steps between progress log lines (default: a twentieth of the steps to run).

    Under torchrun, a list / Tensor source is drawn in global batches of ``world_size *
    batch_size`` states and each rank steps on its shard (`grpo.engine.distributed.rank_batches`); an
    iterable, iterator or callable source yields each rank's own batches and is used as is (so a
    source that is already sharded, like ``grpo-train``'s, is not sharded again). Only the main
    process logs the run summary, writes to the sinks and shows progress.

    The run reports through `logging` (logger ``grpo.progress``, INFO), on the main process,
    terminal or not: a start line (what runs, where, how long: `start_line`), a progress line
    every ``log_every`` steps (or the tqdm bar), a line for every evaluation, and an end line
    (`end_line`: where and why it stopped). Where logging was never configured, these lines go
    to stderr for the run; ``progress=False`` silences them. The resolved config and the whole
    plan (`training_summary`) are logged at DEBUG (logger ``grpo.training.loop``).

    Returns:
        The `TrainState`: ``history`` (one record per step), ``eval_history``, ``checkpoints``,
        ``stop_reason``.
    """
    cfg = trainer.config
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
    if cfg.checkpoint_freq is not None and checkpoint_dir is None:
        raise ValueError(
            f"GRPOConfig.checkpoint_freq={cfg.checkpoint_freq} but train() got no checkpoint_dir; "
            f"pass checkpoint_dir=... or set checkpoint_freq=None."
        )
    if checkpoint_dir is not None:
        _check_checkpoint_dir(Path(checkpoint_dir))
    zero_stage = getattr(trainer, "deepspeed_stage", None)
    if zero_stage is not None and (checkpoint_dir or resume_from) is not None:
        raise NotImplementedError(
            f"train(checkpoint_dir=..., resume_from=...) needs GRPOTrainer checkpoints, which DeepSpeed "
            f"ZeRO-{zero_stage} does not support (the optimizer state is partitioned over "
            f"the processes). Save the model with the policy's save_pretrained from a callback, or "
            f"train with GRPOConfig(deepspeed='off')."
        )
    callbacks, sinks = list(callbacks), list(sinks)
    _check_hooks(callbacks, sinks)
    if not is_main_process():  # under torchrun only rank 0 logs (metrics are already global)
        sinks, progress = [], False
    save = (
        _require_method(trainer, "save_checkpoint", "checkpoint_dir") if checkpoint_dir is not None else None
    )

    problem = schedule_length_problem(
        cfg.lr_schedule, cfg.total_steps, cfg.optimizer_steps_per_step, num_steps
    )
    if problem is not None:
        warnings.warn(problem, UserWarning, stacklevel=2)

    state = TrainState(trainer=trainer, num_steps=num_steps)
    if resume_from is not None:
        _resume(state, resume_from, sinks)

    if is_main_process():  # once per run, not once per process
        summary = training_summary(
            trainer,
            num_steps,
            states_source,
            eval_every=eval_every,
            num_eval_states=None if eval_states is None else _num_states(eval_states),
            checkpoint_dir=checkpoint_dir,
        )
        logger.debug("training configuration:\n%s", summary)
    config_dict = cfg.to_dict()
    for s in sinks:
        if callable(getattr(s, "log_config", None)):
            s.log_config(config_dict)

    own_state = _registered(trainer, states_source)
    if checkpoint_dir is not None or resume_from is not None:
        problem = resume_problem(states_source, registered=own_state)
        if problem is not None:
            warnings.warn(f"train() cannot resume exactly: {problem}", UserWarning, stacklevel=3)
    world = get_world_size() if trainer.distributed is not None else 1  # batch_size is per rank
    batches = rank_batches(
        states_source,
        iter_state_batches(
            states_source, cfg.batch_size * world, start=trainer.step_count, own_state=own_state
        ),
    )
    eval_seed = 0 if cfg.seed is None else cfg.seed
    group_size = cfg.group_size
    last_saved: int | None = None
    _call(callbacks, "on_train_start", state)
    with _report_visible(progress is not False):  # the report reaches stderr if logging is unset
        bar = _Progress(progress, trainer.step_count, num_steps, log_every, cfg.kl_coeff)
        bar.say(start_line(trainer, num_steps, eval_every=eval_every, checkpoint_dir=checkpoint_dir))
        t_start = time.perf_counter()
        try:
            while trainer.step_count < num_steps and not state.should_stop:
                t0 = time.perf_counter()
                try:
                    states = next(batches)
                except StopIteration:
                    state.stop(f"the states source ran out after step {trainer.step_count}")
                    break
                t1 = time.perf_counter()
                lr = None if trainer.optimizer is None else float(trainer.optimizer.param_groups[0]["lr"])
                record = trainer.step(states)
                t2 = time.perf_counter()
                step = trainer.step_count
                record["time/data"] = t1 - t0
                if lr is not None:
                    record["optim/lr"] = lr
                iteration = max(record["time/data"] + record.get("time/step", t2 - t1), 1e-12)
                n_states = _num_states(states)
                if n_states is not None:
                    record["throughput/samples_per_s"] = n_states * group_size / iteration
                record["throughput/steps_per_s"] = 1.0 / iteration

                if eval_every is not None and step % eval_every == 0:
                    with intra_op_threads(getattr(trainer, "step_threads", None)):  # as the steps run
                        ev = evaluate(trainer, eval_states, seed=eval_seed)
                    record.update(ev)
                    state.eval_history.append({"step": float(step), **ev})
                    _call(callbacks, "on_eval", state, ev)
                    bar.say(f"step {step}/{num_steps}: {format_metrics(ev, _EVAL_KEYS)}")

                _call(callbacks, "on_metrics", state, record)  # may add keys: before anything sees it
                state.history.append(record)
                for s in sinks:
                    s.write(record, step)
                _call(callbacks, "on_step_end", state, record)
                bar.update(record, step)

                if save is not None and cfg.checkpoint_freq is not None and step % cfg.checkpoint_freq == 0:
                    _checkpoint(save, checkpoint_dir, state, callbacks)
                    last_saved = step
            if state.stop_reason is None:
                state.stop_reason = f"reached num_steps={num_steps}"
        finally:
            bar.close()

        if save is not None and trainer.step_count != last_saved and state.history:
            _checkpoint(save, checkpoint_dir, state, callbacks)
        bar.say(end_line(state, time.perf_counter() - t_start))
    for s in sinks:
        if callable(getattr(s, "flush", None)):
            s.flush()
    _call(callbacks, "on_train_end", state)
    return state


def _resume(state: TrainState, resume_from: str | os.PathLike[str], sinks: Sequence[Any]) -> None:
    """Load the checkpoint into the trainer; the sinks continue the run's output after its step."""
    trainer = state.trainer
    loaded = _require_method(trainer, "load_checkpoint", "resume_from")(resume_from)
    state.resumed_from = Path(loaded) if loaded is not None else Path(resume_from)
    logger.info("resumed from %s at step %d", state.resumed_from, trainer.step_count)
    for s in sinks:  # the run's files go on (records after the checkpoint are dropped)
        if callable(getattr(s, "resume", None)):
            s.resume(trainer.step_count)


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


def _checkpoint(
    save: Callable[..., Any], directory: Any, state: TrainState, callbacks: Sequence[Any]
) -> None:
    path = Path(save(directory))
    state.checkpoints.append(path)
    logger.info("step %d: checkpoint saved to %s", state.step, path)
    _call(callbacks, "on_checkpoint", state, path)
