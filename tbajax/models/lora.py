"""LoRA as a pure transform over a model's param state, for any model family.

For each selected weight W (stacked over a leading "layers" axis, possibly [in, heads, head_dim] or
[heads, head_dim, out]) the effective weight is

    W_eff = W + (alpha / r) * A @ B,   A: [..., in, r], B: [..., r, out]

with the input/output split of W read from its `logical_axes` (see `split_axes`), A initialised
as PEFT does (Kaiming-uniform) and B at zero, so at init the model equals its base exactly.

Nothing here touches a Module's structure: `apply_lora(params, adapters, cfg)` maps an
`nnx.State` of base params to one with effective weights, so a training loss can close over the
frozen base and differentiate w.r.t. the adapters alone (`jax.grad(loss)(adapters)`), and the
reference policy is just the base params (no second copy). Adapter leaves are `nnx.Param`s with
logical axes, so they shard with the same rules as the weights they modify.

Export: `merge_lora` gives an ordinary model (save it with `save_model` / `save_encoder`),
`save_peft_adapter` writes `adapter_config.json` + `adapter_model.safetensors` that
`peft.PeftModel.from_pretrained` loads onto the torch base model, and `load_peft_adapter` reads
such a directory (also one PEFT itself saved) back into adapters.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from tbajax.models.safetensors_io import SafetensorsReader, write_safetensors
from tbajax.models.lora_config import LoraConfig, LoraDropoutError  # noqa: F401 - re-exported
from tbajax.sharding import named_sharding

Array = jax.Array
Adapters = dict[str, dict[str, nnx.Param]]  # dotted weight name -> {"a": Param, "b": Param}
PEFT_PREFIX = "base_model.model."


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """How one weight splits: leading batch axes ("layers"), then input axes, then output axes."""

    name: str
    shape: tuple[int, ...]
    batch_axes: tuple[str, ...]
    in_axes: tuple[str | None, ...]
    out_axes: tuple[str | None, ...]

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return self.shape[: len(self.batch_axes)]

    @property
    def in_shape(self) -> tuple[int, ...]:
        n = len(self.batch_axes)
        return self.shape[n : n + len(self.in_axes)]

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.shape[len(self.shape) - len(self.out_axes) :]

    @property
    def fan_in(self) -> int:
        return math.prod(self.in_shape)

    @property
    def fan_out(self) -> int:
        return math.prod(self.out_shape)


def split_axes(name: str, logical_axes: tuple[str | None, ...]) -> tuple[tuple[str, ...], tuple, tuple]:
    """(batch, in, out) logical axes of a weight.

    Every projection in our families is an einsum that contracts the leading axes after
    "layers": the model-width axis "embed" is the input when it comes first (q/k/v, gate/up, lm_head)
    and the output when it comes last (o_proj [heads, head_dim, embed], down_proj [mlp, embed]).
    """
    axes = tuple(logical_axes)
    # stacked layers, and a mixture of experts' experts: each its own pair (A, B) per expert
    lead = 2 if axes[:2] == ("layers", "experts") else int(axes[:1] in (("layers",), ("experts",)))
    batch = axes[:lead]
    rest = axes[len(batch) :]
    if len(rest) < 2:
        raise ValueError(
            f"LoRA target {name!r} has axes {axes}: only matrices (projections) can take adapters"
        )
    if rest[0] == "vocab":
        raise ValueError(
            f"LoRA target {name!r} is an embedding table {axes}; embedding adapters are not implemented"
        )
    if rest[0] == "embed":
        return batch, rest[:1], rest[1:]
    if rest[-1] == "embed":
        return batch, rest[:-1], rest[-1:]
    raise ValueError(
        f"LoRA target {name!r} has axes {axes}: cannot tell its input from its output axes "
        "(expected 'embed' first or last)"
    )


def _is_var(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _dotted(path: tuple[Any, ...]) -> str:
    return ".".join(str(getattr(k, "key", k)) for k in path)


def _flat(params: Any) -> list[tuple[str, nnx.Variable]]:
    leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_var)[0]
    return [(_dotted(p), v) for p, v in leaves]


def _matches(name: str, pattern: str) -> bool:
    return name.rsplit(".", 1)[-1] == pattern or fnmatch.fnmatchcase(name, pattern)


def lora_specs(params: Any, config: LoraConfig) -> dict[str, LoraSpec]:
    """The weights `config.targets` selects in `params` (an nnx.State of Params), with their split."""
    flat = _flat(params)
    specs: dict[str, LoraSpec] = {}
    for pattern in config.targets:
        hits = [(n, v) for n, v in flat if _matches(n, pattern)]
        if not hits:
            names = sorted(n for n, v in flat if len(v.shape) >= 2)
            raise ValueError(f"LoRA target {pattern!r} matches no weight; weights: {names}")
        for name, var in hits:
            axes = var.get_metadata().get("logical_axes")
            if axes is None:
                raise ValueError(f"LoRA target {name!r} has no logical_axes metadata to split it by")
            batch, ins, outs = split_axes(name, axes)
            specs[name] = LoraSpec(name, tuple(var.shape), batch, ins, outs)
    return specs


def init_lora(
    params: Any, config: LoraConfig, key: Array, dtype: Any = None, *, mesh: Mesh | None = None
) -> Adapters:
    """Adapters for `params`: A ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (PEFT's Kaiming-uniform
    default), B = 0. dtype defaults to each base weight's dtype. With `mesh`, every adapter is
    created directly in the sharding its logical axes give (the weight's own rules). Works on
    abstract params too (under `jax.eval_shape`)."""
    base = dict(_flat(params))
    specs = sorted(lora_specs(params, config).items())
    dtypes = [np.dtype(dtype or base[name].dtype) for name, _ in specs]

    def arrays(key: Array) -> list[tuple[Array, Array]]:
        # one uniform draw cut into pieces: a single RNG kernel however many adapters there are
        shapes = [(*s.batch_shape, *s.in_shape, config.rank) for _, s in specs]
        u = jax.random.uniform(key, (sum(math.prod(sh) for sh in shapes),), jnp.float32, -1.0, 1.0)
        out, start = [], 0
        for (_, s), sh, dt in zip(specs, shapes, dtypes):
            a = u[start : start + math.prod(sh)].reshape(sh) / math.sqrt(s.fan_in)
            start += math.prod(sh)
            out.append((a.astype(dt), jnp.zeros((*s.batch_shape, config.rank, *s.out_shape), dt)))
        return out

    axes = [
        ((*s.batch_axes, *s.in_axes, None), (*s.batch_axes, None, *s.out_axes)) for _, s in specs
    ]
    shardings = None
    if mesh is not None:
        shapes = jax.eval_shape(arrays, key)
        shardings = [
            (named_sharding(ax_a, a.shape, mesh), named_sharding(ax_b, b.shape, mesh))
            for (ax_a, ax_b), (a, b) in zip(axes, shapes)
        ]
    # one compile for all adapters (eager RNG would compile once per shape)
    made = jax.jit(arrays, out_shardings=shardings)(key)
    return {
        name: {"a": nnx.Param(a, logical_axes=ax_a), "b": nnx.Param(b, logical_axes=ax_b)}
        for (name, _), (a, b), (ax_a, ax_b) in zip(specs, made, axes)
    }


def lora_delta(spec: LoraSpec, a: Array, b: Array, scale: float) -> Array:
    """scale * A @ B in the weight's own shape (fp32)."""
    nb = len(spec.batch_shape)
    a2 = a.astype(jnp.float32).reshape(*spec.batch_shape, spec.fan_in, a.shape[-1])
    b2 = b.astype(jnp.float32).reshape(*spec.batch_shape, b.shape[nb], spec.fan_out)
    return (scale * jnp.matmul(a2, b2)).reshape(spec.shape)


def apply_lora(params: Any, adapters: Adapters, config: LoraConfig) -> Any:
    """`params` (nnx.State) with W + (alpha/r)·A@B for every adapted weight; a pure function, safe
    under jit/grad. An adapter whose weight is missing (or a target without adapter) is an error."""
    specs = lora_specs(params, config)
    if set(specs) != set(adapters):
        raise ValueError(
            f"adapters cover {sorted(adapters)} but the config targets {sorted(specs)}; "
            "build them with init_lora(params, config, key) for this model"
        )
    flat, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_var)

    def one(path: tuple[Any, ...], var: nnx.Variable) -> nnx.Variable:
        name = _dotted(path)
        if name not in adapters:
            return var
        pair = adapters[name]
        w = var[...]
        delta = lora_delta(specs[name], pair["a"][...], pair["b"][...], config.scale)
        return var.replace((w.astype(jnp.float32) + delta).astype(w.dtype))

    return jax.tree_util.tree_unflatten(treedef, [one(p, v) for p, v in flat])


