"""The red-teaming replay buffer: a reward-keyed min-heap of unique attacks (TBA spec §8).

Unlike the per-prompt `ReplayBuffer` (all red-team attacks share one prompt), it keeps the
`capacity` best items by `reward`, rejects near-duplicates, and samples by softmax(priority)
(the reference: heap key = total log-reward, priority = log toxicity). Host-side numpy only.

Adding an item, in order:
  1. exact duplicate (same `text`, or same tokens when no text is given) of a stored item:
     rejected, whatever its reward (as the reference: a lucky re-roll of the victim's answers to
     the same attack does not replace the first measurement);
  2. near-duplicates: stored items within the edit-distance rule (Levenshtein distance of the
     token sequences, `strip_token_ids` removed, < `edit_tolerance`·(len₁ + len₂)) or, when
     `cosine_tolerance` is set, with embedding cosine > `cosine_tolerance`. If any of them has a
     reward >= the new one, the new item is rejected; otherwise all of them are removed and the
     new item goes in. (The reference only compares against the first similar item it meets;
     comparing against all keeps the invariant that no two stored items are near-duplicates.)
  3. capacity: when full, the new item replaces the lowest-reward item only if it is strictly
     better (ties: the older item goes first), else it is rejected.

Everything is deterministic: the outcome depends only on the sequence of `add` calls, and
`state_dict()` holds every item (JSON-able, given JSON-able payloads), so `load_state_dict`
rebuilds the same buffer, sampling included, after `--resume`.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from tbajax.buffer.config import BufferEmptyError
from tbajax.buffer.policies import draw_group

_STATE_FORMAT = 1
_COUNTERS = (
    "added",
    "accepted",
    "exact_duplicates",
    "near_duplicate_drops",
    "near_duplicate_replacements",
    "capacity_drops",
    "evictions",
)


@dataclasses.dataclass(frozen=True)
class RewardHeapConfig:
    """capacity: items kept (1,000 for GPT-2, 5,000 for Llama in the reference).
    edit_tolerance: near-duplicate if edit distance < tol·(len₁ + len₂) (0.25); None: off.
    cosine_tolerance: near-duplicate if embedding cosine > tol (the reference's cosine buffer
      uses 0.4 with MiniLM); None: off. When set, every item needs an `embedding`.
    strip_token_ids: tokens ignored by the edit distance (the reference strips EOS).
    priority_inv_temp: `sample` draws items with probability softmax(priority · inv_temp);
      1 is the reference, 0 uniform.
    """

    capacity: int = 1000
    edit_tolerance: float | None = 0.25
    cosine_tolerance: float | None = None
    strip_token_ids: tuple[int, ...] = ()
    priority_inv_temp: float = 1.0

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {self.capacity}")
        if self.edit_tolerance is not None and not 0.0 <= self.edit_tolerance <= 1.0:
            raise ValueError(f"edit_tolerance must be None or in [0, 1], got {self.edit_tolerance}")
        if self.cosine_tolerance is not None and not -1.0 <= self.cosine_tolerance <= 1.0:
            raise ValueError(f"cosine_tolerance must be None or in [-1, 1], got {self.cosine_tolerance}")
        if not (math.isfinite(self.priority_inv_temp) and self.priority_inv_temp >= 0):
            raise ValueError(f"priority_inv_temp must be finite and >= 0, got {self.priority_inv_temp}")
        object.__setattr__(self, "strip_token_ids", tuple(int(t) for t in self.strip_token_ids))


@dataclasses.dataclass(frozen=True, eq=False)
class HeapItem:
    """One attack. `reward` orders the heap, `priority` (default: reward) drives sampling;
    `payload` is carried along untouched (e.g. a store row id, victim answers, reward parts)."""

    tokens: tuple[int, ...]
    reward: float
    priority: float | None = None
    text: str | None = None
    embedding: np.ndarray | None = None
    payload: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        if any(not 0 <= t < 2**31 for t in self.tokens):
            raise ValueError("token ids must be in [0, 2**31)")
        object.__setattr__(self, "reward", float(self.reward))
        if not math.isfinite(self.reward):
            raise ValueError(f"reward must be finite, got {self.reward}")
        if self.priority is not None:
            object.__setattr__(self, "priority", float(self.priority))
            if not math.isfinite(self.priority):
                raise ValueError(f"priority must be finite, got {self.priority}")
        if self.embedding is not None:
            emb = np.array(self.embedding, np.float32).reshape(-1)
            emb.setflags(write=False)
            object.__setattr__(self, "embedding", emb)

    @property
    def sampling_logit(self) -> float:
        return self.reward if self.priority is None else self.priority


def edit_distances(query: Sequence[int], others: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Levenshtein distances [N] between `query` and each row of `others` [N, L] (its first
    `lengths[n]` entries; padding must not be a valid token, e.g. -1).

    Row-by-row DP over the query, vectorised over the N sequences; within a row the insertion
    chain D[i, j] = min_k (E[k] + j − k) is one cumulative minimum.
    """
    others = np.asarray(others)
    n, width = others.shape
    cols = np.arange(width + 1, dtype=np.int32)
    prev = np.broadcast_to(cols, (n, width + 1)).copy()  # distance from the empty query prefix
    e = np.empty_like(prev)
    for i, q in enumerate(query, start=1):
        e[:, 0] = i
        np.minimum(prev[:, 1:] + 1, prev[:, :-1] + (others != q), out=e[:, 1:])
        e -= cols
        prev = np.minimum.accumulate(e, axis=1)
        prev += cols
    return prev[np.arange(n), np.asarray(lengths, np.int64)]


