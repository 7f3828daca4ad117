"""The algorithm family: pure functions the objective and the advantages are made of.

* `grpo.algorithms.policy_losses`: per-step policy losses (clip, DAPO's asymmetric clip, GSPO, CISPO, ...)
* `grpo.algorithms.kl`: KL estimators (k1, k2, k3) and the KL-in-reward penalty
* `grpo.algorithms.aggregation`: masked aggregation of per-step losses (token / sequence mean, ...)
* `grpo.algorithms.clip_twin`: twin of `GRPOObjective.composed` for the "clip" loss (values and
  gradients in one pass), kept for the small-policy step time it saves, tested equal
* `grpo.algorithms.loss_plugins`: losses a wing registers by name (Liger's, from `grpo.llm.liger`)
* `grpo.algorithms.objective_statistics`: the objective's statistics from its per-step values
* `grpo.algorithms.advantages`: advantage variants (baselines, scales, per-step returns)
* `grpo.algorithms.recipes`: named recipes of published settings (`GRPOConfig.recipe`)
* `grpo.algorithms.pass_at_k`: unbiased pass@k and maj@k from n samples per problem
* `grpo.algorithms.sampler_correction`: importance weights of a sampler/trainer mismatch (token or
  sequence level, truncated or masked) and their effective sample size

The front doors that compose them are `grpo.grpo_objective` and `grpo.advantage_estimator`.
"""
