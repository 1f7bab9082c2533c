"""The trainer step: accumulation, schedules, reference resets, NaN guard, checkpoints, sharding.

Run as a script (`python tests/test_training.py resume CKPT_DIR STEP OUT.npz`) it is the fresh
process of the checkpoint test: restore, train two more updates, write the state to OUT.npz.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tbajax.batch import Batch
from tbajax.training.collate import collate, scored_windows
from tbajax.models import CausalLM, ModelConfig, packed_attention_mask
from tbajax.objectives.base import Max, Min, Ratio
from tbajax.sharding import MeshConfig, make_mesh
from tbajax.trajectory import Trajectory
from tests.conftest import numpy_model_parts
from tbajax.training import (
    BetaSchedule,
    Checkpointer,
    LRSchedule,
    MicroBatchLayoutError,
    NonFiniteLossError,
    OptimizerConfig,
    PolicyUpdater,
    TrainerConfig,
    abstract_train_state,
    beta_at,
    aux_adam_update,
    aux_rows_touched,
    init_aux_opt_state,
    init_train_state,
    initial_aux,
    learning_rate,
    make_train_step,
    raise_on_bad_step,
    sequence_logprobs,
    resolve_objective,
    split_policy,
    state_shardings,
    train_step,
)

ROOT = Path(__file__).resolve().parents[1]
MODEL = ModelConfig(
    model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
)
# groups by explicit id, not contiguous numbering; the last row is padding (its own group)
GROUP_IDS = np.array([5, 5, 1, 1, 7, 7, 3, 0], np.int32)
SAMPLE_MASK = np.array([1, 1, 1, 1, 1, 1, 1, 0], bool)
# prompt 2 has two groups (ids 5 and 7); padding rows carry prompt id 0
PROMPT_IDS = np.array([2, 2, 9, 9, 2, 2, 4, 0], np.int32)


def vargrad_tb(batch: Batch, logprobs, config=None):
    """VarGrad TB written out: per group mean_i (δ_i − δ̄)², δ = S − R − r/β; mean over groups."""
    n, g, m = batch.batch_size, batch.group_id, batch.row_mask()
    w = batch.sample_mask.astype(jnp.float32)
    delta = jnp.where(m > 0, logprobs - batch.reference_logprobs, 0).sum(-1) - batch.reward / batch.beta
    count = jax.ops.segment_sum(w, g, n)
    centered = delta - jax.lax.stop_gradient(jax.ops.segment_sum(w * delta, g, n) / jnp.maximum(count, 1))[g]
    per_group = jax.ops.segment_sum(w * centered**2, g, n) / jnp.maximum(count, 1)
    loss = Ratio(per_group.sum(), (count > 0).sum().astype(jnp.float32))
    real = w > 0
    return loss, {"residual_sq": Ratio((w * centered**2).sum(), w.sum()),
                  "delta_max": Max(jnp.where(real, delta, -jnp.inf).max()),
                  "delta_min": Min(jnp.where(real, delta, jnp.inf).min())}


def make_batch(seed: int, rows: int = 8, seq: int = 16) -> Batch:
    """A random host batch: prompts of 2-4 tokens, responses to a random length, right-padded."""
    r = np.random.default_rng(seed)
    tokens = r.integers(3, MODEL.vocab_size - 1, (rows, seq)).astype(np.int32)  # 63 never drawn
    attn = np.zeros((rows, seq), bool)
    loss = np.zeros((rows, seq), bool)
    for i in range(rows):
        p = int(r.integers(2, 5))
        end = int(r.integers(p + 3, seq + 1))
        attn[i, :end] = True
        loss[i, p:end] = True
    return Batch(
        tokens=np.where(attn, tokens, 0),
        attention_mask=attn,
        loss_mask=loss,
        behavior_logprobs=np.where(loss, -r.random((rows, seq)), 0).astype(np.float32),
        reference_logprobs=np.zeros((rows, seq), np.float32),
        reward=r.integers(0, 2, rows).astype(np.float32),
        group_id=GROUP_IDS[:rows] if rows == 8 else (np.arange(rows) // 2).astype(np.int32),
        sample_mask=SAMPLE_MASK[:rows] if rows == 8 else np.ones(rows, bool),
        policy_version=np.zeros(rows, np.int32),
        prompt_id=PROMPT_IDS[:rows] if rows == 8 else np.zeros(rows, np.int32),
        beta=np.float32(0.5),
        token_versions=np.zeros((rows, seq), np.int32),
        current_version=np.int32(0),
    )


@functools.lru_cache(maxsize=None)
def _model_parts():
    """Graphdef + numpy weights (~N(0, 0.1), norms ~1): no PRNG kernels to compile."""
    return numpy_model_parts(MODEL)


def fresh_model(dtype=jnp.float32) -> CausalLM:
    graphdef, params = _model_parts()
    return nnx.merge(graphdef, jax.tree.map(lambda x: jnp.asarray(x, dtype), params))


def host(tree):
    return jax.tree.map(lambda x: np.array(x), tree)


def leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def assert_trees_close(a, b, atol=1e-5, rtol=1e-5):
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_allclose(x, y, atol=atol, rtol=rtol)


def assert_metrics_close(got: list[dict], want: list[dict]) -> None:
    """Step metrics of two runs that sum in different orders (micro-batches, meshes, layouts).
    The absolute 1e-5: residuals such as `delta_max` are differences of sequence log-prob sums of
    magnitude ~5 here, so fp32 rounding of those sums (XLA blocks a product by its batch size,
    and the blocking differs between CPUs: 5e-6 on an AMD EPYC) shows unscaled in a small residual."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g == pytest.approx(w, rel=1e-5, abs=1e-5)


# XLA's optimisations cost ~2.5x the compile time of these tiny steps and buy nothing here
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
# eps 1e-4: Adam divides by |g| + eps, which would blow fp32 reduction-order noise in near-zero
# gradients up to visible parameter differences between equally correct summation orders
ACCUM_CONFIG = TrainerConfig(
    optimizer=OptimizerConfig(lr=LRSchedule(peak=1e-2), eps=1e-4, weight_decay=0.1, max_grad_norm=5.0),
    temperature=0.7,
    compute_dtype="float32",
)
# every feature at once, for the reset and checkpoint tests
FULL_CONFIG = TrainerConfig(
    optimizer=OptimizerConfig(
        lr=LRSchedule("wsd", peak=1e-2, warmup_steps=1, stable_steps=1, decay_steps=4, final_fraction=0.1),
        weight_decay=0.01,
        max_grad_norm=1.0,
    ),
    beta=BetaSchedule("linear", start=0.5, final=0.1, decay_steps=4),
    reference_reset_every=2,
    reset_optimizer_on_reference_reset=True,
    compute_dtype="float32",
)


def compiled_step(config: TrainerConfig, mesh_config: MeshConfig | None = None):
    """(mesh, step) built once per configuration, so tests share compilations."""
    return _compiled_step(config, mesh_config, vargrad_tb)


@functools.lru_cache(maxsize=None)
def _compiled_step(config, mesh_config, objective):
    mesh = make_mesh(mesh_config) if mesh_config is not None else None
    graphdef, state = init_train_state(fresh_model(), config, mesh)
    sharding = state_shardings(state, mesh) if mesh is not None else None
    return mesh, make_train_step(
        graphdef, config, objective, mesh=mesh, state_sharding=sharding, compiler_options=FAST_COMPILE
    )


def run(config: TrainerConfig, seeds, mesh_config: MeshConfig | None = None, state=None):
    """Train from the fresh model on make_batch(seed) for each seed; returns (state, metrics list)."""
    mesh, step = compiled_step(config, mesh_config)
    if state is None:
        _, state = init_train_state(fresh_model(), config, mesh)
    metrics = []
    first = int(state.step) + 1
    for u, seed in enumerate(seeds, first):
        state, out = step(state, make_batch(seed))
        metrics.append(raise_on_bad_step(out, u))
    return state, metrics


@pytest.fixture(scope="module")
def single_device_run():
    return run(ACCUM_CONFIG, [0, 1])


