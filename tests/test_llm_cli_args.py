"""grpo-train's options from dataclasses (grpo.runtime.dataclass_args): every GRPOConfig knob once,
seed 003's flags as spellings of the same options, recipes, YAML/JSON files, unknown keys, and a
resumed run that equals the uninterrupted one bitwise."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest

from grpo.config import GRPOConfig
from grpo.runtime.dataclass_args import DataclassArgumentParser, UsageError, coerce_value
from grpo.runtime.spellings import Spelling

SEED_003_FLAGS = [
    "--model-name", "--batch-size", "--num-epochs", "--learning-rate", "--num-generations",
    "--max-new-tokens", "--kl-coef", "--clip-range", "--temperature", "--gradient-accumulation-steps",
    "--max-grad-norm", "--warmup-steps", "--output-dir", "--logging-steps", "--save-steps",
    "--use-wandb", "--wandb-project", "--wandb-run-name", "--device",
]  # fmt: skip


# ---- the generic parser, on a toy dataclass --------------------------------------------------------
@dataclass
class Toy:
    flag: bool = field(default=False, metadata={"help": "a switch"})
    on: bool = field(default=True, metadata={"help": "on by default"})
    mode: Literal["a", "b"] = field(default="a", metadata={"help": "100% a or b"})
    scale: Literal["group", "none"] | None = field(default=None, metadata={"help": "None: derived"})
    threads: Literal["auto"] | int | None = field(default="auto", metadata={"help": "threads"})
    count: int | None = field(default=3, metadata={"help": "a count"})
    rate: float = field(default=0.5, metadata={"help": "a rate"})
    names: list[str] | None = field(default=None, metadata={"help": "repeatable"})
    some_name: str = field(default="x", metadata={"help": "a name"})


def toy_parser() -> DataclassArgumentParser:
    p = DataclassArgumentParser(prog="toy", allow_abbrev=False)
    p.add_dataclass(Toy, aliases={"rate": ("--lr",)}, defaults={"count": 7})
    return p


def test_values_from_the_command_line_by_type() -> None:
    parse = toy_parser().parse
    assert parse([]).values == {
        "flag": False, "on": True, "mode": "a", "scale": None, "threads": "auto", "count": 7,
        "rate": 0.5, "names": None, "some_name": "x",
    }  # fmt: skip
    v = parse(
        ["--flag", "--no-on", "--mode", "b", "--count", "none", "--lr", "1e-3", "--some_name", "y"]
    ).values
    assert (v["flag"], v["on"], v["mode"], v["count"], v["rate"], v["some_name"]) == (
        True,
        False,
        "b",
        None,
        1e-3,
        "y",
    )
    v = parse(["--flag", "false", "--on", "yes"]).values
    assert (v["flag"], v["on"]) == (False, True)
    assert parse(["--threads", "4"]).values["threads"] == 4
    assert parse(["--threads", "none"]).values["threads"] is None
    # a Literal that has 'none' keeps it; None is then spelled 'null'
    assert parse(["--scale", "none"]).values["scale"] == "none"
    assert parse(["--scale", "null"]).values["scale"] is None
    assert parse(["--names", "a", "--names", "b"]).values["names"] == ["a", "b"]
    assert parse(["--flag"]).explicit == {"flag"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--mode", "c"], "argument --mode: expected 'a' or 'b', got 'c'"),
        (["--count", "1.5"], "argument --count: expected an integer or none, got '1.5'"),
        (["--flag", "maybe"], "expected true or false"),
        (["--no-flag", "true"], "--no-flag takes no value"),
        (["--rat", "1"], "--rat: did you mean --rate"),
    ],
)
def test_bad_command_lines_exit_2_with_the_reason(argv: list[str], message: str) -> None:
    with pytest.raises(UsageError, match=re.escape(message)) as e:
        toy_parser().parse(argv)
    assert e.value.code == 2


def test_config_file_values_are_typed_and_the_command_line_wins(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("lr: 1e-6\nsome-name: z\nnames: one\nthreads: 2\nflag: true\nscale: null\n")
    parsed = toy_parser().parse(["--config", str(cfg), "--names", "two", "--names", "three"])
    v = parsed.values
    assert v["rate"] == 1e-6  # YAML reads 1e-6 as a string; the option's type makes it a float
    assert (v["some_name"], v["threads"], v["flag"], v["scale"]) == ("z", 2, True, None)
    assert v["names"] == ["two", "three"]  # a list on the command line replaces the file's
    assert parsed.explicit == {"rate", "some_name", "names", "threads", "flag", "scale"}
    assert parsed.file == str(cfg)


def test_unknown_and_repeated_file_keys_are_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"rat": 1, "zzz": 2}))
    with pytest.raises(UsageError, match=r"'rat' \(did you mean rate\?\), 'zzz'\. Valid: .*some_name"):
        toy_parser().parse(["--config", str(cfg)])
    cfg.write_text(json.dumps({"rate": 1, "lr": 2}))
    with pytest.raises(UsageError, match="gives 'rate' twice"):
        toy_parser().parse(["--config", str(cfg)])
    with pytest.raises(ValueError, match=r"k: expected 'a' or 'b', got 3 \(int\)"):
        coerce_value("k", 3, Literal["a", "b"])


@dataclass(frozen=True)
class Sampling:
    group_size: int | None = field(default=None, metadata={"help": "samples"})
    ks: Sequence[int] = field(default=(), metadata={"help": "the k"})


def test_add_dataclass_group_is_a_group_or_the_title_of_a_new_one() -> None:
    """``group=`` takes an argument group of the parser or a title (a new group of that title);
    None titles the new group with the class name. The options land in that group's help."""
    p = DataclassArgumentParser(prog="toy", allow_abbrev=False)
    p.add_dataclass(Toy, group="Toy knobs")
    existing = p.add_argument_group("Sampling knobs")
    p.add_dataclass(Sampling, group=existing, prefix="eval_")
    p.add_dataclass(Sampling, prefix="train_")
    titles = {g.title: [a.dest for a in g._group_actions] for g in p._action_groups}
    assert "rate" in titles["Toy knobs"]
    assert titles["Sampling knobs"] == ["eval_group_size", "eval_ks"]
    assert titles["Sampling"] == ["train_group_size", "train_ks"]


