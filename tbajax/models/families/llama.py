"""Llama (2, 3.x), Mistral (with its sliding window: `ModelConfig.sliding_window`), Qwen2/2.5 (q/k/v
bias; use_sliding_window windows its later layers), Qwen3 (q/k RMSNorm), SmolLM3 (every fourth
layer without RoPE: `ModelConfig.rope_layers`), Granite (multipliers of the embeddings, the
sublayers' outputs and the scores, logits divided by logits_scaling), and the mixture-of-experts
Qwen3-MoE (Qwen3's attention), Qwen2-MoE (Qwen2's, and a shared expert beside the routed ones,
gated per token) and Mixtral (Mistral's), whose MLPs are routed experts
(`tbajax.models.moe`): pre-norm RMSNorm blocks, full RoPE, grouped-query attention, SwiGLU MLP,
optionally tied embeddings."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tbajax.models import layers as L
from tbajax.models.moe import (BiasedExperts, CountRouting, RoutingCounts, moe_clamped_swiglu, moe_swiglu,
                               moe_swiglu_counted)
from tbajax.models.config import ModelConfig, UnsupportedModelError, _parse_rope, rope_inv_freq
from tbajax.models.families import Family, Mapping, ParamSpec, same, transposed
from tbajax.sharding import constrain

Array = jax.Array


# ----------------------------------------------------------------------------- config


def parse_hf(hf: dict[str, Any]) -> dict[str, Any]:
    model_type = hf["model_type"]
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act={act!r} is not supported for {model_type} (only 'silu')")
    if hf.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=true is not supported")
    window, layer_types = _windows(hf)
    attention_bias = bool(hf.get("attention_bias", False))
    if model_type in ("qwen2", "qwen2_moe"):  # q/k/v biased (v5's qwen2_moe config says so: qkv_bias)
        qkv_bias, o_bias = bool(hf.get("qkv_bias", True)), False
    else:
        qkv_bias = o_bias = attention_bias
    return dict(
        **decoder_fields(hf),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        sliding_window=window,
        layer_types=layer_types,
        rope_layers=_rope_layers(hf),
        **_granite_scales(hf),
        **_experts(hf),
    )


def decoder_fields(hf: dict[str, Any], rms_norm_eps: float = 1e-6) -> dict[str, Any]:
    """The sizes, RoPE, norm epsilon and head tying of a RoPE decoder's config.json, read alike by
    the families built on Llama's block (`rms_norm_eps` the family's default)."""
    theta, scaling = _parse_rope(hf)
    num_heads = int(hf["num_attention_heads"])
    return dict(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // num_heads),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", rms_norm_eps)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


# transformers' defaults
ROUTER_AUX_LOSS_COEF = {"qwen2_moe": 0.001, "qwen3_moe": 0.001, "mixtral": 0.001, "olmoe": 0.01}


def _experts(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE's, Qwen2-MoE's, Mixtral's and OLMoE's experts, and their router's load-balancing loss."""
    model_type = hf["model_type"]
    experts = _expert_shapes(hf)
    if experts:
        coef = hf.get("router_aux_loss_coef", ROUTER_AUX_LOSS_COEF[model_type])
        experts.update(output_router_logits=bool(hf.get("output_router_logits", False)),
                       router_aux_loss_coef=float(coef))
    return experts


