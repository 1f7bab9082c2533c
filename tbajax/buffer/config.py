"""Configuration and errors of the trainer-side trajectory buffer."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

Mode = Literal["replay", "fifo_once", "reward_heap"]
HeapPriority = Literal["log_toxicity", "reward"]
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
      "reward_heap" red-teaming (TBA spec §8; `tbajax.buffer.heap_buffer.HeapReplayBuffer`):
                  every attack of the one shared prompt is offered to a reward-keyed heap of
                  `capacity_per_prompt` unique attacks (`tbajax.buffer.RewardHeap`: exact and
                  near-duplicate rejection, the lowest reward evicted); a batch is the newest
                  attacks ("online") with probability `recency_prob`, else each group is K heap
                  attacks drawn by softmax(priority · reward_inv_temp).
    samples_per_group: K, rows per returned group (the default of `sample(k=None)`).
    capacity_per_prompt: C, unique responses kept per prompt (replay; oldest version evicted;
      reward_heap: the heap's capacity, lowest reward evicted).
    recency_prob: m, probability that a group slot uses the recency branch (replay).
    reward_inv_temp: reward branch draws rows with probability softmax(reward * inv_temp);
      0 is uniform. In reward_heap mode it multiplies the heap's priority instead (1 is the
      red-teaming reference: softmax of the log toxicity). Must be >= 0 (a negative value would favour low rewards; almost surely a
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
    edit_tolerance: reward_heap near-duplicates: Levenshtein distance of the attacks' tokens
      (stop token stripped) < tol · (len₁ + len₂) (the reference: 0.25); None: off.
    cosine_tolerance: reward_heap near-duplicates: cosine of the rows' `extras["embedding"]`
      > tol (the reference's MiniLM buffer: 0.4); None: off. Every row then needs that extra.
    heap_priority: what the reward_heap samples by: "log_toxicity" (the reference: the mean log
      toxicity of the victim's answers, from the red-team scorer's `extras["toxicity"]`) or
      "reward" (the row's log reward, which also orders the heap).
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
    edit_tolerance: float | None = 0.25
    cosine_tolerance: float | None = None
    heap_priority: HeapPriority = "log_toxicity"

    def __post_init__(self) -> None:
        _one_of("mode", self.mode, ("replay", "fifo_once", "reward_heap"))
        _one_of("heap_priority", self.heap_priority, ("log_toxicity", "reward"))
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
        if self.edit_tolerance is not None and not 0.0 <= self.edit_tolerance <= 1.0:
            raise ValueError(f"edit_tolerance must be None or in [0, 1], got {self.edit_tolerance}")
        if self.cosine_tolerance is not None and not -1.0 <= self.cosine_tolerance <= 1.0:
            raise ValueError(f"cosine_tolerance must be None or in [-1, 1], got {self.cosine_tolerance}")
        if self.mode == "reward_heap" and self.max_staleness is not None:
            raise ValueError(
                "max_staleness is not supported in reward_heap mode (the heap keeps attacks by "
                "reward, whatever their age, as the red-teaming reference); set it to null"
            )
        if (
            self.mode in ("replay", "reward_heap")
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
