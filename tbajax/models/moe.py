"""Mixture-of-experts MLPs (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, GPT-OSS): a router picks each token's
top-k experts and each expert's tokens go through its own SwiGLU MLP, the outputs weighted by the
router (GPT-OSS: biased router and experts, gate and up fused, a clamped SwiGLU:
`moe_clamped_swiglu`).

Exact, as transformers computes it: no capacity, so no token is ever dropped, and without running
every expert on every token (E / k times the work). The (token, expert) assignments are sorted by
expert, each expert's run padded to whole tiles (`dispatch`), and one product per tile reads that
tile's expert weights (`grouped_matmul`). `jax.lax.ragged_dot` would say the same in one op, but
XLA:CPU lowers it to a dense product over every expert.

The router's load-balancing loss (`load_balancing_loss`) is transformers' own; a training forward
asks each layer for its `RoutingCounts` with `CountRouting` in the cache's place
(`CausalLM.hidden_states`), and `training.loss` adds it where the checkpoint or the trainer asks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tbajax import op_scopes as S
from tbajax.op_scopes import scoped

Array = jax.Array


def router_probabilities(x: Array, router: Array, bias: Array | None = None) -> Array:
    """[N, E] fp32: the router's softmax over its logits for tokens x [N, d] (router [d, E], and
    GPT-OSS's bias [E])."""
    logits = jnp.dot(x, router.astype(x.dtype)).astype(jnp.float32)
    return jax.nn.softmax(logits if bias is None else logits + bias.astype(jnp.float32), axis=-1)


def route(x: Array, router: Array, k: int, normalize: bool) -> tuple[Array, Array]:
    """(weights [N, k] in x's dtype, experts [N, k] int32) of tokens x [N, d] under a router
    [d, E]: softmax in fp32 over the router's logits, the top k, renormalised to sum to one where
    `normalize` (Mixtral always; Qwen3-MoE's norm_topk_prob)."""
    return top_experts(router_probabilities(x, router), k, normalize, x.dtype)


def top_experts(probs: Array, k: int, normalize: bool, dtype: Any) -> tuple[Array, Array]:
    top, experts = jax.lax.top_k(probs, k)
    if normalize:
        top = top / top.sum(-1, keepdims=True)
    return top.astype(dtype), experts.astype(jnp.int32)


class CountRouting(NamedTuple):
    """The `cache` argument of a forward without a KV cache that also hands back every layer's
    `RoutingCounts` over the tokens that count: `tokens` [b, t], 1 for real tokens, 0 for padding."""

    tokens: Array


class RoutingCounts(NamedTuple):
    """What the router's load-balancing loss needs of a layer, summed over the counted tokens:
    how often each expert was among a token's top k (`picked` [E]) and the router's probability
    of each expert (`probability` [E], differentiable). A forward stacks them over layers: [L, E]."""

    picked: Array
    probability: Array


def routing_counts(probs: Array, experts: Array, tokens: Array) -> RoutingCounts:
    """`RoutingCounts` of a layer from its router probabilities [N, E], each token's top-k experts
    [N, k] and which tokens count [N] (a scatter-add: no [N, k, E] one-hot)."""
    weight = tokens.reshape(-1).astype(jnp.float32)
    picked = jnp.zeros(probs.shape[-1], jnp.float32).at[experts.reshape(-1)].add(
        jnp.repeat(weight, experts.shape[-1]))
    return RoutingCounts(picked, (probs * weight[:, None]).sum(0))


def load_balancing_loss(counts: RoutingCounts, tokens: Array) -> Array:
    """The router's auxiliary loss as transformers' `load_balancing_loss_func` computes it (Switch
    Transformer's, with every layer's tokens pooled): E x sum_e f_e P_e, where f_e is the share of
    the pooled (token, layer) pairs that picked expert e (each of a token's k picks counting
    once) and P_e the mean router probability of e over them. `counts` [L, E] from a forward
    over `tokens` counted tokens. Uniform routing gives k. Its gradient flows through the router
    probabilities (into the router and the hidden states it reads); the picks carry none."""
    layers, experts = counts.picked.shape
    pairs = layers * jnp.maximum(jnp.asarray(tokens, jnp.float32), 1.0)
    share = jax.lax.stop_gradient(counts.picked.sum(0)) / pairs
    return experts * jnp.sum(share * counts.probability.sum(0) / pairs)


