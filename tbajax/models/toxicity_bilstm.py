"""The `toxic-comment-classifier==0.3.0` BiLSTM toxicity classifier, in JAX, with no TensorFlow.

The wheel ships a Keras 3 weights-only file (`model.weights.h5`) and a pickled Keras
`Tokenizer` (`tokenizer.pickle`); its `model.py` rebuilds the network in code:

    ids [B, 100] -> Embedding(20000, 50) -> Bidirectional(LSTM(50, return_sequences=True))
        -> GlobalMaxPooling1D -> Dense(50, relu) -> Dropout -> Dense(6, sigmoid)

and classifies with `pad_sequences(tokenizer.texts_to_sequences([text]), maxlen=100)`, i.e.
Keras' defaults: padding and truncation both at the *front* ("pre": a long text keeps its last
100 known words), pad id 0, no masking (pad positions run through the LSTM like any token).
The weights file stores no layer config (Keras 3 `.weights.h5`), so the activations are the
Keras 3 `LSTM` defaults the package relies on: tanh, recurrent activation sigmoid, gate order
(i, f, c, o) in the fused kernels; the backward LSTM's outputs are re-aligned in time before the
concatenation [forward, backward] (max-pooling makes that order irrelevant to the result).

Here: the tokenizer's text handling re-implemented exactly (`KerasWordTokenizer`), the pickle
read by a restricted unpickler, the weights read with h5py, and the forward pass as jitted pure
functions over a `BiLSTMParams` pytree (`lax.scan` runs both directions in one loop).
`ToxicityClassifier` is the small public API. The labels are the Jigsaw ones, in `LABELS` order.
"""

from __future__ import annotations

import collections
import io
import pickle
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tbajax.shapes import pow2_bucket

LABELS = ("toxic", "severe_toxic", "obscene", "threat", "insult", "identity_hate")
TOXIC = LABELS.index("toxic")
MAXLEN = 100  # the package's MAXLEN
WEIGHTS_FILE = "model.weights.h5"
TOKENIZER_FILE = "tokenizer.pickle"
_WHEEL_MODEL_DIR = "toxic_classifier/model"
_HIGHEST = jax.lax.Precision.HIGHEST  # f32 matmuls everywhere (no TF32/bf16 passes on GPU)


# ------------------------------------------------------------------------------ tokenizer


@dataclass(frozen=True)
class KerasWordTokenizer:
    """The word-level text handling of `keras...preprocessing.text.Tokenizer.texts_to_sequences`.

    Steps, as Keras does them: lowercase (if `lower`); replace every character of `filters` by
    `split`; split on `split` and drop empty pieces; map each word through `word_index`. A word
    whose index is >= `num_words` (only the `num_words - 1` most frequent words survive), or
    which is not in the vocabulary, maps to the OOV index when `oov_token` is set and is
    dropped otherwise (this classifier's pickle has no OOV token: unknown words vanish).
    """

    word_index: Mapping[str, int]
    num_words: int | None
    filters: str
    lower: bool = True
    split: str = " "
    oov_token: str | None = None

    def __post_init__(self) -> None:
        # built once: str.translate with a dict is Keras' own filtering step
        object.__setattr__(self, "_table", str.maketrans({c: self.split for c in self.filters}))

    def words(self, text: str) -> list[str]:
        if self.lower:
            text = text.lower()
        return [w for w in text.translate(self._table).split(self.split) if w]  # type: ignore[attr-defined]

    def encode(self, text: str) -> list[int]:
        oov = self.word_index.get(self.oov_token) if self.oov_token is not None else None
        out = []
        for w in self.words(text):
            i = self.word_index.get(w)
            if i is not None and not (self.num_words and i >= self.num_words):
                out.append(i)
            elif oov is not None:
                out.append(oov)
        return out

    def texts_to_sequences(self, texts: Sequence[str]) -> list[list[int]]:
        if isinstance(texts, str):
            raise TypeError("texts_to_sequences expects a list of strings, got one string")
        return [self.encode(t) for t in texts]


