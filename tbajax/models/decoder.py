"""One Flax NNX causal decoder for Llama, Qwen2/2.5 and Qwen3.

Layer parameters are stacked along a leading "layers" axis and applied with `lax.scan`, so a
28-layer model compiles as fast as a 1-layer one and remat is one switch. The NNX module only
owns the parameters; the math lives in small pure functions (`rms_norm`, `apply_rope`,
`attention`, `_layer`) that the training forward and the KV-cache decode path share.

Attention is causal over cache *slots*, with a per-slot validity mask: left-padded prompt batches,
right-padded training batches and incremental decoding are all the same code.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tbajax.models.config import ModelConfig, rope_inv_freq
from tbajax.sharding import constrain

Array = jax.Array
_MASK_VALUE = -1e30

# name -> (logical axes after the leading "layers" axis, shape fn, init kind)
_LAYER_PARAMS: dict[str, tuple[tuple[str, ...], Any, str]] = {
    "input_norm": (("norm",), lambda c: (c.hidden_size,), "ones"),
    "q_proj": (("embed", "q_heads", "head_dim"), lambda c: (c.hidden_size, c.num_heads, c.head_dim), "normal"),
    "k_proj": (("embed", "kv_heads", "head_dim"), lambda c: (c.hidden_size, c.num_kv_heads, c.head_dim), "normal"),
    "v_proj": (("embed", "kv_heads", "head_dim"), lambda c: (c.hidden_size, c.num_kv_heads, c.head_dim), "normal"),
    "q_bias": (("q_heads", "head_dim"), lambda c: (c.num_heads, c.head_dim), "zeros"),
    "k_bias": (("kv_heads", "head_dim"), lambda c: (c.num_kv_heads, c.head_dim), "zeros"),
    "v_bias": (("kv_heads", "head_dim"), lambda c: (c.num_kv_heads, c.head_dim), "zeros"),
    "q_norm": (("head_dim",), lambda c: (c.head_dim,), "ones"),
    "k_norm": (("head_dim",), lambda c: (c.head_dim,), "ones"),
    "o_proj": (("q_heads", "head_dim", "embed"), lambda c: (c.num_heads, c.head_dim, c.hidden_size), "normal"),
    "o_bias": (("norm",), lambda c: (c.hidden_size,), "zeros"),
    "post_attention_norm": (("norm",), lambda c: (c.hidden_size,), "ones"),
    "gate_proj": (("embed", "mlp"), lambda c: (c.hidden_size, c.intermediate_size), "normal"),
    "up_proj": (("embed", "mlp"), lambda c: (c.hidden_size, c.intermediate_size), "normal"),
    "down_proj": (("mlp", "embed"), lambda c: (c.intermediate_size, c.hidden_size), "normal"),
}


def layer_param_names(cfg: ModelConfig) -> tuple[str, ...]:
    """The stacked per-layer parameters this config has."""
    skip = set()
    if not cfg.qkv_bias:
        skip |= {"q_bias", "k_bias", "v_bias"}
    if not cfg.o_bias:
        skip.add("o_bias")
    if not cfg.qk_norm:
        skip |= {"q_norm", "k_norm"}
    return tuple(n for n in _LAYER_PARAMS if n not in skip)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Preallocated keys/values for every layer, plus which slots hold real tokens.

    All rows share the write position `index` (prompts are left-padded), so one
    `dynamic_update_slice` per layer writes the whole batch in place.
    """

    k: Array  # [layers, batch, slots, kv_heads, head_dim]
    v: Array
    valid: Array  # [batch, slots] bool
    index: Array  # int32 scalar: next slot to write

    @classmethod
    def init(cls, cfg: ModelConfig, batch: int, slots: int, dtype: Any = None) -> "KVCache":
        dtype = dtype or cfg.jnp_dtype
        shape = (cfg.num_layers, batch, slots, cfg.num_kv_heads, cfg.head_dim)
        return cls(
            k=jnp.zeros(shape, dtype),
            v=jnp.zeros(shape, dtype),
            valid=jnp.zeros((batch, slots), bool),
            index=jnp.zeros((), jnp.int32),
        )

    @property
    def slots(self) -> int:
        return self.k.shape[2]

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.valid.nbytes