# ----------------------------------------------------------------------------- schedules


def test_lr_schedules_hand_values():
    def lr(s, step):
        return float(learning_rate(s, step))

    const = LRSchedule("constant", peak=1e-3, warmup_steps=10)
    assert [lr(const, s) for s in (0, 5, 10, 1000)] == pytest.approx([0, 5e-4, 1e-3, 1e-3])
    lin = LRSchedule("linear", peak=1.0, decay_steps=100, final_fraction=0.1)
    assert [lr(lin, s) for s in (0, 50, 100, 200)] == pytest.approx([1.0, 0.55, 0.1, 0.1])
    cos = LRSchedule("cosine", peak=2.0, warmup_steps=10, decay_steps=20)
    assert [lr(cos, s) for s in (5, 10, 15, 20, 30, 99)] == pytest.approx(
        [1.0, 2.0, 1 + math.cos(math.pi / 4), 1.0, 0.0, 0.0], abs=1e-6
    )
    # GSM8K: 1e-5, 50 warmup, 350 stable, cosine decay over 600, stopped at 700
    gsm = LRSchedule("wsd", peak=1e-5, warmup_steps=50, stable_steps=350, decay_steps=600)
    got = [lr(gsm, s) for s in (0, 25, 50, 399, 400, 550, 700, 1000, 2000)]
    want = [0, 5e-6, 1e-5, 1e-5, 1e-5, 0.5e-5 * (1 + math.cos(math.pi / 4)), 5e-6, 0, 0]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-12)
    wsd_lin = LRSchedule("wsd", peak=1.0, stable_steps=10, decay_steps=10, decay_shape="linear",
                         final_fraction=0.2)
    assert [lr(wsd_lin, s) for s in (0, 10, 15, 20, 50)] == pytest.approx([1.0, 1.0, 0.6, 0.2, 0.2])
    # the same function runs traced, inside jit
    assert float(jax.jit(lambda s: learning_rate(gsm, s))(jnp.int32(550))) == pytest.approx(want[5], rel=1e-5)


def test_beta_schedule_hand_values():
    gsm = BetaSchedule("linear", start=0.014, final=0.004, decay_steps=500)
    got = [float(beta_at(gsm, u)) for u in (1, 251, 499, 500, 700)]
    assert got == pytest.approx([0.014, 0.009, 0.014 - 0.01 * 498 / 500, 0.004, 0.004], rel=1e-6)
    early_stop = BetaSchedule("linear", start=1.0, final=0.0, decay_steps=100, stop_step=51)
    assert [float(beta_at(early_stop, u)) for u in (1, 50, 51)] == pytest.approx([1.0, 0.51, 0.0])
    const = BetaSchedule("constant", start=0.005)
    assert [float(beta_at(const, u)) for u in (1, 10_000)] == pytest.approx([0.005, 0.005])


def test_config_errors_are_explicit():
    with pytest.raises(ValueError, match="decay_steps"):
        LRSchedule("cosine", peak=1.0)
    with pytest.raises(ValueError, match="constant"):
        LRSchedule("constant", decay_steps=10)
    with pytest.raises(ValueError, match="final"):
        BetaSchedule("linear", start=0.1)
    with pytest.raises(ValueError, match="compute_reference_logprobs"):
        TrainerConfig(reference_reset_every=5, compute_reference_logprobs=False)


def test_precision_defaults_to_fp32_master_bf16_compute():
    bf16_model = fresh_model(jnp.bfloat16)
    graphdef, state = init_train_state(bf16_model, TrainerConfig())
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(state.adam_state.mu)} == {jnp.dtype(jnp.float32)}
    cfg = nnx.merge(graphdef, state.params).config
    assert (cfg.param_dtype, cfg.dtype) == ("float32", "bfloat16")
    assert bf16_model.config.dtype == "float32"  # the caller's model is not touched
    assert bf16_model.embed_tokens[...].dtype == jnp.bfloat16
    fp32 = nnx.merge(*split_policy(bf16_model, TrainerConfig(compute_dtype="float32"))).config
    assert (fp32.param_dtype, fp32.dtype) == ("float32", "float32")


# ----------------------------------------------------------------------------- the update


def test_update_matches_hand_written_adamw(single_device_run):
    """Step = grad of (Σ loss)/(Σ count) → clip → optax.adamw, with a fresh reference score."""
    graphdef, state0 = init_train_state(fresh_model(), ACCUM_CONFIG)
    params, ref = jax.tree.map(jnp.copy, state0.params), state0.ref_params
    tx = optax.chain(optax.clip_by_global_norm(5.0), optax.adamw(1e-2, eps=1e-4, weight_decay=0.1))

    def loss_fn(p, batch):
        lp = sequence_logprobs(graphdef, p, batch, 0.7)
        ref_lp = sequence_logprobs(graphdef, ref, batch, 0.7)
        batch = dataclasses.replace(batch, reference_logprobs=jnp.where(batch.loss_mask, ref_lp, 0))
        loss, _ = vargrad_tb(batch, lp)
        return loss.total / loss.count

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def update(p, opt, batch):
        loss, grads = jax.value_and_grad(loss_fn)(p, batch)
        updates, opt = tx.update(grads, opt, p)
        return optax.apply_updates(p, updates), opt, loss, optax.global_norm(grads)

    opt, norms = tx.init(params), []
    for seed in (0, 1):
        params, opt, loss, norm = update(params, opt, make_batch(seed))
        norms += [float(loss), float(norm)]
    state, metrics = single_device_run
    assert [x for m in metrics for x in (m["loss"], m["grad_norm"])] == pytest.approx(norms, rel=1e-5)
    assert norms[1] > 5.0  # clipping was active
    assert_trees_close(state.params, params)
    assert int(state.step) == 2


# 2 micro-batches are also run by the 2x2x2 sharded test below (against the same single-device run)
@pytest.mark.parametrize("num_microbatches", [pytest.param(2, marks=pytest.mark.slow), 4])
def test_gradient_accumulation_equals_one_batch(single_device_run, num_microbatches):
    state, metrics = run(dataclasses.replace(ACCUM_CONFIG, num_microbatches=num_microbatches), [0, 1])
    want_state, want_metrics = single_device_run
    assert_metrics_close(metrics, want_metrics)
    assert_trees_close(state.params, want_state.params)
    assert_trees_close(state.opt_state, want_state.opt_state)


def test_group_straddling_microbatches_is_refused():
    config = dataclasses.replace(ACCUM_CONFIG, num_microbatches=4)
    _, step = compiled_step(config)
    _, state = init_train_state(fresh_model(), config)
    before = host(state.params)
    bad = dataclasses.replace(make_batch(0), group_id=np.array([0, 0, 0, 4, 4, 4, 6, 7], np.int32))
    state, out = step(state, bad)
    with pytest.raises(MicroBatchLayoutError, match="contiguous"):
        raise_on_bad_step(out, 1)
    assert int(state.step) == 0
    assert all(np.array_equal(a, b) for a, b in zip(leaves(state.params), leaves(before)))


# 2x2x2 shards data, fsdp and tensor at once; pure data parallelism is the slow variant
@pytest.mark.parametrize("mesh_config", [pytest.param(MeshConfig(data=8), marks=pytest.mark.slow),
                                         MeshConfig(data=2, fsdp=2, tensor=2)], ids=["8x1x1", "2x2x2"])
def test_sharded_step_matches_single_device(single_device_run, mesh_config):
    assert jax.device_count() == 8
    config = ACCUM_CONFIG if mesh_config.data == 8 else dataclasses.replace(ACCUM_CONFIG, num_microbatches=2)
    state, metrics = run(config, [0, 1], mesh_config)
    mesh = compiled_step(config, mesh_config)[0]
    want_state, want_metrics = single_device_run
    assert_metrics_close(metrics, want_metrics)
    assert_trees_close(state.params, want_state.params)
    q = state.params["layers"]["q_proj"]
    assert q[...].sharding.spec == state_shardings(state, mesh).params["layers"]["q_proj"].spec
    if mesh_config.tensor == 2:  # really split: layers, embed/fsdp, q_heads/tensor, head_dim
        assert tuple(q[...].sharding.spec) == (None, "fsdp", "tensor", None)


