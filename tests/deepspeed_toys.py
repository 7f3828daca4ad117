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


def zero_config(stage: int) -> dict[str, Any]:
    return {"zero_optimization": {"stage": stage}, "gradient_clipping": "auto"}


def ds_worker(rank: int, world: int, out: Path) -> None:
    """Every scenario of DS_SCENARIOS under ZeRO-1 and ZeRO-2; writes ``ds-rank{r}.pt``."""
    rows = slice(rank * LOCAL_B, (rank + 1) * LOCAL_B)
    res: dict[str, Any] = {}
    for stage in (1, 2):
        path = out / f"zero{stage}.json"
        if rank == 0:
            path.write_text(json.dumps(zero_config(stage)))
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        for name in DS_SCENARIOS:
            assert name in SCENARIOS
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tr = build(name, LOCAL_B, deepspeed=str(path))
                assert tr._deepspeed is not None
                assert tr._deepspeed.stage == stage
                d = data(name, world)
                metrics = [tr.step(d["states"][s, rows], noise=d["noise"][s, rows]) for s in range(STEPS)]
            res[f"{name}/zero{stage}"] = {
                "params": params(tr),
                "metrics": metrics,
                "non_finite": tr.non_finite_steps,
            }
    torch.save(res, out / f"ds-rank{rank}.pt")
