"""Pure building blocks shared by every decoder family: norms, activations, RoPE, attention and
the KV-cache write. Each family's block (tbajax/models/families/*.py) is composed of these."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from tbajax import op_scopes as S
from tbajax.op_scopes import scoped
from tbajax.sharding import batch_shards, devices_in_context, shard_rows, within_batch_shards

Array = jax.Array
_MASK_VALUE = -1e30


def soft_capped(scores: Array, cap: float | None) -> Array:
    """Gemma 2's logit soft-capping, cap * tanh(scores / cap): scores squashed smoothly into
    (-cap, cap), so no single one dominates a softmax (unchanged for cap None)."""
    return scores if cap is None else cap * jnp.tanh(scores / cap)


def lm_head_scaled(head: Array, logits_scaling: float) -> Array:
    """An LM head (either orientation) divided by Granite's `logits_scaling`, so that the model's
    and the trainer's paths from hidden states to logits divide them (the head unchanged where it
    is 1; a sampler's few rows divide their logits instead, `serving.logits`)."""
    return head if logits_scaling == 1.0 else head / jnp.asarray(logits_scaling, head.dtype)


def _scaled(products: Array, d: int, softcap: float | None) -> Array:
    """Attention scores from query-key products of head dim d: scaled by 1/sqrt(d), then soft-capped."""
    return soft_capped(products * d**-0.5, softcap)

# one layer's cache buffers (keys d-major [b,kv,d,s], values [b,kv,s,d]) and the write slot


class PromptKV(NamedTuple):
    """One layer's keys/values of each prompt, held once for the K samples that continue it
    (`serving.PromptCache`): keys d-major [prompts, kv, d, p], values [prompts, kv, p, d], which
    slots hold real tokens [prompts, p]. Rows of the per-sample cache are prompt-major, unless
    the tables say where each sample is (a pool of prompts, as continuous batching holds):
    samples [prompts, K] the row of each prompt's sample j (>= rows: none), and entry [rows]
    each row's prompt * K + j. Under a sliding window of `window` positions, `positions` [rows]
    is each row's query position (`prompt_seen`)."""

    k: Array
    v: Array
    valid: Array
    samples: Array | None = None
    entry: Array | None = None
    positions: Array | None = None
    window: int | None = None


def prompt_seen(valid: Array, query_positions: Array, window: int | None, g: int) -> Array:
    """Which prompt slots each prompt's folded queries see, [prompts, 1, K*g, slots], for a score
    array [prompts, kv, K*g, slots] (query j*g + i: sample j's head i of its group): the real
    slots (`valid` [prompts, slots]) within the window of each sample's query position
    (`query_positions` [prompts, K]). A prompt's real tokens are contiguous (left-padded), so
    their positions count up from 0 across its valid slots."""
    if window is None:
        return valid[:, None, None]
    prompt_pos = jnp.cumsum(valid.astype(jnp.int32), axis=-1) - 1
    seen = valid[:, None] & within_window(query_positions, prompt_pos, window)  # [prompts, K, slots]
    n, k, s = seen.shape
    return jnp.broadcast_to(seen[:, :, None], (n, k, g, s)).reshape(n, 1, k * g, s)


# (keys, values, write index), and the prompt part when the cache holds it once per prompt
LayerCache = tuple[Array, Array, Array] | tuple[Array, Array, Array, PromptKV]


@scoped(S.NORM)
def rms_norm(x: Array, w: Array, eps: float) -> Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (w.astype(jnp.float32) * xf).astype(x.dtype)


@scoped(S.NORM)
def layer_norm(x: Array, w: Array, b: Array, eps: float) -> Array:
    """LayerNorm with bias (GPT-2, GPT-NeoX), computed in fp32 like torch's fused kernel."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    xf = xf - mean
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


@scoped(S.ACTIVATION)
def gelu_exact(x: Array) -> Array:
    """transformers' "gelu": x * Phi(x) with the erf CDF, in fp32, as torch computes it.

    Written 0.5 x (1 + erf(x / sqrt 2)) as torch's kernel is: `jax.nn.gelu` takes erfc(-x / sqrt 2),
    which XLA:CPU evaluates with more branches; the GPT-NeoX forward ran 3-5% longer with it
    (`forward.json`, `experiments/benchmarks/forward.py --compare gelu`)."""
    xf = x.astype(jnp.float32)
    return (0.5 * xf * (1.0 + jax.lax.erf(xf * (1.0 / math.sqrt(2.0))))).astype(x.dtype)


@scoped(S.ACTIVATION)
def gelu_tanh(x: Array) -> Array:
    """transformers' "gelu_new" (OpenAI GPT-2): the tanh approximation."""
    return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


ACTIVATIONS: dict[str, Any] = {"silu": jax.nn.silu, "gelu": gelu_exact, "gelu_new": gelu_tanh,
                               "gelu_pytorch_tanh": gelu_tanh}


_LOW_PRECISION = (jnp.bfloat16, jnp.float16)


def matmul(spec: str, a: Array, b: Array) -> Array:
    """jnp.einsum(spec, a, b); a bf16 / fp16 product is accumulated in fp32 and rounded back.

    XLA:CPU runs a bf16 x bf16 -> bf16 product in a generic kernel, but bf16 x bf16 -> fp32 in
    YNNPACK's, which use AMX / AVX-512 BF16 where the CPU has them: 2.5-5.1x faster at decode and
    training shapes on the Intel Xeon the benchmarks ran on (`bf16_matmul.json`), with the same
    error as torch's bf16 linear, which also accumulates in fp32. Other backends keep the plain
    product (not measured there). fp32 operands get exactly jnp.einsum's program.
    """
    out_dtype = jnp.result_type(a, b)
    if out_dtype not in _LOW_PRECISION:
        return jnp.einsum(spec, a, b)

    def fp32_accumulated(a: Array, b: Array) -> Array:
        return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(out_dtype)

    return jax.lax.platform_dependent(
        a, b, cpu=fp32_accumulated, default=functools.partial(jnp.einsum, spec))


@jax.custom_vjp
@scoped(S.MATMUL)
def linear(x: Array, w: Array) -> Array:
    """x @ w for [..., D] activations and a [D, F] weight.

    Its VJP picks the layout of the weight-gradient product: d w = x^T g contracts the token
    axis of both, so one operand must be transposed. XLA CPU transposes g, fusing whatever
    produced g (a RoPE backward, a residual sum) into a loop that runs in the transposed order,
    even when x is the smaller array. Here the smaller of the two is transposed, as a kernel of
    its own (`unfused_transpose`). When that is g, the product is d w^T = g^T x, transposed
    after (a weight-sized copy): XLA:CPU ran x^T g with g^T as its operand, whose output it lays
    out transposed, with its generic dot emitter instead of its library kernels. A bf16 / fp16
    product always takes x^T, materialised row-major (`row_major_transpose`), as its left operand.
    """
    return matmul("...d,df->...f", x, w)


def _linear_fwd(x: Array, w: Array) -> tuple[Array, tuple[Array, Array]]:
    return linear(x, w), (x, w)


@scoped(S.MATMUL)
def _linear_bwd(residuals: tuple[Array, Array], g: Array) -> tuple[Array, Array]:
    x, w = residuals
    dx = matmul("...f,df->...d", g, w)
    d, f = w.shape
    xs, gs = x.reshape(-1, d), g.reshape(-1, f)
    if jnp.result_type(xs, gs) in _LOW_PRECISION:
        dw = matmul("dn,nf->df", row_major_transpose(xs), gs)
    elif d <= f:
        dw = matmul("dn,nf->df", unfused_transpose(xs), gs)
    else:  # d w^T = g^T x, so that the product writes row-major (see `_row_grads`)
        dw = unfused_transpose(matmul("fn,nd->fd", unfused_transpose(gs), xs))
    return dx, dw.astype(w.dtype)


linear.defvjp(_linear_fwd, _linear_bwd)


OUT_MAJOR = "_out_major"  # key suffix of a weight stored [out, in]

# A product of at most this many rows multiplies an output-major weight as the left operand on
# CPU (`out_major_product`).
WEIGHT_FIRST_MAX_ROWS = 64


