"""`VLLMServerEngine`: generation on a vLLM server process (this machine or another one).

The server is vLLM's own OpenAI-compatible server, started with grpo's weight receiver and its
development endpoints (docs/llm.md, "A vLLM server")::

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model MODEL_DIR \
        --worker-extension-cls grpo.llm.engines.vllm_worker_extension.WeightReceiver \
        --logprobs-mode processed_logprobs

Generation: one ``POST /v1/completions`` per prompt (``prompt``: the policy's token ids,
``n`` = G, the `sampling_params_kwargs` of the policy's options and a seed per prompt from
`request_seeds`, ``return_token_ids``, ``logprobs=0``), sent together so the server batches them;
the answers become the same `Completion` s and sampler log-probs as the in-process engine's
(`completions_and_log_probs`).

Weights (full fine-tuning): the trainer and the server's worker form a two-process gloo group
over TCP (the trainer serves its store at ``weight_sync_host:port``; the worker joins it when
asked through ``POST /collective_rpc``). A sync sends ``grpo_receive_weights`` with the names,
dtypes and shapes, broadcasts one flat CPU buffer per dtype, waits for the worker to load them
(``reload_weights``), then resets the server's prefix cache. This is the pattern of TRL's
``vllm-serve`` and OpenRLHF (a process group beside the HTTP API), with gloo instead of NCCL so
it runs without GPUs. Generations and syncs run in submission order on one thread.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from grpo.generation.engine import Generated
from grpo.llm.engines.causal_lm import CausalLM
from grpo.llm.engines.vllm_engine import (
    FutureGeneration,
    VLLMEngineBase,
    VLLMJob,
    VLLMSample,
    sampling_params_kwargs,
)
from grpo.llm.engines.vllm_worker_extension import GROUP_TIMEOUT, flat_buffers, unflatten, weight_spec
from grpo.llm.sampling_settings import SamplingSettings
from grpo.policy_base import PolicyModel

__all__ = ["VLLMServerEngine", "completion_request", "samples_from_response"]

logger = logging.getLogger(__name__)


def completion_request(
    model: str,
    prompt: Sequence[int],
    options: SamplingSettings,
    *,
    n: int,
    max_tokens: int,
    eos_token_ids: Sequence[int],
    seed: int,
) -> dict[str, Any]:
    """The JSON body of ``POST /v1/completions`` for G = ``n`` samples of one tokenised prompt:
    the in-process engine's sampling parameters, the token ids and the sampled tokens'
    log-probs in the answer."""
    kw = sampling_params_kwargs(options, n=n, max_tokens=max_tokens, eos_token_ids=eos_token_ids, seed=seed)
    kw.pop("detokenize")
    return {"model": model, "prompt": [int(t) for t in prompt], "return_token_ids": True, **kw}


def samples_from_response(body: dict[str, Any]) -> list[VLLMSample]:
    """The G samples of one ``/v1/completions`` answer, by ``index``: token ids, each token's
    log-prob, finish reason (KeyError / ValueError for an answer without them)."""
    samples = []
    for choice in sorted(body["choices"], key=lambda c: c["index"]):
        ids = [int(t) for t in choice["token_ids"]]
        lps = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        samples.append(VLLMSample(ids, lps, choice["finish_reason"]))
    return samples


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class VLLMServerEngine(VLLMEngineBase):
    """A `GenerationEngine` over a running vLLM server (module docstring).

    Args:
        url: the server, e.g. ``"http://127.0.0.1:8000"``.
        policy: the trainer's `CausalLMPolicy` (full fine-tuning; the server serves its model).
        seed: seeds job j's requests with `request_seeds` ``(seed, j)``.
        weight_sync_host: this machine's address as the server reaches it (the gloo group's
            store); ``"127.0.0.1"`` when the server runs here.
        timeout: seconds an HTTP request may take.

    Attributes: ``last_sync_seconds``, ``last_sync_bytes`` (the bytes broadcast), and
    ``last_generation`` as `grpo.llm.engines.vllm_engine.VLLMEngine`'s.
    """

    def __init__(
        self,
        url: str,
        policy: PolicyModel,
        *,
        seed: int | None = 0,
        weight_sync_host: str = "127.0.0.1",
        timeout: float = 600.0,
    ) -> None:
        if not isinstance(policy, CausalLM):
            raise TypeError(
                f"VLLMServerEngine generates for a grpo.llm.CausalLMPolicy; got {type(policy).__name__}."
            )
        if policy.is_peft:
            raise ValueError(
                "VLLMServerEngine pushes full weights; a LoRA policy is not supported yet (use "
                "generation_engine='vllm' or 'worker', or merge the adapter)."
            )
        super().__init__(policy, 0 if seed is None else seed)
        self.url, self.timeout = url.rstrip("/"), float(timeout)
        self.model = self._model_name()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpo-vllm-server")
        self._requests = ThreadPoolExecutor(max_workers=8, thread_name_prefix="grpo-vllm-http")
        self._group = self._init_group(weight_sync_host)

    # ---- HTTP --------------------------------------------------------------------------------
    def _post(self, path: str, body: dict[str, Any] | None) -> Any:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                text = r.read()
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"the vLLM server answered {path} with {e.code}: {e.read()[:500]!r}") from e
        return json.loads(text) if text.strip() else None

    def _model_name(self) -> str:
        try:
            with urllib.request.urlopen(self.url + "/v1/models", timeout=self.timeout) as r:
                return str(json.loads(r.read())["data"][0]["id"])
        except (OSError, KeyError, IndexError) as e:
            raise ConnectionError(
                f"no vLLM server answers at {self.url}/v1/models ({e}); start it first (docs/llm.md, "
                "'A vLLM server')."
            ) from e

    def _rpc(self, method: str, **kwargs: str) -> Any:
        """``POST /collective_rpc`` (the server needs ``VLLM_SERVER_DEV_MODE=1``)."""
        try:
            return self._post("/collective_rpc", {"method": method, "kwargs": kwargs})
        except RuntimeError as e:
            if "404" in str(e):
                raise RuntimeError(
                    f"the vLLM server at {self.url} has no /collective_rpc: start it with "
                    "VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls "
                    "grpo.llm.engines.vllm_worker_extension.WeightReceiver."
                ) from e
            raise

    def _init_group(self, host: str) -> Any:
        """Serve the group's TCP store here and have the server's worker join it (rank 1)."""
        port = _free_port()
        store = dist.TCPStore(  # type: ignore[attr-defined]
            host, port, 2, is_master=True, timeout=GROUP_TIMEOUT, wait_for_workers=False
        )
        joined = self._requests.submit(
            self._rpc, "grpo_init_weight_group", host=host, port=str(port), world_size="2", rank="1"
        )
        group = dist.ProcessGroupGloo(store, 0, 2, timedelta(seconds=self.timeout))
        joined.result()
        return group

    # ---- generation --------------------------------------------------------------------------
    def submit(
        self, states: Any, num_actions_per_state: int, *, with_log_probs: bool, **kwargs: Any
    ) -> FutureGeneration:
        """Queue G = ``num_actions_per_state`` completions per state (``kwargs``: the policy's
        sampling overrides); the sampler's log-probs always come back."""
        g, eos = int(num_actions_per_state), self.policy.eos_token_ids
        job = self.next_job(states, g, kwargs)
        bodies = [
            completion_request(self.model, p, job.opts, n=g, max_tokens=b, eos_token_ids=eos, seed=s)
            for p, b, s in zip(job.prompts, job.budgets, job.seeds, strict=True)
        ]
        return FutureGeneration(self._executor.submit(self._generate, job, bodies, self.policy.device))

    def _generate(self, job: VLLMJob, bodies: list[dict[str, Any]], device: torch.device) -> Generated:
        """Runs on the engine's thread: the server's answers -> `Generated` (the loaded version)."""
        answers = list(self._requests.map(lambda b: self._post("/v1/completions", b), bodies))
        return self.generated(job, [samples_from_response(a) for a in answers], device)

    # ---- weights -----------------------------------------------------------------------------
    def sync(self, policy: PolicyModel, version: int) -> None:
        """Push ``policy``'s trainable parameters (tagged ``version``) to the server after the
        generations queued before; waits until the server has loaded them."""
        if not isinstance(policy, CausalLM) or policy.is_peft:
            raise ValueError("VLLMServerEngine.sync takes the full-weight CausalLMPolicy it was built for.")
        self.start_sync(version)
        weights = [(n, p.detach().to("cpu")) for n, p in policy.get_parameters().items()]
        t0 = time.perf_counter()
        self._executor.submit(self._push, weights, int(version)).result()
        self.last_sync_seconds = time.perf_counter() - t0
        self.last_sync_bytes = sum(t.numel() * t.element_size() for _, t in weights)

    def _push(self, weights: list[tuple[str, Tensor]], version: int) -> None:
        """Broadcast the weights on a daemon thread while this one waits for the server's answer
        to ``grpo_receive_weights``: a server that fails answers with its error at once, instead
        of leaving the trainer in a broadcast nobody joins (TRL's fix for the same hang, its PR
        #6913)."""
        spec = weight_spec(weights)
        entries = json.loads(spec)
        buffers = flat_buffers(entries)
        for (_, view), (_, t) in zip(unflatten(entries, buffers), weights, strict=True):
            view.copy_(t)
        errors: list[BaseException] = []

        def send() -> None:
            try:
                for d in sorted(buffers):  # the receiver's order
                    self._group.broadcast(buffers[d], 0).wait()
            except BaseException as e:  # handed to the waiting thread
                errors.append(e)

        sender = threading.Thread(target=send, name="grpo-vllm-weights", daemon=True)
        sender.start()
        self._rpc("grpo_receive_weights", spec=spec)  # returns once the server loaded them
        sender.join(self.timeout)
        if errors or sender.is_alive():
            raise RuntimeError(f"the weight broadcast to {self.url} failed: {errors or 'timed out'}")
        self._post("/reset_prefix_cache", None)
        self.loaded_version = version

    # ---- shutdown ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Wait for the queued work and leave the weight group (the server keeps running; once,
        by `close`)."""
        self._executor.shutdown(wait=True)
        try:
            self._rpc("grpo_close_weight_group")
        except (RuntimeError, OSError) as e:
            logger.warning("the vLLM server did not close its weight group: %s", e)
        self._requests.shutdown(wait=True)
        self._group = None
