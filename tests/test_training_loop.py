"""GRPOTrainer.train / evaluate: sources, evaluation, glossary, progress, summary, callbacks, errors."""

from __future__ import annotations

import logging
import math
import re
import subprocess
import sys
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from grpo.metrics import metric
from grpo.metrics.sinks import JSONLSink, read_jsonl
from grpo.rollout.reward_guard import RewardTimeoutError
from grpo.training.callbacks import Callback
from grpo.training.loop import TrainState, iter_state_batches
from tests.loop_toys import bandit_states, combined_reward, correct_arm, make_trainer, params_of

GLOSSARY = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


OPTIONAL_HEADING = "## Present only with some options"
LENGTHS_HEADING = "## Returned by `GRPOTrainer.step` when the actions report their lengths"


def glossary_keys(optional: bool = False) -> list[str]:
    """Metric names in the first column of the glossary's tables: those always logged, or
    (``optional=True``) those under the "present only with some options" heading."""
    text = GLOSSARY.read_text(encoding="utf-8")
    always, _, conditional = text.partition(OPTIONAL_HEADING)
    conditional = conditional.partition(LENGTHS_HEADING)[0]  # completion/*: LLM actions only
    keys = []
    for line in (conditional if optional else always).splitlines():
        m = re.match(r"^\|\s*`([^`]+)`\s*\|", line)
        if m:
            keys.append(m.group(1))
    return keys


def take(it: Any, n: int) -> list[Any]:
    return [next(it) for _ in range(n)]


# ---- sources -------------------------------------------------------------------------------
def test_list_source_cycles_in_batch_chunks() -> None:
    src = ["a", "b", "c", "d", "e"]
    assert take(iter_state_batches(src, 2), 4) == [["a", "b"], ["c", "d"], ["e", "a"], ["b", "c"]]
    assert take(iter_state_batches(src, 2, start=2), 2) == [["e", "a"], ["b", "c"]]
    assert take(iter_state_batches(["x"], 3), 1) == [["x", "x", "x"]]


def test_tensor_source_cycles_like_a_list() -> None:
    t = torch.arange(5).unsqueeze(1)
    got = [b.flatten().tolist() for b in take(iter_state_batches(t, 2), 4)]
    assert got == [[0, 1], [2, 3], [4, 0], [1, 2]]


def test_callable_source_with_and_without_argument() -> None:
    calls: list[int] = []

    def sample(n: int) -> list[int]:
        calls.append(n)
        return list(range(n))

    assert take(iter_state_batches(sample, 3), 2) == [[0, 1, 2], [0, 1, 2]]
    assert calls == [3, 3]
    assert take(iter_state_batches(lambda: [7], 3), 1) == [[7]]


def test_iterable_restarts_and_iterator_runs_out() -> None:
    dl = torch.utils.data.DataLoader(torch.arange(4), batch_size=2)
    got = [b.tolist() for b in take(iter_state_batches(dl, 99), 5)]
    assert got == [[0, 1], [2, 3], [0, 1], [2, 3], [0, 1]]
    it = iter_state_batches(iter([[1], [2]]), 2)
    assert list(it) == [[1], [2]]