def orient_for_decode(p: dict[str, Array], names: tuple[str, ...]) -> dict[str, Array]:
    """Each named [in, out] weight moved to name + OUT_MAJOR as [out, in], as torch's nn.Linear
    holds it (a copy of `p`; `decode_product` reads either layout).

    At a few rows a step XLA:CPU's product against a large [in, out] matrix runs well below the
    same product against its transpose (a 0.5B model's decode matmuls 319 -> 218 ms a step at
    batch 32: `sampler_0.5B.json` vs `sampler_0.5B_before_out_major.json`), and output-major is
    the layout that `out_major_product`'s weight-first form needs at any size."""
    p = dict(p)
    for name in names:
        p[name + OUT_MAJOR] = p.pop(name).T
    return p


def undo_orient(p: dict[str, Array]) -> dict[str, Array]:
    """The inverse of `orient_for_decode`."""
    return {k.removesuffix(OUT_MAJOR): v.T if k.endswith(OUT_MAJOR) else v for k, v in p.items()}


def decode_product(x: Array, p: dict[str, Array], name: str) -> Array:
    """x [..., in] times the weight `name` of p, stored [in, out] (through `linear`, whose VJP
    training needs) or output-major by `orient_for_decode`."""
    if name in p:
        return linear(x, p[name])
    with jax.named_scope(S.MATMUL):
        return out_major_product(x, p[name + OUT_MAJOR])


def out_major_product(x: Array, w: Array, out_dtype: Any = None) -> Array:
    """x [..., in] times w [out, in] -> [..., out] (`matmul`, or accumulated and returned in
    `out_dtype`).

    For a few rows (at most WEIGHT_FIRST_MAX_ROWS) XLA:CPU runs the product faster with the
    weight as its left operand, w x^T -> [out, rows], transposed after: 1.07-1.37x faster than
    x w^T for each 10M, 50M and 0.5B-class decode weight and LM head at 32 rows in fp32 (1.09x
    the median at 64), about even at 128 and slower at 256 (`weight_first.json`,
    `experiments/benchmarks/weight_first.py`); the 50M sampler's call at batch 32, 1.22x. The
    barrier keeps XLA from folding the transpose back into the product (it would swap the
    operands again). Other backends take x w^T. Under a mesh the limit is on each batch shard's
    rows."""
    rows = math.prod(x.shape[:-1])
    local_rows = rows // batch_shards(x.shape[0]) if x.ndim > 1 else rows

    def product(spec: str, a: Array, b: Array) -> Array:
        if out_dtype is None:
            return matmul(spec, a, b)
        return jnp.einsum(spec, a, b, preferred_element_type=out_dtype)

    def rows_first(x: Array, w: Array) -> Array:
        return product("...d,fd->...f", x, w)

    if local_rows > WEIGHT_FIRST_MAX_ROWS or x.size == 0:
        return rows_first(x, w)

    def weight_first(x: Array, w: Array) -> Array:
        y = product("fd,md->fm", w, x.reshape(rows, x.shape[-1]))
        return jax.lax.optimization_barrier(y).T.reshape(*x.shape[:-1], w.shape[0])

    return jax.lax.platform_dependent(x, w, cpu=weight_first, default=rows_first)


def decode_matrix_product(x: Array, p: dict[str, Array], name: str, in_axes: int = 1,
                          out_shape: tuple[int, ...] = ()) -> Array:
    """`project` of x by the weight `name` with several axes (the training layout), or, in a
    sampler's layout where that weight is a matrix (`families.matrix_decode_layout`), x's last
    in_axes flattened through `decode_product` and the output shaped [..., *out_shape, -1]."""
    w = p.get(name)
    if w is not None and w.ndim > 2:
        return project(x, w, in_axes)
    lead = x.shape[: x.ndim - in_axes]
    return decode_product(x.reshape(*lead, -1), p, name).reshape(*lead, *out_shape, -1)


def project(x: Array, w: Array, in_axes: int = 1) -> Array:
    """`linear` for a weight with several input or output axes: x [..., *in] and w [*in, *out]
    (q_proj [embed, heads, head_dim] takes in_axes=1, o_proj [heads, head_dim, embed] in_axes=2)
    -> [..., *out], through the flattened [prod(in), prod(out)] matrix."""
    ins, outs = w.shape[:in_axes], w.shape[in_axes:]
    lead = x.shape[: x.ndim - in_axes]
    y = linear(x.reshape(*lead, math.prod(ins)), w.reshape(math.prod(ins), math.prod(outs)))
    return y.reshape(*lead, *outs)


def unfused_transpose(x: Array) -> Array:
    """x with its last two axes swapped (x.T of a 2-D array), on CPU as a kernel of its own.

    XLA CPU fuses a transpose into the loop that produces its operand and runs that loop in the
    transposed order. For the producers a weight gradient has (a key gradient through RoPE's
    VJP, a dynamic slice of a scan's stacked residuals) that is 1.3-3.7x slower than this
    (`experiments/benchmarks/transpose_fusion.py`; a lone elementwise product fuses faster), and
    the train step gains (`train_step.py`). Barriers (`optimization_barrier`) are gone before
    fusion; a conditional's branch is a computation of its own, so the transpose sits in a
    `cond` whose two branches are the same transpose (whatever the predicate reads, the result
    is x.T). Other backends transpose in place, and so does a program under a mesh of
    several devices: there the predicate would come from one device's shard, a collective that
    the transpose (and the weight gradient after it) would wait for.
    """
    return _in_own_kernel(x, _swap_last_axes)


def _swap_last_axes(x: Array) -> Array:
    return jnp.swapaxes(x, -1, -2)


def _in_own_kernel(x: Array, f: Callable[[Array], Array]) -> Array:
    """f(x), on CPU in both branches of a `cond` (see `unfused_transpose`), elsewhere and under a
    mesh of several devices plainly."""
    if x.size == 0 or devices_in_context() > 1:
        return f(x)

    def in_branch(y: Array) -> Array:
        return jax.lax.cond(y.reshape(-1)[0] > 0, f, f, y)

    return jax.lax.platform_dependent(x, cpu=in_branch, default=f)


TRANSPOSE_BLOCKS = 4


def row_major_transpose(x: Array) -> Array:
    """x.T of a 2-D bf16 / fp16 array, on CPU written out row-major for a product to read.

    XLA:CPU folds a transpose into the product that reads it (or lays it out column-major,
    even behind a `cond`), and runs a bf16 product with such an operand as an fp32 one: weight
    gradients ran at 210-255 GFLOP/s that way and at 396-910 reading a row-major x^T
    (`bf16_matmul.json`, its x^T g rows; `experiments/benchmarks/bf16_matmul.py`). Transposed
    in row blocks joined by a concatenate, x^T is a buffer of its own. Other backends, and a
    program under a mesh of several devices (the blocks would cut across the batch shards),
    transpose in place.
    """
    blocks = TRANSPOSE_BLOCKS if x.shape[0] % TRANSPOSE_BLOCKS == 0 else 1
    if x.size == 0 or blocks == 1 or devices_in_context() > 1:
        return x.T

    def in_blocks(y: Array) -> Array:
        return jnp.concatenate([b.T for b in jnp.split(y, blocks, axis=0)], axis=1)

    return jax.lax.platform_dependent(x, cpu=in_blocks, default=jnp.transpose)


def scan_layers(body: Callable[[Array, dict[str, Array]], tuple[Array, Any]], x: Array,
                stacked: dict[str, Array]) -> tuple[Array, Any]:
    """jax.lax.scan(body, x, stacked) over a stack of layer weights, with bf16 weights sliced as
    16-bit integers on CPU.

    XLA:CPU slices a bf16 array as fp32 (convert, slice, convert back), and in a scan it then
    hoists the convert of the whole loop-invariant stack out of the loop: every call wrote an
    fp32 copy of all the layer weights and each layer read its slice of that. Sliced as integers
    and reinterpreted, no copy is made: the bf16 forward of the 50M models plans 27-33% less
    temporary memory, with the same outputs bit for bit, and runs as fast or up to a few percent
    faster (`experiments/benchmarks/forward.py --dtype bfloat16 --compare stack_slicing`).
    Differentiable: the weights' tangents are sliced as before (`_integer_sliced`). Other
    backends slice the weights themselves.
    """
    # fp16 stacks are left to lax.scan: XLA:CPU (jax 0.10) made no fp32 copy of those
    pairs = {k: (jax.lax.bitcast_convert_type(w, jnp.uint16), w) if w.dtype == jnp.bfloat16 else w
             for k, w in stacked.items()}

    def sliced_body(h: Array, p: dict[str, Any]) -> tuple[Array, Any]:
        return body(h, {k: _integer_sliced(*v) if isinstance(v, tuple) else v for k, v in p.items()})

    return jax.lax.scan(sliced_body, x, pairs)


