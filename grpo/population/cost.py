"""What a population's slots cost, in the environment's units.

A slot's cost is counted in two parts, both cumulative since the population was built:

* ``train_env_steps``: what its trainer steps drew. For a policy that counts its own env steps
  (an integer ``policy.env_steps``: `grpo.gym.EpisodePolicy`, `grpo.gym.resets.NearestStartPolicy`)
  the env steps its ``generate_actions`` played during the steps (episode lengths, masked steps
  excluded); for any other policy the actions it sampled, ``B x G`` per step (a bandit arm, a
  control output, a completion).
* ``eval_env_steps``: what measuring its fitness drew. For a policy that counts env steps, the
  env steps played during the fitness call (the default fitness, ``trainer.evaluate``, plays
  ``n x G`` episodes through ``generate_actions``); for any other policy with the default fitness,
  the ``n x G`` actions `GRPOTrainer.evaluate` samples (n eval states, G the config's group size);
  with a ``fitness`` callable on such a policy, 0. A fitness that draws outside what is counted
  (`grpo.gym.evaluate_episodes`, which plays on its own env) adds what it drew itself:
  ``member.eval_env_steps += played``.

``Member.samples`` stays what it was: the actions of the slot's trainer steps, ``B x G`` per step
(for episode policies, episodes, not env steps).
"""

from __future__ import annotations

from typing import Any

__all__ = ["counted_env_steps"]


def counted_env_steps(policy: Any) -> int | None:
    """The policy's own env-step counter (``policy.env_steps``, an int), or None if it has none."""
    steps = getattr(policy, "env_steps", None)
    if isinstance(steps, bool) or not isinstance(steps, int):
        return None
    return steps
