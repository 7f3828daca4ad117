"""LoRA on the LLM path (grpo.llm.lora, grpo.llm.checkpoint): the reference policy by default is
the disabled adapter (no extra parameter, measured), the separate frozen reference adapter as an
option, the errors where neither applies, adapter-only checkpoints and LoRA-config merging.
Real tiny models (grpo.llm.tiny) and real peft; offline."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from grpo import GRPOConfig, GRPOTrainer  # noqa: E402
from grpo.llm import CausalLMPolicy, Completion, DisabledAdapterReference, RewardFunctions  # noqa: E402
from grpo.llm.checkpoint import load_llm_checkpoint, save_llm_checkpoint  # noqa: E402
from grpo.llm.lora import SeparateAdapterReference, adapter_parameters, pad_lora_pair  # noqa: E402
from grpo.llm.sampling_settings import SamplingSettings  # noqa: E402
from tests.llm_helpers import build_model, build_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """A tokenizer and a saved tiny llama (fresh copies are loaded with from_pretrained)."""
    d = tmp_path_factory.mktemp("lora")
    tok = build_tokenizer(d / "tok", pad_is_eos=True)
    build_model(d / "llama", tok, arch="llama", seed=5)
    return {"tok": tok, "dir": d / "llama"}


def _base(tiny: dict[str, object]) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny["dir"]), dtype=torch.float32)


def _lora(tiny: dict[str, object], r: int = 4, targets=("q_proj", "v_proj"), alpha: int = 8, seed: int = 0):
    """A PEFT model whose adapter is random (B != 0), so that it changes the outputs."""
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0)
    model = peft.get_peft_model(_base(tiny), cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    return model


def _comps(tok) -> list[Completion]:
    rows = [("1+2=", "3 "), ("what is 12+30?", "42 ok"), ("a", "bc")]
    out = []
    for prompt, text in rows:
        ids = torch.tensor(tok(text)["input_ids"] + [tok.eos_token_id])
        out.append(Completion(torch.tensor(tok(prompt)["input_ids"]), ids, text, True, 1.0))
    return out


def _logp(policy_or_ref, comps) -> torch.Tensor:
    with torch.no_grad():
        return policy_or_ref.evaluate_actions(None, comps).log_probs.clone()


def _tensor_storages(root: object) -> dict[int, int]:
    """The distinct tensor storages ``root`` holds (data pointer -> bytes): followed through grpo
    objects' attributes, containers, and modules' parameters and buffers."""
    out: dict[int, int] = {}
    seen: set[int] = set()
    stack = [root]
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            out[st.data_ptr()] = st.nbytes()
        elif isinstance(o, torch.nn.Module):
            stack.extend([*o.parameters(), *o.buffers()])
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        elif type(o).__module__.startswith("grpo.") and hasattr(o, "__dict__"):
            stack.extend(vars(o).values())
    return out


def _extra_bytes(reference: object, policy: object) -> int:
    """Bytes of the storages the reference holds that the policy does not."""
    held, own = _tensor_storages(reference), _tensor_storages(policy)
    return sum(n for ptr, n in held.items() if ptr not in own)


def _param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _reward() -> RewardFunctions:
    return RewardFunctions(lambda p, c: [float(len(x)) for x in c])


# ---- the reference -------------------------------------------------------------------------------
def test_default_lora_reference_is_the_disabled_adapter_with_no_extra_parameter(tiny) -> None:
    tok = tiny["tok"]
    comps = _comps(tok)
    base_lp = _logp(CausalLMPolicy(_base(tiny), tok), comps)
    policy = CausalLMPolicy(_lora(tiny), tok, SamplingSettings(max_new_tokens=3))
    assert (_logp(policy, comps) - base_lp).abs().max() > 1e-3  # the adapter changes the outputs
    size = _param_bytes(policy.model)
    cfg = GRPOConfig(device="cpu", group_size=2, batch_size=2, kl_coeff=0.1, learning_rate=0.05, seed=0)
    trainer = GRPOTrainer(cfg, policy, _reward())  # no reference_policy passed
    ref = trainer.reference_policy
    assert _extra_bytes(ref, policy) == 0  # measured: the reference holds no tensor of its own
    assert _param_bytes(policy.model) == size
    assert isinstance(ref, DisabledAdapterReference)
    assert ref.policy is policy
    assert torch.equal(_logp(ref, comps), base_lp)  # exactly the base model
    metrics = trainer.step(["a", "b"])  # a step with the KL term against the base model
    assert 0 < metrics["kl/ref"] < float("inf")  # the random adapter is away from the base
    assert torch.equal(_logp(ref, comps), base_lp)  # the base weights never move
    assert all("lora" in n for n in policy.get_parameters())


def test_full_finetune_still_gets_a_frozen_copy_the_size_of_the_model(tiny) -> None:
    """The same measurement sees the copy where one is needed (no adapter to disable)."""
    model = _base(tiny)
    policy = CausalLMPolicy(model, tiny["tok"], SamplingSettings(max_new_tokens=3))
    trainer = GRPOTrainer(
        GRPOConfig(device="cpu", group_size=2, batch_size=1, kl_coeff=0.1), policy, _reward()
    )
    held = _param_bytes(model) + sum(b.numel() * b.element_size() for b in model.buffers())
    assert _extra_bytes(trainer.reference_policy, policy) == held  # a whole second model
    assert trainer.reference_policy.model is not model


def test_separate_reference_adapter_equals_a_frozen_copy_and_refreshes(tiny) -> None:
    tok = tiny["tok"]
    comps = _comps(tok)
    model = _lora(tiny)
    frozen = copy.deepcopy(model).eval()  # what the reference must compute until refreshed
    before = _param_bytes(model)
    policy = CausalLMPolicy(
        model, tok, SamplingSettings(max_new_tokens=2), use_separate_reference_adapter=True
    )
    actor = {n: p for n, p in model.named_parameters() if ".default." in n}
    assert _param_bytes(model) - before == sum(p.numel() * p.element_size() for p in actor.values())
    assert set(policy.get_parameters()) == set(actor)  # the reference adapter is frozen
    cfg = GRPOConfig(
        device="cpu",
        group_size=2,
        batch_size=1,
        kl_coeff=0.1,
        learning_rate=0.05,
        seed=0,
        reference_update_freq=2,
    )
    trainer = GRPOTrainer(cfg, policy, _reward())
    ref = trainer.reference_policy
    assert _extra_bytes(ref, policy) == 0  # the adapter lives in the policy's model
    assert isinstance(ref, SeparateAdapterReference)
    assert set(trainer.state_dict()["reference_policy"]) == set(adapter_parameters(model, "reference"))
    copy_lp = _logp(CausalLMPolicy(frozen, tok), comps)
    assert torch.equal(_logp(ref, comps), copy_lp)
    trainer.step(["a"])  # step 1: the actor moves, the reference does not
    assert torch.equal(_logp(ref, comps), copy_lp)
    assert (_logp(policy, comps) - copy_lp).abs().max() > 1e-4
    assert model.active_adapter == "default"
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(actor)
    trainer.step(["a"])  # step 2: refreshed from the actor
    ref_params = adapter_parameters(model, "reference")
    for n, p in actor.items():
        assert torch.equal(ref_params[n.replace(".default.", ".reference.")], p)
    assert torch.equal(_logp(ref, comps), _logp(policy, comps))


def test_errors_where_no_lora_reference_applies(tiny) -> None:
    tok = tiny["tok"]
    policy = CausalLMPolicy(_lora(tiny), tok, SamplingSettings(max_new_tokens=3))
    weights = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    cfg = GRPOConfig(device="cpu", group_size=2, batch_size=1, kl_coeff=0.1, reference_update_freq=5)
    with pytest.raises(ValueError, match=r"reference_update_freq=5.*use_separate_reference_adapter=True"):
        GRPOTrainer(cfg, policy, _reward())
    with pytest.raises(ValueError, match=r"DisabledAdapterReference cannot be refreshed"):
        GRPOTrainer(cfg, policy, _reward(), reference_policy=policy.reference_policy())
    assert all(torch.equal(p, weights[n]) for n, p in policy.model.named_parameters())
    with pytest.raises(TypeError, match=r"use_separate_reference_adapter=True .* not a PEFT model"):
        CausalLMPolicy(_base(tiny), tok, use_separate_reference_adapter=True)
    with pytest.raises(TypeError, match=r"DisabledAdapterReference needs a PEFT"):
        DisabledAdapterReference(CausalLMPolicy(_base(tiny), tok))


# ---- checkpoints ---------------------------------------------------------------------------------
def test_adapter_checkpoint_round_trip_is_exact(tiny, tmp_path: Path) -> None:
    tok = tiny["tok"]
    comps = _comps(tok)
    policy = CausalLMPolicy(_lora(tiny, seed=1), tok, use_separate_reference_adapter=True)
    trainer = GRPOTrainer(
        GRPOConfig(device="cpu", group_size=2, batch_size=1, kl_coeff=0.1), policy, _reward()
    )
    trainer.step_count = 7
    out = save_llm_checkpoint(trainer, tmp_path / "ckpt")
    files = sorted(p.name for p in out.iterdir())
    assert "adapter_model.safetensors" in files
    assert "adapter_config.json" in files
    assert "model.safetensors" not in files
    assert "reference" not in files
    assert json.loads((out / "grpo_llm_checkpoint.json").read_text())["step"] == 7
    loaded = CausalLMPolicy(_lora(tiny, seed=2), tok, use_separate_reference_adapter=True)
    info = load_llm_checkpoint(loaded, out)
    assert (info.kind, info.step, info.rebuilt) == ("lora", 7, False)
    want = {n: p for n, p in policy.model.named_parameters() if ".default." in n}
    got = dict(loaded.model.named_parameters())
    assert all(torch.equal(got[n], p) for n, p in want.items())
    assert torch.equal(_logp(loaded, comps), _logp(policy, comps))
    assert torch.equal(_logp(loaded.reference_policy(), comps), _logp(policy, comps))  # copied in
    plain = peft.PeftModel.from_pretrained(_base(tiny), str(out))  # PEFT reads it as it is
    assert torch.equal(_logp(CausalLMPolicy(plain, tok), comps), _logp(policy, comps))


def test_full_model_checkpoint_round_trip_is_exact(tiny, tmp_path: Path) -> None:
    tok = tiny["tok"]
    policy = CausalLMPolicy(_base(tiny), tok)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    out = save_llm_checkpoint(policy, tmp_path / "full")
    fresh = CausalLMPolicy(_base(tiny), tok)
    assert load_llm_checkpoint(fresh, out).kind == "full"
    want = policy.model.state_dict()
    assert all(torch.equal(t, want[n]) for n, t in fresh.model.state_dict().items())
    with pytest.raises(TypeError, match=r"holds a whole model .*but the policy.s model is a PEFT model"):
        load_llm_checkpoint(CausalLMPolicy(_lora(tiny), tok), out)


def test_checkpoint_errors_before_any_weight_changes(tiny, tmp_path: Path) -> None:
    tok = tiny["tok"]
    out = save_llm_checkpoint(CausalLMPolicy(_lora(tiny, r=4), tok), tmp_path / "r4")
    live = CausalLMPolicy(_lora(tiny, r=8, seed=3), tok)
    weights = {n: p.detach().clone() for n, p in live.model.named_parameters()}
    with pytest.raises(ValueError, match=r"r: 8 here, 4 in the checkpoint.*merge_lora_configs=True"):
        load_llm_checkpoint(live, out)
    with pytest.raises(TypeError, match=r"holds a LoRA adapter but the policy's model is not a PEFT"):
        load_llm_checkpoint(CausalLMPolicy(_base(tiny), tok), out)
    same = CausalLMPolicy(_lora(tiny, r=4, seed=4), tok)
    same_weights = {n: p.detach().clone() for n, p in same.model.named_parameters()}
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((out / "adapter_config.json").read_text())
    (bad / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match=r"not a readable safetensors file"):
        load_llm_checkpoint(same, bad)
    from safetensors.torch import load_file, save_file

    forged = {k: v for k, v in load_file(str(out / "adapter_model.safetensors")).items()}
    key = next(k for k in forged if k.endswith("lora_A.weight"))
    forged[key] = torch.zeros(5, 3)
    save_file(forged, str(bad / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=r"has shape \(5, 3\), the live model's has \(4, 32\)"):
        load_llm_checkpoint(same, bad)
    with pytest.raises(ValueError, match=r"is torch.float32 \(5, 3\); a rank-4 LoRA weight"):
        load_llm_checkpoint(live, bad, merge_lora_configs=True)
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3", "r": 4}))
    with pytest.raises(ValueError, match=r"peft_type is 'IA3'"):
        load_llm_checkpoint(same, bad)
    trainer = GRPOTrainer(
        GRPOConfig(device="cpu", group_size=2, batch_size=1), CausalLMPolicy(_lora(tiny, r=2), tok), _reward()
    )
    with pytest.raises(ValueError, match=r"before building the GRPOTrainer"):
        load_llm_checkpoint(trainer, out, merge_lora_configs=True)
    with_ref = CausalLMPolicy(_lora(tiny, r=2), tok, use_separate_reference_adapter=True)
    with pytest.raises(ValueError, match=r"r 2 -> 4.*Pass copy_to_reference=True"):
        load_llm_checkpoint(with_ref, out, merge_lora_configs=True, copy_to_reference=False)
    assert all(torch.equal(p, weights[n]) for n, p in live.model.named_parameters())
    assert all(torch.equal(p, same_weights[n]) for n, p in same.model.named_parameters())


@pytest.mark.parametrize(
    ("live_r", "ckpt_r", "live_targets"),
    [(8, 4, ("q_proj", "v_proj")), (8, 4, ("q_proj", "k_proj")), (2, 4, ("q_proj", "k_proj"))],
)
def test_merge_lora_configs_reproduces_the_checkpoint_adapter(
    tiny, tmp_path: Path, live_r, ckpt_r, live_targets
) -> None:
    """Different r, target_modules and lora_alpha: the merged adapter (r = max, union of targets,
    the live alpha with a warning) computes what the checkpoint's adapter computes."""
    tok = tiny["tok"]
    comps = _comps(tok)
    saved = CausalLMPolicy(_lora(tiny, r=ckpt_r, targets=("q_proj", "v_proj"), alpha=8, seed=6), tok)
    out = save_llm_checkpoint(saved, tmp_path / "ckpt")
    live = CausalLMPolicy(_lora(tiny, r=live_r, targets=live_targets, alpha=16, seed=7), tok)
    with pytest.warns(UserWarning, match=r"kept for lora_alpha=16 \(checkpoint: 8\)"):
        info = load_llm_checkpoint(live, out, merge_lora_configs=True)
    grows = "k_proj" in live_targets
    assert info.rebuilt == (ckpt_r > live_r or grows)  # a larger adapter: new tensors
    assert set(info.merged) == {"r", "lora_alpha"} | ({"target_modules"} if grows else set())
    cfg = live.model.peft_config["default"]
    assert cfg.r == max(live_r, ckpt_r)
    assert set(cfg.target_modules) == {"q_proj", "v_proj", *live_targets}
    torch.testing.assert_close(_logp(live, comps), _logp(saved, comps), atol=1e-5, rtol=0)
    assert set(live.get_parameters()) == {n for n, _ in live.model.named_parameters() if "lora_" in n}


