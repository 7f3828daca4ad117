"""Dynamic sampling with back-fill (``GRPOConfig.max_sampling_draws``, `grpo.rollout.dynamic_sampling`).

The toy: a state is a vector (4,) whose last entry is its *kind*: 0 = every action earns 0, 1 =
every action earns 1 (both all-equal groups), 2 = mixed: the first sample of its group earns 1,
the others 0 (group-major rows: row k is sample k % G). Which groups a step keeps and how many
batches it draws is then known by hand, whatever the policy samples.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from grpo import ExperienceBatch, GRPOConfig, GRPOTrainer
from grpo.policies import categorical_mlp

G = 4


def kind_states(kinds: list[int]) -> Tensor:
    """States (n, 4): random features, the kind in the last column."""
    g = torch.Generator().manual_seed(1)
    s = torch.randn(len(kinds), 4, generator=g)
    s[:, 3] = torch.tensor(kinds, dtype=torch.float32)
    return s


def kind_reward(states: Tensor, actions: Tensor) -> Tensor:
    kind = states[:, 3]
    first = (torch.arange(states.shape[0]) % G == 0).float()
    return torch.where(kind == 2, first, (kind == 1).float())


def make(**config: Any) -> GRPOTrainer:
    cfg: dict[str, Any] = {
        "group_size": G, "batch_size": 2, "seed": 0, "learning_rate": 1e-2,
        "drop_zero_variance_groups": True, "max_sampling_draws": 4,
    }  # fmt: skip
    cfg.update(config)
    torch.manual_seed(0)
    return GRPOTrainer(GRPOConfig(**cfg), categorical_mlp(4, 3, hidden=(8,)), kind_reward)


def last_batch(trainer: GRPOTrainer) -> ExperienceBatch:
    batch = trainer.last_batch
    assert batch is not None
    return batch


def kinds_of(batch_states: Tensor) -> list[int]:
    return [int(k) for k in batch_states[:, 3].tolist()]


def test_train_back_fills_to_b_mixed_groups_counted_by_hand() -> None:
    # B=2. Step 1 draws [0,2] (1 mixed), [1,1] (0), [2,0] (1): 3 draws, 2 mixed kept, the 4
    # all-equal groups dropped. Step 2 draws [2,2]: 1 draw, both kept.
    states = kind_states([0, 2, 1, 1, 2, 0, 2, 2])
    trainer = make()
    run = trainer.train(states, num_steps=2, progress=False)
    first, second = run.history
    assert {k: first[k] for k in first if k.startswith("sampling/")} == {
        "sampling/draws": 3.0, "sampling/kept_groups": 2.0, "sampling/dropped_groups": 4.0,
        "sampling/surplus_groups": 0.0, "sampling/capped": 0.0,
    }  # fmt: skip
    assert (second["sampling/draws"], second["sampling/kept_groups"], second["sampling/dropped_groups"]) == (
        1.0,
        2.0,
        0.0,
    )
    assert first["advantage/frac_dropped_groups"] == 0.0
    assert torch.equal(last_batch(trainer).states, states[6:8])
    assert trainer.stateful_components()["dynamic_sampling"].extra == 2


def test_step_with_a_callable_source_keeps_the_first_b_mixed_and_counts_the_surplus() -> None:
    trainer = make(batch_size=3)
    batches = iter([kind_states([2, 2, 2]), kind_states([0, 0, 0])])
    m = trainer.step(kind_states([0, 2, 1]), more_states=lambda: next(batches, None))
    # draws: [0,2,1] -> 1 mixed; [2,2,2] -> 3 mixed: 4 found, the first 3 kept, 1 surplus
    assert (m["sampling/draws"], m["sampling/kept_groups"], m["sampling/surplus_groups"]) == (2.0, 3.0, 1.0)
    assert m["sampling/dropped_groups"] == 2.0
    assert m["sampling/capped"] == 0.0
    assert "sampling/drawn_episodes" not in m  # a bandit's actions report no success
    assert kinds_of(last_batch(trainer).states) == [2, 2, 2]
    assert last_batch(trainer).num_samples == 3 * G


def test_at_the_cap_it_trains_on_the_mixed_groups_found_with_a_warning() -> None:
    """3 draws of B=2 find one mixed group: the batch is it plus the first all-equal group, which
    drop_zero_variance_groups leaves out of the loss, so the update is the one of the mixed
    group alone (a step on that state only)."""
    source = kind_states([2, 0, 0, 1, 1, 0, 2, 2])
    trainer = make(max_sampling_draws=3)
    with pytest.warns(UserWarning, match=r"1 of 2 groups have mixed rewards after 3 draw\(s\)"):
        run = trainer.train(source, num_steps=1, progress=False)
    m = run.history[0]
    assert (m["sampling/draws"], m["sampling/kept_groups"], m["sampling/capped"]) == (3.0, 1.0, 1.0)
    assert m["sampling/dropped_groups"] == 4.0  # 5 all-equal groups drawn, 1 fills the batch
    assert m["advantage/frac_dropped_groups"] == 0.5
    assert torch.equal(last_batch(trainer).states, source[0:2])

    alone = make(max_sampling_draws=1, batch_size=1)
    alone.step(source[0:1])
    for p, q in zip(trainer.params, alone.params, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7)


def test_never_loops_forever_on_all_equal_groups() -> None:
    trainer = make(max_sampling_draws=5)
    drawn = []

    def more() -> Tensor:
        drawn.append(1)
        return kind_states([1, 0])

    with pytest.warns(UserWarning, match="max_sampling_draws=5 batches were drawn"):
        m = trainer.step(kind_states([0, 1]), more_states=more)
    assert len(drawn) == 4
    assert (m["sampling/draws"], m["sampling/kept_groups"], m["sampling/capped"]) == (5.0, 0.0, 1.0)
    assert m["advantage/frac_dropped_groups"] == 1.0


def test_without_a_source_the_step_warns_and_trains_on_its_own_states() -> None:
    trainer = make()
    with pytest.warns(UserWarning, match="no source of more states was given"):
        m = trainer.step(kind_states([2, 0]))
    assert (m["sampling/draws"], m["sampling/kept_groups"], m["sampling/capped"]) == (1.0, 1.0, 1.0)


def test_off_by_default_no_sampling_metrics() -> None:
    trainer = make(max_sampling_draws=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = trainer.step(kind_states([2, 0]))
    assert not [k for k in m if k.startswith("sampling/")]


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"drop_zero_variance_groups": False}, "Set drop_zero_variance_groups=True"),
        ({"max_sampling_draws": 0}, "expected an integer >= 1"),
        ({"async_staleness": 1}, "Use async_staleness=0 with dynamic sampling"),
    ],
)
def test_bad_settings_are_refused(config: dict[str, Any], match: str) -> None:
    cfg: dict[str, Any] = {"drop_zero_variance_groups": True, "max_sampling_draws": 4, **config}
    with pytest.raises(ValueError, match=match):
        GRPOConfig(**cfg)


def test_resume_is_exact_with_back_fill(tmp_path: Path) -> None:
    """Back-fill moves the source on by a number of batches the step count does not tell; the
    checkpoint keeps it, so a resumed run draws what the uninterrupted one draws."""
    states = kind_states([0, 2, 1, 1, 2, 0, 2, 2, 0, 0, 2, 1, 2, 0])
    straight = make()
    full = straight.train(states, num_steps=5, progress=False)
    make(checkpoint_freq=2).train(states, num_steps=2, checkpoint_dir=tmp_path, progress=False)
    resumed = make(checkpoint_freq=2)
    run = resumed.train(states, num_steps=5, checkpoint_dir=tmp_path, resume_from=tmp_path, progress=False)
    assert [r["step"] for r in run.history] == [3.0, 4.0, 5.0]
    for key in ("sampling/draws", "sampling/kept_groups", "reward/mean", "grad/norm"):
        assert [r[key] for r in run.history] == [r[key] for r in full.history[2:]], key
    assert torch.equal(last_batch(resumed).states, last_batch(straight).states)
    for p, q in zip(straight.params, resumed.params, strict=True):
        assert torch.equal(p, q)


# ---- language models: train() with a tiny transformer, and grpo-train --------------------------
def position_reward(prompts: list[str], completions: list[str]) -> list[float]:
    """'E' prompts earn 1, 'H' prompts 0, 'M' prompts 1 for the first sample of the group only."""
    return [
        1.0 if p.startswith("E") else 0.0 if p.startswith("H") else float(i % 2 == 0)
        for i, p in enumerate(prompts)
    ]


def test_llm_train_back_fills_and_its_behaviour_log_probs_fit_the_joined_batch(tmp_path: Path) -> None:
    """A tiny causal LM, G=2, B=2: step 1 draws [H0,M1], [E2,E3], [M4,H5] (3 draws, M1 and M4
    kept); step 2 draws [M6,M7]. Two optimizer steps a step, so the behaviour log-probs are
    recorded at collection, over the joined batch of two draws' completions: they equal a forward
    of a policy with the collection's weights over that batch."""
    pytest.importorskip("transformers")
    from grpo.llm import CausalLMPolicy, RewardFunctions, SamplingSettings
    from grpo.rollout.batch import evaluate_log_probs
    from tests.llm_helpers import build_model, build_tokenizer

    tok = build_tokenizer(tmp_path / "tok")
    policy = CausalLMPolicy(
        build_model(tmp_path / "m", tok), tok, SamplingSettings(max_new_tokens=5, temperature=1.0)
    )
    config = GRPOConfig(
        group_size=2, batch_size=2, seed=0, learning_rate=1e-3, mini_batch_size=1,
        drop_zero_variance_groups=True, max_sampling_draws=3, kl_coeff=0.0,
    )  # fmt: skip
    trainer = GRPOTrainer(config, policy, RewardFunctions(position_reward))
    prompts = ["H0", "M1", "E2", "E3", "M4", "H5", "M6", "M7"]
    run = trainer.train(prompts, num_steps=1, progress=False)
    m = run.history[0]
    assert (m["sampling/draws"], m["sampling/kept_groups"], m["sampling/dropped_groups"]) == (3.0, 2.0, 4.0)
    batch = last_batch(trainer)
    assert batch.states == ["M1", "M4"]
    assert batch.old_log_probs is not None
    assert batch.mask is not None
    # the weights have moved since: compare with a fresh policy of the same weights as at collection
    fresh = CausalLMPolicy(
        build_model(tmp_path / "m2", tok), tok, SamplingSettings(max_new_tokens=5, temperature=1.0)
    )
    fresh.eval()
    with torch.no_grad():
        lp = evaluate_log_probs(fresh, batch, device=torch.device("cpu"))
    assert lp.log_probs.shape == batch.old_log_probs.shape  # padded to the batch's T if narrower
    assert torch.equal(lp.mask, batch.mask)
    torch.testing.assert_close(lp.log_probs[lp.mask], batch.old_log_probs[lp.mask], rtol=1e-5, atol=1e-5)
    m2 = trainer.train(prompts, num_steps=2, progress=False).history[0]
    assert m2["sampling/draws"] == 1.0
    assert last_batch(trainer).states == ["M6", "M7"]


