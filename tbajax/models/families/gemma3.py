"""Gemma 3 text models (model_type gemma3_text: Gemma 3 270M and 1B, `Gemma3ForCausalLM`).

Llama's projections and grouped-query attention with Gemma's differences: RMSNorm weights are
offsets from one (`x * (1 + w)`, computed in fp32), four norms a block (before and after the
attention and the MLP) and per-head q/k norms; a GeGLU MLP (tanh GELU); embeddings scaled by
sqrt(hidden_size); attention scaled by query_pre_attn_scalar ** -0.5; tied embeddings. Its
layers are of two kinds (`ModelConfig.layer_types`): most attend within a sliding window and take
RoPE of base `rope_local_base_freq`, every sixth (by default) attends to everything with the
global base and scaling (`ModelConfig.layer_kinds`). Soft-capping of the scores and logits
(null in the published configs) is read and applied as Gemma 2's (`gemma2`, which reuses this
module's math). The multimodal Gemma 3 checkpoints (4B, 12B, 27B: `gemma3`) load as their text
model (`config.MULTIMODAL_TEXT_MODELS`; the vision tower is not read).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from tbajax import op_scopes as S
from tbajax.models import layers as L
from tbajax.models.config import ModelConfig, UnsupportedModelError, _parse_rope
from tbajax.models.families import Mapping, ParamSpec, llama, same
from tbajax.op_scopes import scoped
from tbajax.sharding import constrain

Array = jax.Array

ACTIVATION = "gelu_pytorch_tanh"


# ----------------------------------------------------------------------------- config


def check_hf(hf: dict[str, Any]) -> None:
    """What Gemma 2 and 3 checkpoints may set that we do not compute: refused naming the field."""
    model_type = hf.get("model_type")
    if hf.get("use_bidirectional_attention"):
        raise UnsupportedModelError(f"use_bidirectional_attention=true is not supported for {model_type}")
    if hf.get("attention_bias"):
        raise UnsupportedModelError(f"attention_bias=true is not supported for {model_type}")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or ACTIVATION
    if act != ACTIVATION:
        raise UnsupportedModelError(f"hidden_activation={act!r} is not supported for {model_type} "
                                    f"(only {ACTIVATION!r})")


def soft_caps(hf: dict[str, Any]) -> dict[str, float | None]:
    return {field: None if hf.get(field) is None else float(hf[field])
            for field in ("attn_logit_softcapping", "final_logit_softcapping")}


def parse_hf(hf: dict[str, Any]) -> dict[str, Any]:
    layers = int(hf["num_hidden_layers"])
    pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
    layer_types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers v5: RoPE per layer type
        rope = _parse_rope({"rope_parameters": params["full_attention"]})
        local = params.get("sliding_attention") or {}
    else:  # v4: the global RoPE as Llama's, the local base beside it
        rope = _parse_rope({"rope_theta": hf.get("rope_theta", 1e6), "rope_scaling": hf.get("rope_scaling")})
        local = {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}
    if local.get("rope_type", "default") != "default":
        raise UnsupportedModelError(f"sliding_attention rope_type={local['rope_type']!r} is not supported "
                                    "for gemma3_text (only 'default')")
    return {**shared_fields(hf, layer_types, rope, hf.get("sliding_window"), context=32768),
            "qk_norm": True, "local_rope_theta": float(local.get("rope_theta", 10000.0))}


def shared_fields(hf: dict[str, Any], layer_types: list[str], rope: tuple[float, Any], window: int | None,
                  context: int) -> dict[str, Any]:
    """The fields Gemma 2 and Gemma 3 read alike, given each one's layer kinds, RoPE, window and
    default context length (after `check_hf`)."""
    check_hf(hf)
    num_heads = int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // num_heads)
    theta, scaling = rope
    return dict(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=len(layer_types),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        hidden_act=ACTIVATION,
        max_position_embeddings=int(hf.get("max_position_embeddings", context)),
        sliding_window=None if window is None else int(window),
        layer_types=tuple(layer_types),
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or head_dim),
        **soft_caps(hf),
    )


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    scaling = cfg.rope_scaling.to_hf() if cfg.rope_scaling else None
    full = {"rope_type": "default", "rope_theta": cfg.rope_theta} if scaling is None else {
        **scaling, "rope_theta": cfg.rope_theta}
    local = cfg.local_rope_theta if cfg.local_rope_theta is not None else cfg.rope_theta
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_activation": ACTIVATION,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False,
        "query_pre_attn_scalar": _number(cfg.query_pre_attn_scalar),
        "sliding_window": cfg.sliding_window,
        "layer_types": list(cfg.layer_types or ["full_attention"] * cfg.num_layers),
        "final_logit_softcapping": cfg.final_logit_softcapping,
        "attn_logit_softcapping": cfg.attn_logit_softcapping,
        "use_bidirectional_attention": False,
        "rope_parameters": {"full_attention": full, "sliding_attention": {"rope_type": "default",
                                                                          "rope_theta": local}},
    }


def _number(x: float | None) -> float | int | None:
    """An integral float as an int: transformers' config classes check that field's type."""
    return int(x) if x is not None and float(x).is_integer() else x


def validate(cfg: ModelConfig) -> None:
    if cfg.query_pre_attn_scalar is None:
        raise UnsupportedModelError(f"{cfg.model_type} needs query_pre_attn_scalar (ModelConfig.from_hf "
                                    "reads it from config.json)")


# ----------------------------------------------------------------------------- parameters


def top_params(cfg: ModelConfig) -> dict[str, ParamSpec]:
    return {
        "embed_tokens": ParamSpec(("vocab", "embed"), (cfg.vocab_size, cfg.hidden_size)),
        "norm": ParamSpec(("norm",), (cfg.hidden_size,), "zeros"),  # an offset from one
    }


NORMS = ("input_norm", "post_attention_norm", "pre_feedforward_norm", "post_feedforward_norm")


def layer_params(cfg: ModelConfig) -> dict[str, ParamSpec]:
    d, h, kv, hd, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    qk_norms = {name: ParamSpec(("head_dim",), (hd,), "zeros") for name in ("q_norm", "k_norm")}
    return {
        **{name: ParamSpec(("norm",), (d,), "zeros") for name in NORMS},
        "q_proj": ParamSpec(("embed", "q_heads", "head_dim"), (d, h, hd)),
        "k_proj": ParamSpec(("embed", "kv_heads", "head_dim"), (d, kv, hd)),
        "v_proj": ParamSpec(("embed", "kv_heads", "head_dim"), (d, kv, hd)),
        **(qk_norms if cfg.qk_norm else {}),
        "o_proj": ParamSpec(("q_heads", "head_dim", "embed"), (h, hd, d)),
        "gate_proj": ParamSpec(("embed", "mlp"), (d, f)),
        "up_proj": ParamSpec(("embed", "mlp"), (d, f)),
        "down_proj": ParamSpec(("mlp", "embed"), (f, d)),
    }


def hf_mappings(cfg: ModelConfig) -> dict[str, Mapping]:
    pre = "model.layers.{i}."
    ours = layer_params(cfg)
    return {
        **{k: v for k, v in llama.hf_mappings(cfg).items()
           if not k.startswith("layers.") or k.removeprefix("layers.") in ours},
        "layers.pre_feedforward_norm": same(pre + "pre_feedforward_layernorm.weight"),
        "layers.post_feedforward_norm": same(pre + "post_feedforward_layernorm.weight"),
    }


# ----------------------------------------------------------------------------- math


@scoped(S.NORM)
def rms_norm(x: Array, w: Array, eps: float) -> Array:
    """Gemma's RMSNorm: the weight is an offset from one, and the product is taken in fp32 before
    rounding to x's dtype (Llama rounds first)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def embed(cfg: ModelConfig, params: dict[str, Array], tokens: Array, positions: Array) -> Array:
    """Token embeddings times sqrt(hidden_size), the factor rounded to the compute dtype first
    (as transformers rounds it to the weights')."""
    dt = cfg.jnp_dtype
    return params["embed_tokens"].astype(dt)[tokens] * jnp.asarray(cfg.hidden_size**0.5, dt)


