"""Pure sampling policies of the buffer: small numpy functions, no state.

Randomness always comes from an explicit `np.random.Generator`, so a draw is a function of the
generator state and the inputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def reward_logits(
    rewards: Sequence[float] | np.ndarray,
    inv_temp: float,
    log_weights: np.ndarray | None = None,
) -> np.ndarray:
    """Unnormalised log-probabilities `reward * inv_temp (+ log_weights)` of the reward branch."""
    logits = np.asarray(rewards, np.float64) * float(inv_temp)
    if log_weights is not None:
        logits = logits + np.asarray(log_weights, np.float64)
    return logits


def softmax_probs(
    rewards: Sequence[float] | np.ndarray,
    inv_temp: float,
    log_weights: np.ndarray | None = None,
) -> np.ndarray:
    """softmax(reward * inv_temp (+ log_weights)); inv_temp = 0 gives the uniform distribution."""
    return _softmax(reward_logits(rewards, inv_temp, log_weights))


def _softmax(logits: np.ndarray) -> np.ndarray:
    if logits.size == 0:
        raise ValueError("softmax over an empty set of items")
    z = np.exp(logits - logits.max())
    return z / z.sum()


def choose_branch(rng: np.random.Generator, recency_prob: float) -> bool:
    """True (recency branch) with probability m, else False (reward branch)."""
    return bool(rng.random() < recency_prob)


def draw_group(
    rng: np.random.Generator, logits: np.ndarray, k: int, *, replace: bool
) -> np.ndarray:
    """Indices of k items drawn with probability softmax(logits), sorted ascending.

    Without replacement this is successive sampling (draw one, renormalise over the rest, ...),
    done in one shot as the top-k of Gumbel-perturbed logits, which stays exact when some
    weights underflow in probability space.
    """
    logits = np.asarray(logits, np.float64)
    n = logits.size
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if n == 0:
        raise ValueError("cannot draw a group from zero items")
    if replace:
        return np.sort(rng.choice(n, size=k, replace=True, p=_softmax(logits)))
    if k > n:
        raise ValueError(f"cannot draw {k} distinct items from {n}; pass replace=True")
    keys = logits + rng.gumbel(size=n)
    return np.sort(np.argsort(-keys, kind="stable")[:k])


def take_newest(
    rng: np.random.Generator, group_sizes: Sequence[int], k: int
) -> list[np.ndarray]:
    """Pick up to k rows from generation groups ordered newest first, preferring newer groups.

    Whole groups are taken in order; the group where k is reached contributes a uniformly random
    subset of the rows still needed. Returns, per group, the sorted local indices taken (empty
    after the boundary). If all groups hold fewer than k rows together, everything is taken.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    taken: list[np.ndarray] = []
    need = k
    for size in group_sizes:
        if need <= 0:
            taken.append(np.zeros((0,), np.int64))
        elif size <= need:
            taken.append(np.arange(size, dtype=np.int64))
            need -= size
        else:
            taken.append(np.sort(rng.choice(size, size=need, replace=False)).astype(np.int64))
            need = 0
    return taken


def stale_log_weights(
    versions: np.ndarray, current_version: int, max_staleness: int, decay: float
) -> np.ndarray:
    """log of `decay ** max(staleness - max_staleness, 0)`: down-weights rows past the limit."""
    staleness = current_version - np.asarray(versions, np.int64)
    excess = np.maximum(staleness - max_staleness, 0)
    return excess.astype(np.float64) * np.log(decay)


def recent_min_version(sync_versions: Sequence[int]) -> int | None:
    """Oldest policy version whose rows count as "recent"; None means every row is recent.

    The recent set of the TBA reference is what the searchers produced between the last two
    syncs, i.e. rows sampled with the params published at the previous sync or later. Deriving
    it from the rows' versions (instead of from arrival times) keeps it identical when the
    buffer is rebuilt from the stores, and it is never empty right after a sync.
    """
    return int(sync_versions[-2]) if len(sync_versions) >= 2 else None
