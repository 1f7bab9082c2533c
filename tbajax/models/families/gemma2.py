"""Gemma 2 (model_type gemma2: Gemma 2 2B, 9B and 27B, `Gemma2ForCausalLM`).

Gemma 3's math (`gemma3`: four RMSNorms a block with weights offset from one, GeGLU, embeddings
scaled by sqrt(hidden_size), scores scaled by query_pre_attn_scalar ** -0.5) without its per-head
q/k norms, with one RoPE base for every layer, and with logit soft-capping: the attention scores
at `attn_logit_softcapping` (50) before the mask, the LM head's logits at
`final_logit_softcapping` (30), in every pass (`layers.soft_capped`). Layers alternate between a
sliding window (the even ones, 4,096 positions) and full attention.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tbajax.models.config import ModelConfig, _parse_rope
from tbajax.models.families import gemma3


def parse_hf(hf: dict[str, Any]) -> dict[str, Any]:
    layers = int(hf["num_hidden_layers"])
    # transformers' default: the even layers (0, 2, ...) slide, the odd ones see everything
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    window = hf.get("sliding_window", 4096)
    return gemma3.shared_fields(hf, layer_types, _parse_rope(hf), window, context=8192)


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    out = gemma3.to_hf(cfg)
    scaling = cfg.rope_scaling.to_hf() if cfg.rope_scaling else {"rope_type": "default"}
    return {**out, "rope_parameters": {**scaling, "rope_theta": cfg.rope_theta}}


FAMILY = dataclasses.replace(
    gemma3.FAMILY,
    name="gemma2",
    model_types=("gemma2",),
    architectures={"gemma2": ("Gemma2ForCausalLM", "Gemma2ForSequenceClassification")},
    parse_hf=parse_hf,
    to_hf=to_hf,
    fixed={**gemma3.FAMILY.fixed, "qk_norm": (False,), "local_rope_theta": (None,)},
)
