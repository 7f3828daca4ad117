"""Every floating dtype trains (issue 24, part 1): float64, float32, bfloat16, float16, and a
policy that mixes float64 and float32 weights.

Each case runs real steps (`GRPOTrainer.step`, `GRPOTrainer.train_on_batch`), a checkpoint round
trip and evaluation, and checks that the weights moved, stayed finite and kept their dtype. A
float64 policy's update is compared with a plain float64 loop written here to 1e-10: its norms,
advantages and loss are computed in float64, never rounded to float32.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from grpo import ExperienceBatch, GRPOConfig, GRPOTrainer
from grpo.engine.optim import clip_grad_norm
from grpo.policies import CategoricalMLP, DistributionPolicy, GaussianMLP, categorical_mlp, gaussian_mlp

pytestmark = pytest.mark.usefixtures("one_thread")

OBS, ARMS, HIDDEN, B, G = 3, 4, 8, 4, 4

# name -> (dtype of the first layer, dtype of the last layer)
DTYPES: dict[str, tuple[torch.dtype, torch.dtype]] = {
    "float64": (torch.float64, torch.float64),
    "float32": (torch.float32, torch.float32),
    "bfloat16": (torch.bfloat16, torch.bfloat16),
    "float16": (torch.float16, torch.float16),
    "mixed": (torch.float64, torch.float32),
}


class TwoLayerPolicy(nn.Module):
    """A user-written `PolicyModel` (README quick start): states (B, 3) -> logits over 4 arms
    through two linear layers, each in its own dtype (the hidden activations are cast between
    them). Lists in, lists out when the states are lists; tensors otherwise."""

    def __init__(self, first: torch.dtype, last: torch.dtype) -> None:
        super().__init__()
        self.l1 = nn.Linear(OBS, HIDDEN, dtype=first)
        self.l2 = nn.Linear(HIDDEN, ARMS, dtype=last)

    def log_prob_table(self, states: Any) -> Tensor:
        x = torch.as_tensor(states).to(self.l1.weight.dtype)
        h = torch.tanh(self.l1(x)).to(self.l2.weight.dtype)
        return torch.log_softmax(self.l2(h), -1)  # (B, ARMS)

    def generate_actions(self, states: Any, num_actions_per_state: int, **kwargs: Any) -> Any:
        probs = self.log_prob_table(states).exp().float()
        actions = torch.multinomial(probs, num_actions_per_state, replacement=True)  # (B, G)
        return actions if isinstance(states, Tensor) else actions.tolist()

    def get_log_probabilities(self, states: Any, actions: Any) -> Tensor:
        a = torch.as_tensor(actions).long()
        return self.log_prob_table(states).gather(1, a[:, None]).squeeze(1)  # (N,)

    def get_parameters(self) -> dict[str, Tensor]:
        return dict(self.named_parameters())


def make_policy(kind: str, dtype: str, seed: int = 0) -> DistributionPolicy | TwoLayerPolicy:
    """``kind`` "ready": `categorical_mlp` in ``dtype``, or for "mixed" a `gaussian_mlp` whose
    mean network is float32 and whose log-std is float64; "protocol": a `TwoLayerPolicy`."""
    torch.manual_seed(seed)
    first, last = DTYPES[dtype]
    if kind == "protocol":
        return TwoLayerPolicy(first, last)
    if dtype == "mixed":
        policy = gaussian_mlp(OBS, 1, hidden=(HIDDEN,))
        net = policy.net
        assert isinstance(net, GaussianMLP)
        net.log_std = nn.Parameter(net.log_std.detach().to(torch.float64))
        return policy
    return categorical_mlp(OBS, ARMS, hidden=(HIDDEN,)).to(first)


def reward(states: Any, actions: Any) -> Tensor:
    """``-(a - 0.5)^2`` summed over action dims: arms 0 and 1 pay most; works for flat lists of
    ints, (N,) integer tensors and (N, 1) float actions."""
    a = torch.as_tensor(actions, dtype=torch.float64)
    return -(a.reshape(a.shape[0], -1) - 0.5).square().sum(-1)


def make_states(form: str, seed: int, n: int = B) -> Any:
    x = torch.randn(n, OBS, generator=torch.Generator().manual_seed(seed))
    return x if form == "tensor" else x.tolist()


def weights(policy: nn.Module) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in policy.named_parameters()}


def assert_trained(policy: nn.Module, before: dict[str, Tensor]) -> None:
    """Every weight tensor moved, is finite and kept its dtype."""
    after = dict(policy.named_parameters())
    assert after.keys() == before.keys()
    for name, w in after.items():
        assert w.dtype == before[name].dtype, (name, w.dtype, before[name].dtype)
        assert bool(torch.isfinite(w).all()), name
        assert not torch.equal(w.detach(), before[name]), f"{name} did not change"


def config(**kw: Any) -> GRPOConfig:
    base: dict[str, Any] = {
        "group_size": G, "batch_size": B, "learning_rate": 1e-2, "seed": 0,
        "num_epochs_per_update": 2, "mini_batch_size": B // 2,  # 4 optimizer steps: the snapshot path
    }  # fmt: skip
    return GRPOConfig(**(base | kw))


@pytest.mark.parametrize("kind", ["ready", "protocol"])
@pytest.mark.parametrize("form", ["tensor", "list"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_every_dtype_trains_through_step_and_train_on_batch(dtype: str, form: str, kind: str) -> None:
    policy = make_policy(kind, dtype)
    dtypes = {p.dtype for p in policy.parameters()}
    assert len(dtypes) == (2 if dtype == "mixed" else 1)
    before = weights(policy)
    trainer = GRPOTrainer(config(), policy, reward)  # kl_coeff 0.04: a reference copy too
    for i in range(2):
        metrics = trainer.step(make_states(form, seed=i))
        assert math.isfinite(metrics["loss/total"]), metrics
        assert math.isfinite(metrics["grad/norm"]), metrics
        assert 0 < metrics["optim/update_ratio"] < math.inf, metrics
    assert_trained(policy, before)
    assert trainer.non_finite_steps == 0

    # groups from elsewhere: given actions and rewards, no behaviour log-probs
    states = make_states(form, seed=7)
    if kind == "ready" and dtype == "mixed":
        actions: Any = torch.linspace(-1, 1, B * G, dtype=torch.float64).reshape(B, G, 1)
    else:
        actions = torch.arange(B * G).reshape(B, G) % ARMS
        actions = actions if form == "tensor" else actions.tolist()
    rewards = reward(None, torch.as_tensor(actions).reshape(B * G, -1))
    before = weights(policy)
    metrics = trainer.train_on_batch(ExperienceBatch.from_groups(states, actions, rewards))
    assert 0 < metrics["optim/update_ratio"] < math.inf, metrics
    assert_trained(policy, before)
    assert {p.dtype for p in policy.parameters()} == dtypes


@pytest.mark.parametrize("max_grad_norm", [0.2, None], ids=["clipped", "unclipped"])
def test_float64_update_equals_a_float64_loop(max_grad_norm: float | None) -> None:
    """Two optimizer steps (epochs) of SGD on given groups equal a plain float64 loop to 1e-10:
    group-normalised advantages, the clipped surrogate (token-mean), gradient clipping, SGD."""
    torch.manual_seed(0)
    policy = categorical_mlp(OBS, ARMS, hidden=(HIDDEN,)).double()
    mlp = policy.net
    assert isinstance(mlp, CategoricalMLP)
    ref = copy.deepcopy(mlp.net)
    lr, eps = 1.0, 0.2
    cfg = GRPOConfig(
        group_size=G, batch_size=2, kl_coeff=0.0, entropy_coeff=0.0, num_epochs_per_update=2,
        clip_epsilon=eps, max_grad_norm=max_grad_norm, seed=0,
    )  # fmt: skip
    trainer = GRPOTrainer(cfg, policy, reward, optimizer=torch.optim.SGD(policy.parameters(), lr=lr))
    states = torch.randn(2, OBS, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    actions = torch.tensor([[0, 1, 2, 3], [3, 3, 1, 0]])
    rewards = torch.tensor([[1.0, 0.0, 3.0, 0.5], [2.0, -1.0, 0.25, 0.0]], dtype=torch.float64)
    start = [p.detach().clone() for p in policy.parameters()]
    metrics = trainer.train_on_batch(ExperienceBatch.from_groups(states, actions, rewards))

    # the loop: rewards (B, G), log-probs (B, G); the current policy is the behaviour policy
    mean = rewards.mean(1, keepdim=True)
    std = rewards.std(1, keepdim=True)  # unbiased, as the library's group std
    adv = (rewards - mean) / (std + 1e-6)
    params = list(ref.parameters())

    def logp() -> Tensor:
        return torch.log_softmax(ref(states), -1).gather(1, actions)

    logp_old = logp().detach()
    ratios, norms = [], []
    for _ in range(2):
        ratio = torch.exp((logp() - logp_old).clamp(-20.0, 20.0))
        loss = -torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv).mean()
        grads = torch.autograd.grad(loss, params)
        norm = math.sqrt(sum(float(g.square().sum()) for g in grads))
        coef = 1.0 if max_grad_norm is None else min(1.0, max_grad_norm / (norm + 1e-6))
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p.sub_(lr * coef * g)
        ratios.append(ratio.detach())
        norms.append(norm)
    # the case exercises what it claims: the second epoch clips ratios (the first is at ratio 1),
    # and with max_grad_norm the first step's gradient is clipped
    assert float((ratios[1] - 1).abs().max()) > eps
    if max_grad_norm is not None:
        assert norms[0] > max_grad_norm
    # the update's size, ||theta' - theta|| / ||theta||, accumulated in float64 too
    moved = sum(float((q.detach() - p0).square().sum()) for q, p0 in zip(params, start, strict=True))
    size = sum(float(p0.square().sum()) for p0 in start)
    assert metrics["optim/update_ratio"] == pytest.approx(math.sqrt(moved / size), rel=1e-12, abs=0)
    for (name, p), q in zip(mlp.net.named_parameters(), params, strict=True):
        assert p.dtype == torch.float64
        gap = float((p.detach() - q.detach()).abs().max())
        assert gap <= 1e-10, f"{name} differs from the float64 loop by {gap:.3g}"


def test_gradient_norm_of_mixed_dtypes_accumulates_in_float64() -> None:
    """float64 and float32 gradients: their total norm is float64 (as ``clip_grad_norm_``
    promotes it), not rounded to float32, and clipping scales both to the max norm."""
    a = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    b = nn.Parameter(torch.zeros(2))
    a.grad = torch.tensor([1.0, 2.0, 1.0 / 3.0], dtype=torch.float64)
    b.grad = torch.tensor([0.1, 3.0])
    want = math.sqrt(1.0 + 4.0 + 1.0 / 9.0 + float(b.grad.double().square().sum()))
    norm = clip_grad_norm([a, b], 0.5)
    assert norm.dtype == torch.float64
    assert float(norm) == pytest.approx(want, rel=1e-15, abs=0)
    assert a.grad.dtype == torch.float64
    assert b.grad.dtype == torch.float32
    total = math.sqrt(float(a.grad.square().sum()) + float(b.grad.double().square().sum()))
    assert total == pytest.approx(0.5, rel=1e-6)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_checkpoint_round_trip_keeps_dtype_and_resumes_exactly(dtype: str, tmp_path: Path) -> None:
    saved = GRPOTrainer(config(), make_policy("ready", dtype), reward)
    saved.step(make_states("tensor", seed=0))
    saved.save_checkpoint(tmp_path)

    loaded = GRPOTrainer(config(), make_policy("ready", dtype, seed=1), reward)  # other weights
    loaded.load_checkpoint(tmp_path)
    for a, b in zip(saved.params, loaded.params, strict=True):
        assert a.dtype == b.dtype
        assert torch.equal(a, b)
    ref_a, ref_b = saved.reference_policy, loaded.reference_policy
    assert isinstance(ref_a, nn.Module)
    assert isinstance(ref_b, nn.Module)
    for a, b in zip(ref_a.parameters(), ref_b.parameters(), strict=True):
        assert a.dtype == b.dtype
        assert torch.equal(a, b)
    # the optimizer's moments kept their dtype (AdamW: the weights' dtype)
    for p in loaded.params:
        state = loaded.optimizer.state[p]  # type: ignore[union-attr]
        assert state["exp_avg"].dtype == p.dtype
    # resuming gives bitwise the same next step
    for trainer in (saved, loaded):
        torch.manual_seed(5)
        trainer.step(make_states("tensor", seed=1))
    for a, b in zip(saved.params, loaded.params, strict=True):
        assert torch.equal(a, b)
        assert bool(torch.isfinite(a).all())


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_evaluation_of_every_dtype(dtype: str) -> None:
    policy = make_policy("ready", dtype)
    trainer = GRPOTrainer(config(), policy, reward)
    states = make_states("tensor", seed=0, n=8)
    run = trainer.train(states, num_steps=2, eval_states=states[:3], eval_every=1, progress=False)
    assert [e["step"] for e in run.eval_history] == [1.0, 2.0]
    assert all(math.isfinite(e["eval/reward/mean"]) for e in run.eval_history)
    before = weights(policy)
    first = trainer.evaluate(states, seed=3)
    again = trainer.evaluate(states, seed=3)
    assert first["eval/reward/mean"] == again["eval/reward/mean"]  # seeded: the same samples
    # rewards are -(a - 0.5)^2 <= 0, at most -0.25 for arms; the mean lies within the bounds
    assert first["eval/reward/min"] <= first["eval/reward/mean"] <= first["eval/reward/max"] <= 0.0
    after = dict(policy.named_parameters())
    for name, w in before.items():
        assert torch.equal(after[name].detach(), w), f"evaluate() changed {name}"
        assert after[name].dtype == w.dtype
