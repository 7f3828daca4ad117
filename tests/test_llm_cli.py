"""grpo-train: options, YAML/JSON config, checkpoints that load with from_pretrained / PeftModel."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

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


def test_lora_writes_adapter_loadable_with_peft(
    setup: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--lora with a KL term: the reference is the policy's model with its adapter disabled (no
    tensor of its own, no copy); the final model is the adapter alone, loadable with PEFT."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    import grpo.llm.cli_run as cli
    from grpo.llm import DisabledAdapterReference

    made: list[Any] = []

    class Recorded(cli.GRPOTrainer):  # type: ignore[misc,name-defined]
        """The real trainer, recorded."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(cli, "GRPOTrainer", Recorded)

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
    (trainer,) = made
    reference = trainer.reference_policy
    assert isinstance(reference, DisabledAdapterReference)
    assert reference.policy is trainer.policy
    assert reference.get_parameters() == {}  # no weights of its own
    assert not [v for v in vars(reference).values() if isinstance(v, torch.nn.Module)]  # no model copy
    final = out / "final_model"
    assert (final / "adapter_model.safetensors").exists()
    assert not (final / "model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(str(setup / "model"))
    model = peft.PeftModel.from_pretrained(base, str(final))
    assert any("lora_A" in n for n, _ in model.named_parameters())
    (logged,) = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged["optim/lr"] == pytest.approx(0.05 / 3)  # --warmup-steps 2: step 0 uses lr * 1 / 3
    assert logged["kl/ref"] >= 0.0


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
    assert (args.kl_coeff, args.temperature, args.group_size, args.output_dir) == (
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
    with pytest.raises(SystemExit):
        parse_args(["--model-name", "m", "--dataset", "d", "--logging-steps", "0"])


@pytest.mark.multiprocess
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


class FakeWandb:
    """Stands in for `grpo.metrics.sinks.WandbSink` in `grpo.llm.cli` (no W&B run is started)."""

    made: ClassVar[list[FakeWandb]] = []

    def __init__(self, **init_kwargs: Any) -> None:
        self.init_kwargs = init_kwargs
        self.config: dict[str, Any] = {}
        self.steps: list[int] = []
        self.closed = False
        FakeWandb.made.append(self)

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.config.update(config)

    def write(self, metrics: Mapping[str, float], step: int) -> None:
        self.steps.append(step)

    def close(self) -> None:
        self.closed = True


def test_logging_steps_bar_wandb_checkpoints_and_appended_metrics(
    setup: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The command runs on GRPOTrainer.train: --logging-steps 2 over 3 steps writes steps 2 and 3
    (the last) to metrics.jsonl, the log and W&B; --save-steps 2 saves checkpoint-2 with that
    step's record (the command's own keys included); the tqdm bar shows reward and tokens/s;
    metrics.jsonl is appended to by a second run."""
    import grpo.llm.cli_outputs as cli

    FakeWandb.made.clear()
    monkeypatch.setattr(cli, "WandbSink", FakeWandb)
    caplog.set_level(logging.INFO)
    out = tmp_path / "out"
    common = [
        "--model-name", str(setup / "model"), "--dataset", str(setup / "data.jsonl"), "--prompt-column", "q",
        "--batch-size", "2", "--num-generations", "2", "--max-new-tokens", "2", "--device", "cpu",
        "--output-dir", str(out),
    ]  # fmt: skip
    args = [*common, "--max-steps", "3", "--logging-steps", "2", "--save-steps", "2", "--use-wandb"]
    assert main([*args, "--wandb-run-name", "r1"]) == 0

    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [2.0, 3.0]
    for m in lines:
        assert {"optim/lr", "throughput/samples_per_s", "reward/exact_match/applicable"} <= set(m)
        assert "lr" not in m  # optim/lr (step()'s) is the learning rate
        assert m["completion/mean_length"] == pytest.approx(m["completion/tokens"] / 4)
        assert m["throughput/tokens_per_s"] == pytest.approx(m["completion/tokens"] / m["time/step"])
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == [
        "checkpoint-2",
        "checkpoints",
        "final_model",
    ]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "latest",
        "step-00000002",
        "step-00000003",
    ]
    saved = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert saved["step"] == 2
    assert saved["metrics"]["step"] == 2.0
    assert "completion/tokens" in saved["metrics"]
    final = json.loads((out / "final_model" / "trainer_state.json").read_text())
    assert final["metrics"] == lines[-1]
    assert final["args"]["logging_steps"] == 2

    (wandb,) = FakeWandb.made
    assert wandb.steps == [2, 3]
    assert wandb.closed
    assert (wandb.init_kwargs["project"], wandb.init_kwargs["name"]) == ("grpo", "r1")
    assert wandb.init_kwargs["config"]["model_name"] == str(setup / "model")
    assert wandb.config["group_size"] == 2  # the resolved GRPOConfig, from train()

    err = capsys.readouterr().err
    assert "3/3" in err
    assert "reward=" in err
    assert "tok_s=" in err
    messages = [r.getMessage() for r in caplog.records]
    steps = [m.split(":")[0] for m in messages if m.startswith("step ") and "reward/mean=" in m]
    assert steps == ["step 2", "step 3"]
    assert any(m.endswith(f"final model in {out / 'final_model'}") for m in messages)
    assert sum(m.startswith("grpo: training ") for m in messages) == 1  # the start line; the config at DEBUG

    assert main([*common, "--max-steps", "1", "--no-progress"]) == 0
    appended = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert appended == [2.0, 3.0, 1.0]


def test_max_steps_cycles_the_data_and_the_result_goes_to_stdout(
    setup: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """6 prompts at 2 a step are 3 steps an epoch: --max-steps 7 trains 7 steps over 3 epochs
    (said at the start), and stdout holds one JSON line, the result; the log goes to stderr."""
    caplog.set_level(logging.INFO)
    out = tmp_path / "out"
    argv = [
        "--model-name", str(setup / "model"), "--dataset", str(setup / "data.jsonl"), "--prompt-column", "q",
        "--batch-size", "2", "--num-generations", "2", "--max-new-tokens", "2", "--device", "cpu",
        "--output-dir", str(out), "--max-steps", "7", "--no-progress", "--logging-steps", "1",
    ]  # fmt: skip
    assert main(argv) == 0
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    captured = capsys.readouterr()
    (line,) = captured.out.splitlines()
    result = json.loads(line)
    assert result["final_model"] == str(out / "final_model")
    assert result["step"] == 7.0
    messages = [r.getMessage() for r in caplog.records]
    assert "6 prompts, 2 a step: 7 steps (3 epochs of 3 steps; --max-steps cycles the data)" in messages


@pytest.mark.slow  # two generation-worker starts
def test_async_run_with_a_worker_resumes_and_logs_its_staleness(setup: Path, tmp_path: Path) -> None:
    """`grpo-train --async 1 --engine worker`: every step after the first trains on a batch the
    previous weights sampled (async/staleness 1, importance weights reported), and --resume
    continues from the checkpoint."""
    base = [
        "--model-name", str(setup / "model"), "--dataset", str(setup / "data.jsonl"), "--prompt-column", "q",
        "--batch-size", "2", "--num-generations", "2", "--max-new-tokens", "3", "--save-steps", "2",
        "--logging-steps", "1", "--output-dir", str(tmp_path / "out"), "--device", "cpu", "--no-progress",
        "--async", "1", "--engine", "worker", "--reward", "format",
    ]  # fmt: skip
    assert main([*base, "--max-steps", "2"]) == 0
    assert main([*base, "--max-steps", "4", "--resume"]) == 0
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1.0, 2.0, 3.0, 4.0]
    assert [r["async/staleness"] for r in records] == [0.0, 1.0, 0.0, 1.0]  # the resumed run starts fresh
    assert all(0.0 < r["sampler/ess"] <= 1.0 for r in records)
