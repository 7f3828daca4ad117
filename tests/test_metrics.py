"""grpo.metrics: every metric declared once; the cross-process reduction follows the declaration;
docs/metrics.md is generated from the declarations."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from grpo.metrics import METRICS, REDUCTIONS, StepCounts, glossary_markdown, metric, reduce_across_ranks

ROOT = Path(__file__).resolve().parents[1]


def gather_rows(rows: list[dict[str, float]], counts: list[StepCounts]):
    """A fake all_gather over len(rows) processes: this process is row 0; the others' vectors are
    built the way reduce_across_ranks builds its own (a real one is exercised in test_distributed)."""
    calls: list[int] = []

    def all_gather(local: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        out = [local]
        for r, c in zip(rows[1:], counts[1:], strict=True):
            other = local.clone()
            other[1:4] = torch.tensor([c.samples, c.groups, c.valid_steps], dtype=torch.float64)
            other[4:] = torch.tensor([r[k] for k in rows[0]], dtype=torch.float64)
            out.append(other)
        return torch.stack(out)

    return all_gather, calls


def test_pooled_std_and_weighted_means_equal_the_concatenated_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(n, generator=gen, dtype=torch.float64) * (1 + n) for n in (3, 8, 1)]
    rows = [
        {
            "reward/mean": float(p.mean()),
            "reward/std": float(p.std()) if p.numel() > 1 else 0.0,
            "reward/max": float(p.max()),
            "loss/total": loss,
            "time/step": t,
        }
        for p, loss, t in zip(parts, (0.25, 0.5, 0.125), (1.0, 3.0, 2.0), strict=True)
    ]
    counts = [StepCounts(float(p.numel()), 1.0, 1.0) for p in parts]
    all_gather, calls = gather_rows(rows, counts)
    out = reduce_across_ranks(rows[0], counts[0], all_gather)
    every = torch.cat(parts)
    assert len(calls) == 1  # one collective for all metrics
    assert out["reward/mean"] == pytest.approx(float(every.mean()))
    assert out["reward/std"] == pytest.approx(float(every.std()))
    assert out["reward/max"] == float(every.max())
    assert out["loss/total"] == 0.875  # each process's share of the global loss: summed
    assert out["time/step"] == 3.0  # the slowest process


def test_options_metrics_reduce_by_their_own_counts() -> None:
    """sampler/* by valid steps, frac_dropped_groups by groups, dropped_groups summed: a plain
    mean over processes is wrong for each when the counts differ."""
    rows = [
        {"sampler/is_weight_mean": 1.0, "advantage/frac_dropped_groups": 0.5, "reward/dropped_groups": 2.0},
        {"sampler/is_weight_mean": 0.5, "advantage/frac_dropped_groups": 0.0, "reward/dropped_groups": 1.0},
    ]
    counts = [StepCounts(8.0, 2.0, 30.0), StepCounts(24.0, 6.0, 10.0)]
    all_gather, _ = gather_rows(rows, counts)
    out = reduce_across_ranks(rows[0], counts[0], all_gather)
    assert out["sampler/is_weight_mean"] == pytest.approx((1.0 * 30 + 0.5 * 10) / 40)
    assert out["advantage/frac_dropped_groups"] == pytest.approx(0.5 * 2 / 8)
    assert out["reward/dropped_groups"] == 3.0


def test_different_metric_names_on_processes_fail_clearly() -> None:
    def all_gather(local: torch.Tensor) -> torch.Tensor:
        other = local.clone()
        other[0] += 1  # another process hashed other names
        return torch.stack([local, other])

    with pytest.raises(RuntimeError, match="different metric names"):
        reduce_across_ranks({"reward/mean": 1.0}, StepCounts(1, 1, 1), all_gather)


def test_every_metric_declares_a_known_reduction_and_components_match_their_pattern() -> None:
    assert len({m.name for m in METRICS}) == len(METRICS)
    assert all(m.reduce in REDUCTIONS and m.help for m in METRICS)
    declared = metric("reward/format/mean")
    assert declared is not None
    assert declared.name == "reward/<component>/mean"
    assert metric("user/statistic") is None


def test_docs_metrics_md_is_generated_from_the_declarations() -> None:
    text = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")
    assert text == glossary_markdown(), "run: python -m grpo.metrics > docs/metrics.md"
