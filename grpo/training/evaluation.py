"""Evaluation (`evaluate`): rewards, pass@k and maj@k of G sampled actions per held-out state.

`evaluate` samples G actions per eval state and scores them, without log-probs, gradients or any
weight change, under the trainer's reward settings (``config.reward_timeout``,
``config.invalid_rewards``). G defaults to the training ``config.group_size``; an evaluation may
sample its own (``group_size=``) at its own temperature (``temperature=``). With ``ks=`` it also
reports the unbiased pass@k (a sample is correct when its reward reaches ``success_threshold``)
and, with an ``answer`` extractor, maj@k (`grpo.algorithms.pass_at_k`). `EvalOptions` holds these
settings for `grpo.training.loop.train`'s schedule.

It runs on forked RNG streams (torch, Python, NumPy: `grpo.training.rng`), so evaluating never
changes what training samples; `grpo.training.loop.train` evaluates with the fixed seed
``config.seed`` (0 when None), so successive evaluations share random numbers.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from grpo.algorithms.pass_at_k import maj_at_k, pass_at_k
from grpo.experience_collector import ExperienceBatch, ExperienceCollector
from grpo.training.callbacks import TrainerLike
from grpo.training.rng import forked_rng
from grpo.training.sources import num_states, state_sequence

if TYPE_CHECKING:
    from grpo.config import GRPOConfig

__all__ = ["AnswerFn", "EvalOptions", "check_eval_options", "evaluate"]

AnswerFn = Callable[[Any], Hashable | None]
"""An action's final answer for majority voting (None: no answer; it does not vote). It gets a
completion's text for a `grpo.llm.Completion` (so ``grpo.llm.rewards.last_number`` works as is),
else the action itself (a Tensor action as Python numbers, ``.tolist()``)."""


def _is_int_at_least_1(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


@dataclasses.dataclass(frozen=True)
class EvalOptions:
    """How `evaluate` samples and scores; `grpo.training.loop.train(eval_options=...)` uses them
    for every scheduled evaluation. The fields are `evaluate`'s keyword arguments of the same names.

    Attributes:
        group_size: samples per eval state (n of pass@k); None = the training ``config.group_size``.
        temperature: sampling temperature of the evaluation, passed as
            ``policy.generate_actions(..., temperature=t)``; None = the policy's own. A policy
            that does not take it is refused with a `TypeError`.
        batch_size: eval states per generation call; None = ``config.batch_size``.
        ks: the k of ``eval/pass@k`` (and ``eval/maj@k`` with ``answer``); each <= group_size;
            kept sorted and without repeats (a single int is one k).
        answer: an `AnswerFn` (e.g. ``grpo.llm.rewards.last_number``); with ``ks``, adds maj@k.
        success_threshold: a sample is correct when its reward is >= this (default 1.0: the
            reward of a verified answer, e.g. ``exact_match_reward``'s ``correct=1.0``).
        success_component: compare this reward component (a `CombinedReward` name, e.g. the
            accuracy part without a format bonus) instead of the total reward.
    """

    group_size: int | None = dataclasses.field(
        default=None, metadata={"help": "Samples per eval state (n of pass@k); None = config.group_size."}
    )
    temperature: float | None = dataclasses.field(
        default=None, metadata={"help": "Sampling temperature of the evaluation; None = the policy's own."}
    )
    batch_size: int | None = dataclasses.field(
        default=None, metadata={"help": "Eval states per generation call; None = config.batch_size."}
    )
    ks: Sequence[int] = dataclasses.field(
        default=(),
        metadata={"help": "The k of eval/pass@k (and eval/maj@k with answer); each <= group size."},
    )
    answer: AnswerFn | None = dataclasses.field(
        default=None, metadata={"help": "Action -> final answer (None: no vote); with ks, adds eval/maj@k."}
    )
    success_threshold: float = dataclasses.field(
        default=1.0, metadata={"help": "A sample is correct when its reward is >= this."}
    )
    success_component: str | None = dataclasses.field(
        default=None, metadata={"help": "Compare this reward component instead of the total reward."}
    )

    def __post_init__(self) -> None:
        for name in ("group_size", "batch_size"):
            v = getattr(self, name)
            if v is not None and not _is_int_at_least_1(v):
                raise ValueError(f"evaluation {name}={v!r} is not allowed: expected an integer >= 1 or None.")
        t = self.temperature
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < math.inf):
            raise ValueError(
                f"evaluation temperature={t!r} is not allowed: expected a finite number > 0 "
                f"(e.g. 0.6), or None for the policy's own temperature."
            )
        ks: Any = self.ks
        if isinstance(ks, (str, bytes)) or not isinstance(ks, (Sequence, set, frozenset)):
            ks = [ks]  # a single k, or something else that the check below names
        if not all(_is_int_at_least_1(k) for k in ks):
            raise ValueError(
                f"evaluation ks={self.ks!r} is not allowed: expected integers >= 1, e.g. ks=(1, 4)."
            )
        object.__setattr__(self, "ks", tuple(sorted(set(ks))))
        if self.answer is not None and not callable(self.answer):
            raise TypeError(
                f"evaluation answer={self.answer!r} is not callable; pass a function action -> answer."
            )
        if self.answer is not None and not self.ks:
            raise ValueError("evaluation answer= is given but ks is empty; maj@k needs ks, e.g. ks=(4,).")
        th = self.success_threshold
        if isinstance(th, bool) or not isinstance(th, (int, float)) or not math.isfinite(th):
            raise ValueError(f"evaluation success_threshold={th!r} is not allowed: expected a finite number.")

    def resolved_group_size(self, config: GRPOConfig) -> int:
        """The evaluation's G (``group_size`` or ``config.group_size``); a `ValueError` when a k
        of ``ks`` is larger."""
        g = self.group_size if self.group_size is not None else config.group_size
        too_big = [k for k in self.ks if k > g]
        if too_big:
            raise ValueError(
                f"evaluation ks={list(self.ks)} holds k={too_big} larger than the evaluation group size "
                f"{g} (samples per state): pass@k and maj@k need k <= n. Set the evaluation "
                f"group_size to at least {max(too_big)}, or drop those k."
            )
        return g

    def as_kwargs(self) -> dict[str, Any]:
        """The fields as `evaluate`'s keyword arguments."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def _chunks(states: Any, size: int) -> Iterator[Any]:
    """``states`` in chunks of ``size`` (a ``datasets.Dataset``'s rows as lists of records)."""
    states = state_sequence(states)
    n = num_states(states)
    if n is None:
        raise TypeError(
            f"eval states must be a sequence of states or a Tensor (n, ...), got {type(states).__name__}."
        )
    if n == 0:
        raise ValueError("eval states are empty; give at least one state to evaluate on.")
    for i in range(0, n, size):
        yield states[i : i + size]


@dataclasses.dataclass
class _Samples:
    """What the chunks of an evaluation gave: rewards (and components) per chunk, the groups
    dropped as invalid, and (with ``ks``) each kept group's correctness (b, G) and answers."""

    rewards: list[Tensor] = dataclasses.field(default_factory=list)
    comps: dict[str, list[Tensor]] = dataclasses.field(default_factory=dict)
    dropped: int = 0
    correct: list[Tensor] = dataclasses.field(default_factory=list)
    answers: list[list[Hashable | None]] = dataclasses.field(default_factory=list)


def evaluate(
    trainer: TrainerLike,
    states: Any,
    options: EvalOptions | None = None,
    *,
    seed: int | None = None,
    **kwargs: Any,
) -> dict[str, float]:
    """Rewards of G sampled actions per state, and pass@k / maj@k with ``ks``; no update, no
    weight change, RNG streams untouched.

    Samples G actions for each of the n states (G = ``group_size`` or ``config.group_size``, in
    chunks of ``batch_size`` or ``config.batch_size`` states), scores them with the reward model,
    and returns over all ``n * G`` samples::

        eval/reward/{mean,std,min,max}, eval/reward/<component>/mean, time/eval

    and with ``ks`` (a sample is correct when its reward, or ``success_component``, is
    ``>= success_threshold``), averaged over the n states::

        eval/pass@<k>   1 - C(G - c, k) / C(G, k) for a state with c correct of G (Chen et al. 2021)
        eval/maj@<k>    (with ``answer``) the majority answer of k samples is correct (ties
                        split); both exact means over all k-subsets (`grpo.algorithms.pass_at_k`)

    The reward is called as in training: with ``config.reward_timeout``, and with
    ``config.invalid_rewards='drop_groups'`` a group holding a None/NaN/inf reward is left out of
    every ``eval/*`` value and counted in ``eval/reward/dropped_groups`` (present only with that
    setting); a `ValueError` when every group is invalid. With ``'raise'`` an invalid reward raises.

    No log-probs are computed and no gradient is taken. The RNG streams (torch, Python, NumPy)
    are forked: afterwards they are exactly as before, so evaluating does not change training.
    ``group_size`` ... ``success_component`` are the fields of `EvalOptions` (each error is
    raised before anything is sampled).

    Args:
        trainer: the trainer whose policy and reward model are evaluated.
        states: a sequence of n states or a Tensor (n, ...).
        options: the `EvalOptions`; None = its fields given as keywords (``group_size=8,
            ks=(1, 8)``, each with `EvalOptions`' default when absent), not both.
        seed: seed the forked streams with this value (None = continue from the current state
            without advancing it).
        **kwargs: `EvalOptions` fields (without ``options``); every other keyword is passed to
            ``policy.generate_actions``.
    """
    t0 = time.perf_counter()
    opts, generate_kwargs = _options_and_generate_kwargs(options, kwargs)
    g, verify_temperature = check_eval_options(trainer, opts)
    if opts.temperature is not None:
        generate_kwargs = {**generate_kwargs, "temperature": opts.temperature}
    trainer.check_lockstep(states)  # ZeRO-3: all ranks must run the same forwards
    samples = _sample(trainer, states, seed, opts, g, generate_kwargs, verify_temperature)
    out = _reward_statistics(samples.rewards, samples.comps, samples.dropped)
    out.update(_success_statistics(samples, opts.ks, g))
    if trainer.config.invalid_rewards == "drop_groups":
        out["eval/reward/dropped_groups"] = float(samples.dropped)
    out["time/eval"] = time.perf_counter() - t0
    return out


# ---- checks, before anything is sampled -------------------------------------------------------
_OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(EvalOptions))


