"""Liger-Kernel's fused linear GRPO loss, for the settings it covers (not yet called by `GRPOTrainer`).

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
config asks for beyond that; `LigerGRPOLoss(config)` raises on it. One difference that
is not a setting: Liger does not clamp the log-ratio (grpo clamps it to +-log_ratio_clamp, 20 by
default), so the two agree while |logp - logp_old| < log_ratio_clamp.

Status: the loss, its config checks and its equality with the default path (loss and gradients,
tests/test_llm_fused.py, marker ``gpu``; benchmarks/GPU.md has the commands) were checked on CPU
with liger-kernel 0.8.5 (``GRPO_TEST_GPU_DEVICE=cpu``, ``compiled=False``); not yet on CUDA, and
`GRPOTrainer` does not call it yet (the update loop computes log-probs, then the objective; Liger
needs the hidden states in their place).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from torch import Tensor

from grpo.algorithms.aggregation import aggregation_normaliser

if TYPE_CHECKING:
    from grpo.config import GRPOConfig

__all__ = ["LIGER_LOSS_TYPES", "LigerGRPOLoss", "liger_config_problems", "require_liger"]

# grpo's loss_aggregation -> Liger's loss_type
LIGER_LOSS_TYPES: dict[str, str] = {
    "token-mean": "bnpo",
    "seq-mean-token-mean": "grpo",
    "seq-mean-token-sum-norm": "dr_grpo",
}
_LOSSES = ("clip", "gspo", "cispo")


def liger_config_problems(config: GRPOConfig) -> list[str]:
    """What ``config`` asks for that Liger's fused GRPO loss does not compute (empty: none), each
    as "setting: why / what to set"."""
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
    return out


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
    ) -> tuple[Tensor, list[Tensor]]:
        """The loss of one micro-batch and Liger's metrics (mean KL if any, clipped share).

        Shapes: hidden (n, T, H) (the state at t scores targets[:, t]), weight (V, H), targets /
        mask / logp_old / logp_ref (n, T), advantages (n,). ``logp_old`` None: on-policy (ratio 1).
        ``normaliser``: the whole optimizer step's Z (`GRPOObjective.normaliser`); Liger divides by
        this call's own count, so the loss is rescaled by that count / Z. None: the call is the
        whole step.
        """
        loss, metrics = self.loss(
            hidden, weight, targets, mask.to(hidden.dtype), advantages, bias,
            ref_per_token_logps=logp_ref, old_per_token_logps=logp_old,
        )  # fmt: skip
        if normaliser is not None:
            own = aggregation_normaliser(mask, self.aggregation, constant=self.loss_normaliser)
            loss = loss * (own / normaliser)
        return loss, list(metrics)
