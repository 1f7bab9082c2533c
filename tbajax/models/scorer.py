"""Reward models / classifiers: `*ForSequenceClassification` checkpoints of any decoder family.

The head's value(s) are read at each row's **last real token**, i.e. the last position where
`attention_mask` is 1, with position ids that skip padding (cumsum(mask) - 1, as everywhere in
tbajax and as the TBA / TRL reward-model code passes them).

How this relates to transformers v5: its `*ForSequenceClassification.forward` picks the
rightmost token whose id != `config.pad_token_id`, and (without explicit position_ids) uses
positions 0..T-1. So the two agree exactly when (a) padding tokens are `pad_token_id` and that
id does not occur in the content (in particular pad != eos, or the eos is masked out too), and
(b) on left-padded rows, transformers is given position_ids = cumsum(mask) - 1 (on right-padded
rows its default positions are already those). When pad_token_id == eos_token_id, transformers
skips a trailing EOS; we score whatever the mask covers, so mask the EOS out to reproduce it.
We take the mask rather than guess from token ids because a sampled response may legitimately
contain the pad id.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from tbajax.models.config import ModelConfig, UnsupportedModelError
from tbajax.models.decoder import CausalLM, packed_mask, positions_from_mask
from tbajax.models.hf import load_weights, resolve_checkpoint
from tbajax.packing import pack_prompt_groups, packed_width
from tbajax.shapes import next_pow2, pow2_steps_bucket
from tbajax.sharding import along_rows

Array = jax.Array


def sequence_scoring_compiler_options() -> dict[str, Any] | None:
    """XLA options for the encoders' sequence-scoring programs (sentence embeddings, classifiers,
    the red-team toxicity judge): on the CPU backend, XLA's own (Eigen) dot kernels instead of its
    YNNPACK fusions, under which their attention's batched [256 x 256] @ [256 x 32] products ran
    far below the matmul rate. Decoder programs, this module's reward-model scorer included, keep
    XLA's default: since their attention loops over batch rows and skips the causal upper blocks,
    `experiments/benchmarks/dot_backend.py` measures YNNPACK faster for every one of them (the
    encoders' attention does neither, and that benchmark does not time them). None on other
    backends (the option is XLA:CPU's)."""
    if jax.default_backend() != "cpu":
        return None
    return {"xla_cpu_experimental_ynn_fusion_type": ""}


def last_token_index(mask: Array) -> Array:
    """[B, T] mask -> [B] index of each row's last 1 (0 for an all-zero row)."""
    t = mask.shape[-1]
    return (jnp.arange(t, dtype=jnp.int32) * mask.astype(jnp.int32)).argmax(-1)


def sequence_scores(model: CausalLM, tokens: Array, attention_mask: Array) -> Array:
    """[B, num_labels] fp32 head values at each row's last real token (pure; jit it)."""
    if model.config.num_labels is None:
        raise ValueError("sequence_scores needs a model with a score head (config.num_labels set)")
    mask = attention_mask.astype(bool)
    hidden, _ = model.hidden_states(tokens, positions_from_mask(mask), mask)
    last = along_rows(hidden, last_token_index(mask)[:, None])[:, 0]
    return model.logits(last)


def packed_sequence_scores(
    model: CausalLM, tokens: Array, positions: Array, segments: Array, rows: Array, slots: Array
) -> Array:
    """[N, num_labels] fp32 head values at slots (rows[i], slots[i]) of prompt groups packed one
    per row (`tbajax.packing`: segments 0 prompt, j + 1 response j, -1 padding): at a response's
    last token they equal `sequence_scores` of its own `prompt + response` row (pure; jit it)."""
    if model.config.num_labels is None:
        raise ValueError("packed_sequence_scores needs a model with a score head (config.num_labels set)")
    hidden, _ = model.hidden_states(tokens, positions, packed_mask(segments))
    return model.logits(hidden[rows, slots])


class SequenceScorer:
    """A loaded sequence classifier / reward model with a compiled `score`.

    The model's graphdef is static and its params an argument, so a new batch shape compiles
    once and new weights (`update_params`) never recompile.
    """

    def __init__(self, model: CausalLM):
        if model.config.num_labels is None:
            raise ValueError(
                "SequenceScorer needs a model with a score head; this one is a causal LM "
                "(load a *ForSequenceClassification checkpoint with load_scorer)"
            )
        self.config: ModelConfig = model.config
        self._graphdef, self._state = nnx.split(model)
        self._fn = jax.jit(
            lambda state, tokens, mask: sequence_scores(nnx.merge(self._graphdef, state), tokens, mask),
        )
        self._packed_fn = jax.jit(
            lambda state, *rows: packed_sequence_scores(nnx.merge(self._graphdef, state), *rows),
        )

    @property
    def num_labels(self) -> int:
        return int(self.config.num_labels)  # type: ignore[arg-type]

    @property
    def model(self) -> CausalLM:
        return nnx.merge(self._graphdef, self._state)

    def update_params(self, model_or_state: CausalLM | nnx.State) -> None:
        self._state = (
            nnx.split(model_or_state)[1] if isinstance(model_or_state, CausalLM) else model_or_state
        )

    def score(self, tokens: Any, attention_mask: Any) -> Array:
        """tokens, attention_mask [B, T] (any padding side) -> [B, num_labels] fp32."""
        tokens, mask = jnp.asarray(tokens), jnp.asarray(attention_mask)
        if tokens.ndim != 2 or tokens.shape != mask.shape:
            raise ValueError(
                f"tokens {tokens.shape} and attention_mask {mask.shape} must both be [batch, seq]"
            )
        if not bool(np.asarray(mask).astype(bool).any(-1).all()):
            raise ValueError("every row needs at least one real token (attention_mask all zero)")
        return self._fn(self._state, tokens.astype(jnp.int32), mask.astype(bool))

    def score_prompt_groups(
        self, prompts: Sequence[Any], responses: Sequence[Sequence[Any]]
    ) -> list[np.ndarray]:
        """What `score` gives each `prompt + response` row ([len(responses[g]), num_labels] fp32
        for group g), with each prompt run once for all of its responses: one packed row per
        group (`tbajax.packing`), where a response sees its prompt and itself only and is read at
        its last token (an empty response at the prompt's). A group of K costs P + ΣR tokens
        instead of K·P + ΣR, and no response is padded to the longest one. Rows, width and the number of
        responses are rounded up (`tbajax.shapes`), so a stream of batches compiles a few programs.
        """
        prompts = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
        responses = [[np.asarray(r, np.int32).reshape(-1) for r in rs] for rs in responses]
        if not prompts:
            raise ValueError("score_prompt_groups needs at least one prompt")
        width = pow2_steps_bucket(packed_width(prompts, responses), 16, steps=2)
        packed = pack_prompt_groups(prompts, responses, width, rows=next_pow2(len(prompts)))
        where = [
            (g, start + len(r) - 1 if len(r) else len(p) - 1)
            for g, (p, rs) in enumerate(zip(prompts, responses))
            for start, r in zip(packed.starts[g], rs)
        ]
        if not where:
            raise ValueError("score_prompt_groups got no responses to score")
        index = np.zeros((next_pow2(len(where)), 2), np.int32)  # filler entries read slot (0, 0)
        index[: len(where)] = where
        values = np.asarray(self._packed_fn(self._state, packed.tokens, packed.positions, packed.segments,
                                            index[:, 0], index[:, 1]))
        bounds = np.cumsum([0] + [len(rs) for rs in responses])
        return [values[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def load_scorer(
    source: str | os.PathLike[str], *, mesh: Mesh | None = None, **runtime: Any
) -> SequenceScorer:
    """Load a `*ForSequenceClassification` checkpoint (dir or hub id) as a `SequenceScorer`.

    runtime: param_dtype / dtype / remat. The reward of a reward model is `score(...)[:, 0]`.
    """
    directory = resolve_checkpoint(source)
    cfg = ModelConfig.from_hf(json.loads((directory / "config.json").read_text()), **runtime)
    if cfg.num_labels is None:
        raise UnsupportedModelError(
            f"{directory} is not a sequence-classification checkpoint (config.json architectures "
            "has no *ForSequenceClassification); load causal LMs with load_model"
        )
    return SequenceScorer(load_weights(directory, cfg, mesh))
