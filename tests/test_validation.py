"""Every boundary where a user's object hands data over fails clearly, before any weight changes.

Each test pins the message (object, method, what was seen, what was expected, a fix) and checks
that the policy's weights and the optimizer state are exactly as before the failed step.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

from grpo import GRPOConfig, GRPOTrainer, PolicyOutput
from grpo.policies import DistributionPolicy, categorical_mlp


class ListPolicy:
    """Seed-style policy: list states, list actions; a learnable preference over 3 arms.

    ``groups``/``per_group`` let it return the wrong number of groups or actions; ``logp_hook``
    rewrites the log-probs it returns.
    """

    def __init__(self, groups_delta: int = 0, per_group_delta: int = 0) -> None:
        self.w = torch.zeros(3, requires_grad=True)
        self.groups_delta = groups_delta
        self.per_group_delta = per_group_delta
        self.logp_hook: Callable[[Tensor], Any] = lambda x: x

    def generate_actions(self, states: Any, num_actions_per_state: int, **kw: Any) -> list[list[int]]:
        n = len(states) + self.groups_delta
        return [[i % 3 for i in range(num_actions_per_state + self.per_group_delta)] for _ in range(n)]

    def get_log_probabilities(self, states: Any, actions: Any) -> Any:
        return self.logp_hook(torch.log_softmax(self.w, -1)[torch.tensor(actions)])

    def get_parameters(self) -> dict[str, Tensor]:
        return {"w": self.w}

    def train(self) -> None: ...
    def eval(self) -> None: ...
    def to(self, device: Any) -> ListPolicy:
        return self


def arm_reward(states: Any, actions: Any) -> list[float]:
    return [float(a) for a in actions]


CFG = GRPOConfig(group_size=4, batch_size=2, kl_coeff=0.0, learning_rate=0.1, num_epochs_per_update=2, seed=0)
STATES = ["s0", "s1"]


def _state(trainer: GRPOTrainer) -> tuple[list[Tensor], dict[str, Any]]:
    assert trainer.optimizer is not None
    return [p.detach().clone() for p in trainer.params], copy.deepcopy(trainer.optimizer.state_dict())


def _fails_cleanly(trainer: GRPOTrainer, states: Any, exc: type[Exception], match: str) -> None:
    """One good step (so the optimizer has state), then the failing one; nothing may change."""
    before = _state(trainer)
    with pytest.raises(exc, match=match):
        trainer.step(states)
    after = _state(trainer)
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0], strict=True))
    assert str(before[1]) == str(after[1])


def _trained(policy: Any, reward: Any = arm_reward, cfg: GRPOConfig = CFG) -> GRPOTrainer:
    trainer = GRPOTrainer(cfg, policy, reward)
    trainer.step(STATES)
    return trainer


# ---- the policy's actions -------------------------------------------------------------------
def test_wrong_number_of_groups() -> None:
    policy = ListPolicy()
    trainer = _trained(policy)
    policy.groups_delta = -1
    _fails_cleanly(
        trainer,
        STATES,
        ValueError,
        r"ListPolicy\.generate_actions returned 1 groups for 2 states; expected one list",
    )


def test_wrong_number_of_actions_per_group() -> None:
    policy = ListPolicy()
    trainer = _trained(policy)
    policy.per_group_delta = -1
    _fails_cleanly(
        trainer,
        STATES,
        ValueError,
        r"ListPolicy\.generate_actions must return group_size=4 actions for every state; got state 0: 3, "
        r"state 1: 3\. Sample exactly",
    )


def test_tensor_actions_of_the_wrong_shape() -> None:
    policy = categorical_mlp(2, 3, (4,))
    trainer = GRPOTrainer(CFG, policy, lambda s, a: a.float())
    trainer.step(torch.zeros(2, 2))

    def wrong(states: Tensor, g: int, **kw: Any) -> Tensor:
        return torch.zeros(len(states), g - 1, dtype=torch.long)

    policy.generate_actions = wrong  # type: ignore[method-assign]
    # the ready policy also samples through this capability: break both
    policy.generate_actions_with_log_probs = lambda s, g, **kw: (wrong(s, g), None)  # type: ignore[method-assign]
    _fails_cleanly(
        trainer,
        torch.zeros(2, 2),
        ValueError,
        r"DistributionPolicy\.generate_actions returned a Tensor of shape \(2, 3\); "
        r"expected \(2, 4, \.\.\.\)",
    )


# ---- the policy's log-probs ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("hook", "exc", "match"),
    [
        (
            lambda x: x[:3],
            ValueError,
            r"get_log_probabilities returned log-probs of shape \(3,\); expected \(8,\)",
        ),
        (lambda x: x.round().long(), TypeError, r"log-probs of dtype torch\.int64; expected a float dtype"),
        (lambda x: x.tolist(), TypeError, r"returned list; expected a torch\.Tensor of shape \(8,\)"),
        (
            lambda x: torch.zeros(8, device="meta"),
            ValueError,
            r"returned log-probs on meta, but the trainer runs on cpu\. Move the policy",
        ),
        (
            lambda x: torch.where(torch.arange(8) == 5, torch.inf, x),
            ValueError,
            r"ListPolicy\.get_log_probabilities returned log-probs with \+inf at rows \[5\].*expected finite",
        ),
        (
            lambda x: torch.where(torch.arange(8) == 2, -torch.inf, x),
            ValueError,
            r"with -inf at rows \[2\] \(on steps the mask marks as real\).*probability 0",
        ),
        (
            lambda x: x.detach(),
            ValueError,
            r"ListPolicy returned log-probs that do not require grad during the update",
        ),
    ],
    ids=["shape", "dtype", "not-a-tensor", "device", "+inf", "-inf", "no-grad"],
)
@pytest.mark.parametrize(
    "mini_batch_size",
    [None, 1],
    ids=["old-logprobs-from-first-epoch", "old-logprobs-at-collection"],
)
def test_bad_log_probs(
    hook: Callable[[Tensor], Any], exc: type[Exception], match: str, mini_batch_size: int | None
) -> None:
    # one optimizer step per epoch: the behaviour log-probs come from the update's first forward;
    # two (mini_batch_size=1): they are recorded at collection. Both check the same things.
    policy = ListPolicy()
    trainer = _trained(policy, cfg=dataclasses.replace(CFG, mini_batch_size=mini_batch_size))
    policy.logp_hook = hook
    _fails_cleanly(trainer, STATES, exc, match)


def test_minus_inf_on_padding_steps_is_allowed() -> None:
    """-inf (or NaN) where the mask is False is ignored: those steps do not exist."""
    policy = ListPolicy()

    def padded(x: Tensor) -> PolicyOutput:
        logp = torch.stack([x, torch.full_like(x, -torch.inf)], 1)  # step 2 is padding
        mask = torch.tensor([[True, False]]).expand(len(x), 2)
        return PolicyOutput(logp, mask=mask)

    policy.logp_hook = padded
    trainer = GRPOTrainer(CFG, policy, arm_reward)
    metrics = trainer.step(STATES)
    assert math.isfinite(metrics["loss/total"])
    assert metrics["optim/non_finite_steps"] == 0.0
    assert not torch.equal(policy.w, torch.zeros(3)), "it trained"


# ---- rewards -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("values", "exc", "match"),
    [
        (
            [1.0] * 7,
            ValueError,
            r"FunctionReward\(bad\)\.compute_rewards returned rewards of shape \(7,\); "
            r"expected \(8,\): one reward",
        ),
        ([1.0] * 7 + ["x"], TypeError, r"returned non-numeric rewards at positions \[7\] \(e\.g\. 'x'\)"),
        (
            [None] + [1.0] * 7,
            TypeError,
            r"non-numeric rewards at positions \[0\] \(e\.g\. None\).*drop_groups",
        ),
        (
            [1.0] * 6 + [math.nan, 1.0],
            ValueError,
            r"non-finite rewards \(NaN or inf\) at flat positions \[6\]",
        ),
        (
            torch.tensor([1.0] * 3 + [math.inf] * 5),
            ValueError,
            r"non-finite rewards .* at flat positions \[3, 4, 5",
        ),
        ({"a": 1}, TypeError, r"returned dict; expected a Tensor, NumPy array or list of 8 numbers"),
    ],
    ids=["length", "string", "None", "NaN", "inf", "dict"],
)
def test_bad_rewards(values: Any, exc: type[Exception], match: str) -> None:
    good = [True]

    def bad(states: Any, actions: Any) -> Any:
        return arm_reward(states, actions) if good[0] else values

    trainer = _trained(ListPolicy(), bad)
    good[0] = False
    _fails_cleanly(trainer, STATES, exc, match)


# ---- states and config ---------------------------------------------------------------------
def test_empty_states() -> None:
    trainer = _trained(ListPolicy())
    _fails_cleanly(trainer, [], ValueError, r"states is empty; step\(\) needs at least one state")
    _fails_cleanly(
        trainer, torch.zeros(0, 2), ValueError, r"shape \(0, 2\); expected \(B, \.\.\.\) with B >= 1"
    )


def test_mini_batch_size_that_does_not_divide_lists_valid_values() -> None:
    with pytest.raises(
        ValueError,
        match=r"GRPOConfig\.mini_batch_size=4 is not allowed: it must divide batch_size=6 .* "
        r"Valid values: \[1, 2, 3, 6\] \(or None for the whole batch\)",
    ):
        GRPOConfig(batch_size=6, mini_batch_size=4)
    with pytest.raises(
        ValueError, match=r"micro_batch_size=2 .* divide mini_batch_size=3.*Valid values: \[1, 3\]"
    ):
        GRPOConfig(batch_size=6, mini_batch_size=3, micro_batch_size=2)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        (
            "non_finite",
            "ignore",
            r"GRPOConfig\.non_finite='ignore' is not allowed: choose one of \('skip', 'raise'\)",
        ),
        ("invalid_rewards", "zero", r"invalid_rewards='zero' .* \('raise', 'drop_groups'\)"),
        ("reward_timeout", 0, r"reward_timeout=0 is not allowed: expected a number > 0"),
        (
            "checkpoint_keep_last",
            0,
            r"checkpoint_keep_last=0 is not allowed: expected an integer >= 1 or None",
        ),
    ],
)
def test_reliability_config_fields_are_validated(field: str, value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GRPOConfig(**{field: value})


# ---- construction ----------------------------------------------------------------------------
def test_policy_parameters_not_on_the_configured_device() -> None:
    policy = DistributionPolicy(torch.nn.Linear(2, 3, device="meta"))
    policy.to = lambda device: policy  # type: ignore[assignment,method-assign,return-value]  # a .to() that moves nothing
    with pytest.raises(
        ValueError,
        match=r"policy parameters are on \['meta'\] after policy\.to\('cpu'\), "
        r"but GRPOConfig\.device is 'cpu'",
    ):
        GRPOTrainer(CFG, policy, arm_reward)


def test_optimizer_holding_none_of_the_policy_parameters() -> None:
    other = torch.nn.Linear(2, 2)
    with pytest.raises(
        ValueError,
        match=r"the optimizer \(SGD\) holds none of the 1 parameters that policy\.get_parameters\(\)",
    ):
        GRPOTrainer(CFG, ListPolicy(), arm_reward, optimizer=torch.optim.SGD(other.parameters(), lr=0.1))


# ---- newcomer mistakes ---------------------------------------------------------------------
@pytest.mark.parametrize("epochs", [1, 2], ids=["single-optimizer-step", "two-optimizer-steps"])
def test_log_probs_that_require_grad_but_do_not_depend_on_the_parameters(epochs: int) -> None:
    """torch.full(..., requires_grad=True) trains nothing: refused before the optimizer steps."""
    policy = ListPolicy()
    trainer = _trained(policy, cfg=dataclasses.replace(CFG, num_epochs_per_update=epochs))
    policy.logp_hook = lambda x: torch.full(x.shape, -1.0, requires_grad=True)
    _fails_cleanly(
        trainer,
        STATES,
        ValueError,
        r"^ListPolicy\.get_log_probabilities returned log-probs that require grad but do not depend on "
        r"the policy's parameters: after the backward pass none of the 1 tensors from get_parameters\(\) "
        r"has a gradient, so nothing would learn while the optimizer state and the LR schedule advance "
        r"\(stopped before the optimizer step: nothing changed\)\. Compute the log-probs from the "
        r"parameters .*not from a new tensor such as torch\.full\(\.\.\., requires_grad=True\)",
    )
    assert trainer.scheduler is None or trainer.scheduler.last_epoch == epochs


def test_states_as_a_generator_suggest_a_list() -> None:
    trainer = _trained(ListPolicy())
    _fails_cleanly(
        trainer,
        (s for s in STATES),
        TypeError,
        r"^states is a generator, not a sequence the trainer can index and count; pass a list or a "
        r"Tensor \(B, \.\.\.\), e\.g\. step\(list\(states\)\)\.$",
    )


def test_states_as_a_numpy_array_suggest_a_tensor() -> None:
    trainer = _trained(ListPolicy())
    _fails_cleanly(
        trainer,
        np.zeros((2, 3)),
        TypeError,
        r"^states is a NumPy array of shape \(2, 3\); pass a Tensor \(B, \.\.\.\): "
        r"torch\.from_numpy\(states\), or a list of states: list\(states\)\.$",
    )


class TensorFormPolicy(torch.nn.Module):
    """A user policy written for tensor states (B, 2): it calls its network on them directly."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(2, 3)

    def generate_actions(self, states: Tensor, g: int, **kw: Any) -> Tensor:
        return torch.multinomial(torch.softmax(self.net(states), -1), g, replacement=True)

    def get_log_probabilities(self, states: Tensor, actions: Tensor) -> Tensor:
        return torch.log_softmax(self.net(states), -1).gather(1, actions.unsqueeze(1)).squeeze(1)

    def get_parameters(self) -> dict[str, Tensor]:
        return dict(self.named_parameters())


def test_a_list_of_tensors_to_a_tensor_form_policy_suggests_stack() -> None:
    trainer = GRPOTrainer(CFG, TensorFormPolicy(), lambda s, a: a.float())
    trainer.step(torch.zeros(2, 2))
    _fails_cleanly(
        trainer,
        [torch.zeros(2), torch.ones(2)],
        TypeError,
        # the inner error's text depends on who patched F.linear (DeepSpeed ZeRO-3 replaces it)
        r"^TensorFormPolicy\.generate_actions raised (TypeError|AttributeError): .*list.*, with "
        r"states given as a list of 2 Tensors of shape \(2,\)\. If the policy "
        r"takes a Tensor \(B, \.\.\.\), pass torch\.stack\(states\) \(shape \(2, 2\)\)\.$",
    )


def test_a_policy_error_unrelated_to_list_states_is_left_alone() -> None:
    policy = ListPolicy()
    trainer = _trained(policy)

    def broken(states: Any, g: int, **kw: Any) -> Any:
        raise TypeError("something else")

    policy.generate_actions = broken  # type: ignore[method-assign]
    _fails_cleanly(trainer, [torch.zeros(2), torch.ones(2)], TypeError, r"^something else$")