def test_grpo_train_flag_back_fills_and_resumes(tmp_path: Path) -> None:
    """``grpo-train --drop-zero-variance-groups --max-sampling-draws 4``: the metrics hold the
    draws; resumed from its step-1 checkpoint, step 2 is the uninterrupted run's."""
    pytest.importorskip("transformers")
    import json

    from grpo.llm.cli import main
    from tests.llm_helpers import build_model, build_tokenizer

    tok = build_tokenizer(tmp_path / "model")
    build_model(tmp_path / "model", tok)
    with open(tmp_path / "data.jsonl", "w") as f:
        for i in range(6):
            f.write(json.dumps({"q": f"{i}+1=", "answer": str(i + 1)}) + "\n")
    (tmp_path / "parity.py").write_text(
        "def parity(prompts, completions, **columns):\n"
        "    return [float(sum(map(ord, c)) % 2) for c in completions]\n"
    )
    common = [
        "--model-name", str(tmp_path / "model"), "--dataset", str(tmp_path / "data.jsonl"),
        "--prompt-column", "q", "--batch-size", "2", "--num-generations", "3", "--max-new-tokens", "3",
        "--reward", f"{tmp_path / 'parity.py'}:parity", "--device", "cpu", "--no-progress",
        "--logging-steps", "1", "--drop-zero-variance-groups", "--max-sampling-draws", "4",
        "--save-steps", "1",
    ]  # fmt: skip
    assert main([*common, "--output-dir", str(tmp_path / "a"), "--max-steps", "2"]) == 0
    straight = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert all(1.0 <= r["sampling/draws"] <= 4.0 for r in straight)
    assert all("sampling/kept_groups" in r for r in straight)
    assert main([*common, "--output-dir", str(tmp_path / "b"), "--max-steps", "1"]) == 0
    assert main([*common, "--output-dir", str(tmp_path / "b"), "--max-steps", "2", "--resume"]) == 0
    resumed = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    for key in ("sampling/draws", "reward/mean", "grad/norm"):
        assert resumed[-1][key] == straight[-1][key], key


