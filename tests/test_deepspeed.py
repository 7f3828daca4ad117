"""DeepSpeed ZeRO-1/2 (`grpo.engine.deepspeed`): 2 CPU processes (gloo) with DeepSpeed against one
process without it on the same global batch; config handling; `grpo-train` under the variables
``accelerate launch`` exports for a DeepSpeed config."""

from __future__ import annotations

import functools
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("deepspeed")

from grpo import GRPOConfig
from grpo.engine.deepspeed import (
    DeepSpeedBackend,
    deepspeed_config_from,
    is_partitioned,
    prepare_deepspeed_config,
    training_module,
)
from tests.deepspeed_toys import (
    DS_SCENARIOS,
    ZERO_CONFIGS,
    ds_worker,
    launch,
    run_command,
    stale_lock_problem,
)
from tests.distributed_toys import LOCAL_B, STEPS, build, data, params, run_steps

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2


@pytest.fixture(scope="module", autouse=True)
def no_stale_build_lock() -> None:
    """Before any DeepSpeed op is built or loaded: a lock file a killed build left in the
    extensions directory (tests/conftest.py) would make every test below wait until its timeout;
    fail at once, naming the file and the `rm` that removes it."""
    problem = stale_lock_problem()
    if problem is not None:
        pytest.fail(problem, pytrace=False)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("deepspeed")
    ref: dict[str, Any] = {}
    for name in DS_SCENARIOS:
        tr = build(name, WORLD * LOCAL_B)
        d = data(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            metrics = run_steps(tr, d, slice(None), range(STEPS))
        ref[name] = {"params": params(tr), "metrics": metrics, "non_finite": tr.non_finite_steps}
    launch(ds_worker, out, world=WORLD, timeout=420.0)  # the first run JIT-builds DeepSpeed's CPU ops
    ranks = [torch.load(out / f"ds-rank{r}.pt", weights_only=True) for r in range(WORLD)]
    return {"ref": ref, "ranks": ranks, "out": out}


@pytest.mark.multiprocess
@pytest.mark.parametrize("label", list(ZERO_CONFIGS))
@pytest.mark.parametrize("name", DS_SCENARIOS)
def test_zero_on_two_processes_equals_one_process_without_deepspeed(
    run: dict[str, Any], name: str, label: str
) -> None:
    """bandit_deferred: 2 micro-batches (mask recorded at collection); bandit_zero_var: 2 epochs,
    KL, all-zero-variance groups on rank 1; bandit_poison: a NaN loss on rank 1 at step 2, skipped
    on every rank; seq_*: token-mean over lengths that differ 3x between the ranks. zero2-offload
    steps the CPU-offloaded optimizer state with DeepSpeedCPUAdam instead of torch's AdamW;
    zero3 partitions every weight; zero3-offload also keeps the weights' partitions on the CPU."""
    ref = run["ref"][name]
    for rank in range(WORLD):
        got = run["ranks"][rank][f"{name}/{label}"]
        assert got["optimizer"] == ("DeepSpeedCPUAdam" if label.endswith("offload") else "AdamW")
        assert got["params"].keys() == ref["params"].keys()
        # DeepSpeedCPUAdam is AdamW's formula in vectorised C++: float32 rounding differs
        atol = 1e-5 if label.endswith("offload") else 1e-6
        for k, v in ref["params"].items():
            err = (got["params"][k] - v).abs().max().item()
            assert err <= atol, f"rank {rank} {k}: max |diff| = {err:.3g}"
        assert got["non_finite"] == ref["non_finite"]
        for a, b in zip(got["metrics"], ref["metrics"], strict=True):
            assert a["reward/mean"] == pytest.approx(b["reward/mean"], abs=1e-6)
            assert a["optim/non_finite_steps"] == b["optim/non_finite_steps"]
            if math_finite(b["loss/total"]):
                assert a["loss/total"] == pytest.approx(b["loss/total"], abs=1e-5)
                assert a["grad/norm"] == pytest.approx(b["grad/norm"], rel=1e-4, abs=1e-6)
    assert ref["non_finite"] == (1 if name == "bandit_poison" else 0)


@pytest.mark.multiprocess
def test_zero3_refuses_different_numbers_of_states_on_every_rank(run: dict[str, Any]) -> None:
    """Under ZeRO-3 every forward all-gathers weights, so a rank with fewer states would leave the
    others waiting forever: both ranks raise a ValueError naming the counts, before any forward,
    and the weights are unchanged (`zero3_uneven_worker`, run by the `run` fixture's processes
    after the matrix)."""
    for rank in range(WORLD):
        got = torch.load(run["out"] / f"uneven-rank{rank}.pt", weights_only=True)
        assert "different numbers of states this step (per rank: [4, 3])" in got["message"]
        assert "ZeRO-3" in got["message"]
        assert "grpo.engine.distributed.shard" in got["message"]
        assert got["unchanged"]


def math_finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


@pytest.fixture
def own_process_group(monkeypatch: pytest.MonkeyPatch) -> Any:
    """For a one-process DeepSpeed trainer: it makes a 1-process group and sets LOCAL_RANK=0;
    both are undone afterwards so later tests see a plain process.

    On one process DeepSpeed's shared-memory all-reduce (``deepspeed_shm_comm``, a C++ op it
    JIT-builds on first use: ~40 s on 2 cores) would reduce over a single rank, so these tests
    mark it unavailable, as DeepSpeed itself does off Linux: the real engine then reduces through
    torch.distributed (gloo) and nothing is built. The 2-process tests (``multiprocess``) use it."""
    import deepspeed.ops

    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, "deepspeed_shm_comm", False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert not torch.distributed.is_initialized()
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        # DeepSpeed keeps a clone of the world group; a later group in this process needs a new one
        import deepspeed.utils.groups

        deepspeed.utils.groups._WORLD_GROUP = None
    os.environ.pop("LOCAL_RANK", None)


@pytest.mark.usefixtures("own_process_group")
@pytest.mark.parametrize("stage", [2, 3])
def test_one_process_with_deepspeed_equals_one_without(tmp_path: Path, stage: int) -> None:
    """With a KL term whose reference is refreshed from the policy every 2 steps (under ZeRO-3
    both are partitioned and the copy goes module by module)."""
    cfg = tmp_path / f"zero{stage}.json"
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # every weight partitioned
    cfg.write_text(json.dumps({"zero_optimization": zero}))
    d = data("seq_known", 1)
    kl = {"kl_coeff": 0.2, "reference_update_freq": 2}
    ref = build("seq_known", LOCAL_B, **kl)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = build("seq_known", LOCAL_B, deepspeed=str(cfg), **kl)
        for s in range(STEPS):
            ref.step(d["states"][s], noise=d["noise"][s])
            tr.step(d["states"][s], noise=d["noise"][s])
    assert isinstance(tr.backend, DeepSpeedBackend)
    assert ref.reference_policy is not None
    assert tr.reference_policy is not None
    with tr.gathered_weights():
        b = params(tr)
    a = params(ref)
    for k in a:
        assert (a[k] - b[k]).abs().max().item() <= 1e-6
    # the reference holds the weights of step 4 (refreshed at steps 2 and 4), not step 5's
    # under ZeRO-3 the reference copy is partitioned too (1/W of a model per process)
    assert is_partitioned(training_module(tr.reference_policy)) is (stage == 3)
    ref_a = dict(ref.reference_policy.get_parameters())
    with tr.gathered_weights():
        ref_b = {k: v.detach().clone() for k, v in tr.reference_policy.get_parameters().items()}
    for k in ref_a:
        assert (ref_a[k] - ref_b[k]).abs().max().item() <= 1e-6
        assert (ref_a[k] - a[k]).abs().max().item() > 1e-4
    assert tr.backend.stage == stage
    assert not isinstance(ref.backend, DeepSpeedBackend)
    with pytest.raises(NotImplementedError, match="partitioned over the processes"):
        tr.save_checkpoint(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
    # train() refuses checkpointing before it takes a step
    with tr.gathered_weights():
        before = params(tr)
    states = d["states"][0]
    for kwargs in ({"checkpoint_dir": tmp_path / "ckpt"}, {"resume_from": tmp_path / "ckpt"}):
        with pytest.raises(NotImplementedError, match=f"DeepSpeed ZeRO-{stage} does not support"):
            tr.train([states] * 4, num_steps=2, progress=False, **kwargs)
    with tr.gathered_weights():
        after = params(tr)
    for k in before:
        assert torch.equal(before[k], after[k])


@pytest.mark.usefixtures("own_process_group")
def test_a_policy_partitioned_by_an_earlier_trainer_cannot_be_copied_for_the_reference(
    tmp_path: Path,
) -> None:
    """A second trainer on a policy that a ZeRO-3 trainer already partitioned (e.g. rebuilt in a
    notebook) trains without a KL term, and with one refuses clearly instead of copying empty
    partitions into the reference."""
    from grpo import GRPOConfig, GRPOTrainer
    from grpo.policies import categorical_mlp

    cfg = tmp_path / "zero3.json"
    cfg.write_text(json.dumps(ZERO_CONFIGS["zero3"]))
    policy = categorical_mlp(4, 3, (8,))

    def reward(states: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return (actions == 0).float()

    def trainer(kl: float) -> GRPOTrainer:
        config = GRPOConfig(group_size=4, batch_size=2, deepspeed=str(cfg), kl_coeff=kl)
        return GRPOTrainer(config, policy, reward)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(0.1).step(torch.randn(2, 4))
        assert math_finite(trainer(0.0).step(torch.randn(2, 4))["loss/total"])
        with pytest.raises(ValueError, match="already partitioned by DeepSpeed ZeRO-3"):
            trainer(0.1)


@pytest.mark.usefixtures("own_process_group")
@pytest.mark.parametrize("kl", [0.0, 0.1])
def test_close_frees_the_engines_before_the_interpreter_exits(tmp_path: Path, kl: float) -> None:
    """`GRPOTrainer.close` (called by `grpo.engine.distributed.shutdown`) leaves nothing of a ZeRO-3 run
    referenced from DeepSpeed's module globals: once the script drops the trainer and the policy,
    the engines (policy and partitioned reference) are freed, so no process group is left for
    interpreter finalisation to tear down (where gloo can abort the process); `shutdown` then
    destroys the group. Without close, DeepSpeed's forward stack keeps the policy alive forever."""
    import gc
    import weakref

    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.utils import groups

    from grpo import GRPOTrainer
    from grpo.engine.distributed import shutdown
    from grpo.policies import categorical_mlp

    cfg = tmp_path / "zero3.json"
    cfg.write_text(json.dumps(ZERO_CONFIGS["zero3"]))
    policy = categorical_mlp(4, 3, (8,))
    config = GRPOConfig(group_size=4, batch_size=2, deepspeed=str(cfg), kl_coeff=kl)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(config, policy, lambda s, a: (a == 0).float())
        trainer.step(torch.randn(2, 4))
    assert isinstance(trainer.backend, DeepSpeedBackend)
    engines = [weakref.ref(e) for e in (trainer.backend.engine, trainer.backend.reference_engine) if e]
    assert len(engines) == (2 if kl else 1)
    assert any(m is policy for m in parameter_offload.FWD_MODULE_STACK)  # DeepSpeed's own hold
    shutdown(trainer)
    assert not any(m is policy for m in parameter_offload.FWD_MODULE_STACK)
    assert groups._WORLD_GROUP is None
    assert not torch.distributed.is_initialized()
    trainer.close()  # twice: a no-op
    with pytest.raises(
        RuntimeError, match=r"this trainer was closed \(close / grpo.engine.distributed.shutdown\)"
    ):
        trainer.step(torch.randn(2, 4))
    del trainer, policy  # the script's own references (ZeRO-3 parameters reference the engine)
    gc.collect()
    assert [e() for e in engines] == [None] * len(engines)


@pytest.mark.multiprocess
@pytest.mark.parametrize("zero3", [False, True])
def test_shutdown_leaves_no_gloo_thread_for_interpreter_exit(tmp_path: Path, zero3: bool) -> None:
    """2 processes: after `grpo.engine.distributed.shutdown(trainer)` and the script's last references,
    every gloo thread is gone (the process group was freed while Python still ran). Before, a
    DeepSpeed import or an optimizer built after the group (torch._dynamo) kept it alive, and
    gloo aborted ~1 in 3 runs of the ZeRO-3 example at exit."""
    if not Path("/proc/self/task").exists():
        pytest.skip("needs /proc to list a process's threads")
    from tests.deepspeed_toys import shutdown_worker

    if zero3:
        (tmp_path / "zero3.json").write_text(json.dumps(ZERO_CONFIGS["zero3"]))
    launch(shutdown_worker, tmp_path, world=WORLD, timeout=300.0)
    for rank in range(WORLD):
        report = json.loads((tmp_path / f"threads-rank{rank}.json").read_text())
        assert not report["initialised"]
        assert [t for t in report["threads"] if "gloo" in t] == [], report["threads"]


def test_the_head_run_as_forward_leaves_the_modules_own_forward_in_place() -> None:
    """The ZeRO-3 head call replaces the module's forward for one call only, restoring an
    instance-level forward another library installed (accelerate's hooks do that)."""
    from grpo.engine.fsdp import run_as_forward

    def double(h: torch.Tensor) -> tuple[torch.Tensor, None]:
        return h * 2, None

    plain = torch.nn.Linear(2, 2)
    out, _ = run_as_forward(plain, double, torch.ones(1, 2))
    assert out.tolist() == [[2.0, 2.0]]
    assert "forward" not in plain.__dict__
    hooked = torch.nn.Linear(2, 2)
    own = hooked.forward
    hooked.forward = own  # an instance attribute, as accelerate's add_hook_to_module sets
    run_as_forward(hooked, double, torch.ones(1, 2))
    assert hooked.__dict__["forward"] is own


# ---- configuration ------------------------------------------------------------------------------
def test_prepare_fills_the_trainers_settings_and_leaves_the_input_alone() -> None:
    shipped = json.loads((ROOT / "examples/configs/deepspeed_zero2.json").read_text())
    before = json.dumps(shipped)
    cfg = prepare_deepspeed_config(shipped, max_grad_norm=0.5, world_size=4)
    assert json.dumps(shipped) == before
    assert cfg["gradient_clipping"] == 0.5
    assert cfg["gradient_accumulation_steps"] == 1
    assert cfg["train_micro_batch_size_per_gpu"] == 1
    assert cfg["train_batch_size"] == 4
    assert "reduce_bucket_size" not in cfg["zero_optimization"]  # "auto": DeepSpeed's default
    assert cfg["zero_optimization"]["stage"] == 2
    assert cfg["bf16"]["enabled"] is False
    assert cfg["fp16"]["enabled"] is False
    assert (
        prepare_deepspeed_config({"zero_optimization": {"stage": 1}}, max_grad_norm=None, world_size=1)[
            "gradient_clipping"
        ]
        == 0.0
    )


def test_auto_bucket_sizes_follow_the_hidden_size_as_accelerate_sets_them() -> None:
    """The shipped ZeRO-3 config's "auto" sizes: H², 0.9·H², 10·H for hidden size H (accelerate's
    rule), DeepSpeed's defaults when H is unknown (no Hugging Face config)."""
    from types import SimpleNamespace

    from grpo.engine.deepspeed import model_hidden_size

    shipped = json.loads((ROOT / "examples/configs/deepspeed_zero3.json").read_text())
    cfg = prepare_deepspeed_config(shipped, max_grad_norm=1.0, world_size=2, hidden_size=64)
    zero = cfg["zero_optimization"]
    assert zero["reduce_bucket_size"] == 4096
    assert zero["stage3_prefetch_bucket_size"] == 3686  # int(0.9 * 64 * 64)
    assert zero["stage3_param_persistence_threshold"] == 640
    assert zero["stage3_max_live_parameters"] == 1e9  # numbers are kept
    unknown = prepare_deepspeed_config(shipped, max_grad_norm=1.0, world_size=2)["zero_optimization"]
    assert not {"reduce_bucket_size", "stage3_prefetch_bucket_size"} & set(unknown)
    module = torch.nn.Linear(2, 2)
    assert model_hidden_size(module) is None
    module.config = SimpleNamespace(hidden_size=96)  # type: ignore[assignment]
    assert model_hidden_size(module) == 96
    module.config = SimpleNamespace(hidden_sizes=[32, 128, 64])  # type: ignore[assignment]
    assert model_hidden_size(module) == 128


def test_bf16_from_accelerate_turns_on_the_overflow_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    cfg = prepare_deepspeed_config(
        {"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}}, max_grad_norm=1.0, world_size=2
    )
    assert cfg["bf16"] == {"enabled": True, "check_grad_overflow": True}


@pytest.mark.parametrize(
    ("raw", "error", "match"),
    [
        ({"zero_optimization": {"stage": 4}}, ValueError, "stage=4; GRPOTrainer supports stages 1, 2 and 3"),
        ({"zero_optimization": {"stage": 0}}, ValueError, "stage=0"),
        ({}, ValueError, "stage=0"),
        ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "Adam"}}, ValueError, "'optimizer'"),
        ({"zero_optimization": {"stage": 2}, "scheduler": {}}, ValueError, "'scheduler'"),
        ({"zero_optimization": {"stage": 2}, "gradient_clipping": 2.0}, ValueError, "max_grad_norm is 1.0"),
        ({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4}, ValueError, "micro_batch"),
    ],
)
def test_prepare_refuses_what_the_trainer_cannot_honour(
    raw: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        prepare_deepspeed_config(raw, max_grad_norm=1.0, world_size=2)


def test_config_source_follows_accelerate_launch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_CONFIG_FILE"):
        monkeypatch.delenv(var, raising=False)
    assert deepspeed_config_from("auto") is None  # not launched with DeepSpeed
    assert deepspeed_config_from("off") is None
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "1")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "cpu")
    monkeypatch.setenv("ACCELERATE_GRADIENT_CLIPPING", "0.5")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    built = deepspeed_config_from("auto")
    assert built == {
        "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "gradient_clipping": 0.5,
    }
    prepared = prepare_deepspeed_config(built, max_grad_norm=0.5, world_size=2)
    assert prepared["bf16"] == {"enabled": True, "check_grad_overflow": True}  # accelerate's bf16
    assert prepared["fp16"] == {"enabled": False}
    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(f))
    assert deepspeed_config_from("auto") == {"zero_optimization": {"stage": 2}}
    assert deepspeed_config_from("off") is None  # off wins over the launcher
    with pytest.raises(FileNotFoundError, match=r"missing\.json"):
        deepspeed_config_from(str(tmp_path / "missing.json"))
    f.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        deepspeed_config_from(str(f))


