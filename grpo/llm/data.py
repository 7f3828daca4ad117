"""Prompt data: a Python list, a JSON / JSONL / Parquet / CSV file or a `datasets.Dataset`, as
records for the trainer, dealt out in a seeded order that a resumed run can take up exactly.

A *state* of the LLM path is one of

* a prompt string,
* a chat (a list of ``{"role": ..., "content": ...}`` messages), rendered with the tokenizer's
  chat template,
* a record (a mapping) with the prompt under ``"prompt"`` and any other columns (``"answer"``,
  ...), which `grpo.llm.RewardFunctions` passes to the reward functions as keyword arguments.

`PromptDataset` turns every source into records ``{"prompt": ..., <other columns>}``. Three ways
to feed them to the trainer, each exact on resume:

* ``trainer.train(data, ...)``: the records in file order, cycled in batches of B (batch k is
  records ``k*B ... k*B + B - 1`` mod n, `grpo.training.sources`);
* ``trainer.train(data.shuffled(seed), ...)``: the same, over a seeded new order each pass
  (`ShuffledRecords`, a sequence view: nothing to register, sharded under torchrun like a list);
* ``data.batches(B, seed=...)``: a `PromptBatches` iterator (one batch per ``next``, whole epochs,
  optional ``drop_last``) that starts at any batch (``start=k``) and carries its position in
  ``state_dict()``, for ``trainer.register_checkpoint_state("data", batches)`` or a loop of
  one's own.

Epoch e's order is the e-th shuffle of one ``random.Random(seed)`` stream (epoch 0 is the first),
the same in `PromptDataset.batches` and `PromptDataset.shuffled`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, overload

__all__ = [
    "Prompt",
    "PromptBatches",
    "PromptDataset",
    "ShuffledRecords",
    "is_chat",
    "prompt_text",
    "state_columns",
]

Prompt = str | list[dict[str, Any]]
"""A prompt: a string, or a list of chat messages."""

PROMPT_KEY = "prompt"


def is_chat(prompt: Any) -> bool:
    """True for a list of chat messages (mappings with ``role`` and ``content``)."""
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, str)
        and len(prompt) > 0
        and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in prompt)
    )


def prompt_text(state: Any) -> Prompt:
    """The prompt of a state: the state itself (string / chat) or ``state["prompt"]``."""
    if isinstance(state, Mapping):
        if PROMPT_KEY not in state:
            raise KeyError(
                f"a prompt record must have a {PROMPT_KEY!r} key; got keys {sorted(state)}. Build "
                f"records with PromptDataset(..., prompt_column=...)."
            )
        state = state[PROMPT_KEY]
    if isinstance(state, str) or is_chat(state):
        return state  # type: ignore[no-any-return]
    raise TypeError(
        f"a prompt must be a string or a list of chat messages {{'role': ..., 'content': ...}}; "
        f"got {type(state).__name__}: {state!r:.80}"
    )


def state_columns(states: Sequence[Any]) -> dict[str, list[Any]]:
    """Extra columns of N states (records), as ``name -> list of N values``.

    Plain prompts have no columns. A column missing from some records is None there.
    """
    names: list[str] = []
    for s in states:
        if isinstance(s, Mapping):
            names.extend(k for k in s if k != PROMPT_KEY and k not in names)
    return {k: [s.get(k) if isinstance(s, Mapping) else None for s in states] for k in names}


DATASETS_FORMATS = {".parquet": "parquet", ".csv": "csv", ".tsv": "csv"}
"""File suffixes read with ``datasets.load_dataset(<builder>, data_files=path)``."""
FILE_FORMATS = (".jsonl", ".json", *DATASETS_FORMATS)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _EpochOrders:
    """The order of the records in each epoch: epoch e is ``list(range(n))`` after the (e+1)-th
    ``shuffle`` of one ``random.Random(seed)`` stream (unshuffled with ``shuffle=False``).

    Computed forward from the last epoch asked for; an earlier epoch replays the stream from
    its start (O(e * n) for epoch e).
    """

    def __init__(self, n: int, shuffle: bool, seed: int) -> None:
        self.n, self.shuffle, self.seed = n, shuffle, seed
        self._rng = random.Random(seed)
        self._epoch = -1
        self._order: list[int] = []

    def __call__(self, epoch: int) -> list[int]:
        if not self.shuffle:
            if len(self._order) != self.n:
                self._order = list(range(self.n))
            return self._order
        if epoch < self._epoch:
            self._rng, self._epoch = random.Random(self.seed), -1
        while self._epoch < epoch:
            self._order = list(range(self.n))
            self._rng.shuffle(self._order)
            self._epoch += 1
        return self._order


class PromptBatches(Iterator[list[dict[str, Any]]]):
    """Batches of B records, epoch after epoch in a seeded order, from any batch on.

    With P = `per_epoch` batches a pass (``ceil(n / B)``; ``floor(n / B)`` with ``drop_last``,
    which leaves out the short last batch), batch k is batch ``k mod P`` of epoch ``k // P``:
    records ``order_e[j*B : (j+1)*B]`` with ``j = k mod P`` (`_EpochOrders` gives ``order_e``).
    So the batches from ``start=k`` are exactly those an iterator started at 0 yields after its
    first k, across epoch boundaries.

    ``position`` is the index of the next batch. ``state_dict()`` holds it with the settings it
    depends on; ``load_state_dict`` restores it (after checking the settings), so
    ``trainer.register_checkpoint_state("data", batches)`` makes ``train`` resume it exactly.

    Args:
        records: the records (`PromptDataset.records`).
        batch_size: B, records per batch.
        shuffle: a new seeded order each epoch (else the records' own order).
        seed: seed of the ``random.Random`` stream of orders.
        epochs: passes to make; None = without end.
        drop_last: leave out each epoch's short last batch.
        start: index of the first batch to yield.
    """

    def __init__(
        self,
        records: Sequence[dict[str, Any]],
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        epochs: int | None = 1,
        drop_last: bool = False,
        start: int = 0,
    ) -> None:
        if not _is_int(batch_size) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be an integer >= 1.")
        if epochs is not None and (not _is_int(epochs) or epochs < 0):
            raise ValueError(f"epochs={epochs!r} must be an integer >= 0, or None for no end.")
        if not _is_int(seed):
            raise TypeError(f"seed={seed!r} must be an integer.")
        n = len(records)
        self.records = records
        self.batch_size, self.shuffle, self.seed = batch_size, bool(shuffle), seed
        self.epochs, self.drop_last = epochs, bool(drop_last)
        self.per_epoch = n // batch_size if drop_last else -(-n // batch_size)
        if self.per_epoch == 0 and epochs != 0:
            raise ValueError(
                "no records to batch; give at least one."
                if n == 0
                else f"{n} records do not fill one batch of {batch_size} with drop_last=True; use a "
                f"smaller batch_size or drop_last=False."
            )
        self._orders = _EpochOrders(n, self.shuffle, seed)
        self.position = 0
        self._seek(start, "start")

    @property
    def num_batches(self) -> int | None:
        """Batches over all epochs (None without an end)."""
        return None if self.epochs is None else self.per_epoch * self.epochs

    def _seek(self, position: object, name: str) -> None:
        """Make batch ``position`` the next one (0 <= position <= `num_batches`)."""
        total = self.num_batches
        if (
            isinstance(position, bool)
            or not isinstance(position, int)
            or position < 0
            or (total is not None and position > total)
        ):
            bound = "" if total is None else f" and <= {total} (the batches of {self.epochs} epochs)"
            raise ValueError(f"{name}={position!r} must be an integer >= 0{bound}.")
        self.position = position

    def __iter__(self) -> PromptBatches:
        return self

    def __next__(self) -> list[dict[str, Any]]:
        total = self.num_batches
        if total is not None and self.position >= total:
            raise StopIteration
        epoch, j = divmod(self.position, self.per_epoch)
        idx = self._orders(epoch)[j * self.batch_size : (j + 1) * self.batch_size]
        self.position += 1
        return [self.records[i] for i in idx]

    def _settings(self) -> dict[str, Any]:
        return {
            "num_records": len(self.records),
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "epochs": self.epochs,
            "drop_last": self.drop_last,
        }

    def state_dict(self) -> dict[str, Any]:
        """``{"position": <next batch>, "num_records", "batch_size", "shuffle", "seed",
        "epochs", "drop_last"}`` (plain data)."""
        return {"position": self.position, **self._settings()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue at ``state["position"]``; refuses (changing nothing) a state taken with other
        settings, naming each one that differs."""
        mine = self._settings()
        missing = sorted({"position", *mine} - set(state))
        if missing:
            raise ValueError(
                f"PromptBatches.load_state_dict: the state lacks {missing}; got keys {sorted(state)}."
            )
        differ = {k: (state[k], v) for k, v in mine.items() if state[k] != v}
        if differ:
            saved = ", ".join(f"{k}={a!r}" for k, (a, _) in differ.items())
            here = ", ".join(f"{k}={b!r}" for k, (_, b) in differ.items())
            raise ValueError(
                f"PromptBatches.load_state_dict: the position was saved with {saved}, but these "
                f"batches have {here}; build them from the same records with the saved settings."
            )
        self._seek(state["position"], "state['position']")


class ShuffledRecords(Sequence[dict[str, Any]]):
    """``epochs`` passes over the records as one sequence, each pass in its seeded order.

    Item i is ``records[order_e[i mod n]]`` of epoch ``e = i // n`` (the orders of
    `PromptBatches` with the same seed); nothing is copied. ``trainer.train`` cycles a sequence
    in batches of B, batch k being items ``k*B ... k*B + B - 1`` (mod its length), so it resumes
    this view exactly with nothing registered, and shards it under torchrun like a list. After
    ``epochs`` passes the view starts again at epoch 0's order; a batch may span two epochs when
    B does not divide n.
    """

    def __init__(self, records: Sequence[dict[str, Any]], *, seed: int, epochs: int) -> None:
        if not _is_int(epochs) or epochs < 1:
            raise ValueError(f"epochs={epochs!r} must be an integer >= 1 (passes before the order repeats).")
        if not _is_int(seed):
            raise TypeError(f"seed={seed!r} must be an integer.")
        self.records, self.seed, self.epochs = records, seed, epochs
        self._orders = _EpochOrders(len(records), True, seed)

    def __len__(self) -> int:
        return len(self.records) * self.epochs

    @overload
    def __getitem__(self, i: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, i: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, i: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        size = len(self)
        if not -size <= i < size:
            raise IndexError(f"ShuffledRecords index {i} out of range for length {size}.")
        epoch, j = divmod(i % size, len(self.records))
        return self.records[self._orders(epoch)[j]]


def _check_columns(
    names: Sequence[str], prompt_column: str, columns: Sequence[str] | None, what: str
) -> None:
    """Refuse a ``what`` (a dataset, a record) whose columns ``names`` lack the prompt column or
    a column asked for, listing the columns it has."""
    if prompt_column not in names:
        raise KeyError(
            f"{what} has no prompt column {prompt_column!r}; its columns are {sorted(names)}. "
            f"Pass prompt_column=<the column with the prompt>."
        )
    missing = [c for c in columns or () if c not in names]
    if missing:
        raise KeyError(
            f"{what} has no column {missing[0]!r} (asked for in columns={list(columns or ())}); its "
            f"columns are {sorted(names)}. Leave it out of columns=, or add it to the data."
        )


def _record(item: Any, i: int, prompt_column: str, columns: Sequence[str] | None) -> dict[str, Any]:
    """Item ``i`` of the data as ``{"prompt": ..., <columns kept>}``, its prompt checked."""
    if isinstance(item, Mapping):
        _check_columns(list(item), prompt_column, columns, f"record {i}")
        rec = {PROMPT_KEY: item[prompt_column]}
        rec.update(
            (k, v) for k, v in item.items() if k != prompt_column and (columns is None or k in columns)
        )
    elif columns:
        raise KeyError(
            f"record {i} is a bare prompt ({type(item).__name__}) with no columns, but columns="
            f"{list(columns)} were asked for; give records as mappings, or leave out columns=."
        )
    else:
        rec = {PROMPT_KEY: item}
    prompt_text(rec)  # validates the prompt's type
    return rec


def _read_jsonl(path: Path) -> list[Any]:
    """One JSON value per line (blank lines skipped); an error names the file and line."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}): {line[:80]!r}") from e
    return rows


def _read_json(path: Path) -> list[Any]:
    """A JSON list of records, or JSON Lines in a ``.json`` file."""
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            if e.msg == "Extra data":  # one value per line
                return _read_jsonl(path)
            raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg}).") from e
    if not isinstance(data, list):
        raise ValueError(
            f"{path} holds a JSON {type(data).__name__}; expected a list of records (or one record "
            f"per line). For records under a key, load them with json and pass PromptDataset(data[key])."
        )
    return data


def _pick_split(data: Any, split: str, where: str) -> Any:
    """``data[split]`` of a ``DatasetDict``; a `datasets.Dataset` as it is."""
    if not isinstance(data, Mapping):
        return data
    if split not in data:
        raise KeyError(
            f"{where} has no split {split!r}; its splits are {sorted(data)}. Pass split=<one of them>."
        )
    return data[split]


def _read_path(path: Path, split: str) -> Any:
    """The records of a file (by suffix) or of a ``save_to_disk`` directory."""
    if path.is_dir():
        from grpo.llm._deps import require

        return _pick_split(require("datasets").load_from_disk(str(path)), split, str(path))
    if not path.exists():
        raise FileNotFoundError(
            f"prompt data {str(path)!r} not found; give a file ({', '.join(FILE_FORMATS)}) or a "
            f"directory written by datasets.Dataset.save_to_disk. For a dataset of the Hugging Face "
            f"Hub, pass datasets.load_dataset(name, split='train') itself."
        )
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path)
    if suffix == ".json":
        return _read_json(path)
    if suffix in DATASETS_FORMATS:
        from grpo.llm._deps import require

        extra = {"delimiter": "\t"} if suffix == ".tsv" else {}
        load_dataset = require("datasets").load_dataset
        return load_dataset(DATASETS_FORMATS[suffix], data_files=str(path), split="train", **extra)
    raise ValueError(
        f"prompt data {str(path)!r}: cannot tell its format from the suffix {suffix or '(none)'!r}; "
        f"use one of {', '.join(FILE_FORMATS)}, or load it yourself and pass the records."
    )


class PromptDataset(Sequence[dict[str, Any]]):
    """Records ``{"prompt": ..., **columns}`` from a list, a file or a `datasets.Dataset`.

    Args:
        data: a list of prompt strings, chats, or mappings; or a `datasets.Dataset` (a
            ``DatasetDict`` is refused: pass one split). Files: `PromptDataset.load`.
        prompt_column: the column holding the prompt in mappings / datasets (renamed ``prompt``).
        columns: the other columns to keep (default: all); each must be present.

    Raises:
        KeyError: the prompt column, or a column of ``columns``, is missing (the message lists the
            columns present).
        TypeError: a prompt is neither a string nor a chat.
    """

    def __init__(
        self,
        data: Sequence[Any] | Any,
        prompt_column: str = PROMPT_KEY,
        columns: Sequence[str] | None = None,
    ) -> None:
        if isinstance(data, (str, bytes, Path)):
            raise TypeError(f"PromptDataset({str(data)!r:.80}): to read a file use PromptDataset.load(path).")
        if isinstance(columns, str):
            raise TypeError(f"columns={columns!r} must be a list of column names, e.g. [{columns!r}].")
        if isinstance(data, Mapping):
            raise TypeError(
                f"PromptDataset got a mapping ({type(data).__name__}) with keys {sorted(data)[:10]}; "
                f"for a DatasetDict pass one split, e.g. PromptDataset(data['train'])."
            )
        names = getattr(data, "column_names", None)
        if isinstance(names, list):  # a datasets.Dataset: its schema, checked before any row is read
            _check_columns(names, prompt_column, columns, f"the {type(data).__name__}")
        rows = [_record(item, i, prompt_column, columns) for i, item in enumerate(data)]
        if not rows:
            raise ValueError("PromptDataset got no prompts; give at least one.")
        self.records = rows

    @classmethod
    def from_jsonl(
        cls, path: str | Path, prompt_column: str = PROMPT_KEY, columns: Sequence[str] | None = None
    ) -> PromptDataset:
        """One JSON object per line (blank lines skipped), read with the standard library."""
        return cls(_read_jsonl(Path(path)), prompt_column=prompt_column, columns=columns)

    @classmethod
    def load(
        cls,
        source: Any,
        prompt_column: str = PROMPT_KEY,
        columns: Sequence[str] | None = None,
        *,
        split: str = "train",
    ) -> PromptDataset:
        """A `PromptDataset` from a path, a `datasets.Dataset` or a list.

        Paths by suffix: ``.jsonl`` and ``.json`` (a list of records, or one per line) are read
        with the standard library (every value as written, errors with the line number);
        ``.parquet``, ``.csv`` and ``.tsv`` with ``datasets.load_dataset`` (the ``llm`` extra);
        a directory written by ``save_to_disk`` with ``datasets.load_from_disk``, taking
        ``split`` of a ``DatasetDict``. A `PromptDataset` is returned as it is.
        """
        if isinstance(source, PromptDataset):
            return source
        if isinstance(source, (str, Path)):
            source = _read_path(Path(source), split)
        return cls(source, prompt_column, columns)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: Any) -> Any:
        return self.records[i]

    @property
    def column_names(self) -> list[str]:
        """The columns besides ``prompt``, in order of first appearance."""
        return list(state_columns(self.records))

    def batches(
        self,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        epochs: int | None = 1,
        drop_last: bool = False,
        start: int = 0,
    ) -> PromptBatches:
        """Batches of ``batch_size`` records for ``epochs`` passes (None: no end), reshuffled each
        pass, from batch ``start`` on: a `PromptBatches` iterator with ``state_dict()``."""
        return PromptBatches(
            self.records,
            batch_size,
            shuffle=shuffle,
            seed=seed,
            epochs=epochs,
            drop_last=drop_last,
            start=start,
        )

    def shuffled(self, seed: int = 0, *, epochs: int) -> ShuffledRecords:
        """The records over ``epochs`` passes, each in a seeded order, as one sequence for
        ``trainer.train`` (`ShuffledRecords`)."""
        return ShuffledRecords(self.records, seed=seed, epochs=epochs)

    def num_batches(self, batch_size: int, epochs: int = 1, drop_last: bool = False) -> int:
        """Batches of ``batch_size`` over ``epochs`` passes (the short last one of each pass counted
        unless ``drop_last``)."""
        if not _is_int(batch_size) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be an integer >= 1.")
        n = len(self.records)
        per = n // batch_size if drop_last else -(-n // batch_size)
        return per * epochs
