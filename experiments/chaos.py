"""Chaos run: SIGKILL the searcher several times (once deterministically mid-append) and the trainer
once during an async run of the tiny default model, resume, then audit the run directory.

    python experiments/chaos.py --json experiments/results/chaos/chaos.json [--repeats 20]

Figures: kills survived, rows committed, rows read back, torn rows (must be 0), duplicated rows
(must be 0), whether the committed row count ever went down, whether param versions stayed
monotone, and the wall time. tests/test_chaos.py runs the same scenario (`run_scenario`).

The mid-append kill uses the trajectory writer's fault hook (TBAJAX_FAULT_PAUSE_BEFORE_COMMIT_S):
every append pauses between its durable data write and its commit and logs that it does, so the
driver can kill the searcher exactly there. A trainer kill is survived with `--resume` (started
here once the launcher has exited, or followed if a launcher restarts the trainer itself).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SMALL = [
    "--set", "eval.num_problems=16",
    "--set", "eval.batch_size=16",
    "--set", "rollout.prompts_per_call=4",
    "--set", "train.groups_per_step=4",
    "--set", "train.log_every=1",
    "--set", "train.checkpoint_every=2",
    "--set", "system.max_searcher_restarts=50",
    "--set", "system.restart_backoff_s=0.5",  # the backoff has its own launcher test; here it is only idle time
]
HOOK = re.compile(r"fault hook: pid (\d+) wrote data past committed rows (\d+) \(\+(\d+)\)")


class ChaosError(AssertionError):
    """The scenario could not be driven as planned (a role did not come up in time, ...)."""


def _role_pids(run_dir: Path, role: str) -> list[int]:
    """Live processes of `role` in this run (from /proc: the launcher's children, found by cmdline)."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().split(b"\0")
            state = (p / "stat").read_text().split(") ", 1)[1][0]
        except OSError:
            continue
        if state != "Z" and b"tbajax.main" in cmd and f"--role={role}".encode() in cmd \
                and f"--run-dir={run_dir}".encode() in cmd:
            out.append(int(p.name))
    return out


def _status(run_dir: Path, role: str) -> dict[str, Any]:
    try:
        return json.loads((run_dir / "status" / f"{role}.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


class RowMonitor(threading.Thread):
    """Samples the committed row count of every store; records any decrease."""

    def __init__(self, run_dir: Path, every_s: float = 0.1):
        super().__init__(daemon=True)
        self.run_dir, self.every_s = run_dir, every_s
        self.samples: list[int] = []
        self.decreases: list[tuple[int, int]] = []
        self.done = threading.Event()

    def rows(self) -> int:
        from tbajax.stores import TrajectoryReader, discover_searcher_stores

        return sum(TrajectoryReader(u).committed_rows() for u in discover_searcher_stores(str(self.run_dir)).values())

    def run(self) -> None:
        while not self.done.wait(self.every_s):
            try:
                n = self.rows()
            except Exception:  # noqa: BLE001 - a store being created; sample again
                continue
            if self.samples and n < self.samples[-1]:
                self.decreases.append((self.samples[-1], n))
            self.samples.append(n)


def _wait(pred, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        if proc is not None and proc.poll() is not None:
            raise ChaosError(f"the launcher exited ({proc.returncode}) while waiting for {what}")
        time.sleep(0.05)
    raise ChaosError(f"timed out after {timeout:.0f} s waiting for {what}")


def _launch(run_dir: Path, args: list[str], log_path: Path, pause_s: float) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TBAJAX_FAULT_PAUSE_BEFORE_COMMIT_S": str(pause_s),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    # each role: one CPU device, as a user's run (other XLA flags kept)
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")).strip()
    log = open(log_path, "ab")
    try:
        return subprocess.Popen([sys.executable, "-m", "tbajax.main", f"--run-dir={run_dir}", "--quiet", *SMALL, *args],
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    finally:
        log.close()


def _hook_lines(run_dir: Path) -> list[tuple[int, int, int]]:
    try:
        text = (run_dir / "logs" / "searcher-0.log").read_text(errors="replace")
    except OSError:
        return []
    return [tuple(map(int, m.groups())) for m in HOOK.finditer(text)]


def run_scenario(run_dir: Path, *, seed: int = 0, searcher_kills: int = 3, steps: int = 10,
                 pause_s: float = 0.3, early_kills: bool = False, timeout_s: float = 300.0,
                 say=print) -> dict[str, Any]:
    """Drive one chaos run in `run_dir` (must not exist) and return its audited figures.

    Kill 1 lands mid-append. The others land at a random moment after the previous kill: with
    `early_kills`, 0-3 s after the replacement process appears (start-up, store open, or the first
    appends on a fast machine: cheap, for the default test run); else 0-1.5 s after it committed."""
    rng = random.Random(seed)
    run_dir = Path(run_dir).absolute()
    run_dir.mkdir(parents=True)
    t0 = time.time()
    args = ["--set", f"train.steps={steps}", "--set", f"seed={seed}"]
    launcher_log = run_dir.parent / f"{run_dir.name}-launcher.log"
    proc = _launch(run_dir, args, launcher_log, pause_s)
    monitor = RowMonitor(run_dir)
    monitor.start()
    kills: list[dict[str, Any]] = []
    try:
        for k in range(searcher_kills):
            if k == 0 or not early_kills:
                base = monitor.rows()
                _wait(lambda: monitor.rows() > base, timeout_s, f"searcher to commit (kill {k + 1})", proc)
            if k == 0:  # deterministic: right after the data write of an append, before its commit
                seen = len(_hook_lines(run_dir))
                _wait(lambda: len(_hook_lines(run_dir)) > seen, timeout_s, "an append's data write", proc)
                pid, committed, adding = _hook_lines(run_dir)[-1]
                os.kill(pid, signal.SIGKILL)
                # its data is on disk, its commit is not: the rows must stay invisible
                kills.append({"role": "searcher", "pid": pid, "where": "mid-append", "committed_before": committed,
                              "rows_in_flight": adding, "committed_after_kill": monitor.rows()})
            else:
                last = kills[-1]["pid"]
                _wait(lambda: any(p != last for p in _role_pids(run_dir, "searcher")), 120, "a new searcher", proc)
                time.sleep(rng.uniform(0.0, 3.0 if early_kills else 1.5))
                pids = _role_pids(run_dir, "searcher")
                if not pids:
                    raise ChaosError("no searcher process to kill")
                os.kill(pids[0], signal.SIGKILL)
                kills.append({"role": "searcher", "pid": pids[0], "where": "random (early)" if early_kills else "random",
                              "committed_before": monitor.rows()})
            say(f"chaos: killed searcher ({kills[-1]['where']}), {monitor.rows()} rows committed")
            _wait(lambda: not _role_pids(run_dir, "searcher") or _role_pids(run_dir, "searcher") != [kills[-1]["pid"]],
                  60, "the killed searcher to go", proc)
        # the trainer, once it has a checkpoint to resume from (committed: a checkpoint is written in
        # the background, so a step past it does not mean it is there) and steps still to go
        _wait(lambda: _status(run_dir, "trainer").get("step", 0) >= 3 and _committed_steps(run_dir),
              timeout_s, "trainer step 3 and a committed checkpoint", proc)
        time.sleep(rng.uniform(0.0, 1.0))
        pids = _role_pids(run_dir, "trainer")
        step = _status(run_dir, "trainer").get("step", 0)
        if not pids or step >= steps:
            raise ChaosError(f"the trainer finished (step {step}) before it could be killed; raise --steps")
        os.kill(pids[0], signal.SIGKILL)
        kills.append({"role": "trainer", "pid": pids[0], "where": "random", "step": step})
        say(f"chaos: killed trainer at step ~{step}")
        sessions = 1
        _wait(lambda: proc.poll() is not None or any(p != pids[0] for p in _role_pids(run_dir, "trainer")),
              120, "the launcher to exit (or restart the trainer)")
        if proc.poll() is not None:  # this launcher does not restart trainers: resume by hand
            kills[-1]["before_resume"] = _state_before_resume(run_dir)
            proc = _launch(run_dir, [*args, "--resume"], launcher_log, pause_s)
            sessions += 1
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise ChaosError(f"the resumed run did not finish within {timeout_s:.0f} s") from None
    finally:
        monitor.done.set()
        monitor.join()
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
    figures = audit(run_dir)
    figures.update(
        kills_survived=len(kills),
        searcher_kills=sum(k["role"] == "searcher" for k in kills),
        trainer_kills=sum(k["role"] == "trainer" for k in kills),
        kills=kills,
        launcher_sessions=sessions,
        launcher_exit=proc.returncode,
        row_count_samples=len(monitor.samples),
        row_count_went_down=bool(monitor.decreases),
        wall_time_s=round(time.time() - t0, 1),
    )
    return figures


def _committed_steps(run_dir: Path) -> list[int]:
    """The steps of the trainer's checkpoints whose save has committed, oldest first."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and (p / "commit_success.txt").exists())


def _state_before_resume(run_dir: Path) -> dict[str, Any]:
    """What a resume must start from: the newest committed checkpoint (step and its extra
    metadata: buffer state, counters) and the newest published param version."""
    from tbajax.stores import ParamReader, param_store_url

    steps = _committed_steps(run_dir)
    extra = json.loads((run_dir / "checkpoints" / str(steps[-1]) / "extra" / "metadata").read_text()) if steps else None
    return {"checkpoint_step": steps[-1] if steps else None, "checkpoint_extra": extra,
            "latest_version": ParamReader(param_store_url(str(run_dir)), "chaos").latest_version()}


def audit(run_dir: Path) -> dict[str, Any]:
    """Read back every committed row and check the run's invariants."""
    from tbajax.config import ExperimentConfig
    from tbajax.models import resolve_checkpoint
    from tbajax.stores import ParamReader, TrajectoryReader, TrajectoryStoreError, discover_searcher_stores, param_store_url
    from tbajax.system.assets import load_task
    from tbajax.system.metrics import read_metrics
    from tbajax.system.searcher import PromptStream
    from tbajax.system.trainer import check_row

    config = ExperimentConfig.from_dict(json.loads((run_dir / "config.json").read_text()))
    vocab = json.loads((Path(resolve_checkpoint(config.model.checkpoint)) / "config.json").read_text())["vocab_size"]
    k = config.rollout.sampling.num_samples
    committed = read_back = torn = duplicated = 0
    prompt_order_exact = True
    store_versions_monotone = True
    for sid, url in discover_searcher_stores(str(run_dir)).items():
        reader = TrajectoryReader(url)
        n = reader.committed_rows()
        committed += n
        try:
            rows = [r for a in range(0, n, 4096) for r in reader.read(a, min(n, a + 4096))]
        except TrajectoryStoreError:
            torn += n  # inconsistent offsets: nothing in this store can be trusted
            continue
        read_back += len(rows)
        torn += sum(check_row(r, vocab) is not None for r in rows)
        runs: list[tuple[int, int, int]] = []  # (group id, length, prompt id) of contiguous runs
        for r in rows:
            if runs and runs[-1][0] == r.group_id:
                runs[-1] = (r.group_id, runs[-1][1] + 1, runs[-1][2])
            else:
                runs.append((r.group_id, 1, r.prompt_id))
        ids = [g for g, _, _ in runs]
        duplicated += sum(length - k for _, length, _ in runs if length > k)
        duplicated += sum(length for (g, length, _), prev in zip(runs[1:], ids) if g <= prev)  # replayed groups
        torn += sum(length for _, length, _ in runs if length < k)  # a group cut short
        stream = PromptStream(load_task(config).load("train"), sid, config.system.num_searchers, config.seed)
        prompt_order_exact &= [p for _, _, p in runs] == [p.id for p in stream.take(len(runs))]
        versions = [r.policy_version for r in rows]
        store_versions_monotone &= versions == sorted(versions)
    trainer = read_metrics(run_dir, "trainer", superseded=True)
    trainer_versions = [r["version"] for r in trainer if "version" in r]
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    latest = ParamReader(param_store_url(str(run_dir)), "audit").latest_version()
    return {
        "rows_committed": committed,
        "rows_read_back": read_back,
        "torn_rows": torn,
        "duplicated_rows": duplicated,
        "prompt_order_exact": bool(prompt_order_exact),
        "store_policy_versions_monotone": bool(store_versions_monotone),
        "trainer_versions_monotone": trainer_versions == sorted(trainer_versions),
        "final_version": summary.get("final_version"),
        "latest_published_version": latest,
        "resumes": sum(r.get("event") == "resume" for r in trainer),
        "trainer_steps": summary.get("trainer_steps"),
        "target_steps": config.train.steps,
        "stopped_early": summary.get("stopped_early"),
        "summary_samples_generated": summary.get("samples_generated"),
        "invalid_rows_skipped": summary.get("invalid_rows_skipped"),
        "eval_accuracy_start": summary.get("eval_accuracy_start"),
        "eval_accuracy_end": summary.get("eval_accuracy_end"),
    }


def check(f: dict[str, Any]) -> list[str]:
    """What is wrong with one scenario's figures ([] when it is sane)."""
    problems = []
    expect = {
        "torn_rows": 0, "duplicated_rows": 0, "row_count_went_down": False, "prompt_order_exact": True,
        "store_policy_versions_monotone": True, "trainer_versions_monotone": True, "stopped_early": False,
        "invalid_rows_skipped": 0, "trainer_steps": f["target_steps"], "rows_read_back": f["rows_committed"],
        "latest_published_version": f["final_version"],
    }
    for key, want in expect.items():
        if f.get(key) != want:
            problems.append(f"{key} = {f.get(key)!r}, expected {want!r}")
    # the summary counts the rows committed when the trainer finished; a searcher may still commit a
    # call or two before the launcher stops it, so the store may hold more, never fewer
    if not 0 < f.get("summary_samples_generated", 0) <= f["rows_committed"]:
        problems.append(f"summary_samples_generated = {f.get('summary_samples_generated')!r}, expected "
                        f"between 1 and the {f['rows_committed']} rows committed")
    if f["resumes"] < f["trainer_kills"]:
        problems.append(f"{f['trainer_kills']} trainer kill(s) but {f['resumes']} resume(s)")
    for kill in f["kills"]:
        if kill["where"] == "mid-append" and kill["committed_after_kill"] != kill["committed_before"]:
            problems.append(f"the append in flight when searcher {kill['pid']} was killed became visible: {kill}")
    if f["launcher_exit"] != 0:
        problems.append(f"the last launcher exited with {f['launcher_exit']}")
    return problems


def main(argv: list[str] | None = None) -> int:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--searcher-kills", type=int, default=3)
    ap.add_argument("--early-kills", action="store_true", help="kill replacements 0-3 s after they start")
    ap.add_argument("--work-dir", type=Path, default=None, help="where the run dirs go (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="tbajax-chaos-"))
    runs: list[dict[str, Any]] = []
    from tbajax.system.metrics import machine_info

    machine = machine_info()  # wall times mean something only next to the machine's matmul rate
    for i in range(args.repeats):
        try:
            f = run_scenario(work / f"run-{i}", seed=args.seed + i, searcher_kills=args.searcher_kills,
                             steps=args.steps, early_kills=args.early_kills)
            f["problems"] = check(f)
        except ChaosError as e:  # could not drive the scenario: a failed scenario, reported, not a crash
            f = {**dict.fromkeys(("kills_survived", "rows_committed", "rows_read_back", "torn_rows",
                                  "duplicated_rows", "wall_time_s"), 0),
                 "row_count_went_down": False, "trainer_versions_monotone": False,
                 "store_policy_versions_monotone": False, "problems": [f"ChaosError: {e}"]}
        runs.append(f)
        print(json.dumps({k: v for k, v in f.items() if k != "kills"}), flush=True)
        total = _total(runs)
        if args.json:  # after every scenario, so a long series that is cut short still reports
            args.json.parent.mkdir(parents=True, exist_ok=True)
            command = "python experiments/chaos.py " + " ".join(argv if argv is not None else sys.argv[1:])
            payload = {"command": command, "machine": machine, "total": total, "runs": runs}
            args.json.write_text(json.dumps(payload, indent=2) + "\n")
    print(json.dumps(total, indent=2))
    return 0 if total["scenarios_sane"] == total["scenarios"] else 1


def _total(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "scenarios": len(runs),
        "scenarios_sane": sum(not f["problems"] for f in runs),
        "kills_survived": sum(f["kills_survived"] for f in runs),
        "rows_committed": sum(f["rows_committed"] for f in runs),
        "rows_read_back": sum(f["rows_read_back"] for f in runs),
        "torn_rows": sum(f["torn_rows"] for f in runs),
        "duplicated_rows": sum(f["duplicated_rows"] for f in runs),
        "row_count_ever_went_down": any(f["row_count_went_down"] for f in runs),
        "versions_monotone": all(f["trainer_versions_monotone"] and f["store_policy_versions_monotone"] for f in runs),
        "wall_time_s": round(sum(f["wall_time_s"] for f in runs), 1),
    }

if __name__ == "__main__":
    sys.exit(main())
