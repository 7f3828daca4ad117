"""`TensorPendulum`: gymnasium's Pendulum-v1 as a batched tensor environment.

``num_envs`` pendulums live in two tensors on one device and step together in one call: what GPU
simulators (Isaac Gym, MJX, Brax) do, here in plain torch so it runs and is tested on a CPU. The
dynamics, reward and 200-step time limit are gymnasium's Pendulum-v1 (g = 10, m = l = 1,
dt = 0.05, |u| <= 2, |theta_dot| <= 8)::

    u        = clip(a, -2, 2)
    reward   = -(angle_normalize(theta)^2 + 0.1 theta_dot^2 + 0.001 u^2)
    theta_dot' = clip(theta_dot + (3 g / (2 l) sin(theta) + 3 / (m l^2) u) dt, -8, 8)
    theta'   = theta + theta_dot' dt
    obs      = (cos theta, sin theta, theta_dot)

in float32 (gymnasium computes in float64, so trajectories agree to float32 rounding, not
bitwise). A start is an int seed (theta ~ U(-pi, pi), theta_dot ~ U(-1, 1) from
``torch.Generator().manual_seed(seed)``) or a snapshot of one pendulum (`snapshot`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from grpo.envs.protocol import Transition

__all__ = ["TensorPendulum"]

MAX_SPEED, MAX_TORQUE, DT, G, M, L, MAX_STEPS = 8.0, 2.0, 0.05, 10.0, 1.0, 1.0, 200


class TensorPendulum:
    """``num_envs`` Pendulum-v1 environments stepped in one call (an `grpo.envs.Environment`
    with `grpo.envs.SupportsSnapshots`). Observations (num_envs, 3), actions (num_envs, 1).

    Attributes:
        observation_dim: 3.
        action_dim: 1.
    """

    observation_dim = 3
    action_dim = 1

    def __init__(self, num_envs: int, device: str | torch.device = "cpu") -> None:
        if isinstance(num_envs, bool) or not isinstance(num_envs, int) or num_envs < 1:
            raise ValueError(f"TensorPendulum(num_envs={num_envs!r}): expected an integer >= 1.")
        self.num_envs = num_envs
        self.device = torch.device(device)
        self.theta = torch.zeros(num_envs, device=self.device)
        self.theta_dot = torch.zeros(num_envs, device=self.device)
        self.t = torch.zeros(num_envs, dtype=torch.int64, device=self.device)

    def reset(self, starts: Sequence[Any]) -> Tensor:
        if len(starts) != self.num_envs:
            raise ValueError(f"TensorPendulum.reset got {len(starts)} starts for {self.num_envs} envs.")
        state = torch.empty(self.num_envs, 3)
        for i, s in enumerate(starts):
            state[i] = s if isinstance(s, Tensor) else self._random_start(s)
        state = state.to(self.device)
        self.theta, self.theta_dot, self.t = state[:, 0].clone(), state[:, 1].clone(), state[:, 2].long()
        return self._observations()

    @staticmethod
    def _random_start(seed: Any) -> Tensor:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"TensorPendulum starts are non-negative int seeds or snapshots; got {seed!r}.")
        g = torch.Generator().manual_seed(seed)
        u = torch.rand(2, generator=g) * 2 - 1
        return torch.tensor([float(u[0]) * math.pi, float(u[1]), 0.0])

    def step(self, actions: Tensor) -> Transition:
        u = actions.to(self.device).reshape(self.num_envs, -1)[:, 0].clamp(-MAX_TORQUE, MAX_TORQUE)
        th, thdot = self.theta, self.theta_dot
        normalised = torch.remainder(th + math.pi, 2 * math.pi) - math.pi
        costs = normalised.square() + 0.1 * thdot.square() + 0.001 * u.square()
        thdot = (thdot + (3 * G / (2 * L) * torch.sin(th) + 3.0 / (M * L**2) * u) * DT).clamp(
            -MAX_SPEED, MAX_SPEED
        )
        self.theta, self.theta_dot, self.t = th + thdot * DT, thdot, self.t + 1
        terminated = torch.zeros(self.num_envs, dtype=torch.bool, device=self.device)
        return Transition(self._observations(), -costs, terminated, self.t >= MAX_STEPS)

    def snapshot(self, index: int, observation: Tensor | None = None) -> Tensor:
        """Pendulum ``index``'s state (theta, theta_dot, step) as a (3,) tensor: a start for `reset`."""
        return torch.stack([self.theta[index], self.theta_dot[index], self.t[index].float()]).cpu()

    def _observations(self) -> Tensor:
        return torch.stack([torch.cos(self.theta), torch.sin(self.theta), self.theta_dot], dim=1)

    def close(self) -> None:
        return None
