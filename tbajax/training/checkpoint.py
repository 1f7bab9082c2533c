"""Trainer checkpoints with orbax: the whole `TrainState` plus a small JSON `extra` dict.

One checkpoint per saved step under `directory/<step>/` with two items, `state` (params,
optimizer state, reference params, step, PRNG key, and an objective's aux table with its
optimizer state when it has one) and `extra` (JSON: the replay buffer's sync/consumption state
and the run's counters; the rows themselves are re-read from the trajectory stores on resume).
Saves are asynchronous: `save` returns once the arrays are copied off the device, and the
files are committed in the background (a checkpoint is complete when orbax has written its
`commit_success.txt`; incomplete ones are never listed). Only the newest `max_to_keep` are kept.
Restore writes every array straight into the sharding of the target you pass, so a state saved
on one mesh restores onto another.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from tbajax.training.state import TrainState, abstract_state

log = logging.getLogger(__name__)


class Checkpointer:
    """Save / restore train states under one directory (a path or a URL orbax understands)."""

    def __init__(
        self,
        directory: str | Path,
        *,
        max_to_keep: int | None = 3,
        async_save: bool = True,
        save_interval_steps: int = 1,
    ):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None (keep all), got {max_to_keep}")
        self.directory = directory if "://" in str(directory) else Path(directory).absolute()
        self.skipped: list[tuple[int, str]] = []  # (step, reason) the last restore skipped
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                save_interval_steps=save_interval_steps,
                enable_async_checkpointing=async_save,
                create=True,
            ),
            item_names=("state", "extra"),
        )

    def save(self, state: TrainState, extra: dict[str, Any] | None = None, *, force: bool = False) -> bool:
        """Start saving `state` as checkpoint number `state.step`; False if the interval skipped it.

        `extra` must be JSON-serialisable (ints, floats, strings, lists, dicts).
        """
        _check_raw_keys(state)
        step = int(jax.device_get(state.step))
        return self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), extra=ocp.args.JsonSave(dict(extra or {}))
            ),
            force=force,
        )

    def restore(self, target: TrainState, step: int | None = None) -> tuple[TrainState, dict[str, Any]]:
        """(state, extra) of checkpoint `step` (default: the newest complete one that reads back).

        `target` is a state of the same structure, concrete or abstract (ShapeDtypeStructs with
        shardings, see `abstract_state`); arrays come back in its shardings and dtypes. Without
        `step`, a newest checkpoint that cannot be read (truncated or corrupted files) is skipped
        with a warning naming it, and the previous one is restored: losing a few steps beats
        losing the run. `skipped` lists what was skipped, for the caller to report.
        """
        self._manager.wait_until_finished()
        _check_raw_keys(target)
        abstract = abstract_state(target)
        self.skipped: list[tuple[int, str]] = []
        if step is not None:
            if step not in self._manager.all_steps():
                raise FileNotFoundError(
                    f"no checkpoint for step {step} under {self.directory}; have {sorted(self.all_steps())}"
                )
            return self._restore(step, abstract)
        steps = sorted(self._manager.all_steps(), reverse=True)
        if not steps:
            raise FileNotFoundError(f"no complete checkpoint under {self.directory}")
        for s in steps:
            try:
                out = self._restore(s, abstract)
            except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types on bad files
                reason = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                log.warning("checkpoint %s/%d cannot be read (%s); falling back to the previous one",
                            self.directory, s, reason)
                self.skipped.append((s, reason))
                continue
            if self.skipped:
                log.warning("restored checkpoint %d, skipping unreadable newer checkpoint(s) %s; delete them "
                            "once you no longer need them for inspection", s, [k for k, _ in self.skipped])
            return out
        raise RuntimeError(
            f"none of the checkpoints under {self.directory} can be read: "
            + "; ".join(f"step {k}: {r}" for k, r in self.skipped)
            + ". Move the checkpoints directory aside to start again from step 0"
        )

    def _restore(self, step: int, abstract: Any) -> tuple[TrainState, dict[str, Any]]:
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), extra=ocp.args.JsonRestore()),
        )
        return restored.state, dict(restored.extra or {})

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def wait(self) -> None:
        """Block until every started save is committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def restore_params(directory: str | Path, step: int | None = None) -> tuple[Any, int]:
    """(params, step): the trained params alone of checkpoint `step` (default: the newest
    complete one), as a nested dict of arrays on the first device in their stored dtypes: a full
    run's policy, or a LoRA run's adapters (`TrainState.params`). Nothing else is read (no
    optimizer moments, no reference params), and no target state needs building: the
    checkpoint's own metadata gives the shapes. Used to export a run's policy."""
    directory = directory if "://" in str(directory) else Path(directory).absolute()
    options = ocp.CheckpointManagerOptions(create=False, read_only=True)
    manager = ocp.CheckpointManager(directory, options=options, item_names=("state", "extra"))
    try:
        steps, root = sorted(manager.all_steps()), manager.directory
    finally:
        manager.close()
    if not steps:
        raise FileNotFoundError(f"no complete trainer checkpoint under {directory}")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise FileNotFoundError(f"no checkpoint for step {step} under {directory}; have {steps}")
    path = root / str(step) / "state"
    checkpointer = ocp.PyTreeCheckpointer()
    metadata = checkpointer.metadata(path)  # the tree sits under item_metadata in newer orbax versions
    metadata = getattr(getattr(metadata, "item_metadata", metadata), "tree", metadata)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {"params": jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one),
                                     metadata["params"])}
    restore_args = jax.tree.map(
        lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape, dtype=s.dtype), target)
    restored = checkpointer.restore(
        path, args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True))
    return _unwrap_values(restored["params"]), step


def _unwrap_values(tree: Any) -> Any:
    """A saved nnx State's {"value": array} nodes (one per Param) as the arrays themselves."""
    if isinstance(tree, dict):
        if set(tree) == {"value"}:
            return tree["value"]
        return {k: _unwrap_values(v) for k, v in tree.items()}
    return tree


def _check_raw_keys(state: Any) -> None:
    for leaf in jax.tree.leaves(state):
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            raise TypeError(
                "the state holds a typed PRNG key; keep raw uint32 keys in TrainState "
                "(jax.random.key_data(key)) so they save and restore as plain arrays"
            )
