"""The run directory's small control files: resolved config, stop flag, per-role status.

Layout (stores live beside these, see tbajax.stores):
    config.json            the resolved ExperimentConfig (every role reads it)
    launcher.lock          the live launcher's pid and host (one launcher per run directory)
    control/stop           present = every role should finish up and exit
    status/<role>.json     each role's latest progress line (atomically replaced)
    logs/<role>.log        each process's output (launcher)
    metrics.jsonl, tensorboard/, plots/, summary.json, checkpoints/
    model/                 the base checkpoint's config.json and the tokenizer (tbajax.system.run_model)
    wandb/                 Weights & Biases' local files, with system.wandb (tbajax.system.wandb_logging)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from tbajax.config import ConfigError, ExperimentConfig, check_resume_changes


LAUNCHER_PID_ENV = "TBAJAX_LAUNCHER_PID"
LOCK_FILE = "launcher.lock"
# What a run writes into its directory; a run that never trained is replaced by removing these
# (logs/ stay: they tell what went wrong the first time).
RUN_ENTRIES = ("config.json", "run_id", "summary.json", "metrics.jsonl", "trajectories", "params",
               "checkpoints", "status", "control", "tensorboard", "plots", "model",
               "wandb")


def write_json_atomic(path: Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    os.replace(tmp, path)


def make_run_dir(run_dir: Path) -> None:
    """Create the run directory, or say in one line why it cannot be one."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test.{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        reason = e.strerror or type(e).__name__
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(run_dir) else ""
        raise ConfigError(
            f"cannot use {run_dir} as the run directory: {reason}{where}; choose another --run-dir"
        ) from None


def prepare(run_dir: Path, config: ExperimentConfig, *, resume: bool) -> list[str]:
    """Write config.json for a new run; on resume, check the stored config and store the safe
    changes (`tbajax.config.RESUME_SAFE_KEYS`, e.g. more train.steps). Returns the changed keys.

    A directory whose run never trained (it failed before its first step or checkpoint, e.g. on
    bad input) is replaced by a new run, so re-running the fixed command just works."""
    path = run_dir / "config.json"
    changed: list[str] = []
    if resume:
        if not path.exists():
            raise ConfigError(f"--resume: {run_dir} holds no run (no config.json); start it without --resume")
        stored = json.loads(path.read_text())
        try:  # fields added since the run started take their defaults, and are no difference
            stored = ExperimentConfig.from_dict(stored).to_dict()
        except ConfigError:
            pass  # a field since removed: compare as stored, the difference will name it
        changed = check_resume_changes(stored, config.to_dict())
        if changed:
            write_json_atomic(path, config.to_dict())
    else:
        if path.exists():
            if not never_trained(run_dir):
                raise ConfigError(
                    f"{run_dir} already holds a run; pass --resume to continue it or choose a new --run-dir"
                )
            print(f"note: {run_dir} holds a run that never trained (no step, no checkpoint); replacing it",
                  file=sys.stderr, flush=True)
            remove_run(run_dir)
        write_json_atomic(path, config.to_dict())
    clear_stop(run_dir)
    return changed


def checkpoint_steps(run_dir: Path) -> list[int]:
    """Steps of the trainer checkpoints in the run directory (orbax names them by step)."""
    ckpts = run_dir / "checkpoints"
    return sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) if ckpts.is_dir() else []


def never_trained(run_dir: Path) -> bool:
    """No trainer step in any checkpoint, status or summary: nothing a resume could continue
    (a run stopped before its first step still checkpoints its step 0)."""
    if any(step > 0 for step in checkpoint_steps(run_dir)):
        return False
    try:
        summary_steps = json.loads((run_dir / "summary.json").read_text()).get("trainer_steps", 0)
    except FileNotFoundError:
        summary_steps = 0
    except (OSError, json.JSONDecodeError):
        return False  # cannot tell: keep it
    status_steps = read_status(run_dir).get("trainer", {}).get("step", 0)
    return int(summary_steps or 0) == 0 and int(status_steps or 0) == 0