@pytest.mark.parametrize("pack", [False, True], ids=["rows", "packed"])
def test_data_parallel_step_moves_no_activations(pack):
    """On a data-parallel mesh a train step's only float collectives are all-reduces (gradients,
    group sums): the scored positions' hidden states are gathered row by row
    (`sharding.along_rows`), where indexing them by an explicit row number made XLA gather every
    row's hidden states onto every device (forward) and all-reduce them (backward)."""
    from tbajax.training import batch_shardings, resolve_objective

    config = dataclasses.replace(ACCUM_CONFIG, pack_groups=pack)
    mesh = make_mesh(MeshConfig(data=2), devices=jax.devices()[:2])
    graphdef, state = init_train_state(fresh_model(), config, mesh)
    objective, objective_config = resolve_objective(vargrad_tb, None)
    fn = functools.partial(train_step, graphdef=graphdef, objective=objective,
                           objective_config=objective_config, config=config)
    extra = [dataclasses.replace(t, group_id=3) for t in grouped_trajectories(1)[1]]  # 4 groups, 8 rows
    batch = collate([*grouped_trajectories(0), extra], beta=0.5, num_rows=8, length_bucket=8,
                    pack_microbatches=1 if pack else None)
    if not pack:
        batch = dataclasses.replace(batch, scored=scored_windows(np.asarray(batch.loss_mask)))
    step = jax.jit(fn, in_shardings=(state_shardings(state, mesh), batch_shardings(mesh, packed=pack)),
                   compiler_options=FAST_COMPILE)
    with jax.set_mesh(mesh):
        hlo = step.lower(state, batch).compile().as_text()
    moved = re.findall(r"= (\([^)]*\)|\S+) (all-gather|all-to-all|collective-permute)", hlo)
    floats = [(shape, kind) for shape, kind in moved if re.search(r"\bf(16|32|64)\[", shape)]
    # packed: what is left is each scored token's log-prob going back to its row ([tokens] floats)
    assert all(pack and re.fullmatch(r"f32\[\d+\]\{0\}", shape) for shape, _ in floats), floats


def test_chunked_head_step_on_a_mesh_matches_the_whole_head_on_one_device(single_device_run):
    """`model.head_chunk_tokens=5`: the vocabulary projection and its gradient a few tokens at a
    time (every row of a micro-batch in each chunk), two micro-batches on the 2x2x2 mesh: the
    same metrics and params after two steps as one device projecting all tokens at once."""
    config = dataclasses.replace(ACCUM_CONFIG, num_microbatches=2)
    graphdef, params = numpy_model_parts(dataclasses.replace(MODEL, head_chunk_tokens=5))
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    graphdef, state = init_train_state(nnx.merge(graphdef, jax.tree.map(jnp.asarray, params)), config, mesh)
    step = make_train_step(graphdef, config, vargrad_tb, mesh=mesh,
                           state_sharding=state_shardings(state, mesh), compiler_options=FAST_COMPILE)
    metrics = []
    for u, seed in enumerate([0, 1], 1):
        state, out = step(state, make_batch(seed))
        metrics.append(raise_on_bad_step(out, u))
    want_state, want_metrics = single_device_run
    assert_metrics_close(metrics, want_metrics)
    assert_trees_close(state.params, want_state.params)


def test_reference_reset_every_rho_steps():
    _, step = compiled_step(FULL_CONFIG)
    _, state = init_train_state(fresh_model(), FULL_CONFIG)
    initial = host(state.params)
    seen_beta, seen_lr = [], []
    for u in range(1, 6):
        before_ref = host(state.ref_params)
        state, out = step(state, make_batch(10 + u))
        m = raise_on_bad_step(out, u)
        seen_beta.append(m["beta"])
        seen_lr.append(m["lr"])
        params, ref = leaves(state.params), leaves(state.ref_params)
        if u % 2 == 0:  # just reset: the reference is the policy, Adam starts over
            assert all(np.array_equal(a, b) for a, b in zip(params, ref))
            adam = state.adam_state
            assert int(adam.count) == 0 and all(not np.any(x) for x in leaves(adam.mu))
        else:
            assert all(np.array_equal(a, b) for a, b in zip(ref, leaves(before_ref)))
            if u > 1:  # (update 1 runs at lr 0: the end of warmup)
                assert not all(np.array_equal(a, b) for a, b in zip(params, ref))
        if u == 1:
            assert all(np.array_equal(a, b) for a, b in zip(ref, leaves(initial)))
    # β and lr inside the step follow the schedules of the update number
    assert seen_beta == pytest.approx([float(beta_at(FULL_CONFIG.beta, u)) for u in range(1, 6)])
    assert seen_lr == pytest.approx([float(learning_rate(FULL_CONFIG.optimizer.lr, s)) for s in range(5)])
    assert seen_lr[0] == 0.0 and seen_beta[0] == pytest.approx(0.5)


# ----------------------------------------------------------------------------- NaN guard


def test_nan_reward_raises_naming_update_and_group(single_device_run):
    _, step = compiled_step(ACCUM_CONFIG)
    state, _ = run(ACCUM_CONFIG, [0])
    before = host(state)
    batch = make_batch(1)
    reward = batch.reward.copy()
    reward[2] = np.nan  # row 2 belongs to group id 1
    state, out = step(state, dataclasses.replace(batch, reward=reward))
    with pytest.raises(NonFiniteLossError, match="update 2") as err:
        raise_on_bad_step(out, 2)
    assert err.value.update == 2 and err.value.group_ids == [1]
    assert all(np.array_equal(a, b) for a, b in zip(leaves(state), leaves(before)))


def test_nan_logits_raise_and_leave_params_unchanged():
    """An inf embedding row makes the logits of the rows holding that token NaN."""
    _, step = compiled_step(ACCUM_CONFIG)
    _, state = init_train_state(fresh_model(), ACCUM_CONFIG)
    state.params["embed_tokens"][...] = state.params["embed_tokens"][...].at[63].set(jnp.inf)
    before = host(state)
    batch = make_batch(0)
    tokens = batch.tokens.copy()
    tokens[4, 1] = 63  # row 4: group id 7
    state, out = step(state, dataclasses.replace(batch, tokens=tokens))
    with pytest.raises(NonFiniteLossError, match="update 1") as err:
        raise_on_bad_step(out, 1)
    assert err.value.group_ids == [7]
    assert int(state.step) == 0
    assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(leaves(state), leaves(before)))


@pytest.mark.parametrize(
    "objective,overrides,compute_reference,forwards",
    [
        ("tb", {}, True, 2),
        ("dr_grpo", {}, True, 1),  # never reads the reference: no reference forward
        ("grpo", {}, True, 1),
        ("grpo", {"kl_penalty": True}, True, 2),
        ("tb", {}, False, 1),  # reference log-probs come with the batch
    ],
)
def test_reference_forward_only_when_the_objective_reads_it(
    monkeypatch, objective, overrides, compute_reference, forwards
):
    """Counts model forwards in the traced step (eval_shape: traced, never compiled)."""
    import tbajax.training.loss as loss_module

    calls = []
    real = loss_module._score  # every forward of the loss: the policy's, and the reference's

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(loss_module, "_score", counted)
    config = dataclasses.replace(ACCUM_CONFIG, compute_reference_logprobs=compute_reference)
    graphdef, state = init_train_state(fresh_model(), config)
    spec, objective_config = resolve_objective(objective, overrides=overrides)
    step = functools.partial(train_step, graphdef=graphdef, objective=spec,
                             objective_config=objective_config, config=config)
    _, out = jax.eval_shape(step, state, make_batch(0))
    assert len(calls) == forwards
    assert ("kl" in out.metrics) == (forwards == 2 or not compute_reference)
    assert loss_module.scores_reference(spec, objective_config, config) == (forwards == 2)


