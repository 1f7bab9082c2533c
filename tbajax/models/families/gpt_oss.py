"""GPT-OSS (OpenAI's open-weight mixture of experts, model_type gpt_oss): Llama's pre-norm block
with biased q/k/v/o projections and attention sinks (a learned logit per query head in every
softmax's denominator, `layers.self_attention`), a window on every other layer, YaRN RoPE, and
routed experts whose router and projections carry biases, gate and up fused with their columns
interleaved, under a clamped SwiGLU (`moe.moe_clamped_swiglu`). The released checkpoints hold the
experts in MXFP4; they are dequantized on load (`tbajax.models.mxfp4`) and exported unquantized."""

from __future__ import annotations

import dataclasses
from typing import Any

from tbajax.models.config import ModelConfig, UnsupportedModelError
from tbajax.models.families import Mapping, ParamSpec, llama, same, transposed

ROUTER_AUX_LOSS_COEF = 0.001  # transformers' GptOssConfig default


def parse_hf(hf: dict[str, Any]) -> dict[str, Any]:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act={act!r} is not supported for gpt_oss (only 'silu')")
    layers = int(hf["num_hidden_layers"])
    # transformers' default: a window on the even layers
    layer_types = tuple(hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                                  for i in range(layers)])
    window = hf.get("sliding_window")
    windowed = window is not None and "sliding_attention" in layer_types
    bias = bool(hf.get("attention_bias", True))
    return dict(
        **llama.decoder_fields(hf, rms_norm_eps=1e-5),
        qkv_bias=bias,
        o_bias=bias,
        max_position_embeddings=int(hf.get("max_position_embeddings", 131072)),
        sliding_window=int(window) if windowed else None,
        layer_types=layer_types if windowed else None,
        num_experts=int(hf.get("num_local_experts") or hf["num_experts"]),
        # OpenAI's own config names it experts_per_token
        num_experts_per_tok=int(hf.get("num_experts_per_tok") or hf["experts_per_token"]),
        expert_intermediate_size=int(hf["intermediate_size"]),
        norm_topk_prob=True,  # the softmax over the top k logits
        output_router_logits=bool(hf.get("output_router_logits", False)),
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", ROUTER_AUX_LOSS_COEF)),
        attention_sinks=True,
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
    )


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """config.json as transformers' GptOssConfig writes it: Llama's fields and GPT-OSS's own (no
    quantization_config: an export is unquantized)."""
    return {
        **llama.to_hf(cfg),
        "intermediate_size": cfg.expert_intermediate_size,
        "attention_bias": cfg.qkv_bias,
        "sliding_window": cfg.sliding_window,
        "layer_types": list(cfg.layer_types or ("full_attention",) * cfg.num_layers),
        "num_local_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "swiglu_limit": cfg.swiglu_limit,
        "swiglu_alpha": cfg.swiglu_alpha,
    }


def layer_params(cfg: ModelConfig) -> dict[str, ParamSpec]:
    assert cfg.num_experts is not None
    d, e, f = cfg.hidden_size, cfg.num_experts, cfg.expert_intermediate_size
    out = {k: v for k, v in llama.layer_params(cfg).items() if k not in ("expert_gate", "expert_up")}
    out.update(
        sinks=ParamSpec(("q_heads",), (cfg.num_heads,)),
        router_bias=ParamSpec((None,), (e,)),
        expert_gate_up=ParamSpec(("experts", "embed", "mlp"), (e, d, 2 * f)),
        expert_gate_up_bias=ParamSpec(("experts", "mlp"), (e, 2 * f), "zeros"),
        expert_down_bias=ParamSpec(("experts", "embed"), (e, d), "zeros"),
    )
    return out


def hf_mappings(cfg: ModelConfig) -> dict[str, Mapping]:
    """Llama's attention names, and the experts as one tensor per projection (not one per expert):
    gate_up_proj [E, d, 2f] and down_proj [E, f, d] are already in our layout. Listed in the order
    transformers' modules register them (PEFT nests adapted parameters of one module so)."""
    pre = "model.layers.{i}."
    ours = ("layers.router", "layers.expert_")
    return {
        **{k: v for k, v in llama.hf_mappings(cfg).items() if not k.startswith(ours)},
        "layers.sinks": same(pre + "self_attn.sinks"),
        "layers.router": transposed(pre + "mlp.router.weight"),
        "layers.router_bias": same(pre + "mlp.router.bias"),
        "layers.expert_gate_up": same(pre + "mlp.experts.gate_up_proj"),
        "layers.expert_gate_up_bias": same(pre + "mlp.experts.gate_up_proj_bias"),
        "layers.expert_down": same(pre + "mlp.experts.down_proj"),
        "layers.expert_down_bias": same(pre + "mlp.experts.down_proj_bias"),
    }


def validate(cfg: ModelConfig) -> None:
    if cfg.num_experts is None or cfg.swiglu_limit is None:
        raise UnsupportedModelError("gpt_oss needs num_experts and swiglu_limit (ModelConfig.from_hf reads "
                                    "them from config.json)")


# Llama's where not said otherwise: the block (its attention passes the sinks, its MLP takes the
# biased experts), embeddings, RoPE tables, final norm, the sampler's layout
FAMILY = dataclasses.replace(
    llama.FAMILY,
    name="gpt_oss",
    model_types=("gpt_oss",),
    architectures={"gpt_oss": ("GptOssForCausalLM", "GptOssForSequenceClassification")},
    parse_hf=parse_hf,
    to_hf=to_hf,
    layer_params=layer_params,
    hf_mappings=hf_mappings,
    fixed={**llama.FAMILY.fixed, "attention_sinks": (True,), "qk_norm": (False,)},
    validate=validate,
)
