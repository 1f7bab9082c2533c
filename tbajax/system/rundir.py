"""The run directory's small control files: resolved config, stop flag, per-role status.

Layout (stores live beside these, see tbajax.stores):
    config.json            the resolved ExperimentConfig (every role reads it)
    control/stop           present = every role should finish up and exit
    status/<role>.json     each role's latest progress line (atomically replaced)
    logs/<role>.log        each process's output (launcher)
    metrics.jsonl, tensorboard/, plots/, summary.json, checkpoints/
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from tbajax.config import ConfigError, ExperimentConfig


LAUNCHER_PID_ENV = "TBAJAX_LAUNCHER_PID"


def write_json_atomic(path: Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    os.replace(tmp, path)


def prepare(run_dir: Path, config: ExperimentConfig, *, resume: bool) -> None:
    """Write config.json for a new run; on resume, insist the stored config is the same one."""
    path = run_dir / "config.json"
    if resume:
        if not path.exists():
            raise ConfigError(f"--resume: {run_dir} holds no run (no config.json); start it without --resume")
        stored = json.loads(path.read_text())
        if stored != config.to_dict():
            raise ConfigError(
                f"--resume: the configuration differs from the one stored in {path}; resume with the "
                "same experiment and overrides, or start a new --run-dir"
            )
    else:
        if path.exists():
            raise ConfigError(
                f"{run_dir} already holds a run; pass --resume to continue it or choose a new --run-dir"
            )
        write_json_atomic(path, config.to_dict())
    clear_stop(run_dir)


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
    write_json_atomic(run_dir / "status" / f"{role}.json", {"time": time.time(), "pid": os.getpid(), **status})


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
