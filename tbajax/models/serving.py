"""A causal LM's weights laid out for sampling, the KV cache, and the two passes a sampler runs.

A decode step reads every weight once per token, so where the weights lie matters more than in
training: each layer as its own arrays (XLA copies a layer's slice out of a stacked array at every
step of a while loop), projections that read the same input fused into one matmul
(`Family.decode_layout`), weights output-major (`layers.orient_for_decode`), and the LM
head vocab-major. Building that layout copies every weight,
so a sampler builds it once per params version (`ServingParams.of`), not inside every generate
call, and holds only this copy (`stacked_params` gives the model's own layout back).

The two passes:
  - `prompt_pass`: whole left-padded prompts at once, causal attention over their own keys (no
    cache to read or zero first), every layer's keys and values handed back to be written into a
    cache;
  - `cached_pass`: new tokens (usually one per row) written at the cache's index, attending to
    every valid slot of their row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from tbajax import op_scopes as S
from tbajax.models import layers as L
from tbajax.models.config import ModelConfig
from tbajax.models.families import Family, family_for
from tbajax.models.layers import EMIT_KV, CausalMask
from tbajax.op_scopes import scoped
from tbajax.sharding import batch_shards, constrain

Array = jax.Array


@dataclasses.dataclass
class _Slots:
    """Per-layer keys and values over cache slots, and which slots hold real tokens (`KVCache`)."""

    k: tuple[Array, ...]  # per layer [rows, kv_heads, head_dim, slots]
    v: tuple[Array, ...]  # per layer [rows, kv_heads, slots, head_dim]
    valid: Array  # [rows, slots] bool

    K_AXES = ("batch", "kv_heads", "head_dim", "length")
    V_AXES = ("batch", "kv_heads", "length", "head_dim")

    @property
    def rows(self) -> int:
        return self.valid.shape[0]

    @property
    def slots(self) -> int:
        return self.valid.shape[1]

    def nbytes(self) -> int:
        return sum(x.nbytes for x in (*self.k, *self.v)) + self.valid.nbytes


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PromptCache(_Slots):
    """The prompt part of a cache whose rows are K samples of each prompt (prompt-major): every
    prompt's keys/values once, not once per sample (`layers.attention_after_prompt` reads them
    for all K). Same layouts as `KVCache`, rows = prompts, slots = the prompt bucket.

    As a *pool* (continuous batching, `pool`), any row may continue any prompt: samples
    [prompts, K] holds the row of each prompt's sample j (>= rows: none) and entry [rows] each
    row's prompt * K + j (`layers.PromptKV`)."""

    samples: Array | None = None
    entry: Array | None = None

    @classmethod
    def init(cls, cfg: ModelConfig, prompts: int, slots: int, dtype: Any = None) -> "PromptCache":
        cache = KVCache.init(cfg, prompts, slots, dtype)
        return cls(k=cache.k, v=cache.v, valid=cache.valid)

    @classmethod
    def pool(cls, cfg: ModelConfig, prompts: int, slots: int, num_samples: int, rows: int,
             dtype: Any = None) -> "PromptCache":
        """An empty pool of `prompts` entries for a cache of `rows` rows: no sample anywhere."""
        cache = cls.init(cfg, prompts, slots, dtype)
        return dataclasses.replace(cache, samples=jnp.full((prompts, num_samples), rows, jnp.int32),
                                   entry=jnp.zeros((rows,), jnp.int32))

    def nbytes(self) -> int:
        tables = sum(x.nbytes for x in (self.samples, self.entry) if x is not None)
        return super().nbytes() + tables


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache(_Slots):
    """Preallocated keys/values, one buffer per layer, plus which slots hold real tokens.

    Keys are stored d-major ([batch, kv_heads, head_dim, slots]) and values slot-major
    ([batch, kv_heads, slots, head_dim]) so that a decode step reads both in place at memory speed
    (`layers.cached_attention`); separate per-layer buffers let every layer's write and read happen
    in place (a stacked [layers, ...] buffer inside a loop is copied a layer at a time).
    All rows share the write position `index` (prompts are left-padded), so one
    `dynamic_update_slice` per layer writes the whole batch. The continuous-batching engine
    (`tbajax.sampling.continuous`) uses it as a ring: index advances mod `slots` and each row's
    history is wherever it was written (single-token steps attend by `valid` alone).
    With a `prompt` part (the static sampler's K > 1 samples per prompt), the prompt's tokens
    live there once per prompt and these buffers hold the generated tokens only. Buffers are
    `kv_cache_dtype(cfg)` unless `init` is given a dtype: fp32 for a bf16 model on CPU.
    """

    index: Array  # int32 scalar: next slot to write
    prompt: PromptCache | None = None

    @classmethod
    def init(cls, cfg: ModelConfig, batch: int, slots: int, dtype: Any = None) -> "KVCache":
        dtype = dtype or kv_cache_dtype(cfg)
        kv, hd = cfg.num_kv_heads, cfg.head_dim
        return cls(
            k=tuple(jnp.zeros((batch, kv, hd, slots), dtype) for _ in range(cfg.num_layers)),
            v=tuple(jnp.zeros((batch, kv, slots, hd), dtype) for _ in range(cfg.num_layers)),
            valid=jnp.zeros((batch, slots), bool),
            index=jnp.zeros((), jnp.int32),
        )

    @property
    def dtype(self) -> Any:
        return self.k[0].dtype

    def nbytes(self) -> int:
        return super().nbytes() + (0 if self.prompt is None else self.prompt.nbytes())

    def layer(self, i: int) -> L.LayerCache:
        """Layer i's cache as `layers.self_attention` takes it."""
        if self.prompt is None:
            return self.k[i], self.v[i], self.index
        p = self.prompt
        prompt = L.PromptKV(p.k[i], p.v[i], p.valid, p.samples, p.entry)
        return self.k[i], self.v[i], self.index, prompt


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TieredKVCache:
    """A continuous-batching cache whose rows are split into tiers of rings of different lengths
    (`sampling.continuous`'s `ring_tiers`): tier b is a `KVCache` of its own rows, slots and write
    index, rows [0, n_0) of a step are tier 0's, and so on (on a mesh, within each batch shard:
    `layers.tier_rows`). A single-token step's attention then
    reads each row's tier ring, so rows with short histories do not read the longest ring. The
    prompt pool, if any, is shared by all tiers (its tables hold global rows)."""

    tiers: tuple[KVCache, ...]
    prompt: PromptCache | None = None

    @property
    def rows(self) -> int:
        return sum(t.rows for t in self.tiers)

    @property
    def dtype(self) -> Any:
        return self.tiers[0].dtype

    def nbytes(self) -> int:
        return sum(t.nbytes() for t in self.tiers) + (0 if self.prompt is None else self.prompt.nbytes())

    def layer(self, i: int, write: Array) -> L.RingTiers:
        """Layer i's tiers as `layers.self_attention` takes them; `write` [rows]: rows that write."""
        p = self.prompt
        prompt = None if p is None else L.PromptKV(p.k[i], p.v[i], p.valid, p.samples, p.entry)
        return L.RingTiers(k=tuple(t.k[i] for t in self.tiers), v=tuple(t.v[i] for t in self.tiers),
                           index=tuple(t.index for t in self.tiers), write=write, prompt=prompt)


