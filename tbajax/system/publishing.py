"""What the trainer publishes to the searchers, and how a searcher turns a version into the
weights it samples with.

Full fine-tuning publishes every weight. A LoRA run publishes, by default
(`system.publish="auto"`), only its adapters (for r = 8 on a 50M model under 2% of the bytes),
with `adapter_manifest` (LoRA config + the adapted weights' shapes) in the version's manifest;
a searcher keeps the base weights it loaded at start, checks the manifest against them and
merges the adapters into effective weights once per version (`apply_lora`), so decoding runs at
the base model's speed. Sync mode hands `policy_params` over in memory and publishes nothing.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tbajax.config import ExperimentConfig
from tbajax.models.lora import (
    ADAPTER_KIND,
    LoraConfig,
    adapter_arrays,
    adapter_manifest,
    adapter_template,
    apply_lora,
    check_adapter_manifest,
)
from tbajax.stores.params import ParamReader, abstract_target
from tbajax.training.state import policy_params


def publishes_adapters(config: ExperimentConfig) -> bool:
    """Whether the trainer publishes only LoRA adapters (`system.publish`, "auto" = under LoRA)."""
    if config.system.publish == "auto":
        return config.model.lora is not None
    return config.system.publish == "adapters"


def params_to_publish(config: ExperimentConfig, updater: Any) -> tuple[Any, dict[str, Any]]:
    """(pure pytree of arrays, manifest meta) for `ParamPublisher.publish(*...)`.

    `updater` is the trainer's `PolicyUpdater`. Full fine-tuning: its params as they are (no copy);
    LoRA with adapter publishing: the adapters and their `adapter_manifest`; LoRA with
    system.publish="full": the merged policy.
    """
    lora = updater.lora
    if lora is not None and publishes_adapters(config):
        meta = {**adapter_manifest(lora.params, lora.config), "base_checkpoint": config.model.checkpoint}
        return adapter_arrays(updater.state.params), meta
    return nnx.to_pure_dict(policy_params(updater.state, lora)), {"kind": "full"}


class SearcherParams:
    """A searcher's view of published versions: the resident base weights (its model's params, kept
    for the whole run) and what to restore a version into.

    `load(reader, version)` returns the params to hand to `Rollouts.set_params`: a full version as
    stored; an adapter version merged into the base (once per version, jitted). Adapters for
    another base (other targets or shapes) raise ValueError naming the weights that differ.
    """

    def __init__(self, base: nnx.State, mesh: Mesh | None, lora: LoraConfig | None = None):
        from tbajax.sharding import MeshConfig, make_mesh, param_shardings

        mesh = mesh if mesh is not None else make_mesh(MeshConfig(), jax.devices()[:1])
        self.base = base
        self.lora = lora  # the run's LoRA config: published adapters must match it
        self.values = nnx.to_pure_dict(base)
        self.shardings = nnx.to_pure_dict(param_shardings(base, mesh))
        self._adapter_sharding = NamedSharding(mesh, P())  # adapters are small: replicated
        self._merge = jax.jit(apply_lora, static_argnums=2)

    def target(self, meta: dict[str, Any]) -> Any:
        """The abstract target a version with this meta restores into."""
        if meta.get("kind") == ADAPTER_KIND:
            where = f"published adapters (base {meta.get('base_checkpoint')!r})"
            lora = check_adapter_manifest(meta, self.base, where=where)
            if self.lora is not None and lora != self.lora:
                raise ValueError(
                    f"published adapters have LoRA config {lora}, this searcher's run has model.lora={self.lora}"
                )
            return abstract_target(adapter_template(self.base, lora), self._adapter_sharding)
        return abstract_target(self.values, self.shardings)

    def merge(self, adapters: Any, lora: LoraConfig) -> nnx.State:
        """The base with `adapters` (arrays of `adapter_template`) folded in; the base is untouched."""
        return self._merge(self.base, adapters, lora)

    def load(self, reader: ParamReader, version: int) -> nnx.State:
        restored, meta = reader.restore_for(version, self.target)
        if meta.get("kind") == ADAPTER_KIND:
            return self.merge(restored, check_adapter_manifest(meta, self.base))
        state = jax.tree.map(lambda x: x, self.base)
        nnx.replace_by_pure_dict(state, restored)
        return state
