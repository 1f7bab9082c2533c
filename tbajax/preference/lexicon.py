"""Rule-based sentiment scorers over the lexicon files that PyPI packages ship, in pure python.

Three judges for the offline preference experiment (TBA_SPEC §8), each reproducing a
published scorer exactly so numbers can be checked against the real package:

- `Afinn`: AFINN-165 (afinn==0.1). score = Σ valence of the lexicon entries found in the text,
  found as the package does: lower-cased text, whitespace runs collapsed, then a regex
  alternation of all entries (longest first, multi-word entries included) between word
  boundaries, scanned left to right. Integer valences in [−5, 5]; unbounded sum, so longer texts
  score further from 0.
- `Vader`: VADER's compound score (vaderSentiment==3.3.2): word valences adjusted by boosters
  and dampeners, ALL-CAPS emphasis, negations up to three words back, "but", "least", a few
  idioms, and ! / ? emphasis, summed and squashed by x / sqrt(x² + 15) into [−1, 1].
- `TextBlobSentiment`: TextBlob's default polarity (textblob==0.20.1, pattern's en-sentiment.xml):
  the *mean* polarity of the assessed words (mostly adjectives) with intensifiers, "not" × −0.5
  and "!"; in [−1, 1] and independent of length.

How independent they are matters when one judges a policy trained on another. AFINN and VADER
overlap a lot: 78% of AFINN's 3,382 entries are in VADER's 7,506, with the same sign 97% of the
time; their rules differ (plain sum vs negation-aware and normalised). TextBlob's 1,528 forms
(2,860 with the adverbs it derives) share only ~31% with either, and it averages, not sums.

Files come from `python experiments/assets/fetch_lexicons.py` (default <cache>/lexicons, with
<cache> = $TBAJAX_CACHE or ~/.cache/tbajax); each class's `load()` reads them from there, or from
explicit paths. Each reproduces its package exactly (tests compare against the real code).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import string
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Iterable, Mapping, NamedTuple

FETCH_HINT = "run `python experiments/assets/fetch_lexicons.py` (needs PyPI once) or pass the file path"


def lexicon_dir() -> Path:
    """Where fetch_lexicons.py extracts the files: $TBAJAX_CACHE/lexicons (default ~/.cache/tbajax)."""
    return Path(os.environ.get("TBAJAX_CACHE", "~/.cache/tbajax")).expanduser() / "lexicons"


def _resolve(path: str | Path | None, default_name: str) -> Path:
    p = Path(path).expanduser() if path is not None else lexicon_dir() / default_name
    if not p.is_file():
        raise FileNotFoundError(f"lexicon file {p} not found; {FETCH_HINT}")
    return p


def _tab_rows(path: Path, fields: int) -> list[list[str]]:
    """The first `fields` tab-separated fields of each line, stripped (the files have CRLF lines)."""
    rows = []
    for n, line in enumerate(path.read_bytes().decode("utf-8").rstrip("\n").split("\n"), start=1):
        if not line.strip():
            continue
        parts = line.strip().split("\t")
        if len(parts) < fields:
            raise ValueError(f"{path}:{n}: expected {fields} tab-separated fields, got {line!r}")
        rows.append(parts[:fields])
    return rows


# --------------------------------------------------------------------------- AFINN


_WORD_BOUNDARY = re.compile(r"\b")
_END = ""  # trie key marking "an entry ends here" (no character is the empty string)


def _trie(entries: Iterable[str]) -> dict:
    root: dict = {}
    for entry in entries:
        node = root
        for ch in entry:
            node = node.setdefault(ch, {})
        node[_END] = entry
    return root


def _longest_at(trie: dict, text: str, start: int, ends_ok) -> str | None:
    """The longest entry spelled by text[start:...] whose end position passes `ends_ok`."""
    node, best = trie, None
    for pos in range(start, len(text)):
        node = node.get(text[pos])
        if node is None:
            break
        if _END in node and ends_ok(pos + 1):
            best = node[_END]
    return best


@dataclasses.dataclass(frozen=True)
class Afinn:
    """AFINN sum-of-valences scorer (afinn==0.1's `Afinn(...).score`).

    The package matches one regex alternation of all entries, longest first, between word
    boundaries (`\\b`), with findall. The equivalent here: scan left to right; at a word boundary
    take the longest entry that also ends at a word boundary (Python's own `\\b` positions, so the
    boundaries are the same); with emoticons, when no word entry matches, the longest emoticon
    (no boundaries needed); after a match continue at its end, else at the next character.
    A trie makes this ~20× faster than the 3,382-way regex.

    valences: entry -> integer valence; words / emoticons: tries of the two entry sets.
    """

    valences: Mapping[str, int]
    words: Mapping
    emoticons: Mapping

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        *,
        emoticons: bool = False,
        emoticons_path: str | Path | None = None,
    ) -> Afinn:
        """From AFINN-en-165.txt; emoticons=True also matches AFINN-emoticon-8.txt's entries."""
        words = cls._read(_resolve(path, "AFINN-en-165.txt"))
        emo = cls._read(_resolve(emoticons_path, "AFINN-emoticon-8.txt")) if emoticons else {}
        return cls(MappingProxyType({**words, **emo}), _trie(words), _trie(emo))

    @staticmethod
    def _read(path: Path) -> dict[str, int]:
        out: dict[str, int] = {}
        for n, line in enumerate(path.read_bytes().decode("utf-8").splitlines(), start=1):
            parts = line.strip().split("\t")
            if len(parts) != 2:
                raise ValueError(f"{path}:{n}: expected 'entry<TAB>valence', got {line!r}")
            out[parts[0]] = int(parts[1])
        return out

    def matches(self, text: str) -> list[str]:
        """Lexicon entries found in the text, in order (lower-cased, whitespace collapsed)."""
        text = re.sub(r"\s+", " ", text).lower()
        bounds = {m.start() for m in _WORD_BOUNDARY.finditer(text)}
        found, pos = [], 0
        while pos < len(text):
            entry = _longest_at(self.words, text, pos, bounds.__contains__) if pos in bounds else None
            if entry is None and self.emoticons:
                entry = _longest_at(self.emoticons, text, pos, lambda _: True)
            if entry is None:
                pos += 1
            else:
                found.append(entry)
                pos += len(entry)
        return found

    def score(self, text: str) -> float:
        """Σ valence over `matches(text)`; 0.0 when nothing matches."""
        return float(sum(self.valences[m] for m in self.matches(text)))


# --------------------------------------------------------------------------- VADER

# Constants of vaderSentiment 3.3.2 (its empirically derived intensity increments).
BOOST = 0.293  # a booster word ("very") moves a valence this far from 0; a dampener, back toward it
CAPS_BOOST = 0.733  # an ALL-CAPS sentiment word among non-caps words
NEGATION_SCALE = -0.74  # a negated valence flips sign and shrinks
EXCLAMATION_BOOST = 0.292  # per "!", up to 4
COMPOUND_ALPHA = 15.0  # compound = x / sqrt(x² + alpha)

NEGATIONS = frozenset(
    "aint arent cannot cant couldnt darent didnt doesnt ain't aren't can't couldn't daren't didn't "
    "doesn't dont hadnt hasnt havent isnt mightnt mustnt neither don't hadn't hasn't haven't isn't "
    "mightn't mustn't neednt needn't never none nope nor not nothing nowhere oughtnt shant shouldnt "
    "uhuh wasnt werent oughtn't shan't shouldn't uh-uh wasn't weren't without wont wouldnt won't "
    "wouldn't rarely seldom despite".split()
)

_BOOSTERS_UP = (
    "absolutely amazingly awfully completely considerable considerably decidedly deeply effing "
    "enormous enormously entirely especially exceptional exceptionally extreme extremely fabulously "
    "flipping flippin frackin fracking fricking frickin frigging friggin fully fuckin fucking fuggin "
    "fugging greatly hella highly hugely incredible incredibly intensely major majorly more most "
    "particularly purely quite really remarkably so substantially thoroughly total totally tremendous "
    "tremendously uber unbelievably unusually utter utterly very"
).split()
_BOOSTERS_DOWN = (
    "almost barely hardly kinda kindof kind-of less little marginal marginally occasional "
    "occasionally partly scarce scarcely slight slightly somewhat sorta sortof sort-of"
).split() + ["just enough", "kind of", "sort of"]
BOOSTERS: Mapping[str, float] = MappingProxyType(
    {**{w: BOOST for w in _BOOSTERS_UP}, **{w: -BOOST for w in _BOOSTERS_DOWN}}
)

# Phrases whose valence replaces the lexicon word's ("the bomb" is good, "bus stop" neutral).
SPECIAL_CASES: Mapping[str, float] = MappingProxyType(
    {
        "the shit": 3.0,
        "the bomb": 3.0,
        "bad ass": 1.5,
        "badass": 1.5,
        "bus stop": 0.0,
        "yeah right": -2.0,
        "kiss of death": -1.5,
        "to die for": 3.0,
        "beating heart": 3.5,
    }
)

_SO_THIS = ("so", "this")


class VaderScores(NamedTuple):
    """VADER's outputs, unrounded: shares of negative / neutral / positive mass, and compound."""

    neg: float
    neu: float
    pos: float
    compound: float

    def rounded(self) -> dict[str, float]:
        """The dict vaderSentiment's `polarity_scores` returns (3 / 4 decimals)."""
        return {
            "neg": round(self.neg, 3),
            "neu": round(self.neu, 3),
            "pos": round(self.pos, 3),
            "compound": round(self.compound, 4),
        }


def _is_negation(word: str) -> bool:
    return word in NEGATIONS or "n't" in word


def _strip_punctuation(token: str) -> str:
    """Leading/trailing punctuation off, unless ≤ 2 characters remain (then it was an emoticon)."""
    stripped = token.strip(string.punctuation)
    return token if len(stripped) <= 2 else stripped


@dataclasses.dataclass(frozen=True)
class Vader:
    """VADER sentiment scorer (vaderSentiment==3.3.2's `SentimentIntensityAnalyzer`).

    valences: lexicon word -> mean rated valence in [−4, 4]; emoji: emoji character -> the
    description it is replaced by before scoring.
    """

    valences: Mapping[str, float]
    emoji: Mapping[str, str]

    @classmethod
    def load(cls, path: str | Path | None = None, emoji_path: str | Path | None = None) -> Vader:
        """From vader_lexicon.txt (word, mean, std, ratings) and emoji_utf8_lexicon.txt."""
        words = {w: float(v) for w, v in _tab_rows(_resolve(path, "vader_lexicon.txt"), 2)}
        emoji = {e: d for e, d in _tab_rows(_resolve(emoji_path, "emoji_utf8_lexicon.txt"), 2)}
        return cls(MappingProxyType(words), MappingProxyType(emoji))

    def compound(self, text: str) -> float:
        """The compound score in [−1, 1] (unrounded)."""
        return self.polarity_scores(text).compound

    def polarity_scores(self, text: str) -> VaderScores:
        if not isinstance(text, str):
            raise TypeError(f"VADER scores text, got {type(text).__name__}")
        text = self._describe_emoji(text).strip()
        words = [_strip_punctuation(t) for t in text.split()]
        lower = [w.lower() for w in words]
        n_caps = sum(w.isupper() for w in words)
        caps_stand_out = 0 < len(words) - n_caps < len(words)  # some but not all words in caps
        valences = [self._word_valence(words, lower, i, caps_stand_out) for i in range(len(words))]
        return _aggregate(_contrast_but(lower, valences), text)

    def _describe_emoji(self, text: str) -> str:
        out: list[str] = []
        after_space = True
        for ch in text:
            description = self.emoji.get(ch)
            if description is None:
                out.append(ch)
                after_space = ch == " "
            else:
                out.append(description if after_space else " " + description)
                after_space = False
        return "".join(out)

    def _word_valence(self, words: list[str], lower: list[str], i: int, caps: bool) -> float:
        w, lex, n = lower[i], self.valences, len(words)
        if w in BOOSTERS or (w == "kind" and i + 1 < n and lower[i + 1] == "of") or w not in lex:
            return 0.0  # modifiers carry no valence of their own
        v = lex[w]
        if w == "no" and i + 1 < n and lower[i + 1] in lex:
            v = 0.0  # "no" negates the next word rather than counting itself
        if (
            (i > 0 and lower[i - 1] == "no")
            or (i > 1 and lower[i - 2] == "no")
            or (i > 2 and lower[i - 3] == "no" and lower[i - 1] in ("or", "nor"))
        ):
            v = lex[w] * NEGATION_SCALE
        if words[i].isupper() and caps:
            v += CAPS_BOOST if v > 0 else -CAPS_BOOST
        for back in (1, 2, 3):  # the three preceding words that are not lexicon words themselves
            if i < back or lower[i - back] in lex:
                continue
            s = self._booster(words[i - back], v, caps)
            if s != 0:
                s *= (1.0, 0.95, 0.9)[back - 1]  # farther modifiers count less
            v = _negate(v + s, lower, i, back)
            if back == 3:
                v = self._special_cases(v, lower, i)
        if i > 0 and lower[i - 1] == "least" and "least" not in lex:
            if not (i > 1 and lower[i - 2] in ("at", "very")):  # "least good" flips, "at least good" not
                v *= NEGATION_SCALE
        return v

    @staticmethod
    def _booster(word: str, valence: float, caps: bool) -> float:
        scalar = BOOSTERS.get(word.lower())
        if scalar is None:
            return 0.0
        if valence < 0:
            scalar = -scalar
        if word.isupper() and caps:
            scalar += CAPS_BOOST if valence > 0 else -CAPS_BOOST
        return scalar

    @staticmethod
    def _special_cases(v: float, lower: list[str], i: int) -> float:
        """Phrases around word i (i ≥ 3) that override its valence, and two-word dampeners."""
        w3, w2, w1, w0 = lower[i - 3], lower[i - 2], lower[i - 1], lower[i]
        for phrase in (f"{w1} {w0}", f"{w2} {w1} {w0}", f"{w2} {w1}", f"{w3} {w2} {w1}", f"{w3} {w2}"):
            if phrase in SPECIAL_CASES:
                v = SPECIAL_CASES[phrase]
                break
        if i + 1 < len(lower) and f"{w0} {lower[i + 1]}" in SPECIAL_CASES:
            v = SPECIAL_CASES[f"{w0} {lower[i + 1]}"]
        if i + 2 < len(lower) and f"{w0} {lower[i + 1]} {lower[i + 2]}" in SPECIAL_CASES:
            v = SPECIAL_CASES[f"{w0} {lower[i + 1]} {lower[i + 2]}"]
        for phrase in (f"{w3} {w2} {w1}", f"{w3} {w2}", f"{w2} {w1}"):
            if phrase in BOOSTERS:
                v += BOOSTERS[phrase]
        return v


def _negate(v: float, lower: list[str], i: int, back: int) -> float:
    """Apply a negation `back` words before word i (VADER's rules, including its 'so'/'this' boost)."""
    if back == 1:
        return v * NEGATION_SCALE if _is_negation(lower[i - 1]) else v
    if back == 2:
        if lower[i - 2] == "never" and lower[i - 1] in _SO_THIS:
            return v * 1.25
        if lower[i - 2] == "without" and lower[i - 1] == "doubt":
            return v
        return v * NEGATION_SCALE if _is_negation(lower[i - 2]) else v
    # back == 3. As in vaderSentiment 3.3.2, "so"/"this" right before the word boosts it even
    # without a "never" (an operator-precedence quirk kept for parity).
    if (lower[i - 3] == "never" and lower[i - 2] in _SO_THIS) or lower[i - 1] in _SO_THIS:
        return v * 1.25
    if lower[i - 3] == "without" and "doubt" in (lower[i - 2], lower[i - 1]):
        return v
    return v * NEGATION_SCALE if _is_negation(lower[i - 3]) else v


def _contrast_but(lower: list[str], valences: list[float]) -> list[float]:
    """Halve valences before the first "but", scale those after it by 1.5.

    vaderSentiment 3.3.2 locates each value by `list.index`, i.e. its first occurrence, so when
    two words share a valence the first one is scaled twice and the second not at all; kept for
    parity (it only matters for repeated valences around a "but").
    """
    if "but" not in lower:
        return valences
    at = lower.index("but")
    out = list(valences)
    for pos in range(len(out)):
        v = out[pos]
        first = out.index(v)
        if first < at:
            out[first] = v * 0.5
        elif first > at:
            out[first] = v * 1.5
    return out


def _aggregate(valences: list[float], text: str) -> VaderScores:
    if not valences:
        return VaderScores(0.0, 0.0, 0.0, 0.0)
    n_excl = min(text.count("!"), 4)
    n_q = text.count("?")
    emphasis = n_excl * EXCLAMATION_BOOST + ((n_q * 0.18 if n_q <= 3 else 0.96) if n_q > 1 else 0.0)
    total = float(sum(valences))
    if total > 0:
        total += emphasis
    elif total < 0:
        total -= emphasis
    compound = max(-1.0, min(1.0, total / math.sqrt(total * total + COMPOUND_ALPHA)))
    pos = sum(v + 1.0 for v in valences if v > 0)  # +1 / −1: a sentiment word also counts as a word
    neg = sum(v - 1.0 for v in valences if v < 0)
    neu = sum(1 for v in valences if v == 0)
    if pos > abs(neg):
        pos += emphasis
    elif pos < abs(neg):
        neg -= emphasis
    mass = pos + abs(neg) + neu
    return VaderScores(abs(neg / mass), abs(neu / mass), abs(pos / mass), compound)


# --------------------------------------------------------------------------- TextBlob (pattern)

# Tokeniser and rule constants of textblob 0.20.1's English PatternAnalyzer (pattern.en).
_TB_PUNCTUATION = ".,;:!?()[]{}`''\"@#$^&*+-|=~_"  # note: `w in _TB_PUNCTUATION` is a substring test
_TB_CONTRACTIONS = tuple((c, " " + c) for c in ("'d", "'m", "'s", "'ll", "'re", "'ve", "n't"))
_TB_ABBREVIATIONS = frozenset(
    "a. adj. adv. al. a.m. c. cf. comp. conf. def. ed. e.g. esp. etc. ex. f. fig. gen. id. i.e. int. l. m. "
    "Med. Mil. Mr. n. n.q. orig. pl. pred. pres. p.m. ref. v. vs. w/".split()
)
_TB_ABBREVIATION_RES = (
    re.compile(r"^[A-Za-z]\.$"),  # "T."
    re.compile(r"^([A-Za-z]\.)+$"),  # "U.S."
    re.compile("^[A-Z][" + "|".join("bcdfghjklmnpqrstvwxz") + "]+.$"),  # "Mr."
)
_TB_EOS = "END-OF-SENTENCE"
_TB_SENTENCE_END = ("...", ".", "!", "?", _TB_EOS)
_TB_SENTENCE_TAIL = ("'", '"', "”", "’", "...", ".", "!", "?", ")", _TB_EOS)
# (polarity, emoticons) in pattern's order: the first group containing a token wins
_TB_EMOTICONS: tuple[tuple[float, frozenset[str]], ...] = (
    (1.00, frozenset(("<3", "♥"))),
    (1.00, frozenset((">:D", ":-D", ":D", "=-D", "=D", "X-D", "x-D", "XD", "xD", "8-D"))),
    (0.75, frozenset((">:P", ":-P", ":P", ":-p", ":p", ":-b", ":b", ":c)", ":o)", ":^)"))),
    (0.50, frozenset((">:)", ":-)", ":)", "=)", "=]", ":]", ":}", ":>", ":3", "8)", "8-)"))),
    (0.25, frozenset((">;]", ";-)", ";)", ";-]", ";]", ";D", ";^)", "*-)", "*)"))),
    (0.05, frozenset((">:o", ":-O", ":O", ":o", ":-o", "o_O", "o.O", "°O°", "°o°"))),
    (-0.25, frozenset((">:/", ":-/", ":/", ":\\", ">:\\", ":-.", ":-s", ":s", ":S", ":-S", ">.>"))),
    (-0.75, frozenset((">:[", ":-(", ":(", "=(", ":-[", ":[", ":{", ":-<", ":c", ":-c", "=/"))),
    (-1.00, frozenset((":'(", ":'''(", ";'("))),
)
# Emoticons split by the tokeniser (": )") are re-joined. Alternatives follow the group order; the
# order inside a group does not matter (no emoticon there is another's prefix).
_TB_SPACED_EMOTICONS = [r" ?".join(re.escape(ch) for ch in e) for _, group in _TB_EMOTICONS for e in group]
_TB_EMOTICON_RE = re.compile("(%s)($|\\s)" % "|".join(_TB_SPACED_EMOTICONS))
_TB_SARCASM_RE = re.compile(r"\( ?\! ?\)")
_TB_NEGATIONS = ("no", "not", "n't", "never")


def _clamp(x: float) -> float:
    return max(-1.0, min(x, 1.0))


def _mean(values) -> float:
    """pattern's `avg` (the lexicon's per-tag averages): `sum`, which Python 3.12 made compensated."""
    values = list(values)
    return sum(values) / float(len(values) or 1)


def _running_mean(values) -> float:
    """pattern's `Sentiment.__call__` average of the assessments: a plain running sum, as it adds
    them (not `sum`, which rounds differently from Python 3.12 on)."""
    total, n = 0.0, 0
    for v in values:
        total += v
        n += 1
    return total / float(n or 1)


@dataclasses.dataclass(frozen=True)
class TextBlobSentiment:
    """TextBlob's default polarity (textblob==0.20.1, `TextBlob(text).sentiment`; pattern.en rules).

    polarity = mean over the *assessed* words (lexicon words, mostly adjectives, and emoticons) of
    their polarity in [−1, 1]: a word after an intensifier ("very") is scaled by its intensity,
    a negated one ("not good") is × −0.5, "!" scales the previous assessment by 1.25. Because it
    averages, length does not move it, unlike AFINN's sum.

    entries: word -> (polarity, subjectivity, intensity), averaged over the word's senses and
    parts of speech; adverbs: the words usable as intensifiers (an RB sense).
    """

    entries: Mapping[str, tuple[float, float, float]]
    adverbs: frozenset[str]

    @classmethod
    def load(cls, path: str | Path | None = None) -> TextBlobSentiment:
        """From pattern's en-sentiment.xml (as textblob ships it)."""
        from xml.etree import ElementTree

        root = ElementTree.parse(_resolve(path, "en-sentiment.xml")).getroot()
        senses: dict[str, dict[str | None, list]] = {}
        for el in root.findall("word"):
            form = el.attrib.get("form")
            if form:
                defaults = (("polarity", 0.0), ("subjectivity", 0.0), ("intensity", 1.0))
                psi = tuple(float(el.attrib.get(k, d)) for k, d in defaults)
                senses.setdefault(form, {}).setdefault(el.attrib.get("pos"), []).append(psi)
        by_pos: dict[str, dict[str | None, tuple]] = {}
        for form, tags in senses.items():
            per_tag = {tag: tuple(_mean(col) for col in zip(*psis)) for tag, psis in tags.items()}
            per_tag[None] = tuple(_mean(col) for col in zip(*per_tag.values()))
            by_pos[form] = per_tag
        # pattern.en derives adverbs from adjectives ("terrible" -> "terribly"), overwriting any
        # existing entry for the adverb; applied in file order like pattern does.
        for form, tags in list(by_pos.items()):
            if "JJ" in tags:
                stem = form[:-1] + "i" if form.endswith("y") else form
                stem = stem[:-2] if stem.endswith("le") else stem
                adverb = by_pos.setdefault(stem + "ly", {})
                adverb["RB"] = adverb[None] = tags["JJ"]
        entries = {form: tags[None] for form, tags in by_pos.items()}
        adverbs = frozenset(form for form, tags in by_pos.items() if "RB" in tags)
        return cls(MappingProxyType(entries), adverbs)

    def polarity(self, text: str) -> float:
        return self.scores(text)[0]

    def scores(self, text: str) -> tuple[float, float]:
        """(polarity in [−1, 1], subjectivity in [0, 1]); (0, 0) when no word is assessed."""
        if not isinstance(text, str):
            raise TypeError(f"TextBlob sentiment scores text, got {type(text).__name__}")
        words = [w.lower() for w in " ".join(_tb_sentences(text)).split()]
        assessed = self._assess(words)
        return _running_mean(p for p, _ in assessed), _running_mean(s for _, s in assessed)

    def _assess(self, words: list[str]) -> list[tuple[float, float]]:
        """(polarity, subjectivity) per assessed chunk: a lexicon word with its modifier/negation."""
        chunks: list[dict] = []
        modifier: str | None = None  # a preceding adverb ("really good")
        negation: str | None = None  # a preceding negation ("not good")
        for w in words:
            entry = self.entries.get(w)
            if entry is not None:
                p, s, i = entry
                if modifier is None:
                    chunks.append({"p": p, "s": s, "i": i, "neg": False})
                else:
                    last = chunks[-1]
                    last["p"], last["s"], last["i"] = _clamp(p * last["i"]), _clamp(s * last["i"]), i
                if negation is not None:
                    chunks[-1]["i"] = 1.0 / chunks[-1]["i"]
                    chunks[-1]["neg"] = True
                modifier = w if w in self.adverbs else None
                negation = w if w in _TB_NEGATIONS else None
                continue
            if w in _TB_NEGATIONS:
                negation = w
            elif negation and len(w.strip("'")) > 1:
                negation = None  # a negation carries across short words only ("not a good")
            if negation is not None and modifier is not None and modifier.endswith("ly"):
                chunks[-1]["neg"] = True  # "really not good": the negation joins the adverb's chunk
                negation = None
            elif modifier and len(w) > 2:
                modifier = None
            if w == "!" and chunks:
                chunks[-1]["p"] = _clamp(chunks[-1]["p"] * 1.25)
            if w == "(!)":
                chunks.append({"p": 0.0, "s": 1.0, "i": 1.0, "neg": False})  # sarcasm mark
            if not w.isalpha() and len(w) <= 5 and w not in _TB_PUNCTUATION:
                for p, group in _TB_EMOTICONS:
                    if w in {e.lower() for e in group}:
                        chunks.append({"p": p, "s": 1.0, "i": 1.0, "neg": False})
                        break
        return [(c["p"] * -0.5 if c["neg"] else c["p"], c["s"]) for c in chunks]


def _tb_sentences(text: str) -> list[str]:
    """pattern's find_tokens: contractions and punctuation split off, sentences joined by spaces."""
    for old, new in _TB_CONTRACTIONS:
        text = text.replace(old, new)
    for quote in ("“", "”", "‘", "’", "'", '"'):
        text = text.replace(quote, f" {quote} ")
    text = re.sub(r"\s+", " ", re.sub(r"\n{2,}", f" {_TB_EOS} ", text.replace("\r\n", "\n")))
    lead = tuple(_TB_PUNCTUATION.replace(".", ""))
    contractions = {old for old, _ in _TB_CONTRACTIONS}
    tokens: list[str] = []
    for t in re.findall(r"(\S+)\s", text + " "):
        tail: list[str] = []
        while t.startswith(lead) and t not in contractions:
            tokens.append(t[0])
            t = t[1:]
        while t.endswith(lead + (".",)) and t not in contractions:
            if t.endswith(lead):
                tail.append(t[-1])
                t = t[:-1]
            if t.endswith("..."):
                tail.append("...")
                t = t[:-3].rstrip(".")
            if t.endswith("."):
                if t in _TB_ABBREVIATIONS or any(r.match(t) for r in _TB_ABBREVIATION_RES):
                    break
                tail.append(t[-1])
                t = t[:-1]
        if t:
            tokens.append(t)
        tokens.extend(reversed(tail))
    sentences: list[list[str]] = [[]]
    start = j = 0
    while j < len(tokens):
        if tokens[j] in _TB_SENTENCE_END:
            while j < len(tokens) and tokens[j] in _TB_SENTENCE_TAIL:
                if tokens[j] in ("'", '"') and sentences[-1].count(tokens[j]) % 2 == 0:
                    break  # balanced quotes stay with the next sentence
                j += 1
            sentences[-1].extend(t for t in tokens[start:j] if t != _TB_EOS)
            sentences.append([])
            start = j
        j += 1
    sentences[-1].extend(tokens[start:j])
    out = []
    for s in sentences:
        if s:
            joined = _TB_SARCASM_RE.sub("(!)", " ".join(s))
            out.append(_TB_EMOTICON_RE.sub(lambda m: m.group(1).replace(" ", "") + m.group(2), joined))
    return out


# --------------------------------------------------------------------------- by name

JUDGES = ("afinn", "vader", "textblob")


def load_judge(name: str, directory: str | Path | None = None) -> Callable[[str], float]:
    """A text -> score function by name, for configs: "afinn" (valence sum), "vader" (compound),
    "textblob" (polarity). Files from `directory` (default `lexicon_dir()`)."""
    d = Path(directory).expanduser() if directory is not None else lexicon_dir()
    if name == "afinn":
        return Afinn.load(d / "AFINN-en-165.txt").score
    if name == "vader":
        return Vader.load(d / "vader_lexicon.txt", d / "emoji_utf8_lexicon.txt").compound
    if name == "textblob":
        return TextBlobSentiment.load(d / "en-sentiment.xml").polarity
    raise ValueError(f"unknown judge {name!r}; choose one of {JUDGES}")
