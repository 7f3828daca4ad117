"""pass@k / maj@k (grpo.algorithms.pass_at_k) against a loop over every k-subset, and evaluate()
with its own group size, temperature, pass@k and maj@k, alone and on train()'s schedule."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from collections.abc import Hashable, Sequence
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from grpo import GRPOConfig, GRPOTrainer
from grpo.algorithms.pass_at_k import maj_at_k, pass_at_k
from grpo.training.evaluation import EvalOptions
from tests.loop_toys import bandit_states, combined_reward, correct_arm, make_trainer, params_of


# ---- independent references: plain loops over every k-subset ---------------------------------
def brute_pass(correct: Sequence[bool], k: int) -> float:
    subsets = list(itertools.combinations(correct, k))
    return sum(any(s) for s in subsets) / len(subsets)


def brute_maj(answers: Sequence[Hashable | None], correct: Sequence[float], k: int) -> float:
    """Mean over k-subsets of the voted answer's correctness (ties: mean over the tied answers;
    an answer's correctness in a subset: the mean of its samples there; None does not vote)."""
    total, subsets = 0.0, list(itertools.combinations(range(len(answers)), k))
    for s in subsets:
        votes = Counter(answers[i] for i in s if answers[i] is not None)
        if not votes:
            continue
        top = max(votes.values())
        tied = [a for a, v in votes.items() if v == top]
        total += sum(sum(correct[i] for i in s if answers[i] == a) / top for a in tied) / len(tied)
    return total / len(subsets)


# ---- pure functions ------------------------------------------------------------------------
def test_pass_at_k_equals_the_mean_over_all_subsets() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 10)
        k, c = rng.randint(1, n), rng.randint(0, n)
        correct = [True] * c + [False] * (n - c)
        got = float(pass_at_k(n, c, k))
        assert got == pytest.approx(brute_pass(correct, k), abs=1e-12)
        assert got == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)
    cs = torch.tensor([0, 1, 3, 5, 8])  # a batch of problems at once
    got_b = pass_at_k(8, cs, 3)
    assert got_b.shape == (5,)
    assert got_b.dtype == torch.float64
    assert got_b.tolist() == pytest.approx([1 - math.comb(8 - c, 3) / math.comb(8, 3) for c in cs.tolist()])


def test_pass_at_k_edges_and_errors() -> None:
    assert float(pass_at_k(5, 0, 3)) == 0.0  # c = 0
    assert float(pass_at_k(5, 5, 3)) == 1.0  # c = n
    assert float(pass_at_k(5, 1, 5)) == 1.0  # k = n: any correct sample passes
    assert float(pass_at_k(5, 3, 1)) == pytest.approx(3 / 5)  # k = 1: c / n
    assert float(pass_at_k(5, 3, 3)) == 1.0  # n - c < k
    assert float(pass_at_k(2000, 1, 1000)) == pytest.approx(0.5)  # the product form at large n
    with pytest.raises(ValueError, match=r"k=6 is larger than n=5.*Sample n >= 6 per problem"):
        pass_at_k(5, 2, 6)
    with pytest.raises(ValueError, match=r"every count c must lie in \[0, n=5\]; got values in \[0, 7\]"):
        pass_at_k(5, torch.tensor([0, 7]), 2)
    with pytest.raises(TypeError, match=r"c must hold integer counts"):
        pass_at_k(5, torch.tensor([0.5]), 2)
    with pytest.raises(ValueError, match=r"k=0 must be an integer >= 1"):
        pass_at_k(5, 1, 0)


def test_maj_at_k_equals_the_mean_over_all_subsets() -> None:
    """Random answers (with None and ties), correctness 0 / 1 / 0.5, every k."""
    rng = random.Random(1)
    for _ in range(150):
        n = rng.randint(1, 9)
        pool: list[Hashable | None] = [None, "a", "b", 3, (1, 2)][: rng.randint(1, 5)]
        answers = [rng.choice(pool) for _ in range(n)]
        correct = [rng.choice([0.0, 1.0, 0.5]) for _ in range(n)]
        for k in range(1, n + 1):
            assert maj_at_k(answers, correct, k) == pytest.approx(brute_maj(answers, correct, k), abs=1e-12)


