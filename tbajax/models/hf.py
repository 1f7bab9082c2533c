"""Hugging Face checkpoints in and out: config.json + safetensors <-> our stacked NNX params.

Import builds every parameter directly in its target sharding with
`jax.make_array_from_callback`: each device's callback reads only the slice it owns from the
memory-mapped safetensors files, so no device (and no host buffer) ever holds the whole model.
Export writes files that `transformers.AutoModelForCausalLM.from_pretrained` (and vLLM) load.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from tbajax.models.config import ModelConfig, UnsupportedModelError
from tbajax.models.decoder import CausalLM, head_params, layer_param_names
from tbajax.models.families import Mapping, family_for, identity, transposed
from tbajax.models.locate import TOKENIZER_FILES, resolve_checkpoint
from tbajax.models.mxfp4 import DequantizingReader
from tbajax.models.safetensors_io import CheckpointError, SafetensorsReader, write_sharded
from tbajax.sharding import param_shardings

log = logging.getLogger(__name__)



def _mappings(cfg: ModelConfig) -> dict[str, Mapping]:
    """Our parameter name ("embed_tokens", "layers.q_proj", ...) -> its HF tensor, for the
    parameters this config has."""
    family = family_for(cfg.model_type)
    table = dict(family.hf_mappings(cfg))
    table["score"] = transposed("score.weight")
    wanted = set(family.top_params(cfg)) | set(head_params(cfg))
    wanted |= {f"layers.{n}" for n in layer_param_names(cfg)}
    return {k: v for k, v in table.items() if k in wanted}


# Where a multimodal checkpoint (`config.MULTIMODAL_TEXT_MODELS`) keeps its text model: under
# language_model.model. with its head as language_model.lm_head. (transformers 4.5x, and 5.25's
# save_pretrained of Gemma3ForConditionalGeneration), or under model.language_model. (v5's module
# names); the text model's names are rewritten to those, and the vision tower and projector are
# not read.
_NESTED_TEXT = {
    "model.language_model.": {"model.": "model.language_model."},
    "language_model.model.": {"model.": "language_model.model.", "lm_head.": "language_model.lm_head."},
}


class _Names:
    """Resolves the HF names a mapping asks for to the names this checkpoint uses: the first of
    hf_name/aliases present, bare backbone names for checkpoints saved from the base model
    (e.g. the original `gpt2` files: "h.0.attn.c_attn.weight", no "transformer." prefix), and the
    text model's names inside a multimodal checkpoint (`_NESTED_TEXT`)."""

    def __init__(self, reader: SafetensorsReader, cfg: ModelConfig):
        prefix = family_for(cfg.model_type).base_prefix
        keys = reader.keys()
        self.reader = reader
        self.nested = next((renames for outer, renames in _NESTED_TEXT.items()
                            if any(k.startswith(outer) for k in keys)), None)
        self.strip = bool(keys) and self.nested is None and not any(k.startswith(prefix) for k in keys)
        self.prefix = prefix

    def nest(self, name: str) -> str:
        """`name` as the multimodal checkpoint holding this text model spells it (as is otherwise)."""
        for old, new in (self.nested or {}).items():
            if name.startswith(old):
                return new + name[len(old):]
        return name

    def in_text_model(self, name: str) -> bool:
        return self.nested is None or name.startswith(tuple(self.nested.values()))

    def _candidates(self, m: Mapping, i: int | None, j: int | None = None) -> list[str]:
        names = [self.nest(n.format(i=i, j=j)) for n in (m.hf_name, *m.aliases)]
        if self.strip:
            names = [n[len(self.prefix) :] if n.startswith(self.prefix) else n for n in names]
        return names

    def resolve(self, m: Mapping, i: int | None, j: int | None = None) -> str:
        names = self._candidates(m, i, j)
        return next((n for n in names if n in self.reader), names[0])

    def all(self, m: Mapping, i: int | None, experts: int | None) -> list[str]:
        """The tensor names of one layer's weight: one, or one per expert ({j}) stacked."""
        if "{j}" not in m.hf_name:
            return [self.resolve(m, i)]
        return [self.resolve(m, i, j) for j in range(experts or 0)]


# ----------------------------------------------------------------------------- locating


