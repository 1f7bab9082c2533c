"""Configuration and errors of the trainer-side trajectory buffer."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

Mode = Literal["replay", "fifo_once"]
Shortfall = Literal["skip", "replace"]
StalenessMode = Literal["drop", "weight"]
RecencyFallback = Literal["reward", "wait"]


class BufferEmptyError(RuntimeError):
    """Not enough usable data to form the requested groups yet: wait for searchers and retry.

    Raised before any random number is drawn and before anything is consumed, so retrying with
    the same generator gives the same result as if the first attempt had never happened.
    """


@dataclasses.dataclass(frozen=True)
class BufferConfig:
    """How trajectories are kept and how training groups are drawn from them.

    mode:
      "replay"    TBA: per-prompt buffer with dedup and capacity; each group slot takes the
                  recency branch with probability `recency_prob`, else the reward branch.
      "fifo_once" TBA' / async GRPO: whole generation groups, each consumed once, oldest first,
                  dropped when more than `async_level` versions older than the trainer.
                  `async_level=0` is synchronous on-policy training.
    samples_per_group: K, rows per returned group (the default of `sample(k=None)`).
    capacity_per_prompt: C, unique responses kept per prompt (replay; oldest version evicted).
    recency_prob: m, probability that a group slot uses the recency branch (replay).
    reward_inv_temp: reward branch draws rows with probability softmax(reward * inv_temp);
      0 is uniform. Must be >= 0 (a negative value would favour low rewards; almost surely a
      sign mistake).
    shortfall: a prompt with fewer than K usable unique rows is
      "skip"    never picked (default: repeated rows in a group bias its mean baseline, and with
                24 generated per prompt for K = 20 prompts normally have enough), or
      "replace" picked if it has at least `min_group_size` rows; its group is drawn with
                replacement.
    min_group_size: see `shortfall="replace"` (a group of one row carries no TB/GRPO signal);
      capped at K.
    recency_fallback: when no prompt is recent, a recency slot
      "reward"  falls back to the reward branch (counted in stats as `recency_fallbacks`), or
      "wait"    makes `sample` raise BufferEmptyError (when recency_prob > 0).
    max_staleness: rows more than this many versions older than the trainer's current version
      are dropped ("drop") or down-weighted in the reward branch by
      `stale_decay ** (staleness - max_staleness)` ("weight"; the recency branch takes the
      newest rows regardless). None: no limit. (replay)
    async_level: fifo_once drops groups more than this many versions older than the trainer.
    dedup: keep one copy of each distinct response per prompt (replay; the reference does). Turn
      it off for tasks with short canonical answers, where every correct sample is the same token
      sequence and dedup would leave one correct row among many distinct wrong ones.
    keep_failed_grades: keep rows whose reward_status is TIMEOUT or ERROR (default: drop them,
      counted in stats as `failed_grade_drops`).
    max_recent_uses: the recency branch draws each generation group at most this many times
      (replay); a prompt whose groups are used up stops being recent. None: no limit (the
      reference). With few searchers the recent set is small and the trainer otherwise steps on
      the same groups again and again, which on the tiny default task diverges where on-policy
      training at the same learning rate improves; 1 with recency_fallback="wait" makes the
      trainer wait for new data instead, keeping the replay ratio of the recency branch at 1.
    """

    mode: Mode = "replay"
    samples_per_group: int = 20
    capacity_per_prompt: int = 100
    recency_prob: float = 0.95
    reward_inv_temp: float = 0.0
    shortfall: Shortfall = "skip"
    min_group_size: int = 2
    recency_fallback: RecencyFallback = "reward"
    max_staleness: int | None = None
    staleness_mode: StalenessMode = "drop"
    stale_decay: float = 0.5
    async_level: int = 2
    keep_failed_grades: bool = False
    dedup: bool = True
    max_recent_uses: int | None = None

    def __post_init__(self) -> None:
        _one_of("mode", self.mode, ("replay", "fifo_once"))
        _one_of("shortfall", self.shortfall, ("skip", "replace"))
        _one_of("staleness_mode", self.staleness_mode, ("drop", "weight"))
        _one_of("recency_fallback", self.recency_fallback, ("reward", "wait"))
        if self.samples_per_group < 1:
            raise ValueError(f"samples_per_group (K) must be >= 1, got {self.samples_per_group}")
        if self.capacity_per_prompt < 1:
            raise ValueError(
                f"capacity_per_prompt must be >= 1, got {self.capacity_per_prompt}"
            )
        if not 0.0 <= self.recency_prob <= 1.0:
            raise ValueError(f"recency_prob (m) must be in [0, 1], got {self.recency_prob}")
        if not (math.isfinite(self.reward_inv_temp) and self.reward_inv_temp >= 0.0):
            raise ValueError(
                f"reward_inv_temp must be finite and >= 0 (0 = uniform), got {self.reward_inv_temp}"
            )
        if self.min_group_size < 1:
            raise ValueError(f"min_group_size must be >= 1, got {self.min_group_size}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness must be None or >= 0, got {self.max_staleness}")
        if not 0.0 < self.stale_decay <= 1.0:
            raise ValueError(f"stale_decay must be in (0, 1], got {self.stale_decay}")
        if self.max_recent_uses is not None and self.max_recent_uses < 1:
            raise ValueError(f"max_recent_uses must be None or >= 1, got {self.max_recent_uses}")
        if self.async_level < 0:
            raise ValueError(f"async_level must be >= 0, got {self.async_level}")
        if (
            self.mode == "replay"
            and self.shortfall == "skip"
            and self.samples_per_group > self.capacity_per_prompt
        ):
            raise ValueError(
                f"samples_per_group={self.samples_per_group} > capacity_per_prompt="
                f"{self.capacity_per_prompt} with shortfall='skip': no prompt could ever fill a "
                "group; raise the capacity or use shortfall='replace'"
            )


def _one_of(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
