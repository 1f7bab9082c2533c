"""One trainer update as a pure function `(state, batch) -> (state, output)`, and its jitted form.

Loss: merge graphdef + params, score the batch (`token_logprobs` at the sampling temperature),
score it under the reference params too (stop-gradient) when asked, and hand both to the
objective, which returns a `Ratio`. Gradients are taken of the Ratio's *sum* in each
micro-batch, summed across micro-batches and divided once by the summed count, so any
micro-batch split gives the same update as the whole batch.

A non-finite loss or gradient norm never reaches the params: inside the step the update is a
branch taken only when loss and gradient norm are finite (else the old state comes back), and
the host raises `NonFiniteLossError` naming the update and the groups whose inputs or
log-probs are non-finite.

Objectives with per-prompt aux params (`tb_learned_logz`'s log Z table, `TrainState.aux`):
the loss is differentiated with respect to params and aux together; each row reads its table
entry by `batch.prompt_id`. The aux table has its own per-row Adam (`aux_adam_update`) at
lr(step) × `objective_config.aux_lr_scale`; gradient clipping (`max_grad_norm`) looks at the
params' global norm only and never scales the aux gradient (log Z has to travel ~r/β, and its
gradient is large exactly when it lags). Without aux nothing of this is traced.
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

from tbajax.batch import Batch, PackedGroups, packed_token_logprobs, token_logprobs
from tbajax.models.decoder import packed_attention_mask
from tbajax.objectives.base import Max, Metrics, Min, Ratio, combine_metrics
from tbajax.objectives.registry import ObjectiveSpec, gather_aux, get_objective
from tbajax.sharding import LOGICAL_RULES, constrain
from tbajax.training.config import TrainerConfig
from tbajax.training.schedules import beta_at, learning_rate
from tbajax.training.state import (
    TrainState,
    aux_adam_update,
    aux_rows_touched,
    aux_table_size,
    init_train_state,
    make_optimizer,
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


# ----------------------------------------------------------------------------- the loss


def sequence_logprobs(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch, temperature: float) -> Array:
    """Per-token log-probs [B, T] of `batch.tokens` under (graphdef, params) at `temperature`;
    through `batch.packed` when present (then on response tokens only)."""
    model = nnx.merge(graphdef, params)
    if batch.packed is not None:
        pk = batch.packed
        logits, _ = model(pk.tokens, pk.positions, packed_attention_mask(pk.segments))
        return packed_token_logprobs(logits, batch, temperature)
    logits, _ = model(batch.tokens, attention_mask=batch.attention_mask)
    return token_logprobs(logits, batch.tokens, temperature)


def _rows_finite(batch: Batch, logprobs: Array) -> Array:
    """[B] False for a real row whose reward, log-probs or stored log-probs are NaN/inf."""

    def ok(x: Array, mask: Array) -> Array:
        return jnp.isfinite(jnp.where(mask, x, 0.0)).all(-1)

    good = (
        jnp.isfinite(batch.reward)
        & ok(logprobs, batch.attention_mask)
        & ok(batch.reference_logprobs, batch.loss_mask)
        & ok(batch.behavior_logprobs, batch.loss_mask)
    )
    return good | ~batch.sample_mask


def _microbatch_loss(
    trainable: tuple[nnx.State, PyTree | None],
    ref_params: nnx.State | None,
    batch: Batch,
    *,
    graphdef: nnx.GraphDef,
    objective: Objective,
    objective_config: Any,
    config: TrainerConfig,
) -> tuple[Array, tuple[Array, Metrics, Array]]:
    """(loss sum, (loss count, metrics, row_finite)): the sum is what gets differentiated,
    with respect to `trainable` = (params, aux table or None)."""
    params, aux = trainable
    logprobs = sequence_logprobs(graphdef, params, batch, config.temperature)
    if config.compute_reference_logprobs:
        ref = sequence_logprobs(graphdef, jax.lax.stop_gradient(ref_params), batch, config.temperature)
        batch = dataclasses.replace(
            batch, reference_logprobs=jnp.where(batch.loss_mask, jax.lax.stop_gradient(ref), 0.0)
        )
    if aux is None:
        loss, metrics = objective(batch, logprobs, objective_config)
    else:
        loss, metrics = objective(batch, logprobs, objective_config, gather_aux(aux, batch.prompt_id))
    row_ok = _rows_finite(batch, jax.lax.stop_gradient(logprobs))
    return loss.total, (jax.lax.stop_gradient(loss.count), metrics, row_ok)


def local_group_ids(group_id: Array) -> Array:
    """Renumber ids to [0, n) within the last axis (first row of each group): objectives use
    `num_segments = rows`, so ids from the whole batch would fall outside a micro-batch."""
    same = group_id[..., :, None] == group_id[..., None, :]
    return jnp.argmax(same, axis=-1).astype(jnp.int32)


def microbatch_layout_ok(batch: Batch, num_microbatches: int) -> Array:
    """True when every group's real rows lie in one contiguous micro-batch slice."""
    if num_microbatches == 1:
        return jnp.array(True)
    b = batch.batch_size // num_microbatches
    mb = jnp.arange(batch.batch_size) // b
    real = batch.sample_mask
    clash = (
        (batch.group_id[:, None] == batch.group_id[None, :])
        & (mb[:, None] != mb[None, :])
        & real[:, None]
        & real[None, :]
    )
    return ~clash.any()


