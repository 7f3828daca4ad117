"""GRPO step throughput on a causal LM: grpo vs TRL's GRPOTrainer (when installed).

    python benchmarks/llm_throughput.py [--trl-python PY] [--steps 5] [--rounds 3] [--sides hf:0 worker:1 trl]
    python benchmarks/llm_throughput.py --device cuda --model qwen2-0.5b --bf16 --sides hf:0 vllm:1 trl

Same model (``--model tiny``: a random Llama, hidden 64, 2 layers, 55-token vocabulary;
``--model qwen2-0.5b``: Qwen2-0.5B's architecture, 494M parameters, 151,936-token vocabulary,
random weights; both saved and loaded with from_pretrained, with the 55-token character tokenizer,
whose unknown ids decode to nothing), same 8 prompts x 8 generations, 32 new tokens, temperature
1, one optimizer
step per batch, no KL term (TRL's default beta = 0), on the same device. Each trainer runs in
its own subprocess (TRL in its own virtualenv: it is never a dependency of grpo). Reported:
seconds per step (the median of the timed steps, after one warm-up step; TRL's step time is the
interval between consecutive step ends, so generation is included), completion tokens per second
(completion tokens actually generated in that step / its time), and the process's peak resident
memory (CPU) or peak CUDA memory. Ratios are grpo / TRL for speed and memory. On a shared CPU
the figures move with the load of other processes: the sides run in turn in each of ``--rounds``
rounds, and each ratio is taken within a round. A side ``ENGINE:K`` is grpo with
``generation_engine=ENGINE`` and ``async_staleness=K`` (issue 30: ``worker:1`` generates the next
batch in a worker process while this one updates); its step time is the interval between step
ends, as TRL's, and it also reports the worker's peak memory and the weight-sync time.
``trl-vllm``: TRL with ``use_vllm=True, vllm_mode="colocate"`` (vLLM in the trainer's process),
run with ``--trl-python`` and this script both in one environment that has vLLM (on a CPU
machine, the CPU build: docs/llm.md, "Installing vLLM"), so both sides use the same vLLM build.
``--bf16`` (CUDA only): float32 weights with bf16 autocast on both sides (grpo's
`CausalLMPolicy(autocast=True)`, TRL's ``bf16=True``); without it both run in float32.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

PROMPTS = [f"{i}+{j}=" for i, j in [(1, 2), (3, 4), (5, 1), (2, 2), (7, 1), (0, 9), (4, 4), (6, 3)]]

OURS = r"""
import json, resource, sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from grpo import GRPOConfig, GRPOTrainer
from grpo.llm import CausalLMPolicy, RewardFunctions, SamplingSettings
from grpo.training.callbacks import Callback
model_dir, steps, device, prompts = sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
bf16, engine, k = sys.argv[5] == "1", sys.argv[6], int(sys.argv[7])
torch.manual_seed(0)
tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
sampling = SamplingSettings(max_new_tokens=32, temperature=1.0)
policy = CausalLMPolicy(model, tok, sampling, autocast=bf16)
reward = RewardFunctions(lambda p, c: [c_.count("7") / 32 for c_ in c])
trainer = GRPOTrainer(GRPOConfig(group_size=8, batch_size=8, learning_rate=1e-5, kl_coeff=0.0, device=device,
                                 seed=0, generation_engine=engine, async_staleness=k), policy, reward)
class Clock(Callback):  # as TRL's: the interval between consecutive step ends
    def __init__(self): self.ends, self.tokens = [], []
    def on_step_end(self, state, metrics):
        if device.startswith("cuda"): torch.cuda.synchronize()
        self.ends.append(time.perf_counter()); self.tokens.append(metrics["completion/tokens"])
