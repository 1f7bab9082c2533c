"""OLMo 2 and OLMo 3 (AllenAI): Llama's projections, RoPE and SwiGLU MLP with the norms moved. No
norm on a block's input; RMSNorm on the attention output and on the MLP output before each joins
the residual; RMSNorm on the whole query and key projections (over all heads at once, where Qwen3
normalises each head) before RoPE. OLMo 3 windows three layers of four (`layer_types`), and its
RoPE scaling (YaRN for long contexts) is on the full-attention layers only (`local_rope_theta`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from tbajax import op_scopes as S
from tbajax.models import layers as L
from tbajax.models.config import ModelConfig, UnsupportedModelError, _parse_rope
from tbajax.models.families import Mapping, ParamSpec, llama, same
from tbajax.sharding import constrain

Array = jax.Array


def parse_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("attention_bias"):
        raise UnsupportedModelError(f"attention_bias=true is not supported for {hf['model_type']}")
    if hf["model_type"] == "olmo2":
        return {**llama.parse_hf(hf), "qk_norm": True}
    return _parse_olmo3(hf)


def _parse_olmo3(hf: dict[str, Any]) -> dict[str, Any]:
    """OLMo 3's layer kinds (transformers' default: every fourth layer full, the others windowed)
    and RoPE per kind: the scaling on the full-attention layers (v5: `rope_parameters` per layer
    type; v4: `rope_scaling`), the windowed ones plain."""
    layers = int(hf["num_hidden_layers"])
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)]
    params = hf.get("rope_parameters") or {}
    lengths = {k: hf[k] for k in ("max_position_embeddings", "original_max_position_embeddings") if k in hf}
    if "full_attention" in params:
        rope = _parse_rope({**lengths, "rope_parameters": params["full_attention"]})
        local = params.get("sliding_attention") or {}
    else:
        rope = _parse_rope(hf)
        local = {"rope_theta": rope[0]}
    if local.get("rope_type", "default") != "default":
        raise UnsupportedModelError(f"sliding_attention rope_type={local['rope_type']!r} is not supported "
                                    "for olmo3 (only 'default')")
    plain = {k: v for k, v in hf.items() if k not in ("layer_types", "rope_parameters", "rope_scaling")}
    fields = {**llama.parse_hf({**plain, "sliding_window": None}), "qk_norm": True,
              "rope_theta": rope[0], "rope_scaling": rope[1]}
    if "sliding_attention" not in layer_types or hf.get("sliding_window") is None:
        return fields
    return {**fields, "sliding_window": int(hf["sliding_window"]), "layer_types": tuple(layer_types),
            "local_rope_theta": float(local.get("rope_theta", rope[0]))}


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    out = {**llama.to_hf(cfg), "attention_bias": False}
    if cfg.model_type == "olmo3":
        full = {"rope_type": "default", **(cfg.rope_scaling.to_hf() if cfg.rope_scaling else {}),
                "rope_theta": cfg.rope_theta}
        local = cfg.local_rope_theta if cfg.local_rope_theta is not None else cfg.rope_theta
        out.update(layer_types=list(cfg.layer_types or ("full_attention",) * cfg.num_layers),
                   sliding_window=cfg.sliding_window, rope_scaling=None,
                   rope_parameters={"full_attention": full,
                                    "sliding_attention": {"rope_type": "default", "rope_theta": local}})
    return out


def layer_params(cfg: ModelConfig) -> dict[str, ParamSpec]:
    d, h, kv, hd, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    return {
        "q_proj": ParamSpec(("embed", "q_heads", "head_dim"), (d, h, hd)),
        "k_proj": ParamSpec(("embed", "kv_heads", "head_dim"), (d, kv, hd)),
        "v_proj": ParamSpec(("embed", "kv_heads", "head_dim"), (d, kv, hd)),
        "q_norm": ParamSpec(("q_heads", "head_dim"), (h, hd), "ones"),
        "k_norm": ParamSpec(("kv_heads", "head_dim"), (kv, hd), "ones"),
        "o_proj": ParamSpec(("q_heads", "head_dim", "embed"), (h, hd, d)),
        "post_attention_norm": ParamSpec(("norm",), (d,), "ones"),
        "gate_proj": ParamSpec(("embed", "mlp"), (d, f)),
        "up_proj": ParamSpec(("embed", "mlp"), (d, f)),
        "down_proj": ParamSpec(("mlp", "embed"), (f, d)),
        "post_feedforward_norm": ParamSpec(("norm",), (d,), "ones"),
    }


def _whole_projection(hf_name: str, heads_attr: str) -> Mapping:
    """HF's norm weight over a whole projection [heads * head_dim] <-> ours [heads, head_dim]."""
    return Mapping(hf_name, lambda a, c: a.reshape(getattr(c, heads_attr), c.head_dim),
                   lambda a, c: a.reshape(-1))


def hf_mappings(cfg: ModelConfig) -> dict[str, Mapping]:
    pre = "model.layers.{i}."
    out = {k: v for k, v in llama.hf_mappings(cfg).items()
           if k.removeprefix("layers.") in layer_params(cfg) or not k.startswith("layers.")}
    return {
        **out,
        "layers.q_norm": _whole_projection(pre + "self_attn.q_norm.weight", "num_heads"),
        "layers.k_norm": _whole_projection(pre + "self_attn.k_norm.weight", "num_kv_heads"),
        "layers.post_feedforward_norm": same(pre + "post_feedforward_layernorm.weight"),
    }


def norm_over_heads(x: Array, w: Array, eps: float) -> Array:
    """RMSNorm of x [..., heads, head_dim] over its last two axes (the whole projection)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=(-2, -1), keepdims=True) + eps)
    return (w.astype(jnp.float32) * xf).astype(x.dtype)


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
    q, k, v = llama.query_key_value(cfg, w, x)
    with jax.named_scope(S.NORM):
        q, k = norm_over_heads(q, w["q_norm"], eps), norm_over_heads(k, w["k_norm"], eps)
    o, new_cache = llama.attention_sublayer(cfg, w, q, k, v, tables, mask, cache)
    x = x + L.rms_norm(o, w["post_attention_norm"], eps)
    x = x + L.rms_norm(llama.swiglu_mlp(w, x), w["post_feedforward_norm"], eps)
    return constrain(x, ("batch", "length", "act_embed")), new_cache


# Llama's where not said otherwise: embeddings, RoPE tables, final norm, the sampler's layout
FAMILY = dataclasses.replace(
    llama.FAMILY,
    name="olmo2",
    model_types=("olmo2", "olmo3"),
    architectures={"olmo2": ("Olmo2ForCausalLM", "Olmo2ForSequenceClassification"),
                   "olmo3": ("Olmo3ForCausalLM", "Olmo3ForSequenceClassification")},
    parse_hf=parse_hf,
    to_hf=to_hf,
    layer_params=layer_params,
    hf_mappings=hf_mappings,
    block=block,
    fixed={**llama.FAMILY.fixed, "qk_norm": (True,), "qkv_bias": (False,), "o_bias": (False,)},
)