def remove_run(run_dir: Path) -> None:
    for name in RUN_ENTRIES:
        p = run_dir / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()


class RunLock:
    """One launcher per run directory: `launcher.lock` holds the owner's pid and host for the
    life of the run. A lock whose pid is dead on this host is stale (the launcher was killed) and
    is taken over; any other is refused with who holds it."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK_FILE
        self.owner = {"pid": os.getpid(), "host": socket.gethostname()}
        self.held = False

    def acquire(self) -> None:
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is not None and not self._stale(holder):
                    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("time", 0)))
                    raise ConfigError(
                        f"{self.path.parent} is in use by another launcher (pid {holder.get('pid')} on host "
                        f"{holder.get('host')}, since {since}); wait for it to end or stop it (Ctrl-C), or "
                        f"choose another --run-dir. If that launcher is gone, delete {self.path}"
                    ) from None
                self.path.unlink(missing_ok=True)  # stale (or unreadable and old): take it over
                continue
            with os.fdopen(fd, "w") as f:
                json.dump({**self.owner, "time": time.time(), "argv": sys.argv}, f)
            self.held = True
            return
        raise ConfigError(f"could not take the run-directory lock {self.path}; another launcher keeps taking it")

    def release(self) -> None:
        if self.held:
            holder = self._holder()
            if holder is not None and {k: holder.get(k) for k in self.owner} == self.owner:
                self.path.unlink(missing_ok=True)
            self.held = False

    def _holder(self) -> dict[str, Any] | None:
        """The lock's content; None when it is unreadable and older than a minute (a launcher
        killed while writing it), so that only a lock being written right now is respected."""
        try:
            return json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError):
            try:
                age = time.time() - self.path.stat().st_mtime
            except OSError:
                return None
            return None if age > 60 else {"pid": "?", "host": "?", "time": time.time()}

    @staticmethod
    def _stale(holder: dict[str, Any]) -> bool:
        if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
            return False  # another host's launcher: we cannot tell; the message says how to clear it
        try:
            os.kill(holder["pid"], 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def load_config(run_dir: Path) -> ExperimentConfig:
    path = run_dir / "config.json"
    if not path.exists():
        raise ConfigError(
            f"{path} does not exist: start the run with `python -m tbajax.main --experiment=NAME "
            f"--run-dir={run_dir}` (or --role=... after writing the config with --write-config)"
        )
    return ExperimentConfig.from_dict(json.loads(path.read_text()))


def request_stop(run_dir: Path) -> None:
    (run_dir / "control").mkdir(parents=True, exist_ok=True)
    (run_dir / "control" / "stop").write_text(str(time.time()))


def clear_stop(run_dir: Path) -> None:
    (run_dir / "control" / "stop").unlink(missing_ok=True)


def stop_requested(run_dir: Path) -> bool:
    return (run_dir / "control" / "stop").exists()


def write_status(run_dir: Path, role: str, status: dict[str, Any]) -> None:
    write_json_atomic(run_dir / "status" / f"{role}.json",
                      {"time": time.time(), "pid": os.getpid(), "host": socket.gethostname(), **status})


def read_status(run_dir: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for p in sorted((run_dir / "status").glob("*.json")):
        try:
            out[p.stem] = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue
    return out


class StopFlag:
    """True once the launcher asked to stop (stop file) or this process got SIGTERM / SIGINT.

    Installing it replaces those signals' handlers, so a role finishes its current unit of work
    (a generation call, a train step), checkpoints, and exits cleanly."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.signalled = False
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signalled = True

    def __call__(self) -> bool:
        return self.signalled or stop_requested(self.run_dir) or self._orphaned()

    @staticmethod
    def _orphaned() -> bool:
        """Started by a launcher that has died (e.g. SIGKILL): nobody will supervise us."""
        parent = os.environ.get(LAUNCHER_PID_ENV)
        return parent is not None and os.getppid() != int(parent)
