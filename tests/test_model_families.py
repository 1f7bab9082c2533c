"""GPT-NeoX (Pythia) and GPT-2 decoders and the sequence-classification scorers of every decoder
family: parity with torch transformers on tiny random checkpoints, KV-cache decode, greedy
sampling, export round trips, sharded loading and clear errors for unsupported variants."""

import json
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from tests.conftest import assert_serving_layout_converts_back, logits_of
from tbajax.models import (
    KVCache,
    ModelConfig,
    UnsupportedModelError,
    load_model,
    load_scorer,
    packed_attention_mask,
    positions_from_mask,
    save_model,
)
from tbajax.models import layers as L
from tbajax.models.serving import ServingParams
from tbajax.sampling import Sampler, SamplingConfig
from tbajax.sharding import MeshConfig, make_mesh

VOCAB = 103  # odd on purpose

# name -> (model_type, config overrides); small, with non-default shapes
DECODERS = {
    # partial rotary: 6 of 12 head dims rotate; parallel residual
    "neox_parallel": ("gpt_neox", dict(hidden_size=48, num_attention_heads=4, intermediate_size=80,
                                       rotary_pct=0.5, use_parallel_residual=True)),
    # 4 of 16 dims rotate, sequential residual, no attention biases, other rope base
    "neox_sequential": ("gpt_neox", dict(hidden_size=64, num_attention_heads=4, intermediate_size=72,
                                         rotary_pct=0.25, rotary_emb_base=500.0,
                                         use_parallel_residual=False, attention_bias=False)),
    "gpt2": ("gpt2", dict(n_embd=48, n_head=4, n_inner=72, n_positions=64)),
    "gpt2_untied_gelu": ("gpt2", dict(n_embd=32, n_head=2, n_positions=64, activation_function="gelu",
                                      tie_word_embeddings=False)),
}
CLASSIFIERS = {
    "llama": ("llama", dict(hidden_size=48, intermediate_size=64, num_attention_heads=6,
                            num_key_value_heads=2, num_labels=1)),
    "qwen2": ("qwen2", dict(hidden_size=48, intermediate_size=64, num_attention_heads=4,
                            num_key_value_heads=1, num_labels=3)),
    "qwen3": ("qwen3", dict(hidden_size=48, intermediate_size=64, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_labels=2)),
    "gpt_neox": ("gpt_neox", dict(hidden_size=48, num_attention_heads=4, intermediate_size=80,
                                  rotary_pct=0.5, num_labels=1)),
    "gpt2": ("gpt2", dict(n_embd=48, n_head=4, n_positions=64, num_labels=2)),
    "olmo2": ("olmo2", dict(hidden_size=48, intermediate_size=64, num_attention_heads=4,
                            num_key_value_heads=2, num_labels=1)),
    "phi3": ("phi3", dict(hidden_size=48, intermediate_size=64, num_attention_heads=4,
                          num_key_value_heads=2, partial_rotary_factor=0.5, pad_token_id=0, num_labels=1)),
    "gemma3": ("gemma3_text", dict(hidden_size=48, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=12, sliding_window=3, num_labels=1,
                                   layer_types=["full_attention", "sliding_attention"])),
    # the scores soft-capped, the score head not (only the LM head's logits are)
    "gemma2": ("gemma2", dict(hidden_size=48, intermediate_size=64, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=12, sliding_window=3, num_labels=1,
                              attn_logit_softcapping=0.5, final_logit_softcapping=0.1)),
}


