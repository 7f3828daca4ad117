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


# ---- non-finite hyper-parameters and weights -----------------------------------------------
class WritesInf(torch.optim.SGD):
    """SGD that writes inf into one weight from its ``break_at``-th call on (a buggy optimizer: its
    loss and gradient stay finite, only the weights go non-finite)."""

    break_at = -1
    calls = 0
    target = 0  # which weight tensor

    def step(self, closure: Any = None) -> Any:
        out = super().step(closure)
        self.calls += 1
        if self.calls >= self.break_at > 0:
            with torch.no_grad():
                self.param_groups[0]["params"][self.target].view(-1)[0] = torch.inf
        return out


def _user_optimizer_trainer(
    cfg: dict[str, Any], optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW, **extra: Any
) -> tuple[GRPOTrainer, torch.optim.Optimizer]:
    policy = FaultyPolicy()
    opt = optimizer(policy.parameters(), lr=1e-2)
    trainer = GRPOTrainer(GRPOConfig(**cfg, **extra), policy, reward, optimizer=opt)
    trainer.step(torch.randn(4, 3))  # the optimizer now has state
    return trainer, opt


@pytest.mark.parametrize("key", ["lr", "weight_decay"])
@pytest.mark.parametrize("value", [math.inf, math.nan])
@pytest.mark.parametrize("cfg", [MULTI, SINGLE], ids=["multi-step", "single-step"])
def test_a_user_optimizer_with_a_non_finite_lr_is_refused_bitwise(
    key: str, value: float, cfg: dict[str, Any]
) -> None:
    """GRPOConfig refuses learning_rate=inf; a user's optimizer (or a hand-edited param group) is
    refused before its step, with no copy needed."""
    trainer, opt = _user_optimizer_trainer(cfg)
    opt.param_groups[0][key] = value
    before = _snapshot(trainer)
    with pytest.warns(
        RuntimeWarning,
        match=rf"^step 1: the optimizer's {key}={value} is not finite, so its step was not taken; the "
        r"update of this step was undone, so the weights and the optimizer state are exactly as before "
        r"it \(1 step\(s\) skipped so far\)\. Give the optimizer a finite learning rate and weight "
        r"decay, e\.g\. torch\.optim\.AdamW\(params, lr=3e-4\)",
    ):
        metrics = trainer.step(torch.randn(4, 3))
    assert _same(before, _snapshot(trainer)), "weights and optimizer state bitwise unchanged"
    assert metrics["optim/non_finite_steps"] == 1.0
    assert trainer.non_finite_steps == 1
    opt.param_groups[0][key] = 1e-2 if key == "lr" else 0.0
    trainer.step(torch.randn(4, 3))  # training goes on
    assert not _same(before, _snapshot(trainer))


def test_a_non_finite_lr_with_non_finite_raise() -> None:
    trainer, opt = _user_optimizer_trainer(SINGLE, non_finite="raise")
    opt.param_groups[0]["lr"] = math.inf
    before = _snapshot(trainer)
    with pytest.raises(FloatingPointError, match=r"the optimizer's lr=inf is not finite.*non_finite='skip'"):
        trainer.step(torch.randn(4, 3))
    assert _same(before, _snapshot(trainer))
    assert trainer.non_finite_steps == 1


@pytest.mark.parametrize(
    ("break_at", "target", "pattern"),
    [
        (  # the update's last optimizer step breaks a weight: the weight check undoes the update
            4,
            0,
            r"^step 1: the optimizer step made weights NaN/inf \(1 of 4 weight tensors: "
            r"net\.net\.0\.weight\) although the loss and the gradient norm \(.*\) were finite; the "
            r"update of this step was undone, so the weights and the optimizer state are exactly as "
            r"before it \(1 step\(s\) skipped so far\)\. Lower the learning rate \(now 0\.01: "
            r"GRPOConfig\(learning_rate=\.\.\.\) or your optimizer's lr\)",
        ),
        (  # the first one: the next step's loss is NaN, and the message names the weight
            1,
            2,
            r"^step 1: the loss is nan and the gradient norm nan \(the weights hold NaN/inf: 1 of 4 "
            r"weight tensors: net\.net\.2\.weight\); the update of this step was undone",
        ),
        (  # the first one, a weight whose inf tanh absorbs: the end-of-update check finds it
            1,
            0,
            r"^step 1: the optimizer step made weights NaN/inf \(1 of 4 weight tensors: "
            r"net\.net\.0\.weight\) although the loss and the gradient norm \(.*\) were finite; the "
            r"update of this step was undone",
        ),
    ],
    ids=["last-optimizer-step", "first-optimizer-step", "first-optimizer-step-absorbed"],
)
def test_weights_made_non_finite_by_an_optimizer_step_are_undone(
    break_at: int, target: int, pattern: str
) -> None:
    trainer, opt = _user_optimizer_trainer(MULTI, WritesInf)
    assert isinstance(opt, WritesInf)
    opt.calls, opt.break_at, opt.target = 0, break_at, target
    before = _snapshot(trainer)
    with pytest.warns(RuntimeWarning, match=pattern):
        metrics = trainer.step(torch.randn(4, 3))
    assert _same(before, _snapshot(trainer)), "weights and optimizer state bitwise unchanged"
    assert all(bool(torch.isfinite(p).all()) for p in trainer.params)
    assert metrics["optim/non_finite_steps"] == 1.0
    assert trainer.non_finite_steps == 1


