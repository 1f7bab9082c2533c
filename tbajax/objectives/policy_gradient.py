"""Policy-gradient objectives over groups: TBA′, Dr. GRPO, IcePop, GRPO, RLOO, REINFORCE.

All compute a per-sequence loss ℓ_i and return its mean over real sequences as a Ratio.
Advantages are constants (stop-gradient); importance ratios ρ_t = π_θ / π_old use the behaviour
log-probs of the policy that sampled. Token sums are divided by a per-sequence normaliser chosen
by `length_norm` (see `common.length_normaliser`).

Stale tokens (in-flight weight updates, AReaL-style): with `stale_token_max_lag = N`, a scored
token whose param version (`batch.token_versions`) is more than N behind the trainer's
(`batch.current_version`) is either dropped (`stale_token_mode="mask"`: its per-token term is
removed, value and gradient, while it still counts in the length normaliser, so the other
tokens' weights do not change) or has its importance ratio capped at `stale_token_ratio_cap`
(`"cap"`: zero gradient above the cap, on top of the objective's own clip). RLOO and REINFORCE
have no importance ratio: they take "mask" only (the token leaves S_i; the reward, a sequence
property, is unchanged). None (default) turns the option off and leaves the loss bit-for-bit
as it was.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from tbajax.batch import Batch
from tbajax.objectives.base import Metrics, Ratio
from tbajax.objectives.common import (
    Groups,
    capped_ratio,
    diagnostics,
    groups_of,
    length_normaliser,
    log_ratio,
    row_mean,
    seq_sum,
    seq_sums,
    stale_metrics,
    stale_tokens,
    token_mask,
    windowed_ratio,
)
from tbajax.objectives.configs import (
    KLMeanSource,
    StaleTokenMode,
    DrGRPOConfig,
    GRPOConfig,
    IcePopConfig,
    ReinforceConfig,
    RLOOConfig,
    TBAPrimeConfig,
    TBAPrimePaperConfig,
)

Array = jax.Array
sg = jax.lax.stop_gradient


# --------------------------------------------------------------------------- advantages


def centered_reward(g: Groups, batch: Batch, dtype) -> Array:
    """r_i − r̄ (group mean): the Dr. GRPO advantage."""
    return g.centered(batch.reward.astype(dtype))


def tba_prime_advantage(
    g: Groups, batch: Batch, logprobs: Array, kl_clip: float, kl_mean_source: KLMeanSource = "current"
) -> Array:
    """A_i = (r_i − r̄) − β (KL_i − mean_j KL^c_j), KL_i = Σ_t clip(log π − log π_ref, ±kl_clip);
    KL^c is KL itself ("current") or the same sum with the behaviour log-probs ("behaviour")."""
    m = token_mask(batch, logprobs.dtype)
    ref = batch.reference_logprobs.astype(logprobs.dtype)

    def kl_of(lp: Array) -> Array:
        return seq_sum(jnp.clip(lp - ref, -kl_clip, kl_clip), m)

    kl = kl_of(logprobs)
    if kl_mean_source == "current":
        centre = kl
    elif kl_mean_source == "behaviour":
        centre = kl_of(batch.behavior_logprobs.astype(logprobs.dtype))
    else:
        raise ValueError(f"kl_mean_source={kl_mean_source!r}; choose 'current' or 'behaviour'")
    beta = batch.beta.astype(logprobs.dtype)
    return centered_reward(g, batch, logprobs.dtype) - beta * (kl - g.row(g.mean(centre)))


def kl_regularised_reward(batch: Batch, logprobs: Array) -> Array:
    """r_i − β (S_i − R_i), the KL folded into the reward (as a constant)."""
    kl = seq_sums(batch, logprobs).log_ratio_ref
    return batch.reward.astype(logprobs.dtype) - batch.beta.astype(logprobs.dtype) * sg(kl)


# --------------------------------------------------------------------------- shared tail


def _finish(
    batch: Batch,
    logprobs: Array,
    g: Groups,
    per_seq: Array,
    clipped: Array | None,
    reference: bool,
    stale: Array | None = None,
) -> tuple[Ratio, Metrics]:
    """The mean over real rows, and the diagnostics (kl only when the objective reads the
    reference log-probs: otherwise the trainer may not have computed them; stale_frac only with
    the stale-token option on)."""
    loss = row_mean(g, per_seq)
    metrics = diagnostics(batch, logprobs, clipped, reference=reference)
    metrics.update(stale_metrics(batch, stale, logprobs.dtype))
    metrics["loss"] = loss
    return loss, metrics


def _drop(per_token: Array, stale: Array | None, mode: StaleTokenMode) -> Array:
    """per_token with the stale tokens' terms removed (value and gradient) in "mask" mode."""
    if stale is None or mode != "mask":
        return per_token
    return jnp.where(stale, 0, per_token)