def _build(directory: Path, model_type: str, overrides: dict, classifier: bool) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    kwargs = dict(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=64,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if model_type == "gpt2":
        kwargs = dict(vocab_size=VOCAB, n_layer=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kwargs.update(overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(0)
    cls = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
    model = cls.from_config(config).float().eval()
    with torch.no_grad():  # HF zero-inits biases and ones-inits norms: perturb everything
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """ckpt(name) -> a saved tiny checkpoint (a decoder, or `cls:<family>` for a classifier)."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            classifier = name.startswith("cls:")
            model_type, overrides = (CLASSIFIERS[name[4:]] if classifier else DECODERS[name])
            d = tmp_path_factory.mktemp(name.replace(":", "-"))
            cache[name] = _build(d, model_type, overrides, classifier)
        return cache[name]

    return get


def _batch(seed: int = 0, b: int = 4, t: int = 10):
    """Content ids >= 3 (never the pad id 0), rows: full, left-, right-, both-padded."""
    rng = np.random.RandomState(seed)
    ids = rng.randint(3, VOCAB, (b, t))
    mask = np.ones((b, t), np.int64)
    mask[1, :4] = 0
    mask[2, -3:] = 0
    mask[3, :2] = 0
    mask[3, -2:] = 0
    return np.where(mask == 1, ids, 0), mask


def _torch_out(directory: Path, ids: np.ndarray, mask: np.ndarray, classifier: bool = False,
               positions: bool = True) -> np.ndarray:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    cls = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
    model = cls.from_pretrained(directory, dtype=torch.float32).eval()
    kw = dict(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask))
    if positions:
        kw["position_ids"] = torch.tensor(np.maximum(np.cumsum(mask, -1) - 1, 0))
    with torch.no_grad():
        return model(**kw).logits.numpy()


def _ours(model, ids, mask) -> np.ndarray:
    return logits_of(model, ids, mask)


# ----------------------------------------------------------------------------- decoders


@pytest.mark.parametrize("name", list(DECODERS))
def test_logits_match_torch_transformers(ckpt, name):
    directory = ckpt(name)
    ids, mask = _batch()
    ref = _torch_out(directory, ids, mask)
    model = load_model(directory)
    real = mask.astype(bool)
    assert np.abs(_ours(model, ids, mask) - ref)[real].max() <= 1e-4
    assert model.config.num_params() == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_config_fields_are_read(ckpt):
    neox = load_model(ckpt("neox_sequential")).config
    assert (neox.rotary_dim, neox.rope_theta, neox.parallel_residual, neox.qkv_bias) == (4, 500.0, False, False)
    gpt2 = load_model(ckpt("gpt2")).config
    assert (gpt2.intermediate_size, gpt2.max_position_embeddings, gpt2.tie_word_embeddings) == (72, 64, True)
    assert gpt2.hidden_act == "gelu_new" and gpt2.eos_token_ids == (2,)


def test_gpt2_positions_ignore_left_padding(ckpt):
    """A left-padded prompt gets the same logits as the unpadded one (learned positions)."""
    model = load_model(ckpt("gpt2"))
    ids = np.random.RandomState(2).randint(3, VOCAB, (1, 6))
    alone = _ours(model, ids, np.ones_like(ids))
    padded = np.concatenate([np.zeros((1, 3), ids.dtype), ids], 1)
    mask = np.concatenate([np.zeros((1, 3), int), np.ones((1, 6), int)], 1)
    np.testing.assert_allclose(_ours(model, padded, mask)[:, 3:], alone, atol=1e-5)


@pytest.mark.parametrize("name", ["neox_parallel", "gpt2"])
@pytest.mark.parametrize("weight_first", [False, True])
def test_kv_cache_decode_matches_full_forward(ckpt, name, weight_first, monkeypatch):
    """Prefill, then decode token by token through the sampler's layout (q/k/v and o as matrices,
    all four products [out, in]; weight_first: the few rows' products take the weight as their
    left operand, `layers.out_major_product`): the logits of one forward. The layout converts
    back to the model's params exactly."""
    if not weight_first:
        monkeypatch.setattr(L, "WEIGHT_FIRST_MAX_ROWS", 0)
    model = load_model(ckpt(name))
    serving_params = nnx.jit(ServingParams.of)(model)
    products = {"qkv_proj", "o_proj", "up_proj", "down_proj"}
    held = {n.removesuffix(L.OUT_MAJOR) for n in serving_params.layers[0] if n.endswith(L.OUT_MAJOR)}
    assert held == products
    assert_serving_layout_converts_back(model, serving_params)
    rng = np.random.RandomState(1)
    b, prompt, new = 3, 6, 5
    ids = rng.randint(3, VOCAB, (b, prompt + new))
    mask = np.ones((b, prompt + new), bool)
    mask[1, :2] = False
    mask[2, :5] = False
    graphdef, state = nnx.split(model)
    run = jax.jit(lambda s, *args: nnx.merge(graphdef, s)(*args))  # one compile per shape
    pos = positions_from_mask(jnp.asarray(mask))
    full, _ = run(state, jnp.asarray(ids), pos, jnp.asarray(mask))
    cache = KVCache.init(model.config, b, prompt + new + 2)
    logits, cache = run(state, jnp.asarray(ids[:, :prompt]), pos[:, :prompt], jnp.asarray(mask[:, :prompt]), cache)
    steps = [logits[:, -1]]
    for t in range(prompt, prompt + new - 1):
        logits, cache = run(state, jnp.asarray(ids[:, t : t + 1]), pos[:, t : t + 1], jnp.asarray(mask[:, t : t + 1]), cache)
        steps.append(logits[:, -1])
    decoded = np.stack([np.asarray(s) for s in steps], axis=1)
    np.testing.assert_allclose(decoded, np.asarray(full[:, prompt - 1 : -1]), atol=1e-4)


def test_packed_rows_equal_separate_rows(ckpt):
    """One row packing a prompt and two continuations (the trainer's packed groups) gives the
    same logits as the two plain prompt + continuation rows: GPT-2's learned positions follow
    the explicit positions."""
    model = load_model(ckpt("gpt2"))
    rng = np.random.RandomState(3)
    prompt, c1, c2 = rng.randint(3, VOCAB, 4), rng.randint(3, VOCAB, 3), rng.randint(3, VOCAB, 3)
    packed = np.concatenate([prompt, c1, c2])[None]
    segments = jnp.asarray([[0] * 4 + [1] * 3 + [2] * 3])
    pos = jnp.asarray([[0, 1, 2, 3, 4, 5, 6, 4, 5, 6]])
    out = logits_of(model, packed, packed_attention_mask(segments), pos)
    rows = np.stack([np.concatenate([prompt, c1]), np.concatenate([prompt, c2])])
    plain = _ours(model, rows, np.ones_like(rows))
    np.testing.assert_allclose(out[0, :7], plain[0], atol=1e-5)
    np.testing.assert_allclose(out[0, 7:], plain[1, 4:], atol=1e-5)


@pytest.mark.parametrize("name", ["neox_parallel", "gpt2"])
def test_greedy_sampler_matches_torch_generate(ckpt, name):
    from transformers import AutoModelForCausalLM

    directory = ckpt(name)
    prompts = [[5, 17, 42, 8, 99], [7, 3, 64], [11, 12, 13, 14, 15, 16, 17]]
    new = 10
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # torch's pool next to XLA's on a shared CPU can stall
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        expected = []
        with torch.inference_mode():
            for p in prompts:  # one unpadded prompt at a time: no padding conventions involved
                out = model.generate(input_ids=torch.tensor([p]), do_sample=False, max_new_tokens=new,
                                     min_new_tokens=new, pad_token_id=0, eos_token_id=None)
                expected.append(out[0, len(p):].numpy())
    finally:
        torch.set_num_threads(threads)
    sampler = Sampler(load_model(directory), max_cache_length=64, min_prompt_bucket=8)
    got = sampler.sample(prompts, SamplingConfig(max_new_tokens=new, greedy=True, stop_token_ids=()),
                         jax.random.key(0))
    np.testing.assert_array_equal(got.tokens, np.stack(expected))


@pytest.mark.parametrize("name", ["llama", "neox_parallel"])
def test_shared_prompt_cache_samples_like_copied_prompts(ckpt, tiny_checkpoint, name):
    """K samples of a prompt read its cached keys once (`serving.PromptCache`, grouped-query
    Llama and multi-head NeoX): the same tokens, stops and lengths as with the prompt copied into
    every sample's row, log-probs up to summation order, a padding prompt of the bucket included."""
    model = load_model(tiny_checkpoint("llama") if name == "llama" else ckpt(name))
    prompts = [[1, 5, 6, 7], [1, 9], [1, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    cfg = SamplingConfig(max_new_tokens=12, num_samples=3, temperature=1.0, min_new_tokens=2,
                         stop_token_ids=(2, 3, 4))
    key = jax.random.key(5)
    sampler = Sampler(model, first_decode_phase=4)
    shared = sampler.sample(prompts, cfg, key)
    copied = Sampler(model, first_decode_phase=4, share_prompt_cache=False).sample(prompts, cfg, key)
    cache = sampler._cache  # 4 prompts (3 + bucket padding) x 16 slots, 12 x 12 new-token slots
    assert (cache.prompt.rows, cache.prompt.slots, cache.rows, cache.slots) == (4, 16, 12, 12)
    assert shared.finished.any() and (~shared.finished).any()
    np.testing.assert_array_equal(shared.tokens, copied.tokens)
    np.testing.assert_array_equal(shared.length, copied.length)
    np.testing.assert_array_equal(shared.finished, copied.finished)
    np.testing.assert_allclose(shared.logprobs, copied.logprobs, atol=1e-5)


@pytest.mark.parametrize("name", ["neox_sequential", "gpt2"])
def test_export_round_trip_loads_in_torch(ckpt, tmp_path, name):
    directory = ckpt(name)
    model = load_model(directory)
    out = save_model(model, tmp_path / "export", max_shard_bytes=30_000)  # several shards
    assert (out / "model.safetensors.index.json").exists()
    ids, mask = _batch(4)
    ref = _torch_out(directory, ids, mask)
    real = mask.astype(bool)
    assert np.abs(_torch_out(out, ids, mask) - ref)[real].max() <= 1e-5
    assert np.abs(_ours(load_model(out), ids, mask) - ref)[real].max() <= 1e-4


@pytest.mark.parametrize("name", ["neox_parallel", "gpt2"])
def test_sharded_load_matches_single_device(ckpt, name):
    directory = ckpt(name)
    ids, mask = _batch(5)
    single = _ours(load_model(directory), ids, mask)
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=2), devices=jax.devices()[:4])
    model = load_model(directory, mesh=mesh)
    qkv = nnx.state(model, nnx.Param)["layers"]["qkv_proj"][...]
    assert len(qkv.sharding.device_set) == 4
    with jax.set_mesh(mesh):
        sharded = np.asarray(jax.jit(lambda t, m: model(t, attention_mask=m)[0])(jnp.asarray(ids), jnp.asarray(mask)))
    np.testing.assert_allclose(sharded, single, atol=1e-4)


def test_phi3_fused_qkv_splits_by_kv_head_over_a_tensor_mesh(tiny_checkpoint):
    """Phi-3's fused qkv_proj, held per KV head, splits over the tensor axis by KV head (each
    device its own query group, key and value) like o_proj by query head, and the forward gives
    the single-device logits."""
    from jax.sharding import PartitionSpec as P

    directory = tiny_checkpoint("phi3")  # 6 query heads over 2 KV heads
    ids, mask = _batch(5)
    single = _ours(load_model(directory), ids, mask)
    mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=2), devices=jax.devices()[:4])
    model = load_model(directory, mesh=mesh)
    params = nnx.state(model, nnx.Param)["layers"]
    assert params["qkv_proj"][...].sharding.spec == P(None, None, "tensor", None, None)
    assert params["o_proj"][...].sharding.spec == P(None, "tensor", None, None)
    with jax.set_mesh(mesh):
        forward = jax.jit(lambda t, m: model(t, attention_mask=m)[0])
        sharded = np.asarray(forward(jnp.asarray(ids), jnp.asarray(mask)))
    np.testing.assert_allclose(sharded, single, atol=1e-4)


