"""grpo.population: mutation rule, selection, hyperparameters set in live trainers, clones,
evolution, hooks, sinks and the lineage plot (one process; checkpoints, LoRA and torchrun have
their own test files)."""

from __future__ import annotations

import importlib.util
import math
import random
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from grpo import GRPOConfig, GRPOTrainer
from grpo.policies import categorical_mlp
from grpo.population import (
    HyperparameterConfig,
    Member,
    Mutation,
    Population,
    RLParameter,
    apply_hyperparameters,
    choose_mutations,
    elite_index,
    mutate_value,
    plot_lineage,
    population,
    read_hyperparameters,
    sample_hyperparameters,
    tournament_parents,
)
from tests.conftest import bandit_policy
from tests.population_toys import arm_reward, expected_reward

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[1]


def make_bandit(hp: dict[str, float]) -> GRPOTrainer:
    cfg = GRPOConfig(group_size=8, batch_size=4, learning_rate=hp["learning_rate"], seed=0, distributed="off")
    return GRPOTrainer(cfg, bandit_policy(10), arm_reward)


LR_ONLY = HyperparameterConfig(
    learning_rate=RLParameter(min=1e-6, max=1.0, shrink_factor=0.5, grow_factor=3.0)
)
STATES = torch.zeros(64, 1)


# ---- the mutation rule and the selection (pure) ------------------------------------------------
def test_mutate_value_by_hand() -> None:
    spec = RLParameter(min=0.1, max=1.0, shrink_factor=0.5, grow_factor=2.0)
    assert mutate_value(0.3, spec, grow=True) == 0.6
    assert mutate_value(0.3, spec, grow=False) == 0.15
    assert mutate_value(0.8, spec, grow=True) == 1.0  # clamped to max
    assert mutate_value(0.15, spec, grow=False) == 0.1  # clamped to min
    g = RLParameter(min=2, max=16, shrink_factor=0.9, grow_factor=1.1, dtype=int)
    assert mutate_value(8, g, grow=True) == 9  # round(8.8) = 9
    assert mutate_value(4, g, grow=True) == 5  # round(4.4) = 4 unchanged: one step up instead
    assert mutate_value(2, g, grow=False) == 2  # at the bound
    assert isinstance(mutate_value(8, g, grow=False), int)


def test_tournament_selection_by_hand_loop() -> None:
    """Elite kept; every other slot's parent is the fittest of k uniform draws, as a plain loop
    over the same random stream gives."""
    fitness = [0.1, 0.9, 0.5, math.nan, 0.3]
    parents = tournament_parents(fitness, random.Random(7), tournament_size=3)
    rng = random.Random(7)
    want = []
    for j in range(5):
        if j == 1:
            want.append(1)
            continue
        draws = [rng.randrange(5) for _ in range(3)]
        best = draws[0]
        for d in draws[1:]:
            fd = -math.inf if math.isnan(fitness[d]) else fitness[d]
            fb = -math.inf if math.isnan(fitness[best]) else fitness[best]
            if fd > fb or (fd == fb and d < best):
                best = d
        want.append(best)
    assert parents == want
    assert elite_index([0.2, 0.7, 0.7]) == 1  # lowest index on a tie
    assert elite_index([math.nan, 0.0]) == 1  # NaN is the worst


def test_choose_mutations_skip_elite_and_stay_in_range() -> None:
    hpc = HyperparameterConfig(
        learning_rate=RLParameter(min=1e-4, max=1e-2), group_size=RLParameter(min=2, max=8, dtype=int)
    )
    hps = [{"learning_rate": 1e-3, "group_size": 4}] * 4
    muts = choose_mutations(hps, [0, 0, 0, 0], hpc, random.Random(0), elite=0)
    assert muts[0].name is None
    for m in muts[1:]:
        assert m.name in hpc
        assert hpc[m.name].contains(m.new)
        assert m.new != m.old


