"""`Population`: trainers that evolve their hyperparameters while they train (population-based training).

One generation (`Population.evolve`), for P slots::

    1. train     each slot's trainer takes N steps on its own RNG streams (slots one after
                 another, or one per process under torchrun: grpo/population/layout.py)
    2. fitness   f_i = fitness(member_i), by default the evaluation reward
                 ``trainer.evaluate(eval_states, seed=eval_seed)["eval/reward/mean"]``; the
                 generation's step metrics are in ``member_i.step_metrics`` (a free fitness)
    3. select    tournament selection with elitism (grpo/population/selection.py): parent[j]
    4. clone     slot j <- parent[j]'s trainer state (``trainer.load_state_dict(parent.state_dict())``:
                 weights, optimizer moments, LR schedule, counters) and hyperparameters
    5. mutate    one declared hyperparameter of each non-elite slot, grown or shrunk and clamped,
                 set in the live trainer (grpo/population/settings.py); hooks called. Every
                 slot's new values are checked (`checked_config`) before step 4 changes any
                 slot: a value a slot refuses raises with every slot as it was after training
    6. record    a `GenerationRecord` (fitness, parents, mutations, hyperparameters), metrics to
                 the sinks, a checkpoint of the whole population (grpo/population/checkpoint.py)

Trainers are never pickled or deep-copied: a clone goes through the explicit state dicts of
`grpo.state.trainer_state`, so a clone is a bitwise copy of its parent's trainer state.

Determinism: every slot's steps run on the slot's own process-global RNG streams (saved after it
trains, put back before it trains again), the selection and mutations come from one
``random.Random(seed)``, and each slot is built by ``make_member`` with the global RNGs seeded
from ``(seed, index)``. So a fixed seed gives the same weights whether the slots train in one
process or one per process, and a resumed run continues exactly (the checkpoint holds each
slot's RNG streams and the selection RNG).

Metrics in the sinks: one record per population step (the slots' k-th steps of a generation
together), each step metric of slot i under ``member{i}/<name>`` (``member2/reward/mean``); the
generation's last record also holds ``member{i}/fitness``, ``member{i}/hp/<name>``,
``member{i}/train_env_steps``, ``member{i}/eval_env_steps``, ``population/generation``,
``population/best_fitness``, ``population/samples`` (the trainer steps' actions, B x G per
step, summed over the slots) and the whole cost in the env's units (grpo/population/cost.py):
``population/train_env_steps``, ``population/eval_env_steps`` and ``population/env_steps``
(their sum), all cumulative.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grpo.population import checkpoint as files
from grpo.population.cost import counted_env_steps
from grpo.population.hyperparameters import HyperparameterConfig, checked_starts
from grpo.population.layout import MemberLayout, choose_layout
from grpo.population.lineage import GenerationRecord
from grpo.population.member import Member, cloned_tree
from grpo.population.selection import Mutation, choose_mutations, elite_index, tournament_parents
from grpo.population.settings import apply_hyperparameters, checked_config, read_hyperparameters
from grpo.population.shared_weights import SharedWeights, shares_weights
from grpo.state.checkpoint import capture_rng, load_checkpoint, restore_rng, save_checkpoint
from grpo.trainer import GRPOTrainer
from grpo.training.sources import iter_state_batches, num_states

__all__ = ["MemberFactory", "MutationHook", "Population", "build_alone", "member_seed", "population"]

logger = logging.getLogger(__name__)

MemberFactory = Callable[[dict[str, float]], GRPOTrainer]
"""Builds one slot's trainer from its starting hyperparameters (``{"learning_rate": ..., ...}``)."""
MutationHook = Callable[[Member, Mutation], None]
FitnessFn = Callable[[Member], float]


def member_seed(seed: int, index: int) -> int:
    """The seed of slot ``index``'s RNG streams: ``(seed * 1_000_003 + index) mod 2**32``."""
    return (seed * 1_000_003 + index) % 2**32


def _seed_globals(s: int) -> None:
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)


