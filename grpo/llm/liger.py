"""Liger-Kernel's fused linear GRPO loss, for the settings it covers (``GRPOConfig.use_liger_loss``).

`liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss` takes the LM head's input (the last hidden
states) and weight and computes the clipped policy loss and the k3 KL term chunk by chunk (a few
sequences at a time), never holding the (n, T, V) logits. It needs the ``liger-kernel`` package
(``pip install liger-kernel``, which pulls in Triton); the chunked loss itself is PyTorch with
`torch.compile` (``compiled=True``), so it also runs on CPU. It computes the same function as
grpo's default path (`grpo.llm.logprobs.chunked_token_logprobs` then
`grpo.grpo_objective.GRPOObjective`) for:

    policy_loss  "clip" (Liger: token-level ratio), "gspo" (sequence-level ratio), "cispo" with
                 clip_epsilon = 1 (no lower bound; Liger's CISPO has none; its loss_type "cispo"
                 normalises per token like DAPO)
    aggregation  "token-mean" -> Liger "bnpo" ("cispo": its own), "seq-mean-token-mean" -> "grpo",
                 "seq-mean-token-sum-norm" -> "dr_grpo" (max_completion_length = loss_normaliser)
    KL           kl_coeff = 0, or the k3 estimator in the loss (kl_penalty = "loss")

and not for: an entropy term (entropy_coeff > 0), the dual clip, "sapo"/"reinforce" and user loss
or KL functions, the sampler correction (sampler_is_cap), "seq-mean-token-sum", KL folded into the
reward or the advantages with a KL estimator other than k3. `liger_config_problems` lists what a
config asks for beyond that; `LigerGRPOLoss(config)` raises on it. One difference that is not a
setting: Liger does not clamp the log-ratio (grpo clamps it to +-log_ratio_clamp, 20 by
default), so the two agree while |logp - logp_old| < log_ratio_clamp.

The core imports nothing of this module: it registers `liger_config_problems` and
`build_liger_loss` as the loss plugin ``"liger"`` (`grpo.algorithms.loss_plugins`) when imported
(``import grpo.llm`` imports it). In the trainer: ``GRPOConfig(use_liger_loss=True)`` (checked
with `liger_config_problems` when the config is built, or else when the trainer builds the loss)
makes `GRPOTrainer` compute each micro-batch's loss with `LigerGRPOLoss` on
`grpo.llm.CausalLMPolicy.lm_head_inputs` (the backbone's last hidden states and the LM head)
instead of log-probs + `GRPOObjective` (`grpo.update.loop.FusedLoss`, one branch in the update).
Metrics: Liger gives the loss, the clipped share (low and high together: ``clip/frac``) and the
k3 KL to the reference when it is in the loss (``kl/ref``); `OMITTED_METRICS` are not reported.
Per-step advantages (shape (N, T)) are refused, and when collection did not record the behaviour
log-probs the first epoch computes them with one more no-grad LM-head pass.

Status: the loss, its config checks, its equality with the default path (loss and gradients) and
a `GRPOTrainer` step with ``use_liger_loss=True`` against the default step (weights and the
reported metrics; tests/test_llm_fused.py, marker ``gpu``; benchmarks/GPU.md has the commands)
were checked on CPU with liger-kernel 0.8.5 (``GRPO_TEST_GPU_DEVICE=cpu``, uncompiled, and compiled
with torch 2.13's CPU inductor) and on an H200 (torch 2.11.0+cu130, transformers 5.17, 2026-11-27):
the loss and gradient equality compiled, the trainer step uncompiled. Compiled on that torch, the
trainer step with two epochs and micro-batches of one row fails inside dynamo when Liger's loss is
recompiled for a new shape ("sources must not be empty for symbol s37", a torch guard error), so
`GRPOTrainer` compiles Liger's loss only on CUDA with torch >= 2.13 (`compile_liger_loss`).
Under torch.distributed, Liger's "cispo" normaliser is its own all-reduced token
count / world size, which the rescaling here does not model (not checked).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from grpo.algorithms.aggregation import aggregation_normaliser
from grpo.algorithms.loss_plugins import LossPlugin, register_loss_plugin
from grpo.grpo_objective import ObjectiveOutput
from grpo.llm.logprobs import chunked_token_logprobs

if TYPE_CHECKING:
    from grpo.config import GRPOConfig
    from grpo.llm.policy import LMHeadInputs

__all__ = [
    "LIGER_LOSS_TYPES",
    "OMITTED_METRICS",
    "LigerGRPOLoss",
    "build_liger_loss",
    "compile_liger_loss",
    "liger_config_problems",
    "require_liger",
]

# grpo's loss_aggregation -> Liger's loss_type
LIGER_LOSS_TYPES: dict[str, str] = {
    "token-mean": "bnpo",
    "seq-mean-token-mean": "grpo",
    "seq-mean-token-sum-norm": "dr_grpo",
}
_LOSSES = ("clip", "gspo", "cispo")


def liger_config_problems(config: GRPOConfig) -> list[str]:
    """What ``config`` asks for that Liger's fused GRPO loss does not compute (empty: none), each
    as "setting: why / what to set". `GRPOConfig` validation calls it through the loss registry
    (`grpo.algorithms.loss_plugins`, name ``"liger"``) once this module is imported."""
    c = config
    out: list[str] = []
    if c.policy_loss not in _LOSSES:
        out.append(f"policy_loss={c.policy_loss!r}: Liger covers {_LOSSES}")
    if c.policy_loss == "cispo" and c.clip_epsilon != 1.0:
        out.append(f"clip_epsilon={c.clip_epsilon!r} with 'cispo': Liger's CISPO has no lower bound; set 1.0")
    if c.loss_aggregation not in LIGER_LOSS_TYPES:
        out.append(f"loss_aggregation={c.loss_aggregation!r}: Liger covers {tuple(LIGER_LOSS_TYPES)}")
    if c.policy_loss == "cispo" and c.loss_aggregation != "token-mean":
        out.append("'cispo' in Liger normalises per token (DAPO); set loss_aggregation='token-mean'")
    if c.entropy_coeff != 0.0:
        out.append(f"entropy_coeff={c.entropy_coeff!r}: Liger's loss has no entropy term; set 0")
    if c.dual_clip:
        out.append("dual_clip=True: Liger has no dual clip; set False")
    if c.kl_coeff != 0.0 and c.kl_penalty != "reward" and (c.kl_estimator != "k3" or c.kl_penalty != "loss"):
        out.append(
            f"kl_estimator={c.kl_estimator!r}, kl_penalty={c.kl_penalty!r}: Liger's KL term is k3 in "
            "the loss; set kl_estimator='k3', kl_penalty='loss' (or kl_coeff=0)"
        )
    if c.sampler_is_cap is not None:
        out.append("sampler_is_cap: Liger's loss takes no importance weights; set None")
    if c.adaptive_lr_kl is not None:
        out.append("adaptive_lr_kl: needs kl/old, which Liger's loss does not report; set None")
    return out


COMPILED_FROM = (2, 13)
"""The first torch release whose dynamo compiled Liger's loss through a whole trainer step here
(torch 2.13 CPU inductor; torch 2.11 + CUDA failed, see the module docstring)."""


def compile_liger_loss(device: torch.device, torch_version: str = torch.__version__) -> bool:
    """Whether `GRPOTrainer` compiles Liger's loss (Liger's ``compiled``): on CUDA with torch >=
    `COMPILED_FROM`. Uncompiled, the loss is the same function, only slower; on the CPU Liger's
    compiled path gains nothing worth an inductor build."""
    release = tuple(int(p) for p in torch_version.split("+")[0].split(".")[:2])
    return device.type == "cuda" and release >= COMPILED_FROM


OMITTED_METRICS: frozenset[str] = frozenset(
    {
        "loss/policy",
        "loss/kl",
        "loss/entropy",
        "kl/old",
        "policy/entropy",
        "ratio/mean",
        "ratio/min",
        "ratio/max",
        "clip/frac_low",
        "clip/frac_high",
    }
)
"""Update metrics `GRPOTrainer` does not report with ``use_liger_loss`` (Liger's loss gives only
the loss, its clipped share, low and high together, reported as ``clip/frac``, and the KL to the
reference when it is in the loss, ``kl/ref``)."""


def require_liger() -> Any:
    """The ``liger_kernel.chunked_loss`` module, or an ImportError saying how to install it."""
    if importlib.util.find_spec("liger_kernel") is None:
        raise ImportError(
            "LigerGRPOLoss needs the liger-kernel package: pip install liger-kernel (it pulls "
            "in Triton; the chunked GRPO loss itself is PyTorch + torch.compile). grpo's own "
            "chunked log-probs (the default path) keep the (B, T, V) logits out of memory too."
        )
    return importlib.import_module("liger_kernel.chunked_loss")


class LigerGRPOLoss:
    """Liger's `LigerFusedLinearGRPOLoss` set up from a `GRPOConfig` (see the module docstring).

    Args:
        config: the run's config; ValueError listing `liger_config_problems` when it has any.
        temperature: the sampling temperature (logits are divided by it, as grpo scores).
        chunk_size: sequences per Liger chunk.
        compiled: Liger's own `torch.compile` of its chunk function (its default, True).
    """

    def __init__(
        self, config: GRPOConfig, *, temperature: float = 1.0, chunk_size: int = 1, compiled: bool = True
    ) -> None:
        problems = liger_config_problems(config)
        if problems:
            raise ValueError("LigerGRPOLoss cannot compute this config's loss: " + "; ".join(problems))
        chunked = require_liger()
        self.aggregation = config.loss_aggregation
        self.loss_normaliser = config.loss_normaliser
        cispo = config.policy_loss == "cispo"
        loss_type = "cispo" if cispo else LIGER_LOSS_TYPES[config.loss_aggregation]
        kl = 0.0 if config.kl_penalty == "reward" else config.kl_coeff
        self.loss = chunked.LigerFusedLinearGRPOLoss(
            beta=kl,
            compiled=compiled,
            use_ref_model=kl != 0.0,
            chunk_size=chunk_size,
            epsilon_low=config.clip_epsilon,
            # Liger's CISPO caps the weight at epsilon_high itself; grpo's at 1 + eps_high
            epsilon_high=(1.0 + config.resolved_clip_epsilon_high)
            if cispo
            else config.resolved_clip_epsilon_high,
            loss_type=loss_type,
            max_completion_length=int(config.loss_normaliser) if loss_type == "dr_grpo" else None,  # type: ignore[arg-type]
            importance_sampling_level="sequence" if config.policy_loss == "gspo" else "token",
            temperature=temperature,
        )

    def __call__(
        self,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        mask: Tensor,
        advantages: Tensor,
        *,
        bias: Tensor | None = None,
        logp_old: Tensor | None = None,
        logp_ref: Tensor | None = None,
        normaliser: Tensor | float | None = None,
        temperature: float | None = None,
    ) -> tuple[Tensor, list[Tensor]]:
        """The loss of one micro-batch and Liger's metrics (mean KL if any, clipped share).

        Shapes: hidden (n, T, H) (the state at t scores targets[:, t]), weight (V, H), targets /
        mask / logp_old / logp_ref (n, T), advantages (n,). ``logp_old`` None: on-policy (ratio 1).
        ``normaliser``: the whole optimizer step's Z (`GRPOObjective.normaliser`); Liger divides by
        its own count (valid tokens; for "grpo" / "dr_grpo" all n rows, empty ones included), so
        the loss is rescaled by that count / Z. None: Z of ``mask`` (the call is the whole step).
        ``temperature``: the completions' sampling temperature (None: the one set at construction).
        """
        if temperature is not None:
            self.loss.temperature = temperature
        loss, metrics = self.loss(
            hidden,
            weight,
            targets,
            mask.to(hidden.dtype),
            advantages,
            bias,
            ref_per_token_logps=logp_ref,
            old_per_token_logps=logp_old,
        )
        if normaliser is None:
            normaliser = aggregation_normaliser(mask, self.aggregation, constant=self.loss_normaliser)
        own: Tensor | float = float(mask.shape[0])  # Liger's "grpo": rows, empty ones included
        if self.aggregation == "token-mean":  # "bnpo", "cispo": valid tokens, at least 1
            own = aggregation_normaliser(mask, "token-mean")
        elif self.aggregation == "seq-mean-token-sum-norm":  # "dr_grpo": rows x C
            own = own * float(self.loss_normaliser or 1.0)
        return loss * (own / normaliser), list(metrics)

    # ---- the update's loss (GRPOConfig.use_liger_loss) -----------------------------------
    def inputs(self, policy: Any, actions: Any) -> LMHeadInputs:
        """The LM head inputs of ``actions`` from ``policy.lm_head_inputs`` (one backbone forward)."""
        out: LMHeadInputs = policy.lm_head_inputs(actions)
        return out

    def objective(
        self,
        inputs: LMHeadInputs,
        mask: Tensor,
        advantages: Tensor,
        normaliser: Tensor | float,
        *,
        logp_old: Tensor | None,
        logp_ref: Tensor | None,
    ) -> ObjectiveOutput:
        """The update's `ObjectiveOutput` of one micro-batch: Liger's loss, and the statistics
        Liger gives (loss, valid steps, clipped steps in ``clip_low``: low and high together, the
        k3 KL to the reference when it is in the loss); the others are NaN and left out of the
        metrics (`OMITTED_METRICS`). ``mask``: the loss mask (inputs.mask without dropped rows)."""
        loss, metrics = self(
            inputs.hidden,
            inputs.weight,
            inputs.targets,
            mask,
            advantages,
            bias=inputs.bias,
            logp_old=logp_old,
            logp_ref=logp_ref if self.loss.use_ref_model else None,
            normaliser=normaliser,
            temperature=inputs.temperature,
        )
        nan = torch.full((), float("nan"), device=loss.device)
        steps = mask.sum().to(torch.float32)
        kl = metrics[0].float() * steps if self.loss.use_ref_model else torch.zeros_like(steps)
        clipped = metrics[-1].float() * steps
        head = loss.detach().float()
        stats = torch.stack([head, nan, nan, nan, steps, clipped, nan, nan, kl, nan, nan])
        return ObjectiveOutput(loss, stats, torch.stack([nan, nan]))

    def omitted_metrics(self, has_reference: bool) -> frozenset[str]:
        """The update metrics this loss does not give (`OMITTED_METRICS`, and kl/ref when a
        reference is scored but its KL is not in Liger's loss, ``kl_penalty="reward"``)."""
        extra = {"kl/ref"} if has_reference and not self.loss.use_ref_model else set()
        return OMITTED_METRICS | extra

    @staticmethod
    def log_probs(inputs: LMHeadInputs) -> Tensor:
        """Detached log-probs (n, T) of ``inputs``' targets, 0 off the mask (the behaviour
        log-probs when collection did not record them: one more LM head pass, no graph)."""
        with torch.no_grad():
            h, w = inputs.hidden.detach(), inputs.weight.detach()
            bias = None if inputs.bias is None else inputs.bias.detach()
            lp, _ = chunked_token_logprobs(h, w, inputs.targets, bias=bias, temperature=inputs.temperature)
        return torch.where(inputs.mask, lp, torch.zeros((), device=lp.device))


def build_liger_loss(config: GRPOConfig, device: torch.device) -> LigerGRPOLoss:
    """The update's loss for ``GRPOConfig(use_liger_loss=True)`` on ``device`` (compiled as
    `compile_liger_loss` says); ValueError naming `liger_config_problems`, ImportError without
    liger-kernel."""
    return LigerGRPOLoss(config, compiled=compile_liger_loss(device))


# the trainer finds Liger's loss by name (grpo.algorithms.loss_plugins): the core imports no LLM code
register_loss_plugin("liger", LossPlugin(liger_config_problems, build_liger_loss))
