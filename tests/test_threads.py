"""The trainer's intra-op thread policy (GRPOConfig.num_threads, grpo/runtime/threads.py): applied inside
step / train_on_batch / update / evaluate, restored after, and only for small CPU policies."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor

from grpo import GRPOConfig, GRPOTrainer
from grpo.rollout.reward_guard import RewardError
from grpo.runtime import threads
from grpo.runtime.threads import SMALL_POLICY_ELEMENTS, intra_op_threads, policy_elements, resolve_num_threads
from tests.conftest import ContextualBandit, Counting, WordPolicy

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def two_threads() -> Iterator[None]:
    """The caller's setting for these tests: 2 threads (any machine accepts it); restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


class SeesThreads(Counting):
    """Wraps a policy; records torch.get_num_threads() in each call it counts."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.seen: list[int] = []

    def _count(self, name: str) -> None:
        super()._count(name)
        self.seen.append(torch.get_num_threads())


def _setup(**config: Any) -> tuple[GRPOTrainer, SeesThreads, list[int], ContextualBandit]:
    bandit = ContextualBandit(seed=0)
    policy = SeesThreads(bandit.policy())
    in_reward: list[int] = []

    def reward(states: Tensor, actions: Tensor) -> Tensor:
        in_reward.append(torch.get_num_threads())
        return bandit.reward(states, actions)

    cfg = GRPOConfig(group_size=4, batch_size=4, seed=0, **config)
    return GRPOTrainer(cfg, policy, reward), policy, in_reward, bandit


# ---- the pure parts ---------------------------------------------------------------------------
def test_resolve() -> None:
    small, big = SMALL_POLICY_ELEMENTS, SMALL_POLICY_ELEMENTS + 1
    assert resolve_num_threads("auto", device=CPU, elements=small) == 1
    assert resolve_num_threads("auto", device=CPU, elements=big) is None
    assert resolve_num_threads("auto", device=torch.device("cuda"), elements=10) is None
    assert resolve_num_threads("auto", device=torch.device("meta"), elements=10) is None
    assert resolve_num_threads(3, device=CPU, elements=big) == 3
    assert resolve_num_threads(3, device=torch.device("cuda"), elements=10) == 3
    assert resolve_num_threads(None, device=CPU, elements=10) is None


def test_policy_elements_counts_frozen_module_weights_and_each_tensor_once() -> None:
    net = torch.nn.Linear(3, 4)  # 12 + 4
    net.bias.requires_grad_(False)  # frozen: counted all the same (a LoRA policy's base model)
    assert policy_elements(net, [net.weight, net.weight]) == 16

    class HoldsAModel:  # like grpo.llm.CausalLMPolicy: not a module, exposes one
        def training_module(self) -> torch.nn.Module:
            return net

    assert policy_elements(HoldsAModel(), []) == 16
    words = WordPolicy()  # neither: its trained tensors only
    assert policy_elements(words, words.get_parameters().values()) == 4
    extra = torch.zeros(5)
    assert policy_elements(net, [extra]) == 21  # a tensor an optimizer trains outside the module


def test_intra_op_threads_sets_and_restores_even_on_a_raise() -> None:
    with intra_op_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    seen = []

    def fails() -> None:
        with intra_op_threads(3):
            seen.append(torch.get_num_threads())
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fails()
    assert seen == [3]
    assert torch.get_num_threads() == 2
    with intra_op_threads(None):
        assert torch.get_num_threads() == 2


# ---- the trainer applies it -------------------------------------------------------------------
def test_auto_steps_a_small_cpu_policy_on_one_thread_and_restores_the_callers() -> None:
    trainer, policy, in_reward, bandit = _setup()
    assert trainer.step_threads == 1
    for _ in range(2):
        trainer.step(bandit.states(4))
    assert policy.seen
    assert set(policy.seen) == {1}
    assert in_reward == [1, 1]
    assert torch.get_num_threads() == 2


def test_train_on_batch_update_and_evaluate_apply_it_too() -> None:
    trainer, policy, in_reward, bandit = _setup()
    batch = trainer.collect(bandit.states(4))  # not a step: the caller's threads
    assert set(policy.seen) == {2}
    assert in_reward == [2]
    policy.seen.clear()
    trainer.train_on_batch(batch)
    trainer.update(batch, trainer.advantages(batch))
    trainer.evaluate(bandit.states(4))
    assert policy.seen
    assert set(policy.seen) == {1}
    assert torch.get_num_threads() == 2


def test_the_evaluations_of_train_apply_it_too() -> None:
    trainer, _, in_reward, bandit = _setup()
    trainer.train(bandit.states(8), num_steps=2, eval_states=bandit.states(4), eval_every=1, progress=False)
    assert len(in_reward) == 4  # 2 steps, 2 evaluations
    assert set(in_reward) == {1}
    assert torch.get_num_threads() == 2


def test_an_int_sets_that_many_and_none_leaves_torch_alone() -> None:
    trainer, policy, _, bandit = _setup(num_threads=3)
    trainer.step(bandit.states(4))
    assert set(policy.seen) == {3}
    assert torch.get_num_threads() == 2
    trainer, policy, _, bandit = _setup(num_threads=None)
    assert trainer.step_threads is None
    trainer.step(bandit.states(4))
    assert set(policy.seen) == {2}


def test_a_big_policy_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "SMALL_POLICY_ELEMENTS", 100)  # the bandit MLP has 5,898 weights
    trainer, policy, _, bandit = _setup()
    assert trainer.step_threads is None
    trainer.step(bandit.states(4))
    assert set(policy.seen) == {2}


def test_restored_after_a_step_that_raises() -> None:
    bandit = ContextualBandit(seed=0)

    def reward(states: Tensor, actions: Tensor) -> Tensor:
        raise ValueError("reward failed")

    trainer = GRPOTrainer(GRPOConfig(group_size=4, batch_size=4), bandit.policy(), reward)
    with pytest.raises(RewardError, match="reward failed"):
        trainer.step(bandit.states(4))
    assert torch.get_num_threads() == 2


def test_the_choice_is_logged_once_at_info(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="grpo.runtime.threads"):
        trainer, _, _, bandit = _setup()
        trainer.step(bandit.states(4))
        trainer.step(bandit.states(4))
    lines = [r.getMessage() for r in caplog.records if "intra-op threads" in r.getMessage()]
    assert len(lines) == 1
    assert "1 in each step, 2 restored after it" in lines[0]
    assert "5,898 weights" in lines[0]


def test_weights_bitwise_equal_to_an_explicit_one_thread_run() -> None:
    def run(num_threads: Any, outside: int) -> list[Tensor]:
        torch.set_num_threads(outside)
        torch.manual_seed(0)
        trainer, policy, _, bandit = _setup(num_threads=num_threads)
        for _ in range(3):
            trainer.step(bandit.states(4))
        return [p.detach().clone() for p in policy.inner.parameters()]

    auto = run("auto", outside=2)
    explicit = run(1, outside=2)
    global_one = run(None, outside=1)
    assert all(torch.equal(a, b) for a, b in zip(auto, explicit, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(auto, global_one, strict=True))


# ---- the config field -------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["auto", None, 1, 4])
def test_config_accepts(value: Any) -> None:
    assert GRPOConfig(num_threads=value).num_threads == value


@pytest.mark.parametrize("value", [0, -2, True, 1.5, "max", "1"])
def test_config_refuses(value: Any) -> None:
    expected = r"GRPOConfig\.num_threads=.* is not allowed: expected 'auto', an integer >= 1 or None"
    with pytest.raises(ValueError, match=expected):
        GRPOConfig(num_threads=value)


def test_config_help_names_the_threshold() -> None:
    import dataclasses

    (field,) = [f for f in dataclasses.fields(GRPOConfig) if f.name == "num_threads"]
    assert f"{SMALL_POLICY_ELEMENTS:,}" in field.metadata["help"]
