"""Building blocks shared by the objectives: sequence sums, group statistics, ratios, diagnostics.

Groups are found by explicit `batch.group_id` with segment ops (one segment per possible id,
`num_segments = batch size`, static), never by reshaping, so any row order works. Padding rows
(`sample_mask` False) carry zero weight everywhere: they change no group's count, mean or loss,
even when they share a group id with real rows.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from tbajax.batch import Batch
from tbajax.objectives.configs import LengthNorm, StaleTokenMode, check_stale_token_options  # noqa: F401 (re-exported)
from tbajax.objectives.base import Max, Metrics, Min, Ratio

Array = jax.Array


# --------------------------------------------------------------------------- sequences


def token_mask(batch: Batch, dtype=None) -> Array:
    """[B, T] loss mask of real rows, in the log-probs' float dtype."""
    return batch.row_mask().astype(batch.reward.dtype if dtype is None else dtype)


def seq_sum(x: Array, mask: Array) -> Array:
    """Σ_t x over the mask, [B]. `where` (not a product) so junk off-mask can never leak in."""
    return jnp.where(mask > 0, x, 0).sum(-1)


class SeqSums(NamedTuple):
    """Per-sequence log-prob sums over the response mask, each [B]."""

    policy: Array  # S_i: differentiable
    reference: Array  # R_i
    behavior: Array  # log π_old summed

    @property
    def log_ratio_ref(self) -> Array:
        """S_i − R_i: the sequence-level KL estimate (k1)."""
        return self.policy - self.reference


def seq_sums(batch: Batch, logprobs: Array) -> SeqSums:
    m = token_mask(batch, logprobs.dtype)
    return SeqSums(
        seq_sum(logprobs, m),
        seq_sum(batch.reference_logprobs.astype(logprobs.dtype), m),
        seq_sum(batch.behavior_logprobs.astype(logprobs.dtype), m),
    )


def length_normaliser(batch: Batch, kind: LengthNorm, constant: float, dtype=jnp.float32) -> Array:
    """[B] divisor of each sequence's token sum.

    "sequence": prompt + response tokens (what the TBA′ reference divides by);
    "response": the scored response tokens (per-sequence token mean, as in GRPO);
    "constant": a fixed number such as the generation budget (Dr. GRPO: no length bias).
    """
    if kind == "sequence":
        n = jnp.maximum(batch.attention_mask.sum(-1), 1)
    elif kind == "response":
        n = jnp.maximum(batch.loss_mask.sum(-1), 1)
    elif kind == "constant":
        if constant <= 0:
            raise ValueError(f"norm_constant must be > 0, got {constant}")
        n = jnp.full(batch.reward.shape, constant)
    else:
        raise ValueError(f"length_norm must be 'sequence', 'response' or 'constant', got {kind!r}")
    return n.astype(dtype)


# --------------------------------------------------------------------------- groups


class Groups(NamedTuple):
    """Segment view of a batch's groups. Segment index = group id; `count` is per segment."""

    ids: Array  # [B] group id of each row
    weight: Array  # [B] 1.0 for real rows, 0.0 for padding
    count: Array  # [B] number of real rows in each segment (0 for unused ids)

    @property
    def valid(self) -> Array:
        """[B] per segment: the id holds at least one real row."""
        return self.count > 0

    @property
    def num(self) -> Array:
        """Number of (non-empty) groups, a float so it can be a Ratio count."""
        return self.valid.sum().astype(self.weight.dtype)

    def sum(self, x: Array) -> Array:
        """Per-segment sum of x over real rows, [B]."""
        return jax.ops.segment_sum(
            jnp.where(self.weight > 0, x, 0), self.ids, num_segments=self.ids.shape[0]
        )

    def mean(self, x: Array) -> Array:
        """Per-segment mean of x over real rows, [B] (0 for empty segments)."""
        return self.sum(x) / jnp.maximum(self.count, 1)

    def row(self, per_segment: Array) -> Array:
        """Broadcast a per-segment value back to the rows, [B]."""
        return per_segment[self.ids]

    def centered(self, x: Array) -> Array:
        """x_i − mean of x over row i's group, [B]."""
        return x - self.row(self.mean(x))

    def std(self, x: Array, ddof: int = 1) -> Array:
        """Per-segment standard deviation over real rows, [B] (ddof=1: the sample std)."""
        dev = self.centered(x)
        return jnp.sqrt(self.sum(dev * dev) / jnp.maximum(self.count - ddof, 1))

    def total(self, per_segment: Array) -> Array:
        """Σ over non-empty groups of a per-segment value."""
        return jnp.where(self.valid, per_segment, 0).sum()