def _options_and_generate_kwargs(
    options: EvalOptions | None, kwargs: Mapping[str, Any]
) -> tuple[EvalOptions, dict[str, Any]]:
    """`evaluate`'s `EvalOptions` (``options``, or built from the keywords named like its fields)
    and the other keywords (for ``policy.generate_actions``)."""
    fields = {k: v for k, v in kwargs.items() if k in _OPTION_NAMES}
    rest = {k: v for k, v in kwargs.items() if k not in _OPTION_NAMES}
    if options is None:
        return EvalOptions(**fields), rest
    if not isinstance(options, EvalOptions):
        raise TypeError(
            f"evaluate(options=...) takes a grpo.training.evaluation.EvalOptions, got "
            f"{type(options).__name__}; e.g. options=EvalOptions(group_size=8, ks=(1, 8))."
        )
    if fields:
        raise TypeError(
            f"evaluate() got options= and the EvalOptions fields {sorted(fields)} as keywords; "
            f"pass one or the other (e.g. dataclasses.replace(options, {next(iter(sorted(fields)))}=...))."
        )
    return options, rest


def check_eval_options(trainer: TrainerLike, options: EvalOptions) -> tuple[int, bool]:
    """Refuse options the trainer cannot evaluate with, before anything is sampled (`train` calls
    it before its first step): a k above the group size, a temperature the policy cannot take, a
    ``success_component`` the reward model does not have.

    Returns the evaluation's group size G and whether the first chunk's actions must show that
    the temperature was honoured (a ``**kwargs`` policy: `evaluate` checks the recorded one).
    """
    g = options.resolved_group_size(trainer.config)
    verify_temperature = _check_temperature(trainer.policy, options.temperature)
    _check_component(trainer.reward_model, options.success_component)
    return g, verify_temperature


