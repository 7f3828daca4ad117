"""Multi-turn episodes for a causal LM: the policy plays a `grpo.envs.TextEnvironment` turn by turn,
and GRPO treats each whole episode as one action (a bandit over conversations).

The seed: "In the multi-turn case, rollouts are still treated as a bandit problem, with
environment generated tokens masked and reward signal calculated from cumulative episode reward."

One rollout of `MultiTurnPolicy.generate_actions(starts, G)`::

    env = make_env(N)                     # N = B*G chat episodes (built once per N, reused)
    first = env.reset([s for s in starts for _ in range(G)])   # a group: G episodes, one start
    context_i = chat_template(first_i, add_generation_prompt=True)            # prompt_ids
    for turn k = 0, 1, ... while an episode runs:
        turns = policy.generate_from_ids(contexts of the running episodes)  # ONE batched call
        # a turn ends at an EOS id (the end-of-turn token) or at its token budget
        t = env.step(turn texts)           # reward of turn k, terminated, truncated, messages
        context_i += turn tokens (model) + chat-template delta of the env's messages (env)

The chat-template delta of the environment's messages M after a conversation C (ending with the
model's turn) is ``render(C + M, add_generation_prompt=True)`` minus ``render(C)``: the markup
that closes the model's turn (when the template adds some the model did not generate, e.g. a
newline after ``<|im_end|>``), M's messages, and the generation prompt of the next turn. It needs
the template's prefix property (rendering a longer conversation extends the shorter one's text);
a template that rewrites earlier turns (e.g. drops past reasoning) is refused with a clear error.

An episode ends when the environment terminates or truncates it, after ``max_turns`` turns, or
when its tokens after the prompt (model and environment tokens) would pass ``max_total_tokens``
(or the policy's ``max_model_len``): ``truncated``. Each turn's budget is
``min(max_new_tokens, max_total_tokens - tokens so far, max_model_len - context length)``.

Scoring: the action is a `Conversation`; its log-probs are the per-token log-probs of every token
after the prompt, computed by one forward over the whole episode (the causal LM's own scorer),
with ``mask = model_mask``: environment tokens stay in the context and are scored by no one
(log-prob 0, no gradient). The model tokens' log-probs therefore equal a plain forward over
``prompt_ids + token_ids``.

Rewards (`ConversationReward`): the cumulative episode reward ``R = sum_k r_k`` (N,) (the seed's
bandit), or turn-level credit: per-token rewards (N, T) whose discounted return-to-go over the
model tokens (the trainer's ``discounted_returns`` with ``GRPOConfig.gamma``) equals the turn's
return-to-go ``R_k = sum_{k' >= k} gamma^(k' - k) r_k'`` at every model token of turn k (the
discount is per turn, not per token; see `turn_token_rewards`).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from grpo.algorithms.advantages import discounted_returns
from grpo.envs.protocol import Message, TextEnvironment, Transition
from grpo.llm.completion import Completion
from grpo.llm.policy import CausalLMPolicy
from grpo.llm.sampling_settings import SamplingSettings
from grpo.policy_base import EntropyRequest, PolicyOutput, has_method
from grpo.reward_model_base import StatelessReward

__all__ = [
    "Conversation",
    "ConversationReward",
    "MultiTurnPolicy",
    "MultiTurnReference",
    "chat_template_delta",
    "environment_text",
    "turn_token_rewards",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Conversation:
    """One multi-turn episode (the action of `MultiTurnPolicy`).

    Attributes:
        prompt_ids: (P,) int64, the first context: the chat template of the environment's first
            messages with the generation prompt (`CausalLMPolicy.encode_prompt`).
        token_ids: (T,) int64, every token after the prompt in order: the model's turns (each
            ending with its EOS / end-of-turn token when it ended) and the environment's tokens
            between them (`chat_template_delta`).
        model_mask: (T,) bool, True at the tokens the model generated (the only ones scored).
        turn_of_token: (T,) int64, the turn each token belongs to (environment tokens: the turn
            they answer).
        turn_rewards: the reward of each turn taken (``len = number of turns``).
        messages: the whole conversation (first messages, the model's turns as ``assistant``
            messages, the environment's messages).
        finished: the environment terminated the episode.
        truncated: it was cut: by the environment, at ``max_turns``, or at the token limits.
        temperature: the sampling temperature (log-probs are computed at it).
        infos: the environment's info dict of each turn.
    """

    prompt_ids: Tensor
    token_ids: Tensor
    model_mask: Tensor
    turn_of_token: Tensor
    turn_rewards: list[float]
    messages: list[Message]
    finished: bool
    truncated: bool
    temperature: float = 1.0
    infos: list[dict[str, Any]] = field(default_factory=list)

    def __len__(self) -> int:
        """The number of model tokens (the completion length the step's metrics report)."""
        return int(self.model_mask.sum())

    @property
    def num_turns(self) -> int:
        """Turns the model took."""
        return len(self.turn_rewards)

    @property
    def reward(self) -> float:
        """The cumulative episode reward ``sum_k r_k``."""
        return float(sum(self.turn_rewards))

    @property
    def turns(self) -> list[str]:
        """The model's turn texts, in order."""
        return [m["content"] for m in self.messages if m["role"] == "assistant"]

    def as_completion(self) -> Completion:
        """The `Completion` the causal LM scores: all tokens in the context, the model's in the
        loss (``loss_mask = model_mask``)."""
        text = self.turns[-1] if self.turns else ""
        return Completion(
            self.prompt_ids, self.token_ids, text, self.finished, self.temperature, 0, self.model_mask
        )

    def __str__(self) -> str:
        return "\n".join(f"{m['role']}: {m['content']}" for m in self.messages)


def chat_template_delta(tokenizer: Any, conversation: Sequence[Message], new: Sequence[Message]) -> str:
    """The text that follows ``conversation`` (ending with the model's turn) when the environment
    adds the messages ``new`` and the model is prompted again:
    ``render(conversation + new, add_generation_prompt=True)[len(render(conversation)):]``.

    ValueError, naming the template's problem, when the longer rendering does not start with the
    shorter one (the template rewrites earlier turns, so an episode cannot be one growing context).
    """
    return _delta(_render(tokenizer, conversation, False), _render(tokenizer, [*conversation, *new], True))


def _delta(base: str, full: str) -> str:
    """``full`` after its prefix ``base`` (`chat_template_delta`; ValueError when not a prefix)."""
    if not full.startswith(base):
        raise ValueError(
            "the tokenizer's chat template does not render a conversation as a prefix of its "
            "continuation: render(messages + new, add_generation_prompt=True) does not start with "
            f"render(messages) ({base[-60:]!r} vs {full[len(base) - 60 : len(base)]!r}). A "
            "multi-turn episode needs a template that only appends (no rewriting of past turns, "
            "e.g. no stripping of earlier reasoning); set tokenizer.chat_template to one that does."
        )
    return full[len(base) :]


def _render(tokenizer: Any, messages: Sequence[Message], add_generation_prompt: bool) -> str:
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return str(text)


def environment_text(
    tokenizer: Any,
    conversation: Sequence[Message],
    generated: str,
    new: Sequence[Message],
    prompted: str | None = None,
) -> str:
    """The text of the environment's tokens after the model's turn: the template's markup after
    the turn that the model did not generate (e.g. the newline after ``<|im_end|>``; the closing
    tag of a turn cut at its budget), then `chat_template_delta` of ``new``. Three renderings:

        before = render(conversation[:-1], add_generation_prompt=True)   # ``prompted`` if given
        base   = render(conversation)                                    # ends with the turn
        full   = render(conversation + new, add_generation_prompt=True)
        tail   = base[len(before):][len(generated):]   # "" unless base / turn start as expected
        text   = tail + full[len(base):]

    ``generated`` is the turn's decoded tokens with special tokens kept. Its cost grows with the
    messages rendered: `MultiTurnPolicy` passes a short conversation with the same end (see
    ``incremental_deltas`` there). ValueError when ``full`` does not start with ``base``.
    """
    before = _render(tokenizer, conversation[:-1], True) if prompted is None else prompted
    base = _render(tokenizer, conversation, False)
    tail = ""
    if base.startswith(before):
        turn = base[len(before) :]
        tail = turn[len(generated) :] if turn.startswith(generated) else ""
    return tail + _delta(base, _render(tokenizer, [*conversation, *new], True))


def turn_token_rewards(conversation: Conversation, gamma: float = 1.0) -> Tensor:
    """Per-token rewards (T,) float64 of one episode whose per-token discounted return-to-go over
    the model tokens equals the turn's return-to-go (the discount is per turn, not per token).

    With turn rewards r_k and ``R_k = r_k + gamma * R_{k+1}`` (``discounted_returns`` over turns),
    a model token of turn k gets ``r_k`` when it is the turn's last model token and
    ``(1 - gamma) * R_k`` otherwise; environment tokens get 0. Then
    ``discounted_returns(rewards, model_mask, gamma)`` (the trainer's per-step returns, which
    skip masked tokens) is ``R_k`` at every model token of turn k:
    last token ``r_k + gamma * R_{k+1} = R_k``; earlier ones ``(1 - gamma) R_k + gamma R_k = R_k``.
    With ``gamma = 1`` it is the turn reward on the turn's last token, 0 elsewhere.
    """
    r = torch.tensor(conversation.turn_rewards, dtype=torch.float64)  # (K,)
    k = int(r.shape[0])
    returns = discounted_returns(r.unsqueeze(0), torch.ones(1, k, dtype=torch.bool), gamma)[0]  # (K,)
    mask = conversation.model_mask.to(torch.bool)
    turn = conversation.turn_of_token.long()
    out = torch.zeros(mask.shape[0], dtype=torch.float64)
    idx = mask.nonzero().squeeze(1)  # positions of the model tokens
    if idx.numel() == 0:
        return out
    t = turn[idx]
    last = torch.ones_like(t, dtype=torch.bool)
    last[:-1] = t[1:] != t[:-1]  # the next model token belongs to another turn
    out[idx] = torch.where(last, r[t], (1.0 - gamma) * returns[t])
    return out


class ConversationReward(StatelessReward):
    """The reward of `Conversation` actions (a `grpo.RewardModel`).

    ``per_turn=False`` (default): the cumulative episode reward ``R_i = sum_k r_ik``, shape (N,).
    ``per_turn=True``: turn-level credit, per-token rewards (N, T) (`turn_token_rewards`, T the
    longest episode's tokens) that the trainer turns into per-token returns-to-go with
    ``GRPOConfig.gamma``; ``gamma`` here must be that same value (``GRPOConfig.gamma``), so that
    the return of every token of turn k is the turn's discounted return ``R_k``. The trainer then
    compares returns across the group at the same token position (its per-step baseline), and
    logs ``reward/mean`` as the sum of the per-token rewards (the cumulative reward when
    ``gamma = 1``).
    """

    def __init__(self, *, per_turn: bool = False, gamma: float = 1.0) -> None:
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"ConversationReward(gamma={gamma!r}): expected GRPOConfig.gamma, in [0, 1].")
        if gamma != 1.0 and not per_turn:
            raise ValueError(
                f"ConversationReward(gamma={gamma}) discounts turns only with per_turn=True; the "
                f"cumulative reward (per_turn=False) is the plain sum. Pass per_turn=True."
            )
        self.per_turn = per_turn
        self.gamma = float(gamma)

    def compute_rewards(self, states: Any, actions: Sequence[Conversation]) -> Tensor:
        convs = _conversations(actions, "ConversationReward.compute_rewards")
        if not self.per_turn:
            return torch.tensor([c.reward for c in convs], dtype=torch.float32)
        width = max(max(int(c.token_ids.shape[0]) for c in convs), 1)
        out = torch.zeros(len(convs), width, dtype=torch.float32)
        for i, c in enumerate(convs):
            out[i, : int(c.token_ids.shape[0])] = turn_token_rewards(c, self.gamma).float()
        return out


def _conversations(actions: Sequence[Any], where: str) -> list[Conversation]:
    convs = list(actions)
    bad = [i for i, a in enumerate(convs) if not isinstance(a, Conversation)]
    if bad:
        raise TypeError(
            f"{where} expects grpo.llm.multiturn.Conversation actions (from MultiTurnPolicy."
            f"generate_actions); item {bad[0]} is {type(convs[bad[0]]).__name__}."
        )
    if not convs:
        raise ValueError(f"{where} got no conversations.")
    return convs


class _Episode:
    """The growing state of one episode during a rollout (becomes a `Conversation`)."""

    def __init__(self, prompt_ids: Tensor, messages: list[Message]) -> None:
        self.prompt_ids = prompt_ids
        self.messages = messages
        self.num_first = len(messages)  # the first messages (system prompt included)
        self.prompted: str | None = None  # render(first messages, add_generation_prompt=True)
        self.tokens: list[int] = []
        self.model: list[bool] = []
        self.turn_of: list[int] = []
        self.rewards: list[float] = []
        self.infos: list[dict[str, Any]] = []
        self.finished = False
        self.truncated = False

    @property
    def done(self) -> bool:
        return self.finished or self.truncated

    def context(self) -> Tensor:
        return torch.cat([self.prompt_ids, torch.tensor(self.tokens, dtype=torch.long)])

    def add(self, ids: Sequence[int], model: bool, turn: int) -> None:
        self.tokens.extend(int(i) for i in ids)
        self.model.extend([model] * len(ids))
        self.turn_of.extend([turn] * len(ids))

    def conversation(self, temperature: float) -> Conversation:
        return Conversation(
            self.prompt_ids,
            torch.tensor(self.tokens, dtype=torch.long),
            torch.tensor(self.model, dtype=torch.bool),
            torch.tensor(self.turn_of, dtype=torch.long),
            self.rewards,
            self.messages,
            self.finished,
            self.truncated,
            temperature,
            self.infos,
        )


class MultiTurnPolicy:
    """A `grpo.PolicyModel` whose actions are whole multi-turn episodes (`Conversation`) played by
    a `CausalLMPolicy` against a text environment; states are the environment's start states
    (e.g. int seeds, task indices). The module docstring tells one rollout.

    Args:
        policy: the causal LM (its sampling options, ``system_prompt``, ``max_model_len`` apply;
            ``min_new_tokens`` must be 0: it would ban the end-of-turn token at every turn's
            start, which the scorer cannot reproduce).
        make_env: ``make_env(num_envs) -> TextEnvironment`` (e.g.
            ``lambda n: TextEnv(GuessingGame, n)``); called again only when N changes.
        max_turns: turns per episode at most (then ``truncated``).
        max_total_tokens: tokens after the prompt (the model's and the environment's) at most.
        incremental_deltas: render each turn's environment tokens from a short conversation
            (the first messages, the model's last turn, the environment's new messages) instead
            of the whole conversation so far: a turn's cost then does not grow with the turns
            before it. The first rollout renders both ways and compares them at every turn of
            every episode; on a difference (a template whose rendering of a turn depends on the
            turns before it, e.g. one that numbers the turns) it logs a warning, keeps the full
            rendering's tokens and sets ``incremental_deltas`` to False for good. False: always
            the full rendering.
    """

    def __init__(
        self,
        policy: CausalLMPolicy,
        make_env: Callable[[int], TextEnvironment],
        *,
        max_turns: int = 8,
        max_total_tokens: int = 1024,
        incremental_deltas: bool = True,
    ) -> None:
        for name, value in (("max_turns", max_turns), ("max_total_tokens", max_total_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MultiTurnPolicy({name}={value!r}): expected an integer >= 1.")
        if not callable(make_env):
            raise TypeError(
                f"MultiTurnPolicy: make_env must be callable (num_envs -> env), got {make_env!r}."
            )
        if not isinstance(policy, CausalLMPolicy):
            raise TypeError(f"MultiTurnPolicy plays a grpo.llm.CausalLMPolicy, got {type(policy).__name__}.")
        if getattr(policy.tokenizer, "chat_template", None) is None or policy.use_chat_template is False:
            raise ValueError(
                "MultiTurnPolicy renders every turn with the tokenizer's chat template, but "
                + ("use_chat_template=False" if policy.use_chat_template is False else "it has none")
                + "; set tokenizer.chat_template (and leave use_chat_template at None or True)."
            )
        _check_no_min_new_tokens(policy.sampling.min_new_tokens)
        self.policy = policy
        self.make_env = make_env
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens
        self.incremental_deltas = bool(incremental_deltas)
        self._deltas_checked = False  # a rollout compared the incremental rendering with the full one
        self._deltas_compared = 0  # turns compared so far
        self._env: TextEnvironment | None = None
        self.last_rollout: dict[str, float] = {}

    # ---- the environment ---------------------------------------------------------------------
    def environment(self, num_envs: int) -> TextEnvironment:
        """The environment of ``num_envs`` episodes (built by ``make_env`` when N changes)."""
        if self._env is not None and self._env.num_envs == num_envs:
            return self._env
        self.close()
        env = self.make_env(num_envs)
        if not isinstance(env, TextEnvironment) or env.num_envs != num_envs:
            raise TypeError(
                f"make_env({num_envs}) returned {type(env).__name__} with num_envs="
                f"{getattr(env, 'num_envs', None)!r}; expected a TextEnvironment of {num_envs} "
                f"sub-environments (reset(starts) -> messages, step(turns) -> Transition)."
            )
        self._env = env
        return env

    def close(self) -> None:
        """Close the environment (tools, thread pools); a later rollout builds a new one."""
        if self._env is not None:
            self._env.close()
            self._env = None

    # ---- rollout -----------------------------------------------------------------------------
    def generate_actions(
        self, states: Sequence[Any], num_actions_per_state: int, **kwargs: Any
    ) -> list[list[Conversation]]:
        """Play G episodes from each of the B start states: B lists of G `Conversation` s.

        Keyword overrides are the causal LM's sampling settings (`SamplingSettings` fields); each turn
        gets at most ``max_new_tokens`` tokens."""
        opts = self.policy.sampling.replace(**kwargs)
        _check_no_min_new_tokens(opts.min_new_tokens)
        g = int(num_actions_per_state)
        starts = [s for s in states for _ in range(g)]  # group-major: episode k is state k // g
        env = self.environment(len(starts))
        t0 = time.perf_counter()
        first = env.reset(starts)
        episodes = [self._start(messages) for messages in first]
        timing = {"generate": 0.0, "env": 0.0, "turns": 0.0, "model_tokens": 0.0}
        for turn in range(self.max_turns):
            active = [i for i, ep in enumerate(episodes) if not ep.done]
            if not active:
                break
            self._play_turn(env, episodes, active, turn, opts, timing)
            timing["turns"] += 1
        for ep in episodes:  # out of turns: cut
            if not ep.done:
                ep.truncated = True
        self._deltas_checked = self._deltas_checked or self._deltas_compared > 0
        self.last_rollout = {**timing, "seconds": time.perf_counter() - t0}
        convs = [ep.conversation(opts.temperature) for ep in episodes]
        return [convs[k * g : (k + 1) * g] for k in range(len(states))]

    def _start(self, messages: list[Message]) -> _Episode:
        """An episode from the environment's first messages (the policy's system prompt first
        when it has one and they do not start with a system message, as `encode_prompt` does)."""
        msgs = [dict(m) for m in messages]
        system = self.policy.system_prompt
        if system is not None and (not msgs or msgs[0].get("role") != "system"):
            msgs = [{"role": "system", "content": system}, *msgs]
        ids = torch.tensor(self.policy.encode_prompt(messages), dtype=torch.long)
        self.policy.sampling.replace(max_new_tokens=1).completion_budgets(
            [int(ids.shape[0])]
        )  # no room: ValueError
        return _Episode(ids, msgs)

    def _room(self, ep: _Episode) -> int:
        """Tokens the episode may still grow by: ``max_total_tokens`` after the prompt, and the
        policy's ``max_model_len`` for the whole context."""
        room = self.max_total_tokens - len(ep.tokens)
        limit = self.policy.sampling.max_model_len
        if limit is not None:
            room = min(room, limit - int(ep.prompt_ids.shape[0]) - len(ep.tokens))
        return room

    def _budget(self, ep: _Episode, opts: SamplingSettings) -> int:
        """Tokens the next turn may have: ``min(max_new_tokens, room)`` (>= 1 for a running episode)."""
        return min(opts.max_new_tokens, self._room(ep))

    def _play_turn(
        self,
        env: TextEnvironment,
        episodes: list[_Episode],
        active: list[int],
        turn: int,
        opts: SamplingSettings,
        timing: dict[str, float],
    ) -> None:
        """Turn ``turn`` of the running episodes: one batched generation, one env step, the
        environment's tokens appended to the episodes that go on."""
        t0 = time.perf_counter()
        budgets = [self._budget(episodes[i], opts) for i in active]
        comps = self.policy.generate_from_ids([episodes[i].context() for i in active], budgets, opts)
        texts = [""] * len(episodes)
        tok = self.policy.tokenizer
        for i, c in zip(active, comps, strict=True):
            episodes[i].add(c.token_ids.tolist(), True, turn)
            episodes[i].messages.append({"role": "assistant", "content": c.text})
            texts[i] = c.text
        t1 = time.perf_counter()
        result = env.step(texts)
        generated = tok.batch_decode([c.token_ids.tolist() for c in comps], skip_special_tokens=False)
        going = [
            (i, self._after_turn(episodes[i], result, i, turn, g))
            for i, g in zip(active, generated, strict=True)
        ]
        going = [(i, text) for i, text in going if text is not None]
        if going:  # one tokenizer call for every episode that goes on
            rows = tok([text for _, text in going], add_special_tokens=False)["input_ids"]
            for (i, _), ids in zip(going, rows, strict=True):
                self._append_environment(episodes[i], ids, turn)
        timing["generate"] += t1 - t0
        timing["env"] += time.perf_counter() - t1  # the env's step and its tokens
        timing["model_tokens"] += float(sum(len(c) for c in comps))

    def _after_turn(
        self, ep: _Episode, result: Transition[Any], i: int, turn: int, generated: str
    ) -> str | None:
        """Record episode i's reward, flags and the environment's messages; the text of the
        environment's tokens (`environment_text`) if the episode goes on, else None.
        ``generated``: the turn's tokens decoded with special tokens kept."""
        ep.rewards.append(float(result.rewards[i]))
        ep.infos.append(dict(result.infos[i]) if result.infos is not None else {})
        new = list(result.observations[i])
        if bool(result.terminated[i]):
            ep.finished = True
        elif bool(result.truncated[i]) or turn + 1 >= self.max_turns:
            ep.truncated = True
        text = None if ep.done else self._environment_text(ep, generated, new)
        ep.messages.extend(new)
        return text

    def _append_environment(self, ep: _Episode, ids: Sequence[int], turn: int) -> None:
        """Append the environment's tokens ``ids`` of turn ``turn``, or cut the episode when they
        leave no room for one more model token."""
        if self._room(ep) - len(ids) < 1:
            ep.truncated = True  # no room for the environment's reply and one more model token
            return
        ep.add(ids, False, turn)

    def _environment_text(self, ep: _Episode, generated: str, new: list[Message]) -> str:
        """`environment_text` after the episode's last turn: from the whole conversation, or
        (``incremental_deltas``) from the first messages and the last turn only, checked against
        the whole conversation's until a rollout has compared them (see the class docstring)."""
        tok = self.policy.tokenizer
        if not self.incremental_deltas:
            return environment_text(tok, ep.messages, generated, new)
        if ep.prompted is None:
            ep.prompted = _render(tok, ep.messages[: ep.num_first], True)
        short = [*ep.messages[: ep.num_first], ep.messages[-1]]
        text = environment_text(tok, short, generated, new, ep.prompted)
        if self._deltas_checked or len(short) == len(ep.messages):
            return text
        full = environment_text(tok, ep.messages, generated, new)
        self._deltas_compared += 1
        if full != text:
            logger.warning(
                "MultiTurnPolicy: the chat template renders a turn differently after %d messages "
                "than after the first ones (%r vs %r): it depends on the turns before, so every "
                "turn is now rendered from the whole conversation (incremental_deltas=False).",
                len(ep.messages),
                full[-80:],
                text[-80:],
            )
            self.incremental_deltas = False
        return full

    # ---- log-probs ---------------------------------------------------------------------------
    def get_log_probabilities(self, states: Any, actions: Sequence[Conversation]) -> PolicyOutput:
        """Per-token log-probs (N, T) over every token after the prompt, mask = model tokens."""
        return self.evaluate_actions(states, actions)

    def evaluate_actions(
        self,
        states: Any,
        actions: Sequence[Conversation],
        *,
        group_size: int = 1,
        with_entropy: EntropyRequest = False,
    ) -> PolicyOutput:
        """`CausalLMPolicy.evaluate_actions` of the episodes (one forward over each whole
        episode): log_probs / mask / entropy (N, T), T the longest episode's tokens after its
        prompt; the mask is the model tokens (environment tokens: 0, no gradient)."""
        comps = [c.as_completion() for c in _conversations(actions, "MultiTurnPolicy.evaluate_actions")]
        return self.policy.evaluate_actions(states, comps, group_size=group_size, with_entropy=with_entropy)

    # ---- the rest of PolicyModel -------------------------------------------------------------
    def get_parameters(self) -> dict[str, Tensor]:
        """The causal LM's trainable tensors."""
        return self.policy.get_parameters()

    def training_module(self) -> nn.Module:
        """The module holding the trainable parameters (`CausalLMPolicy.training_module`)."""
        return self.policy.training_module()

    def train(self) -> MultiTurnPolicy:
        self.policy.train()
        return self

    def eval(self) -> MultiTurnPolicy:
        self.policy.eval()
        return self

    def to(self, device: Any) -> MultiTurnPolicy:
        self.policy.to(device)
        return self

    @property
    def model(self) -> Any:
        """The causal LM's model."""
        return self.policy.model

    @property
    def tokenizer(self) -> Any:
        """The causal LM's tokenizer."""
        return self.policy.tokenizer

    def save_pretrained(self, directory: str) -> None:
        """`CausalLMPolicy.save_pretrained` (the model or LoRA adapter, and the tokenizer)."""
        self.policy.save_pretrained(directory)

    def reference_policy(self) -> MultiTurnReference | None:
        """The causal LM's own KL reference (LoRA: the disabled adapter, or the separate reference
        adapter) scoring conversations; None for full fine-tuning (the trainer then deep-copies
        this policy: the model is copied, the environment is not)."""
        ref = self.policy.reference_policy()
        return None if ref is None else MultiTurnReference(ref, self)

    def __deepcopy__(self, memo: dict[int, Any]) -> MultiTurnPolicy:
        """A copy with its own causal LM, the same ``make_env``, and no environment yet (the
        frozen KL reference only scores, so it never builds one)."""
        new = MultiTurnPolicy.__new__(MultiTurnPolicy)
        memo[id(self)] = new
        new.__dict__.update(self.__dict__)
        new.policy = copy.deepcopy(self.policy, memo)
        new._env = None
        new.last_rollout = {}
        return new


class MultiTurnReference:
    """A causal LM's KL reference (`DisabledAdapterReference`, `SeparateAdapterReference`) that
    scores `Conversation` s: what `MultiTurnPolicy.reference_policy` returns. It only scores:
    ``generate_actions`` plays episodes with the owner's environment under the reference."""

    def __init__(self, reference: Any, owner: MultiTurnPolicy) -> None:
        self.reference = reference
        self.owner = owner

    def generate_actions(self, states: Any, num_actions_per_state: int, **kwargs: Any) -> Any:
        raise TypeError(
            "MultiTurnReference only scores conversations (the KL reference); generate with the "
            "MultiTurnPolicy itself."
        )

    def get_log_probabilities(self, states: Any, actions: Sequence[Conversation]) -> PolicyOutput:
        return self.evaluate_actions(states, actions)

    def evaluate_actions(
        self,
        states: Any,
        actions: Sequence[Conversation],
        *,
        group_size: int = 1,
        with_entropy: EntropyRequest = False,
    ) -> PolicyOutput:
        comps = [c.as_completion() for c in _conversations(actions, "MultiTurnReference.evaluate_actions")]
        out: PolicyOutput = self.reference.evaluate_actions(
            states, comps, group_size=group_size, with_entropy=with_entropy
        )
        return out

    def get_parameters(self) -> Mapping[str, Tensor]:
        params: Mapping[str, Tensor] = self.reference.get_parameters()
        return params

    def refresh_problem(self) -> str | None:
        """The wrapped reference's reason it cannot be refreshed (None: it can)."""
        if not has_method(self.reference, "refresh_problem"):
            return None
        problem: str | None = self.reference.refresh_problem()
        return problem

    def refresh_from(self, policy: Any) -> None:
        """Refresh the wrapped reference from the causal LM of ``policy`` (a `MultiTurnPolicy`)."""
        inner = policy.policy if isinstance(policy, MultiTurnPolicy) else policy
        if not has_method(self.reference, "refresh_from"):
            raise TypeError(f"{type(self.reference).__name__} cannot be refreshed (no refresh_from).")
        self.reference.refresh_from(inner)

    def train(self) -> MultiTurnReference:
        return self

    def eval(self) -> MultiTurnReference:
        return self

    def to(self, device: Any) -> MultiTurnReference:
        return self


def _check_no_min_new_tokens(min_new_tokens: int) -> None:
    if min_new_tokens:
        raise ValueError(
            f"MultiTurnPolicy: min_new_tokens={min_new_tokens} would ban the end-of-turn token at "
            f"the start of every turn, which the episode's scorer does not reproduce; use "
            f"min_new_tokens=0."
        )
