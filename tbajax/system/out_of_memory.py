"""A role that runs out of device memory says which settings decide how much it needs.

XLA reports an allocation it cannot make as `RESOURCE_EXHAUSTED` (at compile time on a GPU, when
the program's buffers do not fit; at run time otherwise), in a traceback that names no setting
of ours. Each role process runs under `explain_out_of_memory`, which turns that error into a
`DeviceOutOfMemoryError` naming the settings that size the role's largest arrays, with their
current values. Nothing is lost: checkpoints, the buffer's stores and published params stay as
they were, and the settings in `tbajax.config.RESUME_SAFE_KEYS` may change on `--resume`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from tbajax.config import ExperimentConfig
from tbajax.system.launcher import memory_share

OUT_OF_MEMORY_STATUS = "RESOURCE_EXHAUSTED"


class DeviceOutOfMemoryError(RuntimeError):
    """A role's program needed more device memory than its devices have."""


def is_out_of_memory(error: BaseException) -> bool:
    """XLA's out-of-memory error (a `jax.errors.JaxRuntimeError`, a RuntimeError, on every jax we
    support), at compile or run time; not one already explained (it quotes XLA's status)."""
    return (isinstance(error, RuntimeError) and not isinstance(error, DeviceOutOfMemoryError)
            and OUT_OF_MEMORY_STATUS in str(error))


def out_of_memory_advice(config: ExperimentConfig, role: str) -> str:
    """The settings that size `role`'s largest arrays, with their values in `config` (a sync-mode
    trainer also generates and evaluates)."""
    if role == "trainer" and config.system.mode == "sync":
        return " ".join(_advice(config, r) for r in ("trainer", "searcher", "evaluator"))
    return _advice(config, role)


def _advice(config: ExperimentConfig, role: str) -> str:
    train, rollout, model = config.train, config.rollout, config.model
    k = config.buffer.samples_per_group

    def context(new_tokens: int) -> str:
        return f"rollout.max_prompt_tokens={rollout.max_prompt_tokens} + {new_tokens} new tokens"

    share = memory_share(config)
    shared = "" if share is None else (
        f"; on a device shared with other roles, a larger share of its memory (system.memory_fraction="
        f"{config.system.memory_fraction if config.system.memory_fraction is not None else 'null'}: "
        f"{share:.3f} of it for each process)")
    if role == "trainer":
        m = train.trainer.num_microbatches
        rows = train.groups_per_step * k // m
        lower = [] if m >= train.groups_per_step else [
            "more micro-batches (train.trainer.num_microbatches, a divisor of train.groups_per_step)"]
        if model.remat != "full":
            lower.append(f"model.remat=full (now {model.remat})")
        chunk = model.head_chunk_tokens
        smaller = max(1, chunk // 2) if isinstance(chunk, int) else 512
        if chunk != 1:
            lower.append(f"model.head_chunk_tokens={smaller} (now {chunk if chunk is not None else 'null'}: "
                         "the vocabulary projection a chunk of tokens at a time)")
        lower += ["shorter contexts", "more trainer devices (system.trainer_mesh)"]
        return (f"A step holds one micro-batch of {rows} rows (train.groups_per_step={train.groups_per_step} x {k} "
                f"samples / train.trainer.num_microbatches={m}) of up to "
                f"{context(rollout.sampling.max_new_tokens)}. To need less: {', '.join(lower)}{shared}. Then "
                "`--resume` (micro-batches, remat and head chunks may change on resume).")
    if role == "searcher":
        if rollout.engine == "continuous":
            batch = f"rollout.decode_slots={rollout.decode_slots} sequences"
        else:
            batch = (f"rollout.prompts_per_call={rollout.prompts_per_call} x rollout.sampling.num_samples="
                     f"{rollout.sampling.num_samples} sequences")
        mesh_key = "trainer_mesh" if config.system.mode == "sync" else "searcher_mesh"
        mesh = getattr(config.system, mesh_key)
        whole = "" if mesh.fsdp == 1 or rollout.fsdp_weights != "whole" else (
            f" It also holds its weights whole along system.{mesh_key}.fsdp={mesh.fsdp} "
            "(rollout.fsdp_weights=whole: sampling reads every weight at every token); "
            "rollout.fsdp_weights=tensor splits them over the fsdp devices as tensor shards while sampling.")
        return (f"A generation call holds the KV cache of {batch} of up to "
                f"{context(rollout.sampling.max_new_tokens)}.{whole} To need less: fewer sequences at once, "
                f"shorter contexts, or more devices per searcher (system.devices_per_searcher){shared}. Then "
                "`--resume` (the sequences at once and the memory fraction may change on resume).")
    if role == "evaluator":
        new_tokens = config.eval.max_new_tokens or rollout.sampling.max_new_tokens
        return (f"An evaluation call holds eval.batch_size={config.eval.batch_size} sequences of up to "
                f"{context(new_tokens)}: lower eval.batch_size or eval.max_new_tokens{shared}.")
    return f"Lower the batch sizes or context lengths of the {role}{shared}."


@contextlib.contextmanager
def explain_out_of_memory(config: ExperimentConfig, role: str) -> Iterator[None]:
    """Re-raise XLA's out-of-memory error inside as a DeviceOutOfMemoryError with `role`'s advice
    (XLA's own message first; the original error chained); every other error passes unchanged."""
    try:
        yield
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        xla = next((line.strip() for line in str(e).splitlines() if OUT_OF_MEMORY_STATUS in line), str(e))
        xla = xla.rstrip(".")
        raise DeviceOutOfMemoryError(f"the {role} ran out of device memory ({xla}). "
                                     f"{out_of_memory_advice(config, role)}") from e
