import copy
import dataclasses
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from grpo import GRPOConfig, GRPOTrainer, PolicyOutput
from tests.conftest import ContextualBandit, Counting, WordPolicy

ROOT = Path(__file__).resolve().parents[1]


def make(cfg: GRPOConfig, policy: Any, reward: Any, **kw: Any) -> GRPOTrainer:
    return GRPOTrainer(cfg, policy, reward, **kw)


def test_seed_getting_started_example_runs_unchanged_and_prints_metrics() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "data" / "seed_getting_started.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "Training step completed. Metrics:" in out.stdout
    metrics = eval(out.stdout.split("Metrics:\n", 1)[1])  # the printed dict of floats
    for key in ("reward/mean", "reward/std", "advantage/mean", "advantage/std", "reward/frac_zero_std"):
        assert isinstance(metrics[key], float)
    assert out.stderr.count("nothing is trained") == 1


def test_policy_without_parameters_warns_once_and_still_reports() -> None:
    class NoParams(WordPolicy):
        def get_parameters(self) -> dict[str, Tensor]:
            return {}

    trainer = make(
        GRPOConfig(group_size=4, kl_coeff=0.0), NoParams(), lambda s, a: [float(len(w)) for w in a]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m1 = trainer.step(["a", "b"])
        m2 = trainer.step(["a", "b"])
    assert sum("nothing is trained" in str(w.message) for w in caught) == 1
    assert "reward/mean" in m1
    assert "advantage/max" in m2
    assert "loss/total" not in m2


def test_list_form_user_policy_learns_and_gets_group_major_lists() -> None:
    seen: list[tuple[list[Any], list[Any]]] = []

    def reward(states: list[str], actions: list[str]) -> list[float]:
        seen.append((states, actions))
        return [1.0 if a == "blue" else 0.0 for a in actions]

    policy = WordPolicy()
    trainer = make(
        GRPOConfig(group_size=4, batch_size=3, learning_rate=0.1, kl_coeff=0.0, seed=0), policy, reward
    )
    for _ in range(60):
        metrics = trainer.step(["s0", "s1", "s2"])
    states, actions = seen[0]
    assert states == ["s0"] * 4 + ["s1"] * 4 + ["s2"] * 4
    assert isinstance(actions, list)
    assert len(actions) == 12
    assert torch.softmax(policy.logits, 0)[WordPolicy.vocab.index("blue")] > 0.9
    assert metrics["reward/mean"] > 0.8


def test_tensor_form_reward_sees_repeat_interleaved_states_and_flat_actions(
    contextual: ContextualBandit,
) -> None:
    seen: dict[str, Tensor] = {}

    def reward(states: Tensor, actions: Tensor) -> Tensor:
        seen["states"], seen["actions"] = states, actions
        return contextual.reward(states, actions)

    trainer = make(GRPOConfig(group_size=3, batch_size=2, kl_coeff=0.0), contextual.policy(), reward)
    batch = trainer.collect(contextual.states(2))
    assert isinstance(seen["states"], Tensor)
    assert seen["states"].shape == (6, 16)
    assert torch.equal(seen["states"], batch.states.repeat_interleave(3, 0))
    assert seen["actions"].shape == (6,)
    assert batch.group_ids.tolist() == [0, 0, 0, 1, 1, 1]


def test_first_epoch_ratio_is_exactly_one_and_later_epochs_reuse_rollouts(
    contextual: ContextualBandit,
) -> None:
    one = make(
        GRPOConfig(group_size=8, batch_size=16, kl_coeff=0.0, learning_rate=1e-2, seed=0),
        contextual.policy(),
        contextual.reward,
    )
    m = one.step(contextual.states(16))
    assert m["ratio/min"] == 1.0
    assert m["ratio/max"] == 1.0
    assert m["kl/old"] == 0.0
    assert m["clip/frac_low"] == 0.0
    assert m["clip/frac_high"] == 0.0

    policy = Counting(contextual.policy())
    many = make(
        GRPOConfig(
            group_size=8, batch_size=16, num_epochs_per_update=4, kl_coeff=0.0, learning_rate=3e-2, seed=0
        ),
        policy,
        contextual.reward,
    )
    m = many.step(contextual.states(16))
    assert policy.calls["generate_actions"] == 1  # one rollout, reused by all 4 epochs
    assert m["ratio/max"] > 1.0
    assert m["ratio/min"] < 1.0
    assert m["kl/old"] > 0.0


@pytest.mark.parametrize("micro", [None, 2])  # 2: the first epoch's pieces are put together in row order
@pytest.mark.parametrize("kl", [0.0, 0.1])
def test_epochs_take_behaviour_log_probs_from_the_first_forward(
    contextual: ContextualBandit, kl: float, micro: int | None
) -> None:
    """One optimizer step per epoch: the first epoch's forward runs before any weight change, so
    it gives the behaviour log-probs and collection makes no forward of its own. The update equals
    the one with old log-probs recorded at collection (trainer.collect + update)."""
    cfg = GRPOConfig(
        group_size=4,
        batch_size=8,
        micro_batch_size=micro,
        num_epochs_per_update=3,
        kl_coeff=kl,
        learning_rate=3e-2,
        seed=0,
    )
    calls_per_epoch = 1 if micro is None else 8 // micro
    gen_state = contextual.gen.get_state()
    torch.manual_seed(0)
    policy = Counting(contextual.policy())
    trainer = make(cfg, policy, contextual.reward)
    m = trainer.step(contextual.states(8))
    assert policy.calls["get_log_probabilities"] == 3 * calls_per_epoch  # none at collection
    assert m["ratio/max"] > 1.0 > m["ratio/min"]  # epochs 2-3 saw the first epoch's log-probs

    contextual.gen.set_state(gen_state)
    torch.manual_seed(0)
    recorded = Counting(contextual.policy())
    manual = make(cfg, recorded, contextual.reward)
    batch = manual.collect(contextual.states(8))
    assert batch.old_log_probs is not None  # collect() always records them
    stats = manual.update(batch, manual.advantages(batch))
    assert recorded.calls["get_log_probabilities"] == 1 + 3 * calls_per_epoch
    for a, b in zip(policy.inner.parameters(), recorded.inner.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    assert float(stats["ratio/max"]) == pytest.approx(m["ratio/max"], abs=1e-6)


def test_an_update_without_behaviour_log_probs_takes_them_from_the_policy_before_it(
    contextual: ContextualBandit,
) -> None:
    """Several optimizer steps per epoch need the behaviour log-probs before the update; a batch
    without them gets the current policy's (no-grad forward), which is what collection records."""
    cfg = GRPOConfig(group_size=4, batch_size=8, mini_batch_size=4, num_epochs_per_update=2, seed=0)
    torch.manual_seed(0)
    a = make(cfg, contextual.policy(), contextual.reward)
    torch.manual_seed(0)
    b = make(cfg, contextual.policy(), contextual.reward)
    batch = a.collect(contextual.states(8))
    assert batch.old_log_probs is not None
    without = dataclasses.replace(batch, old_log_probs=None, mask=None)
    sa = a.update(batch, a.advantages(batch))
    sb = b.update(without, b.advantages(without))
    for p, q in zip(a.params, b.params, strict=True):
        assert torch.equal(p, q)
    assert float(sa["ratio/max"]) == float(sb["ratio/max"]) > 1.0
    assert without.old_log_probs is None  # the batch given is not changed


def test_kl_zero_builds_and_runs_no_reference(contextual: ContextualBandit) -> None:
    ref = Counting(contextual.policy())
    with pytest.warns(UserWarning, match="reference_policy is ignored because kl_coeff=0"):
        trainer = make(
            GRPOConfig(group_size=4, batch_size=4, kl_coeff=0.0),
            contextual.policy(),
            contextual.reward,
            reference_policy=ref,
        )
    assert trainer.reference_policy is None
    for _ in range(3):
        m = trainer.step(contextual.states(4))
    assert ref.calls == {}
    assert m["kl/ref"] == 0.0


def test_kl_on_runs_reference_once_per_step_and_default_is_frozen_snapshot(
    contextual: ContextualBandit,
) -> None:
    ref = Counting(contextual.policy())
    trainer = make(
        GRPOConfig(group_size=4, batch_size=4, kl_coeff=0.1),
        contextual.policy(),
        contextual.reward,
        reference_policy=ref,
    )
    for _ in range(3):
        trainer.step(contextual.states(4))
    assert ref.calls == {"get_log_probabilities": 3}

    policy = contextual.policy()
    start = copy.deepcopy(policy.state_dict())
    trainer = make(
        GRPOConfig(group_size=4, batch_size=4, kl_coeff=0.1, learning_rate=1e-2), policy, contextual.reward
    )
    snapshot = trainer.reference_policy
    assert snapshot is not None
    assert snapshot is not policy
    for _ in range(3):
        m = trainer.step(contextual.states(4))
    assert m["kl/ref"] > 0
    assert all(torch.equal(v, start[k]) for k, v in snapshot.state_dict().items())  # type: ignore[attr-defined]
    assert not any(p.requires_grad for p in snapshot.parameters())  # type: ignore[attr-defined]
    assert not all(torch.equal(v, start[k]) for k, v in policy.state_dict().items())


def test_reference_refreshed_only_when_asked(contextual: ContextualBandit) -> None:
    policy = contextual.policy()
    trainer = make(
        GRPOConfig(group_size=4, batch_size=4, kl_coeff=0.1, learning_rate=1e-2, reference_update_freq=2),
        policy,
        contextual.reward,
    )
    trainer.step(contextual.states(4))
    ref = trainer.reference_policy
    assert not all(torch.equal(a, b) for a, b in zip(ref.parameters(), policy.parameters(), strict=True))  # type: ignore[union-attr]
    trainer.step(contextual.states(4))
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), policy.parameters(), strict=True))  # type: ignore[union-attr]


