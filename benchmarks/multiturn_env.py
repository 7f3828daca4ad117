"""The environment's share of a multi-turn rollout: ``MultiTurnPolicy.last_rollout["env"]`` per
turn at K = 2, 4 and 8 turns, before and after incremental template deltas, on a task whose own
step costs microseconds (`Echo`: answers turn k with "ok k"), so what is timed is the rendering and
tokenising of the environment's tokens.

Sides (all give the same token ids; tests/test_multiturn_deltas.py checks the last two):

- before: the code this change started from: per turn and episode, the turn's closing markup and
  the chat-template delta each rendered from the whole conversation (4 chat-template renderings
  of the conversation so far);
- full: ``MultiTurnPolicy(incremental_deltas=False)``: the same from the whole conversation, 3
  renderings (the one both used is shared);
- incremental: the default: rendered from the first messages and the last turn only (2
  renderings of a short conversation; the first messages' prompt rendering is kept per episode).

One run alternates the sides rollout by rollout (the order reversed every repeat), after one
untimed warm-up rollout per side (the incremental side's first rollout also renders the full way
to check itself). Tiny 2-layer Llama (hidden 64) and tokenizer of grpo.llm.tiny with its chat
template, ``--starts`` x ``--group`` episodes, ``--max-new-tokens`` per turn, one thread::

    python benchmarks/multiturn_env.py --turns 2 4 8 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from grpo.envs.protocol import Message, TextEnvironment, Transition
from grpo.envs.text import TextEnv, TurnResult
from grpo.llm import CausalLMPolicy
from grpo.llm.multiturn import MultiTurnPolicy, _Episode, _render, chat_template_delta
from grpo.llm.sampling_settings import SamplingSettings
from grpo.llm.tiny import build_tiny_model, build_tiny_tokenizer


class Echo:
    """Never ends; answers turn k with ``"ok k"`` (microseconds a step)."""

    def __init__(self) -> None:
        self.k = 0

    def reset(self, start: Any) -> list[Message]:
        self.k = 0
        return [{"role": "user", "content": f"say {start}"}]

    def step(self, turn: str) -> TurnResult:
        self.k += 1
        return TurnResult([{"role": "user", "content": f"ok {self.k}"}], 0.0, False)


def _old_turn_tail(tokenizer: Any, conversation: Sequence[Message], generated: str) -> str:
    """The code this change started from (grpo/llm/multiturn.py ``_turn_tail``), verbatim."""
    before = _render(tokenizer, conversation[:-1], True)
    rendered = _render(tokenizer, conversation, False)
    if not rendered.startswith(before):
        return ""
    turn = rendered[len(before) :]
    return turn[len(generated) :] if turn.startswith(generated) else ""


class BeforePolicy(MultiTurnPolicy):
    """`MultiTurnPolicy` playing a turn as the code this change started from did (its
    ``_play_turn`` and ``_after_turn``, verbatim but for the name of ``_old_turn_tail``)."""

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
        for i, c in zip(active, comps, strict=True):
            generated = tok.decode(c.token_ids.tolist(), skip_special_tokens=False)
            self._after_turn(episodes[i], result, i, turn, generated, opts)
        timing["generate"] += t1 - t0
        timing["env"] += time.perf_counter() - t1  # the env's step and its tokens
        timing["model_tokens"] += float(sum(len(c) for c in comps))

    def _after_turn(  # type: ignore[override]
        self,
        ep: _Episode,
        result: Transition[Any],
        i: int,
        turn: int,
        generated: str,
        opts: SamplingSettings,
    ) -> None:
        """Record episode i's reward and flags; append the environment's tokens if it goes on."""
        ep.rewards.append(float(result.rewards[i]))
        ep.infos.append(dict(result.infos[i]) if result.infos is not None else {})
        new = list(result.observations[i])
        if bool(result.terminated[i]):
            ep.finished = True
        elif bool(result.truncated[i]) or turn + 1 >= self.max_turns:
            ep.truncated = True
        if ep.done:
            ep.messages.extend(new)
            return
        tok = self.policy.tokenizer
        delta = _old_turn_tail(tok, ep.messages, generated) + chat_template_delta(tok, ep.messages, new)
        ids = tok(delta, add_special_tokens=False)["input_ids"]
        ep.messages.extend(new)
        if self._room(ep) - len(ids) < 1:
            ep.truncated = True  # no room for the environment's reply and one more model token
            return
        ep.add(ids, False, turn)


def make_policies(args: argparse.Namespace, turns: int, lm: CausalLMPolicy) -> dict[str, MultiTurnPolicy]:
    def env(n: int) -> TextEnv:
        return TextEnv(Echo, n)

    return {
        "before": BeforePolicy(lm, env, max_turns=turns, incremental_deltas=False),
        "full": MultiTurnPolicy(lm, env, max_turns=turns, incremental_deltas=False),
        "incremental": MultiTurnPolicy(lm, env, max_turns=turns),
    }


def measure(args: argparse.Namespace, lm: CausalLMPolicy) -> dict[tuple[int, str], list[dict[str, float]]]:
    rows: dict[tuple[int, str], list[dict[str, float]]] = {}
    starts = list(range(args.starts))
    for turns in args.turns:
        policies = make_policies(args, turns, lm)
        for mt in policies.values():  # warm-up (and the incremental side's check)
            mt.generate_actions(starts, args.group)
        names = list(policies)
        for r in range(args.repeats):
            for name in names if r % 2 == 0 else names[::-1]:
                torch.manual_seed(r)
                policies[name].generate_actions(starts, args.group)
                rows.setdefault((turns, name), []).append(dict(policies[name].last_rollout))
        for mt in policies.values():
            mt.close()
    return rows


def report(args: argparse.Namespace, rows: dict[tuple[int, str], list[dict[str, float]]]) -> str:
    n = args.starts * args.group
    lines = [
        f"{n} episodes ({args.starts} starts x {args.group}), {args.max_new_tokens} tokens a turn, "
        f"{args.repeats} rollouts a side, median; load before: {args.load}",
        "| turns K | side | env s / turn | env ms / turn / episode | env share of the rollout "
        "| env x incremental |",
        "|---|---|---|---|---|---|",
    ]
    for turns in args.turns:
        inc = statistics.median(r["env"] / r["turns"] for r in rows[(turns, "incremental")])
        for side in ("before", "full", "incremental"):
            rs = rows[(turns, side)]
            per_turn = statistics.median(r["env"] / r["turns"] for r in rs)
            share = statistics.median(r["env"] / r["seconds"] for r in rs)
            lines.append(
                f"| {turns} | {side} | {per_turn:.4f} | {1e3 * per_turn / n:.3f} | {share:.0%} | "
                f"{per_turn / inc:.2f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", nargs="+", type=int, default=[2, 4, 8])
    p.add_argument("--starts", type=int, default=10)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    args.load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    torch.set_num_threads(1)
    d = Path(tempfile.mkdtemp(prefix="grpo_mt_env_"))
    tok = build_tiny_tokenizer(d, pad_is_eos=True, chat_template=True)
    lm = CausalLMPolicy(
        build_tiny_model(d, tok, hidden=64, layers=2),
        tok,
        SamplingSettings(max_new_tokens=args.max_new_tokens),
    )
    t0 = time.perf_counter()
    out = report(args, measure(args, lm))
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    out += f"\nload after: {load}; {time.perf_counter() - t0:.0f} s"
    print(out)
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
