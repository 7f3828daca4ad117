"""Fused kernels of the LLM path (issue 28, item 9): the one-buffer chunked log-probs, their
`torch.compile` option (``compiled=True``, ``CausalLMPolicy(compile_logprobs=True)``) and Liger's
fused linear GRPO loss (`grpo.llm.liger.LigerGRPOLoss`), each against the default path.

Tolerances: float64 comparisons to the naive full-logits computation at 1e-10 (the same formulas,
summed in another order); float32 compiled vs eager at 1e-5 absolute on log-probs and entropies
(logsumexp of ~10 over 5,000 logits: rounding ~1e-6), 1e-5 absolute and 1e-4 relative on the
gradients (sums over 5,000 logits in another order: differences up to 3.4e-6 seen).
Compiling takes ~20 s per kernel set on a 2-core CPU, so those tests carry ``slow``; the Liger
comparisons (the loss, and a `GRPOTrainer` step with ``use_liger_loss``) need CUDA and
liger-kernel (``gpu``; ``GRPO_TEST_GPU_DEVICE=cpu`` runs them on the CPU).
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from grpo import GRPOConfig
from grpo.llm.logprobs import VOCAB_BLOCK, chunked_token_logprobs, naive_token_logprobs
from grpo.llm.sampling_settings import SamplingSettings


def _inputs(n: int, v: int, h: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g, dtype=dtype) * 2).requires_grad_(True)
    weight = (torch.randn(v, h, generator=g, dtype=dtype) / h**0.5).requires_grad_(True)
    targets = torch.randint(0, v, (n,), generator=g)
    a = torch.randn(n, generator=g, dtype=dtype)
    b = torch.randn(n, generator=g, dtype=dtype)
    return hidden, weight, targets, a, b


def _values_and_grads(
    fn: object, hidden: torch.Tensor, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None
) -> list[torch.Tensor]:
    """log-probs, entropy and the gradients of sum(a lp + b H) w.r.t. hidden and weight."""
    hidden.grad = weight.grad = None
    lp, ent = fn()  # type: ignore[operator]
    loss = (a * lp).sum() + ((b * ent).sum() if b is not None else 0.0)
    loss.backward()
    assert hidden.grad is not None
    assert weight.grad is not None
    return [lp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone()]


@pytest.mark.parametrize("entropy_grad", [True, False])
def test_one_buffer_chunks_equal_the_naive_logits_in_float64(entropy_grad: bool) -> None:
    """The in-place chunk forward (vocabulary blocks of VOCAB_BLOCK for the entropy) and the
    one-buffer backward give the full-logits values and gradients: V spans two vocabulary
    blocks, the rows three chunks (the last one short), temperature 0.7."""
    v = VOCAB_BLOCK + 904
    hidden, weight, targets, a, b = _inputs(40, v, 8, torch.float64)
    b_used = b if entropy_grad else None

    def chunked() -> tuple[torch.Tensor, torch.Tensor]:
        lp, ent = chunked_token_logprobs(
            hidden, weight, targets, chunk_size=16, with_entropy=True, temperature=0.7
        )
        assert ent is not None
        return lp, ent if entropy_grad else ent.detach()

    def naive() -> tuple[torch.Tensor, torch.Tensor]:
        return naive_token_logprobs(hidden @ weight.T, targets, temperature=0.7)

    got = _values_and_grads(chunked, hidden, weight, a, b_used)
    want = _values_and_grads(naive, hidden, weight, a, b_used)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)


def test_log_probs_without_entropy_equal_the_naive_ones_in_float64() -> None:
    """``with_entropy=False``: logsumexp in the logits' own buffer, same values and gradients."""
    hidden, weight, targets, a, _ = _inputs(30, 300, 6, torch.float64, seed=1)

    def chunked() -> tuple[torch.Tensor, torch.Tensor]:
        lp, _ = chunked_token_logprobs(hidden, weight, targets, chunk_size=8)
        return lp, torch.zeros_like(lp)

    def naive() -> tuple[torch.Tensor, torch.Tensor]:
        lp, _ = naive_token_logprobs(hidden @ weight.T, targets)
        return lp, torch.zeros_like(lp)

    for x, y in zip(
        _values_and_grads(chunked, hidden, weight, a, None),
        _values_and_grads(naive, hidden, weight, a, None),
        strict=True,
    ):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)