class Dispatch(NamedTuple):
    """Where the assignments go: `slot` [N k] each assignment's row in the padded, expert-sorted
    buffer; `rows` [P] the token each buffer row holds (N: none, a zero row); `tile_expert`
    [P / tile] the expert of each tile of `tile` rows."""

    slot: Array
    rows: Array
    tile_expert: Array
    tile: int


def tile_rows(assignments: int, experts: int) -> int:
    """Rows per tile: about one expert's share of the assignments (a power of two between 8 and
    128), so that padding each expert's run to whole tiles costs at most one tile per expert."""
    share = max(1, assignments // max(experts, 1))
    return int(min(128, max(8, 2 ** math.ceil(math.log2(share)))))


def dispatch(experts: Array, num_experts: int) -> Dispatch:
    """Sort the assignments [N, k] by expert (stable: by token within an expert) into a buffer of
    P = (ceil(N k / tile) + E) tiles' rows, each expert's run starting on a tile boundary."""
    n, k = experts.shape
    flat = experts.reshape(-1)
    assignments = n * k
    tile = tile_rows(assignments, num_experts)
    order = jnp.argsort(flat, stable=True)
    sorted_experts = flat[order]
    counts = jnp.zeros(num_experts, jnp.int32).at[flat].add(1)
    padded = (counts + tile - 1) // tile * tile
    run_start = jnp.cumsum(counts) - counts
    padded_end = jnp.cumsum(padded)
    rank = jnp.arange(assignments, dtype=jnp.int32) - run_start[sorted_experts]
    dest = (padded_end - padded)[sorted_experts] + rank
    slot = jnp.zeros(assignments, jnp.int32).at[order].set(dest)
    size = (-(-assignments // tile) + num_experts) * tile
    rows = jnp.full(size, n, jnp.int32).at[dest].set((order // k).astype(jnp.int32))
    tiles = jnp.arange(size // tile, dtype=jnp.int32) * tile
    tile_expert = jnp.minimum(jnp.searchsorted(padded_end, tiles, side="right"), num_experts - 1)
    return Dispatch(slot, rows, tile_expert.astype(jnp.int32), tile)


@jax.custom_vjp
def grouped_matmul(xs: Array, w: Array, tile_expert: Array) -> Array:
    """xs [P, din] in tiles of P / len(tile_expert) rows, tile t times w[tile_expert[t]] ([E, din,
    dout]) -> [P, dout] (fp32 accumulation, xs's dtype).

    Its own VJP: autodiff of the tiles' dynamic reads of w would add a whole [E, din, dout] zero
    gradient per tile; here each tile adds its [din, dout] product into its expert's slot."""
    return _grouped_forward(xs, w, tile_expert)


def _tiles(x: Array, count: int) -> Array:
    return x.reshape(count, x.shape[0] // count, *x.shape[1:])


def _grouped_forward(xs: Array, w: Array, tile_expert: Array) -> Array:
    count = tile_expert.shape[0]

    def one(args: tuple[Array, Array]) -> Array:
        x, e = args
        return jnp.dot(x, w[e].astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)

    return jax.lax.map(one, (_tiles(xs, count), tile_expert)).reshape(xs.shape[0], w.shape[-1])


def _grouped_fwd(xs: Array, w: Array, tile_expert: Array) -> tuple[Array, tuple[Array, Array, Array]]:
    return _grouped_forward(xs, w, tile_expert), (xs, w, tile_expert)


def _grouped_bwd(residuals: tuple[Array, Array, Array], g: Array) -> tuple[Array, Array, np.ndarray]:
    xs, w, tile_expert = residuals
    count = tile_expert.shape[0]
    x_tiles, g_tiles = _tiles(xs, count), _tiles(g, count)

    def dx_one(args: tuple[Array, Array]) -> Array:
        gt, e = args
        return jnp.dot(gt, w[e].astype(gt.dtype).T, preferred_element_type=jnp.float32).astype(xs.dtype)

    def dw_add(t: Array, dw: Array) -> Array:
        e = tile_expert[t]
        part = jnp.dot(x_tiles[t].T, g_tiles[t], preferred_element_type=jnp.float32)
        return jax.lax.dynamic_update_index_in_dim(dw, dw[e] + part, e, axis=0)

    dxs = jax.lax.map(dx_one, (g_tiles, tile_expert)).reshape(xs.shape)
    dw = jax.lax.fori_loop(0, count, dw_add, jnp.zeros(w.shape, jnp.float32))
    return dxs, dw.astype(w.dtype), np.zeros(tile_expert.shape, jax.dtypes.float0)


grouped_matmul.defvjp(_grouped_fwd, _grouped_bwd)


@scoped(S.MATMUL)
def moe_swiglu(x: Array, router: Array, gate: Array, up: Array, down: Array, k: int,
               normalize: bool) -> Array:
    """The MoE MLP of tokens x [..., d]: router [d, E], experts' gate / up [E, d, f] and down
    [E, f, d] -> [..., d], each token the router-weighted sum of its k experts' SwiGLU MLPs."""
    return _moe_swiglu(x, router, gate, up, down, k, normalize)[0]


@scoped(S.MATMUL)
def moe_swiglu_counted(x: Array, router: Array, gate: Array, up: Array, down: Array, k: int,
                       normalize: bool, tokens: Array) -> tuple[Array, RoutingCounts]:
    """`moe_swiglu` and its layer's `RoutingCounts` over `tokens` (x's leading shape, 1: counts)."""
    out, probs, experts = _moe_swiglu(x, router, gate, up, down, k, normalize)
    return out, routing_counts(probs, experts, tokens)


def _moe_swiglu(x: Array, router: Array, gate: Array, up: Array, down: Array, k: int,
                normalize: bool) -> tuple[Array, Array, Array]:
    def experts_mlp(xs: Array, plan: Dispatch) -> Array:
        h = jax.nn.silu(grouped_matmul(xs, gate, plan.tile_expert)) * grouped_matmul(xs, up, plan.tile_expert)
        return grouped_matmul(h, down, plan.tile_expert)

    probs = router_probabilities(x.reshape(-1, x.shape[-1]), router)
    out, experts = _routed(x, probs, k, normalize, experts_mlp)
    return out, probs, experts


def _routed(x: Array, probs: Array, k: int, normalize: bool,
            experts_mlp: Callable[[Array, Dispatch], Array]) -> tuple[Array, Array]:
    """(the router-weighted sum [..., d] of each token's top-k experts, the experts [N, k]) of
    tokens x [..., d] under router probabilities [N, E]; `experts_mlp` maps the expert-sorted
    rows (`dispatch`) to their experts' outputs."""
    lead, d = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, d)
    weights, experts = top_experts(probs, k, normalize, flat.dtype)
    plan = dispatch(experts, probs.shape[-1])
    xs = jnp.concatenate([flat, jnp.zeros((1, d), flat.dtype)])[plan.rows]  # empty rows read zeros
    out = experts_mlp(xs, plan)[plan.slot].reshape(-1, k, d)
    return (out * weights[..., None]).sum(1).reshape(*lead, d), experts


def clamped_swiglu(gate: Array, up: Array, alpha: float, limit: float) -> Array:
    """GPT-OSS's activation: (clip(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


class BiasedExperts(NamedTuple):
    """GPT-OSS's MoE weights: router [d, E] and its bias [E]; gate_up [E, d, 2f], gate and up
    columns interleaved (as the checkpoint holds them), and its bias [E, 2f]; down [E, f, d] and
    its bias [E, d]."""

    router: Array
    router_bias: Array
    gate_up: Array
    gate_up_bias: Array
    down: Array
    down_bias: Array


@scoped(S.MATMUL)
def moe_clamped_swiglu(x: Array, w: BiasedExperts, k: int, alpha: float, limit: float,
                       tokens: Array | None = None) -> tuple[Array, RoutingCounts | None]:
    """GPT-OSS's MoE MLP of tokens x [..., d] -> ([..., d], with `tokens` the layer's
    `RoutingCounts`): the top k of the biased router's logits, weighted by their softmax (the
    full softmax renormalised over them: the same numbers), each through its expert's clamped
    SwiGLU (`clamped_swiglu`) with biases. One product per tile for gate and up together."""

    def experts_mlp(xs: Array, plan: Dispatch) -> Array:
        row_expert = jnp.repeat(plan.tile_expert, plan.tile)  # each buffer row's expert
        gate_up = grouped_matmul(xs, w.gate_up, plan.tile_expert)
        gate_up = gate_up + w.gate_up_bias.astype(xs.dtype)[row_expert]
        h = clamped_swiglu(gate_up[:, 0::2], gate_up[:, 1::2], alpha, limit)
        return grouped_matmul(h, w.down, plan.tile_expert) + w.down_bias.astype(xs.dtype)[row_expert]

    probs = router_probabilities(x.reshape(-1, x.shape[-1]), w.router, w.router_bias)
    out, experts = _routed(x, probs, k, True, experts_mlp)
    return out, None if tokens is None else routing_counts(probs, experts, tokens)
