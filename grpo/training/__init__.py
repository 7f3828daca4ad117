"""Around the step: the training loop and the watchers of its metrics.

* `grpo.training.loop`: `train()`: the loop, sinks, callbacks, checkpoints
* `grpo.training.sources`: the states sources of `train()`, batch by batch, and exact resume
* `grpo.training.evaluation`: `evaluate()`, the mean reward on held-out states
* `grpo.training.progress`: what `train()` reports: the plan, start and end lines, progress
* `grpo.training.rng`: forked RNG streams (evaluation and dropped batches change no random number)
* `grpo.training.callbacks`: hooks, early stopping, the `TrainerLike` view of the trainer
* `grpo.training.stall_watch`: step 6, warnings when learning stalls, with the remedy
* `grpo.training.reward_shift`: step 7, the restart when the task changes under a settled policy
"""
