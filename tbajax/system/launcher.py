"""Start the trainer and N searchers as separate OS processes, supervise them, show progress.

Each role is `python -m tbajax.main --role=... --run-dir=...`, the same command a scheduler
(SLURM, Kubernetes, Ray jobs) would run on another host, so the launcher is a convenience for one
machine, not a cluster manager. Roles talk only through the run directory / stores.

Supervision: each role runs in its own process group (its reward workers and any grader they
started are in it too), and the whole group is killed when the role dies, before a restart.
Restarts wait an exponential backoff and count against a budget per time window; a trainer is
restarted only when `system.max_trainer_restarts` allows it, with `--resume`. A run whose
trainer step stops advancing for `system.stall_timeout_s` is stopped, naming the stuck role; a
searcher silent that long while the trainer keeps stepping is killed and restarted.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tbajax.config import ExperimentConfig
from tbajax.system import rundir

MAX_BACKOFF_S = 60.0
_START_MARK = "=== start "
# how a role's traceback names the error `out_of_memory.explain_out_of_memory` raises
OUT_OF_MEMORY_ERROR = "tbajax.system.out_of_memory.DeviceOutOfMemoryError:"


def describe_exit(code: int) -> str:
    """'exited with code 1' or 'killed by signal 9 (SIGKILL)' (Popen reports a signal as -N)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {-code} ({name})"
    return f"exited with code {code}"


def restart_delay(previous: Sequence[float], now: float, *, budget: int, window_s: float,
                  backoff_s: float) -> float | None:
    """Seconds to wait before restarting a role that was restarted at `previous` times, or None
    when `budget` restarts within the last `window_s` are used up. The delay doubles with each
    restart still in the window (capped at MAX_BACKOFF_S): crash loops slow down, and an old
    crash stops counting once it leaves the window."""
    recent = [t for t in previous if now - t < window_s]
    if len(recent) >= budget:
        return None
    return min(backoff_s * 2 ** len(recent), MAX_BACKOFF_S)


_LOGGED_ERROR = re.compile(r"^\S+ \S+ (?:ERROR|CRITICAL) ")  # "12:00:01 searcher-0 ERROR name: ..."


def last_error(log_text: str) -> str | None:
    """The exception line ('ValueError: ...') of the last main-thread traceback in a role's log
    (the last session only): what went wrong, even when background threads (checkpointing,
    logging) print more afterwards. Without a traceback, the last line logged at ERROR level."""
    text = log_text[log_text.rfind(_START_MARK):] if _START_MARK in log_text else log_text
    lines = text.splitlines()
    found = None
    logged = [line.strip() for line in lines if _LOGGED_ERROR.match(line)]
    for i, line in enumerate(lines):
        if not line.startswith("Traceback (most recent call last):"):
            continue
        before = lines[i - 1] if i > 0 else ""
        if before.startswith(("Exception in thread", "Exception ignored in")):
            continue
        for follow in lines[i + 1:]:
            if follow and not follow[0].isspace():
                found = follow.strip()
                break
    return found or (logged[-1] if logged else None)