def kv_cache_dtype(cfg: ModelConfig, platform: str | None = None) -> Any:
    """The dtype a sampler's KV cache holds: the compute dtype, except fp32 for a bf16 / fp16
    model on CPU (`platform`: a `Sampler` passes its mesh's; default JAX's default backend).
    XLA:CPU rewrites every 16-bit update of a cache as fp32 (convert the whole buffer, update,
    convert back: a copy of the layer's cache at every decode step) and reads 16-bit caches
    slower than fp32 ones; the fp32 cache holds the same values (`layers.cache_values`), so
    tokens and log-probs do not change, for twice the cache's memory
    (`experiments/benchmarks/sampler.py --dtype bfloat16`)."""
    dtype = jnp.dtype(cfg.jnp_dtype)
    if dtype.itemsize == 2 and (platform or jax.default_backend()) == "cpu":
        return jnp.float32
    return dtype


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ServingParams:
    """The weights a sampler reads: the family's top params (embeddings, final norm), each
    layer's own weights in the family's decode layout, and the LM head as [vocab, hidden] in the
    compute dtype (None when tied: the embedding already is vocab-major)."""

    top: dict[str, Array]
    layers: tuple[dict[str, Array], ...]
    head: Array | None

    @classmethod
    def of(cls, model: Any) -> "ServingParams":
        """The serving layout of a `CausalLM` (a copy of every layer weight; call it once per params
        version, inside a jitted function)."""
        cfg = model.config
        if cfg.num_labels is not None:
            raise ValueError("a sequence classifier has no LM head to sample from")
        family = family_for(cfg.model_type)
        layers = unstack(model.layers.stacked(cfg), cfg.num_layers)
        if family.decode_layout is not None:
            layers = tuple(family.decode_layout(cfg, p) for p in layers)
        head = None
        if model.lm_head is not None:
            head = constrain(model.lm_head[...].astype(cfg.jnp_dtype).T, ("vocab", "embed"))
        top = {name: getattr(model, name)[...] for name in family.top_params(cfg)}
        return cls(top=top, layers=layers, head=head)

    def head_matrix(self, cfg: ModelConfig) -> Array:
        """The LM head as [vocab, hidden] in the compute dtype."""
        return self.top["embed_tokens"].astype(cfg.jnp_dtype) if self.head is None else self.head


