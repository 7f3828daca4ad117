"""Around the step: the training loop and the watchers of its metrics.

* `grpo.training.loop`: `train()`: the loop, sinks, callbacks, checkpoints
* `grpo.training.sources`: the states sources of `train()`, batch by batch, and exact resume
* `grpo.training.evaluation`: `evaluate()` on held-out states: rewards, pass@k and maj@k, with its
  own group size and temperature (`EvalOptions`)
* `grpo.training.progress`: what `train()` reports: the plan, start and end lines, progress
* `grpo.training.rng`: forked RNG streams (evaluation and dropped batches change no random number)
* `grpo.training.callbacks`: hooks, early stopping, the `TrainerLike` view of the trainer
* `grpo.training.completions_table`: `CompletionsTable`, a callback writing the sampled prompts,
  completions, rewards and advantages every N steps (JSONL, W&B)
* `grpo.training.stall_watch`: step 6, warnings when learning stalls, with the remedy
* `grpo.training.reward_shift`: step 7, the restart when the task changes under a settled policy
"""
