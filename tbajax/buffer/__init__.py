"""Trainer-side trajectory buffer: TBA replay (recency / reward branches) and consume-once queues.

Host-side numpy only (no JAX): pure sampling policies in `policies`, a thin stateful
`ReplayBuffer`, and a `Tailer` that feeds it from the per-searcher stores.
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
from tbajax.buffer.replay import ReplayBuffer
from tbajax.buffer.tailer import Tailer, TrajectorySource

__all__ = [
    "BufferConfig",
    "BufferEmptyError",
    "ReplayBuffer",
    "Tailer",
    "TrajectorySource",
    "choose_branch",
    "draw_group",
    "recent_min_version",
    "reward_logits",
    "softmax_probs",
    "stale_log_weights",
    "take_newest",
]
