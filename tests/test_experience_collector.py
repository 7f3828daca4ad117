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
