"""Bidirectional encoders (BERT, RoBERTa) for sentence embeddings and sequence classification.

The red-teaming task needs two frozen encoders: all-MiniLM-L6-v2 (a BERT) for the diversity of
attacks (mean-pooled, L2-normalised sentence embeddings exactly as sentence-transformers computes
them) and a RoBERTa toxicity classifier (`RobertaForSequenceClassification`). Both are post-LN
transformers with learned absolute positions and token-type embeddings.

Like the decoder, per-layer parameters are stacked on a leading "layers" axis and applied with
`lax.scan`, every parameter carries `logical_axes` (so `tbajax.sharding` places it), and the math
lives in small pure functions. Import reads config.json + safetensors straight into the target
sharding; export writes files `transformers` loads (`save_encoder`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from tbajax.models.config import DTYPES, UnsupportedModelError
from tbajax.models.hf import resolve_checkpoint
from tbajax.models.layers import matmul, scan_layers
from tbajax.models.safetensors_io import CheckpointError, SafetensorsReader, write_sharded
from tbajax.shapes import pow2_bucket
from tbajax.sharding import constrain, param_shardings

log = logging.getLogger(__name__)
Array = jax.Array
_MASK_VALUE = -1e30

ENCODER_MODEL_TYPES = ("bert", "roberta")
# HF hidden_act -> ours; "gelu" is the exact (erf) GELU, the *_tanh/new ones the tanh approximation
_ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
}
# Tensors of heads `load_encoder` does not build (MLM / NSP / QA / classifier heads): reading only
# the trunk of such a checkpoint is legitimate (it is what `AutoModel` does), so they are skipped
# and logged rather than refused. Any other unknown tensor is an architecture mismatch.
_HEAD_PREFIXES = ("cls.", "lm_head.", "classifier.", "qa_outputs.")
_IGNORED_SUFFIXES = ("position_ids", "token_type_ids")  # buffers some checkpoints carry
SENTENCE_FILES = ("modules.json", "sentence_bert_config.json", "1_Pooling/config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
)

Head = Literal["none", "bert", "roberta"]


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """Architecture (from config.json) plus the runtime dtypes.

    head: which `*ForSequenceClassification` head the model carries ("none" for a bare encoder).
    pooler: whether BERT's pooler (dense + tanh on [CLS]) is present.
    """

    model_type: Literal["bert", "roberta"]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    pad_token_id: int = 0
    initializer_range: float = 0.02
    head: Head = "none"
    pooler: bool = False
    num_labels: int = 0
    id2label: tuple[str, ...] = ()
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    param_dtype: str = "float32"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.model_type not in ENCODER_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type={self.model_type!r} is not an encoder tbajax supports {ENCODER_MODEL_TYPES}"
            )
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}"
            )
        if self.hidden_act not in _ACTIVATIONS:
            raise UnsupportedModelError(
                f"hidden_act={self.hidden_act!r} is not supported; supported: {sorted(_ACTIVATIONS)}"
            )
        if self.head not in ("none", "bert", "roberta"):
            raise ValueError(f"head={self.head!r}; choose 'none', 'bert' or 'roberta'")
        if self.head == "bert" and not self.pooler:
            raise ValueError("the BERT classification head reads the pooler: set pooler=True")
        if self.head != "none" and self.num_labels < 1:
            raise ValueError(f"a classification head needs num_labels >= 1, got {self.num_labels}")
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name}={getattr(self, name)!r}; choose one of {sorted(DTYPES)}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def jnp_param_dtype(self) -> Any:
        return DTYPES[self.param_dtype]

    @property
    def jnp_dtype(self) -> Any:
        return DTYPES[self.dtype]

    # ------------------------------------------------------------------ HF conversion

    @classmethod
    def from_hf(cls, hf: dict[str, Any], *, head: Head = "none", **runtime: Any) -> "EncoderConfig":
        """Build from a config.json dict; refuses variants whose math this encoder does not do."""
        model_type = hf.get("model_type")
        if model_type not in ENCODER_MODEL_TYPES:
            raise UnsupportedModelError(
                f"config.json has model_type={model_type!r}; tbajax encoders support {ENCODER_MODEL_TYPES}"
            )
        pet = hf.get("position_embedding_type", "absolute")
        if pet != "absolute":
            raise UnsupportedModelError(
                f"position_embedding_type={pet!r} is not supported (only 'absolute' positions)"
            )
        for flag in ("is_decoder", "add_cross_attention"):
            if hf.get(flag):
                raise UnsupportedModelError(
                    f"{flag}=true: this is a decoder configuration; tbajax encoders are bidirectional only"
                )
        if hf.get("layer_norm_type", "post") not in ("post", None):
            raise UnsupportedModelError(
                f"layer_norm_type={hf['layer_norm_type']!r}: only post-LN is supported"
            )
        id2label = hf.get("id2label") or {}
        labels = tuple(str(id2label[k]) for k in sorted(id2label, key=int)) if id2label else ()
        num_labels = len(labels) or int(hf.get("num_labels", 2))
        pad = hf.get("pad_token_id")
        if pad is None:
            pad = 1 if model_type == "roberta" else 0
        eos = hf.get("eos_token_id")
        return cls(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=int(hf["num_attention_heads"]),
            max_position_embeddings=int(hf.get("max_position_embeddings", 512)),
            type_vocab_size=int(hf.get("type_vocab_size", 2)),
            layer_norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
            hidden_act=str(hf.get("hidden_act", "gelu")),
            pad_token_id=int(pad),
            initializer_range=float(hf.get("initializer_range", 0.02)),
            head=head,
            pooler=head == "bert",
            num_labels=num_labels if head != "none" else 0,
            id2label=labels if head != "none" else (),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) and len(eos) == 1 else eos,
            **runtime,
        )

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict transformers (v4 and v5) loads."""
        prefix = {"bert": "Bert", "roberta": "Roberta"}[self.model_type]
        arch = f"{prefix}ForSequenceClassification" if self.head != "none" else f"{prefix}Model"
        out: dict[str, Any] = {
            "architectures": [arch],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "max_position_embeddings": self.max_position_embeddings,
            "type_vocab_size": self.type_vocab_size,
            "layer_norm_eps": self.layer_norm_eps,
            "hidden_act": self.hidden_act,
            "pad_token_id": self.pad_token_id,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "initializer_range": self.initializer_range,
            "position_embedding_type": "absolute",
            "hidden_dropout_prob": 0.1,
            "attention_probs_dropout_prob": 0.1,
            "torch_dtype": self.param_dtype,
        }
        if self.head != "none":
            labels = self.id2label or tuple(f"LABEL_{i}" for i in range(self.num_labels))
            out["id2label"] = {str(i): l for i, l in enumerate(labels)}
            out["label2id"] = {l: i for i, l in enumerate(labels)}
        return out


