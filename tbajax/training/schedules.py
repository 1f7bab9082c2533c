"""Learning-rate and β schedules: pure functions of the step, usable inside jit or on the host.

Both take a step that may be a Python int or a traced int32 scalar and return a float32 array,
so the same function logs the value on the host and drives the update inside the step.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from tbajax.training.config import BetaSchedule, LRSchedule

Array = jax.Array


def learning_rate(schedule: LRSchedule, step: Array | int) -> Array:
    """lr for the update that follows `step` already-applied updates (see `LRSchedule`)."""
    s = jnp.asarray(step, jnp.float32)
    peak = jnp.float32(schedule.peak)
    final = jnp.float32(schedule.peak * schedule.final_fraction)
    w, stable, d = schedule.warmup_steps, schedule.stable_steps, schedule.decay_steps
    warm = peak * s / w if w > 0 else peak
    if schedule.kind == "constant":
        return jnp.where(s < w, warm, peak).astype(jnp.float32)
    x = jnp.clip((s - w - stable) / d, 0.0, 1.0)
    frac = 1.0 - x if schedule.shape == "linear" else 0.5 * (1.0 + jnp.cos(math.pi * x))
    decayed = final + (peak - final) * frac
    return jnp.where(s < w, warm, decayed).astype(jnp.float32)


def beta_at(schedule: BetaSchedule, update: Array | int) -> Array:
    """β for update number `update` (1-based: the first update is u = 1), TBA spec §3."""
    u = jnp.asarray(update, jnp.float32)
    if schedule.kind == "constant":
        return jnp.full_like(u, schedule.start, dtype=jnp.float32)
    assert schedule.final is not None  # validated by BetaSchedule
    start, final = jnp.float32(schedule.start), jnp.float32(schedule.final)
    ramp = start + (final - start) * (u - 1.0) / schedule.decay_steps
    return jnp.where(u < schedule.stop, ramp, final).astype(jnp.float32)