class DecoderLayers(nnx.Module):
    """All transformer blocks' parameters, stacked on a leading layer axis."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        init = jax.nn.initializers.normal(cfg.initializer_range)
        for name in layer_param_names(cfg):
            axes, shape_fn, kind = _LAYER_PARAMS[name]
            shape = (cfg.num_layers, *shape_fn(cfg))
            if kind == "normal":
                value = init(rngs.params(), shape, cfg.jnp_param_dtype)
            elif kind == "ones":
                value = jnp.ones(shape, cfg.jnp_param_dtype)
            else:
                value = jnp.zeros(shape, cfg.jnp_param_dtype)
            setattr(self, name, nnx.Param(value, logical_axes=("layers", *axes)))

    def stacked(self, cfg: ModelConfig) -> dict[str, Array]:
        return {name: getattr(self, name)[...] for name in layer_param_names(cfg)}


class CausalLM(nnx.Module):
    """Decoder-only LM. `__call__` returns (fp32 logits, updated cache or None)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        init = jax.nn.initializers.normal(cfg.initializer_range)
        pd = cfg.jnp_param_dtype
        self.embed_tokens = nnx.Param(
            init(rngs.params(), (cfg.vocab_size, cfg.hidden_size), pd), logical_axes=("vocab", "embed")
        )
        self.layers = DecoderLayers(cfg, rngs)
        self.norm = nnx.Param(jnp.ones((cfg.hidden_size,), pd), logical_axes=("norm",))
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nnx.Param(
                init(rngs.params(), (cfg.hidden_size, cfg.vocab_size), pd), logical_axes=("embed", "vocab")
            )
        )

    def __call__(
        self,
        tokens: Array,
        positions: Array | None = None,
        attention_mask: Array | None = None,
        cache: KVCache | None = None,
    ) -> tuple[Array, KVCache | None]:
        hidden, cache = self.hidden_states(tokens, positions, attention_mask, cache)
        return self.logits(hidden), cache

    def hidden_states(
        self,
        tokens: Array,
        positions: Array | None = None,
        attention_mask: Array | None = None,
        cache: KVCache | None = None,
    ) -> tuple[Array, KVCache | None]:
        """Final-norm hidden states [batch, seq, hidden] (compute dtype).

        attention_mask: [batch, seq], 1 for real tokens. positions default to
        cumsum(mask) - 1, which is right for left and right padding alike.
        Or [batch, seq, seq]: which key each query may attend to, used as given (no cache; pass
        positions), e.g. `packed_attention_mask` for several sequences sharing one row.
        With `cache`, the tokens are written at slots cache.index ... index + seq.
        """
        cfg = self.config
        b, t = tokens.shape
        if attention_mask is None:
            attention_mask = jnp.ones((b, t), bool)
        attention_mask = attention_mask.astype(bool)
        full_mask = attention_mask.ndim == 3
        if full_mask and (cache is not None or positions is None):
            raise ValueError("a [batch, seq, seq] attention mask needs explicit positions and no cache")
        if positions is None:
            positions = positions_from_mask(attention_mask)
            if cache is not None:
                raise ValueError("pass explicit positions when decoding with a KV cache")
        x = self.embed_tokens[...].astype(cfg.jnp_dtype)[tokens]
        x = constrain(x, ("batch", "length", "act_embed"))
        cos, sin = rope_tables(cfg, positions)
        params = self.layers.stacked(cfg)
        layer = functools.partial(_layer, cfg)
        if cfg.remat != "none":
            policy = (
                jax.checkpoint_policies.dots_with_no_batch_dims_saveable
                if cfg.remat == "dots"
                else jax.checkpoint_policies.nothing_saveable
            )
            layer = jax.checkpoint(layer, policy=policy)

        if cache is None:
            if full_mask:
                mask = attention_mask
            else:
                slots = jnp.arange(t)
                mask = (slots[None, :] <= slots[:, None])[None] & attention_mask[:, None, :]

            def body(h: Array, p: dict[str, Array]) -> tuple[Array, None]:
                h, _ = layer(p, h, cos, sin, mask, None)
                return h, None

            x, _ = jax.lax.scan(body, x, params)
        else:
            valid = jax.lax.dynamic_update_slice(cache.valid, attention_mask, (0, cache.index))
            q_slot = cache.index + jnp.arange(t)
            mask = (jnp.arange(cache.slots)[None, :] <= q_slot[:, None])[None] & valid[:, None, :]

            def body(carry: tuple[Array, Array, Array], xs: Any) -> tuple[Any, None]:
                h, ck, cv = carry
                p, li = xs
                h, (ck, cv) = layer(p, h, cos, sin, mask, (ck, cv, li, cache.index))
                return (h, ck, cv), None

            idx = jnp.arange(cfg.num_layers)
            (x, k, v), _ = jax.lax.scan(body, (x, cache.k, cache.v), (params, idx))
            cache = KVCache(k=k, v=v, valid=valid, index=cache.index + t)
        x = rms_norm(x, self.norm[...], cfg.rms_norm_eps)
        return x, cache

    def logits(self, hidden: Array) -> Array:
        """fp32 logits for hidden states of any leading shape."""
        cfg = self.config
        w = self.embed_tokens[...].T if self.lm_head is None else self.lm_head[...]
        out = jnp.einsum(
            "...d,dv->...v", hidden, w.astype(cfg.jnp_dtype), preferred_element_type=jnp.float32
        )
        return constrain(out, ("batch", "length", "act_vocab")) if out.ndim == 3 else out


