"""`WorkerEngine`: a generation worker in its own process, with weight sync through shared memory.

``GRPOConfig.generation_engine="worker"``. One process (``torch.multiprocessing``, ``spawn``
context) builds its own copy of the policy (``make_policy()``) and serves the commands the trainer
sends through a pipe, strictly in the order they were sent, with one reply per command::

    generate(states, G, options, seed) -> (actions, sampler log-probs, version it had loaded)
    sync(version)                      -> copies the shared buffers into its parameters; ack
    close                              -> exits

So a generation submitted before ``sync(policy, v)`` samples with the weights before ``v``, and one
submitted after samples with ``v`` (`grpo.generation.async_rollouts` relies on it).

Weight sync. ``policy.get_parameters()`` (the trainable tensors; with LoRA the adapter's only) is
copied into CPU buffers in shared memory, allocated once at the first sync and sent to the worker
once (as shared-memory handles); each sync then copies the trainer's tensors in (``B`` bytes,
`WorkerEngine.last_sync_bytes`) and sends a small ``sync(version)`` command; the worker copies the
buffers into its own parameters by name. **No torn reads**: the worker reads the buffers only while
it runs that sync command, and the trainer writes them again only after the worker acknowledged
the previous sync (`WorkerEngine.sync` waits for that ack first). A generation submitted in between
never reads the buffers, so the wait costs nothing when the worker is ahead (async rollouts: the
ack of sync ``s`` arrives before the generation the trainer needs next).

Lifetime: the worker removes the saved copy it loads from (``cleanup_dir``; a causal LM's:
`grpo.llm.engines.worker.causal_lm_worker`) once it has built its policy, and exits
(removing the copy if it is still there) when the trainer dies, whatever killed it
(`grpo.generation.worker_lifetime`); the trainer removes the copy and stops the worker at close.

Reproducibility: with ``seed``, the worker seeds torch's RNG with ``job_seed(seed, j)`` before the
``j``-th generation job (0, 1, ...), so a run's samples do not depend on timing. Train() submits
one job per step, so job j is the batch of step j; a new engine first synced to version v > 0 (a
resumed trainer) starts at job v, so a resumed run seeds each batch as the uninterrupted run did
(with async rollouts the k batches a checkpoint restores count as jobs v .. v+k-1: `skip_job`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.multiprocessing as mp
from torch import Tensor, nn

from grpo.generation.engine import Generated
from grpo.generation.worker_lifetime import (
    abandon,
    exit_with_trainer,
    private_progress_lock,
    remove_owned_dir,
)
from grpo.policy_base import PolicyModel, PolicyOutput, has_method, set_training_mode

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

__all__ = [
    "DeferredCall",
    "GenerationWorkerError",
    "SharedWeights",
    "WorkerEngine",
    "WorkerGeneration",
    "job_seed",
    "sample_with_log_probs",
    "trainable_tensors",
]

logger = logging.getLogger(__name__)

_POLL_SECONDS = 0.1  # how often a wait for a reply checks that the worker is alive
_MASK64 = (1 << 64) - 1


def job_seed(seed: int, job: int) -> int:
    """The torch seed of generation job ``job`` (0, 1, ...) of an engine seeded ``seed``.

    ``splitmix64(seed XOR (job + 1) * 0x9E3779B97F4A7C15)``, shifted to 63 bits: distinct jobs get
    unrelated streams, and seeds ``s`` and ``s + 1`` do not share jobs' streams.
    """
    z = (int(seed) ^ ((int(job) + 1) * 0x9E3779B97F4A7C15)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class GenerationWorkerError(RuntimeError):
    """The generation worker failed a command, or died. ``remote_type`` / ``remote_traceback``:
    the exception raised in the worker and its traceback text (empty when it died)."""

    def __init__(self, message: str, remote_type: str = "", remote_traceback: str = "") -> None:
        super().__init__(message)
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback


# ---- the worker process -------------------------------------------------------------------------
def sample_with_log_probs(
    policy: PolicyModel,
    states: Any,
    num_actions_per_state: int,
    options: Mapping[str, Any],
    with_log_probs: bool,
) -> tuple[Any, Tensor | PolicyOutput | None]:
    """G actions per state from ``policy`` and, when ``with_log_probs``, the sampler's log-probs of
    the N = B*G flat actions (group-major): ``generate_actions_with_sampler_log_probs`` (a
    `grpo.llm.CausalLMPolicy`: read while sampling) or ``generate_actions_with_log_probs`` when the
    policy has one, else ``generate_actions`` then ``get_log_probabilities(flat states, flat
    actions)`` with the same weights (a `grpo.llm.CausalLMPolicy` scores at each completion's
    sampling temperature).
    Shapes: actions as ``generate_actions`` returns them; log-probs (N,) or (N, T) / `PolicyOutput`.
    """
    g = int(num_actions_per_state)
    if with_log_probs and has_method(policy, "generate_actions_with_sampler_log_probs"):
        # a language model: read from the scores generate samples from, no second forward
        return policy.generate_actions_with_sampler_log_probs(states, g, **options)  # type: ignore[attr-defined,no-any-return]
    if with_log_probs and has_method(policy, "generate_actions_with_log_probs"):
        actions, log_probs = policy.generate_actions_with_log_probs(states, g, **options)  # type: ignore[attr-defined]
        return actions, log_probs
    actions = policy.generate_actions(states, g, **options)
    if not with_log_probs:
        return actions, None
    if isinstance(actions, Tensor):
        flat_actions: Any = actions.flatten(0, 1)  # (B, G, ...) -> (N, ...)
    else:
        flat_actions = [a for group in actions for a in group]
    flat_states = (
        states.repeat_interleave(g, 0)
        if isinstance(states, Tensor)
        else [s for s in states for _ in range(g)]
    )
    return actions, policy.get_log_probabilities(flat_states, flat_actions)


class DeferredCall:
    """A picklable ``make_policy`` whose function and arguments are unpickled only when it is
    called: ``DeferredCall(fn, *args, **kwargs)()`` is ``fn(*args, **kwargs)``.

    Spawn unpickles a process's arguments before its target runs, so a plain
    ``functools.partial(fn, ...)`` imports ``fn``'s module (for a language model: transformers)
    before the worker watches for its trainer's death (`worker_lifetime.exit_with_trainer`); a
    trainer killed meanwhile would leave the worker importing for seconds. Here those imports
    run inside ``make_policy()``, after the watch is set up.
    """

    def __init__(self, fn: Callable[..., PolicyModel], *args: Any, **kwargs: Any) -> None:
        self.payload = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)

    def __call__(self) -> PolicyModel:
        fn, args, kwargs = pickle.loads(self.payload)
        policy: PolicyModel = fn(*args, **kwargs)
        return policy


def trainable_tensors(policy: PolicyModel) -> dict[str, Tensor]:
    """``policy.get_parameters()`` as a name -> tensor dict (an iterable is named by position,
    ``"0"``, ``"1"``, ...): what a sync moves."""
    params = policy.get_parameters()
    if isinstance(params, Mapping):
        return dict(params)
    return {str(i): t for i, t in enumerate(params)}


def _named_tensors(policy: PolicyModel) -> dict[str, Tensor]:
    """The policy's tensors a sync may write: `trainable_tensors`, then every parameter of its
    module (``training_module()``, or the policy itself when it is an ``nn.Module``)."""
    named = trainable_tensors(policy)
    module = policy.training_module() if has_method(policy, "training_module") else policy  # type: ignore[attr-defined]
    if isinstance(module, nn.Module):
        for n, p in module.named_parameters():
            named.setdefault(n, p)
    return named


def _matched_parameters(policy: PolicyModel, buffers: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The worker policy's tensor for each buffer name; ValueError naming missing or misshaped ones."""
    own = _named_tensors(policy)
    missing = [n for n in buffers if n not in own]
    shapes = [
        f"{n}: trainer {tuple(b.shape)}, worker {tuple(own[n].shape)}"
        for n, b in buffers.items()
        if n in own and own[n].shape != b.shape
    ]
    if missing or shapes:
        raise ValueError(
            f"the trainer's trainable tensors do not match the worker's policy: missing in the "
            f"worker {missing[:5]}{' ...' if len(missing) > 5 else ''}; shape mismatches {shapes[:5]}. "
            f"make_policy must build the same architecture (with LoRA: the same adapter) as the "
            f"trainer's policy."
        )
    return {n: own[n] for n in buffers}


