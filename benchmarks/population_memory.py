"""Memory of a LoRA population: 4 members over one frozen base model against 4 members with a
model each, measured as the peak resident memory of a process that builds the population and runs
one generation.

Each side runs in a fresh interpreter (``--side shared`` / ``--side separate``), the two sides
alternating over ``--rounds``. A side's figure is its peak RSS (``VmHWM``, reset once the imports
are done) minus the RSS before the first model is loaded (torch, transformers, peft and the
tokenizer already imported),
so it counts the models, the adapters, the optimizer states, the stored adapter copies and one
generation's activations. Also printed: the parameter bytes over distinct storages
(`grpo.population.parameter_bytes`), the count the RSS should follow.

Model (random weights, saved and loaded with ``from_pretrained``): ``small`` is a Llama of hidden
512, 8 layers, 8 heads, 32,000-token vocabulary (~50M parameters, ~200 MB in float32); ``tiny`` is
the tests' (hidden 32, 2 layers); ``qwen2-0.5b`` has Qwen2-0.5B's architecture (494M parameters,
~1.9 GiB in float32; the separate side holds 4 of them, ~8 GiB). LoRA r = 8 on q/v, B = 2
prompts x G = 2 completions of up to 8 tokens, one trainer step per generation, one generation.

    python benchmarks/population_memory.py                 # small, 2 rounds
    python benchmarks/population_memory.py --model tiny --rounds 1
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SIZE = 4
PROMPTS = ["1+2=", "ab", "xyz", "hi"]
MODELS: dict[str, dict[str, Any]] = {
    "small": {"hidden": 512, "layers": 8, "heads": 8, "vocab_size": 32_000},
    "tiny": {"hidden": 32, "layers": 2, "heads": 4},
    "qwen2-0.5b": {
        "arch": "qwen2", "hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2,
        "intermediate": 4864, "vocab_size": 151_936,
    },
}  # fmt: skip


def _status_mib(field: str) -> float:
    """``VmRSS`` (resident now) or ``VmHWM`` (its peak) of this process, from /proc (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field} (this benchmark needs Linux)")


def _reset_peak() -> None:
    """Set the peak (VmHWM) to the resident memory now (Linux >= 4.0: ``clear_refs`` 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def side(kind: str, model_dir: Path, tok_dir: Path) -> dict[str, Any]:
    """Build the population one way, run one generation, report the memory."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo import GRPOConfig, GRPOTrainer
    from grpo.llm import CausalLMPolicy, RewardFunctions, SamplingSettings
    from grpo.population import HyperparameterConfig, RLParameter, parameter_bytes, population

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    before = _status_mib("VmRSS")  # imports and tokenizer
    _reset_peak()  # the imports' own peak must not hide what follows

    def lora_model() -> Any:
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        torch.manual_seed(0)
        cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        return peft.get_peft_model(base, cfg)

    one = lora_model() if kind == "shared" else None

    def make(hp: dict[str, float]) -> GRPOTrainer:
        policy = CausalLMPolicy(
            one if one is not None else lora_model(), tok, SamplingSettings(max_new_tokens=8)
        )
        cfg = GRPOConfig(
            device="cpu", group_size=2, batch_size=2, learning_rate=hp["learning_rate"], seed=0,
            distributed="off",
        )  # fmt: skip
        return GRPOTrainer(cfg, policy, RewardFunctions(lambda p, c: [float(len(x)) for x in c]))

    hpc = HyperparameterConfig(learning_rate=RLParameter(min=1e-4, max=1e-1))
    starts = [{"learning_rate": lr} for lr in (1e-3, 3e-3, 1e-2, 3e-2)]
    pop = population(SIZE, make, hpc, hyperparameters=starts, eval_states=PROMPTS[:2], seed=0)
    pop.evolve(1, PROMPTS, 1)
    models = [m.require_trainer().policy.model for m in pop.members]  # type: ignore[attr-defined]
    extra = [t for slot in pop.shared.slots.values() for t in slot] if pop.shared is not None else []
    return {
        "side": kind,
        "peak_mib": _status_mib("VmHWM") - before,
        "parameter_bytes": parameter_bytes(models, extra),
        "models": len({id(m) for m in models}),
    }


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--model", choices=list(MODELS), default="small")
    parser.add_argument("--rounds", type=int, default=2, help="each round runs both sides, alternating")
    parser.add_argument("--side", choices=["shared", "separate"], help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.side is not None:  # a child: one side, JSON on stdout
        print(json.dumps(side(args.side, args.dir / "model", args.dir / "tok")))
        return {}

    from grpo.llm.tiny import build_tiny_model, build_tiny_tokenizer

    out: dict[str, list[float]] = {"shared": [], "separate": []}
    with tempfile.TemporaryDirectory(prefix="grpo_pop_mem_") as d:
        tok = build_tiny_tokenizer(Path(d) / "tok", pad_is_eos=True)
        spec = {"arch": "llama", **MODELS[args.model]}
        build_tiny_model(Path(d) / "model", tok, seed=0, **spec)
        print(f"LoRA population of {SIZE}, model {args.model}: peak RSS over the imports (MiB)")
        print("| round | side | peak MiB | parameter bytes | models held |")
        print("| --- | --- | ---: | ---: | ---: |")
        for r in range(args.rounds):
            order = ["shared", "separate"] if r % 2 == 0 else ["separate", "shared"]
            for kind in order:
                cmd = [sys.executable, __file__, "--side", kind, "--dir", d]
                res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
                out[kind].append(res["peak_mib"])
                row = (
                    f"| {r} | {kind} | {res['peak_mib']:.0f} | {res['parameter_bytes']:,} | {res['models']} |"
                )
                print(row, flush=True)
    shared, separate = statistics.median(out["shared"]), statistics.median(out["separate"])
    print(f"\nmedian peak: shared {shared:.0f} MiB, separate {separate:.0f} MiB ({shared / separate:.2f}x)")
    return out


if __name__ == "__main__":
    main()