def _build_slot(
    make_member: MemberFactory, hp: Mapping[str, float], seed: int, index: int
) -> tuple[GRPOTrainer, tuple[Any, ...]]:
    """Slot ``index``'s trainer, built on the global RNGs seeded with ``member_seed(seed, index)``
    and given ``hp``, and the slot's training RNG streams (seeded ``member_seed ^ 0x5EED``). Leaves
    the global RNGs on those streams."""
    _seed_globals(member_seed(seed, index))
    trainer = make_member(dict(hp))
    _check_member(trainer, index)
    apply_hyperparameters(trainer, hp)  # the slot's values, whatever the factory did
    _seed_globals(member_seed(seed, index) ^ 0x5EED)
    return trainer, capture_rng()


def build_alone(
    make_member: MemberFactory,
    hyperparameters: Mapping[str, float],
    index: int,
    *,
    seed: int = 0,
    hp_config: HyperparameterConfig | None = None,
) -> GRPOTrainer:
    """Slot ``index`` of ``Population(make_member, starts, ..., seed=seed)`` outside the population,
    with ``hyperparameters = starts[index]``: the same initial weights (built on the same seeded
    RNGs), the same values set, and the process's global RNG streams (Python, NumPy, torch) left
    on the slot's training streams. Its first ``trainer.step(states)`` is then bitwise the slot's
    first step in the population (same ``states``); later steps differ once the population clones
    or mutates the slot. For comparisons: "slot i alone" is a run from the same start without
    selection. ``hp_config``: check ``hyperparameters`` against the declared ranges, as the
    population does."""
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"build_alone: index={index!r} must be a slot number >= 0.")
    hp = dict(hyperparameters)
    if hp_config is not None:
        hp = checked_starts(hp_config, [hp])[0]
    trainer, _ = _build_slot(make_member, hp, int(seed), index)
    return trainer


