"""Device meshes and the one table that maps logical axis names to mesh axes.

Every parameter carries `logical_axes` metadata (e.g. ("layers", "embed", "mlp")); activations
name theirs at the few places the model constrains them. `LOGICAL_RULES` is the only place that
decides which mesh axis each logical axis is split over. A dimension is left unsplit when the
mesh axis does not divide it (e.g. 2 KV heads on a 4-way tensor axis): that is a replication,
never a change in the math.

jax is imported inside the functions: `MeshConfig` is part of the experiment config, which the
launcher reads without importing jax.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import jax
    from jax.sharding import Mesh, NamedSharding

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axes it is split over (in order); None = replicated.
LOGICAL_RULES: dict[str, tuple[str, ...] | None] = {
    # parameters
    "vocab": ("tensor",),
    "embed": ("fsdp",),
    "q_heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "experts": None,  # a mixture-of-experts layer's experts: each device holds all (no expert parallelism)
    "head_dim": None,
    "layers": None,
    "norm": None,
    # activations
    "batch": ("data", "fsdp"),
    "length": None,
    "act_embed": None,
    "act_heads": ("tensor",),
    "act_vocab": ("tensor",),
}


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh shape; -1 on one axis means "all remaining devices"."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    def shape(self, num_devices: int) -> tuple[int, int, int]:
        dims = [self.data, self.fsdp, self.tensor]
        if dims.count(-1) > 1:
            raise ValueError(f"at most one mesh axis may be -1, got {self}")
        known = math.prod(d for d in dims if d != -1)
        if any(d == 0 or d < -1 for d in dims):
            raise ValueError(f"mesh axis sizes must be positive or -1, got {self}")
        if -1 in dims:
            if num_devices % known:
                raise ValueError(f"{num_devices} devices cannot be split into mesh {self}")
            dims[dims.index(-1)] = num_devices // known
        if math.prod(dims) != num_devices:
            raise ValueError(
                f"mesh {dict(zip(MESH_AXES, dims))} needs {math.prod(dims)} devices, "
                f"this process has {num_devices}"
            )
        return tuple(dims)  # type: ignore[return-value]


def make_mesh(config: MeshConfig = MeshConfig(), devices: Sequence[Any] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh with Auto axes (GSPMD propagation) over `devices`."""
    import jax
    from jax.sharding import AxisType, Mesh
    devices = list(devices if devices is not None else jax.devices())
    shape = config.shape(len(devices))
    return Mesh(
        np.asarray(devices, dtype=object).reshape(shape),
        MESH_AXES,
        axis_types=(AxisType.Auto,) * len(MESH_AXES),
    )


def logical_to_spec(
    logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh
) -> jax.sharding.PartitionSpec:
    """PartitionSpec for an array of `shape` whose dims are named `logical_axes`."""
    from jax.sharding import PartitionSpec as P
    if len(logical_axes) != len(shape):
        raise ValueError(f"logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}")
    used: set[str] = set()
    spec: list[Any] = []
    for name, dim in zip(logical_axes, shape):
        if name is not None and name not in LOGICAL_RULES:
            raise KeyError(f"logical axis {name!r} has no rule in LOGICAL_RULES")
        candidates = LOGICAL_RULES[name] or () if name is not None else ()
        # keep the longest run of (unused, non-trivial) mesh axes whose product divides the dim
        kept: list[str] = []
        for a in candidates:
            size = mesh.shape.get(a, 1)
            if size == 1 or a in used:
                continue
            if dim % (math.prod(mesh.shape[k] for k in kept) * size):
                break
            kept.append(a)
        used.update(kept)
        spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return P(*spec)


def named_sharding(logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh) -> NamedSharding:
    from jax.sharding import NamedSharding
    return NamedSharding(mesh, logical_to_spec(logical_axes, shape, mesh))


def fsdp_as_tensor(mesh: Mesh) -> Mesh:
    """The same devices as a (data, 1, fsdp x tensor) mesh: the fsdp devices of each data row
    become more tensor shards. A sampler on it splits every weight as a tensor axis does (by heads,
    MLP columns, vocabulary), so each device holds weights / (fsdp x tensor) and reads only its
    own, where a mesh split over fsdp would gather them whole (`rollout.fsdp_weights=tensor`)."""
    from jax.sharding import Mesh
    d, f, t = (mesh.shape[a] for a in MESH_AXES)
    return Mesh(mesh.devices.reshape(d, 1, f * t), MESH_AXES, axis_types=mesh.axis_types)


