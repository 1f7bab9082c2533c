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

from tbajax._lazy import lazy_exports

_EXPORTS = {  # public name -> the submodule that defines it
    "resolve_objective": "tbajax.objectives.registry",
    "Checkpointer": "checkpoint",
    "BetaSchedule": "config",
    "LRSchedule": "config",
    "OptimizerConfig": "config",
    "TrainerConfig": "config",
    "sequence_logprobs": "loss",
    "accumulate_gradients": "microbatch",
    "beta_at": "schedules",
    "learning_rate": "schedules",
    "AuxAdamState": "state",
    "LoraBase": "state",
    "TrainState": "state",
    "abstract_state": "state",
    "abstract_train_state": "state",
    "aux_adam_update": "state",
    "aux_rows_touched": "state",
    "init_aux_opt_state": "state",
    "init_lora_train_state": "state",
    "init_train_state": "state",
    "make_optimizer": "state",
    "make_trainable_optimizer": "state",
    "policy_params": "state",
    "reset_reference": "state",
    "scale_by_learning_rate_arg": "state",
    "scale_by_row_adam": "state",
    "split_policy": "state",
    "state_shardings": "state",
    "update_key": "state",
    "MicroBatchLayoutError": "step",
    "NonFiniteLossError": "step",
    "StepOutput": "step",
    "batch_shardings": "step",
    "initial_aux": "step",
    "make_train_step": "step",
    "raise_on_bad_step": "step",
    "train_step": "step",
    "PolicyUpdater": "updater",
    "Trainer": "updater",
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
