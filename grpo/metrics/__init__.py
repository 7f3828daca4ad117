"""Every metric the library logs, declared once: its name, how it reduces, what it means.

A `Metric` declares its reduction, which says both what the value is on one process and how the
values of several processes combine into the global one (`reduce_across_ranks`):

| reduction | value on one process | across processes |
| --- | --- | --- |
| ``samples`` | mean over the N samples | mean weighted by each process's samples |
| ``groups`` | mean over the B groups | weighted by groups |
| ``valid_steps`` | mean over valid steps (mask entries) of the update | weighted by valid steps |
| ``pooled_std`` | standard deviation over samples | pooled with the matching ``mean`` |
| ``share`` | this process's share of a global quantity (a loss over a global normaliser) | sum |
| ``sum`` | a count | sum |
| ``min`` / ``max`` | smallest / largest | min / max |
| ``slowest`` | seconds | max (the slowest process) |
| ``global`` | already the same on every process (a global gradient norm, a counter) | mean |
| ``finished`` | mean over the samples that ended on their own | weighted by those samples' count |

The glossary docs/metrics.md is generated from `METRICS` (`glossary_markdown`; a test keeps
them equal: ``python -m grpo.metrics > docs/metrics.md`` rewrites it).
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "METRICS",
    "REDUCTIONS",
    "Metric",
    "Reduction",
    "StepCounts",
    "empty_extremes_as_nan",
    "glossary_markdown",
    "metric",
    "reduce_across_ranks",
]

Reduction = Literal[
    "samples", "groups", "valid_steps", "pooled_std", "share", "sum", "min", "max", "slowest", "global",
    "finished",
]  # fmt: skip
REDUCTIONS: tuple[Reduction, ...] = (
    "samples", "groups", "valid_steps", "pooled_std", "share", "sum", "min", "max", "slowest", "global",
    "finished",
)  # fmt: skip
Section = Literal["step", "train", "eval", "optional", "llm"]


@dataclass(frozen=True)
class Metric:
    """One logged metric: ``name`` (``<component>`` stands for a reward component's name, ``<k>`` for a k),
    ``reduce`` (see the module docstring), ``section`` of the glossary and ``help``."""

    name: str
    reduce: Reduction
    section: Section
    help: str


@dataclass(frozen=True)
class StepCounts:
    """What one process's step metrics were averaged over: the weights of `reduce_across_ranks`."""

    samples: float
    groups: float
    valid_steps: float


def _m(name: str, reduce: Reduction, section: Section, help: str) -> Metric:
    return Metric(name, reduce, section, help)


_UPDATE_NOTE = " Absent when the policy has no trainable parameters (nothing is optimised)."

METRICS: tuple[Metric, ...] = (
    _m("step", "global", "step", "`trainer.step_count` after this step (1 for the first step)."),
    _m("reward/mean", "samples", "step", "Mean reward over the N samples of the step."),
    _m("reward/std", "pooled_std", "step", "Standard deviation (unbiased) of the N rewards (0 when N = 1)."),
    _m("reward/min", "min", "step", "Smallest reward of the step."),
    _m("reward/max", "max", "step", "Largest reward of the step."),
    _m(
        "reward/frac_zero_std",
        "groups",
        "step",
        "Fraction of the B groups whose G rewards are all equal (zero-variance groups: their "
        "advantages are exactly 0 and they teach nothing).",
    ),
    _m(
        "reward/<component>/mean",
        "samples",
        "step",
        "Mean of one component's (unweighted) reward over the N samples.",
    ),
    _m(
        "advantage/mean",
        "samples",
        "step",
        "Mean advantage over the N samples (0 up to rounding with group normalisation).",
    ),
    _m("advantage/std", "pooled_std", "step", "Standard deviation of the N advantages."),
    _m("advantage/min", "min", "step", "Smallest advantage."),
    _m("advantage/max", "max", "step", "Largest advantage."),
    _m(
        "loss/total",
        "share",
        "step",
        "The optimised loss `l_pg + kl_coeff · l_kl − entropy_coeff · l_H`, aggregated as "
        "`loss_aggregation` says, per optimizer step." + _UPDATE_NOTE,
    ),
    _m("loss/policy", "share", "step", "The policy term `l_pg` alone, per optimizer step." + _UPDATE_NOTE),
    _m(
        "loss/kl",
        "share",
        "step",
        "The KL term `l_kl` (before `kl_coeff`), per optimizer step; 0 when `kl_coeff = 0`." + _UPDATE_NOTE,
    ),
    _m(
        "loss/entropy",
        "share",
        "step",
        "The entropy term `l_H` (before `entropy_coeff`), per optimizer step." + _UPDATE_NOTE,
    ),
    _m(
        "policy/entropy",
        "valid_steps",
        "step",
        "Entropy of the policy, averaged over the update (exact when the policy returns it, else "
        "the Monte Carlo estimate `−logp`). With `entropy_coeff = 0` the trainer asks "
        '`evaluate_actions` for it with `with_entropy="no_grad"`: it is computed without an '
        "autograd graph." + _UPDATE_NOTE,
    ),
    _m(
        "kl/ref",
        "valid_steps",
        "step",
        "KL(π_θ ‖ π_ref) estimated with `kl_estimator`, averaged over the update; 0 when "
        "`kl_coeff = 0` (no reference policy runs)." + _UPDATE_NOTE,
    ),
    _m(
        "kl/old",
        "valid_steps",
        "step",
        "KL(π_old ‖ π_θ) to the behaviour policy, k3 estimate `(ρ − 1) − log ρ`, averaged over "
        "the update; exactly 0 when a step takes a single optimizer step (the ratio is then 1)."
        + _UPDATE_NOTE,
    ),
    _m(
        "clip/frac_low",
        "valid_steps",
        "step",
        "Fraction of valid steps whose ratio was clipped below (`ρ < 1 − clip_epsilon` with "
        "`A < 0`: no gradient)." + _UPDATE_NOTE,
    ),
    _m(
        "clip/frac_high",
        "valid_steps",
        "step",
        "Fraction of valid steps clipped above (`ρ > 1 + clip_epsilon_high` with `A > 0`)." + _UPDATE_NOTE,
    ),
    _m(
        "ratio/mean",
        "valid_steps",
        "step",
        "Mean importance ratio `ρ = π_θ / π_old` over the update." + _UPDATE_NOTE,
    ),
    _m(
        "ratio/min",
        "min",
        "step",
        "Smallest ratio over the update; NaN when it had no valid step (every group dropped)." + _UPDATE_NOTE,
    ),
    _m(
        "ratio/max",
        "max",
        "step",
        "Largest ratio over the update; NaN when it had no valid step (every group dropped)." + _UPDATE_NOTE,
    ),
    _m(
        "grad/norm",
        "global",
        "step",
        "Global gradient norm before clipping to `max_grad_norm`, per optimizer step." + _UPDATE_NOTE,
    ),
    _m(
        "optim/non_finite_steps",
        "global",
        "step",
        "Steps whose update was undone because the loss or the gradient was NaN/inf (cumulative)."
        + _UPDATE_NOTE,
    ),
    _m(
        "optim/update_ratio",
        "global",
        "step",
        "Size of the step's whole update next to the weights: ‖θ_after − θ_before‖ / ‖θ_before‖, L2 "
        "norms over every trained weight as one vector (computed in `grpo.update.guard`). NaN = not "
        "measured: a single optimizer step of a policy above 2**22 weight elements, or DeepSpeed "
        "(no copy of the weights before the update is kept); 0 when the guard undid the update. "
        "Below ~1e-7 for several steps the policy has stopped changing (`grpo.training.stall_watch`)."
        + _UPDATE_NOTE,
    ),
    _m(
        "optim/lr",
        "global",
        "step",
        "Learning rate of the first parameter group at the first optimizer step of this step: read "
        "as the step begins, after the schedule's steps so far (warmup / decay, "
        "`grpo.engine.lr_schedules`), before this step's own. The rate after the step (the next "
        'step\'s) is `trainer.optimizer.param_groups[0]["lr"]`; with `adaptive_lr_kl` the rate '
        "the update set is `optim/adaptive_lr`. Absent when nothing is trained (no optimizer).",
    ),
    _m("time/generate", "slowest", "step", "Seconds in `policy.generate_actions`."),
    _m("time/score", "slowest", "step", "Seconds in the reward model."),
    _m(
        "time/logprobs",
        "slowest",
        "step",
        "Seconds computing old (when recorded there) and reference log-probs at collection.",
    ),
    _m("time/update", "slowest", "step", "Seconds in advantages + the optimisation epochs."),
    _m("time/step", "slowest", "step", "Seconds of the whole `step` call."),
    _m(
        "optim/adaptive_lr",
        "global",
        "optional",
        "With `GRPOConfig.adaptive_lr_kl`: the adapted learning rate η of the first parameter "
        "group after this step's update (before warmup / decay multiply it; rule in "
        "`grpo.update.adaptive_lr`). Absent otherwise.",
    ),
    _m(
        "restart/reward_shift",
        "global",
        "optional",
        "With `GRPOConfig.reward_shift_z`: 1 on the step after which the policy was restarted from "
        "its starting weights, on probation, because the rewards fell while it stood still (rule in "
        "`grpo.training.reward_shift`), else 0. Absent otherwise.",
    ),
    _m(
        "restart/given_back",
        "global",
        "optional",
        "With `GRPOConfig.reward_shift_z`: 1 on the step after which the policy a restart replaced "
        "was given back, because the restarted policy's groups still favoured it (the task got "
        "harder or its rewards were rescaled, not changed; `grpo.training.reward_shift`), else 0. Absent "
        "otherwise.",
    ),
    _m(
        "episode/success_rate",
        "samples",
        "optional",
        "With actions that report success (`grpo.gym.episodes.Episode` of an env whose step info holds "
        "`success` or `is_success`): (1/N) Σ_i 1[episode i succeeded], the fraction of the N "
        "episodes in which some step reported success (`grpo.rollout.action_stats.success_metrics`). "
        "With back-fill these are the kept groups' episodes, mixed by construction: the policy's "
        "rate is `sampling/drawn_successes` / `sampling/drawn_episodes`. Absent otherwise.",
    ),
    _m("time/data", "slowest", "train", "Seconds drawing this step's states from the source."),
    _m(
        "throughput/samples_per_s",
        "sum",
        "train",
        "N / (`time/data` + `time/step`): samples generated, scored and trained on per second.",
    ),
    _m("throughput/steps_per_s", "global", "train", "1 / (`time/data` + `time/step`)."),
    _m("eval/reward/mean", "samples", "eval", "Mean reward over the n·G evaluation samples."),
    _m("eval/reward/std", "pooled_std", "eval", "Standard deviation of the n·G evaluation rewards."),
    _m("eval/reward/min", "min", "eval", "Smallest evaluation reward."),
    _m("eval/reward/max", "max", "eval", "Largest evaluation reward."),
    _m(
        "eval/reward/<component>/mean",
        "samples",
        "eval",
        "Mean of one component's reward over the evaluation samples.",
    ),
    _m("time/eval", "slowest", "eval", "Seconds of the evaluation."),
    _m(
        "advantage/frac_dropped_groups",
        "groups",
        "optional",
        "With `drop_zero_variance_groups=True` (DAPO's dynamic sampling): fraction of the B groups "
        "whose rewards are all equal and that were left out of the loss (their rows leave the loss "
        "normaliser too).",
    ),
    _m(
        "sampling/draws",
        "sum",
        "optional",
        "With `max_sampling_draws` > 1 (dynamic sampling with back-fill): batches of states drawn "
        "this step (1 = no back-fill was needed).",
    ),
    _m(
        "sampling/kept_groups",
        "sum",
        "optional",
        "Dynamic sampling: groups with mixed rewards (max > min) in the step's batch (B unless capped).",
    ),
    _m(
        "sampling/dropped_groups",
        "sum",
        "optional",
        "Dynamic sampling: groups drawn whose rewards were all equal and that were left out of the batch.",
    ),
    _m(
        "sampling/surplus_groups",
        "sum",
        "optional",
        "Dynamic sampling: mixed groups drawn beyond the B the batch holds (the last draw's extra).",
    ),
    _m(
        "sampling/drawn_episodes",
        "sum",
        "optional",
        "Dynamic sampling, episodes that report success: every episode drawn this step, kept or left out.",
    ),
    _m(
        "sampling/drawn_successes",
        "sum",
        "optional",
        "Dynamic sampling, episodes that report success: how many of `sampling/drawn_episodes` "
        "succeeded. Their ratio is the policy's success rate at this step (`episode/success_rate` is "
        "the kept batch's, which back-fill fills with groups of mixed outcome).",
    ),
    _m(
        "sampling/capped",
        "max",
        "optional",
        "Dynamic sampling: 1 when the step stopped short of B mixed groups (max_sampling_draws reached "
        "or the source ran out) and trained on those found, else 0.",
    ),
    _m(
        "reward/dropped_groups",
        "sum",
        "optional",
        'With `invalid_rewards="drop_groups"`: number of groups dropped this step because a reward '
        "in them was NaN, inf or None.",
    ),
    _m(
        "eval/reward/dropped_groups",
        "global",
        "optional",
        'With `invalid_rewards="drop_groups"`, on evaluation records: number of evaluation groups '
        "left out of every `eval/reward/*` value because a reward in them was NaN, inf or None.",
    ),
    _m(
        "clip/frac",
        "valid_steps",
        "optional",
        "With `use_liger_loss=True`: fraction of valid steps whose ratio was clipped (low or high; "
        "Liger's fused loss reports the two together), in place of `clip/frac_low` / "
        "`clip/frac_high`.",
    ),
    _m(
        "eval/pass@<k>",
        "samples",
        "optional",
        "With `ks` (`EvalOptions`), on evaluation records: unbiased pass@k, "
        "1 - C(n-c, k)/C(n, k) per state (c correct of n = the evaluation group size; correct: "
        "reward >= `success_threshold`), averaged over the states (`grpo.algorithms.pass_at_k`).",
    ),
    _m(
        "eval/maj@<k>",
        "samples",
        "optional",
        "With `ks` and `answer`, on evaluation records: unbiased maj@k, the chance that the "
        "majority answer of k of the n samples is correct (ties split evenly, samples without an "
        "answer do not vote), averaged over the states.",
    ),
    _m(
        "sampler/is_weight_mean",
        "valid_steps",
        "optional",
        "With `sampler_is_cap`: mean over valid steps (and optimizer steps) of the importance weight "
        "w of the sampler/trainer mismatch, as `sampler_correction` computes it from "
        "exp(logp_old − logp_sampler) and the cap (masked steps count as 0; the sequence modes "
        "give each valid step its sample's weight). 1 = no mismatch.",
    ),
    _m(
        "sampler/is_frac_capped",
        "valid_steps",
        "optional",
        "With `sampler_is_cap`: fraction of valid steps whose ratio (the token's, or its sample's for "
        "the sequence modes) exceeded the cap: truncated to it (`*_truncate`) or masked to weight 0 "
        "(`*_mask`).",
    ),
    _m(
        "async/staleness",
        "max",
        "optional",
        "With a generation engine that owns its weights (`generation_engine` 'worker' / 'vllm'): "
        "steps between the weights that sampled the step's batch and the weights it trains, "
        "max over its samples (`ExperienceBatch.policy_versions`); at most `async_staleness`.",
    ),
    _m(
        "async/sync_seconds",
        "slowest",
        "optional",
        "With an engine that reports it: seconds the last weight sync to the generation engine "
        "took in the trainer's process (copying the trainable weights into shared memory for the "
        "worker; what only LoRA weights move for a LoRA policy).",
    ),
    _m(
        "sampler/ess",
        "global",
        "optional",
        "With `sampler_is_cap`: effective sample size of the applied weights as a fraction, "
        "(Σ w)² / (n Σ w²) over the n units of the update (valid steps; samples for the sequence "
        "modes), from sums over every process. 1 = equal weights; near 1/n = one unit dominates; "
        "0 = every unit masked; NaN = no valid unit.",
    ),
    _m(
        "completion/tokens",
        "sum",
        "llm",
        "Σ L_i: the length of the N actions together (tokens of the step's completions).",
    ),
    _m("completion/mean_length", "samples", "llm", "Σ L_i / N: the mean length of the N actions."),
    _m("completion/min_length", "min", "llm", "The shortest action's length."),
    _m("completion/max_length", "max", "llm", "The longest action's length."),
    _m(
        "completion/frac_truncated",
        "samples",
        "llm",
        "Fraction of the N actions cut at the length limit without ending (`truncated`: no EOS "
        "within `max_new_tokens`). Near 1, the limit is too short for the task.",
    ),
    _m(
        "completion/mean_terminated_length",
        "finished",
        "llm",
        "Mean length of the actions that ended on their own (not `truncated`: an EOS); NaN when none did.",
    ),
)
"""Every metric, in glossary order."""

_BY_NAME = {m.name: m for m in METRICS}
_PLACEHOLDERS = {"<component>": "[^/]+", "<k>": "[0-9]+"}


def _pattern(name: str) -> re.Pattern[str]:
    """``name`` with each placeholder (`_PLACEHOLDERS`) as the regex of what it stands for."""
    regex = re.escape(name)
    for placeholder, what in _PLACEHOLDERS.items():
        regex = regex.replace(re.escape(placeholder), what)
    return re.compile(f"^{regex}$")


_PATTERNS = [(_pattern(m.name), m) for m in METRICS if any(p in m.name for p in _PLACEHOLDERS)]


def metric(name: str) -> Metric | None:
    """The declaration of ``name`` (a component name matches its ``<component>`` pattern, a k its
    ``<k>``), or None
    for a name the library does not log (e.g. statistics of a user's ``advantage_fn``)."""
    found = _BY_NAME.get(name)
    if found is not None:
        return found
    for pattern, m in _PATTERNS:
        if pattern.match(name):
            return m
    return None


# ---- across processes ------------------------------------------------------------------------------
def _weighted(v: Tensor, w: Tensor) -> Tensor:
    total = w.sum()
    return (v * w).sum() / total if float(total) > 0 else v.mean()


def _pooled_std(v: Tensor, mean: Tensor, n: Tensor) -> Tensor:
    total = n.sum()
    if not float(total) > 1:
        return torch.zeros((), dtype=v.dtype)
    grand = (n * mean).sum() / total
    ss = ((n - 1).clamp(min=0) * v * v + n * (mean - grand) ** 2).sum()
    return (ss / (total - 1)).clamp(min=0).sqrt()


def _reduce_column(name: str, cols: Mapping[str, Tensor], counts: Mapping[str, Tensor]) -> Tensor:
    v = cols[name]
    declared = metric(name)
    kind = "global" if declared is None else declared.reduce
    if kind in ("samples", "groups", "valid_steps"):
        return _weighted(v, counts[kind])
    if kind == "pooled_std":
        mean_name = name[: -len("std")] + "mean"
        return _pooled_std(v, cols[mean_name], counts["samples"]) if mean_name in cols else v.mean()
    if kind in ("share", "sum"):
        return v.sum()
    if kind in ("max", "slowest"):
        return v.max()
    if kind == "min":
        return v.min()
    if kind == "finished" and "completion/frac_truncated" in cols:
        return _finished_mean(v, counts["samples"] * (1 - cols["completion/frac_truncated"]))
    return v.mean()


def _finished_mean(v: Tensor, ended: Tensor) -> Tensor:
    """Mean of per-process means over their ``ended`` samples (a process without one holds NaN)."""
    total = ended.sum()
    if not float(total) > 0:
        return torch.full((), math.nan, dtype=v.dtype)
    return torch.where(ended > 0, v * ended, torch.zeros_like(v)).sum() / total


def empty_extremes_as_nan(metrics: dict[str, float]) -> dict[str, float]:
    """``ratio/min`` / ``ratio/max`` of an update without a valid step are the empty min / max
    (+inf / -inf, what the reduction across processes needs); after it they become NaN."""
    lo, hi = metrics.get("ratio/min"), metrics.get("ratio/max")
    if lo is not None and hi is not None and lo > hi:
        metrics["ratio/min"] = metrics["ratio/max"] = math.nan
    return metrics


def reduce_across_ranks(
    metrics: Mapping[str, float], counts: StepCounts, all_gather: Callable[[Tensor], Tensor]
) -> dict[str, float]:
    """The global value of each metric from every process's local values, by its declared
    reduction (one ``all_gather`` of a float64 vector; identical on every process).

    ``all_gather(t)`` stacks every process's ``t`` into ``(world_size, *t.shape)``. Every process
    must log the same names (a `RuntimeError` on every process otherwise).
    """
    names = list(metrics)
    key = float(zlib.crc32("\n".join(names).encode()))
    local = torch.tensor(
        [key, counts.samples, counts.groups, counts.valid_steps, *(float(metrics[k]) for k in names)],
        dtype=torch.float64,
    )
    every = all_gather(local).cpu()  # (W, 4 + K)
    if not bool((every[:, 0] == key).all()):
        raise RuntimeError(
            "the processes returned different metric names this step, so their metrics cannot be "
            "combined; every rank must use the same reward model and config."
        )
    weights = {"samples": every[:, 1], "groups": every[:, 2], "valid_steps": every[:, 3]}
    cols = {k: every[:, 4 + i] for i, k in enumerate(names)}
    return {k: float(_reduce_column(k, cols, weights)) for k in names}


# ---- the glossary -------------------------------------------------------------------------------
_SECTIONS: tuple[tuple[Section, str, str], ...] = (
    ("step", "Returned by `GRPOTrainer.step`", ""),
    ("train", "Added by `GRPOTrainer.train` on every step", ""),
    (
        "eval",
        "Evaluation (`GRPOTrainer.evaluate`, and every `eval_every` steps in `train`)",
        "G actions are sampled for each of the n evaluation states and scored; nothing is updated.\n\n",
    ),
    (
        "optional",
        "Present only with some options",
        "These keys are added to the records of `GRPOTrainer.step` (and so `train`), or of "
        "`evaluate` for `eval/*` keys, only when the option that produces them is on.\n\n",
    ),
    (
        "llm",
        "Returned by `GRPOTrainer.step` when the actions report their lengths (LLM completions)",
        "Each action reports its length L_i with `len(action)` and whether it was cut at the "
        "length limit without ending with `action.truncated` (or `action.finished`, the "
        "negation; the hook of `grpo.rollout.action_stats`). `grpo.llm.Completion` has them: L_i "
        "is its number of tokens, `truncated` whether it hit `max_new_tokens` without an EOS. "
        "Actions without them (tensors, ints, gym episodes) report none of these keys.\n\n",
    ),
)

_HEADER = """# Metric glossary

<!-- generated from grpo/metrics/__init__.py by `python -m grpo.metrics > docs/metrics.md`; edit there -->

Every metric the library logs, with one name each. `GRPOTrainer.step` returns the first table;
`GRPOTrainer.train` adds the second on every step and the third on evaluation steps, and sends
the whole record to each metric sink (`grpo.metrics.sinks`) and to the callbacks. All values are
Python floats.

Notation: B states per step, G actions per state (`group_size`), N = B·G samples, T steps per
action, "valid step" = an entry of the `(N, T)` mask. "Averaged over the update" means over every
valid step of every micro-batch of every optimizer step of the step (all epochs); "per optimizer
step" values are averaged over the `optimizer_steps_per_step` optimizer steps.

A name with `<component>` stands for one entry per named reward of a
[`CombinedReward`](api.md#grpo.reward_model_base.CombinedReward); it is absent with a single
reward. A name with `<k>` stands for one entry per k of the evaluation's `ks`.

The "across processes" column says how the values of several processes (torchrun) combine into
the one every process returns: `samples` / `groups` / `valid_steps` = mean weighted by that count,
`pooled_std` = pooled with the matching mean, `share` = sum of each process's share of a global
loss, `sum`, `min`, `max`, `slowest` = max (seconds), `global` = already equal on every process,
`finished` = mean weighted by each process's actions that ended on their own.
"""


def glossary_markdown() -> str:
    """docs/metrics.md, rendered from `METRICS`."""
    parts = [_HEADER]
    for section, title, intro in _SECTIONS:
        parts.append(f"\n## {title}\n\n{intro}| name | across processes | meaning |\n| --- | --- | --- |\n")
        parts.extend(f"| `{m.name}` | {m.reduce} | {m.help} |\n" for m in METRICS if m.section == section)
    return "".join(parts)