def test_prefixed_dataclass_lists_of_several_values_and_file_translation(tmp_path: Path) -> None:
    """prefix= puts a dataclass's options under a name space (the same field name twice, no
    clash); list and Sequence fields take several values after one flag, or the flag repeated;
    spellings= makes each accepted spelling a flag and a file key (mapped values read as the
    field's, the same values one more flag of the field's option)."""
    spellings = {
        "old_rate": Spelling("rate", "toy 0.1", {"slow": 0.25, "fast": 1.0}, Literal["slow", "fast"]),
        "speed": Spelling("rate", "toy 0.1"),
        "velocity": Spelling("rate", "another toy", accepted=False),
    }
    p = DataclassArgumentParser(prog="toy", allow_abbrev=False, spellings=spellings)
    p.add_dataclass(Toy)
    assert p.add_dataclass(Sampling, prefix="eval_") == ["eval_group_size", "eval_ks"]
    assert p.add_dataclass(Sampling, prefix="train_", exclude=("ks",)) == ["train_group_size"]
    parsed = p.parse(
        ["--eval-ks", "1", "4", "--eval-ks", "2", "--train-group-size", "3", "--names", "a", "b"]
    )
    assert parsed.values["eval_ks"] == [1, 4, 2]
    assert parsed.values["names"] == ["a", "b"]
    assert parsed.for_dataclass(Sampling, prefix="eval_") == {"group_size": None, "ks": [1, 4, 2]}
    assert parsed.for_dataclass(Sampling, prefix="train_", explicit_only=True) == {"group_size": 3}
    assert "--eval-group-size INT|none" in p.format_help()
    cfg = tmp_path / "c.yaml"
    cfg.write_text("old_rate: slow\neval-ks: 8\n")
    v = p.parse(["--config", str(cfg)]).values
    assert (v["rate"], v["eval_ks"]) == (0.25, [8])
    assert p.parse(["--old-rate", "fast"]).values["rate"] == 1.0
    assert p.parse(["--speed", "0.5"]).values["rate"] == 0.5
    cfg.write_text("speed: 2\n")
    assert p.parse(["--config", str(cfg), "--old-rate", "slow"]).values["rate"] == 0.25  # command line wins
    cfg.write_text("old_rate: bad\n")
    with pytest.raises(UsageError, match=r"c\.yaml: old_rate: expected 'slow' or 'fast', got 'bad'"):
        p.parse(["--config", str(cfg)])
    cfg.write_text("old_rate: slow\nrate: 1.0\n")
    with pytest.raises(
        UsageError, match=r"old_rate='slow' means rate=0\.25 \(toy 0\.1's spelling\), but rate=1\.0"
    ):
        p.parse(["--config", str(cfg)])
    with pytest.raises(UsageError, match=r"--velocity: did you mean --rate\?"):
        p.parse(["--velocity", "1"])
    with pytest.raises(ValueError, match=r"prefix='-x'"):
        p.add_dataclass(Sampling, prefix="-x")


# ---- grpo-train -----------------------------------------------------------------------------------
def option_lines(help_text: str) -> list[list[str]]:
    """The option strings of each option of a --help text (its invocation lines)."""
    lines = []
    for line in help_text.splitlines():
        m = re.match(r"^  (-[-\w]+(?:(?: [^,\s]+)?, -[-\w]+)*)", line)
        if m:
            lines.append(re.findall(r"--?[\w][-\w]*", m.group(1)))
    return lines


