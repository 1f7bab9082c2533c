"""The shared causal-decoder skeleton for every family (Llama/Qwen, GPT-NeoX, GPT-2).

Layer parameters are stacked along a leading "layers" axis and applied with `lax.scan`, so a
28-layer model compiles as fast as a 1-layer one and remat is one switch (`scan_layers=False`
unrolls them for scoring and training: faster on CPU for a few layers). The NNX module only
owns the parameters; what differs between architectures (config parsing, parameter tables, HF
names, the block itself) lives in one module per family under `tbajax/models/families/`, and the
math in small pure functions (`tbajax/models/layers.py`) that the training forward and the
sampler's passes (`tbajax/models/serving.py`, over per-layer weights and a KV cache) share.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tbajax import op_scopes as S
from tbajax.models.config import ModelConfig
from tbajax.models.families import Family, ParamSpec, family_for
from tbajax.models.layers import CausalMask, StridedGroups, apply_rope, attention, rms_norm  # noqa: F401
from tbajax.models.layers import lm_head_scaled, soft_capped, windowed
from tbajax.models.layers import scan_layers
from tbajax.models.moe import CountRouting, RoutingCounts
from tbajax.models.serving import KVCache, ServingParams, cached_pass, unstack
from tbajax.op_scopes import scoped
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
        attention_mask: Array | CausalMask | StridedGroups | None = None,
        cache: KVCache | None = None,
    ) -> tuple[Array, KVCache | None]:
        hidden, cache = self.hidden_states(tokens, positions, attention_mask, cache)
        return self.logits(hidden), cache

    def hidden_states(
        self,
        tokens: Array,
        positions: Array | None = None,
        attention_mask: Array | CausalMask | None = None,
        cache: KVCache | CountRouting | None = None,
    ) -> tuple[Array, Any]:
        """Final-norm hidden states [batch, seq, hidden] (compute dtype), and the cache (None
        without one).

        attention_mask: [batch, seq], 1 for real tokens. positions default to
        cumsum(mask) - 1, which is right for left and right padding alike.
        Or [batch, seq, seq]: which key each query may attend to, used as given (no cache; pass
        positions), e.g. `packed_attention_mask` for several sequences sharing one row; wrapped
        in a `CausalMask` it promises that no query sees a later slot, and attention skips the
        blocks above the diagonal. Or `StridedGroups`: rows of one prompt and its K responses at
        fixed strides, each response attending to the prompt and itself (pass positions).
        With `cache`, the tokens are written at slots cache.index ... index + seq
        (`serving.cached_pass` over this model's serving layout, built on every call: a sampler
        builds that layout once per params version and calls the pass itself).
        A sliding window (`ModelConfig.sliding_window`) applies by position in every pass without
        a cache (`layers.windowed`), and by ring distance over one (`serving.cached_pass`).
        A mixture-of-experts model takes `moe.CountRouting` in the cache's place: no cache, and
        every layer's `moe.RoutingCounts` over its counted tokens handed back, stacked [L, E]
        (what the router's load-balancing loss reads, `moe.load_balancing_loss`).
        """
        cfg = self.config
        b, t = tokens.shape
        routing = cache if isinstance(cache, CountRouting) else None
        if routing is not None:
            if cfg.num_experts is None:
                raise ValueError(f"routing counts asked of a {cfg.model_type} model, which has no router")
            if routing.tokens.shape != tokens.shape:
                raise ValueError(f"CountRouting.tokens is {routing.tokens.shape}; "
                                 f"the tokens are {tokens.shape}")
            cache = None
        if isinstance(attention_mask, StridedGroups):
            if cache is not None or positions is None:
                raise ValueError("strided prompt groups need explicit positions and no cache")
            return self._layers_over(tokens, positions, attention_mask, routing)
        promised_causal = isinstance(attention_mask, CausalMask)
        if promised_causal:
            attention_mask = attention_mask.mask
            if attention_mask.ndim != 3:
                raise ValueError("a CausalMask attention mask is [batch, seq, seq]; pass a [batch, seq] "
                                 "padding mask bare (the decoder makes it causal itself)")
        if attention_mask is None:
            attention_mask = jnp.ones((b, t), bool)
        attention_mask = attention_mask.astype(bool)
        full_mask = attention_mask.ndim == 3
        if full_mask and (cache is not None or positions is None):
            raise ValueError("a [batch, seq, seq] attention mask needs explicit positions and no cache")
        if positions is None:
            if cache is not None:
                raise ValueError("pass explicit positions when decoding with a KV cache")
            positions = positions_from_mask(attention_mask)
        if cache is not None:
            return cached_pass(cfg, ServingParams.of(self), tokens, positions, attention_mask, cache)
        if full_mask:
            mask = CausalMask(attention_mask) if promised_causal else attention_mask
        else:
            slots = jnp.arange(t)
            mask = CausalMask((slots[None, :] <= slots[:, None])[None] & attention_mask[:, None, :])
        return self._layers_over(tokens, positions, mask, routing)

    def _layers_over(self, tokens: Array, positions: Array, mask: Array | CausalMask | StridedGroups,
                     routing: CountRouting | None = None) -> tuple[Array, RoutingCounts | None]:
        """Embed, every layer with `mask` as `layers.self_attention` takes it (within the layer's
        sliding window, if any, by position), final norm; with `routing`, each layer's routing
        counts stacked (else None)."""
        cfg = self.config
        family = self.family
        top = {name: getattr(self, name)[...] for name in family.top_params(cfg)}
        with jax.named_scope(S.EMBED):
            x = family.embed(cfg, top, tokens, positions)
        x = constrain(x, ("batch", "length", "act_embed"))
        params = self.layers.stacked(cfg)
        kinds, kind_of = cfg.layer_kinds()
        layers = []
        for kind in kinds:  # each kind of layer (one but for Gemma 3) with its tables and mask
            layer = functools.partial(family.block, kind)
            if cfg.remat != "none":
                policy = (
                    jax.checkpoint_policies.dots_with_no_batch_dims_saveable
                    if cfg.remat == "dots"
                    else jax.checkpoint_policies.nothing_saveable
                )
                layer = jax.checkpoint(layer, policy=policy)
            tables = family.position_tables(kind, positions)
            layers.append(functools.partial(_layer_output, layer, tables=tables, routing=routing,
                                            mask=windowed(mask, positions, kind.sliding_window)))

        def body(h: Array, p: dict[str, Array]) -> tuple[Array, RoutingCounts | None]:
            if len(layers) == 1:
                return layers[0](p, h)
            p = dict(p)
            return jax.lax.switch(p.pop(LAYER_KIND), layers, p, h)

        if cfg.scan_layers:
            if len(layers) > 1:
                params = {**params, LAYER_KIND: jnp.asarray(kind_of, jnp.int32)}
            x, counts = scan_layers(body, x, params)
        else:
            per_layer = []
            for p, kind in zip(unstack(params, cfg.num_layers), kind_of):
                x, c = layers[kind](p, x)
                per_layer.append(c)
            counts = None if routing is None else jax.tree.map(lambda *c: jnp.stack(c), *per_layer)
        return family.final_norm(cfg, top, x), counts

    @scoped(S.LM_HEAD)
    def logits(self, hidden: Array) -> Array:
        """fp32 logits for hidden states of any leading shape (soft-capped as `logit_softcap` says)."""
        out = jnp.einsum("...d,dv->...v", hidden, self.head_weight(), preferred_element_type=jnp.float32)
        out = soft_capped(out, self.logit_softcap)
        return constrain(out, ("batch", "length", "act_vocab")) if out.ndim == 3 else out

    @property
    def logit_softcap(self) -> float | None:
        """The LM head's soft-cap (Gemma 2's `final_logit_softcapping`): every path from hidden
        states to log-probs applies it (`batch.head_logprobs(softcap=...)`). A score head has none."""
        return None if self.score is not None else self.config.final_logit_softcapping

    def head_weight(self) -> Array:
        """The output projection as [hidden, vocab or labels] in the compute dtype: the `score`
        head, the LM head, or the tied embedding's transpose; an LM head divided by Granite's
        `logits_scaling`, so every path from hidden states to logits divides them."""
        if self.score is not None:
            return self.score[...].astype(self.config.jnp_dtype)
        w = self.embed_tokens[...].T if self.lm_head is None else self.lm_head[...]
        return lm_head_scaled(w.astype(self.config.jnp_dtype), self.config.logits_scaling)


# ---------------------------------------------------------------------------- pure pieces

LAYER_KIND = "layer_kind"  # a scanned stack's entry: each layer's index into `ModelConfig.layer_kinds`


def _layer_output(layer: Any, p: dict[str, Array], h: Array, *, tables: Any, mask: Any,
                  routing: CountRouting | None) -> tuple[Array, RoutingCounts | None]:
    """A layer's output without a cache, and its routing counts when `routing` asks for them."""
    out, counts = layer(p, h, tables, mask, routing)
    return out, counts if routing is not None else None


