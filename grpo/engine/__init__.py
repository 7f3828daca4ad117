"""The engine: how gradients are made, reduced and applied, on one process or many.

* `grpo.engine.backends`: the `Backend` protocol, the local and data-parallel backends
* `grpo.engine.deepspeed`: DeepSpeed ZeRO stages 1-3 (the ``deepspeed`` extra)
* `grpo.engine.fsdp`: PyTorch FSDP2 for ``nn.Module`` policies
* `grpo.engine.distributed`: process groups, sharding data, seeding ranks (``torchrun``)
* `grpo.engine.setup`: choosing the backend, the optimizer, the LR schedule and the reference policy
* `grpo.engine.optim`: the default optimizer and gradient-norm clipping
* `grpo.engine.lr_schedules`: constant, linear and cosine schedules with warmup
"""
