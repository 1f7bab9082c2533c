"""What to sample: one frozen, hashable config, validated on construction (before any compile)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Sampling controls for one `Sampler.sample` call.

    temperature: 0 means greedy (log-probs are then reported at T = 1); > 0 scales the logits.
    greedy: argmax decoding at any temperature (log-probs still use `temperature`).
    top_k: 0 = off. top_p: 1.0 = off. Both truncate the *sampling* distribution only: the
      reported log-probs are always under the full tempered distribution softmax(logits / T),
      which is what TBA's loss and the trainer's forward compute. top-p without top-k sorts the
      whole vocabulary every step; with top-k it only sorts the k candidates.
    min_new_tokens: stop tokens are suppressed (never sampled) for the first this-many tokens.
    stop_token_ids: a sequence stops after emitting any of these (the stop token is part of the
      response and of its mask). None = the model's eos ids; () = never stop early.
    num_samples: K samples per prompt; the prompt is prefilled once and its cache rows repeated.
    pad_token_id: fills responses after they stop. None = the model's pad id (or 0).
    """

    max_new_tokens: int = 128
    num_samples: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    min_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if not isinstance(self.num_samples, int) or self.num_samples <= 0:
            raise ValueError(
                f"num_samples (K samples per prompt) must be a positive int, got {self.num_samples!r}"
            )
        if not _is_number(self.temperature) or not self.temperature >= 0:  # also rejects NaN
            raise ValueError(
                f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.min_new_tokens, int) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be an int in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_new_tokens!r}"
            )
        if self.stop_token_ids is not None:
            ids = tuple(self.stop_token_ids)
            if any(not isinstance(i, int) or i < 0 for i in ids):
                raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
            object.__setattr__(self, "stop_token_ids", ids)  # lists -> tuple, so the config hashes

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """The T of the distribution the reported log-probs are under."""
        return 1.0 if self.temperature == 0 else float(self.temperature)


def _is_number(x: object) -> bool:
    """A real number, not a bool or None (None is not "off" here: top_p=1.0 and top_k=0 are)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)
