"""The mixture-of-experts MLP's pieces (`tbajax.models.moe`) against plain formulas; the models
that use it (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE) are checked against transformers in test_models and
test_model_families."""

import functools

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


def test_lora_on_experts_adapts_each_expert_and_exports_merged(tiny_checkpoint, tmp_path):
    """Adapters on routed experts: a pair per expert (A [L, E, in, r], B [L, E, r, out]), each
    expert's weight W_e + (alpha / r) A_e B_e. Qwen3-MoE's checkpoints hold one tensor per expert,
    which PEFT cannot adapt: its PEFT export is refused naming the merged export (GPT-OSS's experts
    export as PEFT target_parameters: test_lora)."""
    from tbajax.models import LoraConfig, init_lora, load_model, merge_lora, save_peft_adapter

    model = load_model(tiny_checkpoint("qwen3_moe"))
    params = nnx.state(model, nnx.Param)
    cfg = LoraConfig(rank=2, alpha=4.0, targets=("expert_gate",))
    adapters = init_lora(params, cfg, jax.random.key(0))
    a = adapters["layers.expert_gate"]["a"][...]
    assert a.shape == (2, 4, 72, 2) and adapters["layers.expert_gate"]["b"][...].shape == (2, 4, 2, 32)
    b = jnp.asarray(np.random.default_rng(0).normal(size=(2, 4, 2, 32)), jnp.float32)
    axes = adapters["layers.expert_gate"]["b"].logical_axes
    adapters["layers.expert_gate"]["b"] = nnx.Param(b, logical_axes=axes)
    merged = nnx.state(merge_lora(model, adapters, cfg), nnx.Param)["layers"]["expert_gate"][...]
    base = params["layers"]["expert_gate"][...]
    np.testing.assert_allclose(np.asarray(merged[1, 3]), np.asarray(base[1, 3] + 2.0 * a[1, 3] @ b[1, 3]),
                               rtol=1e-5, atol=1e-6)  # layer 1, expert 3: scale alpha / r = 2
    with pytest.raises(NotImplementedError, match="one tensor per expert.*export the merged model"):
        save_peft_adapter(tmp_path / "peft", model, adapters, cfg)


def test_routing_counts_and_load_balancing_loss_by_hand():
    from tbajax.models.moe import RoutingCounts, load_balancing_loss, routing_counts

    # three tokens, the third padding; two experts, one a token
    probs = jnp.asarray([[0.75, 0.25], [0.5, 0.5], [0.1, 0.9]])
    counts = routing_counts(probs, jnp.asarray([[0], [0], [1]]), jnp.asarray([1, 1, 0]))
    np.testing.assert_allclose(counts.picked, [2.0, 0.0])
    np.testing.assert_allclose(counts.probability, [1.25, 0.75])
    # E x sum_e f_e P_e = 2 x (2/2 x 1.25/2 + 0 x 0.75/2)
    stacked = RoutingCounts(counts.picked[None], counts.probability[None])
    assert float(load_balancing_loss(stacked, 2)) == pytest.approx(1.25)
    # routing spread evenly: k, whatever the layers and tokens
    even = RoutingCounts(jnp.full((3, 4), 5.0), jnp.full((3, 4), 2.5))  # 10 tokens, k = 2 of E = 4
    assert float(load_balancing_loss(even, 10)) == pytest.approx(2.0)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "gpt_oss"])
