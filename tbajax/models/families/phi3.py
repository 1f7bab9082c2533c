"""Phi-3 / Phi-4 (model_type phi3): Llama's block with the query, key and value projections fused
into one weight (in the checkpoint all query heads, then the key heads, then the value heads) and
the gate and up projections fused into another, and rotary embeddings on the first
`partial_rotary_factor` of each head's dims. The fused weights stay fused here as in PEFT's target
names (qkv_proj, gate_up_proj); qkv_proj is held per KV head ([embed, kv, g + 2, head_dim]: its
group's g query heads, its key, its value), so a tensor-parallel mesh gives each device whole KV
groups (`hf_mappings` reorders it, and the PEFT export its adapters' rows). A sliding window
shorter than the context (Phi-3-mini-4k's 2047) is `ModelConfig.sliding_window`; LongRoPE scaling
(Phi-3.5-mini, Phi-4-mini: 128k contexts) is a `RopeScaling` of type "longrope", applied as
transformers does (`llama.position_tables`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from tbajax.models import layers as L
from tbajax.models.config import ModelConfig, UnsupportedModelError
from tbajax.models.families import Mapping, ParamSpec, llama, same, transposed
from tbajax.sharding import constrain

Array = jax.Array


def parse_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("attention_bias"):
        raise UnsupportedModelError("attention_bias=true is not supported for phi3")
    params = dict(hf.get("rope_parameters") or {})
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    return {**llama.parse_hf(hf), "rotary_pct": float(factor)}


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    out = {**llama.to_hf(cfg), "partial_rotary_factor": cfg.rotary_pct, "sliding_window": cfg.sliding_window,
           "attention_bias": False}
    if cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "longrope":
        # Phi-3 keeps the pretraining length at the top level, and transformers reads it there first
        out["original_max_position_embeddings"] = cfg.rope_scaling.original_max_position_embeddings
    return out


def layer_params(cfg: ModelConfig) -> dict[str, ParamSpec]:
    d, h, kv, hd, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    return {
        "input_norm": ParamSpec(("norm",), (d,), "ones"),
        "qkv_proj": ParamSpec(("embed", "kv_heads", None, "head_dim"), (d, kv, h // kv + 2, hd)),
        "o_proj": ParamSpec(("q_heads", "head_dim", "embed"), (h, hd, d)),
        "post_attention_norm": ParamSpec(("norm",), (d,), "ones"),
        "gate_up_proj": ParamSpec(("embed", None, "mlp"), (d, 2, f)),
        "down_proj": ParamSpec(("mlp", "embed"), (f, d)),
    }


def hf_mappings(cfg: ModelConfig) -> dict[str, Mapping]:
    pre = "model.layers.{i}."
    return {
        "embed_tokens": same("model.embed_tokens.weight"),
        "norm": same("model.norm.weight"),
        "lm_head": transposed("lm_head.weight"),
        "layers.input_norm": same(pre + "input_layernorm.weight"),
        "layers.post_attention_norm": same(pre + "post_attention_layernorm.weight"),
        # HF Linear [(h + 2 kv) * head_dim, d] <-> ours [d, kv, g + 2, head_dim]
        "layers.qkv_proj": Mapping(pre + "self_attn.qkv_proj.weight", _qkv_to_ours, _qkv_to_hf),
        "layers.o_proj": llama.heads_out(pre + "self_attn.o_proj.weight"),
        # HF Linear [2 f, d] (gate rows, then up rows) <-> ours [d, 2, f]
        "layers.gate_up_proj": Mapping(pre + "mlp.gate_up_proj.weight",
                                       lambda a, c: a.T.reshape(a.shape[1], 2, -1),
                                       lambda a, c: a.reshape(a.shape[0], -1).T),
        "layers.down_proj": transposed(pre + "mlp.down_proj.weight"),
    }


def _qkv_to_ours(a: np.ndarray, c: ModelConfig) -> np.ndarray:
    """HF's [q | k | v] rows ([(h + 2 kv) hd, n]) -> [n, kv, g + 2, hd], per KV head (n: the input
    width, or a LoRA rank)."""
    h, kv, hd = c.num_heads, c.num_kv_heads, c.head_dim
    w = a.T.reshape(a.shape[1], h + 2 * kv, hd)
    q = w[:, :h].reshape(-1, kv, h // kv, hd)
    return np.concatenate([q, w[:, h:h + kv, None], w[:, h + kv:, None]], axis=2)


def _qkv_to_hf(a: np.ndarray, c: ModelConfig) -> np.ndarray:
    """The inverse of `_qkv_to_ours`."""
    g = c.num_heads // c.num_kv_heads
    q = a[:, :, :g].reshape(a.shape[0], c.num_heads, c.head_dim)
    return np.concatenate([q, a[:, :, g], a[:, :, g + 1]], axis=1).reshape(a.shape[0], -1).T


def block(
    cfg: ModelConfig,
    p: dict[str, Array],
    x: Array,
    tables: tuple[Array, Array],
    mask: Array,
    cache: L.LayerCache | L.EmitKV | None,
) -> tuple[Array, tuple[Array, Array] | None]:
    w = {k: v.astype(cfg.jnp_dtype) for k, v in p.items()}
    h, kv = cfg.num_heads, cfg.num_kv_heads
    g = h // kv
    qkv = L.decode_matrix_product(L.rms_norm(x, w["input_norm"], cfg.rms_norm_eps), w, "qkv_proj",
                                  out_shape=(kv, g + 2))  # [..., kv, g + 2, hd] in either layout
    q = qkv[..., :g, :].reshape(*qkv.shape[:-3], h, qkv.shape[-1])
    k, v = qkv[..., g, :], qkv[..., g + 1, :]
    o, new_cache = llama.attention_sublayer(cfg, w, q, k, v, tables, mask, cache)
    x = x + o
    gate_up = L.decode_matrix_product(L.rms_norm(x, w["post_attention_norm"], cfg.rms_norm_eps), w,
                                      "gate_up_proj", out_shape=(2,))
    x = x + L.decode_product(L.swiglu(gate_up[..., 0, :], gate_up[..., 1, :]), w, "down_proj")
    return constrain(x, ("batch", "length", "act_embed")), new_cache


PRODUCTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def decode_layout(cfg: ModelConfig, p: dict[str, Any]) -> dict[str, Any]:
    """The fused weights as matrices, all four products output-major (`layers.orient_for_decode`)."""
    d = cfg.hidden_size
    p = dict(p, qkv_proj=p["qkv_proj"].reshape(d, -1), o_proj=p["o_proj"].reshape(-1, d),
             gate_up_proj=p["gate_up_proj"].reshape(d, -1))
    return L.orient_for_decode(p, PRODUCTS)


def undo_decode_layout(cfg: ModelConfig, p: dict[str, Any]) -> dict[str, Any]:
    p, shapes = L.undo_orient(p), layer_params(cfg)
    return dict(p, **{n: p[n].reshape(shapes[n].shape) for n in ("qkv_proj", "o_proj", "gate_up_proj")})


# Llama's where not said otherwise: embeddings, RoPE tables (partial through rotary_pct), final norm
FAMILY = dataclasses.replace(
    llama.FAMILY,
    name="phi3",
    model_types=("phi3",),
    architectures={"phi3": ("Phi3ForCausalLM", "Phi3ForSequenceClassification")},
    parse_hf=parse_hf,
    to_hf=to_hf,
    layer_params=layer_params,
    hf_mappings=hf_mappings,
    block=block,
    fixed={"hidden_act": ("silu",), "parallel_residual": (False,), "qk_norm": (False,),
           "qkv_bias": (False,), "o_bias": (False,)},
    decode_layout=decode_layout,
    undo_decode_layout=undo_decode_layout,
)
