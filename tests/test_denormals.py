"""Subnormal floats are flushed to zero during a step (GRPOConfig.flush_denormals), and only then."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import Tensor

from grpo import GRPOConfig, GRPOTrainer
from grpo.policies import categorical_mlp
from grpo.runtime.denormals import flush_denormals_on, flushing_denormals, restore_denormals

if not torch.set_flush_denormal(False):  # True when the CPU supports the setting  # pragma: no cover
    pytest.skip("this CPU cannot flush subnormal floats", allow_module_level=True)

SUBNORMAL = 1e-39  # float32 subnormal (smallest normal float32 ~1.18e-38)


@pytest.fixture(autouse=True)
def _flag_off() -> Iterator[None]:
    torch.set_flush_denormal(False)
    yield
    torch.set_flush_denormal(False)


def _torch_flushes() -> bool:
    """What torch's CPU kernels do with a float32 subnormal right now (an independent probe)."""
    return float(torch.tensor([1e-30], dtype=torch.float32).mul(1e-9)) == 0.0


def test_probe_and_round_trip() -> None:
    assert not flushing_denormals()
    assert not _torch_flushes()
    changed = flush_denormals_on()
    assert changed
    assert flushing_denormals()
    assert _torch_flushes()
    assert flush_denormals_on() is False  # already on: nothing to undo
    restore_denormals(changed)
    assert not flushing_denormals()
    assert not _torch_flushes()


class Recorder:
    """A reward that records whether subnormals were flushed while it ran."""

    def __init__(self) -> None:
        self.seen: list[bool] = []
        self.threads: list[int] = []

    def __call__(self, states: Tensor, actions: Tensor) -> Tensor:
        import threading

        self.seen.append(_torch_flushes())
        self.threads.append(threading.get_ident())
        return actions.float()


def _trainer(flush: bool, reward: Recorder) -> GRPOTrainer:
    cfg = GRPOConfig(group_size=4, batch_size=2, kl_coeff=0.0, seed=0, flush_denormals=flush)
    return GRPOTrainer(cfg, categorical_mlp(3, 4, (8,)), reward)


@pytest.mark.parametrize("flag_before", [False, True])
def test_step_flushes_and_restores_the_setting(flag_before: bool) -> None:
    reward = Recorder()
    trainer = _trainer(True, reward)
    torch.set_flush_denormal(flag_before)
    trainer.step(torch.randn(2, 3))
    assert reward.seen == [True]
    assert _torch_flushes() is flag_before  # put back as it was (on stays on)


def test_setting_is_restored_when_the_step_raises() -> None:
    def broken(states: Tensor, actions: Tensor) -> Tensor:
        assert _torch_flushes()
        raise RuntimeError("reward down")

    trainer = GRPOTrainer(GRPOConfig(group_size=4, batch_size=2, seed=0), categorical_mlp(3, 4, (8,)), broken)
    with pytest.raises(RuntimeError, match="reward down"):
        trainer.step(torch.randn(2, 3))
    assert not _torch_flushes()


def test_flush_denormals_false_leaves_the_setting_alone() -> None:
    reward = Recorder()
    trainer = _trainer(False, reward)
    trainer.step(torch.randn(2, 3))
    assert reward.seen == [False]
    # a float32 subnormal survives the arithmetic of the step's world
    assert float(torch.tensor([SUBNORMAL], dtype=torch.float32).mul(1.0)) != 0.0


def test_config_rejects_a_non_bool() -> None:
    with pytest.raises(ValueError, match=r"flush_denormals.*expected True or False"):
        GRPOConfig(flush_denormals="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("flush", [False, True])
def test_a_reward_under_a_timeout_computes_as_the_stepping_thread(flush: bool) -> None:
    # with reward_timeout the reward runs in a helper thread started during the step; a new
    # thread inherits its creator's floating-point environment (pthread_create), so the reward
    # computes as the stepping thread does
    import threading

    reward = Recorder()
    cfg = GRPOConfig(
        group_size=4, batch_size=2, kl_coeff=0.0, seed=0, flush_denormals=flush, reward_timeout=30.0
    )
    GRPOTrainer(cfg, categorical_mlp(3, 4, (8,)), reward).step(torch.randn(2, 3))
    assert reward.seen == [flush]
    assert reward.threads[0] != threading.get_ident()  # it did run in the helper thread
    assert not _torch_flushes()
