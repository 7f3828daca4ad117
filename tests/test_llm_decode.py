"""The KV-cache sampling loop (`grpo.llm.decode`) is a second implementation of ``generate``'s
sampling: from the same random stream it must draw bitwise the same tokens, with the same
sampler log-probs, on every architecture the tiny builders make (llama, qwen2, gpt2), under
LoRA, with the EOS ban, per-row budgets and left padding; and it must be the path ``"auto"``
takes exactly where it applies."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from grpo.llm import CausalLMPolicy
from grpo.llm.sampling_settings import SamplingSettings
from tests.llm_helpers import build_model, build_tokenizer

PROMPTS = ["1+2=", "a", "a longer prompt here", "77"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    d = tmp_path_factory.mktemp("tiny_decode")
    tok = build_tokenizer(d / "tok")
    models = {arch: build_model(d / arch, tok, arch=arch, seed=3) for arch in ("llama", "qwen2", "gpt2")}
    return {"tok": tok, **models}


def _both(model, tok, seed: int, **kw: object):
    """(completions, sampler log-probs) of the KV loop and of generate, from the same seed."""
    out = []
    for decoding in ("auto", "generate"):
        policy = CausalLMPolicy(model, tok, SamplingSettings(decoding=decoding, **kw))
        torch.manual_seed(seed)
        groups, sampler = policy.generate_actions_with_sampler_log_probs(PROMPTS, 5)
        out.append(([c for g in groups for c in g], sampler))
    return out


def _assert_same(a, b) -> None:
    (ca, sa), (cb, sb) = a, b
    assert [c.token_ids.tolist() for c in ca] == [c.token_ids.tolist() for c in cb]
    assert [c.finished for c in ca] == [c.finished for c in cb]
    assert torch.equal(sa.mask, sb.mask)
    torch.testing.assert_close(sa.log_probs, sb.log_probs, rtol=0, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize(("temperature", "min_new"), [(1.0, 0), (0.7, 3)])
def test_the_kv_loop_draws_bitwise_what_generate_draws(
    tiny, arch: str, temperature: float, min_new: int
) -> None:
    model, tok = tiny[arch], tiny["tok"]
    for seed in range(3):
        a, b = _both(model, tok, seed, max_new_tokens=12, temperature=temperature, min_new_tokens=min_new)
        _assert_same(a, b)
        lengths = {len(c) for c in a[0]}
        assert min(lengths) >= min_new
        assert len(lengths) > 1  # some rows ended at an EOS before the budget: the padding path ran


def test_the_kv_loop_matches_generate_under_lora(tiny) -> None:
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        tiny["llama"],
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    )
    with torch.no_grad():  # a non-zero adapter, so the LoRA path changes the logits
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    try:
        _assert_same(*_both(model, tiny["tok"], 0, max_new_tokens=10))
    finally:
        model.unload()


def test_per_row_budgets_cut_the_same_tokens(tiny) -> None:
    model, tok = tiny["qwen2"], tiny["tok"]
    rows = [torch.tensor(tok.encode(p)) for p in PROMPTS]
    budgets = [1, 7, 3, 12]
    outs = []
    for decoding in ("auto", "generate"):
        torch.manual_seed(5)
        policy = CausalLMPolicy(model, tok, SamplingSettings(decoding=decoding, max_new_tokens=12))
        outs.append([c.token_ids.tolist() for c in policy.generate_from_ids(rows, budgets)])
    assert outs[0] == outs[1]
    assert all(len(t) <= b for t, b in zip(outs[0], budgets, strict=True))


def test_auto_takes_the_kv_loop_exactly_where_it_applies(tiny) -> None:
    tok, model = tiny["tok"], tiny["llama"]
    policy = CausalLMPolicy(model, tok)
    assert policy.uses_kv_loop(policy.sampling)
    assert policy.uses_kv_loop(policy.sampling.replace(temperature=0.5, min_new_tokens=2))
    for knob in ({"top_k": 5}, {"top_p": 0.9}, {"min_p": 0.1}, {"repetition_penalty": 1.2}):
        assert not policy.uses_kv_loop(policy.sampling.replace(**knob)), knob
    assert not policy.uses_kv_loop(policy.sampling, synced=True)
    assert not policy.uses_kv_loop(policy.sampling.replace(decoding="generate"))
    with pytest.raises(ValueError, match=r"SamplingSettings.decoding='vllm': choose 'auto'"):
        CausalLMPolicy(model, tok, SamplingSettings(decoding="vllm"))


def test_the_prefill_computes_only_the_last_positions_logits(tiny) -> None:
    """Never (n, P, V) logits: with a real vocabulary and long prompts that is gigabytes."""
    tok, model = tiny["tok"], tiny["llama"]
    widths: list[int] = []
    hook = model.lm_head.register_forward_hook(lambda m, args, out: widths.append(int(args[0].shape[1])))
    try:
        CausalLMPolicy(model, tok, SamplingSettings(max_new_tokens=3)).generate_actions(
            ["a longer prompt here"], 2
        )
    finally:
        hook.remove()
    assert widths
    assert set(widths) == {1}
