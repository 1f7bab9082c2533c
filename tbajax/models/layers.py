"""Pure building blocks shared by every decoder family: norms, activations, RoPE, attention and
the KV-cache write. Each family's block (tbajax/models/families/*.py) is composed of these."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array
_MASK_VALUE = -1e30

# (cache_k, cache_v, layer index, write slot) for one layer inside the scan, or None (no cache)
LayerCache = tuple[Array, Array, Array, Array]


def rms_norm(x: Array, w: Array, eps: float) -> Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (w.astype(jnp.float32) * xf).astype(x.dtype)


def layer_norm(x: Array, w: Array, b: Array, eps: float) -> Array:
    """LayerNorm with bias (GPT-2, GPT-NeoX), computed in fp32 like torch's fused kernel."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    xf = xf - mean
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


def gelu_exact(x: Array) -> Array:
    """transformers' "gelu": x * Phi(x) with the erf CDF."""
    return jax.nn.gelu(x, approximate=False)


def gelu_tanh(x: Array) -> Array:
    """transformers' "gelu_new" (OpenAI GPT-2): the tanh approximation."""
    return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


ACTIVATIONS: dict[str, Any] = {"silu": jax.nn.silu, "gelu": gelu_exact, "gelu_new": gelu_tanh}


def rope_tables(inv_freq: Any, positions: Array) -> tuple[Array, Array]:
    """cos/sin [batch, seq, rotary_dim] for the rotate-half convention."""
    inv = jnp.asarray(inv_freq, jnp.float32)
    ang = positions.astype(jnp.float32)[..., None] * inv
    ang = jnp.concatenate([ang, ang], axis=-1)
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate-half RoPE (the HF convention). x: [batch, seq, heads, head_dim].

    When the tables are narrower than head_dim (GPT-NeoX's partial rotary), only the first
    cos.shape[-1] dims of each head rotate and the rest pass through unchanged.
    """
    rot_dim = cos.shape[-1]
    if rot_dim < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rot_dim], cos, sin), x[..., rot_dim:]], axis=-1)
    half = rot_dim // 2
    xf = x.astype(jnp.float32)
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, :, None] + rot * sin[:, :, None]).astype(x.dtype)


def attention(q: Array, k: Array, v: Array, mask: Array) -> Array:
    """Grouped-query attention scaled by 1/sqrt(head_dim).
    q [b,t,h,d]; k,v heads-major [b,kv,s,d] (as `write_cache` returns them); mask [b,t,s] -> [b,t,h,d].

    Keys/values heads-major make both matmuls batched over (b, kv) with the query group folded
    into the rows, so XLA reads the cache in place instead of transposing it at every decode step.
    """
    b, t, h, d = q.shape
    kv = k.shape[1]
    q = q.reshape(b, t, kv, h // kv, d).transpose(0, 2, 3, 1, 4).reshape(b, kv, (h // kv) * t, d)
    scores = jax.lax.dot_general(q, k, (((3,), (3,)), ((0, 1), (0, 1))), preferred_element_type=jnp.float32)
    scores = scores.reshape(b, kv, h // kv, t, -1) * (d**-0.5)
    scores = jnp.where(mask[:, None, None], scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(b, kv, (h // kv) * t, -1)
    out = jax.lax.dot_general(probs, v, (((3,), (2,)), ((0, 1), (0, 1))))  # [b, kv, g*t, d]
    return out.reshape(b, kv, h // kv, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)


def write_cache(
    k: Array, v: Array, cache: LayerCache | None, dtype: Any
) -> tuple[Array, Array, tuple[Array, Array] | None]:
    """Write this step's keys/values ([b,t,kv,d]) into the layer's cache slots and return the
    keys/values to attend over, heads-major [b,kv,s,d] (the whole cache), plus the updated cache
    buffers; without a cache, just the heads-major keys/values."""
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # only the new tokens move
    if cache is None:
        return k, v, None
    ck, cv, li, index = cache
    ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype)[None], (li, 0, 0, index, 0))
    cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype)[None], (li, 0, 0, index, 0))
    k = jax.lax.dynamic_index_in_dim(ck, li, keepdims=False).astype(dtype)
    v = jax.lax.dynamic_index_in_dim(cv, li, keepdims=False).astype(dtype)
    return k, v, (ck, cv)
