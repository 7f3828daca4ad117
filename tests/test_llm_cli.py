"""grpo-train: options, YAML/JSON config, checkpoints that load with from_pretrained / PeftModel."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from grpo.llm.cli import main, parse_args
from tests.llm_helpers import build_model, build_tokenizer


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("cli")
    tok = build_tokenizer(d / "model")
    build_model(d / "model", tok)
    with open(d / "data.jsonl", "w") as f:
        for i in range(6):
            f.write(json.dumps({"q": f"{i}+1=", "answer": str(i + 1)}) + "\n")
    return d


def test_full_finetune_writes_loadable_checkpoints(setup: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        f"model-name: {setup / 'model'}\ndataset: {setup / 'data.jsonl'}\nprompt_column: q\n"
        "batch-size: 2\nnum-generations: 3\nmax-new-tokens: 3\nlearning-rate: 0.01\n"
        "reward: [exact_match=1.0, overlong=0.1]\nkl-coef: 0.1\n"
    )
    out = tmp_path / "out"
    args = [
        "--config",
        str(cfg),
        "--output-dir",
        str(out),
        "--save-steps",
        "2",
        "--max-steps",
        "2",
        "--logging-steps",
        "1",
        "--gradient-accumulation-steps",
        "2",
        "--device",
        "cpu",
        "--no-progress",
    ]
    assert main(args) == 0
    for d in ("checkpoint-2", "final_model"):
        assert (out / d / "model.safetensors").exists()
        model = AutoModelForCausalLM.from_pretrained(str(out / d))
        AutoTokenizer.from_pretrained(str(out / d))
        assert json.loads((out / d / "trainer_state.json").read_text())["step"] == 2
    base = AutoModelForCausalLM.from_pretrained(str(setup / "model"))
    changed = any(not torch.equal(a, b) for a, b in zip(model.parameters(), base.parameters(), strict=True))
    assert changed  # the final model holds the trained weights
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1.0, 2.0]
    assert {"reward/exact_match/mean", "reward/overlong/mean", "throughput/tokens_per_s", "kl/ref"} <= set(
        lines[0]
    )


def test_lora_writes_adapter_loadable_with_peft(setup: Path, tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    cfg = tmp_path / "cfg.json"
    cfg.write_text(
        json.dumps(
            {
                "model_name": str(setup / "model"),
                "dataset": str(setup / "data.jsonl"),
                "prompt_column": "q",
                "batch_size": 3,
                "num_generations": 2,
            }
        )
    )
    out = tmp_path / "out"
    main(
        [
            "--config",
            str(cfg),
            "--output-dir",
            str(out),
            "--max-new-tokens",
            "2",
            "--max-steps",
            "1",
            "--lora",
            "--lora-r",
            "2",
            "--lora-target-modules",
            "q_proj,v_proj",
            "--learning-rate",
            "0.05",
            "--kl-coef",
            "0.1",
            "--warmup-steps",
            "2",
            "--device",
            "cpu",
            "--no-progress",
        ]
    )
    final = out / "final_model"
    assert (final / "adapter_model.safetensors").exists()
    assert not (final / "model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(str(setup / "model"))
    model = peft.PeftModel.from_pretrained(base, str(final))
    assert any("lora_A" in n for n, _ in model.named_parameters())
    (logged,) = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert 0 < logged["lr"] < 0.05  # --warmup-steps 2: still warming up after one step


def test_lora_runs_with_the_same_seed_are_identical(setup: Path, tmp_path: Path) -> None:
    """--seed fixes the adapter's random init too (LoRA A), whatever loading the model drew from
    the global RNG before it: two runs give bitwise the same adapter."""
    from safetensors.torch import load_file

    finals = []
    for run in ("a", "b"):
        torch.manual_seed(len(run) * 1000 + ord(run))  # a different global RNG state before each run
        args = [
            "--model-name", str(setup / "model"), "--dataset", str(setup / "data.jsonl"),
            "--prompt-column", "q", "--batch-size", "2", "--num-generations", "2", "--max-new-tokens", "2",
            "--max-steps", "1", "--lora", "--lora-r", "2", "--seed", "5", "--output-dir", str(tmp_path / run),
            "--device", "cpu", "--no-progress",
        ]  # fmt: skip
        assert main(args) == 0
        finals.append(load_file(tmp_path / run / "final_model" / "adapter_model.safetensors"))
    assert finals[0].keys() == finals[1].keys()
    for k in finals[0]:
        assert torch.equal(finals[0][k], finals[1][k]), k


def test_cli_options_and_errors(setup: Path, tmp_path: Path) -> None:
    args = parse_args(["--model-name", "m", "--dataset", "d.jsonl", "--kl-coef", "0", "--temperature", "0.9"])
    assert (args.kl_coef, args.temperature, args.num_generations, args.output_dir) == (
        0.0,
        0.9,
        4,
        "./grpo_checkpoints",
    )
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model_name": "m", "dataset": "d", "learnin_rate": 1}))
    with pytest.raises(SystemExit, match="unknown option"):
        parse_args(["--config", str(bad)])
    with pytest.raises(SystemExit):
        parse_args(
            ["--model-name", "m", "--dataset", "d", "--batch-size", "4", "--gradient-accumulation-steps", "3"]
        )


def test_two_processes_shard_the_prompts_and_rank_0_writes(setup: Path, tmp_path: Path) -> None:
    """Under torchrun-style launch (2 CPU processes, gloo) each step draws 2 x batch-size prompts,
    each rank trains on its own half, and only rank 0 writes metrics and checkpoints."""
    from tests.distributed_toys import launch
    from tests.llm_distributed_toys import cli_worker

    with open(tmp_path / "data.jsonl", "w") as f:
        for i in range(9):  # 2 full global batches of 4; the 9th prompt is left out on 2 ranks
            f.write(json.dumps({"q": f"{i}+1="}) + "\n")
    toys = Path(__file__).with_name("llm_distributed_toys.py")
    args = [
        "--model-name", str(setup / "model"), "--dataset", str(tmp_path / "data.jsonl"),
        "--prompt-column", "q", "--batch-size", "2", "--num-generations", "2", "--max-new-tokens", "2",
        "--reward", f"{toys}:record_prompts", "--output-dir", str(tmp_path / "run"), "--save-steps", "1",
        "--logging-steps", "1", "--device", "cpu", "--no-progress", "--seed", "3",
    ]  # fmt: skip
    (tmp_path / "args.json").write_text(json.dumps(args))
    launch(cli_worker, tmp_path, world=2, timeout=240.0)

    seen = [
        [json.loads(line) for line in (tmp_path / f"prompts-rank{r}.jsonl").read_text().splitlines()]
        for r in (0, 1)
    ]
    assert len(seen[0]) == len(seen[1]) == 2  # the same number of steps on both ranks
    for step in range(2):
        a, b = set(seen[0][step]), set(seen[1][step])
        assert len(a) == len(b) == 2
        assert not a & b
    assert len({p for s in seen for step in s for p in step}) == 8
    run = tmp_path / "run"
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1.0, 2.0]  # written once, by rank 0
    for d in ("checkpoint-1", "checkpoint-2", "final_model"):
        assert (run / d / "model.safetensors").exists()
