"""Ready policies: a `torch.nn.Module` that maps states to a `torch.distributions.Distribution`
becomes a `PolicyModel` (`grpo.policies.distribution`)."""

from grpo.policies.distribution import (
    CategoricalMLP,
    DistributionPolicy,
    GaussianMLP,
    categorical_mlp,
    gaussian_mlp,
)

__all__ = ["CategoricalMLP", "DistributionPolicy", "GaussianMLP", "categorical_mlp", "gaussian_mlp"]
