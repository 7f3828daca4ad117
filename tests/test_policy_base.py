import re

import pytest
import torch

from grpo import GRPOConfig, GRPOTrainer, check_policy, check_reward_model
from grpo.policy_base import policy_parameters


class Half:
    def generate_actions(self, states, num_actions_per_state, **kwargs):  # type: ignore[no-untyped-def]
        return [[0] * num_actions_per_state for _ in states]

    get_log_probabilities = 3  # not callable

    def train(self) -> None: ...


def test_policy_check_lists_every_missing_and_non_callable_method_with_signature() -> None:
    with pytest.raises(TypeError) as info:
        check_policy(Half())
    msg = str(info.value)
    assert "Half does not satisfy the PolicyModel protocol" in msg
    for name in ("get_parameters(self)", "eval(self)", "to(self, device)"):
        assert f"missing  {name}" in msg
    assert re.search(r"not callable \(int\): get_log_probabilities\(self, states, actions\)", msg)
    assert "generate_actions" not in msg
    assert "train(self)" not in msg


def test_trainer_checks_protocols_at_construction() -> None:
    with pytest.raises(TypeError, match=r"(?s)policy of type Half .*missing  get_parameters"):
        GRPOTrainer(GRPOConfig(), Half(), lambda s, a: torch.zeros(len(a)))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"reward_model of type int does not satisfy the RewardModel"):
        check_reward_model(3)


def test_reward_model_check_names_missing_methods() -> None:
    class OnlyScore:
        def compute_rewards(self, states, actions):  # type: ignore[no-untyped-def]
            return [0.0] * len(actions)

    with pytest.raises(TypeError) as info:
        check_reward_model(OnlyScore())
    msg = str(info.value)
    assert "missing  train(self)" in msg
    assert "missing  eval(self)" in msg
    assert "missing  to(self, device)" in msg


def test_policy_parameters_dedupes_and_skips_frozen() -> None:
    a = torch.zeros(2, requires_grad=True)
    b = torch.zeros(2)

    class P:
        def get_parameters(self):  # type: ignore[no-untyped-def]
            return {"a": a, "again": a, "b": b}

    assert policy_parameters(P()) == [a]  # type: ignore[arg-type]

    class Bad:
        def get_parameters(self):  # type: ignore[no-untyped-def]
            return [1.0]

    with pytest.raises(TypeError, match="must return tensors"):
        policy_parameters(Bad())  # type: ignore[arg-type]


def test_has_method_on_modules_plain_objects_and_delegating_wrappers() -> None:
    from torch import nn

    from grpo.policy_base import has_method

    class Plain(nn.Module):
        def evaluate_actions(self) -> None: ...

    class Delegating(nn.Module):  # forwards unknown attributes to an inner object
        def __init__(self, inner: object) -> None:
            super().__init__()
            self.inner = inner

        def __getattr__(self, name: str) -> object:
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self.__dict__["_modules"]["inner"], name)

    bare = nn.Linear(2, 2)
    assert has_method(Plain(), "evaluate_actions")
    assert not has_method(bare, "evaluate_actions")
    bare.evaluate_actions = lambda: None  # an instance attribute counts
    assert has_method(bare, "evaluate_actions")
    assert not has_method(nn.Sequential(nn.Linear(1, 1)), "missing")
    assert has_method(Delegating(Plain()), "evaluate_actions")
    assert not has_method(Delegating(nn.Linear(1, 1)), "evaluate_actions")
    assert has_method(type("Obj", (), {"f": lambda self: 1})(), "f")
    assert not has_method(object(), "f")
    lin = nn.Linear(1, 1)
    lin.weight_fn = 3  # not callable
    assert not has_method(lin, "weight_fn")
