"""grpo.llm.multiturn: multi-turn episodes of a causal LM against text environments. Environment
tokens masked (values and gradient), log-probs against a plain forward over the whole episode,
truncation at max turns / tokens, failing tools inside an episode, a one-turn episode equal to the
single-turn path bitwise, turn-level credit against a loop over turns, exact resume. Offline, tiny
real models (grpo.llm.tiny)."""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from grpo import GRPOConfig, GRPOTrainer
from grpo.algorithms.advantages import discounted_returns
from grpo.envs.text import GuessingGame, Problem, TextEnv, ToolTask, TurnResult
from grpo.envs.tools import MalformedCall, Tool, ToolBox, ToolCall
from grpo.llm import CausalLMPolicy
from grpo.llm.multiturn import (
    Conversation,
    ConversationReward,
    MultiTurnPolicy,
    turn_token_rewards,
)
from grpo.llm.sampling_settings import SamplingSettings
from tests.llm_helpers import build_model, build_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Char-level tokenizer (pad == eos, the tiny chat template) and a llama model."""
    d = tmp_path_factory.mktemp("tiny_multiturn")
    tok = build_tokenizer(d / "tok", pad_is_eos=True, chat_template=True)
    return {"tok": tok, "model": build_model(d / "llama", tok, arch="llama"), "dir": d}


def guessing(n: int, high: int = 5) -> TextEnv:
    return TextEnv(lambda: GuessingGame(1, high), n)


def flat(groups: list[list[Conversation]]) -> list[Conversation]:
    return [c for g in groups for c in g]


def plain_logprobs(model: Any, c: Conversation, temperature: float) -> torch.Tensor:
    """log p(token_t | everything before it) from one unpadded forward over prompt + tokens."""
    seq = torch.cat([c.prompt_ids, c.token_ids]).unsqueeze(0)
    logits = model(input_ids=seq).logits[0, len(c.prompt_ids) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, c.token_ids.unsqueeze(-1)).squeeze(-1)


def env_blocks(c: Conversation) -> list[list[int]]:
    """The environment's token runs between the model's turns, in order."""
    blocks: list[list[int]] = []
    prev = True
    for tok_id, is_model in zip(c.token_ids.tolist(), c.model_mask.tolist(), strict=True):
        if not is_model:
            if prev:
                blocks.append([])
            blocks[-1].append(tok_id)
        prev = is_model
    return blocks


@pytest.mark.parametrize("chunk", [64, None])
def test_env_tokens_masked_and_logprobs_equal_a_plain_forward(tiny, chunk: int | None) -> None:
    tok, model = tiny["tok"], tiny["model"]
    temperature = 0.8
    policy = CausalLMPolicy(
        model, tok, SamplingSettings(max_new_tokens=5, temperature=temperature), logprob_chunk_size=chunk
    )
    mt = MultiTurnPolicy(policy, guessing, max_turns=3, max_total_tokens=400)
    torch.manual_seed(0)
    convs = flat(mt.generate_actions([0, 1], 2))
    assert max(c.num_turns for c in convs) >= 2  # environment tokens between turns
    for c in convs:
        # each environment block is the chat-template delta of its messages: "<u>reply<a>"
        replies = [m["content"] for m in c.messages[1:] if m["role"] == "user"]
        expected = [tok(f"<u>{r}<a>", add_special_tokens=False)["input_ids"] for r in replies]
        assert env_blocks(c) == expected[: len(env_blocks(c))]
        assert len(c) == int(c.model_mask.sum())
        assert c.turn_of_token[c.model_mask].unique().tolist() == list(range(c.num_turns))

    out = mt.evaluate_actions(None, convs)
    width = max(len(c.token_ids) for c in convs)
    assert out.log_probs.shape == out.mask.shape == (4, width)
    params = [p for p in model.parameters() if p.requires_grad]
    plain_total = torch.zeros(())
    for i, c in enumerate(convs):
        n, m = len(c.token_ids), c.model_mask
        assert out.mask[i, :n].tolist() == m.tolist()
        assert not out.mask[i, n:].any()
        assert torch.all(out.log_probs[i, :n][~m] == 0)  # environment tokens: exactly 0
        lp = plain_logprobs(model, c, temperature)
        torch.testing.assert_close(out.log_probs[i, :n][m], lp[m], atol=1e-5, rtol=0)
        plain_total = plain_total + lp[m].sum()
    # zero gradient through the environment tokens; the rest equals the plain forward's
    env_grads = torch.autograd.grad(
        out.log_probs[~out.mask].sum(), params, allow_unused=True, retain_graph=True
    )
    assert all(g is None or torch.all(g == 0) for g in env_grads)
    grads = torch.autograd.grad(out.log_probs.sum(), params)
    plain_grads = torch.autograd.grad(plain_total, params)
    for g, ref in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(g, ref, atol=1e-4, rtol=1e-4)


def test_truncation_at_max_turns(tiny) -> None:
    tok, model = tiny["tok"], tiny["model"]
    policy = CausalLMPolicy(model, tok, SamplingSettings(max_new_tokens=4))
    secret = {"secret": 999}  # a random model does not find it in 1..1000
    mt = MultiTurnPolicy(policy, lambda n: guessing(n, high=1000), max_turns=2, max_total_tokens=400)
    torch.manual_seed(1)
    convs = flat(mt.generate_actions([secret], 3))
    assert [(c.num_turns, c.finished, c.truncated) for c in convs] == [(2, False, True)] * 3
    assert all(len(env_blocks(c)) == 1 for c in convs)  # no environment tokens after the last turn
    assert all(c.messages[-1]["role"] == "user" for c in convs)  # its reply is kept as a message
    # the environment's own limit (TextEnv(max_turns=1)) truncates too
    env_cut = MultiTurnPolicy(
        policy, lambda n: TextEnv(lambda: GuessingGame(1, 1000), n, max_turns=1), max_turns=5
    )
    convs = flat(env_cut.generate_actions([secret], 2))
    assert [(c.num_turns, c.truncated, int(c.model_mask.all())) for c in convs] == [(1, True, 1)] * 2


@pytest.mark.parametrize(("max_total", "max_new"), [(12, 8), (3, 8)])
def test_truncation_at_max_total_tokens(tiny, max_total: int, max_new: int) -> None:
    tok, model = tiny["tok"], tiny["model"]
    policy = CausalLMPolicy(model, tok, SamplingSettings(max_new_tokens=max_new))
    mt = MultiTurnPolicy(policy, lambda n: guessing(n, high=1000), max_turns=4, max_total_tokens=max_total)
    torch.manual_seed(2)
    convs = flat(mt.generate_actions([{"secret": 999}], 4))
    for c in convs:
        assert len(c.token_ids) <= max_total
        # the first turn fits; the environment's reply (>= 12 tokens) leaves no room after it
        assert (c.num_turns, c.finished, c.truncated) == (1, False, True)
        assert bool(c.model_mask.all())
    assert max(len(c) for c in convs) == min(max_total, max_new) or any(
        c.token_ids[-1] == tok.eos_token_id for c in convs
    )


def test_failing_tools_become_observations_inside_an_episode(tiny) -> None:
    """Every turn calls a tool that raises, one that hangs, one that returns garbage and a
    malformed call (a parser stands in for a model that has learnt the call format): the episode
    goes on with the tool messages as its observations."""
    tok, model = tiny["tok"], tiny["model"]
    release = threading.Event()

    def boom() -> str:
        raise ZeroDivisionError("division by zero")

    def hang() -> str:
        release.wait(10)
        return "late"

    def garbage() -> str:
        return "\x00\ufffd" * 500

    tools = [Tool("boom", boom), Tool("hang", hang, timeout=0.2), Tool("garbage", garbage)]

    def parser(turn: str) -> list[ToolCall | MalformedCall]:
        calls = [ToolCall(name, {}) for name in ("boom", "hang", "garbage")]
        return [*calls, MalformedCall(turn, "not JSON")]

    box = ToolBox(tools, timeout=1.0, max_output_chars=100, parser=parser)
    problems = [Problem("what is the code of x?", "42")]
    policy = CausalLMPolicy(model, tok, SamplingSettings(max_new_tokens=4))
    mt = MultiTurnPolicy(policy, lambda n: TextEnv(lambda: ToolTask(problems, box), n), max_turns=2)
    try:
        torch.manual_seed(3)
        convs = flat(mt.generate_actions([0], 2))
    finally:
        release.set()
    for c in convs:
        assert (c.num_turns, c.finished, c.truncated, c.turn_rewards) == (2, False, True, [0.0, 0.0])
        tool_msgs = [m for m in c.messages if m["role"] == "tool"]
        assert len(tool_msgs) == 8  # 4 per turn
        text = [m["content"] for m in tool_msgs[:4]]
        assert text[0] == "Error: tool 'boom' raised ZeroDivisionError: division by zero"
        assert "did not finish within 0.2 s" in text[1]
        assert text[2].startswith("\x00\ufffd")
        assert text[2].endswith("[cut: 900 more characters]")
        assert text[3].startswith("Error: malformed tool call (not JSON)")
        # the environment's tokens of turn 0: the tool messages in the chat template, then "<a>"
        delta = "".join(f"<t>{t}" for t in text) + "<a>"
        assert env_blocks(c)[0] == tok(delta, add_special_tokens=False)["input_ids"]
    mt.close()


class OneTurn:
    """A one-turn task: the prompt of ``start``, reward = the answer's length / 10, done."""

    prompts = ("1+2=", "what is 12+30?")

    def reset(self, start: int) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.prompts[start]}]

    def step(self, turn: str) -> TurnResult:
        return TurnResult([], len(turn) / 10, True)


