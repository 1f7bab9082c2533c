"""GPT-NeoX (Pythia): LayerNorm with bias, fused per-head QKV, partial rotary (the first
`rotary_pct` of each head's dims), parallel or sequential residual, exact-GELU MLP with biases,
untied output embedding (`embed_out`)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from tbajax.models import layers as L
from tbajax.models.config import ModelConfig, UnsupportedModelError
from tbajax.models.families import Family, Mapping, ParamSpec, matrix_decode_layout, same, transposed
from tbajax.models.families.llama import (  # rotary: as Llama
    attention_sublayer, embed, heads_out, position_tables)
from tbajax.sharding import constrain

Array = jax.Array


# ----------------------------------------------------------------------------- config


def parse_hf(hf: dict[str, Any]) -> dict[str, Any]:
    act = hf.get("hidden_act", "gelu")
    if act != "gelu":
        raise UnsupportedModelError(
            f"hidden_act={act!r} is not supported for gpt_neox (only 'gelu', the exact erf GELU)"
        )
    if hf.get("rope_scaling"):
        raise UnsupportedModelError(
            f"rope_scaling={hf['rope_scaling']!r} is not supported for gpt_neox (only unscaled RoPE)"
        )
    params = dict(hf.get("rope_parameters") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise UnsupportedModelError(
            f"rope_parameters.rope_type={rope_type!r} is not supported for gpt_neox (only 'default')"
        )
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    if hidden % heads:
        raise UnsupportedModelError(
            f"hidden_size={hidden} is not a multiple of num_attention_heads={heads}"
        )
    bias = bool(hf.get("attention_bias", True))
    return dict(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        # v5 layout: rope_parameters; v4 (and Pythia's own config.json): rotary_pct / rotary_emb_base
        rope_theta=float(params.get("rope_theta", hf.get("rotary_emb_base", 10000.0))),
        rotary_pct=float(params.get("partial_rotary_factor", hf.get("rotary_pct", 0.25))),
        layer_norm_eps=float(hf.get("layer_norm_eps", 1e-5)),
        parallel_residual=bool(hf.get("use_parallel_residual", True)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=bias,
        o_bias=bias,
        hidden_act="gelu",
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
    )


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    # Both layouts: v4 (and vLLM) read rotary_pct / rotary_emb_base, v5 reads rope_parameters.
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "hidden_act": "gelu",
        "rotary_pct": cfg.rotary_pct,
        "rotary_emb_base": cfg.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": cfg.rotary_pct,
        },
        "layer_norm_eps": cfg.layer_norm_eps,
        "use_parallel_residual": cfg.parallel_residual,
        "attention_bias": cfg.qkv_bias,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
    }


def validate(cfg: ModelConfig) -> None:
    if cfg.qkv_bias != cfg.o_bias:
        raise UnsupportedModelError(
            f"gpt_neox has one attention_bias switch for both projections; got qkv_bias={cfg.qkv_bias}, "
            f"o_bias={cfg.o_bias}"
        )


# ----------------------------------------------------------------------------- parameters


def top_params(cfg: ModelConfig) -> dict[str, ParamSpec]:
    d = cfg.hidden_size
    return {
        "embed_tokens": ParamSpec(("vocab", "embed"), (cfg.vocab_size, d)),
        "norm": ParamSpec(("norm",), (d,), "ones"),
        "norm_bias": ParamSpec(("norm",), (d,), "zeros"),
    }


def layer_params(cfg: ModelConfig) -> dict[str, ParamSpec]:
    d, h, hd, f = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.intermediate_size
    out = {
        "input_norm": ParamSpec(("norm",), (d,), "ones"),
        "input_norm_bias": ParamSpec(("norm",), (d,), "zeros"),
        # HF interleaves per head: output row = head * 3 * head_dim + {q,k,v} * head_dim + dim
        "qkv_proj": ParamSpec(("embed", "q_heads", None, "head_dim"), (d, h, 3, hd)),
        "qkv_bias": ParamSpec(("q_heads", None, "head_dim"), (h, 3, hd), "zeros"),
        "o_proj": ParamSpec(("q_heads", "head_dim", "embed"), (h, hd, d)),
        "o_bias": ParamSpec(("norm",), (d,), "zeros"),
        "post_attention_norm": ParamSpec(("norm",), (d,), "ones"),
        "post_attention_norm_bias": ParamSpec(("norm",), (d,), "zeros"),
        "up_proj": ParamSpec(("embed", "mlp"), (d, f)),
        "up_bias": ParamSpec(("mlp",), (f,), "zeros"),
        "down_proj": ParamSpec(("mlp", "embed"), (f, d)),
        "down_bias": ParamSpec(("norm",), (d,), "zeros"),
    }
    if not cfg.qkv_bias:
        del out["qkv_bias"], out["o_bias"]
    return out


def hf_mappings(cfg: ModelConfig) -> dict[str, Mapping]:
    pre = "gpt_neox.layers.{i}."
    return {
        "embed_tokens": same("gpt_neox.embed_in.weight"),
        "norm": same("gpt_neox.final_layer_norm.weight"),
        "norm_bias": same("gpt_neox.final_layer_norm.bias"),
        # Pythia (and transformers v4, vLLM) call the output head embed_out; v5 renames it lm_head
        "lm_head": transposed("embed_out.weight", "lm_head.weight"),
        "layers.input_norm": same(pre + "input_layernorm.weight"),
        "layers.input_norm_bias": same(pre + "input_layernorm.bias"),
        "layers.qkv_proj": Mapping(
            pre + "attention.query_key_value.weight",
            lambda a, c: a.T.reshape(a.shape[1], c.num_heads, 3, c.head_dim),
            lambda a, c: a.reshape(a.shape[0], -1).T,
        ),
        "layers.qkv_bias": Mapping(
            pre + "attention.query_key_value.bias",
            lambda a, c: a.reshape(c.num_heads, 3, c.head_dim),
            lambda a, c: a.reshape(-1),
        ),
        "layers.o_proj": heads_out(pre + "attention.dense.weight"),
        "layers.o_bias": same(pre + "attention.dense.bias"),
        "layers.post_attention_norm": same(pre + "post_attention_layernorm.weight"),
        "layers.post_attention_norm_bias": same(pre + "post_attention_layernorm.bias"),
        "layers.up_proj": transposed(pre + "mlp.dense_h_to_4h.weight"),
        "layers.up_bias": same(pre + "mlp.dense_h_to_4h.bias"),
        "layers.down_proj": transposed(pre + "mlp.dense_4h_to_h.weight"),
        "layers.down_bias": same(pre + "mlp.dense_4h_to_h.bias"),
    }


# ----------------------------------------------------------------------------- math


def final_norm(cfg: ModelConfig, params: dict[str, Array], x: Array) -> Array:
    return L.layer_norm(x, params["norm"], params["norm_bias"], cfg.layer_norm_eps)


def block(
    cfg: ModelConfig,
    p: dict[str, Array],
    x: Array,
    tables: tuple[Array, Array],
    mask: Array,
    cache: L.LayerCache | L.EmitKV | None,
) -> tuple[Array, tuple[Array, Array] | None]:
    dt = cfg.jnp_dtype
    w = {k: v.astype(dt) for k, v in p.items()}
    h = L.layer_norm(x, w["input_norm"], w["input_norm_bias"], cfg.layer_norm_eps)
    qkv = L.decode_matrix_product(h, w, "qkv_proj", out_shape=(cfg.num_heads, 3))
    if cfg.qkv_bias:
        # a training forward's bias is a slice of the stacked params (`layers.own_kernel`)
        qkv = qkv + (L.own_kernel(w["qkv_bias"]) if cache is None else w["qkv_bias"])
    q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
    o, new_cache = attention_sublayer(cfg, w, q, k, v, tables, mask, cache)
    if cfg.qkv_bias:
        o = o + w["o_bias"]

    def mlp(y: Array) -> Array:
        y = L.layer_norm(y, w["post_attention_norm"], w["post_attention_norm_bias"], cfg.layer_norm_eps)
        y = L.gelu_exact(L.decode_product(y, w, "up_proj") + w["up_bias"])
        return L.decode_product(y, w, "down_proj") + w["down_bias"]

    if cfg.parallel_residual:
        x = x + o + mlp(x)
    else:
        x = x + o
        x = x + mlp(x)
    return constrain(x, ("batch", "length", "act_embed")), new_cache


PRODUCTS = ("qkv_proj", "o_proj", "up_proj", "down_proj")
decode_layout, undo_decode_layout = matrix_decode_layout(layer_params, PRODUCTS)


FAMILY = Family(
    name="gpt_neox",
    model_types=("gpt_neox",),
    architectures={"gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXForSequenceClassification")},
    base_prefix="gpt_neox.",
    parse_hf=parse_hf,
    to_hf=to_hf,
    top_params=top_params,
    layer_params=layer_params,
    hf_mappings=hf_mappings,
    embed=embed,
    position_tables=position_tables,
    block=block,
    final_norm=final_norm,
    decode_layout=decode_layout,
    undo_decode_layout=undo_decode_layout,
    # old checkpoints carry causal-mask and rotary buffers
    ignored_suffixes=(".attention.bias", ".attention.masked_bias", "rotary_emb.inv_freq"),
    fixed={"hidden_act": ("gelu",), "qk_norm": (False,), "rope_scaling": (None,)},
    validate=validate,
)
