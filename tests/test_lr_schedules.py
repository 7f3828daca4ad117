"""LR schedules: learning rates of every optimizer step against closed-form formulas."""

from __future__ import annotations

import math

import pytest
import torch

from grpo import GRPOConfig
from grpo.engine.lr_schedules import LRSchedule, build_scheduler
from tests.loop_toys import bandit_states, make_trainer


def expected_lr(base: float, s: int, name: str, w: int, total: int | None, r: float) -> float:
    """Written independently of grpo.engine.lr_schedules, straight from the documented formulas."""
    if s < w:
        return base * (s + 1) / (w + 1)
    if name == "constant":
        return base
    assert total is not None
    p = min(1.0, (s - w) / (total - w))
    if name == "linear":
        return base * (r + (1 - r) * (1 - p))
    return base * (r + (1 - r) * 0.5 * (1 + math.cos(math.pi * p)))


@pytest.mark.parametrize(
    ("name", "warmup", "total", "ratio"),
    [("constant", 3, None, 0.0), ("linear", 2, 8, 0.0), ("cosine", 3, 10, 0.1), ("cosine", 0, 5, 0.0)],
)
def test_scheduler_follows_closed_form_every_optimizer_step(
    name: str, warmup: int, total: int | None, ratio: float
) -> None:
    w = torch.zeros(2, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.5)
    sched = build_scheduler(opt, name, warmup, total, ratio)  # type: ignore[arg-type]
    assert sched is not None
    for s in range(14):  # past total_steps: stays at the final value
        assert opt.param_groups[0]["lr"] == pytest.approx(
            expected_lr(0.5, s, name, warmup, total, ratio), abs=1e-12
        )
        opt.step()
        sched.step()


def test_hand_computed_values() -> None:
    # cosine, W=1, S=5, r=0: s=0 -> 1/2; s=1 -> 1; s=3 -> (1+cos(pi/2))/2 = 1/2; s=5 -> 0
    m = LRSchedule("cosine", warmup_steps=1, total_steps=5)
    assert [m(s) for s in (0, 1, 3, 5, 9)] == pytest.approx([0.5, 1.0, 0.5, 0.0, 0.0], abs=1e-12)
    lin = LRSchedule("linear", warmup_steps=0, total_steps=4, lr_min_ratio=0.2)
    assert [lin(s) for s in range(6)] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2, 0.2])


def test_constant_without_warmup_builds_no_scheduler() -> None:
    trainer = make_trainer()
    assert trainer.scheduler is None


def test_trainer_steps_scheduler_once_per_optimizer_step() -> None:
    # 2 optimizer steps per trainer step (mini_batch_size = batch_size / 2).
    base, w, total = 0.02, 3, 10
    trainer = make_trainer(
        batch_size=4,
        mini_batch_size=2,
        learning_rate=base,
        lr_schedule="cosine",
        warmup_steps=w,
        total_steps=total,
        lr_min_ratio=0.1,
    )
    assert trainer.config.optimizer_steps_per_step == 2
    states = bandit_states(4)
    for k in range(6):
        lr_before = trainer.optimizer.param_groups[0]["lr"]  # type: ignore[union-attr]
        assert lr_before == pytest.approx(expected_lr(base, 2 * k, "cosine", w, total, 0.1), abs=1e-15)
        trainer.step(states)
    assert trainer.scheduler is not None
    assert trainer.scheduler.last_epoch == 12


def test_train_logs_lr_of_each_step() -> None:
    trainer = make_trainer(learning_rate=0.01, lr_schedule="linear", warmup_steps=2, total_steps=6)
    run = trainer.train(bandit_states(8), num_steps=8, progress=False)
    got = [r["optim/lr"] for r in run.history]
    want = [expected_lr(0.01, s, "linear", 2, 6, 0.0) for s in range(8)]
    assert got == pytest.approx(want, abs=1e-15)


def test_user_optimizer_lr_is_the_base() -> None:
    cfg = GRPOConfig(group_size=4, batch_size=4, lr_schedule="linear", total_steps=4)
    torch.manual_seed(0)
    from grpo import GRPOTrainer
    from grpo.policies import categorical_mlp
    from tests.loop_toys import correct_arm

    policy = categorical_mlp(4, 3, hidden=(8,))
    opt = torch.optim.SGD(policy.parameters(), lr=0.4)
    trainer = GRPOTrainer(cfg, policy, correct_arm, optimizer=opt)
    trainer.step(bandit_states(4))
    assert opt.param_groups[0]["lr"] == pytest.approx(0.4 * 0.75)


def test_scheduler_state_dict_round_trip() -> None:
    """What a checkpoint stores: the schedule's fields and position; a fresh scheduler resumes."""
    w1 = torch.zeros(1, requires_grad=True)
    opt1 = torch.optim.SGD([w1], lr=1.0)
    s1 = build_scheduler(opt1, "cosine", 2, 9, 0.05)
    assert s1 is not None
    for _ in range(4):
        opt1.step()
        s1.step()
    state = s1.state_dict()
    assert state["lr_lambdas"][0] == {
        "name": "cosine",
        "warmup_steps": 2,
        "total_steps": 9,
        "lr_min_ratio": 0.05,
        "scale": 1.0,  # grpo.update.adaptive_lr's factor
    }
    w2 = torch.zeros(1, requires_grad=True)
    opt2 = torch.optim.SGD([w2], lr=1.0)
    opt2.load_state_dict(opt1.state_dict())
    s2 = build_scheduler(opt2, "cosine", 2, 9, 0.05)
    assert s2 is not None
    s2.load_state_dict(state)
    for _ in range(3):
        opt1.step()
        s1.step()
        opt2.step()
        s2.step()
        assert opt2.param_groups[0]["lr"] == opt1.param_groups[0]["lr"]
    assert opt2.param_groups[0]["lr"] == pytest.approx(expected_lr(1.0, 7, "cosine", 2, 9, 0.05))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr_schedule": "cosine"}, r"total_steps=None is not allowed: lr_schedule='cosine'.*num_steps \* 1"),
        ({"lr_schedule": "linear", "warmup_steps": 5, "total_steps": 5}, r"must be > warmup_steps=5"),
        ({"lr_schedule": "step"}, r"lr_schedule='step' is not allowed: choose one of"),
        ({"warmup_steps": -1}, r"warmup_steps=-1 is not allowed"),
        ({"lr_min_ratio": 1.5}, r"lr_min_ratio=1.5 is not allowed: expected a number in \[0, 1\]"),
    ],
)
def test_config_validation(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GRPOConfig(**kwargs)  # type: ignore[arg-type]


def test_schedule_class_validation() -> None:
    with pytest.raises(ValueError, match="needs total_steps > warmup_steps=0"):
        LRSchedule("cosine")
    with pytest.raises(ValueError, match="unknown"):
        LRSchedule("exp")  # type: ignore[arg-type]