def test_sample_hyperparameters_seeded_and_in_range() -> None:
    hpc = HyperparameterConfig(
        learning_rate=RLParameter(min=1e-5, max=1e-1), group_size=RLParameter(min=2, max=16, dtype=int)
    )
    a, b = sample_hyperparameters(hpc, 6, seed=3), sample_hyperparameters(hpc, 6, seed=3)
    assert a == b
    assert len({h["learning_rate"] for h in a}) == 6
    for hp in a:
        hpc.check(hp, "sampled")


def test_hyperparameter_config_errors() -> None:
    with pytest.raises(ValueError, match="'momentum' cannot be mutated"):
        HyperparameterConfig(momentum=RLParameter(min=0.1, max=0.9))
    with pytest.raises(ValueError, match="group_size is a int; declare RLParameter"):
        HyperparameterConfig(group_size=RLParameter(min=2, max=8))
    with pytest.raises(ValueError, match="0 < min <= max"):
        RLParameter(min=0.0, max=1.0)
    with pytest.raises(ValueError, match=r"learning_rate=5.0 is outside its declared range"):
        population(2, make_bandit, LR_ONLY, hyperparameters={"learning_rate": 5.0}, fitness=expected_reward)


# ---- hyperparameters set in a live trainer are the ones the next step uses -------------------------
def make_mlp(hp: dict[str, float], **extra: Any) -> GRPOTrainer:
    """A contextual-bandit MLP with a KL and an entropy term and 3 epochs (the clip matters)."""
    torch.manual_seed(0)
    policy = categorical_mlp(4, 3, (16,))
    w = torch.tensor([[1.0, -1.0, 0.5], [0.0, 1.0, -0.5], [0.3, 0.2, 0.1], [-1.0, 0.0, 1.0]])

    def reward(states: Tensor, actions: Tensor) -> Tensor:
        return (states @ w).gather(1, actions.long().unsqueeze(1)).squeeze(1)

    cfg = GRPOConfig(
        group_size=int(hp["group_size"]), batch_size=4, learning_rate=hp["learning_rate"],
        clip_epsilon=hp["clip_epsilon"], kl_coeff=hp["kl_coeff"], entropy_coeff=hp["entropy_coeff"],
        num_epochs_per_update=3, seed=0, distributed="off", **extra,
    )  # fmt: skip
    return GRPOTrainer(cfg, policy, reward)


HP0 = {"learning_rate": 1e-2, "clip_epsilon": 0.2, "kl_coeff": 0.05, "entropy_coeff": 0.01, "group_size": 4}


def run(trainer: GRPOTrainer, steps: int = 3) -> list[dict[str, float]]:
    torch.manual_seed(1)
    gen = torch.Generator().manual_seed(2)
    return [trainer.step(torch.randn(4, 4, generator=gen)) for _ in range(steps)]


@pytest.mark.parametrize(
    "change",
    [
        {"learning_rate": 3e-2},
        {"clip_epsilon": 0.02},
        {"kl_coeff": 0.5},
        {"entropy_coeff": 0.2},
        {"group_size": 6},
        {"learning_rate": 2e-3, "clip_epsilon": 0.1, "kl_coeff": 0.2, "entropy_coeff": 0.05, "group_size": 3},
    ],
)
def test_mutated_trainer_steps_exactly_like_one_built_with_the_values(change: dict[str, float]) -> None:
    """A trainer built with HP0 and then given ``change`` takes the same steps, bitwise, as one
    built with the changed values: the objective, the optimizer and the collector read them."""
    mutated = make_mlp(HP0)
    apply_hyperparameters(mutated, change)
    fresh = make_mlp({**HP0, **change})
    m_a, m_b = run(mutated), run(fresh)
    for (k, a), b in zip(
        mutated.policy.get_parameters().items(), fresh.policy.get_parameters().values(), strict=True
    ):
        assert torch.equal(a, b), k
    assert m_a[-1]["loss/policy"] == m_b[-1]["loss/policy"]
    assert read_hyperparameters(mutated, change) == {k: type(v)(v) for k, v in change.items()}
    # and the change did matter: the unmutated trainer moves elsewhere
    other = make_mlp(HP0)
    run(other)
    assert any(
        not torch.equal(a, b)
        for a, b in zip(
            other.policy.get_parameters().values(), fresh.policy.get_parameters().values(), strict=True
        )
    )


