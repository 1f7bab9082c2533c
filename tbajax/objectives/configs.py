"""The built-in objectives' frozen config dataclasses, free of jax.

They live apart from the losses so that a process that only checks a run's config (the launcher,
before any role starts) can validate `train.objective_options` without importing jax; the loss
modules re-export them (`tbajax.objectives.tb.TBConfig` is this `TBConfig`).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Literal

LengthNorm = Literal["sequence", "response", "constant"]
StaleTokenMode = Literal["mask", "cap"]
KLMeanSource = Literal["current", "behaviour"]


def check_stale_token_options(config: Any, *, allow_cap: bool = True) -> None:
    """Validate a config's `stale_token_max_lag` / `stale_token_mode` / `stale_token_ratio_cap`
    (shared by the policy-gradient configs; called from their __post_init__)."""
    name = type(config).__name__
    lag = config.stale_token_max_lag
    if lag is not None and (isinstance(lag, bool) or not isinstance(lag, numbers.Integral) or lag < 0):
        raise ValueError(
            f"{name}.stale_token_max_lag={lag!r}: give an int >= 0 (tokens more than that many "
            "versions behind the trainer are stale) or None (off)"
        )
    if config.stale_token_mode not in ("mask", "cap"):
        raise ValueError(
            f"{name}.stale_token_mode={config.stale_token_mode!r}; choose 'mask' (stale tokens "
            "contribute nothing) or 'cap' (their importance ratio is capped at stale_token_ratio_cap)"
        )
    if config.stale_token_mode == "cap" and not allow_cap:
        raise ValueError(
            f"{name}: stale_token_mode='cap' caps an importance ratio, and this objective has none "
            "(its estimator is on-policy); use stale_token_mode='mask'"
        )
    cap = config.stale_token_ratio_cap
    if isinstance(cap, bool) or not isinstance(cap, numbers.Real) or not cap > 0 or not math.isfinite(cap):
        raise ValueError(f"{name}.stale_token_ratio_cap={cap!r}: give a finite number > 0")


@dataclasses.dataclass(frozen=True)
class TBConfig:
    """VarGrad TB has no static hyperparameters: β comes from `batch.beta`."""


@dataclasses.dataclass(frozen=True)
class LearnedLogZConfig:
    """aux_lr_scale: the trainer's learning rate for the log Z table is lr × this (log Z has
    to travel ~r/β, far more than any policy weight; GFlowNet practice uses ~100×).
    init_log_z: the table's starting value."""

    aux_lr_scale: float = 100.0
    init_log_z: float = 0.0


@dataclasses.dataclass(frozen=True)
class LogZHeadConfig:
    """aux_lr_scale: the head's learning rate is lr × this (as for the table).
    init_log_z: the head's starting bias (its weights start at 0, so log Z(x) = init_log_z).
    reference: read `batch.reference_logprobs` (δ = S − R − r/β); False drops R (δ = S − r/β),
        so neither side computes reference log-probs (red-teaming: the prior is in the reward)."""

    aux_lr_scale: float = 100.0
    init_log_z: float = 0.0
    reference: bool = True


@dataclasses.dataclass(frozen=True)
class DrGRPOConfig:
    """ratio_clip: ρ is capped here with zero gradient above. length_norm "sequence" divides each
    token sum by prompt + response length (the TBA′ reference); "constant" by `norm_constant`
    (Dr. GRPO proper: the generation budget); "response" by the response length.
    stale_token_*: see `tbajax.objectives.policy_gradient` (None: off; "cap" uses the tighter of the two caps)."""

    ratio_clip: float = 8.0
    length_norm: LengthNorm = "sequence"
    norm_constant: float = 1.0
    stale_token_max_lag: int | None = None
    stale_token_mode: StaleTokenMode = "mask"
    stale_token_ratio_cap: float = 1.0

    def __post_init__(self) -> None:
        check_stale_token_options(self)


@dataclasses.dataclass(frozen=True)
class TBAPrimeConfig(DrGRPOConfig):
    """kl_clip: per-token log π − log π_ref is clipped to ±kl_clip inside KL_i.
    kl_mean_source: what the KL penalty is centred with. "current": the group mean of the
    current policy's KL_j (a true group baseline: the advantages' KL parts sum to zero).
    "behaviour": the group mean of the sampling policy's KL, Σ_t clip(log π_old − log π_ref)
    (what the TBA′ reference code used for the paper's MATH and Countdown runs; registered as
    `tba_prime_paper`). Each sample's own KL_i uses the current policy either way; the two agree
    on-policy (π_old = π)."""

    kl_clip: float = 10.0
    kl_mean_source: KLMeanSource = "current"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kl_mean_source not in ("current", "behaviour"):
            raise ValueError(
                f"kl_mean_source={self.kl_mean_source!r}; choose 'current' or 'behaviour' "
                "(the paper's TBA′ runs: 'behaviour', i.e. the objective tba_prime_paper)"
            )


@dataclasses.dataclass(frozen=True)
class TBAPrimePaperConfig(TBAPrimeConfig):
    """TBA′ as the paper's MATH / Countdown runs computed it: KL centred with the behaviour
    policy's group mean."""

    kl_mean_source: KLMeanSource = "behaviour"


@dataclasses.dataclass(frozen=True)
class IcePopConfig:
    """Tokens whose ρ lies outside [ratio_low, ratio_high] are dropped (value and gradient)."""

    ratio_low: float = 0.125
    ratio_high: float = 8.0
    length_norm: LengthNorm = "sequence"
    norm_constant: float = 1.0


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """clip_eps: PPO clip. std_eps: added to the group reward std (ddof=1). kl_penalty: add the
    k3 estimator of KL(π_θ‖π_ref) per token with coefficient batch.beta.
    stale_token_*: see `tbajax.objectives.policy_gradient` (None: off; "mask" drops the KL term too)."""

    clip_eps: float = 0.2
    std_eps: float = 1e-6
    kl_penalty: bool = False
    stale_token_max_lag: int | None = None
    stale_token_mode: StaleTokenMode = "mask"
    stale_token_ratio_cap: float = 1.0

    def __post_init__(self) -> None:
        check_stale_token_options(self)


@dataclasses.dataclass(frozen=True)
class RLOOConfig:
    """kl_in_reward: use r − β·(S − R) (stop-gradient) as the reward.
    stale_token_*: see `tbajax.objectives.policy_gradient` (None: off; "mask" only: no importance ratio here)."""

    kl_in_reward: bool = False
    stale_token_max_lag: int | None = None
    stale_token_mode: StaleTokenMode = "mask"
    stale_token_ratio_cap: float = 1.0

    def __post_init__(self) -> None:
        check_stale_token_options(self, allow_cap=False)


@dataclasses.dataclass(frozen=True)
class ReinforceConfig(RLOOConfig):
    """RLOO's options; REINFORCE puts the KL in its reward by default."""

    kl_in_reward: bool = True


@dataclasses.dataclass(frozen=True)
class OnlineDPOConfig:
    """No static hyperparameters: the DPO coefficient is batch.beta."""
