"""``grpo-train`` (and ``python -m grpo.llm``): GRPO fine-tuning of a Hugging Face causal LM.

    grpo-train --model-name Qwen/Qwen2.5-0.5B-Instruct --dataset train.jsonl \
        --reward exact_match=1.0 --reward format=0.2 --num-generations 8 --output-dir out
    grpo-train --config run.yaml --recipe dapo --resume          # a preset, continued exactly

Every option is a dataclass field, declared once, with its help text in the field's metadata
(`grpo.runtime.dataclass_args`): every `GRPOConfig` field (``--kl-coeff``, ``--policy-loss``,
``--fsdp``, ``--deepspeed``, ... a field added to `GRPOConfig` appears here by itself) and the
command's own options below (`ModelOptions`, `DataOptions`, `GenerationOptions`,
`RewardOptions`, `RunOptions`, `OutputOptions`, `EvaluationOptions`, `EnvironmentOptions`) and
the fields of `grpo.training.evaluation.EvalOptions` as ``--eval-*`` (``--eval-group-size``, ``--eval-ks``,
...). The accepted spellings of `grpo.config.SPELLINGS` (the one alias table) are flags too:
seed 003's ``--num-generations`` = ``--group-size``, ``--kl-coef`` = ``--kl-coeff``, ``--recipe NAME``
= ``--recipe-name``, and with mapped values seed 001's ``--adv-norm mean_only`` = ``--advantage-scale
none``. ``--config FILE`` reads any of them from YAML or JSON (keys with ``-`` or ``_``); a flag or
key that is no option is refused with the name it probably meant. Precedence: `GRPOConfig` defaults
< this command's defaults (`CONFIG_DEFAULTS`) < the recipe < the config file < the command line.

Multi-turn episodes: ``--env module:factory`` (or ``path.py:factory``; ``factory(num_envs) ->
grpo.envs.TextEnvironment``) trains a `grpo.llm.multiturn.MultiTurnPolicy` around the causal LM
(``--max-turns``, ``--max-total-tokens``; ``--max-new-tokens`` per turn) on the environment's
`ConversationReward` (``--per-turn-credit``: turn-level credit discounted by ``--gamma``); the
states are start states, ``--dataset`` rows (`load_starts`) or the seeds ``0 .. --num-starts - 1``,
dealt and resumed like prompts. ``--reward`` and the other single-turn scoring options are
refused with ``--env`` (the environment scores the episodes), as is ``--eval-dataset``.

Training runs on `GRPOTrainer.train` (`grpo.training.loop`): ``step()`` reports the completion
lengths (``completion/*``) and ``optim/lr``; what the command adds to each step's record (the
reward functions' counters, ``throughput/tokens_per_s``), its model saves and the completions
table (``--log-completions-every``) are callbacks; its outputs are metric sinks
(`grpo.metrics.sinks`). With ``--eval-dataset`` and ``--eval-every N`` the run evaluates every N
steps (`grpo.training.evaluation.evaluate`: ``eval/reward/*``, ``eval/pass@k``, ``eval/maj@k``),
and those steps' records reach every sink whatever ``--logging-steps`` is.

Output, in ``<output-dir>``: ``checkpoint-{step}/`` every ``--save-steps`` steps and
``final_model/`` (`grpo.llm.checkpoint.save_llm_checkpoint`): the weights in safetensors plus
the tokenizer, loadable with ``AutoModelForCausalLM.from_pretrained`` (full fine-tuning) or
``PeftModel.from_pretrained`` (``--lora``: the adapter only), and ``trainer_state.json`` (step,
options, last metrics); ``completions.jsonl`` with ``--log-completions-every``; ``checkpoints/step-N/``
at the same steps and at the end: the trainer's checkpoint (weights, optimizer and LR-schedule
state, RNG streams, the data position; `grpo.state.checkpoint`), which ``--resume`` continues
bitwise as the uninterrupted run. Metrics go to ``metrics.jsonl`` (appended, one `JSONLSink` line
per logged step; a resumed run drops the lines after its checkpoint), to the ``grpo.llm`` logger
and to W&B with ``--use-wandb``, every ``--logging-steps`` steps and at the last step.

The command lives in four modules named after what they do: `grpo.llm.cli_options` (the option
dataclasses, the parser, `parse_args`, the checks, `resolve_config`), `grpo.llm.cli_rewards` (the
``--reward`` functions), `grpo.llm.cli_outputs` (model saves, metric sinks, callbacks, checkpoint
locations) and `grpo.llm.cli_run` (`train`, `main`); this module re-exports their public names
(``__all__``: cli_options' and the command's entry points).
"""

from __future__ import annotations

from grpo.llm import cli_options
from grpo.llm.cli_options import *  # noqa: F403  (the options, the parser, parse_args, ...)
from grpo.llm.cli_rewards import build_rewards
from grpo.llm.cli_run import load_starts, main, train

__all__ = ["build_rewards", "load_starts", "main", "train"]
__all__ += cli_options.__all__

if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
