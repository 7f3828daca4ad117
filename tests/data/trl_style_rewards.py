"""Reward functions written the way TRL's GRPOTrainer documentation writes them.

tests/test_llm_rewards_trl.py uses this module unchanged, through `grpo.llm.RewardFunctions` and in a
real `GRPOTrainer.step`. Conversational data: each completion is a list of one message,
``[{"role": "assistant", "content": text}]``; standard (string) data: each completion is a string.
"""

# ruff: noqa: B905  (zip() without strict=, as TRL's examples write it)
import re


# ---- conversational data (completion[0]["content"]) ---------------------------------------------
def format_reward(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def accuracy_reward(completions, solution, **kwargs):
    """Reward function that checks if the completion's answer is the same as the solution."""
    contents = [completion[0]["content"] for completion in completions]
    rewards = []
    for content, sol in zip(contents, solution):
        match = re.search(r"<answer>(.*?)</answer>", content)
        rewards.append(1.0 if match and match.group(1).strip() == sol else 0.0)
    return rewards


def reward_num_unique_letters(completions, **kwargs):
    """Reward function that rewards completions with more unique letters."""
    completion_contents = [completion[0]["content"] for completion in completions]
    return [float(len(set(content))) for content in completion_contents]


def contains_answer(*, completions, answer, **kwargs):
    """Keyword-only: 1.0 if the reference answer appears in the completion."""
    return [1.0 if a in c[0]["content"] else 0.0 for c, a in zip(completions, answer)]


def echo_prompt_reward(prompts, completions, **kwargs):
    """0.5 per word of the last user message repeated in the completion."""
    rewards = []
    for prompt, completion in zip(prompts, completions):
        words = prompt[-1]["content"].split()
        rewards.append(0.5 * sum(w in completion[0]["content"] for w in words))
    return rewards


# ---- any data -------------------------------------------------------------------------------------
def reward_len_ids(completion_ids, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of token count)."""
    return [float(len(ids)) for ids in completion_ids]


def strict_solution_match(completions, solution):
    """No **kwargs: names exactly the arguments it needs."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if s in t else 0.0 for t, s in zip(texts, solution)]


def curriculum_reward(completions, trainer_state, **kwargs):
    """Dynamic reward shaping on the training progress; 0 before step 10."""
    step = trainer_state.global_step if trainer_state is not None else 0
    return [0.0 if step < 10 else 1.0 for _ in completions]


def logging_reward(completions, **kwargs):
    """Uses TRL's logging hooks: a scalar metric and an extra column of the completions table."""
    lengths = [len(c[0]["content"]) if isinstance(c, list) else len(c) for c in completions]
    kwargs["log_metric"]("mean_chars", sum(lengths) / len(lengths))
    kwargs["log_extra"]("chars", lengths)
    return [1.0 for _ in completions]


# ---- standard (string) data ----------------------------------------------------------------------
def boxed_reward(completions, ground_truth, **kwargs):
    """Reward 1 if the content of \\boxed{} is the same as the ground truth, 0 otherwise."""
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


def math_reward_func(prompts, completions, task, **kwargs):
    """Multi-task: a reward for math samples, None (does not apply) for the others."""
    rewards = []
    for completion, t in zip(completions, task):
        rewards.append(float(completion.strip() == "4") if t == "math" else None)
    return rewards