def test_help_lists_every_knob_once() -> None:
    """Each GRPOConfig field (a field added later too), each option of the command and each of
    seed 003's flags is on exactly one option line of --help, and no flag is on two."""
    from grpo.llm.cli_options import OPTION_GROUPS, build_parser

    text = build_parser().format_help()
    flags = [f for line in option_lines(text) for f in line]
    assert len(flags) == len(set(flags)), sorted({f for f in flags if flags.count(f) > 1})
    from grpo.training.evaluation import EvalOptions

    fields = [f.name for f in dataclasses.fields(GRPOConfig)]
    fields += [f.name for _, cls in OPTION_GROUPS for f in dataclasses.fields(cls)]
    fields += ["eval_" + f.name for f in dataclasses.fields(EvalOptions)]  # --eval-answer included
    for name in fields:
        assert flags.count("--" + name.replace("_", "-")) == 1, name
    for flag in [*SEED_003_FLAGS, "--recipe", "--resume", "--fsdp", "--deepspeed", "--config"]:
        assert flags.count(flag) == 1, flag
    lines = option_lines(text)
    assert ["--kl-coeff", "--kl-coef"] in lines  # an alias is a spelling of the same option
    assert ["--fsdp", "--no-fsdp"] in lines


def test_seed_flags_are_the_config_fields_and_defaults_stay() -> None:
    from grpo.llm.cli import build_config, parse_args

    base = ["--model-name", "m", "--dataset", "d.jsonl"]
    args = parse_args(base)
    assert (args.group_size, args.kl_coeff, args.clip_epsilon, args.checkpoint_freq) == (4, 0.04, 0.2, 500)
    assert not hasattr(args, "kl_coef")  # one name per knob: the field's
    assert (args.batch_size, args.learning_rate, args.num_epochs, args.warmup_steps) == (4, 1e-6, 1, 0)
    assert (args.device, args.seed, args.max_grad_norm, args.temperature) == ("auto", 0, 1.0, 0.7)
    args = parse_args(
        [*base, "--num-generations", "3", "--kl-coef", "0.1", "--clip-range", "0.3", "--save-steps", "0",
         "--gradient-accumulation-steps", "2", "--fsdp", "--deepspeed", "off", "--max-grad-norm", "none"]
    )  # fmt: skip
    config = build_config(args)
    assert (config.group_size, config.kl_coeff, config.clip_epsilon) == (3, 0.1, 0.3)
    assert (config.checkpoint_freq, config.micro_batch_size, config.fsdp, config.deepspeed) == (
        None,
        2,
        True,
        "off",
    )
    assert config.max_grad_norm is None
    # seed 001's adv_norm and grpo 0.2's normalize_advantages / num_mini_batches: flags and file keys
    spelled = build_config(
        parse_args([*base, "--adv-norm", "mean_only", "--batch-size", "8", "--num-mini-batches", "4"])
    )
    assert (spelled.advantage_scale, spelled.mini_batch_size) == ("none", 2)
    assert build_config(parse_args([*base, "--no-normalize-advantages"])).advantage_scale == "none"
    explicit = build_config(
        parse_args([*base, "--normalize-advantages", "false", "--advantage-scale", "batch"])
    )
    assert explicit.advantage_scale == "batch"  # the field decides, as in grpo 0.2
    with pytest.raises(SystemExit, match=r"adv_norm='mean_std' means advantage_scale='group'"):
        parse_args([*base, "--adv-norm", "mean_std", "--advantage-scale", "none"])


def test_recipe_then_explicit_options_win(tmp_path: Path) -> None:
    from grpo.llm.cli import build_config, parse_args

    base = ["--model-name", "m", "--dataset", "d.jsonl"]
    dapo = build_config(
        parse_args([*base, "--recipe", "dapo", "--batch-size", "4", "--mini-batch-size", "2"])
    )
    assert dapo.recipe_name == "dapo"
    assert (dapo.clip_epsilon_high, dapo.drop_zero_variance_groups, dapo.kl_coeff) == (0.28, True, 0.0)
    assert dapo.group_size == 16  # the recipe's, over this command's default of 4
    assert (dapo.batch_size, dapo.mini_batch_size) == (4, 2)  # explicit options win
    dr = build_config(parse_args([*base, "--recipe", "dr_grpo", "--max-new-tokens", "64"]))
    assert dr.loss_normaliser == 64.0  # Dr. GRPO's constant: the generation budget
    cfg = tmp_path / "run.yaml"
    cfg.write_text("recipe: cispo\npolicy_loss: gspo\nclip-epsilon: 0.001\nkl_coef: 0.02\n")
    from_file = build_config(parse_args([*base, "--config", str(cfg), "--kl-coeff", "0.03"]))
    assert (from_file.recipe_name, from_file.policy_loss, from_file.clip_epsilon) == ("cispo", "gspo", 0.001)
    assert from_file.kl_coeff == 0.03
    with pytest.raises(SystemExit, match=r"mini_batch_size=32 .*--recipe dapo set"):
        parse_args([*base, "--recipe", "dapo", "--batch-size", "4"])
    with pytest.raises(SystemExit, match="invalid choice: 'dappo'"):
        parse_args([*base, "--recipe", "dappo"])


