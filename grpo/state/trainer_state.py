"""The trainer's state, explicitly: what `GRPOTrainer.state_dict` holds and how it is restored.

No reflection: the state is exactly these entries (a new attribute of the trainer never enters
a checkpoint by accident)::

    step_count          int >= 0   steps taken
    non_finite_steps    int >= 0   steps whose update was undone (grpo.update.guard)
    policy              name -> Tensor, the policy's weights (grpo.state.checkpoint.policy_state)
    reference_policy    name -> Tensor, or None (no KL term)
    optimizer           torch optimizer state dict, or None (nothing to train)
    scheduler           LR scheduler state dict, or None
    generator           the trainer's own torch.Generator state (shuffling of groups)
    components          name -> state dict: the advantage estimator's running statistics, the
                        reward-shift restart's, with async rollouts the generations drawn ahead
                        (``"async_rollouts"``, `grpo.generation.pending_state`; added empty when
                        a state saved without it is loaded, dropped with a warning by a
                        synchronous trainer), and every object given to `register_checkpoint_state`

`load_state_dict` checks every entry against this live trainer before changing anything: keys,
types, ranges and the same components; the weights' names, shapes and dtypes (and no NaN); the
optimizer's param_groups (count, keys, parameter ids, hyper-parameters) and each parameter's
state (for Adam/AdamW ``step`` a finite count >= 0, ``exp_avg``/``exp_avg_sq`` shaped and typed
like the parameter, finite, the second moment >= 0); the scheduler's keys and value types (they
become attributes of the scheduler); the generator state; the advantage estimator's running
statistics. A problem is one `CheckpointError` naming the entry (and, from a checkpoint, the
file). A failure after the checks (a registered component's own ``load_state_dict`` refusing its
state) rolls everything back: the policy, reference, optimizer, scheduler, components, generator
and counters are restored to what they were (the weights from a CPU copy taken before the load).
The process-global RNG streams (Python, NumPy, torch) are not the trainer's: `grpo.state.checkpoint`
saves, checks and restores them beside this state.

Under FSDP (``GRPOConfig(fsdp=True)``, `grpo.engine.fsdp`) the entries have the same format as
one process's (full tensors, torch's optimizer format), so a checkpoint moves between FSDP and
non-FSDP runs: `state_dict` gathers the sharded weights and optimizer state to rank 0 (a
collective; the other ranks get ``{}`` for ``policy`` and ``optimizer``), and `load_state_dict`
broadcasts rank 0's and shards them again.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import Self

from grpo.rollout.dynamic_sampling import DRAWS_COMPONENT
from grpo.state.checkpoint import (
    MAX_COUNT,
    POLICY_FILE,
    REFERENCE_FILE,
    STATE_FILE,
    STATE_JSON,
    CheckpointError,
    in_file,
    load_policy_state,
    policy_state,
)
from grpo.state.checkpoint.errors import kind, short
from grpo.state.checks import (
    optimizer_problem,
    running_stats_problem,
    scheduler_problem,
    single_device,
    tensors_problem,
    weights_problem,
    with_live_flags,
)

if TYPE_CHECKING:
    from grpo.engine.backends import Backend, ShardedWeights

__all__ = ["STATE_KEYS", "TrainerStateMixin"]

STATE_KEYS = (
    "step_count",
    "non_finite_steps",
    "policy",
    "reference_policy",
    "optimizer",
    "scheduler",
    "generator",
    "components",
)
OWN_COMPONENTS = ("advantage_estimator", DRAWS_COMPONENT, "async_rollouts", "reward_shift")
"""The trainer's own stateful parts (attributes of the same names; None when off), saved in this
order before the registered ones."""


class TrainerStateMixin:
    """`state_dict` / `load_state_dict`, stateful components, checkpoints and the gathered weights
    of `GRPOTrainer`."""

    policy: Any
    reference_policy: Any
    optimizer: torch.optim.Optimizer | None
    scheduler: Any
    advantage_estimator: Any
    dynamic_sampling: Any
    async_rollouts: Any
    reward_shift: Any
    step_count: int
    guard: Any
    config: Any
    generator: torch.Generator
    backend: Backend | None

    def __init__(self) -> None:
        self._registered: dict[str, Any] = {}  # register_checkpoint_state's objects, by name

    def sync_engine(self) -> None:
        """Give the generation engine the loaded weights (the trainer implements it)."""

    @property
    def non_finite_steps(self) -> int:
        """Steps whose update was undone because the loss or the gradient was NaN/inf."""
        return int(self.guard.non_finite_steps)

    @non_finite_steps.setter
    def non_finite_steps(self, value: int) -> None:
        self.guard.non_finite_steps = value

    def register_checkpoint_state(self, name: str, obj: Any) -> None:
        """Save and restore ``obj`` (with ``state_dict()`` / ``load_state_dict()``) in checkpoints,
        e.g. a data sampler. The state dict may hold tensors and plain data, never other objects."""
        if not (
            callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
        ):
            raise TypeError(
                f"register_checkpoint_state({name!r}, ...) needs an object with state_dict() and "
                f"load_state_dict(); {type(obj).__name__} lacks them."
            )
        if name in OWN_COMPONENTS:
            raise ValueError(
                f"register_checkpoint_state: {name!r} is the trainer's own; choose another name."
            )
        self._registered[name] = obj

    def stateful_components(self) -> dict[str, Any]:
        """The objects whose state dicts are saved besides the models (see the module docstring):
        the trainer's own (`OWN_COMPONENTS` that are on), then the registered ones."""
        own = {name: getattr(self, name) for name in OWN_COMPONENTS}
        return {k: v for k, v in own.items() if v is not None} | self._registered

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly (see the module docstring for the entries).

        Under FSDP a collective: every process must call it. Rank 0 gets the whole (gathered)
        policy weights and optimizer state; the other ranks get ``{}`` for those two entries.
        """
        self.check_checkpointable("state_dict")
        opt, sched = self.optimizer, self.scheduler
        ref = self.reference_policy
        sharded = self._sharded()
        if sharded is not None:  # gathered: full tensors on rank 0, {} elsewhere
            policy = self._sharded_policy_state(sharded)
            assert self.backend is not None
            engine = self.backend.state_dict()
            optimizer, scheduler = engine["optimizer"], engine["scheduler"]
        else:
            policy = policy_state(self.policy)
            optimizer = None if opt is None else opt.state_dict()
            scheduler = None if sched is None else sched.state_dict()
        return {
            "step_count": self.step_count,
            "non_finite_steps": self.guard.non_finite_steps,
            "policy": policy,
            "reference_policy": None if ref is None else policy_state(ref, "reference_policy"),
            "optimizer": optimizer,
            "scheduler": scheduler,
            "generator": self.generator.get_state(),
            "components": {k: v.state_dict() for k, v in self.stateful_components().items()},
        }

    def load_state_dict(self, state: Mapping[str, Any], *, source: str = "the state dict") -> None:
        """Restore what `state_dict` returned. Every entry is checked first; a `CheckpointError`
        naming ``source`` and the entry leaves the trainer unchanged.

        Under FSDP a collective: every process must call it. Rank 0's ``policy`` and ``optimizer``
        are loaded (broadcast and sharded; the other ranks may pass the same or ``{}``); a state
        that does not fit raises `CheckpointError` on every rank.
        """
        self.check_checkpointable("load_state_dict")
        state = self._with_async_rollouts(state, source)
        sharded = self._sharded()
        if sharded is not None:
            self._sharded_load_state_dict(sharded, state, source)
            return
        self._check_state(state, source)
        self._check_tensors(state, source)
        undo = self._capture()
        stage = "policy"
        try:
            load_policy_state(self.policy, state["policy"])
            if self.reference_policy is not None:
                stage = "reference_policy"
                load_policy_state(self.reference_policy, state["reference_policy"], "reference_policy")
            if self.optimizer is not None:
                stage = "optimizer"
                self.optimizer.load_state_dict(with_live_flags(state["optimizer"], self.optimizer))
            if self.scheduler is not None:
                stage = "scheduler"
                self.scheduler.load_state_dict(copy.deepcopy(dict(state["scheduler"])))
            for name, obj in self.stateful_components().items():
                stage = f"components[{name!r}] ({type(obj).__name__}.load_state_dict)"
                obj.load_state_dict(state["components"][name])
            stage = "generator"
            self.generator.set_state(state["generator"])
            self.step_count = int(state["step_count"])
            self.guard.non_finite_steps = int(state["non_finite_steps"])
            stage = "generation engine (sync of the loaded weights)"
            self.sync_engine()
        except BaseException as e:
            failed = self._restore(undo)
            if not isinstance(e, Exception):
                raise
            undone = (
                "the trainer was restored to its state before the load"
                if not failed
                else f"restoring the trainer's previous state failed too ({'; '.join(failed)}): the "
                f"trainer is in an undefined state, build a new one"
            )
            file = {"policy": POLICY_FILE, "reference_policy": REFERENCE_FILE}.get(stage, STATE_JSON)
            raise CheckpointError(
                f"{in_file(source, file)}: {stage}: loading it failed ({type(e).__name__}: {e}); {undone}."
            ) from e

    def _with_async_rollouts(self, state: Mapping[str, Any], source: str) -> Mapping[str, Any]:
        """``state`` with the component ``"async_rollouts"`` (the generations drawn ahead) made to
        fit this trainer: added empty to a state saved without it (a synchronous run, or a
        checkpoint older than the component), dropped for a synchronous trainer, with a warning
        when it held generations: they are sampled again, by the loaded weights."""
        comps = state.get("components") if isinstance(state, Mapping) else None
        if not isinstance(comps, Mapping):
            return state  # _check_state names the problem
        live = "async_rollouts" in self.stateful_components()
        if live == ("async_rollouts" in comps):
            return state
        if live:
            comps = {**comps, "async_rollouts": {"pending": []}}
        else:
            saved = comps["async_rollouts"]
            if isinstance(saved, Mapping) and saved.get("pending"):
                warnings.warn(
                    f"{source}: the checkpoint holds {len(saved['pending'])} generation(s) drawn ahead "
                    f"by async rollouts, but this trainer has async_staleness=0: those batches are "
                    f"sampled again with the loaded weights (so the run differs from the one that "
                    f"saved it; each batch is still trained once).",
                    RuntimeWarning,
                    stacklevel=3,
                )
            comps = {k: v for k, v in comps.items() if k != "async_rollouts"}
        return {**state, "components": comps}

    def _load_rest(self, state: Mapping[str, Any]) -> None:
        """The components, the generator and the counters (checked already)."""
        for k, obj in self.stateful_components().items():
            obj.load_state_dict(state["components"][k])
        self.generator.set_state(state["generator"])
        self.step_count = int(state["step_count"])
        self.guard.non_finite_steps = int(state["non_finite_steps"])
        self.sync_engine()

    # ---- sharded weights (FSDP): gathered on save, broadcast and sharded on load ------------------
    def _sharded(self) -> ShardedWeights | None:
        """The backend's `grpo.engine.backends.ShardedWeights` when it shards the weights, else None."""
        return None if self.backend is None else self.backend.sharded_weights

    def _sharded_policy_state(self, sharded: ShardedWeights) -> dict[str, Any]:
        """The policy's whole weights gathered by the backend (`ShardedWeights.policy_state`: on
        rank 0, ``{}`` elsewhere); a collective. A policy it cannot map raises on every rank."""
        try:
            sharded.check_policy(self.policy)
        except ValueError as e:
            raise CheckpointError(str(e)) from e
        return sharded.policy_state(self.policy)

    def _sharded_load_state_dict(
        self, sharded: ShardedWeights, state: Mapping[str, Any], source: str
    ) -> None:
        """`load_state_dict` where the backend shards the weights: every rank checks what it can,
        then `ShardedWeights.load_policy_state` agrees over the ranks (rank 0 also checks the
        weights and the optimizer state) and loads the weights; the rest loads as usual."""
        try:
            sharded.check_policy(self.policy)
        except ValueError as e:
            raise CheckpointError(str(e)) from e
        problem: str | None = None
        try:
            self._check_state(state, source)
            ref = self.reference_policy
            if ref is not None:
                problem = weights_problem(policy_state(ref, "reference_policy"), state["reference_policy"])
                problem = problem and f"{source}: reference_policy: {problem}"
        except CheckpointError as e:
            problem = str(e)
        first = sharded.load_policy_state(self.policy, state, problem, source)
        if first is not None:
            raise CheckpointError(first)
        if self.reference_policy is not None:
            load_policy_state(self.reference_policy, state["reference_policy"], "reference_policy")
        assert self.backend is not None
        self.backend.load_state_dict({"optimizer": state["optimizer"], "scheduler": state["scheduler"]})
        self._load_rest(state)

    def _check_state(self, state: Mapping[str, Any], source: str) -> None:
        if not isinstance(state, Mapping):
            raise CheckpointError(f"{source}: the trainer state is {type(state).__name__}, not a mapping.")
        missing = [k for k in STATE_KEYS if k not in state]
        extra = sorted(set(state) - set(STATE_KEYS))
        if missing or extra:
            raise CheckpointError(f"{source}: trainer state entries missing {missing}, unknown {extra}.")
        for k in ("step_count", "non_finite_steps"):
            v = state[k]
            if type(v) is not int or not 0 <= v <= MAX_COUNT:
                raise CheckpointError(
                    f"{in_file(source, STATE_JSON)}: scalars.{k}: must be an integer in [0, 2**63), got "
                    f"{short(v)} ({type(v).__name__})."
                )
        self._check_generator(state["generator"], source)
        self._check_same_parts(state, source)

    def _check_generator(self, g: Any, source: str) -> None:
        """A saved generator state that this trainer's generator can take."""
        live_g = self.generator.get_state()
        if not isinstance(g, torch.Tensor) or g.dtype != torch.uint8 or g.shape != live_g.shape:
            raise CheckpointError(
                f"{in_file(source, STATE_FILE)}: generator: must be a torch.Generator state (a uint8 tensor "
                f"of shape {tuple(live_g.shape)}), got {kind(g)}."
            )
        try:
            torch.Generator().set_state(g)
        except (RuntimeError, ValueError) as e:
            raise CheckpointError(
                f"{in_file(source, STATE_FILE)}: generator: is not a valid torch.Generator state ({e})."
            ) from None

    def _check_same_parts(self, state: Mapping[str, Any], source: str) -> None:
        """The saved state has the parts this trainer has: reference, optimizer, scheduler and the
        same stateful components (the advantage estimator's running statistics checked)."""

        def has(key: str) -> str:
            return "has" if state[key] is not None else "has no"

        ref, opt, sched = self.reference_policy, self.optimizer, self.scheduler
        if (state["reference_policy"] is None) != (ref is None):
            raise CheckpointError(
                f"{in_file(source, STATE_JSON)}: reference: the checkpoint {has('reference_policy')} "
                f"reference policy but this trainer "
                f"{'has one' if ref is not None else 'has none'}; use the same kl_coeff (> 0 builds a "
                f"reference) as the run that saved it."
            )
        if (state["optimizer"] is None) != (opt is None):
            raise CheckpointError(
                f"{in_file(source, STATE_JSON)}: tree.optimizer: the checkpoint {has('optimizer')} optimizer "
                f"state but this trainer "
                f"{'has an optimizer' if opt is not None else 'has none'}."
            )
        if (state["scheduler"] is None) != (sched is None):
            raise CheckpointError(
                f"{in_file(source, STATE_JSON)}: tree.scheduler: the checkpoint {has('scheduler')} LR "
                f"scheduler state but trainer.scheduler is "
                f"{type(sched).__name__}; configure the same schedule."
            )
        comps = state["components"]
        if not isinstance(comps, Mapping) or set(comps) != set(self.stateful_components()):
            saved = sorted(comps) if isinstance(comps, Mapping) else type(comps).__name__
            raise CheckpointError(
                f"{in_file(source, STATE_JSON)}: tree.components: the state holds stateful components "
                f"{saved} but this trainer has "
                f"{sorted(self.stateful_components())}; register the same ones (register_checkpoint_state)."
            )
        from grpo.advantage_estimator import AdvantageEstimator

        if isinstance(self.advantage_estimator, AdvantageEstimator):
            problem = running_stats_problem(comps["advantage_estimator"])
            if problem is not None:
                raise CheckpointError(
                    f"{in_file(source, STATE_JSON)}: components['advantage_estimator']{problem}."
                )

    def _check_tensors(self, state: Mapping[str, Any], source: str) -> None:
        """The checks of the entries that one process holds whole (not under FSDP): the weights
        against the live models, the optimizer and scheduler state against the live ones."""
        problem = tensors_problem(policy_state(self.policy), state["policy"], "policy")
        if problem is not None:
            raise CheckpointError(f"{in_file(source, POLICY_FILE)}: {problem[0]}: {problem[1]}.")
        ref = self.reference_policy
        if ref is not None:
            live_ref = policy_state(ref, "reference_policy")
            problem = tensors_problem(live_ref, state["reference_policy"], "reference_policy")
            if problem is not None:
                raise CheckpointError(f"{in_file(source, REFERENCE_FILE)}: {problem[0]}: {problem[1]}.")
        if self.optimizer is not None:
            opt_problem = optimizer_problem(self.optimizer, state["optimizer"])
            if opt_problem is not None:
                file, field, why = opt_problem
                raise CheckpointError(f"{in_file(source, file)}: {field}: {why}.")
        if self.scheduler is not None:
            problem = scheduler_problem(self.scheduler, state["scheduler"])
            if problem is not None:
                raise CheckpointError(f"{in_file(source, STATE_JSON)}: {problem[0]}: {problem[1]}.")

    def weight_specs(self, role: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]] | None:
        """name -> (shape, dtype) of the live ``policy`` / ``reference_policy``: what
        `grpo.state.checkpoint` checks a weight file's header against before reading a tensor. None
        when there is no such model, or under FSDP (rank 0 checks the weights on load)."""
        model = self.policy if role == "policy" else self.reference_policy
        if model is None or self._sharded() is not None:
            return None
        return {k: (tuple(v.shape), v.dtype) for k, v in policy_state(model, role).items()}

    def _capture(self) -> dict[str, Any]:
        """What `load_state_dict` may change, to put back if it fails half-way: the weights as CPU
        copies, the optimizer's state dict (its tensors are replaced on load, never written), deep
        copies of the scheduler's and components' state dicts, the generator and the counters."""
        ref, opt, sched = self.reference_policy, self.optimizer, self.scheduler

        def weights(model: Any, role: str) -> dict[str, torch.Tensor]:
            return {k: v.detach().to("cpu", copy=True) for k, v in policy_state(model, role).items()}

        opt_state = None
        if opt is not None:
            sd = opt.state_dict()
            opt_state = {
                "state": {k: dict(v) for k, v in sd["state"].items()},
                "param_groups": sd["param_groups"],
            }
        return {
            "policy": weights(self.policy, "policy"),
            "reference_policy": None if ref is None else weights(ref, "reference_policy"),
            "optimizer": opt_state,
            "scheduler": None if sched is None else copy.deepcopy(sched.state_dict()),
            "components": {k: copy.deepcopy(v.state_dict()) for k, v in self.stateful_components().items()},
            "generator": self.generator.get_state(),
            "counters": (self.step_count, self.guard.non_finite_steps),
        }

    def _restore(self, undo: Mapping[str, Any]) -> list[str]:
        """Put back what `_capture` took; the parts that could not be restored (normally none)."""
        failed: list[str] = []

        def attempt(what: str, fn: Any) -> None:
            try:
                fn()
            except Exception as e:
                failed.append(f"{what}: {type(e).__name__}: {e}")

        attempt("policy", lambda: load_policy_state(self.policy, undo["policy"]))
        if self.reference_policy is not None:
            attempt(
                "reference_policy",
                lambda: load_policy_state(
                    self.reference_policy, undo["reference_policy"], "reference_policy"
                ),
            )
        opt = self.optimizer
        if opt is not None:
            attempt("optimizer", lambda: opt.load_state_dict(undo["optimizer"]))
        if self.scheduler is not None:
            attempt("scheduler", lambda: self.scheduler.load_state_dict(undo["scheduler"]))
        for name, obj in self.stateful_components().items():
            attempt(
                f"components[{name!r}]",
                lambda obj=obj, name=name: obj.load_state_dict(undo["components"][name]),
            )
        self.generator.set_state(undo["generator"])
        self.step_count, self.guard.non_finite_steps = undo["counters"]
        return failed

    def save_checkpoint(self, directory: str | os.PathLike[str], *, keep_last: int | None = None) -> Path:
        """Save everything needed to resume exactly to ``directory/step-<step_count>/`` (atomic).

        Holds `state_dict` (weights in safetensors, the rest in JSON) and every process-global
        RNG stream; see `grpo.state.checkpoint`. Keeps the newest ``keep_last`` checkpoints (None =
        ``config.checkpoint_keep_last``, itself None = keep all). Returns the checkpoint's path.

        Under torchrun every process must call it: `state_dict` runs on every rank (under FSDP it
        gathers the sharded weights and optimizer state to rank 0), then rank 0 writes and the
        other ranks wait for it.
        """
        from grpo.engine.distributed import main_process_only
        from grpo.state import checkpoint

        keep = self.config.checkpoint_keep_last if keep_last is None else keep_last
        self.check_checkpointable("save_checkpoint")
        state = self.state_dict()
        return main_process_only(  # under torchrun rank 0 writes, the other ranks wait for it
            lambda: checkpoint.save_checkpoint(state, self.config.to_dict(), directory, keep_last=keep),
            Path(directory) / f"step-{self.step_count:08d}",
        )

    def load_checkpoint(self, path: str | os.PathLike[str]) -> Path:
        """Restore this trainer (built with the same objects and config) from ``path``: a directory
        given to `save_checkpoint` (its newest complete checkpoint is used) or one checkpoint.
        Never unpickles. Returns the checkpoint loaded. Under torchrun every process must call it
        (each reads the checkpoint; under FSDP rank 0's weights and optimizer state are broadcast
        and sharded)."""
        from grpo.engine.distributed import reseed_other_ranks
        from grpo.state import checkpoint

        self.check_checkpointable("load_checkpoint")
        loaded = checkpoint.load_checkpoint(self, path)
        reseed_other_ranks(self.config.seed, self.step_count)  # ranks > 0: their own RNG streams
        return loaded

    @classmethod
    def from_checkpoint(
        cls,
        path: str | os.PathLike[str],
        *,
        policy: Any,
        reward_model: Any,
        reference_policy: Any = None,
        optimizer: torch.optim.Optimizer | None = None,
        device: str | None = None,
    ) -> Self:
        """A trainer with the checkpoint's config, built around ``policy`` / ``reward_model`` (and
        the optional reference policy and optimizer, as in the constructor), then restored from it.

        ``device`` replaces the saved config's ``device`` (e.g. ``'cpu'`` to load the checkpoint of
        a CUDA run on a machine without one; the load then warns that the config differs in
        ``device``). Without it, a saved device this machine lacks raises `CheckpointError`.
        No path written in the checkpoint is opened: a saved ``deepspeed`` config path is refused
        (`grpo.state.checkpoint.resume_config`). If anything fails, ``policy`` is moved back to its
        device and the process-global RNG streams (which the constructor seeds) are put back.
        """
        from grpo.config import GRPOConfig
        from grpo.state import checkpoint

        if device is not None:
            GRPOConfig(device=device)  # a bad argument: ValueError, not the checkpoint's fault
        ckpt, saved = checkpoint.resume_config(path, device=device)
        where = ckpt / checkpoint.STATE_JSON
        known = {f.name for f in dataclasses.fields(GRPOConfig)} | set(GRPOConfig.spellings)
        unknown = sorted(set(saved) - known)
        if unknown:
            raise CheckpointError(
                f"{where}: config: the fields {short(unknown, 200)} are unknown to this version of "
                f"GRPOConfig; load it with the grpo version that saved it."
            )
        try:
            config = GRPOConfig.from_dict(saved)  # a config saved under an earlier field name too
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: config: {e}") from None
        rng = checkpoint.capture_rng()
        home = single_device(policy)
        try:
            trainer = cls(config, policy, reward_model, reference_policy, optimizer)  # type: ignore[call-arg]
            trainer.load_checkpoint(ckpt)
        except BaseException:
            checkpoint.restore_rng(rng)
            if home is not None:
                policy.to(home)
            raise
        return trainer

    def gathered_weights(self) -> contextlib.AbstractContextManager[None]:
        """A context manager within which the policy's weights (and those of the reference copy)
        hold their full values on every rank: under DeepSpeed ZeRO-3 each rank otherwise keeps
        only its partition (every rank must enter it: it all-gathers). A no-op otherwise. For
        reading (comparing, exporting); changes made inside are discarded."""
        return contextlib.nullcontext() if self.backend is None else self.backend.gathered()

    def check_checkpointable(self, what: str) -> None:
        """Raise NotImplementedError naming ``what`` where the backend's state cannot be held by one
        checkpoint (``Backend.checkpointable`` False: DeepSpeed); the training loop asks before
        its first step."""
        if self.backend is not None and not self.backend.checkpointable:
            raise NotImplementedError(
                f"GRPOTrainer.{what} needs GRPOTrainer checkpoints, which {self.backend.name} does not "
                f"support: the optimizer state is partitioned over the processes, and the trainer's "
                f"checkpoint holds one optimizer "
                f"state. Save the model itself (e.g. CausalLMPolicy.save_pretrained, as grpo-train "
                f"does), or train without DeepSpeed (GRPOConfig(deepspeed='off')) to get resumable "
                f"checkpoints."
            )