class _WorkerState:
    """What the worker process holds: its policy, the shared buffers, the version it has loaded."""

    def __init__(self, policy: PolicyModel) -> None:
        self.policy = policy
        self.version = 0
        self.buffers: dict[str, Tensor] = {}
        self.targets: dict[str, Tensor] = {}
        self.broken: str | None = None

    def handle(self, command: tuple[Any, ...]) -> Any:
        kind = command[0]
        if kind == "generate":
            return self.generate(*command[1:])
        if kind == "sync":
            return self.sync(*command[1:])
        if kind == "invalid":
            raise RuntimeError(f"the worker could not read the command: {command[1]}")
        raise ValueError(f"unknown worker command {kind!r}")

    def generate(
        self, states: Any, g: int, options: dict[str, Any], with_log_probs: bool, seed: int | None
    ) -> tuple[Any, Tensor | PolicyOutput | None, int]:
        if self.broken is not None:
            raise RuntimeError(
                f"an earlier weight sync failed in the worker ({self.broken}), so its weights are "
                f"undefined. Close the engine and build a new one."
            )
        if seed is not None:
            torch.manual_seed(seed)
        with torch.no_grad():
            actions, log_probs = sample_with_log_probs(self.policy, states, g, options, with_log_probs)
        return actions, log_probs, self.version

    def sync(self, version: int, buffers: dict[str, Tensor] | None) -> tuple[int, float]:
        """Copy the shared buffers into the policy's tensors (the first sync brings the buffers)."""
        t0 = time.perf_counter()
        try:
            if buffers is not None:
                self.buffers, self.targets = buffers, _matched_parameters(self.policy, buffers)
            with torch.no_grad():
                for name, buf in self.buffers.items():
                    self.targets[name].copy_(buf)
        except Exception as e:
            self.broken = f"{type(e).__name__}: {e}"
            raise
        self.version = int(version)
        return self.version, time.perf_counter() - t0


