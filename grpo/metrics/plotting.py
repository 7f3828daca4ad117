"""The standard training figure: one call from a run's history (or JSONL file) to a PNG.

Needs matplotlib (the ``notebook`` extra), imported when a figure is drawn. The figure is
built with matplotlib's object API and the Agg renderer, never ``pyplot``: no window opens, no
global backend changes, and it works on headless machines and in notebooks.

Panels (x axis: ``step``), metric names as in docs/metrics.md:

1. reward: ``reward/mean`` with a ``reward/std`` band and a ``reward/min..max`` band, plus
   ``eval/reward/mean`` markers when the run evaluated;
2. KL: ``kl/ref`` (and ``kl/old`` when non-zero);
3. entropy: ``policy/entropy``;
4. clip fraction: ``clip/frac_low`` and ``clip/frac_high``;
5. gradient norm: ``grad/norm`` (before clipping);
6. learning rate: ``optim/lr``.

A metric missing from the records leaves its panel with a "not logged" note.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from grpo.metrics.sinks import read_jsonl
from grpo.runtime.extras import install_hint

__all__ = ["plot_history"]

History = Sequence[Mapping[str, float]] | str | os.PathLike[str]


def _series(records: Sequence[Mapping[str, float]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the records that hold ``key``."""
    xs: list[float] = []
    ys: list[float] = []
    for i, r in enumerate(records):
        if key in r:
            xs.append(float(r.get("step", i + 1)))
            ys.append(float(r[key]))
    return xs, ys


def plot_history(
    history: History,
    path: str | os.PathLike[str] | None = None,
    *,
    title: str | None = None,
    dpi: int = 100,
) -> Any:
    """Draw the standard figure of a run and save it as PNG when ``path`` is given.

    Args:
        history: a list of per-step metric dicts (``TrainState.history``, or the dicts returned
            by ``GRPOTrainer.step`` with a ``step`` key), or the path of a `JSONLSink` file.
        path: where to write the PNG (parent directories are created); None = do not save.
        title: the figure's title (default: the JSONL file name, or none).
        dpi: resolution of the saved PNG.

    Returns:
        The ``matplotlib.figure.Figure`` (2 x 3 panels).
    """
    figure_type, canvas_type = _matplotlib()
    records, title = _records(history, title)
    fig = figure_type(figsize=(15, 8), layout="constrained")
    canvas_type(fig)
    axes = fig.subplots(2, 3, sharex=True)
    ax_r, ax_kl, ax_ent, ax_clip, ax_grad, ax_lr = axes.flatten()
    _reward_panel(ax_r, records)
    _lines(ax_kl, records, ["kl/ref", "kl/old"], "KL", skip_zero=("kl/old",))
    _lines(ax_ent, records, ["policy/entropy"], "entropy")
    _lines(ax_clip, records, ["clip/frac_low", "clip/frac_high"], "clip fraction")
    _lines(ax_grad, records, ["grad/norm"], "grad norm (before clipping)")
    _lines(ax_lr, records, ["optim/lr"], "learning rate")
    for ax in axes[1]:
        ax.set_xlabel("step")
    if title:
        fig.suptitle(title)
    if path is not None:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, format="png", dpi=dpi)
    return fig


def _matplotlib() -> tuple[Any, Any]:
    """matplotlib's ``Figure`` and Agg canvas classes; an `ImportError` naming the extra without it."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            f"grpo.metrics.plotting needs matplotlib, which is not installed: {install_hint('notebook')}"
        ) from e
    return Figure, FigureCanvasAgg


def _records(history: History, title: str | None) -> tuple[Sequence[Mapping[str, float]], str | None]:
    """The records of ``history`` (read from a JSONL file when it is a path) and the title (a
    file's name by default); a `ValueError` when there is none."""
    if isinstance(history, (str, os.PathLike)):
        if title is None:
            title = Path(history).name
        records: Sequence[Mapping[str, float]] = read_jsonl(history)
    else:
        records = history
    if len(records) == 0:
        raise ValueError("plot_history got an empty history; run at least one step before plotting.")
    return records, title


def _reward_panel(ax: Any, records: Sequence[Mapping[str, float]]) -> None:
    """``reward/mean`` with its ``reward/std`` and ``reward/min..max`` bands, and the evaluations."""
    steps, mean = _series(records, "reward/mean")
    if steps:
        ax.plot(steps, mean, color="C0", label="reward/mean")
        s_std, std = _series(records, "reward/std")
        if s_std == steps:
            lo = [m - s for m, s in zip(mean, std, strict=True)]
            hi = [m + s for m, s in zip(mean, std, strict=True)]
            ax.fill_between(steps, lo, hi, color="C0", alpha=0.25, label="± reward/std")
        s_min, rmin = _series(records, "reward/min")
        s_max, rmax = _series(records, "reward/max")
        if s_min == steps and s_max == steps:
            ax.fill_between(steps, rmin, rmax, color="C0", alpha=0.08, label="reward/min..max")
    s_eval, ev = _series(records, "eval/reward/mean")
    if s_eval:
        ax.plot(s_eval, ev, "o-", color="C3", markersize=4, label="eval/reward/mean")
    _finish(ax, "reward", bool(steps or s_eval))


def _lines(
    ax: Any,
    records: Sequence[Mapping[str, float]],
    keys: list[str],
    title: str,
    skip_zero: tuple[str, ...] = (),
) -> None:
    drawn = False
    for key in keys:
        xs, ys = _series(records, key)
        if not xs or (key in skip_zero and all(y == 0.0 or math.isnan(y) for y in ys)):
            continue
        ax.plot(xs, ys, label=key)
        drawn = True
    _finish(ax, title, drawn)


def _finish(ax: Any, title: str, drawn: bool) -> None:
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize="small", loc="best")
    else:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
