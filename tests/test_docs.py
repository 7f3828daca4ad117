"""The documentation site (mkdocs + mkdocstrings) builds without a warning (``--strict``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    pytest.importorskip("mkdocstrings_handlers.python")
    site = tmp_path / "site"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(site),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    for name in (
        "grpo.trainer.GRPOTrainer.train",
        "grpo.training.loop.evaluate",
        "grpo.training.callbacks.EarlyStopping",
        "grpo.metrics.sinks.JSONLSink",
        "grpo.engine.lr_schedules.LRSchedule",
        "grpo.metrics.plotting.plot_history",
        "grpo.engine.optim.default_optimizer",
        "grpo.grpo_objective.ObjectiveOutput",
        "grpo.algorithms.policy_losses.cispo_loss",
        "grpo.state.checkpoint",
        "grpo.engine.distributed.DistributedSync",
    ):
        assert f'id="{name}"' in api, name
    assert "reward/frac_zero_std" in (site / "metrics" / "index.html").read_text(encoding="utf-8")


def test_front_page_example_learns() -> None:
    """docs/index.md's example, run as written: the held-out eval reward goes from chance (1/3)
    well above it, and the page quotes what it prints."""
    import re

    page = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    code = page.split("```python", 1)[1].split("```", 1)[0]
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pattern = r"eval reward on held-out states: (\d\.\d\d) -> (\d\.\d\d) \(chance 0\.33\)"
    m = re.fullmatch(pattern, proc.stdout.strip())
    assert m is not None, proc.stdout
    before, after = float(m[1]), float(m[2])
    assert before < 0.45  # about chance before training
    assert after > 0.75  # ~0.87: learned well above chance
    quoted = re.search(rf"It prints `({pattern})`", page)
    assert quoted is not None
    assert abs(float(quoted[3]) - after) <= 0.03, (quoted[1], proc.stdout)
