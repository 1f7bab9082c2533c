"""OLMoE (AllenAI's mixture-of-experts OLMo, model_type olmoe): Llama's pre-norm block whose query
and key projections take OLMo 2's RMSNorm over the whole projection before RoPE, and whose MLP is
routed experts (`tbajax.models.moe`; the top-k weights not renormalised unless norm_topk_prob).
clip_qkv (clamping q, k and v) is refused naming the field."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from tbajax import op_scopes as S
from tbajax.models import layers as L
from tbajax.models.config import ModelConfig, UnsupportedModelError
from tbajax.models.families import Mapping, ParamSpec, llama, olmo2
from tbajax.models.moe import CountRouting
from tbajax.sharding import constrain

Array = jax.Array


def parse_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("clip_qkv") is not None:
        raise UnsupportedModelError(f"clip_qkv={hf['clip_qkv']} is not supported for olmoe (only null)")
    if hf.get("attention_bias"):
        raise UnsupportedModelError("attention_bias=true is not supported for olmoe")
    return {**llama.parse_hf(hf), "qk_norm": True}


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {**llama.to_hf(cfg), "attention_bias": False, "clip_qkv": None, "num_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok, "intermediate_size": cfg.expert_intermediate_size,
            "norm_topk_prob": cfg.norm_topk_prob}


def layer_params(cfg: ModelConfig) -> dict[str, ParamSpec]:
    h, kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    return {**llama.layer_params(cfg),  # its q_norm / k_norm over whole projections, as OLMo 2's
            "q_norm": ParamSpec(("q_heads", "head_dim"), (h, hd), "ones"),
            "k_norm": ParamSpec(("kv_heads", "head_dim"), (kv, hd), "ones")}


def hf_mappings(cfg: ModelConfig) -> dict[str, Mapping]:
    whole = olmo2.hf_mappings(cfg)
    return {**llama.hf_mappings(cfg), "layers.q_norm": whole["layers.q_norm"],
            "layers.k_norm": whole["layers.k_norm"]}


def block(
    cfg: ModelConfig,
    p: dict[str, Array],
    x: Array,
    tables: tuple[Array, Array],
    mask: Array,
    cache: L.LayerCache | L.EmitKV | CountRouting | None,
) -> tuple[Array, Any]:
    w = {k: v.astype(cfg.jnp_dtype) for k, v in p.items()}
    eps = cfg.rms_norm_eps
    q, k, v = llama.query_key_value(cfg, w, L.rms_norm(x, w["input_norm"], eps))
    with jax.named_scope(S.NORM):
        q, k = olmo2.norm_over_heads(q, w["q_norm"], eps), olmo2.norm_over_heads(k, w["k_norm"], eps)
    routing, cache = llama.routing_or_cache(cache)
    o, new_cache = llama.attention_sublayer(cfg, w, q, k, v, tables, mask, cache)
    x = x + o
    out, counts = llama.mlp_counted(cfg, w, L.rms_norm(x, w["post_attention_norm"], eps), routing)
    x = x + out
    return constrain(x, ("batch", "length", "act_embed")), counts if routing is not None else new_cache


def validate(cfg: ModelConfig) -> None:
    if cfg.num_experts is None:
        raise UnsupportedModelError("olmoe needs num_experts (ModelConfig.from_hf reads it from config.json)")


# Llama's where not said otherwise: embeddings, RoPE tables, final norm, the sampler's layout
FAMILY = dataclasses.replace(
    llama.FAMILY,
    name="olmoe",
    model_types=("olmoe",),
    architectures={"olmoe": ("OlmoeForCausalLM", "OlmoeForSequenceClassification")},
    parse_hf=parse_hf,
    to_hf=to_hf,
    layer_params=layer_params,
    hf_mappings=hf_mappings,
    block=block,
    fixed={**llama.FAMILY.fixed, "qk_norm": (True,), "qkv_bias": (False,), "o_bias": (False,)},
    validate=validate,
)
