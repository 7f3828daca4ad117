"""The accelerate / DeepSpeed configs shipped in examples/configs/ parse and agree with each other."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"
ROOT = CONFIGS.parents[1]


@pytest.mark.parametrize(
    ("name", "distributed_type", "zero_stage"),
    [("accelerate_ddp.yaml", "MULTI_GPU", None), ("accelerate_zero2.yaml", "DEEPSPEED", 2),
     ("accelerate_zero3.yaml", "DEEPSPEED", 3)],
)  # fmt: skip
def test_accelerate_config_parses_and_points_at_its_deepspeed_json(
    name: str, distributed_type: str, zero_stage: int | None
) -> None:
    yaml = pytest.importorskip("yaml")
    cfg = yaml.safe_load((CONFIGS / name).read_text())
    assert cfg["distributed_type"] == distributed_type
    assert cfg["num_machines"] == 1
    assert cfg["num_processes"] >= 1
    if zero_stage is None:
        assert "deepspeed_config" not in cfg
        return
    ds_file = ROOT / cfg["deepspeed_config"]["deepspeed_config_file"]
    ds = json.loads(ds_file.read_text())
    assert ds["zero_optimization"]["stage"] == zero_stage
    # off: nothing builds the model under zero.Init; the trainer partitions it when it starts
    assert cfg["deepspeed_config"]["zero3_init_flag"] is False
    # batch sizes, accumulation and clipping are filled in by the trainer (grpo.engine.deepspeed)
    assert ds["train_micro_batch_size_per_gpu"] == "auto"
    assert ds["gradient_clipping"] == "auto"