def _stale_log_ratio(lr: Array, stale: Array | None, config) -> Array:
    """log ρ with the stale tokens' ratio capped at `stale_token_ratio_cap` in "cap" mode (a min
    on the log, before any exp, so the capped branch can neither overflow nor pass gradient)."""
    if stale is None or config.stale_token_mode != "cap":
        return lr
    return jnp.where(stale, jnp.minimum(lr, math.log(config.stale_token_ratio_cap)), lr)


def _token_loss(batch: Batch, per_token: Array, norm: Array) -> Array:
    """ℓ_i = Σ_t per_token / norm_i over the response mask, [B]."""
    return seq_sum(per_token, token_mask(batch, per_token.dtype)) / norm


def capped_pg(
    batch: Batch, logprobs: Array, advantage: Array, config: DrGRPOConfig, reference: bool
) -> tuple[Ratio, Metrics]:
    """Per token −ρ_t A_i with ρ_t = min(π_θ/π_old, ratio_clip); shared by Dr. GRPO and TBA′.
    Stale tokens (config.stale_token_*): dropped, or ρ_t capped at the tighter of the two caps."""
    g = groups_of(batch, logprobs.dtype)
    lr = log_ratio(batch, logprobs, token_mask(batch, logprobs.dtype))
    stale = stale_tokens(batch, config.stale_token_max_lag)
    norm = length_normaliser(batch, config.length_norm, config.norm_constant, logprobs.dtype)
    if stale is None:
        rho = capped_ratio(lr, config.ratio_clip)
        per_seq = _token_loss(batch, -rho * sg(advantage)[:, None], norm)
        return _finish(batch, logprobs, g, per_seq, lr > math.log(config.ratio_clip), reference)
    capped_lr = _stale_log_ratio(lr, stale, config)
    rho = capped_ratio(capped_lr, config.ratio_clip)
    clipped = (lr > math.log(config.ratio_clip)) | (capped_lr < lr)
    per_token = _drop(-rho * sg(advantage)[:, None], stale, config.stale_token_mode)
    per_seq = _token_loss(batch, per_token, norm)
    return _finish(batch, logprobs, g, per_seq, clipped, reference, stale)


# --------------------------------------------------------------------------- objectives


def tba_prime(
    batch: Batch, logprobs: Array, config: TBAPrimeConfig = TBAPrimeConfig()
) -> tuple[Ratio, Metrics]:
    """TBA′: the Dr. GRPO loss with the KL-shaped advantage; β = 0 gives `dr_grpo` exactly.

    `config.kl_mean_source` picks the KL centring. The default ("current") centres with the
    current policy's group mean and keeps the default unchanged for existing runs; the paper's
    MATH and Countdown results used "behaviour": run the objective `tba_prime_paper` (this loss
    with `TBAPrimePaperConfig`) to reproduce them.
    """
    g = groups_of(batch, logprobs.dtype)
    advantage = tba_prime_advantage(g, batch, logprobs, config.kl_clip, config.kl_mean_source)
    return capped_pg(batch, logprobs, advantage, config, reference=True)


def dr_grpo(
    batch: Batch, logprobs: Array, config: DrGRPOConfig = DrGRPOConfig()
) -> tuple[Ratio, Metrics]:
    """Dr. GRPO: advantage r − r̄ (no std normalisation), capped ratio, length normaliser."""
    g = groups_of(batch, logprobs.dtype)
    return capped_pg(batch, logprobs, centered_reward(g, batch, logprobs.dtype), config, reference=False)