@dataclasses.dataclass(frozen=True)
class SentencePooling:
    """How token states become one sentence embedding (sentence-transformers' Pooling + Normalize).

    Read from `modules.json` / `1_Pooling/config.json` when the model directory has them; a plain
    HF encoder gets mean pooling + L2 normalisation (all-MiniLM-L6-v2's recipe).
    """

    mode: Literal["mean", "cls"] = "mean"
    normalize: bool = True
    max_seq_length: int | None = None


# ---------------------------------------------------------------------------- parameters

# name -> (logical axes, shape fn, init kind); names under "layers." get a leading "layers" axis
_QKV = (("embed", "q_heads", "head_dim"), lambda c: (c.hidden_size, c.num_heads, c.head_dim), "normal")
_PARAMS: dict[str, tuple[tuple[str | None, ...], Callable[[EncoderConfig], tuple[int, ...]], str]] = {
    "word_embeddings": (("vocab", "embed"), lambda c: (c.vocab_size, c.hidden_size), "normal"),
    "position_embeddings": ((None, "embed"), lambda c: (c.max_position_embeddings, c.hidden_size), "normal"),
    "token_type_embeddings": ((None, "embed"), lambda c: (c.type_vocab_size, c.hidden_size), "normal"),
    "embed_norm": (("norm",), lambda c: (c.hidden_size,), "ones"),
    "embed_norm_bias": (("norm",), lambda c: (c.hidden_size,), "zeros"),
    "layers.q_proj": _QKV,
    "layers.k_proj": _QKV,
    "layers.v_proj": _QKV,
    "layers.q_bias": (("q_heads", "head_dim"), lambda c: (c.num_heads, c.head_dim), "zeros"),
    "layers.k_bias": (("q_heads", "head_dim"), lambda c: (c.num_heads, c.head_dim), "zeros"),
    "layers.v_bias": (("q_heads", "head_dim"), lambda c: (c.num_heads, c.head_dim), "zeros"),
    "layers.o_proj": (
        ("q_heads", "head_dim", "embed"),
        lambda c: (c.num_heads, c.head_dim, c.hidden_size),
        "normal",
    ),
    "layers.o_bias": (("norm",), lambda c: (c.hidden_size,), "zeros"),
    "layers.attn_norm": (("norm",), lambda c: (c.hidden_size,), "ones"),
    "layers.attn_norm_bias": (("norm",), lambda c: (c.hidden_size,), "zeros"),
    "layers.up_proj": (("embed", "mlp"), lambda c: (c.hidden_size, c.intermediate_size), "normal"),
    "layers.up_bias": (("mlp",), lambda c: (c.intermediate_size,), "zeros"),
    "layers.down_proj": (("mlp", "embed"), lambda c: (c.intermediate_size, c.hidden_size), "normal"),
    "layers.down_bias": (("norm",), lambda c: (c.hidden_size,), "zeros"),
    "layers.mlp_norm": (("norm",), lambda c: (c.hidden_size,), "ones"),
    "layers.mlp_norm_bias": (("norm",), lambda c: (c.hidden_size,), "zeros"),
    # BERT pooler (dense + tanh on [CLS]); small, so replicated on its output axis
    "pooler": (("embed", None), lambda c: (c.hidden_size, c.hidden_size), "normal"),
    "pooler_bias": ((None,), lambda c: (c.hidden_size,), "zeros"),
    # BertForSequenceClassification: classifier on the pooler output
    "classifier": (("embed", None), lambda c: (c.hidden_size, c.num_labels), "normal"),
    "classifier_bias": ((None,), lambda c: (c.num_labels,), "zeros"),
    # RobertaForSequenceClassification: dense + tanh + out_proj on <s>
    "head_dense": (("embed", None), lambda c: (c.hidden_size, c.hidden_size), "normal"),
    "head_dense_bias": ((None,), lambda c: (c.hidden_size,), "zeros"),
    "head_out": (("embed", None), lambda c: (c.hidden_size, c.num_labels), "normal"),
    "head_out_bias": ((None,), lambda c: (c.num_labels,), "zeros"),
}
_POOLER = ("pooler", "pooler_bias")
_HEADS = {
    "bert": ("classifier", "classifier_bias"),
    "roberta": ("head_dense", "head_dense_bias", "head_out", "head_out_bias"),
}