def test_gpt2_checkpoint_without_transformer_prefix(ckpt, tmp_path):
    """The original `gpt2` files name tensors from the base model ("h.0.attn...", no prefix)
    and carry causal-mask buffers: both load."""
    from tbajax.models.safetensors_io import SafetensorsReader, write_safetensors

    src = ckpt("gpt2")
    reader = SafetensorsReader(src)
    tensors = {k.removeprefix("transformer."): np.array(reader.get(k)) for k in reader.keys()}
    tensors["h.0.attn.bias"] = np.tril(np.ones((1, 1, 64, 64), np.float32))
    d = tmp_path / "bare"
    d.mkdir()
    write_safetensors(d / "model.safetensors", tensors)
    shutil.copy(src / "config.json", d / "config.json")
    ids, mask = _batch(6)
    np.testing.assert_allclose(_ours(load_model(d), ids, mask), _ours(load_model(src), ids, mask), atol=0)


def test_pythia_v4_layout_loads(ckpt, tmp_path):
    """Pythia's own files: config.json with rotary_pct / rotary_emb_base (no rope_parameters),
    causal-mask and rotary buffers next to the weights; and the v5 name lm_head for embed_out."""
    from tbajax.models.safetensors_io import SafetensorsReader, write_safetensors

    src = ckpt("neox_sequential")
    reader = SafetensorsReader(src)
    tensors = {k.replace("embed_out.", "lm_head."): np.array(reader.get(k)) for k in reader.keys()}
    for i in range(2):
        tensors[f"gpt_neox.layers.{i}.attention.bias"] = np.tril(np.ones((1, 1, 64, 64), bool))
        tensors[f"gpt_neox.layers.{i}.attention.masked_bias"] = np.array(-1e9, np.float32)
        tensors[f"gpt_neox.layers.{i}.attention.rotary_emb.inv_freq"] = np.ones(2, np.float32)
    d = tmp_path / "pythia"
    d.mkdir()
    write_safetensors(d / "model.safetensors", tensors)
    hf = json.loads((src / "config.json").read_text())
    del hf["rope_parameters"]
    hf.update(rotary_pct=0.25, rotary_emb_base=500, transformers_version="4.24.0")
    (d / "config.json").write_text(json.dumps(hf))
    ids, mask = _batch(10)
    np.testing.assert_allclose(_ours(load_model(d), ids, mask), _ours(load_model(src), ids, mask), atol=0)


