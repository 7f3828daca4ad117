"""Processes for the generation worker's crash tests (tests/test_generation_worker.py).

As a script, a trainer that starts a worker and prints ``started <worker pid>`` once
the worker process exists (the test then SIGKILLs this trainer):

    python tests/data/worker_kill_run.py for_policy MODEL_DIR   # causal_lm_worker(a tiny LM)
    python tests/data/worker_kill_run.py slow MARKER COPY_DIR   # make_policy writes MARKER, then waits

As a reward (``grpo-train --reward tests/data/worker_kill_run.py:kill_the_worker``): the third
call SIGKILLs the run's generation worker.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

_calls = [0]


def kill_the_worker(prompts: list[Any], completions: list[str], **columns: Any) -> list[float]:
    """A reward of 0 that SIGKILLs this process's generation worker at its third call."""
    _calls[0] += 1
    if _calls[0] == 3:
        for child in multiprocessing.active_children():
            if child.name == "grpo-generation-worker":
                os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
    return [0.0 for _ in completions]


def slow_policy(marker: str) -> Any:
    """A make_policy that says it started (writes ``marker``), then takes a minute."""
    from grpo import categorical_mlp

    Path(marker).write_text("building")
    time.sleep(60.0)
    return categorical_mlp(4, 3)


def main(argv: list[str]) -> None:
    from grpo.generation.worker import WorkerEngine

    if argv[0] == "for_policy":
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from grpo.llm import CausalLMPolicy
        from grpo.llm.engines.worker import causal_lm_worker

        model = AutoModelForCausalLM.from_pretrained(argv[1], dtype=torch.float32)
        engine = causal_lm_worker(CausalLMPolicy(model, AutoTokenizer.from_pretrained(argv[1])))
    else:
        os.makedirs(argv[2])
        engine = WorkerEngine(functools.partial(slow_policy, argv[1]), cleanup_dir=argv[2])
    print("started", engine.pid, flush=True)
    engine.wait_ready()
    print("ready", flush=True)
    time.sleep(600.0)


if __name__ == "__main__":
    main(sys.argv[1:])
