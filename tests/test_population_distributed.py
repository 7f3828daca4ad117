"""A population with one member per process (gloo, real processes) ends exactly as the same
population trained in one process; its checkpoint loads in one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import Tensor

from grpo.population import Population, population
from tests.distributed_toys import launch
from tests.population_toys import HPC, expected_reward, make_clipped_bandit

SIZE, STEPS, GENERATIONS = 2, 3, 3


def states(batch_size: int) -> Tensor:
    return torch.rand(batch_size, 1)  # on each member's own RNG streams


def build(distributed: bool) -> Population:
    starts = [{"learning_rate": 1e-3, "clip_epsilon": 0.2}, {"learning_rate": 0.05, "clip_epsilon": 0.1}]
    return population(
        SIZE,
        make_clipped_bandit,
        HPC,
        hyperparameters=starts,
        fitness=expected_reward,
        seed=4,
        distributed=distributed,
    )


def summary(pop: Population) -> dict[str, object]:
    return {
        "history": [r.as_dict() for r in pop.history],
        "weights": {
            m.index: next(iter(m.trainer.policy.get_parameters().values())).detach().tolist()
            for m in pop.local_members
        },
    }


def _worker(rank: int, world: int, out: Path) -> None:
    torch.distributed.init_process_group("gloo")
    pop = build(distributed=True)
    assert [m.index for m in pop.local_members] == [rank]
    pop.evolve(STEPS, states, GENERATIONS, checkpoint_dir=out / "ckpt")
    (out / f"rank{rank}.json").write_text(json.dumps(summary(pop)))


@pytest.mark.slow  # two spawned interpreters: ~10 s on 2 cores
def test_one_member_per_process_equals_one_process(tmp_path: Path) -> None:
    launch(_worker, tmp_path, world=SIZE, timeout=120.0)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(SIZE)]
    torch.set_num_threads(1)
    local = build(distributed=False)
    local.evolve(STEPS, states, GENERATIONS)
    want = json.loads(json.dumps(summary(local)))
    for r, got in enumerate(ranks):
        assert got["history"] == want["history"]
        assert got["weights"][str(r)] == want["weights"][str(r)]
    loaded = build(distributed=False)
    assert loaded.load_checkpoint(tmp_path / "ckpt").name == f"gen-{GENERATIONS:08d}"
    assert json.loads(json.dumps(summary(loaded))) == want