def positions_from_mask(mask: Array) -> Array:
    """Position ids that skip padding: cumsum(mask) - 1, clipped at 0."""
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def packed_attention_mask(segments: Array) -> Array:
    """[b, t] segment ids -> [b, t, t] causal mask for a row packing a shared prompt (segment 0)
    followed by several continuations (1, 2, ...; -1 is padding): a continuation token sees the
    prompt and the earlier tokens of its own continuation, never another continuation. No slot
    sees a later one, so it may be wrapped in a `CausalMask` (attention then skips the blocks
    above the diagonal)."""
    t = segments.shape[-1]
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
    key, query = segments[:, None, :], segments[:, :, None]
    return causal[None] & (key >= 0) & ((key == 0) | (key == query))


PACKED_CAUSAL_BLOCKS_MIN = 512


def packed_mask(segments: Array) -> Array | CausalMask:
    """`packed_attention_mask`, wrapped in a `CausalMask` (attention then skips the blocks above
    the diagonal, `layers.causal_blocks`) for rows of at least PACKED_CAUSAL_BLOCKS_MIN slots
    (read at trace time). The packed TB step with and without the blocks, in alternating rounds
    (`experiments/benchmarks/packed_groups.py`): no faster with them at a few hundred slots, much
    faster at TL;DR's ~1400."""
    mask = packed_attention_mask(segments)
    return CausalMask(mask) if segments.shape[-1] >= PACKED_CAUSAL_BLOCKS_MIN else mask
