"""GPT-2: learned absolute positions, pre-norm LayerNorm blocks, fused QKV stored as HF Conv1D
([in, out], transposed vs Linear), tanh-GELU ("gelu_new") MLP, tied embeddings.

Positions come from the skeleton (cumsum(mask) - 1), so a left-padded prompt gets the same
position embeddings as the unpadded one. Positions past n_positions clamp to the last row
(transformers raises an index error there); keep prompt + new tokens <= n_positions.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from tbajax.models import layers as L
from tbajax.models.config import ModelConfig, UnsupportedModelError
from tbajax.models.families import (
    Family,
    Mapping,
    ParamSpec,
    matrix_decode_layout,
    same,
    transposed,
)
from tbajax.sharding import constrain

Array = jax.Array

# config field -> the value we implement (anything else changes the math)
_REQUIRED = {
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
    "add_cross_attention": False,
}


# ----------------------------------------------------------------------------- config


def parse_hf(hf: dict[str, Any]) -> dict[str, Any]:
    for field, wanted in _REQUIRED.items():
        got = hf.get(field, wanted)
        if bool(got) != wanted:
            raise UnsupportedModelError(
                f"{field}={str(got).lower()} is not supported for gpt2 (only {str(wanted).lower()})"
            )
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu"):
        raise UnsupportedModelError(
            f"activation_function={act!r} is not supported for gpt2 (only 'gelu_new' or 'gelu')"
        )
    d, heads = int(hf["n_embd"]), int(hf["n_head"])
    if d % heads:
        raise UnsupportedModelError(f"n_embd={d} is not a multiple of n_head={heads}")
    return dict(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=d,
        intermediate_size=int(hf.get("n_inner") or 4 * d),
        num_layers=int(hf["n_layer"]),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=d // heads,
        layer_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        qkv_bias=True,
        o_bias=True,
        hidden_act=act,
        max_position_embeddings=int(hf.get("n_positions", 1024)),
    )


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "vocab_size": cfg.vocab_size,
        "n_embd": cfg.hidden_size,
        "n_inner": cfg.intermediate_size,
        "n_layer": cfg.num_layers,
        "n_head": cfg.num_heads,
        "n_positions": cfg.max_position_embeddings,
        "layer_norm_epsilon": cfg.layer_norm_eps,
        "activation_function": cfg.hidden_act,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        **_REQUIRED,
    }


# ----------------------------------------------------------------------------- parameters


def top_params(cfg: ModelConfig) -> dict[str, ParamSpec]:
    d = cfg.hidden_size
    return {
        "embed_tokens": ParamSpec(("vocab", "embed"), (cfg.vocab_size, d)),
        "embed_positions": ParamSpec((None, "embed"), (cfg.max_position_embeddings, d)),
        "norm": ParamSpec(("norm",), (d,), "ones"),
        "norm_bias": ParamSpec(("norm",), (d,), "zeros"),
    }


def layer_params(cfg: ModelConfig) -> dict[str, ParamSpec]:
    d, h, hd, f = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.intermediate_size
    return {
        "input_norm": ParamSpec(("norm",), (d,), "ones"),
        "input_norm_bias": ParamSpec(("norm",), (d,), "zeros"),
        # c_attn output columns are [q | k | v], each heads x head_dim
        "qkv_proj": ParamSpec(("embed", None, "q_heads", "head_dim"), (d, 3, h, hd)),
        "qkv_bias": ParamSpec((None, "q_heads", "head_dim"), (3, h, hd), "zeros"),
        "o_proj": ParamSpec(("q_heads", "head_dim", "embed"), (h, hd, d)),
        "o_bias": ParamSpec(("norm",), (d,), "zeros"),
        "post_attention_norm": ParamSpec(("norm",), (d,), "ones"),
        "post_attention_norm_bias": ParamSpec(("norm",), (d,), "zeros"),
        "up_proj": ParamSpec(("embed", "mlp"), (d, f)),
        "up_bias": ParamSpec(("mlp",), (f,), "zeros"),
        "down_proj": ParamSpec(("mlp", "embed"), (f, d)),
        "down_bias": ParamSpec(("norm",), (d,), "zeros"),
    }


def hf_mappings(cfg: ModelConfig) -> dict[str, Mapping]:
    pre = "transformer.h.{i}."
    return {
        "embed_tokens": same("transformer.wte.weight"),
        "embed_positions": same("transformer.wpe.weight"),
        "norm": same("transformer.ln_f.weight"),
        "norm_bias": same("transformer.ln_f.bias"),
        "lm_head": transposed("lm_head.weight"),
        "layers.input_norm": same(pre + "ln_1.weight"),
        "layers.input_norm_bias": same(pre + "ln_1.bias"),
        # Conv1D stores [in, out] already: only the output axis is split
        "layers.qkv_proj": Mapping(
            pre + "attn.c_attn.weight",
            lambda a, c: a.reshape(a.shape[0], 3, c.num_heads, c.head_dim),
            lambda a, c: a.reshape(a.shape[0], -1),
        ),
        "layers.qkv_bias": Mapping(
            pre + "attn.c_attn.bias",
            lambda a, c: a.reshape(3, c.num_heads, c.head_dim),
            lambda a, c: a.reshape(-1),
        ),
        "layers.o_proj": Mapping(
            pre + "attn.c_proj.weight",
            lambda a, c: a.reshape(c.num_heads, c.head_dim, a.shape[-1]),
            lambda a, c: a.reshape(-1, a.shape[-1]),
        ),
        "layers.o_bias": same(pre + "attn.c_proj.bias"),
        "layers.post_attention_norm": same(pre + "ln_2.weight"),
        "layers.post_attention_norm_bias": same(pre + "ln_2.bias"),
        "layers.up_proj": same(pre + "mlp.c_fc.weight"),
        "layers.up_bias": same(pre + "mlp.c_fc.bias"),
        "layers.down_proj": same(pre + "mlp.c_proj.weight"),
        "layers.down_bias": same(pre + "mlp.c_proj.bias"),
    }


# ----------------------------------------------------------------------------- math


def embed(cfg: ModelConfig, params: dict[str, Array], tokens: Array, positions: Array) -> Array:
    dt = cfg.jnp_dtype
    return params["embed_tokens"].astype(dt)[tokens] + params["embed_positions"].astype(dt)[positions]


def position_tables(cfg: ModelConfig, positions: Array) -> None:
    return None  # positions enter through the embedding


def final_norm(cfg: ModelConfig, params: dict[str, Array], x: Array) -> Array:
    return L.layer_norm(x, params["norm"], params["norm_bias"], cfg.layer_norm_eps)


def block(
    cfg: ModelConfig,
    p: dict[str, Array],
    x: Array,
    tables: None,
    mask: Array,
    cache: L.LayerCache | L.EmitKV | None,
) -> tuple[Array, tuple[Array, Array] | None]:
    dt = cfg.jnp_dtype
    w = {k: v.astype(dt) for k, v in p.items()}
    act = L.ACTIVATIONS[cfg.hidden_act]
    h = L.layer_norm(x, w["input_norm"], w["input_norm_bias"], cfg.layer_norm_eps)
    qkv = L.decode_matrix_product(h, w, "qkv_proj", out_shape=(3, cfg.num_heads))
    qkv = qkv + (L.own_kernel(w["qkv_bias"]) if cache is None else w["qkv_bias"])  # see gpt_neox
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    q = constrain(q, ("batch", "length", "act_heads", None))
    o, new_cache = L.self_attention(q, k, v, mask, cache, dt, cfg.attention)
    o = L.decode_matrix_product(o, w, "o_proj", in_axes=2) + w["o_bias"]
    x = x + o
    h = L.layer_norm(x, w["post_attention_norm"], w["post_attention_norm_bias"], cfg.layer_norm_eps)
    h = act(L.decode_product(h, w, "up_proj") + w["up_bias"])
    x = x + L.decode_product(h, w, "down_proj") + w["down_bias"]
    return constrain(x, ("batch", "length", "act_embed")), new_cache


PRODUCTS = ("qkv_proj", "o_proj", "up_proj", "down_proj")
decode_layout, undo_decode_layout = matrix_decode_layout(layer_params, PRODUCTS)


FAMILY = Family(
    name="gpt2",
    model_types=("gpt2",),
    architectures={"gpt2": ("GPT2LMHeadModel", "GPT2ForSequenceClassification")},
    base_prefix="transformer.",
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
    # old checkpoints carry the causal-mask buffers
    ignored_suffixes=(".attn.bias", ".attn.masked_bias"),
    fixed={"hidden_act": ("gelu_new", "gelu"), "qkv_bias": (True,), "o_bias": (True,), "qk_norm": (False,),
           "rotary_pct": (1.0,), "parallel_residual": (False,), "rope_scaling": (None,)},
)
