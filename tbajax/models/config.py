"""Model configuration: one frozen dataclass for every supported decoder family.

`ModelConfig.from_hf` reads a Hugging Face `config.json` dict (transformers v4 or v5 layout); the
family of its `model_type` (tbajax/models/families/) parses it and refuses anything that would
change the math in a way we do not implement, so an unsupported checkpoint fails loudly instead
of producing silently wrong logits.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import jax.numpy as jnp
import numpy as np

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "smollm3",
                         "granite", "olmo2", "olmo3", "olmoe", "gpt_oss", "phi3", "gemma", "gemma2",
                         "gemma3_text", "gpt_neox", "gpt2")
LAYER_TYPES = ("full_attention", "sliding_attention")
# with a sliding_window
WINDOWED_MODEL_TYPES = ("mistral", "mixtral", "phi3", "gemma2", "gemma3_text", "qwen2", "qwen3", "smollm3",
                        "olmo3", "gpt_oss")
NOPE_MODEL_TYPES = ("smollm3",)  # with layers that take no RoPE (`rope_layers`)
SCALED_MODEL_TYPES = ("granite",)  # with embedding / residual / attention multipliers and logits_scaling
# with a mixture-of-experts MLP (`num_experts`)
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "gpt_oss")
SINK_MODEL_TYPES = ("gpt_oss",)  # with attention sinks and biased, clamped-SwiGLU experts
SOFT_CAPPED_MODEL_TYPES = ("gemma2", "gemma3_text")  # with attn_ / final_logit_softcapping
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
ATTENTION_IMPLEMENTATIONS = ("xla", "cudnn")


class UnsupportedModelError(ValueError):
    """The checkpoint asks for architecture features this decoder does not implement."""


# Multimodal checkpoints whose text model loads on its own (the vision tower is not read, and an
# export is the text model): their model_type -> their text_config's. Gemma 3 4B, 12B and 27B are
# Gemma3ForConditionalGeneration checkpoints.
MULTIMODAL_TEXT_MODELS = {"gemma3": "gemma3_text"}


def text_model_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The config.json of a multimodal checkpoint's text model: its `text_config` with the defaults
    filled in as transformers fills them (published text_configs leave them out), and the token
    ids of the whole model (its top level) where it sets them."""
    from transformers import AutoConfig

    text = dict(hf.get("text_config") or {})
    if not text:
        raise UnsupportedModelError(f"a {hf['model_type']} config.json without a text_config: no text model "
                                    "to load")
    text.pop("model_type", None)
    out = AutoConfig.for_model(MULTIMODAL_TEXT_MODELS[hf["model_type"]], **text).to_dict()
    out.update({k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if hf.get(k) is not None})
    out["architectures"] = []  # a causal LM, whatever the whole model's class
    return out


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling: "linear", "llama3" (Llama 3.x), "longrope" (Phi-3.5 / Phi-4-mini: each
    frequency divided by its short or long factor, the long ones for a call whose longest position
    passes original_max_position_embeddings) or "yarn" (Qwen2.5 / Qwen3 long contexts: frequencies
    between beta_fast and beta_slow rotations over the pretraining length ramp from kept to divided
    by factor); for the last two, cos / sin times attention_factor."""

    rope_type: Literal["linear", "llama3", "longrope", "yarn"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    def to_hf(self) -> dict[str, Any]:
        """The config.json `rope_scaling` / `rope_parameters` entries of this type (without rope_theta)."""
        if self.rope_type == "linear":
            return {"rope_type": "linear", "factor": self.factor}
        if self.rope_type == "llama3":
            return {"rope_type": "llama3", "factor": self.factor, "low_freq_factor": self.low_freq_factor,
                    "high_freq_factor": self.high_freq_factor,
                    "original_max_position_embeddings": self.original_max_position_embeddings}
        if self.rope_type == "yarn":
            return {"rope_type": "yarn", "factor": self.factor, "beta_fast": self.beta_fast,
                    "beta_slow": self.beta_slow, "truncate": self.truncate,
                    "attention_factor": self.attention_factor,
                    "original_max_position_embeddings": self.original_max_position_embeddings}
        return {"rope_type": "longrope", "factor": self.factor, "short_factor": list(self.short_factor),
                "long_factor": list(self.long_factor), "attention_factor": self.attention_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings}



# Up to this many layers "auto" unrolls them: the 10M and 50M train steps (6 and 8 layers) ran
# faster unrolled on a 2-core CPU in about the same compile time (`experiments/benchmarks/
# train_step.py`: `train_step.json` against `train_step_scanned.json`); deeper models keep the
# scan, whose compile time is flat in depth.
UNROLLED_MAX_LAYERS = 8


def check_head_chunk(chunk: Any) -> None:
    """`head_chunk_tokens` is a number of tokens >= 1, "auto" or None (`batch.head_logprobs`)."""
    if chunk not in ("auto", None) and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"head_chunk_tokens={chunk!r}; give a number of tokens >= 1, 'auto' or null")


def scan_layers_for(choice: bool | str, num_layers: int) -> bool:
    """The `scan_layers` a model with `num_layers` gets for True, False or "auto"."""
    if choice == "auto":
        return num_layers > UNROLLED_MAX_LAYERS
    if not isinstance(choice, bool):
        raise ValueError(f"scan_layers={choice!r}; choose true, false or 'auto'")
    return choice


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture (from the checkpoint) plus runtime choices (dtypes, remat, scan_layers, attention,
    head_chunk_tokens)."""

    model_type: Literal["llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "smollm3",
                        "granite", "olmo2", "olmo3", "olmoe", "phi3", "gemma", "gemma2", "gemma3_text",
                        "gpt_neox", "gpt2"]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    layer_norm_eps: float = 1e-5  # GPT-NeoX / GPT-2 LayerNorm
    rotary_pct: float = 1.0  # share of each head's dims that RoPE rotates (GPT-NeoX)
    parallel_residual: bool = False  # GPT-NeoX: x + attn(ln1(x)) + mlp(ln2(x))
    hidden_act: str = "silu"  # "silu" (Llama/Qwen), "gelu" (erf), "gelu_new" / "gelu_pytorch_tanh" (tanh)
    max_position_embeddings: int = 2048
    # Mistral / Phi-3 / Gemma: each query attends to itself and the sliding_window - 1 positions
    # before it (None: every earlier position): by position without a cache, by ring distance over
    # one and by position over its shared prompt part (`serving.cached_pass`).
    sliding_window: int | None = None
    # Gemma 2 / 3, OLMo 3: which layers ("sliding_attention", "full_attention") take the window, and
    # those layers' RoPE base (they take no RoPE scaling); None: every layer alike (`layer_kinds`)
    layer_types: tuple[str, ...] | None = None
    local_rope_theta: float | None = None
    # SmolLM3: which layers rotate their queries and keys (the others, every fourth, take no
    # position signal at all: NoPE); None: every layer (`layer_kinds`)
    rope_layers: tuple[bool, ...] | None = None
    # Gemma: attention scores scaled by query_pre_attn_scalar ** -0.5 rather than head_dim's
    query_pre_attn_scalar: float | None = None
    # Gemma 2: attention scores, and the LM head's logits, soft-capped at these values (cap *
    # tanh(x / cap), `layers.soft_capped`) in every pass: training, scoring, sampling
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Granite: embeddings times embedding_multiplier, each sublayer's output times
    # residual_multiplier before it joins the residual stream, scores scaled by attention_multiplier
    # (None: head_dim ** -0.5), logits divided by logits_scaling
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # Qwen3-MoE / Mixtral: every layer's MLP is `num_experts` SwiGLU experts of width
    # expert_intermediate_size, each token through the top num_experts_per_tok by the router's
    # softmax, renormalised where norm_topk_prob (`tbajax.models.moe`); None: a dense MLP
    num_experts: int | None = None
    num_experts_per_tok: int = 0
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # Qwen2-MoE: a shared SwiGLU expert of this width that every token goes through beside its
    # routed ones, its output gated by sigmoid(x . shared_expert_gate); 0: none
    shared_expert_intermediate_size: int = 0
    # the router's load-balancing loss as the checkpoint's config sets it: transformers adds
    # router_aux_loss_coef x that loss to the training loss where output_router_logits is true
    # (`TrainerConfig.router_aux_loss_coef` None follows it; `moe.load_balancing_loss`)
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.0
    # GPT-OSS: attention sinks (a learned logit per query head in every softmax's denominator:
    # `layers.self_attention`), and experts with biases (router too), gate and up fused, whose
    # activation is the clamped SwiGLU (`moe.clamped_swiglu`; swiglu_limit None: plain SwiGLU)
    attention_sinks: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    # A *ForSequenceClassification checkpoint: a `score` head [hidden, num_labels] instead of
    # the LM head (see tbajax.models.scorer).
    num_labels: int | None = None
    # Runtime choices: not part of the checkpoint.
    param_dtype: str = "float32"
    dtype: str = "float32"
    remat: Literal["none", "full", "dots"] = "none"
    # Scoring and training (no KV cache) apply the layers as one `lax.scan` (compile time flat in
    # depth) or unrolled (each layer its own ops: no stacked residual buffers to zero-fill and slice
    # in the backward, which XLA CPU pays for; compile time grows with depth). `from_hf` (and so
    # `load_model`) also takes "auto": `scan_layers_for`.
    scan_layers: bool = True
    # Attention of the passes without a cache to read (training, scoring, prompt passes): "xla",
    # tbajax's own (`layers.attention`, any platform and dtype), or "cudnn", cuDNN's fused flash
    # attention (`layers.cudnn_attention`: NVIDIA GPUs, bf16/fp16 compute). Decode steps always
    # take tbajax's own attention over the cache.
    attention: Literal["xla", "cudnn"] = "xla"
    # The trainer's vocabulary projection + log-softmax (`batch.head_logprobs`; policy and reference
    # log-probs): tokens per chunk on each device, "auto" (chunks of 1 GiB of fp32 logits, and none
    # when a device's whole share fits in one) or None (all at once). Chunked, no step holds every token's logits and their
    # gradient, for one more vocabulary matmul in the backward. (A searcher's scoring bounds its
    # logits by chunks of rows: `sampling.sampler.score_chunk`.)
    head_chunk_tokens: int | Literal["auto"] | None = "auto"

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type={self.model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name}={getattr(self, name)!r}; choose one of {sorted(DTYPES)}")
        if not isinstance(self.scan_layers, bool):
            raise ValueError(f"scan_layers={self.scan_layers!r}; a ModelConfig takes True or False "
                             "('auto' is resolved by ModelConfig.from_hf / load_model)")
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"attention={self.attention!r}; choose one of {ATTENTION_IMPLEMENTATIONS}")
        if self.attention == "cudnn" and self.dtype not in ("bfloat16", "float16"):
            raise ValueError(f"attention='cudnn' computes in bfloat16 or float16, and dtype={self.dtype!r}: "
                             "set dtype=bfloat16 (model.dtype) or keep attention='xla'")
        check_head_chunk(self.head_chunk_tokens)
        if self.remat not in ("none", "full", "dots"):
            raise ValueError(f"remat={self.remat!r}; choose 'none', 'full' or 'dots'")
        if self.hidden_act not in ("silu", "gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise UnsupportedModelError(
                f"hidden_act={self.hidden_act!r} is not supported; supported: silu, gelu, gelu_new, "
                "gelu_pytorch_tanh"
            )
        if not 0.0 < self.rotary_pct <= 1.0 or self.rotary_dim % 2:
            raise UnsupportedModelError(
                f"rotary_pct={self.rotary_pct} gives {self.rotary_dim} rotary dims of head_dim "
                f"{self.head_dim}; it must be in (0, 1] and give an even number of dims"
            )
        if self.sliding_window is not None:
            if isinstance(self.sliding_window, bool) or self.sliding_window < 1:
                raise ValueError(f"sliding_window={self.sliding_window!r} must be a number of positions >= 1 "
                                 "or None")
            if self.model_type not in WINDOWED_MODEL_TYPES:
                raise UnsupportedModelError(f"sliding_window is read and written for {WINDOWED_MODEL_TYPES} "
                                            f"checkpoints, not {self.model_type}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(LAYER_TYPES):
                raise UnsupportedModelError(f"layer_types={self.layer_types!r}: one of {LAYER_TYPES} for "
                                            f"each of the {self.num_layers} layers")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise UnsupportedModelError("layer_types has sliding_attention layers and sliding_window is "
                                            "None")
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            cap = getattr(self, name)
            if cap is None:
                continue
            if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
                raise ValueError(f"{name}={cap!r} must be a number > 0 or None")
            if self.model_type not in SOFT_CAPPED_MODEL_TYPES:
                raise UnsupportedModelError(f"{name} is read and written for {SOFT_CAPPED_MODEL_TYPES} "
                                            f"checkpoints, not {self.model_type}")
        sinks_or_clamp = self.attention_sinks or self.swiglu_limit is not None
        if sinks_or_clamp and self.model_type not in SINK_MODEL_TYPES:
            raise UnsupportedModelError(f"attention_sinks and swiglu_limit are read and written for "
                                        f"{SINK_MODEL_TYPES} checkpoints, not {self.model_type}")
        if self.attention == "cudnn" and self.attention_sinks:
            raise ValueError("attention='cudnn' has no attention sinks, and this model has them (GPT-OSS): "
                             "keep attention='xla'")
        if self.attention == "cudnn" and self.attn_logit_softcapping is not None:
            raise ValueError(f"attention='cudnn' has no score soft-capping, and this model soft-caps its "
                             f"scores (attn_logit_softcapping={self.attn_logit_softcapping}): keep "
                             "attention='xla'")
        scales = {"embedding_multiplier": 1.0, "residual_multiplier": 1.0, "attention_multiplier": None,
                  "logits_scaling": 1.0}
        changed = [name for name, plain in scales.items() if getattr(self, name) != plain]
        if changed and self.model_type not in SCALED_MODEL_TYPES:
            raise UnsupportedModelError(f"{', '.join(changed)} read and written for {SCALED_MODEL_TYPES} "
                                        f"checkpoints, not {self.model_type}")
        if self.logits_scaling == 0:
            raise ValueError("logits_scaling=0: the logits are divided by it")
        if self.num_experts is not None:
            if self.model_type not in MOE_MODEL_TYPES:
                raise UnsupportedModelError(f"num_experts (a mixture-of-experts MLP) is read and written for "
                                            f"{MOE_MODEL_TYPES} checkpoints, not {self.model_type}")
            if self.shared_expert_intermediate_size and self.model_type != "qwen2_moe":
                raise UnsupportedModelError(f"a shared expert is read and written for qwen2_moe checkpoints, "
                                            f"not {self.model_type}")
            if not 1 <= self.num_experts_per_tok <= self.num_experts or self.expert_intermediate_size < 1:
                raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} of num_experts="
                                 f"{self.num_experts} experts of width {self.expert_intermediate_size}: give "
                                 "1 <= k <= experts and a width >= 1")
        if self.rope_layers is not None:
            if len(self.rope_layers) != self.num_layers:
                raise UnsupportedModelError(f"rope_layers has {len(self.rope_layers)} entries for "
                                            f"{self.num_layers} layers")
            if self.model_type not in NOPE_MODEL_TYPES:
                raise UnsupportedModelError(f"rope_layers (layers without RoPE) is read and written for "
                                            f"{NOPE_MODEL_TYPES} checkpoints, not {self.model_type}")
        s = self.rope_scaling
        if s is not None and s.rope_type == "longrope":
            if not len(s.short_factor) == len(s.long_factor) == self.rotary_dim // 2:
                raise UnsupportedModelError(
                    f"longrope has {len(s.short_factor)} short and {len(s.long_factor)} long factors; "
                    f"{self.rotary_dim} rotary dims need {self.rotary_dim // 2} of each")
        if self.num_labels is not None and self.num_labels < 1:
            raise ValueError(f"num_labels={self.num_labels} must be >= 1")
        from tbajax.models.families import family_for

        family_for(self.model_type).check(self)

    @property
    def jnp_param_dtype(self) -> Any:
        return DTYPES[self.param_dtype]

    @property
    def jnp_dtype(self) -> Any:
        return DTYPES[self.dtype]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates (all of them except for partial-rotary GPT-NeoX)."""
        return int(self.head_dim * self.rotary_pct)

    def layer_kinds(self) -> tuple[tuple["ModelConfig", ...], tuple[int, ...]]:
        """The configs the layers differ by, and each layer's index into them: one for a model
        whose layers are alike; with `layer_types`, one for the full-attention layers (no window)
        and one for the sliding ones (the window, and `local_rope_theta` unscaled if set); with
        `rope_layers`, the NoPE layers' apart (`without_rope`). A family's block and position
        tables take its layer's config."""
        n = self.num_layers
        if self.layer_types is None and self.rope_layers is None:
            return (self,), (0,) * n
        layers = list(zip(self.layer_types or ("full_attention",) * n, self.rope_layers or (True,) * n))
        keys = sorted(set(layers), key=lambda k: (LAYER_TYPES.index(k[0]), not k[1]))
        configs = []
        for layer_type, rope in keys:
            kind = dataclasses.replace(self, layer_types=None, local_rope_theta=None,
                                       rope_layers=None if rope else (False,) * n)
            if layer_type == "full_attention":
                kind = dataclasses.replace(kind, sliding_window=None)
            elif self.local_rope_theta is not None:
                kind = dataclasses.replace(kind, rope_theta=self.local_rope_theta, rope_scaling=None)
            configs.append(kind)
        return tuple(configs), tuple(keys.index(k) for k in layers)

    @property
    def query_scale(self) -> float | None:
        """What the queries are multiplied by so that attention's head_dim ** -0.5 scales the scores
        as this model does (Granite's attention_multiplier, Gemma's query_pre_attn_scalar ** -0.5);
        None where the model's scale is head_dim ** -0.5."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier * self.head_dim**0.5
        if self.query_pre_attn_scalar is not None and self.query_pre_attn_scalar != self.head_dim:
            return (self.head_dim / self.query_pre_attn_scalar) ** 0.5
        return None

    @property
    def without_rope(self) -> bool:
        """No layer of this config rotates its queries and keys (a NoPE kind of `layer_kinds`)."""
        return self.rope_layers is not None and not any(self.rope_layers)

    def fits_window(self, length: int) -> bool:
        """Whether a sequence of `length` tokens is within the sliding window (always without one)."""
        return self.sliding_window is None or length <= self.sliding_window

    def params_per_layer(self) -> int:
        """Parameters of one decoder layer (2x this: its weight FLOPs per token)."""
        from tbajax.models.families import family_for

        return sum(math.prod(s.shape) for s in family_for(self.model_type).layer_params(self).values())

    def layers_forward_flops(self, slots: float, pairs: float, attention_weight: float = 1.0) -> float:
        """Estimated FLOPs of the decoder layers' forward over `slots` tokens whose attention
        computes `pairs` (query, key) products: each layer's weights twice per token, and
        4 x heads x head_dim per pair, weighted by `attention_weight` (attention's many small
        products run below the weight products' rate). The one cost rule behind the choices
        between row and packed layouts (`training.layout.step_cost`,
        `sampling.sampler.packing_is_cheaper`)."""
        pair = 4 * self.num_heads * self.head_dim
        return self.num_layers * (slots * 2 * self.params_per_layer() + attention_weight * pairs * pair)

    def num_params(self) -> int:
        from tbajax.models.families import family_for

        top = sum(math.prod(s.shape) for s in family_for(self.model_type).top_params(self).values())
        layer = self.params_per_layer()
        if self.num_labels is not None:
            head = self.hidden_size * self.num_labels
        else:
            head = 0 if self.tie_word_embeddings else self.hidden_size * self.vocab_size
        return top + self.num_layers * layer + head

    # ------------------------------------------------------------------ HF conversion

    @classmethod
    def from_hf(cls, hf: dict[str, Any], **runtime: Any) -> "ModelConfig":
        """Build from a `config.json` dict; `runtime` sets param_dtype / dtype / remat / scan_layers /
        attention / head_chunk_tokens.

        The family of `model_type` parses (and validates) the architecture; a
        `*ForSequenceClassification` checkpoint also sets `num_labels` (a score head, no LM head).
        """
        from tbajax.models.families import family_for, supported_model_types

        if hf.get("model_type") in MULTIMODAL_TEXT_MODELS:
            hf = text_model_config(hf)
        model_type = hf.get("model_type")
        try:
            family = family_for(model_type)
        except KeyError:
            raise UnsupportedModelError(
                f"config.json has model_type={model_type!r}; tbajax supports {supported_model_types()}"
            ) from None
        _check_quantization(hf)
        fields = family.parse_hf(hf)
        archs = hf.get("architectures") or []
        if any(a.endswith("ForSequenceClassification") for a in archs):
            fields["num_labels"] = int(hf.get("num_labels") or len(hf.get("id2label") or {}) or 2)
        eos = hf.get("eos_token_id")
        fields.update(
            model_type=model_type,
            initializer_range=float(hf.get("initializer_range", 0.02)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            pad_token_id=hf.get("pad_token_id"),
        )
        if "scan_layers" in runtime:
            runtime["scan_layers"] = scan_layers_for(runtime["scan_layers"], fields["num_layers"])
        return cls(**fields, **runtime)

    def to_hf(self) -> dict[str, Any]:
        """A `config.json` dict that transformers (v4 and v5) and vLLM load."""
        from tbajax.models.families import family_for

        family = family_for(self.model_type)
        causal, classifier = family.architectures[self.model_type]
        out: dict[str, Any] = {"architectures": [causal], "model_type": self.model_type}
        out.update(family.to_hf(self))
        out.update(
            initializer_range=self.initializer_range,
            bos_token_id=self.bos_token_id,
            eos_token_id=list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            pad_token_id=self.pad_token_id,
            torch_dtype=self.param_dtype,
            use_cache=True,
        )
        if self.num_labels is not None:
            out["architectures"] = [classifier]
            out["id2label"] = {str(i): f"LABEL_{i}" for i in range(self.num_labels)}
            out["label2id"] = {f"LABEL_{i}": i for i in range(self.num_labels)}
        return out


def _check_quantization(hf: dict[str, Any]) -> None:
    """Quantized checkpoints load only where tbajax dequantizes them: GPT-OSS's MXFP4 experts
    (`tbajax.models.mxfp4`). Others (GPTQ, AWQ, bitsandbytes, FP8, ...) hold packed integer
    weights that would not fit the unquantized layout: refused here, naming what to do."""
    quant = hf.get("quantization_config")
    if not quant:
        return
    method = quant.get("quant_method")
    if method == "mxfp4" and hf.get("model_type") == "gpt_oss":
        return
    raise UnsupportedModelError(
        f"config.json has quantization_config with quant_method={method!r} ({hf.get('model_type')}): tbajax "
        "trains unquantized weights and reads no quantized checkpoint but GPT-OSS's MXFP4 experts; load "
        "the unquantized model, or dequantize it first (transformers: from_pretrained, then "
        "save_pretrained without a quantization_config)")


def _parse_rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """Accept both the v5 `rope_parameters` and the v4 `rope_theta` + `rope_scaling` layouts."""
    params = hf.get("rope_parameters")
    if params:
        theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
        scaling = dict(params)
    else:
        theta = float(hf.get("rope_theta", 10000.0))
        scaling = dict(hf.get("rope_scaling") or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope scaling type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(scaling["factor"]))
    if rope_type == "longrope":
        return theta, _longrope(hf, scaling)
    if rope_type == "yarn":
        return theta, _yarn(hf, scaling)
    return theta, RopeScaling(
        "llama3",
        float(scaling["factor"]),
        float(scaling.get("low_freq_factor", 1.0)),
        float(scaling.get("high_freq_factor", 4.0)),
        int(scaling.get("original_max_position_embeddings", 8192)),
    )


def _lengths(hf: dict[str, Any], scaling: dict[str, Any]) -> tuple[int, float]:
    """(the pretraining length, the factor) of a LongRoPE or YaRN config as transformers reads them:
    the length from the top level first (Phi-3 keeps it there), then the scaling dict; the factor,
    unless given, max_position_embeddings / that length."""
    original = int(hf.get("original_max_position_embeddings")
                   or scaling.get("original_max_position_embeddings") or hf["max_position_embeddings"])
    return original, float(scaling.get("factor") or int(hf["max_position_embeddings"]) / original)


def _longrope(hf: dict[str, Any], scaling: dict[str, Any]) -> RopeScaling:
    """LongRoPE as transformers reads it; attention_factor, unless given, from the factor."""
    original, factor = _lengths(hf, scaling)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling("longrope", factor, original_max_position_embeddings=original,
                       short_factor=tuple(float(x) for x in scaling["short_factor"]),
                       long_factor=tuple(float(x) for x in scaling["long_factor"]),
                       attention_factor=float(attention))


def _yarn(hf: dict[str, Any], scaling: dict[str, Any]) -> RopeScaling:
    """YaRN as transformers reads it (DeepSeek's mscale / mscale_all_dim into the attention factor)."""
    original, factor = _lengths(hf, scaling)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return RopeScaling("yarn", factor, original_max_position_embeddings=original,
                       attention_factor=float(attention), beta_fast=float(scaling.get("beta_fast") or 32),
                       beta_slow=float(scaling.get("beta_slow") or 1),
                       truncate=bool(scaling.get("truncate", True)))


def _yarn_inv_freq(inv: np.ndarray, s: RopeScaling, dim: int, base: float) -> np.ndarray:
    """YaRN's blend: frequencies that turn more than beta_fast times over the pretraining length
    are kept, fewer than beta_slow times divided by the factor, a linear ramp between."""
    def correction_dim(rotations: float) -> float:
        turns = s.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(turns) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    kept = 1 - ramp
    return inv / s.factor * (1 - kept) + inv * kept


def rope_inv_freq(cfg: ModelConfig, long: bool = False) -> np.ndarray:
    """Inverse RoPE frequencies (float64 numpy, then used as constants) incl. Llama-3 scaling, and
    LongRoPE's with its short factors (or `long` ones)."""
    hd = cfg.rotary_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    s = cfg.rope_scaling
    if s is None:
        return inv
    if s.rope_type == "linear":
        return inv / s.factor
    if s.rope_type == "longrope":
        return inv / np.asarray(s.long_factor if long else s.short_factor, np.float64)
    if s.rope_type == "yarn":
        return _yarn_inv_freq(inv, s, hd, cfg.rope_theta)
    # Llama 3.x: long wavelengths are slowed by `factor`, short ones kept, the band between
    # is interpolated smoothly in 1/wavelength.
    wavelen = 2 * math.pi / inv
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return np.where(medium, (1 - smooth) * inv / s.factor + smooth * inv, scaled)
