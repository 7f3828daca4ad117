"""CausalLMPolicy's generation knobs on a tiny real model: a per-call temperature, min_p end to
end, max_model_len (the completion budget and the too-long prompt), min_new_tokens (no early EOS,
scored with the same ban as sampled: log-probs, entropy and gradients against a naive per-row
computation) and generation chunks (what holds against one generate call)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from grpo.llm import CausalLMPolicy, Completion
from grpo.llm.sampling_settings import SamplingSettings
from tests.llm_helpers import build_model, build_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    d = tmp_path_factory.mktemp("tiny_knobs")
    tok = build_tokenizer(d / "tok", pad_is_eos=True, chat_template=True)
    return {"tok": tok, "llama": build_model(d / "llama", tok, arch="llama")}


def _naive(model, c: Completion, *, ban_eos: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpadded forward, logits / temperature, EOS ids at -inf at the first ``min_new_tokens``
    positions when ``ban_eos`` is given, log_softmax: (T,) log-probs of the tokens and entropies."""
    seq = torch.cat([c.prompt_ids, c.token_ids]).unsqueeze(0)
    z = model(input_ids=seq).logits[0, len(c.prompt_ids) - 1 : -1].float() / c.temperature
    if ban_eos is not None:
        z = z.clone()
        z[: c.min_new_tokens, ban_eos] = float("-inf")
    logp_all = torch.log_softmax(z, -1)
    lp = logp_all.gather(-1, c.token_ids.unsqueeze(-1)).squeeze(-1)
    p = logp_all.exp()
    ent = -(p * torch.where(p > 0, logp_all, torch.zeros_like(logp_all))).sum(-1)
    return lp, ent


def test_per_call_temperature_is_recorded_and_scored(tiny) -> None:
    tok, model = tiny["tok"], tiny["llama"]
    policy = CausalLMPolicy(
        model, tok, SamplingSettings(max_new_tokens=5, temperature=1.0), logprob_chunk_size=None
    )
    torch.manual_seed(0)
    groups = policy.generate_actions(["1+2=", "ab"], 2, temperature=0.5)
    flat = [c for g in groups for c in g]
    assert {c.temperature for c in flat} == {0.5}
    assert policy.temperature == 1.0  # the override is for one call only
    out = policy.evaluate_actions(None, flat)
    with torch.no_grad():
        for i, c in enumerate(flat):
            lp, _ = _naive(model, c)
            torch.testing.assert_close(out.log_probs[i, : len(c)], lp, atol=1e-5, rtol=1e-5)
    assert "temperature" in SamplingSettings.names()
    with pytest.raises(TypeError, match=r"unknown sampling settings \['beams'\]; known: \["):
        policy.generate_actions(["x"], 2, beams=3)
    with pytest.raises(ValueError, match=r"SamplingSettings.temperature=0.0 must be > 0"):
        policy.generate_actions(["x"], 2, temperature=0.0)


def test_min_p_is_honoured_end_to_end(tiny) -> None:
    """Every sampled token keeps p >= min_p * max_v p at its position (HF's min-p rule, on the
    temperature-scaled distribution the token is scored with)."""
    tok, model = tiny["tok"], tiny["llama"]
    policy = CausalLMPolicy(
        model, tok, SamplingSettings(max_new_tokens=6, min_p=0.3), logprob_chunk_size=None
    )
    torch.manual_seed(3)
    flat = [c for g in policy.generate_actions(["1+2=", "hello", "x"], 8) for c in g]
    with torch.no_grad():
        for c in flat:
            seq = torch.cat([c.prompt_ids, c.token_ids]).unsqueeze(0)
            p = torch.softmax(model(input_ids=seq).logits[0, len(c.prompt_ids) - 1 : -1].float(), -1)
            chosen = p.gather(-1, c.token_ids.unsqueeze(-1)).squeeze(-1)
            assert bool((chosen >= 0.3 * p.max(-1).values - 1e-6).all())