def _check_temperature(policy: Any, temperature: float | None) -> bool:
    """Refuse ``temperature`` for a policy whose ``generate_actions`` cannot take it. Returns
    whether the sampled actions must show it was honoured: a ``**kwargs`` signature accepts any
    keyword, and some policies ignore the ones they do not know."""
    if temperature is None:
        return False
    name = type(policy).__name__
    try:
        params = inspect.signature(policy.generate_actions).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): check the actions
        return True
    if "temperature" in params and params["temperature"].kind is not inspect.Parameter.VAR_POSITIONAL:
        return False
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return True
    raise TypeError(
        f"evaluate(temperature={temperature}) needs a policy whose generate_actions takes a "
        f"temperature keyword; {name}.generate_actions({', '.join(params)}) "
        f"does not. Leave temperature=None (the policy's own), or add a temperature keyword to "
        f"{name}.generate_actions."
    )


def _check_honoured_temperature(policy: Any, actions: Any, temperature: float) -> None:
    """After the first chunk of a ``**kwargs`` policy: its actions must record the temperature
    they were sampled at (`grpo.llm.Completion.temperature`), and it must be ``temperature``."""
    name = type(policy).__name__
    first = actions[0] if len(actions) else None
    got = getattr(first, "temperature", None)
    if not isinstance(got, (int, float)):
        raise TypeError(
            f"evaluate(temperature={temperature}): {name}.generate_actions takes **kwargs but its "
            f"actions do not record the temperature they were sampled at (a `temperature` "
            f"attribute, as grpo.llm.Completion has), so a temperature it ignores could not be told "
            f"from one it applies. Leave temperature=None for {name}, or declare a temperature "
            f"parameter in {name}.generate_actions."
        )
    if not math.isclose(float(got), temperature, rel_tol=1e-6):
        raise ValueError(
            f"evaluate(temperature={temperature}): {name}.generate_actions sampled at temperature "
            f"{got}, not the {temperature} asked for; it does not apply a per-call temperature."
        )


