"""The functional train state and the pure functions that build and transform it.

The policy Module is split once (`nnx.split`) into a static graphdef and its Param state; only
states travel through `jax.jit` (plain jit over Modules loses tied weights, and re-traces the
graph). Params keep their `nnx.Param` wrappers, so the `logical_axes` metadata that decides their
sharding stays with them, and with the optimizer moments optax builds in their image.

Objectives with trainable per-prompt params (a learned log Z table, see `ObjectiveSpec.init_aux`)
add `aux`. The optimizer (`make_trainable_optimizer`) is one `optax.multi_transform` over the
trainable pair (params, aux): the params get clip-by-global-norm → AdamW → × −lr, the aux table
its per-row Adam (`scale_by_row_adam`) → × −aux_lr; `TrainState.opt_state` is its state. For
objectives without aux, aux is None and only the params' partition exists.

LoRA (`init_lora_train_state`): `TrainState.params` holds the adapters, so the optimizer state,
checkpoints and donation cover only them; the frozen base lives outside the state in a
`LoraBase`, passed to the jitted step as a non-donated argument (never optimised, never
checkpointed: it is reloaded from model.checkpoint). The policy is `apply_lora(base, adapters)`;
the reference is the base itself (adapters disabled), or base + a copy of the adapters once a
reference reset has happened (`ref_params`, kept only when resets are configured).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tbajax.models.config import DTYPES
from tbajax.models.lora import LoraConfig, apply_lora, init_lora
from tbajax.sharding import named_sharding
from tbajax.training.config import OptimizerConfig, TrainerConfig

Array = jax.Array
PyTree = Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything a trainer step reads and writes; a pytree of arrays (checkpointed whole).

    step: number of updates applied so far (int32). rng: the run's base PRNG key, a raw uint32
    key (raw, not typed, so it saves and restores as a plain array); update u draws from
    `update_key(state)` = fold_in(rng, step), so a restored run continues the same stream
    without the key having to change. ref_params: the frozen reference policy, or None when
    reference log-probs come with the batch. aux: the objective's per-prompt trainable table
    (leading axis = prompt id), or None. opt_state: the state of `make_trainable_optimizer` over
    (params, aux); `adam_state` and `aux_opt_state` read its two halves.
    """

    params: nnx.State
    opt_state: optax.OptState
    ref_params: nnx.State | None
    step: Array
    rng: Array
    aux: PyTree | None = None

    @property
    def adam_state(self) -> optax.ScaleByAdamState:
        """The params' Adam state (count, and mu / nu shaped like `params`)."""
        chain = self.opt_state.inner_states["params"].inner_state
        adam = next(s for s in jax.tree.leaves(chain, is_leaf=_is_adam) if _is_adam(s))
        return adam._replace(mu=adam.mu[0], nu=adam.nu[0])  # [1] is the aux half, masked out

    @property
    def aux_opt_state(self) -> AuxAdamState | None:
        """The aux table's per-row Adam state (None without aux)."""
        if self.aux is None:
            return None
        rows = self.opt_state.inner_states["aux"].inner_state[0]
        return AuxAdamState(count=rows.count, mu=rows.mu[1], nu=rows.nu[1])  # [0]: the params, masked out


def _is_adam(x: Any) -> bool:
    return isinstance(x, optax.ScaleByAdamState)


class AuxAdamState(NamedTuple):
    """Adam moments of an aux table, with one step count per table row (prompt id)."""

    count: Array  # [N] int32: updates this row has received
    mu: PyTree
    nu: PyTree


def update_key(state: TrainState) -> Array:
    """The PRNG key of the next update: a pure function of (base key, step)."""
    return jax.random.fold_in(state.rng, state.step)


def make_optimizer(config: OptimizerConfig) -> optax.GradientTransformation:
    """AdamW without the learning rate: the step multiplies by −lr(step) itself.

    Keeping the schedule out of the optimizer state means resetting the moments (on a reference
    reset) does not restart the schedule, and lr is read from `TrainState.step` alone.
    Equals `optax.adamw(schedule, b1, b2, eps, weight_decay)` update for update.
    """
    parts = [optax.scale_by_adam(b1=config.b1, b2=config.b2, eps=config.eps)]
    if config.weight_decay:
        parts.append(optax.add_decayed_weights(config.weight_decay))
    return optax.chain(*parts)


