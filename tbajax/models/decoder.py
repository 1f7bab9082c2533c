"""The shared causal-decoder skeleton for every family (Llama/Qwen, GPT-NeoX, GPT-2).

Layer parameters are stacked along a leading "layers" axis and applied with `lax.scan`, so a
28-layer model compiles as fast as a 1-layer one and remat is one switch (`scan_layers=False`
unrolls them for scoring and training: faster on CPU for a few layers). The NNX module only
owns the parameters; what differs between architectures (config parsing, parameter tables, HF
names, the block itself) lives in one module per family under `tbajax/models/families/`, and the
math in small pure functions (`tbajax/models/layers.py`) that the training forward and the
KV-cache decode path share.

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
from tbajax.models.families import Family, ParamSpec, family_for
from tbajax.models.layers import CausalMask, apply_rope, attention, rms_norm  # noqa: F401  (re-exported)
from tbajax.models.layers import rope_tables as _rope_tables
from tbajax.sharding import constrain

Array = jax.Array


def layer_param_names(cfg: ModelConfig) -> tuple[str, ...]:
    """The stacked per-layer parameters this config has."""
    return tuple(family_for(cfg.model_type).layer_params(cfg))


def head_params(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """The output head: `score` for a sequence classifier, `lm_head` when not tied, else none."""
    if cfg.num_labels is not None:
        return {"score": ParamSpec(("embed", None), (cfg.hidden_size, cfg.num_labels))}
    if cfg.tie_word_embeddings:
        return {}
    return {"lm_head": ParamSpec(("embed", "vocab"), (cfg.hidden_size, cfg.vocab_size))}


def _init(spec: ParamSpec, cfg: ModelConfig, rngs: nnx.Rngs, lead: tuple[int, ...] = ()) -> Array:
    shape = (*lead, *spec.shape)
    if spec.init == "normal":
        return jax.nn.initializers.normal(cfg.initializer_range)(rngs.params(), shape, cfg.jnp_param_dtype)
    fill = jnp.ones if spec.init == "ones" else jnp.zeros
    return fill(shape, cfg.jnp_param_dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Preallocated keys/values, one buffer per layer, plus which slots hold real tokens.

    Keys are stored d-major ([batch, kv_heads, head_dim, slots]) and values slot-major
    ([batch, kv_heads, slots, head_dim]) so that a decode step reads both in place at memory speed
    (`layers.cached_attention`); separate per-layer buffers let every layer's write and read happen
    in place (a stacked [layers, ...] buffer inside the layer scan is copied a layer at a time).
    All rows share the write position `index` (prompts are left-padded), so one
    `dynamic_update_slice` per layer writes the whole batch. The continuous-batching engine
    (`tbajax.sampling.continuous`) uses it as a ring: index advances mod `slots` and each row's
    history is wherever it was written (single-token steps attend by `valid` alone).
    """

    k: tuple[Array, ...]  # per layer [batch, kv_heads, head_dim, slots]
    v: tuple[Array, ...]  # per layer [batch, kv_heads, slots, head_dim]
    valid: Array  # [batch, slots] bool
    index: Array  # int32 scalar: next slot to write

    K_AXES = ("batch", "kv_heads", "head_dim", "length")
    V_AXES = ("batch", "kv_heads", "length", "head_dim")

    @classmethod
    def init(cls, cfg: ModelConfig, batch: int, slots: int, dtype: Any = None) -> "KVCache":
        dtype = dtype or cfg.jnp_dtype
        kv, hd = cfg.num_kv_heads, cfg.head_dim
        return cls(
            k=tuple(jnp.zeros((batch, kv, hd, slots), dtype) for _ in range(cfg.num_layers)),
            v=tuple(jnp.zeros((batch, kv, slots, hd), dtype) for _ in range(cfg.num_layers)),
            valid=jnp.zeros((batch, slots), bool),
            index=jnp.zeros((), jnp.int32),
        )

    @property
    def rows(self) -> int:
        return self.valid.shape[0]

    @property
    def slots(self) -> int:
        return self.valid.shape[1]

    @property
    def dtype(self) -> Any:
        return self.k[0].dtype

    def nbytes(self) -> int:
        return sum(x.nbytes for x in (*self.k, *self.v)) + self.valid.nbytes


