"""TRL-style reward functions in grpo.llm.RewardFunctions: both calling conventions, chat
completions as message lists, the signature read once, each error message, and a real
GRPOTrainer.step on a tiny local model with a chat dataset. tests/data/trl_style_rewards.py is
written as TRL's documentation writes reward functions and is used unchanged."""

from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from grpo import GRPOConfig, GRPOTrainer
from grpo.llm.policy import CausalLMPolicy, Completion
from grpo.llm.rewards import REWARD_ARGUMENTS, RewardFunctions, reward_signature
from grpo.llm.sampling_settings import SamplingSettings
from tests.data import trl_style_rewards as trl
from tests.llm_helpers import build_model, build_tokenizer


def _c(text: str, n: int) -> Completion:
    return Completion(torch.tensor([1]), torch.arange(n), text, True)


def _chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


# N = 4 samples: two prompts, two completions each (group-major), with hand-known rewards.
CHAT_STATES = [
    {"prompt": _chat("what is 2+2"), "solution": "4", "answer": "4"},
    {"prompt": _chat("what is 2+2"), "solution": "4", "answer": "4"},
    {"prompt": _chat("name a fruit"), "solution": "fig", "answer": "fig"},
    {"prompt": _chat("name a fruit"), "solution": "fig", "answer": "fig"},
]
CHAT_TEXTS = [
    "<think>2+2</think><answer>4</answer>",
    "it is 4",
    "<think>a</think><answer>fig</answer>",
    "plum",
]
CHAT_ACTIONS = [_c(t, n) for t, n in zip(CHAT_TEXTS, [9, 3, 7, 1], strict=True)]


def test_auto_convention_is_decided_from_the_signature() -> None:
    expect = {
        trl.format_reward: ("trl", {"completions"}, ("completions",)),
        trl.accuracy_reward: ("trl", {"completions", "solution"}, ("completions", "solution")),
        trl.contains_answer: ("trl", {"completions", "answer"}, ("completions", "answer")),
        trl.reward_len_ids: ("trl", {"completion_ids"}, ("completion_ids",)),
        trl.strict_solution_match: ("trl", {"completions", "solution"}, ("completions", "solution")),
        trl.curriculum_reward: ("trl", {"completions", "trainer_state"}, ("completions", "trainer_state")),
        trl.math_reward_func: ("grpo", {"task"}, ("task",)),  # (prompts, completions, ...): grpo
        trl.echo_prompt_reward: ("grpo", set(), ()),
    }
    for fn, (convention, accepts, required) in expect.items():
        sig = reward_signature(fn)
        assert (sig.convention, set(sig.accepts), sig.required) == (convention, accepts, required), (
            fn.__name__
        )
    assert reward_signature(trl.format_reward).var_kw
    assert not reward_signature(trl.strict_solution_match).var_kw
    assert reward_signature(lambda p, c: c).convention == "grpo"
    assert reward_signature(lambda *args, **kw: args).convention == "grpo"
    assert reward_signature(lambda **kw: kw).convention == "trl"

    def annotated(prompts: list[Any], completions: list[list[dict[str, str]]], **kwargs: Any) -> list[float]:
        return []

    assert reward_signature(annotated).convention == "trl"  # TRL's annotation settles the shared form
    assert reward_signature(trl.echo_prompt_reward, convention="trl").convention == "trl"


def test_trl_module_on_chat_data_hand_values() -> None:
    rf = RewardFunctions(
        [
            trl.format_reward,
            trl.accuracy_reward,
            trl.reward_num_unique_letters,
            trl.contains_answer,
            trl.reward_len_ids,
            trl.strict_solution_match,
        ],
        weights=[0.5, 1.0, 0.0, 2.0, -0.1, 1.0],
    )
    comps = rf.compute_reward_components(CHAT_STATES, CHAT_ACTIONS)
    assert comps["format_reward"] == [1.0, 0.0, 1.0, 0.0]
    assert comps["accuracy_reward"] == [1.0, 0.0, 1.0, 0.0]  # "<answer>4</answer>", "<answer>fig</answer>"
    # distinct characters: {<,t,h,i,n,k,>,2,+,/,a,s,w,e,r,4} = 16; {i,t,' ',s,4} = 5;
    # {<,t,h,i,n,k,>,a,/,s,w,e,r,f,g} = 15; {p,l,u,m} = 4
    assert comps["reward_num_unique_letters"] == [16.0, 5.0, 15.0, 4.0]
    assert comps["contains_answer"] == [1.0, 1.0, 1.0, 0.0]
    assert comps["reward_len_ids"] == [9.0, 3.0, 7.0, 1.0]
    assert comps["strict_solution_match"] == [1.0, 1.0, 1.0, 0.0]
    total = rf.compute_rewards(CHAT_STATES, CHAT_ACTIONS)
    assert total == pytest.approx([0.5 + 1 + 2 - 0.9 + 1, 2 - 0.3 + 1, 0.5 + 1 + 2 - 0.7 + 1, -0.1])