def test_compiled_needs_chunks_and_no_softcap() -> None:
    hidden, weight, targets, _, _ = _inputs(4, 10, 3, torch.float32)
    with pytest.raises(ValueError, match=r"chunk_size=None asks for the full-logits"):
        chunked_token_logprobs(hidden, weight, targets, chunk_size=None, compiled=True)
    with pytest.raises(ValueError, match=r"soft-capped logits \(softcap=30.0"):
        chunked_token_logprobs(hidden, weight, targets, softcap=30.0, compiled=True)


def test_policy_refuses_compile_without_chunks(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from grpo.llm import CausalLMPolicy
    from tests.llm_helpers import build_model, build_tokenizer

    tok = build_tokenizer(tmp_path)
    model = build_model(tmp_path, tok)
    with pytest.raises(ValueError, match=r"compile_logprobs=True compiles .* logprob_chunk_size=None"):
        CausalLMPolicy(model, tok, logprob_chunk_size=None, compile_logprobs=True)
    with pytest.raises(TypeError, match=r"compile_logprobs='yes' must be True or False"):
        CausalLMPolicy(model, tok, compile_logprobs="yes")  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize("entropy_grad", [True, False])
def test_compiled_kernels_equal_the_eager_ones(entropy_grad: bool) -> None:
    """float32: ``compiled=True`` gives the eager chunked values (1e-5) and gradients (1e-5
    absolute, 1e-4 relative), with the entropy's gradient and without it; rows not a multiple of the chunk."""
    hidden, weight, targets, a, b = _inputs(70, 5000, 16, torch.float32, seed=2)
    b_used = b if entropy_grad else None

    def run(compiled: bool) -> list[torch.Tensor]:
        def fn() -> tuple[torch.Tensor, torch.Tensor]:
            lp, ent = chunked_token_logprobs(
                hidden, weight, targets, chunk_size=32, with_entropy=True, temperature=0.8,
                compiled=compiled,
            )  # fmt: skip
            assert ent is not None
            return lp, ent if entropy_grad else ent.detach()

        return _values_and_grads(fn, hidden, weight, a, b_used)

    eager, compiled = run(False), run(True)
    for x, y in zip(compiled[:2], eager[:2], strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-5)
    for x, y in zip(compiled[2:], eager[2:], strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_policy_with_compiled_log_probs_scores_like_the_default(tmp_path: Path) -> None:
    """A tiny Llama (from_pretrained): ``compile_logprobs=True`` gives the default policy's
    log-probs, entropies and parameter gradients of sampled completions (float32, 1e-5)."""
    pytest.importorskip("transformers")
    from grpo.llm import CausalLMPolicy
    from tests.llm_helpers import build_model, build_tokenizer

    tok = build_tokenizer(tmp_path, pad_is_eos=True)
    model = build_model(tmp_path, tok)
    plain = CausalLMPolicy(model, tok, SamplingSettings(max_new_tokens=6), logprob_chunk_size=8)
    fused = CausalLMPolicy(
        model, tok, SamplingSettings(max_new_tokens=6), logprob_chunk_size=8, compile_logprobs=True
    )
    torch.manual_seed(0)
    comps = [c for g in plain.generate_actions(["1+2=", "what is 3+4?"], 3) for c in g]

    def score(policy: CausalLMPolicy) -> list[torch.Tensor]:
        model.zero_grad()
        out = policy.evaluate_actions(None, comps, with_entropy=True)
        assert out.entropy is not None
        (out.log_probs.sum() + 0.1 * out.entropy.sum()).backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        return [out.log_probs.detach(), out.entropy.detach(), *grads]

    for x, y in zip(score(fused), score(plain), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


# ---- Liger --------------------------------------------------------------------------------


def test_liger_config_problems_name_each_setting_liger_does_not_compute() -> None:
    """Each setting Liger's kernel does not compute is named with its fix, before anything runs."""
    from grpo.llm.liger import LigerGRPOLoss, liger_config_problems

    assert liger_config_problems(GRPOConfig()) == []
    cases = [
        ({"entropy_coeff": 0.01}, r"entropy_coeff=0.01: Liger's loss has no entropy term; set 0"),
        ({"policy_loss": "sapo"}, r"policy_loss='sapo': Liger covers \('clip', 'gspo', 'cispo'\)"),
        ({"kl_coeff": 0.04, "kl_estimator": "k1"}, r"kl_estimator='k1'.*set kl_estimator='k3'"),
        ({"loss_aggregation": "seq-mean-token-sum"}, r"loss_aggregation='seq-mean-token-sum'"),
    ]
    for settings, message in cases:
        problems = liger_config_problems(GRPOConfig(**settings))  # type: ignore[arg-type]
        assert any(re.search(message, p) for p in problems), (settings, problems)
        with pytest.raises(ValueError, match=r"LigerGRPOLoss cannot compute this config's loss"):
            LigerGRPOLoss(GRPOConfig(**settings))  # type: ignore[arg-type]


def test_the_core_imports_no_liger_code_and_finds_the_loss_by_name() -> None:
    """Liger's loss and its table of what it computes live in grpo.llm.liger; no module outside
    grpo/llm imports it (function-local imports included): the trainer and the config's check find
    it as the loss plugin "liger", which ``import grpo.llm`` registers."""
    import ast

    import grpo
    import grpo.llm  # registers the plugin
    from grpo.algorithms.loss_plugins import loss_plugin
    from grpo.llm import liger

    root = Path(grpo.__file__).parent
    for path in root.rglob("*.py"):
        if path.is_relative_to(root / "llm"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or "", *(f"{node.module}.{a.name}" for a in node.names)]
            assert not any(n.startswith("grpo.llm.liger") for n in names), (path, names)
    assert not hasattr(importlib.import_module("grpo.config"), "liger_config_problems")
    plugin = loss_plugin("liger")
    assert plugin is not None
    assert plugin.problems is liger.liger_config_problems
    assert plugin.build is liger.build_liger_loss
    assert liger.liger_config_problems(GRPOConfig(entropy_coeff=0.01, use_liger_loss=False)) == [
        "entropy_coeff=0.01: Liger's loss has no entropy term; set 0"
    ]


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is not None, reason="liger-kernel installed")
def test_liger_loss_without_the_package_says_how_to_install() -> None:
    from grpo.llm.liger import LigerGRPOLoss

    with pytest.raises(ImportError, match=r"pip install liger-kernel"):
        LigerGRPOLoss(GRPOConfig())


@pytest.mark.parametrize(
    ("device", "version", "compiled"),
    [
        ("cuda", "2.11.0+cu130", False),  # the torch whose dynamo failed on an H200 (2026-11-27)
        ("cuda", "2.12.1", False),
        ("cuda", "2.13.0", True),
        ("cuda", "2.14.1+cu128", True),
        ("cuda", "3.0.0", True),
        ("cpu", "2.13.0+cpu", False),
    ],
)
def test_the_trainer_compiles_liger_only_on_cuda_from_torch_2_13(
    device: str, version: str, compiled: bool
) -> None:
    from grpo.llm.liger import compile_liger_loss

    assert compile_liger_loss(torch.device(device), version) is compiled


def _default_path_loss(
    config: GRPOConfig, hidden: torch.Tensor, weight: torch.Tensor, batch: dict[str, torch.Tensor]
) -> torch.Tensor:
    """grpo's loss of the same inputs: chunked log-probs, then GRPOObjective (what the trainer runs)."""
    from grpo.grpo_objective import GRPOObjective

    objective = GRPOObjective.from_config(config)
    lp, _ = chunked_token_logprobs(hidden, weight, batch["targets"], temperature=0.9, chunk_size=64)
    mask = batch["mask"]
    out = objective(
        lp, batch["logp_old"], batch["advantages"], mask, objective.normaliser(mask),
        logp_ref=batch["logp_ref"],
    )  # fmt: skip
    return out.loss


DEVICE = os.environ.get("GRPO_TEST_GPU_DEVICE", "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="needs liger-kernel")
@pytest.mark.parametrize(
    "settings",
    [
        {"kl_coeff": 0.04},
        {"kl_coeff": 0.0, "loss_aggregation": "seq-mean-token-mean"},
        {"policy_loss": "gspo", "loss_aggregation": "seq-mean-token-mean", "clip_epsilon": 3e-4},
        {"loss_aggregation": "seq-mean-token-sum-norm", "loss_normaliser": 24.0, "kl_coeff": 0.04},
        {"policy_loss": "cispo", "clip_epsilon": 1.0, "clip_epsilon_high": 0.02},
    ],
)
def test_liger_loss_equals_the_default_path_on_cuda(settings: dict[str, object]) -> None:
    """float32 on CUDA: Liger's fused loss and its gradients (hidden, LM head) equal grpo's chunked
    log-probs + GRPOObjective within 1e-4 relative (float32 sums in another order).
    ``GRPO_TEST_GPU_DEVICE=cpu`` runs it on the CPU (Liger's chunked loss is PyTorch; uncompiled)."""
    from grpo.llm.liger import LigerGRPOLoss

    config = GRPOConfig(**settings)  # type: ignore[arg-type]
    dev = torch.device(DEVICE)
    g = torch.Generator().manual_seed(0)
    n, t, h, v = 6, 24, 32, 1000
    hidden = torch.randn(n, t, h, generator=g).to(dev).requires_grad_(True)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dev).requires_grad_(True)
    targets = torch.randint(0, v, (n, t), generator=g).to(dev)
    lengths = torch.tensor([24, 20, 5, 24, 1, 13])
    batch = {
        "targets": targets,
        "mask": (torch.arange(t) < lengths.unsqueeze(1)).to(dev),
        "advantages": torch.randn(n, generator=g).to(dev),
        "logp_old": None,
        "logp_ref": None,
    }
    with torch.no_grad():
        lp, _ = chunked_token_logprobs(hidden, weight, targets, temperature=0.9)
        batch["logp_old"] = lp + 0.05 * torch.randn(n, t, generator=g).to(dev)
        batch["logp_ref"] = lp + 0.1 * torch.randn(n, t, generator=g).to(dev)
    ours = _default_path_loss(config, hidden, weight, batch)
    ours_grads = torch.autograd.grad(ours, [hidden, weight])
    liger = LigerGRPOLoss(config, temperature=0.9, compiled=dev.type == "cuda")
    theirs, _ = liger(
        hidden, weight, targets, batch["mask"], batch["advantages"],
        logp_old=batch["logp_old"], logp_ref=batch["logp_ref"],
    )  # fmt: skip
    theirs_grads = torch.autograd.grad(theirs, [hidden, weight])
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5)
    for x, y in zip(theirs_grads, ours_grads, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


def test_use_liger_loss_is_refused_for_what_liger_does_not_compute(tmp_path: Path) -> None:
    """``GRPOConfig(use_liger_loss=True)`` names each unsupported setting at construction; the
    trainer refuses a policy without ``lm_head_inputs`` and, without the package, says how to
    install it (both before any step)."""
    from grpo import GRPOTrainer

    with pytest.raises(ValueError, match=r"use_liger_loss=True is not allowed: .*entropy_coeff=0.01.*set 0"):
        GRPOConfig(use_liger_loss=True, entropy_coeff=0.01)
    with pytest.raises(ValueError, match=r"adaptive_lr_kl: needs kl/old"):
        GRPOConfig(use_liger_loss=True, adaptive_lr_kl=0.01, num_epochs_per_update=2)
    with pytest.raises(ValueError, match=r"use_liger_loss must be|expected True or False"):
        GRPOConfig(use_liger_loss="yes")  # type: ignore[arg-type]

    class Coin(torch.nn.Module):  # a policy with log-probs but no LM head
        def __init__(self) -> None:
            super().__init__()
            self.logit = torch.nn.Parameter(torch.zeros(2))

        def generate_actions(self, states: Any, num_actions_per_state: int, **kwargs: Any) -> Any:
            return torch.randint(0, 2, (len(states), num_actions_per_state))

        def get_log_probabilities(self, states: object, actions: torch.Tensor) -> torch.Tensor:
            return torch.log_softmax(self.logit, -1)[actions]

        def get_parameters(self) -> dict[str, torch.Tensor]:
            return dict(self.named_parameters())

    config = GRPOConfig(group_size=2, batch_size=2, use_liger_loss=True)
    with pytest.raises(TypeError, match=r"Coin has no lm_head_inputs"):
        GRPOTrainer(config, Coin(), lambda states, actions: [0.0] * len(actions))
    if importlib.util.find_spec("liger_kernel") is None and importlib.util.find_spec("transformers"):
        from grpo.llm import CausalLMPolicy
        from tests.llm_helpers import build_model, build_tokenizer

        tok = build_tokenizer(tmp_path)
        policy = CausalLMPolicy(build_model(tmp_path, tok), tok, SamplingSettings(max_new_tokens=4))
        with pytest.raises(ImportError, match=r"pip install liger-kernel"):
            GRPOTrainer(config, policy, lambda prompts, comps: [0.0] * len(comps))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="needs liger-kernel")
@pytest.mark.parametrize(
    "settings",
    [
        {"kl_coeff": 0.04, "num_epochs_per_update": 2, "micro_batch_size": 1},
        {"kl_coeff": 0.0, "loss_aggregation": "seq-mean-token-mean", "num_mini_batches": 2},
    ],
)
def test_trainer_step_with_liger_loss_gives_the_default_weights(
    tmp_path: Path, settings: dict[str, object]
) -> None:
    """A `GRPOTrainer` step (tiny Llama, SGD) with ``use_liger_loss=True`` gives the weights of
    the default path within the Liger loss tests' tolerance (1e-4 relative, 1e-5 absolute), over
    micro-batches, two epochs (the second off-policy, with the KL in the loss) or two optimizer
    steps; the reported loss, kl/ref and clipped share agree too."""
    pytest.importorskip("transformers")
    import copy

    from grpo import GRPOTrainer
    from grpo.llm import CausalLMPolicy
    from tests.llm_helpers import build_model, build_tokenizer

    tok = build_tokenizer(tmp_path, pad_is_eos=True)
    model = build_model(tmp_path, tok).to(DEVICE)

    def one_step(use_liger: bool) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        m = copy.deepcopy(model)
        policy = CausalLMPolicy(
            m, tok, SamplingSettings(max_new_tokens=6, temperature=0.9), logprob_chunk_size=16, autocast=False
        )
        config = GRPOConfig(
            group_size=4, batch_size=2, seed=0, use_liger_loss=use_liger, clip_epsilon=0.05,
            device=DEVICE, **settings,  # type: ignore[arg-type]
        )  # fmt: skip
        sgd = torch.optim.SGD(m.parameters(), lr=0.5)
        trainer = GRPOTrainer(
            config, policy, lambda p, c: [float(int(x.token_ids.sum()) % 7) for x in c], optimizer=sgd
        )
        torch.manual_seed(0)
        metrics = trainer.step(["1+2=", "what is 3+4?"])
        return {k: v.detach().clone() for k, v in m.named_parameters()}, metrics

    plain_w, plain_m = one_step(False)
    liger_w, liger_m = one_step(True)
    moved = max(float((plain_w[k] - model.state_dict()[k]).abs().max()) for k in plain_w)
    assert moved > 1e-3  # the step changed the weights
    for k in plain_w:
        torch.testing.assert_close(liger_w[k], plain_w[k], rtol=1e-4, atol=1e-5, msg=k)
    assert liger_m["loss/total"] == pytest.approx(plain_m["loss/total"], rel=1e-4, abs=1e-6)
    assert liger_m["kl/ref"] == pytest.approx(plain_m["kl/ref"], rel=1e-4, abs=1e-7)
    clipped = plain_m["clip/frac_low"] + plain_m["clip/frac_high"]
    assert liger_m["clip/frac"] == pytest.approx(clipped, abs=1e-6)
    assert "ratio/mean" not in liger_m
    assert "loss/policy" not in liger_m
