"""Gemma (model_type gemma: Gemma 1 and 1.1, 2B and 7B, CodeGemma): Llama's layout, a norm before
the attention and one before the MLP and RoPE on every layer, with Gemma 3's pieces (`gemma3`):
RMSNorm weights as offsets from one (in fp32), a GeGLU MLP, embeddings scaled by sqrt(hidden_size),
tied embeddings. The released configs' hidden_act "gelu" means the tanh approximation, as
transformers reads it."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from tbajax.models import layers as L
from tbajax.models.config import ModelConfig, UnsupportedModelError, _parse_rope
from tbajax.models.families import ParamSpec, gemma3, llama
from tbajax.sharding import constrain

Array = jax.Array


def parse_hf(hf: dict[str, Any]) -> dict[str, Any]:
    act = hf.get("hidden_activation") or hf.get("hidden_act") or gemma3.ACTIVATION
    if act == "gelu":  # the legacy value of the official releases, meant as the tanh GELU
        act = gemma3.ACTIVATION
    if hf.get("attention_bias"):
        raise UnsupportedModelError("attention_bias=true is not supported for gemma")
    layers = int(hf["num_hidden_layers"])
    fields = gemma3.shared_fields({**hf, "hidden_activation": act}, ["full_attention"] * layers,
                                  _parse_rope(hf), None, context=8192)
    return {**fields, "layer_types": None}


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {**llama.to_hf(cfg), "hidden_act": gemma3.ACTIVATION, "attention_bias": False}


def layer_params(cfg: ModelConfig) -> dict[str, ParamSpec]:
    return {k: v for k, v in gemma3.layer_params(cfg).items()
            if k not in ("pre_feedforward_norm", "post_feedforward_norm")}


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
    q, k, v = llama.query_key_value(cfg, w, gemma3.rms_norm(x, w["input_norm"], eps))
    o, new_cache = llama.attention_sublayer(cfg, w, q, k, v, tables, mask, cache)
    x = x + o
    x = x + llama.gated_mlp(w, gemma3.rms_norm(x, w["post_attention_norm"], eps), gemma3.geglu)
    return constrain(x, ("batch", "length", "act_embed")), new_cache


# Gemma 3's where not said otherwise: embeddings, final norm, parameter names, the sampler's layout
FAMILY = dataclasses.replace(
    gemma3.FAMILY,
    name="gemma",
    model_types=("gemma",),
    architectures={"gemma": ("GemmaForCausalLM", "GemmaForSequenceClassification")},
    parse_hf=parse_hf,
    to_hf=to_hf,
    layer_params=layer_params,
    block=block,
    fixed={**gemma3.FAMILY.fixed, "qk_norm": (False,), "local_rope_theta": (None,), "layer_types": (None,),
           "attn_logit_softcapping": (None,), "final_logit_softcapping": (None,)},
)
