"""Evaluation arithmetic: accuracy and the unbiased pass@k estimator (Chen et al., 2021)."""

from __future__ import annotations

from collections.abc import Sequence


def accuracy(rewards: Sequence[float], success_threshold: float = 1.0) -> float:
    """Fraction of samples whose reward reaches `success_threshold` (mean reward for 0/1 rewards)."""
    if len(rewards) == 0:
        raise ValueError("accuracy of an empty list of rewards is undefined")
    return sum(1 for r in rewards if r >= success_threshold) / len(rewards)


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k samples drawn without replacement from n is correct), c of n correct:
    1 - C(n-c, k) / C(n, k), as a product so large n does not overflow."""
    if not (0 <= c <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n, got n={n}, c={c}")
    if not (1 <= k <= n):
        raise ValueError(f"pass_at_k needs 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mean_pass_at_k(rewards: Sequence[Sequence[float]], k: int, success_threshold: float = 1.0) -> float:
    """pass@k averaged over problems, each given as its list of sample rewards (any n >= k)."""
    if len(rewards) == 0:
        raise ValueError("mean_pass_at_k got no problems")
    total = 0.0
    for r in rewards:
        c = sum(1 for x in r if x >= success_threshold)
        total += pass_at_k(len(r), c, k)
    return total / len(rewards)

