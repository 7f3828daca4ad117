"""Restart on a reward shift: start again when the task changed under a settled policy, and give
the policy back when it only got harder.

A converged GRPO policy stops exploring: once it is nearly sure of an action, a group rarely
samples another, and a clipped update raises a rarely sampled action by a factor 1 + epsilon at
most. When the task itself changes (a non-stationary bandit whose best arm switches), the policy
does not follow. Classic switching-bandit algorithms detect the change and restart (M-UCB, Cao et
al. 2019); `RewardShiftRestart` does the same for any policy, in two stages.

**1. A drop restarts on probation.** The step's mean reward falls while the policy stands still::

    fast_t   = fast_{t-1} + a_f (r_t - fast_{t-1})         a_f = 0.3   (EMAs of the step's mean
    slow_t   = slow_{t-1} + a_s (r_t - slow_{t-1})         a_s = 0.05   reward r_t)
    spread_t = spread_{t-1} + a_s (s_t - spread_{t-1})                 (EMA of its reward std s_t)
    noise_t  = spread_t * sqrt(a_f / (2 - a_f)) / sqrt(N_t)            (std of fast_t for iid
                                                                         steps of N_t samples)
    settled  = mean of kl/old over the last W = 10 steps < kappa       (the policy stands still)
    large    = slow_t - fast_t > 0.1 (max_s r_s - min_s r_s)            (s: steps since the start
                                                                         or the last restart)
    drop     when settled, large and slow_t - fast_t > z * noise_t, at most once per 20 steps

A drop while the policy barely changes (its updates move it by KL < kappa; defaults kappa = 1e-3,
z = 4) comes from the task, not from the policy. The drop must also be a tenth of the range the
step means have covered, so that a solved task whose rewards have stopped varying (CartPole at 500
in every episode: spread near 0) does not react to one short episode. On a drop the trainer keeps
the policy's weights (the *incumbent*) and copies the weights it started from into the policy: the
restarted policy explores again, and its groups sample the actions the incumbent had stopped
trying.

**2. The restarted policy's groups judge the incumbent.** A fall of the mean alone cannot tell a
changed task (the best action changed: the restart is right) from a harder one (every reward fell,
the best action is still best) or rescaled rewards: all three look alike in the rewards of the
action a settled policy keeps choosing. The restarted policy's groups can: for each of its groups
g, the incumbent's expected advantage is estimated by self-normalised importance sampling, one
step at a time (the surrogate objective of PPO and GRPO, read for the incumbent)::

    rho_it = exp(l_inc,i,t - l_old,i,t)              (l_inc: the incumbent's log-prob of sample i's
                                                      action at step t, l_old: the restarted policy's)
    a_g    = sum_{i in g, t} rho_it A_it / sum_{i in g, t} rho_it        (`incumbent_advantages`;
                                                      valid steps; A_it the advantage of step t, or
                                                      the sample's A_i at every step)

a_g is in advantage units, so a shift or a positive rescaling of the rewards leaves it unchanged.
Per-step ratios, not the ratio of whole sequences: over episodes of hundreds of steps the
product of ratios is dominated by the shortest episodes with the fewest disagreements.
Over the probation's first 16 steps (and at least 16 groups: a step of B states holds B)::

    z_inc = mean_g a_g / (std_g a_g / sqrt(n))
    give the incumbent back  when z_inc > 2   (what it favours still beats the other actions)
    keep the restart         otherwise        (it does not: the task changed)

Giving it back restores the incumbent exactly as it was at the restart: its weights, and the
optimizer's and the learning-rate schedule's state (Adam's moments of the probation's updates
would push the incumbent where the restarted policy was going: on CartPole with a slipping cart
the given-back policy then earned 44-55 instead of 74 per episode); the reward statistics start
again. A restart that stands keeps the optimizer's state (clearing Adam's moments too tracked
the non-stationary bandit worse). A harder or rescaled task costs the
probation's few steps of exploration, not the learned policy. The incumbent's log-probs cost one
forward of the batch per probation step (the weights are swapped in and out under no_grad).

Measured in benchmarks/RESULTS.md ("Restart on a reward shift"): an abrupt switch of the best arm,
all rewards shifted down, rescaled, a slow random walk of the arm means, and CartPole whose push
weakens mid-run, each with the drop alone (the rule before the probation), this one, and none.
Limit: when the incumbent's action is second best after a switch but above the restarted groups'
average, it is given back; GRPO's own updates then have to find the better action.

``GRPOConfig.reward_shift_z`` (None = off) turns it on; the ``small_policy`` recipe does. Its
state, the starting weights and the incumbent included, is saved in checkpoints (component
``"reward_shift"``).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from grpo.policy_base import set_training_mode
from grpo.rollout.batch import ExperienceBatch, evaluate_log_probs
from grpo.state.checks import optimizer_problem, scheduler_problem

if TYPE_CHECKING:
    from grpo.advantage_estimator import Advantages
    from grpo.engine.setup import TrainerSetup

__all__ = [
    "CONFIRM_GROUPS",
    "CONFIRM_Z",
    "COOLDOWN_STEPS",
    "FAST_RATE",
    "MAX_PROBATION_STEPS",
    "MIN_DROP",
    "PROBATION_STEPS",
    "SETTLE_STEPS",
    "SLOW_RATE",
    "RewardShiftRestart",
    "incumbent_advantages",
    "mean_z",
    "shift_score",
]

logger = logging.getLogger(__name__)

FAST_RATE = 0.3
SLOW_RATE = 0.05
SETTLE_STEPS = 10
COOLDOWN_STEPS = 20
MIN_DROP = 0.1
PROBATION_STEPS = 16
"""Steps of the restarted policy whose groups judge the incumbent (on CartPole, 4 groups a step,
the incumbent's one-step advantage is small, ~0.03, and 16 groups did not tell it from 0)."""
CONFIRM_GROUPS = 16
"""Groups the judgement needs at least (a step of one state holds one)."""
CONFIRM_Z = 2.0
"""The incumbent's mean advantage, in standard errors, above which it is given back."""
MAX_PROBATION_STEPS = 50
"""Steps after which a probation without `CONFIRM_GROUPS` groups (all dropped) ends, keeping the
restart."""
_SCALARS = ("fast", "slow", "spread", "lo", "hi")
_COUNTS = ("steps", "cooldown", "restarts", "given_back", "probation_steps")
_STATES = ("incumbent_optimizer", "incumbent_scheduler")
_ADDED = {"given_back", "probation_steps", "probe", "incumbent", *_STATES}  # not saved before the probation


def shift_score(fast: float, slow: float, spread: float, num_samples: int) -> float:
    """``(slow - fast) / noise`` with ``noise = spread * sqrt(a_f / (2 - a_f)) / sqrt(N)``: how
    many standard deviations of the fast average the rewards fell by (inf for a drop with zero
    spread, 0 when they did not fall)."""
    drop = slow - fast
    if drop <= 0:
        return 0.0
    noise = spread * math.sqrt(FAST_RATE / (2.0 - FAST_RATE)) / math.sqrt(max(num_samples, 1))
    return math.inf if noise <= 0 else drop / noise


def incumbent_advantages(
    incumbent_log_probs: Tensor,
    old_log_probs: Tensor,
    mask: Tensor | None,
    advantages: Tensor,
    group_ids: Tensor,
    num_groups: int,
    keep: Tensor | None = None,
) -> Tensor:
    """``[sum_g a_g, sum_g a_g^2, n]`` (float64) over the n groups with a kept, valid step, where
    ``a_g = sum_{i,t} rho_it A_it / sum_{i,t} rho_it`` and ``rho_it = exp(l_inc - l_old)``
    (module docstring): the incumbent's expected advantage in each group of another policy's
    samples.

    Shapes: incumbent_log_probs, old_log_probs (N, T); mask (N, T) bool or None (all valid);
    advantages (N,) (each step of a sample gets its A_i) or (N, T); group_ids (N,) in
    [0, num_groups); keep (N,) bool or None: rows left out (dropped groups). The ratios are
    normalised within each group with its largest log-ratio subtracted, so none overflows; a
    step whose incumbent log-prob is -inf weighs 0.
    """
    n, t = old_log_probs.shape
    valid = torch.ones_like(old_log_probs, dtype=torch.bool) if mask is None else mask
    if keep is not None:
        valid = valid & keep[:, None]
    diff = incumbent_log_probs.detach().double() - old_log_probs.detach().double()
    log_r = torch.where(valid, diff, -math.inf).flatten()  # (N*T,)
    adv = advantages.detach().double()
    adv = (adv if adv.dim() == 2 else adv[:, None].expand(n, t)).flatten()
    gid = group_ids[:, None].expand(n, t).flatten()
    top = torch.full((num_groups,), -math.inf, dtype=torch.float64, device=log_r.device)
    top = top.scatter_reduce(0, gid, log_r, "amax")  # (B,)
    shifted = log_r - top[gid]  # <= 0; NaN where every step of the group has log-ratio -inf
    w = torch.where(torch.isfinite(shifted), shifted.exp(), 0.0)
    zeros = torch.zeros(num_groups, dtype=torch.float64, device=log_r.device)
    mass = zeros.index_add(0, gid, w)
    counted = mass > 0
    a = zeros.index_add(0, gid, w * torch.where(w > 0, adv, 0.0)) / mass.clamp(min=1e-300)
    a = torch.where(counted, a, 0.0)
    return torch.stack([a.sum(), a.square().sum(), counted.double().sum()])


def mean_z(sums: Sequence[float]) -> float:
    """``mean / (std / sqrt(n))`` from ``[sum, sum of squares, n]`` (n >= 2, the sample std): how
    many standard errors the mean is above 0 (+-inf for a non-zero mean with zero spread)."""
    s, q, n = sums
    mean = s / n
    var = max(q - n * mean * mean, 0.0) / (n - 1)
    if var == 0:
        return 0.0 if mean == 0 else math.copysign(math.inf, mean)
    return mean / math.sqrt(var / n)


class RewardShiftRestart:
    """Watches each step's ``reward/mean``, ``reward/std`` and ``kl/old``; restarts a settled
    policy on a drop and gives it back when the restarted policy's groups still favour it (rule
    in the module docstring).

    Args:
        params: the trained tensors (``GRPOTrainer.params``); their values now are the start.
        z: the drop, in standard deviations of the fast average, that counts as a shift (> 0).
        settled_kl: the mean ``kl/old`` over the last 10 steps below which the policy counts as
            standing still (> 0).
        optimizer: the trainer's; its state at a restart comes back with the incumbent (None:
            only the weights do).
        scheduler: the trainer's learning-rate scheduler, likewise (None: none).

    Attributes:
        incumbent: the weights at the last restart while its probation is open, else None.
        restarts: restarts made so far.
        given_back: how many of them gave the incumbent back.
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        *,
        z: float = 4.0,
        settled_kl: float = 1e-3,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
    ) -> None:
        for name, value in (("z", z), ("settled_kl", settled_kl)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"RewardShiftRestart({name}={value!r}): expected a finite number > 0.")
        self.params = list(params)
        self.z, self.settled_kl = float(z), float(settled_kl)
        self.optimizer, self.scheduler = optimizer, scheduler
        self.start = [p.detach().clone() for p in self.params]
        self.incumbent: list[Tensor] | None = None
        self.incumbent_optimizer: dict[str, Any] = {}  # their states at the restart ({}: none)
        self.incumbent_scheduler: dict[str, Any] = {}
        self.run: TrainerSetup | None = None  # the trainer's (from_config): its policy, backend, ranks
        self.probe = [0.0, 0.0, 0.0]  # the probation's incumbent advantages: [sum, sum of squares, n]
        self.restarts = self.given_back = self.probation_steps = 0
        self._reset_statistics()

    @classmethod
    def from_config(cls, config: Any, run: TrainerSetup) -> RewardShiftRestart | None:
        """The restart rule (``GRPOConfig.reward_shift_z``) of a trainer set up as ``run``
        (`grpo.engine.setup.TrainerSetup`: its weights, optimizer and schedule, and for
        `observe_step` its policy, device, backend and processes), or None when it is off.
        Weights partitioned over processes (FSDP, DeepSpeed) are refused."""
        if config.reward_shift_z is None:
            return None
        if run.backend is not None and not run.backend.local_weights:
            raise ValueError(
                "GRPOConfig.reward_shift_z keeps a copy of the starting weights and copies it back "
                "into the policy, which needs the whole weights on every process: not with fsdp=True "
                "or DeepSpeed. Set reward_shift_z=None (or deepspeed='off')."
            )
        watch = cls(
            run.params,
            z=config.reward_shift_z,
            settled_kl=config.reward_shift_kl,
            optimizer=run.optimizer,
            scheduler=run.scheduler,
        )
        watch.run = run
        return watch

    def _reset_statistics(self) -> None:
        self.fast = self.slow = self.spread = self.lo = self.hi = math.nan
        self.kl: list[float] = []
        self.steps = 0
        self.cooldown = 0

    @contextlib.contextmanager
    def incumbent_weights(self) -> Iterator[None]:
        """Inside the block the policy holds the incumbent's weights (under no_grad); its own
        come back afterwards, bitwise. Only while a probation is open."""
        assert self.incumbent is not None, "incumbent_weights() outside a probation"
        with torch.no_grad():
            own = [p.detach().clone() for p in self.params]
            self._load(self.incumbent)
            try:
                yield
            finally:
                self._load(own)

    def _load(self, values: Sequence[Tensor]) -> None:
        with torch.no_grad():
            for p, v in zip(self.params, values, strict=True):
                p.copy_(v)

    def observe_step(
        self, metrics: dict[str, float], batch: ExperienceBatch, advantages: Advantages
    ) -> dict[str, float]:
        """`observe` one trainer step: its reduced metrics over the ``batch``'s samples on every
        process and, while a restart is on probation, the incumbent's advantages in its groups
        (`probation_sums`, summed over processes). Needs the trainer's `from_config`."""
        assert self.run is not None, "observe_step() needs a RewardShiftRestart.from_config(config, run)"
        sums = self.probation_sums(batch, advantages)
        if sums is not None and self.run.backend is not None:
            sums = self.run.backend.global_sum(sums)
        world = 1 if self.run.distributed is None else self.run.distributed.world_size
        return self.observe(metrics, batch.num_samples * world, None if sums is None else sums.tolist())

    def probation_sums(self, batch: ExperienceBatch, advantages: Advantages) -> Tensor | None:
        """This process's `incumbent_advantages` in ``batch``'s groups while a restart is on
        probation (one forward of the batch with the incumbent's weights, no grad), else None (no
        probation, or a batch without behaviour log-probs)."""
        if self.incumbent is None or batch.old_log_probs is None or self.run is None:
            return None
        policy = self.run.policy
        with self.incumbent_weights():
            set_training_mode(policy, False)
            inc = evaluate_log_probs(policy, batch, device=self.run.device, check_inf=False)
        return incumbent_advantages(
            inc.log_probs,
            batch.old_log_probs,
            batch.mask,
            advantages.values,
            batch.group_ids,
            batch.num_groups,
            advantages.keep,
        )

    def observe(
        self, metrics: dict[str, float], num_samples: int, incumbent: Sequence[float] | None = None
    ) -> dict[str, float]:
        """Update the statistics with one step's reduced metrics over ``num_samples`` rewards;
        during a probation ``incumbent`` is the step's `incumbent_advantages` (summed over
        processes). Returns ``metrics`` with ``restart/reward_shift`` (1.0 on the step after
        which the policy restarted) and ``restart/given_back`` (1.0 on the step after which the
        incumbent came back), else 0.0."""
        r, s, kl = metrics.get("reward/mean"), metrics.get("reward/std"), metrics.get("kl/old")
        restarted = given_back = False
        if r is not None and s is not None and kl is not None and all(map(math.isfinite, (r, s, kl))):
            self._update_rewards(r, s, kl)
            if self.incumbent is not None:
                given_back = self._judge(incumbent or (0.0, 0.0, 0.0))
            elif self._dropped(num_samples):
                self._restart(shift_score(self.fast, self.slow, self.spread, num_samples))
                restarted = True
        metrics["restart/reward_shift"] = float(restarted)
        metrics["restart/given_back"] = float(given_back)
        return metrics

    def _update_rewards(self, r: float, s: float, kl: float) -> None:
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

    def _dropped(self, num_samples: int) -> bool:
        """Stage 1: a settled policy's mean reward fell (module docstring)."""
        settled = len(self.kl) == SETTLE_STEPS and sum(self.kl) / SETTLE_STEPS < self.settled_kl
        large = self.slow - self.fast > MIN_DROP * (self.hi - self.lo)
        score = shift_score(self.fast, self.slow, self.spread, num_samples)
        return settled and self.cooldown == 0 and large and score > self.z

    def _restart(self, score: float) -> None:
        logger.warning(
            "reward shift: the mean reward fell %.3g standard deviations (fast average %.4g, slow "
            "%.4g) while the policy stood still (mean kl/old %.3g < %.3g over %d steps); restarting "
            "from the starting weights on probation: the restarted policy's next %d steps judge "
            "the policy it replaces, which comes back if they still favour it (restart %d; "
            "GRPOConfig.reward_shift_z=None turns this off).",
            score,
            self.fast,
            self.slow,
            sum(self.kl) / len(self.kl),
            self.settled_kl,
            len(self.kl),
            PROBATION_STEPS,
            self.restarts + 1,
        )
        self.incumbent = [p.detach().clone() for p in self.params]
        if self.optimizer is not None:
            self.incumbent_optimizer = copy.deepcopy(self.optimizer.state_dict())
        if self.scheduler is not None:
            self.incumbent_scheduler = copy.deepcopy(self.scheduler.state_dict())
        self._load(self.start)
        self.restarts += 1
        self.probe, self.probation_steps = [0.0, 0.0, 0.0], 0
        self._reset_statistics()
        self.cooldown = COOLDOWN_STEPS

    def _judge(self, sums: Sequence[float]) -> bool:
        """Stage 2, each probation step: give the incumbent back (True), keep the restart, or wait."""
        self.probe = [a + float(b) for a, b in zip(self.probe, sums, strict=True)]
        self.probation_steps += 1
        n = self.probe[2]
        short = n < CONFIRM_GROUPS or self.probation_steps < PROBATION_STEPS
        if short and self.probation_steps < MAX_PROBATION_STEPS:
            return False
        z = mean_z(self.probe) if n >= 2 else 0.0
        mean = self.probe[0] / n if n else math.nan
        assert self.incumbent is not None
        if z > CONFIRM_Z:
            logger.warning(
                "reward shift: the restarted policy's %d groups still favour the policy it replaced "
                "(its mean advantage in them %.3g, %.3g standard errors above 0): the task got harder "
                "or its rewards were rescaled, not changed; giving that policy back.",
                n,
                mean,
                z,
            )
            self._load(self.incumbent)
            if self.optimizer is not None and self.incumbent_optimizer:
                self.optimizer.load_state_dict(self.incumbent_optimizer)
            if self.scheduler is not None and self.incumbent_scheduler:
                self.scheduler.load_state_dict(self.incumbent_scheduler)
            self.given_back += 1
            self._reset_statistics()
            self.cooldown = COOLDOWN_STEPS
        else:
            logger.info(
                "reward shift: the restarted policy's %d groups do not favour the policy it replaced "
                "(its mean advantage in them %.3g, %.3g standard errors): the task changed; the restart "
                "stands.",
                n,
                mean,
                z,
            )
        self.incumbent, self.incumbent_optimizer, self.incumbent_scheduler = None, {}, {}
        return z > CONFIRM_Z

    # ---- checkpoints (grpo.state.trainer_state: component "reward_shift") ----------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            **{k: float(getattr(self, k)) for k in _SCALARS},
            **{k: int(getattr(self, k)) for k in _COUNTS},
            "kl": [float(x) for x in self.kl],
            "probe": [float(x) for x in self.probe],
            "start": [t.detach().cpu().clone() for t in self.start],
            "incumbent": [t.detach().cpu().clone() for t in self.incumbent or []],
            "incumbent_optimizer": copy.deepcopy(self.incumbent_optimizer),
            "incumbent_scheduler": copy.deepcopy(self.incumbent_scheduler),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict`'s output (or one saved before the probation existed); everything
        is checked before anything changes."""
        expected = {*_SCALARS, *_COUNTS, "kl", "probe", "start", "incumbent", *_STATES}
        if isinstance(state, Mapping) and set(state) == expected - _ADDED:
            state = {
                **state,
                "given_back": 0,
                "probation_steps": 0,
                "probe": [0.0, 0.0, 0.0],
                "incumbent": [],
                **{k: {} for k in _STATES},
            }
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
        probe = state["probe"]
        if not (
            isinstance(probe, (list, tuple))
            and len(probe) == 3
            and all(isinstance(x, (int, float)) and math.isfinite(x) for x in probe)
            and probe[1] >= 0
            and probe[2] >= 0
        ):
            raise ValueError(
                f"reward_shift state: 'probe' must be [sum, sum of squares >= 0, count >= 0] of finite "
                f"numbers, got {probe!r}."
            )
        start = self._checked_weights(state["start"], "start", empty_ok=False)
        incumbent = self._checked_weights(state["incumbent"], "incumbent", empty_ok=True)
        self._check_states(state, bool(incumbent))
        for k in _SCALARS:
            setattr(self, k, float(state[k]))
        for k in _COUNTS:
            setattr(self, k, int(state[k]))
        self.kl = [float(x) for x in kl]
        self.probe = [float(x) for x in probe]
        self.start = start
        self.incumbent = incumbent or None
        self.incumbent_optimizer = copy.deepcopy(dict(state["incumbent_optimizer"]))
        self.incumbent_scheduler = copy.deepcopy(dict(state["incumbent_scheduler"]))

    def _check_states(self, state: Mapping[str, Any], probation: bool) -> None:
        """The incumbent's optimizer and scheduler states: ``{}``, or (during a probation, with
        an optimizer / scheduler) states those could load (`grpo.state.checks`)."""
        checks = (
            ("incumbent_optimizer", self.optimizer, optimizer_problem),
            ("incumbent_scheduler", self.scheduler, scheduler_problem),
        )
        for key, live, problem_of in checks:
            saved = state[key]
            if not isinstance(saved, Mapping):
                raise ValueError(f"reward_shift state: {key!r} must be a state dict or {{}}, got {saved!r}.")
            if not saved:
                continue
            if not probation or live is None:
                raise ValueError(
                    f"reward_shift state: {key!r} is only kept during a probation of a trainer with "
                    f"{'an optimizer' if key == 'incumbent_optimizer' else 'a scheduler'}; expected {{}}."
                )
            problem = problem_of(live, saved)
            if problem is not None:
                raise ValueError(f"reward_shift state: {key!r} {problem[-1]}.")

    def _checked_weights(self, tensors: Any, key: str, *, empty_ok: bool) -> list[Tensor]:
        """``tensors`` checked against the trained tensors (count, shapes, dtypes, finite), moved
        to their devices; ``empty_ok``: an empty list is allowed (no probation open)."""
        if empty_ok and isinstance(tensors, (list, tuple)) and not tensors:
            return []
        if not isinstance(tensors, (list, tuple)) or len(tensors) != len(self.params):
            raise ValueError(
                f"reward_shift state: {key!r} must hold {len(self.params)} tensors (one per trained "
                f"tensor){' or none' if empty_ok else ''}."
            )
        for i, (t, p) in enumerate(zip(tensors, self.params, strict=True)):
            if not isinstance(t, Tensor) or t.shape != p.shape or t.dtype != p.dtype:
                raise ValueError(
                    f"reward_shift state: {key}[{i}] must be a {p.dtype} tensor of shape {tuple(p.shape)}, "
                    f"got {t.dtype if isinstance(t, Tensor) else type(t).__name__}"
                    f"{tuple(t.shape) if isinstance(t, Tensor) else ''}."
                )
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise ValueError(f"reward_shift state: {key}[{i}] holds NaN or inf.")
        return [t.detach().to(p.device).clone() for t, p in zip(tensors, self.params, strict=True)]