@pytest.fixture(scope="module")
def tb_updater():
    """One PolicyUpdater (one compilation) for the tests below; each starts from a fresh state."""
    updater = PolicyUpdater(fresh_model(), ACCUM_CONFIG, "tb", compiler_options=FAST_COMPILE)
    fresh = host(updater.state)
    return updater, lambda: jax.tree.map(jnp.asarray, fresh)


def test_trainer_with_registered_tb_matches_hand_written(single_device_run, tb_updater):
    trainer, fresh = tb_updater
    trainer.state = fresh()
    for u, seed in enumerate([0, 1], 1):
        m = trainer.step(make_batch(seed))
        assert m["loss"] == pytest.approx(single_device_run[1][u - 1]["loss"], rel=1e-5)
        assert m["grad_norm"] == pytest.approx(single_device_run[1][u - 1]["grad_norm"], rel=1e-5)
    assert trainer.updates_applied == 2
    assert trainer.state.aux is None and trainer.state.aux_opt_state is None
    assert "aux_grad_norm" not in m
    assert_trees_close(trainer.state.params, single_device_run[0].params)
    with pytest.raises(ValueError, match="num_microbatches=3"):
        three = dataclasses.replace(ACCUM_CONFIG, num_microbatches=3)
        PolicyUpdater(fresh_model(), three, "tb").step(make_batch(0))


def test_pipelined_submit_matches_step_and_reports_a_refused_update_one_late(single_device_run, tb_updater):
    updater, fresh = tb_updater
    updater.state = fresh()
    assert updater.submit(make_batch(0)) is None  # nothing checked yet: update 1 is in flight
    first = updater.submit(make_batch(1))  # update 1's metrics, while update 2 runs
    second = updater.flush()
    want_state, want = single_device_run
    assert first["loss"] == pytest.approx(want[0]["loss"], rel=1e-5)
    assert second["grad_norm"] == pytest.approx(want[1]["grad_norm"], rel=1e-5)
    assert_trees_close(updater.state.params, want_state.params)
    assert updater.flush() is None

    reward = make_batch(1).reward.copy()
    reward[2] = np.nan  # group id 1
    assert updater.submit(dataclasses.replace(make_batch(1), reward=reward)) is None
    before = host(updater.state.params)  # the refused update changed nothing
    with pytest.raises(NonFiniteLossError, match="update 3") as err:
        updater.submit(make_batch(0))
    assert err.value.group_ids == [1]
    after = updater.flush()  # the batch after the refused one went in, as update 3
    assert np.isfinite(after["loss"]) and updater.updates_applied == 3
    assert any(not np.array_equal(a, b) for a, b in zip(leaves(updater.state.params), leaves(before)))
    updater.submit(make_batch(0))
    with pytest.raises(RuntimeError, match="flush"):
        updater.step(make_batch(1))
    updater.flush()
    assert updater.updates_applied == 4


# ----------------------------------------------------------------------------- learned log Z

# aux lr = 1e-8 x 1e7 = 0.1 for 20 updates, then cosine to 0 over 20; the policy moves by
# ~1e-8 per weight and update, so S − R stays ~0 and each log Z target stays put. Short Adam
# memories (b1 0.5, b2 0.9): with the defaults log Z overshoots and comes back slowly
LOGZ_CONFIG = TrainerConfig(
    optimizer=OptimizerConfig(
        lr=LRSchedule("wsd", peak=1e-8, stable_steps=20, decay_steps=20), b1=0.5, b2=0.9,
        max_grad_norm=1.0,
    ),
    compute_dtype="float32",
    aux_table_size=12,
)
LOGZ_STEPS, LOGZ_SAVE_AT, LOGZ_INIT = 40, 38, 0.5
# β = 0.5; rows by group 5, 5 | 1, 1 | 7, 7 | 3 | padding, prompts 2, 2 | 9, 9 | 2, 2 | 4 | 0
LOGZ_REWARD = np.array([1, 1, 0, 1, 1, 0, 1, 0], np.float32)
LOGZ_TARGET = {2: 1.5, 9: 1.0, 4: 2.0}  # −mean(S − R − r/β) per prompt with S = R: mean r / β


def logz_batch() -> Batch:
    return dataclasses.replace(make_batch(0), reward=LOGZ_REWARD)


@pytest.fixture(scope="module")
def logz_run(tmp_path_factory):
    """tb_learned_logz through PolicyUpdater on one fixed batch; the table after every update, and a
    checkpoint at update LOGZ_SAVE_AT."""
    from tbajax.objectives import LearnedLogZConfig

    objective_config = LearnedLogZConfig(aux_lr_scale=1e7, init_log_z=LOGZ_INIT)
    trainer = PolicyUpdater(fresh_model(), LOGZ_CONFIG, "tb_learned_logz", objective_config,
                      compiler_options=FAST_COMPILE)
    # committed to a device like a restored state, so the resume test reuses this compilation
    trainer.state = jax.device_put(trainer.state, jax.devices()[0])
    ckpt = Checkpointer(tmp_path_factory.mktemp("logz") / "ckpt", max_to_keep=None)
    batch = logz_batch()
    tables, metrics = [np.array(trainer.state.aux["log_z"])], []
    for u in range(1, LOGZ_STEPS + 1):
        metrics.append(trainer.step(batch))
        tables.append(np.array(trainer.state.aux["log_z"]))
        if u == 1:
            first_count = np.array(trainer.state.aux_opt_state.count)
        if u == LOGZ_SAVE_AT:
            ckpt.save(trainer.state)
    ckpt.wait()
    yield trainer, objective_config, ckpt, np.stack(tables), metrics, first_count
    ckpt.close()


def test_learned_logz_one_step_moves_only_the_batch_prompts(logz_run):
    """Update 1 by hand: S = R (the reference is the initial policy), so δ = −r/β ∈ {0, −2} and
    log Z + δ ∈ {0.5, −1.5}; the loss is the mean over 4 groups of mean (log Z + δ)²:
    (2.25 + 1.25 + 1.25 + 2.25)/4 = 1.75, and ∂/∂log Z_p = (1/4) Σ_{groups of p} 2 (log Z + δ̄)
    = −1.0, −0.25, −0.75 for prompts 2, 9, 4. Adam's first step is lr · g/(|g| + eps): each
    of those rows moves up by the aux lr, 0.1; no other row moves."""
    _, _, _, tables, metrics, count = logz_run
    touched = np.isin(np.arange(12), [2, 4, 9])
    grads = {2: -1.0, 9: -0.25, 4: -0.75}
    m = metrics[0]
    assert m["loss"] == pytest.approx(1.75, rel=1e-5)
    assert m["aux_grad_norm"] == pytest.approx(math.sqrt(sum(g * g for g in grads.values())), rel=1e-5)
    assert m["log_z"] == pytest.approx(LOGZ_INIT) and m["log_z_gap"] == pytest.approx(-1.0, rel=1e-5)
    assert m["lr"] == pytest.approx(1e-8)
    assert np.all(tables[0] == LOGZ_INIT)
    for p, g in grads.items():
        # (rel 1e-5: Adam's bias correction 1 − b2 loses digits in float32, in optax too)
        assert tables[1][p] - LOGZ_INIT == pytest.approx(0.1 * abs(g) / (abs(g) + 1e-8), rel=1e-5)
    assert np.all(tables[1][~touched] == LOGZ_INIT)  # prompt 0 too: the padding row's id
    assert count.tolist() == touched.astype(int).tolist()
    # rows outside the batch never move, not even on momentum, over the whole run
    assert np.all(tables[:, ~touched] == LOGZ_INIT)


def test_learned_logz_converges_to_the_vargrad_estimate(logz_run):
    trainer, _, _, tables, metrics, _ = logz_run
    # the policy stayed at the reference (S − R ≈ 0), so the targets are mean r / β
    assert max(abs(m["kl"]) for m in metrics) < 1e-3
    for p, target in LOGZ_TARGET.items():
        gaps = np.abs(tables[:, p] - target)
        first = round(abs(target - LOGZ_INIT) / 0.1)  # updates to get there at lr 0.1
        assert np.all(np.diff(gaps[:first]) < 0)  # straight toward it at first
        assert gaps[-1] < 3e-3, (p, tables[-5:, p], target)
    # the step's own gap, against the exact −δ̄ of the current policy
    assert abs(metrics[-1]["log_z_gap"]) < 2e-3
    assert np.asarray(trainer.state.aux_opt_state.count)[[2, 4, 9]].tolist() == [LOGZ_STEPS] * 3