# ----------------------------------------------------------------------------- classifiers


@pytest.mark.parametrize("family", list(CLASSIFIERS))
def test_sequence_scores_match_torch(ckpt, family):
    directory = ckpt(f"cls:{family}")
    scorer = load_scorer(directory)
    ids, mask = _batch(7)
    ours = np.asarray(scorer.score(ids, mask))
    assert ours.shape == (4, CLASSIFIERS[family][1]["num_labels"])
    # mixed padding: transformers given the same positions (cumsum(mask) - 1)
    np.testing.assert_allclose(ours, _torch_out(directory, ids, mask, classifier=True), atol=1e-4)
    # right padding only: transformers' own defaults (positions 0..T-1) already agree
    right = np.array([0, 2])
    ref = _torch_out(directory, ids[right], mask[right], classifier=True, positions=False)
    np.testing.assert_allclose(ours[right], ref, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "gpt2"])
def test_packed_prompt_groups_score_like_their_own_rows(ckpt, family, monkeypatch):
    """score_prompt_groups (each prompt once, its responses after it in one row) == score of every
    prompt + response row; 130 packed slots (a 192-wide row) in the causal-block attention."""
    from tbajax.models import decoder

    monkeypatch.setattr(decoder, "PACKED_CAUSAL_BLOCKS_MIN", 0)  # blocks at any width
    scorer = load_scorer(ckpt(f"cls:{family}"))
    rng = np.random.RandomState(4)
    prompts = [rng.randint(3, VOCAB, 30), rng.randint(3, VOCAB, 5)]
    responses = [[rng.randint(3, VOCAB, n) for n in (25, 20, 31, 24)],
                 [rng.randint(3, VOCAB, 3), np.zeros(0, int)]]  # an empty response: read at its prompt's end
    got = scorer.score_prompt_groups(prompts, responses)
    seqs = [np.concatenate([p, r]) for p, rs in zip(prompts, responses) for r in rs]
    ids = np.zeros((len(seqs), max(map(len, seqs))), np.int64)
    mask = np.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    want = np.asarray(scorer.score(ids, mask))
    assert [g.shape[0] for g in got] == [4, 2]
    np.testing.assert_allclose(np.concatenate(got), want, atol=2e-5)