def test_learning_rate_mutation_keeps_the_schedule_position() -> None:
    """With warmup (LambdaLR): after k optimizer steps at lr0, setting lr1 makes every group's lr
    lr1 * m(k), the scheduler's base lr1, and the next step reports optim/lr = lr1 * m(k)."""
    extra = {"lr_schedule": "linear", "warmup_steps": 4, "total_steps": 40}
    t = make_mlp(HP0, **extra)
    run(t, 2)  # 6 optimizer steps (3 epochs x 1 mini-batch x 2 steps)
    sched = t.scheduler
    assert sched is not None
    s = sched.last_epoch
    m_s = sched.lr_lambdas[0](s)
    adam_state = {k: v.clone() for k, v in t.optimizer.state_dict()["state"][0].items()}
    apply_hyperparameters(t, {"learning_rate": 4e-2})
    assert sched.base_lrs == [4e-2]
    assert t.optimizer.param_groups[0]["lr"] == 4e-2 * m_s
    assert t.config.learning_rate == 4e-2
    for k, v in t.optimizer.state_dict()["state"][0].items():  # Adam's moments kept
        assert torch.equal(v, adam_state[k])
    metrics = t.step(torch.randn(4, 4))
    assert metrics["optim/lr"] == 4e-2 * m_s


def test_refused_changes() -> None:
    t = make_mlp({**HP0, "kl_coeff": 0.0})
    with pytest.raises(ValueError, match=r"kl_coeff 0\.0 -> 0\.1 crosses 0"):
        apply_hyperparameters(t, {"kl_coeff": 0.1})
    with pytest.raises(TypeError, match="no numeric 'temperature' attribute"):
        apply_hyperparameters(t, {"temperature": 0.7})
    with pytest.raises(ValueError, match="clip_epsilon"):
        apply_hyperparameters(t, {"clip_epsilon": -0.5})
    assert t.config.clip_epsilon == 0.2  # nothing changed


def test_one_assignment_to_the_config_is_what_the_next_step_uses() -> None:
    """The parts read ``trainer.config`` when they use it: after ``config.kl_coeff = 0.3`` and
    ``config.entropy_coeff = 0.02`` the next step's loss is loss/policy + 0.3 kl/ref - 0.02 H
    (every term a mean over the optimizer steps, so the identity holds for the means), and after
    ``config.group_size = 6`` it scores 4 x 6 actions."""
    t = make_mlp(HP0)
    run(t, 1)
    t.config.kl_coeff = 0.3
    t.config.entropy_coeff = 0.02
    m = run(t, 1)[0]
    expect = m["loss/policy"] + 0.3 * m["kl/ref"] - 0.02 * m["policy/entropy"]
    assert m["loss/total"] == pytest.approx(expect, rel=1e-6, abs=1e-9)
    old = m["loss/policy"] + 0.05 * m["kl/ref"] - 0.01 * m["policy/entropy"]
    assert abs(m["loss/total"] - old) > 1e-4  # the old coefficients would give another number
    assert (t.stall_watch.kl_coeff, t.objective.entropy_coeff) == (0.3, 0.02)
    scored: list[int] = []

    def counting(states: Tensor, actions: Tensor) -> Tensor:
        scored.append(len(actions))
        return actions.float()

    g = GRPOTrainer(GRPOConfig(group_size=4, batch_size=4, seed=0), categorical_mlp(4, 3, (8,)), counting)
    g.step(torch.randn(4, 4))
    g.config.group_size = 6
    g.step(torch.randn(4, 4))
    assert scored == [4 * 4, 4 * 6]


def test_a_mutation_leaves_the_callers_config_as_passed() -> None:
    """The trainer reads its own copy of the config: apply_hyperparameters assigns into it, and
    the config the caller built the trainer with (maybe shared by every member) stays as passed."""
    cfg = GRPOConfig(group_size=4, batch_size=4, kl_coeff=0.05, seed=0)
    t = GRPOTrainer(cfg, categorical_mlp(4, 3, (16,)), lambda s, a: torch.zeros(len(a)))
    apply_hyperparameters(t, {"kl_coeff": 0.2, "group_size": 3})
    assert (t.config.kl_coeff, t.config.group_size) == (0.2, 3)
    assert (cfg.kl_coeff, cfg.group_size) == (0.05, 4)