def test_learned_logz_checkpoint_resume_is_bit_exact(logz_run):
    trainer, objective_config, ckpt, tables, _, _ = logz_run
    want = host(trainer.state)
    assert int(want.step) == LOGZ_STEPS
    abstract_model = nnx.eval_shape(lambda: CausalLM(MODEL, rngs=nnx.Rngs(0)))
    aux = jax.eval_shape(lambda: initial_aux("tb_learned_logz", objective_config, LOGZ_CONFIG))
    _, target = abstract_train_state(abstract_model, LOGZ_CONFIG, aux=aux)
    restored, _ = ckpt.restore(target, step=LOGZ_SAVE_AT)
    assert np.array_equal(np.asarray(restored.aux["log_z"]), tables[LOGZ_SAVE_AT])
    assert np.asarray(restored.aux_opt_state.count)[2] == LOGZ_SAVE_AT
    trainer.state = restored
    for _ in range(LOGZ_STEPS - LOGZ_SAVE_AT):
        trainer.step(logz_batch())
    got = leaves(trainer.state)
    assert len(got) == len(leaves(want))
    assert all(np.array_equal(a, b) for a, b in zip(got, leaves(want)))


def test_learned_logz_bad_prompt_ids_and_table_size_error_clearly(logz_run):
    trainer = logz_run[0]
    before = trainer.updates_applied
    for bad_id in (12, -1):
        pid = PROMPT_IDS.copy()
        pid[3] = bad_id
        with pytest.raises(ValueError, match=r"outside the aux table \[0, 12\).*aux_table_size"):
            trainer.step(dataclasses.replace(logz_batch(), prompt_id=pid))
    assert trainer.updates_applied == before
    with pytest.raises(ValueError, match="aux_table_size"):
        PolicyUpdater(fresh_model(), dataclasses.replace(LOGZ_CONFIG, aux_table_size=0), "tb_learned_logz")


def test_aux_adam_matches_optax_adam_row_by_row():
    """Each row is its own Adam stepping only when touched; the others keep their moments."""
    config = OptimizerConfig(b1=0.8, b2=0.9, eps=1e-3)
    rng = np.random.default_rng(0)
    touched = np.array([[1, 0, 1], [0, 0, 1], [1, 0, 1]], bool)  # 3 updates x 3 rows
    grads = rng.normal(size=(3, 3, 2)).astype(np.float32)  # a leaf [N=3, 2]
    aux = {"w": jnp.zeros((3, 2))}
    state = init_aux_opt_state(aux)
    ours = jax.jit(functools.partial(aux_adam_update, config=config))
    adam = optax.scale_by_adam(b1=0.8, b2=0.9, eps=1e-3)
    theirs = jax.jit(adam.update)
    row_states = [adam.init(jnp.zeros(2)) for _ in range(3)]
    for u in range(3):
        upd, state = ours({"w": jnp.asarray(grads[u])}, state, jnp.asarray(touched[u]))
        for r in range(3):
            if touched[u, r]:
                want, row_states[r] = theirs(jnp.asarray(grads[u, r]), row_states[r])
                np.testing.assert_allclose(upd["w"][r], want, rtol=1e-6)
            else:
                assert np.all(np.asarray(upd["w"][r]) == 0)
    assert np.asarray(state.count).tolist() == [2, 0, 3]
    assert np.all(np.asarray(state.mu["w"][1]) == 0)
    hits = aux_rows_touched(jnp.array([4, 1, 1, 0]), jnp.array([True, True, True, False]), 5)
    assert np.asarray(hits).tolist() == [False, True, False, False, True]  # padding's id 0: no


def test_collate_fills_prompt_id():
    from tbajax.training.collate import collate
    from tbajax.trajectory import Trajectory

    def traj(pid):
        return Trajectory(prompt_id=pid, group_id=0, prompt_tokens=np.array([5, 6]),
                          response_tokens=np.array([7]), behavior_logprobs=np.array([-1.0]), reward=1.0)

    batch = collate([[traj(1_000_000)] * 2, [traj(3)] * 2], beta=0.1, num_rows=6)
    assert batch.prompt_id.dtype == np.int32
    assert batch.prompt_id.tolist() == [1_000_000, 1_000_000, 3, 3, 0, 0]
    with pytest.raises(ValueError, match="does not fit in int32"):
        collate([[traj(2**31)]], beta=0.1)


# ----------------------------------------------------------------------------- checkpoints


def test_checkpoint_resume_in_fresh_process_is_bit_exact(tmp_path):
    _, step = compiled_step(FULL_CONFIG)
    _, state = init_train_state(fresh_model(), FULL_CONFIG)
    ckpt = Checkpointer(tmp_path / "ckpt", max_to_keep=3)
    saved = {}
    for u in range(1, 5):
        state, out = step(state, make_batch(10 + u))
        raise_on_bad_step(out, u)
        saved[u] = host(state)
        # async save, then the next step donates `state` right away
        ckpt.save(state, extra={"buffer_cursor": 100 * u, "note": "tbajax"})
    ckpt.wait()
    assert ckpt.all_steps() == [2, 3, 4]  # keep-last-N

    restored, extra = ckpt.restore(state, step=2)
    assert extra == {"buffer_cursor": 200, "note": "tbajax"}
    assert all(np.array_equal(a, b) for a, b in zip(leaves(restored), leaves(saved[2])))
    # restore straight into another layout: a 2x2x2 mesh
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    _, target = abstract_train_state(fresh_model(), FULL_CONFIG, mesh)
    resharded, _ = ckpt.restore(target)  # the newest: step 4
    assert int(resharded.step) == 4
    assert tuple(resharded.params["layers"]["q_proj"][...].sharding.spec) == (None, "fsdp", "tensor", None)
    assert tuple(resharded.adam_state.mu["layers"]["q_proj"][...].sharding.spec) == (
        None, "fsdp", "tensor", None)
    assert all(np.array_equal(a, b) for a, b in zip(leaves(resharded), leaves(saved[4])))
    ckpt.close()

    out_file = tmp_path / "resumed.npz"
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "resume", str(tmp_path / "ckpt"), "2", str(out_file)],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = np.load(out_file)
    want = leaves(saved[4])
    assert len(resumed.files) == len(want)
    for i, w in enumerate(want):
        assert np.array_equal(resumed[f"leaf{i}"], w), f"leaf {i} differs after resume"


def _resume_main(ckpt_dir: str, from_step: int, out_file: str) -> None:
    abstract_model = nnx.eval_shape(lambda: CausalLM(MODEL, rngs=nnx.Rngs(0)))
    _, target = abstract_train_state(abstract_model, FULL_CONFIG)  # nothing materialised
    with Checkpointer(ckpt_dir) as ckpt:
        state, extra = ckpt.restore(target, step=from_step)
    assert extra["buffer_cursor"] == 100 * from_step
    state, _ = run(FULL_CONFIG, [10 + u for u in range(from_step + 1, from_step + 3)], state=state)
    np.savez(out_file, **{f"leaf{i}": x for i, x in enumerate(leaves(state))})


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "resume":
        _resume_main(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        sys.exit("usage: test_training.py resume CKPT_DIR STEP OUT.npz")


# ----------------------------------------------------------------------------- packed groups


def grouped_trajectories(seed: int) -> list[list[Trajectory]]:
    """Groups whose rows share their prompt (as in a real buffer): 3 + 1 rows, then 3 rows, so that
    two micro-batches of 4 rows each hold whole groups; prompts 2-6 and responses 1-7 tokens long."""
    r = np.random.default_rng(seed)
    groups = []
    for size in (3, 1, 3):
        prompt = r.integers(3, MODEL.vocab_size - 1, int(r.integers(2, 7))).astype(np.int32)
        rows = []
        for _ in range(size):
            resp = r.integers(3, MODEL.vocab_size - 1, int(r.integers(1, 8))).astype(np.int32)
            rows.append(Trajectory(
                prompt_id=int(r.integers(0, 10)), group_id=len(groups), prompt_tokens=prompt,
                response_tokens=resp, behavior_logprobs=-r.random(len(resp)).astype(np.float32),
                reward=float(r.integers(0, 2)), finished=bool(r.integers(0, 2)),
            ))
        groups.append(rows)
    return groups


def grouped_batch(seed: int, pack_microbatches: int | None, strided: bool = False) -> Batch:
    return collate(grouped_trajectories(seed), beta=0.5, num_rows=8, length_bucket=8,
                   pack_microbatches=pack_microbatches, pack_strided=strided)


def test_packed_attention_mask_hand_values():
    # prompt of 2, response 1 of 2 tokens, response 2 of 1 token, one padding slot
    mask = np.asarray(packed_attention_mask(jnp.array([[0, 0, 1, 1, 2, -1]])))[0].astype(int)
    np.testing.assert_array_equal(mask, [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],  # response 2 sees the prompt and itself, not response 1
        [1, 1, 0, 0, 0, 0],  # padding sees the prompt (a non-empty softmax), and nothing reads it
    ])


