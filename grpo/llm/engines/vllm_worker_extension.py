"""`WeightReceiver`: the methods a vLLM server's worker needs to take the trainer's weights.

Loaded by vLLM into its worker process (``--worker-extension-cls
grpo.llm.engines.vllm_worker_extension.WeightReceiver``, vLLM >= 0.9) and called by
`grpo.llm.engines.vllm_server.VLLMServerEngine` through the server's ``/collective_rpc`` endpoint
(``VLLM_SERVER_DEV_MODE=1``), which passes string arguments only:

1. ``grpo_init_weight_group(host, port, world_size, rank)`` joins a two-process gloo group
   whose TCP store the trainer serves at ``host:port`` (rank 0: the trainer, 1: this worker);
2. ``grpo_receive_weights(spec)`` receives one flat buffer per dtype by broadcast from rank 0
   (``spec``: JSON ``[[name, dtype, shape], ...]`` in the trainer's order) and loads the tensors
   into the model with ``reload_weights`` (Hugging Face names, checkpoint format);
3. ``grpo_close_weight_group()`` drops the group.

Only torch is imported here (the server's environment needs grpo importable, nothing else).
"""

from __future__ import annotations

import json
import math
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["WeightReceiver", "unflatten", "weight_spec"]

GROUP_TIMEOUT = timedelta(minutes=10)


def weight_spec(weights: list[tuple[str, torch.Tensor]]) -> str:
    """The JSON ``[[name, dtype, shape], ...]`` that tells the receiver what a push holds."""
    return json.dumps([[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in weights])


def flat_buffers(spec: list[list[Any]]) -> dict[str, torch.Tensor]:
    """One empty 1-D CPU buffer per dtype of ``spec``, sized for its tensors (in spec order)."""
    sizes: dict[str, int] = {}
    for _, dtype, shape in spec:
        sizes[dtype] = sizes.get(dtype, 0) + math.prod(shape)
    return {d: torch.empty(n, dtype=getattr(torch, d)) for d, n in sizes.items()}


def unflatten(spec: list[list[Any]], buffers: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) views of ``buffers`` that ``spec`` describes, in its order."""
    offsets = dict.fromkeys(buffers, 0)
    out = []
    for name, dtype, shape in spec:
        n = math.prod(shape)
        out.append((name, buffers[dtype][offsets[dtype] : offsets[dtype] + n].view(shape)))
        offsets[dtype] += n
    return out


class WeightReceiver:
    """Mixed into vLLM's ``Worker`` (it has ``model_runner``): see the module docstring."""

    model_runner: Any
    _grpo_group: Any = None

    def grpo_init_weight_group(self, host: str, port: str, world_size: str, rank: str) -> None:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            host, int(port), int(world_size), is_master=False, timeout=GROUP_TIMEOUT
        )
        self._grpo_group = dist.ProcessGroupGloo(store, int(rank), int(world_size), GROUP_TIMEOUT)

    def grpo_receive_weights(self, spec: str) -> None:
        if self._grpo_group is None:
            raise RuntimeError("grpo_receive_weights before grpo_init_weight_group")
        entries = json.loads(spec)
        buffers = flat_buffers(entries)
        for d in sorted(buffers):  # the trainer broadcasts in the same (sorted dtype) order
            self._grpo_group.broadcast(buffers[d], 0).wait()
        weights = unflatten(entries, buffers)
        self.model_runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)

    def grpo_close_weight_group(self) -> None:
        self._grpo_group = None