def length_reward(states: Any, completions: Any) -> torch.Tensor:
    return torch.tensor([len(c.text) / 10 for c in completions], dtype=torch.float32)


def test_one_turn_episode_equals_the_single_turn_path_bitwise(tiny, tmp_path: Path) -> None:
    tok = tiny["tok"]
    models = [build_model(tmp_path / f"m{i}", tok, arch="llama", seed=5) for i in range(2)]
    single = CausalLMPolicy(models[0], tok, SamplingSettings(max_new_tokens=6), logprob_chunk_size=16)
    multi = MultiTurnPolicy(
        CausalLMPolicy(models[1], tok, SamplingSettings(max_new_tokens=6), logprob_chunk_size=16),
        lambda n: TextEnv(OneTurn, n),
        max_turns=1,
    )
    prompts = [OneTurn().reset(s) for s in (0, 1)]
    torch.manual_seed(0)
    comps = [c for g in single.generate_actions(prompts, 3) for c in g]
    torch.manual_seed(0)
    convs = flat(multi.generate_actions([0, 1], 3))
    for a, b in zip(comps, convs, strict=True):
        assert torch.equal(a.prompt_ids, b.prompt_ids)
        assert torch.equal(a.token_ids, b.token_ids)
        assert (b.finished, b.truncated, b.turns) == (True, False, [a.text])
    with torch.no_grad():
        lp_single = single.evaluate_actions(None, comps, with_entropy=True)
        lp_multi = multi.evaluate_actions(None, convs, with_entropy=True)
    assert torch.equal(lp_single.log_probs, lp_multi.log_probs)
    assert torch.equal(lp_single.mask, lp_multi.mask)
    assert torch.equal(lp_single.entropy, lp_multi.entropy)

    # one trainer step each (KL on: both take a frozen copy of their policy)
    config = GRPOConfig(group_size=3, batch_size=2, learning_rate=1e-2, kl_coeff=0.05, seed=0)
    t_single = GRPOTrainer(config, single, length_reward)  # seeds the RNG streams
    m_single = t_single.step(prompts)
    t_multi = GRPOTrainer(config, multi, ConversationReward())
    m_multi = t_multi.step([0, 1])
    for key in ("reward/mean", "loss/policy", "kl/ref"):
        assert m_single[key] == m_multi[key], key
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        assert torch.equal(p, q), name
    assert isinstance(t_multi.reference_policy, MultiTurnPolicy)
    assert t_multi.reference_policy._env is None  # the copy builds no environment