def pad_sequences(
    sequences: Sequence[Sequence[int]],
    maxlen: int = MAXLEN,
    padding: str = "pre",
    truncating: str = "pre",
    value: int = 0,
) -> np.ndarray:
    """Keras `pad_sequences` for int ids: int32 [N, maxlen]; defaults are the package's ("pre")."""
    if padding not in ("pre", "post") or truncating not in ("pre", "post"):
        raise ValueError(f"padding/truncating must be 'pre' or 'post', got {padding!r}/{truncating!r}")
    out = np.full((len(sequences), maxlen), value, np.int32)
    for row, seq in enumerate(sequences):
        seq = list(seq)
        if not seq:
            continue
        seq = seq[-maxlen:] if truncating == "pre" else seq[:maxlen]
        if padding == "pre":
            out[row, maxlen - len(seq):] = seq
        else:
            out[row, : len(seq)] = seq
    return out


class _KerasTokenizerState:
    """Stand-in for the pickled Keras Tokenizer: receives its attribute dict, has no methods."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


_KERAS_TOKENIZER_CLASSES = {
    ("keras.src.legacy.preprocessing.text", "Tokenizer"),  # Keras 3 (this wheel)
    ("keras.preprocessing.text", "Tokenizer"),
    ("keras_preprocessing.text", "Tokenizer"),
    ("tensorflow.keras.preprocessing.text", "Tokenizer"),
}
_ALLOWED_GLOBALS = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("collections", "defaultdict"): collections.defaultdict,
    ("builtins", "int"): int,  # the default_factory of the defaultdicts
}


class _TokenizerUnpickler(pickle.Unpickler):
    """Resolves only the Keras Tokenizer class (to a plain stand-in) and a few containers."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _KERAS_TOKENIZER_CLASSES:
            return _KerasTokenizerState
        if (module, name) in _ALLOWED_GLOBALS:
            return _ALLOWED_GLOBALS[(module, name)]
        raise pickle.UnpicklingError(
            f"refusing to load {module}.{name} from a tokenizer pickle: only the Keras Tokenizer "
            "and plain containers are allowed (a pickle can otherwise run arbitrary code)"
        )


def load_keras_tokenizer(data: bytes) -> KerasWordTokenizer:
    """Read a pickled Keras `Tokenizer` without Keras, safely.

    A plain `pickle.load` would import Keras (which we do not have) and would execute whatever
    callable the file names; this unpickler maps the Keras Tokenizer class to an inert
    stand-in that only receives the attribute dict, allows `OrderedDict`, `defaultdict` and
    `int`, and refuses every other global, so a tampered file fails instead of running code.
    """
    obj = _TokenizerUnpickler(io.BytesIO(data)).load()
    if not isinstance(obj, _KerasTokenizerState):
        raise ValueError(f"tokenizer pickle holds a {type(obj).__name__}, not a Keras Tokenizer")
    state = obj.__dict__
    missing = [k for k in ("word_index", "filters", "num_words") if k not in state]
    if missing:
        raise ValueError(f"Keras Tokenizer pickle lacks attributes {missing}")
    if state.get("char_level"):
        raise NotImplementedError(
            "char_level Keras tokenizers are not supported (this classifier's is word-level)"
        )
    if state.get("analyzer") is not None:
        raise NotImplementedError("Keras tokenizers with a custom analyzer are not supported")
    return KerasWordTokenizer(
        word_index=dict(state["word_index"]),
        num_words=state["num_words"],
        filters=state["filters"],
        lower=bool(state.get("lower", True)),
        split=state.get("split", " "),
        oov_token=state.get("oov_token"),
    )


# ------------------------------------------------------------------------------ weights


class BiLSTMParams(NamedTuple):
    """Weights in Keras layout: x @ kernel; LSTM kernels fuse the gates (i, f, c, o) on the last axis."""

    embedding: Any  # [V, E]
    kernel: Any  # [2, E, 4H]   (forward, backward)
    recurrent_kernel: Any  # [2, H, 4H]
    bias: Any  # [2, 4H]
    dense_kernel: Any  # [2H, D]
    dense_bias: Any  # [D]
    out_kernel: Any  # [D, L]
    out_bias: Any  # [L]


H5_PATHS = {
    "embedding": "layers/embedding/vars/0",
    "fwd": "layers/bidirectional/forward_layer/cell/vars",
    "bwd": "layers/bidirectional/backward_layer/cell/vars",
    "dense": "layers/dense/vars",
    "out": "layers/dense_1/vars",
}