def _reply(conn: Connection, seq: int, status: str, payload: Any) -> None:
    """Send one reply (plain pickle: tensors travel by value, not as shared-memory handles)."""
    try:
        data = pickle.dumps((seq, status, payload), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        data = pickle.dumps((seq, "error", _error_payload("pickling the reply")))
    conn.send_bytes(data)


def _reply_or_abandon(conn: Connection, seq: int, status: str, payload: Any, leftover: str | None) -> None:
    """`_reply`, or (the trainer is gone) `worker_lifetime.abandon`: exit without a traceback."""
    try:
        _reply(conn, seq, status, payload)
    except OSError:
        abandon(leftover)


def _error_payload(doing: str = "") -> tuple[str, str, str]:
    """(exception type, message, traceback text) of the exception being handled."""
    exc = sys.exc_info()[1]
    name = type(exc).__name__ if exc is not None else "Error"
    message = f"{doing}: {exc}" if doing else str(exc)
    return name, message, traceback.format_exc()


def _read_commands(
    conn: Connection,
    commands: queue.Queue[tuple[Any, ...]],
    closing: threading.Event,
    on_lost: Callable[[], None],
) -> None:
    """Reader thread: move commands from the pipe to ``commands`` as they come, so the trainer's
    sends never wait on a busy worker (no pipe deadlock). ``close`` or EOF (the trainer is gone)
    sets ``closing``: the worker then exits without running the commands still queued. EOF before
    the policy is built calls ``on_lost`` (`worker_lifetime.abandon`: no load for a dead trainer)."""
    while True:
        try:
            command = conn.recv()
        except (EOFError, OSError):
            on_lost()
            command = ("close",)
        except Exception:
            command = ("invalid", traceback.format_exc())
        if command[0] == "close":
            closing.set()
        commands.put(command)
        if closing.is_set():
            return


def serve(
    conn: Connection,
    make_policy: Callable[[], PolicyModel],
    num_threads: int,
    trainer_pid: int | None = None,
    leftover: str | None = None,
) -> None:
    """The worker process's main: build the policy (reply 0: ready, or the error), then serve the
    commands in order (reply k to the k-th command) until ``close`` or EOF.

    ``trainer_pid``: the parent; when it dies the worker exits at once (`worker_lifetime`).
    ``leftover``: a directory the worker removes once ``make_policy`` returned or raised (the
    saved copy it loads from), or when the trainer dies first."""
    if trainer_pid is not None:
        exit_with_trainer(trainer_pid, leftover)
    private_progress_lock()
    torch.set_num_threads(num_threads)
    commands: queue.Queue[tuple[Any, ...]] = queue.Queue()
    closing, built = threading.Event(), threading.Event()

    def on_lost() -> None:
        if not built.is_set():
            abandon(leftover)

    threading.Thread(target=_read_commands, args=(conn, commands, closing, on_lost), daemon=True).start()
    try:
        policy = make_policy()
        set_training_mode(policy, False)
    except Exception:
        remove_owned_dir(leftover)
        _reply_or_abandon(conn, 0, "error", _error_payload("building the policy (make_policy())"), leftover)
        return
    remove_owned_dir(leftover)
    built.set()
    _reply_or_abandon(conn, 0, "ok", None, leftover)
    state = _WorkerState(policy)
    seq = 0
    while True:
        command = commands.get()
        if closing.is_set():
            return
        seq += 1
        try:
            payload, status = state.handle(command), "ok"
        except Exception:
            payload, status = _error_payload(), "error"
        try:
            _reply(conn, seq, status, payload)
        except OSError:  # the trainer is gone
            return


# ---- the trainer's side -------------------------------------------------------------------------
class _Channel:
    """The trainer's end of the pipe: numbered commands, replies matched to them by order (reply
    k answers command k; reply 0 is the worker's ready), a buffer for replies that arrive before
    their waiter asks, and a clear error when the worker died."""

    def __init__(self, process: Any, conn: Connection, name: str, on_ready: Callable[[], None]) -> None:
        self.process, self.conn, self.name, self.on_ready = process, conn, name, on_ready
        self.sent = 0
        self.received = 0  # replies read from the pipe so far
        self.what: dict[int, str] = {0: "starting (make_policy())"}
        self.replies: dict[int, tuple[str, Any]] = {}
        self.abandoned: set[int] = set()
        self.failure: str | None = None  # set when the worker is dead or closed

    def send(self, command: tuple[Any, ...], what: str, *, shared: bool = False) -> int:
        """Send ``command`` (``shared``: tensors in shared memory go as handles); its reply's number."""
        self.check_usable()
        try:
            if shared:  # torch's ForkingPickler reductions: the storages are shared, not copied
                self.conn.send(command)
            else:
                self.conn.send_bytes(pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:
            raise self._died(what) from None
        self.sent += 1
        self.what[self.sent] = what
        return self.sent

    def wait(self, seq: int) -> Any:
        """The payload of reply ``seq`` (reading and buffering the earlier ones); GenerationWorkerError
        for an error reply or a dead worker."""
        while seq not in self.replies:
            self.check_usable()
            self.receive_one()
        status, payload = self.replies.pop(seq)
        what = self.what.pop(seq, f"command {seq}")
        if status == "error":
            raise self._remote_error(what, payload)
        return payload

    def discard(self, seq: int) -> None:
        """Drop reply ``seq`` (its handle was never asked): now if it came, else when it comes."""
        if self.replies.pop(seq, None) is None and seq >= self.received:
            self.abandoned.add(seq)
        self.what.pop(seq, None)

    def check_usable(self) -> None:
        if self.failure is not None:
            raise GenerationWorkerError(self.failure)

    def receive_one(self) -> None:
        while not self.conn.poll(_POLL_SECONDS):
            if not self.process.is_alive() and not self.conn.poll(0):
                raise self._died(self.what.get(self.received, "a command"))
        try:
            seq, status, payload = self.conn.recv()
        except (EOFError, OSError):
            raise self._died(self.what.get(self.received, "a command")) from None
        self.received += 1
        if seq == 0:
            if status == "error":
                self.failure = f"generation worker {self.name!r} could not start"
                raise self._remote_error(self.what.pop(0), payload)
            self.what.pop(0, None)
            self.on_ready()
        elif seq in self.abandoned:
            self.abandoned.discard(seq)
        else:
            self.replies[seq] = (status, payload)

    def _remote_error(self, what: str, payload: tuple[str, str, str]) -> GenerationWorkerError:
        name, message, tb = payload
        return GenerationWorkerError(
            f"generation worker {self.name!r} (pid {self.process.pid}) failed {what}: {name}: "
            f"{message}\n\n--- traceback in the worker ---\n{tb}",
            name,
            tb,
        )

    def _died(self, what: str) -> GenerationWorkerError:
        self.process.join(10.0)  # its pipe closed: it is gone or going (under load, reaping takes > 1 s)
        code = self.process.exitcode
        how = "no exit code after 10 s" if code is None else f"exit code {code}"
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                how = f"killed by {signal.Signals(-code).name}"
        self.failure = (
            f"generation worker {self.name!r} (pid {self.process.pid}) died ({how}) before replying "
            f"to {what}: it was killed or crashed (out of memory? its output above may say why). The "
            f"engine cannot be used any more: close it and build a new one (a new GRPOTrainer), or "
            f"use generation_engine='hf'."
        )
        return GenerationWorkerError(self.failure)


@dataclass(frozen=True)
class _Resources:
    """What `WorkerEngine.close` (or its finalizer at garbage collection / exit) releases."""

    process: Any
    conn: Connection
    cleanup_dir: str | None
    close_timeout: float

    def ready(self) -> None:
        """The worker loaded its policy: the saved copy on disk is no longer needed."""
        remove_owned_dir(self.cleanup_dir)

    def shutdown(self) -> None:
        """Ask the worker to exit; terminate, then kill it if it does not within the timeout."""
        process = self.process
        if process.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send_bytes(pickle.dumps(("close",)))
            process.join(self.close_timeout)
        if process.is_alive():
            process.terminate()
            process.join(2.0)
        if process.is_alive():
            process.kill()
            process.join()
        self.conn.close()
        self.ready()
        logger.debug("generation worker pid %s stopped (exit code %s)", process.pid, process.exitcode)


class SharedWeights:
    """CPU buffers in shared memory, one per trainable tensor (same name, shape and dtype),
    allocated once; `write` copies the trainer's tensors in. ``nbytes``: bytes one sync moves."""

    def __init__(self, tensors: Mapping[str, Tensor]) -> None:
        self.buffers: dict[str, Tensor] = {
            n: torch.empty(t.shape, dtype=t.dtype, device="cpu").share_memory_()  # type: ignore[no-untyped-call]
            for n, t in tensors.items()
        }
        self.nbytes = sum(b.numel() * b.element_size() for b in self.buffers.values())

    def write(self, tensors: Mapping[str, Tensor]) -> int:
        """Copy ``tensors`` (the same names, shapes and dtypes as at allocation) into the buffers;
        the bytes copied. ValueError naming what changed."""
        if set(tensors) != set(self.buffers):
            extra, gone = sorted(set(tensors) - set(self.buffers)), sorted(set(self.buffers) - set(tensors))
            raise ValueError(
                f"the policy's trainable tensors changed since the first sync (new {extra[:5]}, gone "
                f"{gone[:5]}); the worker's buffers hold the first set. Keep get_parameters() fixed "
                f"during training, or build a new engine."
            )
        bad = [
            f"{n}: {tuple(t.shape)} {t.dtype} (buffer {tuple(self.buffers[n].shape)} {self.buffers[n].dtype})"
            for n, t in tensors.items()
            if t.shape != self.buffers[n].shape or t.dtype != self.buffers[n].dtype
        ]
        if bad:
            raise ValueError(f"trainable tensors changed shape or dtype since the first sync: {bad[:5]}.")
        with torch.no_grad():
            for n, t in tensors.items():
                self.buffers[n].copy_(t.detach())
        return self.nbytes


class WorkerGeneration:
    """A generation submitted to a `WorkerEngine`; ``result()`` waits for it (cached after).

    Attributes: ``job`` (0, 1, ... per engine), ``seed`` (the torch seed the worker used, or None).
    """

    def __init__(self, engine: WorkerEngine, seq: int, states: Any, job: int, seed: int | None) -> None:
        self.engine, self.seq, self.states, self.job, self.seed = engine, seq, states, job, seed
        self._done: Generated | None = None
        self._finalizer = weakref.finalize(self, engine.channel.discard, seq)

    def result(self) -> Generated:
        if self._done is None:
            actions, log_probs, version = self.engine.channel.wait(self.seq)
            self._finalizer.detach()
            self._done = Generated(self.states, actions, log_probs, int(version))
        return self._done


class WorkerEngine:
    """A `GenerationEngine` whose policy copy lives in a worker process (see the module docstring).

    Args:
        make_policy: builds the worker's policy, called in the worker; must be picklable (a
            module-level function or a ``functools.partial`` of one).
            `grpo.llm.engines.worker.causal_lm_worker` makes one for a `grpo.llm.CausalLMPolicy`.
        seed: seeds generation job j with `job_seed` ``(seed, j)``; None = a random stream.
        name: the process's name (in errors and ``ps``).
        num_threads: torch CPU threads in the worker (1: the trainer runs beside it).
        cleanup_dir: a directory removed once the worker has loaded its policy, and at close.
        close_timeout: seconds `close` waits for the worker to exit before terminating it.

    Attributes (the cost of the last `sync`, for logging): ``last_sync_seconds`` (copy into the
    shared buffers and send; the trainer's cost), ``last_sync_wait_seconds`` (waiting for the
    worker's ack of the sync before), ``last_sync_bytes`` (bytes copied).
    """

    owns_weights = True

    def __init__(
        self,
        make_policy: Callable[[], PolicyModel],
        *,
        seed: int | None = None,
        name: str = "grpo-generation-worker",
        num_threads: int = 1,
        cleanup_dir: str | None = None,
        close_timeout: float = 10.0,
    ) -> None:
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads={num_threads!r} must be an integer >= 1.")
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe(duplex=True)
        args = (child, make_policy, num_threads, os.getpid(), cleanup_dir)
        process = ctx.Process(target=serve, args=args, name=name, daemon=True)
        try:
            process.start()
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            conn.close()
            remove_owned_dir(cleanup_dir)
            raise TypeError(
                f"make_policy={make_policy!r} cannot be sent to the worker process ({e}); it must be "
                f"picklable: a module-level function, or functools.partial(module_level_fn, ...)."
            ) from e
        finally:
            child.close()
        resources = _Resources(process, conn, cleanup_dir, float(close_timeout))
        self.channel = _Channel(process, conn, name, resources.ready)
        self._finalizer = weakref.finalize(self, resources.shutdown)
        self.process, self.name, self.seed = process, name, seed
        self._version = 0
        self._jobs = 0
        self.shared_weights: SharedWeights | None = None  # allocated at the first sync
        self._last_sync: int | None = None
        self.last_sync_seconds = 0.0
        self.last_sync_wait_seconds = 0.0
        self.last_sync_bytes = 0
        logger.info("started generation worker %r (pid %s)", name, process.pid)

    # ---- GenerationEngine ------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The version of the last `sync` submitted (0 before any)."""
        return self._version

    def submit(
        self, states: Any, num_actions_per_state: int, *, with_log_probs: bool, **kwargs: Any
    ) -> WorkerGeneration:
        """Queue the generation of G actions for each state (``kwargs``: the policy's generate
        options); the log-probs are computed in the worker only when ``with_log_probs``."""
        job = self._jobs
        seed = None if self.seed is None else job_seed(self.seed, job)
        command = ("generate", states, int(num_actions_per_state), dict(kwargs), bool(with_log_probs), seed)
        seq = self.channel.send(command, f"generation job #{job}")
        self._jobs += 1
        return WorkerGeneration(self, seq, states, job, seed)

    def skip_job(self) -> None:
        """Count one generation job without running it: a batch restored from a checkpoint
        (`grpo.generation.async_rollouts.PrefetchingEngine.load_state_dict`) took its number, so
        the next job is seeded as the uninterrupted run seeded it."""
        self._jobs += 1

    def sync(self, policy: PolicyModel, version: int) -> None:
        """Send ``policy.get_parameters()`` (tagged ``version``) to the worker; generations
        submitted from now on sample with them. Waits for the worker's ack of the previous sync
        before writing the shared buffers (the module docstring)."""
        if self._jobs == 0 and version > 0:  # a new engine for a resumed trainer: its next job is
            self._jobs = int(version)  # the batch of step `version`, seeded as the first run seeded it
        tensors = trainable_tensors(policy)
        t0 = time.perf_counter()
        if self._last_sync is not None:
            self.channel.wait(self._last_sync)
        t1 = time.perf_counter()
        first = self.shared_weights is None
        if self.shared_weights is None:
            self.shared_weights = SharedWeights(tensors)
        nbytes = self.shared_weights.write(tensors)
        command = ("sync", int(version), self.shared_weights.buffers if first else None)
        self._last_sync = self.channel.send(command, f"the weight sync to version {version}", shared=first)
        self._version = int(version)
        self.last_sync_wait_seconds, self.last_sync_seconds = t1 - t0, time.perf_counter() - t1
        self.last_sync_bytes = nbytes
        logger.debug("sync v%d: %d bytes in %.4f s", version, nbytes, self.last_sync_seconds)

    def wait_synced(self) -> float:
        """Wait until the worker has loaded the last sync's weights; the seconds its copy took in
        the worker (0.0 when nothing was synced)."""
        if self._last_sync is None:
            return 0.0
        _, seconds = self.channel.wait(self._last_sync)
        self._last_sync = None
        return float(seconds)

    def wait_ready(self) -> None:
        """Wait until the worker has built its policy (GenerationWorkerError if it could not)."""
        while self.channel.received == 0:
            self.channel.check_usable()
            self.channel.receive_one()

    @property
    def pid(self) -> int | None:
        pid: int | None = self.process.pid
        return pid

    def is_alive(self) -> bool:
        return bool(self.process.is_alive())

    def close(self) -> None:
        """Stop the worker (join, then terminate / kill after ``close_timeout``) and remove the
        saved copy; idempotent. Also runs when the engine is garbage-collected, and at exit."""
        if self.channel.failure is None:
            self.channel.failure = f"the generation engine {self.name!r} was closed"
        self._finalizer()

    def __enter__(self) -> WorkerEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
