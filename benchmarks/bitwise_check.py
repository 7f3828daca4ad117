"""Bitwise behaviour check: the same seeds give the same weights and metrics.

Runs five seeded scenarios through the public API and prints one SHA-256 digest per scenario of
(a) every trainable weight's bytes after the steps and (b) every step's metrics except the
``time/*`` ones (their values in full precision). Used around a refactor (issue 26): record the
digests before, rerun after, compare::

    python benchmarks/bitwise_check.py --out /tmp/before.json      # on the old commit
    python benchmarks/bitwise_check.py --compare /tmp/before.json  # on the new one: exit 1 if any differs

Scenarios: ``quickstart`` (examples/quickstart.py's bandit, small_policy preset), ``gym``
(CartPole, whole episodes, gaussian/categorical MLP from the gym docs), ``tiny_lm`` (a tiny local
Qwen2 with a LoRA-free causal-LM policy and a KL term), ``deepspeed_zero2`` / ``deepspeed_zero3``
(2 gloo processes, tests.distributed_toys' bandit) and ``fsdp`` (2 gloo processes, the same).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

logger = logging.getLogger("bitwise_check")


def skipped_keys() -> tuple[str, ...]:
    """Metric-key prefixes left out of the digest (``--skip-keys``; also seen by the worker
    processes of the distributed scenarios): keys a later version added to ``step()``."""
    return ("time/", *filter(None, os.environ.get("BITWISE_SKIP_KEYS", "").split(",")))


def digest(weights: dict[str, torch.Tensor], history: list[dict[str, float]]) -> str:
    h = hashlib.sha256()
    skip = skipped_keys()
    for name in sorted(weights):
        h.update(name.encode())
        h.update(weights[name].detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    for metrics in history:
        kept = {k: repr(float(v)) for k, v in sorted(metrics.items()) if not k.startswith(skip)}
        h.update(json.dumps(kept, sort_keys=True).encode())
    return h.hexdigest()


def weights_of(policy: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in policy.get_parameters().items()}


def quickstart() -> str:

    from grpo import GRPOConfig, GRPOTrainer

    spec = importlib.util.spec_from_file_location("quickstart", ROOT / "examples" / "quickstart.py")
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    W = torch.randn(mod.DIM, mod.ARMS)

    def reward(states: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return (states @ W).gather(1, actions.unsqueeze(1)).squeeze(1)

    policy = mod.ArmPolicy()
    config = GRPOConfig.recipe("small_policy", group_size=8, batch_size=64, seed=0, kl_coeff=0.02)
    trainer = GRPOTrainer(config, policy, reward)
    history = [trainer.step(torch.randn(config.batch_size, mod.DIM)) for _ in range(12)]
    return digest(weights_of(policy), history)


def gym() -> str:
    from grpo import GRPOConfig, GRPOTrainer, categorical_mlp
    from grpo.gym.episodes import EpisodePolicy, EpisodeRewards

    torch.manual_seed(0)
    policy = EpisodePolicy("CartPole-v1", categorical_mlp(4, 2, hidden=(32,)))
    config = GRPOConfig.recipe("small_policy", group_size=4, batch_size=4, seed=0)
    trainer = GRPOTrainer(config, policy, EpisodeRewards())
    history = [trainer.step(list(range(4 * s, 4 * s + 4))) for s in range(4)]
    policy.close()
    return digest(weights_of(policy), history)


def tiny_lm() -> str:
    from grpo import GRPOConfig, GRPOTrainer
    from grpo.llm import CausalLMPolicy, SamplingSettings
    from grpo.llm.tiny import build_tiny_model, build_tiny_tokenizer

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        tok = build_tiny_tokenizer(d, pad_is_eos=True)
        model = build_tiny_model(d, tok, arch="qwen2", hidden=32, layers=2, heads=4, seed=0)
        policy = CausalLMPolicy(model, tok, SamplingSettings(max_new_tokens=6, temperature=1.0))

    def reward(prompts: list[str], completions: list[Any]) -> list[float]:
        return [float(c.text.count("a")) - 0.1 * len(c.text) for c in completions]

    config = GRPOConfig(group_size=4, batch_size=2, seed=0, kl_coeff=0.05, learning_rate=1e-3)
    trainer = GRPOTrainer(config, policy, reward)
    history = [trainer.step(["1+2=", "ab"]) for _ in range(3)]
    return digest(weights_of(policy), history)


def _dist_worker(kind: str) -> Callable[[int, int, Path], None]:
    import functools

    return functools.partial(_dist_run, kind)


def _dist_run(kind: str, rank: int, world: int, out: Path) -> None:
    from tests.distributed_toys import LOCAL_B, build, data, run_steps

    extra: dict[str, Any] = {"num_epochs_per_update": 2, "kl_coeff": 0.1, "max_grad_norm": 0.05}
    if kind == "fsdp":
        extra |= {"fsdp": True, "mini_batch_size": 2, "micro_batch_size": 1}
    else:
        stage = 2 if kind == "deepspeed_zero2" else 3
        cfg = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
        path = out / f"ds-{kind}-rank{rank}.json"  # one file a rank: a shared one raced (half-written JSON)
        path.write_text(json.dumps(cfg | {"gradient_clipping": "auto"}))
        extra |= {"deepspeed": str(path)}
    trainer: Any = build("bandit_deferred", LOCAL_B, **extra)
    d = data("bandit_deferred", world)
    rows = slice(rank * LOCAL_B, (rank + 1) * LOCAL_B)
    history = run_steps(trainer, d, rows, range(4))
    if kind == "fsdp":
        weights = {k: v.detach().clone() for k, v in trainer.state_dict()["policy"].items()}
    else:  # ZeRO partitions the weights: gather them (every rank takes part)
        from grpo.engine.deepspeed import gathered_state_dict

        weights = gathered_state_dict(trainer.policy)
    if rank == 0 and weights is not None:
        (out / f"{kind}.txt").write_text(digest(weights, history))
    trainer.close()


def distributed(kind: str) -> str:
    import os

    from tests.distributed_toys import launch

    tag = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".torch_extensions" / tag))  # as the tests
    with tempfile.TemporaryDirectory() as d:
        launch(_dist_worker(kind), Path(d), world=2, timeout=300.0)
        return (Path(d) / f"{kind}.txt").read_text()


SCENARIOS: dict[str, Callable[[], str]] = {
    "quickstart": quickstart,
    "gym": gym,
    "tiny_lm": tiny_lm,
    "deepspeed_zero2": lambda: distributed("deepspeed_zero2"),
    "deepspeed_zero3": lambda: distributed("deepspeed_zero3"),
    "fsdp": lambda: distributed("fsdp"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the digests here (JSON)")
    parser.add_argument("--compare", type=Path, help="compare with digests written by --out")
    parser.add_argument("--only", nargs="*", choices=sorted(SCENARIOS), help="run only these")
    parser.add_argument(
        "--skip-keys",
        nargs="*",
        default=[],
        metavar="PREFIX",
        help="leave metric keys with these prefixes out (keys added since --out was written)",
    )
    args = parser.parse_args(argv)
    os.environ["BITWISE_SKIP_KEYS"] = ",".join(args.skip_keys)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    results = {name: SCENARIOS[name]() for name in (args.only or SCENARIOS)}
    for name, value in results.items():
        sys.stdout.write(f"{name:18s} {value}\n")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    if args.compare:
        before = json.loads(args.compare.read_text())
        differ = [n for n in results if before.get(n) != results[n]]
        sys.stdout.write(f"bitwise equal: {len(results) - len(differ)}/{len(results)} scenarios")
        sys.stdout.write(f"; different: {differ}\n" if differ else "\n")
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
