"""The causal LM's generation engines: other places to run the same sampling.

`worker`: a `grpo.generation.worker.WorkerEngine` whose process rebuilds a saved
`grpo.llm.CausalLMPolicy` (`causal_lm_worker`); `vllm_engine`: vLLM in the trainer's process
(`VLLMEngine`, optional extra); `vllm_server`: a vLLM server elsewhere (`VLLMServerEngine`), with
`vllm_worker_extension` loaded into it for weight sync. All satisfy
`grpo.generation.GenerationEngine` and take the policy's `grpo.llm.SamplingSettings`;
`CausalLMPolicy.generation_engine(name, seed=...)` builds the one ``GRPOConfig.generation_engine``
names. Nothing here is imported by ``import grpo.llm``.
"""