def unstack(params: dict[str, Array], num_layers: int) -> tuple[dict[str, Array], ...]:
    """Stacked [layers, ...] weights -> one dict of per-layer weights per layer."""
    return tuple({name: w[i] for name, w in params.items()} for i in range(num_layers))


def stacked_params(cfg: ModelConfig, params: ServingParams) -> dict[str, Any]:
    """The inverse of `ServingParams.of`: the model's params as the pure dict `nnx.to_pure_dict`
    gives (layers stacked, the untied head [hidden, vocab])."""
    family = family_for(cfg.model_type)
    layers = params.layers
    if family.undo_decode_layout is not None:
        layers = tuple(family.undo_decode_layout(cfg, p) for p in layers)
    out: dict[str, Any] = dict(params.top)
    out["layers"] = {name: jnp.stack([p[name] for p in layers]) for name in layers[0]}
    if params.head is not None:
        out["lm_head"] = params.head.T
    return out


@scoped(S.LM_HEAD)
def logits(cfg: ModelConfig, params: ServingParams, hidden: Array) -> Array:
    """fp32 logits [..., vocab] of final hidden states, divided by `logits_scaling` (Granite; the few
    rows' logits here, where the trainer divides its head: `layers.lm_head_scaled`) and soft-capped at
    `final_logit_softcapping` (Gemma 2)."""
    out = L.out_major_product(hidden, params.head_matrix(cfg), out_dtype=jnp.float32)
    if cfg.logits_scaling != 1.0:
        out = out / cfg.logits_scaling
    out = L.soft_capped(out, cfg.final_logit_softcapping)
    return constrain(out, ("batch", "act_vocab")) if out.ndim == 2 else out


def prompt_pass(
    cfg: ModelConfig, params: ServingParams, tokens: Array, mask: Array, positions: Array
) -> tuple[Array, tuple[Array, ...], tuple[Array, ...]]:
    """Left-padded prompts [b, p] through every layer, attending causally over their own keys.

    Returns the final hidden state of the last column [b, hidden] (every row's last prompt token)
    and each layer's keys d-major [b, kv, d, p] and values [b, kv, p, d] in the cache's layout,
    for the caller to write into its cache (slots of padding columns must be marked invalid)."""
    family = family_for(cfg.model_type)
    _, t = tokens.shape
    mask = mask.astype(bool)
    slots = jnp.arange(t)
    causal = CausalMask((slots[None, :] <= slots[:, None])[None] & mask[:, None, :])
    x, keys, values = _through_layers(cfg, family, params, tokens, positions,
                                      lambda kind: L.windowed(causal, positions, kind.sliding_window),
                                      lambda i: EMIT_KV)
    return family.final_norm(cfg, params.top, x[:, -1]), tuple(keys), tuple(values)


def cached_pass(
    cfg: ModelConfig, params: ServingParams, tokens: Array, positions: Array, mask: Array,
    cache: KVCache | TieredKVCache,
) -> tuple[Array, Any]:
    """Tokens [b, t] written at slots cache.index ... index + t, each attending to the valid slots
    of its row up to its own; returns the final hidden states [b, t, hidden] and the cache.

    One new token (t = 1) attends to every valid slot: the same as the causal mask for a linear
    cache (no later slot is valid yet), and right for a ring cache whose older history sits at
    higher slots (continuous batching). Layers are unrolled over their own cache buffers, so each
    write and read happens in place. A `TieredKVCache` takes one token per row, and `mask` [b, 1]
    says which rows write theirs (the others' histories stay as they are). A sliding window
    applies by ring distance (`in_window`), and over a shared prompt part by each row's position
    (`layers.prompt_seen`)."""
    family = family_for(cfg.model_type)
    t = tokens.shape[1]
    if isinstance(cache, TieredKVCache):
        return _tiered_pass(cfg, family, params, tokens, positions, mask, cache)
    if cache.prompt is not None and t != 1:
        raise ValueError(f"a cache with a shared prompt part takes one token per row and step, got {t}")
    valid = jax.lax.dynamic_update_slice(cache.valid, mask.astype(bool), (0, cache.index))
    q_slot = cache.index + jnp.arange(t)
    attend = valid[:, None, :]
    if t > 1:
        attend &= (jnp.arange(cache.slots)[None, :] <= q_slot[:, None])[None]
    kinds, kind_of = cfg.layer_kinds()

    def layer_cache(i: int) -> L.LayerCache:
        layer = cache.layer(i)
        if cache.prompt is None:
            return layer
        return (*layer[:3], _prompt_in_window(layer[3], kinds[kind_of[i]], positions, cache.slots))

    x, ks, vs = _through_layers(cfg, family, params, tokens, positions,
                                lambda kind: attend & in_window(kind, q_slot, cache.slots), layer_cache)
    cache = KVCache(k=tuple(ks), v=tuple(vs), valid=valid, index=cache.index + t, prompt=cache.prompt)
    return family.final_norm(cfg, params.top, x), cache