def param_names(cfg: EncoderConfig) -> tuple[str, ...]:
    """Dotted names of the parameters this config has (layer ones prefixed "layers.")."""
    keep = [n for n in _PARAMS if not n.startswith(("pooler", "classifier", "head_"))]
    if cfg.pooler:
        keep += _POOLER
    if cfg.head != "none":
        keep += _HEADS[cfg.head]
    return tuple(keep)


def _init_value(cfg: EncoderConfig, name: str, key: Array) -> nnx.Param:
    axes, shape_fn, kind = _PARAMS[name]
    shape = shape_fn(cfg)
    if name.startswith("layers."):
        axes, shape = ("layers", *axes), (cfg.num_layers, *shape)
    pd = cfg.jnp_param_dtype
    if kind == "normal":
        value = jax.nn.initializers.normal(cfg.initializer_range)(key, shape, pd)
    else:
        value = (jnp.ones if kind == "ones" else jnp.zeros)(shape, pd)
    return nnx.Param(value, logical_axes=axes)


class EncoderLayers(nnx.Module):
    """All blocks' parameters, stacked on a leading layer axis."""

    def __init__(self, cfg: EncoderConfig, rngs: nnx.Rngs):
        for name in param_names(cfg):
            if name.startswith("layers."):
                setattr(self, name.split(".", 1)[1], _init_value(cfg, name, rngs.params()))

    def stacked(self, cfg: EncoderConfig) -> dict[str, Array]:
        return {
            n.split(".", 1)[1]: getattr(self, n.split(".", 1)[1])[...]
            for n in param_names(cfg)
            if n.startswith("layers.")
        }