@jax.custom_jvp
def _integer_sliced(bits: Array, w: Array) -> Array:
    """w, read on CPU from `bits` (the same slice as integers), elsewhere from w itself. Whichever
    is not read is dead code, and so is w's slice in a differentiated program (its tangent is
    w's tangent)."""
    return jax.lax.platform_dependent(bits, w, cpu=lambda b, _: jax.lax.bitcast_convert_type(b, w.dtype),
                                      default=lambda _, v: v)


@_integer_sliced.defjvp
def _integer_sliced_jvp(primals: tuple[Array, Array], tangents: tuple[Any, Array]) -> tuple[Array, Array]:
    return _integer_sliced(*primals), tangents[1]


def own_kernel(x: Array) -> Array:
    """x, on CPU computed by a kernel of its own (a `cond` branch, as in `unfused_transpose`), so
    that XLA does not fuse its producer into every consumer. For a small per-layer weight of a
    scanned stack (a bias), the producer is a dynamic slice that a large consumer loop fusion would
    recompute per element."""
    return _in_own_kernel(x, jnp.copy)


@jax.custom_vjp
@scoped(S.ACTIVATION)
def swiglu(gate: Array, up: Array) -> Array:
    """silu(gate) * up, the gated MLP activation (Llama, Qwen).

    Its VJP computes both input gradients row-major in one pass and materialises them (an
    optimization barrier) before the weight-gradient matmuls read them: left to itself, XLA CPU
    fuses the sigmoid's gradient into the transpose that the weight gradient's dot wants and runs
    it in transposed order, several times slower than the forward activation.
    """
    return jax.nn.silu(gate) * up


def _swiglu_fwd(gate: Array, up: Array) -> tuple[Array, tuple[Array, Array]]:
    return swiglu(gate, up), (gate, up)


@scoped(S.ACTIVATION)
def _swiglu_bwd(residuals: tuple[Array, Array], g: Array) -> tuple[Array, Array]:
    gate, up = residuals
    x = gate.astype(jnp.float32)
    sig = jax.nn.sigmoid(x)
    gf = g.astype(jnp.float32)
    dgate = gf * up.astype(jnp.float32) * sig * (1.0 + x * (1.0 - sig))
    dup = gf * x * sig
    return jax.lax.optimization_barrier((dgate.astype(gate.dtype), dup.astype(up.dtype)))


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def rope_tables(inv_freq: Any, positions: Array, scale: float = 1.0) -> tuple[Array, Array]:
    """cos/sin [batch, seq, rotary_dim] for the rotate-half convention, each computed once by a
    kernel of its own (`own_kernel`): XLA:CPU fused the cos / sin into every loop that reads them
    (the rotation of q and of k, each causal attention block's slice of those, their VJPs) and
    evaluated them there per head and per element, a 3-5% of the train step
    (`experiments/benchmarks/train_step.py`). Both times `scale` (LongRoPE's attention factor)."""
    inv = jnp.asarray(inv_freq, jnp.float32)
    ang = positions.astype(jnp.float32)[..., None] * inv
    ang = jnp.concatenate([ang, ang], axis=-1)
    if scale == 1.0:
        return own_kernel(jnp.cos(ang)), own_kernel(jnp.sin(ang))
    return own_kernel(jnp.cos(ang) * scale), own_kernel(jnp.sin(ang) * scale)


