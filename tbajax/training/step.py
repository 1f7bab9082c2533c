"""One trainer update as a pure function `(state, batch) -> (state, output)`, and its jitted form.

The loss of a micro-batch is in `training.loss`, the exact micro-batch accumulation in
`training.microbatch`, the stateful edge (`PolicyUpdater`) in `training.updater`; this module
turns accumulated gradients into one update.

A non-finite loss or gradient norm never reaches the params: inside the step the update is a
branch taken only when loss and gradient norm are finite (else the old state comes back), and
the host raises `NonFiniteLossError` naming the update and the groups whose inputs or
log-probs are non-finite.

Objectives with per-prompt aux params (`tb_learned_logz`'s log Z table, `TrainState.aux`):
the loss is differentiated with respect to params and aux together; each row reads its table
entry by `batch.prompt_id`. One `optax.multi_transform` (`make_trainable_optimizer`) updates both:
the aux table has its own per-row Adam (`scale_by_row_adam`) at lr(step) ×
`objective_config.aux_lr_scale`; gradient clipping (`max_grad_norm`) looks at the params' global
norm only and never scales the aux gradient (log Z has to travel ~r/β, and its gradient is large
exactly when it lags). Without aux nothing of this is traced.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tbajax import op_scopes as S
from tbajax.batch import Batch, PackedGroups
from tbajax.objectives.base import Metrics, Ratio
from tbajax.objectives.registry import resolve_objective
from tbajax.sharding import LOGICAL_RULES, host_to_global, spans_processes
from tbajax.training.collate import scored_windows
from tbajax.training.layout import batch_layout
from tbajax.training.config import TrainerConfig
from tbajax.training.loss import sequence_logprobs  # noqa: F401  (re-exported: the old import path)
from tbajax.training.microbatch import (  # noqa: F401  (local_group_ids, split_microbatches: re-exported)
    accumulate_gradients,
    local_group_ids,
    microbatch_layout_ok,
    split_microbatches,
)
from tbajax.training.schedules import beta_at, learning_rate
from tbajax.training.state import (
    LoraBase,
    TrainState,
    aux_rows_touched,
    aux_table_size,
    make_trainable_optimizer,
    reset_reference,
    state_shardings,
)

Array = jax.Array
PyTree = Any
Objective = Callable[[Batch, Array, Any], tuple[Ratio, Metrics]]


class StepOutput(NamedTuple):
    """What a step reports. metrics: float32 scalars. applied: the update went in.
    finite: loss and grad norm were finite. layout_ok: no group straddled two micro-batches.
    row_finite / group_id [B]: which rows had non-finite inputs or log-probs, for the error."""

    metrics: dict[str, Array]
    applied: Array
    finite: Array
    layout_ok: Array
    row_finite: Array
    group_id: Array


class NonFiniteLossError(FloatingPointError):
    """The loss or gradient norm of an update was NaN/inf; the update was not applied."""

    def __init__(self, update: int, group_ids: list[int], metrics: Mapping[str, float]):
        self.update = update
        self.group_ids = group_ids
        self.metrics = dict(metrics)
        where = (
            f"groups with non-finite rewards, log-probs or reference log-probs: {group_ids}"
            if group_ids
            else "no group's inputs or log-probs are non-finite (look at the objective, e.g. β = 0)"
        )
        super().__init__(
            f"non-finite loss or gradient at update {update} (loss={metrics.get('loss')}, "
            f"grad_norm={metrics.get('grad_norm')}); the update was not applied; {where}"
        )


class MicroBatchLayoutError(ValueError):
    """A group's rows fall into more than one micro-batch, so its statistics would be wrong."""


# ----------------------------------------------------------------------------- the step


