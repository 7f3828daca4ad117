"""The causal LM's generation engines: other places to run the same sampling.

`worker`: a `grpo.generation.worker.WorkerEngine` whose process rebuilds a saved
`grpo.llm.CausalLMPolicy` (`causal_lm_worker`); `vllm_engine`: vLLM in the trainer's process
(`VLLMEngine`, optional extra); `vllm_server`: a vLLM server elsewhere (`VLLMServerEngine`), with
`vllm_worker_extension` loaded into it for weight sync. All satisfy
`grpo.generation.GenerationEngine` and take the policy's `grpo.llm.SamplingSettings`;
`CausalLMPolicy.generation_engine(name, seed=...)` builds the one ``GRPOConfig.generation_engine``
names. The engines read the policy through `causal_lm.CausalLM` (a protocol) and build
`grpo.llm.completion.Completion` s, and import no module of the policy's: the policy imports
them. Nothing here is imported by ``import grpo.llm``.
"""
