"""`GRPOConfig.recipe("small_policy")` learns the bandit tasks of issue 19 without tuning.

The tasks and their metrics are defined in ``benchmarks/bandit_tasks.py`` (run side by side with
their classic peers by ``benchmarks/learning.py``). Thresholds, with margin below what the preset
measures and above uniform arms (benchmarks/RESULTS.md, "Small policies"):

- bandit50 (50 Bernoulli arms, best 0.9, others U(0, 0.8), 300 steps of G pulls): the best arm's
  probability > 0.5 (uniform 0.02; Thompson sampling with the same pulls 0.94-0.99);
- nonstationary (10 drifting, switching arms, 450 rounds): expected reward / the oracle's at least
  0.3 above uniform arms' (preset 0.84-0.86, 0.38-0.39 above uniform's 0.45-0.47, with its restart
  on a reward shift; 0.58-0.60 without it; ``GRPOConfig()``'s defaults 0.00 above; eps-greedy
  0.83-0.89);
- contextual (the quick start's bandit with ``categorical_mlp``, 300 steps): normalised reward
  (0 = random arms, 1 = oracle) > 0.8 (preset 0.89-0.92, with its adaptive learning rate; 0.67-0.76
  without; ``GRPOConfig()``'s defaults 0.41-0.43; a hand-written GRPO loop 0.88-0.92).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from grpo import GRPOConfig

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str, file: str) -> ModuleType:
    """benchmarks/<file>.py as module ``name`` (benchmarks/ is no package)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{file}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


bt = _load("bandit_tasks", "bandit_tasks")  # the name benchmarks/learning.py imports
SEEDS = (0, 1, 2)


pytestmark = pytest.mark.usefixtures("one_thread")


def preset(seed: int) -> GRPOConfig:
    return GRPOConfig.recipe("small_policy", seed=seed)


@pytest.mark.filterwarnings("ignore:step\\(\\) got 1 states")
@pytest.mark.parametrize("seed", SEEDS)
def test_small_policy_finds_the_best_of_50_arms(seed: int) -> None:
    result = bt.bandit50_grpo(preset(seed), seed)
    assert result["metric"] > 0.5, f"best arm's probability {result['metric']:.3f} after 300 steps"


@pytest.mark.filterwarnings("ignore:step\\(\\) got 1 states")
@pytest.mark.parametrize("seed", SEEDS)
def test_small_policy_tracks_a_nonstationary_bandit(seed: int) -> None:
    got = bt.nonstationary_grpo(preset(seed), seed)["metric"]
    uniform = bt.nonstationary_uniform(seed)["metric"]
    assert got - uniform >= 0.3, f"fraction of the oracle {got:.3f}, uniform arms {uniform:.3f}"


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_small_policy_learns_the_contextual_bandit(seed: int) -> None:
    result = bt.contextual_grpo(preset(seed), seed)
    assert result["metric"] > 0.8, f"normalised reward {result['metric']:.3f} after 300 steps"


# ---- the harness itself: metrics, repeatability, the benchmark's output ------------------------
def test_metrics_score_uniform_as_0_and_the_oracle_as_1() -> None:
    task = bt.ContextualTask(0)
    assert task.score(lambda x: torch.zeros(x.shape[0], bt.CONTEXT_ARMS)) == pytest.approx(0.0, abs=1e-6)
    assert task.score(lambda x: 1e4 * (x @ task.W)) == pytest.approx(1.0, abs=1e-6)
    means = bt.bandit50_means(3)
    assert (means == 0.9).sum() == 1
    assert means.max() == 0.9
    assert (means.sort(descending=True).values[1] <= 0.8).item()
    bandit = bt.nonstationary_bandit(0)
    uniform = bt.nonstationary_uniform(0)["metric"]
    assert uniform == pytest.approx(float(bandit.means.mean(1).sum() / bandit.oracle.sum()), rel=1e-6)


@pytest.mark.filterwarnings("ignore:step\\(\\) got 1 states")
def test_rows_repeat_exactly() -> None:
    assert bt.bandit50_thompson(1, rounds=20)["metric"] == bt.bandit50_thompson(1, rounds=20)["metric"]
    eps = [bt.nonstationary_eps_greedy(1, rounds=60)["metric"] for _ in range(2)]
    assert eps[0] == eps[1]
    runs = [bt.bandit50_grpo(preset(1), 1, steps=10)["metric"] for _ in range(2)]
    assert runs[0] == runs[1]
    hand = [bt.contextual_hand_loop(1, steps=5)["metric"] for _ in range(2)]
    assert hand[0] == hand[1]


def test_learning_benchmark_prints_tables_and_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("gymnasium")  # learning.py imports examples/cartpole.py
    learning = _load("benchmarks_learning", "learning")
    out_json = tmp_path / "rows.json"
    out = learning.main(
        [
            *("--tasks", "bandit50", "nonstationary", "contextual"),
            *("--seeds", "0", "1", "--budget", "4", "nonstationary=12", "--json", str(out_json)),
        ]
    )
    text = capsys.readouterr().out
    for header in ("=== bandit50", "=== nonstationary", "=== contextual", "=== summary"):
        assert header in text
    assert "| task | grpo library defaults | grpo small_policy preset | peer | target | met |" in text
    saved = json.loads(out_json.read_text())
    assert saved["summary"] == out["summary"]
    assert len(saved["summary"]) == 3
    rows = {r["label"]: r for r in saved["tasks"]["bandit50"]["rows"]}
    assert [run["seed"] for run in rows["GRPO small_policy preset"]["runs"]] == [0, 1]
    assert saved["tasks"]["nonstationary"]["budget"] == 12
    assert {r["side"] for r in saved["tasks"]["contextual"]["rows"]} == {"grpo", "peer"}


def test_learning_benchmark_preset_changes_reach_every_grpo_row(monkeypatch: pytest.MonkeyPatch) -> None:
    from grpo.algorithms.recipes import RECIPES

    learning = _load("benchmarks_learning", "learning")
    original = RECIPES["small_policy"]
    monkeypatch.setitem(RECIPES, "small_policy", original._replace(values=dict(original.values)))
    learning.apply_preset_changes(["kl_coeff=0.01", "adaptive_lr_max=null"])
    config = bt.config_for("small_policy", 0)
    assert config.kl_coeff == 0.01
    assert config.adaptive_lr_max == GRPOConfig().adaptive_lr_max  # removed: the field's default
    assert original.values["kl_coeff"] == 0.0  # the recipe itself is untouched
    with pytest.raises(SystemExit, match="FIELD=JSON"):
        learning.apply_preset_changes(["kl_coeff"])
