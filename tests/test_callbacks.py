"""EarlyStopping on hand-made metric sequences, and inside a real training run."""

from __future__ import annotations

import math

import pytest

from grpo.training.callbacks import EarlyStopping
from grpo.training.loop import TrainState
from tests.loop_toys import bandit_states, make_trainer


def feed(cb: EarlyStopping, values: list[float], key: str = "m") -> tuple[int | None, str | None]:
    """Run ``values`` through ``cb`` as steps 1, 2, ...; return (step it stopped at, reason)."""
    trainer = make_trainer()
    state = TrainState(trainer=trainer, num_steps=len(values))
    cb.on_train_start(state)
    for i, v in enumerate(values, 1):
        trainer.step_count = i
        cb.on_step_end(state, {key: v})
        if state.should_stop:
            return i, state.stop_reason
    return None, None


def test_patience_counts_checks_without_improvement() -> None:
    # best 0.5 at step 2; steps 3, 4 do not improve -> stop at step 4 with patience 2
    step, reason = feed(EarlyStopping("m", patience=2), [0.1, 0.5, 0.5, 0.4, 0.9])
    assert step == 4
    assert reason == "EarlyStopping: m did not improve by more than 0.0 for 2 checks (best 0.5 at step 2)"


def test_improvement_resets_the_wait() -> None:
    assert feed(EarlyStopping("m", patience=2), [0.1, 0.0, 0.2, 0.1, 0.3, 0.2])[0] is None


def test_min_delta() -> None:
    # +0.05 steps do not count with min_delta 0.1
    assert feed(EarlyStopping("m", patience=2, min_delta=0.1), [0.0, 0.05, 0.1, 0.3])[0] == 3


def test_mode_min() -> None:
    assert feed(EarlyStopping("m", patience=1, mode="min"), [3.0, 2.0, 1.0, 1.5])[0] == 4
    assert feed(EarlyStopping("m", patience=1, mode="min"), [3.0, 2.0, 1.0])[0] is None


def test_threshold() -> None:
    step, reason = feed(EarlyStopping("m", patience=10, threshold=0.8), [0.1, 0.8, 0.9])
    assert step == 2
    assert reason == "EarlyStopping: m=0.8 reached threshold 0.8"
    assert feed(EarlyStopping("m", patience=10, mode="min", threshold=-1.0), [0.0, -0.5, -2.0])[0] == 3


def test_non_finite_never_improves() -> None:
    assert feed(EarlyStopping("m", patience=2), [math.nan, math.nan])[0] == 2
    assert feed(EarlyStopping("m", patience=2), [1.0, math.inf, math.nan])[0] == 3


def test_steps_without_the_key_are_not_checks() -> None:
    cb = EarlyStopping("m", patience=1)
    assert feed(cb, [0.1, 0.2], key="other") == (None, None)
    assert cb.checks == 0


def test_in_a_run_with_a_constant_metric() -> None:
    # optim/lr is constant: check 1 sets the best, checks 2 and 3 do not improve -> stop at 3
    trainer = make_trainer()
    run = trainer.train(
        bandit_states(4), num_steps=20, callbacks=[EarlyStopping("optim/lr", patience=2)], progress=False
    )
    assert trainer.step_count == 3
    assert run.stop_reason is not None
    assert run.stop_reason.startswith("EarlyStopping: optim/lr did not improve")


def test_on_eval_metric_in_a_run() -> None:
    trainer = make_trainer()
    cb = EarlyStopping("eval/reward/mean", patience=100, threshold=-1.0)  # any reward >= -1: stop at 1st eval
    run = trainer.train(
        bandit_states(4),
        num_steps=20,
        eval_states=bandit_states(2),
        eval_every=3,
        callbacks=[cb],
        progress=False,
    )
    assert trainer.step_count == 3
    assert len(run.eval_history) == 1


def test_warns_when_monitor_never_logged() -> None:
    trainer = make_trainer()
    with pytest.warns(UserWarning, match=r"EarlyStopping monitored 'eval/reward/mean', which no step logged"):
        trainer.train(bandit_states(4), num_steps=2, callbacks=[EarlyStopping()], progress=False)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "up"}, r"mode='up'\) is not allowed: choose 'max' or 'min'"),
        ({"patience": 0}, r"patience=0\) is not allowed: expected an integer >= 1"),
        ({"min_delta": -0.1}, r"min_delta=-0.1\) is not allowed: expected a number >= 0"),
    ],
)
def test_validation(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EarlyStopping("m", **kwargs)  # type: ignore[arg-type]


def test_trainer_has_every_member_of_trainer_like() -> None:
    """The loop uses a trainer only through `TrainerLike`: `GRPOTrainer` has each of its members,
    each documented in the Protocol."""
    import inspect

    from grpo.training.callbacks import TrainerLike

    members = [n for n, v in vars(TrainerLike).items() if not n.startswith("_") and inspect.getdoc(v)]
    assert {"stateful_components", "check_checkpointable", "step_threads", "check_lockstep"} <= set(members)
    assert {"save_checkpoint", "load_checkpoint", "step", "config", "step_count"} <= set(members)
    trainer = make_trainer()
    for name in members:
        assert hasattr(trainer, name), name
    assert isinstance(trainer.stateful_components(), dict)
    trainer.check_checkpointable("save")  # a local backend: checkpoints are whole
