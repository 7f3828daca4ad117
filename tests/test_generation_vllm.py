"""`grpo.generation.vllm_engine`: the pure parts on the CPU (unmarked), vLLM itself on a GPU
(marker ``gpu``: skipped where vllm or a CUDA device is missing)."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from grpo.generation.vllm_engine import (
    VLLMEngine,
    VLLMSample,
    completions_and_log_probs,
    request_seeds,
    require_vllm,
    sampling_params_kwargs,
    vllm_max_lora_rank,
)
from grpo.llm import CausalLMPolicy
from grpo.llm.policy import SamplingOptions
from grpo.runtime.extras import install_hint
from tests.llm_helpers import build_model, build_tokenizer

HAS_VLLM = importlib.util.find_spec("vllm") is not None
PROMPTS = ["1+2=", "3+4=", "what is 5+1?"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def _opts(**kw: Any) -> SamplingOptions:
    base = {"max_new_tokens": 8, "min_new_tokens": 0, "temperature": 0.7, "top_p": 1.0, "top_k": 0}
    return SamplingOptions(**{**base, "min_p": 0.0, "repetition_penalty": 1.0, **kw})


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_no_cuda_is_a_clear_error(tok: Any, tmp_path: Any) -> None:
    policy = CausalLMPolicy(build_model(tmp_path / "m", tok), tok, max_new_tokens=4)
    with pytest.raises(RuntimeError, match=r"CUDA GPU.*generation_engine='worker'"):
        VLLMEngine.for_policy(policy, seed=0)


# ---- GPU: vLLM itself ------------------------------------------------------------------------
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="needs vllm (pip install -e '.[vllm]')")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _policy(tok: Any, directory: Any, *, lora: bool = False, **kw: Any) -> CausalLMPolicy:
    # hidden 64 / 2 heads: head size 32, which vLLM's attention kernels take
    model = build_model(directory, tok, arch="llama", hidden=64, heads=2).to("cuda")
    if lora:
        import peft

        cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        model = peft.get_peft_model(model, cfg)
    return CausalLMPolicy(model, tok, max_new_tokens=8, temperature=0.8, autocast=False, **kw)


@pytest.fixture
def engine_factory() -> Iterator[Any]:
    made: list[VLLMEngine] = []

    def make(policy: CausalLMPolicy, **kw: Any) -> VLLMEngine:
        made.append(VLLMEngine.for_policy(policy, seed=0, enforce_eager=True, **kw))
        return made[-1]

    yield make
    for e in made:
        e.close()


def _max_gap(policy: CausalLMPolicy, gen: Any) -> float:
    comps = [c for g in gen.actions for c in g]
    with torch.no_grad():
        ref = policy.get_log_probabilities(None, comps)
    assert torch.equal(ref.mask, gen.log_probs.mask)
    return float((ref.log_probs - gen.log_probs.log_probs).abs().max())


@pytest.mark.gpu
@needs_vllm
@needs_cuda
@pytest.mark.parametrize(("dtype", "atol"), [("float32", 1e-4), ("bfloat16", 1e-2)])
def test_vllm_samples_match_the_trainer(
    tok: Any, tmp_path: Any, engine_factory: Any, dtype: str, atol: float
) -> None:
    """Completions decode consistently and carry the sampler's log-probs, equal to the trainer's
    of the same tokens; after an optimizer step and a sync they follow the new weights."""
    policy = _policy(tok, tmp_path / "m", logprob_chunk_size=None)
    if dtype == "bfloat16":
        policy.model.to(torch.bfloat16)
    engine = engine_factory(policy, dtype=dtype)
    gen = engine.submit(PROMPTS, 4, with_log_probs=True).result()
    assert gen.version == 0
    assert len(gen.actions) == 3
    assert all(len(g) == 4 for g in gen.actions)
    for prompt, group in zip(PROMPTS, gen.actions, strict=True):
        for c in group:
            assert c.prompt_ids.tolist() == policy.encode_prompt(prompt)
            assert c.text == tok.decode(c.token_ids.tolist(), skip_special_tokens=True)
            assert c.finished == (int(c.token_ids[-1]) in policy.eos_token_ids)
            assert c.finished or len(c) == 8
    assert gen.log_probs.log_probs.device.type == "cuda"
    assert gen.log_probs.log_probs.dtype == torch.float32
    assert _max_gap(policy, gen) < atol
    # one optimizer step, then a sync: the engine's log-probs follow the new weights
    opt = torch.optim.SGD(policy.model.parameters(), lr=0.5)
    comps = [c for g in gen.actions for c in g]
    loss = -policy.get_log_probabilities(None, comps).log_probs.sum()
    loss.backward()
    opt.step()
    engine.sync(policy, 1)
    gen2 = engine.submit(PROMPTS, 4, with_log_probs=True).result()
    assert gen2.version == 1
    assert engine.version == 1
    assert _max_gap(policy, gen2) < atol
    n_bytes = sum(p.numel() * p.element_size() for p in policy.model.parameters())
    assert engine.last_sync_bytes == n_bytes
    assert engine.last_sync_seconds > 0


@pytest.mark.gpu
@needs_vllm
@needs_cuda
def test_lora_sync_moves_only_the_adapter(tok: Any, tmp_path: Any, engine_factory: Any) -> None:
    """A LoRA policy: vLLM serves the base weights plus the adapter; a sync writes only the
    adapter (its bytes, not the model's) and the next samples' log-probs are the new policy's."""
    policy = _policy(tok, tmp_path / "m", lora=True, logprob_chunk_size=None)
    engine = engine_factory(policy, dtype="float32")
    gen = engine.submit(PROMPTS, 2, with_log_probs=True).result()
    assert _max_gap(policy, gen) < 1e-4
    with torch.no_grad():
        for p in policy.get_parameters().values():
            p.add_(0.05 * torch.randn_like(p))
    engine.sync(policy, 1)
    adapter = sum(p.numel() * p.element_size() for p in policy.get_parameters().values())
    total = sum(p.numel() * p.element_size() for p in policy.model.parameters())
    assert adapter <= engine.last_sync_bytes < adapter + 64 * 1024 < total  # safetensors header only
    gen2 = engine.submit(PROMPTS, 2, with_log_probs=True).result()
    assert gen2.version == 1
    assert _max_gap(policy, gen2) < 1e-4


@pytest.mark.gpu
@needs_vllm
@needs_cuda
def test_trainer_with_the_vllm_engine_and_async_rollouts(tok: Any, tmp_path: Any) -> None:
    """GRPOTrainer(generation_engine="vllm", async_staleness=1) runs 3 steps with finite losses."""
    from grpo import GRPOConfig, GRPOTrainer
    from grpo.llm import RewardFunctions

    policy = _policy(tok, tmp_path / "m")
    reward = RewardFunctions(lambda prompts, completions: [float(len(c)) / 8 for c in completions])
    cfg = GRPOConfig(
        group_size=4, batch_size=3, learning_rate=1e-3, kl_coeff=0.0, device="cuda", seed=0,
        generation_engine="vllm", async_staleness=1,
    )  # fmt: skip
    trainer = GRPOTrainer(cfg, policy, reward)
    try:
        for _ in range(3):
            metrics = trainer.step(PROMPTS)
            assert math.isfinite(metrics["loss/total"])
    finally:
        trainer.close()
