import pytest
import torch
from torch import nn
from torch.distributions import Categorical, Normal

from grpo import DistributionPolicy, PolicyModel, SupportsEvaluateActions, categorical_mlp, gaussian_mlp


def test_ready_policies_satisfy_the_protocols() -> None:
    for policy in (categorical_mlp(4, 3), gaussian_mlp(4, 2)):
        assert isinstance(policy, PolicyModel)
        assert isinstance(policy, SupportsEvaluateActions)


@pytest.mark.parametrize("kind", ["categorical", "gaussian"])
def test_grouped_evaluation_equals_per_sample_evaluation(kind: str) -> None:
    torch.manual_seed(0)
    policy = categorical_mlp(5, 4) if kind == "categorical" else gaussian_mlp(5, 3, log_std_init=-0.5)
    states = torch.randn(6, 5)
    actions = policy.generate_actions(states, 4)
    assert actions.shape[:2] == (6, 4)
    flat_states, flat_actions = states.repeat_interleave(4, 0), actions.flatten(0, 1)
    per_sample = policy.get_log_probabilities(flat_states, flat_actions)
    grouped = policy.evaluate_actions(states, flat_actions, group_size=4, with_entropy=True)
    assert per_sample.shape == (24,)
    assert torch.allclose(grouped.log_probs, per_sample, atol=1e-6)
    dist = policy.distribution(flat_states)
    assert grouped.entropy is not None
    assert torch.allclose(grouped.entropy, dist.entropy(), atol=1e-6)


@pytest.mark.parametrize("kind", ["categorical", "gaussian", "custom categorical"])
def test_entropy_for_metrics_only_has_no_graph(kind: str) -> None:
    # with_entropy="no_grad" (what the trainer asks when entropy_coeff == 0): same values, no graph
    torch.manual_seed(0)
    if kind == "categorical":
        policy = categorical_mlp(5, 4)
    elif kind == "gaussian":
        policy = gaussian_mlp(5, 3)
    else:  # a user network returning a Categorical: the Categorical path, not the table
        policy = DistributionPolicy(_LogitsNet())
    states = torch.randn(6, 5)
    actions = policy.generate_actions(states, 3).flatten(0, 1)
    for g, s in ((3, states), (1, states.repeat_interleave(3, 0))):
        exact = policy.evaluate_actions(s, actions, group_size=g, with_entropy=True)
        metrics = policy.evaluate_actions(s, actions, group_size=g, with_entropy="no_grad")
        assert exact.entropy is not None
        assert metrics.entropy is not None
        assert exact.entropy.requires_grad
        assert not metrics.entropy.requires_grad
        assert metrics.log_probs.requires_grad
        assert torch.equal(exact.entropy, metrics.entropy)
        assert torch.equal(exact.log_probs, metrics.log_probs)
    assert torch.is_grad_enabled()


class _LogitsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 4)

    def forward(self, x: torch.Tensor) -> Categorical:
        return Categorical(logits=self.lin(x))


def test_gaussian_entropy_is_exact_closed_form() -> None:
    policy = gaussian_mlp(2, 3, log_std_init=0.3)
    out = policy.evaluate_actions(torch.zeros(1, 2), torch.zeros(1, 3), with_entropy=True)
    closed = 3 * (0.5 * torch.log(torch.tensor(2 * torch.pi * torch.e)) + 0.3)
    assert out.entropy is not None
    assert out.entropy.item() == pytest.approx(closed.item(), abs=1e-5)


def test_extra_batch_dims_are_folded_into_the_event() -> None:
    class PerDimNormal(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mu = nn.Linear(2, 3)

        def forward(self, x: torch.Tensor) -> Normal:
            return Normal(self.mu(x), 1.0)  # batch shape (B, 3)

    policy = DistributionPolicy(PerDimNormal())
    a = policy.generate_actions(torch.zeros(4, 2), 5)
    assert a.shape == (4, 5, 3)
    assert policy.get_log_probabilities(torch.zeros(20, 2), a.flatten(0, 1)).shape == (20,)


def test_module_that_returns_no_distribution_is_explained() -> None:
    policy = DistributionPolicy(nn.Linear(2, 3))
    with pytest.raises(
        TypeError, match=r"Linear.forward returned Tensor; DistributionPolicy needs a torch.distributions"
    ):
        policy.generate_actions(torch.zeros(1, 2), 2)


def test_list_of_tensor_states_are_stacked() -> None:
    class Uniform(nn.Module):
        def forward(self, x: torch.Tensor) -> Categorical:
            return Categorical(logits=torch.zeros(x.shape[0], 3))

    policy = DistributionPolicy(Uniform())
    assert policy.generate_actions([torch.zeros(2), torch.ones(2)], 4).shape == (2, 4)


def test_categorical_sampling_path_draws_what_categorical_draws() -> None:
    """The ready categorical policy samples without building a Categorical: same draws, same
    log-probs as ``Categorical.sample`` under the same seed."""
    torch.manual_seed(0)
    policy = categorical_mlp(5, 4)
    states = torch.randn(6, 5)
    torch.manual_seed(1)
    actions, out = policy.generate_actions_with_log_probs(states, 8)
    torch.manual_seed(1)
    dist = policy.distribution(states)
    expected = dist.sample((8,)).T  # (B, G)
    assert torch.equal(actions, expected)
    want = dist.log_prob(expected.T).T.reshape(-1)
    assert torch.allclose(out.log_probs, want, atol=1e-6)
    torch.manual_seed(1)
    assert torch.equal(policy.generate_actions(states, 8), expected)  # the plain sampler too


def test_set_training_mode_matches_train_and_respects_overrides() -> None:
    from grpo.policy_base import set_training_mode

    net = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5), nn.Sequential(nn.Tanh()))
    net.register_module("absent", None)  # a None child is allowed by nn.Module
    set_training_mode(net, False)
    assert [m.training for m in net.modules()] == [False] * 5
    set_training_mode(net, True)
    assert [m.training for m in net.modules()] == [True] * 5

    calls: list[bool] = []

    class Frozen(nn.Module):  # overrides train(): must be called, not bypassed
        def train(self, mode: bool = True) -> "Frozen":
            calls.append(mode)
            return super().train(False)

    outer = nn.Sequential(nn.Linear(2, 2), Frozen())
    set_training_mode(outer, True)
    assert calls == [True]
    assert outer[1].training is False

    class Plain:  # not a module: its own train() / eval()
        mode = "unset"

        def train(self) -> None:
            self.mode = "train"

        def eval(self) -> None:
            self.mode = "eval"

    obj = Plain()
    set_training_mode(obj, False)
    assert obj.mode == "eval"
    set_training_mode(obj, True)
    assert obj.mode == "train"