def _hand_conversation(turns: list[tuple[int, int]], rewards: list[float]) -> Conversation:
    """A conversation with (model tokens, environment tokens) per turn."""
    mask: list[bool] = []
    turn_of: list[int] = []
    for k, (n_model, n_env) in enumerate(turns):
        mask += [True] * n_model + [False] * n_env
        turn_of += [k] * (n_model + n_env)
    n = len(mask)
    return Conversation(
        torch.tensor([1, 2]), torch.arange(n), torch.tensor(mask), torch.tensor(turn_of),
        rewards, [], True, False,
    )  # fmt: skip


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.5, 0.0])
def test_turn_credit_return_to_go_equals_a_loop_over_turns(gamma: float) -> None:
    turns, rewards = [(3, 2), (1, 4), (2, 0)], [0.5, -1.0, 2.0]
    c = _hand_conversation(turns, rewards)
    token_rewards = turn_token_rewards(c, gamma)
    per_token = discounted_returns(token_rewards[None], c.model_mask[None], gamma)[0]
    for k, (n_model, _) in enumerate(turns):
        expected = sum(gamma ** (j - k) * rewards[j] for j in range(k, len(rewards)))
        got = per_token[(c.turn_of_token == k) & c.model_mask]
        assert got.shape == (n_model,)
        torch.testing.assert_close(got, torch.full((n_model,), expected, dtype=torch.float64))
    assert torch.all(token_rewards[~c.model_mask] == 0)
    if gamma == 1.0:  # the turn's reward on its last model token, 0 elsewhere
        assert token_rewards.tolist() == [0, 0, 0.5, 0, 0, -1.0, 0, 0, 0, 0, 0, 2.0]
    reward = ConversationReward(per_turn=True, gamma=gamma)
    other = _hand_conversation([(2, 0)], [1.0])
    table = reward.compute_rewards(None, [c, other])
    assert table.shape == (2, 12)
    torch.testing.assert_close(table[0], token_rewards.float())
    assert ConversationReward().compute_rewards(None, [c, other]).tolist() == [1.5, 1.0]