def scale_by_learning_rate_arg(name: str) -> optax.GradientTransformationExtraArgs:
    """× −(the extra argument `name`): the learning rate comes from the step (`TrainState.step`)
    at every update, not from an optimizer state a moment reset would restart."""

    def update(updates: PyTree, state: optax.EmptyState, params: PyTree | None = None,
               **extra: Any) -> tuple[PyTree, optax.EmptyState]:
        del params
        lr = extra[name]
        return jax.tree.map(lambda u: -lr * u, updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def make_trainable_optimizer(config: OptimizerConfig, with_aux: bool) -> optax.GradientTransformationExtraArgs:
    """The whole update of the trainable pair (params, aux table or None): one multi_transform,

        params: clip_by_global_norm(max_grad_norm) → AdamW direction (`make_optimizer`) → × −lr
        aux:    per-row Adam of the touched rows (`scale_by_row_adam`)              → × −aux_lr

    used as `tx.update(grads, state, (params, aux), lr=..., aux_lr=..., touched=...)` and
    `optax.apply_updates`. The clip sees the params' global norm only: it never scales the aux
    gradient (log Z has to travel ~r/β, and its gradient is large exactly when it lags).
    """
    params_tx = [optax.clip_by_global_norm(config.max_grad_norm)] if config.max_grad_norm is not None else []
    transforms = {"params": optax.chain(*params_tx, make_optimizer(config), scale_by_learning_rate_arg("lr"))}
    if not with_aux:
        return optax.multi_transform(transforms, ("params", None))
    transforms["aux"] = optax.chain(scale_by_row_adam(config), scale_by_learning_rate_arg("aux_lr"))
    return optax.multi_transform(transforms, ("params", "aux"))


def aux_table_size(aux: PyTree) -> int:
    """N, the leading axis every leaf of an aux table shares (one entry per prompt id)."""
    sizes = {x.shape[0] if x.ndim else None for x in jax.tree.leaves(aux)}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(
            f"every aux leaf needs the same leading axis (one entry per prompt id), got leading "
            f"sizes {sorted(sizes, key=str)}"
        )
    return sizes.pop()


def init_aux_opt_state(aux: PyTree) -> AuxAdamState:
    return AuxAdamState(
        count=jnp.zeros((aux_table_size(aux),), jnp.int32),
        mu=jax.tree.map(jnp.zeros_like, aux),
        nu=jax.tree.map(jnp.zeros_like, aux),
    )


def aux_rows_touched(prompt_id: Array, sample_mask: Array, size: int) -> Array:
    """[size] bool: the table rows a batch trains (prompt ids of its real rows)."""
    hits = jax.ops.segment_sum(sample_mask.astype(jnp.int32), prompt_id, num_segments=size)
    return hits > 0


def aux_adam_update(
    grads: PyTree, state: AuxAdamState, touched: Array, config: OptimizerConfig
) -> tuple[PyTree, AuxAdamState]:
    """(Adam direction, new state) for an aux table, stepping only the `touched` rows.

    Each row is its own Adam (b1, b2, eps of `config`; no weight decay: decay would pull log Z
    to 0) that moves only when its prompt is in the batch. Plain dense Adam over the table would
    keep moving rows absent from the batch on stale momentum, and bias-correct a row first seen
    at update 500 with the global count (a first step ~2x too large, then ~10 more in the same
    direction). A touched row's update equals `optax.scale_by_adam`'s at the row's own count.
    """
    b1, b2, eps = config.b1, config.b2, config.eps
    count = state.count + touched.astype(jnp.int32)
    n = jnp.maximum(count, 1).astype(jnp.float32)  # untouched rows at count 0 are masked out

    def per_row(x: Array, leaf: Array) -> Array:  # [N] -> broadcastable against leaf [N, ...]
        return x.reshape(x.shape + (1,) * (leaf.ndim - 1))

    def moment(decay: float, m: Array, g: Array) -> Array:
        return jnp.where(per_row(touched, g), decay * m + (1 - decay) * g, m)

    mu = jax.tree.map(lambda m, g: moment(b1, m, g), state.mu, grads)
    nu = jax.tree.map(lambda v, g: moment(b2, v, g * g), state.nu, grads)

    def direction(m: Array, v: Array) -> Array:
        m_hat = m / per_row(1 - b1**n, m).astype(m.dtype)
        v_hat = v / per_row(1 - b2**n, v).astype(v.dtype)
        return jnp.where(per_row(touched, m), m_hat / (jnp.sqrt(v_hat) + eps), 0.0).astype(m.dtype)

    return jax.tree.map(direction, mu, nu), AuxAdamState(count=count, mu=mu, nu=nu)


def scale_by_row_adam(config: OptimizerConfig) -> optax.GradientTransformationExtraArgs:
    """`aux_adam_update` as an optax transformation (state: `AuxAdamState`):
    `update(grads, state, params=None, touched=rows)` with `touched` [N] the rows the batch trains.

    optax's own Adam keeps one step count for the whole tree; a learned log Z table needs one per
    row (see `aux_adam_update`), hence this transformation.
    """

    def update(grads: PyTree, state: AuxAdamState, params: PyTree | None = None, *, touched: Array,
               **extra: Any) -> tuple[PyTree, AuxAdamState]:
        del params, extra
        return aux_adam_update(grads, state, touched, config)

    return optax.GradientTransformationExtraArgs(init_aux_opt_state, update)


def split_policy(model: nnx.Module, config: TrainerConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params) of a copy of `model` set to the trainer's precision.

    The copy's `config` gets dtype=compute_dtype and param_dtype=param_dtype, and its params are
    cast to param_dtype (e.g. bf16 checkpoint weights become fp32 master weights). The caller's
    model is left untouched. An abstract model (`nnx.eval_shape`) gives abstract params.
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise TypeError(
            "the trainer only handles models whose state is all nnx.Param; this model also holds "
            f"{sorted({type(v).__name__ for v in jax.tree.leaves(rest, is_leaf=_is_var)})}"
        )
    copy = nnx.merge(graphdef, params)
    cfg = getattr(copy, "config", None)
    if cfg is None or not dataclasses.is_dataclass(cfg):
        raise TypeError(f"expected a tbajax CausalLM with a `config` ModelConfig, got {type(model).__name__}")
    copy.config = dataclasses.replace(cfg, param_dtype=config.param_dtype, dtype=config.compute_dtype)
    graphdef, params = nnx.split(copy, nnx.Param)
    dtype = DTYPES[config.param_dtype]

    def cast(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
        return x.astype(dtype)

    return graphdef, jax.tree.map(cast, params)


def init_train_state(
    model: nnx.Module, config: TrainerConfig, mesh: Mesh | None = None, *, aux: PyTree | None = None
) -> tuple[nnx.GraphDef, TrainState]:
    """Split `model` and build step 0 of training (reference = a copy of the initial policy).

    aux: the objective's initial per-prompt table (`tbajax.training.initial_aux`), or None; it
    gets its own `AuxAdamState`. With `mesh`, every array is created directly in its target
    sharding (`state_shardings`; the aux table is replicated).
    """
    graphdef, params = split_policy(model, config)
    if aux is not None:
        aux_table_size(aux)  # one leading axis for all leaves, or a clear error
    build = functools.partial(
        _new_state, optimizer=config.optimizer, with_reference=config.compute_reference_logprobs
    )
    seed = jnp.asarray(config.seed, jnp.uint32)
    if mesh is None:
        return graphdef, _build_state(params, seed, aux, config.optimizer, config.compute_reference_logprobs)
    shardings = state_shardings(jax.eval_shape(build, params, seed, aux), mesh)
    params = jax.device_put(params, shardings.params)
    return graphdef, jax.jit(build, out_shardings=shardings)(params, seed, aux)


def abstract_train_state(
    model: nnx.Module, config: TrainerConfig, mesh: Mesh | None = None, *, aux: PyTree | None = None
) -> tuple[nnx.GraphDef, TrainState]:
    """(graphdef, state of ShapeDtypeStructs with shardings): a restore target, built for free.

    `model` may be abstract (`nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))`), so a
    restart never materialises a throwaway state. `aux` (concrete or abstract) as in
    `init_train_state`. Without a mesh, arrays go to the first device.
    """
    graphdef, params = split_policy(model, config)
    build = functools.partial(
        _new_state, optimizer=config.optimizer, with_reference=config.compute_reference_logprobs
    )
    abstract = jax.eval_shape(build, params, jax.ShapeDtypeStruct((), jnp.uint32), aux)
    if mesh is None:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: one, abstract)
    else:
        shardings = state_shardings(abstract, mesh)

    def attach(sharding: Any, sub: Any) -> Any:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), sub)

    return graphdef, jax.tree.map(attach, shardings, abstract)