def test_scorer_sharded_matches_single_device(ckpt):
    directory = ckpt("cls:gpt_neox")
    ids, mask = _batch(13)
    single = np.asarray(load_scorer(directory).score(ids, mask))
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=2), devices=jax.devices()[:4])
    scorer = load_scorer(directory, mesh=mesh)
    with jax.set_mesh(mesh):
        sharded = np.asarray(scorer.score(ids, mask))
    np.testing.assert_allclose(sharded, single, atol=1e-5)
    # packed prompt groups too: one group (one row) on two batch shards, and three groups
    rng = np.random.RandomState(2)
    for n_groups in (1, 3):
        prompts = [rng.randint(3, VOCAB, 6) for _ in range(n_groups)]
        responses = [[rng.randint(3, VOCAB, n) for n in (4, 2)] for _ in range(n_groups)]
        want = load_scorer(directory).score_prompt_groups(prompts, responses)
        with jax.set_mesh(mesh):
            got = scorer.score_prompt_groups(prompts, responses)
        np.testing.assert_allclose(np.concatenate(got), np.concatenate(want), atol=1e-5)


def test_decoder_programs_keep_xla_default_dots_on_cpu(ckpt, tiny_checkpoint):
    """Decoder programs (the reward-model scorer, the sampler) keep XLA's default (YNNPACK) dots on
    CPU, which `experiments/benchmarks/dot_backend.py` measured faster for every one of them; the
    Eigen option (`sequence_scoring_compiler_options`) is for the encoders' programs."""
    from tbajax.models.scorer import sequence_scoring_compiler_options
    from tbajax.sampling import Sampler, SamplingConfig

    if jax.default_backend() != "cpu":
        assert sequence_scoring_compiler_options() is None
        return
    scorer = load_scorer(ckpt("cls:gpt_neox"))
    ids, mask = _batch(7)
    tokens, mask = jnp.asarray(ids, jnp.int32), jnp.asarray(mask, bool)
    hlo = scorer._fn.lower(scorer._state, tokens, mask).compile().as_text()
    assert "ynn_fusion" in hlo
    assert sequence_scoring_compiler_options() == {"xla_cpu_experimental_ynn_fusion_type": ""}
    sampler = Sampler(load_model(tiny_checkpoint("llama")))
    sampler.sample([[1, 5, 6], [1, 7]], SamplingConfig(max_new_tokens=3, num_samples=2), jax.random.key(0))
    programs = {kind: fn.as_text() for (kind, _), fn in sampler._compiled.items()}
    assert "ynn_fusion" in programs["generate"]


