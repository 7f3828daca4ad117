"""What each process of the 2-process DeepSpeed tests runs (module level: spawn pickles it).

The scenarios of `tests.distributed_toys` (same states, noise and policies), trained with a
DeepSpeed ZeRO config on every rank; the results are compared with one process without DeepSpeed.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch

from tests.distributed_toys import LOCAL_B, SCENARIOS, STEPS, build, data, params

DS_SCENARIOS = ["bandit_deferred", "bandit_zero_var", "bandit_poison", "seq_deferred", "seq_known"]
# label -> DeepSpeed config; zero2-offload: optimizer state on the CPU, stepped by DeepSpeedCPUAdam
ZERO_CONFIGS: dict[str, dict[str, Any]] = {
    "zero1": {"zero_optimization": {"stage": 1}, "gradient_clipping": "auto"},
    "zero2": {"zero_optimization": {"stage": 2}, "gradient_clipping": "auto"},
    "zero2-offload": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
}


def ds_worker(rank: int, world: int, out: Path) -> None:
    """Every scenario of DS_SCENARIOS under each of ZERO_CONFIGS; writes ``ds-rank{r}.pt``."""
    rows = slice(rank * LOCAL_B, (rank + 1) * LOCAL_B)
    res: dict[str, Any] = {}
    for label, config in ZERO_CONFIGS.items():
        path = out / f"{label}.json"
        if rank == 0:
            path.write_text(json.dumps(config))
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        for name in DS_SCENARIOS:
            assert name in SCENARIOS
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tr = build(name, LOCAL_B, deepspeed=str(path))
                assert tr._deepspeed is not None
                assert tr._deepspeed.stage == config["zero_optimization"]["stage"]
                d = data(name, world)
                metrics = [tr.step(d["states"][s, rows], noise=d["noise"][s, rows]) for s in range(STEPS)]
            res[f"{name}/{label}"] = {
                "params": params(tr),
                "metrics": metrics,
                "non_finite": tr.non_finite_steps,
                "optimizer": type(tr.optimizer).__name__,
            }
    torch.save(res, out / f"ds-rank{rank}.pt")