# ---------------------------------------------------------------------------- pure pieces


def positions_from_mask(mask: Array) -> Array:
    """Position ids that skip padding: cumsum(mask) - 1, clipped at 0."""
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def packed_attention_mask(segments: Array) -> Array:
    """[b, t] segment ids -> [b, t, t] causal mask for a row packing a shared prompt (segment 0)
    followed by several continuations (1, 2, ...; -1 is padding): a continuation token sees the
    prompt and the earlier tokens of its own continuation, never another continuation."""
    t = segments.shape[-1]
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
    key, query = segments[:, None, :], segments[:, :, None]
    return causal[None] & (key >= 0) & ((key == 0) | (key == query))


def rms_norm(x: Array, w: Array, eps: float) -> Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (w.astype(jnp.float32) * xf).astype(x.dtype)


def rope_tables(cfg: ModelConfig, positions: Array) -> tuple[Array, Array]:
    inv = jnp.asarray(rope_inv_freq(cfg), jnp.float32)
    ang = positions.astype(jnp.float32)[..., None] * inv
    ang = jnp.concatenate([ang, ang], axis=-1)
    return jnp.cos(ang), jnp.sin(ang)  # [batch, seq, head_dim]


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate-half RoPE (the HF convention). x: [batch, seq, heads, head_dim]."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, :, None] + rot * sin[:, :, None]).astype(x.dtype)


def attention(q: Array, k: Array, v: Array, mask: Array) -> Array:
    """Grouped-query attention. q [b,t,h,d]; k,v [b,s,kv,d]; mask [b,t,s] -> [b,t,h,d]."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    q = q.reshape(b, t, kv, h // kv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores * (d**-0.5)
    scores = jnp.where(mask[:, None, None], scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, h, d)


def _layer(
    cfg: ModelConfig,
    p: dict[str, Array],
    x: Array,
    cos: Array,
    sin: Array,
    mask: Array,
    cache: tuple[Array, Array, Array, Array] | None,
) -> tuple[Array, tuple[Array, Array] | None]:
    dt = cfg.jnp_dtype
    w = {k: v.astype(dt) for k, v in p.items()}
    h = rms_norm(x, w["input_norm"], cfg.rms_norm_eps)
    q = jnp.einsum("btd,dhk->bthk", h, w["q_proj"])
    k = jnp.einsum("btd,dhk->bthk", h, w["k_proj"])
    v = jnp.einsum("btd,dhk->bthk", h, w["v_proj"])
    if cfg.qkv_bias:
        q, k, v = q + w["q_bias"], k + w["k_bias"], v + w["v_bias"]
    if cfg.qk_norm:
        q = rms_norm(q, w["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, w["k_norm"], cfg.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    q = constrain(q, ("batch", "length", "act_heads", None))
    new_cache = None
    if cache is not None:
        ck, cv, li, index = cache
        ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype)[None], (li, 0, index, 0, 0))
        cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype)[None], (li, 0, index, 0, 0))
        k = jax.lax.dynamic_index_in_dim(ck, li, keepdims=False).astype(dt)
        v = jax.lax.dynamic_index_in_dim(cv, li, keepdims=False).astype(dt)
        new_cache = (ck, cv)
    o = attention(q, k, v, mask)
    o = jnp.einsum("bthk,hkd->btd", o, w["o_proj"])
    if cfg.o_bias:
        o = o + w["o_bias"]
    x = x + o
    h = rms_norm(x, w["post_attention_norm"], cfg.rms_norm_eps)
    gate = jnp.einsum("btd,df->btf", h, w["gate_proj"])
    up = jnp.einsum("btd,df->btf", h, w["up_proj"])
    x = x + jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, w["down_proj"])
    return constrain(x, ("batch", "length", "act_embed")), new_cache
