"""`CausalLMPolicy`: any Hugging Face causal LM + tokenizer as a GRPO `PolicyModel`.

Actions are `Completion` objects (the prompt's token ids, the completion's token ids, its text);
states are prompts (strings, chat message lists, or records ``{"prompt": ..., **columns}``, see
`grpo.llm.data`).

Log-probs, the contract the trainer relies on (all of it is tested against a naive per-row
full-logits computation):

* Only completion tokens are scored. Sequences are laid out ``[left padding | prompt |
  completion | right padding]``; the mask is ``j < length`` for completion position ``j`` (by
  position, never by token id), so an EOS is scored even when ``pad_token_id == eos_token_id``.
* The hidden state at position t scores token t + 1; position ids are ``cumsum(attention_mask) - 1``
  so a left-padded row gives the same numbers as the unpadded row (and as ``generate``).
* Logits are divided by the sampling temperature, so collection and training agree with the
  distribution the completions were drawn from. top-k / top-p / min-p truncation and the
  repetition penalty shape sampling only and are not part of the scored density (as in TRL).
* The exact entropy of the temperature-scaled next-token distribution comes from the same
  forward, and the (B, T, V) logits are never materialised (`grpo.llm.logprobs`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple, cast

import torch
from torch import Tensor, nn

from grpo.engine.deepspeed import gathered_state_dict, is_partitioned
from grpo.engine.distributed import get_world_size, is_main_process
from grpo.engine.fsdp import full_state_dict, is_fsdp_sharded, run_as_forward
from grpo.llm._deps import require
from grpo.llm.completion import Completion
from grpo.llm.data import is_chat, prompt_text
from grpo.llm.generation_defaults import log_unapplied_checkpoint_settings, model_generation_defaults_off
from grpo.llm.logprobs import checked_compile_option, chunked_token_logprobs
from grpo.llm.lora import REFERENCE_ADAPTER, SeparateAdapterReference, add_reference_adapter
from grpo.llm.sampler_logprobs import ChosenTokenLogProbs
from grpo.llm.sampling_settings import SamplingSettings
from grpo.policy_base import EntropyRequest, PolicyOutput, entropy_grad_mode

__all__ = [
    "CausalLMPolicy",
    "DisabledAdapterReference",
    "LMHeadInputs",
]


def _is_peft(model: Any) -> bool:
    return callable(getattr(model, "disable_adapter", None)) and callable(
        getattr(model, "get_base_model", None)
    )


def _check_policy_options(sampling: Any, logprob_chunk_size: int | None) -> None:
    """TypeError / ValueError naming a `CausalLMPolicy` argument of the wrong type or out of range
    (the sampling settings check themselves: `SamplingSettings`)."""
    if not isinstance(sampling, SamplingSettings):
        raise TypeError(
            f"CausalLMPolicy(sampling=...) takes a grpo.llm.SamplingSettings, got "
            f"{type(sampling).__name__}; e.g. CausalLMPolicy(model, tokenizer, "
            f"SamplingSettings(max_new_tokens=256, temperature=0.7))."
        )
    if logprob_chunk_size is not None and logprob_chunk_size < 1:
        raise ValueError(f"logprob_chunk_size={logprob_chunk_size!r} must be >= 1 or None.")


def _eos_token_ids(tokenizer: Any, model: Any) -> list[int]:
    """The ids that end a completion: the tokenizer's EOS and the model's generation_config ones,
    without repeats, in that order."""
    eos = tokenizer.eos_token_id
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids: list[int] = []
    for v in (eos, gen_eos):
        if isinstance(v, int):
            ids.append(v)
        elif isinstance(v, (list, tuple)):
            ids.extend(int(x) for x in v)
    if not ids:
        raise ValueError(
            "the tokenizer has no eos_token_id, so completions could never stop. Set "
            "tokenizer.eos_token (e.g. tokenizer.eos_token = '</s>')."
        )
    return list(dict.fromkeys(ids))


def _scoring_temperature(comps: Sequence[Any]) -> float:
    """The one temperature the completions ``comps`` were sampled at (TypeError for an item that is
    not a `Completion`, ValueError for none or several temperatures)."""
    bad = [i for i, c in enumerate(comps) if not isinstance(c, Completion)]
    if bad:
        raise TypeError(
            f"CausalLMPolicy.evaluate_actions expects grpo.llm.Completion actions (from "
            f"generate_actions); item {bad[0]} is {type(comps[bad[0]]).__name__}."
        )
    if not comps:
        raise ValueError("evaluate_actions got no completions.")
    temps: set[float] = {c.temperature for c in comps}
    if len(temps) > 1:
        raise ValueError(
            f"completions sampled at different temperatures {sorted(temps)} cannot be scored "
            "in one call; score each temperature separately."
        )
    return temps.pop()


def _eos_ban(comps: Sequence[Completion], t: int, device: torch.device) -> Tensor | None:
    """(N, T) bool: the positions where a completion's EOS ids were banned when it was sampled
    (its first ``min_new_tokens``); None when no completion had a ban."""
    mins = [c.min_new_tokens for c in comps]
    if not any(mins):
        return None
    return (torch.arange(t).unsqueeze(0) < torch.tensor(mins).unsqueeze(1)).to(device)


class _HeadLogits(NamedTuple):
    """The LM head and the logit transforms of `grpo.llm.logprobs.chunked_token_logprobs`:
    ``z = softcap(logit_scale * (h W^T + b)) / temperature`` for chosen vocabulary rows."""

    weight: Tensor
    bias: Tensor | None
    scale: float
    softcap: float | None
    temperature: float

    def __call__(self, h: Tensor, rows: Tensor) -> Tensor:
        """Logits of the vocabulary ids ``rows``: h (N, m, H), rows (E,) -> (N, m, E); rows (N, m)
        -> (N, m) (one id per position)."""
        w = self.weight[rows].float()
        z = h.float() @ w.T if rows.dim() == 1 else (h.float() * w).sum(-1)
        if self.bias is not None:
            z = z + self.bias[rows].float()
        z = z * self.scale
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z / self.temperature


def _renormalised_without_eos(
    hidden: Tensor,
    head: _HeadLogits,
    targets: Tensor,
    logp: Tensor,
    entropy: Tensor | None,
    ban: Tensor,
    eos_ids: Sequence[int],
) -> tuple[Tensor, Tensor | None]:
    """Log-probs and entropy of the distribution sampled under a min_new_tokens ban: at a banned
    position the EOS ids E were removed and the rest renormalised, ``q_v = p_v / (1 - P)`` with
    ``P = sum_{e in E} p_e``. From the unbanned ``logp`` of the target y and entropy H:

        log p_e = logp_y + z_e - z_y                       (E logits and y's, small matmuls)
        log q_y = logp_y - log(1 - P)                      (-inf if y is an EOS id)
        H_q     = (H + sum_e p_e log p_e) / (1 - P) + log(1 - P)

    Shapes: hidden (N, T, H), targets / logp / entropy / ban (N, T) -> (N, T). Differentiable
    (autograd over the few extra logits); only the first max(min_new_tokens) positions change.
    """
    m = int(ban.sum(1).max())
    h, y, b, lp = hidden[:, :m], targets[:, :m], ban[:, :m], logp[:, :m]
    eos = torch.tensor(list(eos_ids), device=targets.device)
    log_pe = lp.unsqueeze(-1) + head(h, eos) - head(h, y).unsqueeze(-1)  # (N, m, E)
    log_eos = torch.logsumexp(log_pe, dim=-1)  # log P
    log_rest = torch.log(-torch.expm1(log_eos))  # log(1 - P)
    impossible = torch.isin(y, eos)
    lp_q = torch.where(impossible, torch.full_like(lp, float("-inf")), lp - log_rest)
    logp = torch.cat([torch.where(b, lp_q, lp), logp[:, m:]], dim=1)
    if entropy is not None:
        ent = entropy[:, :m]
        ent_q = (ent + (log_pe.exp() * log_pe).sum(-1)) / log_rest.exp() + log_rest
        entropy = torch.cat([torch.where(b, ent_q, ent), entropy[:, m:]], dim=1)
    return logp, entropy


class _SamplingCall(NamedTuple):
    """How one ``generate`` call samples: the ``GenerationConfig``, the sampling settings, and
    ``synced`` (every process steps until all are done: ZeRO-3 / FSDP)."""

    gen_cfg: Any
    opts: SamplingSettings
    synced: bool


class _ScoringInputs(NamedTuple):
    """What `CausalLMPolicy.evaluate_actions` feeds the model: prompts left-padded to width P,
    completions right-padded to T."""

    input_ids: Tensor  # (N, P+T-1)
    attn: Tensor  # (N, P+T-1) attention mask
    position_ids: Tensor  # (N, P+T-1)
    targets: Tensor  # (N, T) completion ids
    mask: Tensor  # (N, T) bool, by position
    prompt_width: int  # P


class LMHeadInputs(NamedTuple):
    """What a fused LM-head loss (`grpo.llm.liger.LigerGRPOLoss`) needs of N completions, from
    `CausalLMPolicy.lm_head_inputs`: ``logits = (hidden @ weight.T + bias) / temperature``.

    Shapes: hidden (N, T, H) (the state at t scores targets[:, t]; in the weight's dtype),
    weight (V, H), bias (V,) or None, targets (N, T) token ids, mask (N, T) bool by position
    (and the completions' loss masks).
    """

    hidden: Tensor
    weight: Tensor
    bias: Tensor | None
    targets: Tensor
    mask: Tensor
    temperature: float


class CausalLMPolicy:
    """A `PolicyModel` (with ``evaluate_actions``) over a Hugging Face causal LM.

    Args:
        model: an ``AutoModelForCausalLM`` model, or a PEFT model wrapping one (LoRA).
        tokenizer: its tokenizer. If it has no pad token, the EOS token is used for padding.
        sampling: the `SamplingSettings` (temperature, top-p / top-k / min-p, repetition penalty,
            token limits, context window, batch); None = the defaults
            (``SamplingSettings()``: temperature 1, nothing truncated, 256 new tokens). A call may
            override any of them (``generate_actions(..., temperature=t)``).
        use_chat_template: None = render chat prompts (message lists) with the tokenizer's chat
            template and feed strings as they are; True = also wrap string prompts as one user
            message; False = never (chat prompts are then an error).
        system_prompt: prepended as a system message when the chat template is used.
        max_prompt_length: keep at most this many prompt tokens (the last ones); None = all.
        logprob_chunk_size: tokens per chunk of the LM-head computation (memory: one
            (chunk, V) float32 block at a time); None = the model's own full-logits forward.
        gradient_checkpointing: recompute transformer blocks in the backward to save memory.
        autocast: run forward passes under bf16 autocast when on CUDA.
        use_separate_reference_adapter: LoRA only: keep a second, frozen adapter named
            ``"reference"`` (a copy of the actor adapter at construction) as the KL reference,
            refreshed by ``GRPOConfig.reference_update_freq`` (`grpo.llm.lora`). Default False:
            the reference is the model with its adapter disabled (the base weights; no memory).
        compile_logprobs: run the chunked LM-head log-prob kernels through `torch.compile`
            (`grpo.llm.logprobs.compiled_chunk_kernels`; same values up to float rounding; the
            first scoring call compiles). Needs ``logprob_chunk_size``. Off by default: measured
            in benchmarks/llm_memory.py (docs/llm.md, Fused kernels).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        sampling: SamplingSettings | None = None,
        *,
        use_chat_template: bool | None = None,
        system_prompt: str | None = None,
        max_prompt_length: int | None = None,
        logprob_chunk_size: int | None = 512,
        gradient_checkpointing: bool = False,
        autocast: bool = True,
        use_separate_reference_adapter: bool = False,
        compile_logprobs: bool = False,
    ) -> None:
        sampling = SamplingSettings() if sampling is None else sampling
        _check_policy_options(sampling, logprob_chunk_size)
        self.model = model
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.use_chat_template = use_chat_template
        self.system_prompt = system_prompt
        self.max_prompt_length = max_prompt_length
        self.logprob_chunk_size = logprob_chunk_size
        self.compile_logprobs = checked_compile_option(compile_logprobs, logprob_chunk_size)
        self.autocast = autocast
        self.is_peft = _is_peft(model)
        self.eos_token_ids: list[int] = _eos_token_ids(tokenizer, model)
        pad = tokenizer.pad_token_id
        self.pad_token_id: int = int(pad) if pad is not None else self.eos_token_ids[0]
        own = {
            k: getattr(sampling, k) for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
        }
        log_unapplied_checkpoint_settings(self._causal_lm(), own)
        self.reference_adapter: str | None = self._reference_adapter(use_separate_reference_adapter)
        if gradient_checkpointing:
            self.enable_gradient_checkpointing()
        self.last_generation: dict[str, float] = {}

    @property
    def temperature(self) -> float:
        """``sampling.temperature``, settable: the knob a population mutates on any policy that
        has one (`grpo.population.settings`); setting it replaces ``sampling`` (checked)."""
        return self.sampling.temperature

    @temperature.setter
    def temperature(self, value: float) -> None:
        self.sampling = self.sampling.replace(temperature=float(value))

    def generation_engine(self, name: str, *, seed: int | None) -> Any:
        """The `grpo.generation.GenerationEngine` named ``name`` (``GRPOConfig.generation_engine``)
        sampling for this policy elsewhere: ``"worker"`` = a copy in its own process
        (`grpo.llm.engines.worker.causal_lm_worker`), ``"vllm"`` = vLLM in this process
        (`grpo.llm.engines.vllm_engine.VLLMEngine`). ValueError for another name."""
        if name == "worker":
            from grpo.llm.engines.worker import causal_lm_worker

            return causal_lm_worker(self, seed=seed)
        if name == "vllm":
            from grpo.llm.engines.vllm_engine import VLLMEngine

            return VLLMEngine.for_policy(self, seed=seed)
        raise ValueError(f"CausalLMPolicy has no generation engine {name!r}; choose 'worker' or 'vllm'.")

    # ---- PolicyModel -------------------------------------------------------------------------
    def get_parameters(self) -> dict[str, Tensor]:
        """The trainable tensors (with LoRA: the adapter's only)."""
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    def training_module(self) -> nn.Module:
        """The module holding the trainable parameters (the model, or the PEFT model), for engines
        that wrap a module such as DeepSpeed (`grpo.engine.deepspeed`)."""
        module: nn.Module = self.model
        return module

    def train(self) -> CausalLMPolicy:
        self.model.train()
        return self

    def eval(self) -> CausalLMPolicy:
        self.model.eval()
        return self

    def to(self, device: Any) -> CausalLMPolicy:
        self.model.to(device)
        return self

    @property
    def device(self) -> torch.device:
        device: torch.device = next(iter(self.model.parameters())).device
        return device

    def reference_policy(self) -> DisabledAdapterReference | SeparateAdapterReference | None:
        """The KL reference this policy offers; `GRPOTrainer` uses it when ``kl_coeff > 0`` and
        no ``reference_policy`` is passed. A PEFT (LoRA) model: the model with its adapter disabled
        (`DisabledAdapterReference`, the base weights, no second copy in memory), or the frozen
        ``"reference"`` adapter with ``use_separate_reference_adapter=True``
        (`grpo.llm.lora.SeparateAdapterReference`). None otherwise: the trainer then snapshots a
        frozen copy of the policy."""
        if self.reference_adapter is not None:
            return SeparateAdapterReference(self, self.reference_adapter)
        return DisabledAdapterReference(self) if self.is_peft else None

    def _reference_adapter(self, wanted: bool) -> str | None:
        """Add the separate frozen reference adapter when ``wanted`` (its name), else None."""
        if not wanted:
            return None
        if not self.is_peft:
            raise TypeError(
                f"use_separate_reference_adapter=True keeps a second LoRA adapter as the reference, "
                f"but the model ({type(self.model).__name__}) is not a PEFT model. Wrap it first "
                f"(peft.get_peft_model(model, LoraConfig(...))), or leave the option False: "
                f"GRPOTrainer then takes a frozen copy of a fully fine-tuned policy."
            )
        add_reference_adapter(self.model, REFERENCE_ADAPTER)
        return REFERENCE_ADAPTER

    def enable_gradient_checkpointing(self) -> None:
        """Recompute the transformer blocks in the backward (non-reentrant, works with LoRA)."""
        base = self.model.get_base_model() if self.is_peft else self.model
        kwargs = {"use_reentrant": False}
        if callable(getattr(base, "activation_checkpointing_enable", None)):  # transformers >= 5.x
            base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if hasattr(base, "config"):
            base.config.use_cache = False

    # ---- prompts -----------------------------------------------------------------------------
    def encode_prompt(self, state: Any) -> list[int]:
        """Token ids of one state's prompt (chat template applied when it should be)."""
        prompt = prompt_text(state)
        tok = self.tokenizer
        has_template = getattr(tok, "chat_template", None) is not None
        chat = is_chat(prompt)
        if self.use_chat_template is True and not chat:
            prompt, chat = [{"role": "user", "content": prompt}], True
        if chat:
            if self.use_chat_template is False or not has_template:
                raise ValueError(
                    "got a chat prompt (a list of messages) but "
                    + ("use_chat_template=False" if has_template else "the tokenizer has no chat_template")
                    + "; give string prompts, or a tokenizer with a chat template "
                    "(tokenizer.chat_template = ...)."
                )
            messages: list[dict[str, Any]] = [dict(m) for m in cast(list[dict[str, Any]], prompt)]
            if self.system_prompt is not None and messages[0].get("role") != "system":
                messages = [{"role": "system", "content": self.system_prompt}, *messages]
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tok(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tok(prompt, add_special_tokens=True)["input_ids"]
        if self.max_prompt_length is not None:
            ids = ids[-self.max_prompt_length :]
        if not ids:
            raise ValueError(f"prompt {prompt!r:.60} encodes to no tokens; give a non-empty prompt.")
        return [int(i) for i in ids]

    def _left_pad(self, rows: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """Left-pad (P_i,) id rows -> input_ids (n, P), attention_mask (n, P)."""
        width = max(int(r.shape[0]) for r in rows)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            n = int(r.shape[0])
            ids[i, width - n :] = r
            attn[i, width - n :] = 1
        return ids, attn

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast and self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ---- generation --------------------------------------------------------------------------
    def generate_actions(
        self, states: Sequence[Any], num_actions_per_state: int, **kwargs: Any
    ) -> list[list[Completion]]:
        """Sample G completions per prompt: B lists of G `Completion` s.

        Keyword overrides for one call: any `SamplingSettings` field (``temperature``,
        ``max_new_tokens``, ...; `SamplingSettings.replace`, checked). Each completion records
        its temperature and ``min_new_tokens`` and is scored at them, so an evaluation at another
        temperature (``temperature=t``) keeps log-probs and sampling in agreement. With
        ``max_model_len`` each completion stops at ``min(max_new_tokens, max_model_len - its
        prompt length)`` tokens (`SamplingSettings.completion_budgets`).
        """
        return self._generate_groups(states, int(num_actions_per_state), self.sampling.replace(**kwargs))

    def _generate_groups(
        self,
        states: Sequence[Any],
        g: int,
        opts: SamplingSettings,
        sampler_log_probs: list[Tensor] | None = None,
    ) -> list[list[Completion]]:
        """`generate_actions` with checked ``opts``; ``sampler_log_probs``: see `generate_from_ids`."""
        prompts = [torch.tensor(self.encode_prompt(s), dtype=torch.long) for s in states]
        budgets = opts.completion_budgets([int(p.shape[0]) for p in prompts])
        rows = [p for p in prompts for _ in range(g)]  # group-major: row k is prompt k // g
        row_budgets = [b for b in budgets for _ in range(g)]
        out = self.generate_from_ids(rows, row_budgets, opts, sampler_log_probs=sampler_log_probs)
        return [out[k * g : (k + 1) * g] for k in range(len(prompts))]

    def generate_from_ids(
        self,
        contexts: Sequence[Tensor],
        budgets: Sequence[int],
        options: SamplingSettings | None = None,
        *,
        sampler_log_probs: list[Tensor] | None = None,
    ) -> list[Completion]:
        """One sampled `Completion` per context: ``contexts[i]`` (P_i,) int64 token ids on CPU (no
        padding; they become the completion's ``prompt_ids``), at most ``budgets[i]`` (>= 1) new
        tokens, cut after the first EOS id. All rows go through ``generate`` together (in
        ``options.generation_batch_size`` chunks), with the sampling ``options`` (None = the
        policy's ``sampling``). `generate_actions`
        is this on the encoded prompts; a multi-turn rollout (`grpo.llm.multiturn`) calls it once
        per turn on the active episodes' contexts. ``sampler_log_probs``: a list that receives,
        per ``generate`` chunk, the (n, T') log-probs of the sampled tokens under the scores they
        were drawn from (`grpo.llm.sampler_logprobs.ChosenTokenLogProbs`; valid only without
        top-k / top-p / min-p)."""
        opts = self.sampling if options is None else options
        if len(contexts) != len(budgets) or not contexts:
            raise ValueError(
                f"generate_from_ids got {len(contexts)} contexts and {len(budgets)} budgets; give "
                f"one budget (max new tokens) per context, and at least one context."
            )
        if min(budgets) < 1:
            raise ValueError(f"generate_from_ids: every budget must be >= 1 new token, got {min(budgets)}.")
        transformers = require("transformers")
        rows, row_budgets = list(contexts), [int(b) for b in budgets]
        # ZeRO-3 or FSDP on several processes: every forward all-gathers weights, so every rank
        # keeps stepping until all ranks' sequences are done (rows that finished only get padding).
        synced = self.is_partitioned and get_world_size() > 1
        chunk = opts.generation_batch_size or len(rows)
        out: list[Completion] = []
        t0 = time.perf_counter()
        n_tokens = 0
        for start in range(0, len(rows), chunk):
            part_budgets = row_budgets[start : start + chunk]
            gen_cfg = self._generation_config(transformers, opts.replace(max_new_tokens=max(part_budgets)))
            call = _SamplingCall(gen_cfg, opts, synced)
            completions = self._generate_rows(
                rows[start : start + chunk], part_budgets, call, sampler_log_probs
            )
            n_tokens += sum(len(c) for c in completions)
            out.extend(completions)
        self.last_generation = {"completion_tokens": float(n_tokens), "seconds": time.perf_counter() - t0}
        return out

    def _generation_config(self, transformers: Any, opts: SamplingSettings) -> Any:
        """The ``GenerationConfig`` of one ``generate`` call: every sampling field explicit
        (`grpo.llm.generation_defaults`; ``min_p`` and ``min_new_tokens`` 0 = off are passed as
        None, which `model_generation_defaults_off` keeps None)."""
        return transformers.GenerationConfig(
            do_sample=True,
            temperature=opts.temperature,
            top_p=opts.top_p,
            top_k=opts.top_k,  # 0 = off; None would let generate fill in top_k=50
            min_p=opts.min_p if opts.min_p > 0 else None,
            repetition_penalty=opts.repetition_penalty,
            max_new_tokens=opts.max_new_tokens,
            min_new_tokens=opts.min_new_tokens if opts.min_new_tokens > 0 else None,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            use_cache=True,
        )

    def _generate_rows(
        self,
        part: Sequence[Tensor],
        budgets: Sequence[int],
        call: _SamplingCall,
        sampler_log_probs: list[Tensor] | None = None,
    ) -> list[Completion]:
        """One ``generate`` call on the prompt rows ``part``: a `Completion` per row, cut after its
        first EOS token or at its budget (``budgets[i]`` tokens; the first tokens of a longer
        sample are a sample of the shorter length: the cut changes no distribution). The sampler
        log-probs (n, T') are appended to ``sampler_log_probs`` when it is a list."""
        opts, device, eos = call.opts, self.device, torch.tensor(self.eos_token_ids)
        ids, attn = self._left_pad(part)
        with_log_probs = sampler_log_probs is not None
        comp, logp = self._sample_ids(ids.to(device), attn.to(device), call, with_log_probs)
        comp = comp.cpu()  # (n, T') completion ids, padded after the first EOS
        if logp is not None and sampler_log_probs is not None:
            sampler_log_probs.append(logp.cpu().clone())  # (n, T'); clone: no inference tensor
        limit = torch.tensor(budgets).clamp(max=comp.shape[1])  # (n,)
        is_eos = torch.isin(comp, eos) & (torch.arange(comp.shape[1]) < limit.unsqueeze(1))
        has_eos = is_eos.any(dim=1)
        first = is_eos.int().argmax(dim=1)
        lengths = torch.where(has_eos, first + 1, limit)
        token_rows = [comp[i, : int(lengths[i])].clone() for i in range(comp.shape[0])]
        texts = self.tokenizer.batch_decode([t.tolist() for t in token_rows], skip_special_tokens=True)
        return [
            Completion(part[i], toks, text, bool(has_eos[i]), opts.temperature, opts.min_new_tokens)
            for i, (toks, text) in enumerate(zip(token_rows, texts, strict=True))
        ]

    def _sample_ids(
        self, ids: Tensor, attn: Tensor, call: _SamplingCall, with_log_probs: bool
    ) -> tuple[Tensor, Tensor | None]:
        """(n, T') ids sampled by ``generate`` after the left-padded prompts ``ids`` (n, P) (pad
        after a row's EOS) and, with ``with_log_probs``, their (n, T') sampler log-probs
        (`ChosenTokenLogProbs` reading the scores ``generate`` samples from)."""
        # inference mode (9 % faster decoding on a tiny CPU model than no_grad) except where
        # ZeRO-3 / FSDP gather weights during generation: tensors they allocate here would be
        # inference tensors in the training forward. What leaves `_generate_rows` is built outside.
        gen_cfg, opts, synced = call
        no_autograd = torch.no_grad() if self.is_partitioned else torch.inference_mode()
        transformers = require("transformers")
        recorder = ChosenTokenLogProbs(opts.temperature) if with_log_probs else None
        extra = {} if recorder is None else {"logits_processor": recorder.processors(transformers)}
        no_defaults = model_generation_defaults_off(self._causal_lm(), transformers)
        with no_autograd, self._autocast(), no_defaults:
            seqs = self.model.generate(
                input_ids=ids, attention_mask=attn, generation_config=gen_cfg, synced_gpus=synced, **extra
            )
        comp = seqs[:, ids.shape[1] :]
        return comp, (None if recorder is None else recorder.finish(comp))

    def generate_actions_with_sampler_log_probs(
        self, states: Sequence[Any], num_actions_per_state: int, **kwargs: Any
    ) -> tuple[list[list[Completion]], PolicyOutput]:
        """`generate_actions` and the sampler's log-probs of the N = B*G completions (flat,
        group-major): `PolicyOutput` (log_probs (N, T) float32, 0 after each completion's end;
        mask (N, T)), read from the scores ``generate`` samples from
        (`grpo.llm.sampler_logprobs.ChosenTokenLogProbs`): no second forward. With top-k, top-p
        or min-p (which ``generate`` applies after any processor of ours) they come from
        `get_log_probabilities` instead. A generation engine with its own weights reports these
        for the sampler correction of async rollouts (`grpo.generation.worker`)."""
        opts = self.sampling.replace(**kwargs)
        if opts.top_k > 0 or opts.top_p < 1.0 or opts.min_p > 0.0:
            groups = self.generate_actions(states, num_actions_per_state, **kwargs)
            flat_states = [s for s in states for _ in range(num_actions_per_state)]
            return groups, self.get_log_probabilities(flat_states, [c for g in groups for c in g])
        chunks: list[Tensor] = []  # (n, T') per generate chunk, in row order
        groups = self._generate_groups(states, int(num_actions_per_state), opts, sampler_log_probs=chunks)
        lengths = torch.tensor([len(c) for g in groups for c in g])  # (N,)
        width = int(lengths.max())
        logp = torch.zeros(int(lengths.shape[0]), width)
        row = 0
        for chunk in chunks:
            n, w = chunk.shape[0], min(int(chunk.shape[1]), width)
            logp[row : row + n, :w] = chunk[:, :w]
            row += n
        mask = torch.arange(width) < lengths.unsqueeze(1)  # (N, T)
        logp = logp.masked_fill(~mask, 0.0)  # after each completion's end: its padding's values
        return groups, PolicyOutput(logp.to(self.device), mask.to(self.device))

    # ---- log-probs ---------------------------------------------------------------------------
    def get_log_probabilities(self, states: Any, actions: Sequence[Completion]) -> PolicyOutput:
        """Per-token log-probs of N completions: `PolicyOutput` (log_probs (N, T), mask (N, T))."""
        return self.evaluate_actions(states, actions, group_size=1, with_entropy=False)

    def evaluate_actions(
        self,
        states: Any,
        actions: Sequence[Completion],
        *,
        group_size: int = 1,
        with_entropy: EntropyRequest = False,
    ) -> PolicyOutput:
        """Per-token log-probs, mask and (optionally) exact entropy of N completions, one forward.

        The prompts are read from the completions themselves (``prompt_ids``), so ``states`` may
        be flat (N rows) or one per group. Shapes: log_probs (N, T) float32, mask (N, T) bool,
        entropy (N, T) float32 or None, with T the longest completion. Masked entries are 0.
        ``with_entropy="no_grad"``: the entropy carries no gradient (metrics only; the backward
        then skips its terms).
        """
        comps = list(actions)
        temperature = _scoring_temperature(comps)
        device = self.device
        inputs = self._scoring_inputs(comps, device)
        mask = inputs.mask
        ban = _eos_ban(comps, int(inputs.targets.shape[1]), device)  # min_new_tokens: EOS banned there

        def forward() -> tuple[Tensor, Tensor | None]:
            return self._score(inputs, temperature, with_entropy, ban)

        def fsdp_forward() -> tuple[Tensor, Tensor | None]:
            # owned (N, T) tensors, not views: FSDP2 hooks its backward on the forward's outputs
            logp, entropy = forward()
            return logp.clone(), None if entropy is None else entropy.clone()

        if self.logprob_chunk_size is not None and is_fsdp_sharded(self.model):
            # FSDP: the chunked head uses the backbone and lm_head.weight outside the root's
            # forward; run it as that forward so its hooks gather the root's shards (and again
            # for the backward). The full-logits path calls the root itself.
            logp, entropy = run_as_forward(self.model, fsdp_forward)
        else:
            logp, entropy = forward()
        zero = torch.zeros((), device=device)
        logp = torch.where(mask, logp, zero)
        if entropy is not None:
            entropy = torch.where(mask, entropy, zero)
        return PolicyOutput(log_probs=logp, mask=mask, entropy=entropy)

    def lm_head_inputs(self, actions: Sequence[Completion]) -> LMHeadInputs:
        """The last hidden states of N completions and the LM head (`LMHeadInputs`): the backbone
        forward of `evaluate_actions` without the head, for a fused loss that applies the head
        itself (``GRPOConfig.use_liger_loss``). The hidden states are cast to the head's dtype.
        ValueError for what such a loss cannot reproduce: a min_new_tokens EOS ban, a logit
        scale or soft-cap, weights partitioned by FSDP or ZeRO-3."""
        comps = list(actions)
        temperature = _scoring_temperature(comps)
        input_ids, attn, position_ids, targets, mask, p = self._scoring_inputs(comps, self.device)
        cfg = getattr(self._causal_lm(), "config", None)
        problems = [
            ("a min_new_tokens EOS ban", any(c.min_new_tokens for c in comps)),
            ("logit_scale", float(getattr(cfg, "logit_scale", None) or 1.0) != 1.0),
            ("final_logit_softcapping", getattr(cfg, "final_logit_softcapping", None) is not None),
            ("weights partitioned by FSDP / ZeRO-3", self.is_partitioned),
        ]
        bad = [name for name, found in problems if found]
        if bad:
            raise ValueError(
                f"use_liger_loss: the fused LM-head loss cannot score these completions ({', '.join(bad)}); "
                "set GRPOConfig(use_liger_loss=False) (the default chunked log-probs handle them)."
            )
        with self._autocast():
            hidden = self._backbone()(
                input_ids=input_ids, attention_mask=attn, position_ids=position_ids, use_cache=False
            ).last_hidden_state[:, p - 1 :]  # (N, T, H)
        head = self._head()
        return LMHeadInputs(hidden.to(head.weight.dtype), head.weight, head.bias, targets, mask, temperature)

    def _scoring_inputs(self, comps: Sequence[Completion], device: torch.device) -> _ScoringInputs:
        """The forward's inputs for scoring ``comps``, on ``device`` (`_ScoringInputs`)."""
        prompt_ids, prompt_attn = self._left_pad([c.prompt_ids for c in comps])  # (N, P)
        lengths = torch.tensor([len(c) for c in comps], dtype=torch.long)
        t = max(int(lengths.max()), 1)
        comp_ids = torch.full((len(comps), t), self.pad_token_id, dtype=torch.long)
        for i, c in enumerate(comps):
            comp_ids[i, : len(c)] = c.token_ids
        mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)  # (N, T) by position
        input_ids = torch.cat([prompt_ids, comp_ids], dim=1)[:, :-1].to(device)  # (N, P+T-1)
        attn = torch.cat([prompt_attn, mask.long()], dim=1)[:, :-1].to(device)
        if any(c.loss_mask is not None for c in comps):  # tokens in the context, not in the loss
            mask = mask.clone()
            for i, c in enumerate(comps):
                if c.loss_mask is not None:
                    mask[i, : len(c)] &= c.loss_mask.to(torch.bool)
        position_ids = (attn.cumsum(dim=1) - 1).clamp(min=0)
        targets = comp_ids.to(device)  # token P+j is scored by the hidden state at P+j-1
        return _ScoringInputs(input_ids, attn, position_ids, targets, mask.to(device), prompt_ids.shape[1])

    def _score(
        self,
        inputs: _ScoringInputs,
        temperature: float,
        with_entropy: EntropyRequest,
        ban: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Log-probs (N, T) of ``inputs.targets`` and the entropy (or None), unmasked: the forward
        of `evaluate_actions` (full logits, or the backbone then the chunked LM head). ``ban``
        (N, T) bool: positions where the EOS ids were forbidden when sampling (min_new_tokens);
        there the distribution is the one renormalised without them."""
        with self._autocast():
            if self.logprob_chunk_size is None:
                return self._score_full_logits(inputs, temperature, with_entropy, ban)
            hidden = self._backbone()(
                input_ids=inputs.input_ids,
                attention_mask=inputs.attn,
                position_ids=inputs.position_ids,
                use_cache=False,
            ).last_hidden_state[:, inputs.prompt_width - 1 :]  # (N, T, H)
            head = self._head()
            cfg = getattr(self._causal_lm(), "config", None)
            scale = float(getattr(cfg, "logit_scale", None) or 1.0)
            softcap = getattr(cfg, "final_logit_softcapping", None)
            head_logits = _HeadLogits(head.weight, head.bias, scale, softcap, temperature)
            targets = inputs.targets

            def score(h: Tensor) -> tuple[Tensor, Tensor | None]:
                lp, ent = chunked_token_logprobs(
                    h,
                    head.weight,
                    targets,
                    bias=head.bias,
                    temperature=temperature,
                    chunk_size=self.logprob_chunk_size,
                    with_entropy=bool(with_entropy),
                    logit_scale=scale,
                    softcap=softcap,
                    compiled=self.compile_logprobs,
                )
                if ban is None:
                    return lp, ent
                return _renormalised_without_eos(h, head_logits, targets, lp, ent, ban, self.eos_token_ids)

            if is_partitioned(head):
                logp, entropy = run_as_forward(head, score, hidden)
            else:
                logp, entropy = score(hidden)
            if entropy is not None and with_entropy == "no_grad":
                entropy = entropy.detach()  # no gradient reaches its backward terms
        return logp, entropy

    def _score_full_logits(
        self,
        inputs: _ScoringInputs,
        temperature: float,
        with_entropy: EntropyRequest,
        ban: Tensor | None,
    ) -> tuple[Tensor, Tensor | None]:
        """`_score` from the model's full (N, T, V) logits (``logprob_chunk_size=None``); called
        under the policy's autocast."""
        logits = self.model(
            input_ids=inputs.input_ids,
            attention_mask=inputs.attn,
            position_ids=inputs.position_ids,
            use_cache=False,
        ).logits[:, inputs.prompt_width - 1 :]  # (N, T, V)
        z = logits.float() / temperature
        if ban is not None:  # -inf at the banned EOS logits
            z = z.masked_fill(ban.unsqueeze(-1) & self._eos_vocab(z), float("-inf"))
        logp_all = torch.log_softmax(z, dim=-1)
        logp, entropy = logp_all.gather(-1, inputs.targets.unsqueeze(-1)).squeeze(-1), None
        if with_entropy:
            with entropy_grad_mode(with_entropy):
                finite = logp_all if ban is None else logp_all.masked_fill(z == float("-inf"), 0.0)
                entropy = -(logp_all.exp() * finite).sum(-1)
        return logp, entropy

    def _eos_vocab(self, z: Tensor) -> Tensor:
        """(V,) bool: True at the EOS ids (the vocabulary of logits ``z`` (..., V))."""
        vocab = torch.zeros(z.shape[-1], dtype=torch.bool, device=z.device)
        return vocab.index_fill_(0, torch.tensor(self.eos_token_ids, device=z.device), True)

    def _causal_lm(self) -> Any:
        return self.model.get_base_model() if self.is_peft else self.model

    def _backbone(self) -> Any:
        lm = self._causal_lm()
        base = getattr(lm, "base_model", lm)
        if base is lm:
            raise TypeError(
                f"{type(lm).__name__} exposes no base transformer (base_model) under its LM head; "
                "use CausalLMPolicy(..., logprob_chunk_size=None) to score with full logits."
            )
        return base

    def _head(self) -> nn.Linear:
        head = self._causal_lm().get_output_embeddings()
        if not isinstance(head, nn.Linear):
            raise TypeError(
                f"the model's output embeddings are {type(head).__name__}, not nn.Linear; use "
                "CausalLMPolicy(..., logprob_chunk_size=None) to score with full logits."
            )
        return head

    # ---- saving ------------------------------------------------------------------------------
    @property
    def is_partitioned(self) -> bool:
        """True when the model's weights are partitioned over the processes: by DeepSpeed ZeRO-3
        (set up by `GRPOTrainer` with a stage-3 config) or by FSDP2 (``GRPOConfig(fsdp=True)``).
        Generation then keeps the processes in step, and `save_pretrained` must be called on
        every process."""
        return is_partitioned(self.model) or is_fsdp_sharded(self.model)

    def save_pretrained(self, directory: str) -> None:
        """Write the model (LoRA: the adapter) and tokenizer in safetensors / HF format.

        When the weights are partitioned (`is_partitioned`) every process must call it: they are
        gathered (DeepSpeed ZeRO-3: one module at a time, `grpo.engine.deepspeed.gathered_state_dict`;
        FSDP2: one parameter at a time, `grpo.engine.fsdp.full_state_dict`, to rank 0's CPU) and
        rank 0 writes them; the other ranks write nothing.
        """
        if is_fsdp_sharded(self.model):
            full = full_state_dict(self.model)  # collective: every rank; {} except on rank 0
            if not is_main_process():
                return
            self.model.save_pretrained(directory, state_dict=full, safe_serialization=True)
        elif self.is_partitioned:
            state = gathered_state_dict(self.model)
            if state is None:
                return
            self.model.save_pretrained(directory, state_dict=state, safe_serialization=True)
        else:
            self.model.save_pretrained(directory, safe_serialization=True)
        self.tokenizer.save_pretrained(directory)


class DisabledAdapterReference:
    """The reference policy of a LoRA run: the same model with its adapter disabled.

    No second model is held; each call runs the shared model under ``disable_adapter()``, in eval
    mode (no dropout) and without gradient. It has no parameters of its own (0 extra tensors), and
    ``train``/``eval``/``to`` leave the shared model alone. It cannot be refreshed
    (``GRPOConfig.reference_update_freq``): the base weights are the policy's too; a refreshed
    LoRA reference is ``CausalLMPolicy(..., use_separate_reference_adapter=True)``.
    """

    refresh_problem_text = (
        "the reference is the policy's own model with its LoRA adapter disabled (the base "
        "weights), which cannot take the adapter's weights without changing the policy. Build the "
        "policy with CausalLMPolicy(..., use_separate_reference_adapter=True) for a frozen "
        "reference adapter that is refreshed, or set reference_update_freq=None"
    )

    def __init__(self, policy: CausalLMPolicy) -> None:
        if not policy.is_peft:
            raise TypeError(
                "DisabledAdapterReference needs a PEFT (LoRA) model; for full fine-tuning let "
                "GRPOTrainer snapshot a frozen copy (reference_policy=None)."
            )
        self.policy = policy

    @contextlib.contextmanager
    def _disabled(self) -> Iterator[None]:
        model = self.policy.model
        training = bool(model.training)
        model.eval()  # the frozen reference: no dropout
        try:
            with model.disable_adapter(), torch.no_grad():
                yield
        finally:
            model.train(training)

    def refresh_problem(self) -> str:
        """Why this reference cannot be refreshed (always: see the class docstring)."""
        return self.refresh_problem_text

    def generate_actions(self, states: Any, num_actions_per_state: int, **kwargs: Any) -> Any:
        with self._disabled():
            return self.policy.generate_actions(states, num_actions_per_state, **kwargs)

    def get_log_probabilities(self, states: Any, actions: Sequence[Completion]) -> PolicyOutput:
        with self._disabled():
            return self.policy.get_log_probabilities(states, actions)

    def evaluate_actions(
        self,
        states: Any,
        actions: Sequence[Completion],
        *,
        group_size: int = 1,
        with_entropy: EntropyRequest = False,
    ) -> PolicyOutput:
        with self._disabled():
            return self.policy.evaluate_actions(
                states, actions, group_size=group_size, with_entropy=with_entropy
            )

    def get_parameters(self) -> Mapping[str, Tensor]:
        return {}

    def train(self) -> DisabledAdapterReference:
        return self

    def eval(self) -> DisabledAdapterReference:
        return self

    def to(self, device: Any) -> DisabledAdapterReference:
        return self
