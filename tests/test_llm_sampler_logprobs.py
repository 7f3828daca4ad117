"""`CausalLMPolicy.generate_actions_with_sampler_log_probs`: the log-probs read from the scores
``generate`` samples from equal a forward's, the tokens equal `generate_actions`'s."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.llm import CausalLMPolicy
from grpo.llm.sampling_settings import SamplingSettings
from grpo.llm.tiny import build_tiny_model, build_tiny_tokenizer

PROMPTS = ["1+2=", "33", "x"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tiny")
    build_tiny_model(str(d), build_tiny_tokenizer(str(d)), hidden=32, layers=2)
    return d


@pytest.mark.parametrize(
    "settings",
    [
        {"temperature": 0.7, "min_new_tokens": 2, "max_new_tokens": 6},  # the EOS ban, 3 chunks of 5 rows
        {"temperature": 1.3, "max_new_tokens": 5},
        {"top_k": 5, "max_new_tokens": 4},  # truncated: taken from a forward instead
    ],
)
def test_sampler_log_probs_equal_a_forward_and_the_tokens_generate_actions(
    model_dir: Path, settings: dict[str, Any]
) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir)
    policy = CausalLMPolicy(
        AutoModelForCausalLM.from_pretrained(model_dir),
        tok,
        SamplingSettings(generation_batch_size=5, **settings),
    )
    policy.eval()
    torch.manual_seed(3)
    plain = policy.generate_actions(PROMPTS, 4)
    torch.manual_seed(3)
    groups, out = policy.generate_actions_with_sampler_log_probs(PROMPTS, 4)
    flat = [c for g in groups for c in g]
    assert [c.token_ids.tolist() for g in plain for c in g] == [c.token_ids.tolist() for c in flat]
    ref = policy.get_log_probabilities([s for s in PROMPTS for _ in range(4)], flat)
    assert out.mask is not None
    assert ref.mask is not None
    assert torch.equal(out.mask, ref.mask)
    assert torch.allclose(out.log_probs, ref.log_probs, atol=1e-5)
    assert float(out.log_probs[~out.mask].abs().sum()) == 0.0  # padding is 0