class Population:
    """P trainers whose hyperparameters evolve (see the module docstring for one generation).

    Args:
        make_member: builds a slot's `GRPOTrainer` from its starting hyperparameters (a dict of
            the names in ``hp_config``); called once per slot this process holds, with the global
            RNGs seeded for that slot. Every slot must be built alike (same policy architecture,
            optimizer, schedule, ``kl_coeff > 0`` or not), since clones load each other's state.
            Members whose trainers share one model (one PEFT model: LoRA) keep their own trained
            tensors (grpo/population/shared_weights.py).
        hyperparameters: each slot's starting hyperparameters (P dicts), within ``hp_config``'s ranges.
        hp_config: the hyperparameters to mutate and their ranges (`HyperparameterConfig`).
        eval_states: the states of the default fitness (``trainer.evaluate``'s mean reward).
        fitness: ``fitness(member) -> float`` (higher is better) in place of the evaluation;
            ``member.step_metrics`` holds the generation's step metrics (the training reward:
            ``lambda m: m.step_metrics[-1]["reward/mean"]``, no extra samples).
        eval_seed: the evaluation's fixed seed (the same samples' randomness for every slot).
        seed: seeds the selection, the mutations and the slots' RNG streams.
        tournament_size: entrants per tournament (k).
        elitism: keep the fittest slot unchanged each generation.
        no_mutation: probability that a non-elite slot is copied without a mutation.
        sinks: metric sinks (``write(record, step)``), written on the main process.
        distributed: one slot per process of the default process group (None: when one of > 1
            processes is initialised). Build each member with ``GRPOConfig(distributed="off")``.
    """

    def __init__(
        self,
        make_member: MemberFactory,
        hyperparameters: Sequence[Mapping[str, float]],
        hp_config: HyperparameterConfig,
        *,
        eval_states: Any = None,
        fitness: FitnessFn | None = None,
        eval_seed: int = 0,
        seed: int = 0,
        tournament_size: int = 2,
        elitism: bool = True,
        no_mutation: float = 0.0,
        sinks: Sequence[Any] = (),
        distributed: bool | None = None,
    ) -> None:
        if not isinstance(hp_config, HyperparameterConfig):
            raise TypeError(f"hp_config must be a HyperparameterConfig, got {type(hp_config).__name__}.")
        if fitness is None and eval_states is None:
            raise ValueError(
                "Population needs eval_states (the default fitness is the evaluation's mean reward "
                "on them) or fitness=callable(member) -> float."
            )
        if isinstance(tournament_size, bool) or not isinstance(tournament_size, int) or tournament_size < 1:
            raise ValueError(f"tournament_size={tournament_size!r} must be an integer >= 1 (2 or 3 is usual)")
        if not 0.0 <= no_mutation <= 1.0:
            raise ValueError(f"no_mutation={no_mutation} must be a probability in [0, 1].")
        starts = checked_starts(hp_config, hyperparameters)
        if len(starts) < 2:
            raise ValueError(f"a population needs at least 2 members, got {len(starts)}.")
        self.hp_config, self.seed = hp_config, int(seed)
        self.eval_states, self.fitness_fn, self.eval_seed = eval_states, fitness, eval_seed
        self.tournament_size, self.elitism, self.no_mutation = tournament_size, elitism, no_mutation
        self.sinks = list(sinks)
        self.layout: MemberLayout = choose_layout(distributed)
        self.rng = random.Random(self.seed)
        self.generation = 0
        self.step = 0  # population steps: each slot has taken this many steps since the start
        self.history: list[GenerationRecord] = []
        self.hooks: list[MutationHook] = []
        self.members = [Member(i, hp) for i, hp in enumerate(starts)]
        self._build(make_member)

    # ---- construction -------------------------------------------------------------------
    def _build(self, make_member: MemberFactory) -> None:
        outer = capture_rng()
        try:
            for i in self.layout.local(len(self.members)):
                m = self.members[i]
                m.trainer, m.rng = _build_slot(make_member, m.hp, self.seed, i)
        finally:
            restore_rng(outer)
        local = {m.index: m.require_trainer() for m in self.local_members}
        self.shared: SharedWeights | None = SharedWeights(local) if shares_weights(local) else None

    @property
    def size(self) -> int:
        """P, the number of slots."""
        return len(self.members)

    @property
    def local_members(self) -> list[Member]:
        """The slots this process trains (all of them on one process)."""
        return [m for m in self.members if m.trainer is not None]

    def register_mutation_hook(self, hook: MutationHook) -> None:
        """Call ``hook(member, mutation)`` after each mutation applied in this process (the
        member's trainer already holds the new value)."""
        if not callable(hook):
            raise TypeError(f"register_mutation_hook needs a callable, got {type(hook).__name__}.")
        self.hooks.append(hook)

    @contextlib.contextmanager
    def acting(self, member: Member) -> Iterator[GRPOTrainer]:
        """The member's trainer, ready to act: its RNG streams (and, with shared weights, its
        weights) in place; afterwards its streams are saved and the caller's put back."""
        trainer = member.require_trainer()
        outer = capture_rng()
        if member.rng is not None:
            restore_rng(member.rng)
        if self.shared is not None:
            self.shared.activate(member.index)
        try:
            yield trainer
        finally:
            member.rng = capture_rng()
            restore_rng(outer)

    # ---- one generation -----------------------------------------------------------------
    def evolve(
        self,
        steps_per_generation: int,
        states_source: Any,
        num_generations: int | None = None,
        *,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        keep_last: int | None = None,
    ) -> list[GenerationRecord]:
        """Run generations until ``self.generation == num_generations`` (None: one more).

        ``states_source``: what `GRPOTrainer.train` takes (a list / Tensor of states, cycled from
        each slot's own step count; an iterable; or a callable ``f(batch_size)``, called on the
        slot's RNG streams). ``checkpoint_dir``: save the population after every generation
        (`save_checkpoint`). Returns the new generations' records."""
        if (
            isinstance(steps_per_generation, bool)
            or not isinstance(steps_per_generation, int)
            or steps_per_generation < 1
        ):
            raise ValueError(f"steps_per_generation={steps_per_generation!r} must be an integer >= 1.")
        target = self.generation + 1 if num_generations is None else num_generations
        out = []
        while self.generation < target:
            out.append(self._generation(steps_per_generation, states_source))
            if checkpoint_dir is not None:
                self.save_checkpoint(checkpoint_dir, keep_last=keep_last)
        return out

    def _generation(self, steps: int, source: Any) -> GenerationRecord:
        local = self.local_members
        step_metrics = self.layout.gather({m.index: self._train(m, steps, source) for m in local})
        fitness_map = self.layout.gather({m.index: self._fitness(m) for m in local})
        fitness = [fitness_map[i] for i in range(self.size)]
        costs = self.layout.gather({m.index: (m.samples, m.train_env_steps, m.eval_env_steps) for m in local})
        for m in self.members:
            m.samples, m.train_env_steps, m.eval_env_steps = (int(c) for c in costs[m.index])
        rng_before = self.rng.getstate()
        elite = elite_index(fitness) if self.elitism else None
        parents = tournament_parents(
            fitness, self.rng, tournament_size=self.tournament_size, elitism=self.elitism
        )
        hps = [m.hp for m in self.members]
        mutations = choose_mutations(
            hps, parents, self.hp_config, self.rng, elite=elite, no_mutation=self.no_mutation
        )
        new_hps = [dict(hps[p]) for p in parents]
        for j, mut in enumerate(mutations):
            if mut.name is not None:
                new_hps[j][mut.name] = mut.new
        try:
            self._check_new_hyperparameters(new_hps, parents, mutations, elite)
        except ValueError:
            self.rng.setstate(rng_before)  # the selection is dropped with the generation
            raise
        for m in self.members:
            m.fitness.append(fitness[m.index])
        self._clone_slots(parents, elite)
        self._set_hyperparameters(new_hps, parents, mutations, elite)
        record = GenerationRecord(
            self.generation,
            tuple(fitness),
            elite,
            tuple(parents),
            tuple(mutations),
            tuple(dict(h) for h in new_hps),
            tuple(m.samples for m in self.members),
        )
        self.history.append(record)
        self._write_sinks(step_metrics, record, steps)
        self.generation += 1
        self.step += steps
        rounded = [round(f, 4) for f in fitness]
        logger.info(
            "generation %d: fitness %s, elite %s, parents %s", record.generation, rounded, elite, parents
        )
        return record

    def _check_new_hyperparameters(
        self,
        new_hps: Sequence[Mapping[str, float]],
        parents: Sequence[int],
        mutations: Sequence[Mutation],
        elite: int | None,
    ) -> None:
        """Every slot's new values through `checked_config` (on the process holding the slot)
        before any slot is cloned or changed; the first refusal raises on every process."""
        problems = {}
        for m in self.local_members:
            if m.index == elite:
                continue
            try:
                checked_config(m.require_trainer(), new_hps[m.index])
            except (ValueError, TypeError, NotImplementedError) as e:
                problems[m.index] = f"{type(e).__name__}: {e}"
        gathered = self.layout.gather(problems)
        if gathered:
            j = min(gathered)
            mut = mutations[j]
            change = "no mutation" if mut.name is None else f"mutation {mut.name} {mut.old} -> {mut.new}"
            raise ValueError(
                f"generation {self.generation}: slot {j} refuses its new hyperparameters {dict(new_hps[j])} "
                f"(slot {parents[j]}'s values, {change}): {gathered[j]} No slot was changed (the "
                f"generation's training is kept, its selection dropped). Narrow the declared "
                f"RLParameter range so that every value in it is valid for the members' config."
            )

    def _train(self, member: Member, steps: int, source: Any) -> list[dict[str, float]]:
        """``steps`` trainer steps of one slot on its own RNG streams."""
        with self.acting(member) as trainer:
            batches = iter_state_batches(source, trainer.config.batch_size, start=trainer.step_count)
            out = []
            counted, sampled = counted_env_steps(trainer.policy), 0
            for _ in range(steps):
                states = next(batches)
                out.append(trainer.step(states))
                sampled += (num_states(states) or 0) * trainer.config.group_size  # the step's G
            member.samples += sampled
            after = counted_env_steps(trainer.policy)
            played = sampled if counted is None or after is None else after - counted
            member.train_env_steps += played  # grpo/population/cost.py
        member.step_metrics = out
        return out

    def _fitness(self, member: Member) -> float:
        """The slot's fitness (NaN counts as the worst in selection)."""
        with self.acting(member) as trainer:
            counted = counted_env_steps(trainer.policy)
            if self.fitness_fn is not None:
                value = self.fitness_fn(member)
            else:
                value = trainer.evaluate(self.eval_states, seed=self.eval_seed)["eval/reward/mean"]
            after = counted_env_steps(trainer.policy)
            if counted is not None and after is not None:
                member.eval_env_steps += after - counted  # grpo/population/cost.py
            elif self.fitness_fn is None:
                member.eval_env_steps += (num_states(self.eval_states) or 0) * trainer.config.group_size
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"the fitness of member {member.index} is {value!r}; expected a number.")
        return float(value)

    def _clone_slots(self, parents: Sequence[int], elite: int | None) -> None:
        """Each slot j whose parent is another slot takes the parent's trainer state. Every
        parent's state is read before any slot is overwritten."""
        donors = sorted({p for j, p in enumerate(parents) if p != j and j != elite})
        snapshots = {}
        for d in donors:
            mine = self.members[d].trainer is not None
            snapshots[d] = self.layout.share(self._snapshot(self.members[d]) if mine else None, d)
        for j, p in enumerate(parents):
            if p != j and j != elite and self.members[j].trainer is not None:
                with self.acting(self.members[j]) as trainer:
                    # a copy per child: torch's optimizer keeps the loaded state tensors
                    # themselves, so two children of one parent must not get the same ones
                    trainer.load_state_dict(cloned_tree(snapshots[p]), source=f"member {p}'s state")

    def _snapshot(self, member: Member) -> dict[str, Any]:
        with self.acting(member) as trainer:
            return dict(cloned_tree(trainer.state_dict()))

    def clone(self, source: int, target: int) -> None:
        """Make slot ``target`` a copy of slot ``source`` (trainer state and hyperparameters),
        through the state dicts; no mutation. Both slots must be held by this process."""
        if source == target:
            return
        state = self._snapshot(self.members[source])
        with self.acting(self.members[target]) as trainer:
            trainer.load_state_dict(state, source=f"member {source}'s state")
            apply_hyperparameters(trainer, self.members[source].hp)
        self.members[target].hp = dict(self.members[source].hp)

    def _set_hyperparameters(
        self,
        new_hps: Sequence[dict[str, float]],
        parents: Sequence[int],
        mutations: Sequence[Mutation],
        elite: int | None,
    ) -> None:
        for j, m in enumerate(self.members):
            m.hp = dict(new_hps[j])
            if m.trainer is None or j == elite:
                continue
            with self.acting(m) as trainer:
                apply_hyperparameters(trainer, m.hp)
            if mutations[j].name is not None:
                for hook in self.hooks:
                    hook(m, mutations[j])

    def _write_sinks(self, step_metrics: Mapping[int, Any], record: GenerationRecord, steps: int) -> None:
        """One record per population step (see the module docstring), on the main process."""
        if not self.sinks or not self.layout.is_main:
            return
        for k in range(steps):
            row = {f"member{i}/{key}": v for i in range(self.size) for key, v in step_metrics[i][k].items()}
            if k == steps - 1:
                for i, m in enumerate(self.members):
                    row[f"member{i}/fitness"] = record.fitness[i]
                    row.update({f"member{i}/hp/{n}": float(v) for n, v in m.hp.items()})
                    row[f"member{i}/train_env_steps"] = float(m.train_env_steps)
                    row[f"member{i}/eval_env_steps"] = float(m.eval_env_steps)
                row["population/generation"] = float(record.generation)
                row["population/best_fitness"] = record.best_fitness
                row["population/samples"] = float(sum(record.samples))
                row.update(self.cost_metrics())
            for sink in self.sinks:
                sink.write(row, self.step + k + 1)

    def cost_metrics(self) -> dict[str, float]:
        """The population's whole cost so far in the env's units (grpo/population/cost.py):
        ``population/train_env_steps``, ``population/eval_env_steps``, ``population/env_steps``
        (their sum), each summed over the slots."""
        train = sum(m.train_env_steps for m in self.members)
        evaluation = sum(m.eval_env_steps for m in self.members)
        return {
            "population/train_env_steps": float(train),
            "population/eval_env_steps": float(evaluation),
            "population/env_steps": float(train + evaluation),
        }

    # ---- checkpoints -------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The population's own state as JSON-ready values (see grpo/population/checkpoint.py)."""
        version, ints, gauss = self.rng.getstate()
        return {
            "generation": self.generation,
            "step": self.step,
            "seed": self.seed,
            "rng": [version, list(ints), gauss],
            "members": [
                {
                    "index": m.index,
                    "hp": dict(m.hp),
                    "fitness": list(m.fitness),
                    "samples": m.samples,
                    "train_env_steps": m.train_env_steps,
                    "eval_env_steps": m.eval_env_steps,
                }
                for m in self.members
            ],
            "history": [r.as_dict() for r in self.history],
        }

    def save_checkpoint(self, directory: str | os.PathLike[str], *, keep_last: int | None = None) -> Path:
        """Save the whole population to ``directory/gen-<generation>/`` atomically (layout in
        grpo/population/checkpoint.py). Under torchrun every process must call it: each writes
        its slot's trainer checkpoint, the main process the population state. Returns the path."""
        root = Path(directory)
        if self.layout.is_main:
            root.mkdir(parents=True, exist_ok=True)
            files.temp_generation_dir(root, self.generation, fresh=True)
        self.layout.barrier()
        tmp = files.temp_generation_dir(root, self.generation, fresh=False)
        for m in self.local_members:
            with self.acting(m) as trainer:
                save_checkpoint(
                    trainer.state_dict(), trainer.config.to_dict(), files.member_dir(tmp, m.index)
                )
        self.layout.barrier()
        final = root / files.generation_name(self.generation)
        if self.layout.is_main:
            files.write_population_json(tmp, self.state())
            final = files.publish_generation(tmp, root, self.generation, keep_last)
        self.layout.barrier()
        return final

    def load_checkpoint(self, path: str | os.PathLike[str]) -> Path:
        """Restore the population from ``path`` (a root given to `save_checkpoint`: its newest
        complete generation; or one ``gen-*`` directory). Everything in ``population.json`` is
        checked before anything changes; each slot's trainer is restored by
        `grpo.state.checkpoint.load_checkpoint` (its own checks), with its RNG streams."""
        gen_dir = files.find_latest_generation(path, self.hp_config, self.size)
        state = files.read_population_json(gen_dir, self.hp_config, self.size)
        for m in self.local_members:
            saved = state["members"][m.index]
            with self.acting(m) as trainer:
                apply_hyperparameters(trainer, saved["hp"])
                load_checkpoint(trainer, files.member_dir(gen_dir, m.index))  # and its RNG streams,
                # which acting() keeps as the slot's at exit
        for m, saved in zip(self.members, state["members"], strict=True):
            m.hp, m.fitness, m.samples = (
                dict(saved["hp"]),
                [float(f) for f in saved["fitness"]],
                saved["samples"],
            )
            m.train_env_steps = saved.get("train_env_steps", 0)  # absent before grpo 0.3: from 0
            m.eval_env_steps = saved.get("eval_env_steps", 0)
        self.generation, self.step = state["generation"], state["step"]
        version, ints, gauss = state["rng"]
        self.rng.setstate((version, tuple(ints), gauss))
        self.history = [GenerationRecord.from_dict(r) for r in state["history"]]
        return gen_dir

    def best(self) -> Member:
        """The slot with the highest latest fitness (slot 0 before any generation)."""
        if not self.history:
            return self.members[0]
        return self.members[elite_index(list(self.history[-1].fitness))]

    def hyperparameters(self) -> list[dict[str, float]]:
        """Each slot's current hyperparameters as its trainer holds them (this process's slots)."""
        return [read_hyperparameters(m.require_trainer(), self.hp_config) for m in self.local_members]


