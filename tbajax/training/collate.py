"""Host-side batch building: pad groups of trajectories into a `Batch`, and pack each group's
prompt once (`PackedGroups`). numpy only; the trainer's step consumes what this returns.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tbajax.batch import Batch, PackedGroups
from tbajax.packing import pack_prompt_groups, packed_width, predicting_slots, response_windows
from tbajax.shapes import pow2_steps_bucket
from tbajax.trajectory import Trajectory


class UnpackableGroups(ValueError):
    """Groups that one packed row per group cannot hold: a group whose rows do not share one
    prompt (the buffer draws a group's K rows by prompt id, from any generation), or an empty
    prompt."""


def collate(
    groups: Sequence[Sequence[Trajectory]],
    beta: float,
    *,
    seq_len: int | None = None,
    num_rows: int | None = None,
    score_stop_token: bool = True,
    length_bucket: int = 32,
    pack_microbatches: int | None = None,
    pack_row_multiple: int = 1,
    pack_strided: bool = False,
    current_version: int = 0,
) -> Batch:
    """Pad groups of trajectories into one host-side (numpy) Batch.

    seq_len: pad/validate to this length (default: the longest row rounded up to
    `length_bucket`, so a long run compiles a handful of shapes, not one per batch).
    num_rows: pad with masked-out rows up to this many (fixed micro-batch shapes).
    score_stop_token: whether a finished response's final stop token is in the loss.
    pack_microbatches: also build `Batch.packed` for a step cut into this many micro-batches.
    pack_row_multiple: make the number of packed rows a multiple of this (the data-parallel shards).
    pack_strided: pack each group at fixed strides (`pack_groups(..., strided=True)`).
    current_version: the trainer's param version, written into `Batch.current_version` (token lags
    and the objectives' stale-token options are measured against it).
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
    token_versions = np.zeros((n, seq_len), np.int32)
    prompt_id = np.zeros((n,), np.int32)
    i = 0
    for g, group in enumerate(groups):
        for t in group:
            p, r = len(t.prompt_tokens), len(t.response_tokens)
            tokens[i, :p] = t.prompt_tokens
            tokens[i, p : p + r] = t.response_tokens
            attn[i, : p + r] = True
            n_scored = r - (1 if (t.finished and not score_stop_token and r > 0) else 0)
            loss[i, p : p + n_scored] = True
            blp[i, p : p + r] = t.behavior_logprobs
            token_versions[i, p : p + r] = t.token_versions
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
    packed, scored = None, None
    if pack_microbatches is None:
        scored = scored_windows(loss)
    else:
        prompt_len = np.zeros((n,), np.int64)
        prompt_len[: len(rows)] = [len(t.prompt_tokens) for t in rows]
        packed = pack_groups(
            tokens, prompt_len, attn, gid, sample_mask, pack_microbatches, length_bucket, pack_row_multiple,
            strided=pack_strided,
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
        token_versions=token_versions,
        current_version=np.int32(current_version),
        packed=packed,
        scored=scored,
    )


def scored_windows(loss_mask: np.ndarray, minimum: int = 16) -> np.ndarray:
    """`Batch.scored` of a row layout: each row's slots from its first loss-masked token (at least
    slot 1: slot 0 has no predecessor to predict it) on, as many as the longest such span in the
    batch rounded up to a power of two or 1.25, 1.5, 1.75 x one (`shapes.pow2_steps_bucket`, at
    least `minimum`, capped at seq - 1). Coarse enough that a run compiles about as many step
    programs as without windows (rounded to the 32-token length buckets, several times as many
    (length, width) pairs for MATH-like lengths: `test_scored_window_widths_add_few_compiled_shapes`),
    fine enough to waste at most a fifth. A row without loss-masked tokens gets the window at
    slot 1; past a row's end its last slot repeats."""
    n, seq = loss_mask.shape
    if seq < 2:
        raise ValueError(f"rows of {seq} token(s) have nothing to score: a token is scored from the one "
                         "before it")
    has = loss_mask.any(-1)
    first = np.where(has, loss_mask.argmax(-1), 1).clip(1)
    last = np.where(has, seq - 1 - loss_mask[:, ::-1].argmax(-1), first)
    span = int((last - first + 1).max())
    width = min(pow2_steps_bucket(span, minimum, steps=4), seq - 1)
    return response_windows(first, [], n, seq, width)[0]


def pack_groups(
    tokens: np.ndarray,
    prompt_len: np.ndarray,
    attention_mask: np.ndarray,
    group_id: np.ndarray,
    sample_mask: np.ndarray,
    num_microbatches: int,
    length_bucket: int = 32,
    row_multiple: int = 1,
    strided: bool = False,
) -> PackedGroups:
    """PackedGroups of row-layout arrays (host side). Every micro-batch slice gets the same number
    of packed rows (the most groups any slice holds, rounded up so that the total is a multiple of
    `row_multiple`) so the slices stack; padding rows are left out.

    strided: each group's prompt in the first P slots and response j from slot P + j R (P, R: the
    batch's longest prompt and response, rounded up to `length_bucket`; K the largest group), so
    that attention runs per response over the prompt and itself (`layers.StridedGroups`), not
    over the whole row: for long responses, where a packed row's (P + sum R)^2 attention costs
    more than the prompt work it saves. Responses shorter than R leave padding slots."""
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
                raise UnpackableGroups(
                    f"row {first} has an empty prompt; packing needs at least one prompt token")
            for i in rows[1:]:
                if prompt_len[i] != p or not np.array_equal(tokens[i, :p], tokens[first, :p]):
                    raise UnpackableGroups(
                        f"rows {first} and {i} share group {int(group_id[i])} but not their prompt; "
                        "packing needs every row of a group to have the same prompt (a task whose prompt "
                        "for one prompt id varies between calls: train.trainer.pack_groups=auto scores "
                        "such batches in rows, false always does)"
                    )
    response_len = attention_mask.sum(-1) - prompt_len
    prompts = [[tokens[rows[0], : int(prompt_len[rows[0]])] for rows in groups] for groups in slices]
    answers = [[[tokens[i, int(prompt_len[i]) : int(prompt_len[i] + response_len[i])] for i in rows]
                for rows in groups] for groups in slices]
    stride = None
    if strided:
        bucket = lambda x: -(-max(x, 1) // length_bucket) * length_bucket  # noqa: E731
        stride = (bucket(max(len(p) for ps in prompts for p in ps)),
                  bucket(max(len(r) for groups in answers for a in groups for r in a)))
        most = max(len(rows) for groups in slices for rows in groups)
        width = stride[0] + most * stride[1]
    else:
        need = max((packed_width(p, a) for p, a in zip(prompts, answers) if p), default=1)
        width = -(-need // length_bucket) * length_bucket
    most_answers = max([int(response_len[rows].sum()) for groups in slices for rows in groups] + [1])
    # rounded as the row layout's windows are (`scored_windows`), not to the width's length
    # buckets: fewer (width, scored width) pairs to compile
    # (`test_packed_scored_widths_add_few_compiled_shapes`)
    scored_width = min(pow2_steps_bucket(most_answers, steps=4), width)
    g_m = max(1, max(len(groups) for groups in slices))
    while (num_microbatches * g_m) % row_multiple:
        g_m += 1
    parts = [pack_prompt_groups(p, a, width, rows=g_m, stride=stride) for p, a in zip(prompts, answers)]
    scored = np.zeros((num_microbatches * g_m, scored_width), np.int32)
    previous = np.zeros_like(scored)
    source = np.zeros((n, seq), np.int32)
    for m, groups in enumerate(slices):
        for local, rows in enumerate(groups):
            g = m * g_m + local
            p = int(prompt_len[rows[0]])
            k = 0  # the next response's first index among the group's scored slots
            for i, at in zip(rows, parts[m].starts[local]):
                r = int(response_len[i])
                scored[g, k : k + r] = np.arange(at, at + r)
                previous[g, k : k + r] = predicting_slots(p, at, r)
                source[i, p : p + r] = local * scored_width + k + np.arange(r)
                k += r
    segments = np.concatenate([x.segments for x in parts])
    strided_masks = {}
    if stride is not None:
        rows_total, (slots, span) = segments.shape[0], stride
        strided_masks = {
            "prompt_real": segments[:, :slots] == 0,
            "response_real": (segments[:, slots:] > 0).reshape(rows_total, (width - slots) // span, span),
        }
    return PackedGroups(
        tokens=np.concatenate([x.tokens for x in parts]),
        positions=np.concatenate([x.positions for x in parts]),
        segments=segments,
        scored=scored, previous=previous, source=source, **strided_masks,
    )


def _int32_id(prompt_id: int) -> int:
    if not np.iinfo(np.int32).min <= prompt_id <= np.iinfo(np.int32).max:
        raise ValueError(
            f"prompt_id {prompt_id} does not fit in int32; number the dataset's prompts 0, 1, 2, ..."
        )
    return int(prompt_id)
