import dataclasses
import inspect
import pickle

import pytest

from grpo import GRPOConfig


def test_group_size_one_explains_why() -> None:
    with pytest.raises(
        ValueError, match=r"group_size=1 is not allowed: GRPO needs group_size >= 2.*nothing to compare"
    ):
        GRPOConfig(group_size=1)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"batch_size": 0}, r"batch_size=0 .*integer >= 1"),
        ({"learning_rate": 0.0}, r"learning_rate=0.0 .*number > 0"),
        ({"learning_rate": float("nan")}, r"learning_rate=nan"),
        ({"clip_epsilon": 1.5}, r"clip_epsilon=1.5 .*> 0.0 and < 1.0.*Exactly 1 is allowed too"),
        ({"kl_coeff": -0.1}, r"kl_coeff=-0.1 .*>= 0.0"),
        ({"kl_estimator": "k5"}, r"kl_estimator='k5'.*\('k1', 'k2', 'k3'\)"),
        ({"loss_aggregation": "sum"}, r"loss_aggregation='sum'.*token-mean"),
        ({"device": "tpu"}, r"device='tpu'"),
        ({"num_epochs_per_update": 0}, r"num_epochs_per_update=0"),
        ({"max_grad_norm": 0.0}, r"max_grad_norm=0.0"),
        ({"group_size": 4.0}, r"group_size=4.0 .*integer"),
    ],
)
def test_bad_values_say_what_is_allowed(kwargs: dict[str, object], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        GRPOConfig(**kwargs)  # type: ignore[arg-type]


def test_mini_batch_that_does_not_divide_lists_valid_values() -> None:
    with pytest.raises(
        ValueError, match=r"mini_batch_size=5 .*batch_size=12.*Valid values: \[1, 2, 3, 4, 6, 12\]"
    ):
        GRPOConfig(batch_size=12, mini_batch_size=5)
    with pytest.raises(
        ValueError, match=r"micro_batch_size=4 .*mini_batch_size=6.*Valid values: \[1, 2, 3, 6\]"
    ):
        GRPOConfig(batch_size=12, mini_batch_size=6, micro_batch_size=4)


def test_every_field_has_help_text_and_print_shows_resolved_and_derived() -> None:
    cfg = GRPOConfig(group_size=4, batch_size=6, mini_batch_size=2, num_epochs_per_update=3)
    for f in dataclasses.fields(cfg):
        assert f.metadata.get("help"), f"field {f.name} has no help text"
    text = str(cfg)
    for f in dataclasses.fields(cfg):
        assert f"{f.name} " in text
    assert "samples_per_step" in text
    assert "= 24" in text
    assert cfg.optimizer_steps_per_step == 9
    assert "optimizer_steps_per_step" in text


def test_seed_names_exist() -> None:
    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    seed_names = {
        "group_size",
        "batch_size",
        "learning_rate",
        "num_epochs_per_update",
        "clip_epsilon",
        "kl_coeff",
        "entropy_coeff",
        "normalize_advantages",
        "max_grad_norm",
        "device",
        "reference_update_freq",
        "checkpoint_freq",
    }
    assert seed_names <= names


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (
            {"learning_rate": float("inf")},
            r"^GRPOConfig\.learning_rate=inf is not allowed: expected a finite number > 0\.0\. "
            r"Valid: e\.g\. learning_rate=0\.0003 \(the default\)\.$",
        ),
        (
            {"learning_rate": float("nan")},
            r"^GRPOConfig\.learning_rate=nan is not allowed: expected a finite number > 0\.0\. Valid: "
            r"e\.g\. learning_rate=0\.0003",
        ),
        ({"learning_rate": -1e-3}, r"^GRPOConfig\.learning_rate=-0\.001 is not allowed: expected a finite"),
        (
            {"weight_decay": float("inf")},
            r"^GRPOConfig\.weight_decay=inf is not allowed: expected a finite number >= 0\.0\. "
            r"Valid: e\.g\. weight_decay=0\.0 \(the default\)\.$",
        ),
        ({"weight_decay": float("-inf")}, r"^GRPOConfig\.weight_decay=-inf is not allowed"),
        ({"kl_coeff": float("inf")}, r"^GRPOConfig\.kl_coeff=inf .*finite number >= 0\.0.*kl_coeff=0\.04"),
        ({"entropy_coeff": float("inf")}, r"^GRPOConfig\.entropy_coeff=inf .*finite"),
        ({"advantage_eps": float("inf")}, r"^GRPOConfig\.advantage_eps=inf .*finite number > 0\.0"),
    ],
)
def test_non_finite_learning_rate_and_weight_decay_are_refused(
    kwargs: dict[str, float], pattern: str
) -> None:
    """One optimizer step with lr or weight decay inf makes every weight non-finite."""
    with pytest.raises(ValueError, match=pattern):
        GRPOConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"lr": 1e-3}, r"^GRPOConfig got unknown field lr=0\.001 \(did you mean learning_rate=0\.001\?\)\.$"),
        (
            {"lerning_rate": 0.1},
            r"^GRPOConfig got unknown field lerning_rate=0\.1 \(did you mean learning_rate=0\.1",
        ),
        ({"beta": 0.04}, r"unknown field beta=0\.04 \(did you mean kl_coeff=0\.04\?\)"),
        ({"num_generations": 8}, r"unknown field num_generations=8 \(did you mean group_size=8\?\)"),
        (
            {"lr": 1e-3, "epochs": 2},
            r"unknown fields lr=0\.001 \(did you mean learning_rate=0\.001\?\), epochs=2 \(did you mean "
            r"num_epochs_per_update=2\?\)\.$",
        ),
        (
            {"xyzzy": 1},
            r"^GRPOConfig got unknown field xyzzy=1\. Valid fields: adaptive_lr_kl, .*whiten",
        ),
    ],
)
def test_unknown_keywords_name_the_field_meant(kwargs: dict[str, object], pattern: str) -> None:
    with pytest.raises(TypeError, match=pattern):
        GRPOConfig(**kwargs)  # type: ignore[arg-type]


def test_the_constructor_keeps_the_dataclass_signature_and_errors() -> None:
    sig = inspect.signature(GRPOConfig)
    assert list(sig.parameters) == [f.name for f in dataclasses.fields(GRPOConfig)]
    assert sig.parameters["learning_rate"].default == 3e-4
    cfg = GRPOConfig(learning_rate=0.1)
    assert dataclasses.replace(cfg, group_size=4).learning_rate == 0.1
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    with pytest.raises(TypeError, match=r"positional arguments but"):  # Python's own, unchanged
        GRPOConfig(*range(len(dataclasses.fields(GRPOConfig)) + 1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"unknown fields \['lr'\]; valid: .*Did you mean learning_rate=1"):
        GRPOConfig.recipe("dapo", lr=1)
