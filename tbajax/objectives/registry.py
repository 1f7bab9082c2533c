"""Objective lookup: built-in names, `module:function` or `file.py:function` paths, or callables.

The table costs no jax import: its losses are `_Deferred` import paths until first called, so the
launcher checks `train.objective` and its options before any role starts, without jax.

No global mutable registry: `OBJECTIVES` is read-only; to add names, pass your own mapping
(`get_objective("mine", registry={**OBJECTIVES, "mine": ObjectiveSpec(...)})`) or, simplest, an
import path string, which also survives a round trip through `config.json`.
"""

from __future__ import annotations

import dataclasses
import typing
import inspect
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from tbajax.imports import import_object
from tbajax.objectives.configs import (
    DrGRPOConfig,
    GRPOConfig,
    IcePopConfig,
    LearnedLogZConfig,
    LogZHeadConfig,
    OnlineDPOConfig,
    ReinforceConfig,
    RLOOConfig,
    TBAPrimeConfig,
    TBAPrimePaperConfig,
    TBConfig,
)

if TYPE_CHECKING:
    import jax

    from tbajax.batch import Batch
    from tbajax.objectives.base import Metrics, Ratio

    Array = jax.Array

PyTree = Any
DEFAULT_OBJECTIVE = "tb"


@dataclasses.dataclass(frozen=True)
class ObjectiveInputs:
    """Which batch inputs an objective reads, so the trainer computes (and checks) only those.

    reference_logprobs: `batch.reference_logprobs` (S − R terms, KL penalties). False lets the
        trainer skip the reference forward pass, a full second forward per step.
    behavior_logprobs: `batch.behavior_logprobs` (importance ratios, off-policy diagnostics).
    prompt_features: `batch.prompt_features`, the policy's final hidden state mean-pooled over
        each row's prompt (stop-gradient; a learned log Z head reads it). Off by default: it is
        computed only when asked for.
    The aux params are declared by `ObjectiveSpec.init_aux`, not here.
    Default: everything a batch carries (safe for objectives that say nothing).
    """

    reference_logprobs: bool = True
    behavior_logprobs: bool = True
    prompt_features: bool = False


EVERYTHING = ObjectiveInputs()