def test_pack_groups_layout_hand_values():
    prompt, a, b = np.array([7, 8], np.int32), np.array([9, 10], np.int32), np.array([11], np.int32)
    rows = [Trajectory(0, 0, prompt, x, np.zeros(len(x), np.float32), 0.0) for x in (a, b)]
    batch = collate([rows], beta=1.0, num_rows=2, length_bucket=1, pack_microbatches=1)
    pk = batch.packed
    np.testing.assert_array_equal(pk.tokens, [[7, 8, 9, 10, 11]])
    np.testing.assert_array_equal(pk.positions, [[0, 1, 2, 3, 2]])
    np.testing.assert_array_equal(pk.segments, [[0, 0, 1, 1, 2]])
    # the response slots, only these are scored (3 of them, rounded up to 4: padded with slot 0)
    np.testing.assert_array_equal(pk.scored, [[2, 3, 4, 0]])
    np.testing.assert_array_equal(pk.previous, [[1, 2, 1, 0]])  # both responses start after slot 1
    np.testing.assert_array_equal(pk.source[0, 2:4], [0, 1])  # indices into the scored slots
    np.testing.assert_array_equal(pk.source[1, 2:3], [2])


def test_strided_pack_layout_hand_values():
    """Prompt in the first P slots, response j from slot P + j R (P = 2 and R = 2 here, the
    longest of each with length buckets of 1); the masks of real slots; the same scored slots,
    predecessors and sources as the packed layout's, at the strided slots."""
    prompt, a, b = np.array([7, 8], np.int32), np.array([9, 10], np.int32), np.array([11], np.int32)
    rows = [Trajectory(0, 0, prompt, x, np.zeros(len(x), np.float32), 0.0) for x in (a, b)]
    pk = collate([rows], beta=1.0, num_rows=2, length_bucket=1, pack_microbatches=1, pack_strided=True).packed
    np.testing.assert_array_equal(pk.tokens, [[7, 8, 9, 10, 11, 0]])
    np.testing.assert_array_equal(pk.positions, [[0, 1, 2, 3, 2, 0]])
    np.testing.assert_array_equal(pk.segments, [[0, 0, 1, 1, 2, -1]])
    np.testing.assert_array_equal(pk.prompt_real, [[True, True]])
    np.testing.assert_array_equal(pk.response_real, [[[True, True], [True, False]]])
    np.testing.assert_array_equal(pk.scored, [[2, 3, 4, 0]])
    np.testing.assert_array_equal(pk.previous, [[1, 2, 1, 0]])
    np.testing.assert_array_equal(pk.source[0, 2:4], [0, 1])
    np.testing.assert_array_equal(pk.source[1, 2:3], [2])
    with pytest.raises(ValueError, match="pack_groups=True"):
        dataclasses.replace(ACCUM_CONFIG, pack_strided=True)


