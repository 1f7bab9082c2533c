"""`PolicyUpdater`: the stateful edge around the pure step (owns the train state, checks every
update on the host).

Three things are called "trainer" around here; their names keep them apart:
`PolicyUpdater` (this: state + jitted step), `tbajax.system.trainer.Learner` (groups of
trajectories in, one update out: collating, validating, metrics) and the trainer *process*
(`tbajax.system.trainer.run_trainer`: tailing, syncs, evaluation, checkpoints).
"""

from __future__ import annotations

import collections
import time
import warnings
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from tbajax.batch import Batch
from tbajax.models.lora import LoraConfig
from tbajax.objectives.registry import resolve_objective
from tbajax.sharding import LOGICAL_RULES
from tbajax.training.config import TrainerConfig
from tbajax.training.layout import batch_layout, configured_layouts
from tbajax.training.loss import objective_inputs, router_aux_loss_coef, scores_reference
from tbajax.training.state import (
    LoraBase,
    TrainState,
    aux_table_size,
    init_lora_train_state,
    init_train_state,
    policy_params,
    state_shardings,
)
from tbajax.training.step import make_train_step, raise_on_bad_step


class PolicyUpdater:
    """The stateful edge around the pure step: owns the state, checks every update on the host.

    updater = PolicyUpdater(model, TrainerConfig(...), "tb", mesh=mesh)
    metrics = updater.step(batch)     # raises NonFiniteLossError, nothing applied

    An objective with aux params (`tb_learned_logz`) gets its table from
    `ObjectiveSpec.initial_aux`, sized by `config.aux_table_size`;
    `updater.state.aux["log_z"][prompt_id]` is the learned log Z.

    Pipelined use: `submit(batch)` dispatches an update and returns the checked metrics of the
    one before (the host prepares the next batch while the device computes); `flush()` waits
    for the last. Checking one update late is safe: a refused update leaves the state as it was,
    so the update dispatched after it started from params no NaN reached.

    `last_dispatch` is (host `time.perf_counter()` just before the last update was dispatched, a
    small output of it that is ready when the device has finished it): what a loop needs to time
    the device's idle gaps (`tbajax.system.pipeline.UpdateClock`) without waiting for results.
    """

    def __init__(
        self,
        model: nnx.Module,
        config: TrainerConfig,
        objective: Any,
        objective_config: Any = None,
        *,
        mesh: Mesh | None = None,
        state: TrainState | None = None,
        compiler_options: dict[str, Any] | None = None,
        lora: LoraConfig | None = None,
    ):
        self.config = config
        self.mesh = mesh
        router_aux_loss_coef(model.config, config)  # a coefficient the model cannot take: refused now
        spec, objective_config = resolve_objective(objective, objective_config)
        self.objective, self.objective_config = spec, objective_config
        aux = spec.initial_aux(objective_config, config.aux_table_size, _hidden_size(model))
        self.lora: LoraBase | None = None  # LoRA: the frozen base; state.params are the adapters
        if lora is None:
            self.graphdef, fresh = init_train_state(model, config, mesh, aux=aux)
        else:
            self.graphdef, self.lora, fresh = init_lora_train_state(model, config, lora, mesh, aux=aux)
        self.state = fresh if state is None else state
        if (self.state.aux is None) != (fresh.aux is None):
            raise ValueError(
                f"objective {spec.name!r} "
                + ("trains an aux table but the given state has none" if spec.has_aux
                   else "has no aux params but the given state holds an aux table")
            )
        # prompt ids index a per-prompt table; a shared head has one row and takes any id
        per_prompt = self.state.aux is not None and spec.aux_scope == "prompt"
        self._aux_size = aux_table_size(self.state.aux) if per_prompt else None
        if self._aux_size is not None and self._aux_size != config.aux_table_size:
            raise ValueError(
                f"the given state's aux table has {self._aux_size} rows but "
                f"TrainerConfig.aux_table_size={config.aux_table_size}"
            )
        self.shardings = state_shardings(self.state, mesh) if mesh is not None else None
        # (StepOutput, update number) of the updates in flight, oldest first
        self._pending: collections.deque[tuple[Any, int]] = collections.deque()
        self._next_update = int(jax.device_get(self.state.step)) + 1
        self.last_dispatch: tuple[float, Any] | None = None
        # the batch layouts this trainer takes (`pack_groups`; "auto": any of them, chosen per batch)
        self.layouts = configured_layouts(
            config, prompt_features=objective_inputs(spec, objective_config).prompt_features)
        self._step = make_train_step(
            self.graphdef,
            config,
            spec,
            objective_config,
            mesh=mesh,
            state_sharding=self.shardings,
            compiler_options=compiler_options,
            lora=self.lora,
        )

    @property
    def updates_applied(self) -> int:
        return int(jax.device_get(self.state.step))

    @property
    def scores_reference(self) -> bool:
        """Whether each step runs the reference forward (the objective reads its log-probs and
        the trainer keeps the reference); otherwise batch.reference_logprobs are not used."""
        return scores_reference(self.objective, self.objective_config, self.config)

    def step(self, batch: Batch) -> dict[str, float]:
        """Apply one update and wait for it; returns its metrics as floats."""
        if self._pending:
            raise RuntimeError("an update from submit() is still in flight: call flush() before step()")
        self._check_batch(batch)
        update = self.updates_applied + 1
        t0 = time.perf_counter()
        self.state, output = self._step(self.state, batch)
        self.last_dispatch = (t0, output.applied)
        metrics = raise_on_bad_step(output, update)
        self._next_update = update + 1
        return metrics

    def submit(self, batch: Batch, *, check_previous: bool = True) -> dict[str, float] | None:
        """Dispatch one update without waiting for it; returns the checked metrics of the update
        submitted before (None for the first). Raises that update's NonFiniteLossError /
        MicroBatchLayoutError; this batch's update is then still in flight (see `flush`).

        `check_previous=False` leaves the previous update unchecked too (at most two in flight):
        the caller does host work first and checks it with `check_previous()`."""
        self._check_batch(batch)
        if len(self._pending) > 1:
            raise RuntimeError("two updates are already in flight: check_previous() or flush() first")
        if not self._pending:  # nothing in flight: cheap, and the state may have been replaced
            self._next_update = self.updates_applied + 1
        t0 = time.perf_counter()
        self.state, output = self._step(self.state, batch)
        self.last_dispatch = (t0, output.applied)
        self._pending.append((output, self._next_update))
        self._next_update += 1
        return self.check_previous() if check_previous else None

    def check_previous(self) -> dict[str, float] | None:
        """Check the update dispatched before the newest one in flight (waiting for it); None if
        only one (or none) is in flight."""
        if len(self._pending) < 2:
            return None
        return self._check(self._pending.popleft())

    def flush(self) -> dict[str, float] | None:
        """Wait for the updates in flight (if any), check them and return the newest's metrics."""
        metrics = None
        while self._pending:
            metrics = self._check(self._pending.popleft())
        return metrics

    def _check(self, pending: tuple[Any, int]) -> dict[str, float]:
        output, update = pending
        try:
            return raise_on_bad_step(output, update)
        except Exception:
            self._next_update -= 1  # the refused update took no number: the ones after it move down
            self._pending = collections.deque((o, n - 1) for o, n in self._pending)
            raise

    @property
    def batch_shards(self) -> int:
        """Devices a batch is split over (data × fsdp); 1 without a mesh."""
        if self.mesh is None:
            return 1
        return int(np.prod([self.mesh.shape[a] for a in LOGICAL_RULES["batch"] or ()]))

    def policy(self) -> nnx.Module:
        """The current policy as a Module (shares the state's arrays; under LoRA, the base with
        the adapters merged in)."""
        return nnx.merge(self.graphdef, policy_params(self.state, self.lora))

    def _check_batch(self, batch: Batch) -> None:
        n = batch.tokens.shape[0]
        m = self.config.num_microbatches
        if n % m:
            raise ValueError(f"batch of {n} rows does not split into num_microbatches={m}")
        layout = batch_layout(batch)
        if layout not in self.layouts:
            raise ValueError(
                f"the batch is in the {layout!r} layout but this trainer takes {' or '.join(self.layouts)} "
                f"(TrainerConfig.pack_groups={self.config.pack_groups!r}, "
                f"pack_strided={self.config.pack_strided}); build it with "
                + " or ".join(f"collate({_COLLATE_ARGS[lay].format(m=m)})" for lay in self.layouts)
            )
        shards = self.batch_shards
        if batch.packed is not None and batch.packed.tokens.shape[0] % int(np.lcm(m, shards)):
            raise ValueError(
                f"{batch.packed.tokens.shape[0]} packed rows do not split into num_microbatches={m} "
                f"over {shards} data-parallel devices; pass collate(pack_row_multiple={shards})"
            )
        if n % shards:
            raise ValueError(f"batch of {n} rows does not split over {shards} data-parallel devices")
        prompt_id = np.asarray(jax.device_get(batch.prompt_id))
        if prompt_id.shape != (n,):
            raise ValueError(f"batch.prompt_id has shape {prompt_id.shape}, expected ({n},): one per row")
        if self._aux_size is not None:
            bad = (prompt_id < 0) | (prompt_id >= self._aux_size)
            if bad.any():
                rows = np.flatnonzero(bad)
                raise ValueError(
                    f"prompt ids {sorted({int(i) for i in prompt_id[rows]})[:10]} (rows "
                    f"{rows[:10].tolist()}) are outside the aux table [0, {self._aux_size}); "
                    "set TrainerConfig.aux_table_size to the largest prompt id + 1"
                )


_COLLATE_ARGS = {"rows": "pack_microbatches=None", "packed": "pack_microbatches={m}",
                 "strided": "pack_microbatches={m}, pack_strided=True"}


def _hidden_size(model: nnx.Module) -> int | None:
    return getattr(getattr(model, "config", None), "hidden_size", None)


class Trainer(PolicyUpdater):
    """Deprecated name of `PolicyUpdater` (kept for one release so existing imports run)."""

    def __init__(self, *args: Any, **kwargs: Any):
        warnings.warn(
            "tbajax.training.Trainer is now tbajax.training.PolicyUpdater (the name kept it apart "
            "from system.trainer.Learner and the trainer process); Trainer will be removed",
            DeprecationWarning,
            stacklevel=2,
        )
        super().__init__(*args, **kwargs)