def _new_state(
    params: nnx.State, seed: Array, aux: PyTree | None, optimizer: OptimizerConfig, with_reference: bool
) -> TrainState:
    # copies: the state is donated to the step, so it must not share buffers with the model
    return TrainState(
        params=jax.tree.map(jnp.copy, params),
        opt_state=make_trainable_optimizer(optimizer, aux is not None).init((params, aux)),
        ref_params=jax.tree.map(jnp.copy, params) if with_reference else None,
        step=jnp.zeros((), jnp.int32),
        rng=jax.random.PRNGKey(seed),
        aux=None if aux is None else jax.tree.map(jnp.copy, aux),
    )


_build_state = jax.jit(_new_state, static_argnums=(3, 4))


def state_shardings(state: Any, mesh: Mesh) -> Any:
    """NamedShardings for any pytree holding nnx Params (params, moments, reference).

    The result is a tree prefix of `state` (one sharding per Param node), as jit and device_put
    accept. Each Param is split by its `logical_axes` (tbajax.sharding rules); every other leaf (step,
    PRNG key, Adam's count) is replicated.
    """

    def one(x: Any) -> Any:
        if isinstance(x, nnx.Variable):
            axes = x.get_metadata().get("logical_axes")
            return named_sharding(axes, x.shape, mesh) if axes is not None else NamedSharding(mesh, P())
        return NamedSharding(mesh, P())

    return jax.tree.map(one, state, is_leaf=_is_var)