def replicated_over(sharding: NamedSharding, axis: str) -> NamedSharding:
    """`sharding` with mesh axis `axis` dropped from its spec: the same split over the other axes,
    each shard held whole by every device along `axis`."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    def drop(entry: Any) -> Any:
        kept = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a != axis)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return NamedSharding(sharding.mesh, P(*(drop(e) for e in sharding.spec)))


def devices_in_context() -> int:
    """How many devices the mesh in context spans (1 with no mesh)."""
    import jax
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh is None or mesh.empty else math.prod(mesh.shape.values())


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """Sharding hint for an activation inside jit; a no-op when no mesh is in context."""
    import jax
    if devices_in_context() == 1:
        return x
    mesh = jax.sharding.get_abstract_mesh()
    return jax.lax.with_sharding_constraint(x, logical_to_spec(logical_axes, x.shape, mesh))


def batch_shards(rows: int) -> int:
    """How many devices the mesh in context splits a batch of `rows` over (1 with no mesh)."""
    import jax
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return 1
    axes = logical_to_spec(("batch",), (rows,), mesh)[0]
    if axes is None:
        return 1
    return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))


def over_batch_shards(fn: Callable[..., Any], *xs: Any) -> Any:
    """fn(*xs) for row-wise fn, each batch shard of the mesh in context running it on its own rows
    (xs: arrays whose first axis is the batch, as fn's outputs). For ops whose partitioning XLA
    does not split by rows: on CPU, `lax.top_k` of batch-sharded logits all-gathers the whole
    batch onto every device and runs it there. Without a mesh or batch shards: fn(*xs)."""
    import jax
    from jax.sharding import PartitionSpec as P
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return fn(*xs)
    axes = logical_to_spec(("batch",), (xs[0].shape[0],), mesh)[0]
    if axes is None:
        return fn(*xs)
    return jax.shard_map(fn, in_specs=P(axes), out_specs=P(axes))(*xs)


def along_rows(x: Any, index: Any) -> Any:
    """x[b, index[b, j]] for x [B, T, ...] and index [B, S] -> [B, S, ...]: a gather whose rows are
    a batch dim of the gather, so a mesh splits it row by row. Written x[arange(B)[:, None], index],
    the row number is one more index to XLA's partitioner, which then gathered every row of a
    batch-sharded x (a train step's hidden states) onto every device."""
    import jax.numpy as jnp
    return jnp.take_along_axis(x, index.reshape(*index.shape, *(1,) * (x.ndim - 2)), axis=1)


def shard_rows(rows: Any, shard: Any, per_shard: int) -> Any:
    """Global row indices -> those of the shard `shard` of `per_shard` rows (inside
    `within_batch_shards`); rows of other shards (and padding) -> per_shard: out of range."""
    import jax.numpy as jnp
    local = rows - shard * per_shard
    return jnp.where((local >= 0) & (local < per_shard), local, per_shard)


def within_batch_shards(fn: Callable[..., Any], args: Sequence[tuple[Any, Sequence[str | None]]],
                        out_axes: Sequence[Sequence[str | None]]) -> Any:
    """fn(shard, *xs), each device running it on its own shards of xs (given with their logical
    axes; outputs named by `out_axes`, one per output of the tuple fn returns), `shard` being the
    device's index along the batch axes (0 without a mesh). For row tables that hold global row
    indices (a prompt pool's): fn maps them to the shard's own rows, where XLA would gather the
    rows of every device onto every device to index them. Every "batch" dim must be split alike."""
    import jax
    from jax.sharding import PartitionSpec as P
    xs = [x for x, _ in args]
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return fn(0, *xs)
    in_specs = tuple(logical_to_spec(axes, x.shape, mesh) for x, axes in args)
    shapes = jax.eval_shape(lambda *a: fn(0, *a), *xs)
    if len(shapes) != len(out_axes):
        raise ValueError(f"within_batch_shards: fn returns {len(shapes)} outputs, out_axes names {len(out_axes)}")
    out_specs = tuple(logical_to_spec(axes, s.shape, mesh) for s, axes in zip(shapes, out_axes))
    named = [*zip(in_specs, (axes for _, axes in args)), *zip(out_specs, out_axes)]
    split = {spec[i] for spec, axes in named for i, name in enumerate(axes) if name == "batch"}
    if len(split) != 1:
        raise ValueError(f"the batch dims of within_batch_shards' arrays are split differently: {split}")
    (batch,) = split

    def local(*a: Any) -> Any:
        return fn(0 if batch is None else jax.lax.axis_index(batch), *a)

    return jax.shard_map(local, in_specs=in_specs, out_specs=out_specs)(*xs)


def param_shardings(abstract_state: Any, mesh: Mesh) -> Any:
    """Map an nnx State of Params (abstract or concrete) to NamedShardings by their metadata."""
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    def one(var: Any) -> Any:
        axes = var.get_metadata().get("logical_axes")
        if axes is None:
            return NamedSharding(mesh, P())
        return named_sharding(axes, var.shape, mesh)

    return jax.tree.map(one, abstract_state, is_leaf=lambda v: isinstance(v, nnx.Variable))


def spans_processes(mesh: Mesh) -> bool:
    """Whether some of `mesh`'s devices belong to other processes (a multi-process mesh)."""
    import jax
    return any(d.process_index != jax.process_index() for d in mesh.devices.flat)


def host_to_global(tree: Any, shardings: Any) -> Any:
    """A tree of host (numpy) arrays, identical on every process, as global jax.Arrays in
    `shardings` (a matching tree or tree prefix): each process materialises only the shards of
    its own devices. jit refuses host arrays for a sharding that spans processes; arrays that
    are already jax.Arrays pass through unchanged."""
    import jax

    def one(sharding: Any, x: Any) -> Any:
        if x is None or isinstance(x, jax.Array):
            return x
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    return jax.tree.map(one, shardings, tree, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))
