"""A reward that raises says which reward and which sample; an optional per-call timeout."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import Tensor

from grpo import GRPOConfig, GRPOTrainer
from grpo.policies import categorical_mlp
from grpo.reward_model_base import CombinedReward
from grpo.rollout.reward_guard import RewardError, RewardTimeoutError, call_reward


class Words:
    """List-form policy: state 's1' gets the action 'bad' in position 1 of its group."""

    def __init__(self) -> None:
        self.w = torch.zeros(1, requires_grad=True)

    def generate_actions(self, states: Any, g: int, **kw: Any) -> list[list[str]]:
        return [["bad" if (s, i) == ("s1", 1) else f"ok{i}" for i in range(g)] for s in states]

    def get_log_probabilities(self, states: Any, actions: Any) -> Tensor:
        return self.w.expand(len(actions)) - 1.0

    def get_parameters(self) -> list[Tensor]:
        return [self.w]

    def train(self) -> None: ...
    def eval(self) -> None: ...
    def to(self, device: Any) -> Any:
        return self


def parse(states: list[str], actions: list[str]) -> list[float]:
    return [float(int(a.removeprefix("ok"))) for a in actions]  # int("bad") raises


CFG = GRPOConfig(group_size=4, batch_size=2, kl_coeff=0.0)


def test_function_reward_names_itself_and_the_sample() -> None:
    trainer = GRPOTrainer(CFG, Words(), parse)
    with pytest.raises(
        RewardError,
        match=r"FunctionReward\(parse\)\.compute_rewards raised ValueError: invalid literal .*'bad'.* "
        r"First failing sample: flat index 5 \(group 1, action 1\), state='s1', action='bad'",
    ):
        trainer.step(["s0", "s1"])


def test_combined_reward_names_the_component() -> None:
    def length(states: list[str], actions: list[str]) -> list[float]:
        return [float(len(a)) for a in actions]

    trainer = GRPOTrainer(CFG, Words(), CombinedReward({"length": length, "format": parse}))
    with pytest.raises(
        RewardError, match=r"CombinedReward\.components\['format'\] raised ValueError.*flat index 5"
    ):
        trainer.step(["s0", "s1"])
    metrics = GRPOTrainer(CFG, Words(), CombinedReward({"length": length})).step(["s0", "s2"])
    assert metrics["reward/length/mean"] == 3.0


def test_tensor_form_reward_sample_located() -> None:
    def reward(states: Tensor, actions: Tensor) -> Tensor:
        if bool((states[:, 0] > 0.5).any()):
            raise RuntimeError("state out of range")
        return actions.float()

    states = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    trainer = GRPOTrainer(GRPOConfig(group_size=3, batch_size=2, kl_coeff=0.0), categorical_mlp(2, 3), reward)
    with pytest.raises(
        RewardError,
        match=r"raised RuntimeError: state out of range\. First failing sample: flat index 3 \(group 1",
    ):
        trainer.step(states)


def test_failure_only_on_the_whole_batch() -> None:
    def batch_only(states: list[str], actions: list[str]) -> list[float]:
        if len(actions) > 1:
            raise RuntimeError("batch too big")
        return [0.0]

    with pytest.raises(
        RewardError, match=r"raised RuntimeError: batch too big on the batch of 8 samples, but not on"
    ):
        call_reward(batch_only, "r", ["s"] * 8, ["a"] * 8)


def test_timeout() -> None:
    release = threading.Event()

    def slow(states: list[str], actions: list[str]) -> list[float]:
        release.wait(30)
        return [0.0] * len(actions)

    cfg = GRPOConfig(group_size=4, batch_size=2, kl_coeff=0.0, reward_timeout=0.2)
    try:
        with pytest.raises(
            RewardTimeoutError,
            match=r"FunctionReward\(slow\)\.compute_rewards did not return within .*=0\.2 s",
        ):
            GRPOTrainer(cfg, Words(), slow).step(["s0", "s2"])
    finally:
        release.set()  # let the background thread finish


def test_timeout_passes_results_and_errors_through() -> None:
    assert call_reward(lambda s, a: [1.0, 2.0], "r", ["x", "y"], [0, 1], timeout=10.0) == [1.0, 2.0]
    with pytest.raises(RewardError, match=r"flat index 5 \(group 1, action 1\)"):
        call_reward(
            parse, "parse", ["s"] * 8, ["ok0"] * 5 + ["bad"] + ["ok1"] * 2, group_size=4, timeout=10.0
        )


# ---- a reward with the wrong signature -----------------------------------------------------------
def one_arg(actions: list[str]) -> list[float]:
    return [0.0] * len(actions)


def three_args(states: list[str], actions: list[str], answers: list[str]) -> list[float]:
    return [0.0] * len(actions)


class OneArgModel:
    def compute_rewards(self, actions: list[str]) -> list[float]:
        return [0.0] * len(actions)

    def train(self) -> None: ...
    def eval(self) -> None: ...
    def to(self, device: Any) -> Any:
        return self


@pytest.mark.parametrize(
    ("reward", "pattern"),
    [
        (
            one_arg,
            r"^FunctionReward\(one_arg\)\.compute_rewards cannot be called as reward\(states, actions\): "
            r"one_arg\(actions: 'list\[str\]'\) -> 'list\[float\]' \(too many positional arguments\)\. A "
            r"reward is called once per step with two arguments, the N flat states and the N flat "
            r"actions, and returns N numbers: def reward\(states, actions\) -> list\[float\] \| Tensor "
            r"\(N,\) \(a RewardModel: compute_rewards\(self, states, actions\)\)\. Give it that "
            r"signature, or adapt it, e\.g\. lambda states, actions: one_arg\(actions\)\.$",
        ),
        (
            three_args,
            r"^FunctionReward\(three_args\)\.compute_rewards cannot be called as reward\(states, "
            r"actions\): three_args\(states: .*answers: .*\) .*\(missing a required argument: 'answers'\)",
        ),
        (
            lambda x: [0.0] * len(x),
            r"^FunctionReward\(<lambda>\)\.compute_rewards cannot be called as reward\(states, actions\): "
            r"<lambda>\(x\) \(too many positional arguments\)\..*lambda states, actions: "
            r"my_reward\(actions\)\.$",
        ),
        (
            OneArgModel(),
            r"^OneArgModel\.compute_rewards cannot be called as reward\(states, actions\): "
            r"OneArgModel\.compute_rewards\(actions: .*\(too many positional arguments\)",
        ),
        (
            CombinedReward({"format": one_arg}),
            r"^CombinedReward\.components\['format'\] cannot be called as reward\(states, actions\): "
            r"one_arg\(actions",
        ),
    ],
    ids=["one-argument", "three-arguments", "lambda", "reward-model", "combined"],
)
def test_a_reward_with_the_wrong_signature_says_what_it_must_be(reward: Any, pattern: str) -> None:
    policy = Words()
    trainer = GRPOTrainer(CFG, policy, reward)
    before = policy.w.detach().clone()
    with pytest.raises(TypeError, match=pattern) as info:
        trainer.step(["s0", "s2"])
    assert not isinstance(info.value, RewardError)
    assert torch.equal(policy.w, before)


def test_a_type_error_inside_a_reward_with_the_right_signature_is_located() -> None:
    def typo(states: list[str], actions: list[str]) -> list[float]:
        return [len(a) + "1" for a in actions]  # type: ignore[operator]

    with pytest.raises(RewardError, match=r"raised TypeError: unsupported operand.*flat index 0"):
        GRPOTrainer(CFG, Words(), typo).step(["s0", "s2"])