def _check_component(reward_model: Any, component: str | None) -> None:
    """Refuse a ``success_component`` the reward model's ``components`` does not name (a reward
    without a ``components`` mapping is checked on the first chunk)."""
    parts = getattr(reward_model, "components", None)
    if component is not None and isinstance(parts, Mapping) and component not in parts:
        raise ValueError(
            f"evaluation success_component={component!r} is not a component of the reward model "
            f"{type(reward_model).__name__}; its components are {sorted(parts)}."
        )


# ---- sampling -------------------------------------------------------------------------------
def _sample(
    trainer: TrainerLike,
    states: Any,
    seed: int | None,
    opts: EvalOptions,
    g: int,
    generate_kwargs: dict[str, Any],
    verify_temperature: bool,
) -> _Samples:
    """The rewards (and components, correctness, answers) of G actions per state, chunk by chunk,
    on forked RNG streams and without gradients. The policy is put back in training mode if it
    was in it."""
    cfg = trainer.config
    collector = ExperienceCollector(
        trainer.policy,
        trainer.reward_model,
        g,
        trainer.device,
        reference_policy=None,
        record_old_log_probs=False,
        invalid_rewards=cfg.invalid_rewards,
        reward_timeout=cfg.reward_timeout,
        allow_empty=True,  # a chunk whose groups are all invalid is dropped whole; see evaluate
    )
    was_training = getattr(trainer.policy, "training", None)
    out = _Samples()
    try:
        with forked_rng(trainer.device, seed), torch.no_grad():
            for i, chunk in enumerate(_chunks(states, opts.batch_size or cfg.batch_size)):
                batch = collector.collect(chunk, **generate_kwargs)
                if i == 0 and verify_temperature and opts.temperature is not None:
                    _check_honoured_temperature(trainer.policy, batch.actions, opts.temperature)
                _add_chunk(out, batch, opts, g)
    finally:
        if was_training is True:
            trainer.policy.train()
    return out


def _add_chunk(out: _Samples, batch: ExperienceBatch, opts: EvalOptions, g: int) -> None:
    """One chunk's rewards and components; with ``ks`` its correctness (b, G) and answers."""
    out.dropped += batch.dropped_groups
    out.rewards.append(batch.rewards.detach().double())
    for k, v in batch.reward_components.items():
        out.comps.setdefault(k, []).append(v.detach().double())
    if not opts.ks:
        return
    score = batch.rewards
    if opts.success_component is not None:
        if opts.success_component not in batch.reward_components:
            raise ValueError(
                f"evaluation success_component={opts.success_component!r} is not among the reward "
                f"components {sorted(batch.reward_components)}; name one of them, or None to "
                f"compare the total reward."
            )
        score = batch.reward_components[opts.success_component]
    out.correct.append((score.detach() >= opts.success_threshold).view(-1, g).cpu())  # (b, G)
    if opts.answer is not None:
        answers = [_answer_of(opts.answer, a) for a in _action_list(batch.actions)]
        out.answers += [answers[j : j + g] for j in range(0, len(answers), g)]


def _action_list(actions: Any) -> list[Any]:
    """The N flat actions as a list (a Tensor's rows as Python numbers or lists)."""
    if isinstance(actions, Tensor):
        rows: list[Any] = actions.cpu().tolist()
        return rows
    return list(actions)


def _answer_of(answer: AnswerFn, action: Any) -> Hashable | None:
    """``answer`` of a completion's text (an action with a ``text`` str) or of the action; a
    Tensor answer as a Python number or tuple."""
    text = getattr(action, "text", None)
    value = answer(text if isinstance(text, str) else action)
    if isinstance(value, Tensor):
        value = value.item() if value.numel() == 1 else tuple(value.flatten().tolist())
    return value


# ---- statistics -----------------------------------------------------------------------------
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


def _success_statistics(samples: _Samples, ks: Sequence[int], g: int) -> dict[str, float]:
    """``eval/pass@<k>`` (and ``eval/maj@<k>`` when answers were extracted), means over the kept
    groups."""
    if not ks:
        return {}
    correct = torch.cat(samples.correct)  # (B, G) bool
    c = correct.sum(1)  # (B,) correct samples per state
    out = {f"eval/pass@{k}": float(pass_at_k(g, c, k).mean()) for k in ks}
    if samples.answers:
        for k in ks:
            votes = [maj_at_k(a, row, k) for a, row in zip(samples.answers, correct, strict=True)]
            out[f"eval/maj@{k}"] = math.fsum(votes) / len(votes)
    return out