# ---- gym episode groups: back-fill draws new starts ----------------------------------------------
def test_gym_episode_groups_back_fill_with_new_seeded_starts() -> None:
    """Same-start groups of G=8 one-step episodes from `SeededStarts` on an env whose own reset
    ignores the seed: start s has kind s % 3 (0: fails, 1: succeeds, 2: succeeds iff the action
    is 1). B=2 from the seeds [0, 1, 2, 5, 3, 4, 8, 11]: each step draws an all-equal pair of
    starts, then a pair of kind-2 starts (mixed at this seed), so 2 draws a step, 32 episodes."""
    gym = pytest.importorskip("gymnasium")
    import numpy as np

    from grpo.gym import EpisodePolicy, EpisodeSuccess, SeededStarts

    class KindEnv(gym.Env):  # type: ignore[misc,name-defined]
        observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
        action_space = gym.spaces.Discrete(2)
        kind = 0

        def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[Any, dict[str, Any]]:
            super().reset(seed=None)  # the seed is ignored, as MetaWorld's reset does
            return np.array([self.kind, 1.0], np.float32), {}

        def step(self, action: int) -> tuple[Any, float, bool, bool, dict[str, Any]]:
            success = self.kind == 1 or (self.kind == 2 and int(action) == 1)
            return np.zeros(2, np.float32), float(success), True, False, {"success": success}

    def start(env: Any, seed: int) -> None:
        env.kind = seed % 3

    torch.manual_seed(0)
    policy = EpisodePolicy(lambda: SeededStarts(KindEnv(), start), categorical_mlp(2, 2, hidden=(4,)))
    config = GRPOConfig(
        group_size=8, batch_size=2, seed=0, learning_rate=1e-2,
        drop_zero_variance_groups=True, max_sampling_draws=3,
    )  # fmt: skip
    trainer = GRPOTrainer(config, policy, EpisodeSuccess())
    run = trainer.train([0, 1, 2, 5, 3, 4, 8, 11], num_steps=2, progress=False)
    assert [r["sampling/draws"] for r in run.history] == [2.0, 2.0]
    assert [r["sampling/kept_groups"] for r in run.history] == [2.0, 2.0]
    assert [r["sampling/dropped_groups"] for r in run.history] == [2.0, 2.0]
    assert last_batch(trainer).states == [8, 11]
    assert policy.env_steps == 2 * 2 * 2 * 8  # steps x draws x B x G one-step episodes
    for r in run.history:  # every drawn episode: 8 of kind 0 fail, 8 of kind 1 succeed, 16 kept
        assert r["sampling/drawn_episodes"] == 32.0
        assert r["sampling/drawn_successes"] == 8.0 + 16 * r["episode/success_rate"]
        assert 0.0 < r["episode/success_rate"] < 1.0
    policy.close()