def test_a_policy_that_is_not_a_module_needs_training_module() -> None:
    from tests.conftest import WordPolicy

    with pytest.raises(TypeError, match="training_module"):
        training_module(WordPolicy())
    with pytest.raises(ValueError, match=r"GRPOConfig\.deepspeed=''"):
        GRPOConfig(deepspeed="")


# ---- the LLM path -------------------------------------------------------------------------------
def tiny_model_and_prompts(directory: Path, n: int, arch: str = "llama") -> None:
    """A tiny causal LM + tokenizer saved to ``directory/model`` and ``n`` prompts in
    ``directory/data.jsonl`` (column ``q``). ``arch="qwen2"`` ties the LM head to the embeddings."""
    pytest.importorskip("transformers")
    from tests.llm_helpers import build_model, build_tokenizer

    build_model(directory / "model", build_tokenizer(directory / "model"), arch=arch)
    with open(directory / "data.jsonl", "w") as f:
        for i in range(n):
            f.write(json.dumps({"q": f"{i}+1="}) + "\n")


_LORA_FLAGS = ["--lora", "--gradient-checkpointing", "--gradient-accumulation-steps", "2"]


# full fine-tuning under ZeRO-2 and LoRA under ZeRO-3 in `multiprocess`; the other two in `slow`
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("extra", "stage"),
    [
        pytest.param([], 2, id="full-2"),
        pytest.param([], 3, id="full-3", marks=pytest.mark.slow),
        pytest.param(_LORA_FLAGS, 2, id="lora-2", marks=pytest.mark.slow),
        pytest.param(_LORA_FLAGS, 3, id="lora-3"),
    ],
)
def test_grpo_train_under_accelerate_deepspeed(tmp_path: Path, extra: list[str], stage: int) -> None:
    """Two processes with the variables `accelerate launch --config_file
    examples/configs/accelerate_zero{2,3}.yaml` exports: the trainer runs that ZeRO stage on every
    rank (ZeRO-3: every weight partitioned, a Qwen2-style model with a tied LM head), rank 0 writes
    checkpoints, and the trained weights equal a run without DeepSpeed (same seed, same prompts).
    Full fine-tuning with a KL term (a frozen reference copy; --kl-coef defaults to 0.04), and
    LoRA (reference = adapter disabled) with gradient checkpointing and 2 micro-batches per
    optimizer step."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from tests.llm_distributed_toys import deepspeed_cli_worker

    tiny_model_and_prompts(tmp_path, 8, arch="qwen2" if stage == 3 else "llama")
    toys = Path(__file__).with_name("llm_distributed_toys.py")
    config = ROOT / f"examples/configs/deepspeed_zero{stage}.json"
    if stage == 3:  # the shipped config, with every weight partitioned (none kept whole for size)
        cfg = json.loads(config.read_text())
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        config = tmp_path / "zero3.json"
        config.write_text(json.dumps(cfg))
    finals = {}
    for mode in ("deepspeed", "off"):
        out = tmp_path / mode
        out.mkdir()
        args = [
            "--model-name", str(tmp_path / "model"), "--dataset", str(tmp_path / "data.jsonl"),
            "--prompt-column", "q", "--batch-size", "2", "--num-generations", "2", "--max-new-tokens", "3",
            "--reward", f"{toys}:char_score", "--output-dir", str(out / "run"), "--save-steps", "1",
            "--logging-steps", "1", "--device", "cpu", "--no-progress", "--seed", "3",
            "--learning-rate", "0.01", *extra,
        ]  # fmt: skip
        (out / "args.json").write_text(json.dumps(args))
        env = {
            "ACCELERATE_USE_DEEPSPEED": "true" if mode == "deepspeed" else "false",
            "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(config),
            "ACCELERATE_MIXED_PRECISION": "no",
        }
        (out / "accelerate_env.json").write_text(json.dumps(env))
        launch(deepspeed_cli_worker, out, world=WORLD, timeout=420.0)
        ran = [json.loads((out / f"stage-rank{r}.json").read_text()) for r in range(WORLD)]
        on = mode == "deepspeed"
        assert [r["stage"] for r in ran] == ([stage] * WORLD if on else [None] * WORLD)
        assert [r["partitioned"] for r in ran] == [on and stage == 3] * WORLD
        want_ref = None if extra else on and stage == 3  # LoRA: no copy (the adapter disabled)
        assert [r["reference_partitioned"] for r in ran] == [want_ref] * WORLD
        weights = "adapter_model.safetensors" if extra else "model.safetensors"
        run_dir = out / "run"
        for d in ("checkpoint-1", "checkpoint-2", "final_model"):
            assert (run_dir / d / weights).exists()
        finals[mode] = load_file(run_dir / "final_model" / weights)
    initial = {} if extra else load_file(tmp_path / "model" / "model.safetensors")
    assert finals["off"].keys() == finals["deepspeed"].keys()
    moved = 0.0
    for k, v in finals["off"].items():
        # Adam's step lr * m / (sqrt(v) + eps) amplifies the rounding noise of the gradient
        # reduction (summed in another order by DeepSpeed) for an entry whose gradient is ~eps:
        # such rare entries move by up to 1e-4 (1% of one step at lr=0.01). A key bias's true
        # gradient is exactly 0 (it shifts all scores of a query equally), so all of it is noise.
        diff = (finals["deepspeed"][k] - v).abs()
        assert diff.max().item() <= 1e-4, k
        if not k.endswith("k_proj.bias"):
            assert (diff > 1e-6).float().mean().item() <= 0.01, k
        start = initial.get(k, torch.zeros_like(v) if "lora_B" in k else v)  # LoRA B starts at 0
        moved = max(moved, (v - start).abs().max().item())
    assert moved > 1e-4  # training changed the weights (the comparison is not of two untouched models)


@pytest.mark.multiprocess
def test_zero3_llm_policy_generation_in_step_and_gathered_save(tmp_path: Path) -> None:
    """ZeRO-3, every weight partitioned, Qwen2-style model (LM head tied to the embeddings),
    chunked log-prob head: rank 0 generates at most 2 tokens and rank 1 up to 6, as when one
    rank's completions all stop early. Every forward all-gathers weights, so without keeping the
    ranks in step (synced_gpus) rank 1 would wait forever; the run completes instead. The saved
    model (written by rank 0, gathered module by module) holds exactly the gathered weights, keeps
    the tie, and loads."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from tests.llm_distributed_toys import zero3_policy_worker

    tiny_model_and_prompts(tmp_path, 0, arch="qwen2")
    cfg = json.loads(json.dumps(ZERO_CONFIGS["zero3"]))
    (tmp_path / "zero3.json").write_text(json.dumps(cfg))
    launch(zero3_policy_worker, tmp_path, world=WORLD, timeout=300.0)
    ran = [json.loads((tmp_path / f"zero3-rank{r}.json").read_text()) for r in range(WORLD)]
    assert [r["partitioned"] for r in ran] == [True, True]
    assert max(ran[0]["completion_tokens"]) <= 2 * 4  # 2 prompts x 2 completions x <= 2 tokens
    assert max(ran[1]["completion_tokens"]) > 2 * 4  # rank 1 generated longer completions
    assert all(0.0 <= r["eval_reward"] <= 6.0 for r in ran)  # evaluate() completed on both
    gathered = torch.load(tmp_path / "gathered.pt", weights_only=True)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
    assert saved.lm_head.weight.data_ptr() == saved.model.embed_tokens.weight.data_ptr()
    state = saved.state_dict()
    moved = 0.0
    for k, v in initial.state_dict().items():
        assert torch.equal(state[k], gathered[k]), k
        moved = max(moved, (state[k] - v).abs().max().item())
    assert moved > 1e-4  # trained weights, not the initial ones


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=pytest.mark.slow)])  # ZeRO-3 in `slow`
def test_accelerate_launch_with_the_shipped_config(tmp_path: Path, stage: int) -> None:
    """The documented command, for real: `accelerate launch --config_file
    examples/configs/accelerate_zero{2,3}.yaml --num_processes 2 --mixed_precision bf16 -m
    grpo.llm ...` from the repository root, on 2 CPU processes. The trainer reports the ZeRO stage
    on 2 processes with bf16 (the config's "auto" follows accelerate's mixed precision); rank 0
    writes a final model, in bf16 as DeepSpeed keeps it, that loads with from_pretrained."""
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    import sys

    from transformers import AutoModelForCausalLM

    tiny_model_and_prompts(tmp_path, 4)
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", f"examples/configs/accelerate_zero{stage}.yaml", "--num_processes", "2",
        "--mixed_precision", "bf16",
        "-m", "grpo.llm", "--model-name", str(tmp_path / "model"), "--dataset", str(tmp_path / "data.jsonl"),
        "--prompt-column", "q", "--batch-size", "2", "--num-generations", "2", "--max-new-tokens", "3",
        "--reward", "tests/llm_distributed_toys.py:char_score", "--output-dir", str(tmp_path / "run"),
        "--device", "cpu", "--no-progress",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = run_command(cmd, cwd=ROOT, env=env, timeout=420)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"DeepSpeed ZeRO-{stage} on 2 process(es)" in proc.stderr
    assert proc.stderr.count("grpo.llm: done: ") == 1  # rank 0 alone logs
    assert "bf16=True" in proc.stderr
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final_model", dtype="auto")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert all(bool(p.isfinite().all()) and p.abs().max() > 0 for p in model.parameters())


