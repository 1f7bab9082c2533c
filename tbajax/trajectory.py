"""One sampled trajectory as it travels searcher -> store -> replay buffer -> training batch.

Host-side numpy only: this is the record format, not a device array. Variable-length fields
stay variable-length here; padding happens once, in `tbajax.batch.collate`.

Versions: a searcher that swaps params in the middle of a generation (in-flight weight updates)
produces samples whose tokens come from several param versions. `token_versions[t]` is the
version whose logits produced response token t; `policy_version` is the *oldest* of them (the
version the sample started with when versions only grow), so the sample-level lag
`current - policy_version` is the largest lag of any of its tokens and buffer staleness rules
that read `policy_version` stay conservative. A sample from one version needs no
`token_versions`: omitted, it is every token = `policy_version`.
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
    policy_version: int = 0  # param version the searcher sampled with; the oldest one when
    #   `token_versions` holds several (see the module docstring)
    searcher_id: int = 0
    wall_time: float = 0.0  # unix time the sample was generated
    reference_logprobs: np.ndarray | None = None  # float32 [R] when the searcher computed them
    # per-sample extras from the task's scorer (JSON-serialisable): e.g. a victim's answers and
    # their toxicity (red-teaming), a reward model's raw score; for evaluation and logging
    extras: Mapping[str, Any] | None = None
    # int32 [R]: the param version that produced each response token. None (the default) is
    # filled in as every token = policy_version, so after construction it is always an array
    # (then a read-only broadcast of one int32: a buffer of single-version rows costs nothing more).
    token_versions: np.ndarray | None = None

    def __post_init__(self) -> None:
        r = len(self.response_tokens)
        if self.token_versions is None:
            versions = np.broadcast_to(np.int32(self.policy_version), (r,))
        else:
            versions = _versions_array(self.token_versions, r, self.policy_version)
        object.__setattr__(self, "token_versions", versions)  # frozen: the one normalisation
        if len(self.behavior_logprobs) != r:
            raise ValueError(
                f"behavior_logprobs has {len(self.behavior_logprobs)} entries for {r} response tokens"
            )
        if self.reference_logprobs is not None and len(self.reference_logprobs) != r:
            raise ValueError(
                f"reference_logprobs has {len(self.reference_logprobs)} entries for {r} response tokens"
            )

    @property
    def mixed_versions(self) -> bool:
        """Whether the tokens come from more than one param version."""
        return bool(len(self.token_versions)) and bool((self.token_versions != self.policy_version).any())

    @property
    def response_key(self) -> bytes:
        """Identity for de-duplication: the prompt and the exact response token sequence."""
        return np.int64(self.prompt_id).tobytes() + np.asarray(self.response_tokens, np.int32).tobytes()


def _versions_array(x: Any, length: int, policy_version: int) -> np.ndarray:
    a = np.asarray(x)
    if a.shape != (length,) or (a.size and a.dtype.kind not in "iu"):
        raise ValueError(
            f"token_versions must be an integer array with one entry per response token ({length}), "
            f"got {a.dtype}{list(a.shape)}"
        )
    if a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
        raise ValueError("token_versions has values outside int32")
    if a.size and int(a.min()) != int(policy_version):
        raise ValueError(
            f"policy_version is {policy_version} but the oldest of token_versions is {int(a.min())}: "
            "policy_version must be the oldest version that produced a token of the sample"
        )
    return a.astype(np.int32, copy=False)
