"""grpo.llm.CausalLMPolicy: per-token log-probs against a naive per-row computation, masking,
entropy, chunking, references (LoRA / full fine-tuning) and a learning test. Offline, tiny models."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from grpo import GRPOConfig, GRPOTrainer
from grpo.grpo_objective import GRPOObjective
from grpo.llm import (
    CausalLMPolicy,
    Completion,
    DisabledAdapterReference,
    RewardFunctions,
    SamplingSettings,
    chunked_token_logprobs,
    naive_token_logprobs,
)
from tests.llm_helpers import build_model, build_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Tokenizer with pad == eos and two architectures, saved and loaded with from_pretrained."""
    d = tmp_path_factory.mktemp("tiny")
    tok = build_tokenizer(d / "tok", pad_is_eos=True, chat_template=True)
    return {
        "tok": tok,
        "llama": build_model(d / "llama", tok, arch="llama"),
        "gpt2": build_model(d / "gpt2", tok, arch="gpt2"),
    }


def _completions(tok, temperature: float = 1.0) -> list[Completion]:
    """Prompts of different lengths (left padding) and completions: ending in EOS (== pad),
    truncated (no EOS), a single EOS, and one containing the pad id before its end."""
    eos = tok.eos_token_id
    rows = [
        ("1+2=", "3", True),
        ("what is 12+30?", "42 ok", False),
        ("a", "", True),
        ("hello there, x=", "ab", True),
    ]
    out = []
    for prompt, text, finished in rows:
        p = torch.tensor(tok(prompt)["input_ids"])
        ids = tok(text)["input_ids"] if text else []
        if finished:
            ids = [*ids, eos]
        out.append(Completion(p, torch.tensor(ids, dtype=torch.long), text, finished, temperature))
    return out


