"""Shape buckets: inputs padded to a few sizes, so a stream of batches of every size compiles a
handful of programs instead of one per shape."""

from __future__ import annotations


def next_pow2(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= n, and at least `minimum`."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def pow2_bucket(n: int, limit: int, minimum: int = 1) -> int:
    """`next_pow2(n, minimum)` capped at `limit` (a size that may not be a power of two)."""
    return min(next_pow2(n, minimum), limit)


def pow2_steps_bucket(n: int, minimum: int = 1, steps: int = 2) -> int:
    """The smallest size >= n (and >= `minimum`) among the powers of two and the `steps` - 1
    evenly spaced sizes between each and the next: padding below 1 / (steps + 1) of the size
    above 2 x steps (`steps` = 2: 16, 24, 32, 48, 64, ...), `steps` compiled sizes per doubling."""
    p = next_pow2(n, minimum)
    half = p // 2
    if half < steps:
        return p
    for j in range(1, steps):
        size = half + half * j // steps
        if size >= max(n, minimum):
            return size
    return p
