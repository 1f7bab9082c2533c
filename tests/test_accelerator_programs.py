"""The programs a GPU runs, checked on this CPU: the trainer's step, the sampler's and the
continuous engine's programs are lowered for CUDA (`jax.stages.Traced.lower(lowering_platforms=
("cuda",))`), so every `jax.lax.platform_dependent` in them takes its accelerator branch, then
compiled and run here. No GPU was lent to these sessions; this is what can be checked without
one: that the programs lower for CUDA at all, and that the accelerator branches (products
rows-first and without fp32 accumulation, no own-kernel conditionals, no fusion breaks before
the sampling step) compute what the CPU programs compute. What only a GPU shows (cuDNN, memory,
speed) is in `experiments/benchmarks/gpu_check.sh` and `tests/test_gpu_attention.py`."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tbajax.models import layers, load_model
from tbajax.sampling import Sampler, SamplingConfig
from tbajax.sampling.continuous import ContinuousEngine, request_keys
from tbajax.sharding import MeshConfig, make_mesh
from tbajax.training import init_train_state, resolve_objective, train_step
from tbajax.training.collate import scored_windows
from tbajax.training.step import batch_shardings
from tests.test_model_families import DECODERS, _build
from tests.test_training import ACCUM_CONFIG, FAST_COMPILE, fresh_model, make_batch

PROMPTS = [[1, 5, 6, 7], [1, 9], [1, *range(3, 22)], [1, 40, 41]]
CFG = SamplingConfig(max_new_tokens=8, num_samples=2, temperature=0.8, top_k=40, top_p=0.9,
                     min_new_tokens=2, stop_token_ids=tuple(range(3, 30)), pad_token_id=0)


class LoweredFor:
    """A jitted function whose `lower` lowers it for `platforms` (None: this backend's); compiled,
    it runs on this (CPU) backend. `lowered` keeps each program's text."""

    def __init__(self, jitted: Any, platforms: tuple[str, ...] | None, lowered: list[str]):
        self.jitted, self.platforms, self.lowered = jitted, platforms, lowered

    def lower(self, *args: Any) -> Any:
        lowered = self.jitted.trace(*args).lower(lowering_platforms=self.platforms)
        self.lowered.append(lowered.as_text())
        return lowered


def sampler_lowered_for(platforms: tuple[str, ...] | None, model: Any, lowered: list[str],
                        **options: Any) -> Sampler:
    """A `Sampler` whose programs (and those of a `ContinuousEngine` over it) are lowered for
    `platforms`, their texts kept in `lowered`."""
    sampler = Sampler(model, **options)
    run = sampler._run  # every sampler and engine program is compiled here, on first use

    def run_lowered(key: tuple[Any, ...], build: Any, *args: Any) -> Any:
        return run(key, lambda: LoweredFor(build(), platforms, lowered), *args)

    sampler._run = run_lowered  # type: ignore[method-assign]
    return sampler


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint, tmp_path_factory):
    """checkpoint(name): the tiny Llama or Gemma 3 of `tiny_checkpoint`, or a tiny GPT-NeoX with
    partial rotary, biases and a parallel residual (`test_model_families.DECODERS`)."""
    def get(name: str) -> Any:
        if name in ("llama", "gemma3"):
            return tiny_checkpoint(name)
        model_type, overrides = DECODERS[name]
        return _build(tmp_path_factory.mktemp(name), model_type, overrides, classifier=False)

    return get


def conditionals(compiled: Any) -> int:
    return compiled.as_text().count(" conditional(")


def loops(compiled: Any) -> int:
    return compiled.as_text().count(" while(")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_train_step_lowered_for_cuda_matches_the_cpu_step(dtype, monkeypatch):
    """One TB update: new params, loss and grad norm as the CPU program's. On CPU the step keeps
    its transposes and RoPE tables in kernels of their own (`layers.own_kernel`, conditionals)
    and, with a CPU's attention budget of 0 here, loops over the batch one row at a time; the
    CUDA program has only the step's own skip-on-NaN branch and takes every row in one step
    (`layers.ACCELERATOR_ROW_SCORES_BUDGET`)."""
    monkeypatch.setattr(layers, "ROW_SCORES_BUDGET", 0)
    config = dataclasses.replace(ACCUM_CONFIG, compute_dtype=dtype)
    objective, objective_config = resolve_objective("tb", None)
    graphdef, state = init_train_state(fresh_model(), config)
    batch = make_batch(0)
    fn = jax.jit(functools.partial(train_step, graphdef=graphdef, objective=objective,
                                   objective_config=objective_config, config=config))
    on_cpu = fn.trace(state, batch).lower().compile(FAST_COMPILE)
    for_cuda = fn.trace(state, batch).lower(lowering_platforms=("cuda",)).compile(FAST_COMPILE)
    assert conditionals(for_cuda) == 1 < conditionals(on_cpu)
    assert loops(for_cuda) < loops(on_cpu)  # the attention's forward and VJP row loops of each layer
    (want, want_out), (got, got_out) = on_cpu(state, batch), for_cuda(state, batch)
    assert bool(got_out.applied) and bool(want_out.applied)
    tol = 1e-5 if dtype == "float32" else 2e-2  # bf16: products rounded without fp32 accumulation
    for name in ("loss", "grad_norm"):
        assert float(got_out.metrics[name]) == pytest.approx(float(want_out.metrics[name]), rel=tol), name
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=tol, rtol=tol)


