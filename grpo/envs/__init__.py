"""Environments: one protocol for everything a policy plays against, stepped many at a time.

* `grpo.envs.protocol`: the `Environment` protocol (reset to given starts, step, close), generic
  over observations and actions: tensors for control, chat messages and turn texts for language
  models (`TextEnvironment`); its optional `SupportsSnapshots` capability
* `grpo.envs.pendulum`: `TensorPendulum`, gymnasium's Pendulum as a batched tensor environment
  (many envs stepped in one call, as GPU simulators do)
* `grpo.envs.text`: `TextEnv`, ``num_envs`` chat episodes from one episode class (`TextTask`);
  ready tasks `GuessingGame` and `ToolTask`
* `grpo.envs.tools`: tool calls parsed from the model's turn and run with a timeout (`ToolBox`);
  ready tools `calculator_tool` and `lookup_tool`

The gymnasium adapter, `grpo.gym.vector_env.GymVectorEnvironment`, lives with the rest of the
gymnasium path in `grpo.gym`; this package imports nothing of it.
"""

from grpo.envs.protocol import (
    Environment,
    Message,
    SupportsSnapshots,
    TextEnvironment,
    TextObservation,
    Transition,
)
from grpo.envs.text import GuessingGame, Problem, TextEnv, TextTask, ToolTask, TurnResult
from grpo.envs.tools import (
    Tool,
    ToolBox,
    ToolCall,
    ToolResult,
    calculator_tool,
    lookup_tool,
    parse_tool_calls,
)

__all__ = [
    "Environment",
    "GuessingGame",
    "Message",
    "Problem",
    "SupportsSnapshots",
    "TextEnv",
    "TextEnvironment",
    "TextObservation",
    "TextTask",
    "Tool",
    "ToolBox",
    "ToolCall",
    "ToolResult",
    "ToolTask",
    "Transition",
    "TurnResult",
    "calculator_tool",
    "lookup_tool",
    "parse_tool_calls",
]