def load_config(source: str | os.PathLike[str], **runtime: Any) -> ModelConfig:
    directory = resolve_checkpoint(source)
    return ModelConfig.from_hf(json.loads((directory / "config.json").read_text()), **runtime)


# ----------------------------------------------------------------------------- import


def abstract_model(cfg: ModelConfig) -> CausalLM:
    return nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))


def load_model(
    source: str | os.PathLike[str],
    *,
    mesh: Mesh | None = None,
    config: ModelConfig | None = None,
    **runtime: Any,
) -> CausalLM:
    """Load an HF causal-LM checkpoint (dir or hub id) straight into its sharding on `mesh`.

    runtime: param_dtype / dtype / remat / scan_layers / attention, passed to `ModelConfig.from_hf`.
    """
    directory = resolve_checkpoint(source)
    cfg = config or ModelConfig.from_hf(json.loads((directory / "config.json").read_text()), **runtime)
    if cfg.num_labels is not None:
        raise UnsupportedModelError(
            f"{directory} is a sequence-classification checkpoint (num_labels={cfg.num_labels}, "
            "a `score` head, no LM head); load it with tbajax.models.load_scorer"
        )
    return load_weights(directory, cfg, mesh)


def load_weights(directory: str | os.PathLike[str], cfg: ModelConfig, mesh: Mesh | None = None) -> CausalLM:
    """The weights of a local checkpoint directory as a `CausalLM` of `cfg` (whatever its head:
    LM head, tied, or a `score` head), each parameter built directly in its sharding on `mesh`.
    MXFP4 tensors (GPT-OSS's experts) are read dequantized (`mxfp4.DequantizingReader`)."""
    directory = Path(directory)
    reader = DequantizingReader(SafetensorsReader(directory))
    graphdef, abstract = nnx.split(abstract_model(cfg))
    shardings = (
        param_shardings(abstract, mesh)
        if mesh is not None
        else jax.tree.map(
            lambda v: SingleDeviceSharding(jax.devices()[0]),
            abstract,
            is_leaf=lambda v: isinstance(v, nnx.Variable),
        )
    )
    mappings = _mappings(cfg)
    names = _Names(reader, cfg)
    _check_unused(reader, cfg, mappings, names)

    def build(path: tuple[Any, ...], var: nnx.Variable, sharding: Any) -> nnx.Variable:
        name = ".".join(str(getattr(k, "key", k)) for k in path)
        m = mappings[name]
        dtype = np.dtype(var.dtype)
        layered = name.startswith("layers.")
        expected = var.shape[1:] if layered else var.shape

        per_expert = "{j}" in m.hf_name  # one HF tensor per expert, stacked on our leading axis
        each = expected[1:] if per_expert else expected

        def one(hf_name: str, shape_only: bool = False) -> np.ndarray:
            # shape_only: zeros of the tensor's shape (checked without reading or dequantizing it)
            raw = np.zeros(reader.shape(hf_name), np.float32) if shape_only else reader.get(hf_name)
            try:
                out = m.to_ours(raw, cfg)
            except ValueError:
                out = None
            if out is None or out.shape != each:
                raise CheckpointError(
                    f"tensor {hf_name!r} has shape {raw.shape} but config.json implies "
                    f"{tuple(m.to_hf(np.empty(each, np.float32), cfg).shape)} "
                    f"(in {reader.directory})"
                )
            return out

        def tensor(i: int | None, shape_only: bool = False) -> np.ndarray:
            parts = [one(n, shape_only) for n in names.all(m, i, cfg.num_experts)]
            return np.stack(parts) if per_expert else parts[0]

        for i in range(cfg.num_layers) if layered else [None]:
            tensor(i, shape_only=True)  # validate every shape before any device transfer

        def part(i: int | None, index: tuple[slice, ...]) -> np.ndarray:
            """tensor(i)[index]; read as that part alone where our layout is the checkpoint's, so
            that a dequantized tensor (`mxfp4`) is dequantized only where a device holds it."""
            if m.to_ours is identity and not per_expert:
                return reader.get(names.resolve(m, i), index)
            return tensor(i)[index]

        def callback(index: tuple[slice, ...]) -> np.ndarray:
            if not layered:
                return np.asarray(part(None, index), dtype=dtype)
            layers = range(cfg.num_layers)[index[0]]
            return np.stack([np.asarray(part(i, index[1:]), dtype=dtype) for i in layers])

        return var.replace(jax.make_array_from_callback(var.shape, sharding, callback))

    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=lambda v: isinstance(v, nnx.Variable))
    flat_shardings = jax.tree.leaves(shardings, is_leaf=lambda v: isinstance(v, jax.sharding.Sharding))
    state = jax.tree_util.tree_unflatten(
        treedef, [build(p, v, s) for (p, v), s in zip(flat, flat_shardings)]
    )
    return nnx.merge(graphdef, state)


