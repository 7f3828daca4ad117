"""Around the step: the training loop and the watchers of its metrics.

* `grpo.training.loop`: `train()`: data, progress, evaluation, sinks, callbacks, checkpoints
* `grpo.training.callbacks`: hooks, early stopping, the `TrainerLike` view of the trainer
* `grpo.training.stall_watch`: step 6, warnings when learning stalls, with the remedy
* `grpo.training.reward_shift`: step 7, the restart when the task changes under a settled policy
"""
