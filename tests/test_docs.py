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
        "grpo.training_loop.evaluate",
        "grpo.callbacks.EarlyStopping",
        "grpo.metric_sinks.JSONLSink",
        "grpo.lr_schedules.LRSchedule",
        "grpo.plotting.plot_history",
        "grpo.optim.default_optimizer",
        "grpo.grpo_objective.ObjectiveOutput",
        "grpo.policy_losses.cispo_loss",
        "grpo.checkpoint",
        "grpo.distributed.DistributedSync",
    ):
        assert f'id="{name}"' in api, name
    assert "reward/frac_zero_std" in (site / "metrics" / "index.html").read_text(encoding="utf-8")
