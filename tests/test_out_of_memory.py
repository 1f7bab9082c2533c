"""A role that runs out of device memory names the settings that size it (XLA's real error)."""

import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from tbajax.config import apply_overrides, check_resume_changes
from tbajax.main import load_experiment
from tbajax.system.launcher import last_error
from tbajax.system.out_of_memory import DeviceOutOfMemoryError, explain_out_of_memory, is_out_of_memory

TIB = 2**40
# a program whose output no machine here can hold: XLA refuses the allocation at once
ALLOCATE_A_TIB = "jax.block_until_ready(jax.jit(lambda: jnp.zeros((2**38,), jnp.float32))())"


def _config(*overrides: str):
    return apply_overrides(load_experiment("tiny_arithmetic"), list(overrides))


def _xla_out_of_memory() -> RuntimeError:
    try:
        exec(ALLOCATE_A_TIB, {"jax": jax, "jnp": jnp})
    except RuntimeError as e:
        return e
    pytest.skip("this machine allocated 1 TiB")


def test_xla_out_of_memory_becomes_advice_for_the_trainer():
    error = _xla_out_of_memory()
    assert is_out_of_memory(error)
    config = _config("train.trainer.num_microbatches=2")
    with pytest.raises(DeviceOutOfMemoryError) as caught:
        with explain_out_of_memory(config, "trainer"):
            raise error
    message = str(caught.value)
    assert message.startswith(f"the trainer ran out of device memory (RESOURCE_EXHAUSTED: Out of memory allocating "
                              f"{TIB} bytes")
    rows = config.train.groups_per_step * config.buffer.samples_per_group // 2
    for named in (f"one micro-batch of {rows} rows", "train.trainer.num_microbatches=2", "more micro-batches",
                  "model.remat=full (now none)", "model.head_chunk_tokens=512 (now auto", "system.trainer_mesh",
                  "--resume"):
        assert named in message, named
    assert caught.value.__cause__ is error
    # what is already at its leanest is not suggested: one group per micro-batch, full remat
    lean = _config(f"train.trainer.num_microbatches={config.train.groups_per_step}", "model.remat=full")
    with pytest.raises(DeviceOutOfMemoryError) as caught:
        with explain_out_of_memory(lean, "trainer"):
            raise error
    assert "more micro-batches" not in str(caught.value) and "model.remat" not in str(caught.value)
    # a chunk size already set is halved; null (never chunk) is pointed at a chunk size
    for setting, suggested in (("256", "model.head_chunk_tokens=128 (now 256"),
                               ("null", "model.head_chunk_tokens=512 (now null")):
        with pytest.raises(DeviceOutOfMemoryError, match=re.escape(suggested)):
            with explain_out_of_memory(_config(f"model.head_chunk_tokens={setting}"), "trainer"):
                raise error


def test_each_role_gets_its_own_settings():
    error = _xla_out_of_memory()
    messages = {}
    for role, overrides in (("searcher", ()), ("continuous searcher", ("rollout.engine=continuous",)),
                            ("evaluator", ()), ("sync trainer", ("system.mode=sync",))):
        with pytest.raises(DeviceOutOfMemoryError) as caught:
            with explain_out_of_memory(_config(*overrides), role.split()[-1]):
                raise error
        messages[role] = str(caught.value)
    config = _config()
    assert f"rollout.prompts_per_call={config.rollout.prompts_per_call} x rollout.sampling.num_samples=" \
           in messages["searcher"]
    assert "system.devices_per_searcher" in messages["searcher"]
    assert f"rollout.decode_slots={config.rollout.decode_slots} sequences" in messages["continuous searcher"]
    assert f"eval.batch_size={config.eval.batch_size} sequences" in messages["evaluator"]
    # in sync mode the trainer also generates and evaluates
    assert all(s in messages["sync trainer"] for s in ("micro-batch", "rollout.prompts_per_call", "eval.batch_size"))
    # a sampling mesh split over fsdp holds its weights whole along it (`serving_shardings`): named
    assert "whole along" not in messages["searcher"]
    for role, mesh_key in (("searcher", "searcher_mesh"), ("trainer", "trainer_mesh")):
        config = _config(f"system.{mesh_key}.fsdp=2", *(("system.mode=sync",) if role == "trainer" else ()))
        with pytest.raises(DeviceOutOfMemoryError) as caught:
            with explain_out_of_memory(config, role):
                raise error
        assert f"whole along system.{mesh_key}.fsdp=2" in str(caught.value)
        assert "rollout.fsdp_weights=tensor splits them" in str(caught.value)
    for split in ("tensor", "split"):  # nothing held whole to name
        config = _config("system.searcher_mesh.fsdp=2", f"rollout.fsdp_weights={split}")
        with pytest.raises(DeviceOutOfMemoryError) as caught:
            with explain_out_of_memory(config, "searcher"):
                raise error
        assert "whole along" not in str(caught.value)


