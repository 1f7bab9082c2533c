"""The training batch every objective consumes, and the log-prob function that scores it.

Layout: each row is one sampled trajectory, `prompt tokens + response tokens + padding`, in a
[batch, seq] array. Per-token arrays are aligned with `tokens`: entry t belongs to token t
(predicted from tokens < t), so `loss_mask[:, t] = 1` exactly where token t is a response token
that the loss scores. Rows of one group (same prompt, K samples) share `group_id`; groups are
found by id, never by reshaping, so any row order works.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from tbajax.trajectory import Trajectory

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedGroups:
    """The batch's groups packed one per row, each prompt once: `prompt, response 1, response 2,
    ...` with every response attending to the prompt and to itself only. Scoring this costs
    (P + K·R) tokens per group instead of K·(P + R): K times less prompt work, which dominates
    when prompts are long and answers short. Built by `collate(pack_microbatches=M)`: packed rows
    are laid out per micro-batch ([M·G_m] rows, those of slice m first), and `source` indexes the
    flattened rows of the row's own micro-batch slice, so cutting into M slices keeps it valid.
    """

    tokens: Array  # [G, L] int32
    positions: Array  # [G, L] int32: prompt 0..P-1, every response again from P
    segments: Array  # [G, L] int32: 0 prompt, j + 1 response j, -1 padding
    previous: Array  # [G, L] int32: the slot whose logits predict this token (its predecessor)
    source: Array  # [B, T] int32: for each response token of the row layout, its slot in the
    #   flattened [G_m · L] packed rows of its micro-batch slice (0 off the response)


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
    policy_version: Array  # [B] int32: param version the sample was generated with
    prompt_id: Array  # [B] int32: the prompt's id in its dataset (0 for padding rows); indexes
    #   per-prompt trainable tables such as a learned log Z
    beta: Array  # [] f32: KL coefficient at the trainer's current step
    packed: PackedGroups | None = None  # the same rows packed per group (see PackedGroups)

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
    logits = logits[:, :-1].astype(jnp.float32) / temperature
    targets = tokens[:, 1:]
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.pad(picked - logz, ((0, 0), (1, 0)))


def packed_token_logprobs(logits: Array, batch: Batch, temperature: float = 1.0) -> Array:
    """`token_logprobs` for a batch scored through its packed rows: logits [G, L, V] of
    `batch.packed.tokens`, result [B, T] in the row layout, filled on `loss_mask` only (0 elsewhere:
    prompt tokens are not scored in a packed row)."""
    pk = batch.packed
    logits = logits.astype(jnp.float32) / temperature
    g = jnp.arange(logits.shape[0])[:, None]
    logz = jax.nn.logsumexp(logits, axis=-1)[g, pk.previous]
    picked = logits[g, pk.previous, pk.tokens]
    flat = (picked - logz).reshape(-1)
    return jnp.where(batch.loss_mask, flat[pk.source], 0.0)


def collate(
    groups: Sequence[Sequence["Trajectory"]],
    beta: float,
    *,
    seq_len: int | None = None,
    num_rows: int | None = None,
    score_stop_token: bool = True,
    length_bucket: int = 32,
    pack_microbatches: int | None = None,
    pack_row_multiple: int = 1,
) -> Batch:
    """Pad groups of trajectories into one host-side (numpy) Batch.

    seq_len: pad/validate to this length (default: the longest row rounded up to
    `length_bucket`, so a long run compiles a handful of shapes, not one per batch).
    num_rows: pad with masked-out rows up to this many (fixed micro-batch shapes).
    score_stop_token: whether a finished response's final stop token is in the loss.
    pack_microbatches: also build `Batch.packed` for a step cut into this many micro-batches.
    pack_row_multiple: make the number of packed rows a multiple of this (the data-parallel shards).
    """
    rows = [t for g in groups for t in g]
    if not rows:
        raise ValueError("collate needs at least one trajectory")
    lengths = [len(t.prompt_tokens) + len(t.response_tokens) for t in rows]
    longest = max(lengths)
    if seq_len is None:
        seq_len = -(-longest // length_bucket) * length_bucket
    if longest > seq_len:
        raise ValueError(f"a trajectory has {longest} tokens, more than seq_len={seq_len}")
    n = num_rows or len(rows)
    if n < len(rows):
        raise ValueError(f"num_rows={n} is smaller than the {len(rows)} trajectories given")
    tokens = np.zeros((n, seq_len), np.int32)
    attn = np.zeros((n, seq_len), bool)
    loss = np.zeros((n, seq_len), bool)
    blp = np.zeros((n, seq_len), np.float32)
    rlp = np.zeros((n, seq_len), np.float32)
    reward = np.zeros((n,), np.float32)
    gid = np.zeros((n,), np.int32)
    version = np.zeros((n,), np.int32)
    prompt_id = np.zeros((n,), np.int32)
    i = 0
    for g, group in enumerate(groups):
        for t in group:
            p, r = len(t.prompt_tokens), len(t.response_tokens)
            tokens[i, :p] = t.prompt_tokens
            tokens[i, p : p + r] = t.response_tokens
            attn[i, : p + r] = True
            scored = r - (1 if (t.finished and not score_stop_token and r > 0) else 0)
            loss[i, p : p + scored] = True
            blp[i, p : p + r] = t.behavior_logprobs
            if t.reference_logprobs is not None:
                rlp[i, p : p + r] = t.reference_logprobs
            reward[i] = t.reward
            gid[i] = g
            version[i] = t.policy_version
            prompt_id[i] = _int32_id(t.prompt_id)
            i += 1
    sample_mask = np.arange(n) < len(rows)
    gid[len(rows) :] = np.arange(len(groups), len(groups) + n - len(rows))  # padding: own groups
    blp *= loss
    rlp *= loss
    packed = None
    if pack_microbatches is not None:
        prompt_len = np.zeros((n,), np.int64)
        prompt_len[: len(rows)] = [len(t.prompt_tokens) for t in rows]
        packed = pack_groups(
            tokens, prompt_len, attn, gid, sample_mask, pack_microbatches, length_bucket, pack_row_multiple
        )
    return Batch(
        tokens=tokens,
        attention_mask=attn,
        loss_mask=loss,
        behavior_logprobs=blp,
        reference_logprobs=rlp,
        reward=reward,
        group_id=gid,
        sample_mask=sample_mask,
        policy_version=version,
        prompt_id=prompt_id,
        beta=np.float32(beta),
        packed=packed,
    )


def pack_groups(
    tokens: np.ndarray,
    prompt_len: np.ndarray,
    attention_mask: np.ndarray,
    group_id: np.ndarray,
    sample_mask: np.ndarray,
    num_microbatches: int,
    length_bucket: int = 32,
    row_multiple: int = 1,
) -> PackedGroups:
    """PackedGroups of row-layout arrays (host side). Every micro-batch slice gets the same number
    of packed rows (the most groups any slice holds, rounded up so that the total is a multiple of
    `row_multiple`) so the slices stack; padding rows are left out."""
    n, seq = tokens.shape
    if n % num_microbatches:
        raise ValueError(f"batch of {n} rows cannot be cut into {num_microbatches} equal micro-batches")
    per_slice = n // num_microbatches
    slices: list[list[list[int]]] = []  # slice -> groups -> row indices
    for m in range(num_microbatches):
        order: dict[int, list[int]] = {}
        for i in range(m * per_slice, (m + 1) * per_slice):
            if sample_mask[i]:
                order.setdefault(int(group_id[i]), []).append(i)
        slices.append(list(order.values()))
    for groups in slices:
        for rows in groups:
            first = rows[0]
            p = int(prompt_len[first])
            if p < 1:
                raise ValueError(f"row {first} has an empty prompt; packing needs at least one prompt token")
            for i in rows[1:]:
                if prompt_len[i] != p or not np.array_equal(tokens[i, :p], tokens[first, :p]):
                    raise ValueError(
                        f"rows {first} and {i} share group {int(group_id[i])} but not their prompt; "
                        "packing needs every row of a group to have the same prompt"
                    )
    response_len = attention_mask.sum(-1) - prompt_len
    lengths = [int(prompt_len[rows[0]] + response_len[rows].sum()) for groups in slices for rows in groups]
    width = -(-max(lengths, default=1) // length_bucket) * length_bucket
    g_m = max(1, max(len(groups) for groups in slices))
    while (num_microbatches * g_m) % row_multiple:
        g_m += 1
    shape = (num_microbatches * g_m, width)
    out_tokens = np.zeros(shape, np.int32)
    positions = np.zeros(shape, np.int32)
    segments = np.full(shape, -1, np.int32)
    previous = np.zeros(shape, np.int32)
    source = np.zeros((n, seq), np.int32)
    for m, groups in enumerate(slices):
        for local, rows in enumerate(groups):
            g = m * g_m + local
            p = int(prompt_len[rows[0]])
            out_tokens[g, :p] = tokens[rows[0], :p]
            positions[g, :p] = np.arange(p)
            segments[g, :p] = 0
            previous[g, :p] = np.maximum(np.arange(p) - 1, 0)
            at = p
            for j, i in enumerate(rows):
                r = int(response_len[i])
                span = slice(at, at + r)
                out_tokens[g, span] = tokens[i, p : p + r]
                positions[g, span] = p + np.arange(r)
                segments[g, span] = j + 1
                previous[g, span] = np.arange(at, at + r) - 1
                if r:
                    previous[g, at] = p - 1
                source[i, p : p + r] = local * width + np.arange(at, at + r)
                at += r
    return PackedGroups(tokens=out_tokens, positions=positions, segments=segments, previous=previous, source=source)


def _int32_id(prompt_id: int) -> int:
    if not np.iinfo(np.int32).min <= prompt_id <= np.iinfo(np.int32).max:
        raise ValueError(
            f"prompt_id {prompt_id} does not fit in int32; number the dataset's prompts 0, 1, 2, ..."
        )
    return int(prompt_id)
