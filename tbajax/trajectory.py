"""One sampled trajectory as it travels searcher -> store -> replay buffer -> training batch.

Host-side numpy only: this is the record format, not a device array. Variable-length fields
stay variable-length here; padding happens once, in `tbajax.batch.collate`.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

import numpy as np


class RewardStatus(enum.IntEnum):
    """How the reward was obtained; anything but OK/WRONG/NO_ANSWER means the grader failed."""

    OK = 0  # graded, correct (or a real-valued score)
    WRONG = 1  # graded, incorrect
    NO_ANSWER = 2  # no parsable answer in the completion
    TIMEOUT = 3  # the grader ran past its time limit and was killed
    ERROR = 4  # the grader raised or crashed


@dataclasses.dataclass(frozen=True)
class Trajectory:
    prompt_id: int  # stable id of the prompt in its dataset
    group_id: int  # unique id of the generation call that produced this prompt's K samples
    prompt_tokens: np.ndarray  # int32 [P]
    response_tokens: np.ndarray  # int32 [R]; includes the stop token when finished
    behavior_logprobs: np.ndarray  # float32 [R]: log-probs under the (tempered) sampling policy
    reward: float
    reward_status: RewardStatus = RewardStatus.OK
    finished: bool = True  # response ended with a stop token (else hit max_new_tokens)
    policy_version: int = 0  # param version the searcher sampled with
    searcher_id: int = 0
    wall_time: float = 0.0  # unix time the sample was generated
    reference_logprobs: np.ndarray | None = None  # float32 [R] when the searcher computed them
    # per-sample extras from the task's scorer (JSON-serialisable): e.g. a victim's answers and
    # their toxicity (red-teaming), a reward model's raw score; for evaluation and logging
    extras: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        r = len(self.response_tokens)
        if len(self.behavior_logprobs) != r:
            raise ValueError(
                f"behavior_logprobs has {len(self.behavior_logprobs)} entries for {r} response tokens"
            )
        if self.reference_logprobs is not None and len(self.reference_logprobs) != r:
            raise ValueError(
                f"reference_logprobs has {len(self.reference_logprobs)} entries for {r} response tokens"
            )

    @property
    def response_key(self) -> bytes:
        """Identity for de-duplication: the prompt and the exact response token sequence."""
        return np.int64(self.prompt_id).tobytes() + np.asarray(self.response_tokens, np.int32).tobytes()