def _naive_row(model, c: Completion, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpadded full-sequence forward, log_softmax at the temperature, gather: the reference."""
    seq = torch.cat([c.prompt_ids, c.token_ids]).unsqueeze(0)
    logits = model(input_ids=seq).logits[0, len(c.prompt_ids) - 1 : -1]  # logits at t score t+1
    return naive_token_logprobs(logits, c.token_ids, temperature=temperature)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("chunk", [3, None])
def test_log_probs_match_naive_per_row(tiny, arch: str, chunk: int | None) -> None:
    tok, model = tiny["tok"], tiny[arch]
    temperature = 0.7
    policy = CausalLMPolicy(model, tok, SamplingSettings(temperature=temperature), logprob_chunk_size=chunk)
    comps = _completions(tok, temperature)
    with torch.no_grad():
        out = policy.evaluate_actions(None, comps, with_entropy=True)
    lengths = [len(c) for c in comps]
    assert out.log_probs.shape == (4, max(lengths))
    assert out.mask.tolist() == [[j < n for j in range(max(lengths))] for n in lengths]
    assert tok.pad_token_id == tok.eos_token_id
    for i, c in enumerate(comps):
        with torch.no_grad():
            lp, ent = _naive_row(model, c, temperature)
        n = len(c)
        torch.testing.assert_close(out.log_probs[i, :n], lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(out.entropy[i, :n], ent, atol=1e-5, rtol=0)
        assert torch.all(out.log_probs[i, n:] == 0)
    # the EOS (== pad) tokens are scored: finite, non-zero log-probs under the mask
    assert out.mask[0, 1]
    assert out.log_probs[0, 1] < 0
    assert out.mask[2, 0]


def test_masked_token_ids_do_not_change_log_probs_or_loss(tiny) -> None:
    tok, model = tiny["tok"], tiny["llama"]
    comps = _completions(tok)
    adv = torch.tensor([1.0, -0.5, 0.25, -1.0])
    objective = GRPOObjective(clip_epsilon=0.2, kl_coeff=0.0)
    results = []
    for pad in (tok.pad_token_id, 7, 30):  # the id written into left/right padding positions
        policy = CausalLMPolicy(model, tok, logprob_chunk_size=2)
        policy.pad_token_id = pad
        out = policy.evaluate_actions(None, comps, with_entropy=True)
        loss = objective(out.log_probs, out.log_probs.detach() - 0.1, adv, out.mask, out.mask.sum()).loss
        results.append((out.log_probs.detach(), loss.detach()))
    for lp, loss in results[1:]:
        torch.testing.assert_close(lp, results[0][0], atol=1e-6, rtol=0)
        torch.testing.assert_close(loss, results[0][1], atol=1e-6, rtol=0)


def test_chunked_gradients_equal_full_logits_gradients(tiny) -> None:
    tok, model = tiny["tok"], tiny["llama"]
    comps = _completions(tok)
    grads = []
    for chunk in (2, None):
        model.zero_grad(set_to_none=True)
        policy = CausalLMPolicy(model, tok, logprob_chunk_size=chunk)
        out = policy.evaluate_actions(None, comps, with_entropy=True)
        (out.log_probs.sum() + 0.1 * out.entropy.sum()).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)


def test_chunked_token_logprobs_unit() -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 8, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(11, generator=g, dtype=torch.float64)
    y = torch.randint(0, 11, (3, 5), generator=g)
    lp, ent = chunked_token_logprobs(
        hidden, weight, y, bias=bias, temperature=0.5, chunk_size=4, with_entropy=True
    )
    assert ent is not None
    (lp.sum() + ent.sum()).backward()
    g1 = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    lp2, ent2 = naive_token_logprobs(hidden @ weight.T + bias, y, temperature=0.5)
    (lp2.sum() + ent2.sum()).backward()
    torch.testing.assert_close(lp, lp2, atol=1e-12, rtol=0)
    torch.testing.assert_close(ent, ent2, atol=1e-12, rtol=0)
    torch.testing.assert_close(g1[0], hidden.grad, atol=1e-12, rtol=0)
    torch.testing.assert_close(g1[1], weight.grad, atol=1e-12, rtol=0)
    # hand check: uniform logits -> log p = -log V, entropy = log V
    lp3, ent3 = chunked_token_logprobs(
        torch.zeros(2, 4), torch.zeros(6, 4), torch.tensor([0, 5]), with_entropy=True
    )
    torch.testing.assert_close(lp3, torch.full((2,), -torch.log(torch.tensor(6.0)).item()))
    torch.testing.assert_close(ent3, torch.full((2,), torch.log(torch.tensor(6.0)).item()))
    with pytest.raises(ValueError, match="temperature=0"):
        chunked_token_logprobs(torch.zeros(2, 4), torch.zeros(6, 4), torch.tensor([0, 5]), temperature=0)


def test_chunked_backward_skips_an_unused_entropy() -> None:
    # an entropy output that no gradient reaches (detached, as for with_entropy="no_grad", or
    # simply unused in the loss) leaves the gradients those of the log-probs alone
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 7, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(13, 8, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 13, (2, 7), generator=g)
    coef = torch.randn(2, 7, generator=g, dtype=torch.float64)
    grads = []
    for with_entropy in (False, True):
        lp, _ent = chunked_token_logprobs(hidden, weight, y, chunk_size=3, with_entropy=with_entropy)
        (lp * coef).sum().backward()
        grads.append((hidden.grad.clone(), weight.grad.clone()))
        hidden.grad = weight.grad = None
    lp2, _ = naive_token_logprobs(hidden @ weight.T, y)
    (lp2 * coef).sum().backward()
    for got in grads:
        torch.testing.assert_close(got[0], hidden.grad, atol=1e-12, rtol=0)
        torch.testing.assert_close(got[1], weight.grad, atol=1e-12, rtol=0)


@pytest.mark.parametrize("chunk", [None, 4])
def test_entropy_for_metrics_only_carries_no_gradient(tiny, chunk) -> None:
    tok, model = tiny["tok"], tiny["llama"]
    policy = CausalLMPolicy(model, tok, logprob_chunk_size=chunk)
    comps = _completions(tok)
    exact = policy.evaluate_actions(None, comps, with_entropy=True)
    metrics_only = policy.evaluate_actions(None, comps, with_entropy="no_grad")
    assert exact.entropy is not None
    assert metrics_only.entropy is not None
    assert exact.entropy.requires_grad
    assert not metrics_only.entropy.requires_grad
    assert metrics_only.log_probs.requires_grad
    torch.testing.assert_close(metrics_only.entropy, exact.entropy, atol=0, rtol=0)
    torch.testing.assert_close(metrics_only.log_probs, exact.log_probs, atol=0, rtol=0)


def test_generation_stops_on_eos_and_masks_by_position(tiny) -> None:
    tok, model = tiny["tok"], tiny["llama"]
    policy = CausalLMPolicy(
        model,
        tok,
        SamplingSettings(max_new_tokens=12, top_k=20, top_p=0.95, min_p=0.01, repetition_penalty=1.1),
    )
    torch.manual_seed(1)
    groups = policy.generate_actions(["1+2=", "x", [{"role": "user", "content": "hi"}]], 4)
    assert [len(g) for g in groups] == [4, 4, 4]
    flat = [c for g in groups for c in g]
    ends = set(policy.eos_token_ids)  # <eos>, and <pad> of the pad_is_eos tiny tokenizer (grpo.llm.tiny)
    assert ends == {tok.eos_token_id, tok.convert_tokens_to_ids("<pad>")}
    for c in flat:
        ids = c.token_ids.tolist()
        assert 1 <= len(ids) <= 12
        assert not ends & set(ids[:-1])  # generation stopped at the first EOS id
        assert c.finished == (ids[-1] in ends)
        if not c.finished:
            assert len(ids) == 12
    assert any(c.finished for c in flat)
    assert any(not c.finished for c in flat)
    # the chat prompt went through the template
    assert tok.decode(groups[2][0].prompt_ids) == "<u>hi<a>"
    out = policy.evaluate_actions(None, flat)
    assert out.mask.sum(1).tolist() == [len(c) for c in flat]
    with pytest.raises(TypeError, match=r"unknown sampling settings \['num_beams'\]"):
        policy.generate_actions(["x"], 2, num_beams=2)


def test_per_row_budgets_cut_each_row_of_the_same_draw(tiny) -> None:
    """`generate_from_ids` samples every row to the largest budget and cuts row i at its own
    ``budgets[i]``: from the same seed each row is the prefix of the row drawn with no cut."""
    tok, model = tiny["tok"], tiny["llama"]
    rows = [torch.tensor(tok(p)["input_ids"]) for p in ["1+2=", "a", "a longer prompt here", "77"]]
    policy = CausalLMPolicy(model, tok, SamplingSettings(max_new_tokens=12, min_new_tokens=12))
    torch.manual_seed(5)
    whole = [c.token_ids.tolist() for c in policy.generate_from_ids(rows, [12] * 4)]
    torch.manual_seed(5)
    cut = policy.generate_from_ids(rows, [1, 7, 3, 12])
    assert [len(w) for w in whole] == [12] * 4  # the EOS ban: every row runs to its budget
    assert [c.token_ids.tolist() for c in cut] == [w[:b] for w, b in zip(whole, [1, 7, 3, 12], strict=True)]
    assert [c.finished for c in cut] == [False, False, False, False]


def test_sampling_computes_only_the_last_positions_logits(tiny) -> None:
    """``generate``'s prefill asks the model for the last position's logits only (never the
    (n, P, V) of every prompt position: with a real vocabulary and long prompts, gigabytes)."""
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


def test_constructor_errors(tiny) -> None:
    tok, model = tiny["tok"], tiny["llama"]
    with pytest.raises(ValueError, match=r"SamplingSettings.temperature=0.0 must be > 0"):
        CausalLMPolicy(model, tok, SamplingSettings(temperature=0))
    with pytest.raises(ValueError, match=r"top_p=1.5"):
        CausalLMPolicy(model, tok, SamplingSettings(top_p=1.5))
    policy = CausalLMPolicy(model, tok)
    with pytest.raises(TypeError, match=r"expects grpo\.llm\.Completion"):
        policy.evaluate_actions(None, ["text"])


def test_reference_none_for_full_finetune_and_copy_when_kl(tiny) -> None:
    tok, model = tiny["tok"], tiny["gpt2"]
    policy = CausalLMPolicy(model, tok, SamplingSettings(max_new_tokens=3))
    assert policy.reference_policy() is None
    r = RewardFunctions(lambda p, c: [0.0] * len(c))
    t0 = GRPOTrainer(GRPOConfig(group_size=2, batch_size=1, kl_coeff=0.0), policy, r)
    assert t0.reference_policy is None
    t1 = GRPOTrainer(GRPOConfig(group_size=2, batch_size=1, kl_coeff=0.1), policy, r)
    ref = t1.reference_policy
    assert isinstance(ref, CausalLMPolicy)
    assert ref.model is not model
    assert not any(p.requires_grad for p in ref.model.parameters())


def test_lora_reference_is_the_disabled_adapter(tiny, tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    tok = tiny["tok"]
    base = build_model(tmp_path / "m", tok, arch="llama", seed=3)
    comps = _completions(tok)
    with torch.no_grad():
        base_lp = CausalLMPolicy(base, tok).evaluate_actions(None, comps).log_probs.clone()
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(base, cfg)
    policy = CausalLMPolicy(model, tok, SamplingSettings(max_new_tokens=4), gradient_checkpointing=True)
    ref = policy.reference_policy()
    assert isinstance(ref, DisabledAdapterReference)
    assert ref.policy is policy
    assert set(policy.get_parameters())
    assert all("lora" in n for n in policy.get_parameters())
    trainer = GRPOTrainer(
        GRPOConfig(group_size=4, batch_size=2, kl_coeff=0.1, learning_rate=0.05, seed=0),
        policy,
        RewardFunctions(lambda p, c: [float(len(x)) for x in c]),
        reference_policy=ref,
    )
    assert trainer.reference_policy is ref
    for _ in range(2):
        metrics = trainer.step(["a", "b"])
    assert metrics["kl/ref"] > 0  # the adapter moved the policy away from the base model
    with torch.no_grad():
        now = policy.evaluate_actions(None, comps).log_probs
        ref_lp = ref.evaluate_actions(None, comps).log_probs
    torch.testing.assert_close(ref_lp, base_lp, atol=1e-6, rtol=0)  # reference == untouched base
    assert (now - base_lp).abs().max() > 1e-4  # ... while the adapted policy changed


def test_policy_learns_to_emit_target_token(tiny, tmp_path: Path) -> None:
    """Toy task: reward = fraction of the 4 completion tokens that are '7'. From ~0.02 (random
    init, 55-token vocabulary) the mean reward reaches >= 0.9 within 20 steps (9 at this seed)."""
    tok = tiny["tok"]
    model = build_model(tmp_path / "m", tok, arch="llama", seed=0)
    policy = CausalLMPolicy(model, tok, SamplingSettings(max_new_tokens=4), logprob_chunk_size=64)

    def sevens(prompts, completions):
        return [c.count("7") / 4 for c in completions]

    trainer = GRPOTrainer(
        GRPOConfig(group_size=8, batch_size=4, learning_rate=3e-2, kl_coeff=0.0, seed=0),
        policy,
        RewardFunctions(sevens),
    )
    history = []
    for _ in range(20):
        history.append(trainer.step(["a", "b", "c", "d"])["reward/mean"])
        if history[-1] >= 0.9:
            break
    print("reward history", history)
    assert history[0] < 0.1
    assert history[-1] >= 0.9, history


def test_import_grpo_does_not_import_transformers_and_llm_names_the_extra() -> None:
    code = (
        "import sys; import grpo; assert 'transformers' not in sys.modules, 'transformers imported'\n"
        "sys.modules['transformers'] = None\n"
        "try:\n    import grpo.llm\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install -e '.[llm]'" in out.stdout  # this is a checkout (grpo.runtime.extras)


def test_qwen2_architecture_with_a_vocabulary_larger_than_the_tokenizer(tmp_path: Path) -> None:
    # the benchmarks' 0.5B-class model is Qwen2's architecture with its 151,936-token vocabulary
    # and the char tokenizer (55 ids): sampled ids the tokenizer does not know decode to nothing,
    # and log-probs, EOS handling and training work over the whole vocabulary
    tok = build_tokenizer(tmp_path / "tok")
    model = build_model(
        tmp_path / "qwen2", tok, arch="qwen2", hidden=32, layers=2, heads=4, kv_heads=2,
        intermediate=48, vocab_size=300,
    )  # fmt: skip
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as Qwen2-0.5B
    assert model.config.num_key_value_heads == 2
    policy = CausalLMPolicy(model, tok, SamplingSettings(max_new_tokens=6), logprob_chunk_size=8)
    torch.manual_seed(0)
    groups = policy.generate_actions(["1+2=", "3+4="], 4)
    flat = [c for g in groups for c in g]
    assert any(int(c.token_ids.max()) >= len(tok) for c in flat if len(c))  # beyond the tokenizer
    out = policy.evaluate_actions(None, flat)
    naive = [_naive_row(model, c, 1.0)[0] for c in flat]
    for row, ref, c in zip(out.log_probs, naive, flat, strict=True):
        torch.testing.assert_close(row[: len(c)], ref, atol=1e-5, rtol=0)
    trainer = GRPOTrainer(
        GRPOConfig(group_size=4, batch_size=2, kl_coeff=0.0, seed=0), policy,
        RewardFunctions(lambda p, c: [float(len(x)) for x in c]),
    )  # fmt: skip
    before = model.lm_head.weight.detach().clone()
    m = trainer.step(["1+2=", "3+4="])
    assert m["grad/norm"] > 0
    assert not torch.equal(before, model.lm_head.weight)