@pytest.mark.parametrize(
    ("source", "error", "match"),
    [
        ("abc", TypeError, r"states_source is a str; expected a list of states"),
        ({"a": 1}, TypeError, r"states_source is a dict"),
        ([], ValueError, r"states_source is an empty sequence"),
        (torch.zeros(0, 3), ValueError, r"Tensor of shape \(0, 3\); it holds no states"),
        (3.5, TypeError, r"states_source of type float is not supported"),
    ],
)
def test_bad_sources(source: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        next(iter_state_batches(source, 2))


def test_empty_iterable_source() -> None:
    empty = torch.utils.data.DataLoader(torch.arange(0), batch_size=2)
    with pytest.raises(ValueError, match=r"states_source \(DataLoader\) yielded no batch"):
        next(iter_state_batches(empty, 2))


def test_train_draws_the_documented_batches() -> None:
    """The states each step sees (recorded by the reward) are the chunks of the list, in order."""
    seen: list[list[int]] = []
    states = bandit_states(6)

    def reward(flat_states: Tensor, actions: Tensor) -> Tensor:
        rows = flat_states[::4]  # G = 4 copies of each state
        seen.append([int((states == r).all(-1).nonzero()) for r in rows])
        return correct_arm(flat_states, actions)

    trainer = make_trainer(reward=reward)
    trainer.train(states, num_steps=2, progress=False)
    trainer.train(states, num_steps=4, progress=False)  # continues at chunk 2
    assert seen == [[0, 1, 2, 3], [4, 5, 0, 1], [2, 3, 4, 5], [0, 1, 2, 3]]


def test_train_equals_a_hand_written_loop_bitwise() -> None:
    states = bandit_states(10)
    a = make_trainer(kl_coeff=0.05, mini_batch_size=2)
    run = a.train(states, num_steps=5, progress=False)
    b = make_trainer(kl_coeff=0.05, mini_batch_size=2)
    manual = []
    for k in range(5):
        idx = [(k * 4 + j) % 10 for j in range(4)]
        manual.append(b.step(states[idx]))
    for p, q in zip(params_of(a), params_of(b), strict=True):
        assert torch.equal(p, q)
    assert [r["reward/mean"] for r in run.history] == [m["reward/mean"] for m in manual]
    assert a.step_count == b.step_count == 5


def test_iterator_source_stops_training_when_exhausted() -> None:
    trainer = make_trainer()
    batches = iter([bandit_states(4, seed=1), bandit_states(4, seed=2)])
    run = trainer.train(batches, num_steps=5, progress=False)
    assert trainer.step_count == 2
    assert run.stop_reason == "the states source ran out after step 2"


def test_callable_and_dataloader_sources_train() -> None:
    trainer = make_trainer()
    run = trainer.train(lambda n: bandit_states(n, seed=3), num_steps=2, progress=False)
    assert [r["step"] for r in run.history] == [1.0, 2.0]
    dl = torch.utils.data.DataLoader(bandit_states(8), batch_size=4)
    run = trainer.train(dl, num_steps=5, progress=False)
    assert trainer.step_count == 5
    assert len(run.history) == 3


def test_num_steps_is_the_final_step_count() -> None:
    trainer = make_trainer()
    trainer.train(bandit_states(4), num_steps=3, progress=False)
    run = trainer.train(bandit_states(4), num_steps=3, progress=False)
    assert run.history == []
    assert trainer.step_count == 3


def test_seeded_runs_are_identical() -> None:
    runs = []
    for _ in range(2):
        t = make_trainer(kl_coeff=0.1)
        run = t.train(
            bandit_states(12), num_steps=4, eval_states=bandit_states(3, 9), eval_every=2, progress=False
        )
        runs.append(
            (
                [
                    {k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))}
                    for r in run.history
                ],
                params_of(t),
            )
        )
    assert runs[0][0] == runs[1][0]
    for p, q in zip(runs[0][1], runs[1][1], strict=True):
        assert torch.equal(p, q)


# ---- evaluation ----------------------------------------------------------------------------
def test_evaluate_matches_manual_sampling_and_changes_nothing() -> None:
    trainer = make_trainer(reward=combined_reward(), batch_size=2)
    states = bandit_states(5, seed=4)  # chunks of batch_size=2: 2 + 2 + 1 states
    before = params_of(trainer)
    torch.manual_seed(11)
    ev = trainer.evaluate(states, seed=123)
    after_rng = torch.rand(3)

    torch.manual_seed(123)
    rewards, correct, small = [], [], []
    with torch.no_grad():
        for chunk in (states[0:2], states[2:4], states[4:5]):
            actions = trainer.policy.generate_actions(chunk, 4).flatten(0, 1)
            flat = chunk.repeat_interleave(4, 0)
            c, s = correct_arm(flat, actions), -0.1 * actions.float()
            correct.append(c)
            small.append(s)
            rewards.append(c + 0.5 * s)
    r = torch.cat(rewards).double()
    assert ev["eval/reward/mean"] == pytest.approx(float(r.mean()), abs=1e-12)
    assert ev["eval/reward/std"] == pytest.approx(float(r.std()), abs=1e-12)
    assert ev["eval/reward/min"] == float(r.min())
    assert ev["eval/reward/max"] == float(r.max())
    assert ev["eval/reward/correct/mean"] == pytest.approx(float(torch.cat(correct).double().mean()))
    assert ev["eval/reward/small/mean"] == pytest.approx(float(torch.cat(small).double().mean()))
    assert ev["time/eval"] > 0
    for p, q in zip(before, params_of(trainer), strict=True):
        assert torch.equal(p, q)
    torch.manual_seed(11)
    assert torch.equal(after_rng, torch.rand(3)), "evaluate() advanced the global torch RNG"


