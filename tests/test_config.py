import dataclasses
import inspect
import pickle

import pytest

from grpo import GRPOConfig
from grpo.algorithms.mini_batches import divisors, mini_batch_for_count
from grpo.algorithms.recipes import RECIPES
from grpo.config import SPELLINGS, optimizer_steps_per_step


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
        (
            {"num_generations": 8},
            r"^GRPOConfig got num_generations=8, seed 003's spelling of group_size: pass group_size=8\. "
            r"\(GRPOConfig\.from_dict reads every spelling\.\)$",
        ),
        (
            {"normalize_advantages": False},
            r"normalize_advantages=False, grpo 0\.2's spelling of advantage_scale: "
            r"pass advantage_scale='none'",
        ),
        ({"adv_norm": "mean"}, r"^GRPOConfig got adv_norm='mean' is not allowed: choose one of \['mean_std'"),
        (
            {"lr": 1e-3, "epochs": 2},
            r"unknown fields lr=0\.001 \(did you mean learning_rate=0\.001\?\), epochs=2 \(did you mean "
            r"num_epochs_per_update=2\?\)\.$",
        ),
        (
            {"xyzzy": 1},
            r"^GRPOConfig got unknown field xyzzy=1\. Valid: adaptive_lr_kl, .*whiten",
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
    with pytest.raises(
        TypeError,
        match=r"^GRPOConfig.recipe\('dapo'\) got unknown field lr=1 \(did you mean learning_rate=1\?\)\.$",
    ):
        GRPOConfig.recipe("dapo", lr=1)


# ---- one alias table, one "did you mean" (grpo.config.SPELLINGS, grpo.runtime.spellings) ----------
def test_the_constructor_is_the_dataclass_init_and_spellings_go_through_from_dict() -> None:
    """No ``__init__`` is replaced: unknown keywords are named by `SpelledFields.__new__`, before
    the dataclass's own ``__init__``; the accepted spellings are read by `GRPOConfig.from_dict`."""
    assert not hasattr(GRPOConfig.__init__, "__wrapped__")
    assert GRPOConfig.__init__.__qualname__ == "GRPOConfig.__init__"
    assert "__init__" in GRPOConfig.__dict__  # the dataclass's, generated in the class body
    cfg = GRPOConfig.from_dict(
        {"num_generations": 3, "kl_coef": 0.1, "clip_range": 0.3, "save_steps": 7, "adv_norm": "mean_only"}
    )
    assert (cfg.group_size, cfg.kl_coeff, cfg.clip_epsilon, cfg.checkpoint_freq) == (3, 0.1, 0.3, 7)
    assert cfg.advantage_scale == "none"
    with pytest.raises(
        TypeError, match=r"^GRPOConfig got unknown field lr=0\.1 \(did you mean learning_rate=0\.1\?\)"
    ):
        GRPOConfig.from_dict({"lr": 0.1})  # another library's name: offered, not read


@pytest.mark.parametrize(
    ("saved", "expect"),
    [  # a config as grpo 0.2 saved it (to_dict) reads the same: A = r - mean, 2 optimizer steps of 4
        (
            {"normalize_advantages": False, "advantage_scale": None, "batch_size": 8, "num_mini_batches": 4,
             "mini_batch_size": None},
            ("none", 2, 4),
        ),
        ({"normalize_advantages": False, "advantage_scale": "batch", "batch_size": 6}, ("batch", None, 1)),
        ({"normalize_advantages": True, "advantage_scale": None, "batch_size": 6, "num_mini_batches": 4},
         ("group", 1, 6)),  # 6 // 4 = 1
        ({"batch_size": 6, "num_mini_batches": 3, "num_epochs_per_update": 2}, ("group", 2, 6)),
    ],
)  # fmt: skip
def test_overlapping_fields_read_as_the_one_field(
    saved: dict[str, object], expect: tuple[object, ...]
) -> None:
    """normalize_advantages -> advantage_scale ('group' / 'none'; an advantage_scale given too
    decides, as in grpo 0.2); num_mini_batches=k -> the largest mini_batch_size dividing
    batch_size that is <= batch_size // k (grpo 0.2's rule, exactly)."""
    cfg = GRPOConfig.from_dict(saved)
    assert (cfg.advantage_scale, cfg.mini_batch_size, cfg.optimizer_steps_per_step) == expect


def test_a_spelling_that_contradicts_its_field_is_refused() -> None:
    with pytest.raises(
        ValueError,
        match=r"adv_norm='mean_std' means advantage_scale='group' \(seed 001's spelling\), but "
        r"advantage_scale='none' was given too\. Pass only advantage_scale\.",
    ):
        GRPOConfig.from_dict({"adv_norm": "mean_std", "advantage_scale": "none"})
    with pytest.raises(ValueError, match=r"num_mini_batches=0 is not allowed: expected an integer >= 1"):
        GRPOConfig.from_dict({"num_mini_batches": 0})
    with pytest.raises(
        TypeError,
        match=r"got num_mini_batches=2, grpo 0\.2 / PPO's spelling of mini_batch_size: "
        r"pass mini_batch_size=4",
    ):
        GRPOConfig(num_mini_batches=2)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match=r"advantage_scale=None is not allowed: choose one of"):
        GRPOConfig(advantage_scale=None)  # type: ignore[arg-type]