def _params_after(cfg: GRPOConfig, contextual: ContextualBandit, steps: int = 2) -> list[Tensor]:
    torch.manual_seed(0)
    policy = contextual.policy()
    trainer = make(cfg, policy, contextual.reward)
    gen_state = contextual.gen.get_state()
    for _ in range(steps):
        trainer.step(contextual.states(8))
    contextual.gen.set_state(gen_state)
    return [p.detach().clone() for p in policy.parameters()]


@pytest.mark.parametrize("kl", [0.0, 0.1])  # 0.0: mask unknown before the forward (deferred normaliser)
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_accumulate_to_the_full_batch_update(
    contextual: ContextualBandit, kl: float, aggregation: str
) -> None:
    base = dict(
        group_size=4, batch_size=8, kl_coeff=kl, learning_rate=1e-2, seed=3, loss_aggregation=aggregation
    )
    full = _params_after(GRPOConfig(**base), contextual)  # type: ignore[arg-type]
    micro = _params_after(GRPOConfig(**base, micro_batch_size=2), contextual)  # type: ignore[arg-type]
    for a, b in zip(full, micro, strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_minibatches_take_several_optimizer_steps_with_recorded_old_logprobs(
    contextual: ContextualBandit,
) -> None:
    policy = Counting(contextual.policy())
    trainer = make(
        GRPOConfig(group_size=4, batch_size=8, mini_batch_size=2, kl_coeff=0.0, seed=0),
        policy,
        contextual.reward,
    )
    assert trainer.collector.record_old_log_probs
    batch = trainer.collect(contextual.states(8))
    assert batch.old_log_probs is not None
    assert batch.old_log_probs.shape == (32, 1)
    stats = trainer.update(batch, trainer.advantages(batch))
    assert float(stats["ratio/min"]) != 1.0 or float(stats["ratio/max"]) != 1.0  # steps 2..4 see a new policy


def test_seeded_runs_are_bitwise_equal(contextual: ContextualBandit) -> None:
    cfg = GRPOConfig(group_size=4, batch_size=8, mini_batch_size=4, num_epochs_per_update=2, seed=7)
    a = _params_after(cfg, contextual, steps=3)
    b = _params_after(cfg, contextual, steps=3)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_step_metrics_are_floats_with_documented_names(contextual: ContextualBandit) -> None:
    trainer = make(
        GRPOConfig(group_size=4, batch_size=4, entropy_coeff=0.01), contextual.policy(), contextual.reward
    )
    m = trainer.step(contextual.states(4))
    expected = {
        "reward/mean",
        "reward/std",
        "reward/min",
        "reward/max",
        "reward/frac_zero_std",
        "advantage/mean",
        "advantage/std",
        "advantage/min",
        "advantage/max",
        "loss/total",
        "loss/policy",
        "loss/kl",
        "loss/entropy",
        "policy/entropy",
        "kl/ref",
        "kl/old",
        "clip/frac_low",
        "clip/frac_high",
        "ratio/mean",
        "ratio/min",
        "ratio/max",
        "grad/norm",
        "optim/non_finite_steps",
        "time/generate",
        "time/score",
        "time/logprobs",
        "time/update",
        "time/step",
        "step",
    }
    assert expected <= set(m)
    assert all(isinstance(v, float) for v in m.values())
    # exact entropy of the categorical policy at the sampled states (ready policy gives it)
    assert 0.0 < m["policy/entropy"] <= torch.log(torch.tensor(10.0)).item() + 1e-6


def test_per_step_logprobs_with_mask_ignore_padding() -> None:
    """A policy with (N, T) log-probs and a mask: values at masked steps never reach the update."""

    class Steps:
        def __init__(self, garbage: float) -> None:
            self.w = torch.zeros(3, requires_grad=True)
            self.garbage = garbage

        def generate_actions(self, states: Tensor, g: int, **kw: Any) -> Tensor:
            lengths = torch.tensor([1, 2, 3, 3])[:g].repeat(states.shape[0], 1)  # (B, G)
            return lengths

        def get_log_probabilities(self, states: Tensor, actions: Tensor) -> PolicyOutput:
            lp = torch.log_softmax(self.w, 0).expand(actions.shape[0], 3)
            mask = torch.arange(3).unsqueeze(0) < actions.unsqueeze(1)
            return PolicyOutput(torch.where(mask, lp, lp * 0 + self.garbage), mask=mask)

        def get_parameters(self) -> dict[str, Tensor]:
            return {"w": self.w}

        def train(self) -> None: ...
        def eval(self) -> None: ...
        def to(self, device: Any) -> Any:
            return self

    grads = []
    for garbage in (0.0, 55.0):
        policy = Steps(garbage)
        trainer = make(
            GRPOConfig(group_size=4, batch_size=2, kl_coeff=0.0, learning_rate=0.1),
            policy,
            lambda s, a: a.float(),
        )
        batch = trainer.collect(torch.zeros(2, 1))
        trainer.update(batch, trainer.advantages(batch))
        grads.append(policy.w.detach().clone())
    assert torch.equal(grads[0], grads[1])
    assert not torch.equal(grads[0], torch.zeros(3))


def test_user_optimizer_is_used_and_foreign_optimizer_rejected(contextual: ContextualBandit) -> None:
    policy = contextual.policy()
    sgd = torch.optim.SGD(policy.parameters(), lr=0.5)
    trainer = make(
        GRPOConfig(group_size=4, batch_size=4, kl_coeff=0.0), policy, contextual.reward, optimizer=sgd
    )
    assert trainer.optimizer is sgd
    before = [p.detach().clone() for p in policy.parameters()]
    trainer.step(contextual.states(4))
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters(), strict=True))
    other = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)
    with pytest.raises(ValueError, match=r"holds none of the .* parameters"):
        make(GRPOConfig(), contextual.policy(), contextual.reward, optimizer=other)


