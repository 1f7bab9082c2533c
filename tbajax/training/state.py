"""The functional train state and the pure functions that build and transform it.

The policy Module is split once (`nnx.split`) into a static graphdef and its Param state; only
states travel through `jax.jit` (plain jit over Modules loses tied weights, and re-traces the
graph). Params keep their `nnx.Param` wrappers, so the `logical_axes` metadata that decides their
sharding stays with them, and with the optimizer moments optax builds in their image.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tbajax.models.config import DTYPES
from tbajax.sharding import named_sharding
from tbajax.training.config import OptimizerConfig, TrainerConfig

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything a trainer step reads and writes; a pytree of arrays (checkpointed whole).

    step: number of updates applied so far (int32). rng: the run's base PRNG key, a raw uint32
    key (raw, not typed, so it saves and restores as a plain array); update u draws from
    `update_key(state)` = fold_in(rng, step), so a restored run continues the same stream
    without the key having to change. ref_params: the frozen reference policy, or None when
    reference log-probs come with the batch.
    """

    params: nnx.State
    opt_state: optax.OptState
    ref_params: nnx.State | None
    step: Array
    rng: Array


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
    model: nnx.Module, config: TrainerConfig, mesh: Mesh | None = None
) -> tuple[nnx.GraphDef, TrainState]:
    """Split `model` and build step 0 of training (reference = a copy of the initial policy).

    With `mesh`, every array is created directly in its target sharding (`state_shardings`).
    """
    graphdef, params = split_policy(model, config)
    build = functools.partial(
        _new_state, optimizer=config.optimizer, with_reference=config.compute_reference_logprobs
    )
    seed = jnp.asarray(config.seed, jnp.uint32)
    if mesh is None:
        return graphdef, _build_state(params, seed, config.optimizer, config.compute_reference_logprobs)
    shardings = state_shardings(jax.eval_shape(build, params, seed), mesh)
    params = jax.device_put(params, shardings.params)
    return graphdef, jax.jit(build, out_shardings=shardings)(params, seed)


def abstract_train_state(
    model: nnx.Module, config: TrainerConfig, mesh: Mesh | None = None
) -> tuple[nnx.GraphDef, TrainState]:
    """(graphdef, state of ShapeDtypeStructs with shardings): a restore target, built for free.

    `model` may be abstract (`nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))`), so a
    restart never materialises a throwaway state. Without a mesh, arrays go to the first device.
    """
    graphdef, params = split_policy(model, config)
    build = functools.partial(
        _new_state, optimizer=config.optimizer, with_reference=config.compute_reference_logprobs
    )
    abstract = jax.eval_shape(build, params, jax.ShapeDtypeStruct((), jnp.uint32))
    if mesh is None:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: one, abstract)
    else:
        shardings = state_shardings(abstract, mesh)

    def attach(sharding: Any, sub: Any) -> Any:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), sub)

    return graphdef, jax.tree.map(attach, shardings, abstract)


def _new_state(
    params: nnx.State, seed: Array, optimizer: OptimizerConfig, with_reference: bool
) -> TrainState:
    # copies: the state is donated to the step, so it must not share buffers with the model
    return TrainState(
        params=jax.tree.map(jnp.copy, params),
        opt_state=make_optimizer(optimizer).init(params),
        ref_params=jax.tree.map(jnp.copy, params) if with_reference else None,
        step=jnp.zeros((), jnp.int32),
        rng=jax.random.PRNGKey(seed),
    )


_build_state = jax.jit(_new_state, static_argnums=(2, 3))


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

    reset_moments re-initialises the optimizer state (Adam moments and bias-correction count),
    like building a fresh torch optimizer; the learning-rate schedule follows `step`, so it goes on.
    """
    if state.ref_params is None:
        raise ValueError("this state keeps no reference params (compute_reference_logprobs=False)")
    opt_state = tx.init(state.params) if reset_moments else state.opt_state
    return dataclasses.replace(state, ref_params=jax.tree.map(jnp.copy, state.params), opt_state=opt_state)


def _is_var(x: Any) -> bool:
    return isinstance(x, nnx.Variable)