def train_step(
    state: TrainState,
    batch: Batch,
    lora: LoraBase | None = None,
    *,
    graphdef: nnx.GraphDef,
    objective: Objective,
    objective_config: Any,
    config: TrainerConfig,
) -> tuple[TrainState, StepOutput]:
    """One AdamW update (pure; jit it with `make_train_step`).

    With `state.aux`, also one per-row Adam update of the aux table (rows of the batch's
    prompts only) at lr × `objective_config.aux_lr_scale`, unclipped; metrics gain aux_grad_norm.
    With `lora` (the frozen base), `state.params` are the adapters and only they are updated.
    """
    has_aux = getattr(objective, "has_aux", False)
    if has_aux != (state.aux is not None):
        raise ValueError(
            f"objective {getattr(objective, 'name', objective)!r} "
            + ("trains an aux table but the state has none: build it with "
               "init_train_state(..., aux=initial_aux(objective, objective_config, config))"
               if has_aux else "has no aux params but the state holds an aux table")
        )
    tx = make_trainable_optimizer(config.optimizer, state.aux is not None)
    update = state.step + 1
    if config.beta is not None:
        batch = dataclasses.replace(batch, beta=beta_at(config.beta, update))
    batch = dataclasses.replace(batch, beta=jnp.asarray(batch.beta, jnp.float32))
    frozen = state.ref_params if lora is None else dataclasses.replace(lora, ref_adapters=state.ref_params)
    (grads, aux_grads), total, count, obj_metrics, row_ok = accumulate_gradients(
        state.params,
        frozen,
        batch,
        graphdef=graphdef,
        objective=objective,
        objective_config=objective_config,
        config=config,
        aux=state.aux,
    )
    denom = jnp.maximum(count, 1e-12)
    loss = total / denom
    grads = jax.tree.map(lambda g: (g / denom).astype(g.dtype), grads)
    grad_norm = optax.global_norm(grads)
    lr = learning_rate(config.optimizer.lr, state.step)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    extra_metrics: dict[str, Array] = {}
    extra_args: dict[str, Array] = {"lr": lr}
    if state.aux is not None:
        aux_grads = jax.tree.map(lambda g: (g / denom).astype(g.dtype), aux_grads)
        aux_grad_norm = optax.global_norm(aux_grads)
        finite = finite & jnp.isfinite(aux_grad_norm)
        extra_args.update(
            aux_lr=lr * objective_config.aux_lr_scale,
            touched=jnp.ones((1,), bool) if getattr(objective, "aux_scope", "prompt") == "shared"
            else aux_rows_touched(batch.prompt_id, batch.sample_mask, aux_table_size(state.aux)),
        )
        extra_metrics["aux_grad_norm"] = aux_grad_norm
    layout_ok = microbatch_layout_ok(batch, config.num_microbatches)
    applied = finite & layout_ok

    def apply(operand: tuple[TrainState, Any]) -> TrainState:
        old, g = operand
        trainable = (old.params, old.aux)
        with jax.named_scope(S.OPTIMIZER):
            updates, opt_state = tx.update(g, old.opt_state, trainable, **extra_args)
            params, aux = optax.apply_updates(trainable, updates)
        new = dataclasses.replace(old, params=params, aux=aux, opt_state=opt_state, step=update)
        if config.reference_reset_every is not None:
            reset = functools.partial(
                reset_reference, tx=tx, reset_moments=config.reset_optimizer_on_reference_reset
            )
            new = jax.lax.cond(update % config.reference_reset_every == 0, reset, lambda s: s, new)
        return new

    # a branch, not a select after the fact: the select kept XLA from fusing the AdamW pass
    # (4x slower optimizer on CPU), and the skipped branch costs nothing
    new = jax.lax.cond(applied, apply, lambda operand: operand[0], (state, (grads, aux_grads)))

    real = batch.sample_mask
    metrics = {k: v.value for k, v in obj_metrics.items()}
    metrics.update(
        loss=loss,
        grad_norm=grad_norm,
        lr=lr,
        beta=batch.beta,
        tokens=(batch.attention_mask & real[:, None]).sum().astype(jnp.float32),
        loss_tokens=batch.row_mask().sum(),
        sequences=real.sum().astype(jnp.float32),
        **extra_metrics,
    )
    metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
    return new, StepOutput(metrics, applied, finite, layout_ok, row_ok, batch.group_id)


def batch_shardings(mesh: Mesh, packed: bool = False, strided: bool = False) -> Batch:
    """Every [B, ...] field split on its batch dim over the "batch" mesh axes; the scalars (β, the
    current version) replicated; packed rows (if `packed`; with the strided layout's masks if
    `strided`) split on their leading dim too, else the scored windows (`Batch.scored`;
    `make_train_step` fills them in for a batch without)."""
    rows = NamedSharding(mesh, P(LOGICAL_RULES["batch"]))
    fields = {f.name: rows for f in dataclasses.fields(Batch)}
    fields["beta"] = fields["current_version"] = NamedSharding(mesh, P())
    layout = {f.name: rows for f in dataclasses.fields(PackedGroups)}
    if not strided:
        layout["prompt_real"] = layout["response_real"] = None
    fields["packed"] = PackedGroups(**layout) if packed else None
    fields["scored"] = None if packed else rows
    fields["prompt_features"] = None  # computed inside the step, never an input
    return Batch(**fields)