def split_microbatches(batch: Batch, num_microbatches: int) -> Batch:
    """[B, ...] -> [M, B/M, ...] contiguous slices, batch dim of each slice sharded like B (packed
    rows likewise: `collate` lays them out per slice)."""
    n, m = batch.batch_size, num_microbatches
    if n % m:
        raise ValueError(f"batch of {n} rows cannot be cut into {m} equal micro-batches")

    def cut(x: Array) -> Array:
        if x.ndim == 0:  # beta: the same for every slice
            return jnp.broadcast_to(x, (m,))
        y = x.reshape(m, x.shape[0] // m, *x.shape[1:])  # rows, or packed rows
        return constrain(y, (None, "batch") + (None,) * (y.ndim - 2))

    out = jax.tree.map(cut, batch)
    return dataclasses.replace(out, group_id=local_group_ids(out.group_id))


def _identity_metrics(shapes: Metrics) -> Metrics:
    """Neutral elements to start accumulating metrics shaped like `shapes`."""
    out: Metrics = {}
    for k, m in shapes.items():
        if isinstance(m, Ratio):
            out[k] = Ratio(jnp.zeros(m.total.shape, m.total.dtype), jnp.zeros(m.count.shape, m.count.dtype))
        elif isinstance(m, Max):
            out[k] = Max(jnp.full(m.value.shape, -jnp.inf, m.value.dtype))
        elif isinstance(m, Min):
            out[k] = Min(jnp.full(m.value.shape, jnp.inf, m.value.dtype))
        else:
            raise TypeError(f"objective metric {k!r} is a {type(m).__name__}; use Ratio, Min or Max")
    return out


def accumulate_gradients(
    params: nnx.State,
    ref_params: nnx.State | None,
    batch: Batch,
    *,
    graphdef: nnx.GraphDef,
    objective: Objective,
    objective_config: Any,
    config: TrainerConfig,
    aux: PyTree | None = None,
) -> tuple[tuple[Any, PyTree | None], Array, Array, Metrics, Array]:
    """((Σ grads of params, Σ grads of aux or None), Σ loss sums, Σ counts, combined metrics,
    row_finite [B]). `aux` is the objective's per-prompt table (None: the objective has none)."""
    loss_fn = functools.partial(
        _microbatch_loss,
        graphdef=graphdef,
        objective=objective,
        objective_config=objective_config,
        config=config,
    )
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    trainable = (params, aux)
    m = config.num_microbatches
    mbs = split_microbatches(batch, m)
    if m == 1:
        mb = jax.tree.map(lambda x: x[0], mbs)
        (total, (count, metrics, row_ok)), grads = grad_fn(trainable, ref_params, mb)
        return grads, total, count, metrics, row_ok

    first = jax.tree.map(lambda x: x[0], mbs)
    (total_s, (count_s, metric_s, _)), _ = jax.eval_shape(grad_fn, trainable, ref_params, first)
    carry0 = (
        jax.tree.map(jnp.zeros_like, trainable),
        jnp.zeros(total_s.shape, total_s.dtype),
        jnp.zeros(count_s.shape, count_s.dtype),
        _identity_metrics(metric_s),
    )

    def body(carry: Any, mb: Batch) -> tuple[Any, Array]:
        g_acc, t_acc, c_acc, m_acc = carry
        (total, (count, metrics, row_ok)), grads = grad_fn(trainable, ref_params, mb)
        g_acc = jax.tree.map(jnp.add, g_acc, grads)
        return (g_acc, t_acc + total, c_acc + count, combine_metrics(m_acc, metrics)), row_ok

    (grads, total, count, metrics), row_ok = jax.lax.scan(body, carry0, mbs)
    return grads, total, count, metrics, row_ok.reshape(-1)


# ----------------------------------------------------------------------------- the step


def train_step(
    state: TrainState,
    batch: Batch,
    *,
    graphdef: nnx.GraphDef,
    objective: Objective,
    objective_config: Any,
    config: TrainerConfig,
) -> tuple[TrainState, StepOutput]:
    """One AdamW update (pure; jit it with `make_train_step`).

    With `state.aux`, also one per-row Adam update of the aux table (rows of the batch's
    prompts only) at lr × `objective_config.aux_lr_scale`, unclipped; metrics gain aux_grad_norm.
    """
    has_aux = getattr(objective, "has_aux", False)
    if has_aux != (state.aux is not None):
        raise ValueError(
            f"objective {getattr(objective, 'name', objective)!r} "
            + ("trains an aux table but the state has none: build it with "
               "init_train_state(..., aux=initial_aux(objective, objective_config, config))"
               if has_aux else "has no aux params but the state holds an aux table")
        )
    tx = make_optimizer(config.optimizer)
    update = state.step + 1
    if config.beta is not None:
        batch = dataclasses.replace(batch, beta=beta_at(config.beta, update))
    batch = dataclasses.replace(batch, beta=jnp.asarray(batch.beta, jnp.float32))
    (grads, aux_grads), total, count, obj_metrics, row_ok = accumulate_gradients(
        state.params,
        state.ref_params,
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
    touched = None
    if state.aux is not None:
        aux_grads = jax.tree.map(lambda g: (g / denom).astype(g.dtype), aux_grads)
        aux_grad_norm = optax.global_norm(aux_grads)
        finite = finite & jnp.isfinite(aux_grad_norm)
        touched = aux_rows_touched(batch.prompt_id, batch.sample_mask, aux_table_size(state.aux))
        extra_metrics["aux_grad_norm"] = aux_grad_norm
    layout_ok = microbatch_layout_ok(batch, config.num_microbatches)
    applied = finite & layout_ok

    def apply(operand: tuple[TrainState, Any, Any]) -> TrainState:
        old, g, aux_g = operand
        if config.optimizer.max_grad_norm is not None:
            c = config.optimizer.max_grad_norm
            scale = jnp.where(grad_norm < c, 1.0, c / grad_norm)
            g = jax.tree.map(lambda x: (x * scale).astype(x.dtype), g)
        updates, opt_state = tx.update(g, old.opt_state, old.params)
        params = jax.tree.map(lambda p, u: (p - lr * u).astype(p.dtype), old.params, updates)
        new = dataclasses.replace(old, params=params, opt_state=opt_state, step=update)
        if old.aux is not None:
            aux_lr = lr * objective_config.aux_lr_scale
            aux_updates, aux_opt = aux_adam_update(aux_g, old.aux_opt_state, touched, config.optimizer)
            aux = jax.tree.map(lambda a, u: (a - aux_lr * u).astype(a.dtype), old.aux, aux_updates)
            new = dataclasses.replace(new, aux=aux, aux_opt_state=aux_opt)
        if config.reference_reset_every is not None:
            reset = functools.partial(
                reset_reference, tx=tx, reset_moments=config.reset_optimizer_on_reference_reset
            )
            new = jax.lax.cond(update % config.reference_reset_every == 0, reset, lambda s: s, new)
        return new

    # a branch, not a select after the fact: the select kept XLA from fusing the AdamW pass
    # (4x slower optimizer on CPU), and the skipped branch costs nothing
    new = jax.lax.cond(applied, apply, lambda operand: operand[0], (state, grads, aux_grads))

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


def batch_shardings(mesh: Mesh, packed: bool = False) -> Batch:
    """Every [B, ...] field split on its batch dim over the "batch" mesh axes; β replicated;
    packed rows (if `packed`) split on their leading dim too."""
    rows = NamedSharding(mesh, P(LOGICAL_RULES["batch"]))
    fields = {f.name: rows for f in dataclasses.fields(Batch)}
    fields["beta"] = NamedSharding(mesh, P())
    fields["packed"] = PackedGroups(**{f.name: rows for f in dataclasses.fields(PackedGroups)}) if packed else None
    return Batch(**fields)


def resolve_objective(objective: Any, objective_config: Any = None) -> tuple[ObjectiveSpec, Any]:
    """(spec, config) from a registered name, an import path, an ObjectiveSpec or a function.

    objective_config None means the objective's default config (`spec.make_config()`; a bare
    function gets config=None, as in `tbajax.objectives.get_objective`).
    """
    spec = get_objective(objective)
    config = spec.make_config() if objective_config is None else objective_config
    if spec.has_aux and not hasattr(config, "aux_lr_scale"):
        raise ValueError(
            f"objective {spec.name!r} has aux params but its config {config!r} has no "
            "aux_lr_scale (the aux learning-rate multiplier)"
        )
    return spec, config


def initial_aux(objective: Any, objective_config: Any, config: TrainerConfig) -> PyTree | None:
    """The objective's initial per-prompt table (`spec.init_aux(objective_config,
    config.aux_table_size)`), or None for objectives without aux params.

    Pass it to `init_train_state(..., aux=...)`; `Trainer` does both.
    """
    spec, objective_config = resolve_objective(objective, objective_config)
    if not spec.has_aux:
        return None
    if config.aux_table_size < 1:
        raise ValueError(
            f"objective {spec.name!r} trains one entry per prompt id (a learned log Z table); set "
            "TrainerConfig.aux_table_size to the number of distinct prompt ids (largest "
            "Trajectory.prompt_id + 1, e.g. the dataset's size)"
        )
    aux = spec.init_aux(objective_config, config.aux_table_size)
    size = aux_table_size(aux)
    if size != config.aux_table_size:
        raise ValueError(
            f"objective {spec.name!r}: init_aux made a table of {size} rows for "
            f"aux_table_size={config.aux_table_size}"
        )
    return aux


def make_train_step(
    graphdef: nnx.GraphDef,
    config: TrainerConfig,
    objective: Any,
    objective_config: Any = None,
    *,
    mesh: Mesh | None = None,
    state_sharding: Any = None,
    compiler_options: dict[str, Any] | None = None,
) -> Callable[[TrainState, Batch], tuple[TrainState, StepOutput]]:
    """`step(state, batch) -> (state, output)`, jitted, donating the input state.

    graphdef, config, objective and objective_config are baked in (static). `objective` is
    anything `tbajax.objectives.get_objective` accepts ("tb", "tba_prime", a function, ...);
    objective_config None means its default config. An objective with aux params needs a state
    built with `init_train_state(..., aux=initial_aux(...))`. With `mesh`, the
    state is pinned to `state_sharding` (see `state_shardings`) in and out, the batch is split
    over the batch axes (its size must divide by data × fsdp), and outputs are replicated; the
    mesh is put in context while tracing so the model's activation constraints apply.
    """
    objective, objective_config = resolve_objective(objective, objective_config)
    fn = functools.partial(
        train_step, graphdef=graphdef, objective=objective, objective_config=objective_config, config=config
    )
    if mesh is None:
        return jax.jit(fn, donate_argnums=0, compiler_options=compiler_options)
    if state_sharding is None:
        raise ValueError("make_train_step(mesh=...) needs state_sharding=state_shardings(state, mesh)")
    jitted = jax.jit(
        fn,
        in_shardings=(state_sharding, batch_shardings(mesh, packed=config.pack_groups)),
        out_shardings=(state_sharding, NamedSharding(mesh, P())),
        donate_argnums=0,
        compiler_options=compiler_options,
    )

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, StepOutput]:
        with jax.set_mesh(mesh):
            return jitted(state, batch)

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


# ----------------------------------------------------------------------------- the edge


class Trainer:
    """The stateful edge around the pure step: owns the state, checks every update on the host.

    trainer = Trainer(model, TrainerConfig(...), "tb", mesh=mesh)
    metrics = trainer.step(batch)     # raises NonFiniteLossError, nothing applied

    An objective with aux params (`tb_learned_logz`) gets its table from `initial_aux`, sized by
    `config.aux_table_size`; `trainer.state.aux["log_z"][prompt_id]` is the learned log Z.
    """

    def __init__(
        self,
        model: nnx.Module,
        config: TrainerConfig,
        objective: Any,
        objective_config: Any = None,
        *,
        mesh: Mesh | None = None,
        state: TrainState | None = None,
        compiler_options: dict[str, Any] | None = None,
    ):
        self.config = config
        self.mesh = mesh
        spec, objective_config = resolve_objective(objective, objective_config)
        self.graphdef, fresh = init_train_state(
            model, config, mesh, aux=initial_aux(spec, objective_config, config)
        )
        self.state = fresh if state is None else state
        if (self.state.aux is None) != (fresh.aux is None):
            raise ValueError(
                f"objective {spec.name!r} "
                + ("trains an aux table but the given state has none" if spec.has_aux
                   else "has no aux params but the given state holds an aux table")
            )
        self._aux_size = None if self.state.aux is None else aux_table_size(self.state.aux)
        if self._aux_size is not None and self._aux_size != config.aux_table_size:
            raise ValueError(
                f"the given state's aux table has {self._aux_size} rows but "
                f"TrainerConfig.aux_table_size={config.aux_table_size}"
            )
        self.shardings = state_shardings(self.state, mesh) if mesh is not None else None
        self._step = make_train_step(
            self.graphdef,
            config,
            spec,
            objective_config,
            mesh=mesh,
            state_sharding=self.shardings,
            compiler_options=compiler_options,
        )

    @property
    def updates_applied(self) -> int:
        return int(jax.device_get(self.state.step))

    def step(self, batch: Batch) -> dict[str, float]:
        """Apply one update; returns its metrics as floats."""
        self._check_batch(batch)
        update = self.updates_applied + 1
        self.state, output = self._step(self.state, batch)
        return raise_on_bad_step(output, update)

    @property
    def batch_shards(self) -> int:
        """Devices a batch is split over (data × fsdp); 1 without a mesh."""
        if self.mesh is None:
            return 1
        return int(np.prod([self.mesh.shape[a] for a in LOGICAL_RULES["batch"] or ()]))

    def policy(self) -> nnx.Module:
        """The current policy as a Module (shares the state's arrays)."""
        return nnx.merge(self.graphdef, self.state.params)

    def _check_batch(self, batch: Batch) -> None:
        n = batch.tokens.shape[0]
        m = self.config.num_microbatches
        if n % m:
            raise ValueError(f"batch of {n} rows does not split into num_microbatches={m}")
        if (batch.packed is not None) != self.config.pack_groups:
            raise ValueError(
                f"TrainerConfig.pack_groups={self.config.pack_groups} but the batch "
                f"{'has' if batch.packed is not None else 'has no'} packed rows; build it with "
                f"collate(pack_microbatches={m if self.config.pack_groups else None})"
            )
        shards = self.batch_shards
        if batch.packed is not None and batch.packed.tokens.shape[0] % int(np.lcm(m, shards)):
            raise ValueError(
                f"{batch.packed.tokens.shape[0]} packed rows do not split into num_microbatches={m} "
                f"over {shards} data-parallel devices; pass collate(pack_row_multiple={shards})"
            )
        if n % shards:
            raise ValueError(f"batch of {n} rows does not split over {shards} data-parallel devices")
        prompt_id = np.asarray(jax.device_get(batch.prompt_id))
        if prompt_id.shape != (n,):
            raise ValueError(f"batch.prompt_id has shape {prompt_id.shape}, expected ({n},): one per row")
        if self._aux_size is not None:
            bad = (prompt_id < 0) | (prompt_id >= self._aux_size)
            if bad.any():
                rows = np.flatnonzero(bad)
                raise ValueError(
                    f"prompt ids {sorted({int(i) for i in prompt_id[rows]})[:10]} (rows "
                    f"{rows[:10].tolist()}) are outside the aux table [0, {self._aux_size}); "
                    "set TrainerConfig.aux_table_size to the largest prompt id + 1"
                )