class Encoder(nnx.Module):
    """BERT / RoBERTa encoder, optionally with BERT's pooler and a sequence-classification head.

    `hidden_states` -> [B, T, D]; `embed` -> pooled sentence embeddings [B, D];
    `classify` -> fp32 logits [B, num_labels].
    """

    def __init__(self, cfg: EncoderConfig, *, rngs: nnx.Rngs, pooling: SentencePooling | None = None):
        self.config = cfg
        self.pooling = pooling or SentencePooling()
        for name in param_names(cfg):
            if not name.startswith("layers."):
                setattr(self, name, _init_value(cfg, name, rngs.params()))
        self.layers = EncoderLayers(cfg, rngs)

    def _p(self, name: str) -> Array:
        return getattr(self, name)[...].astype(self.config.jnp_dtype)

    @property
    def max_length(self) -> int:
        """Longest input the position table covers (RoBERTa's positions start at pad_token_id + 1)."""
        cfg = self.config
        offset = cfg.pad_token_id + 1 if cfg.model_type == "roberta" else 0
        return cfg.max_position_embeddings - offset

    def default_positions(self, tokens: Array) -> Array:
        """BERT: 0, 1, 2, ... RoBERTa: padding_idx + 1 + (index among non-pad tokens), pads at
        padding_idx, exactly as transformers derives them from the token ids."""
        cfg = self.config
        if cfg.model_type == "bert":
            return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        real = (tokens != cfg.pad_token_id).astype(jnp.int32)
        return jnp.cumsum(real, axis=1) * real + cfg.pad_token_id

    def hidden_states(
        self,
        tokens: Array,
        attention_mask: Array | None = None,
        token_type_ids: Array | None = None,
        positions: Array | None = None,
    ) -> Array:
        """Last-layer hidden states [batch, seq, hidden] (compute dtype); attention_mask [batch, seq]
        is 1 for real tokens (padded keys are never attended to)."""
        cfg = self.config
        if positions is None and tokens.shape[1] > self.max_length:
            # a position past the table would be clamped by the gather: refuse instead
            raise ValueError(
                f"{tokens.shape[1]} tokens exceed this {cfg.model_type} encoder's {self.max_length} "
                "positions; truncate the input (e.g. the tokenizer's max_length)"
            )
        if attention_mask is None:
            attention_mask = jnp.ones(tokens.shape, bool)
        if token_type_ids is None:
            token_type_ids = jnp.zeros(tokens.shape, jnp.int32)
        if positions is None:
            positions = self.default_positions(tokens)
        x = self._p("word_embeddings")[tokens]
        x = x + self._p("token_type_embeddings")[token_type_ids] + self._p("position_embeddings")[positions]
        x = layer_norm(x, self._p("embed_norm"), self._p("embed_norm_bias"), cfg.layer_norm_eps)
        x = constrain(x, ("batch", "length", "act_embed"))
        mask = attention_mask.astype(bool)[:, None, :]

        def body(h: Array, p: dict[str, Array]) -> tuple[Array, None]:
            return _layer(cfg, p, h, mask), None

        x, _ = scan_layers(body, x, self.layers.stacked(cfg))
        return x

    def __call__(
        self, tokens: Array, attention_mask: Array | None = None, token_type_ids: Array | None = None
    ) -> Array:
        return self.hidden_states(tokens, attention_mask, token_type_ids)

    def pool(self, hidden: Array, attention_mask: Array) -> Array:
        """Sentence embeddings [B, D] (fp32) from hidden states, per `self.pooling`."""
        if self.pooling.mode == "cls":
            out = hidden[:, 0].astype(jnp.float32)
        else:
            out = mean_pool(hidden, attention_mask)
        return l2_normalize(out) if self.pooling.normalize else out

    def embed(self, tokens: Array, attention_mask: Array, token_type_ids: Array | None = None) -> Array:
        """Sentence embeddings [B, D] as sentence-transformers computes them (L2-normalised for
        all-MiniLM-L6-v2), fp32."""
        return self.pool(self.hidden_states(tokens, attention_mask, token_type_ids), attention_mask)

    def pooled_output(self, hidden: Array) -> Array:
        """BERT's pooler: tanh(dense(h[CLS]))."""
        if not self.config.pooler:
            raise ValueError("this encoder has no pooler (the checkpoint carries no pooler.dense weights)")
        return jnp.tanh(hidden[:, 0] @ self._p("pooler") + self._p("pooler_bias"))

    def classify(self, tokens: Array, attention_mask: Array, token_type_ids: Array | None = None) -> Array:
        """fp32 logits [B, num_labels] of the `*ForSequenceClassification` head."""
        cfg = self.config
        if cfg.head == "none":
            raise ValueError("this encoder has no classification head; load it with load_classifier")
        h = self.hidden_states(tokens, attention_mask, token_type_ids)
        if cfg.head == "bert":
            x, w, b = self.pooled_output(h), self._p("classifier"), self._p("classifier_bias")
        else:
            x = jnp.tanh(h[:, 0] @ self._p("head_dense") + self._p("head_dense_bias"))
            w, b = self._p("head_out"), self._p("head_out_bias")
        return jnp.einsum("bd,dl->bl", x, w, preferred_element_type=jnp.float32) + b.astype(jnp.float32)


# ---------------------------------------------------------------------------- pure pieces


def layer_norm(x: Array, w: Array, b: Array, eps: float) -> Array:
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    out = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (out * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


def mean_pool(hidden: Array, attention_mask: Array) -> Array:
    """sentence-transformers' mean pooling: sum of real-token states / max(count, 1e-9), fp32."""
    m = attention_mask.astype(jnp.float32)[..., None]
    total = jnp.sum(hidden.astype(jnp.float32) * m, axis=1)
    return total / jnp.maximum(jnp.sum(m, axis=1), 1e-9)


def l2_normalize(x: Array, eps: float = 1e-12) -> Array:
    """x / max(||x||, eps), as torch.nn.functional.normalize."""
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), eps)