def test_trl_keyword_call_passes_what_trl_passes_and_message_lists() -> None:
    seen: dict[str, Any] = {}

    def spy(completions, **kwargs):
        seen["completions"], seen["kwargs"] = completions, kwargs
        return [0.0] * len(completions)

    rf = RewardFunctions(spy)
    rf.compute_reward_components(CHAT_STATES, CHAT_ACTIONS)
    assert seen["completions"][1] == [{"role": "assistant", "content": "it is 4"}]
    kw = seen["kwargs"]
    assert sorted(kw) == sorted({*REWARD_ARGUMENTS, "answer", "solution"} - {"completions"})
    assert kw["prompts"][2] == _chat("name a fruit")
    assert kw["completion_ids"][1] == [0, 1, 2]
    assert kw["completion_lengths"] == [9, 3, 7, 1]
    assert kw["solution"] == ["4", "4", "fig", "fig"]
    assert kw["trainer_state"] is None
    # string prompts: TRL's standard format, completions are the texts
    rf.compute_reward_components(["1+1=", "x"], [_c("2", 1), _c("y", 1)])
    assert seen["completions"] == ["2", "y"]
    assert seen["kwargs"]["prompts"] == ["1+1=", "x"]


def test_grpo_positional_functions_still_get_text_for_chat_prompts() -> None:
    seen: dict[str, Any] = {}

    def grpo_style(prompts, completions, answer):
        seen["prompts"], seen["completions"] = prompts, completions
        return [float(a in c) for c, a in zip(completions, answer, strict=True)]

    rf = RewardFunctions([grpo_style, lambda p, c: [float(len(x)) for x in c]], weights=[1.0, 0.0])
    comps = rf.compute_reward_components(CHAT_STATES, CHAT_ACTIONS)
    assert seen["completions"] == CHAT_TEXTS
    assert seen["prompts"][0] == _chat("what is 2+2")
    assert comps["grpo_style"] == [1.0, 1.0, 1.0, 0.0]
    assert comps["<lambda>"] == [float(len(t)) for t in CHAT_TEXTS]
    # the shared form (prompts, completions, **kwargs) is grpo by default; "trl" gives message lists
    forced = RewardFunctions([trl.echo_prompt_reward], convention={"echo_prompt_reward": "trl"})
    assert forced.signatures["echo_prompt_reward"].convention == "trl"
    # words of "what is 2+2" / "name a fruit" found in each completion: "2+2"; "is"; "a"; none
    assert forced.compute_reward_components(CHAT_STATES, CHAT_ACTIONS) == {
        "echo_prompt_reward": [0.5, 0.5, 0.5, 0.0]
    }


def test_trl_module_on_string_data_none_trainer_state_and_logging_hooks() -> None:
    states = [
        {"prompt": "2+2=", "ground_truth": "4", "task": "math", "solution": "4"},
        {"prompt": "2+2=", "ground_truth": "4", "task": "math", "solution": "4"},
        {"prompt": "a poem", "ground_truth": "x", "task": "poem", "solution": "sky"},
    ]
    actions = [_c("\\boxed{4}", 2), _c(" 4 ", 3), _c("blue sky", 4)]
    rf = RewardFunctions(
        [
            trl.boxed_reward,
            trl.math_reward_func,
            trl.curriculum_reward,
            trl.logging_reward,
            trl.strict_solution_match,
        ]
    )
    comps = rf.compute_reward_components(states, actions)
    assert comps["boxed_reward"] == [1.0, 0.0, 0.0]
    assert comps["math_reward_func"] == [0.0, 1.0, 0.0]  # None (the poem) counts 0 ...
    assert rf.last_metrics["reward/math_reward_func/applicable"] == pytest.approx(
        2 / 3
    )  # ... and is left out
    assert rf.last_metrics["reward/math_reward_func/applicable_mean"] == 0.5
    assert comps["curriculum_reward"] == [0.0, 0.0, 0.0]  # trainer_state None -> step 0
    assert comps["strict_solution_match"] == [1.0, 1.0, 1.0]
    assert rf.last_metrics["mean_chars"] == pytest.approx((9 + 3 + 8) / 3)  # log_metric
    assert rf.last_extra == {"chars": [9, 3, 8]}  # log_extra
    rf.trainer_state = SimpleNamespace(global_step=12)
    assert rf.compute_reward_components(states, actions)["curriculum_reward"] == [1.0, 1.0, 1.0]


def test_async_reward_is_awaited() -> None:
    async def judge(completions, answer, **kwargs):
        return [float(a in c[0]["content"]) for c, a in zip(completions, answer, strict=True)]

    assert RewardFunctions(judge).compute_rewards(CHAT_STATES, CHAT_ACTIONS) == [1.0, 1.0, 1.0, 0.0]


