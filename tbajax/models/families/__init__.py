"""Decoder families: one module each, behind the shared skeleton in `tbajax.models.decoder`.

A family says everything that differs between architectures, in one place:
  - `parse_hf(hf)`: config.json -> ModelConfig fields (refusing what it does not implement),
  - `to_hf(cfg)`: ModelConfig -> config.json,
  - `top_params(cfg)` / `layer_params(cfg)`: parameter shapes with logical axes and init,
  - `hf_mappings(cfg)`: our parameter name <-> HF tensor name and layout,
  - `embed(cfg, params, tokens, positions)`, `position_tables(cfg, positions)`,
    `block(cfg, p, x, tables, mask, cache)`, `final_norm(cfg, params, x)`: the math.
The skeleton (embedding, `lax.scan` over stacked layers, remat, KV cache, logits) is shared.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from tbajax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter: logical axes (sharding), shape, and init ("normal" | "ones" | "zeros")."""

    axes: tuple[str | None, ...]
    shape: tuple[int, ...]
    init: str = "normal"


@dataclasses.dataclass(frozen=True)
class Mapping:
    """Our parameter <-> one HF tensor. hf_name may contain {i} (layer index); `aliases` are other
    names the same tensor has in older/newer checkpoints (read only; export writes hf_name)."""

    hf_name: str
    to_ours: Callable[[np.ndarray, "ModelConfig"], np.ndarray]
    to_hf: Callable[[np.ndarray, "ModelConfig"], np.ndarray]
    aliases: tuple[str, ...] = ()


def identity(a: np.ndarray, c: Any) -> np.ndarray:
    return a


def transposed(hf_name: str, *aliases: str) -> Mapping:
    """HF Linear [out, in] <-> ours [in, out]."""
    return Mapping(hf_name, lambda a, c: a.T, lambda a, c: a.T, aliases)


def same(hf_name: str, *aliases: str) -> Mapping:
    return Mapping(hf_name, identity, identity, aliases)


def matrix_decode_layout(
    layer_params: Callable[[ModelConfig], dict[str, ParamSpec]], products: tuple[str, ...]
) -> tuple[Callable[..., dict[str, Any]], Callable[..., dict[str, Any]]]:
    """(decode_layout, undo_decode_layout) for a family whose fused qkv_proj and o_proj weights
    have head axes: the sampler holds both as matrices (`layers.decode_matrix_product` reads
    either layout), and its products output-major (`layers.orient_for_decode`)."""
    from tbajax.models import layers as L

    def layout(cfg: ModelConfig, p: dict[str, Any]) -> dict[str, Any]:
        d = cfg.hidden_size
        p = dict(p, qkv_proj=p["qkv_proj"].reshape(d, -1), o_proj=p["o_proj"].reshape(-1, d))
        return L.orient_for_decode(p, products)

    def undo(cfg: ModelConfig, p: dict[str, Any]) -> dict[str, Any]:
        p, shapes = L.undo_orient(p), layer_params(cfg)
        return dict(p, **{n: p[n].reshape(shapes[n].shape) for n in ("qkv_proj", "o_proj")})

    return layout, undo


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    # model_type -> (causal LM, sequence classifier) HF class names, written to config.json
    architectures: dict[str, tuple[str, str]]
    base_prefix: str  # the backbone's module name in HF checkpoints ("model.", "transformer.")
    parse_hf: Callable[[dict[str, Any]], dict[str, Any]]
    to_hf: Callable[["ModelConfig"], dict[str, Any]]
    top_params: Callable[["ModelConfig"], dict[str, ParamSpec]]
    layer_params: Callable[["ModelConfig"], dict[str, ParamSpec]]
    hf_mappings: Callable[["ModelConfig"], dict[str, Mapping]]
    embed: Callable[..., Any]
    position_tables: Callable[..., Any]
    block: Callable[..., Any]
    final_norm: Callable[..., Any]
    # derived state some checkpoints carry (causal-mask buffers, rotary caches): not weights
    ignored_suffixes: tuple[str, ...] = ()
    # ModelConfig field -> the values this family implements (checked on construction, so a
    # hand-built config cannot silently mix families, e.g. GPT-2 with SiLU)
    fixed: dict[str, tuple[Any, ...]] = dataclasses.field(default_factory=dict)
    validate: Callable[["ModelConfig"], None] | None = None  # any further family-specific check
    # one layer's weights -> the same weights laid out for decoding a few rows (e.g. projections
    # that read the same input concatenated into one matmul); `block` accepts both layouts
    grouped_query_attention: bool = False  # num_kv_heads may be fewer than num_heads
    decode_layout: Callable[["ModelConfig", dict[str, Any]], dict[str, Any]] | None = None
    undo_decode_layout: Callable[["ModelConfig", dict[str, Any]], dict[str, Any]] | None = None  # its inverse

    def __post_init__(self) -> None:
        if (self.decode_layout is None) != (self.undo_decode_layout is None):
            raise ValueError(f"family {self.name}: decode_layout and undo_decode_layout come together")

    def check(self, cfg: "ModelConfig") -> None:
        from tbajax.models.config import UnsupportedModelError

        for field, allowed in self.fixed.items():
            value = getattr(cfg, field)
            if value not in allowed:
                raise UnsupportedModelError(
                    f"{cfg.model_type} needs {field} in {allowed}, got {value!r}"
                )
        if self.validate is not None:
            self.validate(cfg)
        if cfg.num_heads != cfg.num_kv_heads and not self.grouped_query_attention:
            raise UnsupportedModelError(
                f"{cfg.model_type} has no grouped-query attention: num_kv_heads={cfg.num_kv_heads} "
                f"must equal num_heads={cfg.num_heads}"
            )


def family_for(model_type: str) -> Family:
    """The family implementing `model_type` (imported lazily: families import the config)."""
    for fam in _families():
        if model_type in fam.model_types:
            return fam
    raise KeyError(model_type)


def supported_model_types() -> tuple[str, ...]:
    return tuple(t for fam in _families() for t in fam.model_types)


def _families() -> tuple[Family, ...]:
    from tbajax.models.families import (gemma, gemma2, gemma3, gpt2, gpt_neox, gpt_oss, llama, olmo2, olmoe,
                                        phi3)

    return (llama.FAMILY, olmo2.FAMILY, olmoe.FAMILY, gpt_oss.FAMILY, phi3.FAMILY, gemma.FAMILY,
            gemma2.FAMILY, gemma3.FAMILY, gpt_neox.FAMILY, gpt2.FAMILY)
