"""grpo.metrics.plotting: the standard figure from a history or a JSONL file, saved as a valid PNG."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from grpo.metrics.sinks import JSONLSink
from tests.loop_toys import bandit_states, make_trainer

pytest.importorskip("matplotlib")
from grpo.metrics.plotting import plot_history

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    assert data.endswith(b"IEND\xaeB`\x82")
    width, height = struct.unpack(">II", data[16:24])
    return width, height


@pytest.fixture(scope="module")
def run_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, float]], Path]:
    out = tmp_path_factory.mktemp("run")
    trainer = make_trainer(kl_coeff=0.05, lr_schedule="cosine", warmup_steps=2, total_steps=8)
    with JSONLSink(out / "metrics.jsonl") as sink:
        run = trainer.train(
            bandit_states(8),
            num_steps=8,
            eval_states=bandit_states(3),
            eval_every=4,
            sinks=[sink],
            progress=False,
        )
    return run.history, out / "metrics.jsonl"


def test_history_to_png(run_files: tuple[list[dict[str, float]], Path], tmp_path: Path) -> None:
    history, _ = run_files
    fig = plot_history(history, tmp_path / "plots" / "run.png", dpi=50)
    assert png_size(tmp_path / "plots" / "run.png") == (750, 400)  # 15 x 8 inches at 50 dpi
    ax_r, ax_kl, ax_ent, ax_clip, ax_grad, ax_lr = fig.axes
    mean_line = ax_r.lines[0]
    assert list(mean_line.get_xdata()) == [r["step"] for r in history]
    assert list(mean_line.get_ydata()) == [r["reward/mean"] for r in history]
    eval_line = ax_r.lines[1]
    assert list(eval_line.get_xdata()) == [4.0, 8.0]
    assert list(eval_line.get_ydata()) == [history[3]["eval/reward/mean"], history[7]["eval/reward/mean"]]
    assert list(ax_kl.lines[0].get_ydata()) == [r["kl/ref"] for r in history]
    assert list(ax_ent.lines[0].get_ydata()) == [r["policy/entropy"] for r in history]
    assert [ln.get_label() for ln in ax_clip.lines] == ["clip/frac_low", "clip/frac_high"]
    assert list(ax_grad.lines[0].get_ydata()) == [r["grad/norm"] for r in history]
    assert list(ax_lr.lines[0].get_ydata()) == [r["optim/lr"] for r in history]
    assert [ax.get_title() for ax in fig.axes] == [
        "reward",
        "KL",
        "entropy",
        "clip fraction",
        "grad norm (before clipping)",
        "learning rate",
    ]


def test_jsonl_to_png_same_data(run_files: tuple[list[dict[str, float]], Path], tmp_path: Path) -> None:
    history, jsonl = run_files
    fig = plot_history(jsonl, tmp_path / "run.png", dpi=40)
    assert png_size(tmp_path / "run.png") == (600, 320)
    assert list(fig.axes[0].lines[0].get_ydata()) == [r["reward/mean"] for r in history]
    assert fig.get_suptitle() == "metrics.jsonl"


def test_missing_metrics_panel_says_so(tmp_path: Path) -> None:
    history = [{"step": 1.0, "reward/mean": 0.1}, {"step": 2.0, "reward/mean": 0.3}]
    fig = plot_history(history)
    assert [t.get_text() for t in fig.axes[1].texts] == ["not logged"]
    assert len(fig.axes[0].texts) == 0


def test_empty_history() -> None:
    with pytest.raises(ValueError, match="empty history"):
        plot_history([])
