"""Preference-tuning building blocks: win rate, KL, perplexity, lexicon judges, prompt data."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from tbajax.preference import metrics as M

Z95 = 1.959963984540054  # two-sided 95% normal quantile

# --------------------------------------------------------------------------- win rate


def _wilson_by_quadratic(p_hat: float, n: int, z: float) -> tuple[float, float]:
    """The Wilson bounds as the roots of (p̂ − p)² = z² p(1 − p) / n, solved independently."""
    a = 1 + z * z / n
    b = -(2 * p_hat + z * z / n)
    c = p_hat * p_hat
    disc = math.sqrt(b * b - 4 * a * c)
    return (-b - disc) / (2 * a), (-b + disc) / (2 * a)


def test_win_rate_counts_ties_as_declared_and_matches_the_wilson_closed_form():
    policy = [3.0, 1.0, 2.0, 2.0, 5.0, -1.0, 0.5, 7.0]
    reference = [1.0, 2.0, 2.0, 0.0, 4.0, -1.0, 0.4, 9.0]
    # wins: 3>1, 2>0, 5>4, 0.5>0.4 -> 4; ties: 2=2, -1=-1 -> 2; losses: 1<2, 7<9 -> 2
    half = M.win_rate(policy, reference)
    assert (half.wins, half.ties, half.losses, half.n) == (4, 2, 2, 8)
    assert half.rate == pytest.approx(5 / 8)
    assert (half.low, half.high) == pytest.approx(_wilson_by_quadratic(5 / 8, 8, Z95), abs=1e-12)
    assert half.low < half.rate < half.high

    strict = M.win_rate(policy, reference, ties="loss")  # the TBA reference's `>`
    assert strict.rate == pytest.approx(4 / 8) and strict.n == 8
    assert (strict.low, strict.high) == pytest.approx(_wilson_by_quadratic(0.5, 8, Z95), abs=1e-12)

    drop = M.win_rate(policy, reference, ties="drop")
    assert drop.rate == pytest.approx(4 / 6) and drop.n == 6
    assert (drop.low, drop.high) == pytest.approx(_wilson_by_quadratic(4 / 6, 6, Z95), abs=1e-12)

    # a policy identical to the reference scores exactly 0.5 with ties counted half
    same = M.win_rate(reference, reference)
    assert same.rate == 0.5 and same.ties == 8


def test_wilson_interval_hand_values_and_errors():
    # 0 of 10 at 95%: [0, z²/(n + z²)] = [0, 0.2775]
    low, high = M.wilson_interval(0, 10)
    assert low == 0.0 and high == pytest.approx(Z95**2 / (10 + Z95**2), abs=1e-12)
    assert high == pytest.approx(0.2775, abs=1e-4)
    # symmetric around 1/2 for p̂ = 1/2; a higher confidence widens it
    lo, hi = M.wilson_interval(50, 100)
    assert lo + hi == pytest.approx(1.0) and hi - lo == pytest.approx(
        2 * Z95 / (1 + Z95**2 / 100) * math.sqrt(0.25 / 100 + Z95**2 / 40000), abs=1e-12
    )
    lo99, hi99 = M.wilson_interval(50, 100, confidence=0.99)
    assert lo99 < lo and hi99 > hi
    with pytest.raises(ValueError, match="at least one prompt"):
        M.wilson_interval(0, 0)
    with pytest.raises(ValueError, match="one reference score per policy score"):
        M.win_rate([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="finite"):
        M.win_rate([1.0, float("nan")], [1.0, 0.0])
    with pytest.raises(ValueError, match="every prompt tied"):
        M.win_rate([1.0], [1.0], ties="drop")
    with pytest.raises(ValueError, match="ties must be"):
        M.win_rate([1.0], [0.0], ties="win")


# --------------------------------------------------------------------------- KL

P_REF = np.array([0.5, 0.25, 0.25])
P_PI = np.array([0.8, 0.1, 0.1])
KL_REF_PI = 0.5 * math.log(0.5 / 0.8) + 2 * 0.25 * math.log(0.25 / 0.1)  # 0.2231
KL_PI_REF = 0.8 * math.log(0.8 / 0.5) + 2 * 0.1 * math.log(0.1 / 0.25)  # 0.1927


def _logits(*rows: np.ndarray, shift: float = 3.0) -> jnp.ndarray:
    """[1, T, 3] logits whose softmax is each row (shifted: softmax ignores a constant)."""
    return jnp.asarray(np.stack([np.log(r) + shift for r in rows])[None], jnp.float32)


def test_full_vocab_kl_both_directions_on_a_three_token_vocabulary():
    # position 0: a prompt token (masked out, with junk distributions); 1, 2: response tokens
    junk = np.array([0.98, 0.01, 0.01])
    policy = _logits(junk, P_PI, P_REF, shift=-1.0)
    ref = _logits(P_REF[::-1], P_REF, P_REF)
    mask = jnp.array([[False, True, True]])
    fwd = M.kl_ref_pi(policy, ref, mask)
    rev = M.kl_pi_ref(policy, ref, mask)
    assert KL_REF_PI != pytest.approx(KL_PI_REF, abs=1e-2)  # the test can tell the directions apart
    np.testing.assert_allclose(fwd.tokens, [[0.0, KL_REF_PI, 0.0]], atol=1e-6)
    np.testing.assert_allclose(rev.tokens, [[0.0, KL_PI_REF, 0.0]], atol=1e-6)
    np.testing.assert_allclose(fwd.sequence_sum, [KL_REF_PI], atol=1e-6)
    np.testing.assert_allclose(fwd.token_mean, KL_REF_PI / 2, atol=1e-6)
    np.testing.assert_allclose(rev.token_mean, KL_PI_REF / 2, atol=1e-6)


def test_full_vocab_kl_zero_probabilities_and_temperature():
    # the reference puts no mass on tokens 1, 2: KL(ref‖π) = −log π(0), finite
    ref = jnp.array([[[0.0, -jnp.inf, -jnp.inf]]])
    policy = _logits(P_PI)
    mask = jnp.ones((1, 1), bool)
    np.testing.assert_allclose(M.kl_ref_pi(policy, ref, mask).token_mean, -math.log(0.8), atol=1e-6)
    assert np.isinf(float(M.kl_pi_ref(policy, ref, mask).token_mean))  # π has mass where ref has none
    # temperature 2 compares softmax(logits / 2), i.e. sqrt-renormalised distributions
    t_ref, t_pi = np.sqrt(P_REF) / np.sqrt(P_REF).sum(), np.sqrt(P_PI) / np.sqrt(P_PI).sum()
    expected = float((t_ref * np.log(t_ref / t_pi)).sum())
    got = M.kl_ref_pi(_logits(P_PI), _logits(P_REF), mask, temperature=2.0).token_mean
    np.testing.assert_allclose(got, expected, atol=1e-6)


def test_sampled_kl_estimators_hand_values_and_exact_expectations():
    lp_pi = jnp.array([[math.log(0.8), math.log(0.1), 0.0]])
    lp_ref = jnp.array([[math.log(0.5), math.log(0.25), -5.0]])
    mask = jnp.array([[True, True, False]])
    d1, d2 = math.log(0.8 / 0.5), math.log(0.1 / 0.25)
    k1 = M.sampled_kl_pi_ref(lp_pi, lp_ref, mask, estimator="k1")
    np.testing.assert_allclose(k1.tokens, [[d1, d2, 0.0]], atol=1e-6)
    k3 = M.sampled_kl_pi_ref(lp_pi, lp_ref, mask)
    np.testing.assert_allclose(k3.tokens, [[0.5 / 0.8 - 1 + d1, 0.25 / 0.1 - 1 + d2, 0.0]], atol=1e-6)
    np.testing.assert_allclose(k3.sequence_sum, k3.tokens.sum(-1), atol=1e-7)
    # exact expectations over x ~ π (enumerate the vocabulary, weight by π) equal the full-vocab KLs
    all_pi = jnp.log(jnp.asarray(P_PI, jnp.float32))[None]
    all_ref = jnp.log(jnp.asarray(P_REF, jnp.float32))[None]
    ones = jnp.ones((1, 3), bool)
    for est in ("k1", "k3"):
        per_token = M.sampled_kl_pi_ref(all_pi, all_ref, ones, estimator=est).tokens[0]
        assert float((P_PI * per_token).sum()) == pytest.approx(KL_PI_REF, abs=1e-6)
    per_token = M.sampled_kl_ref_pi(all_pi, all_ref, ones).tokens[0]
    assert float((P_PI * per_token).sum()) == pytest.approx(KL_REF_PI, abs=1e-6)
    assert (np.asarray(per_token) >= 0).all()
    with pytest.raises(ValueError, match="estimator"):
        M.sampled_kl_pi_ref(lp_pi, lp_ref, mask, estimator="k2")


# --------------------------------------------------------------------------- perplexity


def test_perplexity_response_only_and_prompt_inclusive_hand_values():
    # row 0: 2 prompt + 2 response tokens (NLL 1 + 2) + 1 pad; row 1: 1 prompt + 3 response (NLL 0.5 each)
    logprobs = jnp.array([[-9.0, -7.0, -1.0, -2.0, -4.0], [-3.0, -0.5, -0.5, -0.5, 0.0]])
    response = jnp.array([[0, 0, 1, 1, 0], [0, 1, 1, 1, 0]], bool)
    attention = jnp.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 0]], bool)
    resp = M.response_perplexity(logprobs, response)
    np.testing.assert_allclose(resp.per_sequence, [math.exp(3 / 2), math.exp(1.5 / 3)], rtol=1e-6)
    np.testing.assert_allclose(resp.mean, (math.exp(1.5) + math.exp(0.5)) / 2, rtol=1e-6)
    np.testing.assert_allclose(resp.pooled, math.exp(4.5 / 5), rtol=1e-6)
    incl = M.prompt_inclusive_perplexity(logprobs, response, attention)
    np.testing.assert_allclose(incl.per_sequence, [math.exp(3 / 4), math.exp(1.5 / 4)], rtol=1e-6)
    np.testing.assert_allclose(incl.pooled, math.exp(4.5 / 8), rtol=1e-6)
    # a row without response tokens is NaN and leaves mean / pooled unchanged
    empty = M.response_perplexity(jnp.concatenate([logprobs, logprobs[:1]]), jnp.concatenate([response, 0 * response[:1]]))
    assert np.isnan(empty.per_sequence[2])
    np.testing.assert_allclose([empty.mean, empty.pooled], [resp.mean, resp.pooled], rtol=1e-6)


def test_token_logprobs_from_logits_gathers_the_log_softmax():
    logits = _logits(P_PI, P_REF)
    got = M.token_logprobs_from_logits(logits, jnp.array([[0, 2]]))
    np.testing.assert_allclose(got, [[math.log(0.8), math.log(0.25)]], atol=1e-6)
