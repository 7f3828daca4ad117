"""Log-prob shapes that could mean two things are refused with the fix (issue 24, part 5).

A Gaussian policy that forgets ``.sum(-1)`` returns log-probs (N, D) for actions (N, D): read as
per-step log-probs of D steps, they would train each action component as its own step. The
trainer refuses that shape when the actions are a float Tensor (N, D), D > 1, and no mask says
the columns are steps; per-step log-probs given with a mask, integer token actions (N, T) and
the ready policies are accepted as before.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributions import Categorical, Normal

from grpo import ExperienceBatch, GRPOConfig, GRPOTrainer, PolicyOutput
from grpo.policies import DistributionPolicy, gaussian_mlp
from grpo.rollout.log_probs import normalise_log_probs

CPU = torch.device("cpu")
OBS, D = 3, 2
CFG = GRPOConfig(group_size=4, batch_size=2, kl_coeff=0.0, learning_rate=0.05, seed=0)
FORGOT_SUM = (
    r"GaussianPolicy\.get_log_probabilities returned log-probs of shape \(8, 2\) without a mask "
    r"for float actions of shape \(8, 2\).*ambiguous.*\.sum\(-1\).*"
    r"torch\.distributions\.Independent\(Normal\(mu, std\), 1\).*grpo\.PolicyOutput\(log_probs, mask="
)


class GaussianPolicy(nn.Module):
    """A hand-written `PolicyModel`: states (B, 3) -> Normal over a 2-D action, one log-prob per
    action when ``sum_over_action_dims`` (the correct policy), (N, 2) per component when not."""

    def __init__(self, sum_over_action_dims: bool = True) -> None:
        super().__init__()
        self.mean = nn.Linear(OBS, D)
        self.log_std = nn.Parameter(torch.full((D,), -0.5))
        self.sum_over_action_dims = sum_over_action_dims

    def dist(self, states: Tensor) -> Normal:
        mu = self.mean(states)
        return Normal(mu, self.log_std.exp().expand_as(mu))  # batch shape (B, D): not Independent

    def generate_actions(self, states: Tensor, num_actions_per_state: int, **kwargs: Any) -> Tensor:
        return self.dist(states).sample((num_actions_per_state,)).transpose(0, 1)  # (B, G, D)

    def get_log_probabilities(self, states: Tensor, actions: Tensor) -> Tensor:
        logp = self.dist(states).log_prob(actions)  # (N, D): one number per action component
        return logp.sum(-1) if self.sum_over_action_dims else logp  # (N,) | (N, D)

    def get_parameters(self) -> dict[str, Tensor]:
        return dict(self.named_parameters())


def reach(states: Tensor, actions: Tensor) -> Tensor:
    """r = -||a - x[:2]||: move to the first two coordinates of the state."""
    return -(actions - states[:, :D]).norm(dim=-1)


def _state(trainer: GRPOTrainer) -> tuple[list[Tensor], str]:
    assert trainer.optimizer is not None
    return [p.detach().clone() for p in trainer.params], str(copy.deepcopy(trainer.optimizer.state_dict()))


STATES = torch.tensor([[0.5, -0.5, 1.0], [-0.3, 0.8, 0.0]])


@pytest.mark.parametrize(
    "cfg",
    [
        CFG,
        dataclasses.replace(CFG, num_epochs_per_update=2, mini_batch_size=1),
        dataclasses.replace(CFG, kl_coeff=0.1),
    ],
    ids=["old-logprobs-from-first-epoch", "old-logprobs-at-collection", "with-reference"],
)
def test_a_gaussian_policy_that_forgets_to_sum_is_refused_before_any_weight_changes(cfg: GRPOConfig) -> None:
    torch.manual_seed(0)
    policy = GaussianPolicy(sum_over_action_dims=True)
    trainer = GRPOTrainer(cfg, policy, reach)
    trainer.step(STATES)  # a good step first: the optimizer has state
    policy.sum_over_action_dims = False
    before = _state(trainer)
    with pytest.raises(ValueError, match=FORGOT_SUM):
        trainer.step(STATES)
    after = _state(trainer)
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0], strict=True))
    assert before[1] == after[1]


def test_the_same_gaussian_policy_with_the_sum_trains() -> None:
    torch.manual_seed(0)
    policy = GaussianPolicy(sum_over_action_dims=True)
    trainer = GRPOTrainer(dataclasses.replace(CFG, group_size=16, batch_size=8), policy, reach)
    targets = torch.rand(64, OBS) * 2 - 1

    def error() -> float:
        with torch.no_grad():
            return float(-reach(targets, policy.dist(targets).mean).mean())

    start = error()
    for _ in range(60):
        trainer.step(torch.rand(8, OBS) * 2 - 1)
    assert error() < 0.5 * start, (start, error())


def test_the_error_names_the_sampler_when_it_reports_per_component_log_probs() -> None:
    class Sampling(GaussianPolicy):
        def generate_actions_with_log_probs(self, states: Tensor, g: int, **kw: Any) -> tuple[Tensor, Tensor]:
            actions = self.generate_actions(states, g)  # (B, G, D)
            flat = actions.flatten(0, 1)
            return actions, self.dist(states.repeat_interleave(g, 0)).log_prob(flat)  # (N, D)

    trainer = GRPOTrainer(dataclasses.replace(CFG, mini_batch_size=1), Sampling(), reach)
    with pytest.raises(
        ValueError, match=r"Sampling\.generate_actions_with_log_probs returned log-probs of shape \(8, 2\)"
    ):
        trainer.step(STATES)


class StepsPolicy(nn.Module):
    """T = 2 scalar continuous actions in a row per sample: float actions (N, T) whose log-probs
    really are per step; ``explicit`` returns them as a `PolicyOutput` with a mask."""

    def __init__(self, explicit: bool) -> None:
        super().__init__()
        self.mean = nn.Linear(OBS, D)
        self.explicit = explicit

    def generate_actions(self, states: Tensor, num_actions_per_state: int, **kwargs: Any) -> Tensor:
        return Normal(self.mean(states), 1.0).sample((num_actions_per_state,)).transpose(0, 1)

    def get_log_probabilities(self, states: Tensor, actions: Tensor) -> Tensor | PolicyOutput:
        logp = Normal(self.mean(states), 1.0).log_prob(actions)  # (N, T)
        if not self.explicit:
            return logp
        return PolicyOutput(logp, mask=torch.ones_like(logp, dtype=torch.bool))

    def get_parameters(self) -> dict[str, Tensor]:
        return dict(self.named_parameters())


def test_per_step_log_probs_of_float_actions_are_accepted_with_a_mask() -> None:
    torch.manual_seed(0)
    policy = StepsPolicy(explicit=True)
    trainer = GRPOTrainer(CFG, policy, reach)
    weight = policy.mean.weight.detach().clone()
    trainer.step(STATES)
    batch = trainer.collector.collect(STATES)
    assert batch.ref_log_probs is None
    lp = normalise_log_probs(policy.get_log_probabilities(batch.flat_states, batch.actions), 8, "P.m", CPU)
    assert lp.log_probs.shape == (8, D)
    assert lp.mask.shape == (8, D)
    assert not torch.equal(policy.mean.weight, weight), "it trained"


def test_per_step_log_probs_of_float_actions_without_a_mask_are_refused() -> None:
    trainer = GRPOTrainer(CFG, StepsPolicy(explicit=False), reach)
    with pytest.raises(ValueError, match=r"StepsPolicy\.get_log_probabilities .* mask=torch\.ones_like"):
        trainer.step(STATES)


class TokenPolicy(nn.Module):
    """Integer token ids (N, T) with per-token log-probs (N, T) as a plain tensor (no mask)."""

    def __init__(self, vocab: int = 5, t: int = 3) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.zeros(t, vocab))

    def generate_actions(self, states: Tensor, num_actions_per_state: int, **kwargs: Any) -> Tensor:
        tokens = Categorical(logits=self.logits).sample((len(states), num_actions_per_state))
        return tokens  # (B, G, T) int64

    def get_log_probabilities(self, states: Tensor, actions: Tensor) -> Tensor:
        return Categorical(logits=self.logits).log_prob(actions)  # (N, T)

    def get_parameters(self) -> dict[str, Tensor]:
        return dict(self.named_parameters())


def test_integer_token_actions_with_per_step_log_probs_are_accepted() -> None:
    torch.manual_seed(0)
    policy = TokenPolicy()
    trainer = GRPOTrainer(CFG, policy, lambda s, a: (a == 0).float().sum(-1))
    trainer.step(STATES)
    batch = trainer.collector.collect(STATES)
    assert batch.actions.shape == (8, 3)
    assert not batch.actions.is_floating_point()
    assert batch.mask is not None
    assert batch.mask.shape == (8, 3)
    assert not torch.equal(policy.logits, torch.zeros(3, 5)), "it trained"


class NormalNet(nn.Module):
    """states (B, 3) -> Normal with batch shape (B, 2): `DistributionPolicy` sums it itself."""

    def __init__(self) -> None:
        super().__init__()
        self.mean = nn.Linear(OBS, D)

    def forward(self, states: Tensor) -> Normal:
        return Normal(self.mean(states), 1.0)


@pytest.mark.parametrize(
    "make", [lambda: gaussian_mlp(OBS, D, (8,)), lambda: DistributionPolicy(NormalNet())]
)
def test_ready_policies_with_vector_actions_are_unaffected(make: Any) -> None:
    torch.manual_seed(0)
    policy = make()
    trainer = GRPOTrainer(dataclasses.replace(CFG, kl_coeff=0.1, num_epochs_per_update=2), policy, reach)
    before = [p.detach().clone() for p in trainer.params]
    trainer.step(STATES)
    assert policy.get_log_probabilities(STATES, torch.zeros(2, D)).shape == (2,)
    assert not all(torch.equal(a, b) for a, b in zip(before, trainer.params, strict=True)), "it trained"


# ---- the rule at the normalisation point ------------------------------------------------------
@pytest.mark.parametrize(
    ("log_probs", "actions"),
    [
        (torch.zeros(4, 2), torch.zeros(4, 2)),  # one float vector per sample, log-probs per component
        (PolicyOutput(torch.zeros(4, 2)), torch.zeros(4, 2)),  # a PolicyOutput without a mask says nothing
        # the sampler reports before groups are dropped: rows may differ, the shape per row counts
        (torch.zeros(4, 2), torch.zeros(6, 2, dtype=torch.float64)),
    ],
    ids=["tensor", "policy-output-without-mask", "float64-other-rows"],
)
def test_ambiguous_shapes_are_refused(log_probs: Tensor | PolicyOutput, actions: Tensor) -> None:
    with pytest.raises(ValueError, match=r"P\.m returned log-probs of shape \(4, 2\) without a mask"):
        normalise_log_probs(log_probs, 4, "P.m", CPU, actions=actions)


@pytest.mark.parametrize(
    ("log_probs", "actions"),
    [
        (torch.zeros(4), torch.zeros(4, 2)),  # summed: one log-prob per action
        (torch.zeros(4, 1), torch.zeros(4, 1)),  # D = 1: the sum over one component is itself
        (torch.zeros(4, 2), torch.zeros(4, 2, dtype=torch.long)),  # token ids: per-step log-probs
        (torch.zeros(4, 3), torch.zeros(4, 2)),  # T != D: not the action's components
        (torch.zeros(4, 2), torch.zeros(4, 2, 5)),  # (N, T, D) actions summed over D: per step
        (PolicyOutput(torch.zeros(4, 2), mask=torch.ones(4, 2)), torch.zeros(4, 2)),  # said explicitly
        (torch.zeros(4, 2), [[0.0, 1.0]] * 4),  # list actions: objects the trainer cannot look into
        (torch.zeros(4, 2), None),  # actions not given
    ],
    ids=["summed", "D=1", "int-tokens", "T!=D", "steps-of-vectors", "with-mask", "list", "no-actions"],
)
def test_unambiguous_shapes_are_accepted(log_probs: Tensor | PolicyOutput, actions: Any) -> None:
    out = normalise_log_probs(log_probs, 4, "P.m", CPU, actions=actions)
    assert out.log_probs.shape[0] == 4


def test_from_groups_refuses_per_component_old_log_probs_and_says_to_pass_a_mask() -> None:
    actions = torch.zeros(2, 4, D)  # (B, G, D)
    with pytest.raises(ValueError, match=r"from_groups old_log_probs .*pass mask=torch\.ones_like"):
        ExperienceBatch.from_groups(STATES, actions, torch.zeros(2, 4), old_log_probs=torch.zeros(8, D))
    batch = ExperienceBatch.from_groups(
        STATES, actions, torch.zeros(2, 4), old_log_probs=torch.zeros(8, D), mask=torch.ones(8, D)
    )
    assert batch.old_log_probs is not None
    assert batch.old_log_probs.shape == (8, D)