@scoped(S.ROPE)
def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate-half RoPE (the HF convention). x: [batch, seq, heads, head_dim].

    When the tables are narrower than head_dim (GPT-NeoX's partial rotary), only the first
    cos.shape[-1] dims of each head rotate and the rest pass through unchanged.
    """
    rot_dim = cos.shape[-1]
    if rot_dim < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rot_dim], cos, sin), x[..., rot_dim:]], axis=-1)
    half = rot_dim // 2
    xf = x.astype(jnp.float32)
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, :, None] + rot * sin[:, :, None]).astype(x.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CausalMask:
    """A [b, t, t] attention mask that the decoder built as causal & padding: no query sees a later
    position, so attention may skip the blocks above the diagonal. The family blocks pass masks
    through to `self_attention` without looking at them. A query that sees no key (a left-padding
    position) then averages the values of its own block's keys rather than of all keys: padding
    output either way, which no real position reads."""

    mask: Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StridedGroups:
    """The attention mask of rows that each hold one prompt group at fixed strides: the prompt in
    the first P slots, then K responses of R slots each (`training.collate.pack_groups(...,
    strided=True)`). The prompt attends causally to itself; each response to the prompt and
    causally to itself. Attention then runs per part: the prompt's P x P, and each response's
    R x (P + R) (`strided_group_attention`), never the row's whole (P + K R)^2 that a packed
    row's mask spans, so long responses cost what their own rows would, less the prompt's
    repeats. The shapes say P, K and R."""

    prompt: Array  # [b, P] bool: real prompt slots
    responses: Array  # [b, K, R] bool: real slots of each response's stride
    # `ModelConfig.sliding_window` and the row's positions [b, P + K R], set by the decoder
    window: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    positions: Array | None = None


def within_window(query_pos: Array, key_pos: Array, window: int | None) -> Array | bool:
    """[..., queries, keys]: which keys each query sees under a sliding window of `window`
    positions, itself and the window - 1 before it (transformers' `kv_idx > q_idx - window`);
    True (every key) for window None."""
    if window is None:
        return True
    return (query_pos[..., :, None] - key_pos[..., None, :]) < window


def windowed(mask: Any, positions: Array, window: int | None) -> Any:
    """A pass's attention mask (an array [b, t, t], a `CausalMask` or `StridedGroups`) restricted
    to a sliding window by the tokens' positions [b, t] (the mask itself without one). Packed
    rows are right too: a continuation's positions count from its own prompt."""
    if window is None:
        return mask
    if isinstance(mask, StridedGroups):
        return dataclasses.replace(mask, window=window, positions=positions)
    if isinstance(mask, CausalMask):
        return CausalMask(mask.mask & within_window(positions, positions, window))
    return mask & within_window(positions, positions, window)


class EmitKV:
    """The `cache` argument of a prompt pass (`serving.prompt_pass`): no cache to read, attend over
    this step's own keys like a training forward, and hand them back in the cache's layout."""


EMIT_KV = EmitKV()


class RingTiers(NamedTuple):
    """One layer's cache for single-token steps whose rows are split into tiers, each tier a ring
    of its own length (continuous batching's `ring_tiers`): rows [0, n_0) use tier 0, the next n_1
    tier 1, and so on (on a mesh, within each batch shard: `tier_rows`), so a row's attention
    reads its tier's s_b slots, not the longest ring's.
    Per tier: keys d-major [n_b, kv, d, s_b], values [n_b, kv, s_b, d], the write slot; `write`
    [rows] bool says which rows write this step: a row that does not (a paused sample waiting
    for a longer tier) keeps its history intact. `prompt`: the pool the rows continue, if any."""

    k: tuple[Array, ...]
    v: tuple[Array, ...]
    index: tuple[Array, ...]
    write: Array
    prompt: PromptKV | None = None


def tier_rows(x: Array, start: int, n: int, shards: int) -> Array:
    """Tier rows [start, start + n) of a step's rows x [rows, ...]. With D batch shards every shard
    holds its share of each tier: shard s's rows are n_0 / D of tier 0, then n_1 / D of tier 1, ...,
    so a tier's rows are a slice of each shard's own (no rows cross devices), and a tier's cache,
    sharded over its n rows, puts them on the same shard. D = 1: the plain slice."""
    if shards == 1:
        return x[start:start + n]
    y = x.reshape(shards, x.shape[0] // shards, *x.shape[1:])
    return y[:, start // shards:(start + n) // shards].reshape(n, *x.shape[1:])


def join_tier_rows(parts: Sequence[Array], shards: int) -> Array:
    """The inverse of `tier_rows`: the tiers' rows [n_b, ...], shortest ring first, back in step
    order."""
    if shards == 1:
        return jnp.concatenate(parts, axis=0)
    y = jnp.concatenate([p.reshape(shards, p.shape[0] // shards, *p.shape[1:]) for p in parts], axis=1)
    return y.reshape(-1, *y.shape[2:])


@scoped(S.ATTENTION)
def self_attention(
    q: Array, k: Array, v: Array, mask: Array | CausalMask | tuple[Array, ...],
    cache: LayerCache | EmitKV | RingTiers | None, dtype: Any, implementation: str = "xla",
    softcap: float | None = None, sinks: Array | None = None,
) -> tuple[Array, Any]:
    """Attention of this step's queries q [b,t,h,d] over its keys/values [b,t,kv,d], or, with a
    layer cache, over the whole cache after writing this step's keys/values into it at the write
    slot. Returns ([b,t,h,d], the updated (keys, values) buffers, or with EMIT_KV this step's own
    keys d-major [b,kv,d,t] and values [b,kv,t,d], or None). With `RingTiers` (mask: one
    [n_b, 1, s_b] per tier) the updated tiers' (keys, values) buffers.

    implementation (`ModelConfig.attention`): "xla", our own attention; "cudnn", cuDNN's fused
    attention (`cudnn_attention`) for the passes without a cache to read (training, scoring,
    prompt passes). Decode steps over a cache always take ours. softcap: the scores soft-capped
    at that value (`soft_capped`, Gemma 2's `attn_logit_softcapping`) before the mask, in every path.
    sinks: GPT-OSS's attention sinks, a learned logit per query head [h] that joins every
    softmax's denominator (a key that every query sees and whose value is zero), in every path."""
    if isinstance(cache, RingTiers):
        return tiered_ring_attention(q, k, v, mask, cache, dtype, softcap, sinks)
    if isinstance(mask, StridedGroups):
        if cache is not None:
            raise TypeError("strided prompt groups are scored without a KV cache")
        return strided_group_attention(q, k, v, mask, implementation, softcap, sinks), None
    if cache is None or isinstance(cache, EmitKV):
        causal = isinstance(mask, CausalMask)
        dense = mask.mask if causal else mask
        if implementation == "cudnn":
            out = cudnn_attention(q, k, v, dense, causal, softcap, sinks)
        else:
            out = attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), dense, causal=causal,
                            softcap=softcap, sinks=sinks)
        return out, None if cache is None else (k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3))
    if isinstance(mask, CausalMask):
        raise TypeError("a KV-cache step takes its mask over cache slots, not a CausalMask")
    kt, cv, index, *prompt = cache
    with jax.named_scope(S.KV_WRITE):
        kt = jax.lax.dynamic_update_slice(kt, cache_values(k.transpose(0, 2, 3, 1), kt.dtype),
                                          (0, 0, 0, index))
        cv = jax.lax.dynamic_update_slice(cv, cache_values(v.transpose(0, 2, 1, 3), cv.dtype),
                                          (0, 0, index, 0))
    # the attention reads the cache in its own dtype (it computes in fp32 either way): an fp32
    # cache of a bf16 model is not rounded through bf16 and back at every read
    if prompt:
        return attention_after_prompt(q, kt, cv, mask, prompt[0], softcap, sinks).astype(dtype), (kt, cv)
    return cached_attention(q, kt, cv, mask, softcap, sinks).astype(dtype), (kt, cv)


def cache_values(x: Array, dtype: Any) -> Array:
    """x as a KV cache of `dtype` holds it. A 16-bit x going into a wider cache (a bf16 model's
    fp32 cache on CPU, `serving.kv_cache_dtype`) is rounded to its own precision explicitly:
    XLA may drop a round trip through bf16 (excess precision), and the cache would then hold
    values that the bf16 cache of another backend does not."""
    x_dtype, dtype = jnp.dtype(x.dtype), jnp.dtype(dtype)
    if x_dtype.itemsize == 2 and jnp.issubdtype(x_dtype, jnp.floating) and dtype.itemsize > 2:
        info = jnp.finfo(x_dtype)
        return jax.lax.reduce_precision(x.astype(dtype), exponent_bits=info.nexp, mantissa_bits=info.nmant)
    return x.astype(dtype)


def attention(q: Array, k: Array, v: Array, mask: Array, causal: bool = False,
              softcap: float | None = None, sinks: Array | None = None) -> Array:
    """Grouped-query attention scaled by 1/sqrt(head_dim) (and soft-capped at `softcap`, with the
    per-head attention `sinks` [h] in the softmax's denominator).
    q [b,t,h,d]; k,v heads-major [b,kv,s,d]; mask [b,t,s] -> [b,t,h,d].

    Both matmuls are batched over kv heads with the query group folded into the rows, a few
    batch rows at a time (`_attend_rows`). causal=True promises that no query sees a later position
    (mask within the lower triangle; with s > t keys, query j sees none past key s - t + j), so
    the blocks above the diagonal are skipped.
    """
    blocks = causal_blocks(q.shape[1]) if causal else 1
    return _attend_rows(_group_queries(q, k.shape[1]), k, v, mask, keys_d_major=False, blocks=blocks,
                        softcap=softcap, sinks=sinks)


def cudnn_attention(q: Array, k: Array, v: Array, mask: Array, causal: bool,
                    softcap: float | None = None, sinks: Array | None = None) -> Array:
    """cuDNN's fused (flash) attention, `ModelConfig.attention="cudnn"`: q [b,t,h,d], keys and
    values [b,s,kv,d], mask [b,t,s] -> [b,t,h,d]. The mask goes in as an additive bias, so every
    layout (rows, packed or strided groups) keeps its exact mask; `causal` (which the mask already
    holds) also lets cuDNN skip the blocks above the diagonal where t == s (its causal mask is
    aligned top-left). cuDNN needs an NVIDIA GPU and bf16/fp16 inputs; where it cannot run, this
    fails while tracing, with cuDNN's reason and what to set instead. cuDNN's kernel takes no
    soft-capping and no attention sinks (`ModelConfig` refuses either pair first)."""
    if softcap is not None:
        raise ValueError("cuDNN's fused attention has no score soft-capping; set model.attention=xla")
    if sinks is not None:
        raise ValueError("cuDNN's fused attention has no attention sinks; set model.attention=xla")
    try:
        return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation="cudnn",
                                            is_causal=causal and q.shape[1] == k.shape[1])
    except (RuntimeError, ValueError, NotImplementedError) as e:
        raise RuntimeError(
            f"model.attention=cudnn cannot run here ({type(e).__name__}: {e}). cuDNN's fused attention "
            "needs an NVIDIA GPU with cuDNN and model.dtype bfloat16 or float16; set model.attention=xla "
            "to use tbajax's own attention") from e


def strided_group_attention(q: Array, k: Array, v: Array, mask: StridedGroups, implementation: str = "xla",
                            softcap: float | None = None, sinks: Array | None = None) -> Array:
    """Attention of rows laid out as `StridedGroups`: q [b, P + K R, h, d], k and v
    [b, P + K R, kv, d] -> [b, P + K R, h, d]. The prompt part is causal attention over its own
    keys; the K responses become K rows of R queries over the prompt's keys (repeated per
    response for the product; their gradients sum back) followed by their own, causally. Both
    take causal query blocks (`_causal_row_attention`; the responses' with the prompt's keys in
    front)."""
    b, t, h, d = q.shape
    p = mask.prompt.shape[1]
    n, r = mask.responses.shape[1:]
    if t != p + n * r:
        raise ValueError(f"a strided group row of {t} slots is not a prompt of {p} + {n} x {r}")

    def attend(q: Array, k: Array, v: Array, sees: Array) -> Array:  # k, v [rows, s, kv, d]
        if implementation == "cudnn":
            return cudnn_attention(q, k, v, sees, causal=True, softcap=softcap, sinks=sinks)
        return attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), sees, causal=True,
                         softcap=softcap, sinks=sinks)

    def responses(x: Array) -> Array:  # [b, P + K R, ...] -> [b K, R, ...]
        return x[:, p:].reshape(b * n, r, *x.shape[2:])

    def per_response(x: Array) -> Array:  # [b, ...] -> [b K, ...]
        return jnp.repeat(x, n, axis=0)

    slots = jnp.arange(p)
    prompt_sees = (slots[None, :] <= slots[:, None])[None] & mask.prompt[:, None, :]  # [b, P, P]
    if mask.window is not None:
        assert mask.positions is not None, "a windowed StridedGroups carries its positions"
        prompt_pos, response_pos = mask.positions[:, :p], responses(mask.positions)
        prompt_sees &= within_window(prompt_pos, prompt_pos, mask.window)
    out_p = attend(q[:, :p], k[:, :p], v[:, :p], prompt_sees)
    own = jnp.arange(r)
    seen = jnp.concatenate([
        jnp.broadcast_to(per_response(mask.prompt)[:, None, :], (b * n, r, p)),
        (own[None, :] <= own[:, None])[None] & mask.responses.reshape(b * n, 1, r),
    ], axis=-1)  # [b K, R, P + R]
    if mask.window is not None:
        key_pos = jnp.concatenate([per_response(prompt_pos), response_pos], axis=1)
        seen &= within_window(response_pos, key_pos, mask.window)
    keys = jnp.concatenate([per_response(k[:, :p]), responses(k)], axis=1)
    values = jnp.concatenate([per_response(v[:, :p]), responses(v)], axis=1)
    out_r = attend(responses(q), keys, values, seen)
    return jnp.concatenate([out_p, out_r.reshape(b, n * r, h, d)], axis=1)


def cached_attention(q: Array, kt: Array, v: Array, mask: Array, softcap: float | None = None,
                     sinks: Array | None = None) -> Array:
    """`attention` over a layer's cache: keys d-major kt [b,kv,d,s], values [b,kv,s,d].

    One decode token (t = 1) is a batch of tiny matrix-vector products, which XLA's older CPU dot
    kernels ran at ~1 GFLOP/s (2-3 ms a layer for 10M at batch 32, plus a copy of the layer's
    cache). As a multiply-reduce over d, vectorised along the slots (why keys are stored d-major),
    then over the slots, vectorised along d, it reads the cache once, in place (~3x faster then;
    jax 0.10's YNNPACK dots run as fast as it, not faster: benchmarks/README.md).
    It reads the whole cache, empty tail included: attending to a static prefix of one cache
    was tried and lost (XLA:CPU copies the sliced cache every step). The sampler's decode loop
    instead runs over caches that grow (`sampling.core.phase_slots`), each copied once.
    A prompt (t > 1) takes the batched matmuls.
    """
    b, t, h, d = q.shape
    kv = kt.shape[1]
    g = h // kv
    if t > 1:  # batched products of one dtype (a wider cache holds q's dtype's values exactly)
        return _attend_rows(_group_queries(q, kv), kt.astype(q.dtype), v.astype(q.dtype), mask,
                            keys_d_major=True, softcap=softcap, sinks=sinks)
    sink = grouped_sinks(sinks, kv)
    if g == 1:  # one query per kv head (MHA): without a size-1 group axis, with which XLA:CPU
        # ran Pythia-410M's decode attention 20x slower (`sampler_pythia410M*.json`)
        qh = q.reshape(b, kv, d, 1).astype(jnp.float32)
        scores = _scaled((qh * kt.astype(jnp.float32)).sum(2), d, softcap)  # [b, kv, s]
        scores = jnp.where(mask[:, :1], scores, _MASK_VALUE)  # mask [b, 1, s]
        weights, total = _exponentials(scores, None if sink is None else sink[:, 0])
        out = (weights[..., None] * v.astype(jnp.float32)).sum(2)  # [b, kv, d]
        return (out / total[..., None]).reshape(b, 1, h, d).astype(v.dtype)
    qg = q.reshape(b, kv, g, d, 1).astype(jnp.float32)
    scores = _scaled((qg * kt[:, :, None].astype(jnp.float32)).sum(3), d, softcap)  # [b, kv, g, s]
    scores = jnp.where(mask[:, :1, None], scores, _MASK_VALUE)  # mask [b, 1, s]
    # normalised after the values' sum, not before: XLA:CPU then reads the values at a higher
    # rate (`experiments/benchmarks/sampler.py`, its attn ms column)
    weights, total = _exponentials(scores, sink)
    out = (weights[..., None] * v[:, :, None].astype(jnp.float32)).sum(3)  # [b, kv, g, d]
    out = out / total[..., None]
    return out.reshape(b, 1, h, d).astype(v.dtype)


def grouped_sinks(sinks: Array | None, kv: int) -> Array | None:
    """Per-query-head sink logits [h] as fp32 [kv, g], the grouping of the queries (head j g + i
    is kv head j's i-th query)."""
    return None if sinks is None else sinks.astype(jnp.float32).reshape(kv, -1)


def _exponentials(scores: Array, sink: Array | None) -> tuple[Array, Array]:
    """exp(scores - max) [..., s] and their sum [...], with the sink logit (broadcast to
    scores.shape[:-1]) in the max and the sum where there is one."""
    top = scores.max(-1)
    if sink is not None:
        top = jnp.maximum(top, sink)
    weights = jnp.exp(scores - top[..., None])
    total = weights.sum(-1)
    return weights, total if sink is None else total + jnp.exp(sink - top)


def attention_after_prompt(q: Array, kt: Array, v: Array, mask: Array, prompt: PromptKV,
                           softcap: float | None = None, sinks: Array | None = None) -> Array:
    """`cached_attention` of one new token per row (q [b,1,h,d]) over its prompt's keys, held once
    per prompt (`prompt`), and over its row's own cache (kt [b,kv,d,s], v [b,kv,s,d], mask [b,1,s]).

    The K samples of a prompt attend to the same prompt keys, so that part is one product per
    (prompt, kv head) with all K samples' queries folded into its rows: the prompt's keys and
    values are read once, not K times (for a TL;DR-like 256-token prompt and 64 new tokens at
    K = 16 the decode attention reads ~1/4 of the bytes). The softmax spans both parts: one max
    and one sum over both, the values of both added before the division. Rows are prompt-major.
    """
    if prompt.samples is not None:
        return _attention_after_pooled_prompt(q, kt, v, mask, prompt, softcap, sinks)
    b, t, h, d = q.shape
    kv, n = kt.shape[1], prompt.k.shape[0]
    g, k = h // kv, b // n
    if t != 1 or b != n * k:
        raise ValueError(f"attention after a shared prompt takes one token per row and K rows per prompt; "
                         f"got q {q.shape} for {n} prompts")

    def rows(x: Array) -> Array:  # [n, kv, k*g, ...] -> [b, kv, g, ...]
        return x.reshape(n, kv, k, g, *x.shape[3:]).swapaxes(1, 2).reshape(b, kv, g, *x.shape[3:])

    def by_prompt(x: Array) -> Array:  # [b, kv, g] -> [n, kv, k*g]
        return x.reshape(n, k, kv, g).swapaxes(1, 2).reshape(n, kv, k * g)

    qf = q.reshape(b, kv, g, d).astype(jnp.float32)
    qp = qf.reshape(n, k, kv, g, d).swapaxes(1, 2).reshape(n, kv, k * g, d)
    sp = _scaled(jnp.einsum("nhqd,nhds->nhqs", qp, prompt.k.astype(jnp.float32)), d, softcap)
    positions = None if prompt.positions is None else prompt.positions.reshape(n, k)
    sp = jnp.where(prompt_seen(prompt.valid, positions, prompt.window, g), sp, _MASK_VALUE)
    sink = grouped_sinks(sinks, kv)
    if g == 1:  # no size-1 group axis in the row part's products (see `cached_attention`)
        sr = _scaled((qf.reshape(b, kv, d, 1) * kt.astype(jnp.float32)).sum(2), d, softcap)  # [b, kv, s]
        sr = jnp.where(mask[:, :1], sr, _MASK_VALUE)
        top = jnp.maximum(rows(sp.max(-1)).reshape(b, kv), sr.max(-1))
        top = top if sink is None else jnp.maximum(top, sink[:, 0])
        er = jnp.exp(sr - top[..., None])
        out_r = (er[..., None] * v.astype(jnp.float32)).sum(2).reshape(b, kv, 1, d)
        top = top.reshape(b, kv, 1)
    else:
        sr = _scaled((qf[..., None] * kt[:, :, None].astype(jnp.float32)).sum(3), d, softcap)  # [b, kv, g, s]
        sr = jnp.where(mask[:, :1, None], sr, _MASK_VALUE)
        top = jnp.maximum(rows(sp.max(-1)), sr.max(-1))
        top = top if sink is None else jnp.maximum(top, sink)
        er = jnp.exp(sr - top[..., None])
        out_r = (er[..., None] * v[:, :, None].astype(jnp.float32)).sum(3)
    ep = jnp.exp(sp - by_prompt(top)[..., None])
    out_p = rows(jnp.einsum("nhqs,nhsd->nhqd", ep, prompt.v.astype(jnp.float32)))
    total = rows(ep.sum(-1)) + er.sum(-1).reshape(b, kv, g)
    if sink is not None:
        total = total + jnp.exp(sink - top)
    return ((out_p + out_r) / total[..., None]).reshape(b, 1, h, d).astype(v.dtype)


def _attention_after_pooled_prompt(q: Array, kt: Array, v: Array, mask: Array, prompt: PromptKV,
                                   softcap: float | None, sinks: Array | None) -> Array:
    """`attention_after_prompt` where any row may continue any prompt of the pool (`PromptKV`'s
    tables): each prompt's K queries are gathered from their rows (a few KB), its keys and values
    read once, and its rows' results gathered back. The two parts keep their own max and sum and
    merge after (as flash attention merges blocks), so a row that holds no live sample, whose
    table entries may be stale, still gives finite numbers."""
    b, t, h, d = q.shape
    if t != 1:
        raise ValueError(f"attention after a pooled prompt takes one token per row, got q {q.shape}")
    qf = q.reshape(b, kt.shape[1], h // kt.shape[1], d).astype(jnp.float32)
    ring = _ring_part(qf, kt, v, mask, softcap)
    out = _merged(_pooled_prompt_part(qf, prompt, softcap), ring, *_sink_part(sinks, ring))
    return out.reshape(b, 1, h, d).astype(v.dtype)


# A part of one token's softmax attention, unnormalised: (row max [b, kv, g], sum of exp(score -
# max) [b, kv, g], exp-weighted values [b, kv, g, d]); parts over disjoint keys merge exactly.
Part = tuple[Array, Array, Array]


def _pooled_prompt_part(qf: Array, prompt: PromptKV, softcap: float | None) -> Part:
    """The pool's part for every row (qf [b, kv, g, d] fp32): each prompt's K queries gathered
    from their rows, its keys and values read once, the results gathered back to the rows.

    On a mesh every device does this for its own pool entries and rows: the continuous engine
    places a prompt's K samples on its entry's device, so the tables' global indices are mapped
    to the device's own (`sharding.within_batch_shards`). Indexing the batch-sharded rows with
    global indices instead made XLA all-gather every row's queries and results onto every
    device, at every layer of every decode step."""
    positions = jnp.zeros(qf.shape[:1], jnp.int32) if prompt.positions is None else prompt.positions
    return within_batch_shards(
        functools.partial(_pool_part_of_shard, prompt.window, softcap),
        [(qf, ("batch", "kv_heads", None, None)), (prompt.k, ("batch", "kv_heads", "head_dim", "length")),
         (prompt.v, ("batch", "kv_heads", "length", "head_dim")), (prompt.valid, ("batch", "length")),
         (prompt.samples, ("batch", None)), (prompt.entry, ("batch",)), (positions, ("batch",))],
        (("batch", "kv_heads", None), ("batch", "kv_heads", None), ("batch", "kv_heads", None, None)),
    )


def _pool_part_of_shard(window: int | None, softcap: float | None, shard: Array | int, qf: Array, pk: Array,
                        pv: Array, valid: Array, samples: Array, entry: Array, positions: Array) -> Part:
    b, kv, g, d = qf.shape
    n, k = samples.shape
    rows = shard_rows(samples, shard, b)
    qe = jnp.take(qf, rows.reshape(-1), axis=0, mode="fill", fill_value=0)  # [n*k, kv, g, d]
    qp = qe.reshape(n, k, kv, g, d).swapaxes(1, 2).reshape(n, kv, k * g, d)
    sp = _scaled(jnp.einsum("nhqd,nhds->nhqs", qp, pk.astype(jnp.float32)), d, softcap)
    query_positions = jnp.take(positions, rows, mode="fill", fill_value=0)  # [n, k]
    sp = jnp.where(prompt_seen(valid, query_positions, window, g), sp, _MASK_VALUE)
    top_p = sp.max(-1)
    ep = jnp.exp(sp - top_p[..., None])
    out_p = jnp.einsum("nhqs,nhsd->nhqd", ep, pv.astype(jnp.float32))
    # a row's prompt * K + j, among this shard's entries (a row that holds no live sample may
    # point anywhere: clipped, its finite result unused)
    position = entry - shard * n * k

    def to_rows(x: Array) -> Array:  # [n, kv, k*g, ...] -> [b, kv, g, ...] at each row's entry
        rest = x.shape[3:]
        x = x.reshape(n, kv, k, g, *rest).swapaxes(1, 2).reshape(n * k, kv, g, *rest)
        return jnp.take(x, position, axis=0, mode="clip")

    return to_rows(top_p), to_rows(ep.sum(-1)), to_rows(out_p)


def _ring_part(qf: Array, kt: Array, v: Array, mask: Array, softcap: float | None) -> Part:
    """Each row's part over its own cache (qf [b, kv, g, d] fp32; kt [b, kv, d, s], v [b, kv, s, d],
    mask [b, 1, s]), as multiply-reduces (see `cached_attention`)."""
    b, kv, g, d = qf.shape
    if g == 1:  # no size-1 group axis in the products (see `cached_attention`)
        sr = _scaled((qf.reshape(b, kv, d, 1) * kt.astype(jnp.float32)).sum(2), d, softcap)  # [b, kv, s]
        sr = jnp.where(mask[:, :1], sr, _MASK_VALUE)
        top_r = sr.max(-1)
        er = jnp.exp(sr - top_r[..., None])
        out_r = (er[..., None] * v.astype(jnp.float32)).sum(2).reshape(b, kv, 1, d)
        return top_r[..., None], er.sum(-1)[..., None], out_r
    sr = _scaled((qf[..., None] * kt[:, :, None].astype(jnp.float32)).sum(3), d, softcap)  # [b, kv, g, s]
    sr = jnp.where(mask[:, :1, None], sr, _MASK_VALUE)
    top_r = sr.max(-1)
    er = jnp.exp(sr - top_r[..., None])
    out_r = (er[..., None] * v[:, :, None].astype(jnp.float32)).sum(3)
    return top_r, er.sum(-1), out_r


def _sink_part(sinks: Array | None, like: Part) -> tuple[Part, ...]:
    """The attention sinks (`self_attention`) as a part of their own: a key of score `sink` whose
    value is zero. None or one part, shaped as `like`."""
    if sinks is None:
        return ()
    top = jnp.broadcast_to(grouped_sinks(sinks, like[0].shape[1]), like[0].shape)
    return (top, jnp.ones_like(top), jnp.zeros_like(like[2])),


def _merged(*parts: Part) -> Array:
    """The normalised attention [b, kv, g, d] over the keys of all parts."""
    top = functools.reduce(jnp.maximum, [part[0] for part in parts])
    scales = [jnp.exp(part[0] - top) for part in parts]  # one of them is 1: the sum is >= 1
    out = functools.reduce(jnp.add, [part[2] * c[..., None] for part, c in zip(parts, scales)])
    return out / functools.reduce(jnp.add, [part[1] * c for part, c in zip(parts, scales)])[..., None]


def tiered_ring_attention(q: Array, k: Array, v: Array, masks: tuple[Array, ...], cache: RingTiers,
                          dtype: Any, softcap: float | None = None, sinks: Array | None = None
                          ) -> tuple[Array, tuple[tuple[Array, ...], tuple[Array, ...]]]:
    """`self_attention` of one token per row (q [b,1,h,d], k/v [b,1,kv,d]) over a `RingTiers`
    cache: each tier's rows write their keys/values at the tier's slot (rows that do not write
    keep what was there) and attend over their own tier's ring, then over the pool's prompt if
    there is one. Returns ([b,1,h,d], (the tiers' keys, the tiers' values))."""
    b, t, h, d = q.shape
    if t != 1:
        raise ValueError(f"a tiered ring cache takes one token per row and step, got q {q.shape}")
    kv = k.shape[2]
    shards = batch_shards(b)
    qf = q.reshape(b, kv, h // kv, d).astype(jnp.float32)
    keys, values, parts, start = [], [], [], 0
    with jax.named_scope(S.KV_WRITE):
        for kt, cv, index in zip(cache.k, cache.v, cache.index):
            n = kt.shape[0]
            write, kn, vn = (tier_rows(x, start, n, shards) for x in (cache.write, k, v))
            new_k = cache_values(kn.transpose(0, 2, 3, 1), kt.dtype)  # [n, kv, d, 1]
            old_k = jax.lax.dynamic_slice(kt, (0, 0, 0, index), new_k.shape)
            keys.append(jax.lax.dynamic_update_slice(
                kt, jnp.where(write[:, None, None, None], new_k, old_k), (0, 0, 0, index)))
            new_v = cache_values(vn.transpose(0, 2, 1, 3), cv.dtype)  # [n, kv, 1, d]
            old_v = jax.lax.dynamic_slice(cv, (0, 0, index, 0), new_v.shape)
            values.append(jax.lax.dynamic_update_slice(
                cv, jnp.where(write[:, None, None, None], new_v, old_v), (0, 0, index, 0)))
            start += n
    if start != b:
        raise ValueError(f"the ring tiers hold {start} rows, the step has {b}")
    start = 0
    for kt, cv, mask in zip(keys, values, masks):
        n = kt.shape[0]
        parts.append(_ring_part(tier_rows(qf, start, n, shards), kt, cv, mask, softcap))
        start += n
    ring: Part = tuple(join_tier_rows(x, shards) for x in zip(*parts))  # type: ignore[assignment]
    prompt = () if cache.prompt is None else (_pooled_prompt_part(qf, cache.prompt, softcap),)
    if not prompt and sinks is None:
        out = ring[2] / ring[1][..., None]
    else:
        out = _merged(*prompt, ring, *_sink_part(sinks, ring))
    return out.reshape(b, 1, h, d).astype(dtype), (tuple(keys), tuple(values))


def _group_queries(q: Array, kv: int) -> Array:
    """q [b,t,h,d] -> [b,kv,g*t,d]: each kv head's query group folded into its rows (g-major)."""
    b, t, h, d = q.shape
    return q.reshape(b, t, kv, h // kv, d).transpose(0, 2, 3, 1, 4).reshape(b, kv, (h // kv) * t, d)


def _attend_rows(q: Array, k: Array, v: Array, mask: Array, keys_d_major: bool, blocks: int = 1,
                 softcap: float | None = None, sinks: Array | None = None) -> Array:
    """Scaled (soft-capped), masked softmax attention of grouped queries q [b,kv,g*t,d] over k ([b,kv,s,d], or
    d-major [b,kv,d,s]) and v [b,kv,s,d], mask [b,t,s] -> [b,t,g*kv,d].

    A loop over batch rows (`_looped_attention`), `rows_per_step` of them a step (a step's scores
    within ROW_SCORES_BUDGET on CPU, ACCELERATOR_ROW_SCORES_BUDGET elsewhere). Under a mesh
    the loop runs over rows *within* a batch shard, so every device keeps its own rows (a loop
    over a sharded axis would gather the batch onto every device).
    """
    b, kv, gt, d = q.shape
    t, s = mask.shape[1], mask.shape[2]
    shards = batch_shards(b)
    on_cpu = rows_per_step(b // shards, kv * gt * s * 4)
    on_accelerator = rows_per_step(b // shards, kv * gt * s * 4, ACCELERATOR_ROW_SCORES_BUDGET)

    def looped(rows: int, q: Array, k: Array, v: Array, mask: Array, sink: Array | None) -> Array:
        steps = b // (shards * rows)

        def loop_major(x: Array) -> Array:  # [b, ...] -> [steps, shards * rows, ...], shard-major rows
            x = x.reshape(shards, steps, rows, *x.shape[1:]).swapaxes(0, 1)
            return x.reshape(steps, shards * rows, *x.shape[3:])

        out = _looped_attention(keys_d_major, blocks, softcap, *(loop_major(x) for x in (q, k, v, mask)),
                                sink)
        out = out.reshape(steps, shards, rows, *out.shape[2:]).swapaxes(0, 1).reshape(b, kv, gt // t, t, d)
        return out.transpose(0, 3, 1, 2, 4).reshape(b, t, gt * kv // t, d)

    sink = grouped_sinks(sinks, kv)
    if on_cpu == on_accelerator:
        return looped(on_cpu, q, k, v, mask, sink)
    return jax.lax.platform_dependent(q, k, v, mask, sink, cpu=functools.partial(looped, on_cpu),
                                      default=functools.partial(looped, on_accelerator))


# A loop step's scores: within the caches of a CPU core, and on an accelerator (GPU, TPU) within a
# share of its memory: there every loop step is a sequence of kernel launches and a loop test, so
# the fewer steps the better (the whole batch in one where it fits). The accelerator's figure was
# chosen, not measured (no GPU was lent to these sessions).
ROW_SCORES_BUDGET = 8 << 20
ACCELERATOR_ROW_SCORES_BUDGET = 1 << 30


def rows_per_step(rows: int, row_score_bytes: int, budget: int | None = None) -> int:
    """How many of a device's batch rows one attention loop step takes: all of them when their
    fp32 scores fit in `budget` (no loop is left: the small ops of a one-row step leave the
    second CPU core mostly idle), else the largest divisor of `rows` within half the budget (a
    step's scores still stay in cache), at least 1. `experiments/benchmarks/attention.py`
    compares it with one row a step. budget None: ROW_SCORES_BUDGET, read at trace time (the
    CPU's; `_attend_rows` takes ACCELERATOR_ROW_SCORES_BUDGET on other platforms).
    """
    budget = ROW_SCORES_BUDGET if budget is None else budget
    if rows * row_score_bytes <= budget:
        return rows
    fit = max(1, budget // 2 // max(1, row_score_bytes))
    return max(r for r in range(1, min(rows, fit) + 1) if rows % r == 0)


def _bdot(x: Array, y: Array, x_contract: int, y_contract: int) -> Array:
    """fp32 product of [rows, kv, ...] arrays batched over their two leading axes."""
    return jax.lax.dot_general(x, y, (((x_contract,), (y_contract,)), ((0, 1), (0, 1))),
                               preferred_element_type=jnp.float32)


def _row_scores(qi: Array, ki: Array, mi: Array, keys_d_major: bool, softcap: float | None
                ) -> tuple[Array, Array | None]:
    """Scaled, soft-capped, masked scores [rows, kv, g, t, s] of one loop step (qi [rows, kv, g*t, d]),
    and the cap's slope d capped / d uncapped, 1 - (capped / cap)^2 (None without a cap)."""
    rows, kv, gt, d = qi.shape
    t, s = mi.shape[1], mi.shape[2]
    scores = _scaled(_bdot(qi, ki, 3, 2 if keys_d_major else 3).reshape(rows, kv, gt // t, t, s), d, softcap)
    slope = None if softcap is None else 1.0 - jnp.square(scores / softcap)
    return jnp.where(mi[:, None, None], scores, _MASK_VALUE), slope


def _row_attention(keys_d_major: bool, softcap: float | None, sink: Array | None, xs: tuple[Array, ...]
                   ) -> tuple[Array, Array, Array]:
    """One loop step: (output [rows, kv, g, t, d], row max, row sum of the exponentials); the
    sink logits [kv, g] (`grouped_sinks`) in the max and the sum where there are some."""
    qi, ki, vi, mi = xs
    rows, kv, gt, d = qi.shape
    scores, _ = _row_scores(qi, ki, mi, keys_d_major, softcap)
    top = scores.max(-1, keepdims=True)
    if sink is not None:
        top = jnp.maximum(top, sink[:, :, None, None])
    e = jnp.exp(scores - top)
    total = e.sum(-1, keepdims=True)
    if sink is not None:
        total = total + jnp.exp(sink[:, :, None, None] - top)
    out = _bdot(e.astype(vi.dtype).reshape(rows, kv, gt, -1), vi, 3, 2).reshape(*scores.shape[:-1], d)
    return (out / total).astype(vi.dtype), top, total


def _row_grads(keys_d_major: bool, softcap: float | None, sink: Array | None, xs: tuple[Array, ...]
               ) -> tuple[Array, Array, Array, Array | None]:
    """One loop step of the VJP: the scores recomputed from q and k, then (dq, dk, dv, d sink).
    With sinks the probabilities are those of the real keys (the sink's share left out), and
    d out / d sink = -p_sink out, so a sink's gradient is -p_sink (g . out) summed over its
    queries."""
    qi, ki, vi, mi, oi, top, total, gi = xs
    rows, kv, gt, d = qi.shape
    scores, slope = _row_scores(qi, ki, mi, keys_d_major, softcap)
    p = jnp.exp(scores - top) / total  # [rows, kv, g, t, s]
    gf = gi.astype(jnp.float32).reshape(rows, kv, gt, d)
    dp = _bdot(gf, vi.astype(jnp.float32), 3, 3).reshape(p.shape)
    delta = (gf.reshape(oi.shape) * oi.astype(jnp.float32)).sum(-1, keepdims=True)
    dsink = None if sink is None else -(jnp.exp(sink[:, :, None, None] - top) / total * delta).sum((0, 3, 4))
    ds = jnp.where(mi[:, None, None], p * (dp - delta), 0.0)
    if slope is not None:
        ds = ds * slope
    ds = ds.reshape(rows, kv, gt, -1) * (d**-0.5)
    dq = _bdot(ds, ki.astype(jnp.float32), 3, 3 if keys_d_major else 2)  # [rows, kv, g*t, d]
    # dk and dv contract the query rows of both operands: XLA:CPU ran that batched product with
    # its generic dot emitter, not its library kernels (`experiments/benchmarks/backward_layouts.py`
    # counts them and times the step both ways). Here the small operand (g or q, [g*t, d]) is
    # transposed first and the product writes [d, s], transposed after, so the product is one its
    # library kernels take; both transposes are kernels of their own (`unfused_transpose`), else
    # XLA folds them back into the product.
    dvt = _bdot(unfused_transpose(gf), p.reshape(rows, kv, gt, -1), 3, 2)  # [rows, kv, d, s]
    dkt = _bdot(unfused_transpose(qi.astype(jnp.float32)), ds, 3, 2)  # [rows, kv, d, s]
    dk = dkt if keys_d_major else unfused_transpose(dkt)
    return dq.astype(qi.dtype), dk.astype(ki.dtype), unfused_transpose(dvt).astype(vi.dtype), dsink


def _query_blocks(q: Array, t: int, blocks: int) -> list[Array]:
    """Grouped queries [rows, kv, g*t, d] -> `blocks` consecutive position blocks, each grouped."""
    rows, kv, gt, d = q.shape
    q5 = q.reshape(rows, kv, gt // t, t, d)
    tb = t // blocks
    return [q5[:, :, :, i * tb:(i + 1) * tb].reshape(rows, kv, -1, d) for i in range(blocks)]


def _causal_row_attention(keys_d_major: bool, blocks: int, softcap: float | None, sink: Array | None,
                          xs: tuple[Array, ...]) -> tuple[Array, Array, Array]:
    """`_row_attention` for a mask that sees no later position, in `blocks` query blocks: block i
    attends to the first (i + 1) / blocks of the keys only (the rest are masked anyway). With
    more keys than queries (s = o + t), query j may see keys up to o + j: o keys before its own
    span, as a response after a shared prompt (`strided_group_attention`); block i then attends
    to the first o + (i + 1) t / blocks keys."""
    if blocks == 1:
        return _row_attention(keys_d_major, softcap, sink, xs)
    qi, ki, vi, mi = xs
    t, s = mi.shape[1], mi.shape[2]
    tb = t // blocks
    parts = [
        _row_attention(keys_d_major, softcap, sink, (qb, _first_keys(ki, s - t + (i + 1) * tb, keys_d_major),
                                                     vi[:, :, :s - t + (i + 1) * tb],
                                                     mi[:, i * tb:(i + 1) * tb, :s - t + (i + 1) * tb]))
        for i, qb in enumerate(_query_blocks(qi, t, blocks))
    ]
    return tuple(jnp.concatenate(x, axis=3) for x in zip(*parts))  # type: ignore[return-value]


def _causal_row_grads(keys_d_major: bool, blocks: int, softcap: float | None, sink: Array | None,
                      xs: tuple[Array, ...]) -> tuple[Array, Array, Array, Array | None]:
    """`_row_grads` in the query blocks of `_causal_row_attention`; key, value and sink gradients
    add up over the blocks that read them."""
    if blocks == 1:
        return _row_grads(keys_d_major, softcap, sink, xs)
    qi, ki, vi, mi, oi, top, total, gi = xs
    rows, kv, gt, d = qi.shape
    t, s = mi.shape[1], mi.shape[2]
    tb = t // blocks
    dqs, dk, dv = [], jnp.zeros(ki.shape, jnp.float32), jnp.zeros(vi.shape, jnp.float32)
    dsink = None if sink is None else jnp.zeros(sink.shape, jnp.float32)
    for i, qb in enumerate(_query_blocks(qi, t, blocks)):
        n, rows_t = s - t + (i + 1) * tb, slice(i * tb, (i + 1) * tb)
        dq_b, dk_b, dv_b, dsink_b = _row_grads(keys_d_major, softcap, sink, (
            qb, _first_keys(ki, n, keys_d_major), vi[:, :, :n], mi[:, rows_t, :n],
            oi[:, :, :, rows_t], top[:, :, :, rows_t], total[:, :, :, rows_t], gi[:, :, :, rows_t]))
        dqs.append(dq_b.reshape(rows, kv, -1, tb, d))
        pad_k = ((0, 0), (0, 0), (0, 0), (0, s - n)) if keys_d_major else ((0, 0), (0, 0), (0, s - n), (0, 0))
        dk = dk + jnp.pad(dk_b.astype(jnp.float32), pad_k)
        dv = dv + jnp.pad(dv_b.astype(jnp.float32), ((0, 0), (0, 0), (0, s - n), (0, 0)))
        dsink = None if dsink is None else dsink + dsink_b
    dq = jnp.concatenate(dqs, axis=3).reshape(rows, kv, gt, d)
    return dq, dk.astype(ki.dtype), dv.astype(vi.dtype), dsink


def _first_keys(k: Array, n: int, keys_d_major: bool) -> Array:
    return k[..., :n] if keys_d_major else k[:, :, :n]


def causal_blocks(t: int) -> int:
    """How many query blocks a causal attention over t positions is split into: 4 skips 3/8 of
    the score and value products; blocks of fewer than 32 positions would cost more in per-block
    overhead than they skip."""
    for blocks in (4, 2):
        if t % blocks == 0 and t // blocks >= 32:
            return blocks
    return 1


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _looped_attention(keys_d_major: bool, blocks: int, softcap: float | None, q: Array, k: Array, v: Array,
                      mask: Array, sink: Array | None) -> Array:
    """Attention with a leading loop axis ([n, rows, ...] inputs -> [n, rows, kv, g, t, d]);
    blocks > 1 promises a causal mask (`_causal_row_attention`).

    The whole batch's scores ([b,kv,g*t,s] fp32, 33 MB for 16 x 256 tokens at 8 heads) would be
    written and re-read by the masking, exponent, sum and product passes at memory speed, while
    one row's stay in cache (`experiments/benchmarks/attention.py` times both against torch's
    fused kernel). The softmax is normalised after the value product (fewer divisions). The VJP
    is flash-attention's: it keeps only each row's max and sum and recomputes the scores a row at
    a time, instead of storing every probability (no [b,kv,g*t,s] residual).
    """
    return _looped_attention_fwd(keys_d_major, blocks, softcap, q, k, v, mask, sink)[0]


def _looped_attention_fwd(keys_d_major: bool, blocks: int, softcap: float | None, q: Array, k: Array,
                          v: Array, mask: Array, sink: Array | None) -> tuple[Array, Any]:
    step = functools.partial(_causal_row_attention, keys_d_major, blocks, softcap, sink)
    out, top, total = jax.lax.map(step, (q, k, v, mask))
    return out, (q, k, v, mask, sink, out, top, total)


@scoped(S.ATTENTION)
def _looped_attention_bwd(keys_d_major: bool, blocks: int, softcap: float | None, residuals: Any, g_out: Array
                          ) -> tuple[Array, Array, Array, None, Array | None]:
    q, k, v, mask, sink, out, top, total = residuals
    dq, dk, dv, dsink = jax.lax.map(functools.partial(_causal_row_grads, keys_d_major, blocks, softcap, sink),
                                    (q, k, v, mask, out, top, total, g_out))
    return dq, dk, dv, None, None if sink is None else dsink.sum(0)


_looped_attention.defvjp(_looped_attention_fwd, _looped_attention_bwd)