def icepop(
    batch: Batch, logprobs: Array, config: IcePopConfig = IcePopConfig()
) -> tuple[Ratio, Metrics]:
    """Dr. GRPO with a hard token mask: ρ outside [ratio_low, ratio_high] contributes nothing.

    Dropped tokens still count in the length normaliser. clip_frac = fraction dropped.
    """
    g = groups_of(batch, logprobs.dtype)
    lr = log_ratio(batch, logprobs, token_mask(batch, logprobs.dtype))
    rho, keep = windowed_ratio(lr, config.ratio_low, config.ratio_high)
    adv = sg(centered_reward(g, batch, logprobs.dtype))
    norm = length_normaliser(batch, config.length_norm, config.norm_constant, logprobs.dtype)
    per_seq = _token_loss(batch, -rho * adv[:, None], norm)
    return _finish(batch, logprobs, g, per_seq, ~keep, reference=False)


def grpo(batch: Batch, logprobs: Array, config: GRPOConfig = GRPOConfig()) -> tuple[Ratio, Metrics]:
    """GRPO: A = (r − r̄)/(std + eps); per token −min(ρA, clip(ρ, 1±ε)A) [+ β·k3]; token mean.

    clip_frac counts tokens where the clip is active (zero gradient): ρ > 1+ε with A > 0, or
    ρ < 1−ε with A < 0.
    """
    dtype = logprobs.dtype
    g = groups_of(batch, dtype)
    r = batch.reward.astype(dtype)
    adv = sg(g.centered(r) / (g.row(g.std(r)) + config.std_eps))[:, None]
    m = token_mask(batch, dtype)
    stale = stale_tokens(batch, config.stale_token_max_lag)
    lr = log_ratio(batch, logprobs, m)
    capped_lr = _stale_log_ratio(lr, stale, config)
    rho = jnp.exp(capped_lr)
    eps = config.clip_eps
    per_token = -jnp.minimum(rho * adv, jnp.clip(rho, 1 - eps, 1 + eps) * adv)
    if config.kl_penalty:
        d = jnp.where(m > 0, batch.reference_logprobs.astype(dtype) - logprobs, 0)
        per_token = per_token + batch.beta.astype(dtype) * (jnp.exp(d) - d - 1)
    per_token = _drop(per_token, stale, config.stale_token_mode)
    clipped = ((rho > 1 + eps) & (adv > 0)) | ((rho < 1 - eps) & (adv < 0))
    if stale is not None:
        clipped = clipped | (capped_lr < lr)
    per_seq = _token_loss(batch, per_token, length_normaliser(batch, "response", 1.0, dtype))
    return _finish(batch, logprobs, g, per_seq, clipped, reference=config.kl_penalty, stale=stale)


def rloo(batch: Batch, logprobs: Array, config: RLOOConfig = RLOOConfig()) -> tuple[Ratio, Metrics]:
    """RLOO: ℓ_i = −(r_i − mean_{j≠i} r_j)·S_i (sequence sum, on-policy estimator, no IS)."""
    dtype = logprobs.dtype
    g = groups_of(batch, dtype)
    r = kl_regularised_reward(batch, logprobs) if config.kl_in_reward else batch.reward.astype(dtype)
    k = g.row(g.count)  # real rows in the group
    baseline = (g.row(g.sum(r)) - r) / jnp.maximum(k - 1, 1)
    stale = stale_tokens(batch, config.stale_token_max_lag)
    per_seq = -sg(r - baseline) * _policy_sum(batch, logprobs, stale)
    return _finish(batch, logprobs, g, per_seq, None, reference=config.kl_in_reward, stale=stale)


def reinforce(
    batch: Batch, logprobs: Array, config: ReinforceConfig = ReinforceConfig()
) -> tuple[Ratio, Metrics]:
    """REINFORCE with the group-mean baseline: ℓ_i = −(r̃_i − mean r̃)·S_i, r̃ = r − β(S − R).

    With equal group sizes its gradient is exactly β/2 times VarGrad TB's.
    """
    dtype = logprobs.dtype
    g = groups_of(batch, dtype)
    r = kl_regularised_reward(batch, logprobs) if config.kl_in_reward else batch.reward.astype(dtype)
    stale = stale_tokens(batch, config.stale_token_max_lag)
    per_seq = -sg(g.centered(r)) * _policy_sum(batch, logprobs, stale)
    return _finish(batch, logprobs, g, per_seq, None, reference=config.kl_in_reward, stale=stale)


def _policy_sum(batch: Batch, logprobs: Array, stale: Array | None) -> Array:
    """S_i, [B]; without the stale tokens when there are any to mask (RLOO / REINFORCE)."""
    if stale is None:
        return seq_sums(batch, logprobs).policy
    return seq_sum(logprobs, jnp.where(stale, 0, token_mask(batch, logprobs.dtype)))