def test_evaluation_does_not_change_training() -> None:
    states = bandit_states(8)
    plain = make_trainer()
    plain.train(states, num_steps=4, progress=False)
    evaluated = make_trainer()
    run = evaluated.train(states, num_steps=4, eval_states=states[:3], eval_every=1, progress=False)
    for p, q in zip(params_of(plain), params_of(evaluated), strict=True):
        assert torch.equal(p, q)
    assert [e["step"] for e in run.eval_history] == [1.0, 2.0, 3.0, 4.0]
    assert all("eval/reward/mean" in r for r in run.history)


def test_eval_every_period_and_mismatch_errors() -> None:
    trainer = make_trainer()
    run = trainer.train(
        bandit_states(4), num_steps=5, eval_states=bandit_states(2), eval_every=2, progress=False
    )
    assert [("eval/reward/mean" in r) for r in run.history] == [False, True, False, True, False]
    with pytest.raises(ValueError, match=r"got eval_states but not eval_every=N"):
        trainer.train(bandit_states(4), num_steps=6, eval_states=bandit_states(2), progress=False)
    with pytest.raises(ValueError, match=r"got eval_every but not eval_states="):
        trainer.train(bandit_states(4), num_steps=6, eval_every=2, progress=False)
    with pytest.raises(ValueError, match=r"eval_every=0\) is not allowed"):
        trainer.train(bandit_states(4), num_steps=6, eval_states=bandit_states(2), eval_every=0)


# ---- glossary ------------------------------------------------------------------------------
def test_every_glossary_key_is_in_every_jsonl_line(tmp_path: Path) -> None:
    components = ["correct", "small"]
    expected = set()
    for key in glossary_keys():
        if "<component>" in key:
            expected.update(key.replace("<component>", c) for c in components)
        else:
            expected.add(key)
    assert {
        "reward/frac_zero_std",
        "clip/frac_low",
        "kl/ref",
        "policy/entropy",
        "grad/norm",
        "throughput/samples_per_s",
        "time/step",
        "optim/lr",
    } <= expected
    trainer = make_trainer(reward=combined_reward(), kl_coeff=0.05)
    path = tmp_path / "metrics.jsonl"
    with JSONLSink(path) as sink:
        trainer.train(
            bandit_states(8),
            num_steps=3,
            eval_states=bandit_states(2),
            eval_every=1,
            sinks=[sink],
            progress=False,
        )
    lines = read_jsonl(path)
    assert len(lines) == 3
    for line in lines:
        assert expected - set(line) == set(), "glossary keys missing from a JSONL line"
        assert set(line) - expected == set(), "logged keys missing from docs/metrics.md"
    assert [line["step"] for line in lines] == [1.0, 2.0, 3.0]


def declared_name(key: str) -> str:
    """The glossary's name of a logged key (``eval/pass@4`` -> ``eval/pass@<k>``)."""
    found = metric(key)
    return key if found is None else found.name


def test_optional_glossary_keys_appear_exactly_when_their_option_is_on() -> None:
    optional = set(glossary_keys(optional=True))
    assert optional == {
        "advantage/frac_dropped_groups",
        "reward/dropped_groups",
        "eval/reward/dropped_groups",
        "sampler/is_weight_mean",
        "sampler/is_frac_capped",
        "sampler/ess",
        "async/staleness",
        "async/sync_seconds",
        "optim/adaptive_lr",
        "restart/reward_shift",
        "restart/given_back",
        "eval/pass@<k>",
        "eval/maj@<k>",
        "clip/frac",
        "episode/success_rate",
        "sampling/draws",
        "sampling/kept_groups",
        "sampling/dropped_groups",
        "sampling/surplus_groups",
        "sampling/capped",
        "sampling/drawn_episodes",
        "sampling/drawn_successes",
    }
    always = set(glossary_keys())
    on = make_trainer(
        drop_zero_variance_groups=True, invalid_rewards="drop_groups", sampler_is_cap=2.0,
        adaptive_lr_kl=0.01, num_epochs_per_update=2, reward_shift_z=4.0, max_sampling_draws=4,
    )  # fmt: skip
    evaluated = on.evaluate(bandit_states(4), ks=(1, 2), answer=int)
    more = iter([bandit_states(4, seed=s) for s in (1, 2, 3)])
    stepped = on.step(bandit_states(4), more_states=lambda: next(more, None))
    logged = {declared_name(k) for k in set(stepped) | set(evaluated)}
    liger_only = {"clip/frac"}  # needs use_liger_loss, an LLM and liger-kernel: tests/test_llm_fused.py
    engine_only = {"async/staleness", "async/sync_seconds"}  # an engine with its own weights:
    # tests/test_async_rollouts.py
    episode_only = {"episode/success_rate", "sampling/drawn_episodes", "sampling/drawn_successes"}
    # episodes whose env reports success: tests/test_robot_success.py, tests/test_dynamic_sampling.py
    assert optional - liger_only - engine_only - episode_only <= logged
    assert logged - always - optional == set(), "logged keys missing from docs/metrics.md"
    plain = make_trainer()
    assert not optional & (set(plain.step(bandit_states(4))) | set(plain.evaluate(bandit_states(4))))


