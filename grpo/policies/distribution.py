"""Ready policies: wrap any `torch.nn.Module` that maps states to a `torch.distributions.Distribution`.

`DistributionPolicy(net)` implements `PolicyModel` and the `evaluate_actions` capability:

* ``generate_actions(states (B, ...), G) -> (B, G, *event)``: one forward, ``dist.sample((G,))``;
* ``evaluate_actions(states (B, ...), actions (B*G, *event), group_size=G)``: one forward per
  *state* (not per sample), log-probs gathered for the G actions, exact ``dist.entropy()``.

``net(states)`` must return a distribution whose batch shape starts with B. Extra batch dims
(e.g. a ``Normal`` over D action dims) are folded into the event with
`torch.distributions.Independent`, so log-probs are one number per action.
`categorical_mlp` and `gaussian_mlp` build the usual networks for discrete and continuous control.
Their states are checked: numbers of shape (B, obs_dim) as a Tensor, a NumPy array or nested lists,
cast to the network's dtype (float64 states are accepted); anything else raises naming the states
and the expected shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.distributions import Categorical, Distribution, Independent, Normal

from grpo.policy_base import EntropyRequest, PolicyOutput, entropy_grad_mode

__all__ = ["CategoricalMLP", "DistributionPolicy", "GaussianMLP", "categorical_mlp", "gaussian_mlp"]


def _mlp(sizes: Sequence[int], activation: type[nn.Module]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(activation())
    return nn.Sequential(*layers)


class CategoricalMLP(nn.Module):
    """states (B, obs_dim) -> Categorical over ``num_actions`` (logits from an MLP)."""

    def __init__(
        self,
        obs_dim: int,
        num_actions: int,
        hidden: Sequence[int] = (64, 64),
        activation: type[nn.Module] = nn.Tanh,
    ) -> None:
        super().__init__()
        self.obs_dim = obs_dim
        self.net = _mlp([obs_dim, *hidden, num_actions], activation)

    def forward(self, states: Tensor) -> Distribution:
        return Categorical(logits=self.net(states), validate_args=False)

    def first_weight(self) -> Tensor:
        """The first layer's weight: the dtype and device states are converted to."""
        # self.net[0].weight as plain dict reads (Module.__getattr__ costs ~1 us on the hot path)
        weight = self._modules["net"]._modules["0"]._parameters["weight"]  # type: ignore[union-attr]
        assert weight is not None
        return weight


class GaussianMLP(nn.Module):
    """states (B, obs_dim) -> Independent Normal over ``action_dim`` (state-independent log-std)."""

    def __init__(
        self,
        obs_dim: int,
        action_dim: int,
        hidden: Sequence[int] = (64, 64),
        activation: type[nn.Module] = nn.Tanh,
        log_std_init: float = 0.0,
    ) -> None:
        super().__init__()
        self.obs_dim = obs_dim
        self.mean = _mlp([obs_dim, *hidden, action_dim], activation)
        self.log_std = nn.Parameter(torch.full((action_dim,), float(log_std_init)))

    def forward(self, states: Tensor) -> Distribution:
        mu = self.mean(states)
        std = self.log_std.exp().expand_as(mu)
        return Independent(Normal(mu, std, validate_args=False), 1, validate_args=False)

    def first_weight(self) -> Tensor:
        """The first layer's weight: the dtype and device states are converted to."""
        # self.mean[0].weight as plain dict reads (Module.__getattr__ costs ~1 us on the hot path)
        weight = self._modules["mean"]._modules["0"]._parameters["weight"]  # type: ignore[union-attr]
        assert weight is not None
        return weight


_READY = (CategoricalMLP, GaussianMLP)