def final_norm(cfg: ModelConfig, params: dict[str, Array], x: Array) -> Array:
    return rms_norm(x, params["norm"], cfg.rms_norm_eps)


def block(
    cfg: ModelConfig,
    p: dict[str, Array],
    x: Array,
    tables: tuple[Array, Array],
    mask: Array,
    cache: L.LayerCache | L.EmitKV | None,
) -> tuple[Array, tuple[Array, Array] | None]:
    w = {k: v.astype(cfg.jnp_dtype) for k, v in p.items()}
    eps = cfg.rms_norm_eps
    q, k, v = llama.query_key_value(cfg, w, rms_norm(x, w["input_norm"], eps))
    if cfg.qk_norm:  # Gemma 3's; Gemma 2 has none
        q, k = rms_norm(q, w["q_norm"], eps), rms_norm(k, w["k_norm"], eps)
    o, new_cache = llama.attention_sublayer(cfg, w, q, k, v, tables, mask, cache)  # soft-capped, query scaled
    x = x + rms_norm(o, w["post_attention_norm"], eps)
    h = llama.gated_mlp(w, rms_norm(x, w["pre_feedforward_norm"], eps), geglu)
    x = x + rms_norm(h, w["post_feedforward_norm"], eps)
    return constrain(x, ("batch", "length", "act_embed")), new_cache


@scoped(S.ACTIVATION)
def geglu(gate: Array, up: Array) -> Array:
    return L.gelu_tanh(gate) * up


# Llama's where not said otherwise: RoPE tables (of each layer kind's config), the sampler's layout
FAMILY = dataclasses.replace(
    llama.FAMILY,
    name="gemma3",
    model_types=("gemma3_text",),
    architectures={"gemma3_text": ("Gemma3ForCausalLM", "Gemma3TextForSequenceClassification")},
    parse_hf=parse_hf,
    to_hf=to_hf,
    top_params=top_params,
    layer_params=layer_params,
    hf_mappings=hf_mappings,
    embed=embed,
    block=block,
    final_norm=final_norm,
    fixed={"hidden_act": (ACTIVATION,), "rotary_pct": (1.0,), "parallel_residual": (False,),
           "qk_norm": (True,), "qkv_bias": (False,), "o_bias": (False,)},
    validate=validate,
)