def initial_aux(
    objective: Any, objective_config: Any, config: TrainerConfig, feature_dim: int | None = None
) -> PyTree | None:
    """The objective's initial aux params (`ObjectiveSpec.initial_aux`: a per-prompt table sized by
    `config.aux_table_size`, or a head on `feature_dim` = the model's hidden size), or None for
    objectives without aux params.

    Pass it to `init_train_state(..., aux=...)`; `PolicyUpdater` does both.
    """
    spec, objective_config = resolve_objective(objective, objective_config)
    return spec.initial_aux(objective_config, config.aux_table_size, feature_dim)


def make_train_step(
    graphdef: nnx.GraphDef,
    config: TrainerConfig,
    objective: Any,
    objective_config: Any = None,
    *,
    mesh: Mesh | None = None,
    state_sharding: Any = None,
    compiler_options: dict[str, Any] | None = None,
    lora: LoraBase | None = None,
) -> Callable[[TrainState, Batch], tuple[TrainState, StepOutput]]:
    """`step(state, batch) -> (state, output)`, jitted, donating the input state.

    graphdef, config, objective and objective_config are baked in (static). `objective` is
    anything `tbajax.objectives.get_objective` accepts ("tb", "tba_prime", a function, ...);
    objective_config None means its default config. An objective with aux params needs a state
    built with `init_train_state(..., aux=initial_aux(...))`. With `mesh`, the
    state is pinned to `state_sharding` (see `state_shardings`) in and out, the batch is split
    over the batch axes (its size must divide by data × fsdp), and outputs are replicated; the
    mesh is put in context while tracing so the model's activation constraints apply. The step
    takes a batch in any layout (rows, packed or strided groups: `training.layout`) and compiles
    one program per layout and shape it meets.

    lora: the frozen base of a LoRA state (`init_lora_train_state`); it is passed to every call
    as an argument (never donated, never a compile-time constant).
    """
    objective, objective_config = resolve_objective(objective, objective_config)
    fn = functools.partial(
        train_step, graphdef=graphdef, objective=objective, objective_config=objective_config, config=config
    )
    if mesh is None:
        jitted = jax.jit(fn, donate_argnums=0, compiler_options=compiler_options)
        if lora is None:
            return jitted
        return lambda state, batch: jitted(state, batch, lora)
    if state_sharding is None:
        raise ValueError("make_train_step(mesh=...) needs state_sharding=state_shardings(state, mesh)")
    frozen = () if lora is None else (lora,)
    frozen_shardings = () if lora is None else (state_shardings(lora, mesh),)
    global_batch = spans_processes(mesh)  # jit takes no host arrays for shardings across processes
    per_layout: dict[str, tuple[Callable[..., Any], Batch]] = {}  # jitted once per batch layout

    def jitted_for(layout: str) -> tuple[Callable[..., Any], Batch]:
        if layout not in per_layout:
            in_batch = batch_shardings(mesh, packed=layout != "rows", strided=layout == "strided")
            per_layout[layout] = (jax.jit(
                fn,
                in_shardings=(state_sharding, in_batch, *frozen_shardings),
                out_shardings=(state_sharding, NamedSharding(mesh, P())),
                donate_argnums=0,
                compiler_options=compiler_options,
            ), in_batch)
        return per_layout[layout]

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, StepOutput]:
        if batch.packed is None and batch.scored is None:  # the same log-probs, and the batch
            # then has the structure that the shardings were declared for; widths rounded as
            # `collate`'s, so that varied batches compile a few programs
            batch = dataclasses.replace(batch, scored=scored_windows(np.asarray(batch.loss_mask)))
        jitted, in_batch = jitted_for(batch_layout(batch))
        if global_batch:
            batch = host_to_global(batch, in_batch)
        with jax.set_mesh(mesh):
            return jitted(state, batch, *frozen)

    return step


def raise_on_bad_step(output: StepOutput, update: int) -> dict[str, float]:
    """Host-side check of a step's output; returns the metrics as floats.

    Raises NonFiniteLossError (naming `update` and the groups with non-finite rows) or
    MicroBatchLayoutError when the step refused the update.
    """
    applied, finite, layout_ok, metrics = jax.device_get(
        (output.applied, output.finite, output.layout_ok, output.metrics)
    )
    metrics = {k: float(v) for k, v in metrics.items()}
    if bool(applied):
        return metrics
    if not bool(finite):
        rows, gids = jax.device_get((output.row_finite, output.group_id))
        bad = sorted({int(g) for g in np.asarray(gids)[~np.asarray(rows)]})
        raise NonFiniteLossError(update, bad, metrics)
    if not bool(layout_ok):
        raise MicroBatchLayoutError(
            f"update {update}: a group's rows span two micro-batches; keep each group's K rows "
            "contiguous and make the micro-batch size (batch / num_microbatches) a multiple of K"
        )
    raise AssertionError("update not applied for an unknown reason")
