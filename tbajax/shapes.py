"""Shape buckets: inputs padded to a few sizes, so a stream of batches of every size compiles a
handful of programs instead of one per shape."""

from __future__ import annotations


def next_pow2(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= n, and at least `minimum`."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def pow2_bucket(n: int, limit: int, minimum: int = 1) -> int:
    """`next_pow2(n, minimum)` capped at `limit` (a size that may not be a power of two)."""
    return min(next_pow2(n, minimum), limit)


def half_pow2_bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two or 1.5 x a power of two that is >= n (and >= `minimum`): at most
    a third of padding, two sizes per doubling."""
    p = next_pow2(n, minimum)
    return p * 3 // 4 if p >= 4 and p * 3 // 4 >= max(n, minimum) else p
