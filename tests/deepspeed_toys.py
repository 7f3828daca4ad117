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

from tests.distributed_toys import LOCAL_B, SCENARIOS, STEPS, build, data, params, run_steps

DS_SCENARIOS = ["bandit_deferred", "bandit_zero_var", "bandit_poison", "seq_deferred", "seq_known"]
# label -> DeepSpeed config; *-offload: optimizer state on the CPU, stepped by DeepSpeedCPUAdam
ZERO_CONFIGS: dict[str, dict[str, Any]] = {
    "zero1": {"zero_optimization": {"stage": 1}, "gradient_clipping": "auto"},
    "zero2": {"zero_optimization": {"stage": 2}, "gradient_clipping": "auto"},
    "zero2-offload": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
    "zero3": {
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "gradient_clipping": "auto",
    },
    # ZeRO-3 with the weights and the optimizer state offloaded to the CPU (ZeRO-Infinity's layout)
    "zero3-offload": {
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "cpu"},
        }
    },
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
                metrics = run_steps(tr, d, rows, range(STEPS))
                with tr.gathered_weights():  # ZeRO-3: the full weights on every rank
                    weights = params(tr)
            res[f"{name}/{label}"] = {
                "params": weights,
                "metrics": metrics,
                "non_finite": tr.non_finite_steps,
                "optimizer": type(tr.optimizer).__name__,
            }
    torch.save(res, out / f"ds-rank{rank}.pt")


def zero3_uneven_worker(rank: int, world: int, out: Path) -> None:
    """ZeRO-3 with one state fewer on rank 1: ``step`` must raise on every rank before any
    forward (which would hang: each forward all-gathers weights); writes ``uneven-rank{r}.pt``."""
    path = out / f"zero3-rank{rank}.json"  # no process group yet: the trainer joins it
    path.write_text(json.dumps(ZERO_CONFIGS["zero3"]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = build("bandit_deferred", LOCAL_B, deepspeed=str(path))
    assert tr._deepspeed is not None
    d = data("bandit_deferred", world)
    n = LOCAL_B - rank  # rank 1 gets one state fewer
    rows = slice(rank * LOCAL_B, rank * LOCAL_B + n)
    with tr.gathered_weights():
        before = params(tr)
    message = ""
    try:
        tr.step(d["states"][0, rows], noise=d["noise"][0, rows])
    except ValueError as e:
        message = str(e)
    with tr.gathered_weights():
        after = params(tr)
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    torch.save({"message": message, "unchanged": unchanged}, out / f"uneven-rank{rank}.pt")
