"""What ``generate`` samples is the distribution the trainer scores: the policy's temperature over
the whole vocabulary, whatever transformers' global defaults (``top_k=50``) or the checkpoint's
generation_config.json (top-k, min-p, a repetition penalty) say. Checked on first tokens drawn
from a real tiny Llama, against the softmax of its own forward pass."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from grpo.llm import CausalLMPolicy
from grpo.llm.sampling_settings import SamplingSettings
from tests.llm_helpers import build_model, build_tokenizer

N = 20_000  # first tokens drawn per check


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    d = tmp_path_factory.mktemp("tiny_sampling")
    tok = build_tokenizer(d / "tok")
    model = build_model(d / "llama", tok, arch="llama")
    return {"tok": tok, "model": model, "dir": d / "llama"}


def _first_token_probs(model, policy: CausalLMPolicy, prompt: str, temperature: float) -> torch.Tensor:
    ids = torch.tensor([policy.encode_prompt(prompt)])
    with torch.no_grad():
        z = model(input_ids=ids).logits[0, -1].float()
    return torch.softmax(z / temperature, -1)  # (V,)


def _first_token_counts(policy: CausalLMPolicy, prompt: str, vocab: int, **kw: object) -> torch.Tensor:
    torch.manual_seed(0)
    groups = policy.generate_actions([prompt], N, max_new_tokens=1, **kw)
    firsts = torch.tensor([int(c.token_ids[0]) for c in groups[0]])
    return torch.bincount(firsts, minlength=vocab).double()  # (V,)


def _assert_drawn_from(counts: torch.Tensor, p: torch.Tensor) -> None:
    """Every token's count within 5 binomial standard deviations (+1) of N p, and the 8 least
    likely tokens (which a top-50 cut of this 55-token vocabulary removes) drawn as often as
    their total probability says."""
    p = p.double()
    expected = N * p
    sd = (N * p * (1 - p)).sqrt()
    worst = ((counts - expected).abs() - 5 * sd - 1).max()
    assert worst <= 0, f"a token's count is {float(worst):.1f} beyond 5 standard deviations"
    tail = torch.argsort(p)[:8]
    mass = float(p[tail].sum())
    assert mass * N > 200  # the check below has something to see
    drawn = float(counts[tail].sum())
    assert abs(drawn - mass * N) <= 5 * (N * mass * (1 - mass)) ** 0.5, (drawn, mass * N)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generate_samples_the_full_softmax_not_transformers_top_k_50(tiny, temperature: float) -> None:
    tok, model = tiny["tok"], tiny["model"]
    policy = CausalLMPolicy(model, tok, SamplingSettings(max_new_tokens=1, temperature=temperature))
    vocab = model.config.vocab_size
    assert vocab > 50  # so transformers' default top_k=50 would cut tokens off
    p = _first_token_probs(model, policy, "1+2=", temperature)
    _assert_drawn_from(_first_token_counts(policy, "1+2=", vocab), p)


def test_the_checkpoints_generation_config_does_not_change_what_is_sampled(tiny, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny["dir"])
    model.generation_config.do_sample = True
    model.generation_config.top_k = 2
    model.generation_config.min_p = 0.5
    model.generation_config.repetition_penalty = 3.0
    model.save_pretrained(tmp_path)  # generation_config.json as a checkpoint would ship it
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.generation_config.top_k == 2
    assert loaded.generation_config.min_p == 0.5
    policy = CausalLMPolicy(loaded, tiny["tok"], SamplingSettings(max_new_tokens=1, temperature=1.0))
    p = _first_token_probs(loaded, policy, "3+4=", 1.0)
    _assert_drawn_from(_first_token_counts(policy, "3+4=", loaded.config.vocab_size), p)
    assert loaded.generation_config.top_k == 2  # the model's own config is put back afterwards
    assert loaded.generation_config.min_p == 0.5


def test_the_policy_says_which_checkpoint_settings_it_does_not_apply(tiny, tmp_path, caplog) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny["dir"])
    model.generation_config.do_sample = True
    model.generation_config.top_k = 20
    model.generation_config.top_p = 0.8
    model.save_pretrained(tmp_path)
    with caplog.at_level("WARNING", logger="grpo.llm.generation_defaults"):
        CausalLMPolicy(
            AutoModelForCausalLM.from_pretrained(tmp_path), tiny["tok"], SamplingSettings(temperature=0.9)
        )
    (record,) = [r for r in caplog.records if "generation_config sets" in r.getMessage()]
    assert "top_k=20, top_p=0.8" in record.getMessage()
    assert "temperature=0.9, top_k=0, top_p=1.0" in record.getMessage()
    caplog.clear()
    with caplog.at_level("WARNING", logger="grpo.llm.generation_defaults"):
        CausalLMPolicy(tiny["model"], tiny["tok"])  # a config with no sampling settings: silent
    assert not [r for r in caplog.records if "generation_config sets" in r.getMessage()]


def test_the_policys_own_top_k_still_truncates(tiny) -> None:
    tok, model = tiny["tok"], tiny["model"]
    policy = CausalLMPolicy(model, tok, SamplingSettings(max_new_tokens=1, temperature=1.0))
    counts = _first_token_counts(policy, "1+2=", model.config.vocab_size, top_k=3)
    p = _first_token_probs(model, policy, "1+2=", 1.0)
    assert set(torch.nonzero(counts).flatten().tolist()) == set(torch.topk(p, 3).indices.tolist())


def test_the_models_generation_config_is_put_back_when_generate_raises(tiny) -> None:
    tok, model = tiny["tok"], tiny["model"]
    own = model.generation_config
    policy = CausalLMPolicy(model, tok, SamplingSettings(max_new_tokens=1))
    out_of_vocabulary = torch.tensor([3, model.config.vocab_size + 5])  # the embedding raises in generate
    with pytest.raises(IndexError):
        policy.generate_from_ids([out_of_vocabulary], [1])
    assert model.generation_config is own


def test_what_generation_returns_is_no_inference_tensor(tiny) -> None:
    """generate runs in inference mode; its completions and sampler log-probs must still be
    usable in a training forward (an inference tensor cannot be saved for backward)."""
    tok, model = tiny["tok"], tiny["model"]
    policy = CausalLMPolicy(model, tok, SamplingSettings(max_new_tokens=4))
    groups, sampler = policy.generate_actions_with_sampler_log_probs(["1+2=", "ab"], 3)
    flat = [c for g in groups for c in g]
    assert not any(c.token_ids.is_inference() or c.prompt_ids.is_inference() for c in flat)
    assert not sampler.log_probs.is_inference()
    assert not sampler.mask.is_inference()
    out = policy.evaluate_actions(None, flat)
    (out.log_probs * out.mask).sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