def test_pad_lora_pair_keeps_the_product() -> None:
    g = torch.Generator().manual_seed(0)
    a_c, b_c = torch.randn(2, 5, generator=g), torch.randn(3, 2, generator=g)
    fill = torch.randn(4, 5, generator=g)
    a, b = pad_lora_pair(a_c, b_c, fill, (3, 4), ratio=0.5)
    torch.testing.assert_close(b @ a, 0.5 * b_c @ a_c)  # s * B'A' = s_c * B_c A_c with s_c / s = 0.5
    assert torch.equal(a[2:], fill[2:])
    assert torch.equal(b[:, 2:], torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r"ranks do not fit"):
        pad_lora_pair(fill, torch.randn(3, 4), a_c, (3, 2), ratio=1.0)


def test_base_model_state_dict_saves_the_base_without_a_copy(tiny: dict[str, object], tmp_path: Path) -> None:
    """The base weights written from `base_model_state_dict` load as the plain base model: its
    logits equal the PEFT model's with the adapter disabled, and equal the original checkpoint's."""
    from transformers import AutoModelForCausalLM

    from grpo.llm.lora import base_model_state_dict

    model = _lora(tiny)
    state = base_model_state_dict(model)
    assert not [n for n in state if "lora_" in n or "base_layer" in n]
    model.get_base_model().save_pretrained(tmp_path, state_dict=state, safe_serialization=True)
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    ids = torch.tensor([[3, 7, 11, 5, 2]])
    with torch.no_grad(), model.disable_adapter():
        want = model(input_ids=ids).logits
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, want)
        assert torch.equal(_base(tiny)(input_ids=ids).logits, want)
        assert not torch.equal(model(input_ids=ids).logits, want)  # the adapter changes them
