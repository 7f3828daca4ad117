"""The process the trainer runs in.

* `grpo.runtime.threads`: intra-op threads per step (one for a small CPU policy)
* `grpo.runtime.denormals`: subnormal floats flushed to zero on CPU during a step
* `grpo.runtime.devices`: whether two devices are the same (``cuda`` matches ``cuda:N``)
* `grpo.runtime.extras`: install hints for the optional extras
* `grpo.runtime.dataclass_args`: command-line options and YAML/JSON config files from dataclasses
"""