def test_concat_batches_pads_steps_and_renumbers_groups() -> None:
    """Draws whose actions have different lengths T: per-step fields are right-padded (mask
    False, log-probs 0), groups renumbered, counts and timings summed."""
    from grpo.rollout.batch import concat_batches

    def batch(states: list[str], t: int, dropped: int) -> ExperienceBatch:
        n = 2 * len(states)
        return ExperienceBatch(
            states=states, flat_states=[s for s in states for _ in range(2)], actions=list(range(n)),
            group_ids=torch.arange(len(states)).repeat_interleave(2), group_size=2,
            rewards=torch.ones(n), old_log_probs=-torch.ones(n, t), mask=torch.ones(n, t, dtype=torch.bool),
            dropped_groups=dropped, timings={"generate": 1.0},
        )  # fmt: skip

    joined = concat_batches([batch(["a"], 3, 1), batch(["b", "c"], 1, 2)])
    assert joined.states == ["a", "b", "c"]
    assert joined.group_ids.tolist() == [0, 0, 1, 1, 2, 2]
    assert joined.mask is not None
    assert joined.mask.tolist() == [[True] * 3] * 2 + [[True, False, False]] * 4
    assert joined.old_log_probs is not None
    assert joined.old_log_probs[2:].tolist() == [[-1.0, 0.0, 0.0]] * 4
    assert (joined.dropped_groups, joined.timings) == (3, {"generate": 2.0})


