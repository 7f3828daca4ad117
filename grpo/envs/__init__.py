"""Environments: one protocol for everything a policy plays against, stepped many at a time.

* `grpo.envs.protocol`: the `Environment` protocol (reset to given starts, step, close) and its
  optional `SupportsSnapshots` capability
* `grpo.envs.gymnasium`: `GymVectorEnvironment`, any gymnasium vector env as an `Environment`
* `grpo.envs.pendulum`: `TensorPendulum`, gymnasium's Pendulum as a batched tensor environment
  (many envs stepped in one call, as GPU simulators do)
"""

from grpo.envs.protocol import Environment, SupportsSnapshots, Transition

__all__ = ["Environment", "SupportsSnapshots", "Transition"]