def abstract_state(state: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a concrete state: a restore target."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), state
    )


def reset_reference(state: TrainState, tx: optax.GradientTransformation, reset_moments: bool) -> TrainState:
    """The reference becomes a copy of the current policy (TBA′ every ρ steps).

    reset_moments re-initialises the optimizer state (`tx`, the state's `make_trainable_optimizer`:
    Adam moments and bias-correction count, the aux table's too: a new reference moves every log Z
    target), like building a fresh torch optimizer; the learning-rate schedule follows `step`, so
    it goes on. The aux table is kept. Under LoRA `params` are the adapters: the reference becomes
    base + a copy of them.
    """
    if state.ref_params is None:
        raise ValueError("this state keeps no reference params (compute_reference_logprobs=False)")
    new = dataclasses.replace(state, ref_params=jax.tree.map(jnp.copy, state.params))
    if not reset_moments:
        return new
    return dataclasses.replace(new, opt_state=tx.init((state.params, state.aux)))


def _is_var(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


# ---------------------------------------------------------------------------- LoRA


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraBase:
    """The frozen half of a LoRA run: the base params (trainer precision) and the adapter config.

    A pytree (config is static), so the step takes it as one argument. Also what the loss gets
    in place of the reference params (`frozen`), with `ref_adapters` = the state's reference
    adapters (None: the reference is the base with adapters disabled).
    """

    params: nnx.State
    config: LoraConfig = dataclasses.field(metadata=dict(static=True))
    ref_adapters: PyTree | None = None

    def policy(self, adapters: PyTree) -> nnx.State:
        """Effective params of the policy: W + (alpha/r)·A@B on every adapted weight."""
        return apply_lora(self.params, adapters, self.config)

    def reference(self) -> nnx.State:
        """The reference policy: the base itself until a reference reset copied the adapters."""
        return self.params if self.ref_adapters is None else self.policy(self.ref_adapters)


_ADAPTER_SEED = 0x10AA  # adapter init draws from its own stream of TrainerConfig.seed


def init_lora_train_state(
    model: nnx.Module,
    config: TrainerConfig,
    lora: LoraConfig,
    mesh: Mesh | None = None,
    *,
    aux: PyTree | None = None,
) -> tuple[nnx.GraphDef, LoraBase, TrainState]:
    """(graphdef, frozen base, step 0) of LoRA training: the state's params are fresh adapters
    (B = 0, so the policy equals the base exactly), optimised alone.

    The base is `model`'s params at the trainer's precision, not copied again (the caller's model
    keeps its own arrays; with `param_dtype` equal to the model's they are shared, which is safe:
    the base is never donated). A reference copy of the adapters is kept only when reference
    resets are configured; before the first reset it equals the base exactly.
    """
    graphdef, base = split_policy(model, config)
    if mesh is not None:
        base = jax.device_put(base, state_shardings(base, mesh))
    key = jax.random.fold_in(jax.random.PRNGKey(config.seed), _ADAPTER_SEED)
    adapters = init_lora(base, lora, key, DTYPES[config.param_dtype], mesh=mesh)
    if aux is not None:
        aux_table_size(aux)
    with_reference = config.compute_reference_logprobs and config.reference_reset_every is not None
    seed = jnp.asarray(config.seed, jnp.uint32)
    if mesh is None:
        state = _build_state(adapters, seed, aux, config.optimizer, with_reference)
    else:
        build = functools.partial(_new_state, optimizer=config.optimizer, with_reference=with_reference)
        shardings = state_shardings(jax.eval_shape(build, adapters, seed, aux), mesh)
        state = jax.jit(build, out_shardings=shardings)(adapters, seed, aux)
    return graphdef, LoraBase(base, lora), state


def policy_params(state: TrainState, lora: LoraBase | None) -> nnx.State:
    """The policy's effective params: `state.params` itself without LoRA (no copy), else the base
    with the adapters merged in (new arrays for the adapted weights only)."""
    if lora is None:
        return state.params
    return _merge(lora, state.params)


@jax.jit
def _merge(lora: LoraBase, adapters: PyTree) -> nnx.State:
    return lora.policy(adapters)
