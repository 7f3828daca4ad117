"""Step 3, the update: the loop over optimizer steps and what protects it.

* `grpo.update.loop`: forwards, objective, backward passes, optimizer steps (`run_update`)
* `grpo.update.plan`: epochs x whole-group optimizer steps x micro-batches, decided once per batch
* `grpo.update.guard`: an update that raises or goes non-finite is undone
* `grpo.update.rollback`: copies of the weights and optimizer state, restored bitwise
* `grpo.update.adaptive_lr`: the learning rate that keeps each optimizer step's KL near a target
"""
