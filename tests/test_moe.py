"""The mixture-of-experts MLP's pieces (`tbajax.models.moe`) against plain formulas; the models
that use it (Qwen3-MoE, Mixtral) are checked against transformers in test_models and
test_model_families."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tbajax.models.moe import dispatch, grouped_matmul, moe_swiglu, route, tile_rows

N, D, F, E, K = 37, 16, 24, 5, 2


def _inputs(seed: int = 0):
    r = np.random.default_rng(seed)
    x = jnp.abs(jnp.asarray(r.normal(size=(N, D)), jnp.float32))  # positive, so that expert 4's
    router = jnp.asarray(r.normal(size=(D, E)), jnp.float32).at[:, 4].add(-100.0)  # logit is the lowest
    gate, up = (jnp.asarray(r.normal(size=(E, D, F)) * 0.3, jnp.float32) for _ in range(2))
    down = jnp.asarray(r.normal(size=(E, F, D)) * 0.3, jnp.float32)
    return x, router, gate, up, down


def _every_expert(x, router, gate, up, down, normalize=True):
    """Every expert on every token, the top k kept: E / k times the work, the same result."""
    top, experts = jax.lax.top_k(jax.nn.softmax(x @ router, -1), K)
    if normalize:
        top = top / top.sum(-1, keepdims=True)
    h = jax.nn.silu(jnp.einsum("nd,edf->nef", x, gate)) * jnp.einsum("nd,edf->nef", x, up)
    y = jnp.take_along_axis(jnp.einsum("nef,efd->ned", h, down), experts[..., None], 1)
    return (y * top[..., None]).sum(1)


@pytest.mark.parametrize("normalize", [True, False])
def test_moe_mlp_and_its_gradients_equal_every_expert_on_every_token(normalize):
    """The sorted, tiled dispatch gives what running all experts and keeping each token's top k
    gives, and so do the gradients of the tokens, the router and every expert (an expert no token
    picks gets none)."""
    args = _inputs()
    ours = jax.jit(lambda *a: moe_swiglu(*a, k=K, normalize=normalize))
    np.testing.assert_allclose(ours(*args), _every_expert(*args, normalize=normalize), atol=1e-5)
    w = jnp.asarray(np.random.default_rng(1).normal(size=(N, D)), jnp.float32)
    got = jax.jit(jax.grad(lambda *a: (moe_swiglu(*a, k=K, normalize=normalize) * w).sum(),
                           argnums=tuple(range(5))))(*args)
    want = jax.grad(lambda *a: (_every_expert(*a, normalize=normalize) * w).sum(),
                    argnums=tuple(range(5)))(*args)
    for a, b, name in zip(got, want, ("x", "router", "gate", "up", "down")):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5, err_msg=name)
    assert 4 not in np.asarray(route(args[0], args[1], K, normalize)[1])
    assert not np.asarray(got[2][4]).any() and not np.asarray(got[4][4]).any()  # expert 4 saw no token


def test_dispatch_by_hand():
    """Three tokens, two experts each of three: expert runs start on tile boundaries (tile 8 at
    this size), in token order, empty rows point past the tokens, and every tile names its expert."""
    experts = jnp.asarray([[2, 0], [0, 1], [2, 1]], jnp.int32)
    plan = dispatch(experts, 3)
    assert plan.tile == tile_rows(6, 3) == 8
    rows = np.asarray(plan.rows)
    assert rows.shape == ((1 + 3) * 8,)  # ceil(6 / 8) + 3 experts' tiles at most
    assert rows[:2].tolist() == [0, 1] and rows[8:10].tolist() == [1, 2] and rows[16:18].tolist() == [0, 2]
    assert set(rows.tolist()) - {0, 1, 2} == {3}  # the rest: no token
    assert np.asarray(plan.slot).tolist() == [16, 0, 1, 8, 17, 9]  # (token, its j-th expert) -> row
    assert np.asarray(plan.tile_expert).tolist() == [0, 1, 2, 2]
    assert [tile_rows(a, 128) for a in (64, 4096, 65536, 10**7)] == [8, 32, 512 // 4, 128]


def test_grouped_matmul_by_hand():
    xs = jnp.arange(8.0).reshape(4, 2)  # two tiles of two rows
    w = jnp.stack([jnp.eye(2), 2 * jnp.eye(2), 3 * jnp.eye(2)])
    np.testing.assert_allclose(grouped_matmul(xs, w, jnp.asarray([2, 0])),
                               xs * jnp.asarray([[3], [3], [1], [1]]))
    dw = jax.grad(lambda w: grouped_matmul(xs, w, jnp.asarray([2, 2])).sum())(w)
    assert not np.asarray(dw[:2]).any() and np.allclose(dw[2], xs.T @ jnp.ones((4, 2)))


def test_route_renormalises_only_when_asked():
    x, router, *_ = _inputs()
    for normalize in (True, False):
        weights, experts = route(x, router, K, normalize)
        probs = jax.nn.softmax(x @ router, -1)
        top = jnp.take_along_axis(probs, experts, -1)
        np.testing.assert_allclose(weights, top / top.sum(-1, keepdims=True) if normalize else top, rtol=1e-6)
        assert not (np.asarray(experts) == 4).any()


def test_lora_on_experts_is_refused(tiny_checkpoint):
    from tbajax.models import LoraConfig, init_lora, load_model

    model = load_model(tiny_checkpoint("qwen3_moe"))
    params = nnx.state(model, nnx.Param)
    init_lora(params, LoraConfig(rank=2, targets=("q_proj", "v_proj")), jax.random.key(0))  # attention: fine
    with pytest.raises(ValueError, match="adapters on experts are not implemented"):
        init_lora(params, LoraConfig(rank=2, targets=("expert_gate",)), jax.random.key(0))