@functools.cache
def torchrun_bandit_curve(deepspeed: str) -> tuple[str, ...]:
    """The printed learning curve (the "step" lines) of `torchrun --nproc_per_node=2
    examples/distributed_bandit.py --steps 40 --log-every 13 --deepspeed DEEPSPEED`, run once
    per module ("off", the trainer's own gradient sync, is the reference of both ZeRO stages)."""
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "examples/distributed_bandit.py", "--steps", "40", "--log-every", "13", "--deepspeed", deepspeed,
    ]  # fmt: skip
    proc = run_command(cmd, timeout=300, env=env, cwd=ROOT)
    if proc.returncode != 0 and "terminate called without an active exception" in proc.stderr:
        proc = run_command(cmd, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if deepspeed == "off":
        assert "deepspeed=off" in proc.stdout
    else:
        stage = json.loads((ROOT / deepspeed).read_text())["zero_optimization"]["stage"]
        assert f"deepspeed=ZeRO-{stage}" in proc.stdout
    return tuple(ln for ln in proc.stdout.splitlines() if ln.startswith("step"))


@pytest.mark.slow  # ~16 s a stage; the two-process ZeRO equalities above run by default
@pytest.mark.parametrize("stage", [2, 3])
def test_bandit_example_under_torchrun_learns_the_same_with_zero(stage: int) -> None:
    """`torchrun --nproc_per_node=2 examples/distributed_bandit.py --deepspeed
    examples/configs/deepspeed_zero{2,3}.json`: the printed learning curve (reward, gradient norm,
    3 decimals) is the one of the same run with the trainer's own gradient sync, and it learns."""
    zero = torchrun_bandit_curve(f"examples/configs/deepspeed_zero{stage}.json")
    own = torchrun_bandit_curve("off")
    assert len(zero) == 4  # steps 0, 13, 26, 39
    assert zero == own
    first, last = (float(line.split()[3]) for line in (zero[0], zero[-1]))
    assert last > first + 0.4  # 0.22 -> ~0.85: the policy learns the best arm of each context


# ---- the op build cache and processes that outlive a test ----------------------------------------
def test_a_stale_build_lock_is_named_with_the_command_that_removes_it(tmp_path: Path) -> None:
    """A lock file left by a killed build (old, held open by no process) is reported with its path
    and the `rm` that removes it; a fresh lock, or one a running build holds open, is not."""
    from tests.deepspeed_toys import STALE_LOCK_MINUTES, lock_holders

    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.touch()
    assert stale_lock_problem(tmp_path) is None  # just created: a build may be starting
    old = time.time() - (STALE_LOCK_MINUTES + 5) * 60
    os.utime(lock, (old, old))
    problem = stale_lock_problem(tmp_path)
    assert problem is not None
    assert f"stale torch extension build lock: {lock} (10 min old, held open by no process)" in problem
    assert problem.endswith(f"Remove it and rerun: rm {lock}")
    fd = os.open(lock, os.O_RDONLY)  # a build in progress holds its lock open
    try:
        assert lock_holders(lock) == [os.getpid()]
        assert stale_lock_problem(tmp_path) is None
    finally:
        os.close(fd)


def test_the_private_extensions_directory_is_used() -> None:
    """tests/conftest.py points torch's JIT builds at the checkout's ignored .torch_extensions/."""
    from tests.conftest import OWN_EXTENSIONS_DIR
    from tests.deepspeed_toys import extensions_dir

    if not OWN_EXTENSIONS_DIR:
        pytest.skip("TORCH_EXTENSIONS_DIR was set before the tests started; it is kept")
    assert extensions_dir().parent == ROOT / ".torch_extensions"
    assert "/.torch_extensions/" in (ROOT / ".gitignore").read_text()


@pytest.mark.slow  # ~10 s: waits out a launch timeout (the command-timeout test runs by default)
def test_a_timed_out_launch_kills_the_workers_and_what_they_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker stuck in an op build (holding the lock, a compiler running): at the timeout the
    worker and its compiler are killed, the lock the killed build left is removed, and the error
    says so. The worker gets stuck ~3 s after the launch (5-10 s on a loaded machine): a launch
    timed out before it was stuck (no pid file) is retried with the 30 s this test used to wait."""
    from tests.deepspeed_toys import hung_build_worker
    from tests.distributed_toys import is_alive

    for timeout in (10, 30):
        out = tmp_path / f"timeout-{timeout}"
        out.mkdir()
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(out / "ext"))
        with pytest.raises(TimeoutError, match=f"did not finish within {timeout}") as err:
            launch(hung_build_worker, out, world=1, timeout=float(timeout))
        pid_file = out / "hung-rank0.json"
        if pid_file.exists() and pid_file.read_text():
            break
    pids = json.loads(pid_file.read_text())
    deadline = time.monotonic() + 10
    while (is_alive(pids["worker"]) or is_alive(pids["child"])) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not is_alive(pids["worker"])
    assert not is_alive(pids["child"])  # the "compiler" did not outlive its worker
    lock = out / "ext" / "fake_op" / "lock"
    assert not lock.exists()
    assert f"Removed the build lock(s) the killed workers left: ['{lock}']" in str(err.value)


def test_a_timed_out_command_kills_workers_in_sessions_of_their_own(tmp_path: Path) -> None:
    """torchrun starts each worker in a new session; subprocess.run's timeout would kill only
    torchrun. run_command kills the launcher and every process below it."""
    import sys

    from tests.distributed_toys import is_alive

    pid_file = tmp_path / "worker.pid"
    launcher = (
        "import subprocess, sys, time\n"
        "cmd = [sys.executable, '-c', 'import time; time.sleep(600)']\n"
        "w = subprocess.Popen(cmd, start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(w.pid))\n"
        "time.sleep(600)\n"
    )
    with pytest.raises(TimeoutError, match="did not finish within 5 s; it and its workers were killed"):
        run_command([sys.executable, "-c", launcher], timeout=5)
    worker = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while is_alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not is_alive(worker)
