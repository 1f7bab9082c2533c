"""Where a run stands, from its directory alone: for roles a scheduler started (SLURM, Ray, by hand)
as much as for the launcher's.

    python -m tbajax.status RUN_DIR [--json] [--watch SECONDS]

Reads the files the roles keep up to date (config.json, status/<role>.json, summary.json, the
evaluation records in metrics.jsonl, checkpoints/, launcher.lock, control/stop); imports no jax
and touches no store, so it answers at once, also while the run is going.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

QUIET_S = 120.0  # a role whose status is older than this, and not known alive, has stopped


@dataclasses.dataclass(frozen=True)
class RoleState:
    role: str
    phase: str | None
    step: int | None
    version: int | None
    samples: int | None
    tokens_per_s: float | None
    age_s: float  # since its last status update
    alive: bool | None  # its process on this host: True / False; None = another host, or unknown


@dataclasses.dataclass(frozen=True)
class RunState:
    run_dir: str
    experiment: str
    objective: str
    mode: str
    searchers: int
    steps: int  # train.steps
    state: str  # "finished", "running", "stopped", "not started"
    step: int  # the trainer's latest step
    stop_requested: bool
    launcher: dict[str, Any] | None  # launcher.lock: pid, host, since
    roles: list[RoleState]
    evals: list[tuple[int, float]]  # (trainer step, eval_score), by step
    eval_metric: str | None
    checkpoints: list[int]
    summary: dict[str, Any] | None


def process_alive(pid: Any, host: Any) -> bool | None:
    """Whether process `pid` runs, when it is on this host; None when that cannot be told."""
    if host != socket.gethostname() or not isinstance(pid, int):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_state(run_dir: str | os.PathLike[str], now: float | None = None) -> RunState:
    from tbajax.system import rundir
    from tbajax.system.launcher import read_summary
    from tbajax.system.metrics import eval_records

    run_dir = Path(run_dir)
    config = rundir.load_config(run_dir)  # ConfigError (no config.json) says how to start one
    now = time.time() if now is None else now
    roles = []
    for role, s in rundir.read_status(run_dir).items():
        roles.append(RoleState(
            role, s.get("phase"), _int(s.get("step")), _int(s.get("version")), _int(s.get("samples")),
            s.get("tokens_per_s"), now - float(s.get("time", 0.0)),
            process_alive(s.get("pid"), s.get("host"))))
    roles.sort(key=lambda r: (r.role != "trainer", r.role))
    summary = read_summary(run_dir)
    lock = _read_json(run_dir / rundir.LOCK_FILE)
    launcher = None
    if lock is not None and process_alive(lock.get("pid"), lock.get("host")) is not False:
        launcher = {k: lock.get(k) for k in ("pid", "host", "time")}
    trainer = next((r for r in roles if r.role == "trainer"), None)
    step = (trainer.step or 0) if trainer else 0
    if summary is not None:
        step = max(step, int(summary.get("trainer_steps", 0)))
    live = [r for r in roles if r.alive or (r.alive is None and r.age_s < QUIET_S)]
    if launcher is not None:
        state = "running"
    elif summary is not None and not summary.get("stopped_early") and step >= config.train.steps:
        state = "finished"
    elif live:
        state = "running"
    elif roles or summary is not None:
        state = "stopped"
    else:
        state = "not started"
    records = eval_records(run_dir)
    evals = [(int(r["step"]), float(r["eval_score"])) for r in records]
    # the task's headline metric: every evaluation record names it (the summary too, at the end)
    metric = next((r["eval_metric"] for r in reversed(records) if "eval_metric" in r),
                  summary.get("eval_metric") if summary else None)
    return RunState(str(run_dir), config.name, config.train.objective, config.system.mode,
                    config.system.num_searchers, config.train.steps, state, step,
                    rundir.stop_requested(run_dir), launcher, roles, evals, metric,
                    rundir.checkpoint_steps(run_dir), summary)


def describe(s: RunState) -> str:
    """The run's state as a few lines of text."""
    plural = "s" if s.searchers != 1 else ""
    mode = "sync" if s.mode == "sync" else f"async with {s.searchers} searcher{plural}"
    lines = [f"{s.run_dir}: {s.experiment}, objective {s.objective}, {mode}"]
    progress = f"trainer step {s.step} of {s.steps} ({100 * s.step / max(s.steps, 1):.0f}%)"
    state = {"running": f"running: {progress}", "finished": f"finished: {progress}",
             "stopped": f"stopped at {progress}; continue it with `python -m tbajax.main --run-dir "
                        f"{s.run_dir} --resume`",
             "not started": "not started: no role has reported yet"}[s.state]
    if s.stop_requested and s.state == "running":
        state += "; stop requested"
    lines.append(state)
    if s.launcher is not None:
        since = time.strftime("%Y-%m-%d %H:%M", time.localtime(s.launcher.get("time") or 0))
        lines.append(f"launcher: pid {s.launcher.get('pid')} on {s.launcher.get('host')}, since {since}")
    if s.roles:
        rows = [("role", "phase", "step", "version", "samples", "tok/s", "updated")]
        for r in s.roles:
            alive = {True: "", False: ", exited", None: ""}[r.alive]
            rate = "-" if r.tokens_per_s is None else f"{r.tokens_per_s:,.0f}"
            rows.append((r.role, r.phase or "-", _num(r.step), _num(r.version), _num(r.samples), rate,
                         f"{_ago(r.age_s)}{alive}"))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines += ["  " + "  ".join(c.ljust(w) if i in (0, 1) else c.rjust(w)
                                   for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
    if s.evals:
        name = s.eval_metric or "eval score"
        shown = s.evals if len(s.evals) <= 4 else [s.evals[0], None, *s.evals[-2:]]
        lines.append(f"{name}: " + " → ".join("…" if e is None else f"{e[1]:.3f} (step {e[0]})"
                                               for e in shown))
    if s.checkpoints:
        lines.append(f"checkpoints: {', '.join(map(str, s.checkpoints[-3:]))}"
                     + (f" (and {len(s.checkpoints) - 3} older)" if len(s.checkpoints) > 3 else ""))
    if s.state == "finished" and s.summary is not None:
        lines.append(f"wall time {s.summary.get('wall_time_s', 0):.0f} s, "
                     f"{s.summary.get('samples_generated', 0):,} samples generated; "
                     f"summary: {Path(s.run_dir) / 'summary.json'}")
    return "\n".join(lines)


def _int(x: Any) -> int | None:
    return None if x is None else int(x)


def _num(x: int | None) -> str:
    return "-" if x is None else f"{x:,}"


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s ago"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tbajax.status", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path, help="the run directory (--run-dir of python -m tbajax.main)")
    ap.add_argument("--json", action="store_true", help="the state as one JSON object")
    ap.add_argument("--watch", type=float, metavar="SECONDS",
                    help="print it again every SECONDS until Ctrl-C")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from tbajax.config import ConfigError

    while True:
        try:
            state = run_state(args.run_dir)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(json.dumps(dataclasses.asdict(state)) if args.json else describe(state), flush=True)
        if args.watch is None:
            return 0
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0
        if not args.json:
            print()


if __name__ == "__main__":
    sys.exit(main())