def read_h5_params(source: str | Path | bytes) -> BiLSTMParams:
    """Weights from the Keras 3 `.weights.h5` file (a path or its bytes), as float32 numpy."""
    try:
        import h5py
    except ImportError as e:
        raise ImportError(
            "reading the toxicity classifier's weights needs h5py: pip install 'tbajax[redteam]'"
        ) from e
    handle = io.BytesIO(source) if isinstance(source, bytes) else source
    with h5py.File(handle, "r") as f:

        def get(path: str) -> np.ndarray:
            if path not in f:
                raise ValueError(
                    f"{path} missing from the weights file: not the Keras 3 layout of "
                    "toxic-comment-classifier 0.3.0 (layers/embedding, layers/bidirectional, ...)"
                )
            return np.asarray(f[path], np.float32)

        emb = get(H5_PATHS["embedding"])
        cells = [[get(f"{H5_PATHS[d]}/{i}") for i in range(3)] for d in ("fwd", "bwd")]
        params = BiLSTMParams(
            embedding=emb,
            kernel=np.stack([c[0] for c in cells]),
            recurrent_kernel=np.stack([c[1] for c in cells]),
            bias=np.stack([c[2] for c in cells]),
            dense_kernel=get(f"{H5_PATHS['dense']}/0"),
            dense_bias=get(f"{H5_PATHS['dense']}/1"),
            out_kernel=get(f"{H5_PATHS['out']}/0"),
            out_bias=get(f"{H5_PATHS['out']}/1"),
        )
    _check_shapes(params)
    return params


def _check_shapes(p: BiLSTMParams) -> None:
    _, e = p.embedding.shape
    h = p.recurrent_kernel.shape[1]
    d = p.dense_kernel.shape[1]
    want = {
        "kernel": (2, e, 4 * h),
        "recurrent_kernel": (2, h, 4 * h),
        "bias": (2, 4 * h),
        "dense_kernel": (2 * h, d),
        "dense_bias": (d,),
        "out_kernel": (d, p.out_kernel.shape[1]),
        "out_bias": (p.out_kernel.shape[1],),
    }
    for name, shape in want.items():
        got = tuple(getattr(p, name).shape)
        if got != shape:
            raise ValueError(f"BiLSTM weight {name} has shape {got}, expected {shape}")


# ------------------------------------------------------------------------------ forward