def test_scorer_when_pad_is_eos(ckpt, tmp_path):
    """pad_token_id == eos_token_id: transformers skips a trailing EOS (it looks like padding);
    we score what the mask covers, so masking the EOS out reproduces transformers."""
    d = tmp_path / "rm"
    shutil.copytree(ckpt("cls:gpt2"), d)
    hf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**hf, "pad_token_id": 2}))
    ids = np.random.RandomState(12).randint(3, VOCAB, (2, 8))
    ids[0, 5], ids[0, 6:] = 2, 2  # content, EOS, padding (also 2)
    ids[1, 7] = 2  # content, EOS
    with_eos = np.array([[1] * 6 + [0] * 2, [1] * 8])
    ref = _torch_out(d, ids, with_eos, classifier=True, positions=False)
    scorer = load_scorer(d)
    without_eos = with_eos.copy()
    without_eos[0, 5] = without_eos[1, 7] = 0
    np.testing.assert_allclose(np.asarray(scorer.score(ids, without_eos)), ref, atol=1e-4)
    assert np.abs(np.asarray(scorer.score(ids, with_eos)) - ref).max() > 1e-3  # the EOS's own value


def test_scorer_export_round_trip_and_wrong_loader(ckpt, tmp_path):
    directory = ckpt("cls:gpt_neox")
    scorer = load_scorer(directory)
    out = save_model(scorer.model, tmp_path / "rm")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["GPTNeoXForSequenceClassification"]
    ids, mask = _batch(8)
    np.testing.assert_allclose(
        _torch_out(out, ids, mask, classifier=True), _torch_out(directory, ids, mask, classifier=True), atol=1e-5
    )
    with pytest.raises(UnsupportedModelError, match="load_scorer"):
        load_model(directory)
    with pytest.raises(ValueError, match="cannot sample from a sequence classifier"):
        Sampler(scorer.model)
    with pytest.raises(UnsupportedModelError, match="load_model"):
        load_scorer(ckpt("neox_parallel"))


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "name, changes, message",
    [
        ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=true"),
        ("gpt2", {"reorder_and_upcast_attn": True}, "reorder_and_upcast_attn=true"),
        ("gpt2", {"add_cross_attention": True}, "add_cross_attention=true"),
        ("gpt2", {"scale_attn_weights": False}, "scale_attn_weights=false"),
        ("gpt2", {"activation_function": "relu"}, "activation_function='relu'"),
        ("neox_parallel", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling="),
        ("neox_parallel", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}},
         "rope_parameters.rope_type='yarn'"),
        ("neox_parallel", {"hidden_act": "gelu_new"}, "hidden_act='gelu_new'"),
        ("neox_parallel", {"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.3}}, "rotary_pct=0.3"),
    ],
)
def test_unsupported_variant_names_the_field(ckpt, name, changes, message):
    hf = json.loads((ckpt(name) / "config.json").read_text())
    hf.update(changes)
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf(hf)


