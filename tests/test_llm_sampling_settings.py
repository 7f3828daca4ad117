"""`grpo.llm.SamplingSettings`: one validated object for every sampling setting (issue 42)."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
from typing import Any

import pytest

pytest.importorskip("transformers")

from grpo.llm import CausalLMPolicy, SamplingSettings
from grpo.llm.tiny import build_tiny_model, build_tiny_tokenizer


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_new_tokens", 0, r"SamplingSettings.max_new_tokens=0 must be >= 1"),
        ("min_new_tokens", -1, r"SamplingSettings.min_new_tokens=-1 must be >= 0"),
        ("temperature", 0.0, r"SamplingSettings.temperature=0.0 must be > 0.*Use e.g. 0.7"),
        ("temperature", float("nan"), r"SamplingSettings.temperature=nan must be > 0"),
        ("top_p", 0.0, r"SamplingSettings.top_p=0.0 must be in \(0, 1\]; 1 switches"),
        ("top_p", 1.5, r"SamplingSettings.top_p=1.5 must be in \(0, 1\]"),
        ("top_k", -1, r"SamplingSettings.top_k=-1 must be >= 0; 0 switches top-k off"),
        ("min_p", 1.0, r"SamplingSettings.min_p=1.0 must be in \[0, 1\)"),
        ("repetition_penalty", 0.0, r"SamplingSettings.repetition_penalty=0.0 must be > 0 \(1 = off\)"),
        ("max_model_len", 0, r"SamplingSettings.max_model_len=0 must be an integer >= 1 or None"),
        ("generation_batch_size", 0, r"SamplingSettings.generation_batch_size=0 must be an integer >= 1"),
    ],
)
def test_every_field_is_checked_with_its_name_and_the_fix(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingSettings(**{field: value})
    with pytest.raises(ValueError, match=message):  # a call's override goes through the same check
        SamplingSettings().replace(**{field: value})


@pytest.mark.parametrize(("field", "value"), [("top_k", 2.5), ("max_new_tokens", True), ("temperature", "1")])
def test_wrong_types_name_the_field(field: str, value: Any) -> None:
    with pytest.raises(TypeError, match=rf"SamplingSettings.{field}={value!r} must be an? (int|float)"):
        SamplingSettings(**{field: value})


def test_frozen_typed_documented_and_replace_checks_names() -> None:
    s = SamplingSettings(temperature=1)  # an int temperature is stored as a float
    assert s.temperature == 1.0
    assert isinstance(s.temperature, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.temperature = 0.5  # type: ignore[misc]
    with pytest.raises(TypeError, match=r"unknown sampling settings \['num_beams'\]; known: \[.*'top_k'"):
        s.replace(num_beams=2)
    assert s.replace(top_k=3) == SamplingSettings(temperature=1.0, top_k=3)
    assert pickle.loads(pickle.dumps(s)) == s  # what the worker carries
    source = inspect.getsource(SamplingSettings)
    for name in SamplingSettings.names():  # a docstring under every field
        assert f"    {name}: " in source
        after = source.split(f"    {name}: ", 1)[1].split("\n", 2)[1]
        assert after.strip().startswith('"""'), name


def test_completion_budgets() -> None:
    assert SamplingSettings(max_new_tokens=8).completion_budgets([3, 100]) == [8, 8]
    assert SamplingSettings(max_new_tokens=8, max_model_len=12).completion_budgets([2, 8]) == [8, 4]
    with pytest.raises(ValueError, match=r"prompt 1 has 12 tokens.*max_model_len=12"):
        SamplingSettings(max_model_len=12).completion_budgets([2, 12])


def test_the_policy_takes_one_object_and_no_sampling_keyword(tmp_path) -> None:
    tok = build_tiny_tokenizer(tmp_path)
    model = build_tiny_model(tmp_path, tok, hidden=16, layers=1)
    params = set(inspect.signature(CausalLMPolicy.__init__).parameters)
    assert "sampling" in params
    assert not params & set(SamplingSettings.names())
    s = SamplingSettings(max_new_tokens=3, temperature=0.9)
    policy = CausalLMPolicy(model, tok, s)
    assert policy.sampling is s
    assert CausalLMPolicy(model, tok).sampling == SamplingSettings()
    policy.temperature = 0.5  # the population's knob: replaces the object, checked
    assert policy.sampling == s.replace(temperature=0.5)
    with pytest.raises(ValueError, match=r"temperature=-1.0 must be > 0"):
        policy.temperature = -1.0
    with pytest.raises(TypeError, match=r"takes a grpo.llm.SamplingSettings, got dict"):
        CausalLMPolicy(model, tok, {"temperature": 0.7})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'temperature'"):
        CausalLMPolicy(model, tok, temperature=0.7)  # type: ignore[call-arg]


def test_the_cli_builds_the_settings_once_from_its_flags(tmp_path) -> None:
    """Every sampling flag of grpo-train lands in the policy's one `SamplingSettings` object."""
    from grpo.llm.cli_options import parse_args
    from grpo.llm.cli_run import build_policy

    flags = {
        "max_new_tokens": 7, "min_new_tokens": 1, "temperature": 0.6, "top_p": 0.9, "top_k": 4,
        "min_p": 0.05, "repetition_penalty": 1.2, "max_model_len": 99, "generation_batch_size": 3,
    }  # fmt: skip
    assert set(flags) == set(SamplingSettings.names())
    argv = ["--model-name", "m", "--dataset", "d.jsonl"]
    for name, value in flags.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    tok = build_tiny_tokenizer(tmp_path)
    policy = build_policy(parse_args(argv), build_tiny_model(tmp_path, tok, hidden=16, layers=1), tok)
    assert policy.sampling == SamplingSettings(**flags)


REMOVED = r"decoding was removed in grpo 0\.3 \(issue 42\): Hugging Face generate is the one .*Leave it out"


def test_the_removed_decoding_setting_is_refused_naming_the_removal(tmp_path) -> None:
    """``decoding`` (the KV-cache loop's switch) is gone: a keyword, a call's override, a
    ``grpo-train`` flag and a config-file key naming it are refused saying so, not as unknown."""
    from grpo.llm.cli_options import parse_args
    from grpo.runtime.dataclass_args import UsageError

    with pytest.raises(TypeError, match="SamplingSettings." + REMOVED):
        SamplingSettings(decoding="generate")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="SamplingSettings." + REMOVED):
        SamplingSettings().replace(decoding="auto")
    base = ["--model-name", "m", "--dataset", "d.jsonl"]
    with pytest.raises(UsageError, match=r"unrecognized arguments: --decoding generate \(--" + REMOVED):
        parse_args([*base, "--decoding", "generate"])
    config = tmp_path / "run.yaml"
    config.write_text("decoding: auto\n")
    with pytest.raises(UsageError, match=r"run\.yaml': " + REMOVED):
        parse_args([*base, "--config", str(config)])
    assert "decoding" not in SamplingSettings.names()