def test_maj_at_k_edges_and_errors() -> None:
    answers, correct = ["7", "7", "3", None, "3", "3"], [1, 1, 0, 0, 0, 0]
    assert maj_at_k(answers, correct, 1) == pytest.approx(2 / 6)  # k = 1: answered correct / n
    assert maj_at_k(answers, correct, 6) == 0.0  # k = n: "3" (3 votes) beats "7" (2)
    assert maj_at_k(["x", "y"], [1, 0], 2) == 0.5  # a tie is split evenly
    assert maj_at_k([None, None, None], [0, 0, 0], 2) == 0.0  # nobody votes
    assert maj_at_k([None, "5", None], [0, 1, 0], 3) == 1.0  # None abstains: "5" wins alone
    assert maj_at_k(["5"] * 4, torch.tensor([True] * 4), 3) == 1.0  # c = n
    assert maj_at_k(["5", "6", "6", "5"], [0.0] * 4, 2) == 0.0  # c = 0
    assert maj_at_k(list(range(50)), [1.0] + [0.0] * 49, 25) == pytest.approx(1 / 50)  # all tie
    with pytest.raises(ValueError, match=r"k=4 is larger than n=3"):
        maj_at_k(["a", "b", "c"], [1, 0, 0], 4)
    with pytest.raises(ValueError, match=r"got 3 answers but 2 correctness values"):
        maj_at_k(["a", "b", "c"], [1, 0], 2)
    with pytest.raises(TypeError, match=r"the answer \['a'\] of type list is not hashable"):
        maj_at_k([["a"], "b"], [1, 0], 1)


# ---- evaluate() on a scripted policy: correctness known ----------------------------------------
NUM_ARMS = 5


def scripted_actions(state: int, g: int) -> list[int]:
    """The G actions the scripted policy gives ``state``: a fixed, state-dependent pattern."""
    return [(state * 7 + j * j * 3) % NUM_ARMS for j in range(g)]


def target(state: int) -> int:
    return state % NUM_ARMS


class ScriptedPolicy(nn.Module):
    """A `PolicyModel` whose actions are `scripted_actions`; it records each temperature it got."""

    def __init__(self) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.zeros(NUM_ARMS))
        self.temperatures: list[float | None] = []

    def generate_actions(
        self, states: Any, num_actions_per_state: int, temperature: float | None = None
    ) -> Any:
        self.temperatures.append(temperature)
        return [scripted_actions(int(s), num_actions_per_state) for s in states]

    def get_log_probabilities(self, states: Any, actions: Any) -> Tensor:
        return torch.log_softmax(self.logits, 0)[torch.as_tensor(actions)]

    def get_parameters(self) -> dict[str, Tensor]:
        return {"logits": self.logits}


def scripted_reward(states: Sequence[int], actions: Sequence[int]) -> list[float]:
    return [1.0 if int(a) == target(int(s)) else 0.0 for s, a in zip(states, actions, strict=True)]


def scripted_trainer() -> tuple[GRPOTrainer, ScriptedPolicy]:
    policy = ScriptedPolicy()
    return GRPOTrainer(GRPOConfig(group_size=2, batch_size=3, seed=0), policy, scripted_reward), policy


def test_evaluate_pass_and_maj_at_k_match_the_subset_loops() -> None:
    """Own group size (6 vs training's 2), pass@k and maj@k: each the mean over states of the
    subset loops on the scripted actions; the existing keys unchanged; temperature reached the
    policy."""
    trainer, policy = scripted_trainer()
    states, g = list(range(7)), 6
    ev = trainer.evaluate(states, group_size=g, ks=(1, 2, 6), answer=lambda a: a, temperature=0.7)
    correct = [[a == target(s) for a in scripted_actions(s, g)] for s in states]
    rewards = [float(c) for row in correct for c in row]
    assert ev["eval/reward/mean"] == pytest.approx(sum(rewards) / len(rewards))
    assert {k for k in ev if k.startswith("eval/") and "@" not in k} == {
        "eval/reward/mean", "eval/reward/std", "eval/reward/min", "eval/reward/max",
    }  # fmt: skip
    for k in (1, 2, 6):
        want_pass = sum(brute_pass(row, k) for row in correct) / len(states)
        want_maj = (
            sum(brute_maj(scripted_actions(s, g), row, k) for s, row in zip(states, correct, strict=True)) / 7
        )
        assert ev[f"eval/pass@{k}"] == pytest.approx(want_pass, abs=1e-12)
        assert ev[f"eval/maj@{k}"] == pytest.approx(want_maj, abs=1e-12)
    assert 0 < ev["eval/pass@1"] < ev["eval/pass@2"] < ev["eval/pass@6"] <= 1
    assert policy.temperatures == [0.7, 0.7, 0.7]  # 7 states in chunks of batch_size=3
    policy.temperatures.clear()
    ev2 = trainer.evaluate(states, batch_size=7)  # defaults: training G, no temperature, no pass@k
    assert policy.temperatures == [None]
    assert not any("@" in k for k in ev2)