def _check_member(trainer: Any, index: int) -> None:
    if not isinstance(trainer, GRPOTrainer):
        raise TypeError(
            f"make_member returned {type(trainer).__name__} for member {index}; it must return a GRPOTrainer."
        )
    if trainer.distributed is not None:
        raise ValueError(
            f"member {index}'s trainer joined the process group (data-parallel); in a population each "
            f"member trains alone: build it with GRPOConfig(distributed='off')."
        )


def population(
    size: int,
    make_member: MemberFactory,
    hp_config: HyperparameterConfig,
    *,
    hyperparameters: Mapping[str, float] | Sequence[Mapping[str, float]],
    **kwargs: Any,
) -> Population:
    """A `Population` of ``size`` slots (AgileRL's ``population(size=...)``): ``hyperparameters``
    is one dict for every slot, or ``size`` dicts (e.g. `sample_hyperparameters`); the other
    arguments are `Population`'s."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 2:
        raise ValueError(f"population size={size!r} must be an integer >= 2.")
    starts = [hyperparameters] * size if isinstance(hyperparameters, Mapping) else list(hyperparameters)
    if len(starts) != size:
        raise ValueError(
            f"population(size={size}) got {len(starts)} hyperparameter dicts; give one or {size}."
        )
    return Population(make_member, starts, hp_config, **kwargs)
