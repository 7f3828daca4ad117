"""The trainer's state on disk and back: explicit, checked, atomic.

* `grpo.state.trainer_state`: what `GRPOTrainer.state_dict` holds and how it is restored
* `grpo.state.checks`: checks of a state read from disk against the live trainer
* `grpo.state.checkpoint`: checkpoint directories: safe to load, written atomically, resumed exactly
"""