@dataclass
class _Child:
    role: str
    args: list[str]
    env: dict[str, str]
    log_path: Path
    command: list[str] | None = None  # what `args` follow; default: this Python running tbajax.main
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    restart_times: list[float] = field(default_factory=list)
    restart_at: float | None = None  # a restart is scheduled for this time (monotonic)
    started_at: float = 0.0  # wall time of the latest start (status files carry wall times)
    history: list[int] = field(default_factory=list)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        log.write(f"\n{_START_MARK}{self.role} at {time.ctime()} (restart {self.restarts}) ===\n".encode())
        log.flush()
        self.proc = subprocess.Popen(
            [*(self.command or [sys.executable, "-m", "tbajax.main"]), *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,  # its own process group; Ctrl-C reaches the launcher only
        )
        log.close()
        self.restart_at = None
        self.started_at = time.time()

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        """Send `sig` to the role's whole process group, also after the role itself has exited
        (its reward workers or a hung grader may still be alive in the group)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def kill_group(self) -> None:
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    def ran_out_of_memory(self) -> bool:
        """Whether this role's latest session ended out of device memory (`out_of_memory`): the
        same program would again, so a restart waits for a change of settings."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return False
        return (last_error(text) or "").startswith(OUT_OF_MEMORY_ERROR)

    def tail(self, lines: int = 15) -> str:
        """The last lines of this role's latest session in its log, led by the error line."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        session = text[text.rfind(_START_MARK):] if _START_MARK in text else text
        out = "\n".join(session.splitlines()[-lines:])
        error = last_error(text)
        return (f"  error: {error}\n" if error else "") + f"  last lines of {self.log_path}:\n{out}"


def has_evaluator(config: ExperimentConfig) -> bool:
    """Whether the run has an evaluator role (eval.mode=process; sync mode evaluates inline)."""
    return config.eval.mode == "process" and config.system.mode == "async"


def memory_share(config: ExperimentConfig) -> float | None:
    """Each role process's share of a shared GPU's memory: `system.memory_fraction`, else 0.9 over
    the JAX processes the run starts on it (a sync run starts the trainer alone; none may
    preallocate 75% of the device); None with devices of their own (devices=split)."""
    sysc = config.system
    if sysc.memory_fraction is not None:
        return sysc.memory_fraction
    if sysc.devices != "shared":
        return None
    searchers = sysc.num_searchers if sysc.mode == "async" else 0
    return 0.9 / (sysc.trainer_processes + searchers + int(has_evaluator(config)))


def child_env(config: ExperimentConfig, role: str, index: int) -> dict[str, str]:
    """Environment of one role: its device set and its share of a shared GPU's memory (`index`:
    the searcher's id, or the trainer's process id when the trainer runs as several processes;
    the evaluator takes the slot after the last searcher's)."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env[rundir.LAUNCHER_PID_ENV] = str(os.getpid())
    sysc = config.system
    share = memory_share(config)
    if sysc.memory_fraction is not None:
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(sysc.memory_fraction)
    elif share is not None:
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{share:.3f}")
    if sysc.compile_cache is None:  # off, also for a cache directory this process inherited
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
    else:
        env.update(compile_cache_env(sysc.compile_cache, env))
    host_devices = {"trainer": sysc.cpu_devices_per_trainer_process,
                    "searcher": sysc.cpu_devices_per_searcher}.get(role)
    if host_devices is not None:
        flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")).strip()
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={host_devices}".strip()
    if sysc.devices == "split":
        if role == "trainer":
            per = sysc.trainer_devices // sysc.trainer_processes
            ids = range(index * per, (index + 1) * per)
        else:
            first = sysc.trainer_devices + index * sysc.devices_per_searcher
            ids = range(first, first + sysc.devices_per_searcher)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, ids))
    return env


def compile_cache_dir(setting: str, env: Mapping[str, str]) -> str:
    """The directory (or bucket URL) `system.compile_cache` names: "auto" is a
    $JAX_COMPILATION_CACHE_DIR already set (by the user, or the test session's shared cache), else
    $TBAJAX_CACHE/xla."""
    if setting != "auto":
        return setting
    return env.get("JAX_COMPILATION_CACHE_DIR") or str(
        Path(env.get("TBAJAX_CACHE", "~/.cache/tbajax")).expanduser() / "xla")


