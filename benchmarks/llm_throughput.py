"""GRPO step throughput on a causal LM: grpo vs TRL's GRPOTrainer (when installed).

    python benchmarks/llm_throughput.py [--trl-python /work/venv-trl/bin/python] [--steps 5]
    python benchmarks/llm_throughput.py --device cuda --model qwen2-0.5b --bf16   # on a GPU

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
the figures move with the load of other processes: run it a few times. ``--bf16`` (CUDA only):
float32 weights with bf16 autocast on both sides (grpo's `CausalLMPolicy(autocast=True)`, TRL's
``bf16=True``); without it both run in float32.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PROMPTS = [f"{i}+{j}=" for i, j in [(1, 2), (3, 4), (5, 1), (2, 2), (7, 1), (0, 9), (4, 4), (6, 3)]]

OURS = r"""
import json, resource, sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from grpo import GRPOConfig, GRPOTrainer
from grpo.llm import CausalLMPolicy, RewardFunctions
model_dir, steps, device, prompts = sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
bf16 = sys.argv[5] == "1"
torch.manual_seed(0)
tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
policy = CausalLMPolicy(model, tok, max_new_tokens=32, temperature=1.0, autocast=bf16)
reward = RewardFunctions(lambda p, c: [c_.count("7") / 32 for c_ in c])
trainer = GRPOTrainer(GRPOConfig(group_size=8, batch_size=8, learning_rate=1e-5, kl_coeff=0.0, device=device,
                                 seed=0), policy, reward)
times, tokens = [], []
for s in range(steps + 1):
    if device.startswith("cuda"): torch.cuda.synchronize()
    t = time.perf_counter()
    trainer.step(prompts)
    if device.startswith("cuda"): torch.cuda.synchronize()
    if s:  # step 0 is warm-up
        times.append(time.perf_counter() - t); tokens.append(policy.last_generation["completion_tokens"])
order = sorted(range(len(times)), key=times.__getitem__)
mid = order[len(order) // 2]  # the median step (robust to other processes on a shared CPU)
times, tokens = [times[mid]], [tokens[mid]]
peak = (torch.cuda.max_memory_allocated() if device.startswith("cuda")
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
print(json.dumps({"s_per_step": sum(times) / len(times), "tokens_per_s": sum(tokens) / sum(times),
                  "peak": peak}))
"""

TRL = r"""
import json, resource, sys, time, torch, tempfile
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
model_dir, steps, device, prompts = sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
bf16 = sys.argv[5] == "1"
torch.manual_seed(0)
tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
ds = Dataset.from_list([{"prompt": p} for p in prompts] * (steps + 1))
def sevens(prompts, completions, **kw):
    return [c.count("7") / 32 for c in completions]
class Clock(TrainerCallback):
    # step time = interval between consecutive step ends: includes generation wherever TRL runs it
    def __init__(self): self.ends, self.lengths = [], []
    def on_step_end(self, args, state, control, **kw):
        if device.startswith("cuda"): torch.cuda.synchronize()
        self.ends.append(time.perf_counter())
    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "completions/mean_length" in logs: self.lengths.append(logs["completions/mean_length"])
clock = Clock()
cfg = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=64, num_generations=8,
                 max_completion_length=32, temperature=1.0, top_p=1.0, top_k=0, learning_rate=1e-5, beta=0.0,
                 max_steps=steps + 1, logging_steps=1, report_to="none",
                 use_cpu=not device.startswith("cuda"),
                 save_strategy="no", shuffle_dataset=False, seed=0, bf16=bf16)
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
print(json.dumps({"s_per_step": sum(times) / len(times), "tokens_per_s": tokens / sum(times), "peak": peak}))
"""


def run(
    python: str, code: str, model_dir: str, steps: int, device: str, bf16: bool, extra_path: str | None
) -> dict[str, float]:
    env = dict(os.environ)
    if extra_path:
        env["PYTHONPATH"] = extra_path
    out = subprocess.run(
        [python, "-c", code, model_dir, str(steps), device, json.dumps(PROMPTS), "1" if bf16 else "0"],
        capture_output=True,
        text=True,
        env=env,
    )
    if out.returncode:
        raise RuntimeError(f"{python} failed:\n{out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="timed steps (after one warm-up step)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--trl-python", default="/work/venv-trl/bin/python", help="python with trl installed")
    p.add_argument(
        "--model", choices=["tiny", "qwen2-0.5b"], default="tiny", help="architecture (random weights)"
    )
    p.add_argument("--bf16", action="store_true", help="bf16 autocast on both sides (CUDA only)")
    a = p.parse_args()
    if a.bf16 and not a.device.startswith("cuda"):
        p.error("--bf16 needs --device cuda (grpo's autocast is CUDA-only)")
    from grpo.llm.tiny import build_tiny_model, build_tiny_tokenizer

    model_dir = tempfile.mkdtemp(prefix="grpo_bench_")
    tok = build_tiny_tokenizer(model_dir)
    if a.model == "tiny":
        model = build_tiny_model(model_dir, tok, hidden=64, layers=2)
        name = "tiny Llama (hidden 64, 2 layers)"
    else:
        model = build_tiny_model(
            model_dir, tok, arch="qwen2", hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864,
            vocab_size=151936,
        )  # fmt: skip
        name = "Qwen2-0.5B architecture (random weights)"
    params = sum(t.numel() for t in model.parameters())
    vocab = model.config.vocab_size
    del model
    print(
        f"{name}, {params / 1e6:.2f}M parameters, vocab {vocab}; 8 prompts x 8 generations, 32 new "
        f"tokens, {a.steps} timed steps on {a.device}, {'bf16 autocast' if a.bf16 else 'float32'}"
    )
    results = {"grpo": run(sys.executable, OURS, model_dir, a.steps, a.device, a.bf16, None)}
    if Path(a.trl_python).exists():
        try:
            results["trl"] = run(a.trl_python, TRL, model_dir, a.steps, a.device, a.bf16, None)
        except RuntimeError as e:
            print(f"TRL run failed: {e}")
    else:
        print(f"TRL not found at {a.trl_python}; only grpo is measured")
    print(f"{'trainer':<8}{'s/step':>10}{'tokens/s':>12}{'peak MiB':>12}")
    for name, r in results.items():
        print(f"{name:<8}{r['s_per_step']:>10.3f}{r['tokens_per_s']:>12.0f}{r['peak'] / 2**20:>12.0f}")
    if "trl" in results:
        g, t = results["grpo"], results["trl"]
        print(f"throughput grpo/TRL (tokens/s): {g['tokens_per_s'] / t['tokens_per_s']:.2f}x  (goal >= 2)")
        print(f"step-time ratio TRL/grpo: {t['s_per_step'] / g['s_per_step']:.2f}x")
        print(f"peak memory ratio grpo/TRL: {g['peak'] / t['peak']:.2f}  (goal <= 1)")


if __name__ == "__main__":
    main()