def bidirectional_attention(q: Array, k: Array, v: Array, mask: Array) -> Array:
    """q, k, v [b, t, h, d]; mask [b, 1 or t, s] (True = may attend) -> [b, t, h, d]."""
    scores = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32)
    scores = scores * (q.shape[-1] ** -0.5)
    scores = jnp.where(mask[:, None], scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return matmul("bhts,bshd->bthd", probs, v)


def _layer(cfg: EncoderConfig, p: dict[str, Array], x: Array, mask: Array) -> Array:
    """One post-LN block: x = LN(x + Attn(x)); x = LN(x + FFN(x))."""
    w = {k: v.astype(cfg.jnp_dtype) for k, v in p.items()}
    q = matmul("btd,dhk->bthk", x, w["q_proj"]) + w["q_bias"]
    k = matmul("btd,dhk->bthk", x, w["k_proj"]) + w["k_bias"]
    v = matmul("btd,dhk->bthk", x, w["v_proj"]) + w["v_bias"]
    q = constrain(q, ("batch", "length", "act_heads", None))
    o = matmul("bthk,hkd->btd", bidirectional_attention(q, k, v, mask), w["o_proj"]) + w["o_bias"]
    x = layer_norm(x + o, w["attn_norm"], w["attn_norm_bias"], cfg.layer_norm_eps)
    h = _ACTIVATIONS[cfg.hidden_act](matmul("btd,df->btf", x, w["up_proj"]) + w["up_bias"])
    h = matmul("btf,fd->btd", h, w["down_proj"]) + w["down_bias"]
    x = layer_norm(x + h, w["mlp_norm"], w["mlp_norm_bias"], cfg.layer_norm_eps)
    return constrain(x, ("batch", "length", "act_embed"))


# ---------------------------------------------------------------------------- HF names


@dataclasses.dataclass(frozen=True)
class _Mapping:
    hf_name: str  # relative to the trunk prefix ("bert." / "roberta." / ""), may contain {i}
    to_ours: Callable[[np.ndarray, EncoderConfig], np.ndarray]
    to_hf: Callable[[np.ndarray, EncoderConfig], np.ndarray]
    trunk: bool = True  # False: head tensors, named from the checkpoint root


def _same(a: np.ndarray, c: EncoderConfig) -> np.ndarray:
    return a


def _linear(hf: str, heads_out: bool = False, heads_in: bool = False, trunk: bool = True) -> _Mapping:
    """HF Linear weight [out, in] <-> ours [in, out] (out or in split into heads x head_dim)."""

    def to_ours(a: np.ndarray, c: EncoderConfig) -> np.ndarray:
        a = a.T
        if heads_out:
            return a.reshape(a.shape[0], c.num_heads, c.head_dim)
        if heads_in:
            return a.reshape(c.num_heads, c.head_dim, a.shape[-1])
        return a

    def to_hf(a: np.ndarray, c: EncoderConfig) -> np.ndarray:
        if heads_in:
            return a.reshape(-1, a.shape[-1]).T
        return a.reshape(a.shape[0], -1).T

    return _Mapping(hf, to_ours, to_hf, trunk)


def _split_heads(a: np.ndarray, c: EncoderConfig) -> np.ndarray:
    return a.reshape(c.num_heads, c.head_dim)


def _flatten(a: np.ndarray, c: EncoderConfig) -> np.ndarray:
    return a.reshape(-1)


def _vec(hf: str, heads: bool = False, trunk: bool = True) -> _Mapping:
    if heads:
        return _Mapping(hf, _split_heads, _flatten, trunk)
    return _Mapping(hf, _same, _same, trunk)


def hf_mappings(cfg: EncoderConfig) -> dict[str, _Mapping]:
    """Our dotted param name -> HF tensor name (relative to the trunk prefix) and layout maps."""
    pre = "encoder.layer.{i}."
    att = pre + "attention."
    cls_ = "classifier."
    table = {
        "word_embeddings": _vec("embeddings.word_embeddings.weight"),
        "position_embeddings": _vec("embeddings.position_embeddings.weight"),
        "token_type_embeddings": _vec("embeddings.token_type_embeddings.weight"),
        "embed_norm": _vec("embeddings.LayerNorm.weight"),
        "embed_norm_bias": _vec("embeddings.LayerNorm.bias"),
        "layers.q_proj": _linear(att + "self.query.weight", heads_out=True),
        "layers.k_proj": _linear(att + "self.key.weight", heads_out=True),
        "layers.v_proj": _linear(att + "self.value.weight", heads_out=True),
        "layers.q_bias": _vec(att + "self.query.bias", heads=True),
        "layers.k_bias": _vec(att + "self.key.bias", heads=True),
        "layers.v_bias": _vec(att + "self.value.bias", heads=True),
        "layers.o_proj": _linear(att + "output.dense.weight", heads_in=True),
        "layers.o_bias": _vec(att + "output.dense.bias"),
        "layers.attn_norm": _vec(att + "output.LayerNorm.weight"),
        "layers.attn_norm_bias": _vec(att + "output.LayerNorm.bias"),
        "layers.up_proj": _linear(pre + "intermediate.dense.weight"),
        "layers.up_bias": _vec(pre + "intermediate.dense.bias"),
        "layers.down_proj": _linear(pre + "output.dense.weight"),
        "layers.down_bias": _vec(pre + "output.dense.bias"),
        "layers.mlp_norm": _vec(pre + "output.LayerNorm.weight"),
        "layers.mlp_norm_bias": _vec(pre + "output.LayerNorm.bias"),
        "pooler": _linear("pooler.dense.weight"),
        "pooler_bias": _vec("pooler.dense.bias"),
        "classifier": _linear("classifier.weight", trunk=False),
        "classifier_bias": _vec("classifier.bias", trunk=False),
        "head_dense": _linear(cls_ + "dense.weight", trunk=False),
        "head_dense_bias": _vec(cls_ + "dense.bias", trunk=False),
        "head_out": _linear(cls_ + "out_proj.weight", trunk=False),
        "head_out_bias": _vec(cls_ + "out_proj.bias", trunk=False),
    }
    return {n: table[n] for n in param_names(cfg)}


def _trunk_prefix(reader: SafetensorsReader, cfg: EncoderConfig) -> str:
    """"bert." / "roberta." for *ForX checkpoints, "" for a bare BertModel / RobertaModel."""
    for prefix in (f"{cfg.model_type}.", ""):
        if _find(reader, prefix + "embeddings.word_embeddings.weight") is not None:
            return prefix
    raise CheckpointError(
        f"{reader.directory} has no embeddings.word_embeddings.weight (bare or under "
        f"'{cfg.model_type}.'); is it a {cfg.model_type} checkpoint?"
    )


def _find(reader: SafetensorsReader, name: str) -> str | None:
    """The stored name of `name`, accepting the old LayerNorm gamma/beta spelling."""
    if name in reader:
        return name
    for new, old in ((".LayerNorm.weight", ".LayerNorm.gamma"), (".LayerNorm.bias", ".LayerNorm.beta")):
        if name.endswith(new) and name[: -len(new)] + old in reader:
            return name[: -len(new)] + old
    return None


# ---------------------------------------------------------------------------- loading


def read_pooling(directory: Path) -> SentencePooling:
    """The sentence-transformers pipeline in `directory` (modules.json), or the default.

    Only Transformer -> Pooling (mean or cls) -> optional Normalize is implemented; any other
    module (Dense, max pooling, ...) is refused so embeddings are never silently different.
    """
    modules_file = directory / "modules.json"
    max_len = None
    st_cfg = directory / "sentence_bert_config.json"
    if st_cfg.exists():
        max_len = json.loads(st_cfg.read_text()).get("max_seq_length")
    if not modules_file.exists():
        return SentencePooling(max_seq_length=max_len)
    mode: str | None = None
    normalize = False
    for module in json.loads(modules_file.read_text()):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            pcfg = json.loads((directory / module["path"] / "config.json").read_text())
            on = sorted(k for k, v in pcfg.items() if k.startswith("pooling_mode") and v is True)
            if on == ["pooling_mode_mean_tokens"]:
                mode = "mean"
            elif on == ["pooling_mode_cls_token"]:
                mode = "cls"
            else:
                raise UnsupportedModelError(
                    f"{directory / module['path'] / 'config.json'} asks for pooling {on}; tbajax "
                    "implements exactly one of pooling_mode_mean_tokens or pooling_mode_cls_token"
                )
        else:
            raise UnsupportedModelError(
                f"{modules_file} has a sentence-transformers module {module.get('type')!r}; tbajax "
                "implements only Transformer -> Pooling (mean/cls) -> Normalize"
            )
    if mode is None:
        raise UnsupportedModelError(f"{modules_file} has no Pooling module")
    return SentencePooling(mode=mode, normalize=normalize, max_seq_length=max_len)  # type: ignore[arg-type]


def load_encoder_config(
    source: str | os.PathLike[str], *, head: Head = "none", **runtime: Any
) -> EncoderConfig:
    directory = resolve_checkpoint(source)
    return EncoderConfig.from_hf(json.loads((directory / "config.json").read_text()), head=head, **runtime)


def load_encoder(source: str | os.PathLike[str], *, mesh: Mesh | None = None, **runtime: Any) -> Encoder:
    """An HF BERT/RoBERTa checkpoint (dir or hub id) as a bare `Encoder` for embeddings.

    The pooler is loaded when the checkpoint has one; classification/MLM head tensors are skipped
    (use `load_classifier` for the head). runtime: param_dtype / dtype.
    """
    directory = resolve_checkpoint(source)
    hf = json.loads((directory / "config.json").read_text())
    cfg = EncoderConfig.from_hf(hf, **runtime)
    reader = SafetensorsReader(directory)
    prefix = _trunk_prefix(reader, cfg)
    if _find(reader, prefix + "pooler.dense.weight") is not None:
        cfg = dataclasses.replace(cfg, pooler=True)
    return _load(directory, reader, cfg, prefix, read_pooling(directory), mesh)


def load_classifier(source: str | os.PathLike[str], *, mesh: Mesh | None = None, **runtime: Any) -> Encoder:
    """A `BertForSequenceClassification` / `RobertaForSequenceClassification` checkpoint;
    `Encoder.classify` returns its logits."""
    directory = resolve_checkpoint(source)
    hf = json.loads((directory / "config.json").read_text())
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    wanted = {"bert": "BertForSequenceClassification", "roberta": "RobertaForSequenceClassification"}
    if model_type not in wanted or wanted[model_type] not in archs:
        raise UnsupportedModelError(
            f"{directory}/config.json has model_type={model_type!r}, architectures={archs}; "
            f"load_classifier reads {sorted(wanted.values())} checkpoints"
        )
    cfg = EncoderConfig.from_hf(hf, head=model_type, **runtime)
    reader = SafetensorsReader(directory)
    prefix = _trunk_prefix(reader, cfg)
    return _load(directory, reader, cfg, prefix, read_pooling(directory), mesh)


def _is_var(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def abstract_encoder(cfg: EncoderConfig, pooling: SentencePooling | None = None) -> Encoder:
    return nnx.eval_shape(lambda: Encoder(cfg, rngs=nnx.Rngs(0), pooling=pooling))


def _load(
    directory: Path,
    reader: SafetensorsReader,
    cfg: EncoderConfig,
    prefix: str,
    pooling: SentencePooling,
    mesh: Mesh | None,
) -> Encoder:
    """Build every parameter straight in its sharding, each device reading only its slice."""
    mappings = hf_mappings(cfg)
    graphdef, abstract = nnx.split(abstract_encoder(cfg, pooling))
    shardings = (
        param_shardings(abstract, mesh)
        if mesh is not None
        else jax.tree.map(
            lambda v: SingleDeviceSharding(jax.devices()[0]), abstract, is_leaf=_is_var
        )
    )

    def stored(m: _Mapping, i: int | None) -> str:
        want = (prefix if m.trunk else "") + m.hf_name.format(i=i)
        found = _find(reader, want)
        if found is None:
            raise CheckpointError(f"tensor {want!r} is not in the checkpoint at {directory}")
        return found

    used: set[str] = set()

    def build(path: tuple[Any, ...], var: nnx.Variable, sharding: Any) -> nnx.Variable:
        name = ".".join(str(getattr(k, "key", k)) for k in path)
        m = mappings[name]
        layered = name.startswith("layers.")
        expected = var.shape[1:] if layered else var.shape
        dtype = np.dtype(var.dtype)

        def tensor(i: int | None) -> np.ndarray:
            hf_name = stored(m, i)
            raw = reader.get(hf_name)
            try:
                out = m.to_ours(raw, cfg)
            except ValueError:
                out = None
            if out is None or out.shape != expected:
                raise CheckpointError(
                    f"tensor {hf_name!r} has shape {raw.shape} but config.json implies "
                    f"{tuple(m.to_hf(np.empty(expected, np.float32), cfg).shape)} (in {directory})"
                )
            return out

        for i in range(cfg.num_layers) if layered else [None]:
            tensor(i)  # validate every shape before any device transfer
            used.add(stored(m, i))

        def callback(index: tuple[slice, ...]) -> np.ndarray:
            if not layered:
                return np.asarray(tensor(None)[index], dtype=dtype)
            layers = range(cfg.num_layers)[index[0]]
            return np.stack([np.asarray(tensor(i)[index[1:]], dtype=dtype) for i in layers])

        return var.replace(jax.make_array_from_callback(var.shape, sharding, callback))

    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=_is_var)
    flat_shardings = jax.tree.leaves(shardings, is_leaf=lambda v: isinstance(v, jax.sharding.Sharding))
    state = jax.tree_util.tree_unflatten(treedef, [build(p, v, s) for (p, v), s in zip(flat, flat_shardings)])
    _check_unused(reader, used, prefix, cfg)
    return nnx.merge(graphdef, state)


def _check_unused(reader: SafetensorsReader, used: set[str], prefix: str, cfg: EncoderConfig) -> None:
    extra = [k for k in reader.keys() if k not in used and not k.endswith(_IGNORED_SUFFIXES)]

    def unused_part(k: str) -> bool:
        if cfg.head == "none":
            return k.startswith(_HEAD_PREFIXES)  # the trunk of a *ForX checkpoint
        # a RoBERTa classifier reads <s> directly; some checkpoints still carry a pooler
        return cfg.head == "roberta" and k.startswith(prefix + "pooler.")

    skipped = [k for k in extra if unused_part(k)]
    if skipped:
        log.info("encoder %s: skipped %d unused tensors (%s...)", reader.directory, len(skipped), skipped[0])
    extra = [k for k in extra if k not in skipped]
    if extra:
        raise CheckpointError(
            f"checkpoint {reader.directory} has {len(extra)} tensors this {cfg.model_type} config "
            f"does not use (e.g. {extra[:3]}); config.json and weights disagree about the architecture"
        )


# ---------------------------------------------------------------------------- export


def hf_tensors(model: Encoder, dtype: str | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, host array) pairs in transformers' layout, one tensor gathered at a time."""
    cfg = model.config
    name = dtype or cfg.param_dtype
    np_dtype = np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)
    prefix = f"{cfg.model_type}." if cfg.head != "none" else ""
    state = nnx.state(model, nnx.Param)
    flat = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda v: isinstance(v, nnx.Variable))[0]
    mappings = hf_mappings(cfg)
    for path, var in flat:
        ours = ".".join(str(getattr(k, "key", k)) for k in path)
        m = mappings[ours]
        host = np.asarray(jax.device_get(var[...]))
        pre = prefix if m.trunk else ""
        if ours.startswith("layers."):
            for i in range(cfg.num_layers):
                out = np.ascontiguousarray(m.to_hf(host[i], cfg)).astype(np_dtype)
                yield pre + m.hf_name.format(i=i), out
        else:
            yield pre + m.hf_name, np.ascontiguousarray(m.to_hf(host, cfg)).astype(np_dtype)