def test_max_model_len_caps_each_completion_and_refuses_a_prompt_with_no_room(tiny) -> None:
    tok, model = tiny["tok"], tiny["llama"]
    policy = CausalLMPolicy(
        model, tok, SamplingSettings(max_new_tokens=8, min_new_tokens=8, max_model_len=12)
    )
    prompts = ["abcdefgh", "ab"]  # 8 and 2 tokens (the tiny tokenizer adds no BOS)
    lengths = [len(policy.encode_prompt(p)) for p in prompts]
    assert policy.sampling.completion_budgets(lengths) == [min(8, 12 - n) for n in lengths]
    torch.manual_seed(0)
    groups = policy.generate_actions(prompts, 3)
    for prompt_len, group in zip(lengths, groups, strict=True):
        budget = min(8, 12 - prompt_len)
        for c in group:  # EOS is banned for 8 tokens: every completion runs to its budget
            assert len(c) == budget
            assert c.truncated
            assert prompt_len + len(c) <= 12
    with pytest.raises(ValueError, match=r"prompt 1 has 12 tokens.*max_model_len=12.*max_prompt_length"):
        policy.generate_actions(["ab", "abcdefghijkl"], 2)
    cut = CausalLMPolicy(
        model, tok, SamplingSettings(max_new_tokens=8, max_model_len=12), max_prompt_length=11
    )
    assert len(cut.generate_actions(["abcdefghijkl"], 1)[0][0]) == 1  # left-truncated: room for 1


@pytest.mark.parametrize("chunk", [None, 3])
def test_min_new_tokens_bans_eos_and_is_scored_with_the_ban(tiny, chunk: int | None) -> None:
    tok, model = tiny["tok"], tiny["llama"]
    policy = CausalLMPolicy(
        model, tok, SamplingSettings(max_new_tokens=6, temperature=0.8), logprob_chunk_size=chunk
    )
    torch.manual_seed(1)
    flat = [c for g in policy.generate_actions(["1+2=", "xy"], 4, min_new_tokens=3) for c in g]
    eos = policy.eos_token_ids
    for c in flat:
        assert c.min_new_tokens == 3
        assert len(c) >= 3
        assert not any(t in eos for t in c.token_ids[:3].tolist())
    # a completion ending right after the ban, as a sampler with the ban can produce
    flat.append(Completion(flat[0].prompt_ids, torch.tensor([10, 11, 12, eos[0]]), "abc", True, 0.8, 3))
    out = policy.evaluate_actions(None, flat, with_entropy=True)
    loss = (out.log_probs.sum() + out.entropy.sum()) if out.entropy is not None else out.log_probs.sum()
    grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
    naive_loss = torch.zeros(())
    for i, c in enumerate(flat):
        lp, ent = _naive(model, c, ban_eos=eos)
        torch.testing.assert_close(out.log_probs[i, : len(c)], lp, atol=2e-5, rtol=2e-5)
        assert out.entropy is not None
        torch.testing.assert_close(out.entropy[i, : len(c)], ent, atol=2e-5, rtol=2e-5)
        naive_loss = naive_loss + lp.sum() + ent.sum()
        unbanned, _ = _naive(model, c)
        assert not torch.allclose(lp[:3], unbanned[:3])  # the ban changes the density
    naive_grads = torch.autograd.grad(naive_loss, [p for p in model.parameters() if p.requires_grad])
    for g, n in zip(grads, naive_grads, strict=True):
        torch.testing.assert_close(g, n, atol=5e-5, rtol=1e-4)


def test_generation_chunks_keep_deterministic_samples_identical(tiny) -> None:
    """With top_k=1 sampling is deterministic: chunks of 2 sequences give exactly one call's
    completions. (With real sampling the chunks draw the same distribution, but not the same
    samples for a seed: the random stream is consumed in another order.)"""
    tok, model = tiny["tok"], tiny["llama"]
    prompts = ["1+2=", "hello there", "x", "ab"]
    whole = CausalLMPolicy(model, tok, SamplingSettings(max_new_tokens=6, top_k=1)).generate_actions(
        prompts, 3
    )
    chunked = CausalLMPolicy(model, tok, SamplingSettings(max_new_tokens=6, top_k=1, generation_batch_size=2))
    parts = chunked.generate_actions(prompts, 3)
    assert [[c.token_ids.tolist() for c in g] for g in parts] == [
        [c.token_ids.tolist() for c in g] for g in whole
    ]


def test_constructor_checks_the_new_knobs(tiny) -> None:
    tok, model = tiny["tok"], tiny["llama"]
    with pytest.raises(ValueError, match=r"SamplingSettings.min_new_tokens=-1 must be >= 0"):
        CausalLMPolicy(model, tok, SamplingSettings(min_new_tokens=-1))
    with pytest.raises(ValueError, match=r"SamplingSettings.max_model_len=0 must be an integer >= 1 or None"):
        CausalLMPolicy(model, tok, SamplingSettings(max_model_len=0))