def in_window(cfg: ModelConfig, query_slots: Array, slots: int) -> Array | bool:
    """[queries, slots]: the cache slots within the model's sliding window of each query slot,
    counting back around the ring (True without a window). A row's history runs in ring order up
    to the slot its query writes (a linear cache is a ring that has not wrapped; `KVCache`), so a
    slot's distance back is its token's distance in positions."""
    if cfg.fits_window(slots):
        return True
    return jnp.mod(query_slots[:, None] - jnp.arange(slots)[None, :], slots) < cfg.sliding_window


def _prompt_in_window(prompt: L.PromptKV, kind: ModelConfig, positions: Array, slots: int) -> L.PromptKV:
    """A layer's shared prompt part as a query at `positions` [rows, 1] sees it under the layer's
    sliding window (unchanged where a prompt and `slots` more tokens fit the window)."""
    if kind.fits_window(prompt.k.shape[-1] + slots):
        return prompt
    return prompt._replace(positions=positions[:, 0], window=kind.sliding_window)


def _through_layers(
    cfg: ModelConfig, family: Family, params: ServingParams, tokens: Array, positions: Array,
    attend: Callable[[ModelConfig], Any], layer_cache: Callable[[int], Any],
) -> tuple[Array, list[Any], list[Any]]:
    """Tokens through every layer, each with its kind's config, position tables and mask
    (`attend(kind)`; `ModelConfig.layer_kinds`), attending over `layer_cache(i)`: (hidden
    states, each layer's updated keys, its values)."""
    x = _embed(cfg, family, params, tokens, positions)
    kinds, kind_of = cfg.layer_kinds()
    inputs = [(family.position_tables(kind, positions), attend(kind)) for kind in kinds]
    ks, vs = [], []
    for i, (p, kind) in enumerate(zip(params.layers, kind_of)):
        x, (k, v) = family.block(kinds[kind], p, x, *inputs[kind], layer_cache(i))
        ks.append(k)
        vs.append(v)
    return x, ks, vs


def _tiered_pass(
    cfg: ModelConfig, family: Family, params: ServingParams, tokens: Array, positions: Array, mask: Array,
    cache: TieredKVCache,
) -> tuple[Array, TieredKVCache]:
    """`cached_pass` of one token per row over a `TieredKVCache`."""
    if tokens.shape[1] != 1:
        raise ValueError(f"a tiered ring cache takes one token per row and step, got {tokens.shape[1]}")
    write = mask[:, 0].astype(bool)
    shards = batch_shards(write.shape[0])
    valid, start = [], 0
    for tier in cache.tiers:
        w = L.tier_rows(write, start, tier.rows, shards)[:, None]
        old = jax.lax.dynamic_slice(tier.valid, (0, tier.index), (tier.rows, 1))
        valid.append(jax.lax.dynamic_update_slice(tier.valid, w | old, (0, tier.index)))
        start += tier.rows

    def attend(kind: ModelConfig) -> tuple[Array, ...]:
        return tuple(v[:, None, :] & in_window(kind, tier.index[None], tier.slots)
                     for v, tier in zip(valid, cache.tiers))

    kinds, kind_of = cfg.layer_kinds()
    longest = max(tier.slots for tier in cache.tiers)

    def layer_cache(i: int) -> L.RingTiers:
        layer = cache.layer(i, write)
        if layer.prompt is None:
            return layer
        return layer._replace(prompt=_prompt_in_window(layer.prompt, kinds[kind_of[i]], positions, longest))

    x, ks, vs = _through_layers(cfg, family, params, tokens, positions, attend, layer_cache)
    tiers = tuple(
        KVCache(k=tuple(layer[b] for layer in ks), v=tuple(layer[b] for layer in vs), valid=valid[b],
                index=tier.index + 1)
        for b, tier in enumerate(cache.tiers)
    )
    return family.final_norm(cfg, params.top, x), TieredKVCache(tiers=tiers, prompt=cache.prompt)


@scoped(S.EMBED)
def _embed(cfg: ModelConfig, family: Family, params: ServingParams, tokens: Array, positions: Array) -> Array:
    return constrain(family.embed(cfg, params.top, tokens, positions), ("batch", "length", "act_embed"))
