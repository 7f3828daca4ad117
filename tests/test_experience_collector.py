import numpy as np
import pytest
import torch

from grpo import PolicyOutput
from grpo.rollout.checks import to_reward_tensor
from grpo.rollout.log_probs import normalise_log_probs

CPU = torch.device("cpu")


def test_one_shot_logprobs_become_one_step_with_full_mask() -> None:
    out = normalise_log_probs(torch.tensor([-1.0, -2.0]), 2, "P.get_log_probabilities", CPU)
    assert out.log_probs.shape == (2, 1)
    assert out.mask.all()
    assert out.mask.dtype == torch.bool


def test_policy_output_mask_and_entropy_are_kept() -> None:
    lp = torch.randn(3, 4)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    out = normalise_log_probs(PolicyOutput(lp, mask=mask, entropy=lp.abs()), 3, "P.m", CPU)
    assert out.mask.dtype == torch.bool
    assert out.mask.sum() == 7
    assert out.entropy is not None
    assert torch.equal(out.entropy, lp.abs())


@pytest.mark.parametrize(
    ("value", "pattern"),
    [
        (
            torch.zeros(3),
            r"P.m returned log-probs of shape \(3,\); expected \(2,\) for one-shot actions or \(2, T\)",
        ),
        (torch.zeros(2, 2, 2), r"shape \(2, 2, 2\)"),
        (torch.zeros(2, dtype=torch.long), r"dtype torch.int64; expected a float dtype"),
        ([0.0, 0.0], r"P.m returned list; expected a torch.Tensor"),
        (
            PolicyOutput(torch.zeros(2, 3), mask=torch.ones(2, 2)),
            r"mask of shape \(2, 2\) for log-probs of shape \(2, 3\)",
        ),
    ],
)
def test_bad_logprobs_are_explained(value: object, pattern: str) -> None:
    with pytest.raises((TypeError, ValueError), match=pattern):
        normalise_log_probs(value, 2, "P.m", CPU)  # type: ignore[arg-type]


def test_rewards_from_lists_arrays_and_tensors() -> None:
    for value in (
        [1, 2.5, 3],
        np.array([1.0, 2.5, 3.0]),
        torch.tensor([1.0, 2.5, 3.0], dtype=torch.float64),
        torch.tensor([[1.0], [2.5], [3.0]]),
    ):
        t = to_reward_tensor(value, 3, "R.compute_rewards", CPU)
        assert t.dtype == torch.float32
        assert t.tolist() == [1.0, 2.5, 3.0]
    with pytest.raises(TypeError, match="non-numeric rewards at positions \\[1\\]"):
        to_reward_tensor([1.0, "x", 2.0], 3, "R.compute_rewards", CPU)
    with pytest.raises(ValueError, match=r"non-finite rewards \(NaN or inf\) at flat positions \[2\]"):
        to_reward_tensor([1.0, 2.0, float("inf")], 3, "R.compute_rewards", CPU)
    with pytest.raises(TypeError, match="returned int; expected a Tensor"):
        to_reward_tensor(3, 3, "R.compute_rewards", CPU)


def test_select_groups_takes_every_row_field_of_the_chosen_groups() -> None:
    from grpo import ExperienceBatch

    # 3 groups of G=2: rows 0-1, 2-3, 4-5; keep groups 2 then 0 (in that order)
    batch = ExperienceBatch(
        states=["s0", "s1", "s2"],
        flat_states=["s0", "s0", "s1", "s1", "s2", "s2"],
        actions=torch.arange(6) * 10,
        group_ids=torch.tensor([0, 0, 1, 1, 2, 2]),
        group_size=2,
        rewards=torch.arange(6, dtype=torch.float32),
        reward_components={"acc": torch.arange(6, dtype=torch.float32) + 100},
        old_log_probs=torch.arange(12, dtype=torch.float32).view(6, 2),
        mask=torch.tensor([[True, False]] * 6),
        loss_rows=torch.tensor([True, False, True, True, False, True]),
        policy_versions=torch.tensor([7] * 6),
        dropped_groups=4,
    )
    sub = batch.select_groups(torch.tensor([2, 0]))
    assert sub.states == ["s2", "s0"]
    assert sub.flat_states == ["s2", "s2", "s0", "s0"]
    assert sub.actions.tolist() == [40, 50, 0, 10]
    assert sub.group_ids.tolist() == [0, 0, 1, 1]
    assert sub.rewards.tolist() == [4.0, 5.0, 0.0, 1.0]
    assert sub.reward_components["acc"].tolist() == [104.0, 105.0, 100.0, 101.0]
    assert sub.old_log_probs is not None
    assert sub.old_log_probs[:, 0].tolist() == [8.0, 10.0, 0.0, 2.0]
    assert sub.loss_rows is not None
    assert sub.loss_rows.tolist() == [False, True, True, False]
    assert sub.ref_log_probs is None
    assert sub.step_rewards is None
    assert sub.dropped_groups == 4
    assert sub.num_groups == 2
    assert sub.num_samples == 4


def test_allow_empty_returns_no_group_when_every_reward_is_invalid() -> None:
    """The public way evaluation asks for an empty batch (it overrode a private method before)."""
    from grpo import ExperienceCollector
    from grpo.policies import categorical_mlp
    from grpo.reward_model_base import as_reward_model

    policy = categorical_mlp(3, 4, hidden=(8,))

    def nan_reward(states: object, actions: object) -> list[float]:
        return [float("nan")] * len(actions)  # type: ignore[arg-type]

    reward = as_reward_model(nan_reward, "reward_model")
    states = torch.zeros(2, 3)
    common = {"invalid_rewards": "drop_groups", "record_old_log_probs": False}
    with pytest.raises(ValueError, match="in every one of the 2 groups"):
        ExperienceCollector(policy, reward, 4, CPU, **common).collect(states)  # type: ignore[arg-type]
    batch = ExperienceCollector(policy, reward, 4, CPU, allow_empty=True, **common).collect(states)  # type: ignore[arg-type]
    assert (batch.num_groups, batch.num_samples, batch.dropped_groups) == (0, 0, 2)
