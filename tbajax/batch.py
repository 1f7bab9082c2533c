"""The training batch every objective consumes, and the log-prob function that scores it.

Layout: each row is one sampled trajectory, `prompt tokens + response tokens + padding`, in a
[batch, seq] array. Per-token arrays are aligned with `tokens`: entry t belongs to token t
(predicted from tokens < t), so `loss_mask[:, t] = 1` exactly where token t is a response token
that the loss scores. Rows of one group (same prompt, K samples) share `group_id`; groups are
found by id, never by reshaping, so any row order works.

Pure array maths only; building a Batch from trajectories (padding, packing) is host-side and
lives next to the trainer, in `tbajax.training.collate`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from tbajax import op_scopes as S
from tbajax.models.config import check_head_chunk
from tbajax.models.layers import soft_capped, unfused_transpose
from tbajax.op_scopes import scoped
from tbajax.sharding import along_rows, batch_shards, constrain

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedGroups:
    """The batch's groups packed one per row, each prompt once: `prompt, response 1, response 2,
    ...` with every response attending to the prompt and to itself only. Scoring this costs
    (P + K·R) tokens per group instead of K·(P + R): K times less prompt work, which dominates
    when prompts are long and answers short. Built by `training.collate.collate(pack_microbatches=M)`: packed rows
    are laid out per micro-batch ([M·G_m] rows, those of slice m first), and `source` indexes the
    flattened rows of the row's own micro-batch slice, so cutting into M slices keeps it valid.
    """

    tokens: Array  # [G, L] int32
    positions: Array  # [G, L] int32: prompt 0..P-1, every response again from P
    segments: Array  # [G, L] int32: 0 prompt, j + 1 response j, -1 padding
    scored: Array  # [G, S] int32: the slots of the response tokens, the only ones the loss scores
    #   (S: the most response tokens a group has, bucketed; padded with slot 0)
    previous: Array  # [G, S] int32: for each scored slot, the slot whose hidden state predicts its
    #   token (its predecessor in its own response, or the prompt's last slot)
    source: Array  # [B, T] int32: for each response token of the row layout, its index in the
    #   flattened [G_m · S] scored slots of its micro-batch slice (0 off the response)
    # the strided layout only (`collate(..., pack_strided=True)`; `layers.StridedGroups`): the
    # prompt in the first P slots, response j from slot P + j R
    prompt_real: Array | None = None  # [G, P] bool: real prompt slots
    response_real: Array | None = None  # [G, K, R] bool: real slots of each response's stride


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
    tokens: Array  # [B, T] int32: prompt + response, right-padded
    attention_mask: Array  # [B, T] bool: real (prompt or response) tokens
    loss_mask: Array  # [B, T] bool: response tokens the loss scores
    behavior_logprobs: Array  # [B, T] f32: log-probs under the policy that sampled (0 off-mask)
    reference_logprobs: Array  # [B, T] f32: log-probs under the reference policy (0 off-mask)
    reward: Array  # [B] f32
    group_id: Array  # [B] int32 in [0, B): rows with equal id are one group
    sample_mask: Array  # [B] bool: False for padding rows (e.g. to fill a micro-batch)
    policy_version: Array  # [B] int32: param version the sample was generated with (the oldest
    #   of its tokens' versions: `Trajectory.policy_version`)
    prompt_id: Array  # [B] int32: the prompt's id in its dataset (0 for padding rows); indexes
    #   per-prompt trainable tables such as a learned log Z
    beta: Array  # [] f32: KL coefficient at the trainer's current step
    token_versions: Array  # [B, T] int32: param version that produced each token (set on the
    #   response tokens; 0 elsewhere): a sample spans versions when the searcher swapped params
    #   mid-sequence
    current_version: Array  # [] int32: the trainer's param version when the batch was drawn (what
    #   token lags are measured against; objectives read it, so they stay pure functions of the batch)
    packed: PackedGroups | None = None  # the same rows packed per group (see PackedGroups)
    scored: Array | None = None  # [B, S] int32: each row's scored window, the slots from its first
    #   loss-masked token on (S: the most a row spans from its first to its last loss-masked
    #   token, rounded up by `collate.scored_windows`; past the row's end the last slot repeats).
    #   Only these tokens are scored, so the vocabulary projection skips the prompt
    #   (transformers' `logits_to_keep`, per row). None scores every position. Built by `collate`
    #   for the row layout (None when packed).
    prompt_features: Array | None = None  # [B, D] f32: the policy's final hidden state mean-pooled
    #   over each row's prompt tokens (stop-gradient), filled inside the step for objectives that
    #   declare `ObjectiveInputs.prompt_features` (a learned log Z head); None otherwise

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    def row_mask(self) -> Array:
        """loss_mask restricted to real rows, as float32."""
        return (self.loss_mask & self.sample_mask[:, None]).astype(jnp.float32)


def token_logprobs(logits: Array, tokens: Array, temperature: float = 1.0) -> Array:
    """log softmax(logits / T) of each next token, aligned with `tokens` ([B, T]; entry 0 is 0).

    logits[:, t] predicts tokens[:, t + 1]. The temperature is the sampling temperature: TBA
    scores trajectories under the same tempered distribution they were sampled from.
    """
    return _aligned(tempered_logprobs(logits, _next_tokens(tokens), jnp.float32(temperature)))


# Every position is scored (the last against a dummy target) and the shift happens on the [B, T]
# result: slicing the [B, T, V] logits instead costs a vocab-sized copy and, in the backward, a
# pad of the vocab-sized gradient.
def _next_tokens(tokens: Array) -> Array:
    """The target of each position: the next token (0 after the last)."""
    return jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))


def _aligned(picked: Array) -> Array:
    """Per-position log-probs of the next token -> aligned with the token they score (entry 0 is 0)."""
    return jnp.pad(picked[:, :-1], ((0, 0), (1, 0)))


@jax.custom_vjp
def tempered_logprobs(logits: Array, targets: Array, temperature: Array) -> Array:
    """log softmax(logits / temperature)[..., target]: [..., V] logits, [...] targets -> [...] f32.

    Its own VJP so that the backward is one pass over the vocab, g * (onehot - softmax) / T, from
    the saved logits and log-normaliser; autodiff of the composition materialises the scaled
    logits, exp, and the divide's gradient as separate vocab-sized arrays.
    """
    return _tempered_forward(logits, targets, temperature)[0]


@scoped(S.LOGPROBS)
def _tempered_forward(logits: Array, targets: Array, temperature: Array) -> tuple[Array, Array]:
    scaled = logits.astype(jnp.float32) / temperature
    logz = jax.nn.logsumexp(scaled, axis=-1)
    picked = jnp.take_along_axis(scaled, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked - logz, logz


def _tempered_fwd(logits: Array, targets: Array, temperature: Array):
    out, logz = _tempered_forward(logits, targets, temperature)
    return out, (logits, targets, temperature, logz)


@scoped(S.LOGPROBS)
def _cotangents(logits: Array, targets: Array, temperature: Array, logz: Array, g: Array) -> tuple[Array, Array]:
    """d(sum g * tempered_logprobs) by logits, g * (onehot(target) - softmax(logits / T)) / T in
    f32, and by T, which is -sum(d logits * logits) / T (z = logits / T enters only through z);
    XLA drops the latter unless the caller differentiates through the temperature."""
    x = logits.astype(jnp.float32)
    probs = jnp.exp(x / temperature - logz[..., None])
    onehot = jnp.arange(logits.shape[-1], dtype=jnp.int32) == targets[..., None].astype(jnp.int32)
    dlogits = (onehot.astype(jnp.float32) - probs) * (g / temperature)[..., None]
    return dlogits, (-jnp.sum(dlogits * x) / temperature).astype(temperature.dtype)


def _tempered_bwd(residuals, g: Array):
    logits, targets, temperature, logz = residuals
    dlogits, dtemp = _cotangents(logits, targets, temperature, logz, g)
    return dlogits.astype(logits.dtype), _int_zeros(targets), dtemp


tempered_logprobs.defvjp(_tempered_fwd, _tempered_bwd)


def hidden_token_logprobs(hidden: Array, head: Array, tokens: Array, temperature: float = 1.0,
                          chunk: HeadChunk = "auto", softcap: float | None = None) -> Array:
    """`token_logprobs` of `hidden @ head` ([B, T, D] hidden, [D, V] head) without going through
    autodiff of the vocabulary projection: `head_logprobs` computes the [B, T, V] logit gradient
    once and feeds both weight-gradient matmuls from it."""
    targets = _next_tokens(tokens)
    return _aligned(head_logprobs(hidden, head, targets, jnp.float32(temperature), chunk, softcap))


# `head_logprobs(chunk=...)`: tokens per chunk of the vocabulary projection, "auto" (as many as
# HEAD_CHUNK_BYTES of fp32 logits hold; all at once when the whole fits) or None (all at once)
HeadChunk = int | Literal["auto"] | None
# 1 GiB of fp32 logits: 1,766 tokens of Qwen2.5's 151,936-word vocabulary, 8,192 of a 32,768 one
HEAD_CHUNK_BYTES = 1 << 30


def head_chunk_steps(chunk: HeadChunk, hidden_shape: tuple[int, ...], vocab: int, shards: int = 1) -> int:
    """How many steps `head_logprobs` takes over the length axis (axis -2) of `hidden_shape`
    [..., L, D] whose rows are split over `shards` devices: 1 (all at once) when `chunk` is None or
    each device's tokens fit in one chunk (a chunk counts the tokens one device projects at once)."""
    if chunk is None:
        return 1
    if chunk == "auto":
        chunk = max(1, HEAD_CHUNK_BYTES // (4 * vocab))
    check_head_chunk(chunk)
    rows, length = max(1, -(-math.prod(hidden_shape[:-2]) // shards)), hidden_shape[-2]
    per_step = max(1, chunk // rows)  # positions of the length axis per step, every row
    return -(-length // per_step) if rows * length > chunk else 1


def head_logprobs(hidden: Array, head: Array, targets: Array, temperature: Array,
                  chunk: HeadChunk = "auto", softcap: float | None = None) -> Array:
    """tempered_logprobs(hidden @ head): [..., L, D] hidden, [D, V] head (the compute dtype; logits
    in f32), [..., L] targets -> [..., L] f32. softcap: the logits soft-capped before the
    temperature (`layers.soft_capped`; Gemma 2's `final_logit_softcapping`), as the model's are.

    With more tokens on a device than `chunk` (a batch-sharded mesh splits the rows over its
    devices), the projection runs a chunk of the length axis at a time (every row in each chunk,
    so the mesh keeps its sharding) and its backward computes each chunk's logits again: memory
    for [chunk, V] logits instead of all [tokens, V] of them and their gradient, for one more
    vocabulary matmul in the backward. A long-context step with a 150k-word vocabulary otherwise
    holds ~0.6 MB of logits per token, plus their gradient.
    """
    lead, (length, width) = hidden.shape[:-2], hidden.shape[-2:]
    rows = math.prod(lead)
    steps = head_chunk_steps(chunk, hidden.shape, head.shape[-1], batch_shards(rows))
    if steps == 1:
        return _whole_head_logprobs(softcap, hidden, head, targets, temperature)
    out = _chunked_head_logprobs(steps, softcap, hidden.reshape(rows, length, width), head,
                                 targets.reshape(rows, length), temperature)
    return out.reshape(*lead, length)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _whole_head_logprobs(softcap: float | None, hidden: Array, head: Array, targets: Array,
                         temperature: Array) -> Array:
    """`head_logprobs` all at once.

    XLA CPU differentiates the projection by computing the [rows, V] logit gradient twice, once
    row-major for d hidden and once transposed for d head (each as slow as the matmul it feeds);
    here it is computed once and both products read it as laid out. The temperature divides the
    hidden states before the product, not the [rows, V] logits after it: (h / T) @ W is
    logits / T without a vocab-sized pass over them (soft-capped logits are capped first, and
    divided by T after: `_head_input`).
    """
    return _head_forward(softcap, hidden, head, targets, temperature)[0]


_UNIT_TEMPERATURE = np.float32(1.0)


def _head_input(hidden: Array, temperature: Array, softcap: float | None) -> Array:
    """What the vocabulary product reads: h / T, whose product is the tempered logits, or h itself
    for soft-capped logits (the cap comes before the temperature, `_tempered_logits`)."""
    if softcap is None:
        return (hidden.astype(jnp.float32) / temperature).astype(hidden.dtype)
    return hidden


def _tempered_logits(product: Array, temperature: Array, softcap: float | None) -> Array:
    """The tempered logits z from the vocabulary product of `_head_input`."""
    return product if softcap is None else soft_capped(product, softcap) / temperature


def _product_grad(dz: Array, z: Array, temperature: Array, softcap: float | None) -> tuple[Array, Array]:
    """(d product, what d product @ W^T is divided by for d hidden) from dz = d z: with
    z = (h / T) @ W, (dz, T); with z = cap tanh((h @ W) / cap) / T, (dz (1 - (z T / cap)^2) / T, 1)."""
    if softcap is None:
        return dz, temperature
    return dz * (1.0 - jnp.square(z * (temperature / softcap))) / temperature, jnp.float32(1.0)


def _head_forward(softcap: float | None, hidden: Array, head: Array, targets: Array, temperature: Array):
    """(log-probs, (the product's input, the tempered logits z, log-normaliser))."""
    scaled = _head_input(hidden, temperature, softcap)
    with jax.named_scope(S.LM_HEAD):
        z = _vocab_sharded(jnp.einsum("...d,dv->...v", scaled, head, preferred_element_type=jnp.float32))
    z = _tempered_logits(z, temperature, softcap)
    out, logz = _tempered_forward(z, targets, _UNIT_TEMPERATURE)
    return out, (scaled, z, logz)


def _head_fwd(softcap: float | None, hidden: Array, head: Array, targets: Array, temperature: Array):
    out, (scaled, z, logz) = _head_forward(softcap, hidden, head, targets, temperature)
    return out, (scaled, head, targets, temperature, z, logz)


def _head_bwd(softcap: float | None, residuals, g: Array):
    """With z = (h / T) @ W: dz = g * (onehot - softmax(z)), d h = (dz @ W^T) / T, d W = (h / T)^T dz,
    and d T = -sum(dz * z) / T (h / T and so z move with T); soft-capped, `_product_grad`."""
    scaled, head, targets, temperature, z, logz = residuals
    dz, dtemp_unit = _cotangents(z, targets, _UNIT_TEMPERATURE, logz, g)
    dz, divisor = _product_grad(dz, z, temperature, softcap)
    dz = _vocab_sharded(dz.astype(scaled.dtype))
    with jax.named_scope(S.LM_HEAD):
        dhidden = jnp.einsum("...v,dv->...d", dz, head, preferred_element_type=jnp.float32) / divisor
        flat_h = scaled.reshape(-1, scaled.shape[-1])
        flat_dz = dz.reshape(-1, dz.shape[-1])
        # (h / T)^T transposed first (the small operand): as "nv,nd->vd" then .T, XLA:CPU ran the
        # product with its generic dot emitter (see `layers._row_grads`)
        dhead = jnp.einsum("dn,nv->dv", unfused_transpose(flat_h), flat_dz, preferred_element_type=jnp.float32)
    dtemp = (dtemp_unit / temperature).astype(temperature.dtype)
    return dhidden.astype(scaled.dtype), dhead.astype(head.dtype), _int_zeros(targets), dtemp


_whole_head_logprobs.defvjp(_head_fwd, _head_bwd)


def _in_steps(x: Array, steps: int) -> tuple[Array, int]:
    """`x` [rows, L, ...] padded along L to `steps` equal chunks, and the chunk length."""
    per_step = -(-x.shape[1] // steps)
    pad = steps * per_step - x.shape[1]
    return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)), per_step


def _chunk(x: Array, j: Array, per_step: int) -> Array:
    return jax.lax.dynamic_slice_in_dim(x, j * per_step, per_step, axis=1)


def _chunk_logits(scaled: Array, head: Array) -> Array:
    with jax.named_scope(S.LM_HEAD):
        return _vocab_sharded(jnp.einsum("...d,dv->...v", scaled, head, preferred_element_type=jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _chunked_head_logprobs(steps: int, softcap: float | None, hidden: Array, head: Array, targets: Array,
                           temperature: Array) -> Array:
    """`head_logprobs` over [rows, L, D] hidden states in `steps` chunks of the length axis."""
    return _chunked_forward(steps, softcap, hidden, head, targets, temperature)[0]


def _chunked_forward(steps: int, softcap: float | None, hidden: Array, head: Array, targets: Array,
                     temperature: Array):
    """(log-probs [rows, L], (the product's input padded to the chunks, the log-normalisers [rows, L']))."""
    length = hidden.shape[1]
    scaled, per_step = _in_steps(_head_input(hidden, temperature, softcap), steps)
    padded_targets = _in_steps(targets, steps)[0]

    def one(j: Array) -> tuple[Array, Array]:
        z = _tempered_logits(_chunk_logits(_chunk(scaled, j, per_step), head), temperature, softcap)
        return _tempered_forward(z, _chunk(padded_targets, j, per_step), _UNIT_TEMPERATURE)

    out, logz = jax.lax.map(one, jnp.arange(steps))  # [steps, rows, per_step]
    joined = lambda x: jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1)  # noqa: E731
    return joined(out)[:, :length], (scaled, joined(logz))


def _chunked_fwd(steps: int, softcap: float | None, hidden: Array, head: Array, targets: Array,
                 temperature: Array):
    out, (scaled, logz) = _chunked_forward(steps, softcap, hidden, head, targets, temperature)
    return out, (scaled, head, targets, temperature, logz)


def _chunked_bwd(steps: int, softcap: float | None, residuals, g: Array):
    """`_head_bwd` a chunk at a time, each chunk's logits computed again from the saved product input."""
    scaled, head, targets, temperature, logz = residuals
    length, per_step = targets.shape[1], scaled.shape[1] // steps
    padded_targets, padded_g = _in_steps(targets, steps)[0], _in_steps(g, steps)[0]  # g = 0 on the pad

    def one(j: Array, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        dhidden, dhead, dtemp = carry
        h = _chunk(scaled, j, per_step)
        z = _tempered_logits(_chunk_logits(h, head), temperature, softcap)
        dz, dtemp_unit = _cotangents(z, _chunk(padded_targets, j, per_step), _UNIT_TEMPERATURE,
                                     _chunk(logz, j, per_step), _chunk(padded_g, j, per_step))
        dz, divisor = _product_grad(dz, z, temperature, softcap)
        dz = _vocab_sharded(dz.astype(h.dtype))
        with jax.named_scope(S.LM_HEAD):
            dh = jnp.einsum("...v,dv->...d", dz, head, preferred_element_type=jnp.float32) / divisor
            dhead = dhead + jnp.einsum("dn,nv->dv", unfused_transpose(h.reshape(-1, h.shape[-1])),
                                       dz.reshape(-1, dz.shape[-1]), preferred_element_type=jnp.float32)
        dhidden = jax.lax.dynamic_update_slice_in_dim(dhidden, dh.astype(dhidden.dtype), j * per_step, axis=1)
        return dhidden, dhead, dtemp + dtemp_unit

    init = (jnp.zeros(scaled.shape, scaled.dtype), jnp.zeros(head.shape, jnp.float32),
            jnp.zeros((), jnp.float32))
    dhidden, dhead, dtemp_unit = jax.lax.fori_loop(0, steps, one, init)
    dtemp = (dtemp_unit / temperature).astype(temperature.dtype)
    return dhidden[:, :length], dhead.astype(head.dtype), _int_zeros(targets), dtemp


_chunked_head_logprobs.defvjp(_chunked_fwd, _chunked_bwd)


def _vocab_sharded(x: Array) -> Array:
    return constrain(x, ("batch", "length", "act_vocab")) if x.ndim == 3 else x


def _int_zeros(x: Array) -> Array:
    """The (symbolic-zero) cotangent of an integer input."""
    return np.zeros(x.shape, dtype=jax.dtypes.float0)


def window_logprobs(hidden: Array, head: Array, tokens: Array, slots: Array, temperature: Array,
                    chunk: HeadChunk = "auto", softcap: float | None = None) -> Array:
    """[B, S] log-probs of tokens[b, slots[b, j]] from hidden states [B, T, D] of `tokens`
    (slots >= 1): the states that predict them (slots - 1) are gathered first, so the vocabulary
    projection, its [B, S, V] logits and their gradient (`head_logprobs`) cover the window only."""
    temperature = jnp.asarray(temperature, jnp.float32)
    return head_logprobs(along_rows(hidden, slots - 1), head, along_rows(tokens, slots), temperature, chunk,
                         softcap)


def windowed_hidden_logprobs(hidden: Array, head: Array, batch: Batch, temperature: float = 1.0,
                             chunk: HeadChunk = "auto", softcap: float | None = None) -> Array:
    """`hidden_token_logprobs` over each row's scored window only (`batch.scored`): hidden states
    [B, T, D] of `batch.tokens`, result [B, T], filled on `loss_mask` only (0 elsewhere).

    The states that predict the window's tokens (slots - 1) are gathered first, so the vocabulary
    projection, its [B, S, V] logits and their gradient cover the window, not the prompt."""
    slots, tokens = jnp.asarray(batch.scored), jnp.asarray(batch.tokens)
    picked = window_logprobs(hidden, head, tokens, slots, temperature, chunk, softcap)
    offset = jnp.arange(tokens.shape[1])[None, :] - slots[:, :1]  # slot t -> window entry t - first
    inside = (offset >= 0) & (offset < slots.shape[1])
    aligned = jnp.take_along_axis(picked, jnp.clip(offset, 0, slots.shape[1] - 1), axis=1)
    return jnp.where(batch.loss_mask & inside, aligned, 0.0)


def packed_hidden_logprobs(hidden: Array, head: Array, batch: Batch, temperature: float = 1.0,
                           chunk: HeadChunk = "auto", softcap: float | None = None) -> Array:
    """`hidden_token_logprobs` for a batch scored through its packed rows: hidden states [G, L, D]
    of `batch.packed.tokens`, result [B, T] in the row layout, filled on `loss_mask` only (0
    elsewhere: prompt tokens are not scored in a packed row).

    Only the response tokens (`packed.scored`) are scored, each from the hidden state at its
    `packed.previous` slot. Those states are gathered first, so the vocabulary projection runs over
    the scored tokens alone (not the prompt's) and it and its gradient go through `head_logprobs`
    as the row layout's do."""
    pk = batch.packed
    predicting = along_rows(hidden, pk.previous)  # [G, S, D]
    targets = along_rows(pk.tokens, pk.scored)
    flat = head_logprobs(predicting, head, targets, jnp.float32(temperature), chunk, softcap).reshape(-1)
    return jnp.where(batch.loss_mask, flat[pk.source], 0.0)


def __getattr__(name: str):
    # `collate` / `pack_groups` live in tbajax.training.collate (host-side, they need Trajectory);
    # the old import path keeps working (lazily: training imports this module)
    if name in ("collate", "pack_groups"):
        import importlib

        return getattr(importlib.import_module("tbajax.training.collate"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
