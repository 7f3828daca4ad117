"""Metrics of `GRPOTrainer.step` beyond rewards and loss: the actions' lengths (``completion/*``,
grpo.rollout.action_stats), the learning rate (``optim/lr``), and the per-sample completions table
(grpo.training.completions_table). Numbers by hand or from the token ids; a tiny real LM."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from grpo import GRPOConfig, GRPOTrainer
from grpo.gym.episodes import Episode
from grpo.metrics import StepCounts, metric, reduce_across_ranks
from grpo.rollout.action_stats import LENGTH_KEYS, LengthReporting, action_metrics
from grpo.training.completions_table import CompletionsTable, sample_text
from tests.loop_toys import bandit_states, combined_reward, make_trainer

EOS = 1  # the id of "<eos>" in grpo.llm.tiny's tokenizer


class Sampled:
    """An action with the hook: ``len()`` and ``truncated`` (what `grpo.llm.Completion` has)."""

    def __init__(self, length: int, finished: bool) -> None:
        self.length, self.truncated = length, not finished

    def __len__(self) -> int:
        return self.length


class Ended(Sampled):
    """The other form of the hook: ``finished`` (the negation of ``truncated``) only."""

    def __init__(self, length: int, finished: bool) -> None:
        self.length, self.finished = length, finished


def sampled(lengths: list[int], ended: list[bool]) -> list[Sampled]:
    return [Sampled(n, e) for n, e in zip(lengths, ended, strict=True)]


# ---- the hook -----------------------------------------------------------------------------------
def test_length_metrics_by_hand() -> None:
    actions = sampled([3, 5, 5, 2, 4], [True, False, False, True, True])
    assert isinstance(actions[0], LengthReporting)
    m = action_metrics(actions)
    assert list(m) == list(LENGTH_KEYS)
    assert m == {
        "completion/tokens": 19.0,
        "completion/mean_length": 19 / 5,
        "completion/min_length": 2.0,
        "completion/max_length": 5.0,
        "completion/frac_truncated": 2 / 5,
        "completion/mean_terminated_length": (3 + 2 + 4) / 3,
    }
    assert action_metrics([Ended(a.length, not a.truncated) for a in actions]) == m
    none_ended = action_metrics(sampled([4, 4], [False, False]))
    assert none_ended["completion/frac_truncated"] == 1.0
    assert math.isnan(none_ended["completion/mean_terminated_length"])


def test_actions_without_the_hook_report_nothing() -> None:
    episode = Episode(
        0, torch.zeros(3, 2), torch.zeros(3), torch.zeros(3), torch.ones(3, dtype=torch.bool), True
    )
    for actions in (torch.arange(6), [0, 1, 2], ["ab", "c"], [episode], [], None):
        assert action_metrics(actions) == {}
    with pytest.warns(UserWarning, match=r"action 1 of the step is a int without len\(\) and \.truncated"):
        assert action_metrics([Sampled(2, True), 7]) == {}


def test_lengths_reduce_across_processes_as_the_concatenated_batch() -> None:
    """Two processes' local metrics, reduced by their declarations, equal the metrics of all
    their actions together (the terminated mean is weighted by each process's ended samples)."""
    parts = [
        sampled([3, 5, 5, 2], [True, False, False, True]),
        sampled([1, 6, 6, 6, 2, 4], [True, False, False, False, False, False]),
    ]
    rows = [action_metrics(p) for p in parts]
    counts = [StepCounts(float(len(p)), 1.0, 1.0) for p in parts]

    def all_gather(local: torch.Tensor) -> torch.Tensor:
        other = local.clone()
        other[1:4] = torch.tensor([counts[1].samples, counts[1].groups, counts[1].valid_steps])
        other[4:] = torch.tensor([rows[1][k] for k in rows[0]], dtype=torch.float64)
        return torch.stack([local, other])

    out = reduce_across_ranks(rows[0], counts[0], all_gather)
    whole = action_metrics(parts[0] + parts[1])
    assert out == pytest.approx(whole, rel=1e-12)
    assert whole["completion/mean_terminated_length"] == (3 + 2 + 1) / 3
    assert all(metric(k) is not None for k in LENGTH_KEYS)


# ---- a tiny real language model ------------------------------------------------------------------
def test_llm_step_reports_lengths_and_truncated_share(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from grpo.llm import CausalLMPolicy, RewardFunctions, SamplingSettings
    from tests.llm_helpers import build_model, build_tokenizer

    tok = build_tokenizer(tmp_path / "tok")
    assert tok.eos_token_id == EOS
    limit = 6
    policy = CausalLMPolicy(
        build_model(tmp_path / "m", tok, arch="llama"), tok, SamplingSettings(max_new_tokens=limit)
    )
    config = GRPOConfig(group_size=4, batch_size=4, kl_coeff=0.0, learning_rate=1e-3, seed=0)
    trainer = GRPOTrainer(config, policy, RewardFunctions(lambda p, c: [float(len(x)) for x in c]))
    torch.manual_seed(3)
    m = trainer.step(["1+2=", "ab", "x", "hello"])
    assert trainer.last_batch is not None
    ids = [c.token_ids.tolist() for c in trainer.last_batch.actions]  # what generate returned
    lengths = [len(t) for t in ids]
    cut = [n == limit and t[-1] != EOS for n, t in zip(lengths, ids, strict=True)]
    ended = [n for n, c in zip(lengths, cut, strict=True) if not c]
    assert 0 < len(ended) < 16, "this seed should give both ended and truncated completions"
    assert m["completion/tokens"] == sum(lengths)
    assert m["completion/mean_length"] == pytest.approx(sum(lengths) / 16)
    assert (m["completion/min_length"], m["completion/max_length"]) == (min(lengths), max(lengths))
    assert m["completion/frac_truncated"] == pytest.approx(sum(cut) / 16)
    assert m["completion/mean_terminated_length"] == pytest.approx(sum(ended) / len(ended))


# ---- the learning rate ---------------------------------------------------------------------------
def test_step_reports_the_lr_its_first_optimizer_step_uses() -> None:
    """Linear warmup over 2 steps from lr/3, then linear decay to 0 at step 10 (one optimizer step
    per step): optim/lr of step k is the rate before step k's scheduler step, the same value
    train() logs; the rate after the step is the next step's."""
    base = 0.03
    want = [base / 3, 2 * base / 3, base, 7 / 8 * base, 6 / 8 * base]
    trainer = make_trainer(learning_rate=base, lr_schedule="linear", warmup_steps=2, total_steps=10)
    assert trainer.optimizer is not None
    for k, lr in enumerate(want):
        assert trainer.step(bandit_states(4))["optim/lr"] == pytest.approx(lr, rel=1e-12), k
        after = want[k + 1] if k + 1 < len(want) else 5 / 8 * base
        assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(after, rel=1e-12)
    again = make_trainer(learning_rate=base, lr_schedule="linear", warmup_steps=2, total_steps=10)
    run = again.train(bandit_states(4), num_steps=5, progress=False)
    assert [r["optim/lr"] for r in run.history] == pytest.approx(want, rel=1e-12)


def test_bandit_step_has_no_length_keys() -> None:
    m = make_trainer().step(bandit_states(4))
    assert not [k for k in m if k.startswith("completion/")]
    assert "optim/lr" in m


# ---- the completions table -----------------------------------------------------------------------
def hand_rows(line_group: list[dict[str, object]], state: torch.Tensor) -> list[dict[str, float]]:
    """The rewards and advantages of one group's JSONL lines, from the grpo.loop_toys formulas:
    correct = [a == argmax(s[:3])], small = -0.1 a, reward = correct + 0.5 small,
    advantage = (r - mean_g r) / (std_g r + 1e-6) (unbiased std)."""
    actions = [int(str(line["completion"])) for line in line_group]
    correct = [float(a == int(state[:3].argmax())) for a in actions]
    small = [-0.1 * a for a in actions]
    r = torch.tensor([c + 0.5 * s for c, s in zip(correct, small, strict=True)])
    adv = ((r - r.mean()) / (r.std() + 1e-6)).tolist()
    return [
        {"reward/correct": c, "reward/small": s, "reward": float(x), "advantage": a}
        for c, s, x, a in zip(correct, small, r.tolist(), adv, strict=True)
    ]


def test_completions_table_jsonl_rows(tmp_path: Path) -> None:
    path = tmp_path / "table" / "completions.jsonl"
    states = bandit_states(4)
    trainer = make_trainer(reward=combined_reward())
    table = CompletionsTable(path, every=2)
    trainer.train(states, num_steps=5, callbacks=[table], progress=False)
    lines = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]
    assert [line["step"] for line in lines] == [2] * 16 + [4] * 16
    assert [line["group"] for line in lines[:16]] == [g for g in range(4) for _ in range(4)]
    keys = ["step", "group", "prompt", "completion", "reward/correct", "reward/small", "reward", "advantage"]
    for k in range(0, 32, 4):
        group = lines[k : k + 4]
        g = group[0]["group"]
        for line, want in zip(group, hand_rows(group, states[g]), strict=True):
            assert list(line) == keys
            assert line["prompt"] == str(states[g].tolist())
            assert line["completion"] in {"0", "1", "2"}
            for name, v in want.items():
                assert line[name] == pytest.approx(v, abs=1e-5), name
    # train() goes on: the lines so far stay; a fresh trainer at step 0 starts the file again
    trainer.train(states, num_steps=6, callbacks=[table], progress=False)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()][::16] == [2, 4, 6]
    few = CompletionsTable(path, every=3, max_samples=5)
    make_trainer(reward=combined_reward()).train(states, num_steps=3, callbacks=[few], progress=False)
    assert [json.loads(x)["group"] for x in path.read_text().splitlines()] == [0, 0, 0, 0, 1]


