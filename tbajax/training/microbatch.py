"""Gradient accumulation over micro-batches that gives exactly the whole batch's update.

Gradients are taken of each micro-batch's loss *sum* (`Ratio.total`), summed across
micro-batches (a `lax.scan`) and divided once by the summed count, so any split gives the same
update as the whole batch, provided no group straddles two slices (checked, not assumed).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tbajax.batch import Batch
from tbajax.objectives.base import Max, Metrics, Min, Ratio, combine_metrics
from tbajax.sharding import constrain
from tbajax.training.config import TrainerConfig
from tbajax.training.loss import microbatch_loss

Array = jax.Array
PyTree = Any


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


def identity_metrics(shapes: Metrics) -> Metrics:
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
    objective: Any,
    objective_config: Any,
    config: TrainerConfig,
    aux: PyTree | None = None,
) -> tuple[tuple[Any, PyTree | None], Array, Array, Metrics, Array]:
    """((Σ grads of params, Σ grads of aux or None), Σ loss sums, Σ counts, combined metrics,
    row_finite [B]). `aux` is the objective's per-prompt table (None: the objective has none)."""
    loss_fn = functools.partial(
        microbatch_loss,
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
        identity_metrics(metric_s),
    )

    def body(carry: Any, mb: Batch) -> tuple[Any, Array]:
        g_acc, t_acc, c_acc, m_acc = carry
        (total, (count, metrics, row_ok)), grads = grad_fn(trainable, ref_params, mb)
        g_acc = jax.tree.map(jnp.add, g_acc, grads)
        return (g_acc, t_acc + total, c_acc + count, combine_metrics(m_acc, metrics)), row_ok

    (grads, total, count, metrics), row_ok = jax.lax.scan(body, carry0, mbs)
    return grads, total, count, metrics, row_ok.reshape(-1)
