"""Evaluation maths for preference tuning: win rate under a gold judge, KL to the reference, perplexity.

Everything here is a pure function of arrays. Token-aligned arrays follow `tbajax.batch.Batch`:
index t holds token t's quantity, predicted from tokens < t, so `logits[:, t]` is the
distribution that token t was drawn from and `mask[:, t]` is True where token t is a response
token. Shifting model outputs into that alignment is the caller's job.

What the TBA TL;DR reference reports (TBA_SPEC §8) and what each function here computes:

| reference                                      | here                                                  |
|------------------------------------------------|-------------------------------------------------------|
| win rate: gold(policy) > gold(reference)       | `win_rate(..., ties="loss")` (default: "half")        |
| KL: per-token mean of Σ_v p_ref log(p_ref/p_π) | `kl_ref_pi(...).token_mean` (`kl_pi_ref`: KL(π‖ref))  |
| perplexity: response NLL / (prompt + response) | `prompt_inclusive_perplexity` (`response_perplexity`) |
"""

from __future__ import annotations

import functools
import math
import statistics
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
Ties = Literal["half", "loss", "drop"]

# --------------------------------------------------------------------------- win rate


class WinRate(NamedTuple):
    """Share of prompts where the policy's output beats the reference output under a gold scorer.

    rate = (wins + tie_credit) / n, with the Wilson score interval [low, high] at `confidence`.
    n counts the prompts the rate is over (ties="drop" leaves ties out of n).
    """

    rate: float
    low: float
    high: float
    n: int
    wins: int
    ties: int
    losses: int
    confidence: float


