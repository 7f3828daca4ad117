"""Environments: one protocol for everything a policy plays against, stepped many at a time.

* `grpo.envs.protocol`: the `Environment` protocol (reset to given starts, step, close) and its
  optional `SupportsSnapshots` capability
* `grpo.envs.pendulum`: `TensorPendulum`, gymnasium's Pendulum as a batched tensor environment
  (many envs stepped in one call, as GPU simulators do)

The gymnasium adapter, `grpo.gym.vector_env.GymVectorEnvironment`, lives with the rest of the
gymnasium path in `grpo.gym`; this package imports nothing of it.
"""

from grpo.envs.protocol import Environment, SupportsSnapshots, Transition

__all__ = ["Environment", "SupportsSnapshots", "Transition"]