def _expert_shapes(hf: dict[str, Any]) -> dict[str, Any]:
    """The experts: every layer sparse (Qwen3-MoE's decoder_sparse_step 1, no mlp_only_layers;
    other layouts are refused naming the field)."""
    model_type = hf["model_type"]
    if model_type in ("qwen2_moe", "qwen3_moe"):
        if int(hf.get("decoder_sparse_step", 1)) != 1 or hf.get("mlp_only_layers"):
            raise UnsupportedModelError(
                f"{model_type} with dense layers (decoder_sparse_step={hf.get('decoder_sparse_step')}, "
                f"mlp_only_layers={hf.get('mlp_only_layers')}) is not supported: every layer must be sparse")
        experts = hf.get("num_experts") or hf["num_local_experts"]  # transformers v5 names it the latter
        shared = int(hf.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0
        return dict(num_experts=int(experts), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                    expert_intermediate_size=int(hf["moe_intermediate_size"]),
                    norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                    shared_expert_intermediate_size=shared)
    if model_type == "olmoe":
        return dict(num_experts=int(hf.get("num_experts") or hf["num_local_experts"]),
                    num_experts_per_tok=int(hf["num_experts_per_tok"]),
                    expert_intermediate_size=int(hf["intermediate_size"]),
                    norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
    if model_type == "mixtral":
        return dict(num_experts=int(hf.get("num_local_experts") or hf["num_experts"]),
                    num_experts_per_tok=int(hf["num_experts_per_tok"]),
                    expert_intermediate_size=int(hf["intermediate_size"]), norm_topk_prob=True)
    return {}


def _granite_scales(hf: dict[str, Any]) -> dict[str, Any]:
    if hf["model_type"] != "granite":
        return {}
    return dict(embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
                residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
                attention_multiplier=float(hf.get("attention_multiplier", 1.0)),
                logits_scaling=float(hf.get("logits_scaling", 1.0)))


def _rope_layers(hf: dict[str, Any]) -> tuple[bool, ...] | None:
    """SmolLM3's NoPE layers: `no_rope_layers` holds 1 for each layer that takes RoPE (by default
    all but every `no_rope_layer_interval`-th); None where every layer does."""
    if hf["model_type"] != "smollm3":
        return None
    layers = int(hf["num_hidden_layers"])
    flags = hf.get("no_rope_layers")
    if flags is None:
        interval = int(hf.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    return None if all(flags) else tuple(bool(f) for f in flags)


def _windows(hf: dict[str, Any]) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types) where a window changes attention. Mistral and Phi-3 have no
    switch: a window shorter than the context is in force on every layer. Qwen2 / Qwen3 window
    the layers from max_window_layers on when use_sliding_window is set (transformers v5 writes
    them out as layer_types)."""
    model_type, window = hf["model_type"], hf.get("sliding_window")
    layer_types = hf.get("layer_types")
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "smollm3"):
        if not hf.get("use_sliding_window") or window is None:
            return None, None
        if model_type == "smollm3" and not layer_types:  # the window on the NoPE layers only
            rope = _rope_layers(hf) or (True,) * int(hf["num_hidden_layers"])
            layer_types = ["full_attention" if r else "sliding_attention" for r in rope]
        if not layer_types:
            first = int(hf.get("max_window_layers", 0))
            layer_types = ["sliding_attention" if i >= first else "full_attention"
                           for i in range(int(hf["num_hidden_layers"]))]
        if "sliding_attention" not in layer_types:
            return None, None
        return int(window), tuple(layer_types)
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise UnsupportedModelError(
            f"layer_types {sorted(set(layer_types))} are not supported for {model_type} (only full_attention)"
        )
    context = int(hf.get("max_position_embeddings", 0))
    if model_type in ("mistral", "mixtral", "phi3") and window is not None and int(window) < context:
        return int(window), None
    return None, None


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    out: dict[str, Any] = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling.to_hf() if cfg.rope_scaling else None,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
    }
    if cfg.model_type in ("llama", "qwen3", "granite", "qwen3_moe"):
        out["attention_bias"] = cfg.qkv_bias
    if cfg.model_type in ("qwen2_moe", "qwen3_moe"):
        out.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                   moe_intermediate_size=cfg.expert_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                   decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False, sliding_window=None)
    if cfg.model_type == "qwen2_moe":
        out.update(qkv_bias=cfg.qkv_bias, shared_expert_intermediate_size=cfg.shared_expert_intermediate_size)
    if cfg.model_type == "mixtral":
        out.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                   sliding_window=cfg.sliding_window)
    if cfg.num_experts is not None:
        out.update(output_router_logits=cfg.output_router_logits,
                   router_aux_loss_coef=cfg.router_aux_loss_coef)
    if cfg.model_type in ("llama", "granite"):
        out["mlp_bias"] = False
    if cfg.model_type == "granite":
        out.update(embedding_multiplier=cfg.embedding_multiplier, residual_multiplier=cfg.residual_multiplier,
                   attention_multiplier=cfg.attention_multiplier, logits_scaling=cfg.logits_scaling)
    if cfg.model_type in ("qwen2", "qwen3"):
        sliding = [i for i, t in enumerate(cfg.layer_types or ()) if t == "sliding_attention"]
        out["use_sliding_window"] = bool(sliding)
        out["sliding_window"] = cfg.sliding_window if sliding else None
        # transformers v4 windows the layers from max_window_layers on; v5 reads layer_types
        out["max_window_layers"] = sliding[0] if sliding else cfg.num_layers
        if sliding:
            out["layer_types"] = list(cfg.layer_types or ())
    if cfg.model_type == "mistral":
        out["sliding_window"] = cfg.sliding_window
    if cfg.model_type == "smollm3":
        sliding = "sliding_attention" in (cfg.layer_types or ())
        out.update(no_rope_layers=[int(r) for r in cfg.rope_layers or (True,) * cfg.num_layers],
                   use_sliding_window=sliding, sliding_window=cfg.sliding_window if sliding else None,
                   layer_types=list(cfg.layer_types or ("full_attention",) * cfg.num_layers),
                   attention_bias=cfg.qkv_bias, mlp_bias=False)
    return out


# ----------------------------------------------------------------------------- parameters


def top_params(cfg: ModelConfig) -> dict[str, ParamSpec]:
    return {
        "embed_tokens": ParamSpec(("vocab", "embed"), (cfg.vocab_size, cfg.hidden_size)),
        "norm": ParamSpec(("norm",), (cfg.hidden_size,), "ones"),
    }


def layer_params(cfg: ModelConfig) -> dict[str, ParamSpec]:
    d, h, kv, hd, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    out = {
        "input_norm": ParamSpec(("norm",), (d,), "ones"),
        "q_proj": ParamSpec(("embed", "q_heads", "head_dim"), (d, h, hd)),
        "k_proj": ParamSpec(("embed", "kv_heads", "head_dim"), (d, kv, hd)),
        "v_proj": ParamSpec(("embed", "kv_heads", "head_dim"), (d, kv, hd)),
        "q_bias": ParamSpec(("q_heads", "head_dim"), (h, hd), "zeros"),
        "k_bias": ParamSpec(("kv_heads", "head_dim"), (kv, hd), "zeros"),
        "v_bias": ParamSpec(("kv_heads", "head_dim"), (kv, hd), "zeros"),
        "q_norm": ParamSpec(("head_dim",), (hd,), "ones"),
        "k_norm": ParamSpec(("head_dim",), (hd,), "ones"),
        "o_proj": ParamSpec(("q_heads", "head_dim", "embed"), (h, hd, d)),
        "o_bias": ParamSpec(("norm",), (d,), "zeros"),
        "post_attention_norm": ParamSpec(("norm",), (d,), "ones"),
        "gate_proj": ParamSpec(("embed", "mlp"), (d, f)),
        "up_proj": ParamSpec(("embed", "mlp"), (d, f)),
        "down_proj": ParamSpec(("mlp", "embed"), (f, d)),
    }
    skip = set()
    if not cfg.qkv_bias:
        skip |= {"q_bias", "k_bias", "v_bias"}
    if not cfg.o_bias:
        skip.add("o_bias")
    if not cfg.qk_norm:
        skip |= {"q_norm", "k_norm"}
    if cfg.num_experts is not None:  # the MLP is routed experts
        skip |= {"gate_proj", "up_proj", "down_proj"}
        e, fe = cfg.num_experts, cfg.expert_intermediate_size
        out.update(router=ParamSpec(("embed", None), (d, e)),
                   expert_gate=ParamSpec(("experts", "embed", "mlp"), (e, d, fe)),
                   expert_up=ParamSpec(("experts", "embed", "mlp"), (e, d, fe)),
                   expert_down=ParamSpec(("experts", "mlp", "embed"), (e, fe, d)))
        fs = cfg.shared_expert_intermediate_size
        if fs:  # Qwen2-MoE's shared expert and its gate
            out.update(shared_gate_proj=ParamSpec(("embed", "mlp"), (d, fs)),
                       shared_up_proj=ParamSpec(("embed", "mlp"), (d, fs)),
                       shared_down_proj=ParamSpec(("mlp", "embed"), (fs, d)),
                       shared_expert_gate=ParamSpec(("embed", None), (d, 1)))
    return {k: v for k, v in out.items() if k not in skip}


def _heads_in(hf_name: str, heads_attr: str) -> Mapping:
    """HF Linear [heads * head_dim, in] <-> ours [in, heads, head_dim]."""

    def to_ours(a: np.ndarray, c: ModelConfig) -> np.ndarray:
        return a.T.reshape(a.shape[1], getattr(c, heads_attr), c.head_dim)

    return Mapping(hf_name, to_ours, lambda a, c: a.reshape(a.shape[0], -1).T)


def _head_bias(hf_name: str, heads_attr: str) -> Mapping:
    return Mapping(
        hf_name, lambda a, c: a.reshape(getattr(c, heads_attr), c.head_dim), lambda a, c: a.reshape(-1)
    )


def heads_out(hf_name: str) -> Mapping:
    """HF Linear [hidden, heads * head_dim] -> ours [heads, head_dim, hidden] (an attention output)."""
    return Mapping(
        hf_name,
        lambda a, c: a.T.reshape(c.num_heads, c.head_dim, c.hidden_size),
        lambda a, c: a.reshape(-1, a.shape[-1]).T,
    )


def hf_mappings(cfg: ModelConfig) -> dict[str, Mapping]:
    pre = "model.layers.{i}."
    return {
        "embed_tokens": same("model.embed_tokens.weight"),
        "norm": same("model.norm.weight"),
        "lm_head": transposed("lm_head.weight"),
        "layers.input_norm": same(pre + "input_layernorm.weight"),
        "layers.post_attention_norm": same(pre + "post_attention_layernorm.weight"),
        "layers.q_proj": _heads_in(pre + "self_attn.q_proj.weight", "num_heads"),
        "layers.k_proj": _heads_in(pre + "self_attn.k_proj.weight", "num_kv_heads"),
        "layers.v_proj": _heads_in(pre + "self_attn.v_proj.weight", "num_kv_heads"),
        "layers.q_bias": _head_bias(pre + "self_attn.q_proj.bias", "num_heads"),
        "layers.k_bias": _head_bias(pre + "self_attn.k_proj.bias", "num_kv_heads"),
        "layers.v_bias": _head_bias(pre + "self_attn.v_proj.bias", "num_kv_heads"),
        "layers.q_norm": same(pre + "self_attn.q_norm.weight"),
        "layers.k_norm": same(pre + "self_attn.k_norm.weight"),
        "layers.o_proj": heads_out(pre + "self_attn.o_proj.weight"),
        "layers.o_bias": same(pre + "self_attn.o_proj.bias"),
        "layers.gate_proj": transposed(pre + "mlp.gate_proj.weight"),
        "layers.up_proj": transposed(pre + "mlp.up_proj.weight"),
        "layers.down_proj": transposed(pre + "mlp.down_proj.weight"),
        **_expert_mappings(cfg),
    }


def _expert_mappings(cfg: ModelConfig) -> dict[str, Mapping]:
    """The router and each expert's projections: one HF tensor per expert ({j}), stacked here."""
    if cfg.num_experts is None:
        return {}
    pre = "model.layers.{i}."
    if cfg.model_type == "mixtral":
        moe = pre + "block_sparse_moe."
        names = ("w1", "w3", "w2")
    else:
        moe = pre + "mlp."
        names = ("gate_proj", "up_proj", "down_proj")
    out = {
        "layers.router": transposed(moe + "gate.weight"),
        **{f"layers.expert_{ours}": transposed(f"{moe}experts.{{j}}.{theirs}.weight")
           for ours, theirs in zip(("gate", "up", "down"), names)},
    }
    if cfg.shared_expert_intermediate_size:
        out.update({f"layers.shared_{name}": transposed(f"{moe}shared_expert.{name}.weight")
                    for name in ("gate_proj", "up_proj", "down_proj")})
        out["layers.shared_expert_gate"] = transposed(moe + "shared_expert_gate.weight")
    return out


# ----------------------------------------------------------------------------- math


def embed(cfg: ModelConfig, params: dict[str, Array], tokens: Array, positions: Array) -> Array:
    """Token embeddings only: positions enter through RoPE (shared by the rotary families); Granite
    scales them (`embedding_multiplier`)."""
    x = params["embed_tokens"].astype(cfg.jnp_dtype)[tokens]
    return x if cfg.embedding_multiplier == 1.0 else x * jnp.asarray(cfg.embedding_multiplier, x.dtype)


def position_tables(cfg: ModelConfig, positions: Array) -> tuple[Array, Array] | None:
    if cfg.without_rope:  # SmolLM3's NoPE layers: no rotation at all
        return None
    s = cfg.rope_scaling
    if s is None or s.rope_type not in ("longrope", "yarn"):
        return L.rope_tables(rope_inv_freq(cfg), positions)
    if s.rope_type == "yarn":
        return L.rope_tables(rope_inv_freq(cfg), positions, scale=s.attention_factor)
    # LongRoPE as transformers applies it: one set of factors for the whole call, the long one when
    # its longest position passes the pretraining length (in a decode step, that of the step's
    # tokens: keys cached before keep the rotation they were written with), cos / sin scaled
    long = jnp.max(positions) + 1 > s.original_max_position_embeddings
    inv = jnp.where(long, rope_inv_freq(cfg, long=True).astype(np.float32),
                    rope_inv_freq(cfg).astype(np.float32))
    return L.rope_tables(inv, positions, scale=s.attention_factor)


def final_norm(cfg: ModelConfig, params: dict[str, Array], x: Array) -> Array:
    return L.rms_norm(x, params["norm"], cfg.rms_norm_eps)


def block(
    cfg: ModelConfig,
    p: dict[str, Array],
    x: Array,
    tables: tuple[Array, Array] | None,
    mask: Array,
    cache: L.LayerCache | L.EmitKV | CountRouting | None,
) -> tuple[Array, Any]:
    dt = cfg.jnp_dtype
    w = {k: v.astype(dt) for k, v in p.items()}
    h = L.rms_norm(x, w["input_norm"], cfg.rms_norm_eps)
    q, k, v = query_key_value(cfg, w, h)
    if cfg.qkv_bias:
        q, k, v = q + w["q_bias"], k + w["k_bias"], v + w["v_bias"]
    if cfg.qk_norm:
        q = L.rms_norm(q, w["q_norm"], cfg.rms_norm_eps)
        k = L.rms_norm(k, w["k_norm"], cfg.rms_norm_eps)
    routing, cache = routing_or_cache(cache)
    o, new_cache = attention_sublayer(cfg, w, q, k, v, tables, mask, cache)
    if cfg.o_bias:
        o = o + w["o_bias"]
    x = x + _residual(cfg, o)
    out, counts = mlp_counted(cfg, w, L.rms_norm(x, w["post_attention_norm"], cfg.rms_norm_eps), routing)
    x = x + _residual(cfg, out)
    return constrain(x, ("batch", "length", "act_embed")), counts if routing is not None else new_cache


def attention_sublayer(
    cfg: ModelConfig, w: dict[str, Array], q: Array, k: Array, v: Array, tables: tuple[Array, Array] | None,
    mask: Any, cache: Any,
) -> tuple[Array, Any]:
    """The attention sublayer from its queries, keys and values on, as every RoPE family runs it:
    RoPE (none on a NoPE layer: `tables` None), the queries scaled where the model scales its scores
    otherwise (`ModelConfig.query_scale`), attention over `mask` / `cache` with the model's score
    cap and attention sinks (GPT-OSS's `sinks` weights), and the output projection. Returns (its
    output, the updated cache)."""
    if tables is not None:
        cos, sin = tables
        q, k = L.apply_rope(q, cos, sin), L.apply_rope(k, cos, sin)
    if cfg.query_scale is not None:
        q = q * jnp.asarray(cfg.query_scale, q.dtype)
    q = constrain(q, ("batch", "length", "act_heads", None))
    o, new_cache = L.self_attention(q, k, v, mask, cache, cfg.jnp_dtype, cfg.attention,
                                    cfg.attn_logit_softcapping, w.get("sinks"))
    return L.decode_matrix_product(o, w, "o_proj", in_axes=2), new_cache


def routing_or_cache(cache: Any) -> tuple[CountRouting | None, Any]:
    """A block's `cache` argument as (the routing counts it asks for, the KV cache for attention):
    `moe.CountRouting` asks for the counts and attends without a cache."""
    return (cache, None) if isinstance(cache, CountRouting) else (None, cache)


def mlp(cfg: ModelConfig, w: dict[str, Array], h: Array) -> Array:
    """The SwiGLU MLP, or the mixture of SwiGLU experts (`tbajax.models.moe`) of a model that has them."""
    return mlp_counted(cfg, w, h, None)[0]


def shared_expert(cfg: ModelConfig, w: dict[str, Array], h: Array) -> Array | float:
    """Qwen2-MoE's shared expert: a SwiGLU MLP on every token, gated by sigmoid(h . shared_expert_gate)
    (0 for a model without one)."""
    if not cfg.shared_expert_intermediate_size:
        return 0.0
    shared = {name: w["shared_" + name] for name in ("gate_proj", "up_proj", "down_proj")}
    return jax.nn.sigmoid(L.linear(h, w["shared_expert_gate"])) * swiglu_mlp(shared, h)


def mlp_counted(cfg: ModelConfig, w: dict[str, Array], h: Array,
                routing: CountRouting | None) -> tuple[Array, RoutingCounts | None]:
    """`mlp`, and with `routing` (a block's `cache` argument asking for them) the layer's
    `RoutingCounts` over its counted tokens."""
    if cfg.num_experts is None:
        if routing is not None:
            raise ValueError(f"routing counts asked of a {cfg.model_type} model, which has no router")
        return swiglu_mlp(w, h), None
    if cfg.swiglu_limit is not None:  # GPT-OSS's biased experts
        weights = BiasedExperts(w["router"], w["router_bias"], w["expert_gate_up"], w["expert_gate_up_bias"],
                                w["expert_down"], w["expert_down_bias"])
        return moe_clamped_swiglu(h, weights, cfg.num_experts_per_tok, cfg.swiglu_alpha, cfg.swiglu_limit,
                                  None if routing is None else routing.tokens)
    experts = (h, w["router"], w["expert_gate"], w["expert_up"], w["expert_down"], cfg.num_experts_per_tok,
               cfg.norm_topk_prob)
    if routing is None:
        out, counts = moe_swiglu(*experts), None
    else:
        out, counts = moe_swiglu_counted(*experts, routing.tokens)
    return out + shared_expert(cfg, w, h), counts


def _residual(cfg: ModelConfig, out: Array) -> Array:
    """A sublayer's output as it joins the residual stream (Granite: times residual_multiplier)."""
    return out if cfg.residual_multiplier == 1.0 else out * jnp.asarray(cfg.residual_multiplier, out.dtype)


def query_key_value(cfg: ModelConfig, w: dict[str, Array], h: Array) -> tuple[Array, Array, Array]:
    """q [b,t,h,d], k and v [b,t,kv,d] from the layer's input, in either weight layout."""
    if "q_proj" in w:
        return tuple(L.project(h, w[name]) for name in ("q_proj", "k_proj", "v_proj"))  # type: ignore
    # decode_layout: per KV head, its query group's heads, its key, its value
    b, t, _ = h.shape
    g = cfg.num_heads // cfg.num_kv_heads
    qkv = L.decode_product(h, w, "qkv_proj").reshape(b, t, cfg.num_kv_heads, g + 2, cfg.head_dim)
    return qkv[..., :g, :].reshape(b, t, cfg.num_heads, cfg.head_dim), qkv[..., g, :], qkv[..., g + 1, :]


def swiglu_mlp(w: dict[str, Array], h: Array) -> Array:
    """down(silu(gate h) * up h), in either weight layout."""
    return gated_mlp(w, h, L.swiglu)


def gated_mlp(w: dict[str, Array], h: Array, activation: Callable[[Array, Array], Array]) -> Array:
    """down(activation(gate h, up h)), in either weight layout."""
    if "gate_proj" in w:
        gate = L.linear(h, w["gate_proj"])
        up = L.linear(h, w["up_proj"])
    else:  # decode_layout: gate and up columns interleaved
        gate_up = L.decode_product(h, w, "gate_up_proj")
        gate_up = gate_up.reshape(*gate_up.shape[:-1], -1, 2)
        gate, up = gate_up[..., 0], gate_up[..., 1]
    return L.decode_product(activation(gate, up), w, "down_proj")


def decode_layout(cfg: ModelConfig, p: dict[str, Array]) -> dict[str, Array]:
    """q/k/v and gate/up each as one matmul: at a few rows per step, one [d, 2f] product runs
    ~1.5x faster on CPU than two [d, f] ones. o_proj becomes a matrix; all four
    products are stored output-major (`layers.orient_for_decode`).

    The fused columns go per KV head (its group's query heads, its key, its value) and gate / up
    interleaved, so that a tensor-parallel mesh, which splits them into contiguous blocks, gives
    every device whole KV groups and matching gate and up columns: its slices of the fused output
    are its own. Laid out as [q | k | v] and [gate | up], each block straddled devices and every
    layer's slices were collective-permutes, at every decode step."""
    p = dict(p)
    d, kv, hd = cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim
    q = p.pop("q_proj").reshape(d, kv, -1, hd)  # [d, kv, g, hd]: query head j * g + i uses KV head j
    qkv = jnp.concatenate([q, p.pop("k_proj")[:, :, None], p.pop("v_proj")[:, :, None]], axis=2)
    p["qkv_proj"] = constrain(qkv, ("embed", "kv_heads", None, "head_dim")).reshape(d, -1)
    p["o_proj"] = p["o_proj"].reshape(-1, d)
    if cfg.num_experts is not None:  # routed experts: their tiles' products as in training
        return L.orient_for_decode(p, ("qkv_proj", "o_proj"))
    gate_up = jnp.stack([p.pop("gate_proj"), p.pop("up_proj")], axis=-1)  # [d, f, 2]
    p["gate_up_proj"] = constrain(gate_up, ("embed", "mlp", None)).reshape(d, -1)
    return L.orient_for_decode(p, ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))


def undo_decode_layout(cfg: ModelConfig, p: dict[str, Array]) -> dict[str, Array]:
    """The inverse of `decode_layout`."""
    p = L.undo_orient(p)
    d, kv, hd = cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim
    g = cfg.num_heads // kv
    qkv = p.pop("qkv_proj").reshape(d, kv, g + 2, hd)
    p["q_proj"] = qkv[:, :, :g].reshape(d, cfg.num_heads, hd)
    p["k_proj"], p["v_proj"] = qkv[:, :, g], qkv[:, :, g + 1]
    if cfg.num_experts is not None:
        p["o_proj"] = p["o_proj"].reshape(cfg.num_heads, hd, d)
        return p
    gate_up = p.pop("gate_up_proj").reshape(d, -1, 2)
    p["gate_proj"], p["up_proj"] = gate_up[..., 0], gate_up[..., 1]
    p["o_proj"] = p["o_proj"].reshape(cfg.num_heads, hd, d)
    return p


FAMILY = Family(
    name="llama",
    model_types=("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "smollm3",
                 "granite"),
    architectures={
        "llama": ("LlamaForCausalLM", "LlamaForSequenceClassification"),
        "mistral": ("MistralForCausalLM", "MistralForSequenceClassification"),
        "qwen2": ("Qwen2ForCausalLM", "Qwen2ForSequenceClassification"),
        "qwen3": ("Qwen3ForCausalLM", "Qwen3ForSequenceClassification"),
        "smollm3": ("SmolLM3ForCausalLM", "SmolLM3ForSequenceClassification"),
        "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeForSequenceClassification"),
        "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeForSequenceClassification"),
        "mixtral": ("MixtralForCausalLM", "MixtralForSequenceClassification"),
        # transformers has no Granite classifier class: a score-head Granite exports under this name
        "granite": ("GraniteForCausalLM", "GraniteForSequenceClassification"),
    },
    base_prefix="model.",
    parse_hf=parse_hf,
    to_hf=to_hf,
    top_params=top_params,
    layer_params=layer_params,
    hf_mappings=hf_mappings,
    embed=embed,
    position_tables=position_tables,
    block=block,
    final_norm=final_norm,
    ignored_suffixes=("rotary_emb.inv_freq",),
    fixed={"hidden_act": ("silu",), "rotary_pct": (1.0,), "parallel_residual": (False,)},
    grouped_query_attention=True,
    decode_layout=decode_layout,
    undo_decode_layout=undo_decode_layout,
)