def test_programs_on_a_mesh_lowered_for_cuda_match_one_cpu_device(tiny_checkpoint):
    """On a data x fsdp x tensor mesh of 8 (CPU) devices, as on a multi-GPU host: a TB update and
    a sampler's programs lowered for CUDA give one CPU device's params, tokens and log-probs."""
    assert jax.device_count() == 8
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    config = ACCUM_CONFIG
    objective, objective_config = resolve_objective("tb", None)
    fn = jax.jit(functools.partial(train_step, graphdef=init_train_state(fresh_model(), config)[0],
                                   objective=objective, objective_config=objective_config, config=config))
    batch = make_batch(0)
    one_device = init_train_state(fresh_model(), config)[1]
    want, want_out = fn.trace(one_device, batch).lower().compile(FAST_COMPILE)(one_device, batch)
    _, state = init_train_state(fresh_model(), config, mesh)
    batch = dataclasses.replace(batch, scored=scored_windows(np.asarray(batch.loss_mask)))
    batch = jax.device_put(batch, batch_shardings(mesh))
    with jax.set_mesh(mesh):
        lowered_step = fn.trace(state, batch).lower(lowering_platforms=("cuda",))
        got, got_out = lowered_step.compile(FAST_COMPILE)(state, batch)
    assert got.params["layers"]["q_proj"][...].sharding.mesh == mesh
    assert float(got_out.metrics["loss"]) == pytest.approx(float(want_out.metrics["loss"]), rel=1e-5)
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)

    key = jax.random.key(3)
    want_sample = Sampler(load_model(tiny_checkpoint("llama")), max_cache_length=64).sample(PROMPTS, CFG, key)
    lowered: list[str] = []
    model = load_model(tiny_checkpoint("llama"), mesh=mesh)
    got_sample = sampler_lowered_for(("cuda",), model, lowered, mesh=mesh, max_cache_length=64).sample(
        PROMPTS, CFG, key)
    assert lowered
    np.testing.assert_array_equal(got_sample.tokens, want_sample.tokens)
    np.testing.assert_allclose(got_sample.logprobs, want_sample.logprobs, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "neox_parallel", "gemma3"])
def test_sampler_and_continuous_engine_lowered_for_cuda_sample_what_the_cpu_programs_sample(
        checkpoint, family):
    """Static sampling (top-k + top-p, K samples sharing each prompt's cache, stops) and, for the
    Llama, the continuous engine over the same keys: the same tokens and log-probs as on CPU. The
    decode products take x w^T rather than the CPU's weight-first w x^T (`layers.out_major_product`).
    Gemma 3: a windowed layer (4 positions, shorter than the prompts) and a full one."""
    model = load_model(checkpoint(family))
    key = jax.random.key(11)
    on_cpu: list[str] = []
    want = sampler_lowered_for(None, model, on_cpu, max_cache_length=64).sample(PROMPTS, CFG, key)
    lowered: list[str] = []
    sampler = sampler_lowered_for(("cuda",), model, lowered, max_cache_length=64)
    got = sampler.sample(PROMPTS, CFG, key)
    barriers = [text.count("optimization_barrier") for text in (*on_cpu, *lowered)]
    assert barriers[:len(on_cpu)] != [0] * len(on_cpu) and barriers[len(on_cpu):] == [0] * len(lowered)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.length, want.length)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
    assert got.finished.any() and not got.finished.all()
    if family != "llama":
        return
    engine = ContinuousEngine(sampler, CFG, slots=4, chunk=3, max_prompt_tokens=32)
    k = CFG.num_samples
    for i, p in enumerate(PROMPTS):
        engine.submit(p, request_keys(key, i * k, k), tag=i)
    groups = {g.tag: g for g in engine.run()}
    assert {e.kind for e in sampler.compile_events} >= {"admit", "decode_chunk"}
    assert len(lowered) == len(sampler.compile_events)  # every program, the engine's too, for CUDA
    for i, g in groups.items():
        for j in range(k):
            n = want.length[i * k + j]
            np.testing.assert_array_equal(g.tokens[j], want.tokens[i * k + j, :n])
            np.testing.assert_allclose(g.logprobs[j], want.logprobs[i * k + j, :n], atol=1e-5)


def test_bf16_decode_lowered_for_cuda_matches_the_cpu_programs(tiny_checkpoint):
    """A bf16 model's decode: on CPU its products accumulate in fp32 and its cache is fp32
    (`serving.kv_cache_dtype`); lowered for CUDA the products are plain bf16 ones. With the cache
    dtype held the same, the log-probs of the same tokens agree to bf16's rounding."""
    model = load_model(tiny_checkpoint("llama"), param_dtype="bfloat16", dtype="bfloat16")
    key = jax.random.key(5)
    cfg = dataclasses.replace(CFG, temperature=1.0, top_k=0, top_p=1.0, stop_token_ids=())
    want = Sampler(model, max_cache_length=64).sample(PROMPTS, cfg, key)
    lowered: list[str] = []
    got = sampler_lowered_for(("cuda",), model, lowered, max_cache_length=64).sample(PROMPTS, cfg, key)
    assert lowered
    same = (got.tokens == want.tokens).all(axis=1)
    assert same.mean() >= 0.75, same  # a rounding difference may tip a draw in a row
    np.testing.assert_allclose(got.logprobs[same], want.logprobs[same], atol=0.05)
    assert jnp.dtype(got.logprobs.dtype) == jnp.float32