def _describe(states: Any) -> str:
    """``states`` in a few words for an error message."""
    if isinstance(states, Tensor):
        return f"a Tensor of shape {tuple(states.shape)} and dtype {states.dtype}"
    if isinstance(states, np.ndarray):
        return f"a NumPy array of shape {states.shape} and dtype {states.dtype}"
    if isinstance(states, Sequence) and not isinstance(states, (str, bytes)) and states:
        first = repr(states[0])
        first = first if len(first) <= 40 else first[:37] + "..."
        return f"a {type(states).__name__} of {len(states)} {type(states[0]).__name__} (first: {first})"
    return f"{type(states).__name__} {states!r:.40}"


def _ready_states(net: CategoricalMLP | GaussianMLP, states: Any) -> Tensor:
    """``states`` as the (B, obs_dim) tensor of ``net``'s dtype and device, or an error naming them.

    Accepted: a Tensor, a NumPy array, a sequence of Tensors (stacked) or nested lists of numbers,
    of any real dtype (float64 and integers are cast). A Tensor already of the right shape, dtype
    and device costs a few attribute reads.
    """
    weight, obs = net.first_weight(), net.obs_dim
    if isinstance(states, Tensor):
        if (
            states.dim() == 2
            and states.shape[1] == obs
            and states.dtype == weight.dtype
            and states.device == weight.device
        ):
            return states
        x = states
    else:
        x = _numbers(net, states)
    name = f"{type(net).__name__}(obs_dim={obs})"
    if x.dim() != 2 or x.shape[1] != obs:
        if x.dim() == 1 and x.shape[0] == obs:
            fix = f" One state? Pass a batch of one: states[None] (shape (1, {obs}))."
        elif x.dim() == 2:
            fix = (
                f" Each state has {x.shape[1]} features: build the policy for them (obs_dim="
                f"{x.shape[1]}) or fix the states."
            )
        else:
            fix = f" Flatten each state to {obs} numbers."
        seen = _describe(states) if isinstance(states, Tensor) else f"states of shape {tuple(x.shape)}"
        raise ValueError(
            f"{name} expects states of shape (B, {obs}): B states of obs_dim={obs} numbers each; got "
            f"{seen}.{fix}"
        )
    if x.is_complex():
        raise TypeError(f"{name} takes real-valued states; got {_describe(states)}.")
    return x.to(device=weight.device, dtype=weight.dtype)


def _numbers(net: CategoricalMLP | GaussianMLP, states: Any) -> Tensor:
    """Non-Tensor ``states`` (Tensors to stack, a NumPy array, nested lists) as one Tensor."""
    obs = net.obs_dim
    name = f"{type(net).__name__}(obs_dim={obs})"
    if isinstance(states, Sequence) and states and isinstance(states[0], Tensor):
        shapes = {tuple(s.shape) if isinstance(s, Tensor) else type(s).__name__ for s in states}
        if len(shapes) != 1:
            raise ValueError(
                f"{name} got states as a list of Tensors of different shapes "
                f"{sorted(map(str, shapes))}; expected B Tensors of shape ({obs},)."
            )
        return torch.stack(list(states))
    expected = (
        f"{name} takes states as numbers of shape (B, {obs}) (a Tensor, a NumPy array or B lists of "
        f"{obs} numbers)"
    )
    try:
        arr = np.asarray(states)
    except (TypeError, ValueError) as e:  # ragged nested lists
        raise TypeError(f"{expected}; got {_describe(states)}, which is not an array ({e}).") from e
    if arr.dtype.kind not in "biuf":
        raise TypeError(
            f"{expected}; got {_describe(states)} (NumPy dtype {arr.dtype}). Encode each state as "
            f"{obs} numbers first."
        )
    return torch.from_numpy(np.ascontiguousarray(arr))


def categorical_mlp(obs_dim: int, num_actions: int, hidden: Sequence[int] = (64, 64)) -> DistributionPolicy:
    """A ready discrete-action policy: `DistributionPolicy` around a `CategoricalMLP`."""
    return DistributionPolicy(CategoricalMLP(obs_dim, num_actions, hidden))