def test_an_optimizer_that_overrides_zero_grad_gets_its_own_called(contextual: ContextualBandit) -> None:
    # torch optimizers are zeroed by setting .grad = None directly; one with its own zero_grad
    # (e.g. one that keeps extra gradient buffers) has it called before every optimizer step
    class Counting(torch.optim.SGD):
        calls = 0

        def zero_grad(self, set_to_none: bool = True) -> None:
            Counting.calls += 1
            super().zero_grad(set_to_none=set_to_none)

    cfg = GRPOConfig(group_size=4, batch_size=4, kl_coeff=0.0, num_epochs_per_update=3, seed=0)
    states = contextual.states(4)
    policies = []
    for cls in (Counting, torch.optim.SGD):  # its own zero_grad / the trainer's direct zeroing
        torch.manual_seed(0)
        policy = contextual.policy()
        make(cfg, policy, contextual.reward, optimizer=cls(policy.parameters(), lr=0.1)).step(states)
        policies.append(policy)
    assert Counting.calls == 3
    # the same update either way: gradients were cleared, not accumulated, between epochs
    for a, b in zip(policies[0].parameters(), policies[1].parameters(), strict=True):
        assert torch.equal(a, b)


def test_bad_user_outputs_raise_before_any_weight_change(contextual: ContextualBandit) -> None:
    class Wrong(WordPolicy):
        def __init__(self, mode: str) -> None:
            super().__init__()
            self.mode = mode

        def generate_actions(self, states: list[Any], g: int, **kw: Any) -> Any:
            groups = super().generate_actions(states, g)
            if self.mode == "groups":
                return groups[:-1]
            if self.mode == "per_group":
                groups[1] = groups[1][:-1]
            return groups

        def get_log_probabilities(self, states: list[Any], actions: list[str]) -> Tensor:
            lp = super().get_log_probabilities(states, actions)
            return lp.detach() if self.mode == "nograd" else lp

    def reward(s: list[str], a: list[str]) -> list[float]:
        return [float(len(w)) for w in a]

    cases = {
        "groups": r"Wrong.generate_actions returned 2 groups for 3 states",
        "per_group": r"must return group_size=4 actions for every state; got state 1: 3",
        "nograd": r"returned log-probs that do not require grad during the update",
    }
    for mode, pattern in cases.items():
        policy = Wrong(mode)
        trainer = make(GRPOConfig(group_size=4, kl_coeff=0.0), policy, reward)
        before = policy.logits.detach().clone()
        with pytest.raises((ValueError, TypeError), match=pattern):
            trainer.step(["a", "b", "c"])
        assert torch.equal(policy.logits, before)

    bad_rewards = {
        "length": (
            lambda s, a: [0.0] * 3,
            r"FunctionReward\(<lambda>\).compute_rewards returned rewards of shape \(3,\); expected \(12,\)",
        ),
        "nan": (
            lambda s, a: [float("nan")] + [0.0] * 11,
            r"non-finite rewards \(NaN or inf\) at flat positions \[0\]",
        ),
        "none": (lambda s, a: [None] * 12, r"non-numeric rewards at positions \[0, 1"),
    }
    for fn, pattern in bad_rewards.values():
        trainer = make(GRPOConfig(group_size=4, kl_coeff=0.0), WordPolicy(), fn)
        with pytest.raises((ValueError, TypeError), match=pattern):
            trainer.step(["a", "b", "c"])
    trainer = make(GRPOConfig(group_size=4, kl_coeff=0.0), WordPolicy(), reward)
    with pytest.raises(ValueError, match="states is empty"):
        trainer.step([])
    tensor_trainer = make(GRPOConfig(group_size=4, kl_coeff=0.0), contextual.policy(), contextual.reward)
    with pytest.raises(ValueError, match=r"expected \(B, \.\.\.\) with B >= 1"):
        tensor_trainer.step(torch.zeros(0, 16))


