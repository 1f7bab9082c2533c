"""Start the trainer and N searchers as separate OS processes, supervise them, show progress.

Each role is `python -m tbajax.main --role=... --run-dir=...`, the same command a scheduler
(SLURM, Kubernetes, Ray jobs) would run on another host, so the launcher is a convenience for one
machine, not a cluster manager. Roles talk only through the run directory / stores.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tbajax.config import ExperimentConfig
from tbajax.system import rundir


@dataclass
class _Child:
    role: str
    args: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    history: list[int] = field(default_factory=list)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        log.write(f"\n=== start {self.role} at {time.ctime()} (restart {self.restarts}) ===\n".encode())
        log.flush()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tbajax.main", *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,  # Ctrl-C reaches the launcher only; it forwards a clean stop
        )
        log.close()

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass


def child_env(config: ExperimentConfig, role: str, index: int) -> dict[str, str]:
    """Environment of one role: its device set and its share of a shared GPU's memory."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env[rundir.LAUNCHER_PID_ENV] = str(os.getpid())
    sysc = config.system
    if sysc.memory_fraction is not None:
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(sysc.memory_fraction)
    elif sysc.devices == "shared":
        # several JAX processes on one GPU: none may preallocate 75% of it
        share = 0.9 / (1 + sysc.num_searchers)
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{share:.3f}")
    if sysc.devices == "split":
        if role == "trainer":
            ids = range(sysc.trainer_devices)
        else:
            first = sysc.trainer_devices + index * sysc.devices_per_searcher
            ids = range(first, first + sysc.devices_per_searcher)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, ids))
    return env


def launch(config: ExperimentConfig, run_dir: Path, *, resume: bool = False, quiet: bool = False) -> int:
    """Run the experiment to completion; returns the process exit code."""
    preflight(config)
    rundir.prepare(run_dir, config, resume=resume)
    common = [f"--run-dir={run_dir}"] + (["--resume"] if resume else [])
    logs = run_dir / "logs"
    trainer = _Child("trainer", ["--role=trainer", *common], child_env(config, "trainer", 0), logs / "trainer.log")
    searchers = [
        _Child(
            f"searcher-{i}",
            ["--role=searcher", f"--searcher-id={i}", *common],
            child_env(config, "searcher", i),
            logs / f"searcher-{i}.log",
        )
        for i in range(config.system.num_searchers if config.system.mode == "async" else 0)
    ]  # sync mode: the trainer process generates its own batches
    children = [trainer, *searchers]
    stop_requested = False

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stop_requested
        stop_requested = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    progress = _Progress(config, run_dir, quiet)
    try:
        for c in children:
            c.start()
        code = 0
        while True:
            time.sleep(0.5)
            progress.update()
            if stop_requested:
                print("\nstopping: asking every role to shut down cleanly (checkpointing)...", flush=True)
                code = 130
                break
            t = trainer.poll()
            if t is not None:
                if t != 0:
                    print(f"\ntrainer failed (exit {t}); last lines of {trainer.log_path}:", file=sys.stderr)
                    print(_tail(trainer.log_path), file=sys.stderr)
                    code = t if t > 0 else 1
                break
            for s in searchers:
                r = s.poll()
                if r is None:
                    continue
                s.history.append(r)
                if s.restarts >= config.system.max_searcher_restarts:
                    print(f"\n{s.role} failed {s.restarts + 1} times (exit {r}); giving up. Last lines:", file=sys.stderr)
                    print(_tail(s.log_path), file=sys.stderr)
                    stop_requested = True
                    code = 1
                    break
                s.restarts += 1
                print(f"\n{s.role} exited with {r}; restarting ({s.restarts}/{config.system.max_searcher_restarts})", flush=True)
                s.start()
            if code:
                break
        _shutdown(children, run_dir)
        progress.close()
        return code
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for c in children:
            c.signal(signal.SIGKILL)


def preflight(config: ExperimentConfig) -> None:
    """Fail in the launcher, with one clear message, on what every role would fail on."""
    from tbajax.config import ConfigError
    from tbajax.models import CheckpointError, resolve_checkpoint
    from tbajax.system.assets import load_task, load_tokenizer_for
    from tbajax.system.trainer import resolve_objective

    try:
        resolve_checkpoint(config.model.checkpoint)  # also fetches a hub id once, for all roles
    except CheckpointError as e:
        raise CheckpointError(
            f"model.checkpoint={config.model.checkpoint!r}: {e}. Pass a local Hugging Face directory "
            "with --set model.checkpoint=DIR (or download the hub id on a machine with network access)"
        ) from None
    try:
        load_tokenizer_for(config)
        resolve_objective(config.train.objective)
        load_task(config)
    except (ValueError, ImportError, AttributeError, TypeError) as e:
        raise ConfigError(f"{type(e).__name__}: {e}") from None


def _shutdown(children: Sequence[_Child], run_dir: Path, grace_s: float = 60.0) -> None:
    rundir.request_stop(run_dir)
    for c in children:
        c.signal(signal.SIGTERM)
    deadline = time.time() + grace_s
    for c in children:
        while c.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        c.signal(signal.SIGKILL)
        if c.proc is not None:
            c.proc.wait()


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class _Progress:
    """A live progress bar over trainer steps, fed by the roles' status files."""

    def __init__(self, config: ExperimentConfig, run_dir: Path, quiet: bool):
        self.run_dir = run_dir
        self.bar = None
        if not quiet:
            from tqdm import tqdm

            # disable=None: a bar on a terminal, nothing in a log file (the status line is in status/)
            self.bar = tqdm(total=config.train.steps, desc="trainer steps", unit="step", dynamic_ncols=True,
                            disable=None, mininterval=1.0)

    def update(self) -> None:
        if self.bar is None:
            return
        status = rundir.read_status(self.run_dir)
        t = status.get("trainer", {})
        gen = sum(s.get("tokens_per_s", 0.0) for k, s in status.items() if k.startswith("searcher"))
        samples = sum(s.get("samples", 0) for k, s in status.items() if k.startswith("searcher"))
        self.bar.n = int(t.get("step", 0))
        self.bar.set_postfix_str(
            f"{t.get('phase', 'starting')} reward={t.get('reward_mean', float('nan')):.3f} "
            f"eval={t.get('eval_accuracy', float('nan')):.3f} buffer={t.get('buffer_rows', 0)} "
            f"lag={t.get('policy_lag', float('nan')):.1f} samples={samples} gen={gen:,.0f}tok/s",
            refresh=False,
        )
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.update()
            self.bar.close()


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "summary.json"
    return json.loads(path.read_text()) if path.exists() else None