def test_the_signature_is_read_once_at_construction() -> None:
    seen: list[Any] = []

    def fn(completions, **kwargs):
        seen.append(completions[0])
        return [0.0] * len(completions)

    rf = RewardFunctions(fn)
    fn.__signature__ = inspect.signature(lambda prompts, completions: None)  # type: ignore[attr-defined]
    assert reward_signature(fn).convention == "grpo"  # a new inspection would now decide grpo ...
    rf.compute_rewards(CHAT_STATES, CHAT_ACTIONS)
    assert seen == [[{"role": "assistant", "content": CHAT_TEXTS[0]}]]  # ... the decision made stands


def test_errors_name_the_function_the_parameter_and_the_available_names() -> None:
    rf = RewardFunctions(trl.accuracy_reward)
    no_solution = [{k: v for k, v in s.items() if k != "solution"} for s in CHAT_STATES]
    with pytest.raises(
        TypeError, match=r"reward 'accuracy_reward' \(accuracy_reward \(trl_style_rewards\.py:\d+\)\) "
    ) as e:
        rf.compute_rewards(no_solution, CHAT_ACTIONS)
    msg = str(e.value)
    assert "needs the argument 'solution'" in msg
    assert "prompts, completions, completion_ids, completion_lengths, trainer_state" in msg
    assert "dataset columns ['answer']" in msg
    assert "Add a 'solution' column to the prompt records" in msg
    with pytest.raises(TypeError, match=r"needs the argument 'ground_truth'.*dataset columns none"):
        RewardFunctions(trl.boxed_reward).compute_rewards(["p"], [_c("a", 1)])

    def grpo_style(prompts, completions, label):
        return [1.0] * len(completions)

    with pytest.raises(TypeError, match=r"reward 'grpo_style' .* needs the argument 'label'"):
        RewardFunctions(grpo_style).compute_rewards(CHAT_STATES, CHAT_ACTIONS)

    def pos_only(completions, /, **kwargs):
        return completions

    with pytest.raises(TypeError, match=r"reward 'pos_only' .*parameter 'completions' is positional-only"):
        RewardFunctions(pos_only)
    with pytest.raises(
        TypeError, match=r"reward 'format_reward' .*takes 1 positional argument.*convention='trl'"
    ):
        RewardFunctions(trl.format_reward, convention="grpo")
    with pytest.raises(ValueError, match=r"convention='keyword'; choose one of \('auto', 'grpo', 'trl'\)"):
        RewardFunctions(trl.format_reward, convention="keyword")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"convention names unknown rewards \['accuracy'\]"):
        RewardFunctions(trl.format_reward, convention={"accuracy": "trl"})
    clash = [{"prompt": "p", "completions": "x"}]
    with pytest.raises(ValueError, match=r"column\(s\) \['completions'\], names RewardFunctions gives"):
        RewardFunctions(trl.format_reward).compute_rewards(clash, [_c("a", 1)])


def test_trl_module_in_a_real_trainer_step(tmp_path: Path) -> None:
    """The unchanged TRL module on a chat dataset, in GRPOTrainer.step on a tiny local model; each
    logged component equals the function applied by hand to the sampled texts."""
    tok = build_tokenizer(tmp_path / "tok", pad_is_eos=True, chat_template=True)
    model = build_model(tmp_path / "m", tok, arch="llama", seed=0)
    policy = CausalLMPolicy(model, tok, SamplingSettings(max_new_tokens=6))
    seen: list[str] = []

    def record(prompts, completions):  # grpo convention, weight 0: the texts the step sampled
        seen.extend(completions)
        return [0.0] * len(completions)

    fns = [trl.format_reward, trl.reward_num_unique_letters, trl.contains_answer, trl.reward_len_ids, record]
    rewards = RewardFunctions(fns, weights=[1.0, 0.1, 1.0, 0.0, 0.0])
    trainer = GRPOTrainer(GRPOConfig(group_size=3, batch_size=2, kl_coeff=0.0, seed=0), policy, rewards)
    states = [{"prompt": _chat("1+1"), "answer": "2"}, {"prompt": _chat("a b"), "answer": "a"}]
    metrics = trainer.step(states)
    assert len(seen) == 6
    answers = ["2"] * 3 + ["a"] * 3
    unique = [float(len(set(t))) for t in seen]
    contains = [float(a in t) for t, a in zip(seen, answers, strict=True)]
    assert metrics["reward/reward_num_unique_letters/mean"] == pytest.approx(sum(unique) / 6)
    assert metrics["reward/contains_answer/mean"] == pytest.approx(sum(contains) / 6)
    assert 1.0 <= metrics["reward/reward_len_ids/mean"] <= 6.0
    fmt = metrics["reward/format_reward/mean"]
    assert metrics["reward/mean"] == pytest.approx(fmt + 0.1 * sum(unique) / 6 + sum(contains) / 6)