def test_plain_function_reward_and_combined_components(contextual: ContextualBandit) -> None:
    from grpo.reward_model_base import CombinedReward

    reward = CombinedReward(
        {"value": contextual.reward, "bonus": lambda s, a: (a == 0).float()}, {"bonus": 0.5}
    )
    trainer = make(GRPOConfig(group_size=4, batch_size=4, kl_coeff=0.0), contextual.policy(), reward)
    batch = trainer.collect(contextual.states(4))
    comps = batch.reward_components
    assert set(comps) == {"value", "bonus"}
    assert torch.allclose(batch.rewards, comps["value"] + 0.5 * comps["bonus"])
    m = trainer.step(contextual.states(4))
    assert "reward/value/mean" in m
    assert "reward/bonus/mean" in m


def _recording_categorical(obs_dim: int, arms: int) -> Any:
    """The ready categorical MLP, recording the ``with_entropy`` the trainer asks for."""
    from grpo.policies import DistributionPolicy, categorical_mlp

    class Recording(DistributionPolicy):
        requests: list[Any]

        def evaluate_actions(self, states: Any, actions: Any, **kw: Any) -> PolicyOutput:
            self.requests.append(kw.get("with_entropy"))
            return super().evaluate_actions(states, actions, **kw)

    policy = Recording(categorical_mlp(obs_dim, arms, (16,)).net)
    policy.requests = []
    return policy


