"""Checkpoints that are safe to load and resume a run exactly.

A checkpoint root (the directory given to ``save_checkpoint``) holds::

    <root>/
        step-00000004/              one checkpoint per saved step (8 digits), complete or absent
            policy.safetensors      the policy's weights, name -> Tensor
            reference.safetensors   the reference policy's, when the trainer has one
            state.safetensors       every other tensor: optimizer state, scheduler tensors, RNG
                                    states, running statistics of stateful components
            state.json              everything that is not a tensor (the config, step counters, the
                                    optimizer's ``param_groups``, Python / NumPy RNG states, the
                                    structure of each state dict with tensors replaced by
                                    ``{"__tensor__": key}`` references) and a manifest of the files
                                    with their sizes
        step-00000006/
        latest                      text: the newest checkpoint's name (for people and tools)
        .tmp-*                      leftovers of an interrupted save: ignored, removed by the next

Modules (each one's docstring gives its formats):

* `grpo.state.checkpoint.layout`: the file names above;
* `grpo.state.checkpoint.errors`: `CheckpointError` and the messages' pieces;
* `grpo.state.checkpoint.files`: atomic publication, ``latest``, keep-last-K, listing;
* `grpo.state.checkpoint.tree`: state trees <-> JSON with tensor references;
* `grpo.state.checkpoint.codec`: tensors <-> safetensors (aliases of tied tensors, header checks);
* `grpo.state.checkpoint.meta`: ``state.json``'s schema;
* `grpo.state.checkpoint.rng`: the process-global RNG streams;
* `grpo.state.checkpoint.policy`: the policy hook (below);
* `grpo.state.checkpoint.verify`: complete checkpoints, `find_latest_checkpoint`;
* `grpo.state.checkpoint.resume`: the saved config, `resume_config`;
* `grpo.state.checkpoint.config_diff`: the saved config against the live one, by current names;
* `grpo.state.checkpoint.save` / `grpo.state.checkpoint.load`: `save_checkpoint` / `load_checkpoint`.

Guarantees (tests in ``tests/test_checkpoint.py`` and ``tests/test_checkpoint_tampering.py``, list
in ``docs/reliability.md``):

* **Nothing is unpickled.** Tensors go through ``safetensors`` and the rest through JSON; loading
  calls neither ``pickle`` nor ``torch.load``. A file that is not valid safetensors/JSON is
  refused with `CheckpointError`.
* **A checkpoint is untrusted input.** Every value is checked before anything changes, and every
  problem is one `CheckpointError` naming the file and the field: ``state.json`` against its
  schema (keys, types, ranges, nesting depth, size), each safetensors header (names, dtypes,
  shapes) against the live trainer before any tensor is read, and the decoded state against the
  live trainer (`grpo.state.trainer_state`). Allocations are bounded by the live trainer's sizes and
  the bytes present in the files, never by a size written in JSON. No path written in a
  checkpoint is opened (`resume_config`).
* **Atomic.** A checkpoint is written in a temporary directory ``<root>/.tmp-*`` (files fsynced),
  then renamed to ``step-XXXXXXXX`` in one ``os.replace``. Only after that is the ``latest``
  pointer (a text file with the directory name) replaced, again atomically. A process killed at
  any moment leaves either the previous checkpoints or the new complete one; leftovers named
  ``.tmp-*`` are ignored by the loader and removed by the next save.
* **Newest complete wins.** `find_latest_checkpoint` scans ``step-*`` directories newest first and
  returns the first whose manifest checks (``state.json`` parses and fits its schema, every
  listed file exists with its recorded size, every safetensors header parses and holds the
  tensors ``state.json`` refers to); each one skipped is named in a `RuntimeWarning`. ``latest``
  is a convenience for people and tools.
* **Keep last K.** Older checkpoints are renamed to ``.tmp-*`` before they are deleted, so a
  half-deleted checkpoint never carries a ``step-*`` name.

One process writes to one root at a time.

Policies that are not ``nn.Module``s save through this hook (first that applies):

1. methods ``state_dict() -> Mapping[str, Tensor]`` and ``load_state_dict(mapping)``;
2. otherwise the tensors of ``get_parameters()`` (a mapping or an iterable), restored by copying
   in place (``tensor.copy_``) so that an optimizer holding them stays valid.
"""

from __future__ import annotations

from grpo.state.checkpoint.errors import CheckpointDir, CheckpointError, in_file
from grpo.state.checkpoint.files import list_checkpoints
from grpo.state.checkpoint.layout import (
    FORMAT,
    LATEST,
    POLICY_FILE,
    PREFIX,
    REFERENCE_FILE,
    STATE_FILE,
    STATE_JSON,
    TMP_PREFIX,
    VERSION,
)
from grpo.state.checkpoint.load import Restorable, load_checkpoint
from grpo.state.checkpoint.meta import MAX_COUNT, MAX_STATE_JSON_BYTES
from grpo.state.checkpoint.policy import load_policy_state, policy_state
from grpo.state.checkpoint.resume import PATH_FIELDS, read_checkpoint_config, resume_config
from grpo.state.checkpoint.rng import capture_rng, restore_rng
from grpo.state.checkpoint.save import save_checkpoint
from grpo.state.checkpoint.tree import MAX_DEPTH, TensorFn
from grpo.state.checkpoint.verify import find_latest_checkpoint, manifest_problem

__all__ = [
    "FORMAT",
    "LATEST",
    "MAX_COUNT",
    "MAX_DEPTH",
    "MAX_STATE_JSON_BYTES",
    "PATH_FIELDS",
    "POLICY_FILE",
    "PREFIX",
    "REFERENCE_FILE",
    "STATE_FILE",
    "STATE_JSON",
    "TMP_PREFIX",
    "VERSION",
    "CheckpointDir",
    "CheckpointError",
    "Restorable",
    "TensorFn",
    "capture_rng",
    "find_latest_checkpoint",
    "in_file",
    "list_checkpoints",
    "load_checkpoint",
    "load_policy_state",
    "manifest_problem",
    "policy_state",
    "read_checkpoint_config",
    "restore_rng",
    "resume_config",
    "save_checkpoint",
]