def test_sample_text_and_argument_errors(tmp_path: Path) -> None:
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert sample_text({"prompt": chat, "answer": "3"}) == "user: hi\nassistant: yo"
    assert sample_text(torch.tensor([1.5, 2.0])) == "[1.5, 2.0]"
    assert sample_text("x") == "x"
    with pytest.raises(ValueError, match="neither path= nor wandb_run="):
        CompletionsTable()
    with pytest.raises(ValueError, match=r"CompletionsTable\(every=0\)"):
        CompletionsTable(tmp_path / "t.jsonl", every=0)
    with pytest.raises(TypeError, match="needs a wandb run"):
        CompletionsTable(wandb_run="my-project")


@pytest.mark.slow  # starting a W&B run takes seconds
@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb not installed")
def test_completions_table_to_wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(project="grpo-test", mode="offline", dir=str(tmp_path))
    try:
        table = CompletionsTable(every=1, wandb_run=run, max_samples=4)
        make_trainer(reward=combined_reward()).train(
            bandit_states(4), num_steps=1, callbacks=[table], progress=False
        )
    finally:
        run.finish()
    files = sorted(tmp_path.glob("wandb/offline-run-*/files/media/table/completions_*.table.json"))
    assert len(files) == 1
    logged = json.loads(files[0].read_text())
    assert logged["columns"] == [
        "step", "group", "prompt", "completion", "reward/correct", "reward/small", "reward", "advantage"
    ]  # fmt: skip
    assert [row[:2] for row in logged["data"]] == [[1, 0]] * 4
