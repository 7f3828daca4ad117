import pytest
import torch
from torch import nn
from torch.distributions import Categorical, Normal

from grpo import PolicyModel
from grpo.policies import DistributionPolicy, categorical_mlp, gaussian_mlp
from grpo.policy_base import SupportsEvaluateActions


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


# ---- the ready policies check their states ------------------------------------------------------
def _ready(kind: str) -> DistributionPolicy:
    torch.manual_seed(0)
    return categorical_mlp(4, 3) if kind == "categorical" else gaussian_mlp(4, 2)


@pytest.mark.parametrize("kind", ["categorical", "gaussian"])
@pytest.mark.parametrize(
    ("states", "exc", "pattern"),
    [
        (
            torch.zeros(2, 5),
            ValueError,
            r"^{net}\(obs_dim=4\) expects states of shape \(B, 4\): B states of obs_dim=4 numbers each; got "
            r"a Tensor of shape \(2, 5\) and dtype torch\.float32\. Each state has 5 features: build the "
            r"policy for them \(obs_dim=5\) or fix the states\.$",
        ),
        (
            torch.zeros(4),
            ValueError,
            r"^{net}\(obs_dim=4\) expects states of shape \(B, 4\).* got a Tensor of shape \(4,\) .*One "
            r"state\? Pass a batch of one: states\[None\] \(shape \(1, 4\)\)\.$",
        ),
        (
            [[0.0, 1.0], [2.0, 3.0]],
            ValueError,
            r"^{net}\(obs_dim=4\) expects states of shape \(B, 4\).*; got states of shape \(2, 2\)\. Each "
            r"state has 2 features",
        ),
        (
            [torch.zeros(3), torch.zeros(3)],
            ValueError,
            r"^{net}\(obs_dim=4\) expects states of shape \(B, 4\).*; got states of shape \(2, 3\)",
        ),
        (
            [torch.zeros(4), torch.zeros(3)],
            ValueError,
            r"^{net}\(obs_dim=4\) got states as a list of Tensors of different shapes "
            r"\['\(3,\)', '\(4,\)'\]; expected B Tensors of shape \(4,\)\.$",
        ),
        (
            ["up", "down"],
            TypeError,
            r"^{net}\(obs_dim=4\) takes states as numbers of shape \(B, 4\) \(a Tensor, a NumPy array or B "
            r"lists of 4 numbers\); got a list of 2 str \(first: 'up'\) \(NumPy dtype <U4\)\. Encode each "
            r"state as 4 numbers first\.$",
        ),
        (
            [[0.0] * 4, [0.0] * 3],
            TypeError,
            r"^{net}\(obs_dim=4\) takes states as numbers .*; got a list of 2 list .*which is not an array",
        ),
        (
            torch.zeros(2, 4, dtype=torch.complex64),
            TypeError,
            r"^{net}\(obs_dim=4\) takes real-valued states; got a Tensor of shape \(2, 4\) and dtype "
            r"torch\.complex64\.$",
        ),
    ],
    ids=["features", "one-state", "lists", "tensor-list", "ragged-tensors", "strings", "ragged", "complex"],
)
def test_ready_policies_name_bad_states(
    kind: str, states: object, exc: type[Exception], pattern: str
) -> None:
    policy = _ready(kind)
    net = type(policy.net).__name__
    before = [p.detach().clone() for p in policy.parameters()]
    for call in (
        lambda: policy.generate_actions(states, 2),
        lambda: policy.generate_actions_with_log_probs(states, 2),
        lambda: policy.get_log_probabilities(states, torch.zeros(2, dtype=torch.long)),
        lambda: policy.evaluate_actions(states, torch.zeros(2, dtype=torch.long)),
    ):
        with pytest.raises(exc, match=pattern.replace("{net}", net)):
            call()
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters(), strict=True))


@pytest.mark.parametrize("kind", ["categorical", "gaussian"])
def test_ready_policies_cast_float64_and_integer_states(kind: str) -> None:
    policy = _ready(kind)
    states = torch.randn(3, 4, dtype=torch.float64)
    actions = policy.generate_actions(states.float(), 2).flatten(0, 1)
    expected = policy.evaluate_actions(states.float(), actions, group_size=2).log_probs
    for given in (states, states.numpy(), states.tolist(), list(states.numpy()), list(states)):
        got = policy.evaluate_actions(given, actions, group_size=2).log_probs
        assert got.dtype == torch.float32
        assert torch.equal(got, expected), type(given)
    assert policy.generate_actions(torch.ones(3, 4, dtype=torch.long), 2).shape[:2] == (3, 2)
    double = _ready(kind).double()  # a float64 policy: float32 states are cast up
    assert double.evaluate_actions(states.float(), actions, group_size=2).log_probs.dtype == torch.float64


def test_ready_policy_float64_states_train_through_the_trainer() -> None:
    from grpo import GRPOConfig, GRPOTrainer

    policy = _ready("categorical")
    trainer = GRPOTrainer(
        GRPOConfig(group_size=4, batch_size=2, kl_coeff=0.0), policy, lambda s, a: a.float()
    )
    before = [p.detach().clone() for p in policy.parameters()]
    metrics = trainer.step(torch.randn(2, 4, dtype=torch.float64))
    assert metrics["optim/non_finite_steps"] == 0.0
    assert not all(torch.equal(a, b) for a, b in zip(before, policy.parameters(), strict=True))
    before = [p.detach().clone() for p in policy.parameters()]
    with pytest.raises(ValueError, match=r"^CategoricalMLP\(obs_dim=4\) expects states of shape \(B, 4\)"):
        trainer.step(torch.randn(2, 5))
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters(), strict=True))