# JAX's cache settings for the roles, unless the environment already has its own: programs that
# compile in 0.2 s or more are kept (JAX's own threshold, 1 s, left most of the default
# experiment's first generate call to compile again: `experiments/benchmarks/compile_cache.py`),
# and at most 4 GiB, least recently used first out.
COMPILE_CACHE_DEFAULTS = {"JAX_COMPILATION_CACHE_MAX_SIZE": str(4 << 30),
                          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.2"}


def compile_cache_env(setting: str, env: Mapping[str, str]) -> dict[str, str]:
    """The variables that point a role's JAX at the persistent compilation cache, passed through
    the environment so that the role's `import jax` reads them before its first compile."""
    out = {"JAX_COMPILATION_CACHE_DIR": compile_cache_dir(setting, env)}
    out.update({k: v for k, v in COMPILE_CACHE_DEFAULTS.items() if k not in env})
    return out


def resume_command(run_dir: Path) -> str:
    """The command that continues this run (the config is read back from the run directory)."""
    return f"python -m tbajax.main --run-dir={shlex.quote(str(run_dir))} --resume"


def launch(config: ExperimentConfig, run_dir: Path, *, resume: bool = False, quiet: bool = False) -> int:
    """Run the experiment to completion; returns the process exit code."""
    with session(config, run_dir, resume=resume):
        logs = run_dir / "logs"
        trainer, *searchers = [
            _Child(role, args, child_env(config, role.split("-")[0], index), logs / f"{role}.log")
            for role, index, args in role_commands(config, run_dir, resume=resume)
        ]  # the searchers, then the evaluator: supervised alike (restarted within their budget)
        peers = [_Child(f"trainer-{i}", list(trainer.args), child_env(config, "trainer", i),
                        logs / f"trainer-{i}.log") for i in range(1, config.system.trainer_processes)]
        if peers:
            set_coordinator([trainer, *peers])
        return Supervisor(config, run_dir, trainer, searchers, quiet=quiet, trainer_peers=peers).run()


def free_port() -> int:
    """A TCP port free on this host now (for the trainer processes' coordinator)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def set_coordinator(trainers: Sequence[_Child]) -> None:
    """Point the trainer processes (process 0 first) at a fresh localhost coordinator: each start
    of a multi-process trainer (restarts too) gets a new port, so a dying coordinator's socket
    never blocks the next one."""
    port = free_port()
    for i, c in enumerate(trainers):
        c.args = [a for a in c.args if not a.startswith(("--coordinator-address=", "--num-processes=",
                                                          "--process-id="))]
        c.args += [f"--coordinator-address=127.0.0.1:{port}", f"--num-processes={len(trainers)}",
                   f"--process-id={i}"]


@contextlib.contextmanager
def session(config: ExperimentConfig, run_dir: Path, *, resume: bool) -> Iterator[None]:
    """What every launcher does around a run: everything that can be checked before a role
    starts is (preflight); the run directory is locked for the life of the run; config.json is
    written only after those checks pass."""
    preflight(config)
    rundir.make_run_dir(run_dir)
    with rundir.RunLock(run_dir):
        changed = rundir.prepare(run_dir, config, resume=resume)
        if changed:
            print(f"resume: updating {', '.join(changed)} in {run_dir / 'config.json'}", flush=True)
        if resume and not rundir.checkpoint_steps(run_dir):
            print(f"resume: no checkpoint in {run_dir / 'checkpoints'}; the trainer starts again from step 0 "
                  "(the trajectories already generated are kept)", file=sys.stderr, flush=True)
        yield


def role_commands(config: ExperimentConfig, run_dir: Path, *, resume: bool,
                  extra: Sequence[str] = ()) -> list[tuple[str, int, list[str]]]:
    """(role name, index, `tbajax.main` arguments) of the trainer, then of each searcher (none in
    sync mode: the trainer process generates its own batches), then of the evaluator
    (eval.mode=process; its index is the device slot after the searchers', see `child_env`)."""
    common = [f"--run-dir={run_dir}", *extra] + (["--resume"] if resume else [])
    n = config.system.num_searchers if config.system.mode == "async" else 0
    evaluator = [("evaluator", n, ["--role=evaluator", *common])] if has_evaluator(config) else []
    return [("trainer", 0, ["--role=trainer", *common])] + [
        (f"searcher-{i}", i, ["--role=searcher", f"--searcher-id={i}", *common]) for i in range(n)
    ] + evaluator


class Supervisor:
    """Runs the roles until the trainer finishes, the user stops, or the run cannot go on."""

    tick_s = 0.5
    launcher_flag = ""  # what the resume command adds to name this launcher

    def __init__(self, config: ExperimentConfig, run_dir: Path, trainer: _Child, searchers: Sequence[_Child],
                 *, quiet: bool = True, trainer_peers: Sequence[_Child] = ()):
        self.config = config
        self.run_dir = run_dir
        self.trainer = trainer
        self.trainer_peers = list(trainer_peers)  # processes 1.. of a multi-process trainer
        self.failed_trainer = trainer  # the trainer process whose exit ended the trainer (for messages)
        self.searchers = list(searchers)
        self.children = [trainer, *self.trainer_peers, *self.searchers]
        self.quiet = quiet
        self.interrupts = 0
        self.last_step = -1
        self.last_progress = time.monotonic()

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.interrupts += 1
        if self.interrupts >= 2:
            # a second Ctrl-C: act inside the handler, the main loop may be blocked in a wait
            print("\nsecond interrupt: killing every role now (SIGKILL); steps since the trainer's last "
                  "checkpoint are lost", file=sys.stderr, flush=True)
            for c in self.children:
                c.signal(signal.SIGKILL)

    def run(self) -> int:
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        progress = _Progress(self.config, self.run_dir, self.quiet)
        try:
            for c in self.children:
                c.start()
            self.last_progress = time.monotonic()
            code = self._supervise(progress)
            self._shutdown()
            progress.close()
            return code
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            for c in self.children:
                c.signal(signal.SIGKILL)

    # -- the loop --------------------------------------------------------------------------

    def _supervise(self, progress: _Progress) -> int:
        while True:
            time.sleep(self.tick_s)
            status = rundir.read_status(self.run_dir)
            progress.update(status)
            self._each_tick()
            if self.interrupts:
                print("\nstopping: asking every role to shut down cleanly (checkpointing); "
                      "press Ctrl-C again to kill them at once", flush=True)
                return 130
            now = time.monotonic()
            t = self._trainer_exit()
            if t is not None and self.trainer.restart_at is None:
                for c in (self.trainer, *self.trainer_peers):
                    c.kill_group()
                if t == 0:
                    return 0
                code = self._trainer_failed(t, now)
                if code is not None:
                    return code
            for s in self.searchers:
                r = s.poll()
                if r is None or s.restart_at is not None:
                    continue
                s.kill_group()  # its reward workers and graders too, before a new one starts
                s.history.append(r)
                code = self._searcher_exited(s, r, now)
                if code is not None:
                    return code
            for c in self.children:
                if c.restart_at is not None and now >= c.restart_at:
                    c.start()
            self._kill_hung_searchers(status, now)
            stalled = self._stalled(status, now)
            if stalled:
                print(f"\nstalled: {stalled}\nstopping the run.", file=sys.stderr, flush=True)
                return 3

    def _trainer_exit(self) -> int | None:
        """The trainer's exit code once it is over: process 0's, or that of a process of a
        multi-process trainer that failed (it takes the others down). When several are dead,
        the one that was not aborted by JAX for a dead peer (SIGABRT) is named: the cause."""
        exited = [(c, c.poll()) for c in (self.trainer, *self.trainer_peers)]
        failed = [(c, r) for c, r in exited if r not in (None, 0)]
        if not failed:
            return exited[0][1]
        causes = [(c, r) for c, r in failed if r not in (-signal.SIGABRT, 128 + signal.SIGABRT)]
        self.failed_trainer, code = (causes or failed)[0]
        return code

    def _each_tick(self) -> None:
        """Per-tick work of a subclass (the Ray launcher streams the roles' log lines here)."""

    def _searcher_exited(self, s: _Child, r: int, now: float) -> int | None:
        """Schedule the restart of a searcher that exited with `r`; the run's exit code when its
        restart budget is used up."""
        if s.ran_out_of_memory():
            return self._searcher_out_of_memory(s)
        sysc = self.config.system
        delay = restart_delay(s.restart_times, now, budget=sysc.max_searcher_restarts,
                              window_s=sysc.restart_window_s, backoff_s=sysc.restart_backoff_s)
        recent = len([x for x in s.restart_times if now - x < sysc.restart_window_s])
        if delay is None:
            print(f"\n{s.role} {describe_exit(r)}; giving up after {recent} restarts within "
                  f"{sysc.restart_window_s:g} s (system.max_searcher_restarts="
                  f"{sysc.max_searcher_restarts}).\n{s.tail()}", file=sys.stderr, flush=True)
            return 1
        s.restarts += 1
        s.restart_times.append(now)
        s.restart_at = now + delay
        print(f"\n{s.role} exited with {r}; restarting in {delay:g} s ({describe_exit(r)}; restart "
              f"{recent + 1} of {sysc.max_searcher_restarts} within {sysc.restart_window_s:g} s)", flush=True)
        return None

    def _trainer_failed(self, code: int, now: float) -> int | None:
        sysc = self.config.system
        t = self.trainer
        if self.failed_trainer.ran_out_of_memory():
            return self._trainer_out_of_memory(code)
        ckpt = self._resume_point()
        delay = restart_delay(t.restart_times, now, budget=sysc.max_trainer_restarts,
                              window_s=sysc.restart_window_s, backoff_s=sysc.restart_backoff_s)
        if delay is None:
            recent = len([x for x in t.restart_times if now - x < sysc.restart_window_s])
            budget = (f" after {recent} automatic restarts within {sysc.restart_window_s:g} s"
                      if sysc.max_trainer_restarts else "")
            print(f"\n{self._trainer_name()} failed ({describe_exit(code)}){budget}.\n{self.failed_trainer.tail()}\n"
                  f"to continue from {ckpt}: {self._resume_command()}", file=sys.stderr, flush=True)
            return code if code > 0 else 1
        t.restarts += 1
        t.restart_times.append(now)
        t.restart_at = now + delay
        for c in (t, *self.trainer_peers):
            c.restart_at = t.restart_at
            if "--resume" not in c.args:
                c.args.append("--resume")
        if self.trainer_peers:
            set_coordinator([t, *self.trainer_peers])
        self.last_progress = now + delay  # the stall clock restarts with the trainer
        print(f"\n{self._trainer_name()} failed ({describe_exit(code)}); restarting it from {ckpt} in {delay:g} s "
              f"(restart {t.restarts}, system.max_trainer_restarts={sysc.max_trainer_restarts})", flush=True)
        return None

    def _resume_point(self) -> str:
        """Where a resumed trainer continues from, in words."""
        steps = rundir.checkpoint_steps(self.run_dir)
        return f"its last checkpoint (step {steps[-1]})" if steps else "step 0 (there is no checkpoint yet)"

    def _resume_command(self) -> str:
        return f"{resume_command(self.run_dir)}{self.launcher_flag}"

    def _searcher_out_of_memory(self, s: _Child) -> int:
        """End the run: a searcher ran out of device memory, and the same program would again."""
        print(f"\n{s.role} ran out of device memory; a restart would too.\n{s.tail()}\nchange the settings "
              f"the error names, then: {self._resume_command()} --set KEY=VALUE (`--resume` takes "
              "the keys in tbajax.config.RESUME_SAFE_KEYS; others need a new run directory)",
              file=sys.stderr, flush=True)
        return 1

    def _trainer_out_of_memory(self, code: int) -> int:
        ckpt = self._resume_point()
        print(f"\n{self._trainer_name()} ran out of device memory; a restart would too.\n"
              f"{self.failed_trainer.tail()}\nchange the settings the error names, then continue from {ckpt}: "
              f"{self._resume_command()} --set KEY=VALUE", file=sys.stderr, flush=True)
        return code if code > 0 else 1

    def _trainer_name(self) -> str:
        if not self.trainer_peers:
            return "trainer"
        i = [self.trainer, *self.trainer_peers].index(self.failed_trainer)
        return (f"trainer process {i} of {1 + len(self.trainer_peers)} (log {self.failed_trainer.log_path}; "
                "the other trainer processes were stopped with it)")

    def _kill_hung_searchers(self, status: dict[str, dict[str, Any]], now: float) -> None:
        """Kill a searcher that has not reported for stall_timeout_s while the trainer kept
        stepping (so it is not merely paused waiting for new params); the restart path takes it
        from there, within its budget. A hung grader or a wedged device is the usual cause."""
        timeout = self.config.system.stall_timeout_s
        if timeout is None or now - self.last_progress >= timeout:
            return  # the trainer is stuck too: `_stalled` names who
        for s in self.searchers:
            if not s.running():
                continue
            reported = max(float(status.get(s.role, {}).get("time", 0.0)), s.started_at)
            silent = time.time() - reported
            if silent > timeout:
                print(f"\n{s.role} has not reported for {silent:.0f} s while the trainer kept training "
                      f"(system.stall_timeout_s={timeout:g}); it looks hung: killing it", file=sys.stderr, flush=True)
                s.signal(signal.SIGKILL)

    def _stalled(self, status: dict[str, dict[str, Any]], now: float) -> str | None:
        """Why the run is stuck, once the trainer's step has not moved for stall_timeout_s."""
        timeout = self.config.system.stall_timeout_s
        trainer = status.get("trainer", {})
        step = int(trainer.get("step", 0) or 0)
        if step != self.last_step:
            self.last_step, self.last_progress = step, now
        if timeout is None or now - self.last_progress < timeout or self.trainer.restart_at is not None:
            return None
        idle = now - self.last_progress
        phase = trainer.get("phase")
        if phase == "waiting for the evaluator":
            return None  # the trainer bounds it (eval.wait_timeout_s, counted from the evaluator's progress)
        if phase != "waiting for data":
            return (f"the trainer has not advanced past step {step} for {idle:.0f} s (phase: {phase or 'starting'}); "
                    f"it looks hung (system.stall_timeout_s={timeout:g}). See {self.trainer.log_path}")
        lines = []
        for s in self.searchers:
            st = status.get(s.role)
            seen = f"last reported {time.time() - st['time']:.0f} s ago ({st.get('calls', 0)} calls, " \
                   f"{st.get('samples', 0)} samples)" if st and "time" in st else "never reported"
            lines.append(f"  {s.role}: {seen}; log {s.log_path}")
        who = "the searchers deliver nothing trainable (a hung grader? every grade failing?)" if self.searchers \
            else "the trainer's own generation delivers nothing trainable"
        return (f"the trainer has been waiting for data at step {step} for {idle:.0f} s "
                f"(system.stall_timeout_s={timeout:g}): {who}\n" + "\n".join(lines))

    # -- stopping --------------------------------------------------------------------------

    def _shutdown(self) -> None:
        """Ask every role to stop (stop file + SIGTERM to its group), wait up to stop_grace_s,
        then kill what is left, saying so."""
        rundir.request_stop(self.run_dir)
        for c in self.children:
            if c.running():
                c.signal(signal.SIGTERM)
        grace = self.config.system.stop_grace_s
        deadline = time.monotonic() + grace
        for c in self.children:
            while c.running() and time.monotonic() < deadline and self.interrupts < 2:
                time.sleep(0.1)
            if c.running():
                if self.interrupts < 2:
                    print(f"{c.role} did not exit within {grace:g} s of the stop request; killing it (SIGKILL)",
                          file=sys.stderr, flush=True)
            c.kill_group()


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

    def update(self, status: dict[str, dict[str, Any]] | None = None) -> None:
        if self.bar is None:
            return
        status = rundir.read_status(self.run_dir) if status is None else status
        t = status.get("trainer", {})
        gen = sum(s.get("tokens_per_s", 0.0) for k, s in status.items() if k.startswith("searcher"))
        samples = sum(s.get("samples", 0) for k, s in status.items() if k.startswith("searcher"))
        self.bar.n = int(t.get("step", 0))
        # eval.mode=process: the newest evaluation is the evaluator's
        score = t.get("eval_score")
        score = status.get("evaluator", {}).get("eval_score") if score is None else score
        self.bar.set_postfix_str(
            f"{t.get('phase', 'starting')} reward={t.get('reward_mean', float('nan')):.3f} "
            f"eval={float('nan') if score is None else score:.3f} buffer={t.get('buffer_rows', 0)} "
            f"lag={t.get('policy_lag', float('nan')):.1f} samples={samples} gen={gen:,.0f}tok/s",
            refresh=False,
        )
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.update()
            self.bar.close()


def preflight(config: ExperimentConfig) -> None:
    """Fail in the launcher, with one clear message, on what every role would fail on."""
    from tbajax.config import ConfigError
    from tbajax.models import CheckpointError, resolve_checkpoint
    from tbajax.models.safetensors_io import SafetensorsReader
    from tbajax.system.assets import check_tokenizer_for, load_task
    from tbajax.objectives.registry import resolve_objective  # no jax for built-in objectives
    from tbajax.tasks import check_grading_mode

    try:
        directory = resolve_checkpoint(config.model.checkpoint)  # also fetches a hub id once, for all roles
    except CheckpointError as e:
        raise CheckpointError(
            f"model.checkpoint={config.model.checkpoint!r}: {e}. Pass a local Hugging Face directory "
            "with --set model.checkpoint=DIR (or download the hub id on a machine with network access)"
        ) from None
    SafetensorsReader(directory)  # the weights exist, and every header and size is intact
    try:
        check_tokenizer_for(config)
        resolve_objective(config.train.objective, overrides=dict(config.train.objective_options))
        task = load_task(config)
        check_grading_mode(task, config.rollout.reward_workers)
    except SyntaxError as e:
        raise ConfigError(f"SyntaxError in {e.filename}, line {e.lineno}: {e.msg}") from None
    except KeyError as e:
        raise ConfigError(str(e.args[0]) if e.args else repr(e)) from None
    except (ValueError, ImportError, AttributeError, TypeError, OSError) as e:
        raise ConfigError(f"{type(e).__name__}: {e}") from None
    check_compile_cache(config.system.compile_cache)
    if config.system.wandb is not None:
        from tbajax.system.wandb_logging import import_wandb

        import_wandb()


def check_compile_cache(setting: str | None) -> None:
    """A local cache directory the roles could not create would cost every compile a warning."""
    from tbajax.config import ConfigError

    if setting is None:
        return
    directory = compile_cache_dir(setting, os.environ)
    if "://" in directory or Path(directory).is_dir():  # a bucket URL is JAX's file layer's to reach
        return
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"system.compile_cache: cannot create {directory} ({e.strerror or e}); choose a "
                          "writable directory with --set system.compile_cache=DIR, or turn the cache off "
                          "with --set system.compile_cache=null") from None


def read_summary(run_dir: Path, since: float | None = None) -> dict[str, Any] | None:
    """summary.json, or None; with `since`, only one written at or after that time (so a failed
    session does not show the previous session's summary as if it were its own)."""
    path = run_dir / "summary.json"
    try:
        if since is not None and path.stat().st_mtime < since:
            return None
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None