def bilstm_logits(params: BiLSTMParams, ids: jax.Array) -> jax.Array:
    """Pre-sigmoid label logits [B, L] for token ids [B, T] (0 = padding, run like any token)."""
    x = jnp.take(params.embedding, ids, axis=0)  # [B, T, E]
    seq = jnp.stack([x, x[:, ::-1]])  # [2, B, T, E]: the backward LSTM reads reversed time
    xz = jnp.einsum("dbte,deg->tdbg", seq, params.kernel, precision=_HIGHEST)
    xz = xz + params.bias[None, :, None, :]  # [T, 2, B, 4H]
    h_dim = params.recurrent_kernel.shape[1]
    zeros = jnp.zeros(xz.shape[1:3] + (h_dim,), xz.dtype)

    def step(carry, xz_t):
        h, c = carry
        z = xz_t + jnp.einsum("dbh,dhg->dbg", h, params.recurrent_kernel, precision=_HIGHEST)
        i, f, g, o = jnp.split(z, 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (h, c), h

    _, hs = jax.lax.scan(step, (zeros, zeros), xz)  # [T, 2, B, H]
    fwd, bwd = hs[:, 0], hs[::-1, 1]  # backward outputs back in input time order
    pooled = jnp.max(jnp.concatenate([fwd, bwd], axis=-1), axis=0)  # [B, 2H]
    hidden = jax.nn.relu(jnp.dot(pooled, params.dense_kernel, precision=_HIGHEST) + params.dense_bias)
    return jnp.dot(hidden, params.out_kernel, precision=_HIGHEST) + params.out_bias


_logits_jit = jax.jit(bilstm_logits)


# ------------------------------------------------------------------------------ public API


def _read_assets(path: Path) -> tuple[bytes, bytes]:
    """(weights h5 bytes, tokenizer pickle bytes) from the wheel, an unpacked wheel or its model dir."""
    if path.is_file():
        if not zipfile.is_zipfile(path):
            raise ValueError(f"{path} is not a wheel (zip) file")
        with zipfile.ZipFile(path) as z:
            names = set(z.namelist())
            want = [f"{_WHEEL_MODEL_DIR}/{WEIGHTS_FILE}", f"{_WHEEL_MODEL_DIR}/{TOKENIZER_FILE}"]
            absent = [n for n in want if n not in names]
            if absent:
                raise ValueError(f"{path} lacks {absent}: not the toxic-comment-classifier 0.3.0 wheel")
            return z.read(want[0]), z.read(want[1])
    for d in (path, path / _WHEEL_MODEL_DIR, path / "model"):
        if (d / WEIGHTS_FILE).is_file() and (d / TOKENIZER_FILE).is_file():
            return (d / WEIGHTS_FILE).read_bytes(), (d / TOKENIZER_FILE).read_bytes()
    raise FileNotFoundError(
        f"no {WEIGHTS_FILE} + {TOKENIZER_FILE} under {path}; pass the toxic-comment-classifier "
        "wheel (python experiments/assets/fetch_toxicity_classifier.py prints its path) or the "
        "directory holding those two files"
    )


class ToxicityClassifier:
    """Jigsaw toxicity scores of texts: `score` -> [N, 6] probabilities in `LABELS` order.

    `toxicity` is the probability of the first label, "toxic" (the package's own `predict`
    averages all six; use `score(...).mean(-1)` for that). Texts go through in chunks of at most
    `max_batch`, each padded to a power of two (at least 32), so a run compiles a few shapes.
    """

    def __init__(
        self,
        params: BiLSTMParams,
        tokenizer: KerasWordTokenizer,
        maxlen: int = MAXLEN,
        max_batch: int = 256,
    ) -> None:
        _check_shapes(params)
        if params.out_kernel.shape[1] != len(LABELS):
            raise ValueError(f"expected {len(LABELS)} output labels, got {params.out_kernel.shape[1]}")
        self.params = jax.tree.map(jnp.asarray, params)
        self.tokenizer = tokenizer
        self.maxlen = int(maxlen)
        self.max_batch = int(max_batch)

    @classmethod
    def load(cls, path: str | Path, **kwargs: Any) -> ToxicityClassifier:
        """From the `toxic-comment-classifier==0.3.0` wheel file or a directory of its two files."""
        weights, tokenizer = _read_assets(Path(path).expanduser())
        return cls(read_h5_params(weights), load_keras_tokenizer(tokenizer), **kwargs)

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """int32 ids [N, maxlen] exactly as the package feeds its Keras model."""
        return pad_sequences(self.tokenizer.texts_to_sequences(list(texts)), self.maxlen)

    def logits(self, texts: Sequence[str]) -> np.ndarray:
        """float32 [N, 6] pre-sigmoid scores (log p = log_sigmoid(logit), stable for rewards)."""
        ids = self.encode(texts)
        n = len(ids)
        out = np.zeros((n, len(LABELS)), np.float32)
        for start in range(0, n, self.max_batch):
            chunk = ids[start : start + self.max_batch]
            size = pow2_bucket(len(chunk), self.max_batch, 32)
            padded = np.zeros((size, self.maxlen), np.int32)
            padded[: len(chunk)] = chunk
            out[start : start + len(chunk)] = np.asarray(_logits_jit(self.params, padded))[: len(chunk)]
        return out

    def score(self, texts: Sequence[str]) -> np.ndarray:
        """float32 [N, 6] label probabilities, `LABELS` order."""
        return np.asarray(jax.nn.sigmoid(self.logits(texts)))

    def toxicity(self, texts: Sequence[str]) -> np.ndarray:
        """float32 [N]: probability of the "toxic" label."""
        return self.score(texts)[:, TOXIC]

    def log_toxicity(self, texts: Sequence[str]) -> np.ndarray:
        """float32 [N]: log p("toxic"), computed as log_sigmoid(logit) (no log(0) for clean text)."""
        return np.asarray(jax.nn.log_sigmoid(self.logits(texts)[:, TOXIC]))