def test_errors_name_the_problem(tiny) -> None:
    tok, model = tiny["tok"], tiny["model"]
    with pytest.raises(ValueError, match="min_new_tokens=2 would ban the end-of-turn token"):
        MultiTurnPolicy(CausalLMPolicy(model, tok, SamplingSettings(min_new_tokens=2)), guessing)
    with pytest.raises(ValueError, match="max_turns=0"):
        MultiTurnPolicy(CausalLMPolicy(model, tok), guessing, max_turns=0)
    rewriting = copy.deepcopy(tok)  # renders only the last message: not a prefix of its continuation
    rewriting.chat_template = (
        "{% for m in messages %}{% if loop.last %}<{{ m['role'][0] }}>{{ m['content'] }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
    )
    mt = MultiTurnPolicy(
        CausalLMPolicy(model, rewriting, SamplingSettings(max_new_tokens=2)), guessing, max_turns=3
    )
    with pytest.raises(ValueError, match="does not render a conversation as a prefix"):
        mt.generate_actions([{"secret": 3}], 1)
    wrong = MultiTurnPolicy(CausalLMPolicy(model, tok), lambda n: guessing(n + 1))
    with pytest.raises(TypeError, match=r"make_env\(2\) returned TextEnv with num_envs=3"):
        wrong.generate_actions([0], 2)
    with pytest.raises(TypeError, match="item 0 is str"):
        wrong.evaluate_actions(None, ["text"])
    with pytest.raises(ValueError, match="per_turn=True"):
        ConversationReward(gamma=0.9)


def _trainer(tok: Any, directory: Path, per_turn: bool) -> GRPOTrainer:
    model = build_model(directory, tok, arch="llama", seed=1)
    policy = CausalLMPolicy(model, tok, SamplingSettings(max_new_tokens=3), logprob_chunk_size=32)
    mt = MultiTurnPolicy(policy, guessing, max_turns=2, max_total_tokens=120)
    config = GRPOConfig(
        group_size=2,
        batch_size=2,
        learning_rate=1e-2,
        seed=0,
        checkpoint_freq=2,
        gamma=0.9 if per_turn else 1.0,
    )
    return GRPOTrainer(config, mt, ConversationReward(per_turn=per_turn, gamma=config.gamma))


@pytest.mark.parametrize("per_turn", [False, True])
def test_train_resumes_mid_run_exactly(tiny, tmp_path: Path, per_turn: bool) -> None:
    tok = tiny["tok"]
    starts = list(range(8))  # seeds of the guessing game: a sequence source resumes exactly
    full = _trainer(tok, tmp_path / "a", per_turn)
    full.train(starts, 4, checkpoint_dir=tmp_path / "ckpt_full", progress=False)
    first = _trainer(tok, tmp_path / "b", per_turn)
    first.train(starts, 2, checkpoint_dir=tmp_path / "ckpt", progress=False)
    resumed = _trainer(tok, tmp_path / "c", per_turn)
    resumed.train(
        starts, 4, checkpoint_dir=tmp_path / "ckpt_resumed", resume_from=tmp_path / "ckpt", progress=False
    )
    assert resumed.step_count == 4
    for (name, p), q in zip(
        full.policy.get_parameters().items(), resumed.policy.get_parameters().values(), strict=True
    ):
        assert torch.equal(p, q), name
    assert not all(
        torch.equal(p, q)
        for p, q in zip(
            full.policy.get_parameters().values(), first.policy.get_parameters().values(), strict=True
        )
    )
