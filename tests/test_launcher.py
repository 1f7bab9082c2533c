"""The launcher: supervision (process groups, backoff, budgets, stalls, Ctrl-C), run-directory
safety (lock, replacing a run that never trained, resume changes) and bad input caught up front.

Supervision is tested on real processes standing in for the roles (small Python scripts that
write status files, spawn children, crash or hang), so these run in seconds; the checks on bad
input call `tbajax.main.main` in-process, which stops in preflight before any role starts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROLE_XLA_FLAGS

from tbajax.config import ConfigError, apply_overrides, check_resume_changes, config_differences
from tbajax.main import load_experiment, main
from tbajax.models import CheckpointError
from tbajax.models.safetensors_io import SafetensorsReader, write_safetensors
from tbajax.system import rundir
from tbajax.system.launcher import (
    Supervisor, _Child, check_compile_cache, child_env, compile_cache_env, describe_exit, last_error,
    read_summary, restart_delay,
)

pytestmark = pytest.mark.processes

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "experiments" / "assets" / "tiny-arithmetic"


def _config(*overrides: str):
    return apply_overrides(load_experiment("tiny_arithmetic"), list(overrides))


# --- pure pieces ----------------------------------------------------------------------------------


def test_restart_delay_doubles_within_the_window_and_forgets_old_crashes():
    kw = dict(budget=3, window_s=100.0, backoff_s=2.0)
    assert restart_delay([], 0.0, **kw) == 2.0
    assert restart_delay([0.0], 10.0, **kw) == 4.0
    assert restart_delay([0.0, 5.0], 10.0, **kw) == 8.0
    assert restart_delay([0.0, 5.0, 8.0], 10.0, **kw) is None  # a crash loop: budget used up
    # four crashes spread over days: each one finds the window empty again
    assert restart_delay([0.0, 5.0, 8.0], 200.0, **kw) == 2.0
    assert restart_delay([0.0, 150.0], 200.0, **kw) == 4.0
    assert restart_delay([], 0.0, budget=0, window_s=1.0, backoff_s=1.0) is None
    assert restart_delay([1.0] * 10, 2.0, budget=20, window_s=100.0, backoff_s=1.0) == 60.0  # capped


def test_roles_get_the_persistent_compile_cache_the_config_names(tmp_path, monkeypatch):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.delenv("JAX_COMPILATION_CACHE_MAX_SIZE", raising=False)
    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
    monkeypatch.setenv("TBAJAX_CACHE", str(tmp_path / "cache"))
    for role in ("trainer", "searcher", "evaluator"):  # "auto": under $TBAJAX_CACHE, at most 4 GiB
        env = child_env(_config(), role, 0)
        assert env["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "cache" / "xla")
        assert env["JAX_COMPILATION_CACHE_MAX_SIZE"] == str(4 << 30)
        assert env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0.2"
    bucket = child_env(_config('system.compile_cache="gs://b/xla"'), "trainer", 0)
    assert bucket["JAX_COMPILATION_CACHE_DIR"] == "gs://b/xla"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "inherited"))
    assert "JAX_COMPILATION_CACHE_DIR" not in child_env(_config("system.compile_cache=null"), "searcher", 0)
    # a directory the user (or the test session) already chose wins over "auto", and so does their size
    mine = {"JAX_COMPILATION_CACHE_MAX_SIZE": "-1", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "1"}
    assert compile_cache_env("auto", {"JAX_COMPILATION_CACHE_DIR": "/mine", **mine}) == {
        "JAX_COMPILATION_CACHE_DIR": "/mine"}
    assert compile_cache_env("/run/xla", mine) == {"JAX_COMPILATION_CACHE_DIR": "/run/xla"}
    # a directory that cannot be created is one clear error before any role starts
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="compile_cache: cannot create .*system.compile_cache=null"):
        check_compile_cache(str(tmp_path / "file" / "xla"))
    check_compile_cache(str(tmp_path / "new" / "xla"))
    assert (tmp_path / "new" / "xla").is_dir()


def test_describe_exit_names_the_signal():
    assert describe_exit(-9) == "killed by signal 9 (SIGKILL)"
    assert describe_exit(-15) == "killed by signal 15 (SIGTERM)"
    assert describe_exit(1) == "exited with code 1"


def test_last_error_is_the_main_threads_exception_of_the_last_session():
    log = textwrap.dedent("""\
        === start trainer at Mon (restart 0) ===
        Traceback (most recent call last):
          File "a.py", line 1, in <module>
        OldError: from an earlier session
        === start trainer at Tue (restart 1) ===
        Traceback (most recent call last):
          File "trainer.py", line 9, in run
            step % config.train.checkpoint_every
        ZeroDivisionError: integer modulo by zero
        Exception in thread Thread-3 (orbax):
        Traceback (most recent call last):
          File "orbax.py", line 3, in save
        RuntimeError: unrelated orbax noise
        12:00:01 trainer INFO absl: finalizing
        """)
    assert last_error(log) == "ZeroDivisionError: integer modulo by zero"
    assert last_error("no traceback here\n") is None
    logged = ("=== start searcher-0 at Tue (restart 0) ===\n"
              "12:00:00 searcher-0 ERROR tbajax.tasks.reward_pool: reward of sample 3 failed: KeyError\n"
              "12:00:09 searcher-0 ERROR tbajax.system.searcher: every grade of 64 samples failed; stopping\n"
              "12:00:09 searcher-0 INFO tbajax.system.searcher: bye\n")
    assert last_error(logged).endswith("every grade of 64 samples failed; stopping")


@pytest.mark.parametrize("override, key", [
    ("train.checkpoint_every=0", "train.checkpoint_every"),
    ("train.log_every=0", "train.log_every"),
    ("eval.every=-1", "eval.every"),
    ("system.max_searcher_restarts=-1", "system.max_searcher_restarts"),
    ("rollout.prompts_per_call=0", "rollout.prompts_per_call"),
    ("rollout.reward_timeout_s=0", "rollout.reward_timeout_s"),
    ("system.stall_timeout_s=-5", "system.stall_timeout_s"),
    ("system.memory_fraction=1.5", "system.memory_fraction"),
    ("eval.num_problems=0", "eval.num_problems"),
    ("train.keep_checkpoints=0", "train.keep_checkpoints"),
    ("model.head_chunk_tokens=0", "model.head_chunk_tokens"),
])
def test_numeric_config_fields_are_range_checked_by_key(override, key):
    with pytest.raises(ConfigError, match=rf"^{key.replace('.', r'[.]')}="):
        _config(override)


def test_resume_accepts_safe_changes_and_lists_the_unsafe_ones():
    base = _config().to_dict()
    longer = _config("train.steps=900", "eval.every=50", "system.stall_timeout_s=null",
                     "model.head_chunk_tokens=512").to_dict()
    assert check_resume_changes(base, longer) == ["eval.every", "model.head_chunk_tokens", "system.stall_timeout_s",
                                                  "train.steps"]
    assert check_resume_changes(base, base) == []
    other = _config("train.steps=900", "train.groups_per_step=4", "seed=3").to_dict()
    assert config_differences(base, other) == ["seed", "train.groups_per_step", "train.steps"]
    with pytest.raises(ConfigError) as e:
        check_resume_changes(base, other)
    assert "seed (0 -> 3)" in str(e.value) and "train.groups_per_step" in str(e.value)
    assert "train.steps (" not in str(e.value)  # the safe change is not listed as a problem


# --- the run directory ----------------------------------------------------------------------------


def test_prepare_extends_a_run_on_resume_and_refuses_other_changes(tmp_path):
    run = tmp_path / "run"
    rundir.prepare(run, _config("train.steps=10"), resume=False)
    (run / "checkpoints" / "10").mkdir(parents=True)  # it trained
    with pytest.raises(ConfigError, match="already holds a run"):
        rundir.prepare(run, _config("train.steps=10"), resume=False)
    assert rundir.prepare(run, _config("train.steps=20"), resume=True) == ["train.steps"]
    assert json.loads((run / "config.json").read_text())["train"]["steps"] == 20
    with pytest.raises(ConfigError, match=r"buffer.recency_prob \(0.95 -> 0.5\)"):
        rundir.prepare(run, _config("train.steps=20", "buffer.recency_prob=0.5"), resume=True)
    assert json.loads((run / "config.json").read_text())["buffer"]["recency_prob"] == 0.95


def test_a_run_that_never_trained_is_replaced_by_the_fixed_command(tmp_path, capsys):
    run = tmp_path / "run"
    rundir.prepare(run, _config("train.steps=10"), resume=False)
    (run / "trajectories" / "searcher-0").mkdir(parents=True)
    (run / "logs").mkdir()
    (run / "logs" / "trainer.log").write_text("ZeroDivisionError\n")
    rundir.write_status(run, "trainer", {"step": 0, "phase": "waiting for data"})
    (run / "checkpoints" / "0").mkdir(parents=True)  # stopped before its first step
    rundir.write_json_atomic(run / "summary.json", {"trainer_steps": 0, "stopped_early": True})
    rundir.prepare(run, _config("train.steps=12"), resume=False)  # not "already holds a run"
    assert "never trained" in capsys.readouterr().err
    assert json.loads((run / "config.json").read_text())["train"]["steps"] == 12
    assert not any((run / name).exists() for name in ("trajectories", "status", "checkpoints", "summary.json"))
    assert (run / "logs" / "trainer.log").exists()  # what went wrong the first time stays
    rundir.write_status(run, "trainer", {"step": 3, "phase": "training"})  # this one trained
    with pytest.raises(ConfigError, match="already holds a run"):
        rundir.prepare(run, _config("train.steps=12"), resume=False)


def test_run_lock_refuses_a_second_launcher_and_takes_over_a_stale_lock(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with rundir.RunLock(run):
        holder = json.loads((run / rundir.LOCK_FILE).read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        with pytest.raises(ConfigError, match=rf"in use by another launcher \(pid {os.getpid()} on host "):
            rundir.RunLock(run).acquire()
    assert not (run / rundir.LOCK_FILE).exists()  # released
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run / rundir.LOCK_FILE).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "time": 0}))
    with rundir.RunLock(run):  # its launcher died (SIGKILL): the lock is stale
        assert json.loads((run / rundir.LOCK_FILE).read_text())["pid"] == os.getpid()
    (run / rundir.LOCK_FILE).write_text(json.dumps({"pid": 1, "host": "gpu-node-7", "time": 0}))
    with pytest.raises(ConfigError, match="pid 1 on host gpu-node-7"):
        rundir.RunLock(run).acquire()  # another host's launcher: cannot tell, so refuse


def test_run_dir_under_a_file_is_a_one_line_error(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match=r"cannot use .*afile/run as the run directory: Not a directory"):
        rundir.make_run_dir(tmp_path / "afile" / "run")


def test_read_only_filesystem_is_a_one_line_error_from_main(tmp_path, capsys, monkeypatch):
    """As root no directory is read-only to us, so the filesystem's refusal is simulated."""
    import errno

    def refuse(self, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(Path, "mkdir", refuse)
    code = main([f"--run-dir={tmp_path / 'run'}", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().splitlines() == [
        f"error: cannot use {tmp_path / 'run'} as the run directory: Read-only file system; choose another --run-dir"
    ], err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_run_dir_is_a_one_line_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(ConfigError, match="Permission denied"):
            rundir.make_run_dir(ro / "run")
    finally:
        ro.chmod(0o755)


def test_summary_of_a_previous_session_is_not_shown(tmp_path):
    rundir.write_json_atomic(tmp_path / "summary.json", {"trainer_steps": 5})
    os.utime(tmp_path / "summary.json", (time.time() - 100, time.time() - 100))
    assert read_summary(tmp_path) == {"trainer_steps": 5}
    assert read_summary(tmp_path, since=time.time() - 10) is None


# --- corrupt checkpoints --------------------------------------------------------------------------


def _weights(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    write_safetensors(path, {"a": np.arange(64, dtype=np.float32).reshape(8, 8), "b": np.ones(3, np.int32)})
    assert SafetensorsReader(tmp_path).get("a")[1, 2] == 10.0
    return path


@pytest.mark.parametrize("cut, why", [
    (lambda data: data[:-7], "ends at data byte"),  # data shorter than the header says
    (lambda data: data[:40], "header says it is"),  # cut inside the header
    (lambda data: data[:5], "shorter than the 8-byte header length"),
    (lambda data: data[:8] + b"\xff" * (len(data) - 8), "not valid JSON"),
])
def test_truncated_or_corrupt_safetensors_is_named(tmp_path, cut, why):
    path = _weights(tmp_path)
    path.write_bytes(cut(path.read_bytes()))
    with pytest.raises(CheckpointError, match="corrupt or truncated") as e:
        SafetensorsReader(tmp_path)
    assert str(path) in str(e.value) and why in str(e.value)


def test_header_offsets_that_disagree_with_the_shape_are_corrupt(tmp_path):
    header = json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    with pytest.raises(CheckpointError, match=r"shape \[4\] F32 needs 16 bytes"):
        SafetensorsReader(tmp_path)


# --- bad input stops in preflight, before any role starts -------------------------------------------


def _bad_run(tmp_path, capsys, *args: str) -> str:
    run = tmp_path / "run"
    code = main([f"--run-dir={run}", "--quiet", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert not (run / "logs").exists() and not (run / "config.json").exists()  # no role ever started
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return err


def test_truncated_weights_are_refused_before_any_role_starts(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(TINY, ckpt)
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    err = _bad_run(tmp_path, capsys, "--set", f"model.checkpoint={ckpt}")
    assert "corrupt or truncated" in err and str(weights) in err
    weights.unlink()
    assert "no model.safetensors" in _bad_run(tmp_path, capsys, "--set", f"model.checkpoint={ckpt}")


def test_a_corrupt_tokenizer_is_refused_before_any_role_starts(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(TINY, ckpt)
    (ckpt / "tokenizer.json").write_text('{"model": {"type": "WordLevel"')  # cut off mid-write
    err = _bad_run(tmp_path, capsys, "--set", f"model.checkpoint={ckpt}")
    assert "tokenizer.json does not load as a tokenizer" in err and str(ckpt) in err


def test_task_typo_and_user_file_syntax_error_are_one_line(tmp_path, capsys):
    assert "unknown task 'arithmatic'" in _bad_run(tmp_path, capsys, "--set", "task.name=arithmatic")
    broken = tmp_path / "my_task.py"
    broken.write_text("def make(:\n    pass\n")
    err = _bad_run(tmp_path, capsys, "--set", f"task.name={broken}:make")
    assert "SyntaxError" in err and "my_task.py" in err
    assert "train.checkpoint_every=0 must be >= 1" in _bad_run(tmp_path, capsys, "--set", "train.checkpoint_every=0")


def test_expensive_task_graded_in_process_is_refused_at_start(tmp_path, capsys):
    task = tmp_path / "slow_task.py"
    task.write_text(
        "import dataclasses\nfrom tbajax.tasks.arithmetic import arithmetic_task\n\n"
        "def make(**kw):\n    return dataclasses.replace(arithmetic_task(**kw), cheap_reward=False)\n"
    )
    err = _bad_run(tmp_path, capsys, "--set", f"task.name={task}:make")
    assert "cheap_reward=False" in err and "--set rollout.reward_workers=2" in err


def test_second_launcher_on_a_live_run_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    with rundir.RunLock(run):
        code = main([f"--run-dir={run}", "--quiet", "--resume"])
    err = capsys.readouterr().err
    assert code == 2 and "in use by another launcher" in err and str(os.getpid()) in err, err


# --- supervision on stand-in roles ------------------------------------------------------------------

ROLE = textwrap.dedent("""\
    import json, os, subprocess, sys, time
    run, role, behaviour = sys.argv[1], sys.argv[2], sys.argv[3]
    def status(**kw):
        os.makedirs(f"{run}/status", exist_ok=True)
        tmp = f"{run}/status/.{role}.tmp"
        with open(tmp, "w") as f:
            json.dump({"time": time.time(), "pid": os.getpid(), **kw}, f)
        os.replace(tmp, f"{run}/status/{role}.json")
    with open(f"{run}/{role}.starts", "a") as f:
        f.write(" ".join(sys.argv[4:]) + "\\n")
    if behaviour == "train":  # a trainer that makes 3 steps and finishes
        for step in range(1, 4):
            time.sleep(0.3)
            status(step=step, phase="training")
        sys.exit(0)
    if behaviour == "train_forever":
        step = 0
        while True:
            step += 1
            status(step=step, phase="training")
            time.sleep(0.2)
    if behaviour == "wait":  # a trainer that waits for data forever
        while True:
            status(step=0, phase="waiting for data")
            time.sleep(0.2)
    if behaviour == "crash_with_worker":  # a searcher whose grader outlives it
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(f"{run}/{role}.workers", "a") as f:
            f.write(f"{worker.pid}\\n")
        time.sleep(0.5)
        os._exit(1)
    if behaviour == "crash":
        sys.exit(1)
    if behaviour == "out_of_memory":  # XLA's real error for an allocation no machine here can make
        import jax, jax.numpy as jnp
        from tbajax.main import load_experiment
        from tbajax.system.out_of_memory import explain_out_of_memory
        with explain_out_of_memory(load_experiment("tiny_arithmetic"), role.split("-")[0]):
            jax.block_until_ready(jax.jit(lambda: jnp.zeros((2**38,), jnp.float32))())
    if behaviour == "sleep_then_die":  # killed from outside in the test
        time.sleep(600)
    if behaviour == "stubborn":  # ignores SIGTERM and the stop file
        import signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            status(step=1, phase="training")
            time.sleep(0.2)
    """)


def _supervisor(tmp_path: Path, trainer: str, searchers: list[str], *overrides: str) -> Supervisor:
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    script = tmp_path / "role.py"
    script.write_text(ROLE)
    config = _config("system.restart_backoff_s=0.2", *overrides)

    def child(role: str, behaviour: str) -> _Child:
        return _Child(role, [f"--role={role}"], dict(os.environ), run / "logs" / f"{role}.log",
                      command=[sys.executable, str(script), str(run), role, behaviour])

    sup = Supervisor(config, run, child("trainer", trainer), [child(f"searcher-{i}", b) for i, b in enumerate(searchers)])
    sup.tick_s = 0.1
    return sup


def _starts(sup: Supervisor, role: str) -> list[str]:
    path = sup.run_dir / f"{role}.starts"
    return path.read_text().splitlines() if path.exists() else []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its dead parent's reaper) counts as dead
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_crashed_searcher_group_is_killed_restarted_with_backoff_and_budgeted(tmp_path, capsys):
    sup = _supervisor(tmp_path, "wait", ["crash_with_worker"], "system.max_searcher_restarts=2")
    t0 = time.monotonic()
    assert sup.run() == 1
    elapsed = time.monotonic() - t0
    out, err = capsys.readouterr()
    assert len(_starts(sup, "searcher-0")) == 3  # the first start and two restarts
    assert "searcher-0 exited with 1; restarting in 0.2 s (exited with code 1; restart 1 of 2" in out
    assert "restarting in 0.4 s" in out  # backoff doubled
    assert "searcher-0 exited with code 1; giving up after 2 restarts" in err
    assert elapsed > 3 * 0.5 + 0.2 + 0.4  # each crash after 0.5 s, plus the two delays
    workers = [int(p) for p in (sup.run_dir / "searcher-0.workers").read_text().split()]
    assert len(workers) == 3
    # SIGKILL is delivered asynchronously: on a loaded machine a killed worker may take a moment to die
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in workers), "a dead searcher's grader survived it"


def test_trainer_killed_by_a_signal_is_named_and_resume_is_suggested(tmp_path, capsys):
    sup = _supervisor(tmp_path, "sleep_then_die", [])
    threading.Thread(target=lambda: (_wait_started(sup.trainer), sup.trainer.proc.send_signal(signal.SIGKILL)),
                     daemon=True).start()
    assert sup.run() == 1
    err = capsys.readouterr().err
    assert "trainer failed (killed by signal 9 (SIGKILL))" in err
    assert f"to continue from step 0 (there is no checkpoint yet): python -m tbajax.main --run-dir={sup.run_dir} --resume" in err


def test_trainer_is_restarted_with_resume_when_allowed(tmp_path, capsys):
    sup = _supervisor(tmp_path, "crash", [], "system.max_trainer_restarts=1")
    assert sup.run() == 1  # the restarted trainer crashes again: budget used up
    out, err = capsys.readouterr()
    assert _starts(sup, "trainer") == ["--role=trainer", "--role=trainer --resume"]  # the restart resumes from the checkpoint
    assert "trainer failed (exited with code 1); restarting it from step 0" in out
    assert "after 1 automatic restarts" in err


@pytest.mark.parametrize("role", ["trainer", "searcher-0"])
def test_a_role_out_of_device_memory_is_not_restarted_and_its_advice_is_shown(tmp_path, capsys, role):
    """The same program would run out again: the run ends at once (restarts were allowed), showing
    the error's advice."""
    trainer, searchers = ("out_of_memory", []) if role == "trainer" else ("wait", ["out_of_memory"])
    sup = _supervisor(tmp_path, trainer, searchers, "system.max_trainer_restarts=2", "system.max_searcher_restarts=2")
    assert sup.run() == 1
    err = capsys.readouterr().err
    assert len(_starts(sup, role)) == 1
    assert f"{role} ran out of device memory; a restart would too" in err
    assert (f"error: tbajax.system.out_of_memory.DeviceOutOfMemoryError: the {role.split('-')[0]} ran out of "
            "device memory (RESOURCE_EXHAUSTED") in err
    assert f"--run-dir={sup.run_dir} --resume --set KEY=VALUE" in err
    assert ("model.head_chunk_tokens=512" if role == "trainer" else "rollout.prompts_per_call=") in err


def test_stall_ends_the_run_naming_the_stuck_role(tmp_path, capsys):
    sup = _supervisor(tmp_path, "wait", ["sleep_then_die"], "system.stall_timeout_s=1.5")
    t0 = time.monotonic()
    assert sup.run() == 3
    assert time.monotonic() - t0 < 30
    err = capsys.readouterr().err
    assert "the trainer has been waiting for data at step 0" in err
    assert "searcher-0: never reported" in err


def test_silent_searcher_is_killed_and_restarted_while_the_trainer_trains(tmp_path, capsys):
    sup = _supervisor(tmp_path, "train_forever", ["sleep_then_die"], "system.stall_timeout_s=1.5",
                      "system.max_searcher_restarts=1")
    assert sup.run() == 1  # hung, restarted, hung again: its budget is used up
    out, err = capsys.readouterr()
    assert re.search(r"searcher-0 has not reported for \d+ s while the trainer kept training", err), err
    assert "searcher-0 exited with -9; restarting in 0.2 s (killed by signal 9 (SIGKILL); restart 1 of 1" in out
    assert "searcher-0 killed by signal 9 (SIGKILL); giving up after 1 restarts" in err
    assert len(_starts(sup, "searcher-0")) == 2


def test_first_ctrl_c_stops_cleanly_and_says_what_it_force_kills(tmp_path, capsys):
    sup = _supervisor(tmp_path, "stubborn", [], "system.stop_grace_s=1")
    threading.Thread(target=lambda: (_wait_started(sup.trainer), time.sleep(0.5), os.kill(os.getpid(), signal.SIGINT)),
                     daemon=True).start()
    assert sup.run() == 130
    out, err = capsys.readouterr()
    assert "stopping: asking every role to shut down cleanly" in out and "Ctrl-C again" in out
    assert "trainer did not exit within 1 s of the stop request; killing it (SIGKILL)" in err
    assert rundir.stop_requested(sup.run_dir)


def test_second_ctrl_c_kills_at_once(tmp_path, capsys):
    sup = _supervisor(tmp_path, "stubborn", [], "system.stop_grace_s=120")

    def interrupt_twice() -> None:
        _wait_started(sup.trainer)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_twice, daemon=True).start()
    t0 = time.monotonic()
    assert sup.run() == 130
    assert time.monotonic() - t0 < 30  # not the 120 s grace
    assert "second interrupt: killing every role now (SIGKILL)" in capsys.readouterr().err


def _wait_started(child: _Child, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while child.proc is None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)


# --- a real run, extended on resume -------------------------------------------------------------------


@pytest.mark.slow  # two real runs each; the resume-key rules are unit-tested in the default run
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resume_extends_a_finished_run(tmp_path, mode):
    """A finished 2-step run continued to 3 steps with `--resume --set train.steps=3` (no
    experiment or other overrides: the config comes from the run directory). In sync mode the
    resumed version is the restored step (it once came back as 0: "current_version went backwards")."""
    run = tmp_path / "run"
    small = ["--quiet", f"--mode={mode}", "--set", "eval.num_problems=16", "--set", "eval.batch_size=16",
             "--set", "rollout.prompts_per_call=4", "--set", "train.groups_per_step=4"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["XLA_FLAGS"] = ROLE_XLA_FLAGS  # each role: one CPU device, as a user's run

    def run_main(*args: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "tbajax.main", f"--run-dir={run}", *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    run_main(*small, "--set", "train.steps=2")
    assert json.loads((run / "summary.json").read_text())["trainer_steps"] == 2
    out = run_main("--quiet", "--resume", "--set", "train.steps=3")
    assert "resume: updating train.steps" in out
    assert json.loads((run / "config.json").read_text())["train"]["steps"] == 3
    assert json.loads((run / "summary.json").read_text())["trainer_steps"] == 3
    assert not (run / rundir.LOCK_FILE).exists()


def test_resume_compares_against_the_stored_config_with_new_fields_defaulted(tmp_path):
    """A run started before a field existed resumes: the missing field is its default, no change."""
    run = tmp_path / "run"
    rundir.prepare(run, _config(), resume=False)
    stored = json.loads((run / "config.json").read_text())
    del stored["system"]["devices_per_searcher"], stored["rollout"]["reward_timeout_s"]
    rundir.write_json_atomic(run / "config.json", stored)
    assert rundir.prepare(run, _config(), resume=True) == []