def test_remat_gradients_equal_plain(ckpt):
    """Remat wraps each family's block unchanged (GPT-2's block takes no RoPE tables)."""
    directory = ckpt("gpt2")
    ids, mask = _batch(9)

    def grads(model):
        graphdef, state = nnx.split(model)

        def loss(s):
            return nnx.merge(graphdef, s)(jnp.asarray(ids), attention_mask=jnp.asarray(mask))[0].mean()

        return jax.jit(jax.grad(loss))(state)

    plain = grads(load_model(directory))
    remat = grads(load_model(directory, remat="full"))
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(remat)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_hand_built_config_exports_and_is_checked(tmp_path):
    """A random-init GPT-2 from a hand-written ModelConfig saves as a checkpoint transformers
    loads with the same logits; a config mixing families is refused on construction."""
    from transformers import AutoModelForCausalLM

    from tbajax.models import CausalLM

    fields = dict(model_type="gpt2", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=4, num_kv_heads=4, head_dim=8, max_position_embeddings=32, qkv_bias=True,
                  o_bias=True, tie_word_embeddings=True, eos_token_id=2)
    model = CausalLM(ModelConfig(hidden_act="gelu_new", **fields), rngs=nnx.Rngs(0))
    out = save_model(model, tmp_path / "gpt2")
    ids = np.random.RandomState(11).randint(3, VOCAB, (2, 9))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(input_ids=torch.tensor(ids)).logits
    assert np.abs(_ours(model, ids, np.ones_like(ids)) - ref.numpy()).max() <= 1e-4
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        ModelConfig(hidden_act="silu", **fields)
    with pytest.raises(UnsupportedModelError, match="num_kv_heads=2"):
        ModelConfig(hidden_act="gelu_new", **{**fields, "num_kv_heads": 2})


# SwiGLU + tied head; GELU + untied; OLMo 2's norms over whole projections and after each sublayer;
def _per_expert(grads: dict, model_type: str) -> dict:
    """transformers v5 holds a mixture-of-experts layer's experts fused (mlp.experts.gate_up_proj
    [E, 2f, d], down_proj [E, d, f]); checkpoints, and our export, name them one per expert
    (Mixtral's under block_sparse_moe as w1 / w3 / w2). GPT-OSS's checkpoints hold them fused too."""
    if model_type == "gpt_oss":
        return grads
    moe, (gate, up, down) = ((".block_sparse_moe.", ("w1", "w3", "w2")) if model_type == "mixtral"
                             else (".mlp.", ("gate_proj", "up_proj", "down_proj")))
    out = {}
    for name, g in grads.items():
        m = re.fullmatch(r"(model\.layers\.\d+)\.mlp\.(experts\.gate_up_proj|experts\.down_proj"
                         r"|gate\.weight)", name)
        if m is None:
            out[name] = g
        elif m.group(2) == "gate.weight":
            out[m.group(1) + moe + "gate.weight"] = g
        elif m.group(2) == "experts.gate_up_proj":
            f = g.shape[1] // 2
            for j in range(g.shape[0]):
                out[f"{m.group(1)}{moe}experts.{j}.{gate}.weight"] = g[j, :f]
                out[f"{m.group(1)}{moe}experts.{j}.{up}.weight"] = g[j, f:]
        else:
            for j in range(g.shape[0]):
                out[f"{m.group(1)}{moe}experts.{j}.{down}.weight"] = g[j]
    return out


