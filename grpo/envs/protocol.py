"""The `Environment` protocol: what a policy's rollout needs of anything it plays against, for
control (tensors) and for text (chat messages) alike.

An environment holds ``num_envs`` sub-environments stepped together (1 for a plain env; hundreds
for a batched tensor simulator on a GPU; B*G chat episodes for a language model). It is generic
over its batched observation type ``ObsT`` and its batched action type ``ActT``::

    obs = env.reset(starts)            # starts: num_envs start states -> ObsT
    t = env.step(actions)              # actions: ActT, one per sub-environment -> Transition[ObsT]
    t.observations: ObsT, t.rewards (num_envs,) float32,
    t.terminated (num_envs,) bool, t.truncated (num_envs,) bool,
    t.infos: None or num_envs dicts (one per sub-environment)
    env.close()

Control, ``Environment[Tensor, Tensor]`` (the default, so a bare ``Environment`` means this):
observations are a tensor ``(num_envs, *obs_shape)`` on the environment's device, actions
``(num_envs,)`` ints or ``(num_envs, act_dim)`` floats (`grpo.gym.episodes.run_episodes`, the
branching of `grpo.gym.branching`, `grpo.envs.pendulum.TensorPendulum`).

Text, `TextEnvironment` = ``Environment[TextObservation, Sequence[str]]``:

* a `Message` is one chat message, ``{"role": "system" | "user" | "tool" | ..., "content": str}``
  (the dicts ``tokenizer.apply_chat_template`` takes);
* a `TextObservation` holds, per sub-environment, the list of messages the environment *adds* to
  that episode's conversation: ``reset`` returns each episode's first messages (the system and/or
  user prompt of the task), ``step`` the environment's answer to the turn just taken (a user
  reply, tool results; ``[]`` when it has nothing to say, e.g. at the end of an episode);
* the actions are the model's turn texts, ``num_envs`` strings (the assistant message contents,
  without the chat template's markup);
* ``rewards[i]`` is the reward of the turn just taken by episode i; the episode's return is the sum
  over its turns (or the discounted return-to-go the control path uses, ``GRPOConfig.gamma``);
* ``infos[i]`` is a dict of whatever episode i wants to report (e.g. ``{"success": True}``).

Common to both: a start state is whatever the environment resets to: an int seed (gymnasium:
``env.reset(seed=s)``), a snapshot of the simulator (`grpo.gym.snapshots.Snapshot`), or a task
object of the environment's own. A GRPO group is G sub-environments reset to the same start (so
their first observations are equal). After a sub-environment's episode ends (terminated or
truncated) the caller ignores it: the actions it passes for it (e.g. ``""`` for text) and what the
environment returns for it do not matter. Rewards are the reward of the transition just taken.

`SupportsSnapshots` is the optional capability of saving and restoring one sub-environment's
state: branching and exact replay need it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, Protocol, TypeAlias, runtime_checkable

from torch import Tensor
from typing_extensions import NamedTuple, TypeVar

__all__ = [
    "Environment",
    "Message",
    "SupportsSnapshots",
    "TextEnvironment",
    "TextObservation",
    "Transition",
]

ObsT_co = TypeVar("ObsT_co", covariant=True, default=Tensor)
ActT_contra = TypeVar("ActT_contra", contravariant=True, default=Tensor)

Message: TypeAlias = dict[str, str]
"""One chat message: ``{"role": ..., "content": ...}`` (the format of ``apply_chat_template``)."""

TextObservation: TypeAlias = list[list[Message]]
"""Per sub-environment, the messages the environment adds to its conversation (``[]``: none)."""


class Transition(NamedTuple, Generic[ObsT_co]):
    """One step of every sub-environment (shapes and types in the module docstring).

    The first four fields are positional as before; ``infos`` (one dict per sub-environment) is
    optional and defaults to None (control environments report nothing).
    """

    observations: ObsT_co
    rewards: Tensor
    terminated: Tensor
    truncated: Tensor
    infos: Sequence[dict[str, Any]] | None = None


@runtime_checkable
class Environment(Protocol[ObsT_co, ActT_contra]):
    """``num_envs`` sub-environments, reset to given start states and stepped together.

    ``Environment`` alone is ``Environment[Tensor, Tensor]`` (control); text environments are
    `TextEnvironment`. ``isinstance(x, Environment)`` checks that the members exist, not their
    types (a runtime check cannot tell a text environment from a tensor one).
    """

    num_envs: int

    def reset(self, starts: Sequence[Any]) -> ObsT_co:
        """Reset sub-environment i to ``starts[i]``; returns the first observations."""

    def step(self, actions: ActT_contra) -> Transition[ObsT_co]:
        """Take ``actions[i]`` in sub-environment i."""

    def close(self) -> None:
        """Release what the environment holds (processes, simulators, threads)."""


@runtime_checkable
class TextEnvironment(Environment[TextObservation, Sequence[str]], Protocol):
    """An `Environment` of chat episodes: ``reset(starts) -> TextObservation`` (each episode's
    first messages), ``step(turns: Sequence[str]) -> Transition[TextObservation]`` (the messages
    the environment adds after each turn, the turn's reward, terminated, truncated, infos)."""

    num_envs: int

    def reset(self, starts: Sequence[Any]) -> TextObservation:
        """Reset episode i to ``starts[i]``; returns its first messages (system/user prompt)."""

    def step(self, actions: Sequence[str]) -> Transition[TextObservation]:
        """Episode i takes the model's turn ``actions[i]``; returns what the environment adds."""

    def close(self) -> None:
        """Release what the environment holds (tool threads, sandboxes)."""


@runtime_checkable
class SupportsSnapshots(Protocol):
    """An `Environment` that saves and restores one sub-environment's full state."""

    def snapshot(self, index: int, observation: Tensor | None = None) -> Any:
        """The state of sub-environment ``index`` (a start state `Environment.reset` accepts)."""