class DecoderLayers(nnx.Module):
    """All transformer blocks' parameters, stacked on a leading layer axis."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        for name, spec in family_for(cfg.model_type).layer_params(cfg).items():
            value = _init(spec, cfg, rngs, (cfg.num_layers,))
            setattr(self, name, nnx.Param(value, logical_axes=("layers", *spec.axes)))

    def stacked(self, cfg: ModelConfig) -> dict[str, Array]:
        return {name: getattr(self, name)[...] for name in layer_param_names(cfg)}


class CausalLM(nnx.Module):
    """Decoder-only LM. `__call__` returns (fp32 logits, updated cache or None).

    With `config.num_labels` set (a *ForSequenceClassification checkpoint) the head is `score`
    and "logits" are the per-token head values [..., num_labels]; see `tbajax.models.scorer`.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        family = family_for(cfg.model_type)
        for name, spec in family.top_params(cfg).items():
            setattr(self, name, nnx.Param(_init(spec, cfg, rngs), logical_axes=spec.axes))
        self.layers = DecoderLayers(cfg, rngs)
        heads = {
            name: nnx.Param(_init(spec, cfg, rngs), logical_axes=spec.axes)
            for name, spec in head_params(cfg).items()
        }
        self.lm_head = nnx.data(heads.get("lm_head"))
        self.score = nnx.data(heads.get("score"))

    @property
    def family(self) -> Family:
        return family_for(self.config.model_type)

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
        layers: tuple[dict[str, Array], ...] | None = None,
    ) -> tuple[Array, KVCache | None]:
        """Final-norm hidden states [batch, seq, hidden] (compute dtype).

        attention_mask: [batch, seq], 1 for real tokens. positions default to
        cumsum(mask) - 1, which is right for left and right padding alike.
        Or [batch, seq, seq]: which key each query may attend to, used as given (no cache; pass
        positions), e.g. `packed_attention_mask` for several sequences sharing one row.
        With `cache`, the tokens are written at slots cache.index ... index + seq.
        layers: `per_layer_params()`, which a decode loop takes once outside the loop (XLA does not
        hoist the per-layer weight slices out of a while loop: it would copy every weight per step).
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
        family = self.family
        top = {name: getattr(self, name)[...] for name in family.top_params(cfg)}
        x = family.embed(cfg, top, tokens, positions)
        x = constrain(x, ("batch", "length", "act_embed"))
        tables = family.position_tables(cfg, positions)
        params = self.layers.stacked(cfg)
        layer = functools.partial(family.block, cfg)
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
                mask = CausalMask((slots[None, :] <= slots[:, None])[None] & attention_mask[:, None, :])

            def body(h: Array, p: dict[str, Array]) -> tuple[Array, None]:
                h, _ = layer(p, h, tables, mask, None)
                return h, None

            if cfg.scan_layers:
                x, _ = jax.lax.scan(body, x, params)
            else:
                for p in unstack(params, cfg.num_layers):
                    x, _ = body(x, p)
        else:
            valid = jax.lax.dynamic_update_slice(cache.valid, attention_mask, (0, cache.index))
            if t == 1:
                # one new token attends to every valid slot: the same as the causal mask for a
                # linear cache (no later slot is valid yet), and right for a ring cache whose
                # older history sits at higher slots (continuous batching)
                mask = valid[:, None, :]
            else:
                q_slot = cache.index + jnp.arange(t)
                mask = (jnp.arange(cache.slots)[None, :] <= q_slot[:, None])[None] & valid[:, None, :]

            if t == 1 or layers is not None:
                # a decode step: layers unrolled over their own cache buffers, so each write and
                # read is in place
                ks, vs = [], []
                for i, p in enumerate(layers if layers is not None else unstack(params, cfg.num_layers)):
                    x, (k, v) = layer(p, x, tables, mask, (cache.k[i], cache.v[i], cache.index))
                    ks.append(k)
                    vs.append(v)
            else:
                # a prompt: scanned (one compiled layer; the cache copies cost little next to the
                # prompt's matmuls, and an unrolled prefill would multiply compile time by depth)
                def body(h: Array, xs: Any) -> tuple[Array, tuple[Array, Array]]:
                    p, kt, cv = xs
                    h, (kt, cv) = layer(p, h, tables, mask, (kt, cv, cache.index))
                    return h, (kt, cv)

                x, (k, v) = jax.lax.scan(body, x, (params, jnp.stack(cache.k), jnp.stack(cache.v)))
                ks, vs = list(k), list(v)
            cache = KVCache(k=tuple(ks), v=tuple(vs), valid=valid, index=cache.index + t)
        return family.final_norm(cfg, top, x), cache

    def logits(self, hidden: Array, head: Array | None = None) -> Array:
        """fp32 logits for hidden states of any leading shape; `head` is `vocab_major_head()`,
        hoisted out of a decode loop by the caller."""
        if head is not None:
            out = jnp.einsum("...d,vd->...v", hidden, head, preferred_element_type=jnp.float32)
        else:
            out = jnp.einsum("...d,dv->...v", hidden, self.head_weight(), preferred_element_type=jnp.float32)
        return constrain(out, ("batch", "length", "act_vocab")) if out.ndim == 3 else out

    def head_weight(self) -> Array:
        """The output projection as [hidden, vocab or labels] in the compute dtype: the `score`
        head, the LM head, or the tied embedding's transpose."""
        if self.score is not None:
            w = self.score[...]
        elif self.lm_head is not None:
            w = self.lm_head[...]
        else:
            w = self.embed_tokens[...].T
        return w.astype(self.config.jnp_dtype)

    def per_layer_params(self) -> tuple[dict[str, Array], ...]:
        """Each layer's weights as their own arrays, in the family's decode layout (copied once
        per program; see `hidden_states`)."""
        cfg = self.config
        layers = unstack(self.layers.stacked(cfg), cfg.num_layers)
        if self.family.decode_layout is not None:
            layers = tuple(self.family.decode_layout(cfg, p) for p in layers)
        return jax.lax.optimization_barrier(layers)

    def vocab_major_head(self) -> Array:
        """The LM head as [vocab, hidden] in the compute dtype, for decoding a few rows at a time.

        XLA's CPU dot runs [rows, hidden] x [hidden, vocab] at a third of the speed of the same
        product against a vocab-major copy when rows are few (14 vs 44 GFLOP/s at 32 x 512 x 24576),
        so the sampler transposes an untied `lm_head` once per program (the barrier keeps XLA from
        folding the transpose back into the dot); tied embeddings already are vocab-major.
        """
        cfg = self.config
        if self.score is not None:
            raise ValueError("a sequence classifier has no LM head")
        if self.lm_head is None:
            return self.embed_tokens[...].astype(cfg.jnp_dtype)
        head = self.lm_head[...].astype(cfg.jnp_dtype).T
        return constrain(jax.lax.optimization_barrier(head), ("vocab", "embed"))


# ---------------------------------------------------------------------------- pure pieces


def unstack(params: dict[str, Array], num_layers: int) -> tuple[dict[str, Array], ...]:
    """Stacked [layers, ...] weights -> one dict of per-layer weights per layer."""
    return tuple({name: w[i] for name, w in params.items()} for i in range(num_layers))


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


def rope_tables(cfg: ModelConfig, positions: Array) -> tuple[Array, Array]:
    """cos/sin [batch, seq, rotary_dim] for a RoPE family."""
    return _rope_tables(rope_inv_freq(cfg), positions)