def test_unknown_keys_and_bad_values_name_the_fix(tmp_path: Path) -> None:
    from grpo.llm.cli import parse_args

    base = ["--model-name", "m", "--dataset", "d.jsonl"]
    cfg = tmp_path / "c.yaml"
    cfg.write_text("beta: 0.1\nloss-type: dr_grpo\n")
    with pytest.raises(SystemExit, match=r"'beta' \(did you mean kl_coeff\?\), 'loss_type' \(did you mean"):
        parse_args([*base, "--config", str(cfg)])
    with pytest.raises(SystemExit, match=r"--beta: did you mean --kl-coeff\?"):
        parse_args([*base, "--beta", "0.1"])
    with pytest.raises(SystemExit, match=r"GRPOConfig.clip_epsilon=1.5 is not allowed"):
        parse_args([*base, "--clip-range", "1.5"])
    with pytest.raises(SystemExit, match="set the same thing"):
        parse_args([*base, "--gradient-accumulation-steps", "2", "--micro-batch-size", "2"])


# ---- runs on a tiny model -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    from tests.llm_helpers import build_model, build_tokenizer

    d = tmp_path_factory.mktemp("cli_args")
    tok = build_tokenizer(d / "model", chat_template=True)  # string prompts stay raw
    build_model(d / "model", tok)
    with open(d / "data.jsonl", "w") as f:
        for i in range(6):
            f.write(json.dumps({"q": f"{i}+1=", "answer": str(i + 1)}) + "\n")
    return d


def run_args(setup: Path, out: Path, *more: str) -> list[str]:
    return [
        "--model-name", str(setup / "model"), "--dataset", str(setup / "data.jsonl"), "--prompt-column", "q",
        "--batch-size", "2", "--num-generations", "3", "--max-new-tokens", "3", "--device", "cpu",
        "--output-dir", str(out), "--no-progress", "--logging-steps", "1", "--learning-rate", "0.05",
        "--reward", f"{Path(__file__).with_name('llm_distributed_toys.py')}:char_score", *more,
    ]  # fmt: skip


def test_dapo_run_from_the_command_line(setup: Path, tmp_path: Path) -> None:
    from grpo.llm.cli import main

    out = tmp_path / "dapo"
    assert main(run_args(setup, out, "--recipe", "dapo", "--mini-batch-size", "1", "--max-steps", "2")) == 0
    state = json.loads((out / "final_model" / "trainer_state.json").read_text())
    args = state["args"]
    assert (args["recipe_name"], args["clip_epsilon_high"], args["kl_coeff"], args["group_size"]) == (
        "dapo", 0.28, 0.0, 3,
    )  # fmt: skip
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1.0, 2.0]
    assert all("advantage/frac_dropped_groups" in m for m in lines)  # DAPO's dynamic-sampling filter
    assert all(m["kl/ref"] == 0.0 for m in lines)  # no KL term: no reference model


