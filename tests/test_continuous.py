"""Continuous batching (`tbajax.sampling.continuous`): the same tokens and log-probs per sample as
the static sampler for the same per-sample keys, per-sample caps, in-flight weight swaps with
per-token versions checked against a step-by-step reference decode, and a sharded mesh."""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tbajax.models import KVCache, load_model, positions_from_mask
from tbajax.models.serving import TieredKVCache
from tbajax.sampling import Sampler, SamplingConfig
from tbajax.sampling.continuous import (
    ContinuousEngine, default_prompt_pool, geometric_ring_tiers, request_keys, ring_sources,
)
from tbajax.sampling.step import step_keys
from tbajax.sampling import core
from tbajax.sharding import MeshConfig, make_mesh

# lengths 4, 2, 20 (a second prompt bucket), 3, 7
PROMPTS = [[1, 5, 6, 7], [1, 9], [1, *range(3, 22)], [1, 40, 41], [1, 8, 8, 8, 9, 9, 10]]
CFG = SamplingConfig(max_new_tokens=10, num_samples=3, temperature=0.8, top_k=40, top_p=0.9,
                     min_new_tokens=2, stop_token_ids=tuple(range(3, 30)), pad_token_id=0)


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return load_model(tiny_checkpoint("llama"))


def _run_engine(sampler, cfg, key, prompts, *, slots, chunk, caps=None, **options):
    engine = ContinuousEngine(sampler, cfg, slots=slots, chunk=chunk, max_prompt_tokens=32, **options)
    k = cfg.num_samples
    for i, p in enumerate(prompts):
        engine.submit(p, request_keys(key, i * k, k), tag=i,
                      max_new_per_sample=None if caps is None else caps[i * k:(i + 1) * k])
    groups = {g.tag: g for g in engine.run()}
    assert sorted(groups) == list(range(len(prompts))) and engine.idle
    return engine, groups


def _assert_same(static, groups, k):
    for i, g in groups.items():
        for j in range(k):
            r = i * k + j
            n = static.length[r]
            np.testing.assert_array_equal(g.tokens[j], static.tokens[r, :n])
            np.testing.assert_allclose(g.logprobs[j], static.logprobs[r, :n], atol=1e-5)
            assert g.finished[j] == static.finished[r]


def test_ring_sources():
    # a 3-column prompt ending at slot index - 1 of a ring of 6
    np.testing.assert_array_equal(ring_sources(jnp.int32(1), 6, 3), [2, 3, 4, 5, 0, 1])
    np.testing.assert_array_equal(ring_sources(jnp.int32(3), 6, 3), [0, 1, 2, 3, 4, 5])


@pytest.mark.parametrize("pool", [0, 1, 3, None],
                         ids=["copied_prompts", "pool_of_1", "pool_of_3", "default_pool"])
def test_continuous_matches_static(llama, pool):
    """Fewer slots than samples (refills mid-run, the ring wraps), two prompt buckets, stops,
    min_new_tokens, per-sample caps on new tokens, top-k + top-p, temperature: every sample equals
    the static sampler's row for the same key. With a shared prompt pool too: of one entry (a
    prompt waits for the last one's stragglers), of three (rows of a finished sample go to
    another prompt while their old prompt is still in the pool), and the default (the sampler's
    share_prompt_cache, `default_prompt_pool`: 2 x slots / K entries here, the prompt bucket being
    longer than the responses' cap)."""
    sampler = Sampler(llama, max_cache_length=64)
    key = jax.random.key(3)
    caps = np.random.default_rng(0).integers(1, 11, len(PROMPTS) * CFG.num_samples)
    caps[:6] = CFG.max_new_tokens
    static = sampler.sample(PROMPTS, CFG, key, max_new_per_row=caps)
    assert (static.length <= caps).all()
    assert static.finished.any() and (static.length == caps).any() and (static.length > 3).any()
    options = {"share_prompt_cache": False} if pool == 0 else {} if pool is None else {"prompt_pool": pool}
    engine, groups = _run_engine(sampler, CFG, key, PROMPTS, slots=4, chunk=3, caps=caps, **options)
    _assert_same(static, groups, CFG.num_samples)
    assert engine.pool == (2 if pool is None else pool)
    assert sorted(engine._free_entries) == list(range(engine.pool))  # every entry freed
    assert all((v == 0).all() for g in groups.values() for v in g.token_versions)
    kinds = [e.kind for e in sampler.compile_events]
    assert kinds.count("decode_chunk") == 1  # two prompt buckets, one decode program
    assert {dict(e.shape)["prompt_len"] for e in sampler.compile_events if e.kind == "admit"} == {16, 32}
    assert engine.stats.chunks > 5 and 0 < engine.stats.occupancy(4) <= 1


