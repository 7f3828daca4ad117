"""A LoRA population over one frozen base model (grpo.population.shared_weights): the same
results as members with a whole model each, and the memory of each, measured. Real tiny models
(grpo.llm.tiny) and real peft; offline."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from grpo import GRPOConfig, GRPOTrainer  # noqa: E402
from grpo.llm import CausalLMPolicy, RewardFunctions  # noqa: E402
from grpo.llm.sampling_settings import SamplingSettings  # noqa: E402
from grpo.llm.tiny import build_tiny_model, build_tiny_tokenizer  # noqa: E402
from grpo.population import (  # noqa: E402
    HyperparameterConfig,
    Population,
    RLParameter,
    parameter_bytes,
    population,
)

pytestmark = pytest.mark.usefixtures("one_thread")
logger = logging.getLogger(__name__)

HPC = HyperparameterConfig(
    learning_rate=RLParameter(min=1e-3, max=0.5, shrink_factor=0.5, grow_factor=2.0),
    temperature=RLParameter(min=0.5, max=2.0),
)
SIZE = 4
PROMPTS = ["1+2=", "ab", "xyz", "hi"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("pop_lora")
    tok = build_tiny_tokenizer(d / "tok", pad_is_eos=True)
    build_tiny_model(d / "llama", tok, arch="llama", seed=5)
    return {"tok": tok, "dir": d / "llama"}


def lora_model(tiny: dict[str, Any]) -> Any:
    """The base loaded from disk with a LoRA adapter (seeded init: every call gives the same)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny["dir"]), dtype=torch.float32)
    torch.manual_seed(0)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(base, cfg)


def reward() -> RewardFunctions:
    return RewardFunctions(lambda p, c: [float(len(x)) for x in c])  # longer completions pay more


def trainer_for(model: Any, tiny: dict[str, Any], hp: dict[str, float]) -> GRPOTrainer:
    policy = CausalLMPolicy(
        model, tiny["tok"], SamplingSettings(max_new_tokens=3, temperature=hp["temperature"])
    )
    cfg = GRPOConfig(
        device="cpu", group_size=2, batch_size=2, kl_coeff=0.05, learning_rate=hp["learning_rate"],
        seed=0, distributed="off",
    )  # fmt: skip
    return GRPOTrainer(cfg, policy, reward())


def build(tiny: dict[str, Any], shared: bool) -> Population:
    one = lora_model(tiny) if shared else None

    def make(hp: dict[str, float]) -> GRPOTrainer:
        return trainer_for(one if one is not None else lora_model(tiny), tiny, hp)

    starts = [{"learning_rate": lr, "temperature": 1.0} for lr in (0.002, 0.01, 0.05, 0.2)]
    return population(SIZE, make, HPC, hyperparameters=starts, eval_states=PROMPTS[:2], seed=1)


def adapters(pop: Population) -> list[list[torch.Tensor]]:
    out = []
    for m in pop.members:
        with pop.acting(m) as t:
            out.append([p.detach().clone() for p in t.params])
    return out


def test_shared_base_population_equals_members_with_their_own_models(tiny: dict[str, Any]) -> None:
    """Members over one PEFT model (adapters swapped in) end bitwise where members with a model
    each end; parameter bytes: base + (P + 1) adapters against P whole models."""
    shared, separate = build(tiny, shared=True), build(tiny, shared=False)
    assert shared.shared is not None
    assert separate.shared is None
    for pop in (shared, separate):
        pop.evolve(1, PROMPTS, 2)
    assert [r.as_dict() for r in shared.history] == [r.as_dict() for r in separate.history]
    for a, b in zip(adapters(shared), adapters(separate), strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert len({id(m.trainer.policy.model) for m in shared.members}) == 1
    assert [m.trainer.policy.temperature for m in shared.members] == [
        h["temperature"] for h in shared.history[-1].hyperparameters
    ]
    # memory, measured over distinct storages
    model = shared.members[0].trainer.policy.model
    lora = sum(p.numel() * p.element_size() for p in shared.members[0].trainer.params)
    base = parameter_bytes([model]) - lora
    assert shared.shared is not None
    shared_bytes = parameter_bytes([model], [t for slot in shared.shared.slots.values() for t in slot])
    separate_bytes = parameter_bytes([m.trainer.policy.model for m in separate.members])
    assert shared_bytes == base + (SIZE + 1) * lora
    assert separate_bytes == SIZE * (base + lora)
    logger.info(
        "LoRA population of %d: %d parameter bytes shared vs %d separate (base %d, adapter %d)",
        SIZE, shared_bytes, separate_bytes, base, lora,
    )  # fmt: skip
    assert shared_bytes < 0.5 * separate_bytes


def test_a_separate_reference_adapter_is_refused(tiny: dict[str, Any], tmp_path: Path) -> None:
    one = lora_model(tiny)

    def make(hp: dict[str, float]) -> GRPOTrainer:
        policy = CausalLMPolicy(
            one, tiny["tok"], SamplingSettings(max_new_tokens=2), use_separate_reference_adapter=True
        )
        cfg = GRPOConfig(
            device="cpu",
            group_size=2,
            batch_size=2,
            kl_coeff=0.05,
            learning_rate=hp["learning_rate"],
            seed=0,
            distributed="off",
        )
        return GRPOTrainer(cfg, policy, reward())

    hpc = HyperparameterConfig(learning_rate=RLParameter(min=1e-3, max=0.5))
    with pytest.raises(ValueError, match="reference"):  # grpo.llm refuses a second one first
        population(2, make, hpc, hyperparameters={"learning_rate": 0.01}, eval_states=PROMPTS[:1])