# ---- clones and evolution ----------------------------------------------------------------------
def test_clone_copies_the_trainer_state_through_state_dicts() -> None:
    pop = population(
        2,
        make_bandit,
        LR_ONLY,
        hyperparameters=[{"learning_rate": 0.5}, {"learning_rate": 1e-3}],
        fitness=expected_reward,
    )
    pop.evolve(2, STATES)  # both train; the elite is kept
    a, b = pop.members
    with pop.acting(a) as ta:
        sa = ta.state_dict()
        ta_params = [p.clone() for p in ta.policy.get_parameters().values()]
    pop.clone(0, 1)
    with pop.acting(b) as tb:
        assert [
            torch.equal(p, q) for p, q in zip(tb.policy.get_parameters().values(), ta_params, strict=True)
        ] == [True]
        sb = tb.state_dict()
        assert tb.optimizer.param_groups[0]["lr"] == a.hp["learning_rate"]
    assert sb["step_count"] == sa["step_count"]
    for k, v in sa["optimizer"]["state"][0].items():
        assert torch.equal(sb["optimizer"]["state"][0][k], v)
    assert b.hp == a.hp
    assert b.trainer is not a.trainer
    assert b.trainer.policy is not a.trainer.policy


def test_population_repairs_a_bad_learning_rate_and_is_deterministic() -> None:
    """Every member starts at lr 1e-5 (a bandit learns nothing at it in 60 steps); the population
    grows it and reaches a far better policy. Two runs with the same seed are equal."""

    def evolve() -> tuple[Population, list[Any]]:
        pop = population(
            4, make_bandit, LR_ONLY, hyperparameters={"learning_rate": 1e-5}, fitness=expected_reward, seed=0
        )
        calls: list[tuple[int, Mutation]] = []
        pop.register_mutation_hook(lambda m, mut: calls.append((m.index, mut)))
        pop.evolve(5, STATES, 12)
        return pop, calls

    pop, calls = evolve()
    alone = make_bandit({"learning_rate": 1e-5})
    for s in range(60):
        alone.step(STATES[(s * 4) % 64 : (s * 4) % 64 + 4])
    alone_reward = expected_reward(Member(0, {}, alone))
    best = pop.best()
    assert alone_reward < 0.51
    assert pop.history[-1].best_fitness > 0.6
    assert best.hp["learning_rate"] > 1e-3
    # hooks: one call per mutation applied, with the member's trainer already holding the value
    applied = [(j, m) for r in pop.history for j, m in enumerate(r.mutations) if m.name is not None]
    assert [(j, m) for j, m in calls] == applied
    # the elite of each generation is kept: its fitness never falls below the last best
    pop2, _ = evolve()
    assert [r.as_dict() for r in pop2.history] == [r.as_dict() for r in pop.history]
    for m, m2 in zip(pop.members, pop2.members, strict=True):
        assert torch.equal(
            next(iter(m.trainer.policy.get_parameters().values())),
            next(iter(m2.trainer.policy.get_parameters().values())),
        )


def test_elitism_keeps_the_best_member_unchanged() -> None:
    pop = population(
        3, make_bandit, LR_ONLY, hyperparameters={"learning_rate": 0.1}, fitness=expected_reward, seed=1
    )
    pop.evolve(3, STATES)
    r = pop.history[0]
    assert r.elite == elite_index(list(r.fitness))
    assert r.parents[r.elite] == r.elite
    assert r.mutations[r.elite].name is None
    assert pop.members[r.elite].hp == {"learning_rate": 0.1}


