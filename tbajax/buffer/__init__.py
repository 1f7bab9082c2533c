"""Trainer-side trajectory buffer: TBA replay (recency / reward branches) and consume-once queues.

Host-side numpy only (no JAX): pure sampling policies in `policies`, three thin stateful buffers
behind one protocol (`TrajectoryBuffer`: `ReplayBuffer` for TBA replay, `GroupQueue` for
consume-once groups, `HeapReplayBuffer` for red-teaming's reward-keyed heap of unique attacks;
`make_buffer(config)` picks by mode), and a `Tailer` that feeds any of them from the
per-searcher stores.
"""

from tbajax.buffer.config import BufferConfig, BufferEmptyError
from tbajax.buffer.policies import (
    choose_branch,
    draw_group,
    recent_min_version,
    reward_logits,
    softmax_probs,
    stale_log_weights,
    take_newest,
)
from tbajax.buffer.replay import GroupQueue, ReplayBuffer, TrajectoryBuffer, make_buffer
from tbajax.buffer.tailer import Tailer, TrajectorySource
from tbajax.buffer.heap_buffer import HeapReplayBuffer
from tbajax.buffer.reward_heap import HeapItem, RewardHeap, RewardHeapConfig

__all__ = [
    "BufferConfig",
    "BufferEmptyError",
    "GroupQueue",
    "HeapItem",
    "HeapReplayBuffer",
    "RewardHeap",
    "RewardHeapConfig",
    "ReplayBuffer",
    "Tailer",
    "TrajectoryBuffer",
    "TrajectorySource",
    "choose_branch",
    "draw_group",
    "make_buffer",
    "recent_min_version",
    "reward_logits",
    "softmax_probs",
    "stale_log_weights",
    "take_newest",
]