def merge_lora(model: nnx.Module, adapters: Adapters, config: LoraConfig) -> nnx.Module:
    """A new model whose weights have the adapters folded in (export it as a plain checkpoint)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return nnx.merge(graphdef, apply_lora(params, adapters, config), rest)


def adapter_arrays(adapters: Adapters) -> dict[str, dict[str, Array]]:
    """The adapters as a pure pytree of arrays (what a param store publishes)."""
    return {n: {k: v[...] for k, v in pair.items()} for n, pair in adapters.items()}


def adapter_nbytes(adapters: Any) -> int:
    """Bytes of all adapter leaves (Params or plain arrays, concrete or abstract)."""
    leaves = jax.tree.leaves(adapters, is_leaf=_is_var)
    return sum(math.prod(v.shape) * np.dtype(v.dtype).itemsize for v in leaves)


# ---------------------------------------------------------------------------- publishing adapters
# A trainer that publishes only the adapters writes `adapter_arrays` plus `adapter_manifest` (in
# the param store's version manifest); a searcher checks the manifest against its resident base
# (`check_adapter_manifest`), loads the arrays into `adapter_template` and merges them once.

ADAPTER_KIND = "lora_adapters"


def adapter_manifest(params: Any, config: LoraConfig) -> dict[str, Any]:
    """JSON description of adapters for `params`: the LoRA config and the shape of every adapted
    weight, so a searcher with another base is refused with names, not a shape error in a matmul."""
    return {
        "kind": ADAPTER_KIND,
        "lora": {"rank": config.rank, "alpha": config.alpha, "targets": list(config.targets)},
        "weights": {n: list(s.shape) for n, s in sorted(lora_specs(params, config).items())},
    }


def check_adapter_manifest(meta: dict[str, Any], params: Any, *, where: str = "published adapters") -> LoraConfig:
    """The LoraConfig of `meta` (from `adapter_manifest`) after checking that the adapters fit the
    base `params`: every adapted weight present with the same shape. ValueError saying what differs."""
    if meta.get("kind") != ADAPTER_KIND:
        raise ValueError(f"{where}: not LoRA adapters (kind {meta.get('kind')!r})")
    lora = meta["lora"]
    config = LoraConfig(rank=int(lora["rank"]), alpha=float(lora["alpha"]), targets=tuple(lora["targets"]))
    try:
        mine = {n: list(s.shape) for n, s in lora_specs(params, config).items()}
    except ValueError as e:
        raise ValueError(
            f"{where} target weights this base does not have ({e}); load the base they were trained on"
        ) from None
    theirs = meta["weights"]
    if mine != theirs:
        diff = sorted(n for n in set(mine) | set(theirs) if mine.get(n) != theirs.get(n))
        shown = ", ".join(f"{n}: trained on {theirs.get(n)}, here {mine.get(n)}" for n in diff[:4])
        raise ValueError(
            f"{where} were trained on a different base model ({shown}); give this process the "
            "model.checkpoint the trainer adapted"
        )
    return config


def adapter_template(params: Any, config: LoraConfig, dtype: Any = jnp.float32) -> dict[str, dict[str, Any]]:
    """ShapeDtypeStructs of `adapter_arrays` for `params` (what a searcher restores into)."""
    out = {}
    for name, s in sorted(lora_specs(params, config).items()):
        out[name] = {
            "a": jax.ShapeDtypeStruct((*s.batch_shape, *s.in_shape, config.rank), dtype),
            "b": jax.ShapeDtypeStruct((*s.batch_shape, config.rank, *s.out_shape), dtype),
        }
    return out


# ---------------------------------------------------------------------------- PEFT export
# Coupling with the per-family HF name tables (tbajax.models.hf for decoders,
# tbajax.models.encoders for BERT/RoBERTa): adapt `_hf_modules` when those tables move.


def _hf_modules(model: nnx.Module) -> tuple[str, dict[str, tuple[str, Any]]]:
    """(PEFT task type, our weight name -> (HF weight name with {i}, to_hf layout fn taking
    (array, config)))."""
    from tbajax.models.encoders import Encoder, hf_mappings as encoder_mappings

    if isinstance(model, Encoder):
        if model.config.head != "none":
            raise NotImplementedError(
                "PEFT export of a classifier needs PEFT's modules_to_save for the head; export the "
                "merged model (merge_lora + save_encoder) instead"
            )
        table = encoder_mappings(model.config)
        return "FEATURE_EXTRACTION", {n: (m.hf_name, m.to_hf) for n, m in table.items()}
    from tbajax.models import hf

    return "CAUSAL_LM", {n: (m.hf_name, m.to_hf) for n, m in hf._mappings(model.config).items()}


def _hf_row_order(to_hf: Any, spec: LoraSpec, config: Any) -> np.ndarray:
    """Where each row of the HF [out, in] weight comes from among our flattened outputs: HF row r
    is our output order[r] (the identity for a plain Linear; Phi-3's qkv_proj, held per KV head,
    reorders them). A layout that moves inputs too cannot carry a LoRA pair and is refused."""
    fan_in, fan_out = spec.fan_in, spec.fan_out
    # probe value i * fan_out + o: our input i, output o
    probe = np.arange(fan_in * fan_out, dtype=np.float64).reshape(spec.shape[len(spec.batch_shape):])
    hf = np.asarray(to_hf(probe, config))
    order = (hf[:, 0] % fan_out).astype(np.int64) if hf.shape == (fan_out, fan_in) else None
    if order is None or not np.array_equal(hf, order[:, None] + fan_out * np.arange(fan_in)[None, :]):
        raise NotImplementedError(f"{spec.name}: its HF layout moves its inputs, not only its output rows; "
                                  "PEFT export unsupported")
    return order


def _expert_parameter(name: str, hf_name: str) -> str:
    """The HF parameter (with {i}) of adapted experts that PEFT can adapt as `target_parameters`:
    one [E, in, out] tensor for all experts (GPT-OSS's); experts held one tensor each are refused."""
    if "{j}" in hf_name or hf_name.endswith(".weight"):
        raise NotImplementedError(
            f"{name}: adapters on experts that the checkpoint holds one tensor per expert ({hf_name}) have "
            "no PEFT form here; export the merged model (python -m tbajax.export without --peft)")
    return hf_name


def _peft_expert_layout(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One layer's expert adapters A [E, in, r], B [E, r, out] as PEFT's `ParamWrapper` holds them:
    lora_A [E r, in] expert-major, lora_B [out, r E] rank-major (delta_e = A_e B_e alike)."""
    e, fan_in, r = a.shape
    return (np.ascontiguousarray(a.transpose(0, 2, 1).reshape(e * r, fan_in)),
            np.ascontiguousarray(b.transpose(2, 1, 0).reshape(b.shape[-1], r * e)))


def _nesting(parameters: list[str]) -> dict[str, str]:
    """PEFT wraps each targeted parameter of a module in its own layer, in the order the module
    registers its parameters, the first innermost: its key path goes through one `base_layer` per
    wrapper above it. `parameters` in that order (the family's HF name table lists them so)."""
    out = {}
    for p in parameters:
        module = p.rsplit(".", 1)[0]
        same_module = [q for q in parameters if q.rsplit(".", 1)[0] == module]
        out[p] = ".base_layer" * (len(same_module) - 1 - same_module.index(p))
    return out


def peft_tensors(
    model: nnx.Module, adapters: Adapters, config: LoraConfig
) -> tuple[str, dict[str, np.ndarray], list[str], list[str]]:
    """(task type, PEFT state dict with [r, in] lora_A / [out, r] lora_B, target module suffixes,
    target parameter suffixes: adapted experts, PEFT's `ParamWrapper` layout)."""
    task, table = _hf_modules(model)
    specs = lora_specs(nnx.state(model, nnx.Param), config)
    tensors: dict[str, np.ndarray] = {}
    modules: set[str] = set()
    experts = {_expert_parameter(n, hf_name): n for n, (hf_name, _) in table.items()
               if n in adapters and "experts" in specs[n].batch_axes}
    nesting = _nesting(list(experts))
    for hf_name, name in experts.items():
        a = np.asarray(jax.device_get(adapters[name]["a"][...]), np.float32)
        b = np.asarray(jax.device_get(adapters[name]["b"][...]), np.float32)
        module = hf_name.rsplit(".", 1)[0] + nesting[hf_name]
        for i in range(a.shape[0]):
            tensors[f"{PEFT_PREFIX}{module.format(i=i)}.lora_A.weight"], \
                tensors[f"{PEFT_PREFIX}{module.format(i=i)}.lora_B.weight"] = _peft_expert_layout(a[i], b[i])
    for name, pair in sorted(adapters.items()):
        s = specs[name]
        hf_name, to_hf = table[name]
        if "experts" in s.batch_axes:
            continue
        if not hf_name.endswith(".weight"):
            raise NotImplementedError(f"{name} maps to {hf_name!r}, not a Linear weight PEFT can adapt")
        # PEFT's layout is HF's [out, in]: our weight flattened to [in, out], transposed, its rows in
        # HF's order (lora_B's rows follow them; lora_A's columns are the inputs, in order)
        order = _hf_row_order(to_hf, s, model.config)
        a = np.asarray(jax.device_get(pair["a"][...]), np.float32).reshape(*s.batch_shape, s.fan_in, -1)
        b = np.asarray(jax.device_get(pair["b"][...]), np.float32).reshape(*s.batch_shape, -1, s.fan_out)
        module = hf_name[: -len(".weight")]
        layers = range(s.batch_shape[0]) if s.batch_shape else [None]
        for i in layers:
            path = module.format(i=i)
            ai, bi = (a[i], b[i]) if i is not None else (a, b)
            tensors[f"{PEFT_PREFIX}{path}.lora_A.weight"] = np.ascontiguousarray(ai.T)
            tensors[f"{PEFT_PREFIX}{path}.lora_B.weight"] = np.ascontiguousarray(bi.T[order])
        # PEFT matches target_modules as key suffixes: use the module path after the layer index
        modules.add(module.split("{i}.", 1)[-1])
    return task, tensors, sorted(modules), [p.split("{i}.", 1)[-1] for p in experts]


def save_peft_adapter(
    directory: str | os.PathLike[str],
    model: nnx.Module,
    adapters: Adapters,
    config: LoraConfig,
    *,
    base_model_name_or_path: str | None = None,
) -> Path:
    """Write a PEFT LoRA adapter dir (adapter_config.json + adapter_model.safetensors) for the
    torch twin of `model`, loadable with `peft.PeftModel.from_pretrained(base, directory)`."""
    task, tensors, modules, parameters = peft_tensors(model, adapters, config)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    write_safetensors(directory / "adapter_model.safetensors", tensors)
    peft_config = {
        "peft_type": "LORA",
        "task_type": task,
        "base_model_name_or_path": base_model_name_or_path,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": modules,
        "target_parameters": parameters or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
    (directory / "adapter_config.json").write_text(json.dumps(peft_config, indent=2))
    return directory


def load_peft_adapter(
    directory: str | os.PathLike[str], model: nnx.Module, *, mesh: Mesh | None = None
) -> tuple[LoraConfig, Adapters]:
    """Read a PEFT LoRA adapter dir (ours or `PeftModel.save_pretrained`'s) for `model`'s family
    into (LoraConfig, adapters). Refuses PEFT options that change the math (rsLoRA, DoRA, biases,
    per-module ranks, extra saved modules). lora_dropout only acts in PEFT training and is not
    carried over (our LoRA has none)."""
    directory = Path(directory)
    meta = json.loads((directory / "adapter_config.json").read_text())
    if meta.get("peft_type") != "LORA":
        raise ValueError(
            f"{directory}: peft_type={meta.get('peft_type')!r}, only 'LORA' adapters are read"
        )
    for key, neutral in (
        ("use_rslora", False),
        ("use_dora", False),
        ("bias", "none"),
        ("fan_in_fan_out", False),
        ("modules_to_save", None),
        ("rank_pattern", {}),
        ("alpha_pattern", {}),
        ("layers_to_transform", None),
    ):
        if meta.get(key, neutral) not in (neutral, None):
            raise NotImplementedError(
                f"{directory}/adapter_config.json sets {key}={meta[key]!r}; not supported"
            )
    found_files = sorted(p.name for p in directory.glob("*.safetensors"))
    if found_files != ["adapter_model.safetensors"]:
        raise ValueError(
            f"{directory} should hold exactly one adapter_model.safetensors (found {found_files}); "
            "keep each PEFT adapter in its own directory"
        )
    reader = SafetensorsReader(directory)
    tensors = {k: reader.get(k) for k in reader.keys()}
    _, table = _hf_modules(model)
    rank = int(meta["r"])
    targets, found = [], {}
    for name, (hf_name, _) in table.items():
        module = hf_name[: -len(".weight")] if hf_name.endswith(".weight") else None
        if module is None or "{j}" in module:  # one tensor per expert: no PEFT form (`_expert_parameter`)
            continue
        layered = "{i}" in module
        first = f"{PEFT_PREFIX}{module.format(i=0) if layered else module}.lora_A.weight"
        if first in tensors:
            targets.append(name)
            found[name] = module
    # adapted experts (PEFT's target_parameters), in the order their module registers them
    wanted = set(meta.get("target_parameters") or ())
    experts = {hf_name: name for name, (hf_name, _) in table.items()
               if hf_name.split("{i}.", 1)[-1] in wanted}
    if len(experts) != len(wanted):
        raise ValueError(f"{directory}: target_parameters {sorted(wanted)} are not all parameters of this "
                         f"{type(model).__name__}'s experts ({sorted(experts)})")
    targets += list(experts.values())
    if not targets:
        raise ValueError(f"{directory}: no lora_A tensor matches a weight of this {type(model).__name__}")
    config = LoraConfig(rank=rank, alpha=float(meta["lora_alpha"]), targets=tuple(targets))
    specs = lora_specs(nnx.state(model, nnx.Param), config)
    dtypes = {n: v.dtype for n, v in _flat(nnx.state(model, nnx.Param))}
    adapters: Adapters = {}
    used: set[str] = set()

    def adapter_pair(name: str, a_host: np.ndarray, b_host: np.ndarray) -> dict[str, nnx.Param]:
        s, pair = specs[name], {}
        for key, host, ax in (
            ("a", a_host, (*s.batch_axes, *s.in_axes, None)),
            ("b", b_host, (*s.batch_axes, None, *s.out_axes)),
        ):
            host = np.ascontiguousarray(host).astype(dtypes[name])
            value = jax.device_put(host, named_sharding(ax, host.shape, mesh)) if mesh else jnp.asarray(host)
            pair[key] = nnx.Param(value, logical_axes=ax)
        return pair

    nesting = _nesting(list(experts))
    for hf_name, name in experts.items():
        s = specs[name]
        layers_, n_experts = s.batch_shape
        a_list, b_list = [], []
        for i in range(layers_):
            path = PEFT_PREFIX + hf_name.rsplit(".", 1)[0].format(i=i) + nesting[hf_name]
            a, b = tensors[path + ".lora_A.weight"], tensors[path + ".lora_B.weight"]
            if a.shape != (n_experts * rank, s.fan_in) or b.shape != (s.fan_out, rank * n_experts):
                raise ValueError(f"{path}: lora_A {a.shape} / lora_B {b.shape}, expected "
                                 f"{(n_experts * rank, s.fan_in)} / {(s.fan_out, rank * n_experts)}")
            used |= {path + ".lora_A.weight", path + ".lora_B.weight"}
            a_list.append(a.reshape(n_experts, rank, s.fan_in).transpose(0, 2, 1))  # [E, in, r]
            b_list.append(b.reshape(s.fan_out, rank, n_experts).transpose(2, 1, 0))  # [E, r, out]
        adapters[name] = adapter_pair(name, np.stack(a_list), np.stack(b_list))
    for name, module in found.items():
        s = specs[name]
        ours = np.argsort(_hf_row_order(table[name][1], s, model.config))  # our output j is HF row ours[j]
        layers = range(s.batch_shape[0]) if s.batch_shape else [None]
        a_list, b_list = [], []
        for i in layers:
            path = PEFT_PREFIX + (module.format(i=i) if i is not None else module)
            a, b = tensors[path + ".lora_A.weight"], tensors[path + ".lora_B.weight"]
            if a.shape != (rank, s.fan_in) or b.shape != (s.fan_out, rank):
                raise ValueError(
                    f"{path}: lora_A {a.shape} / lora_B {b.shape}, expected "
                    f"{(rank, s.fan_in)} / {(s.fan_out, rank)}"
                )
            used |= {path + ".lora_A.weight", path + ".lora_B.weight"}
            a_list.append(a.T.reshape(*s.in_shape, rank))
            b_list.append(b[ours].T.reshape(rank, *s.out_shape))
        a_host = np.stack(a_list) if s.batch_shape else a_list[0]
        b_host = np.stack(b_list) if s.batch_shape else b_list[0]
        adapters[name] = adapter_pair(name, a_host, b_host)
    extra = sorted(set(tensors) - used)
    if extra:
        raise ValueError(
            f"{directory}: {len(extra)} adapter tensors match no weight of this model (e.g. {extra[:3]})"
        )
    return config, adapters