def test_default_fitness_is_the_evaluation_reward() -> None:
    pop = population(
        2,
        make_bandit,
        LR_ONLY,
        hyperparameters={"learning_rate": 0.05},
        eval_states=torch.zeros(8, 1),
        eval_seed=5,
    )
    pop.evolve(1, STATES)
    for m in pop.members:
        t = make_bandit({"learning_rate": 0.05})  # the fitness is evaluate(eval_states, seed=5)
        want = m.trainer.evaluate(torch.zeros(8, 1), seed=5)["eval/reward/mean"]
        assert m.fitness == [want]
        del t


def test_fitness_can_read_the_generations_step_metrics() -> None:
    seen: list[list[dict[str, float]]] = []

    def training_reward(m: Member) -> float:
        seen.append(m.step_metrics)
        return m.step_metrics[-1]["reward/mean"]

    sink = ListSink()
    pop = population(
        2, make_bandit, LR_ONLY, hyperparameters={"learning_rate": 0.05},
        fitness=training_reward, sinks=[sink],
    )  # fmt: skip
    pop.evolve(3, STATES, 2)
    assert [len(s) for s in seen] == [3, 3, 3, 3]  # 2 generations x 2 slots, 3 steps each
    # the metrics are this generation's: member i's third step, as the sinks got it
    for g in range(2):
        row = sink.rows[3 * g + 2][1]
        assert list(pop.history[g].fitness) == [row["member0/reward/mean"], row["member1/reward/mean"]]


class ListSink:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []

    def write(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append((step, dict(metrics)))

    def close(self) -> None: ...


def test_sinks_get_member_prefixed_metrics_and_the_lineage_plots(tmp_path: Path) -> None:
    sink = ListSink()
    pop = population(
        2,
        make_bandit,
        LR_ONLY,
        hyperparameters={"learning_rate": 0.05},
        fitness=expected_reward,
        sinks=[sink],
    )
    pop.evolve(3, STATES, 2)
    assert [s for s, _ in sink.rows] == [1, 2, 3, 4, 5, 6]
    step1 = sink.rows[0][1]
    assert {"member0/reward/mean", "member1/reward/mean", "member1/loss/policy"} <= set(step1)
    last = sink.rows[2][1]
    assert last["population/generation"] == 0.0
    assert last["member1/fitness"] == pop.history[0].fitness[1]
    assert last["member0/hp/learning_rate"] == pop.history[0].hyperparameters[0]["learning_rate"]
    assert last["population/samples"] == 2 * 3 * 4 * 8  # 2 members x 3 steps x B=4 x G=8
    pytest.importorskip("matplotlib")
    out = plot_lineage(pop.history, tmp_path / "lineage.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_example_runs_with_a_tiny_budget() -> None:
    """examples/population.py end to end (2 generations of 2 steps)."""
    spec = importlib.util.spec_from_file_location("population_example", ROOT / "examples" / "population.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = module.main(["--generations", "2", "--steps", "2"])
    assert set(out) == {"alone", "population"}
    assert math.isfinite(out["population"])


def test_benchmark_independent_runs_are_the_populations_generation_zero(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """benchmarks/population.py's promise: independent run i starts exactly as slot i (same
    weights, same RNG streams), so the population's first fitness values are the runs' first
    scores."""
    spec = importlib.util.spec_from_file_location("population_bench", ROOT / "benchmarks" / "population.py")
    assert spec is not None
    assert spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclass looks itself up there
    spec.loader.exec_module(bench)
    task = bench.TASKS["contextual"](0)
    starts = sample_hyperparameters(bench.HP_CONFIGS["lr-clip"], 4, seed=1000)
    firsts = []
    for i, hp in enumerate(starts):
        t = bench.start_like_slot(task, hp, 0, i)
        t.step(task.states(t.config.batch_size))
        firsts.append(task.score(t)[0])
    pop = population(
        4, lambda hp: task.make(hp, 0), bench.HP_CONFIGS["lr-clip"], hyperparameters=starts,
        fitness=lambda m: task.score(m.require_trainer())[0], seed=0,
    )  # fmt: skip
    (record,) = pop.evolve(1, task.states)
    assert list(record.fitness) == firsts
    assert len(set(firsts)) == 4  # four different runs, not one run four times