def test_other_errors_pass_unchanged():
    explained = DeviceOutOfMemoryError("the trainer ran out of device memory (RESOURCE_EXHAUSTED: ...)")
    for error in (ValueError("RESOURCE_EXHAUSTED but not XLA's"), RuntimeError("INTERNAL: something else"),
                  explained):  # an inner role's explanation is not explained again
        with pytest.raises(type(error)) as caught:
            with explain_out_of_memory(_config(), "trainer"):
                raise error
        assert caught.value is error


def test_a_role_process_that_runs_out_reports_the_advice_to_the_launcher():
    """A real process: what `launcher.last_error` reads from the role's log is the advice, not
    XLA's bare status (the XLA traceback stays above it, chained)."""
    script = ("import jax, jax.numpy as jnp\n"
              "from tbajax.main import load_experiment\n"
              "from tbajax.system.out_of_memory import explain_out_of_memory\n"
              "with explain_out_of_memory(load_experiment('tiny_arithmetic'), 'trainer'):\n"
              f"    {ALLOCATE_A_TIB}\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    reported = last_error(done.stderr)
    assert reported.startswith("tbajax.system.out_of_memory.DeviceOutOfMemoryError: the trainer ran out of device "
                               "memory (RESOURCE_EXHAUSTED"), done.stderr[-2000:]
    assert "model.head_chunk_tokens" in reported
    assert "The above exception was the direct cause" in done.stderr


def test_the_settings_the_advice_names_may_change_on_resume():
    base = _config().to_dict()
    leaner = _config("train.trainer.num_microbatches=2", "model.remat=full", "model.head_chunk_tokens=256",
                     "rollout.prompts_per_call=8", "rollout.decode_slots=32", "rollout.prompt_pool=4",
                     "system.memory_fraction=0.4").to_dict()
    assert check_resume_changes(base, leaner) == [
        "model.head_chunk_tokens", "model.remat", "rollout.decode_slots", "rollout.prompt_pool",
        "rollout.prompts_per_call", "system.memory_fraction", "train.trainer.num_microbatches"]


def test_the_launcher_recognises_the_error_by_its_name():
    from tbajax.system.launcher import OUT_OF_MEMORY_ERROR

    assert OUT_OF_MEMORY_ERROR == f"{DeviceOutOfMemoryError.__module__}.{DeviceOutOfMemoryError.__qualname__}:"


def test_a_shared_gpu_is_split_over_the_processes_the_run_starts(monkeypatch):
    """A sync run starts the trainer alone: it gets 0.9 of a shared GPU, not a share kept for
    searchers that never start; the advice states the share in effect."""
    from tbajax.system.launcher import child_env, memory_share

    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert child_env(_config("system.mode=sync"), "trainer", 0)["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.900"
    assert child_env(_config(), "trainer", 0)["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.450"  # + 1 searcher
    assert memory_share(_config("system.memory_fraction=0.3")) == 0.3
    assert memory_share(_config("system.devices=split", "system.trainer_devices=1")) is None
    with pytest.raises(DeviceOutOfMemoryError, match=r"system.memory_fraction=null: 0.450 of it for each process"):
        with explain_out_of_memory(_config(), "searcher"):
            raise _xla_out_of_memory()
