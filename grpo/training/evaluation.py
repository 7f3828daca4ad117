"""Evaluation (`evaluate`): the mean reward of G sampled actions per held-out state.

`evaluate` samples G actions per eval state and scores them, without log-probs, gradients or any
weight change, under the trainer's reward settings (``config.reward_timeout``,
``config.invalid_rewards``). It runs on forked RNG streams (torch, Python, NumPy:
`grpo.training.rng`), so evaluating never changes what training samples; `grpo.training.loop.train`
evaluates with the fixed seed ``config.seed`` (0 when None), so successive evaluations share
random numbers.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from grpo.experience_collector import ExperienceCollector, select_rows
from grpo.training.callbacks import TrainerLike
from grpo.training.rng import forked_rng
from grpo.training.sources import num_states

__all__ = ["evaluate"]


def _chunks(states: Any, size: int) -> Iterator[Any]:
    n = num_states(states)
    if n is None:
        raise TypeError(
            f"eval states must be a sequence of states or a Tensor (n, ...), got {type(states).__name__}."
        )
    if n == 0:
        raise ValueError("eval states are empty; give at least one state to evaluate on.")
    for i in range(0, n, size):
        yield states[i : i + size]


class _EvalCollector(ExperienceCollector):
    """The collector of `evaluate`: with ``invalid_rewards='drop_groups'`` a chunk in which every
    group holds an invalid reward is dropped whole (counted in ``dropped_groups``) instead of
    raising as a training step does; `evaluate` raises only when no group of the whole evaluation
    is left."""

    def _drop_invalid_groups(
        self, states: Any, flat_states: Any, actions: Any, rewards: Tensor, comps: dict[str, Tensor]
    ) -> tuple[Any, Any, Any, Tensor, dict[str, Tensor], Tensor | None]:
        if bool(torch.isnan(rewards).view(-1, self.group_size).any(1).all()):
            none = torch.zeros(0, dtype=torch.long, device=rewards.device)
            return (
                select_rows(states, none),
                select_rows(flat_states, none),
                select_rows(actions, none),
                rewards[:0],
                {k: v[:0] for k, v in comps.items()},
                none,
            )
        return super()._drop_invalid_groups(states, flat_states, actions, rewards, comps)


def evaluate(
    trainer: TrainerLike, states: Any, *, seed: int | None = None, **generate_kwargs: Any
) -> dict[str, float]:
    """Mean reward of G sampled actions per state, with no update and no weight change.

    Samples ``config.group_size`` actions for each state (in chunks of ``config.batch_size``
    states), scores them with the reward model, and returns over all ``n * G`` samples::

        eval/reward/{mean,std,min,max}, eval/reward/<component>/mean, time/eval

    The reward is called as in training: with ``config.reward_timeout``, and with
    ``config.invalid_rewards='drop_groups'`` a group holding a None/NaN/inf reward is left out of
    every ``eval/reward/*`` value and counted in ``eval/reward/dropped_groups`` (present only with
    that setting); a `ValueError` when every group is invalid. With ``'raise'`` an invalid reward
    raises.

    No log-probs are computed and no gradient is taken. The RNG streams (torch, Python, NumPy)
    are forked: afterwards they are exactly as before, so evaluating does not change training.

    Args:
        trainer: the trainer whose policy and reward model are evaluated.
        states: a sequence of n states or a Tensor (n, ...).
        seed: seed the forked streams with this value (None = continue from the current state
            without advancing it).
        **generate_kwargs: passed to ``policy.generate_actions``.
    """
    t0 = time.perf_counter()
    trainer.check_lockstep(states)  # ZeRO-3: all ranks must run the same forwards
    drop_groups = trainer.config.invalid_rewards == "drop_groups"
    rewards, comps, dropped = _sample_rewards(trainer, states, seed, generate_kwargs)
    out = _reward_statistics(rewards, comps, dropped)
    if drop_groups:
        out["eval/reward/dropped_groups"] = float(dropped)
    out["time/eval"] = time.perf_counter() - t0
    return out


def _sample_rewards(
    trainer: TrainerLike, states: Any, seed: int | None, generate_kwargs: dict[str, Any]
) -> tuple[list[Tensor], dict[str, list[Tensor]], int]:
    """The rewards (and reward components) of G actions per state, chunk by chunk, on forked RNG
    streams and without gradients, and the number of groups dropped as invalid. The policy is
    put back in training mode if it was in it."""
    cfg = trainer.config
    collector = _EvalCollector(
        trainer.policy,
        trainer.reward_model,
        cfg.group_size,
        trainer.device,
        reference_policy=None,
        record_old_log_probs=False,
        invalid_rewards=cfg.invalid_rewards,
        reward_timeout=cfg.reward_timeout,
    )
    was_training = getattr(trainer.policy, "training", None)
    rewards: list[Tensor] = []
    comps: dict[str, list[Tensor]] = {}
    dropped = 0
    try:
        with forked_rng(trainer.device, seed), torch.no_grad():
            for chunk in _chunks(states, cfg.batch_size):
                batch = collector.collect(chunk, **generate_kwargs)
                dropped += batch.dropped_groups
                rewards.append(batch.rewards.detach().double())
                for k, v in batch.reward_components.items():
                    comps.setdefault(k, []).append(v.detach().double())
    finally:
        if was_training is True:
            trainer.policy.train()
    return rewards, comps, dropped


def _reward_statistics(
    rewards: list[Tensor], comps: dict[str, list[Tensor]], dropped: int
) -> dict[str, float]:
    """``eval/reward/{mean,std,min,max}`` and ``eval/reward/<component>/mean`` over every sample
    left; a `ValueError` when none is (every group was dropped as invalid)."""
    r = torch.cat(rewards)
    if r.numel() == 0:
        raise ValueError(
            f"every one of the {dropped} evaluation groups holds an invalid reward (None, NaN or inf), "
            f"so nothing is left to evaluate (GRPOConfig.invalid_rewards='drop_groups'). Fix the reward."
        )
    values = [r.mean(), r.std() if r.numel() > 1 else r.new_zeros(()), r.min(), r.max()]
    names = ["eval/reward/mean", "eval/reward/std", "eval/reward/min", "eval/reward/max"]
    for k, parts in comps.items():
        names.append(f"eval/reward/{k}/mean")
        values.append(torch.cat(parts).mean())
    out: dict[str, float] = dict(zip(names, torch.stack(values).cpu().tolist(), strict=True))
    return out