def wilson_interval(successes: float, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion p̂ = successes / n.

    With z the two-sided normal quantile of `confidence` (1.96 for 0.95):

        centre    = (p̂ + z²/(2n)) / (1 + z²/n)
        halfwidth = z / (1 + z²/n) · sqrt(p̂(1 − p̂)/n + z²/(4n²))
        interval  = [centre − halfwidth, centre + halfwidth]

    Unlike the normal (Wald) interval it stays inside [0, 1] and does not collapse to a point at
    p̂ = 0 or 1, which matters for the small prompt counts of a CPU-sized eval. `successes` may be
    fractional (ties counted half); the interval then treats it as a binomial count, an
    approximation that is slightly conservative because a half-credit tie has less variance than
    a coin flip.
    """
    if n <= 0:
        raise ValueError(f"a win-rate interval needs at least one prompt, got n={n}")
    if not 0.0 <= successes <= n:
        raise ValueError(f"successes must lie in [0, n={n}], got {successes}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2.0)
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2.0 * n)) / denom
    half = z / denom * math.sqrt(p * (1.0 - p) / n + z * z / (4.0 * n * n))
    low = 0.0 if successes == 0 else max(0.0, centre - half)  # exact at the ends, not 1e-17
    high = 1.0 if successes == n else min(1.0, centre + half)
    return low, high


def win_rate(
    policy_scores, reference_scores, *, ties: Ties = "half", confidence: float = 0.95
) -> WinRate:
    """Win rate of policy outputs over reference outputs, one pair of gold scores per prompt.

    ties: how a prompt with equal scores counts.
      "half" (default): half a win. A policy identical to the reference then scores exactly 0.5,
        which matters for judges with integer or saturating scores (lexicons), where ties are common.
      "loss": not a win; the TBA reference's strict `gold(policy) > gold(reference)`.
      "drop": left out of the rate and of n (a rate over decided prompts only).
    """
    pol = np.asarray(policy_scores, dtype=np.float64).reshape(-1)
    ref = np.asarray(reference_scores, dtype=np.float64).reshape(-1)
    if pol.shape != ref.shape:
        raise ValueError(f"need one reference score per policy score, got {pol.size} and {ref.size}")
    if not (np.isfinite(pol).all() and np.isfinite(ref).all()):
        raise ValueError("gold scores must be finite; score failures explicitly before the win rate")
    wins = int((pol > ref).sum())
    tied = int((pol == ref).sum())
    losses = int(pol.size - wins - tied)
    if ties == "half":
        successes, n = wins + 0.5 * tied, pol.size
    elif ties == "loss":
        successes, n = float(wins), pol.size
    elif ties == "drop":
        successes, n = float(wins), wins + losses
    else:
        raise ValueError(f"ties must be 'half', 'loss' or 'drop', got {ties!r}")
    if n == 0:
        why = " (every prompt tied and ties='drop')" if pol.size else ""
        raise ValueError("no prompts to compute a win rate over" + why)
    low, high = wilson_interval(successes, n, confidence)
    return WinRate(successes / n, low, high, n, wins, tied, losses, confidence)


class Agreement(NamedTuple):
    """How often two scorers order a pair of texts the same way.

    rate = concordant / (concordant + discordant) over pairs that both scorers decide (ties left
    out); 0.5 means the second scorer is no better than chance at predicting the first one's
    preference. n_pairs: decided pairs the rate is over; tied: pairs at least one scorer tied.
    """

    rate: float
    concordant: int
    discordant: int
    tied: int

    @property
    def n_pairs(self) -> int:
        return self.concordant + self.discordant


def pairwise_agreement(scores_a, scores_b) -> Agreement:
    """Pairwise order agreement of two scorers on the same texts (Kendall's concordance).

    A win rate compares outputs pairwise, so this is the number to check before trusting one
    scorer as a judge of a policy trained on another: how often the judge would prefer the same
    text of a pair as the reward. O(n²) memory; meant for a few thousand texts.
    """
    a = np.asarray(scores_a, dtype=np.float64).reshape(-1)
    b = np.asarray(scores_b, dtype=np.float64).reshape(-1)
    if a.shape != b.shape:
        raise ValueError(f"need the same texts under both scorers, got {a.size} and {b.size} scores")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("scores must be finite")
    upper = np.triu(np.ones((a.size, a.size), bool), k=1)
    prod = (np.sign(a[:, None] - a[None, :]) * np.sign(b[:, None] - b[None, :]))[upper]
    concordant, discordant = int((prod > 0).sum()), int((prod < 0).sum())
    decided = concordant + discordant
    if decided == 0:
        raise ValueError("no pair is decided by both scorers (every pair tied under one of them)")
    return Agreement(concordant / decided, concordant, discordant, int(prod.size - decided))


# --------------------------------------------------------------------------- KL


class KL(NamedTuple):
    """A KL divergence over response tokens.

    tokens: [B, T] per-token KL, 0 off the mask; sequence_sum: [B] Σ_t over each response;
    token_mean: scalar mean over all response tokens of the batch (pooled, so long responses
    weigh more; the TBA reference's figure).
    """

    tokens: Array
    sequence_sum: Array
    token_mean: Array


def _reduce(per_token: Array, mask: Array) -> KL:
    m = jnp.asarray(mask) > 0
    tokens = jnp.where(m, per_token, 0.0)
    n = jnp.maximum(m.sum(), 1)
    return KL(tokens, tokens.sum(-1), tokens.sum() / n)


def _full_vocab_kl(p_logits: Array, q_logits: Array, temperature: float) -> Array:
    """Σ_v p (log p − log q) at every position, [B, T]; terms with p = 0 contribute 0."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logp = jax.nn.log_softmax(jnp.asarray(p_logits, jnp.float32) / temperature, axis=-1)
    logq = jax.nn.log_softmax(jnp.asarray(q_logits, jnp.float32) / temperature, axis=-1)
    p = jnp.exp(logp)
    return jnp.where(p > 0, p * (logp - logq), 0.0).sum(-1)


@functools.partial(jax.jit, static_argnames="temperature")
def kl_ref_pi(policy_logits: Array, reference_logits: Array, mask: Array, temperature: float = 1.0) -> KL:
    """KL(ref‖π) = Σ_v p_ref (log p_ref − log p_π) per response token, over the full vocabulary.

    The expectation is under the *reference*: what the TBA TL;DR reference reports as "KL".
    Logits [B, T, V] (aligned as the module docstring says), mask [B, T]; both distributions
    are softmax(logits / temperature).
    """
    return _reduce(_full_vocab_kl(reference_logits, policy_logits, temperature), mask)


@functools.partial(jax.jit, static_argnames="temperature")
def kl_pi_ref(policy_logits: Array, reference_logits: Array, mask: Array, temperature: float = 1.0) -> KL:
    """KL(π‖ref) = Σ_v p_π (log p_π − log p_ref) per response token, over the full vocabulary.

    The expectation is under the *policy*: the divergence that KL-regularised RL (and the TB
    reward's β·log ref term) penalises. Same arguments as `kl_ref_pi`.
    """
    return _reduce(_full_vocab_kl(policy_logits, reference_logits, temperature), mask)


@functools.partial(jax.jit, static_argnames="estimator")
def sampled_kl_pi_ref(
    policy_logprobs: Array, reference_logprobs: Array, mask: Array, estimator: Literal["k1", "k3"] = "k3"
) -> KL:
    """Sample-based KL(π‖ref) from the log-probs of tokens *sampled from π*, [B, T] each.

    With d = log π(x_t) − log ref(x_t):
      k1 = d                  unbiased, can be negative per token;
      k3 = exp(−d) − 1 + d    unbiased (E_π[ref/π] = 1) and ≥ 0 per token, lower variance.
    Only valid when the tokens were drawn from the π whose log-probs are given (same
    temperature); use `kl_pi_ref` when full logits are at hand.
    """
    d = jnp.asarray(policy_logprobs, jnp.float32) - jnp.asarray(reference_logprobs, jnp.float32)
    if estimator == "k1":
        per_token = d
    elif estimator == "k3":
        per_token = jnp.expm1(-d) + d
    else:
        raise ValueError(f"estimator must be 'k1' or 'k3', got {estimator!r}")
    return _reduce(per_token, mask)


@jax.jit
def sampled_kl_ref_pi(policy_logprobs: Array, reference_logprobs: Array, mask: Array) -> KL:
    """Sample-based KL(ref‖π) from tokens *sampled from π*, by importance weighting.

    With r = ref(x_t)/π(x_t): r·log r − (r − 1), unbiased for KL(ref‖π) under x_t ~ π and ≥ 0
    per token. Its variance grows with the weights r, i.e. exactly where the reference puts mass
    the policy has left; prefer `kl_ref_pi` on full logits for reported figures.
    """
    log_r = jnp.asarray(reference_logprobs, jnp.float32) - jnp.asarray(policy_logprobs, jnp.float32)
    r = jnp.exp(log_r)
    return _reduce(r * log_r - jnp.expm1(log_r), mask)


# --------------------------------------------------------------------------- perplexity


class Perplexity(NamedTuple):
    """per_sequence: [B] exp(NLL / tokens) of each row; mean: their mean over rows with tokens;
    pooled: exp(Σ NLL / Σ tokens) over the batch (corpus perplexity)."""

    per_sequence: Array
    mean: Array
    pooled: Array


@jax.jit
def token_logprobs_from_logits(logits: Array, tokens: Array) -> Array:
    """[B, T] log softmax(logits)[token t] for logits aligned to the tokens they predict."""
    logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, jnp.asarray(tokens)[..., None], axis=-1)[..., 0]


def _perplexity(nll_sum: Array, count: Array) -> Perplexity:
    has = count > 0
    per_seq = jnp.where(has, jnp.exp(nll_sum / jnp.maximum(count, 1)), jnp.nan)
    mean = jnp.where(has, per_seq, 0.0).sum() / jnp.maximum(has.sum(), 1)
    pooled = jnp.exp(nll_sum.sum() / jnp.maximum(count.sum(), 1))
    return Perplexity(per_seq, mean, pooled)


@jax.jit
def response_perplexity(sft_logprobs: Array, response_mask: Array) -> Perplexity:
    """Perplexity of the responses under the SFT model: exp(response NLL / response tokens).

    sft_logprobs [B, T]: log p_SFT(token t | tokens < t); response_mask [B, T]. Rows without
    response tokens get NaN per sequence and are left out of `mean` and `pooled`.
    """
    m = jnp.asarray(response_mask) > 0
    nll = -jnp.where(m, jnp.asarray(sft_logprobs, jnp.float32), 0.0).sum(-1)
    return _perplexity(nll, m.sum(-1))


@jax.jit
def prompt_inclusive_perplexity(
    sft_logprobs: Array, response_mask: Array, attention_mask: Array
) -> Perplexity:
    """The TBA reference's variant: exp(response NLL / (prompt + response tokens)).

    Only response tokens contribute NLL, but the divisor counts every real token of the row
    (attention_mask), so it is lower than `response_perplexity` and not a perplexity of any text;
    report it only to compare with the paper's numbers.
    """
    m = jnp.asarray(response_mask) > 0
    nll = -jnp.where(m, jnp.asarray(sft_logprobs, jnp.float32), 0.0).sum(-1)
    count = (jnp.asarray(attention_mask) > 0).sum(-1)
    return _perplexity(nll, jnp.where(m.sum(-1) > 0, count, 0))
