"""What DeepSpeed ZeRO-2 and ZeRO-3 hold and cost per process on the LLM path, 2 CPU processes.

    python benchmarks/zero_llm.py                     # Qwen2-style, hidden 256, 4 layers, V=32k
    python benchmarks/zero_llm.py --hidden 512 --layers 8 --steps 5

A random Qwen2-architecture model (tied LM head; `grpo.llm.tiny.build_tiny_model`) trained by
`GRPOTrainer` + `CausalLMPolicy` on 2 gloo processes (one thread each), three ways, each in fresh
processes: the trainer's own gradient sync (``deepspeed="off"``), ZeRO-2 and ZeRO-3 with the
shipped ``examples/configs/deepspeed_zero{2,3}.json`` (their "auto" bucket sizes and persistence
threshold follow the hidden size H as accelerate sets them: H², 0.9·H², 10·H; weights of at most
10·H elements, the norms and biases, stay whole under ZeRO-3). Printed per way, for rank 0:

    weights   bytes of the model's weights held between forwards (ZeRO-3: its partitions)
    moments   bytes of the AdamW moments (ZeRO-2/3: this rank's partition)
    tensors   bytes of every live tensor of the process (storages counted once, found through the
              garbage collector): weights, master copies, moments, gradient buffers, DeepSpeed's
              buckets, whatever else is held after the timed steps
    RSS now   resident memory after the timed steps (includes the libraries and what the allocator
              keeps after frees; the model is loaded whole first, so the peak, RSS max, includes
              one full copy under every way)
    s/step    median seconds per `trainer.step` (generation included), and the generation share

Exact byte counts are the point; times on a shared 2-core machine are indicative (the ratios
between ways are measured in one run).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from scaling import free_port, state_bytes, weight_bytes  # benchmarks/scaling.py, beside this file

ROOT = Path(__file__).resolve().parents[1]


def _vm(field: str) -> float:
    """A /proc/self/status field in MiB (0 where there is no /proc)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _live_tensor_bytes() -> int:
    """Bytes of the storages of all tensors the garbage collector can reach (each counted once)."""
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            try:
                st = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):  # e.g. tensors without storage
                continue
            storages[st.data_ptr()] = max(storages.get(st.data_ptr(), 0), st.nbytes())
    return sum(storages.values())


def _worker(rank: int, world: int, port: int, args: dict[str, Any], out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
    )  # fmt: skip
    import warnings

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo import GRPOConfig, GRPOTrainer
    from grpo.llm import CausalLMPolicy, RewardFunctions, SamplingSettings

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(args["model"], dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(args["model"])
    policy = CausalLMPolicy(
        model, tok, SamplingSettings(max_new_tokens=args["new_tokens"]), logprob_chunk_size=256
    )

    def score(prompts: list[Any], completions: list[str], **_: Any) -> list[float]:
        return [float(len(c) % 5) for c in completions]

    config = GRPOConfig(
        group_size=4, batch_size=2, seed=0, learning_rate=1e-4, kl_coeff=0.0, deepspeed=args["deepspeed"]
    )
    trainer = GRPOTrainer(config, policy, RewardFunctions({"score": score}))
    times, gen = [], []
    for step in range(args["steps"] + 1):
        prompts = [f"{rank} {step} {i} +" for i in range(2)]
        t0 = time.perf_counter()
        trainer.step(prompts)
        if step:  # the first step warms up
            times.append(time.perf_counter() - t0)
            gen.append(policy.last_generation["seconds"])
    weights = weight_bytes(list(model.parameters()))
    moments = state_bytes(trainer.optimizer)
    if rank == 0:
        result = {
            "weights": weights,
            "moments": moments,
            "tensors": _live_tensor_bytes(),
            "rss_now": _vm("VmRSS"),
            "rss_max": _vm("VmHWM"),
            "s_step": statistics.median(times),
            "gen_share": sum(gen) / sum(times),
            "stage": trainer.deepspeed_stage,
        }
        Path(out).write_text(json.dumps(result))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(k, None)
    from grpo.llm.tiny import build_tiny_model, build_tiny_tokenizer

    with tempfile.TemporaryDirectory() as d:
        tok = build_tiny_tokenizer(d)
        model = build_tiny_model(
            d, tok, arch="qwen2", hidden=args.hidden, layers=args.layers, heads=4, vocab_size=args.vocab
        )
        n_params = sum(p.numel() for p in model.parameters())
        del model
        with open("/proc/loadavg") if os.path.exists("/proc/loadavg") else open(os.devnull) as f:
            load = f.read().split()[:3]
        print(
            f"Qwen2-style, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: "
            f"{n_params / 1e6:.1f}M parameters ({n_params * 4 / 2**20:.0f} MiB fp32); 2 prompts x 4 "
            f"completions x {args.new_tokens} new tokens per rank; torch {torch.__version__}; "
            f"2 gloo processes, 1 thread each; load average {load}"
        )
        print(
            f"{'way':>9} {'weights MiB':>11} {'moments MiB':>11} {'tensors MiB':>11} {'RSS now':>8} "
            f"{'RSS max':>8} {'s/step':>7} {'vs own':>6} {'generation':>10}"
        )
        own = None
        for label, stage in (("own sync", None), ("ZeRO-2", 2), ("ZeRO-3", 3)):
            ds = "off"
            if stage is not None:  # the shipped configs ("auto" sizes follow the hidden size)
                ds = str(ROOT / "examples" / "configs" / f"deepspeed_zero{stage}.json")
            out = os.path.join(d, f"{label}.json")
            run = {"model": d, "deepspeed": ds, "steps": args.steps, "new_tokens": args.new_tokens}
            mp.spawn(_worker, args=(2, free_port(), run, out), nprocs=2)
            r = json.loads(Path(out).read_text())
            assert r["stage"] == stage
            own = own or r["s_step"]
            print(
                f"{label:>9} {r['weights'] / 2**20:>11.1f} {r['moments'] / 2**20:>11.1f} "
                f"{r['tensors'] / 2**20:>11.1f} "
                f"{r['rss_now']:>8.0f} {r['rss_max']:>8.0f} {r['s_step']:>7.2f} "
                f"{r['s_step'] / own:>6.2f} {r['gen_share']:>10.0%}"
            )


if __name__ == "__main__":
    main()