clock = Clock()
trainer.train(prompts, steps + 1, progress=False, callbacks=[clock])
times = [b - a for a, b in zip(clock.ends, clock.ends[1:])]  # steps 1.. (step 0 = warm-up)
tokens = clock.tokens[1:]
mid = sorted(range(len(times)), key=times.__getitem__)[len(times) // 2]  # the median step
times, tokens = [times[mid]], [tokens[mid]]
sync = getattr(trainer.collector.engine, "last_sync_seconds", None) or 0.0
trainer.close()  # joins a worker process: its peak memory is then in RUSAGE_CHILDREN
peak = (torch.cuda.max_memory_allocated() if device.startswith("cuda")
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
print(json.dumps({"s_per_step": sum(times) / len(times), "tokens_per_s": sum(tokens) / sum(times),
                  "peak": peak, "worker_peak": child, "sync_s": sync}))
"""

TRL = r"""
import json, resource, sys, time, torch, tempfile
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
# Everything runs inside main(): datasets hashes the functions it maps, and dill pickles a
# function of __main__ with __main__'s globals, where a Dataset (pyarrow types) must not be.
def sevens(prompts, completions, **kw):
    return [c.count("7") / 32 for c in completions]
class Clock(TrainerCallback):
    # step time = interval between consecutive step ends: includes generation wherever TRL runs it
    def __init__(self, device): self.device, self.ends, self.lengths = device, [], []
    def on_step_end(self, args, state, control, **kw):
        if self.device.startswith("cuda"): torch.cuda.synchronize()
        self.ends.append(time.perf_counter())
    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "completions/mean_length" in logs: self.lengths.append(logs["completions/mean_length"])
def main():
    model_dir, steps, device, prompts = sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
    bf16, use_vllm = sys.argv[5] == "1", len(sys.argv) > 6 and sys.argv[6] == "vllm"
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ds = Dataset.from_list([{"prompt": p} for p in prompts] * (steps + 1))
    clock = Clock(device)
    cfg = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=64, num_generations=8,
                     max_completion_length=32, temperature=1.0, top_p=1.0, top_k=0, learning_rate=1e-5,
                     beta=0.0,
                     max_steps=steps + 1, logging_steps=1, report_to="none",
                     use_cpu=not device.startswith("cuda"),
                     save_strategy="no", shuffle_dataset=False, seed=0, bf16=bf16,
                     **({"use_vllm": True, "vllm_mode": "colocate"} if use_vllm else {}))
    trainer = GRPOTrainer(model=model, reward_funcs=sevens, args=cfg, train_dataset=ds, processing_class=tok,
                          callbacks=[clock])
    trainer.train()
    times = [b - a for a, b in zip(clock.ends, clock.ends[1:])]  # steps 1.. (step 0 = warm-up)
    lengths = clock.lengths[1:]
    mid = sorted(range(len(times)), key=times.__getitem__)[len(times) // 2]  # median step
    times, lengths = [times[mid]], [lengths[mid]]
    peak = (torch.cuda.max_memory_allocated() if device.startswith("cuda")
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    tokens = sum(l * 64 for l in lengths)
    s_per_step = sum(times) / len(times)
    print(json.dumps({"s_per_step": s_per_step, "tokens_per_s": tokens / sum(times), "peak": peak}))
main()
"""


def run(
    python: str, code: str, model_dir: str, steps: int, device: str, bf16: bool, extra: Sequence[str] = ()
) -> dict[str, float]:
    env = dict(os.environ)
    out = subprocess.run(
        [
            python,
            "-c",
            code,
            model_dir,
            str(steps),
            device,
            json.dumps(PROMPTS),
            "1" if bf16 else "0",
            *extra,
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    if out.returncode:
        err = out.stderr if len(out.stderr) <= 6000 else out.stderr[:2500] + "\n[...]\n" + out.stderr[-3500:]
        raise RuntimeError(f"{python} failed:\n{err}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="timed steps (after one warm-up step)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--trl-python", default="/work/benchvenv/bin/python", help="python with trl installed")
    p.add_argument(
        "--model", choices=["tiny", "qwen2-0.5b"], default="tiny", help="architecture (random weights)"
    )
    p.add_argument(
        "--heads", type=int, default=4,
        help="attention heads of --model tiny (2: head size 32, which vLLM's CPU attention needs)",
    )  # fmt: skip
    p.add_argument("--bf16", action="store_true", help="bf16 autocast on both sides (CUDA only)")
    p.add_argument(
        "--sides", nargs="+", default=["hf:0", "worker:1", "trl"],
        help="what to measure, alternating in each round: ENGINE:K (grpo with generation_engine=ENGINE, "
        "async_staleness=K), trl, or trl-vllm (TRL with use_vllm=True, vllm_mode='colocate')",
    )  # fmt: skip
    p.add_argument("--rounds", type=int, default=3, help="rounds; each runs every side once, in turn")
    a = p.parse_args()
    if a.bf16 and not a.device.startswith("cuda"):
        p.error("--bf16 needs --device cuda (grpo's autocast is CUDA-only)")
    bad = [s for s in a.sides if s not in ("trl", "trl-vllm") and len(s.split(":")) != 2]
    if bad:
        p.error(f"--sides {bad[0]}: expected ENGINE:K (e.g. hf:0, worker:1), trl or trl-vllm")
    model_dir, name, params, vocab = _model(a.model, a.heads)
    print(
        f"{name}, {params / 1e6:.2f}M parameters, vocab {vocab}; 8 prompts x 8 generations, 32 new "
        f"tokens, {a.steps} timed steps on {a.device}, {'bf16 autocast' if a.bf16 else 'float32'}; "
        f"{a.rounds} rounds of {a.sides}"
    )
    results: dict[str, list[dict[str, float]]] = {side: [] for side in a.sides}
    for r in range(a.rounds):
        for side in a.sides:
            res = _measure(side, a, model_dir)
            if res is not None:
                results[side].append(res)
                print(
                    f"round {r} {side:<18} {res['s_per_step']:.3f} s/step, "
                    f"{res['tokens_per_s']:.0f} tokens/s, peak {res['peak'] / 2**20:.0f} MiB", flush=True,
                )  # fmt: skip
    _report(results)


def _model(kind: str, heads: int = 4) -> tuple[str, str, int, int]:
    from grpo.llm.tiny import build_tiny_model, build_tiny_tokenizer

    model_dir = tempfile.mkdtemp(prefix="grpo_bench_")
    tok = build_tiny_tokenizer(model_dir)
    if kind == "tiny":
        model = build_tiny_model(model_dir, tok, hidden=64, layers=2, heads=heads)
        name = f"tiny Llama (hidden 64, 2 layers, {heads} heads)"
    else:
        model = build_tiny_model(
            model_dir, tok, arch="qwen2", hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864,
            vocab_size=151936,
        )  # fmt: skip
        name = "Qwen2-0.5B architecture (random weights)"
    return model_dir, name, sum(t.numel() for t in model.parameters()), int(model.config.vocab_size)


def _measure(side: str, a: argparse.Namespace, model_dir: str) -> dict[str, float] | None:
    if side in ("trl", "trl-vllm"):
        if not Path(a.trl_python).exists():
            print(f"TRL not found at {a.trl_python}; only grpo is measured")
            return None
        extra = ["vllm"] if side == "trl-vllm" else []
        return run(a.trl_python, TRL, model_dir, a.steps, a.device, a.bf16, extra)
    engine, k = side.split(":")
    return run(sys.executable, OURS, model_dir, a.steps, a.device, a.bf16, (engine, k))


def _median(rows: list[dict[str, float]], key: str) -> float:
    return float(statistics.median(r[key] for r in rows))


def _report(results: dict[str, list[dict[str, float]]]) -> None:
    print(f"{'side':<18}{'s/step (median, min-max)':>28}{'peak MiB':>10}{'worker MiB':>12}{'sync ms':>9}")
    for side, rows in results.items():
        if not rows:
            continue
        t = [r["s_per_step"] for r in rows]
        worker = _median(rows, "worker_peak") / 2**20 if "worker_peak" in rows[0] else 0.0
        sync_ms = 1e3 * _median(rows, "sync_s") if "sync_s" in rows[0] else 0.0
        print(
            f"{side:<18}{_median(rows, 's_per_step'):>12.3f} ({min(t):.3f}-{max(t):.3f})    "
            f"{_median(rows, 'peak') / 2**20:>10.0f}{worker:>12.0f}{sync_ms:>9.1f}"
        )
    trl = results.get("trl")
    if not trl:
        return
    for side, rows in results.items():
        if side == "trl" or not rows:
            continue
        ratios = [
            t["s_per_step"] / g["s_per_step"] for g, t in zip(rows, trl, strict=False)
        ]  # same round, side by side
        print(
            f"steps/s {side} / TRL: median {statistics.median(ratios):.2f}x "
            f"(rounds {', '.join(f'{x:.2f}' for x in ratios)}; goal >= 2); peak memory "
            f"{_median(rows, 'peak') / _median(trl, 'peak'):.2f}x TRL's (goal <= 1 in process)"
        )


if __name__ == "__main__":
    main()