def test_throughput_is_samples_over_iteration_time() -> None:
    trainer = make_trainer()
    run = trainer.train(bandit_states(4), num_steps=2, progress=False)
    for r in run.history:
        it = r["time/data"] + r["time/step"]
        assert r["throughput/samples_per_s"] == pytest.approx(16 / it, rel=1e-9)
        assert r["throughput/steps_per_s"] == pytest.approx(1 / it, rel=1e-9)


# ---- callbacks -----------------------------------------------------------------------------
class Recorder(Callback):
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def on_train_start(self, state: TrainState) -> None:
        self.calls.append(("start", state.step))

    def on_metrics(self, state: TrainState, metrics: dict[str, float]) -> None:
        self.calls.append(("metrics", int(metrics["step"])))

    def on_step_end(self, state: TrainState, metrics: Mapping[str, float]) -> None:
        self.calls.append(("step", int(metrics["step"])))

    def on_eval(self, state: TrainState, metrics: Mapping[str, float]) -> None:
        assert set(metrics) == {
            "eval/reward/mean",
            "eval/reward/std",
            "eval/reward/min",
            "eval/reward/max",
            "time/eval",
        }
        self.calls.append(("eval", state.step))

    def on_train_end(self, state: TrainState) -> None:
        self.calls.append(("end", state.step))


def test_callback_hooks_in_order() -> None:
    rec = Recorder()
    trainer = make_trainer()
    trainer.train(
        bandit_states(4),
        num_steps=4,
        eval_states=bandit_states(2),
        eval_every=2,
        callbacks=[rec],
        progress=False,
    )
    assert rec.calls == [
        ("start", 0),
        ("metrics", 1),
        ("step", 1),
        ("eval", 2),
        ("metrics", 2),
        ("step", 2),
        ("metrics", 3),
        ("step", 3),
        ("eval", 4),
        ("metrics", 4),
        ("step", 4),
        ("end", 4),
    ]


def test_callback_can_stop_training() -> None:
    class StopAtTwo(Callback):
        def on_step_end(self, state: TrainState, metrics: Mapping[str, float]) -> None:
            if state.step == 2:
                state.stop("enough")

    trainer = make_trainer()
    rec = Recorder()
    run = trainer.train(bandit_states(4), num_steps=10, callbacks=[StopAtTwo(), rec], progress=False)
    assert trainer.step_count == 2
    assert run.stop_reason == "enough"
    assert run.should_stop
    assert rec.calls[-1] == ("end", 2)


def test_bad_callback_and_sink_are_rejected() -> None:
    trainer = make_trainer()
    with pytest.raises(TypeError, match=r"callback object has none of the hooks"):
        trainer.train(bandit_states(4), num_steps=1, callbacks=[object()], progress=False)
    with pytest.raises(TypeError, match=r"sink int has no write\(metrics, step\) method"):
        trainer.train(bandit_states(4), num_steps=1, sinks=[3], progress=False)
    assert trainer.step_count == 0