# Phi-3's fused projections and partial rotary; Gemma 2's soft-capped scores and logits; SmolLM3's NoPE
# layer (windowed); Granite's multipliers
@pytest.mark.parametrize("name", ["qwen2_tied", "neox_parallel", "olmo2", "phi3", "gemma2", "gemma3",
                                  "smollm3_window", "granite", "gemma", "olmo3", "qwen3_moe", "mixtral",
                                  "olmoe", "qwen2_moe", "gpt_oss"])
def test_logprob_gradients_match_torch(ckpt, tiny_checkpoint, name):
    """The trainer's scoring path (`sequence_logprobs`: the hand-written VJPs of the vocabulary
    projection + tempered log-softmax, of every MLP matmul and of SwiGLU) against torch autograd,
    gradient by gradient in the HF layout, with the layers scanned and unrolled."""
    from transformers import AutoModelForCausalLM

    from tbajax.batch import Batch
    from tbajax.models.hf import hf_tensors
    from tbajax.training import sequence_logprobs

    tiny = ("qwen2_tied", "olmo2", "phi3", "gemma2", "gemma3", "smollm3_window", "granite", "gemma", "olmo3",
            "qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "gpt_oss")
    directory = tiny_checkpoint(name) if name in tiny else ckpt(name)
    temperature = 0.7
    ids, mask = _batch(3)
    scored = mask * np.pad(mask[:, :-1], ((0, 0), (1, 0)))  # a real token after a real one
    #   (what a pad position predicts is not defined the same way on both sides)
    weights = np.random.RandomState(1).normal(size=ids.shape).astype(np.float32) * scored

    torch_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    pos = torch.tensor(np.maximum(np.cumsum(mask, -1) - 1, 0))
    logits = torch_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), position_ids=pos).logits
    lp = torch.log_softmax(logits[:, :-1] / temperature, -1).gather(-1, torch.tensor(ids[:, 1:, None]))[..., 0]
    (lp * torch.tensor(weights[:, 1:])).sum().backward()
    want = _per_expert({n: p.grad.numpy() for n, p in torch_model.named_parameters()},
                       torch_model.config.model_type)

    zeros = np.zeros(ids.shape, np.float32)
    rows = ids.shape[0]
    batch = Batch(tokens=jnp.asarray(ids, jnp.int32), attention_mask=jnp.asarray(mask, bool),
                  loss_mask=jnp.asarray(mask, bool), behavior_logprobs=zeros, reference_logprobs=zeros,
                  reward=np.zeros(rows, np.float32), group_id=np.zeros(rows, np.int32),
                  sample_mask=np.ones(rows, bool), policy_version=np.zeros(rows, np.int32),
                  prompt_id=np.zeros(rows, np.int32), beta=np.float32(0), token_versions=zeros.astype(np.int32),
                  current_version=np.int32(0))
    for scan in (True, False) if name in ("qwen2_tied", "gemma3") else (True,):
        model = load_model(directory, scan_layers=scan)
        graphdef, state = nnx.split(model)
        grads = jax.jit(jax.grad(lambda s: (sequence_logprobs(graphdef, s, batch, temperature) * weights).sum()))(state)
        got = dict(hf_tensors(nnx.merge(graphdef, grads)))
        for hf_name, g in got.items():
            # torch names the Pythia head lm_head (the checkpoint's embed_out), GPT-2's under transformer.
            ref = want.get({"embed_out.weight": "lm_head.weight"}.get(hf_name, hf_name),
                           want.get(f"transformer.{hf_name}"))
            assert ref is not None, hf_name
            scale = max(np.abs(ref).max(), 1e-3)
            np.testing.assert_allclose(g, ref, atol=2e-4 * scale, rtol=0, err_msg=f"{hf_name} scan={scan}")
