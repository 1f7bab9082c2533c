"""One sampling step on a batch of logits: pure, jit-able, testable on hand-made logits.

Randomness is per row: row r draws one uniform from its own key (`keys[r]`, or
`fold_in(key, row_ids[r])`) and inverts the CDF, so a sample does not depend on how many other rows
share the batch (padding a batch to a bucket or splitting it over devices leaves every row's draw
unchanged). The samplers give every sample its own key and draw its step s from
`fold_in(sample_key, s)` (`step_keys`), so a sample's tokens do not depend on which slot or batch
it was decoded in either (static buckets and continuous batching agree).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tbajax.sharding import over_batch_shards

Array = jax.Array
_NEG_INF = -jnp.inf


def sample_keys(key: Array, rows: Array) -> Array:
    """One key per sample: fold_in(call key, row)."""
    return jax.vmap(lambda r: jax.random.fold_in(key, r))(rows)


def step_keys(keys: Array, steps: Array) -> Array:
    """Each sample's key for its step: fold_in(sample key, step); steps [B] or a scalar."""
    steps = jnp.broadcast_to(jnp.asarray(steps, jnp.int32), keys.shape[:1])
    return jax.vmap(jax.random.fold_in)(keys, steps)


def top_p_filter(sorted_logits: Array, top_p: float | Array) -> Array:
    """Keep the smallest prefix of descending-sorted logits whose probability mass reaches top_p.

    A token is kept when the mass strictly before it is < top_p, so the most likely token is
    always kept; the rest become -inf.
    """
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    return jnp.where(mass_before < top_p, sorted_logits, _NEG_INF)


_BLOCK = 128  # vocab block of the two-level inverse CDF


def _pick(cdf: Array, target: Array) -> Array:
    """Index of the first entry of each row's non-decreasing `cdf` that exceeds `target`."""
    return jnp.sum(cdf <= target[:, None], axis=-1)


def _last_with_mass(probs: Array) -> Array:
    return probs.shape[-1] - 1 - jnp.argmax((probs > 0)[:, ::-1], axis=-1)


def _inverse_cdf_sample(keys: Array, logits: Array) -> Array:
    """One categorical draw per row from ONE uniform per row (a vocab-sized Gumbel draw costs
    more than the whole sampling step on CPU). Large vocabularies go in two levels, blocks then
    tokens, so no full-vocab cumulative sum is needed."""
    b, v = logits.shape
    probs = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))  # -inf -> exactly 0
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
    if v <= 2 * _BLOCK:
        cdf = jnp.cumsum(probs, axis=-1)
        # rounding can put the target at the very top: fall back to the last token with mass
        return jnp.minimum(_pick(cdf, u * cdf[:, -1]), _last_with_mass(probs))
    nb = -(-v // _BLOCK)
    blocks = jnp.pad(probs, ((0, 0), (0, nb * _BLOCK - v))).reshape(b, nb, _BLOCK)
    block_mass = blocks.sum(-1)
    block_cdf = jnp.cumsum(block_mass, axis=-1)
    target = u * block_cdf[:, -1]
    j = jnp.minimum(_pick(block_cdf, target), _last_with_mass(block_mass))
    mass_before = jnp.take_along_axis(block_cdf - block_mass, j[:, None], axis=-1)[:, 0]
    inner = jnp.take_along_axis(blocks, j[:, None, None], axis=1)[:, 0]  # [b, block]
    i = jnp.minimum(_pick(jnp.cumsum(inner, axis=-1), target - mass_before), _last_with_mass(inner))
    return j * _BLOCK + i


def unfuse_from_producer(logits: Array) -> Array:
    """An exact fp32 identity that XLA keeps as its own op on CPU, so the vocabulary matmul that
    produced `logits` runs alone.

    XLA's CPU backend (YNNPACK) fuses a dot with the row max that the softmax takes over its
    output, and at 128 rows and more the fused program runs far slower than the dot alone
    (`experiments/benchmarks/decode_head.py`: at 128 x 512 x 24576 with the sampling step after
    it, 1.7x slower than with this identity in between). For a few rows the two cost the same.
    GPU programs are left as they were (unmeasured there).
    """
    def identity(x: Array) -> Array:
        return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=23)

    return jax.lax.platform_dependent(logits, cpu=identity, default=lambda x: x)


def sample_logits(
    key: Array | None,
    logits: Array,
    *,
    temperature: float | Array = 1.0,
    top_k: int = 0,
    top_p: float | Array | None = None,
    greedy: bool = False,
    banned: Array | None = None,
    row_ids: Array | None = None,
    keys: Array | None = None,
) -> tuple[Array, Array]:
    """Draw one token per row; return (tokens [B] int32, log-probs [B] f32).

    logits: [B, V] raw (untempered) logits. temperature > 0 (traced is fine).
    top_k: static; 0 = off. top_p: None or 1.0 = off (a traced value always applies the filter).
    greedy: argmax of the (banned-masked) logits.
    banned: [V] or [B, V] bool, tokens that may not be drawn (e.g. stop ids before min_new_tokens).
    keys: [B] per-row keys used as given (then `key` and `row_ids` are ignored; pass key=None).
    The returned log-prob is log softmax(logits / T) at the drawn token: the full tempered
    distribution, not the truncated one that top-k / top-p / `banned` sampled from.
    """
    b, v = logits.shape
    scaled = unfuse_from_producer(logits.astype(jnp.float32)) / temperature
    full_logprobs = jax.nn.log_softmax(scaled, axis=-1)
    if banned is not None:
        scaled = jnp.where(banned, _NEG_INF, scaled)
    if greedy:
        tokens = jnp.argmax(scaled, axis=-1)
    else:
        if keys is None:
            if key is None:
                raise ValueError("sample_logits needs a key (or per-row keys=)")
            keys = sample_keys(key, jnp.arange(b) if row_ids is None else row_ids)
        use_top_p = top_p is not None and not (isinstance(top_p, (int, float)) and top_p >= 1.0)
        if top_k and top_k < v:
            vals, idx = over_batch_shards(lambda x: jax.lax.top_k(x, top_k), scaled)
            if use_top_p:
                vals = top_p_filter(vals, top_p)
            choice = _inverse_cdf_sample(keys, vals)
            tokens = jnp.take_along_axis(idx, choice[:, None], axis=-1)[:, 0]
        elif use_top_p:
            vals, idx = over_batch_shards(lambda x: jax.lax.top_k(x, v), scaled)  # a full descending sort
            choice = _inverse_cdf_sample(keys, top_p_filter(vals, top_p))
            tokens = jnp.take_along_axis(idx, choice[:, None], axis=-1)[:, 0]
        else:
            tokens = _inverse_cdf_sample(keys, scaled)
    tokens = tokens.astype(jnp.int32)
    logprobs = jnp.take_along_axis(full_logprobs, tokens[:, None], axis=-1)[:, 0]
    return tokens, logprobs
