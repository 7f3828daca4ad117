"""Sources of states for `grpo.training.loop.train`: how each kind is drawn, batch by batch, and
how a resumed run draws the batches an uninterrupted run draws.

What ``states_source`` may be:

* a list / sequence of states or a Tensor ``(n, ...)``: cycled in ``config.batch_size`` chunks,
  wrapping around; chunk ``k`` holds items ``k*B ... k*B + B - 1`` (mod n), where ``k`` is the
  trainer's step count, so a resumed run draws the same states as an uninterrupted one;
* a map-style dataset of states that is not a Python sequence: a ``datasets.Dataset`` (each row a
  record, a dict of its columns) or a map-style ``torch.utils.data.Dataset`` (each item a state):
  a sequence of its items (`state_sequence`), cycled as a list. For a seeded new order each pass,
  pass ``grpo.llm.PromptDataset(ds).shuffled(seed, epochs=E)`` (a sequence too);
* a callable: called once per step as ``source(batch_size)`` if it takes an argument, else
  ``source()``; it returns one batch of states;
* an iterable (e.g. a ``torch.utils.data.DataLoader``): each item is one batch, passed to
  ``step`` as is; restarted when exhausted (a new epoch). An *iterator* (a generator, ``iter(x)``)
  is used once: training stops when it runs out. An item that is a mapping (a record of a
  ``datasets.IterableDataset``, a DataLoader's default collation of records) is refused with the
  fix: batch the records as lists, ``DataLoader(ds, batch_size=B, collate_fn=list)``.

Resuming (``resume_from=``, or a second ``train`` call on the same trainer): batch ``k`` of the
source is the one fed at step ``k`` (steps counted from the trainer's first step), and a resumed
run feeds exactly the batches the uninterrupted run feeds when the source can be replayed:

* a list / Tensor / map-style dataset: always (chunk ``k`` is a function of ``k``);
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

Batches drawn only to be dropped are drawn on forked RNG streams (`grpo.training.rng`), so
dropping them changes no random number of the run. ``train`` with ``checkpoint_dir`` or
``resume_from`` warns once when its source cannot resume exactly, naming the source and the fix
(`resume_problem`).
"""

from __future__ import annotations

import inspect
import itertools
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, overload

import torch
from torch import Tensor
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler
from torch.utils.data import Dataset as TorchDataset

from grpo.training.rng import forked_rng

__all__ = ["describe_source", "iter_state_batches", "num_states", "resume_problem", "state_sequence"]


def num_states(states: Any) -> int | None:
    """How many states ``states`` holds: the length of a sequence, the first dimension of a
    Tensor; None for anything else (an iterable, a callable, a 0-d Tensor)."""
    if isinstance(states, Tensor):
        return int(states.shape[0]) if states.dim() > 0 else None
    if isinstance(states, Sequence) and not isinstance(states, (str, bytes)):
        return len(states)
    return None


def _is_map_dataset(source: Any) -> bool:
    """A map-style dataset that is not a Python sequence: a ``datasets.Dataset`` (it has a list
    ``column_names``) or a map-style torch ``Dataset``, with ``__len__`` and ``__getitem__``."""
    if isinstance(source, (Sequence, Tensor, Mapping, DataLoader)):
        return False
    if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
        return False
    if isinstance(source, TorchDataset):
        return not isinstance(source, IterableDataset)
    return isinstance(getattr(source, "column_names", None), list)


class _ItemView(Sequence[Any]):
    """The items ``dataset[0] ... dataset[n-1]`` of a map-style dataset, as a sequence (nothing
    copied; index i reads ``dataset[i mod n]``, a slice gives a list)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    @overload
    def __getitem__(self, i: int) -> Any: ...

    @overload
    def __getitem__(self, i: slice) -> list[Any]: ...

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self.dataset[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for {type(self.dataset).__name__} of {n} items.")
        return self.dataset[i % n]


def state_sequence(source: Any) -> Any:
    """``source`` as a sequence of states when it is a map-style dataset that is not a Python
    sequence (a ``datasets.Dataset``, whose rows are dicts; a map-style torch ``Dataset``); any
    other source as it is. `iter_state_batches` cycles the sequence like a list, and ``train``
    shards it under torchrun like a list."""
    return _ItemView(source) if _is_map_dataset(source) else source


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
    if _is_map_dataset(source):
        return f"{type(source).__name__} of {len(source)} states (cycled)"
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
        raise TypeError(_refused_source(source))
    source = state_sequence(source)
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
        return _no_records(source, source)
    if isinstance(source, Iterable):
        if own_state:
            return _no_records(_repeat_iterable(source), source)
        if isinstance(source, DataLoader) and not isinstance(source.dataset, IterableDataset):
            return _no_records(_replay_loader(source, start), source)
        return _skip_batches(_no_records(_repeat_iterable(source), source), start)
    if callable(source):
        return _call_source(source, batch_size)
    raise TypeError(
        f"states_source of type {type(source).__name__} is not supported; expected a list of "
        f"states, a Tensor (n, ...), an iterable of batches (e.g. a DataLoader) or a callable."
    )


def _refused_source(source: str | bytes | Mapping[Any, Any]) -> str:
    """Why a string or a mapping is no states source, and what to pass instead."""
    name = type(source).__name__
    if isinstance(source, Mapping) and name.endswith("DatasetDict"):
        return (
            f"states_source is a {name} of the splits {sorted(source)}; pass one split, e.g. "
            f"train(ds[{next(iter(sorted(source)), 'train')!r}], ...)."
        )
    return (
        f"states_source is a {name}; expected a list of states, a Tensor (n, ...), a map-style "
        f"dataset (datasets.Dataset), an iterable of batches (e.g. a DataLoader) or a callable "
        f"returning a batch."
    )


def _no_records(batches: Iterator[Any], source: Any) -> Iterator[Any]:
    """``batches``, refusing an item that is a mapping: an iterable source yields batches, and a
    mapping is one record (or a DataLoader's dict of columns), never a batch of states."""
    for batch in batches:
        if isinstance(batch, Mapping):
            raise TypeError(
                f"states_source ({type(source).__name__}) yielded a {type(batch).__name__} with keys "
                f"{sorted(batch)[:8]}, but each item of an iterable source must be one batch of "
                f"states (a list or a Tensor (B, ...)). For a stream of records (a "
                f"datasets.IterableDataset) or a DataLoader over records, batch them as lists: "
                f"DataLoader(ds, batch_size=B, collate_fn=list); a datasets.Dataset can be passed "
                f"itself."
            )
        yield batch


def _call_source(source: Callable[..., Any], batch_size: int) -> Iterator[Any]:
    with_arg = _wants_argument(source)
    while True:
        yield source(batch_size) if with_arg else source()


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
        with forked_rng(torch.device("cpu"), None):
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
            with forked_rng(torch.device("cpu"), None):
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


_REGISTER = (
    "or give it state_dict()/load_state_dict() (e.g. torchdata's StatefulDataLoader) and call "
    "trainer.register_checkpoint_state('data', source) before train()"
)


def resume_problem(source: Any, *, registered: bool = False) -> str | None:
    """Why a resumed `train` would not feed the batches an uninterrupted run feeds, and the fix;
    None when it would (see the module docstring)."""
    if registered or isinstance(source, (Tensor, str, bytes, Mapping)) or _is_map_dataset(source):
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
