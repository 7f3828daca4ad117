"""Peak extra memory and time of one real `GRPOTrainer.step` on a causal LM with a 32k vocabulary.

    python benchmarks/llm_memory.py [--sides chunked,full,compiled --rounds 2 --steps 2]

The model is a random Llama of tiny depth (1 layer, hidden 64) with a 32,000-token vocabulary,
built from a config (`grpo.llm.tiny.build_tiny_model`), saved and loaded with from_pretrained. A
step is the whole `GRPOTrainer.step`: B = batch * G = 16 completions of up to 512 new tokens
(a random model over 32k tokens almost never samples EOS, so T = 512), their rewards, the
reference log-probs (``kl_coeff > 0``: a frozen copy of the policy) and one optimizer step with
the gradient through the log-probs (and the exact entropy with ``--entropy-coeff``). The full
float32 logits of the update, B * T * V * 4 bytes, are 1000 MiB.

Sides (each a CausalLMPolicy setting, everything else equal):

* ``chunked``: the default, ``logprob_chunk_size=512`` (`grpo.llm.logprobs`);
* ``full``: ``logprob_chunk_size=None``, the model's own forward, which materialises the
  (B, T, V) logits: the baseline;
* ``compiled``: the default plus ``compile_logprobs=True`` (`torch.compile` of the chunk kernels).

Method. Each (side, round) runs in a fresh subprocess, sides alternating within a round (the
order reverses every other round), so that load from other processes falls on every side alike.
The child builds the trainer, runs one warm-up step (its time is reported as the first step: for
``compiled`` it includes compilation), then ``--steps`` measured steps. Before each measured step
it resets the kernel's resident-set high-water mark (``echo 5 > /proc/self/clear_refs``) and reads
the resident set (VmRSS); after the step it reads the high-water mark (VmHWM). Extra memory =
VmHWM - VmRSS before: what the step needed on top of the weights, the reference copy, the
optimizer state and the gradients already held. ``MALLOC_MMAP_THRESHOLD_=65536`` makes glibc
return every freed block over 64 KiB to the OS, so the resident set follows the live tensors
instead of allocator caches (the method of benchmarks/llm_logprob_memory.py, which measures the
log-prob function alone). The extra memory is end to end: it also holds the transformer's
activations (attention over 528 positions included), so it bounds the log-prob path's own extra
memory from above. Ratios are extra / (B * T * V * 4) and time ratios side / chunked, medians over
the rounds of the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from grpo import GRPOConfig, GRPOTrainer
from grpo.llm import CausalLMPolicy, RewardFunctions, SamplingSettings
model_dir, side = sys.argv[1], sys.argv[2]
steps, new_tokens, kl, ent = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6])
torch.manual_seed(0)
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
policy = CausalLMPolicy(model, tok, SamplingSettings(max_new_tokens=new_tokens, temperature=1.0),
                        logprob_chunk_size=None if side == "full" else 512,
                        **({"compile_logprobs": True} if side == "compiled" else {}))
def ids_reward(prompts, completions, completion_ids, **kw):
    return [float(sum(int(t) for t in ids[:8]) % 13) for ids in completion_ids]
reward = RewardFunctions(ids_reward)
cfg = GRPOConfig(group_size=8, batch_size=2, learning_rate=1e-5, kl_coeff=kl, entropy_coeff=ent,
                 num_threads=2, seed=0)
trainer = GRPOTrainer(cfg, policy, reward)
prompts = ["1+2=", "what is 3+4?"]
t0 = time.perf_counter(); trainer.step(prompts); first = time.perf_counter() - t0
rows = []
for _ in range(steps):
    open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS
    base = status("VmRSS")
    t0 = time.perf_counter(); m = trainer.step(prompts); wall = time.perf_counter() - t0
    nan = float("nan")
    rows.append({"extra": status("VmHWM") - base, "step_s": wall, "base": base,
                 "logprobs_s": m.get("time/logprobs", nan), "update_s": m.get("time/update", nan),
                 "generate_s": m.get("time/generate", nan), "T": m.get("completion/max_length", nan)})
print(json.dumps({"first_step_s": first, "rows": rows}))
"""


def child(model_dir: str, side: str, a: argparse.Namespace) -> dict[str, object]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "2", "PYTHONPATH": os.getcwd()}
    args = [model_dir, side, str(a.steps), str(a.new_tokens), str(a.kl_coeff), str(a.entropy_coeff)]
    out = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(f"side {side} failed:\n{out.stderr[-3000:]}")
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def build(directory: str, a: argparse.Namespace) -> None:
    from grpo.llm.tiny import build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer(directory)
    build_tiny_model(directory, tok, hidden=a.hidden, layers=a.layers, heads=2, vocab_size=a.vocab)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sides", default="chunked,full,compiled")
    p.add_argument("--rounds", type=int, default=2, help="fresh processes per side, alternating")
    p.add_argument("--steps", type=int, default=2, help="measured steps per process (after a warm-up)")
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--kl-coeff", type=float, default=0.04)
    p.add_argument("--entropy-coeff", type=float, default=0.0)
    a = p.parse_args()
    sides = a.sides.split(",")
    directory = tempfile.mkdtemp(prefix="grpo_llm_memory_")
    build(directory, a)
    full = 16 * a.new_tokens * a.vocab * 4
    mib = 2**20
    print(f"load average: {os.getloadavg()}")
    print(
        f"Llama, {a.layers} layer(s), hidden {a.hidden}, vocab {a.vocab}; B=16 (2 prompts x 8), "
        f"T<={a.new_tokens}; kl_coeff={a.kl_coeff}, entropy_coeff={a.entropy_coeff}; full logits "
        f"{full / mib:.0f} MiB"
    )
    results: dict[str, list[dict[str, object]]] = {s: [] for s in sides}
    for r in range(a.rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:
            res = child(directory, side, a)
            results[side].append(res)
            print(f"round {r} {side}: {json.dumps(res)}", flush=True)
    report(results, sides, full)
    print(f"load average: {os.getloadavg()}")


def report(results: dict[str, list[dict[str, object]]], sides: list[str], full: int) -> None:
    """The table: per side the worst extra memory, median times, ratios to ``chunked``."""

    def rows(side: str) -> list[dict[str, float]]:
        return [row for res in results[side] for row in res["rows"]]  # type: ignore[attr-defined]

    def med(side: str, key: str) -> float:
        return statistics.median(float(row[key]) for row in rows(side))

    mib = 2**20
    ref = sides[0]
    print(
        f"\n{'side':<10}{'extra MiB':>10}{'/logits':>9}{'step s':>9}{'logprobs+update s':>19}"
        f"{'first step s':>14}{'T':>6}{'mem/' + ref:>12}{'time/' + ref:>12}"
    )
    for s in sides:
        extra = max(float(row["extra"]) for row in rows(s))
        lu = med(s, "logprobs_s") + med(s, "update_s")
        first = statistics.median(float(res["first_step_s"]) for res in results[s])  # type: ignore[arg-type]
        ref_extra = max(float(row["extra"]) for row in rows(ref))
        ref_lu = med(ref, "logprobs_s") + med(ref, "update_s")
        print(
            f"{s:<10}{extra / mib:>10.0f}{extra / full:>9.1%}{med(s, 'step_s'):>9.2f}{lu:>19.2f}"
            f"{first:>14.1f}{med(s, 'T'):>6.0f}{extra / ref_extra:>12.2f}{lu / ref_lu:>12.2f}"
        )


if __name__ == "__main__":
    main()