def test_resumed_run_equals_the_uninterrupted_run_bitwise(setup: Path, tmp_path: Path) -> None:
    """4 steps in one run against 2 steps, then --resume to 4 (the data position, optimizer and RNG
    streams come from the checkpoint): the same weights bit for bit and the same step records."""
    from safetensors.torch import load_file

    from grpo.llm.cli import main

    common = ["--kl-coef", "0.1", "--save-steps", "2", "--seed", "3"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert main(run_args(setup, whole, *common, "--max-steps", "4")) == 0
    assert main(run_args(setup, parts, *common, "--max-steps", "2")) == 0
    with pytest.raises(SystemExit, match="no complete trainer checkpoint"):
        main(run_args(setup, tmp_path / "empty", *common, "--max-steps", "4", "--resume"))
    assert main(run_args(setup, parts, *common, "--max-steps", "4", "--resume")) == 0

    a = load_file(whole / "final_model" / "model.safetensors")
    b = load_file(parts / "final_model" / "model.safetensors")
    base = load_file(setup / "model" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(a[k].equal(b[k]) for k in a)
    assert any(not a[k].equal(base[k]) for k in a)  # it trained
    records = [
        [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (whole, parts)
    ]
    assert [r["step"] for r in records[1]] == [1.0, 2.0, 3.0, 4.0]  # the resumed run appends
    for key in ("reward/mean", "loss/total", "kl/ref", "grad/norm", "optim/lr"):
        assert [r[key] for r in records[0]] == [r[key] for r in records[1]], key
    assert sorted(p.name for p in (parts / "checkpoints").glob("step-*")) == [
        "step-00000002",
        "step-00000004",
    ]


# ---- the flags of evaluation, rewards, generation and outputs ----------------------------------
def test_new_flags_parse_and_are_checked_before_any_model_loads() -> None:
    from grpo.llm.cli import build_eval_options, build_rewards, parse_args
    from grpo.llm.rewards import last_number

    base = ["--model-name", "m", "--dataset", "d.jsonl"]
    args = parse_args(
        [*base, "--eval-dataset", "e.jsonl", "--eval-every", "5", "--eval-ks", "1", "4",
         "--eval-group-size", "4", "--eval-temperature", "0.6", "--eval-batch-size", "2",
         "--eval-answer", "last_number",
         "--eval-success-threshold", "0.5", "--eval-success-component", "exact_match",
         "--reward-convention", "trl", "--min-new-tokens", "2", "--max-model-len", "128",
         "--use-separate-reference-adapter", "--log-completions-every", "3"]
    )  # fmt: skip
    assert (args.eval_dataset, args.eval_every, args.reward_convention) == ("e.jsonl", 5, "trl")
    assert (args.min_new_tokens, args.max_model_len, args.use_separate_reference_adapter) == (2, 128, True)
    assert args.log_completions_every == 3
    options = build_eval_options(args)
    assert options is not None
    assert (options.group_size, options.temperature, options.batch_size, options.ks) == (4, 0.6, 2, (1, 4))
    assert (options.answer, options.success_threshold, options.success_component) == (
        last_number,
        0.5,
        "exact_match",
    )
    trl = Path(__file__).parent / "data" / "trl_style_rewards.py"
    fns = [f"{trl}:echo_prompt_reward", "exact_match"]  # f(prompts, completions, **kwargs): auto reads grpo
    for convention, want in (("auto", "grpo"), ("trl", "trl")):
        rewards = build_rewards(parse_args([*base, "--reward", *fns, "--reward-convention", convention]))
        assert rewards.signatures["echo_prompt_reward"].convention == want
        assert rewards.signatures["exact_match"].convention == "grpo"  # the ready rewards keep theirs
    plain = parse_args(base)
    assert build_eval_options(plain) is None
    assert (plain.reward_convention, plain.min_new_tokens, plain.max_model_len) == ("auto", 0, None)
    assert (plain.use_separate_reference_adapter, plain.log_completions_every) == (False, None)
    bad = {
        "--eval-dataset needs --eval-every N too": ["--eval-dataset", "e.jsonl"],
        "--eval-every needs --eval-dataset PATH too": ["--eval-every", "2"],
        r"--eval-ks, --eval-temperature set how to evaluate, but no --eval-dataset": [
            "--eval-ks", "2", "--eval-temperature", "1.0",
        ],
        r"evaluation ks=\[8\] holds k=\[8\] larger than the evaluation group size 4": [
            "--eval-dataset", "e.jsonl", "--eval-every", "1", "--eval-ks", "8",
        ],
        r"unknown --eval-answer 'after:'; use last_number, boxed, after:MARKER": [
            "--eval-dataset", "e.jsonl", "--eval-every", "1", "--eval-ks", "2", "--eval-answer", "after:",
        ],
        r"evaluation answer= is given but ks is empty": [
            "--eval-dataset", "e.jsonl", "--eval-every", "1", "--eval-answer", "boxed",
        ],
        r"unknown --answer-extractor 'box'": ["--answer-extractor", "box"],
        r"--eval-every=0 must be >= 1": ["--eval-dataset", "e.jsonl", "--eval-every", "0"],
        r"argument --reward-convention: expected 'auto', 'grpo' or 'trl', got 'tlr'": [
            "--reward-convention", "tlr",
        ],
    }  # fmt: skip
    for message, more in bad.items():
        with pytest.raises(SystemExit, match=message):
            parse_args([*base, *more])


def test_seed_001_names_in_a_config_file_are_translated(tmp_path: Path) -> None:
    """adv_norm and use_kl_advantage_shaping (seed 001's GRPOConfig keywords) are accepted in
    --config files, through grpo.config.SPELLINGS (the one alias table)."""
    from grpo.llm.cli import build_config, parse_args

    base = ["--model-name", "m", "--dataset", "d.jsonl", "--config"]
    cfg = tmp_path / "seed.yaml"
    cfg.write_text("adv_norm: mean_only\nuse-kl-advantage-shaping: true\nkl_coef: 0.05\n")
    config = build_config(parse_args([*base, str(cfg)]))
    assert (config.advantage_scale, config.kl_penalty, config.kl_coeff) == ("none", "advantage", 0.05)
    cfg.write_text("adv_norm: mean_std\nuse_kl_advantage_shaping: false\n")
    config = build_config(parse_args([*base, str(cfg)]))
    assert (config.advantage_scale, config.kl_penalty) == ("group", "loss")
    cfg.write_text("adv_norm: mean_only\nadvantage_scale: group\n")
    with pytest.raises(SystemExit, match=r"adv_norm='mean_only' means advantage_scale='none' .*, but"):
        parse_args([*base, str(cfg)])
    cfg.write_text("adv_norm: zscore\n")
    with pytest.raises(
        SystemExit, match=r"seed\.yaml: adv_norm: expected 'mean_std' or 'mean_only', got 'zscore'"
    ):
        parse_args([*base, str(cfg)])


class TrainerSpy:
    """Records the real `GRPOTrainer`s grpo-train builds (nothing replaced: a subclass)."""

    @staticmethod
    def install(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
        import grpo.llm.cli_run as cli

        made: list[Any] = []

        class Recorded(cli.GRPOTrainer):  # type: ignore[misc,name-defined]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                made.append(self)

        monkeypatch.setattr(cli, "GRPOTrainer", Recorded)
        return made


REWARD_PROBES = """
import json

def record_state(completions, trainer_state, **kwargs):
    with open({path!r}, "a") as f:
        f.write(json.dumps([trainer_state.global_step, trainer_state.max_steps]) + "\\n")
    return [0.0 for _ in completions]

def only_train(completions, split, **kwargs):
    return [1.0 if s == "train" else None for s in split]
"""


def chat_records(n: int, split: str) -> str:
    rows = [
        {"prompt": [{"role": "user", "content": f"{i}+1="}], "answer": str((i + 1) % 10), "split": split}
        for i in range(n)
    ]
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_trl_rewards_evaluation_and_completions_table_from_the_command_line(
    setup: Path, tmp_path: Path
) -> None:
    """Chat prompts, rewards of tests/data/trl_style_rewards.py used unchanged (keyword-only
    ``contains_answer``, ``reward_len_ids``) and reward probes that read ``trainer_state`` and a
    column; --eval-every 1 with its own group size: every step's record in metrics.jsonl holds
    eval/pass@k (written although --logging-steps is 5), pass@1 is the success rate of the
    success component, and the reward counters are the training step's, not the evaluation's."""
    from grpo.llm.cli import main

    (tmp_path / "train.jsonl").write_text(chat_records(4, "train"))
    (tmp_path / "eval.jsonl").write_text(chat_records(2, "eval"))
    probes = tmp_path / "probes.py"
    probes.write_text(REWARD_PROBES.format(path=str(tmp_path / "states.jsonl")))
    trl = Path(__file__).parent / "data" / "trl_style_rewards.py"
    out = tmp_path / "out"
    argv = [
        "--model-name", str(setup / "model"), "--dataset", str(tmp_path / "train.jsonl"),
        "--batch-size", "2", "--num-generations", "3", "--max-new-tokens", "3", "--device", "cpu",
        "--output-dir", str(out), "--no-progress", "--logging-steps", "5", "--max-steps", "2",
        "--reward", f"{trl}:contains_answer", f"{trl}:reward_len_ids=0.1", f"{probes}:record_state",
        f"{probes}:only_train", "--eval-dataset", str(tmp_path / "eval.jsonl"), "--eval-every", "1",
        "--eval-ks", "1", "2", "--eval-group-size", "4", "--eval-answer", "last_number",
        "--eval-success-component", "contains_answer", "--eval-temperature", "1.5",
        "--log-completions-every", "2",
    ]  # fmt: skip
    assert main(argv) == 0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1.0, 2.0]  # step 1: written for its evaluation
    for m in lines:
        assert m["eval/pass@1"] == pytest.approx(m["eval/reward/contains_answer/mean"])
        assert 0.0 <= m["eval/pass@1"] <= m["eval/pass@2"] <= 1.0
        assert "eval/maj@2" in m
        assert m["reward/only_train/applicable"] == 1.0  # the step's call (the evaluation's is 0)
        assert m["throughput/tokens_per_s"] == pytest.approx(m["completion/tokens"] / m["time/step"])
        assert m["completion/mean_length"] == pytest.approx(m["completion/tokens"] / 6)
        assert "lr" not in m  # step()'s optim/lr is the one learning-rate key
        assert m["optim/lr"] == 1e-6
    states = [json.loads(x) for x in (tmp_path / "states.jsonl").read_text().splitlines()]
    assert states == [[0, 2], [0, 2], [1, 2], [1, 2]]  # step 1, its evaluation, step 2, its evaluation
    rows = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2] * 6  # --log-completions-every 2: step 2's 2 x 3 samples
    assert {"prompt", "completion", "reward/contains_answer", "reward", "advantage"} <= set(rows[0])
    assert rows[0]["prompt"].startswith("user: ")


def test_lora_with_a_separate_reference_adapter_and_generation_limits(
    setup: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--use-separate-reference-adapter: the trainer's reference is the frozen adapter inside the
    policy's model (no copy); --min-new-tokens holds every completion to at least 2 tokens; the
    final model is the actor adapter alone (save_llm_checkpoint)."""
    pytest.importorskip("peft")
    from grpo.llm.cli import main
    from grpo.llm.lora import SeparateAdapterReference

    made = TrainerSpy.install(monkeypatch)
    out = tmp_path / "out"
    more = ["--lora", "--lora-r", "2", "--use-separate-reference-adapter", "--kl-coef", "0.1",
            "--min-new-tokens", "2", "--max-model-len", "64", "--max-steps", "1"]  # fmt: skip
    assert main(run_args(setup, out, *more)) == 0
    (trainer,) = made
    assert isinstance(trainer.reference_policy, SeparateAdapterReference)
    assert trainer.reference_policy.policy is trainer.policy
    (m,) = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert m["completion/min_length"] >= 2
    assert m["kl/ref"] >= 0.0
    final = out / "final_model"
    assert (final / "adapter_model.safetensors").exists()
    assert not (final / "reference").exists()  # the reference adapter is not saved
    assert json.loads((final / "grpo_llm_checkpoint.json").read_text())["kind"] == "lora"


# ---- --env: multi-turn episodes from the command line ---------------------------------------------
GUESSING_ENV = Path(__file__).parent / "data" / "guessing_env.py"


def test_env_options_parse_and_are_checked_before_any_model_loads() -> None:
    """--env makes --dataset optional (--num-starts instead); the options that only shape the
    single-turn path, a second source of starts, evaluation, --min-new-tokens and a discount
    without --per-turn-credit are refused with the fix; the episode options need --env."""
    from grpo.llm.cli import build_config, parse_args

    env = ["--model-name", "m", "--env", f"{GUESSING_ENV}:make_env"]
    args = parse_args([*env, "--num-starts", "6", "--max-turns", "3", "--max-total-tokens", "40"])
    assert (args.env, args.num_starts, args.max_turns, args.max_total_tokens) == (
        f"{GUESSING_ENV}:make_env", 6, 3, 40,
    )  # fmt: skip
    assert (args.per_turn_credit, args.start_column, args.dataset) == (False, "start", None)
    args = parse_args([*env, "--dataset", "s.jsonl", "--per-turn-credit", "--gamma", "0.9"])
    assert (args.per_turn_credit, build_config(args).gamma) == (True, 0.9)
    dr = build_config(
        parse_args([*env, "--num-starts", "2", "--recipe", "dr_grpo", "--max-total-tokens", "50"])
    )
    assert dr.loss_normaliser == 50.0  # Dr. GRPO's constant: an episode's token budget
    plain = parse_args(["--model-name", "m", "--dataset", "d.jsonl"])
    assert (plain.env, plain.max_turns, plain.max_total_tokens, plain.num_starts) == (None, 8, 1024, None)
    bad = {
        r"--reward, --reward-convention shape the single-turn rewards and prompts; with --env the "
        r"reward is the environment's": [
            "--num-starts", "2", "--reward", "format", "--reward-convention", "trl",
        ],
        r"--prompt-column shape the single-turn": ["--num-starts", "2", "--prompt-column", "q"],
        "--dataset and --num-starts both give the start states; give one": [
            "--num-starts", "2", "--dataset", "s.jsonl",
        ],
        r"--env needs start states: --dataset PATH .* or --num-starts N": [],
        "--eval-dataset is not available with --env": [
            "--num-starts", "2", "--eval-dataset", "e.jsonl", "--eval-every", "1",
        ],
        "--use-chat-template no: --env renders": ["--num-starts", "2", "--use-chat-template", "no"],
        "--min-new-tokens=2 would ban the end-of-turn token": ["--num-starts", "2", "--min-new-tokens", "2"],
        r"--gamma=0.9 discounts turns only with --per-turn-credit": ["--num-starts", "2", "--gamma", "0.9"],
        r"--max-turns=0 must be >= 1": ["--num-starts", "2", "--max-turns", "0"],
        r"--num-starts=0 must be >= 1": ["--num-starts", "0"],
    }  # fmt: skip
    for message, more in bad.items():
        with pytest.raises(SystemExit, match=message):
            parse_args([*env, *more])
    with pytest.raises(
        SystemExit, match=r"--env 'guess': expected module:factory or path/to/file.py:factory"
    ):
        parse_args(["--model-name", "m", "--env", "guess", "--num-starts", "2"])
    with pytest.raises(
        SystemExit, match=r"--max-turns, --per-turn-credit set the multi-turn episodes, but no --env"
    ):
        parse_args(["--model-name", "m", "--dataset", "d.jsonl", "--max-turns", "2", "--per-turn-credit"])
    with pytest.raises(SystemExit, match="--dataset is required"):
        parse_args(["--model-name", "m"])


def test_load_starts_reads_a_column_or_whole_rows(tmp_path: Path) -> None:
    from grpo.llm.cli import load_starts

    f = tmp_path / "s.jsonl"
    f.write_text('{"start": 3, "note": "a"}\n\n{"start": {"secret": 2}}\n')
    assert load_starts(f) == [3, {"secret": 2}]
    f.write_text('{"secret": 4}\n7\n')
    assert load_starts(f) == [{"secret": 4}, 7]  # no row has the column: each row is a start
    with pytest.raises(ValueError, match=r"row 1 has no 'secret' column \(7\) but others do; give every row"):
        load_starts(f, column="secret")
    j = tmp_path / "s.json"
    j.write_text(json.dumps([{"start": 0}, {"start": 1}]))
    assert load_starts(j) == [0, 1]
    j.write_text(json.dumps({"start": 0}))
    with pytest.raises(ValueError, match="holds a JSON dict; expected a list of start states"):
        load_starts(j)
    with pytest.raises(FileNotFoundError, match="the start states of --env"):
        load_starts(tmp_path / "missing.jsonl")


def env_args(setup: Path, out: Path, *more: str) -> list[str]:
    return [
        "--model-name", str(setup / "model"), "--env", f"{GUESSING_ENV}:make_shaped_env", "--batch-size", "2",
        "--num-generations", "2", "--max-new-tokens", "3", "--max-turns", "2", "--max-total-tokens", "40",
        "--temperature", "1.0", "--device", "cpu", "--output-dir", str(out), "--no-progress",
        "--logging-steps", "1", "--learning-rate", "0.05", "--save-steps", "2", "--seed", "3", *more,
    ]  # fmt: skip


def test_env_run_resumed_equals_the_uninterrupted_run_bitwise(setup: Path, tmp_path: Path) -> None:
    """grpo-train --env: guessing-game episodes from --dataset starts (a column, mixed seeds and
    records), turn-level credit with --gamma and a KL term; 4 steps in one run against 2, then
    --resume to 4: the same weights bit for bit and the same step records. The completions table
    holds whole conversations; a factory that returns no environment is named."""
    from safetensors.torch import load_file

    from grpo.llm.cli import main

    starts = tmp_path / "starts.jsonl"
    starts.write_text("".join(json.dumps({"start": s}) + "\n" for s in [0, {"secret": 2}, 5, {"secret": 4}]))
    common = ["--dataset", str(starts), "--per-turn-credit", "--gamma", "0.9", "--kl-coef", "0.1"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert main(env_args(setup, whole, *common, "--max-steps", "4", "--log-completions-every", "4")) == 0
    assert main(env_args(setup, parts, *common, "--max-steps", "2")) == 0
    assert main(env_args(setup, parts, *common, "--max-steps", "4", "--resume")) == 0
    a = load_file(whole / "final_model" / "model.safetensors")
    b = load_file(parts / "final_model" / "model.safetensors")
    base = load_file(setup / "model" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(a[k].equal(b[k]) for k in a)
    assert any(not a[k].equal(base[k]) for k in a)  # it trained
    records = [
        [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (whole, parts)
    ]
    assert [r["step"] for r in records[1]] == [1.0, 2.0, 3.0, 4.0]
    for key in ("reward/mean", "loss/total", "kl/ref", "grad/norm", "completion/mean_length"):
        assert [r[key] for r in records[0]] == [r[key] for r in records[1]], key
    assert json.loads((whole / "final_model" / "grpo_llm_checkpoint.json").read_text())["step"] == 4
    rows = [json.loads(x) for x in (whole / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 4  # step 4's 2 x 2 episodes, each the whole conversation
    assert all(r["completion"].startswith("user: I am thinking of") for r in rows)
    assert main(env_args(setup, tmp_path / "seeds", "--num-starts", "4", "--max-steps", "1")) == 0
    (m,) = [json.loads(x) for x in (tmp_path / "seeds" / "metrics.jsonl").read_text().splitlines()]
    assert m["reward/mean"] > 0.0  # the seeds 0..3 as starts; the shaped reward of the turns
    with pytest.raises(TypeError, match=r"make_env\(4\) returned list .* expected a TextEnvironment of 4"):
        main(env_args(setup, tmp_path / "bad", "--env", f"{GUESSING_ENV}:not_an_env", "--num-starts", "2"))