@pytest.mark.parametrize("entropy_coeff", [0.0, 0.5])
def test_entropy_is_differentiable_only_when_the_loss_trains_it(entropy_coeff: float) -> None:
    torch.manual_seed(0)
    policy = _recording_categorical(4, 5)
    cfg = GRPOConfig(group_size=4, batch_size=8, kl_coeff=0.0, entropy_coeff=entropy_coeff, seed=0)
    trainer = make(cfg, policy, lambda s, a: torch.ones(len(a)))  # equal rewards: zero advantages
    states = torch.randn(8, 4)
    before = copy.deepcopy(policy.state_dict())
    with torch.no_grad():
        ent_before = float(policy.distribution(states).entropy().mean())
    m = trainer.step(states)
    assert policy.requests
    assert set(policy.requests) == {True if entropy_coeff else "no_grad"}
    # the reported entropy is the exact one of the states' distributions before the update
    assert m["policy/entropy"] == pytest.approx(ent_before, rel=1e-5)
    with torch.no_grad():
        ent_after = float(policy.distribution(states).entropy().mean())
    if entropy_coeff:  # the bonus alone moves the weights, towards more entropy
        assert ent_after > ent_before
    else:  # nothing to learn from zero advantages: the weights stay as they were
        for k, v in policy.state_dict().items():
            assert torch.equal(v, before[k]), k


def test_the_batch_is_frozen_and_update_takes_the_advantages_it_is_given(
    contextual: ContextualBandit,
) -> None:
    """Nothing writes into a batch after it is made (advantages are returned, never stored in it),
    and update() refuses anything but trainer.advantages(batch)."""
    trainer = make(GRPOConfig(group_size=4, batch_size=2, seed=0), contextual.policy(), contextual.reward)
    batch = trainer.collect(contextual.states(2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.rewards = torch.zeros(8)  # type: ignore[misc]
    assert not hasattr(batch, "advantages")
    assert not hasattr(trainer, "compute_advantages")
    with pytest.raises(
        TypeError, match=r"update\(batch, advantages\) needs the Advantages of trainer\.advantages"
    ):
        trainer.update(batch, batch.rewards)  # type: ignore[arg-type]
    stats = trainer.update(batch, trainer.advantages(batch))
    assert "loss/policy" in stats