def gaussian_mlp(
    obs_dim: int, action_dim: int, hidden: Sequence[int] = (64, 64), log_std_init: float = 0.0
) -> DistributionPolicy:
    """A ready continuous-action policy: `DistributionPolicy` around a `GaussianMLP`."""
    return DistributionPolicy(GaussianMLP(obs_dim, action_dim, hidden, log_std_init=log_std_init))


class DistributionPolicy(nn.Module):
    """`PolicyModel` for any module ``net: states (B, ...) -> Distribution`` with batch shape (B,).

    Args:
        net: the module. Its distribution's batch dims beyond the first are treated as event dims.
    """

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def distribution(self, states: Any) -> Distribution:
        """``net(states)`` with batch shape exactly (B,)."""
        x = self._as_tensor(states)
        out: Any = self.net(x)
        if not isinstance(out, Distribution):
            raise TypeError(
                f"{type(self.net).__name__}.forward returned {type(out).__name__}; "
                "DistributionPolicy needs a torch.distributions.Distribution (e.g. "
                "Categorical(logits=...) or Independent(Normal(mu, std), 1))."
            )
        dist: Distribution = out
        extra = len(dist.batch_shape) - 1
        if extra > 0:
            dist = Independent(dist, extra)
        elif extra < 0:
            raise ValueError(
                f"{type(self.net).__name__} returned a distribution with batch shape "
                f"{tuple(dist.batch_shape)}; expected (B,) = ({x.shape[0]},), one per state."
            )
        return dist

    def _as_tensor(self, states: Any) -> Tensor:
        net = self.net
        if type(net) in _READY:  # exactly the ready networks: a subclass may take other states
            return _ready_states(net, states)  # type: ignore[arg-type]
        if isinstance(states, Tensor):
            return states
        if isinstance(states, Sequence) and states and isinstance(states[0], Tensor):
            return torch.stack(list(states))
        return torch.as_tensor(states, dtype=torch.float32, device=self.device)

    @property
    def device(self) -> torch.device:
        """Where the policy's parameters live (CPU for a policy without parameters)."""
        p = next(self.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    # ---- PolicyModel ---------------------------------------------------------------------
    def generate_actions(self, states: Any, num_actions_per_state: int, **kwargs: Any) -> Tensor:
        """Sample G actions for each state. Returns (B, G, *event_shape)."""
        table = self._log_prob_table(states)
        if table is not None:  # as Categorical.sample: multinomial with replacement on the probs
            return torch.multinomial(table.exp(), num_actions_per_state, replacement=True)  # (B, G)
        dist = self.distribution(states)
        samples = dist.sample((num_actions_per_state,))  # (G, B, *event)
        return samples.transpose(0, 1)

    def generate_actions_with_log_probs(
        self, states: Any, num_actions_per_state: int, **kwargs: Any
    ) -> tuple[Tensor, PolicyOutput]:
        """Sample (B, G, *event) actions and their (B*G,) log-probs from one forward per state."""
        table = self._log_prob_table(states)
        if table is not None:  # as Categorical.sample: multinomial with replacement on the probs
            actions = torch.multinomial(table.exp(), num_actions_per_state, replacement=True)  # (B, G)
            return actions, PolicyOutput(table.gather(1, actions).reshape(-1))
        dist = self.distribution(states)
        samples = dist.sample((num_actions_per_state,))  # (G, B, *event)
        logp = dist.log_prob(samples).transpose(0, 1).reshape(-1)  # (B*G,)
        return samples.transpose(0, 1), PolicyOutput(logp)

    def get_log_probabilities(self, states: Any, actions: Any) -> Tensor:
        """log pi(actions[i] | states[i]) for N flat pairs. Returns (N,)."""
        return self.distribution(states).log_prob(torch.as_tensor(actions))

    def get_parameters(self) -> dict[str, Tensor]:
        return dict(self.named_parameters())

    def _log_prob_table(self, states: Any) -> Tensor | None:
        """(B, K) log-probabilities of every action when the network is the ready `CategoricalMLP`
        (exactly that class: a subclass may change ``forward``) and `distribution` is not
        overridden, else None. Same numbers as its Categorical without building the distribution
        object (per-call overhead on small nets)."""
        if (
            type(self.net) is not CategoricalMLP
            or type(self).distribution is not DistributionPolicy.distribution
        ):
            return None
        return torch.log_softmax(self.net.net(self._as_tensor(states)), -1)

    # ---- capability: grouped evaluation with exact entropy --------------------------------
    def evaluate_actions(
        self, states: Any, actions: Any, *, group_size: int = 1, with_entropy: EntropyRequest = False
    ) -> PolicyOutput:
        """Log-probs (N,) and exact entropy (N,) in one forward (``with_entropy="no_grad"``: the
        entropy without a graph, for metrics).

        With ``group_size=G``, ``states`` is (N/G, ...) and ``actions`` (N, *event) group-major:
        the network runs once per state and the G actions are scored against its output.
        """
        table = self._log_prob_table(states)
        if table is not None:
            return _table_evaluate(table, torch.as_tensor(actions), group_size, with_entropy)
        dist = self.distribution(states)
        a = torch.as_tensor(actions)
        if type(dist) is Categorical:
            return _categorical_evaluate(dist, a, group_size, with_entropy)
        if group_size == 1:
            logp = dist.log_prob(a)
            ent = None
            if with_entropy:
                with entropy_grad_mode(with_entropy):
                    ent = dist.entropy()
            return PolicyOutput(logp, entropy=ent)
        b = dist.batch_shape[0]
        grouped = a.reshape(b, group_size, *a.shape[1:]).transpose(0, 1)  # (G, B, *event)
        logp = dist.log_prob(grouped).transpose(0, 1).reshape(-1)  # (B*G,)
        ent = None
        if with_entropy:
            try:
                with entropy_grad_mode(with_entropy):
                    ent = dist.entropy().repeat_interleave(group_size)
            except NotImplementedError:
                ent = None
        return PolicyOutput(logp, entropy=ent)


def _categorical_evaluate(
    dist: Categorical, actions: Tensor, group_size: int, with_entropy: EntropyRequest
) -> PolicyOutput:
    """`DistributionPolicy.evaluate_actions` for a Categorical, straight from its normalised logits.

    Same values as ``dist.log_prob`` / ``dist.entropy`` with a handful of ops instead of the
    broadcasting machinery: ``logits`` (B, K) are already ``log_softmax``-ed by Categorical.
    """
    logits = dist.logits  # (B, K), log-probabilities
    b = logits.shape[0]
    idx = actions.long().reshape(b, -1)  # (B, G)
    logp = logits.gather(1, idx).reshape(-1)  # (B*G,)
    ent = None
    if with_entropy:
        with entropy_grad_mode(with_entropy):
            # as Categorical.entropy: clamp -inf logits (p = 0) so that 0 * log 0 counts as 0
            ent = -(dist.probs * logits.clamp(min=torch.finfo(logits.dtype).min)).sum(-1)
            if group_size > 1:
                ent = ent.repeat_interleave(group_size)
    return PolicyOutput(logp, entropy=ent)


def _table_evaluate(
    table: Tensor, actions: Tensor, group_size: int, with_entropy: EntropyRequest
) -> PolicyOutput:
    """Log-probs (B*G,) of group-major ``actions`` and exact entropies from a (B, K) log-prob
    table: ``H = -sum_k p_k log p_k`` (the table is finite: it comes from finite logits)."""
    b = table.shape[0]
    logp = table.gather(1, actions.long().reshape(b, -1)).reshape(-1)
    ent = None
    if with_entropy:
        with entropy_grad_mode(with_entropy):
            ent = (table.exp() * table).sum(-1).neg_()
            if group_size > 1:
                ent = ent.repeat_interleave(group_size)
    return PolicyOutput(logp, entropy=ent)
