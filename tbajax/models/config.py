"""Model configuration: one frozen dataclass for every supported decoder family.

`ModelConfig.from_hf` reads a Hugging Face `config.json` dict (transformers v4 or v5 layout) and
refuses anything that would change the math in a way this decoder does not implement, so an
unsupported checkpoint fails loudly instead of producing silently wrong logits.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import jax.numpy as jnp
import numpy as np

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class UnsupportedModelError(ValueError):
    """The checkpoint asks for architecture features this decoder does not implement."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    rope_type: Literal["linear", "llama3"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture (from the checkpoint) plus runtime choices (dtypes, remat)."""

    model_type: Literal["llama", "qwen2", "qwen3"]
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
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    # Runtime choices: not part of the checkpoint.
    param_dtype: str = "float32"
    dtype: str = "float32"
    remat: Literal["none", "full", "dots"] = "none"

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
        if self.remat not in ("none", "full", "dots"):
            raise ValueError(f"remat={self.remat!r}; choose 'none', 'full' or 'dots'")

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

    def num_params(self) -> int:
        d, f, l = self.hidden_size, self.intermediate_size, self.num_layers
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = d * (q + 2 * kv) + q * d + 3 * d * f + 2 * d
        per_layer += (q + 2 * kv) * self.qkv_bias + d * self.o_bias + 2 * self.head_dim * self.qk_norm
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return l * per_layer + emb + d

    # ------------------------------------------------------------------ HF conversion

    @classmethod
    def from_hf(cls, hf: dict[str, Any], **runtime: Any) -> "ModelConfig":
        """Build from a `config.json` dict; `runtime` sets param_dtype / dtype / remat."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"config.json has model_type={model_type!r}; tbajax supports {SUPPORTED_MODEL_TYPES}"
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act={act!r} is not supported (only 'silu')")
        if hf.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias=true is not supported")
        if hf.get("use_sliding_window"):
            raise UnsupportedModelError(
                "use_sliding_window=true changes attention; sliding-window attention is not "
                "implemented (set use_sliding_window=false only if every sequence fits the window)"
            )
        layer_types = hf.get("layer_types")
        if layer_types and any(t != "full_attention" for t in layer_types):
            raise UnsupportedModelError(
                f"layer_types {sorted(set(layer_types))} are not supported (only full_attention)"
            )
        theta, scaling = _parse_rope(hf)
        num_heads = int(hf["num_attention_heads"])
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        attention_bias = bool(hf.get("attention_bias", False))
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = attention_bias
        eos = hf.get("eos_token_id")
        return cls(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=model_type == "qwen3",
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            initializer_range=float(hf.get("initializer_range", 0.02)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            pad_token_id=hf.get("pad_token_id"),
            **runtime,
        )

    def to_hf(self) -> dict[str, Any]:
        """A `config.json` dict that transformers (v4 and v5) and vLLM load."""
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
        out: dict[str, Any] = {
            "architectures": [arch[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dataclasses.asdict(self.rope_scaling) if self.rope_scaling else None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": self.initializer_range,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id)
            if isinstance(self.eos_token_id, tuple)
            else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": self.param_dtype,
            "use_cache": True,
        }
        if self.model_type in ("llama", "qwen3"):
            out["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            out["mlp_bias"] = False
        if self.model_type in ("qwen2", "qwen3"):
            out["use_sliding_window"] = False
            out["sliding_window"] = None
            out["max_window_layers"] = self.num_layers
        return out


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
    return theta, RopeScaling(
        "llama3",
        float(scaling["factor"]),
        float(scaling.get("low_freq_factor", 1.0)),
        float(scaling.get("high_freq_factor", 4.0)),
        int(scaling.get("original_max_position_embeddings", 8192)),
    )


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse RoPE frequencies (float64 numpy, then used as constants) incl. Llama-3 scaling."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    s = cfg.rope_scaling
    if s is None:
        return inv
    if s.rope_type == "linear":
        return inv / s.factor
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
