"""Restart on a reward shift: start again when the rewards drop while the policy stands still.

A converged GRPO policy stops exploring: once it is nearly sure of an action, a group rarely
samples another, and a clipped update raises a rarely sampled action by a factor 1 + epsilon at
most. When the task itself changes (a non-stationary bandit whose best arm switches), the policy
does not follow. Classic switching-bandit algorithms detect the change and restart (M-UCB, Cao et
al. 2019); `RewardShiftRestart` does the same for any policy:

    fast_t   = fast_{t-1} + a_f (r_t - fast_{t-1})         a_f = 0.3   (EMAs of the step's mean
    slow_t   = slow_{t-1} + a_s (r_t - slow_{t-1})         a_s = 0.05   reward r_t)
    spread_t = spread_{t-1} + a_s (s_t - spread_{t-1})                 (EMA of its reward std s_t)
    noise_t  = spread_t * sqrt(a_f / (2 - a_f)) / sqrt(N_t)            (std of fast_t for iid
                                                                         steps of N_t samples)
    settled  = mean of kl/old over the last W = 10 steps < kappa       (the policy stands still)
    large    = slow_t - fast_t > 0.1 (max_s r_s - min_s r_s)            (s: steps since the start
                                                                         or the last restart)
    restart  when settled, large and slow_t - fast_t > z * noise_t, at most once per 20 steps

A drop while the policy itself barely changes (its updates move it by KL < kappa) is a change
of the task, not of the policy: while a policy learns, its updates move it more than kappa
(defaults kappa = 1e-3, z = 4). The drop must also be a tenth of the range the step means have
covered, so that a solved task whose rewards have stopped varying (CartPole at 500 in every
episode: spread near 0) does not restart on one short episode. A restart copies the weights the
trainer started from back into the policy; the statistics start again from the next step. The
optimizer's state is kept (clearing Adam's moments too tracked the non-stationary bandit worse:
0.80 / 0.81 / 0.80 of the oracle instead of 0.84 / 0.86 / 0.85). Measured in
benchmarks/RESULTS.md ("Small policies"): on the non-stationary 10-armed bandit it fires at the
two switches and nowhere else, and on CartPole, Acrobot, Pendulum, the 50-armed and the contextual
bandit it never fires.

``GRPOConfig.reward_shift_z`` (None = off) turns it on; the ``small_policy`` recipe does. Its
state, the starting weights included, is saved in checkpoints (component ``"reward_shift"``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "COOLDOWN_STEPS",
    "FAST_RATE",
    "MIN_DROP",
    "SETTLE_STEPS",
    "SLOW_RATE",
    "RewardShiftRestart",
    "shift_score",
]

logger = logging.getLogger(__name__)

FAST_RATE = 0.3
SLOW_RATE = 0.05
SETTLE_STEPS = 10
COOLDOWN_STEPS = 20
MIN_DROP = 0.1
_SCALARS = ("fast", "slow", "spread", "lo", "hi")
_COUNTS = ("steps", "cooldown", "restarts")


def shift_score(fast: float, slow: float, spread: float, num_samples: int) -> float:
    """``(slow - fast) / noise`` with ``noise = spread * sqrt(a_f / (2 - a_f)) / sqrt(N)``: how
    many standard deviations of the fast average the rewards fell by (inf for a drop with zero
    spread, 0 when they did not fall)."""
    drop = slow - fast
    if drop <= 0:
        return 0.0
    noise = spread * math.sqrt(FAST_RATE / (2.0 - FAST_RATE)) / math.sqrt(max(num_samples, 1))
    return math.inf if noise <= 0 else drop / noise


class RewardShiftRestart:
    """Watches each step's ``reward/mean``, ``reward/std`` and ``kl/old`` and restarts the policy
    from its starting weights on a reward shift (rule in the module docstring).

    Args:
        params: the trained tensors (``GRPOTrainer.params``); their values now are the start.
        z: the drop, in standard deviations of the fast average, that counts as a shift (> 0).
        settled_kl: the mean ``kl/old`` over the last 10 steps below which the policy counts as
            standing still (> 0).
    """

    def __init__(self, params: Sequence[Tensor], *, z: float = 4.0, settled_kl: float = 1e-3) -> None:
        for name, value in (("z", z), ("settled_kl", settled_kl)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"RewardShiftRestart({name}={value!r}): expected a finite number > 0.")
        self.params = list(params)
        self.z, self.settled_kl = float(z), float(settled_kl)
        self.start = [p.detach().clone() for p in self.params]
        self.restarts = 0
        self._reset_statistics()

    @classmethod
    def from_config(
        cls, config: Any, params: Sequence[Tensor], *, sharded: bool = False
    ) -> RewardShiftRestart | None:
        """The trainer's restart rule (``GRPOConfig.reward_shift_z``), or None when it is off.
        ``sharded``: the weights are partitioned over processes (FSDP, DeepSpeed): refused."""
        if config.reward_shift_z is None:
            return None
        if sharded:
            raise ValueError(
                "GRPOConfig.reward_shift_z keeps a copy of the starting weights and copies it back "
                "into the policy, which needs the whole weights on every process: not with fsdp=True "
                "or DeepSpeed. Set reward_shift_z=None (or deepspeed='off')."
            )
        return cls(params, z=config.reward_shift_z, settled_kl=config.reward_shift_kl)

    def _reset_statistics(self) -> None:
        self.fast = self.slow = self.spread = self.lo = self.hi = math.nan
        self.kl: list[float] = []
        self.steps = 0
        self.cooldown = 0

    def observe(self, metrics: dict[str, float], num_samples: int) -> dict[str, float]:
        """Update the statistics with one step's reduced metrics over ``num_samples`` rewards (all
        processes); restart on a shift. Returns ``metrics`` with ``restart/reward_shift`` (1.0 on
        the step that restarted, else 0.0)."""
        r, s, kl = metrics.get("reward/mean"), metrics.get("reward/std"), metrics.get("kl/old")
        fired = False
        if r is not None and s is not None and kl is not None and all(map(math.isfinite, (r, s, kl))):
            if self.steps == 0:
                self.fast = self.slow = self.lo = self.hi = r
                self.spread = s
            self.fast += FAST_RATE * (r - self.fast)
            self.slow += SLOW_RATE * (r - self.slow)
            self.spread += SLOW_RATE * (s - self.spread)
            self.lo, self.hi = min(self.lo, r), max(self.hi, r)
            self.kl = [*self.kl, kl][-SETTLE_STEPS:]
            self.steps += 1
            self.cooldown = max(self.cooldown - 1, 0)
            settled = len(self.kl) == SETTLE_STEPS and sum(self.kl) / SETTLE_STEPS < self.settled_kl
            score = shift_score(self.fast, self.slow, self.spread, num_samples)
            large = self.slow - self.fast > MIN_DROP * (self.hi - self.lo)
            if settled and self.cooldown == 0 and score > self.z and large:
                self._restart(score)
                fired = True
        metrics["restart/reward_shift"] = float(fired)
        return metrics

    def _restart(self, score: float) -> None:
        logger.warning(
            "reward shift: the mean reward fell %.3g standard deviations (fast average %.4g, slow "
            "%.4g) while the policy stood still (mean kl/old %.3g < %.3g over %d steps); restarting "
            "from the starting weights (restart %d; "
            "GRPOConfig.reward_shift_z=None turns this off).",
            score, self.fast, self.slow, sum(self.kl) / len(self.kl), self.settled_kl, len(self.kl),
            self.restarts + 1,
        )  # fmt: skip
        with torch.no_grad():
            for p, p0 in zip(self.params, self.start, strict=True):
                p.copy_(p0)
        self.restarts += 1
        self._reset_statistics()
        self.cooldown = COOLDOWN_STEPS

    # ---- checkpoints (grpo.trainer_state: component "reward_shift") ----------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            **{k: float(getattr(self, k)) for k in _SCALARS},
            **{k: int(getattr(self, k)) for k in _COUNTS},
            "kl": [float(x) for x in self.kl],
            "start": [t.detach().cpu().clone() for t in self.start],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict`'s output; everything is checked before anything changes."""
        expected = {*_SCALARS, *_COUNTS, "kl", "start"}
        if not isinstance(state, Mapping) or set(state) != expected:
            got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"reward_shift state: expected the keys {sorted(expected)}, got {got}.")
        for k in _SCALARS:
            if not isinstance(state[k], (int, float)) or math.isinf(state[k]):
                raise ValueError(
                    f"reward_shift state: {k!r} must be a finite number or NaN, got {state[k]!r}."
                )
        for k in _COUNTS:
            if not isinstance(state[k], int) or isinstance(state[k], bool) or state[k] < 0:
                raise ValueError(f"reward_shift state: {k!r} must be an int >= 0, got {state[k]!r}.")
        kl = state["kl"]
        if not isinstance(kl, (list, tuple)) or len(kl) > SETTLE_STEPS:
            raise ValueError(f"reward_shift state: 'kl' must be a list of at most {SETTLE_STEPS} numbers.")
        if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in kl):
            raise ValueError("reward_shift state: 'kl' must hold finite numbers.")
        start = state["start"]
        if not isinstance(start, (list, tuple)) or len(start) != len(self.params):
            raise ValueError(
                f"reward_shift state: 'start' must hold {len(self.params)} tensors (one per trained tensor)."
            )
        for i, (t, p) in enumerate(zip(start, self.params, strict=True)):
            if not isinstance(t, Tensor) or t.shape != p.shape or t.dtype != p.dtype:
                raise ValueError(
                    f"reward_shift state: start[{i}] must be a {p.dtype} tensor of shape {tuple(p.shape)}, "
                    f"got {t.dtype if isinstance(t, Tensor) else type(t).__name__}"
                    f"{tuple(t.shape) if isinstance(t, Tensor) else ''}."
                )
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise ValueError(f"reward_shift state: start[{i}] holds NaN or inf.")
        for k in _SCALARS:
            setattr(self, k, float(state[k]))
        for k in _COUNTS:
            setattr(self, k, int(state[k]))
        self.kl = [float(x) for x in kl]
        self.start = [t.detach().to(p.device).clone() for t, p in zip(start, self.params, strict=True)]
