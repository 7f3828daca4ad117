"""Non-finite containment and invalid rewards.

A NaN/inf loss or gradient never updates the weights: with several optimizer steps per trainer
step, a NaN in the second epoch undoes the first epoch's steps too (weights and optimizer state
bitwise as before the trainer step). Invalid rewards raise, or drop their groups.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from torch import Tensor

from grpo import GRPOConfig, GRPOTrainer, PolicyOutput
from grpo.policies import CategoricalMLP, DistributionPolicy


class FaultyPolicy(DistributionPolicy):
    """A categorical MLP policy that corrupts its ``fault_at``-th training forward.

    ``fault="loss"``: NaN log-probs (the loss is NaN, the gradient finite); ``"+inf"`` / ``"-inf"``:
    one infinite log-prob (the clamped ratio and KL stay finite; the objective makes the loss
    non-finite all the same); ``"grad"``: finite
    log-probs but a NaN gradient; ``"shape"``: log-probs with one more step than at collection.
    """

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(CategoricalMLP(3, 4, (8,)))
        self.fault: str | None = None
        self.fault_at = -1
        self.train_calls = 0

    def evaluate_actions(
        self, states: Any, actions: Any, *, group_size: int = 1, with_entropy: bool = False
    ) -> PolicyOutput:
        out = super().evaluate_actions(states, actions, group_size=group_size, with_entropy=with_entropy)
        if not self.training:
            return out
        self.train_calls += 1
        if self.train_calls != self.fault_at:
            return out
        if self.fault == "loss":
            return PolicyOutput(out.log_probs + torch.nan, entropy=out.entropy)
        if self.fault in ("+inf", "-inf"):  # one valid step; collection saw finite values
            bad = torch.zeros_like(out.log_probs)
            bad[1] = torch.inf if self.fault == "+inf" else -torch.inf
            return PolicyOutput(out.log_probs + bad, entropy=out.entropy)
        if self.fault == "grad":
            logp = out.log_probs.clone()
            logp.register_hook(lambda g: g * torch.nan)
            return PolicyOutput(logp, entropy=out.entropy)
        assert self.fault == "shape"
        return PolicyOutput(torch.stack([out.log_probs, out.log_probs], 1))


def reward(states: Tensor, actions: Tensor) -> Tensor:
    return actions.float() + states[:, 0]


MULTI = dict(group_size=4, batch_size=4, mini_batch_size=2, num_epochs_per_update=2, kl_coeff=0.04, seed=0)
SINGLE = dict(group_size=4, batch_size=4, kl_coeff=0.04, seed=0)


def _snapshot(trainer: GRPOTrainer) -> tuple[list[Tensor], dict[str, Any]]:
    assert trainer.optimizer is not None
    return [p.detach().clone() for p in trainer.params], copy.deepcopy(trainer.optimizer.state_dict())


def _same(a: tuple[list[Tensor], dict[str, Any]], b: tuple[list[Tensor], dict[str, Any]]) -> bool:
    if not all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True)):
        return False
    sa, sb = a[1]["state"], b[1]["state"]
    if sa.keys() != sb.keys() or a[1]["param_groups"] != b[1]["param_groups"]:
        return False
    return all(torch.equal(sa[k][n], sb[k][n]) for k in sa for n in sa[k])


def _faulty_trainer(
    fault: str, cfg: dict[str, Any], fault_call: int, **extra: Any
) -> tuple[GRPOTrainer, FaultyPolicy]:
    policy = FaultyPolicy()
    trainer = GRPOTrainer(GRPOConfig(**cfg, **extra), policy, reward)
    trainer.step(torch.randn(4, 3))  # the optimizer now has state
    policy.fault, policy.fault_at = fault, policy.train_calls + fault_call
    return trainer, policy


@pytest.mark.parametrize("fault", ["loss", "+inf", "-inf", "grad"])
@pytest.mark.parametrize(
    ("cfg", "fault_call"),
    [(MULTI, 3), (SINGLE, 1)],
    ids=["nan-in-epoch-2-after-2-optimizer-steps", "single-optimizer-step"],
)
def test_non_finite_update_is_skipped_bitwise(fault: str, cfg: dict[str, Any], fault_call: int) -> None:
    trainer, _policy = _faulty_trainer(fault, cfg, fault_call)
    before = _snapshot(trainer)
    with pytest.warns(RuntimeWarning, match=r"step 1: the loss is .* the update of this step was undone"):
        metrics = trainer.step(torch.randn(4, 3))
    assert _same(before, _snapshot(trainer)), "weights and optimizer state bitwise unchanged"
    assert metrics["optim/non_finite_steps"] == 1.0
    assert trainer.non_finite_steps == 1
    assert trainer.step_count == 2
    # training goes on afterwards
    metrics = trainer.step(torch.randn(4, 3))
    assert not _same(before, _snapshot(trainer))
    assert metrics["optim/non_finite_steps"] == 1.0


def test_a_nan_in_epoch_2_undoes_real_changes() -> None:
    """Without the rollback, epoch 1 would already have moved the weights: show they did move."""
    trainer, _policy = _faulty_trainer("loss", MULTI, 99)  # no fault this step
    before = _snapshot(trainer)
    trainer.step(torch.randn(4, 3))
    assert not _same(before, _snapshot(trainer))


def test_non_finite_raise_policy() -> None:
    trainer, _ = _faulty_trainer("loss", MULTI, 3, non_finite="raise")
    before = _snapshot(trainer)
    with pytest.raises(FloatingPointError, match=r"update of this step was undone.*non_finite='skip'"):
        trainer.step(torch.randn(4, 3))
    assert _same(before, _snapshot(trainer))
    assert trainer.non_finite_steps == 1


def test_any_error_during_the_update_rolls_back_earlier_optimizer_steps() -> None:
    trainer, _ = _faulty_trainer("shape", MULTI, 3)
    before = _snapshot(trainer)
    with pytest.raises(ValueError, match=r"the number of steps T of an action must not change"):
        trainer.step(torch.randn(4, 3))
    assert _same(before, _snapshot(trainer))


# ---- invalid rewards -------------------------------------------------------------------------
def test_drop_groups_with_nan_and_inf_rewards() -> None:
    values = torch.arange(16, dtype=torch.float32)
    values[5] = math.nan  # group 1
    values[14] = math.inf  # group 3
    policy = FaultyPolicy()
    cfg = GRPOConfig(group_size=4, batch_size=4, kl_coeff=0.0, invalid_rewards="drop_groups", seed=0)
    trainer = GRPOTrainer(cfg, policy, lambda s, a: values)
    w = [p.detach().clone() for p in trainer.params]
    metrics = trainer.step(torch.randn(4, 3))
    assert metrics["reward/dropped_groups"] == 2.0
    kept = torch.cat([values[0:4], values[8:12]])  # groups 0 and 2
    assert metrics["reward/mean"] == pytest.approx(float(kept.mean()))
    assert metrics["reward/max"] == 11.0
    assert math.isfinite(metrics["loss/total"])
    assert not all(torch.equal(a, b) for a, b in zip(w, trainer.params, strict=True)), "the kept groups train"


def test_drop_groups_with_none_rewards_in_list_form() -> None:
    class Lists:
        def __init__(self) -> None:
            self.w = torch.zeros(2, requires_grad=True)

        def generate_actions(self, states: Any, g: int, **kw: Any) -> list[list[int]]:
            return [[i % 2 for i in range(g)] for _ in states]

        def get_log_probabilities(self, states: Any, actions: Any) -> Tensor:
            return torch.log_softmax(self.w, -1)[torch.tensor(actions)]

        def get_parameters(self) -> list[Tensor]:
            return [self.w]

        def train(self) -> None: ...
        def eval(self) -> None: ...
        def to(self, device: Any) -> Any:
            return self

    def r(states: list[str], actions: list[int]) -> list[float | None]:
        return [None if s == "bad" else float(a) for s, a in zip(states, actions, strict=True)]

    cfg = GRPOConfig(group_size=2, batch_size=3, kl_coeff=0.0, invalid_rewards="drop_groups")
    trainer = GRPOTrainer(cfg, Lists(), r)
    batch = trainer.collect(["a", "bad", "c"])
    assert batch.dropped_groups == 1
    assert batch.states == ["a", "c"]
    assert batch.flat_states == ["a", "a", "c", "c"]
    assert batch.rewards.tolist() == [0.0, 1.0, 0.0, 1.0]
    assert batch.group_ids.tolist() == [0, 0, 1, 1]
    with pytest.raises(ValueError, match=r"invalid reward \(None, NaN or inf\) in every one of the 2 groups"):
        trainer.step(["bad", "bad"])


def test_drop_groups_keeps_behaviour_log_probs_aligned() -> None:
    """With several optimizer steps the ready policy returns log-probs while sampling; dropping
    groups must drop the same rows of those log-probs."""
    values = torch.arange(16, dtype=torch.float32)
    values[1] = math.nan  # group 0
    policy = FaultyPolicy()
    cfg = GRPOConfig(**MULTI, invalid_rewards="drop_groups")
    trainer = GRPOTrainer(cfg, policy, lambda s, a: values)
    batch = trainer.collect(torch.randn(4, 3))
    assert batch.dropped_groups == 1
    assert batch.old_log_probs is not None
    assert batch.old_log_probs.shape == (12, 1)
    with torch.no_grad():
        expected = policy.evaluate_actions(batch.states, batch.actions, group_size=4).log_probs
    torch.testing.assert_close(batch.old_log_probs.squeeze(1), expected)
    assert trainer.step(torch.randn(4, 3))["reward/dropped_groups"] == 1.0