# ---- arguments -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_steps": -1}, r"num_steps=-1\) is not allowed: expected an integer >= 0"),
        ({"num_steps": 2, "progress": "fancy"}, r"progress='fancy'\) is not allowed"),
        ({"num_steps": 2, "log_every": 0}, r"log_every=0\) is not allowed"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_trainer().train(bandit_states(4), **kwargs)


def test_an_unknown_train_option_is_refused_with_the_closest_one() -> None:
    with pytest.raises(
        TypeError, match=r"unexpected keyword argument 'eval_evry'; did you mean 'eval_every'\?"
    ):
        make_trainer().train(bandit_states(4), num_steps=1, eval_evry=2)  # type: ignore[call-arg]


def test_checkpoint_freq_needs_a_directory() -> None:
    trainer = make_trainer(checkpoint_freq=2)
    with pytest.raises(ValueError, match=r"checkpoint_freq=2 but train\(\) got no checkpoint_dir"):
        trainer.train(bandit_states(4), num_steps=2, progress=False)


# ---- progress and summary ------------------------------------------------------------------
def test_summary_logged_once_with_derived_quantities(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    trainer = make_trainer(mini_batch_size=2, num_epochs_per_update=2)
    with caplog.at_level(logging.DEBUG, logger="grpo.training.loop"):
        trainer.train(bandit_states(4), num_steps=3, progress="log", log_every=100)
    assert capsys.readouterr().out == ""  # logged, not printed
    summaries = [
        r for r in caplog.records if r.name == "grpo.training.loop" and "GRPOConfig(" in r.getMessage()
    ]
    assert len(summaries) == 1
    assert summaries[0].levelno == logging.DEBUG  # the one-line start is at INFO (grpo.progress)
    out = summaries[0].getMessage()
    assert out.count("GRPOConfig(") == 1
    assert re.search(r"samples_per_step\s+= 16\n", out)
    assert re.search(r"optimizer_steps_per_step\s+= 4\n", out)
    assert "steps              = 0 -> 3 (3 to run, 48 samples, 12 optimizer steps)" in out
    assert "states source      = Tensor (4, 4) (cycled)" in out


def test_summary_logged_not_printed_when_silent(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="grpo.training.loop"):
        make_trainer().train(bandit_states(4), num_steps=1, progress=False)
    assert capsys.readouterr().out == ""
    assert any("GRPOConfig(" in r.getMessage() for r in caplog.records)


def test_progress_log_lines(capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="grpo.progress"):
        make_trainer().train(
            bandit_states(4),
            num_steps=5,
            progress="log",
            log_every=2,
            eval_states=bandit_states(2),
            eval_every=2,
        )
    assert capsys.readouterr().out == ""
    lines = [r.getMessage() for r in caplog.records if re.match(r"step \d/5 \(", r.getMessage())]
    assert [ln.split(" (")[0] for ln in lines] == ["step 2/5", "step 4/5", "step 5/5"]
    assert {r.name for r in caplog.records if r.getMessage().startswith("step ")} == {"grpo.progress"}
    evals = [r.getMessage() for r in caplog.records if re.match(r"step \d/5: eval/", r.getMessage())]
    assert [ln.split(":")[0] for ln in evals] == ["step 2/5", "step 4/5"]  # every evaluation
    assert re.search(
        r"steps/s\): reward/mean=\S+ reward/std=\S+ kl/ref=\S+ policy/entropy=\S+ "
        r"grad/norm=\S+ eval/reward/mean=\S+$",
        lines[0],
    )


def test_progress_bar_shows_reward_and_kl(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tqdm")
    make_trainer(kl_coeff=0.05).train(bandit_states(4), num_steps=3, progress="bar")
    err = capsys.readouterr().err
    assert "3/3" in err
    assert "reward=" in err
    assert "kl=" in err
    assert "step" in err


PRINTS_NOTHING = """
import logging, sys
from tests.loop_toys import bandit_states, make_trainer
if sys.argv[1] == "configured":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s|%(message)s")
make_trainer().train(bandit_states(4), num_steps=3, progress="log", log_every=1)
"""


@pytest.mark.parametrize("logging_setup", ["none", "configured"])
def test_train_prints_nothing_to_stdout(logging_setup: str) -> None:
    """Outside pytest's log capture, nothing on stdout either way. No handler configured: the
    report (start line, one line per step, end line) on stderr, the config dump not (DEBUG).
    Configured at INFO: the same report through the user's handler (logger grpo.progress)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", PRINTS_NOTHING, logging_setup],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=root,
    )
    assert out.stdout == ""
    assert "GRPOConfig(" not in out.stderr  # the whole config is at DEBUG
    prefix = "" if logging_setup == "none" else r"grpo\.progress\|"
    steps = re.findall(rf"^{prefix}(step \d/3) \(", out.stderr, flags=re.M)
    assert steps == ["step 1/3", "step 2/3", "step 3/3"]
    assert len(re.findall(rf"^{prefix}grpo: training ", out.stderr, flags=re.M)) == 1
    assert len(re.findall(rf"^{prefix}grpo: stopped at step 3 ", out.stderr, flags=re.M)) == 1


# ---- on_metrics ----------------------------------------------------------------------------
def test_on_metrics_adds_keys_that_sinks_history_and_on_step_end_see(tmp_path: Path) -> None:
    class AddKey:  # any object with one of the hooks is a callback
        def on_metrics(self, state: TrainState, metrics: dict[str, float]) -> None:
            assert "eval/reward/mean" in metrics or state.step % 2 == 1  # after the evaluation
            metrics["custom/double_step"] = 2.0 * state.step

    seen: list[float] = []

    class Check(Callback):
        def on_step_end(self, state: TrainState, metrics: Mapping[str, float]) -> None:
            seen.append(metrics["custom/double_step"])

    path = tmp_path / "m.jsonl"
    with JSONLSink(path) as sink:
        run = make_trainer().train(
            bandit_states(4),
            num_steps=3,
            eval_states=bandit_states(2),
            eval_every=2,
            callbacks=[AddKey(), Check()],
            sinks=[sink],
            progress=False,
        )
    assert [r["custom/double_step"] for r in read_jsonl(path)] == [2.0, 4.0, 6.0]
    assert [r["custom/double_step"] for r in run.history] == [2.0, 4.0, 6.0]
    assert seen == [2.0, 4.0, 6.0]


# ---- evaluation under the trainer's reward settings ----------------------------------------
def test_evaluate_drops_invalid_groups_and_counts_them() -> None:
    """invalid_rewards='drop_groups': a group with a NaN reward leaves every eval/reward/* value
    and is counted; a chunk whose every group is invalid (the last, 1-state chunk here) is
    dropped whole instead of failing the evaluation."""
    states = bandit_states(5, seed=4)  # chunks of batch_size=2: states 0-1, 2-3, 4
    bad = {1, 4}

    def reward(flat_states: Tensor, actions: Tensor) -> Tensor:
        rows = [(states == row).all(-1).nonzero().flatten().tolist() for row in flat_states]
        invalid = torch.tensor([bool(set(r) & bad) for r in rows])  # training states: valid
        return torch.where(invalid, torch.nan, correct_arm(flat_states, actions))

    trainer = make_trainer(reward=reward, batch_size=2, invalid_rewards="drop_groups")
    ev = trainer.evaluate(states, seed=123)

    torch.manual_seed(123)
    kept = []
    with torch.no_grad():
        for lo, hi in ((0, 2), (2, 4), (4, 5)):
            chunk = states[lo:hi]
            actions = trainer.policy.generate_actions(chunk, 4).flatten(0, 1)
            r = correct_arm(chunk.repeat_interleave(4, 0), actions)
            kept += [r[4 * j : 4 * j + 4] for j in range(hi - lo) if lo + j not in bad]
    r = torch.cat(kept).double()
    assert r.numel() == 12
    assert ev["eval/reward/dropped_groups"] == 2.0
    assert ev["eval/reward/mean"] == pytest.approx(float(r.mean()), abs=1e-12)
    assert ev["eval/reward/std"] == pytest.approx(float(r.std()), abs=1e-12)
    assert ev["eval/reward/min"] == float(r.min())
    assert ev["eval/reward/max"] == float(r.max())
    assert all(math.isfinite(v) for v in ev.values())

    run = trainer.train(bandit_states(4), num_steps=2, eval_states=states, eval_every=2, progress=False)
    assert run.history[-1]["eval/reward/dropped_groups"] == 2.0
    assert "eval/reward/dropped_groups" not in make_trainer().evaluate(states)


def test_evaluate_raises_when_no_group_is_valid_or_invalid_rewards_raise() -> None:
    def nan_reward(flat_states: Tensor, actions: Tensor) -> Tensor:
        return torch.full((len(actions),), torch.nan)

    trainer = make_trainer(reward=nan_reward, batch_size=2, invalid_rewards="drop_groups")
    with pytest.raises(ValueError, match=r"every one of the 3 evaluation groups holds an invalid reward"):
        trainer.evaluate(bandit_states(3))
    assert trainer.policy.training  # training mode restored after the error
    with pytest.raises(ValueError, match=r"invalid_rewards='drop_groups'"):
        make_trainer(reward=nan_reward).evaluate(bandit_states(3))  # 'raise': the first NaN raises


def test_evaluate_honours_reward_timeout() -> None:
    release = threading.Event()

    def slow(flat_states: Tensor, actions: Tensor) -> Tensor:
        release.wait(30)
        return correct_arm(flat_states, actions)

    trainer = make_trainer(reward=slow, reward_timeout=0.2)
    try:
        with pytest.raises(RewardTimeoutError, match=r"did not return within .*reward_timeout=0\.2 s"):
            trainer.evaluate(bandit_states(2))
    finally:
        release.set()  # let the background thread finish


# ---- step() and config.batch_size ---------------------------------------------------------
def test_step_warns_once_when_given_another_number_of_states_than_batch_size() -> None:
    """step() trains on every state it is given; batch_size only sets train()'s batches and the
    arithmetic of optimizer_steps_per_step. A different number is worth one warning, not more."""
    trainer = make_trainer()  # batch_size=4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.step(bandit_states(6))
        trainer.step(bandit_states(2))
    messages = [str(w.message) for w in caught if "batch_size" in str(w.message)]
    assert messages == [messages[0]]
    assert "step() got 6 states but GRPOConfig.batch_size=4" in messages[0]
    assert "only sets how many states train() draws per step" in messages[0]
    assert "optimizer_steps_per_step" in messages[0]
    assert caught[0].filename == __file__  # points at the caller
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_trainer().step(bandit_states(4))  # batch_size states: silent


def test_other_iterables_resume_by_skipping_the_batches_already_fed() -> None:
    class Batches:  # re-iterable, not a DataLoader: each pass yields the same 3 batches
        def __iter__(self) -> Any:
            return iter([[1], [2], [3]])

    assert take(iter_state_batches(Batches(), 1, start=4), 3) == [[2], [3], [1]]
    dl = torch.utils.data.DataLoader(torch.arange(4), batch_size=2)
    assert [b.tolist() for b in take(iter_state_batches(dl, 2, start=3), 2)] == [[2, 3], [0, 1]]


# ---- the run's report ----------------------------------------------------------------------------
REPORT_SCRIPT = """
import torch
from tests.loop_toys import bandit_states, make_trainer
trainer = make_trainer(kl_coeff=0.0)
run = trainer.train(bandit_states(8), num_steps=4, eval_states=bandit_states(4), eval_every=2, log_every=2)
print("stop_reason:", run.stop_reason)
"""


def test_a_piped_run_reports_on_stderr_without_any_logging_setup() -> None:
    """A script with no logging configured, stdout and stderr piped (CI, `| tee`): stderr gets a
    start line, progress lines (kl/old, not the always-0 kl/ref, since kl_coeff = 0), a line for
    every evaluation and an end line; stdout only what the script prints; stop_reason is set."""
    out = subprocess.run(
        [sys.executable, "-c", REPORT_SCRIPT], capture_output=True, text=True, timeout=120, check=True,
        cwd=Path(__file__).resolve().parent.parent,
    )  # fmt: skip
    assert out.stdout == "stop_reason: reached num_steps=4\n"
    lines = out.stderr.splitlines()
    assert lines[0].startswith("grpo: training DistributionPolicy (")
    assert "on cpu, steps 0 -> 4 (" in lines[0]
    assert "evaluation every 2 steps" in lines[0]
    progress = [line for line in lines if line.startswith(("step 2/4 (", "step 4/4 ("))]
    assert len(progress) == 2
    assert all("kl/old=" in line and "kl/ref" not in line for line in progress)
    evals = [line for line in lines if re.match(r"step [24]/4: eval/reward/mean=", line)]
    assert len(evals) == 2
    assert lines[-1].startswith("grpo: stopped at step 4 (reached num_steps=4) after ")
    assert "reward/mean" in lines[-1]
    assert "eval/reward/mean" in lines[-1]
    assert len(lines) == 6


def test_configured_logging_gets_the_report_and_no_extra_handler(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="grpo.progress"):
        run = make_trainer(kl_coeff=0.05).train(bandit_states(4), num_steps=2, progress="log", log_every=1)
    report = [r.getMessage() for r in caplog.records if r.name == "grpo.progress"]
    assert report[0].startswith("grpo: training")
    assert "kl/ref=" in report[1]  # a KL term: kl/ref is what it optimises
    assert report[-1].startswith("grpo: stopped at step 2 (reached num_steps=2)")
    assert logging.getLogger("grpo.progress").handlers == []  # none left behind
    assert run.stop_reason == "reached num_steps=2"
