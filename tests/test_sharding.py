"""Sharded forward on 8 fake CPU devices equals the single-device forward; rules are applied."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from tbajax.models import load_model
from tbajax.sharding import MeshConfig, fsdp_as_tensor, logical_to_spec, make_mesh, replicated_over
from tests.conftest import build_tiny_hf_checkpoint


@pytest.fixture(scope="module")
def divisible_checkpoint(tmp_path_factory):
    """Dimensions divisible by 8 so every rule really splits."""
    d = tmp_path_factory.mktemp("hf-sharding")
    return build_tiny_hf_checkpoint(
        d, "qwen2", hidden_size=64, intermediate_size=128, num_attention_heads=8,
        num_key_value_heads=8, vocab_size=128,
    )


@pytest.mark.parametrize(
    "mesh_config",
    [MeshConfig(data=8), MeshConfig(data=2, tensor=4), MeshConfig(data=1, tensor=8), MeshConfig(data=2, fsdp=2, tensor=2)],
    ids=["8x1x1", "2x1x4", "1x1x8", "2x2x2"],
)
def test_sharded_forward_matches_single_device(divisible_checkpoint, mesh_config):
    assert jax.device_count() == 8
    ids = np.random.RandomState(0).randint(3, 128, (8, 10))
    mask = np.ones_like(ids)
    mask[3, :4] = 0
    ref = np.asarray(load_model(divisible_checkpoint)(jnp.asarray(ids), attention_mask=jnp.asarray(mask))[0])
    mesh = make_mesh(mesh_config)
    model = load_model(divisible_checkpoint, mesh=mesh)
    graphdef, state = nnx.split(model)
    batch = jax.NamedSharding(mesh, P(("data", "fsdp")))
    with jax.set_mesh(mesh):
        fwd = jax.jit(lambda s, t, m: nnx.merge(graphdef, s)(t, attention_mask=m)[0])
        out = fwd(state, jax.device_put(ids, batch), jax.device_put(mask, batch))
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-4)
    # parameters are really split as the rules say
    q = state["layers"]["q_proj"][...]
    assert q.sharding.spec == logical_to_spec(("layers", "embed", "q_heads", "head_dim"), q.shape, mesh)
    shard = q.addressable_shards[0].data.shape
    assert shard == (2, 64 // mesh.shape["fsdp"], 8 // mesh.shape["tensor"], 8)


def test_rules_skip_axes_that_do_not_divide():
    mesh = make_mesh(MeshConfig(data=2, tensor=4))
    assert logical_to_spec(("embed", "kv_heads"), (64, 2), mesh) == P(None, None)
    assert logical_to_spec(("embed", "mlp"), (64, 128), mesh) == P(None, "tensor")
    assert logical_to_spec(("batch", "length"), (6, 3), mesh) == P("data", None)
    with pytest.raises(KeyError, match="no rule"):
        logical_to_spec(("nonsense",), (4,), mesh)


def test_mesh_config_errors():
    with pytest.raises(ValueError, match="needs 6 devices"):
        make_mesh(MeshConfig(data=3, tensor=2))
    with pytest.raises(ValueError, match="at most one"):
        MeshConfig(data=-1, tensor=-1).shape(8)
    assert make_mesh(MeshConfig(tensor=2)).shape == {"data": 4, "fsdp": 1, "tensor": 2}


def test_replicated_over_drops_one_mesh_axis():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    cases = {P(("data", "fsdp"), "tensor", None): P("data", "tensor", None),
             P("fsdp", "tensor"): P(None, "tensor"), P(("fsdp", "tensor")): P("tensor"),
             P("tensor", "fsdp"): P("tensor", None), P(): P()}
    for spec, expected in cases.items():
        dropped = replicated_over(jax.NamedSharding(mesh, spec), "fsdp")
        assert dropped.mesh is mesh and dropped.spec == expected, (spec, dropped.spec)
    x = jax.device_put(jnp.arange(16.0).reshape(4, 4), jax.NamedSharding(mesh, P("fsdp", "tensor")))
    whole = jax.device_put(x, replicated_over(x.sharding, "fsdp"))
    assert whole.addressable_shards[0].data.shape == (4, 2)  # whole along fsdp, still split over tensor
    np.testing.assert_array_equal(whole, x)


def test_fsdp_as_tensor_keeps_each_data_rows_devices():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    folded = fsdp_as_tensor(mesh)
    assert folded.shape == {"data": 2, "fsdp": 1, "tensor": 4}
    assert (folded.devices.reshape(2, 4) == mesh.devices.reshape(2, 4)).all()  # a data row's devices
    assert folded.axis_types == mesh.axis_types


def test_data_parallel_forward_keeps_rows_on_their_device(divisible_checkpoint):
    """The attention's loop over batch rows runs within each device's shard: a data-parallel
    forward and backward compile to no all-gather (a loop over the sharded axis would gather
    the whole batch onto every device)."""
    from tbajax.sharding import batch_shards

    mesh = make_mesh(MeshConfig(data=8))
    model = load_model(divisible_checkpoint, mesh=mesh)
    graphdef, state = nnx.split(model)
    batch = jax.NamedSharding(mesh, P(("data", "fsdp")))
    ids = jax.device_put(np.random.RandomState(0).randint(3, 128, (16, 10)), batch)
    with jax.set_mesh(mesh):
        assert batch_shards(16) == 8 and batch_shards(12) == 1  # 8 does not divide 12: replicated
        loss = lambda s, t: nnx.merge(graphdef, s)(t)[0].mean()  # noqa: E731
        hlo = jax.jit(jax.value_and_grad(loss)).lower(state, ids).compile().as_text()
    assert "all-gather" not in hlo
    # layers.unfused_transpose keeps its cond off a mesh: its predicate would be a collective
    assert "conditional" not in hlo
    assert batch_shards(16) == 1  # no mesh in context


def test_top_k_sampling_keeps_rows_on_their_device():
    """XLA:CPU partitions `lax.top_k` of batch-sharded logits by gathering the whole batch onto
    every device; `sample_logits` runs it per batch shard (`over_batch_shards`) and draws the
    same tokens as without a mesh."""
    from tbajax.sampling.step import sample_logits

    mesh = make_mesh(MeshConfig(data=4, tensor=2))
    rows = jax.NamedSharding(mesh, P(("data", "fsdp")))
    plain_logits = jax.random.normal(jax.random.key(0), (8, 300))
    plain_keys = jax.random.split(jax.random.key(1), 8)
    logits, keys = jax.device_put((plain_logits, plain_keys), rows)

    def draw(x, k, top_k, top_p):
        return sample_logits(None, x, temperature=0.7, top_k=top_k, top_p=top_p, keys=k)

    for top_k, top_p in ((20, None), (0, 0.9), (20, 0.9)):
        fn = jax.jit(draw, static_argnums=(2, 3))
        with jax.set_mesh(mesh):
            hlo = fn.lower(logits, keys, top_k, top_p).compile().as_text()
            tokens, logprobs = fn(logits, keys, top_k, top_p)
        assert "all-gather" not in hlo
        want_tokens, want_logprobs = fn(plain_logits, plain_keys, top_k, top_p)
        np.testing.assert_array_equal(tokens, want_tokens)
        np.testing.assert_allclose(logprobs, want_logprobs, rtol=1e-6)


def test_within_batch_shards_maps_global_rows_to_each_shards_own():
    """A table of global row indices, split over 4 batch shards of 2 rows: each device looks its
    own rows up (no gather); rows of other shards (2 in shard 0's) and padding (8) come out as the
    fill value."""
    from tbajax.sharding import shard_rows, within_batch_shards

    np.testing.assert_array_equal(shard_rows(jnp.array([0, 3, 4, 5, 8]), 2, 2), [2, 2, 0, 1, 2])
    mesh = make_mesh(MeshConfig(data=4, tensor=2))
    values = jnp.arange(8.0) * 10  # one value per row
    table = jnp.array([[1, 2], [3, 8], [4, 5], [7, 7]])

    def look_up(shard, table, values):
        return (jnp.take(values, shard_rows(table, shard, values.shape[0]), mode="fill", fill_value=-1),)

    fn = jax.jit(lambda t, v: within_batch_shards(look_up, [(t, ("batch", None)), (v, ("batch",))],
                                                  [("batch", None)])[0])
    want = [[10, 20], [30, -1], [40, 50], [70, 70]]
    np.testing.assert_array_equal(fn(table, values), want)  # no mesh: shard 0 holds every row
    rows = jax.NamedSharding(mesh, P(("data", "fsdp")))
    with jax.set_mesh(mesh):
        t, v = jax.device_put((table, values), rows)
        hlo = fn.lower(t, v).compile().as_text()
        np.testing.assert_array_equal(fn(t, v), [[10, -1], [30, -1], [40, 50], [70, 70]])
    assert not re.search(r"all-gather|all-to-all|collective-permute|all-reduce", hlo)
    with pytest.raises(ValueError, match="split differently"), jax.set_mesh(mesh):
        jax.eval_shape(lambda t, v: within_batch_shards(look_up, [(t, ("batch", None)), (v, ("batch",))],
                                                        [("batch", None)]), table, jnp.zeros(6))


def test_gpt_oss_sharded_forward_and_gradients_match_single_device(tmp_path):
    """GPT-OSS on a data x fsdp x tensor mesh: its sinks split with the query heads, its experts'
    fused gate/up columns (interleaved pairs) and biases with the MLP axis; the logits and the
    gradients (sinks and experts included) equal one device's."""
    checkpoint = build_tiny_hf_checkpoint(
        tmp_path / "gpt_oss", "gpt_oss", hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
        head_dim=8, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, vocab_size=128,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"], swiglu_limit=0.3)
    ids = np.random.RandomState(1).randint(3, 128, (8, 10))
    mask = np.ones_like(ids)
    mask[3, :4] = 0
    weights = np.random.RandomState(2).normal(size=(8, 10, 128)).astype(np.float32)

    def loss_and_grads(model, put=lambda x: x):
        graphdef, state = nnx.split(model)
        loss = lambda s, t, m, w: (nnx.merge(graphdef, s)(t, attention_mask=m)[0] * w).sum()  # noqa: E731
        return jax.jit(jax.value_and_grad(loss))(state, put(ids), put(mask), put(weights))

    ref_loss, ref_grads = loss_and_grads(load_model(checkpoint))
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    model = load_model(checkpoint, mesh=mesh)
    assert model.layers.sinks[...].sharding.spec == logical_to_spec(("layers", "q_heads"), (2, 8), mesh)
    assert not model.layers.expert_gate_up[...].sharding.is_fully_replicated
    batch = jax.NamedSharding(mesh, P(("data", "fsdp")))
    with jax.set_mesh(mesh):
        loss, grads = loss_and_grads(model, lambda x: jax.device_put(x, batch))
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for name in ("sinks", "expert_gate_up", "expert_gate_up_bias", "router_bias", "q_proj"):
        got, want = (np.asarray(g["layers"][name][...]) for g in (grads, ref_grads))
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4, err_msg=name)