def test_load_balancing_loss_and_its_gradient_match_transformers(tiny_checkpoint, model_type):
    """moe.load_balancing_loss over a forward's routing counts (padding left out) against
    transformers' aux_loss (output_router_logits=True), and its gradient in every router and the
    first layer's attention (the routers read the hidden states) against torch autograd."""
    import torch
    from transformers import AutoModelForCausalLM

    from tbajax.models import load_model
    from tbajax.models.moe import CountRouting, load_balancing_loss

    directory = tiny_checkpoint(model_type)
    r = np.random.default_rng(1)
    tokens = r.integers(3, 100, size=(3, 9))
    mask = np.ones((3, 9), bool)
    mask[1, 6:], mask[2, 4:] = False, False
    theirs = AutoModelForCausalLM.from_pretrained(directory).float().eval()
    out = theirs(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64)),
                 output_router_logits=True)
    out.aux_loss.backward()

    model = load_model(directory)
    graphdef, params = nnx.split(model)

    def aux(params):
        m = nnx.merge(graphdef, params)
        _, counts = m.hidden_states(jnp.asarray(tokens), attention_mask=jnp.asarray(mask),
                                    cache=CountRouting(jnp.asarray(mask)))
        return load_balancing_loss(counts, mask.sum())

    value, grads = jax.jit(jax.value_and_grad(aux))(params)
    assert float(value) == pytest.approx(out.aux_loss.item(), rel=1e-5)
    layers = theirs.model.layers
    for i, layer in enumerate(layers):
        block = layer.mlp if hasattr(layer, "mlp") else layer.block_sparse_moe  # Mixtral's name in v4
        router = block.router if hasattr(block, "router") else block.gate  # GPT-OSS's name
        router_grad = router.weight.grad.numpy().T  # [d, E] as ours holds it
        np.testing.assert_allclose(np.asarray(grads["layers"]["router"][...][i]), router_grad,
                                   rtol=1e-4, atol=1e-7)
    q_proj = layers[0].self_attn.q_proj.weight
    q_grad = np.asarray(grads["layers"]["q_proj"][...][0]).reshape(q_proj.shape[1], -1)
    np.testing.assert_allclose(q_grad, q_proj.grad.numpy().T, rtol=1e-4, atol=1e-7)


MOE_MODEL = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                 expert_intermediate_size=16)


def test_router_aux_loss_coefficient_follows_the_checkpoint_unless_the_trainer_sets_it():
    from tbajax.models import ModelConfig
    from tbajax.training import TrainerConfig
    from tbajax.training.loss import router_aux_loss_coef

    quiet = ModelConfig(**MOE_MODEL, router_aux_loss_coef=0.25)  # output_router_logits false
    asked = ModelConfig(**MOE_MODEL, output_router_logits=True, router_aux_loss_coef=0.25)
    assert router_aux_loss_coef(quiet, TrainerConfig()) == 0.0
    assert router_aux_loss_coef(asked, TrainerConfig()) == 0.25
    assert router_aux_loss_coef(asked, TrainerConfig(router_aux_loss_coef=0.0)) == 0.0
    assert router_aux_loss_coef(quiet, TrainerConfig(router_aux_loss_coef=0.5)) == 0.5
    dense = {k: v for k, v in MOE_MODEL.items() if not k.startswith(("num_experts", "expert_"))}
    dense_config = ModelConfig(**{**dense, "model_type": "qwen3"})
    assert router_aux_loss_coef(dense_config, TrainerConfig()) == 0.0
    with pytest.raises(ValueError, match="has no router"):
        router_aux_loss_coef(dense_config, TrainerConfig(router_aux_loss_coef=0.01))
    with pytest.raises(ValueError, match="router_aux_loss_coef must be >= 0"):
        TrainerConfig(router_aux_loss_coef=-1.0)


def test_router_aux_loss_joins_the_training_loss():
    """The loss sum gains coef x aux x the micro-batch's loss count, logged as router_aux_loss;
    with the coefficient 0 the loss is the objective's alone."""
    import functools

    from tbajax.models import ModelConfig
    from tbajax.models.moe import CountRouting, load_balancing_loss
    from tbajax.training import TrainerConfig
    from tbajax.training.loss import microbatch_loss
    from tests.conftest import numpy_model_parts
    from tests.test_training import make_batch, vargrad_tb

    graphdef, params = numpy_model_parts(ModelConfig(**MOE_MODEL, output_router_logits=True,
                                                     router_aux_loss_coef=0.25))
    params = jax.tree.map(jnp.asarray, params)
    batch = jax.tree.map(jnp.asarray, make_batch(0))

    def loss_parts(config):
        step = jax.jit(functools.partial(microbatch_loss, graphdef=graphdef, objective=vargrad_tb,
                                         objective_config=None, config=config))
        total, (count, metrics, _) = step((params, None), params, batch)
        return float(total), float(count), metrics

    total, count, metrics = loss_parts(TrainerConfig(compute_dtype="float32"))  # the checkpoint's 0.25
    off = TrainerConfig(compute_dtype="float32", router_aux_loss_coef=0.0)
    total_off, count_off, metrics_off = loss_parts(off)
    _, counts = jax.jit(lambda p: nnx.merge(graphdef, p).hidden_states(
        batch.tokens, attention_mask=batch.attention_mask, cache=CountRouting(batch.attention_mask)))(params)
    aux = float(load_balancing_loss(counts, batch.attention_mask.sum()))
    assert aux > 2.0  # above a perfect balance's k
    assert "router_aux_loss" not in metrics_off and count == count_off
    assert float(metrics["router_aux_loss"].value) == pytest.approx(aux, rel=1e-6)
    assert total == pytest.approx(total_off + 0.25 * aux * count, rel=1e-6)


