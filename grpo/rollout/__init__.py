"""The parts of step 1, the rollout (its front door is `grpo.experience_collector`).

* `grpo.rollout.reward_guard`: calling a user's reward, naming the failing sample; time limits
"""
