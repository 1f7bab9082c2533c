"""LoRA's config, apart from the transform (tbajax.models.lora) so that reading an experiment
config imports no jax."""

from __future__ import annotations

import dataclasses


class LoraDropoutError(NotImplementedError, ValueError):
    """LoRA dropout other than 0 was asked for (a ValueError too, so config parsing reports it)."""


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """rank r, alpha (scale = alpha / r) and the weights to adapt.

    targets: names or glob patterns matched against our dotted param names (e.g. "q_proj"
    matches "layers.q_proj"; "layers.*_proj" every stacked projection). Every target must match
    at least one weight. Dropout is not implemented: it must stay 0.
    """

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if not self.targets:
            raise ValueError(
                "LoraConfig.targets is empty: name the weights to adapt, e.g. ('q_proj', 'v_proj')"
            )
        if isinstance(self.targets, str):
            raise TypeError(f"LoraConfig.targets must be a tuple of names, got the string {self.targets!r}")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be > 0 (the adapters' scale is alpha / rank), got {self.alpha}")
        if any(not isinstance(t, str) or not t for t in self.targets):
            raise ValueError(f"LoraConfig.targets must be non-empty names or patterns, got {self.targets!r}")
        if self.dropout != 0.0:
            raise LoraDropoutError(
                f"LoRA dropout={self.dropout} is not implemented (adapters train without dropout); use 0.0"
            )

    @property
    def scale(self) -> float:
        return self.alpha / self.rank
