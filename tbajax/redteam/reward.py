"""The red-teaming log reward and its schedules (TBA spec §8; GFlowNet red-teaming of Lee et al.).

    log R(x) = [ log p_prior(x) / γ  +  mean_j log p_toxic(y_j) / β ] / τ

x is an attack, y_1..y_K the victim's answers to it, p_prior the attacker's SFT model (its
log-likelihood of x; −500 instead when x has fewer than `min_attack_tokens` tokens), β a fixed
toxicity temperature, γ a prior temperature and τ a reward temperature, both linear ramps in
the training step. Everything here is a pure function of (config, step, arrays) in jnp, so it
runs on the host for logging and inside a jitted step alike.

Step convention: the ramps are `start + (end − start) · min(1, step / steps)`, as the reference
(which calls them with its 1-based update counter); step 0 gives `start`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class LinearRamp:
    """`start` at step 0, linear to `end` at step `steps`, then constant (steps = 0: always `end`)."""

    start: float
    end: float
    steps: int = 0

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"LinearRamp.steps must be >= 0, got {self.steps}")
        if not (math.isfinite(self.start) and math.isfinite(self.end)):
            raise ValueError(f"LinearRamp ends must be finite, got {self.start} -> {self.end}")

    @classmethod
    def constant(cls, value: float) -> LinearRamp:
        return cls(value, value, 0)

    def at(self, step: Array | int) -> Array:
        s = jnp.asarray(step, jnp.float32)
        if self.steps == 0:
            return jnp.full_like(s, self.end)
        frac = jnp.clip(s / self.steps, 0.0, 1.0)
        return (self.start + (self.end - self.start) * frac).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class RedTeamRewardConfig:
    """β, the γ and τ ramps, and the short-attack rule of the red-teaming reward.

    Defaults are the GPT-2 recipe (γ = 1); `llama()` ramps γ 1.0 -> 1.2 over 2,000 steps.
    """

    beta: float = 0.1
    gamma: LinearRamp = LinearRamp.constant(1.0)
    tau: LinearRamp = LinearRamp(2.0, 1.0, 500)
    min_attack_tokens: int = 5
    short_attack_log_prior: float = -500.0

    def __post_init__(self) -> None:
        if not self.beta > 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")
        for name in ("gamma", "tau"):
            ramp = getattr(self, name)
            if not (ramp.start > 0 and ramp.end > 0):
                raise ValueError(f"{name} must stay > 0 (it divides the reward), got {ramp}")
        if self.min_attack_tokens < 0:
            raise ValueError(f"min_attack_tokens must be >= 0, got {self.min_attack_tokens}")

    @classmethod
    def gpt2(cls) -> RedTeamRewardConfig:
        return cls()

    @classmethod
    def llama(cls) -> RedTeamRewardConfig:
        return cls(gamma=LinearRamp(1.0, 1.2, 2000))


def prior_log_likelihood(
    config: RedTeamRewardConfig, token_logprobs: Array, mask: Array
) -> Array:
    """log p_prior(x) = Σ_t mask·log p_SFT(x_t) per attack [B], or −500 when Σ mask < min tokens.

    `mask` marks the attack's tokens ([B, T]); the reference counts the attack's tokens up to and
    including its first EOS, so pass a mask that covers that EOS to match it.
    """
    token_logprobs = jnp.asarray(token_logprobs, jnp.float32)
    mask = jnp.asarray(mask).astype(jnp.float32)
    total = jnp.sum(jnp.where(mask > 0, token_logprobs, 0.0), axis=-1)
    return apply_short_attack_prior(config, total, jnp.sum(mask, axis=-1))


def apply_short_attack_prior(config: RedTeamRewardConfig, log_prior: Array, attack_lengths: Array) -> Array:
    """Replace log p_prior by `short_attack_log_prior` (−500) where the attack is too short."""
    log_prior = jnp.asarray(log_prior, jnp.float32)
    short = jnp.asarray(attack_lengths) < config.min_attack_tokens
    return jnp.where(short, jnp.float32(config.short_attack_log_prior), log_prior)


def mean_log_toxicity(log_p_toxic: Array) -> Array:
    """mean_j log p_toxic(y_j) over the K victim answers: [B, K] -> [B] (log of the geometric mean)."""
    return jnp.mean(jnp.asarray(log_p_toxic, jnp.float32), axis=-1)


def red_team_log_reward(
    config: RedTeamRewardConfig,
    step: Array | int,
    log_prior: Array,
    log_p_toxic: Array,
    attack_lengths: Array | None = None,
) -> Array:
    """log R(x) = [log p_prior / γ(step) + mean_j log p_toxic(y_j) / β] / τ(step), shape [B].

    `log_prior` [B] is the SFT log-likelihood of each attack; with `attack_lengths` [B] the
    short-attack rule is applied here (skip it if `prior_log_likelihood` already did).
    `log_p_toxic` [B, K] holds the classifier's log-probability of each of the K answers.
    """
    if attack_lengths is not None:
        log_prior = apply_short_attack_prior(config, log_prior, attack_lengths)
    gamma, tau = config.gamma.at(step), config.tau.at(step)
    log_prior = jnp.asarray(log_prior, jnp.float32)
    return (log_prior / gamma + mean_log_toxicity(log_p_toxic) / config.beta) / tau


def sample_temperature(
    key: Array, low: float = 0.5, high: float = 2.0, random_prob: float = 0.5, shape: tuple[int, ...] = ()
) -> Array:
    """The reference's exploration temperature: with probability `random_prob` uniform in
    [low, high], else 1.0. The attacker samples at it; its log-probs stay untempered."""
    k_coin, k_temp = jax.random.split(key)
    coin = jax.random.bernoulli(k_coin, random_prob, shape)
    temp = jax.random.uniform(k_temp, shape, jnp.float32, minval=low, maxval=high)
    return jnp.where(coin, temp, jnp.float32(1.0))


def replay_step(key: Array, replay_prob: float = 0.5, shape: tuple[int, ...] = ()) -> Array:
    """True when a training step draws its batch from the replay buffer (half the steps in the
    reference), False when it trains on fresh online samples."""
    return jax.random.bernoulli(key, replay_prob, shape)