def test_weights_made_non_finite_by_a_single_optimizer_step_raise_whatever_the_policy() -> None:
    """One optimizer step per trainer step keeps no copy (it would cost the weights' and the
    optimizer state's memory every step), so the weights cannot be put back: it always raises."""
    trainer, opt = _user_optimizer_trainer(SINGLE, WritesInf)
    assert isinstance(opt, WritesInf)
    opt.calls, opt.break_at = 0, 1
    with pytest.raises(
        FloatingPointError,
        match=r"^step 1: the optimizer step made weights NaN/inf \(1 of 4 weight tensors: "
        r"net\.net\.0\.weight\) although the loss and the gradient norm \(.*\) were finite\. With one "
        r"optimizer step per trainer step no copy of the weights is kept \(grpo/update/rollback\.py\), so "
        r"this "
        r"cannot be undone and training cannot go on; resume from the last checkpoint \(1 non-finite "
        r"step\(s\) so far\)\. Lower the learning rate",
    ):
        trainer.step(torch.randn(4, 3))
    assert trainer.non_finite_steps == 1


def test_the_weight_check_has_no_false_positives() -> None:
    """Huge finite weights overflow the fused float32 norm; the exact check then clears them."""
    from grpo.update.guard import weights_finite

    w = torch.nn.Parameter(torch.tensor([1e30, -3e38, 1.0]))
    b = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    optimizer = torch.optim.SGD([w, b], lr=0.1)
    assert weights_finite(optimizer)
    for bad in (math.inf, -math.inf, math.nan):
        with torch.no_grad():
            b[1] = bad
        assert not weights_finite(optimizer), bad
    with torch.no_grad():
        b[1] = 1.0
        w[2] = -math.inf  # -inf among larger finite values
    assert not weights_finite(optimizer)


def test_a_non_finite_lr_is_caught_by_the_weight_check_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the hyper-parameter check (e.g. an lr tensor on a GPU, which is not read), the step
    with lr=inf runs, makes every weight NaN/inf, and the guard undoes the update bitwise."""
    import grpo.update.guard

    monkeypatch.setattr(grpo.update.guard, "_bad_hyperparameter", lambda optimizer: None)
    trainer, opt = _user_optimizer_trainer(MULTI)
    opt.param_groups[0]["lr"] = math.inf
    before = _snapshot(trainer)
    with pytest.warns(RuntimeWarning, match=r"^step 1: .*weights.* NaN/inf.*net\.net\.0\.weight.*undone"):
        metrics = trainer.step(torch.randn(4, 3))
    assert _same(before, _snapshot(trainer)), "weights and optimizer state bitwise unchanged"
    assert metrics["optim/non_finite_steps"] == 1.0


def test_a_cpu_tensor_lr_is_read() -> None:
    policy = FaultyPolicy()
    opt = torch.optim.AdamW(policy.parameters(), lr=torch.tensor(1e-2), foreach=False)
    trainer = GRPOTrainer(GRPOConfig(**SINGLE), policy, reward, optimizer=opt)
    trainer.step(torch.randn(4, 3))
    opt.param_groups[0]["lr"].fill_(math.inf)
    before = _snapshot(trainer)
    with pytest.warns(RuntimeWarning, match=r"^step 1: the optimizer's lr=inf is not finite"):
        trainer.step(torch.randn(4, 3))
    assert _same(before, _snapshot(trainer))