def test_success_component_and_threshold() -> None:
    """A combined reward (correct + 0.5 * small): pass@1 on the 'correct' component is its mean;
    on the total with threshold 0.92 it counts the samples whose total reaches 0.92."""
    trainer = make_trainer(reward=combined_reward())
    states = bandit_states(6, seed=2)
    ev = trainer.evaluate(states, seed=5, ks=(1,), success_component="correct", group_size=8)
    assert ev["eval/pass@1"] == pytest.approx(ev["eval/reward/correct/mean"], abs=1e-12)
    torch.manual_seed(5)  # the forked stream of seed=5, as evaluate samples
    with torch.no_grad():
        actions = trainer.policy.generate_actions(states[:4], 8).flatten(0, 1)
        actions = torch.cat([actions, trainer.policy.generate_actions(states[4:], 8).flatten(0, 1)])
    flat = states.repeat_interleave(8, 0)
    total = correct_arm(flat, actions) - 0.05 * actions.float()
    ev_total = trainer.evaluate(states, seed=5, ks=(1,), success_threshold=0.92, group_size=8)
    assert ev_total["eval/pass@1"] == pytest.approx(float((total >= 0.92).double().mean()), abs=1e-12)
    assert ev_total["eval/pass@1"] < ev["eval/pass@1"]  # a correct arm 2 totals 1 - 0.1 < 0.92


def test_evaluate_takes_an_eval_options_or_its_fields_as_keywords() -> None:
    """``evaluate(..., options=EvalOptions(...))`` gives exactly what the same fields as keywords
    give (same forked seed); both at once, or something else as options, is refused."""
    trainer = make_trainer(reward=combined_reward())
    states = bandit_states(6, seed=2)
    kw: dict[str, Any] = {"group_size": 8, "ks": (1, 2), "success_component": "correct"}
    by_keywords = trainer.evaluate(states, seed=5, **kw)
    by_options = trainer.evaluate(states, seed=5, options=EvalOptions(**kw))
    del by_keywords["time/eval"], by_options["time/eval"]
    assert by_options == by_keywords
    with pytest.raises(TypeError, match=r"options= and the EvalOptions fields \['ks'\]"):
        trainer.evaluate(states, options=EvalOptions(group_size=8), ks=(1,))
    with pytest.raises(TypeError, match=r"takes a grpo\.training\.evaluation\.EvalOptions, got dict"):
        trainer.evaluate(states, options=kw)


def test_evaluate_refuses_bad_options_before_sampling() -> None:
    trainer, policy = scripted_trainer()
    with pytest.raises(
        ValueError, match=r"ks=\[1, 4\] holds k=\[4\] larger than the evaluation group size 2"
    ):
        trainer.evaluate([1, 2], ks=(1, 4))
    with pytest.raises(ValueError, match=r"answer= is given but ks is empty"):
        trainer.evaluate([1, 2], answer=str)
    with pytest.raises(ValueError, match=r"temperature=0 is not allowed"):
        trainer.evaluate([1, 2], temperature=0)
    with pytest.raises(ValueError, match=r"ks=\[0\] is not allowed"):
        EvalOptions(ks=[0])
    assert EvalOptions(ks=[4, 1, 4]).ks == (1, 4)
    assert policy.temperatures == []  # nothing was sampled
    with pytest.raises(
        ValueError, match=r"success_component='acc' is not a component .* \['correct', 'small'\]"
    ):
        make_trainer(reward=combined_reward()).evaluate(bandit_states(2), ks=(1,), success_component="acc")


def test_temperature_needs_a_policy_that_takes_it() -> None:
    """categorical_mlp takes **kwargs and ignores them; a policy with neither is refused at once."""
    with pytest.raises(
        TypeError, match=r"DistributionPolicy.generate_actions takes \*\*kwargs but its actions"
    ):
        make_trainer().evaluate(bandit_states(2), temperature=0.5)

    class Fixed(ScriptedPolicy):
        def generate_actions(self, states: Any, num_actions_per_state: int) -> Any:  # type: ignore[override]
            raise AssertionError("must not be called")

    trainer = GRPOTrainer(GRPOConfig(group_size=2, batch_size=2), Fixed(), scripted_reward)
    with pytest.raises(TypeError, match=r"Fixed.generate_actions\(states, num_actions_per_state\) does not"):
        trainer.evaluate([1, 2], temperature=0.5)