def test_kept_groups_pads_only_to_the_draws_that_keep_a_group() -> None:
    """A draw whose groups are all left out does not widen the batch: its T=5 log-probs would
    not match the policy's forward over the kept actions (T=2)."""
    from grpo.rollout.dynamic_sampling import kept_groups

    def draw(rewards: list[float], t: int) -> ExperienceBatch:
        n = len(rewards)
        return ExperienceBatch(
            states=[f"s{i}" for i in range(n // 2)], flat_states=list(range(n)), actions=list(range(n)),
            group_ids=torch.arange(n // 2).repeat_interleave(2), group_size=2,
            rewards=torch.tensor(rewards), sampler_log_probs=torch.zeros(n, t),
            mask=torch.ones(n, t, dtype=torch.bool), dropped_groups=1, timings={"score": 0.5},
        )  # fmt: skip

    first, second = draw([1.0, 1.0, 0.0, 0.0], 5), draw([0.0, 1.0, 2.0, 3.0], 2)
    mixed = [torch.tensor([False, False]), torch.tensor([True, True])]
    batch = kept_groups([first, second], mixed, 2)
    assert batch.sampler_log_probs is not None
    assert tuple(batch.sampler_log_probs.shape) == (4, 2)
    assert batch.rewards.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert (batch.dropped_groups, batch.timings) == (2, {"score": 1.0})
    assert (batch.sampling["sampling/capped"], batch.sampling["sampling/dropped_groups"]) == (0.0, 2.0)


def test_with_per_step_credit_a_group_judged_by_its_outcome_all_succeed_faster_or_slower() -> None:
    """Per-step credit (gamma 0.9): a group whose episodes all succeed, at t = 0 or t = 2, has
    non-zero per-step advantages (1 vs 0.81 at t = 0), yet both filters call it all-equal by its
    total reward: `mixed_groups` (back-fill) and the estimator's ``keep`` (the loss) agree."""
    from grpo.advantage_estimator import AdvantageEstimator
    from grpo.rollout.dynamic_sampling import mixed_groups

    mask = torch.tensor([[True, False, False], [True, True, True]] * 2)
    step = torch.tensor([[1.0, 0, 0], [0, 0, 1.0], [1.0, 0, 0], [0, 0, 0]])  # group 0: both succeed
    totals = step.sum(1)
    ids = torch.tensor([0, 0, 1, 1])
    est = AdvantageEstimator(drop_zero_variance_groups=True, gamma=0.9)
    result = est(totals, ids, 2, mask=mask, step_rewards=step, group_size=2)
    assert result.advantages[:2, 0].abs().min() > 0.5  # speed is ranked: (1 - 0.81) / std
    assert mixed_groups(totals, 2).tolist() == [False, True]
    assert result.keep is not None
    assert result.keep.tolist() == [False, False, True, True]


Outcome = Callable[[int, int, int], tuple[bool, bool]]
"""``outcome(kind, t, action) -> (success, done)`` of step t (from 1) of a start of that kind."""


def per_step_trainer(outcome: Outcome, kinds: int, **config: Any) -> tuple[GRPOTrainer, Any]:
    """A trainer with per-step credit (`EpisodeRewards`, gamma 0.9) over a real gymnasium env whose
    reset ignores the seed (as MetaWorld's does): `SeededStarts` gives start s the kind s % kinds,
    observations are (kind, t), the reward is 1 at a success. G = 8, B = 2, back-fill on."""
    gym = pytest.importorskip("gymnasium")
    import numpy as np

    from grpo.gym import EpisodePolicy, EpisodeRewards, SeededStarts

    class KindEnv(gym.Env):  # type: ignore[misc,name-defined]
        observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
        action_space = gym.spaces.Discrete(2)
        kind, t = 0, 0

        def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[Any, dict[str, Any]]:
            super().reset(seed=None)
            self.t = 0
            return np.array([self.kind, 0.0], np.float32), {}

        def step(self, action: int) -> tuple[Any, float, bool, bool, dict[str, Any]]:
            self.t += 1
            success, done = outcome(self.kind, self.t, int(action))
            obs = np.array([self.kind, self.t], np.float32)
            return obs, float(success), done, False, {"success": success}

    def start(env: Any, seed: int) -> None:
        env.kind = seed % kinds

    torch.manual_seed(0)
    policy = EpisodePolicy(lambda: SeededStarts(KindEnv(), start), categorical_mlp(2, 2, hidden=(4,)))
    cfg: dict[str, Any] = {
        "group_size": 8, "batch_size": 2, "seed": 0, "learning_rate": 1e-2, "gamma": 0.9,
        "drop_zero_variance_groups": True, "max_sampling_draws": 3, **config,
    }  # fmt: skip
    return GRPOTrainer(GRPOConfig(**cfg), policy, EpisodeRewards()), policy


def test_gym_back_fill_with_per_step_credit_leaves_out_groups_that_all_succeed() -> None:
    """Starts of kind 1 always succeed, at the step where the action is 1 or at step 3 (so the G
    lengths differ); kind 2 succeeds iff the first action is 1. From the seeds [1, 4, 2, 5], B=2:
    the first draw (kind 1, all succeed) is left out and the second (kind 2, mixed) kept."""

    def outcome(kind: int, t: int, action: int) -> tuple[bool, bool]:
        success = action == 1 or (kind == 1 and t == 3)
        return success, success or kind == 2

    trainer, policy = per_step_trainer(outcome, kinds=3)
    run = trainer.train([1, 4, 2, 5], num_steps=1, progress=False)
    assert run.history[0]["sampling/draws"] == 2.0
    assert run.history[0]["sampling/dropped_groups"] == 2.0
    assert run.history[0]["sampling/drawn_successes"] == 16.0 + 16 * run.history[0]["episode/success_rate"]
    assert last_batch(trainer).states == [2, 5]
    policy.close()


def test_back_fill_joins_draws_of_different_episode_lengths_with_one_group_mini_batches() -> None:
    """Episodes end early on failure as on success, so the draws' padded lengths differ: the
    first draw (kind 3: success when the action is 1, failure at step 3; kind 0: fails at once)
    is 3 steps wide, the second (kind 2: one step, success iff the action is 1) 1 step wide. One
    group a mini-batch with per-step credit: the group of the 1-step draw is evaluated 1 step
    wide while the batch's advantages are 3 wide. The update runs, and the narrow group's
    log-probs, padded, equal the rows of one forward over the whole batch (the padding is no step)."""
    from grpo.rollout.batch import evaluate_log_probs

    def outcome(kind: int, t: int, action: int) -> tuple[bool, bool]:
        success = kind in (2, 3) and action == 1
        return success, success or kind in (0, 2) or t == 3

    trainer, policy = per_step_trainer(outcome, kinds=4, mini_batch_size=1, num_epochs_per_update=2)
    more = iter([[2, 6]])
    m = trainer.step([3, 4], more_states=lambda: next(more, None))
    batch = last_batch(trainer)
    assert batch.states == [3, 2]
    assert batch.mask is not None
    assert batch.mask.shape[1] == 3
    assert not bool(batch.mask[8:, 1:].any())  # kind 2: 1 step
    assert (m["sampling/draws"], m["sampling/kept_groups"]) == (2.0, 2.0)
    assert math.isfinite(m["loss/total"])
    cpu = torch.device("cpu")
    whole = evaluate_log_probs(policy, batch, device=cpu, with_entropy=True)
    part = evaluate_log_probs(policy, batch, torch.arange(8, 16), device=cpu, with_entropy=True)
    assert torch.equal(part.log_probs, whole.log_probs[8:])
    assert torch.equal(part.mask, whole.mask[8:])
    assert part.entropy is not None
    assert whole.entropy is not None
    assert torch.equal(part.entropy, whole.entropy[8:])
    policy.close()
