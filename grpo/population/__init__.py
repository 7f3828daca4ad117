"""Population-based training: trainers that evolve their hyperparameters while they train.

`Population` (grpo/population/population.py) runs generations of train / fitness / tournament
selection with elitism / clone through state dicts / mutation; the modules, one job each:

* `grpo.population.hyperparameters`: `RLParameter`, `HyperparameterConfig`, the mutation rule;
* `grpo.population.settings`: setting a hyperparameter in a live trainer (optimizer, schedule,
  objective) so that the next step uses it;
* `grpo.population.selection`: tournament selection with elitism, the mutations drawn;
* `grpo.population.member`: `Member` (a slot: ``index``, trainer, hyperparameters, fitness, cost);
* `grpo.population.cost`: what a slot's training and fitness cost, in the env's units;
* `grpo.population.layout`: all slots in one process, or one per process under torchrun;
* `grpo.population.shared_weights`: members sharing one model (LoRA adapters over one base);
* `grpo.population.checkpoint`: the population's checkpoints on disk;
* `grpo.population.lineage`: `GenerationRecord`, `plot_lineage`.

docs/population.md is the guide.
"""

from grpo.population.hyperparameters import (
    MUTABLE,
    HyperparameterConfig,
    RLParameter,
    mutate_value,
    sample_hyperparameters,
)
from grpo.population.lineage import GenerationRecord, plot_lineage
from grpo.population.member import Member
from grpo.population.population import MemberFactory, MutationHook, Population, build_alone, population
from grpo.population.selection import Mutation, choose_mutations, elite_index, tournament_parents
from grpo.population.settings import (
    apply_hyperparameters,
    checked_config,
    read_hyperparameters,
    set_learning_rate,
)
from grpo.population.shared_weights import SharedWeights, parameter_bytes, shares_weights

__all__ = [
    "MUTABLE",
    "GenerationRecord",
    "HyperparameterConfig",
    "Member",
    "MemberFactory",
    "Mutation",
    "MutationHook",
    "Population",
    "RLParameter",
    "SharedWeights",
    "apply_hyperparameters",
    "build_alone",
    "checked_config",
    "choose_mutations",
    "elite_index",
    "mutate_value",
    "parameter_bytes",
    "plot_lineage",
    "population",
    "read_hyperparameters",
    "sample_hyperparameters",
    "set_learning_rate",
    "shares_weights",
    "tournament_parents",
]
