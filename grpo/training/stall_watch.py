"""No silent stalls: warn when training has stopped learning, with the numbers and the remedy.

`StallWatch` reads each step's (process-reduced, so every rank decides alike) metrics and warns
with a `StallWarning` once per stall, after ``steps`` consecutive stalled steps (default
`STALL_STEPS` = 5). Two stalls are watched:

**Every group's rewards are equal.** ``reward/frac_zero_std`` = 1 (each group's G rewards are
all equal) and every advantage is 0 (``advantage/min`` = ``advantage/max`` = 0; a non-group
baseline can still give non-zero advantages, which is no stall). GRPO's advantage of sample i of
a group is

    A_i = (r_i - mean_g r) / (std_g r + eps)

so equal rewards give A_i = 0 exactly, the policy term's gradient is 0, and what is left of the
gradient is the KL term's pull towards the reference (``kl_coeff``) and the entropy term's push
towards uniform (``entropy_coeff``); with both 0 the gradient is exactly 0 and nothing is learned
(only Adam's momentum from earlier steps still moves the weights, fading). The warning names
the reward value(s) and which case it is, judged from the rewards seen before the stall (the
lowest ``reward/min`` and the highest ``reward/max``):

* all fail: one value, the lowest reward seen so far (or the only one since step 1, the usual
  start on a sparse reward): nothing ever succeeds, so nothing can be reinforced. Remedy: a small
  exploration bonus that varies within a group (`grpo.gym.exploration`), measured in
  benchmarks/RESULTS.md ("Stalls: all-fail and all-succeed groups"); an entropy bonus, larger
  groups or another baseline did not help there;
* all succeed: one value, the highest seen after lower ones: the states are too easy for the
  policy, nothing is left to learn from them. Remedy: harder states or a stricter reward, or stop;
* one value, the only one seen since step 1: either of the two; both remedies are given;
* several values: every group is uniform, at different values (some groups all fail, others all
  succeed). Remedy: states of intermediate difficulty, larger groups, the bonus.

A run of flat steps whose case is *all succeed* is not a stall but a solved task: no warning,
one INFO log line (`logging`, logger ``grpo.training.stall_watch``) saying so, with the values.

**The update is vanishingly small next to the weights.** ``optim/update_ratio`` =
``||theta_after - theta_before|| / ||theta_before||`` (`grpo.update.guard`) below ``update_ratio_floor``
(default `UPDATE_RATIO_FLOOR` = 1e-7: a float32 weight cannot even represent a relative change
below ~6e-8) on each of the steps. The warning gives the largest and the mean ratio, the learning
rate and the step's signals that point at a cause: the learning rate too small for the network,
(nearly) zero advantages, every ratio clipped, a tiny gradient. Not raised while the first stall
is on (that one names the cause), nor on steps whose update the guard undid
(``optim/non_finite_steps`` grew; it warned already), nor where the ratio is NaN (not measured).
Such a run has three causes, told apart in this order:

* the learning-rate schedule has ended: a decaying ``lr_schedule`` is past ``total_steps``, which
  counts *optimizer* steps (``optimizer_steps_per_step`` per trainer step), so a value meant in
  trainer steps ends the schedule that many times too early. A StallWarning names the schedule,
  the steps and the value to set;
* the policy has converged: it is near deterministic (``policy/entropy`` below
  `CONVERGED_ENTROPY` nats per step, fewer than ~1.3 equally likely actions) and its rewards are
  at their running best (an EMA of ``reward/mean`` with rate 0.05 within 10% of the covered
  reward range of its highest value so far: the noise of a few samples a step stays inside).
  Success, not a stall: no warning, one INFO line;
* otherwise a stall: a StallWarning with the signals that point at a cause (the learning rate
  too small for the network, (nearly) zero advantages, every ratio clipped, a tiny gradient).

A step that is not stalled ends the stall; the next one warns again. Silence the warnings with
``warnings.filterwarnings("ignore", category=grpo.training.stall_watch.StallWarning)``, or
``StallWatch(steps=None)``.
The counters are not part of checkpoints: a resumed run counts from 0.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import warnings
from collections import deque
from collections.abc import Mapping, MutableMapping
from typing import Any, Literal, TypeVar

__all__ = ["CONVERGED_ENTROPY", "STALL_STEPS", "UPDATE_RATIO_FLOOR", "StallWarning", "StallWatch"]

logger = logging.getLogger(__name__)

STALL_STEPS = 5
"""Consecutive stalled steps before `StallWatch` warns."""

UPDATE_RATIO_FLOOR = 1e-7
"""``optim/update_ratio`` below this is "vanishingly small" (float32 resolves ~6e-8 relative)."""

CONVERGED_ENTROPY = 0.25
"""``policy/entropy`` (nats per step) below which a policy counts as near deterministic."""

_REWARD_RATE = 0.05  # the EMA of reward/mean that tells "at its running best"
_AT_BEST = 0.1  # within this fraction of the covered reward range of the best EMA

BONUS_REMEDY = (
    "give the groups a signal that varies within them: add a small exploration bonus to the reward, "
    "e.g. for gymnasium episodes CombinedReward({'task': EpisodeReturn(), 'spread': EpisodeSpread()}, "
    "{'spread': 0.01}) (grpo.gym.exploration; GRPO's per-group std normalisation makes the small weight a "
    "full-strength signal in groups whose task rewards are equal and a negligible one elsewhere), or "
    "a partial-credit / shaped reward of your own; or make the task easier first (shorter horizon, "
    "easier states). An entropy bonus, larger groups and a batch baseline did not learn on an "
    "all-fail task (benchmarks/RESULTS.md, 'Stalls: all-fail and all-succeed groups'; docs/training.md, "
    "'When learning stalls')"
)
SUCCEED_REMEDY = (
    "these states are too easy for the policy, so nothing is left to learn from them: train on harder "
    "states or with a stricter reward (a curriculum), or stop (EarlyStopping on eval/reward/mean)"
)

Case = Literal["fail", "succeed", "constant", "mixed"]
M = TypeVar("M", bound=MutableMapping[str, float])


class StallWarning(UserWarning):
    """Training has stopped learning (`grpo.training.stall_watch`): the message has the numbers and the
    remedy."""


def _fmt(v: float) -> str:
    return f"{v:.4g}"


class StallWatch:
    """Watches each step's metrics and warns (`StallWarning`) when learning has stalled.

    Args:
        steps: consecutive stalled steps before warning (>= 1); None = never warn.
        update_ratio_floor: ``optim/update_ratio`` below this counts as no update (>= 0).
        kl_coeff: the loss's KL term coefficient, named in the message (what gradient is left
            when the advantages are 0).
        entropy_coeff: the loss's entropy term coefficient, named in the message likewise.
        optimizer: its first parameter group's learning rate is quoted in the update-size
            message (None: not quoted).
        scheduler: the trainer's `LambdaLR` over a `grpo.engine.lr_schedules.LRSchedule` (None: no
            schedule), read to tell a schedule that has ended from a stall.
        config: a `GRPOConfig` to read ``kl_coeff`` / ``entropy_coeff`` from when a message is
            written (`from_config` passes the trainer's live config), instead of the arguments,
            and ``optimizer_steps_per_step`` (quoted with the schedule; not quoted without one).
    """

    def __init__(
        self,
        steps: int | None = STALL_STEPS,
        *,
        update_ratio_floor: float = UPDATE_RATIO_FLOOR,
        kl_coeff: float = 0.0,
        entropy_coeff: float = 0.0,
        optimizer: Any = None,
        scheduler: Any = None,
        config: Any = None,
    ) -> None:
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(f"StallWatch(steps={steps!r}): expected an int >= 1, or None to never warn.")
        if not update_ratio_floor >= 0:
            raise ValueError(f"StallWatch(update_ratio_floor={update_ratio_floor!r}): expected >= 0.")
        self.steps = steps
        self.update_ratio_floor = update_ratio_floor
        self._coeffs, self.config = (kl_coeff, entropy_coeff), config
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.reward_ema = math.nan  # EMA of reward/mean and its highest value so far
        self.best_ema = -math.inf
        self.lowest = math.inf  # lowest / highest reward seen outside flat runs
        self.highest = -math.inf
        keep = steps or 1
        # the last `steps` metrics of the current run of flat steps / of vanishing updates, and
        # each run's length so far (the runs can be longer than what is kept)
        self._flat: deque[dict[str, float]] = deque(maxlen=keep)
        self._small: deque[dict[str, float]] = deque(maxlen=keep)
        self.flat_steps = 0
        self.small_steps = 0
        self._steps_seen = 0
        self._non_finite = 0.0  # optim/non_finite_steps of the last step (cumulative)

    @classmethod
    def from_config(cls, config: Any, optimizer: Any = None, scheduler: Any = None) -> StallWatch:
        """A watch with the default thresholds and ``config``'s ``kl_coeff`` / ``entropy_coeff``."""
        return cls(optimizer=optimizer, scheduler=scheduler, config=config)

    @property
    def optimizer_steps_per_step(self) -> int | None:
        """Optimizer steps per trainer step (``config.optimizer_steps_per_step``; None without a
        config)."""
        return None if self.config is None else int(self.config.optimizer_steps_per_step)

    @property
    def kl_coeff(self) -> float:
        return float(self._coeffs[0] if self.config is None else self.config.kl_coeff)

    @property
    def entropy_coeff(self) -> float:
        return float(self._coeffs[1] if self.config is None else self.config.entropy_coeff)

    def observe(self, metrics: M) -> M:
        """Read one step's metrics (`grpo.metrics` names); warn on a stall. Returns ``metrics``."""
        self._steps_seen += 1
        flat = _all_groups_flat(metrics)
        self._track_reward(metrics)
        if flat:
            self._flat.append(dict(metrics))
            self.flat_steps += 1
            if self.flat_steps == self.steps:
                self._flat_stall()
        else:
            self._flat.clear()
            self.flat_steps = 0
        lo, hi = metrics.get("reward/min"), metrics.get("reward/max")
        if not flat and lo is not None and hi is not None:  # history outside flat runs
            self.lowest, self.highest = min(self.lowest, lo), max(self.highest, hi)
        self._watch_update(metrics, flat)
        return metrics

    def _track_reward(self, metrics: Mapping[str, float]) -> None:
        r = metrics.get("reward/mean")
        if r is None or not math.isfinite(r):
            return
        self.reward_ema = (
            r if math.isnan(self.reward_ema) else self.reward_ema + _REWARD_RATE * (r - self.reward_ema)
        )
        self.best_ema = max(self.best_ema, self.reward_ema)

    def converged(self, metrics: Mapping[str, float]) -> bool:
        """Near deterministic (``policy/entropy`` < `CONVERGED_ENTROPY`) with its rewards at their
        running best (module docstring)."""
        entropy = metrics.get("policy/entropy", math.nan)
        if not entropy < CONVERGED_ENTROPY or math.isnan(self.reward_ema):
            return False
        covered = self.highest - self.lowest if self.highest > self.lowest else 0.0
        return self.reward_ema >= self.best_ema - _AT_BEST * covered

    # ---- all groups flat ---------------------------------------------------------------------
    def _flat_stall(self) -> None:
        case, values = self._case()
        if case == "succeed":  # a solved task, not a stall
            logger.info(
                "solved: for the last %d steps every sample reached the highest reward seen (%s); "
                "nothing is left to learn from these states: stop (EarlyStopping on "
                "eval/reward/mean) or train on harder ones.",
                len(self._flat),
                values,
            )
            return
        self._warn(self._flat_message())

    def _case(self) -> tuple[Case, str]:
        """Which flat case the current run is, and the reward value(s) in words."""
        lo = min(m["reward/min"] for m in self._flat)
        hi = max(m["reward/max"] for m in self._flat)
        low, high = _fmt(self.lowest), _fmt(self.highest)
        if lo != hi:
            return (
                "mixed",
                f"equal within each group but not across groups: from {_fmt(lo)} to {_fmt(hi)}",
            )
        v = _fmt(lo)
        below, above = self.lowest < lo, self.highest > lo
        if above and not below:
            return "fail", f"all {v}, the lowest reward seen so far (earlier steps reached {high})"
        if below and not above:
            return "succeed", f"all {v}, the highest reward seen so far (earlier steps had {low})"
        if not below and not above:
            since = "since step 1" if self.flat_steps == self._steps_seen else "so far"
            return "constant", f"all {v}, the only reward seen {since}"
        return "mixed", f"all {v}, between the lowest ({low}) and the highest ({high}) seen before"

    def _gradient_left(self) -> str:
        kl, ent = self.kl_coeff, self.entropy_coeff
        if kl == 0 and ent == 0:
            return "with kl_coeff=0 and entropy_coeff=0, so is the gradient: these steps teach nothing"
        terms = []
        if kl != 0:
            terms.append(f"the KL term's pull towards the reference policy (kl_coeff={_fmt(kl)})")
        if ent != 0:
            terms.append(f"the entropy bonus's push towards uniform (entropy_coeff={_fmt(ent)})")
        return "the only gradient left is " + " and ".join(terms) + ", neither of which learns the task"

    def _flat_message(self) -> str:
        case, values = self._case()
        first, last = self._flat[0].get("step"), self._flat[-1].get("step")
        when = f" (steps {first:.0f}-{last:.0f})" if first is not None and last is not None else ""
        head = (
            f"for the last {len(self._flat)} steps{when} every group's rewards were equal ({values}), "
            f"so every advantage is 0 and, {self._gradient_left()}."
        )
        if case == "fail":
            tail = f"Every sample fails. Remedy: {BONUS_REMEDY}."
        elif case == "succeed":
            tail = f"Every sample succeeds. Remedy: {SUCCEED_REMEDY}."
        elif case == "constant":
            tail = (
                f"If that reward is a failure (the usual start on a sparse reward: nothing reached "
                f"yet), remedy: {BONUS_REMEDY}. If it is a success, {SUCCEED_REMEDY}."
            )
        else:
            tail = (
                "Each group either all fails or all succeeds. Remedy: states of intermediate "
                "difficulty, a larger group_size (more chances of one differing sample per group), "
                f"or {BONUS_REMEDY}."
            )
        return f"{head} {tail}"

    # ---- vanishing update ---------------------------------------------------------------------
    def _watch_update(self, metrics: Mapping[str, float], flat: bool) -> None:
        ratio = metrics.get("optim/update_ratio", math.nan)
        undone = metrics.get("optim/non_finite_steps", 0.0) > self._non_finite
        self._non_finite = metrics.get("optim/non_finite_steps", self._non_finite)
        if flat or undone or not math.isfinite(ratio) or ratio >= self.update_ratio_floor:
            self._small.clear()
            self.small_steps = 0
            return
        self._small.append(dict(metrics))
        self.small_steps += 1
        if self.small_steps != self.steps:
            return
        ended = self._schedule_ended()
        if ended is not None:
            self._warn(ended)
        elif self.converged(metrics):
            logger.info(
                "converged: the policy is near deterministic (policy/entropy %s < %s nats per step) and "
                "its rewards are at their best (running mean %s), so its updates have become "
                "vanishingly small (optim/update_ratio %s). Success, not a stall: stop (EarlyStopping "
                "on eval/reward/mean) or train on harder states.",
                _fmt(metrics.get("policy/entropy", math.nan)),
                _fmt(CONVERGED_ENTROPY),
                _fmt(self.reward_ema),
                _fmt(metrics.get("optim/update_ratio", math.nan)),
            )
        else:
            self._warn(self._update_message())

    def _schedule_ended(self) -> str | None:
        """The message when a decaying learning-rate schedule is past its ``total_steps``."""
        lambdas = getattr(self.scheduler, "lr_lambdas", None)
        schedule = lambdas[0] if lambdas else None
        total = getattr(schedule, "total_steps", None)
        name = getattr(schedule, "name", "constant")
        done = getattr(self.scheduler, "last_epoch", 0)
        if name == "constant" or total is None or done < total:
            return None
        k = self.optimizer_steps_per_step
        per = (
            f" There are {k} optimizer steps per trainer step (optimizer_steps_per_step), so the "
            f"schedule ended after trainer step {math.ceil(total / k)}."
            if k
            else ""
        )
        lr = self._learning_rate()
        return (
            f"the learning-rate schedule has ended: lr_schedule={name!r} reached its final rate "
            f"(lr_min_ratio={_fmt(getattr(schedule, 'lr_min_ratio', math.nan))}"
            + (f", lr={_fmt(lr)}" if lr is not None else "")
            + f") at total_steps={total}, and {done} optimizer steps have run, so the weights barely "
            f"move (optim/update_ratio below {_fmt(self.update_ratio_floor)} for {len(self._small)} "
            f"steps). GRPOConfig.total_steps counts optimizer steps, not trainer steps.{per} Set "
            f"total_steps = num_steps * optimizer_steps_per_step for the run you intend, or a "
            f"non-zero lr_min_ratio."
        )

    def _update_message(self) -> str:
        ms = self._small
        ratios = [m["optim/update_ratio"] for m in ms]
        causes = []
        lr = self._learning_rate()
        causes.append(
            "the learning rate is too small for this network"
            + (f" (lr={_fmt(lr)}; raise GRPOConfig.learning_rate)" if lr is not None else " (raise it)")
        )
        adv = max(_largest_advantage(m) for m in ms)
        zero_std = sum(m.get("reward/frac_zero_std", math.nan) for m in ms) / len(ms)
        causes.append(
            f"the advantages are (nearly) zero (largest |A| {_fmt(adv)}; on average {_fmt(zero_std)} of "
            f"the groups had equal rewards)"
        )
        clipped = sum(m.get("clip/frac_low", 0.0) + m.get("clip/frac_high", 0.0) for m in ms) / len(ms)
        causes.append(
            f"every ratio was clipped (clip/frac_low + clip/frac_high = {_fmt(clipped)} on average; "
            f"1 means no gradient from the policy term)"
        )
        grad = max(m.get("grad/norm", math.nan) for m in ms)
        causes.append(f"the gradient itself is tiny (largest grad/norm {_fmt(grad)})")
        return (
            f"for the last {len(ms)} steps the update moved the weights by at most {_fmt(max(ratios))} "
            f"of their norm (optim/update_ratio = ||theta_after - theta_before|| / ||theta_before||, "
            f"mean {_fmt(sum(ratios) / len(ratios))}, below {_fmt(self.update_ratio_floor)}): the "
            f"policy has effectively stopped changing. Likely causes: " + "; ".join(causes) + "."
        )

    def _learning_rate(self) -> float | None:
        groups = getattr(self.optimizer, "param_groups", None)
        if not groups:
            return None
        lr = groups[0].get("lr")
        try:
            return float(lr)
        except (TypeError, ValueError):
            return None

    def _warn(self, message: str) -> None:
        warnings.warn(message, StallWarning, stacklevel=_caller_stacklevel())


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning raised in `StallWatch._warn` at the first frame
    outside the ``grpo`` package: the user's line that called ``step`` / ``train``."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # grpo/
    frame, level = sys._getframe(1), 1  # _warn's frame
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def _largest_advantage(metrics: Mapping[str, float]) -> float:
    """``max(|advantage/min|, |advantage/max|)`` (NaN when absent)."""
    return max(abs(metrics.get("advantage/min", math.nan)), abs(metrics.get("advantage/max", math.nan)))


def _all_groups_flat(metrics: Mapping[str, float]) -> bool:
    """Every group's rewards equal and every advantage exactly 0 (a step that teaches nothing)."""
    frac = metrics.get("reward/frac_zero_std")
    if frac is None or not frac >= 1.0 or "reward/min" not in metrics or "reward/max" not in metrics:
        return False
    a_lo, a_hi = metrics.get("advantage/min", 0.0), metrics.get("advantage/max", 0.0)
    return a_lo == 0.0 and a_hi == 0.0
