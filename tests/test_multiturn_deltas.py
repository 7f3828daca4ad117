"""grpo.llm.multiturn's incremental template deltas (a turn's environment tokens rendered from the
first messages and the last turn only) give exactly the full rendering's token ids at 2, 4 and 8
turns on the tiny template and on ChatML-shaped ones (with the closing markup the model does not
generate, and a default system prompt); a template that numbers its turns falls back to the full
rendering. And grpo.llm.tiny's ``pad_is_eos=True`` tokenizer: an untrained model's sampled
``<pad>`` ends the completion (a second EOS id) and never shows in a text. Tiny real models."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from grpo.envs.protocol import Message
from grpo.envs.text import TextEnv, TurnResult
from grpo.llm import CausalLMPolicy
from grpo.llm.multiturn import Conversation, MultiTurnPolicy, chat_template_delta, environment_text
from grpo.llm.sampling_settings import SamplingSettings
from tests.llm_helpers import build_model, build_tokenizer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen2.5's shape: a default system prompt when the conversation does not start with one
CHATML_SYSTEM = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nyou are a bot.<|im_end|>\n{% endif %}"
    + CHATML
)
# prefix-stable, but a turn's rendering depends on how many messages came before it
NUMBERED = (
    "{% for m in messages %}<{{ m['role'][0] }}>{{ loop.index }}{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<a>{% endif %}"
)


class Echo:
    """Never ends: answers turn k with ``"ok k"``."""

    def __init__(self) -> None:
        self.k = 0

    def reset(self, start: Any) -> list[Message]:
        self.k = 0
        return [{"role": "user", "content": f"say {start}"}]

    def step(self, turn: str) -> TurnResult:
        self.k += 1
        return TurnResult([{"role": "user", "content": f"ok {self.k}"}], 0.0, False)


def tiny_lm(d: Path, template: str) -> CausalLMPolicy:
    """The tiny tokenizer with ``template``; ChatML ones get ``<|im_start|>``, ``<|im_end|>``
    (the EOS) and a newline as tokens of their own."""
    tok = build_tokenizer(d / "tok", pad_is_eos=template == "tiny", chat_template=True)
    if template != "tiny":
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        tok.add_tokens(["\n"])
        tok.eos_token = "<|im_end|>"
        tok.chat_template = {"chatml": CHATML, "chatml_system": CHATML_SYSTEM, "numbered": NUMBERED}[template]
    model = build_model(d / "model", tok, seed=3)
    return CausalLMPolicy(model, tok, SamplingSettings(max_new_tokens=3, temperature=1.0))


def rollout(
    lm: CausalLMPolicy, turns: int, incremental: bool, seed: int
) -> tuple[MultiTurnPolicy, list[Conversation]]:
    mt = MultiTurnPolicy(lm, lambda n: TextEnv(Echo, n), max_turns=turns, incremental_deltas=incremental)
    torch.manual_seed(seed)
    return mt, [c for g in mt.generate_actions([1, 2], 2) for c in g]


def assert_same(a: list[Conversation], b: list[Conversation]) -> None:
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.prompt_ids, y.prompt_ids)
        assert x.token_ids.tolist() == y.token_ids.tolist()
        assert x.model_mask.tolist() == y.model_mask.tolist()
        assert x.turn_of_token.tolist() == y.turn_of_token.tolist()
        assert x.messages == y.messages


@pytest.mark.parametrize("template", ["tiny", "chatml_system"])
def test_incremental_deltas_give_the_full_renderings_ids(template: str, tmp_path: Path) -> None:
    lm = tiny_lm(tmp_path, template)
    for turns in (2, 4, 8):
        full_mt, full = rollout(lm, turns, False, seed=turns)
        mt, inc = rollout(lm, turns, True, seed=turns)  # the checked rollout (both renderings)
        assert [c.num_turns for c in full] == [turns] * 4  # Echo never ends: every turn is played
        assert_same(inc, full)
        assert mt.incremental_deltas
        assert not full_mt.incremental_deltas
        assert mt._deltas_checked == (turns > 2)  # 2 turns: the one delta is after the first turn
        torch.manual_seed(turns)  # a second rollout: incremental only, still the same ids
        again = [c for g in mt.generate_actions([1, 2], 2) for c in g]
        assert_same(again, full)
    if template != "tiny":  # after a turn ended by <|im_end|>: the "\n" the model did not generate
        conv: list[Message] = [{"role": "user", "content": "say 1"}, {"role": "assistant", "content": "hi"}]
        new: list[Message] = [{"role": "user", "content": "ok 1"}]
        after = "<|im_start|>user\nok 1<|im_end|>\n<|im_start|>assistant\n"
        assert environment_text(lm.tokenizer, conv, "hi<|im_end|>", new) == "\n" + after
        assert environment_text(lm.tokenizer, conv, "hi", new) == "<|im_end|>\n" + after  # cut turn


def test_a_template_that_numbers_its_turns_falls_back_to_the_full_rendering(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    lm = tiny_lm(tmp_path, "numbered")
    _, full = rollout(lm, 4, False, seed=0)
    with caplog.at_level(logging.WARNING, logger="grpo.llm.multiturn"):
        mt, inc = rollout(lm, 4, True, seed=0)
    assert_same(inc, full)
    assert not mt.incremental_deltas
    assert "renders a turn differently" in caplog.text
    # the incremental text would have been wrong: turn 2's reply is message 5, not message 3
    tok, msgs = lm.tokenizer, full[0].messages
    assert chat_template_delta(tok, [msgs[0], msgs[3]], [msgs[4]]) == "<u>3ok 2<a>"
    assert chat_template_delta(tok, msgs[:4], [msgs[4]]) == "<u>5ok 2<a>"


def test_untrained_tiny_model_never_puts_pad_in_a_text(tmp_path: Path) -> None:
    """With ``pad_is_eos=True`` ``<pad>`` (id 0) is not the pad token; an untrained model samples
    it like any id (about 1 in 55). It is an EOS id of the model: it ends the completion, and
    decoding drops it, so no completion or turn text contains it."""
    tok = build_tokenizer(tmp_path / "tok", pad_is_eos=True, chat_template=True)
    pad = tok.convert_tokens_to_ids("<pad>")
    assert pad != tok.pad_token_id == tok.eos_token_id
    lm = CausalLMPolicy(build_model(tmp_path / "m", tok, seed=0), tok, SamplingSettings(max_new_tokens=12))
    assert sorted(lm.eos_token_ids) == sorted([tok.eos_token_id, pad])
    torch.manual_seed(0)
    comps = [c for g in lm.generate_actions(["a", "b"], 64) for c in g]
    ended_by_pad = [c for c in comps if c.token_ids[-1:].tolist() == [pad]]
    assert len(ended_by_pad) >= 3  # sampled: the test would see it
    for c in comps:
        assert "<pad>" not in c.text
        assert pad not in c.token_ids[:-1].tolist()  # only ever the last token ...
        assert c.finished or c.token_ids[-1] != pad  # ... of a finished completion
    mt = MultiTurnPolicy(lm, lambda n: TextEnv(Echo, n), max_turns=4)
    torch.manual_seed(1)
    convs = [c for g in mt.generate_actions([1, 2], 16) for c in g]
    model_ids = torch.cat([c.token_ids[c.model_mask] for c in convs]).tolist()
    assert model_ids.count(pad) >= 3
    assert not any("<pad>" in t for c in convs for t in c.turns)
    assert not any("<pad>" in m["content"] for c in convs for m in c.messages)