def test_recipes_use_field_names_and_small_policy_keeps_4_steps_per_epoch() -> None:
    """Every recipe value is a GRPOConfig field (no other spelling). small_policy's mini-batches,
    ``StepsPerEpoch(4)``, give 10 epochs x 4 = 40 optimizer steps per rollout whenever 4 divides the
    batch size, and for every batch size the mini-batch grpo 0.2's ``num_mini_batches=4`` gave (a
    group is never split: B = 6 -> 6 steps of one state, B = 2 -> 2)."""
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    for name, recipe in RECIPES.items():
        assert set(recipe.values) <= fields, (name, set(recipe.values) - fields)
    for batch_size, group_size in [(4, 2), (8, 8), (16, 4), (64, 16)]:
        cfg = GRPOConfig.recipe("small_policy", batch_size=batch_size, group_size=group_size)
        assert optimizer_steps_per_step(cfg.batch_size, cfg.mini_batch_size, cfg.num_epochs_per_update) == 40
    steps = {b: GRPOConfig.recipe("small_policy", batch_size=b).optimizer_steps_per_step for b in (1, 2, 6)}
    assert steps == {1: 10, 2: 20, 6: 60}
    for b in range(1, 41):
        as_02 = GRPOConfig.from_dict({"batch_size": b, "num_mini_batches": 4}).mini_batch_size
        assert GRPOConfig.recipe("small_policy", batch_size=b).mini_batch_size == as_02, b
        assert GRPOConfig.recipe("finetune_success", batch_size=b).mini_batch_size == as_02, b
    assert GRPOConfig.recipe("small_policy", batch_size=8, mini_batch_size=8).optimizer_steps_per_step == 10
    assert GRPOConfig.recipe("small_policy", batch_size=8, num_mini_batches=2).mini_batch_size == 4


def test_a_count_of_mini_batches_is_a_divisor_found_without_a_long_search() -> None:
    """``mini_batch_for_count``: the largest divisor of B that is <= B // k, by hand; a batch above
    2**40 is refused at once (the search over every integer up to B hung on 2**61 - 1)."""
    assert divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]
    assert divisors(2**40 + 1) == []
    assert [mini_batch_for_count(12, k) for k in (1, 2, 3, 4, 5, 7, 13)] == [12, 6, 4, 3, 2, 1, 1]
    assert mini_batch_for_count(2**40, 3) == 2**38
    with pytest.raises(ValueError, match=r"needs batch_size as an integer >= 1 and <= 2\*\*40"):
        GRPOConfig.from_dict({"batch_size": 2**61 - 1, "num_mini_batches": 2})
    with pytest.raises(ValueError, match=r"divide batch_size=2305843009213693951 .* Valid values: its div"):
        GRPOConfig(batch_size=2**61 - 1, mini_batch_size=2)


def test_the_cli_reads_the_same_table() -> None:
    """Every accepted spelling of SPELLINGS is a grpo-train flag (the field's own option when the
    values are the same), and an unknown flag gets the suggestion GRPOConfig gives."""
    from grpo.llm.cli_options import build_parser
    from grpo.runtime.spellings import did_you_mean

    parser = build_parser()
    for name, spelling in SPELLINGS.items():
        flag = "--" + name.replace("_", "-")
        if not spelling.accepted:  # offered only (--num-epochs is grpo-train's own dataset passes)
            action = parser._option_string_actions.get(flag)
            assert action is None or action.dest != spelling.field, name
            continue
        action = parser._option_string_actions[flag]
        assert action.dest == (spelling.field if spelling.values is None else name), name
    fields = [f.name for f in dataclasses.fields(GRPOConfig)]
    assert did_you_mean("beta", fields, SPELLINGS) == ["kl_coeff"]
    with pytest.raises(SystemExit, match=r"--beta: did you mean --kl-coeff\?"):
        parser.parse(["--beta", "0.1"])
