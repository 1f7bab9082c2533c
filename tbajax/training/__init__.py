"""The policy update: a functional train state, one jitted sharded update, schedules, checkpoints.

    graphdef, state = init_train_state(model, TrainerConfig(...), mesh)
    step = make_train_step(graphdef, config, "tb", mesh=mesh, state_sharding=state_shardings(state, mesh))
    update = int(state.step) + 1
    state, out = step(state, batch)
    metrics = raise_on_bad_step(out, update)  # NonFiniteLossError: the update was not applied

Modules, by seam: `loss` (one micro-batch's loss: policy and, if the objective reads it,
reference scoring), `microbatch` (exact gradient accumulation), `step` (accumulated gradients
-> one update, jitted), `updater` (`PolicyUpdater`, the stateful edge with host-side checks),
`collate` (host side: trajectories -> Batch), `state`, `config`, `schedules`, `checkpoint`.

An objective with per-prompt trainable params (`tb_learned_logz`) needs
`TrainerConfig(aux_table_size=number of prompt ids)` and a state built with
`init_train_state(model, config, mesh, aux=spec.initial_aux(objective_config, config.aux_table_size))`
(`PolicyUpdater` does this); the table is `state.aux`, e.g. `state.aux["log_z"][prompt_id]`.
"""

from tbajax.objectives.registry import resolve_objective
from tbajax.training.checkpoint import Checkpointer
from tbajax.training.config import BetaSchedule, LRSchedule, OptimizerConfig, TrainerConfig
from tbajax.training.loss import sequence_logprobs
from tbajax.training.microbatch import accumulate_gradients
from tbajax.training.schedules import beta_at, learning_rate
from tbajax.training.state import (
    AuxAdamState,
    LoraBase,
    TrainState,
    abstract_state,
    abstract_train_state,
    aux_adam_update,
    aux_rows_touched,
    init_aux_opt_state,
    init_lora_train_state,
    init_train_state,
    make_optimizer,
    make_trainable_optimizer,
    policy_params,
    reset_reference,
    scale_by_learning_rate_arg,
    scale_by_row_adam,
    split_policy,
    state_shardings,
    update_key,
)
from tbajax.training.step import (
    MicroBatchLayoutError,
    NonFiniteLossError,
    StepOutput,
    batch_shardings,
    initial_aux,
    make_train_step,
    raise_on_bad_step,
    train_step,
)
from tbajax.training.updater import PolicyUpdater, Trainer

__all__ = [
    "AuxAdamState",
    "BetaSchedule",
    "Checkpointer",
    "LRSchedule",
    "LoraBase",
    "MicroBatchLayoutError",
    "NonFiniteLossError",
    "OptimizerConfig",
    "PolicyUpdater",
    "StepOutput",
    "TrainState",
    "Trainer",
    "TrainerConfig",
    "abstract_state",
    "abstract_train_state",
    "accumulate_gradients",
    "aux_adam_update",
    "aux_rows_touched",
    "batch_shardings",
    "beta_at",
    "init_aux_opt_state",
    "init_lora_train_state",
    "init_train_state",
    "initial_aux",
    "learning_rate",
    "make_optimizer",
    "make_train_step",
    "make_trainable_optimizer",
    "policy_params",
    "raise_on_bad_step",
    "reset_reference",
    "resolve_objective",
    "scale_by_learning_rate_arg",
    "scale_by_row_adam",
    "sequence_logprobs",
    "split_policy",
    "state_shardings",
    "train_step",
    "update_key",
]