def groups_of(batch: Batch, dtype=None) -> Groups:
    w = batch.sample_mask.astype(batch.reward.dtype if dtype is None else dtype)
    ids = batch.group_id.astype(jnp.int32)
    return Groups(ids, w, jax.ops.segment_sum(w, ids, num_segments=ids.shape[0]))


def row_mean(groups: Groups, x: Array) -> Ratio:
    """Mean of a per-row value over real rows, as a Ratio."""
    return Ratio(jnp.where(groups.weight > 0, x, 0).sum(), groups.weight.sum())


# --------------------------------------------------------------------------- ratios


def log_ratio(batch: Batch, logprobs: Array, mask: Array) -> Array:
    """[B, T] log π_θ − log π_old on the mask, 0 elsewhere."""
    return jnp.where(mask > 0, logprobs - batch.behavior_logprobs.astype(logprobs.dtype), 0)


def capped_ratio(log_r: Array, cap: float) -> Array:
    """min(exp(log_r), cap): the ratio clipped from above with zero gradient where clipped.

    Clipping the log first (not the ratio) keeps exp from overflowing to inf, whose gradient
    would turn into NaN even where it is masked out.
    """
    return jnp.exp(jnp.minimum(log_r, math.log(cap)))


def windowed_ratio(log_r: Array, low: float, high: float) -> tuple[Array, Array]:
    """(ratio inside [low, high] else 0, keep mask): IcePop's hard token mask."""
    keep = (log_r >= math.log(low)) & (log_r <= math.log(high))
    return jnp.where(keep, jnp.exp(jnp.clip(log_r, math.log(low), math.log(high))), 0), keep


# --------------------------------------------------------------------------- stale tokens


def token_lag(batch: Batch) -> Array:
    """[B, T] int32: how many param versions each token is behind the trainer
    (`batch.current_version − batch.token_versions`; meaningful on the loss mask only)."""
    return batch.current_version.astype(jnp.int32) - batch.token_versions.astype(jnp.int32)


def stale_tokens(batch: Batch, max_lag: int | None) -> Array | None:
    """[B, T] bool: scored tokens more than `max_lag` versions behind; None when `max_lag` is None
    (the option is off, and callers then skip every stale-token term: bit-for-bit the old loss)."""
    if max_lag is None:
        return None
    return (token_lag(batch) > max_lag) & batch.loss_mask & batch.sample_mask[:, None]


def stale_metrics(batch: Batch, stale: Array | None, dtype) -> Metrics:
    """stale_frac: the fraction of scored tokens that were stale (empty when the option is off)."""
    if stale is None:
        return {}
    m = token_mask(batch, dtype)
    return {"stale_frac": Ratio(jnp.where(stale, 1.0, 0.0).astype(dtype).sum(), m.sum())}


# --------------------------------------------------------------------------- diagnostics


def diagnostics(
    batch: Batch, logprobs: Array, clipped: Array | None = None, *, reference: bool = True
) -> Metrics:
    """Stop-gradient health metrics shared by all objectives.

    ratio_*: π_θ / π_old per scored token (Min/Max combine with min/max across micro-batches);
    logprob_gap: mean per token of log π_θ − log π_old (how off-policy the batch is);
    entropy: −mean token log-prob (a one-sample entropy estimate);
    kl: mean per sequence of S − R (k1 KL to the reference); only with `reference` (an
      objective that declares it reads no reference log-probs gets none, and reports no kl);
    clip_frac: fraction of scored tokens where `clipped` is True (objective-specific).
    """
    logprobs = jax.lax.stop_gradient(logprobs)
    m = token_mask(batch, logprobs.dtype)
    on = m > 0
    n_tok = m.sum()
    lr = log_ratio(batch, logprobs, m)
    ratio = jnp.exp(lr)
    out: Metrics = {
        "ratio_mean": Ratio(jnp.where(on, ratio, 0).sum(), n_tok),
        "ratio_min": Min(jnp.where(on, ratio, jnp.inf).min()),
        "ratio_max": Max(jnp.where(on, ratio, -jnp.inf).max()),
        "logprob_gap": Ratio(lr.sum(), n_tok),
        "entropy": Ratio(-jnp.where(on, logprobs, 0).sum(), n_tok),
    }
    if reference:
        out["kl"] = row_mean(groups_of(batch, logprobs.dtype), seq_sums(batch, logprobs).log_ratio_ref)
    if clipped is not None:
        out["clip_frac"] = Ratio(jnp.where(on & clipped, 1.0, 0.0).astype(m.dtype).sum(), n_tok)
    return out