def _check_unused(
    reader: SafetensorsReader, cfg: ModelConfig, mappings: dict[str, Mapping], names: _Names
) -> None:
    expected = set()
    for name, m in mappings.items():
        for i in range(cfg.num_layers) if name.startswith("layers.") else [None]:
            expected |= set(names.all(m, i, cfg.num_experts))
    ignored = family_for(cfg.model_type).ignored_suffixes
    tied_heads = ("lm_head.weight", "embed_out.weight", names.nest("lm_head.weight"))
    extra = [
        k
        for k in reader.keys()
        if k not in expected
        and names.in_text_model(k)  # a multimodal checkpoint's vision tower is not read
        and not k.endswith(ignored)
        and not (k in tied_heads and cfg.tie_word_embeddings)
    ]
    if names.nested is not None:
        skipped = sum(not names.in_text_model(k) for k in reader.keys())
        log.info("%s: the text model of a multimodal checkpoint (%d other tensors, its vision tower and "
                 "projector, not read)", reader.directory, skipped)
    if extra:
        hint = ""
        if cfg.num_labels is None and any(k.startswith("score.") for k in extra):
            hint = " (a `score` head: is it a *ForSequenceClassification checkpoint? use load_scorer)"
        raise CheckpointError(
            f"checkpoint {reader.directory} has {len(extra)} tensors this config does not use "
            f"(e.g. {extra[:3]}); config.json and weights disagree about the architecture{hint}"
        )


# ----------------------------------------------------------------------------- export


def hf_tensors(model: CausalLM, dtype: str | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, host array) pairs, one tensor gathered at a time."""
    cfg = model.config
    np_dtype = np.dtype(ml_dtypes.bfloat16) if (dtype or cfg.param_dtype) == "bfloat16" else np.dtype(dtype or cfg.param_dtype)
    state = nnx.state(model, nnx.Param)
    flat = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda v: isinstance(v, nnx.Variable))[0]
    mappings = _mappings(cfg)
    for path, var in flat:
        name = ".".join(str(getattr(k, "key", k)) for k in path)
        m = mappings[name]
        host = np.asarray(jax.device_get(var[...]))
        if name.startswith("layers.") and "{j}" in m.hf_name:  # one tensor per expert
            for i in range(cfg.num_layers):
                for j in range(host.shape[1]):
                    yield (m.hf_name.format(i=i, j=j),
                           np.ascontiguousarray(m.to_hf(host[i, j], cfg)).astype(np_dtype))
        elif name.startswith("layers."):
            for i in range(cfg.num_layers):
                yield m.hf_name.format(i=i), np.ascontiguousarray(m.to_hf(host[i], cfg)).astype(np_dtype)
        else:
            yield m.hf_name, np.ascontiguousarray(m.to_hf(host, cfg)).astype(np_dtype)


def save_model(
    model: CausalLM,
    directory: str | os.PathLike[str],
    *,
    dtype: str | None = None,
    tokenizer_source: str | os.PathLike[str] | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> Path:
    """Write config.json + safetensors (+ tokenizer files copied from `tokenizer_source`)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    hf = cfg.to_hf()
    hf["torch_dtype"] = dtype or cfg.param_dtype
    write_sharded(directory, hf_tensors(model, dtype), max_shard_bytes)
    (directory / "config.json").write_text(json.dumps(hf, indent=2))
    if tokenizer_source is not None:
        src = Path(tokenizer_source)
        copied = [f for f in TOKENIZER_FILES if (src / f).exists()]
        if not copied:
            raise CheckpointError(f"no tokenizer files in {src}")
        for f in copied:
            shutil.copy2(src / f, directory / f)
    return directory