def save_encoder(
    model: Encoder,
    directory: str | os.PathLike[str],
    *,
    dtype: str | None = None,
    source: str | os.PathLike[str] | None = None,
) -> Path:
    """Write config.json + model.safetensors (+ tokenizer and sentence-transformers files copied
    from `source`) that `transformers.AutoModel` / `AutoModelForSequenceClassification` load."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf = model.config.to_hf()
    hf["torch_dtype"] = dtype or model.config.param_dtype
    write_sharded(directory, hf_tensors(model, dtype))
    (directory / "config.json").write_text(json.dumps(hf, indent=2))
    if source is not None:
        src = Path(source)
        for f in (*TOKENIZER_FILES, *SENTENCE_FILES):
            if (src / f).exists():
                (directory / f).parent.mkdir(parents=True, exist_ok=True)
                (directory / f).write_bytes((src / f).read_bytes())
    return directory


def _embed_rows(graphdef: nnx.GraphDef, state: nnx.State, ids: Array, mask: Array,
                types: Array | None) -> Array:
    return nnx.merge(graphdef, state).embed(ids, mask, types)


@functools.cache
def _embed_program() -> Callable[..., Array]:
    """`Encoder.embed`, jitted (eager dispatch runs each of its primitives on its own, several
    times slower) and compiled as a sequence-scoring program."""
    from tbajax.models.scorer import sequence_scoring_compiler_options

    return jax.jit(_embed_rows, static_argnums=0, compiler_options=sequence_scoring_compiler_options())


def embed_texts(
    encoder: Encoder,
    tokenizer: Any,
    texts: list[str],
    *,
    max_length: int | None = None,
    batch_size: int = 128,
) -> np.ndarray:
    """Sentence embeddings [len(texts), D] (host fp32) with an HF tokenizer, `batch_size` texts
    at a time, truncating at the model's `max_seq_length` (sentence-transformers' limit, 256 for
    all-MiniLM-L6-v2) unless `max_length` is given. Rows are padded on the right whatever the
    tokenizer's padding side: BERT's absolute positions start at the first slot, so a left-padded
    row would embed differently from the same text alone."""
    limit = min(max_length or encoder.pooling.max_seq_length or encoder.max_length, encoder.max_length)
    texts = list(texts)
    pad = int(tokenizer.pad_token_id or 0)
    graphdef, state = nnx.split(encoder)
    chunks = []
    for start in range(0, len(texts), batch_size):
        enc = tokenizer(texts[start : start + batch_size], truncation=True, max_length=limit)
        rows, types = enc["input_ids"], enc.get("token_type_ids")
        # one compiled program per (rows, width) bucket: powers of two, so a stream of texts of
        # every length compiles a handful of programs (padding is masked out of every row)
        n, width = pow2_bucket(len(rows), batch_size), pow2_bucket(max(len(r) for r in rows), limit, 16)
        ids = np.full((n, width), pad, np.int32)
        mask = np.zeros((n, width), np.int32)
        mask[len(rows) :, 0] = 1  # padding rows: one token each, so their (dropped) pooling stays finite
        token_types = None if types is None else np.zeros((n, width), np.int32)
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = r, 1
            if token_types is not None:
                token_types[i, : len(r)] = types[i]
        out = _embed_program()(graphdef, state, jnp.asarray(ids), jnp.asarray(mask),
                               None if token_types is None else jnp.asarray(token_types))
        chunks.append(np.asarray(out)[: len(rows)])
    if not chunks:
        return np.zeros((0, encoder.config.hidden_size), np.float32)
    return np.concatenate(chunks)