def test_policy_updater_refuses_a_router_loss_for_a_dense_model_before_compiling():
    from tbajax.models import CausalLM, ModelConfig
    from tbajax.training import PolicyUpdater, TrainerConfig

    dense = {k: v for k, v in MOE_MODEL.items() if not k.startswith(("num_experts", "expert_"))}
    config = ModelConfig(**{**dense, "model_type": "qwen3"})
    model = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="has no router"):
        PolicyUpdater(model, TrainerConfig(router_aux_loss_coef=0.01), "tb")


def test_router_loss_fields_are_read_and_written_back(tiny_checkpoint):
    import json

    from tbajax.models import ModelConfig

    hf = json.loads((tiny_checkpoint("olmoe") / "config.json").read_text())
    cfg = ModelConfig.from_hf(hf)
    assert (cfg.output_router_logits, cfg.router_aux_loss_coef) == (False, hf["router_aux_loss_coef"])
    asked = ModelConfig.from_hf({**hf, "output_router_logits": True, "router_aux_loss_coef": 0.02})
    assert (asked.output_router_logits, asked.router_aux_loss_coef) == (True, 0.02)
    assert ModelConfig.from_hf(asked.to_hf()) == asked



def test_router_loss_counts_each_real_token_the_forward_runs_in_every_layout():
    """Packed and strided groups run each prompt once and each response once: the same tokens
    with the same hidden states, so the same load-balancing loss; the row layout runs a group's
    prompt once per response, and counts it so (as transformers does, a row at a time)."""
    from tbajax.models import ModelConfig
    from tbajax.training.collate import collate
    from tbajax.training.loss import _score
    from tests.conftest import numpy_model_parts
    from tests.test_training import _random_groups

    graphdef, params = numpy_model_parts(ModelConfig(**MOE_MODEL))
    groups = _random_groups(3, (9, 12), (5, 11, 7))
    layouts = {name: collate(groups, beta=0.5, pack_microbatches=m, pack_strided=s)
               for name, m, s in (("rows", None, False), ("packed", 1, False), ("strided", 1, True))}

    @functools.partial(jax.jit, static_argnums=0)
    def balance(graphdef, params, batch):
        return _score(nnx.merge(graphdef, params), batch, 1.0, router_balance=True).router_balance

    got = {name: float(balance(graphdef, params, batch)) for name, batch in layouts.items()}
    assert got["packed"] == pytest.approx(got["strided"], rel=1e-5)
    assert abs(got["rows"] - got["packed"]) > 1e-4 * got["packed"]


def test_clamped_swiglu_by_hand():
    """GPT-OSS's activation: (clip(up, -7, 7) + 1) * g * sigmoid(1.702 g), g = min(gate, 7)."""
    import math

    from tbajax.models.moe import clamped_swiglu

    got = clamped_swiglu(jnp.asarray([0.0, 10.0, -1.0]), jnp.asarray([1.0, 10.0, -10.0]), 1.702, 7.0)
    sigmoid = lambda z: 1 / (1 + math.exp(-z))  # noqa: E731
    want = [0.0, (7 + 1) * 7 * sigmoid(1.702 * 7), (-7 + 1) * -1 * sigmoid(-1.702)]  # gate and up clamped
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
    assert want[1] == pytest.approx(55.9996, abs=1e-4) and want[2] == pytest.approx(0.92522, abs=1e-5)
