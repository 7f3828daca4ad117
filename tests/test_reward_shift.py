"""Restart on a reward shift (GRPOConfig.reward_shift_z, grpo.training.reward_shift): the statistics and
the decision against the module docstring's formulas written again here; the incumbent's
advantages against a plain loop; what a restart and its probation do; no restart while the policy
moves or when rewards rise; checkpoints; bad states; config errors; trainers on a bandit whose
best arm switches (the restart stands) and on one whose rewards all fall (the policy comes back)."""

from __future__ import annotations

import copy
import dataclasses
import math
import random
import types
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from grpo import GRPOConfig, GRPOTrainer
from grpo.engine.setup import setup_trainer
from grpo.policies import DistributionPolicy, categorical_mlp
from grpo.training.reward_shift import (
    PROBATION_STEPS,
    RewardShiftRestart,
    incumbent_advantages,
    mean_z,
    shift_score,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def without_start(state: dict[str, object]) -> dict[str, object]:
    return {
        k: v
        for k, v in state.items()
        if k not in ("start", "incumbent", "incumbent_optimizer", "incumbent_scheduler")
    }


STANDS = (0.0, 1.0 / PROBATION_STEPS, 1.0)  # one step's group that does not favour the incumbent
GIVE_BACK = (0.5, 0.3, 1.0)  # one step's group with a_g = 0.5 (16 of them: mean 0.5, std ~0.22)


def step(r: float, s: float = 0.4, kl: float = 1e-4) -> dict[str, float]:
    return {"reward/mean": r, "reward/std": s, "kl/old": kl}


def test_shift_score_by_hand() -> None:
    # noise = 0.4 * sqrt(0.3 / 1.7) / sqrt(16) = 0.0420084; drop 0.3 -> 7.1414
    assert shift_score(0.5, 0.8, 0.4, 16) == pytest.approx(0.3 / (0.4 * math.sqrt(0.3 / 1.7) / 4), rel=1e-12)
    assert shift_score(0.5, 0.8, 0.4, 16) == pytest.approx(7.1414, abs=1e-3)
    assert shift_score(0.9, 0.8, 0.4, 16) == 0.0  # a rise is no shift
    assert shift_score(0.5, 0.8, 0.0, 16) == math.inf


def test_the_statistics_and_the_decision_follow_the_documented_rule() -> None:
    """300 random steps (rewards, spreads and KLs drawn so that restarts happen): fast / slow /
    spread, the KL window and every decision equal the docstring's recursions computed here."""
    rng = random.Random(0)
    w = nn.Parameter(torch.zeros(3))
    watch = RewardShiftRestart([w], z=3.0, settled_kl=1e-3)
    fast = slow = spread = lo = hi = math.nan
    kls: list[float] = []
    n_seen, cooldown, fired_at, probation = 0, 0, [], 0
    for t in range(300):
        r = rng.choice([0.8, 0.3]) if t % 60 > 40 else 0.8 + rng.gauss(0, 0.02)
        s, kl = abs(rng.gauss(0.3, 0.05)), rng.choice([1e-4] * 9 + [5e-3])
        if n_seen == 0:
            fast = slow = lo = hi = r
            spread = s
        fast += 0.3 * (r - fast)
        slow += 0.05 * (r - slow)
        spread += 0.05 * (s - spread)
        lo, hi = min(lo, r), max(hi, r)
        kls = [*kls, kl][-10:]
        n_seen += 1
        cooldown = max(cooldown - 1, 0)
        noise = spread * math.sqrt(0.3 / 1.7) / math.sqrt(8)
        settled = len(kls) == 10 and sum(kls) / 10 < 1e-3
        drop = settled and cooldown == 0 and (slow - fast) / noise > 3.0 and slow - fast > 0.1 * (hi - lo)
        expect = drop and not probation  # a probation step judges the incumbent instead
        probation = max(probation - 1, 0)
        with torch.no_grad():
            w.add_(1.0)  # the policy moves between steps
        got = watch.observe(step(r, s, kl), num_samples=8, incumbent=STANDS)["restart/reward_shift"]
        assert got == float(expect), t
        if expect:
            fired_at.append(t)
            assert torch.equal(w, torch.zeros(3))  # back to the starting weights
            fast = slow = spread = lo = hi = math.nan
            kls, n_seen, cooldown, probation = [], 0, 20, PROBATION_STEPS
        else:
            got_stats = (watch.fast, watch.slow, watch.spread, watch.lo, watch.hi)
            assert got_stats == pytest.approx((fast, slow, spread, lo, hi), rel=1e-12)
            assert watch.kl == pytest.approx(kls)
    assert len(fired_at) >= 2  # the test exercised restarts
    assert watch.restarts == len(fired_at)


def test_a_drop_of_a_settled_policy_restarts_it_once() -> None:
    w = nn.Parameter(torch.tensor([1.0, -2.0]))
    watch = RewardShiftRestart([w])
    with torch.no_grad():
        w.copy_(torch.tensor([5.0, 7.0]))  # learned since the start
    for _ in range(30):
        assert watch.observe(step(0.8), 8)["restart/reward_shift"] == 0.0
    flags = [watch.observe(step(0.2), 8, STANDS)["restart/reward_shift"] for _ in range(30)]
    assert flags.count(1.0) == 1  # the statistics start again and wait 10 steps, the cooldown 20
    assert flags.index(1.0) <= 2  # within a few steps of the drop
    assert torch.equal(w, torch.tensor([1.0, -2.0]))
    assert watch.restarts == 1
    assert watch.given_back == 0
    assert watch.incumbent is None  # the probation ended: its groups did not favour [5, 7]


def test_a_probation_whose_groups_favour_the_incumbent_gives_it_back() -> None:
    """A drop restarts from the start and keeps the incumbent; the probation waits
    PROBATION_STEPS steps (and CONFIRM_GROUPS groups), then gives the incumbent back when
    z_inc > 2."""
    w = nn.Parameter(torch.tensor([1.0, -2.0]))
    watch = RewardShiftRestart([w])
    with torch.no_grad():
        w.copy_(torch.tensor([5.0, 7.0]))
    for _ in range(30):
        watch.observe(step(0.8), 8)
    flags = []
    for _ in range(5):
        flags.append(watch.observe(step(0.2), 8))
        if watch.incumbent is not None:
            break
    assert flags[-1]["restart/reward_shift"] == 1.0
    assert torch.equal(w, torch.tensor([1.0, -2.0]))
    assert watch.incumbent is not None
    assert torch.equal(watch.incumbent[0], torch.tensor([5.0, 7.0]))
    with torch.no_grad():
        w.add_(0.5)  # the restarted policy learns during its probation
    for _ in range(PROBATION_STEPS - 1):
        m = watch.observe(step(0.2, kl=5e-3), 8, GIVE_BACK)
        assert (m["restart/reward_shift"], m["restart/given_back"]) == (0.0, 0.0)
    assert watch.incumbent is not None
    assert watch.probe == pytest.approx([0.5 * 15, 0.3 * 15, 15.0])
    last = watch.observe(step(0.2, kl=5e-3), 8, GIVE_BACK)
    assert last["restart/given_back"] == 1.0
    assert torch.equal(w, torch.tensor([5.0, 7.0]))  # the incumbent, bitwise
    assert (watch.restarts, watch.given_back, watch.incumbent) == (1, 1, None)


def test_mean_z_by_hand() -> None:
    # values 1, 2, 3: mean 2, sample std 1, se 1/sqrt(3) -> z = 2 sqrt(3)
    assert mean_z([6.0, 14.0, 3.0]) == pytest.approx(2 * math.sqrt(3), rel=1e-12)
    assert mean_z([-6.0, 14.0, 3.0]) == pytest.approx(-2 * math.sqrt(3), rel=1e-12)
    assert mean_z([2.0, 2.0, 2.0]) == math.inf  # 1, 1: no spread
    assert mean_z([0.0, 0.0, 4.0]) == 0.0


def incumbent_advantages_loop(
    inc: Tensor, old: Tensor, mask: Tensor | None, adv: Tensor, gid: Tensor, b: int, keep: Tensor | None
) -> list[float]:
    """The module docstring's a_g, one group, sample and step at a time, in Python floats."""
    values = []
    for g in range(b):
        terms = []  # (log rho, A) of the group's valid steps
        for i in range(inc.shape[0]):
            if int(gid[i]) != g or (keep is not None and not bool(keep[i])):
                continue
            for t in range(inc.shape[1]):
                if mask is None or bool(mask[i, t]):
                    a = float(adv[i, t]) if adv.dim() == 2 else float(adv[i])
                    terms.append((float(inc[i, t]) - float(old[i, t]), a))
        finite = [lr for lr, _ in terms if math.isfinite(lr)]
        if not finite:
            continue
        top = max(finite)
        weights = [(math.exp(lr - top) if math.isfinite(lr) else 0.0, a) for lr, a in terms]
        values.append(sum(w * a for w, a in weights) / sum(w for w, _ in weights))
    return [sum(values), sum(v * v for v in values), float(len(values))]


@pytest.mark.parametrize("case", ["flat", "per-step", "masked", "kept", "minus-inf"])
def test_incumbent_advantages_equal_a_plain_loop(case: str) -> None:
    gen = torch.Generator().manual_seed(3)
    b, g, t = 5, 4, 1 if case == "flat" else 6
    n = b * g
    gid = torch.arange(b).repeat_interleave(g)
    inc = -3 * torch.rand(n, t, generator=gen, dtype=torch.float64)
    old = -3 * torch.rand(n, t, generator=gen, dtype=torch.float64)
    adv = (
        torch.randn(n, t, generator=gen, dtype=torch.float64)
        if case == "per-step"
        else torch.randn(n, generator=gen)
    )
    mask = torch.rand(n, t, generator=gen) < 0.7 if case in ("masked", "per-step") else None
    if mask is not None:
        mask[:, 0] = True
    keep = (gid != 2) if case == "kept" else None
    if case == "minus-inf":
        inc[0:4, :] = -math.inf  # group 0: the incumbent never takes these actions
        inc[5, 0] = -math.inf
    got = incumbent_advantages(inc, old, mask, adv, gid, b, keep).tolist()
    assert got == pytest.approx(
        incumbent_advantages_loop(inc, old, mask, adv, gid, b, keep), rel=1e-12, abs=1e-12
    )
    if case == "kept":
        assert got[2] == b - 1
    if case == "minus-inf":
        assert got[2] == b - 1  # group 0 says nothing


def test_incumbent_advantages_are_the_incumbents_expected_advantage() -> None:
    """Sampled uniformly over 3 arms, a deterministic incumbent's a_g is the advantage of its arm
    (the samples of the other arms weigh exp(-large) = 0); a uniform incumbent's is the group
    mean of A, 0."""
    actions = torch.tensor([0, 1, 2, 1])
    adv = torch.tensor([1.5, -0.5, -0.5, -0.5])
    old = torch.full((4, 1), math.log(1 / 3), dtype=torch.float64)
    greedy = torch.log(torch.tensor([1.0, 1e-30, 1e-30], dtype=torch.float64))[actions][:, None]
    uniform = old.clone()
    gid = torch.zeros(4, dtype=torch.long)
    assert incumbent_advantages(greedy, old, None, adv, gid, 1)[0].item() == pytest.approx(1.5)
    assert incumbent_advantages(uniform, old, None, adv, gid, 1)[0].item() == pytest.approx(0.0, abs=1e-12)


def test_a_solved_task_does_not_restart_on_a_few_short_episodes() -> None:
    """CartPole-like returns: they rise to 500 while the policy learns, then every episode
    reaches 500 (spread near 0) under a settled policy. A few short episodes are far more than 4
    sigma of that spread, but far less than a tenth of the range covered: no restart. A collapse
    to half the return is a restart."""
    w = nn.Parameter(torch.ones(2))
    watch = RewardShiftRestart([w])
    for t in range(100):
        watch.observe(step(min(20 + 4.8 * t, 500.0), s=30.0, kl=5e-3), 16)
    for _ in range(100):
        watch.observe(step(500.0, s=0.0), 16)
    short = [watch.observe(step(r, s=10.0), 16)["restart/reward_shift"] for r in (497.5, 470.0, 490.0, 500.0)]
    assert short == [0.0] * 4
    assert watch.slow - watch.fast > 4 * watch.spread * math.sqrt(0.3 / 1.7) / 4  # the z-test alone would
    collapse = [watch.observe(step(250.0, s=100.0), 16)["restart/reward_shift"] for _ in range(3)]
    assert 1.0 in collapse


@pytest.mark.parametrize(
    ("rewards", "kl"),
    [
        ([0.8] * 30 + [0.2] * 30, 5e-3),  # the policy is moving (learning): a drop is its own doing
        ([0.2] * 30 + [0.8] * 30, 1e-4),  # a rise
        ([0.8] * 60, 1e-4),  # nothing changes
    ],
)
def test_no_restart_while_the_policy_moves_or_rewards_rise(rewards: list[float], kl: float) -> None:
    w = nn.Parameter(torch.ones(2))
    watch = RewardShiftRestart([w])
    with torch.no_grad():
        w.mul_(3.0)
    flags = [watch.observe(step(r, kl=kl), 8)["restart/reward_shift"] for r in rewards]
    assert flags == [0.0] * len(rewards)
    assert torch.equal(w, torch.full((2,), 3.0))


def test_steps_without_the_metrics_leave_the_statistics_alone() -> None:
    watch = RewardShiftRestart([nn.Parameter(torch.ones(1))])
    watch.observe(step(0.5), 8)
    before = watch.state_dict()
    out = watch.observe({"reward/mean": 0.1, "reward/std": 0.2}, 8)  # no kl/old: nothing optimised
    assert out["restart/reward_shift"] == 0.0
    watch.observe({"reward/mean": float("nan"), "reward/std": 0.2, "kl/old": 0.0}, 8)
    after = watch.state_dict()
    assert without_start(after) == without_start(before)


# ---- checkpoints ---------------------------------------------------------------------------------
def test_state_dict_round_trip_and_bad_states_change_nothing() -> None:
    w = nn.Parameter(torch.tensor([0.5, 1.5]))
    a = RewardShiftRestart([w])
    for r in (0.8, 0.7, 0.9):
        a.observe(step(r), 8)
    state = a.state_dict()
    b = RewardShiftRestart([nn.Parameter(torch.zeros(2))])
    b.load_state_dict(state)
    assert b.state_dict()["start"][0].tolist() == [0.5, 1.5]
    assert {k: v for k, v in b.state_dict().items() if k != "start"} == {
        k: v for k, v in state.items() if k != "start"
    }
    good = b.state_dict()
    bad_states = [
        ({**state, "steps": -1}, r"'steps' must be an int >= 0"),
        ({**state, "fast": math.inf}, r"'fast' must be a finite number or NaN"),
        ({**state, "kl": [0.0] * 11}, r"'kl' must be a list of at most 10 numbers"),
        ({**state, "kl": [math.nan]}, r"'kl' must hold finite numbers"),
        ({**state, "start": [torch.zeros(3)]}, r"start\[0\] must be a torch.float32 tensor of shape \(2,\)"),
        ({**state, "start": [torch.tensor([0.0, math.nan])]}, r"start\[0\] holds NaN or inf"),
        ({**state, "start": []}, r"'start' must hold 1 tensors"),
        ({k: v for k, v in state.items() if k != "slow"}, r"expected the keys"),
        ({**state, "probe": [0.0, -1.0, 2.0]}, r"'probe' must be \[sum, sum of squares >= 0, count >= 0\]"),
        ({**state, "probe": [math.nan, 0.0, 0.0]}, r"'probe' must be"),
        (
            {**state, "incumbent": [torch.zeros(2), torch.zeros(2)]},
            r"'incumbent' must hold 1 tensors .* or none",
        ),
        (
            {**state, "incumbent": [torch.zeros(2, dtype=torch.float64)]},
            r"incumbent\[0\] must be a torch.float32",
        ),
        ({**state, "given_back": True}, r"'given_back' must be an int >= 0"),
        (
            {**state, "incumbent_optimizer": {"state": {}}},
            r"'incumbent_optimizer' is only kept during a probation",
        ),
        ({**state, "incumbent_scheduler": 3}, r"'incumbent_scheduler' must be a state dict or \{\}"),
    ]
    for bad, message in bad_states:
        with pytest.raises(ValueError, match=message):
            b.load_state_dict(bad)
        now = b.state_dict()
        assert torch.equal(now["start"][0], good["start"][0])
        assert without_start(now) == without_start(good)


def test_a_state_saved_before_the_probation_loads_with_none_open() -> None:
    w = nn.Parameter(torch.tensor([0.5, 1.5]))
    a = RewardShiftRestart([w])
    a.observe(step(0.8), 8)
    state = a.state_dict()
    added = (
        "given_back",
        "probation_steps",
        "probe",
        "incumbent",
        "incumbent_optimizer",
        "incumbent_scheduler",
    )
    legacy = {k: v for k, v in state.items() if k not in added}
    b = RewardShiftRestart([nn.Parameter(torch.zeros(2))])
    b.load_state_dict(legacy)
    assert without_start(b.state_dict()) == without_start(state)
    assert b.incumbent is None


class ArmLogits(nn.Module):
    def __init__(self, arms: int) -> None:
        super().__init__()
        self.theta = nn.Parameter(torch.zeros(arms))

    def forward(self, states: Tensor) -> torch.distributions.Categorical:
        return torch.distributions.Categorical(logits=self.theta.expand(states.shape[0], -1))


def switching_reward(switch_at: int) -> tuple[list[int], object]:
    """Bernoulli arms: arm 0 pays with probability 0.8, arm 3 with 0.4, the others 0.1, for the
    first ``switch_at`` steps; then arm 0 pays 0.4 and arm 3 0.9."""
    calls = [0]
    gen = torch.Generator().manual_seed(7)

    def reward(states: Tensor, actions: Tensor) -> Tensor:
        calls[0] += 1
        p = torch.tensor([0.8, 0.1, 0.1, 0.4, 0.1] if calls[0] <= switch_at else [0.4, 0.1, 0.1, 0.9, 0.1])
        return (torch.rand(actions.shape, generator=gen) < p[actions]).float()

    return calls, reward


def trainer(reward: object, **overrides: object) -> GRPOTrainer:
    config = GRPOConfig.recipe("small_policy", **{"group_size": 8, "batch_size": 1, "seed": 0, **overrides})
    return GRPOTrainer(config, DistributionPolicy(ArmLogits(5)), reward)  # type: ignore[arg-type]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_preset_follows_a_switch_that_it_would_miss_without_the_restart(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The best arm switches at step 120: with the preset's restart the policy prefers the new
    arm by step 240 (measured 0.97); without it (reward_shift_z=None) it is still mostly on the old one."""
    probs = {}
    for z in (4.0, None):
        _, reward = switching_reward(120)
        tr = trainer(reward, reward_shift_z=z)
        restarts = []
        for _ in range(240):
            restarts.append(tr.step(torch.zeros(1, 1)).get("restart/reward_shift"))
        probs[z] = torch.softmax(tr.policy.net.theta.detach(), 0)
        if z is None:
            assert set(restarts) == {None}  # the metric is absent when the rule is off
        else:
            assert restarts.count(1.0) == 1
            assert 120 <= restarts.index(1.0) < 130  # within a few steps of the switch
    assert probs[4.0][3] > 0.9, probs[4.0]
    assert probs[None][3] < 0.5, probs[None]  # measured 0.33: still mostly on the old arm (0.65)
    assert "reward shift: the mean reward fell" in caplog.text


def falling_reward(fall_at: int) -> object:
    """Arm 0 pays with probability 0.8, arm 3 with 0.4, the others 0.1; from call ``fall_at`` on
    every reward is r - 0.5 (the task got harder by the same amount for every arm)."""
    calls = [0]
    gen = torch.Generator().manual_seed(7)

    def reward(states: Tensor, actions: Tensor) -> Tensor:
        calls[0] += 1
        p = torch.tensor([0.8, 0.1, 0.1, 0.4, 0.1])
        r = (torch.rand(actions.shape, generator=gen) < p[actions]).float()
        return r - 0.5 if calls[0] > fall_at else r

    return reward


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_preset_gives_a_policy_back_when_every_reward_fell(caplog: pytest.LogCaptureFixture) -> None:
    """Every reward falls by 0.5 at step 120: the drop restarts the policy on probation, the
    restarted policy's groups still favour arm 0, and the incumbent comes back bitwise; the drop
    alone (the rule before the probation) would have left the policy restarted."""
    tr = trainer(falling_reward(120))
    watch = tr.reward_shift
    assert watch is not None
    flags, incumbent, moments, lr = [], None, None, None
    for _ in range(200):
        before = (tr.policy.net.theta.detach().clone(), copy.deepcopy(tr.optimizer.state_dict()))
        lr_before = tr.optimizer.param_groups[0]["lr"]
        m = tr.step(torch.zeros(1, 1))
        flags.append((m["restart/reward_shift"], m["restart/given_back"]))
        if m["restart/reward_shift"] == 1.0:
            assert watch.incumbent is not None
            incumbent = watch.incumbent[0].clone()
            moments = copy.deepcopy(tr.optimizer.state_dict()["state"])  # after the step's update
            lr = tr.optimizer.param_groups[0]["lr"]
            assert torch.equal(tr.policy.net.theta.detach(), torch.zeros(5))  # restarted
        if m["restart/given_back"] == 1.0:
            assert incumbent is not None
            assert moments is not None
            assert torch.equal(tr.policy.net.theta.detach(), incumbent)  # given back bitwise
            state = tr.optimizer.state_dict()["state"]  # with Adam's moments at the restart
            assert all(torch.equal(state[0][k], moments[0][k]) for k in ("exp_avg", "exp_avg_sq", "step"))
            assert not torch.equal(before[1]["state"][0]["exp_avg"], moments[0]["exp_avg"])  # they had moved
            assert tr.optimizer.param_groups[0]["lr"] == lr  # and the adaptive rate
            del lr_before
    restarts = [i for i, f in enumerate(flags) if f[0] == 1.0]
    backs = [i for i, f in enumerate(flags) if f[1] == 1.0]
    assert restarts
    assert 120 <= restarts[0] < 135
    assert len(backs) == len(restarts)  # every restart given back
    assert all(b - r == PROBATION_STEPS for r, b in zip(restarts, backs, strict=True))
    assert torch.softmax(tr.policy.net.theta.detach(), 0)[0] > 0.95
    assert "still favour the policy it replaced" in caplog.text


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_checkpoint_during_a_probation_resumes_it(tmp_path: Path) -> None:
    tr = trainer(falling_reward(120))
    watch = tr.reward_shift
    assert watch is not None
    while watch.incumbent is None:
        tr.step(torch.zeros(1, 1))
        assert tr.step_count < 200
    tr.step(torch.zeros(1, 1))
    assert watch.incumbent is not None
    path = tr.save_checkpoint(tmp_path / "ckpt")
    other = trainer(falling_reward(0), seed=1)
    other.load_checkpoint(path)
    assert other.reward_shift is not None
    assert other.reward_shift.incumbent is not None
    assert torch.equal(other.reward_shift.incumbent[0], watch.incumbent[0])
    assert without_start(other.reward_shift.state_dict()) == without_start(watch.state_dict())
    saved, loaded = watch.incumbent_optimizer["state"][0], other.reward_shift.incumbent_optimizer["state"][0]
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert other.reward_shift.incumbent_scheduler == watch.incumbent_scheduler
    bad = {**watch.state_dict(), "incumbent_optimizer": {"state": {}, "param_groups": []}}
    with pytest.raises(ValueError, match=r"reward_shift state: 'incumbent_optimizer'"):
        other.reward_shift.load_state_dict(bad)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_checkpoint_keeps_the_starting_weights_and_the_statistics(tmp_path: Path) -> None:
    _, reward = switching_reward(10_000)
    tr = trainer(reward)
    for _ in range(12):
        tr.step(torch.zeros(1, 1))
    path = tr.save_checkpoint(tmp_path / "ckpt")
    _, reward2 = switching_reward(10_000)
    other = trainer(reward2, seed=1)
    other.load_checkpoint(path)
    assert other.reward_shift is not None
    assert tr.reward_shift is not None
    a, b = tr.reward_shift.state_dict(), other.reward_shift.state_dict()
    assert torch.equal(a["start"][0], torch.zeros(5))  # the weights the trainer started from
    assert torch.equal(b["start"][0], a["start"][0])
    assert {k: v for k, v in a.items() if k != "start"} == {k: v for k, v in b.items() if k != "start"}
    assert a["steps"] == 12


def test_config_errors() -> None:
    with pytest.raises(ValueError, match=r"GRPOConfig.reward_shift_z=0.0 is not allowed"):
        GRPOConfig(reward_shift_z=0.0, num_epochs_per_update=2)
    with pytest.raises(ValueError, match=r"GRPOConfig.reward_shift_z=inf is not allowed"):
        GRPOConfig(reward_shift_z=math.inf, num_epochs_per_update=2)
    with pytest.raises(ValueError, match=r"GRPOConfig.reward_shift_kl=-1.0 is not allowed"):
        GRPOConfig(reward_shift_kl=-1.0)
    with pytest.raises(ValueError, match=r"kl/old, which is exactly 0 with one optimizer step per update"):
        GRPOConfig(reward_shift_z=4.0)
    with pytest.raises(ValueError, match=r"RewardShiftRestart\(z=-1\): expected a finite number > 0"):
        RewardShiftRestart([], z=-1)
    cfg = GRPOConfig(reward_shift_z=4.0, num_epochs_per_update=2)
    run = setup_trainer(cfg, categorical_mlp(2, 2, (4,)), lambda s, a: (a == 0).float(), None, None)
    partitioned = types.SimpleNamespace(local_weights=False)  # FSDP's and DeepSpeed's flag
    with pytest.raises(ValueError, match=r"whole weights on every process: not with fsdp=True or DeepSpeed"):
        RewardShiftRestart.from_config(cfg, dataclasses.replace(run, backend=partitioned))  # type: ignore[arg-type]
    assert RewardShiftRestart.from_config(GRPOConfig(), run) is None
    watch = RewardShiftRestart.from_config(cfg, run)
    assert watch is not None
    assert watch.run is run
    assert [id(p) for p in watch.params] == [id(p) for p in run.params]
