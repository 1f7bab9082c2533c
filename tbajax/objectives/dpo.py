"""Online DPO: one preference pair per group, the best- against the worst-rewarded response."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tbajax.batch import Batch
from tbajax.objectives.base import Metrics, Ratio
from tbajax.objectives.common import Groups, diagnostics, groups_of, seq_sums
from tbajax.objectives.configs import OnlineDPOConfig

Array = jax.Array


def _first_row_where(g: Groups, hit: Array) -> Array:
    """Per segment: the lowest row index with `hit` (B where none), so ties pick one row."""
    b = hit.shape[0]
    rows = jnp.where(hit, jnp.arange(b), b)
    return jax.ops.segment_min(rows, g.ids, num_segments=b)


def preference_pairs(g: Groups, reward: Array) -> tuple[Array, Array, Array]:
    """(winner row, loser row, valid) per segment. Ties in the extreme pick the lowest row;
    a group whose rewards all tie (or an empty id) is not valid."""
    b = reward.shape[0]
    real = g.weight > 0
    hi = jax.ops.segment_max(jnp.where(real, reward, -jnp.inf), g.ids, num_segments=b)
    lo = jax.ops.segment_min(jnp.where(real, reward, jnp.inf), g.ids, num_segments=b)
    win = _first_row_where(g, real & (reward == g.row(hi)))
    lose = _first_row_where(g, real & (reward == g.row(lo)))
    valid = g.valid & (hi > lo)
    return jnp.minimum(win, b - 1), jnp.minimum(lose, b - 1), valid


def online_dpo(
    batch: Batch, logprobs: Array, config: OnlineDPOConfig = OnlineDPOConfig()
) -> tuple[Ratio, Metrics]:
    """−log σ(β[(S_w − R_w) − (S_l − R_l)]) per group, mean over groups with a reward gap.

    Extra metrics: pair_frac (groups that formed a pair), margin (mean implicit-reward margin).
    """
    dtype = logprobs.dtype
    g = groups_of(batch, dtype)
    win, lose, valid = preference_pairs(g, batch.reward.astype(dtype))
    h = seq_sums(batch, logprobs).log_ratio_ref
    margin = batch.beta.astype(dtype) * (h[win] - h[lose])
    n_pairs = valid.sum().astype(dtype)
    loss = Ratio(jnp.where(valid, -jax.nn.log_sigmoid(margin), 0).sum(), n_pairs)
    metrics = diagnostics(batch, logprobs)
    metrics.update(
        loss=loss,
        pair_frac=Ratio(n_pairs, g.num),
        margin=Ratio(jnp.where(valid, jax.lax.stop_gradient(margin), 0).sum(), n_pairs),
    )
    return loss, metrics