def test_packed_scored_widths_add_few_compiled_shapes():
    """TL;DR-shaped packed batches (8 groups of K = 20, posts of 200-512 tokens, summaries of
    16-128, length buckets of 64): about half as many (width, scored width) pairs to compile as
    scored widths rounded to the length buckets would give."""
    from tbajax.training.collate import pack_groups

    r = np.random.default_rng(0)
    widths, pairs, by_bucket = set(), set(), set()
    for _ in range(60):
        p, n = r.integers(200, 512, 8), r.integers(16, 128, (8, 20))
        seq = int((p[:, None] + n).max())
        slot = np.arange(seq)
        prompt_len = np.repeat(p, 20)
        mask = slot < (prompt_len + n.reshape(-1))[:, None]
        gid = np.repeat(np.arange(8), 20)
        tokens = np.where(mask, 3, 0).astype(np.int32)
        pk = pack_groups(tokens, prompt_len, mask, gid, np.ones(160, bool), 8, length_bucket=64)
        widths.add(pk.tokens.shape[1])
        pairs.add((pk.tokens.shape[1], pk.scored.shape[1]))
        by_bucket.add((pk.tokens.shape[1], -(-int(n.sum(1).max()) // 64) * 64))
    assert len(pairs) <= 0.6 * len(by_bucket), (len(widths), len(pairs), len(by_bucket))


@pytest.mark.parametrize("strided", [False, True], ids=["packed", "strided"])
def test_packed_logprobs_equal_the_row_layout(strided):
    graphdef, params = _model_parts()
    # jitted: eager dispatch of the model's ops (compiled per new shape) took 5x longer
    score = jax.jit(sequence_logprobs, static_argnums=(0, 3), compiler_options=FAST_COMPILE)
    for seed in range(3):
        rows, packed = grouped_batch(seed, None), grouped_batch(seed, 1, strided)
        assert (packed.packed.prompt_real is not None) == strided
        want = np.asarray(score(graphdef, params, rows, 0.7))
        got = np.asarray(score(graphdef, params, packed, 0.7))
        assert packed.packed.tokens.size < rows.tokens.size  # really fewer tokens scored
        np.testing.assert_allclose(np.where(rows.loss_mask, got, 0), np.where(rows.loss_mask, want, 0),
                                   atol=1e-5, rtol=1e-5)
        assert (got[~rows.loss_mask] == 0).all()


def _random_groups(seed: int, prompt_lengths: tuple[int, ...], response_lengths: tuple[int, ...]
                   ) -> list[list[Trajectory]]:
    """A group of random responses of `response_lengths` for each random prompt of `prompt_lengths`."""
    r = np.random.default_rng(seed)
    groups = []
    for g, length in enumerate(prompt_lengths):
        prompt = r.integers(3, MODEL.vocab_size - 1, length).astype(np.int32)
        groups.append([Trajectory(g, g, prompt, r.integers(3, MODEL.vocab_size - 1, n).astype(np.int32),
                                  np.zeros(n, np.float32), 0.0) for n in response_lengths])
    return groups


def test_strided_logprobs_equal_the_row_layout_over_causal_blocks():
    """Strided groups whose responses take 64 slots: each response's attention runs in 2 causal
    query blocks over the prompt's keys and its own (`layers.causal_blocks(64)`)."""
    from tbajax.models.layers import causal_blocks

    graphdef, params = _model_parts()
    groups = _random_groups(6, (20, 25), (64, 40, 57))
    rows, strided = (collate(groups, beta=0.5, pack_microbatches=m, pack_strided=m is not None)
                     for m in (None, 1))
    assert strided.packed.response_real.shape == (2, 3, 64) and causal_blocks(64) == 2
    score = jax.jit(sequence_logprobs, static_argnums=(0, 3), compiler_options=FAST_COMPILE)
    want = np.asarray(score(graphdef, params, rows, 0.7))
    got = np.asarray(score(graphdef, params, strided, 0.7))
    np.testing.assert_allclose(np.where(rows.loss_mask, got, 0), np.where(rows.loss_mask, want, 0),
                               atol=1e-5, rtol=1e-5)


# GPT-OSS: the window on its first layer, attention sinks in every layout, biased experts
GPT_OSS = dict(model_type="gpt_oss", sliding_window=8, layer_types=("sliding_attention", "full_attention"),
               qkv_bias=True, o_bias=True, num_experts=4, num_experts_per_tok=2, expert_intermediate_size=16,
               attention_sinks=True, swiglu_limit=7.0)


@pytest.mark.parametrize("model", [dict(model_type="mistral", sliding_window=8), GPT_OSS],
                         ids=["mistral", "gpt_oss"])
def test_a_sliding_window_scores_alike_in_every_layout(model):
    """A Mistral-style window of 8 positions over prompts of 12-17 and responses of up to 20
    tokens: packed and strided rows window by each sequence's own positions, as its plain row
    does (which matches transformers, `test_models.py`); without the window the log-probs differ."""
    windowed = dataclasses.replace(MODEL, **model)
    graphdef, params = numpy_model_parts(windowed)
    groups = _random_groups(8, (12, 17), (20, 6, 13))
    rows, packed, strided = (collate(groups, beta=0.5, pack_microbatches=m, pack_strided=s)
                             for m, s in ((None, False), (1, False), (1, True)))
    score = jax.jit(sequence_logprobs, static_argnums=(0, 3), compiler_options=FAST_COMPILE)
    want = np.where(rows.loss_mask, np.asarray(score(graphdef, params, rows, 0.7)), 0)
    for batch in (packed, strided):
        got = np.where(rows.loss_mask, np.asarray(score(graphdef, params, batch, 0.7)), 0)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    unwindowed = nnx.graphdef(CausalLM(dataclasses.replace(windowed, sliding_window=None, layer_types=None),
                                       rngs=nnx.Rngs(0)))
    other = np.where(rows.loss_mask, np.asarray(score(unwindowed, params, rows, 0.7)), 0)
    assert np.abs(other - want).max() > 1e-3


@pytest.mark.parametrize("blocks_from", [0, 10**6], ids=["causal-blocks", "whole-rows"])
def test_packed_logprobs_equal_the_row_layout_over_causal_blocks(blocks_from, monkeypatch):
    """Packed rows of 128 slots, their attention in `layers.causal_blocks` (4) query blocks that
    skip the blocks above the diagonal (the packed mask as a CausalMask) or over whole rows."""
    from tbajax.models import decoder
    from tbajax.models.layers import causal_blocks

    monkeypatch.setattr(decoder, "PACKED_CAUSAL_BLOCKS_MIN", blocks_from)

    graphdef, params = _model_parts()
    groups = _random_groups(5, (40, 40), (20, 30, 25))
    rows, packed = (collate(groups, beta=0.5, pack_microbatches=m) for m in (None, 1))
    assert packed.packed.tokens.shape == (2, 128) and causal_blocks(128) == 4
    score = jax.jit(sequence_logprobs, static_argnums=(0, 3), compiler_options=FAST_COMPILE)
    want = np.asarray(score(graphdef, params, rows, 0.7))
    got = np.asarray(score(graphdef, params, packed, 0.7))
    np.testing.assert_allclose(np.where(rows.loss_mask, got, 0), np.where(rows.loss_mask, want, 0),
                               atol=1e-5, rtol=1e-5)


# "data-parallel" also splits into two micro-batches; the single-device two-micro-batch case is slow
@pytest.mark.parametrize("num_microbatches,mesh_config",
                         [(1, None), pytest.param(2, None, marks=pytest.mark.slow),
                          (2, MeshConfig(data=2, fsdp=2, tensor=2))],
                         ids=["one", "two-microbatches", "data-parallel"])
def test_packed_step_equals_row_layout_step(num_microbatches, mesh_config):
    """The row layout, packed groups and strided groups: the same metrics and params after two
    steps (one step program per layout). Under the mesh also pack_groups="auto": one step function
    that takes a strided batch, then a packed one (a program per layout, each with its own batch
    shardings; without a mesh it is a plain jit, which the sync CLI run of `test_system.py`
    takes with pack_groups=auto)."""
    base = dataclasses.replace(ACCUM_CONFIG, num_microbatches=num_microbatches)
    results = []
    m = num_microbatches
    arms = [(False, [(None, False)] * 2), (True, [(m, False)] * 2), (True, [(m, True)] * 2)]
    if mesh_config is not None:
        arms.append(("auto", [(m, True), (m, False)]))
    for pack, layouts in arms:
        config = dataclasses.replace(base, pack_groups=pack, pack_strided=pack is True and layouts[0][1])
        mesh, step = compiled_step(config, mesh_config)
        _, state = init_train_state(fresh_model(), config, mesh)
        metrics = []
        for u, (seed, (pack_microbatches, strided)) in enumerate(zip([0, 1], layouts), 1):
            state, out = step(state, grouped_batch(seed, pack_microbatches, strided))
            metrics.append(raise_on_bad_step(out, u))
        results.append((state, metrics))
    (want_state, want), *others = results
    for got_state, got in others:
        assert_metrics_close(got, want)
        # two Adam steps: Adam's normalisation turns fp32 reduction-order noise in near-zero
        # gradients (packed and row attention sum in different orders) into ~1e-5 parameter differences
        # (one of 2,048 reached 3.8e-5 on an AMD EPYC, two micro-batches, at this test's old 3e-5)
        assert_trees_close(got_state.params, want_state.params, atol=5e-5)


def test_packing_refuses_mixed_prompts_and_mismatched_config():
    groups = grouped_trajectories(0)
    groups[0][1] = dataclasses.replace(groups[0][1], prompt_tokens=groups[0][1].prompt_tokens + 1)
    with pytest.raises(ValueError, match="share group 0 but not their prompt"):
        collate(groups, beta=0.5, pack_microbatches=1)
    trainer = PolicyUpdater(fresh_model(), dataclasses.replace(ACCUM_CONFIG, pack_groups=True), vargrad_tb)
    with pytest.raises(ValueError, match="pack_microbatches=1"):
        trainer.step(grouped_batch(0, None))
    with pytest.raises(ValueError, match="pack_strided=False"):
        trainer.step(grouped_batch(0, 1, strided=True))


# ----------------------------------------------------------------------------- scored windows


def test_scored_windows_hand_values():
    loss = np.array([[0, 0, 1, 1, 0, 0],
                     [0, 1, 1, 1, 1, 0],
                     [0, 0, 0, 0, 0, 0],  # nothing scored (a padding row): the window at slot 1
                     [1, 1, 0, 0, 0, 0]], bool)  # slot 0 has no predecessor: the window starts at 1
    np.testing.assert_array_equal(scored_windows(loss, 1),
                                  [[2, 3, 4, 5], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    # rounded up to at least 8, capped at seq - 1 = 5; past a row's end its last slot repeats
    np.testing.assert_array_equal(scored_windows(loss, 8)[:2], [[2, 3, 4, 5, 5], [1, 2, 3, 4, 5]])
    wide = np.zeros((1, 400), bool)
    wide[0, 100:300] = True  # a span of 200: a width of 224 (1.75 x 128)
    assert scored_windows(wide).shape == (1, 224)
    trajectories = [Trajectory(0, 0, np.array([7, 8, 9], np.int32), np.array(x, np.int32),
                               np.zeros(len(x), np.float32), 0.0) for x in ([4, 5], [6])]
    batch = collate([trajectories], beta=1.0, length_bucket=1)
    np.testing.assert_array_equal(batch.scored, [[3, 4, 4, 4], [3, 4, 4, 4]])  # width 16, capped at 4
    assert collate([trajectories], beta=1.0, length_bucket=1, pack_microbatches=1).scored is None


def test_scored_window_widths_add_few_compiled_shapes():
    """Over MATH-like batches (prompts of 80-600 tokens, responses of 100-3072) the (row length,
    window width) pairs that a run compiles are about as many as the row lengths alone; widths
    rounded to the rows' 32-token length buckets would make several times as many."""
    r = np.random.default_rng(0)
    lengths, pairs, by_32 = set(), set(), set()
    for _ in range(200):
        p, n = r.integers(80, 600, 64), r.integers(100, 3072, 64)
        seq = -(-int((p + n).max()) // 32) * 32
        slot = np.arange(seq)
        loss = (slot >= p[:, None]) & (slot < (p + n)[:, None])
        lengths.add(seq)
        pairs.add((seq, scored_windows(loss).shape[1]))
        by_32.add((seq, min(-(-int(n.max()) // 32) * 32, seq - 1)))
    counts = (len(lengths), len(pairs), len(by_32))
    assert len(pairs) <= 1.2 * len(lengths) and len(by_32) >= 2.5 * len(lengths), counts


def long_prompt_batch(seed: int) -> Batch:
    """make_batch with the loss on slots >= 10 only: a long prompt, a short response."""
    b = make_batch(seed)
    loss = b.loss_mask & (np.arange(16) >= 10)
    return dataclasses.replace(b, loss_mask=loss, behavior_logprobs=np.where(loss, b.behavior_logprobs, 0))


def test_windowed_logprobs_equal_every_positions_on_the_loss_tokens():
    graphdef, params = _model_parts()
    score = jax.jit(sequence_logprobs, static_argnums=(0, 3), compiler_options=FAST_COMPILE)
    for seed in range(3):
        full = long_prompt_batch(seed)
        windowed = dataclasses.replace(full, scored=scored_windows(full.loss_mask, 4))
        want = np.asarray(score(graphdef, params, full, 0.7))
        got = np.asarray(score(graphdef, params, windowed, 0.7))
        np.testing.assert_allclose(np.where(full.loss_mask, got, 0), np.where(full.loss_mask, want, 0),
                                   rtol=1e-6, atol=1e-6)
        assert (got[~full.loss_mask] == 0).all()


def test_windowed_head_projects_only_the_window():
    """The vocabulary-sized products of the windowed forward and backward cover [rows, S] (S = 6:
    slots 10..15), not every [rows, 16] position (what the row layout computed before)."""
    cfg = dataclasses.replace(MODEL, vocab_size=80)  # unlike any other dimension of the model
    graphdef, params = nnx.split(jax.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0))))
    batch = long_prompt_batch(0)
    batch = dataclasses.replace(batch, scored=scored_windows(batch.loss_mask, 1))
    assert batch.scored.shape == (8, 6)
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: sequence_logprobs(graphdef, p, batch, 0.7).sum()))(params)
    vocab_dots = [e for e in _all_eqns(jaxpr.jaxpr)
                  if e.primitive.name == "dot_general" and 80 in e.outvars[0].aval.shape]
    shapes = [e.outvars[0].aval.shape for e in vocab_dots]
    assert vocab_dots and all(shape in ((8, 6, 80), (32, 80)) for shape in shapes), shapes
    operands = [v.aval.shape for e in vocab_dots for v in e.invars]  # the head gradient: [32, 48] @ [48, 80]
    assert all(16 not in shape and 8 * 16 not in shape for shape in operands), operands


def _all_eqns(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for v in e.params.values():  # the sub-programs of custom_vjp, jit, cond, scan ...
            inner = getattr(v, "jaxpr", None)
            if inner is not None:
                yield from _all_eqns(getattr(inner, "jaxpr", inner))


def test_windowed_step_equals_the_step_over_every_position(single_device_run):
    mesh, step = compiled_step(ACCUM_CONFIG)
    _, state = init_train_state(fresh_model(), ACCUM_CONFIG, mesh)
    metrics = []
    for u, seed in enumerate([0, 1], 1):
        batch = make_batch(seed)
        state, out = step(state, dataclasses.replace(batch, scored=scored_windows(batch.loss_mask, 4)))
        metrics.append(raise_on_bad_step(out, u))
    want_state, want = single_device_run
    assert_metrics_close(metrics, want)
    assert_trees_close(state.params, want_state.params, atol=3e-5)


def test_a_window_missing_loss_tokens_is_refused():
    from tbajax.objectives import validate_batch

    batch = make_batch(0)
    narrow = scored_windows(batch.loss_mask, 1)[:, :3]
    with pytest.raises(ValueError, match="outside the scored window in rows"):
        validate_batch(dataclasses.replace(batch, scored=narrow))
    with pytest.raises(ValueError, match="consecutive slots from slot >= 1"):
        validate_batch(dataclasses.replace(batch, scored=np.tile(np.arange(15, dtype=np.int32), (8, 1))))


# --------------------------------------------------------------------------- learned log Z head


def test_prompt_features_are_the_pooled_prompt_states_of_the_same_forward():
    from tbajax.training.loss import logprobs_and_prompt_features

    graphdef, params = nnx.split(fresh_model(), nnx.Param)
    batch = jax.tree.map(jnp.asarray, make_batch(3))


    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)  # eager ops would compile one by one
    def run(params, batch):
        model = nnx.merge(graphdef, params)
        hidden, _ = model.hidden_states(batch.tokens, attention_mask=batch.attention_mask)
        return (logprobs_and_prompt_features(graphdef, params, batch, 0.7),
                sequence_logprobs(graphdef, params, batch, 0.7), hidden)

    (lp, feats), want_lp, hidden = run(params, batch)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(want_lp), rtol=1e-6, atol=1e-6)
    hidden = np.asarray(hidden)
    for i in range(batch.batch_size):
        p = int(np.argmax(np.asarray(batch.loss_mask[i])))  # the first response token
        np.testing.assert_allclose(np.asarray(feats[i]), hidden[i, :p].mean(0), rtol=1e-5, atol=1e-6)


def test_logz_head_step_trains_the_head_and_the_policy_as_a_fixed_log_z_would():
    """One update: the head (w = 0, b = 0.5 at the start: log Z = 0.5 for every prompt) gets
    Adam's first step, lr_aux · sign(g), on every weight with a gradient; the policy's update equals
    tb_learned_logz's with its table at 0.5 (the head's loss reaches no model weight)."""
    from tbajax.objectives import LearnedLogZConfig, LogZHeadConfig

    config = dataclasses.replace(LOGZ_CONFIG, optimizer=dataclasses.replace(
        LOGZ_CONFIG.optimizer, lr=LRSchedule("constant", peak=1e-3)))
    head = PolicyUpdater(fresh_model(), config, "tb_logz_head", LogZHeadConfig(aux_lr_scale=100.0, init_log_z=LOGZ_INIT),
                         compiler_options=FAST_COMPILE)
    table = PolicyUpdater(fresh_model(), config, "tb_learned_logz",
                          LearnedLogZConfig(aux_lr_scale=100.0, init_log_z=LOGZ_INIT), compiler_options=FAST_COMPILE)
    assert set(head.state.aux) == {"w", "b"} and head.state.aux["w"].shape == (1, MODEL.hidden_size)
    pid = PROMPT_IDS.copy()
    pid[3] = 10**6  # a head takes any prompt id: no table to index
    m_head = head.step(dataclasses.replace(logz_batch(), prompt_id=pid))
    m_table = table.step(logz_batch())
    assert m_head["loss"] == pytest.approx(m_table["loss"], rel=1e-6)
    assert m_head["loss"] == pytest.approx(1.75, rel=1e-5)  # the table test's hand value
    assert_trees_close(host(head.state.params), host(table.state.params), atol=1e-7, rtol=1e-6)
    aux_lr = 1e-3 * 100.0
    assert float(head.state.aux["b"][0]) - LOGZ_INIT == pytest.approx(aux_lr, rel=1e-4)  # ∂L/∂b < 0
    dw = np.asarray(head.state.aux["w"][0])
    assert np.all(np.isclose(np.abs(dw), aux_lr, rtol=1e-3) | (dw == 0)) and np.any(dw != 0)
    assert np.isfinite(m_head["aux_grad_norm"]) and m_head["aux_grad_norm"] > 0
    with pytest.raises(ValueError, match="feature_dim"):
        initial_aux("tb_logz_head", None, config)