# ---- the schedule inside train() ---------------------------------------------------------------
def test_train_schedule_uses_the_eval_options_and_changes_no_training() -> None:
    states, eval_states = bandit_states(8), bandit_states(3, seed=9)
    options = EvalOptions(group_size=8, ks=(1, 4), answer=int)
    plain = make_trainer()
    plain.train(states, num_steps=4, progress=False)
    evaluated = make_trainer()
    run = evaluated.train(
        states, num_steps=4, eval_states=eval_states, eval_every=2, eval_options=options, progress=False
    )
    for p, q in zip(params_of(plain), params_of(evaluated), strict=True):
        assert torch.equal(p, q)  # evaluation forks the RNGs: training is bitwise the same
    assert [e["step"] for e in run.eval_history] == [2.0, 4.0]
    last = run.eval_history[-1]
    assert last["group_size"] == 8.0
    assert "temperature" not in last
    again = evaluated.evaluate(eval_states, seed=0, **options.as_kwargs())  # train's seed: config.seed
    for key in ("eval/pass@1", "eval/pass@4", "eval/maj@1", "eval/maj@4", "eval/reward/mean"):
        assert last[key] == again[key]
        assert run.history[-1][key] == again[key]
    assert last["eval/pass@1"] == pytest.approx(last["eval/reward/mean"], abs=1e-12)  # 0/1 reward


def test_train_refuses_bad_eval_options_before_any_step() -> None:
    trainer = make_trainer()
    before = params_of(trainer)
    with pytest.raises(ValueError, match=r"holds k=\[8\] larger than the evaluation group size 4"):
        trainer.train(
            bandit_states(4), num_steps=2, eval_states=bandit_states(2), eval_every=1,
            eval_options=EvalOptions(ks=(8,)), progress=False,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"got eval_options but no eval_states"):
        trainer.train(bandit_states(4), num_steps=2, eval_options=EvalOptions(), progress=False)
    with pytest.raises(TypeError, match=r"takes a grpo.training.evaluation.EvalOptions, got dict"):
        trainer.train(
            bandit_states(4), num_steps=2, eval_states=bandit_states(2), eval_every=1,
            eval_options={"group_size": 8}, progress=False,  # type: ignore[arg-type]
        )  # fmt: skip
    assert trainer.step_count == 0
    for p, q in zip(before, params_of(trainer), strict=True):
        assert torch.equal(p, q)


# ---- a real tiny language model: its own temperature, maj@k on the completions' text ---------
def test_llm_evaluation_at_its_own_temperature(tmp_path: Any) -> None:
    pytest.importorskip("transformers")
    from grpo.llm import CausalLMPolicy, SamplingSettings
    from grpo.llm.rewards import last_number
    from tests.llm_helpers import build_model, build_tokenizer

    tok = build_tokenizer(tmp_path / "tok", pad_is_eos=True)
    policy = CausalLMPolicy(
        build_model(tmp_path / "m", tok), tok, SamplingSettings(max_new_tokens=4, temperature=1.0)
    )
    seen: list[tuple[str, float]] = []

    def reward(prompts: Sequence[str], completions: Sequence[Any]) -> list[float]:
        seen.extend((c.text, c.temperature) for c in completions)
        return [1.0 if any(ch.isdigit() for ch in c.text) else 0.0 for c in completions]

    trainer = GRPOTrainer(GRPOConfig(group_size=2, batch_size=2, seed=0), policy, reward)
    ev = trainer.evaluate(
        ["1+2=", "3*4="], seed=0, group_size=4, temperature=3.0, ks=(2,), answer=last_number
    )
    assert [t for _, t in seen] == [3.0] * 8  # sampled (and recorded) at the evaluation's temperature
    texts = [t for t, _ in seen]
    correct = [any(ch.isdigit() for ch in t) for t in texts]
    want_maj = sum(
        brute_maj([last_number(t) for t in texts[i : i + 4]], correct[i : i + 4], 2) for i in (0, 4)
    )
    want_pass = sum(brute_pass(correct[i : i + 4], 2) for i in (0, 4))
    assert ev["eval/maj@2"] == pytest.approx(want_maj / 2, abs=1e-12)
    assert ev["eval/pass@2"] == pytest.approx(want_pass / 2, abs=1e-12)