@pytest.mark.parametrize("seed", [0, 1])
def test_prompt_pool_on_random_schedules_matches_static(llama, seed):
    """Random K, prompts, stops, per-sample caps, slots, chunk and pool sizes: whatever order
    the samples are admitted, end and free their rows and pool entries in, each equals the static
    sampler's row for its key."""
    r = np.random.default_rng(seed)
    k = int(r.integers(2, 4))
    prompts = [[1, *r.integers(3, 60, r.integers(1, 20)).tolist()] for _ in range(int(r.integers(4, 8)))]
    cfg = SamplingConfig(max_new_tokens=9, num_samples=k, temperature=1.0, top_k=40,
                         stop_token_ids=(3, 4, 5, 6), pad_token_id=0)
    caps = r.integers(1, 10, len(prompts) * k)
    slots = k * int(r.integers(1, 4))
    pool = int(r.integers(1, 2 * slots // k + 1))
    sampler = Sampler(llama, max_cache_length=32)
    key = jax.random.key(seed)
    static = sampler.sample(prompts, cfg, key, max_new_per_row=caps)
    engine, groups = _run_engine(sampler, cfg, key, prompts, slots=slots, chunk=int(r.integers(1, 5)),
                                 caps=caps, prompt_pool=pool)
    _assert_same(static, groups, k)
    assert engine.pool == pool and sorted(engine._free_entries) == list(range(pool))


@pytest.mark.parametrize("shared", [False, True], ids=["copied_prompts", "prompt_pool"])
@pytest.mark.parametrize("seed", [0, 1])
def test_ring_tiers_match_static(llama, shared, seed):
    """Ring tiers (rows split into rings of 4 / 8 / full slots, fewer long rows than long samples):
    samples move to longer tiers as they grow, pause when none has a free row, and every sample
    still equals the static sampler's row for its key."""
    r = np.random.default_rng(seed)
    k = 2
    prompts = [[1, *r.integers(3, 60, r.integers(1, 12)).tolist()] for _ in range(8)]
    prompts[0] = [1, *r.integers(3, 60, 15).tolist()]  # fills its bucket: no padding slot to spare
    cfg = SamplingConfig(max_new_tokens=14, num_samples=k, temperature=1.0, top_k=40,
                         stop_token_ids=(3, 4), pad_token_id=0)
    caps = r.integers(1, 15, len(prompts) * k)
    caps[::3] = 14
    sampler = Sampler(llama, max_cache_length=32)
    key = jax.random.key(seed)
    static = sampler.sample(prompts, cfg, key, max_new_per_row=caps)
    # the last ring holds the longest history: max_new_tokens, plus the prompt bucket (16 here, up
    # to 18 admitted) where the prompts are copied into the rows
    tiers = ((4, 4), (2, 8), (2, 14)) if shared else ((2, 20), (4, 24), (2, 32))
    engine, groups = _run_engine(sampler, cfg, key, prompts, slots=8, chunk=3, caps=caps,
                                 share_prompt_cache=shared, ring_tiers=tiers)
    _assert_same(static, groups, k)
    assert engine.stats.moves > 0 and engine.stats.pauses > 0 and not engine._paused
    assert isinstance(engine._cache, TieredKVCache)
    assert [t.slots for t in engine._cache.tiers] == [n for _, n in tiers]


# Gemma 3's layer kinds (each its own RoPE base) decode as their forward in
# test_models.test_kv_cache_decode_matches_full_forward and sample alike on CUDA and CPU programs in
# test_accelerator_programs; here Gemma 2 stands for both kinds of layer in every engine
@pytest.mark.parametrize("family", ["mistral_window", "gemma2", "gpt_oss"])
def test_a_sliding_window_samples_alike_in_every_engine(tiny_checkpoint, family):
    """A model whose window (4 positions) is far shorter than its prompts + responses (up to 14 +
    12): the static sampler's linear cache and the continuous engine's rings, tiered or not,
    window by ring distance, and a shared prompt part (the static sampler's, the engine's pool,
    on one device and over 2 batch shards, tiered) by each row's position: every engine gives the same
    tokens and log-probs, which are the teacher-forced forward's (windowed by position, as
    transformers). Gemma 2: a windowed layer and a full one, its scores and logits soft-capped in
    every engine's attention and head. GPT-OSS: its attention sinks in every engine's attention."""
    model = load_model(tiny_checkpoint(family))
    r = np.random.default_rng(4)
    k = 2
    prompts = [[1, *r.integers(3, 60, r.integers(1, 14)).tolist()] for _ in range(5)]
    cfg = SamplingConfig(max_new_tokens=12, num_samples=k, temperature=1.0, stop_token_ids=(3,),
                         pad_token_id=0)
    key = jax.random.key(7)
    static = Sampler(model, max_cache_length=32).sample(prompts, cfg, key)  # prompts shared
    assert static.length.max() == cfg.max_new_tokens
    copied = Sampler(model, max_cache_length=32, share_prompt_cache=False)
    again = copied.sample(prompts, cfg, key)
    np.testing.assert_array_equal(again.tokens, static.tokens)
    np.testing.assert_allclose(again.logprobs, static.logprobs, atol=1e-5)
    mesh = make_mesh(MeshConfig(data=2), devices=jax.devices()[:2])
    sharded = Sampler(load_model(tiny_checkpoint(family), mesh=mesh), mesh=mesh, max_cache_length=32)
    # the engines split between the two models (each run compiles its own programs)
    tiered = (copied, False, ((2, 20), (4, 24), (2, 32)))
    engines = [(copied, True, None) if family == "mistral_window" else tiered,
               (sharded, True, ((4, 4), (2, 8), (2, 12)))]
    for sampler, shared, tiers in engines:
        engine, groups = _run_engine(sampler, cfg, key, prompts, slots=8, chunk=3, share_prompt_cache=shared,
                                     ring_tiers=tiers)
        assert (engine.pool > 0) == shared and (engine.stats.moves > 0) == (tiers is not None)
        _assert_same(static, groups, k)
    rows = [prompts[i // k] + static.response(i).tolist() for i in range(len(static))]
    width = max(map(len, rows))
    ids = np.array([[0] * (width - len(row)) + row for row in rows])
    starts = width - np.array([len(row) for row in rows])
    mask = np.arange(width)[None, :] >= starts[:, None]  # by length: 0 may be a sampled token too
    forward = nnx.jit(lambda m, ids, mask: m(ids, attention_mask=mask)[0])
    logits = forward(model, jnp.asarray(ids), jnp.asarray(mask))
    logprobs = np.asarray(jax.nn.log_softmax(logits, -1))
    for i, row in enumerate(rows):
        n = static.length[i]
        own = logprobs[i, width - n - 1:width - 1][np.arange(n), ids[i, width - n:]]
        np.testing.assert_allclose(static.logprobs[i, :n], own, atol=1e-4)


def test_default_prompt_pool(llama):
    # 3 x slots / K, or 2 x when the prompt bucket is longer than the responses' cap
    assert default_prompt_pool(128, 16, 64, 512) == 24
    assert default_prompt_pool(128, 16, 64, 64) == 24
    assert default_prompt_pool(64, 8, 256, 128) == 16
    assert default_prompt_pool(4, 3, 32, 10) == 2
    cfg = SamplingConfig(max_new_tokens=40, num_samples=2)
    engine = ContinuousEngine(Sampler(llama, max_cache_length=64), cfg, slots=4, chunk=4, max_prompt_tokens=16)
    assert engine.pool == 6  # the 16-slot prompt bucket is shorter than the 40 new tokens


def test_geometric_ring_tiers():
    assert geometric_ring_tiers(128, 512, 3) == ((64, 128), (32, 256), (32, 512))
    assert geometric_ring_tiers(8, 14, 3) == ((4, 4), (2, 7), (2, 14))  # ceil(14 / 4) = 4
    assert geometric_ring_tiers(3, 10, 3) == ((1, 3), (1, 5), (1, 10))  # a row each at least
    assert geometric_ring_tiers(16, 100, 1) == ((16, 100),)
    assert geometric_ring_tiers(16, 100, 3, shards=4) == ((8, 25), (4, 50), (4, 100))  # 4 rows a shard
    with pytest.raises(ValueError, match="one row each at least on each of the 4 batch shards"):
        geometric_ring_tiers(8, 100, 3, shards=4)


@pytest.mark.parametrize("shared", [False, True], ids=["copied_prompts", "prompt_pool"])
def test_sharded_ring_tiers_match_static(tiny_checkpoint, llama, shared):
    """Ring tiers over 2 batch shards, each holding its share of every tier (`layers.tier_rows`):
    samples move (across shards too) and pause, every sample equals the static sampler's row, and
    without a prompt pool a decode chunk moves no rows between devices."""
    r = np.random.default_rng(0)
    k = 2
    prompts = [[1, *r.integers(3, 60, r.integers(1, 12)).tolist()] for _ in range(8)]
    cfg = SamplingConfig(max_new_tokens=14, num_samples=k, temperature=1.0, top_k=40,
                         stop_token_ids=(3, 4), pad_token_id=0)
    caps = r.integers(1, 15, len(prompts) * k)
    caps[::3] = 14
    key = jax.random.key(0)
    static = Sampler(llama, max_cache_length=32).sample(prompts, cfg, key, max_new_per_row=caps)
    mesh = make_mesh(MeshConfig(data=2), devices=jax.devices()[:2])
    sampler = Sampler(load_model(tiny_checkpoint("llama"), mesh=mesh), mesh=mesh, max_cache_length=32)
    tiers = ((4, 4), (2, 8), (2, 14)) if shared else ((2, 20), (4, 24), (2, 32))
    engine = ContinuousEngine(sampler, cfg, slots=8, chunk=3, max_prompt_tokens=32, share_prompt_cache=shared,
                              ring_tiers=tiers)
    for i, p in enumerate(prompts):
        engine.submit(p, request_keys(key, i * k, k), tag=i, max_new_per_sample=caps[i * k:(i + 1) * k])
    groups = {}
    while not engine.idle:
        groups.update((g.tag, g) for g in engine.step())
        if shared:  # every sample on its prompt's pool entry's shard (4 rows, 2 entries a shard)
            for s, rec in enumerate(engine._slot):
                if rec is not None:
                    assert s // 4 == engine._requests[rec.request].entry // (engine.pool // 2)
    _assert_same(static, groups, k)
    assert engine.stats.moves > 0 and engine.stats.pauses > 0 and not engine._paused
    # shard 0 holds rows 0-3: its share of tier 0, 1, 2, then shard 1 likewise
    per_shard = [0, 0, 1, 2] if shared else [0, 1, 1, 2]
    np.testing.assert_array_equal(engine._tier_of, per_shard * 2)
    for tier in engine._cache.tiers:
        for buf in (*tier.k, *tier.v):
            assert buf.sharding.spec[0] == "data" and len(buf.sharding.device_set) == 2
    chunk = next(c for (kind, _), c in sampler._compiled.items() if kind == "decode_chunk")
    ops = _collectives(chunk.as_text())
    # the loop's exit test (is any slot live, could a prompt enter) is all a chunk reduces
    scalars = r"\(?(s32|pred)\[\](, (s32|pred)\[\])*\)?"
    assert ops and all(kind == "all-reduce" and re.fullmatch(scalars, shape) for shape, kind, _ in ops), ops


def _collectives(hlo):
    """(result shape, collective, op name) of each collective op in an HLO text."""
    kinds = "all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter"
    return re.findall(rf"= (\([^)]*\)|\S+) ({kinds})(?:-start)?\(.*?op_name=\"([^\"]*)", hlo)


def test_ring_tiers_rows_split_over_batch_shards(tiny_checkpoint):
    mesh = make_mesh(MeshConfig(data=2), devices=jax.devices()[:2])
    sampler = Sampler(load_model(tiny_checkpoint("llama"), mesh=mesh), mesh=mesh, max_cache_length=64)
    with pytest.raises(ValueError, match="multiple of the mesh's 2 batch shards"):
        ContinuousEngine(sampler, CFG, slots=6, chunk=2, ring_tiers=((3, 20), (3, 64)))
    with pytest.raises(ValueError, match="decode slots; raise rollout.decode_slots to at least 6"):
        ContinuousEngine(sampler, CFG, slots=4, chunk=2, share_prompt_cache=True)
    engine = ContinuousEngine(sampler, CFG, slots=8, chunk=4, ring_tiers=2)
    # each shard: 2 rows of ring / 2, 2 of the ring (the pool holds prompts: ring = max_new_tokens)
    assert engine.ring == 10 and engine.ring_tiers == ((4, 5), (4, 10))
    np.testing.assert_array_equal(engine._tier_of, [0, 0, 1, 1, 0, 0, 1, 1])


@pytest.mark.parametrize("seed", [0, 1])
def test_schedule_model_matches_the_engine(llama, seed):
    """`experiments/benchmarks/continuous_schedule.py`'s model of the engine's scheduling (which
    sizes the default prompt pool) counts the engine's own decode steps and chunks."""
    from experiments.benchmarks.continuous_schedule import schedule

    r = np.random.default_rng(seed)
    k = int(r.integers(2, 4))
    slots, chunk = k * int(r.integers(2, 4)), int(r.integers(2, 5))
    pool = int(r.integers(1, 3 * slots // k + 1))
    lengths = r.integers(1, 13, 8 * k)
    prompts = [[1, *r.integers(3, 60, r.integers(1, 9)).tolist()] for _ in range(8)]
    cfg = SamplingConfig(max_new_tokens=12, num_samples=k, temperature=1.0, stop_token_ids=(), pad_token_id=0)
    engine, _ = _run_engine(Sampler(llama, max_cache_length=32), cfg, jax.random.key(seed), prompts,
                            slots=slots, chunk=chunk, caps=lengths, prompt_pool=pool)
    want = schedule(lengths, k, slots, chunk, pool)
    assert (engine.stats.decode_steps, engine.stats.chunks) == (want["decode_steps"], want["chunks"])
    assert engine.stats.occupancy(slots) == pytest.approx(want["occupancy"])


def test_chunk_runs_on_while_the_pool_is_held(llama):
    """A waiting prompt ends a chunk early only if it could enter: with the one pool entry held by
    a straggler, chunks run their full length (they used to end after one step each), and the
    prompt enters once the straggler ends."""
    sampler = Sampler(llama, max_cache_length=32)
    cfg = SamplingConfig(max_new_tokens=13, num_samples=2, temperature=1.0, stop_token_ids=())
    engine = ContinuousEngine(sampler, cfg, slots=4, chunk=4, max_prompt_tokens=8, prompt_pool=1)
    key = jax.random.key(2)
    engine.submit([1, 5, 6], request_keys(key, 0, 2), tag="a", max_new_per_sample=[2, 13])
    engine.submit([1, 7], request_keys(key, 2, 2), tag="b", max_new_per_sample=[3, 3])
    groups = {g.tag: g for g in engine.run()}
    assert [len(t) for t in groups["a"].tokens] == [2, 13] and [len(t) for t in groups["b"].tokens] == [3, 3]
    # a: 12 decode steps in chunks of 4 (not 12 chunks of 1); b: 2 more steps after it enters
    assert engine.stats.decode_steps == 14 and engine.stats.chunks == 4


def test_bad_engine_inputs(llama):
    sampler = Sampler(llama, max_cache_length=64)
    with pytest.raises(ValueError, match="decode_slots"):
        ContinuousEngine(sampler, CFG, slots=2, chunk=4)
    with pytest.raises(ValueError, match="chunk"):
        ContinuousEngine(sampler, CFG, slots=4, chunk=0)
    with pytest.raises(ValueError, match="at least one prompt"):
        ContinuousEngine(sampler, CFG, slots=4, chunk=4, prompt_pool=0)
    with pytest.raises(ValueError, match="needs share_prompt_cache"):
        ContinuousEngine(sampler, CFG, slots=4, chunk=4, share_prompt_cache=False, prompt_pool=2)
    for tiers, match in [(((2, 4), (1, 10)), "add up to the 4"), (((2, 10), (2, 4)), "must increase"),
                         (((2, 4), (2, 9)), "must hold the longest history a sample can have, 10 slots"),
                         (((2, 3), (2, 10)), "shorter than a decode chunk"), (5, "1 to 4 tiers")]:
        with pytest.raises(ValueError, match=match):
            ContinuousEngine(sampler, CFG, slots=4, chunk=4, ring_tiers=tiers)
    engine = ContinuousEngine(sampler, CFG, slots=4, chunk=4, max_prompt_tokens=8)
    with pytest.raises(ValueError, match="at most 8"):
        engine.submit(list(range(1, 12)), request_keys(jax.random.key(0), 0, 3))
    with pytest.raises(ValueError, match="per-sample keys"):
        engine.submit([1, 2], request_keys(jax.random.key(0), 0, 2))


def _reference_decode(models, switch_at, prompt, keys, cfg, new_tokens):
    """Step-by-step decode of one prompt's samples in a linear cache, the params switching from
    models[0] to models[1] from step `switch_at` on (the cache written so far is kept)."""
    k = len(keys)
    p = len(prompt)
    tokens = jnp.asarray([prompt] * k, jnp.int32)
    mask = jnp.ones((k, p), bool)
    cache = KVCache.init(models[0].config, k, p + new_tokens)
    graphdef = nnx.graphdef(models[0])

    @jax.jit
    def prefill(state, cache):
        model = nnx.merge(graphdef, state)
        hidden, cache = model.hidden_states(tokens, positions_from_mask(mask), mask, cache)
        return model.logits(hidden[:, -1]), cache

    logits, cache = prefill(nnx.state(models[0]), cache)
    spec = core.DecodeSpec(new_tokens, cfg.top_k, cfg.top_p < 1, False, (), 0)
    knobs = core.Knobs(jnp.float32(cfg.temperature), jnp.float32(cfg.top_p), jnp.int32(0))
    pick = jax.jit(lambda logits, s: core.pick_tokens(logits, step_keys(keys, s), s, knobs=knobs, spec=spec))

    @jax.jit
    def one_step(state, tok, position, cache):  # one compiled step for both param versions
        model = nnx.merge(graphdef, state)
        hidden, cache = model.hidden_states(tok[:, None], position, jnp.ones((k, 1), bool), cache)
        return model.logits(hidden[:, 0]), cache

    out_t, out_lp = [], []
    for s in range(new_tokens):
        if s:
            state = nnx.state(models[int(s >= switch_at)])
            logits, cache = one_step(state, out_t[-1], jnp.full((k, 1), p + s - 1, jnp.int32), cache)
        tok, lp = pick(logits, jnp.int32(s))
        out_t.append(tok)
        out_lp.append(lp)
    return np.stack(out_t, 1), np.stack(out_lp, 1)


def test_inflight_swap_records_versions(llama):
    """Params swapped between chunks: samples in flight go on, each token carries the version that
    produced it and its log-prob under that version (the reference switches at the same step)."""
    sampler = Sampler(llama, max_cache_length=64)
    cfg = SamplingConfig(max_new_tokens=12, num_samples=2, temperature=1.0, top_k=30, stop_token_ids=())
    new = jax.tree.map(lambda x: x * 1.3, nnx.state(llama, nnx.Param))
    engine = ContinuousEngine(sampler, cfg, slots=4, chunk=4, max_prompt_tokens=16, version=5)
    key = jax.random.key(11)
    prompts = [[1, 5, 6, 7], [1, 9, 10]]
    for i, p in enumerate(prompts):
        engine.submit(p, request_keys(key, 2 * i, 2), tag=i)
    assert engine.step() == []  # admit (first token) + 4 steps under version 5
    engine.update_params(new, version=6)
    assert engine.stats.swaps == 1 and engine.stats.last_swap_s > 0
    groups = {g.tag: g for g in engine.run()}
    assert sum(e.kind == "decode_chunk" for e in sampler.compile_events) == 1  # the swap compiled nothing
    swapped = nnx.merge(nnx.graphdef(llama), new)
    for i, p in enumerate(prompts):
        g = groups[i]
        versions = np.stack(g.token_versions)
        np.testing.assert_array_equal(versions, [[5] * 5 + [6] * 7] * 2)
        ref_t, ref_lp = _reference_decode((llama, swapped), 5, p, request_keys(key, 2 * i, 2), cfg, 12)
        np.testing.assert_array_equal(np.stack(g.tokens), ref_t)
        np.testing.assert_allclose(np.stack(g.logprobs), ref_lp, atol=1e-5)


@pytest.mark.parametrize("shared, mesh_config, fsdp_weights", [
    (False, MeshConfig(data=4, tensor=2), "whole"), (True, MeshConfig(data=4, tensor=2), "whole"),
    (True, MeshConfig(data=2, fsdp=2, tensor=2), "whole"),
    (True, MeshConfig(data=2, fsdp=2, tensor=2), "tensor")],
    ids=["copied_prompts", "prompt_pool", "prompt_pool-fsdp-whole", "prompt_pool-fsdp-tensor"])
def test_sharded_engine_matches_single_device(tiny_checkpoint, llama, shared, mesh_config, fsdp_weights):
    """On an fsdp mesh too, with the weights held whole along fsdp (`serving_shardings`) or split
    over the fsdp devices as tensor shards (`fsdp_as_tensor`): a decode chunk moves no weights."""
    assert jax.device_count() == 8
    key = jax.random.key(5)
    single = Sampler(llama, max_cache_length=64).sample(PROMPTS[:4], CFG, key)
    mesh = make_mesh(mesh_config)
    sampler = Sampler(load_model(tiny_checkpoint("llama"), mesh=mesh), mesh=mesh, max_cache_length=64,
                      fsdp_weights=fsdp_weights)
    # a pool's prompt decodes its K = 3 samples on its entry's shard: at least 3 slots a shard
    slots = 12 if shared else 8
    engine, groups = _run_engine(sampler, CFG, key, PROMPTS[:4], slots=slots, chunk=4,
                                 share_prompt_cache=shared)
    pool = engine._cache.prompt
    # 2 x 12 // 3 (prompt bucket 32 > max_new_tokens 10), a multiple of the 4 shards
    assert (pool is not None) == shared and engine.pool == (8 if shared else 0)
    rows = "data" if mesh_config.fsdp == 1 or fsdp_weights == "tensor" else ("data", "fsdp")
    for buf in (*engine._cache.k, *engine._cache.v, *(pool.k if shared else ())):  # per layer [batch, ...]
        assert buf.sharding.spec[0] == rows and len(buf.sharding.device_set) == 8
    _assert_same(single, groups, CFG.num_samples)
    chunk = next(c for (kind, _), c in sampler._compiled.items() if kind == "decode_chunk").as_text()
    # nothing moves rows between batch shards; the tensor axis only sums the row-split products
    assert {kind for _, kind, _ in _collectives(chunk)} == {"all-reduce"}


@pytest.mark.processes
def test_async_run_with_the_continuous_engine(tmp_path):
    """The tiny default experiment, async, its searcher on the continuous engine (its slots in two
    ring tiers): the trainer trains on its groups, every row's token versions are stored, the
    searcher reports occupancy. (Rings of 3 and 6 slots: chunks of 2 steps.)"""
    from tbajax.stores import TrajectoryReader, trajectory_store_url
    from tbajax.system.metrics import read_metrics
    from tests.test_system import _finish, _main

    run = tmp_path / "run"
    out = _finish(_main(run, "--set", "train.steps=4", "--set", "system.sync_every=2",
                        "--set", "rollout.engine=continuous", "--set", "rollout.decode_slots=16",
                        "--set", "rollout.decode_chunk=2", "--set", "rollout.ring_tiers=2"), timeout=180)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["trainer_steps"] == 4, out
    searcher = [r for r in read_metrics(run, "searcher-0") if "slot_occupancy" in r]
    assert searcher and all(0 < r["slot_occupancy"] <= 1 for r in searcher)
    assert searcher[-1]["ring_moves"] > 0  # samples outgrew the 3-slot ring (running totals)
    reader = TrajectoryReader(trajectory_store_url(str(run), 0))
    rows = reader.read(0, reader.committed_rows())
    k = 8
    assert len(rows) % k == 0 and len(rows) >= 4 * k
    groups = [r.group_id for r in rows]
    assert all(len(set(groups[i:i + k])) == 1 for i in range(0, len(rows), k))  # a group's K rows together
    assert len(set(groups)) == len(rows) // k
    for r in rows:
        assert len(r.token_versions) == len(r.response_tokens) and r.policy_version == r.token_versions.min()


@pytest.mark.slow  # two searcher stacks; the async end-to-end run below covers this path by default
def test_rollouts_generate_continuous_equals_static():
    """`Rollouts.generate` through the engine: the same rows as the static path (tokens, behaviour
    and reference log-probs, rewards, group ids, versions) on the tiny default experiment."""
    from tbajax.main import load_experiment
    from tbajax.system.searcher import build_rollouts

    base = load_experiment("tiny_arithmetic")
    base = dataclasses.replace(base, rollout=dataclasses.replace(base.rollout, reference_logprobs=True))
    cont = dataclasses.replace(base, rollout=dataclasses.replace(base.rollout, engine="continuous",
                                                                 decode_slots=16, decode_chunk=3))
    static_r = build_rollouts(base, 0)
    cont_r = build_rollouts(cont, 0)
    problems = static_r.task.load("train")[:5]
    key = jax.random.key(9)
    a = static_r.generate(problems, key, version=3, first_group_id=100)
    b = cont_r.generate(problems, key, version=3, first_group_id=100)
    assert len(a) == len(b) == 5 * base.rollout.sampling.num_samples
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.response_tokens, y.response_tokens)
        np.testing.assert_allclose(x.behavior_logprobs, y.behavior_logprobs, atol=1e-5)
        np.testing.assert_allclose(x.reference_logprobs, y.reference_logprobs, atol=1e-5)
        assert (x.group_id, x.prompt_id, x.reward, x.finished, x.policy_version) == \
            (y.group_id, y.prompt_id, y.reward, y.finished, y.policy_version)
        assert (y.token_versions == 3).all()
