"""The parts of step 1, the rollout (its front door is `grpo.experience_collector`).

* `grpo.rollout.batch`: the frozen `ExperienceBatch`, `select_rows`, `evaluate_log_probs`
* `grpo.rollout.log_probs`: what a policy returns -> ``(n, T)`` log-probs + mask
* `grpo.rollout.checks`: checks of what a policy and a reward return, with errors that name them
* `grpo.rollout.reward_guard`: calling a user's reward, naming the failing sample; time limits
* `grpo.rollout.action_stats`: the step's completion-length metrics, for actions that report a length
"""