class RewardHeap:
    """Reward-keyed replay buffer with near-duplicate rejection (see the module docstring)."""

    def __init__(self, config: RewardHeapConfig | None = None) -> None:
        self.config = config if config is not None else RewardHeapConfig()
        self._reset()

    def _reset(self) -> None:
        cap = self.config.capacity
        self._items: dict[int, HeapItem] = {}  # seq -> item; insertion (seq) order
        self._slot_of: dict[int, int] = {}  # seq -> row in the matrices below
        self._free: list[int] = list(range(cap))  # min-heap of free rows
        self._tokens = np.full((cap, 8), -1, np.int32)  # stripped tokens, -1 padded
        self._lengths = np.zeros(cap, np.int64)
        self._live = np.zeros(cap, bool)
        self._unit: np.ndarray | None = None  # [cap, D] normalised embeddings
        self._heap: list[tuple[float, int]] = []  # (reward, seq), lazy deletion
        self._exact: dict[Any, int] = {}  # dedup key -> seq
        self._next_seq = 0
        self._counts = dict.fromkeys(_COUNTERS, 0)

    # ------------------------------------------------------------------ ingestion

    def add(self, items: Iterable[HeapItem]) -> list[bool]:
        """Offer items in order; returns, per item, whether it was stored."""
        out = []
        for item in items:
            if not isinstance(item, HeapItem):
                raise TypeError(f"RewardHeap.add expects HeapItem, got {type(item).__name__}")
            out.append(self._add_one(item))
        return out

    def _dedup_key(self, item: HeapItem) -> Any:
        return ("text", item.text) if item.text is not None else ("tokens", self._stripped(item))

    def _stripped(self, item: HeapItem) -> tuple[int, ...]:
        strip = self.config.strip_token_ids
        return tuple(t for t in item.tokens if t not in strip) if strip else item.tokens

    def _add_one(self, item: HeapItem) -> bool:
        cfg, counts = self.config, self._counts
        counts["added"] += 1
        unit = self._unit_embedding(item)
        key = self._dedup_key(item)
        if key in self._exact:
            counts["exact_duplicates"] += 1
            return False
        similar = self._near_duplicates(self._stripped(item), unit)
        if similar:
            if max(self._items[s].reward for s in similar) >= item.reward:
                counts["near_duplicate_drops"] += 1
                return False
            for s in similar:
                self._remove(s)
            counts["near_duplicate_replacements"] += len(similar)
        elif len(self._items) >= cfg.capacity:
            worst = self._min_entry()
            if item.reward <= worst[0]:
                counts["capacity_drops"] += 1
                return False
            self._remove(worst[1])
            counts["evictions"] += 1
        self._insert(item, unit, key)
        counts["accepted"] += 1
        return True

    def _unit_embedding(self, item: HeapItem) -> np.ndarray | None:
        if item.embedding is None:
            if self.config.cosine_tolerance is not None:
                raise ValueError("cosine_tolerance is set: every item needs an embedding")
            return None
        norm = float(np.linalg.norm(item.embedding))
        if not (math.isfinite(norm) and norm > 0):
            raise ValueError("item embedding must be finite and non-zero")
        if self._unit is not None and self._unit.shape[1] != item.embedding.size:
            raise ValueError(
                f"embedding has {item.embedding.size} dims, the buffer holds {self._unit.shape[1]}-dim ones"
            )
        return item.embedding.astype(np.float64) / norm

    def _near_duplicates(self, tokens: tuple[int, ...], unit: np.ndarray | None) -> list[int]:
        if not self._items:
            return []
        cfg = self.config
        near = np.zeros(self._live.shape[0], bool)
        if cfg.edit_tolerance is not None:
            # |len1 - len2| <= distance: rows whose length alone rules them out skip the DP
            lq, lens = len(tokens), self._lengths
            bound = cfg.edit_tolerance * (lq + lens)
            rows = np.flatnonzero(self._live & (np.abs(lens - lq) < bound))
            if rows.size:
                width = int(lens[rows].max())
                dist = edit_distances(tokens, self._tokens[rows, :width], lens[rows])
                near[rows[dist < bound[rows]]] = True
        if cfg.cosine_tolerance is not None and unit is not None and self._unit is not None:
            near |= self._unit @ unit > cfg.cosine_tolerance
        near &= self._live
        hits = set(np.flatnonzero(near).tolist())
        return [s for s, r in self._slot_of.items() if r in hits] if hits else []

    def _insert(self, item: HeapItem, unit: np.ndarray | None, key: Any) -> None:
        seq = self._next_seq
        self._next_seq += 1
        row = heapq.heappop(self._free)
        tokens = self._stripped(item)
        if len(tokens) > self._tokens.shape[1]:  # widen the token matrix
            width = max(len(tokens), 2 * self._tokens.shape[1])
            wider = np.full((self._tokens.shape[0], width), -1, np.int32)
            wider[:, : self._tokens.shape[1]] = self._tokens
            self._tokens = wider
        self._tokens[row] = -1
        self._tokens[row, : len(tokens)] = tokens
        self._lengths[row] = len(tokens)
        self._live[row] = True
        if unit is not None and self._unit is None:
            self._unit = np.zeros((self._live.shape[0], unit.size), np.float64)
        if self._unit is not None:
            self._unit[row] = 0.0 if unit is None else unit
        self._items[seq] = item
        self._slot_of[seq] = row
        self._exact[key] = seq
        heapq.heappush(self._heap, (item.reward, seq))
        if len(self._heap) > 2 * len(self._items) + 32:  # drop entries of removed items
            self._heap = [(it.reward, s) for s, it in self._items.items()]
            heapq.heapify(self._heap)

    def _remove(self, seq: int) -> None:
        item = self._items.pop(seq)
        row = self._slot_of.pop(seq)
        self._live[row] = False
        self._lengths[row] = 0
        heapq.heappush(self._free, row)
        del self._exact[self._dedup_key(item)]

    def _min_entry(self) -> tuple[float, int]:
        while self._heap[0][1] not in self._items:  # drop entries of removed items
            heapq.heappop(self._heap)
        return self._heap[0]

    # ------------------------------------------------------------------ sampling

    def sample(self, rng: np.random.Generator, num: int, replace: bool = False) -> list[HeapItem]:
        """`num` items drawn with probability softmax(priority · inv_temp), without replacement
        by default (successive sampling, as the reference's `np.random.choice(..., replace=False)`).
        Raises BufferEmptyError, before drawing anything, when there are too few items."""
        if not isinstance(rng, np.random.Generator):
            raise TypeError(f"rng must be a numpy Generator, got {type(rng).__name__}")
        if num < 1:
            raise ValueError(f"num must be >= 1, got {num}")
        if not self._items or (not replace and num > len(self._items)):
            raise BufferEmptyError(
                f"cannot draw {num} items {'with' if replace else 'without'} replacement from a "
                f"reward heap holding {len(self._items)}; wait for more attacks"
            )
        items = list(self._items.values())  # insertion order: a rebuilt buffer draws the same
        logits = np.array([it.sampling_logit for it in items]) * self.config.priority_inv_temp
        return [items[i] for i in draw_group(rng, logits, num, replace=replace)]

    def probabilities(self) -> np.ndarray:
        """Sampling probability of each item, in `items()` order (for tests and logging)."""
        if not self._items:
            raise BufferEmptyError("the reward heap is empty: no sampling distribution yet")
        logits = np.array([it.sampling_logit for it in self._items.values()]) * self.config.priority_inv_temp
        z = np.exp(logits - logits.max())
        return z / z.sum()

    # ------------------------------------------------------------------ introspection, state

    def __len__(self) -> int:
        return len(self._items)

    def items(self) -> list[HeapItem]:
        """Stored items in insertion order."""
        return list(self._items.values())

    def __iter__(self) -> Iterator[HeapItem]:
        return iter(self.items())

    def stats(self) -> dict[str, Any]:
        """Counters and reward range for logging; NaN where undefined (empty buffer)."""
        out: dict[str, Any] = dict(self._counts)
        rewards = np.array([it.reward for it in self._items.values()])
        nan = float("nan")
        out["size"] = len(self._items)
        out["capacity"] = self.config.capacity
        out["min_reward"] = float(rewards.min()) if rewards.size else nan
        out["max_reward"] = float(rewards.max()) if rewards.size else nan
        out["mean_reward"] = float(rewards.mean()) if rewards.size else nan
        return out

    def _config_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self.config) | {"strip_token_ids": list(self.config.strip_token_ids)}

    def state_dict(self) -> dict[str, Any]:
        """Everything, JSON-able if payloads are: the items in insertion order and the counters."""
        return {
            "format": _STATE_FORMAT,
            "config": self._config_dict(),
            "next_seq": self._next_seq,
            "counts": dict(self._counts),
            "items": [
                {
                    "seq": seq,
                    "tokens": list(it.tokens),
                    "reward": it.reward,
                    "priority": it.priority,
                    "text": it.text,
                    "embedding": None if it.embedding is None else [float(x) for x in it.embedding],
                    "payload": it.payload,
                }
                for seq, it in self._items.items()
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the contents by `state_dict()`'s; the config must match (it decided what is stored)."""
        if state.get("format") != _STATE_FORMAT:
            raise ValueError(f"unknown reward-heap state format {state.get('format')!r}")
        mine = self._config_dict()
        theirs = dict(state["config"])
        theirs["strip_token_ids"] = list(theirs.get("strip_token_ids", []))
        diff = sorted(k for k in mine if mine[k] != theirs.get(k))
        if diff:
            raise ValueError(
                "reward-heap state was saved with a different config ("
                + ", ".join(f"{k}: saved {theirs.get(k)!r}, now {mine[k]!r}" for k in diff)
                + "); resume with the saved settings"
            )
        self._reset()
        for rec in sorted(state["items"], key=lambda r: r["seq"]):
            item = HeapItem(
                tokens=tuple(rec["tokens"]),
                reward=rec["reward"],
                priority=rec["priority"],
                text=rec["text"],
                embedding=None if rec["embedding"] is None else np.asarray(rec["embedding"], np.float32),
                payload=rec["payload"],
            )
            self._next_seq = int(rec["seq"])
            self._insert(item, self._unit_embedding(item), self._dedup_key(item))
        self._next_seq = int(state["next_seq"])
        self._counts = {k: int(state["counts"].get(k, 0)) for k in _COUNTERS}
