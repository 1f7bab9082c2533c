"""The objective contract: `fn(batch, logprobs, config) -> (loss, metrics)`.

* `batch` is a `tbajax.batch.Batch` (behaviour / reference log-probs, rewards, group ids, β).
* `logprobs` are the current policy's per-token log-probs [B, T], aligned with `batch.tokens`,
  computed inside the trainer's loss from the params (so gradients flow through them). They are
  filled on `batch.loss_mask` (0 elsewhere, when the batch scores its response windows,
  `Batch.scored`, or packed groups): read them there.
* `config` is the objective's own frozen dataclass of hyperparameters (static under jit).

Every loss and metric is returned as a `Ratio` (numerator, denominator) so that summing over
micro-batches and devices and dividing once at the end gives the exact global mean, whatever
the split. Extrema use `Min` / `Max`, which reduce with min / max instead.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from tbajax.batch import Batch

Array = jax.Array


class Ratio(NamedTuple):
    """A mean carried as (sum, count); add Ratios to accumulate, `.value` to read."""

    total: Array
    count: Array

    @property
    def value(self) -> Array:
        return self.total / jnp.maximum(self.count, 1e-12)

    def __add__(self, other: "Ratio") -> "Ratio":  # type: ignore[override]
        return Ratio(self.total + other.total, self.count + other.count)


class Max(NamedTuple):
    """A max metric: combines across micro-batches / devices with max."""

    value: Array

    def combine(self, other: "Max") -> "Max":
        return Max(jnp.maximum(self.value, other.value))


class Min(NamedTuple):
    """A min metric: combines across micro-batches / devices with min."""

    value: Array

    def combine(self, other: "Min") -> "Min":
        return Min(jnp.minimum(self.value, other.value))


Metric = Ratio | Max | Min
Metrics = dict[str, Metric]


class Objective(Protocol):
    def __call__(self, batch: Batch, logprobs: Array, config: Any) -> tuple[Ratio, Metrics]: ...


def combine_metrics(a: Metrics, b: Metrics) -> Metrics:
    """Merge two micro-batches' metrics (sum Ratios, min/max the extrema)."""
    out: Metrics = {}
    for k in a:
        x, y = a[k], b[k]
        out[k] = x + y if isinstance(x, Ratio) else x.combine(y)  # type: ignore[operator,arg-type]
    return out


def metric_values(metrics: Metrics) -> dict[str, Array]:
    return {k: m.value for k, m in metrics.items()}
