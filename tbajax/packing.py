"""Host-side layouts of prompts and their responses: prompt groups packed one per row
(`prompt, response 1, response 2, ...`), and each row's response window (`response_windows`).

Every response attends to the prompt and to itself only (`models.decoder.packed_attention_mask`)
and takes positions from the prompt's length on, so each response's hidden states equal those of
its own `prompt + response` row, while the prompt is run once per group instead of once per
sample. The trainer's packed groups (`training.collate.pack_groups`) and the reward model's
packed scoring (`models.scorer.SequenceScorer.score_prompt_groups`) both lay rows out with it.
The windows let a scorer gather the hidden states that predict the response tokens before the
vocabulary projection (the trainer's row layout, the preference eval's SFT model, the red-team
prior). numpy only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class PromptGroupRows:
    tokens: np.ndarray  # [rows, width] int32
    positions: np.ndarray  # [rows, width] int32: prompt 0..P-1, every response again from P
    segments: np.ndarray  # [rows, width] int32: 0 prompt, j + 1 response j, -1 padding
    starts: tuple[tuple[int, ...], ...]  # group -> response -> the slot of its first token


def packed_width(prompts: Sequence[np.ndarray], responses: Sequence[Sequence[np.ndarray]]) -> int:
    """The most slots any group needs: its prompt plus all of its responses."""
    return max((len(p) + sum(len(r) for r in rs) for p, rs in zip(prompts, responses)), default=1)


def pack_prompt_groups(
    prompts: Sequence[np.ndarray],
    responses: Sequence[Sequence[np.ndarray]],
    width: int,
    rows: int | None = None,
    stride: tuple[int, int] | None = None,
) -> PromptGroupRows:
    """Group g (prompts[g] with its responses[g]) in row g of `rows` (default: one per group;
    further rows are all padding), each row `width` slots long. Responses follow each other
    (packed), or with stride = (P, R) response j starts at slot P + j R (the prompt in the first
    P slots; `layers.StridedGroups`)."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} lists of responses")
    rows = len(prompts) if rows is None else rows
    if rows < len(prompts):
        raise ValueError(f"{len(prompts)} groups do not fit in {rows} rows")
    if stride is not None:
        slots, span = stride
        if any(len(p) > slots for p in prompts) or any(len(a) > span for rs in responses for a in rs):
            raise ValueError(f"a prompt or response is longer than its stride {stride}")
        need = slots + span * max((len(rs) for rs in responses), default=0)
    else:
        need = packed_width(prompts, responses)
    if need > width:
        raise ValueError(f"a group needs {need} slots (its prompt and all its responses), more than "
                         f"width={width}")
    tokens = np.zeros((rows, width), np.int32)
    positions = np.zeros((rows, width), np.int32)
    segments = np.full((rows, width), -1, np.int32)
    starts = []
    for g, (prompt, answers) in enumerate(zip(prompts, responses)):
        p = len(prompt)
        if p < 1:
            raise ValueError(f"group {g} has an empty prompt; packing needs at least one prompt token")
        tokens[g, :p] = prompt
        positions[g, :p] = np.arange(p)
        segments[g, :p] = 0
        at, firsts = p if stride is None else stride[0], []
        for j, answer in enumerate(answers):
            r = len(answer)
            tokens[g, at : at + r] = answer
            positions[g, at : at + r] = p + np.arange(r)
            segments[g, at : at + r] = j + 1
            firsts.append(at)
            at = at + r if stride is None else stride[0] + (j + 1) * stride[1]
        starts.append(tuple(firsts))
    return PromptGroupRows(tokens=tokens, positions=positions, segments=segments, starts=tuple(starts))


def predicting_slots(prompt_len: int, start: int, length: int) -> np.ndarray:
    """Slots of the hidden states that predict a packed response's `length` tokens (at slots
    start ... start + length - 1 of a row from `pack_prompt_groups`): the prompt's last slot for
    its first token (the response follows the prompt, not the response packed before it), the
    slot before it for every later one."""
    previous = np.arange(start - 1, start + length - 1, dtype=np.int32)
    if length:
        previous[0] = prompt_len - 1
    return previous


def group_by_prompt(prompts: Sequence[np.ndarray]) -> list[list[int]]:
    """Indices of equal prompts, in order of first appearance: [[i, j, ...], ...]."""
    groups: dict[bytes, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(np.asarray(p, np.int32).tobytes(), []).append(i)
    return list(groups.values())


def response_windows(
    first: Sequence[int], lengths: Sequence[int], rows: int, seq: int, width: int
) -> tuple[np.ndarray, np.ndarray]:
    """([rows, width] int32 slots, [rows, width] bool real): row i's window starts at slot
    first[i] (>= 1: slot 0 has no predecessor to predict it) and its first lengths[i] slots are
    real; past a row's end (seq - 1) the last slot repeats. Rows past len(first) (filler) get the
    window at slot 1, nothing real."""
    start = np.ones(rows, np.int64)
    start[: len(first)] = first
    if (start < 1).any():
        raise ValueError("a response window starts at slot >= 1 (scoring needs a non-empty prompt)")
    slots = np.minimum(start[:, None] + np.arange(width)[None, :], seq - 1).astype(np.int32)
    real = np.zeros((rows, width), bool)
    for i, n in enumerate(lengths):
        real[i, :n] = True
    return slots, real
