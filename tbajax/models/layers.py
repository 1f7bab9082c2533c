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
    q [b,t,h,d]; k,v [b,s,kv,d]; mask [b,t,s] -> [b,t,h,d]."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    q = q.reshape(b, t, kv, h // kv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores * (d**-0.5)
    scores = jnp.where(mask[:, None, None], scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, h, d)


def write_cache(
    k: Array, v: Array, cache: LayerCache | None, dtype: Any
) -> tuple[Array, Array, tuple[Array, Array] | None]:
    """Write this step's keys/values into the layer's cache slots and return the keys/values to
    attend over (the whole cache) plus the updated cache buffers; without a cache, a no-op."""
    if cache is None:
        return k, v, None
    ck, cv, li, index = cache
    ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype)[None], (li, 0, index, 0, 0))
    cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype)[None], (li, 0, index, 0, 0))
    k = jax.lax.dynamic_index_in_dim(ck, li, keepdims=False).astype(dtype)
    v = jax.lax.dynamic_index_in_dim(cv, li, keepdims=False).astype(dtype)
    return k, v, (ck, cv)