@dataclasses.dataclass(frozen=True)
class ObjectiveSpec:
    """An objective and what the trainer needs to drive it.

    loss: `fn(batch, logprobs, config) -> (Ratio, metrics)`; with `init_aux`, it takes a fourth
        argument: the aux pytree gathered per row (`gather_aux(aux, prompt_ids)`), e.g. log Z.
    config_cls: frozen dataclass of static hyperparameters, every field defaulted (None: the
        loss is called with config=None).
    init_aux: `(config, n) -> pytree` of trainable arrays with leading axis n. The trainer
        differentiates the loss with respect to it as well and updates it with its own (per-row)
        Adam at lr × `config.aux_lr_scale`. What n is depends on `aux_scope`.
    aux_scope: "prompt": a table with one row per prompt id (n = `TrainerConfig.aux_table_size`),
        gathered per batch row (`gather_aux`) before the loss sees it (a learned log Z table);
        "shared": one set of weights for every row (n = 1, `init_aux(config, feature_dim)` with
        the model's hidden size: a log Z head on `batch.prompt_features`), passed to the loss
        whole.
    positive_beta: validation rejects β <= 0 (the loss divides by β or needs it as a scale).
    inputs: the `ObjectiveInputs` the loss reads, or `config -> ObjectiveInputs` when that depends
        on the config (GRPO reads the reference only with its KL penalty on). Default: everything.
    """

    loss: Callable[..., tuple[Ratio, Metrics]]
    config_cls: type | None = None
    init_aux: Callable[..., PyTree] | None = None
    aux_scope: str = "prompt"
    name: str = ""
    positive_beta: bool = False
    inputs: ObjectiveInputs | Callable[[Any], ObjectiveInputs] = EVERYTHING

    def __post_init__(self) -> None:
        if self.aux_scope not in ("prompt", "shared"):
            raise ValueError(f"objective {self.name!r}: aux_scope must be 'prompt' or 'shared', got {self.aux_scope!r}")
        if self.init_aux is not None and (
            self.config_cls is None
            or "aux_lr_scale" not in {f.name for f in dataclasses.fields(self.config_cls)}
        ):
            raise ValueError(
                f"objective {self.name!r} has init_aux, so its config_cls needs an "
                "`aux_lr_scale` field (the trainer's lr multiplier for the aux params)"
            )
        if not (isinstance(self.inputs, ObjectiveInputs) or callable(self.inputs)):
            raise TypeError(
                f"objective {self.name!r}: inputs must be an ObjectiveInputs or a function "
                f"config -> ObjectiveInputs, got {self.inputs!r}"
            )

    @property
    def has_aux(self) -> bool:
        return self.init_aux is not None

    def inputs_for(self, config: Any) -> ObjectiveInputs:
        """The inputs the loss reads under `config`."""
        if isinstance(self.inputs, ObjectiveInputs):
            return self.inputs
        found = self.inputs(config)
        if not isinstance(found, ObjectiveInputs):
            raise TypeError(
                f"objective {self.name!r}: inputs(config) returned {found!r}, not an ObjectiveInputs"
            )
        return found

    def make_config(self, overrides: Mapping[str, Any] | None = None) -> Any:
        """The default config with `overrides` applied; unknown keys are an error."""
        overrides = dict(overrides or {})
        if self.config_cls is None:
            if overrides:
                raise ValueError(
                    f"objective {self.name!r} has no config class but got overrides "
                    f"{sorted(overrides)}; wrap it as ObjectiveSpec(loss=fn, config_cls=YourConfig)"
                )
            return None
        fields = {f.name for f in dataclasses.fields(self.config_cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(
                f"unknown {self.config_cls.__name__} fields {unknown} for objective "
                f"{self.name!r}; valid fields: {sorted(fields)}"
            )
        return self.config_cls(**overrides)

    def initial_aux(self, config: Any, num_prompts: int, feature_dim: int | None = None) -> PyTree | None:
        """The initial aux params, checked, or None for objectives without any: a per-prompt table
        (`init_aux(config, num_prompts)`, `num_prompts` = `TrainerConfig.aux_table_size`) or, for
        `aux_scope="shared"`, one row of shared weights (`init_aux(config, feature_dim)`,
        `feature_dim` = the model's hidden size)."""
        if not self.has_aux:
            return None
        if self.aux_scope == "shared":
            if feature_dim is None or feature_dim < 1:
                raise ValueError(f"objective {self.name!r} trains a head on the prompt features: pass "
                                 f"feature_dim (the model's hidden size), got {feature_dim}")
            import jax

            aux = self.init_aux(config, feature_dim)  # type: ignore[misc]
            if {getattr(x, "shape", ())[:1] for x in jax.tree.leaves(aux)} != {(1,)}:
                raise ValueError(f"objective {self.name!r}: a shared aux (aux_scope='shared') has one "
                                 "row: every leaf needs a leading axis of size 1")
            return aux
        if num_prompts < 1:
            raise ValueError(
                f"objective {self.name!r} trains one entry per prompt id (a learned log Z table); set "
                "TrainerConfig.aux_table_size to the number of distinct prompt ids (largest "
                "Trajectory.prompt_id + 1, e.g. the dataset's size)"
            )
        import jax

        aux = self.init_aux(config, num_prompts)  # type: ignore[misc]
        sizes = {getattr(x, "shape", ())[:1] for x in jax.tree.leaves(aux)}
        if sizes != {(num_prompts,)}:
            raise ValueError(
                f"objective {self.name!r}: init_aux made a table with leading sizes "
                f"{sorted(sizes)} for aux_table_size={num_prompts} (every leaf needs {num_prompts} rows)"
            )
        return aux

    def __call__(
        self, batch: Batch, logprobs: Array, config: Any, aux: PyTree | None = None
    ) -> tuple[Ratio, Metrics]:
        if self.has_aux != (aux is not None):
            need = "needs" if self.has_aux else "takes no"
            raise ValueError(f"objective {self.name!r} {need} per-row aux params")
        if aux is None:
            return self.loss(batch, logprobs, config)
        return self.loss(batch, logprobs, config, aux)


def resolve_objective(
    objective: Any,
    config: Any = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    registry: Mapping[str, ObjectiveSpec] | None = None,
) -> tuple[ObjectiveSpec, Any]:
    """(spec, config) from a registered name, an import path, an ObjectiveSpec or a function.

    config: the objective's config instance; None builds the default with `overrides` applied
    (`spec.make_config(overrides)`; a bare function without a config annotation gets None).
    Passing both is an error: overrides apply to the default only.
    """
    spec = get_objective(objective, OBJECTIVES if registry is None else registry)
    if config is not None and overrides:
        raise ValueError(
            f"objective {spec.name!r}: pass either a config instance or overrides of the default, not both"
        )
    config = spec.make_config(overrides) if config is None else config
    if spec.has_aux and not hasattr(config, "aux_lr_scale"):
        raise ValueError(
            f"objective {spec.name!r} has aux params but its config {config!r} has no "
            "aux_lr_scale (the aux learning-rate multiplier)"
        )
    spec.inputs_for(config)  # a bad declaration fails here, not inside jit
    return spec, config


def gather_aux(aux: PyTree, prompt_ids: Array) -> PyTree:
    """Each row's slice of a per-prompt aux table; its gradient scatters back to the table."""
    import jax

    return jax.tree.map(lambda a: a[prompt_ids], aux)


def aux_for_loss(objective: Any, aux: PyTree, prompt_ids: Array) -> PyTree:
    """What the loss gets as its aux argument: the rows of a per-prompt table, or shared weights
    whole."""
    if getattr(objective, "aux_scope", "prompt") == "shared":
        return aux
    return gather_aux(aux, prompt_ids)


@dataclasses.dataclass(frozen=True)
class _Deferred:
    """A built-in function by import path, imported on its first call (the loss modules import jax)."""

    path: str

    @property
    def function(self) -> Callable[..., Any]:
        return import_object(self.path, "objective")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(*args, **kwargs)


def _spec(name: str, loss: str, config_cls, init_aux: str | None = None, **kw) -> ObjectiveSpec:
    return ObjectiveSpec(loss=_Deferred(f"tbajax.objectives.{loss}"), config_cls=config_cls, name=name,
                         init_aux=None if init_aux is None else _Deferred(f"tbajax.objectives.{init_aux}"), **kw)


NO_REFERENCE = ObjectiveInputs(reference_logprobs=False)


def _reference_if(flag: str) -> Callable[[Any], ObjectiveInputs]:
    """Inputs of an objective that reads the reference only when `config.<flag>` is on."""
    return lambda config: EVERYTHING if getattr(config, flag) else NO_REFERENCE


# behaviour log-probs: every built-in reads them (ratios, or the off-policy diagnostics)
OBJECTIVES: Mapping[str, ObjectiveSpec] = MappingProxyType(
    {
        "tb": _spec("tb", "tb:tb", TBConfig, positive_beta=True),
        "tb_learned_logz": _spec(
            "tb_learned_logz",
            "tb:tb_learned_logz",
            LearnedLogZConfig,
            init_aux="tb:init_log_z_table",
            positive_beta=True,
        ),
        "tb_logz_head": _spec(
            "tb_logz_head",
            "tb:tb_logz_head",
            LogZHeadConfig,
            init_aux="tb:init_log_z_head",
            aux_scope="shared",
            positive_beta=True,
            inputs=lambda config: ObjectiveInputs(reference_logprobs=config.reference, prompt_features=True),
        ),
        "tba_prime": _spec("tba_prime", "policy_gradient:tba_prime", TBAPrimeConfig),
        "tba_prime_paper": _spec("tba_prime_paper", "policy_gradient:tba_prime", TBAPrimePaperConfig),
        "dr_grpo": _spec("dr_grpo", "policy_gradient:dr_grpo", DrGRPOConfig, inputs=NO_REFERENCE),
        "grpo": _spec("grpo", "policy_gradient:grpo", GRPOConfig, inputs=_reference_if("kl_penalty")),
        "rloo": _spec("rloo", "policy_gradient:rloo", RLOOConfig, inputs=_reference_if("kl_in_reward")),
        "reinforce": _spec("reinforce", "policy_gradient:reinforce", ReinforceConfig, inputs=_reference_if("kl_in_reward")),
        "online_dpo": _spec("online_dpo", "dpo:online_dpo", OnlineDPOConfig, positive_beta=True),
        "icepop": _spec("icepop", "policy_gradient:icepop", IcePopConfig, inputs=NO_REFERENCE),
    }
)


def _import(path: str) -> Any:
    return import_object(path, "objective")


def _config_annotation(fn: Callable[..., Any]) -> type | None:
    """The dataclass annotated on fn's third parameter, if any."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        return None
    if len(params) < 3 or params[2].annotation is inspect.Parameter.empty:
        return None
    try:
        hint = typing.get_type_hints(fn).get(params[2].name)
    except (NameError, TypeError, AttributeError) as e:
        raise ValueError(f"cannot resolve the config annotation of objective {fn!r}: {e}") from e
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def get_objective(
    objective: str | ObjectiveSpec | Callable[..., tuple[Ratio, Metrics]],
    registry: Mapping[str, ObjectiveSpec] = OBJECTIVES,
) -> ObjectiveSpec:
    """Resolve a registered name, a 'package.module:name' or 'path/to/file.py:name' import path,
    an ObjectiveSpec or a callable.

    A bare callable becomes a spec without aux whose config class is the annotation of its third
    parameter when that is a dataclass (`def f(batch, logprobs, config: MyConfig)`), else None.
    """
    if isinstance(objective, ObjectiveSpec):
        return objective
    if isinstance(objective, str):
        if objective in registry:
            return registry[objective]
        if ":" in objective:
            found = _import(objective)
            if isinstance(found, str) or not (isinstance(found, ObjectiveSpec) or callable(found)):
                raise ValueError(f"{objective!r} is neither an ObjectiveSpec nor a callable")
            spec = get_objective(found, registry)
            return spec if spec.name else dataclasses.replace(spec, name=objective)
        raise ValueError(
            f"unknown objective {objective!r}; registered: {sorted(registry)}, or pass a "
            "callable fn(batch, logprobs, config) or an import path 'package.module:name' / "
            "'path/to/file.py:name'"
        )
    if callable(objective):
        name = getattr(objective, "__name__", repr(objective))
        return ObjectiveSpec(loss=objective, config_cls=_config_annotation(objective), name=name)
    raise TypeError(f"objective must be a name, an ObjectiveSpec or a callable, got {objective!r}")
