"""Population checkpoints: a run killed with SIGKILL mid-generation and resumed ends exactly as an
uninterrupted run; ``population.json`` is untrusted input (every problem refused before any
change); interrupted saves are ignored.

The runs are subprocesses of this file (``python tests/test_population_checkpoint.py ...``)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from grpo import GRPOTrainer  # noqa: E402
from grpo.population import Population, population  # noqa: E402
from grpo.state.checkpoint import CheckpointError  # noqa: E402
from tests.population_toys import HPC, expected_reward, make_clipped_bandit  # noqa: E402

GENERATIONS, STEPS = 4, 3


def make(hp: dict[str, float]) -> GRPOTrainer:
    return make_clipped_bandit(hp, lr_schedule="linear", warmup_steps=2, total_steps=200)


def build() -> Population:
    return population(
        4,
        make,
        HPC,
        hyperparameters={"learning_rate": 1e-3, "clip_epsilon": 0.2},
        fitness=expected_reward,
        seed=3,
    )


def worker(ckpt: str, out: str, kill_at: int) -> None:
    """Evolve to GENERATIONS with checkpoints, resuming from ``ckpt`` when it holds one; SIGKILL
    itself at the ``kill_at``-th states draw (-1: never). Writes the final weights and history."""
    torch.set_num_threads(1)
    pop = build()
    if any(Path(ckpt).glob("gen-*")):
        pop.load_checkpoint(ckpt)
    calls = [0]

    def states(batch_size: int) -> Tensor:  # drawn on the member's own RNG streams
        calls[0] += 1
        if calls[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.rand(batch_size, 1)

    pop.evolve(STEPS, states, GENERATIONS, checkpoint_dir=ckpt, keep_last=2)
    result = {
        "weights": [
            next(iter(m.trainer.policy.get_parameters().values())).detach().tolist() for m in pop.members
        ],
        "history": [r.as_dict() for r in pop.history],
        "lrs": [m.trainer.optimizer.param_groups[0]["lr"] for m in pop.members],
        "rng": [float(torch.rand(1)) for _ in range(1)],
    }
    Path(out).write_text(json.dumps(result))


def _run(ckpt: Path, out: Path, kill_at: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, __file__, str(ckpt), str(out), str(kill_at)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip


@pytest.mark.slow  # three interpreters: ~17 s on 2 cores
def test_sigkill_mid_generation_then_resume_ends_exactly_like_an_uninterrupted_run(tmp_path: Path) -> None:
    ref = _run(tmp_path / "ref", tmp_path / "ref.json", -1)
    assert ref.returncode == 0, ref.stderr
    draws_per_generation = 4 * STEPS
    kill_at = random.Random(0).randrange(draws_per_generation + 1, 3 * draws_per_generation)  # gen 1 or 2
    killed = _run(tmp_path / "run", tmp_path / "unused.json", kill_at)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    saved = sorted(p.name for p in (tmp_path / "run").glob("gen-*"))
    assert saved
    assert all(not p.name.startswith(".tmp") or p.is_dir() for p in (tmp_path / "run").iterdir())
    resumed = _run(tmp_path / "run", tmp_path / "resumed.json", -1)
    assert resumed.returncode == 0, resumed.stderr
    a, b = (
        json.loads((tmp_path / "ref.json").read_text()),
        json.loads((tmp_path / "resumed.json").read_text()),
    )
    assert b["weights"] == a["weights"]
    assert b["history"] == a["history"]
    assert b["lrs"] == a["lrs"]
    assert sorted(p.name for p in (tmp_path / "run").glob("gen-*")) == ["gen-00000003", "gen-00000004"]


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Population, Path]:
    torch.set_num_threads(1)
    pop = build()
    pop.evolve(2, torch.zeros(16, 1), 2, checkpoint_dir=tmp_path)
    return pop, tmp_path


def test_load_restores_the_population(saved: tuple[Population, Path]) -> None:
    pop, root = saved
    other = build()
    assert other.load_checkpoint(root).name == "gen-00000002"
    assert [r.as_dict() for r in other.history] == [r.as_dict() for r in pop.history]
    assert other.rng.getstate() == pop.rng.getstate()
    for m, o in zip(pop.members, other.members, strict=True):
        assert o.hp == m.hp
        assert o.fitness == m.fitness
        assert o.samples == m.samples
        assert (o.train_env_steps, o.eval_env_steps) == (m.train_env_steps, m.eval_env_steps)
        assert o.train_env_steps == 2 * 2 * 4 * 4  # 2 generations x 2 steps x B x G (actions)
        assert o.trainer.config.learning_rate == m.hp["learning_rate"]
        assert o.trainer.optimizer.param_groups[0]["lr"] == m.trainer.optimizer.param_groups[0]["lr"]
        assert torch.equal(
            next(iter(o.trainer.policy.get_parameters().values())),
            next(iter(m.trainer.policy.get_parameters().values())),
        )


def test_resume_in_process_continues_exactly(tmp_path: Path) -> None:
    """Save after 2 generations, load into a new population, evolve to 4: equal to 4 at once."""
    torch.set_num_threads(1)
    states = torch.rand(16, 1, generator=torch.Generator().manual_seed(0))
    straight = build()
    straight.evolve(2, states, 4)
    first = build()
    first.evolve(2, states, 2, checkpoint_dir=tmp_path)
    second = build()
    second.load_checkpoint(tmp_path)
    second.evolve(2, states, 4)
    assert [r.as_dict() for r in second.history] == [r.as_dict() for r in straight.history]
    for m, o in zip(straight.members, second.members, strict=True):
        assert torch.equal(
            next(iter(o.trainer.policy.get_parameters().values())),
            next(iter(m.trainer.policy.get_parameters().values())),
        )


def _tamper(root: Path, edit: Any) -> None:
    path = root / "gen-00000002" / "population.json"
    state = json.loads(path.read_text())
    edit(state)
    path.write_text(json.dumps(state))


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda s: s["members"][1]["hp"].update(learning_rate=50.0), "outside its declared range"),
        (lambda s: s["members"].pop(), "holds 3 members; this population has 4"),
        (lambda s: s["rng"][1].__setitem__(0, -1), "rng: its state must be 624 integers"),
        (lambda s: s.update(generation=7), "must be 7 numbers"),
        (lambda s: s["history"][0]["parents"].__setitem__(0, 9), r"parents must be slots in \[0, 4\)"),
        (lambda s: s["history"][1]["mutations"][2].update(name="os.system"), "a declared hyperparameter"),
        (lambda s: s.update(extra=1), "has the keys"),
        (lambda s: s["members"][0].update(eval_env_steps=-3), "eval_env_steps: must be integers >= 0"),
    ],
)
def test_tampered_population_json_is_refused_before_any_change(
    saved: tuple[Population, Path], edit: Any, match: str
) -> None:
    _pop, root = saved
    _tamper(root, edit)
    fresh = build()
    before = [next(iter(m.trainer.policy.get_parameters().values())).clone() for m in fresh.members]
    with pytest.raises(CheckpointError, match=match):
        fresh.load_checkpoint(root / "gen-00000002")
    with pytest.warns(RuntimeWarning, match="skipping the population checkpoint"):
        assert fresh.load_checkpoint(root).name == "gen-00000001"  # the newest one that checks
    fresh2 = build()
    (root / "gen-00000001").rename(root / ".tmp-gen-gone")
    with (
        pytest.raises(CheckpointError, match="no complete population checkpoint"),
        pytest.warns(RuntimeWarning),
    ):
        fresh2.load_checkpoint(root)
    assert fresh2.generation == 0
    for m, b in zip(fresh2.members, before, strict=True):
        assert torch.equal(next(iter(m.trainer.policy.get_parameters().values())), b)


def test_a_checkpoint_without_env_step_counts_loads_them_as_0(saved: tuple[Population, Path]) -> None:
    """population.json before grpo 0.3 held no env-step counts: it loads, the counts from 0."""
    _, root = saved
    _tamper(root, lambda s: [(m.pop("train_env_steps"), m.pop("eval_env_steps")) for m in s["members"]])
    other = build()
    assert other.load_checkpoint(root).name == "gen-00000002"
    assert [(m.train_env_steps, m.eval_env_steps) for m in other.members] == [(0, 0)] * 4


def test_not_json_and_interrupted_saves(saved: tuple[Population, Path]) -> None:
    _, root = saved
    (root / "gen-00000002" / "population.json").write_bytes(b"\x80\x04 pickle?")
    (root / ".tmp-gen-00000003").mkdir()  # an interrupted save
    with pytest.raises(CheckpointError, match="cannot be read as JSON"):
        build().load_checkpoint(root / "gen-00000002")
    with pytest.warns(RuntimeWarning, match="skipping"):
        assert build().load_checkpoint(root).name == "gen-00000001"


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2], int(sys.argv[3]))
