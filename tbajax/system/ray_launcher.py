"""`--launcher=ray`: the trainer and each searcher as Ray actors, placed by declared resources
(the evaluator of eval.mode=process too, with a searcher's resources and restart budget).

Each actor runs its role exactly as the process launcher does, as `python -m tbajax.main
--role=... --run-dir=...` in a process group of its own (so its reward workers and graders die
with it), writing `logs/<role>.log` in the run directory; the driver streams those lines to the
console, prefixed by role. The run directory must therefore be on a filesystem every node sees
at the same path (as for SLURM); the stores may live elsewhere (`--store=gs://...`).

Faults are Ray's: a role that fails takes its actor down (`os._exit`), and Ray restarts the
actor (`max_restarts`) and re-runs its `run` task on it (`max_task_retries`): a searcher up to
`system.max_searcher_restarts` times, the trainer up to `system.max_trainer_restarts` times (with
`--resume`). Ray's budgets count over the actor's lifetime, not per `system.restart_window_s`;
each restart waits `system.restart_backoff_s`. A role that ran out of device memory is not
restarted (the same program would run out again): its actor returns the exit code and the run
ends with the error's advice, as under the process launcher. Everything else is the process launcher's own
code: preflight, the run-directory lock, config writing, stall detection, the clean stop (stop
file, grace period, then `ray.kill`), a second Ctrl-C, and the final summary.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tbajax.config import ConfigError, ExperimentConfig, RaySpec
from tbajax.system.launcher import (
    _START_MARK,
    Supervisor,
    _Child,
    child_env,
    describe_exit,
    role_commands,
    session,
)

_STOP_TIMEOUT_S = 10.0  # for an actor to kill its role's process group before `ray.kill`
_PENDING_NOTICE_S = 120.0  # say so when Ray has not placed a role's actor after this long
_EXIT_NOTE = "; ending its Ray actor so that Ray restarts it (if its budget allows)"
_OUT_OF_MEMORY_NOTE = "; out of device memory: its Ray actor stays up, so Ray does not restart it"


def import_ray():  # -> the ray module
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "--launcher=ray needs Ray: pip install 'tbajax[ray]' (or pip install 'ray>=2.40'), on every node"
        ) from None
    return ray


def actor_options(spec: RaySpec, kind: str, *, max_restarts: int) -> dict[str, Any]:
    """Ray actor options of one role ("trainer", "searcher" or "evaluator"): its resources, node
    labels, and Ray's fault tolerance (restart the actor, re-run its task on the new one). The
    evaluator (eval.mode=process) samples like a searcher, so it asks for a searcher's resources."""
    kind = "searcher" if kind == "evaluator" else kind
    options: dict[str, Any] = {
        "num_cpus": getattr(spec, f"{kind}_cpus"),
        "num_gpus": getattr(spec, f"{kind}_gpus"),
        "max_restarts": max_restarts,
        "max_task_retries": max_restarts,
        "max_concurrency": 2,  # `stop`/`signal` must reach an actor whose `run` is busy
    }
    resources = dict(getattr(spec, f"{kind}_resources"))
    if resources:
        options["resources"] = resources
    labels = dict(getattr(spec, f"{kind}_labels"))
    if labels:
        options["label_selector"] = labels
    return options


def gpu_env(env: dict[str, str], gpus: float, memory_fraction: float | None,
            environ: Mapping[str, str]) -> dict[str, str]:
    """A role's environment once Ray has given its actor `gpus` GPUs: Ray's CUDA_VISIBLE_DEVICES
    (in `environ`) replaces system.devices="split", and unless the user fixed the memory share
    (system.memory_fraction, or XLA_PYTHON_CLIENT_MEM_FRACTION), a role on a fraction of a GPU
    preallocates only that fraction, and one with whole GPUs of its own the JAX default."""
    if gpus <= 0:
        return env
    env = {**env, "CUDA_VISIBLE_DEVICES": environ.get("CUDA_VISIBLE_DEVICES", "")}
    if memory_fraction is None and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in environ:
        if gpus < 1:
            env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{0.9 * gpus:.3f}"
        else:
            env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
    return env


class RoleActor:
    """One role inside a Ray actor (a plain class: `ray.remote` wraps it at launch, so importing
    this module does not need Ray)."""

    def __init__(self, config: ExperimentConfig, role: str, index: int, args: Sequence[str], log_path: str,
                 cwd: str, gpus: float, command: Sequence[str] | None = None):
        import ray

        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        kind = role.split("-")[0]
        args = list(args)
        if restarted and kind == "trainer" and "--resume" not in args:
            args.append("--resume")  # Ray restarted a failed trainer: from its last checkpoint
        if os.path.isdir(cwd):
            os.chdir(cwd)  # relative paths in the config (a user's task file) mean the driver's
        # this node's environment (the role's parent, for its orphan check, is this actor)
        env = gpu_env(child_env(config, kind, index), gpus, config.system.memory_fraction, os.environ)
        self.child = _Child(role, args, env, Path(log_path), command=list(command) if command else None)
        self.backoff_s = config.system.restart_backoff_s if restarted else 0.0
        self.stopping = False

    def run(self) -> int:
        """Run the role to its end. A failure ends this actor's process, which is how Ray learns
        of it: Ray then restarts the actor and calls `run` again, within the actor's budget. A
        role out of device memory returns its code instead: a restart would run out again."""
        time.sleep(self.backoff_s)  # a crash loop does not spin
        self.backoff_s = 0.0
        if self.stopping:  # the run ended while this actor started: a final stop found no process
            return 0
        self.child.start()
        assert self.child.proc is not None
        if self.stopping:  # ... or came while the role started (`signal` runs beside `run`)
            self.child.signal(signal.SIGTERM)
        code = self.child.proc.wait()
        self.child.kill_group()  # its reward workers and a hung grader too
        if code != 0 and not self.stopping:
            out_of_memory = self.child.ran_out_of_memory()
            with open(self.child.log_path, "a") as log:
                note = _OUT_OF_MEMORY_NOTE if out_of_memory else _EXIT_NOTE
                log.write(f"=== {self.child.role} {describe_exit(code)}{note} ===\n")
            if not out_of_memory:
                os._exit(1)
        return code

    def signal(self, sig: int, final: bool = False) -> None:
        """Signal the role's process group; `final`: the run is ending, do not restart it."""
        self.stopping = self.stopping or final
        self.child.signal(sig)

    def stop(self) -> None:
        """Kill the role's process group for good (the driver `ray.kill`s this actor next)."""
        self.stopping = True
        self.child.kill_group()


@dataclass
class _RayChild(_Child):
    """A role as the Supervisor sees it, backed by a Ray actor (see RoleActor)."""

    config: ExperimentConfig | None = None
    index: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)
    actor: Any = None
    ref: Any = None
    code: int | None = None
    died: str | None = None
    final: bool = False  # the run is ending: a role that dies now is not restarted

    def start(self) -> None:
        import ray

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.actor is None:
            cls = ray.remote(RoleActor).options(**self.options)
            self.actor = cls.remote(self.config, self.role, self.index, self.args, str(self.log_path),
                                    os.getcwd(), float(self.options.get("num_gpus") or 0.0), self.command)
        self.ref = self.actor.run.remote()
        self.code = self.died = None
        self.restart_at = None
        self.started_at = time.time()

    def poll(self) -> int | None:
        import ray

        if self.code is not None or self.ref is None:
            return self.code
        ready, _ = ray.wait([self.ref], timeout=0)
        if not ready:
            return None
        try:
            self.code = int(ray.get(self.ref))
        except ray.exceptions.RayError as e:  # Ray gave up on the actor (its restarts are used up)
            lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()] or [type(e).__name__]
            self.died = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"  # what, and the cause
            self.code = 1
        return self.code

    def running(self) -> bool:
        return self.ref is not None and self.poll() is None

    def signal(self, sig: int) -> None:
        if self.actor is not None:
            self.actor.signal.remote(sig, self.final)  # fire and forget: a dead actor just drops it

    def kill_group(self) -> None:
        import ray

        if self.actor is None:
            return
        try:
            ray.get(self.actor.stop.remote(), timeout=_STOP_TIMEOUT_S)
        except (ray.exceptions.RayError, TimeoutError):
            pass  # the actor is gone (its role's orphan check stops the role) or hung
        ray.kill(self.actor, no_restart=True)
        self.actor = None


class RaySupervisor(Supervisor):
    """The process launcher's Supervisor over Ray actors: restarts are Ray's, so a role that
    reaches the Supervisor as exited has used its Ray restarts (or ran out of device memory,
    which is not restarted); role logs are streamed."""

    launcher_flag = " --launcher=ray"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.offsets = {c.role: _size(c.log_path) for c in self.children}  # this session's lines only
        self.partial = {c.role: "" for c in self.children}
        self.starts = {c.role: 0 for c in self.children}
        self.exits: dict[str, str] = {}  # role -> how its process last ended, as its actor logged it
        self.began = time.monotonic()
        self.pending_noted: set[str] = set()

    def _on_signal(self, signum: int, frame: Any) -> None:
        for c in self.children:
            if isinstance(c, _RayChild):
                c.final = True
        super()._on_signal(signum, frame)

    def _each_tick(self) -> None:
        """Print the roles' new log lines, `[role] line`; note Ray's restarts as they show."""
        from tqdm import tqdm

        for c in self.children:
            try:
                with open(c.log_path, "rb") as f:
                    f.seek(self.offsets[c.role])
                    data = f.read()
            except OSError:
                continue
            self.offsets[c.role] += len(data)
            text = self.partial[c.role] + data.decode(errors="replace")
            *lines, self.partial[c.role] = text.split("\n")
            for line in lines:
                if line.startswith(f"{_START_MARK}{c.role} "):
                    self.starts[c.role] += 1
                    if self.starts[c.role] > 1:
                        c.started_at = time.time()  # the hung-searcher clock restarts with it
                        tqdm.write(f"[{c.role}] restarted by Ray (restart {self.starts[c.role] - 1})")
                        continue
                if line.startswith(f"=== {c.role} ") and line.endswith(f"{_EXIT_NOTE} ==="):
                    self.exits[c.role] = line[len(f"=== {c.role} "):-len(f"{_EXIT_NOTE} ===")]
                if line.strip():
                    tqdm.write(f"[{c.role}] {line}")
            if (not self.starts[c.role] and c.role not in self.pending_noted
                    and time.monotonic() - self.began > _PENDING_NOTICE_S and isinstance(c, _RayChild)):
                self.pending_noted.add(c.role)
                wanted = {k: v for k, v in c.options.items() if k in ("num_cpus", "num_gpus", "resources",
                                                                      "label_selector")}
                print(f"note: {c.role} has not started after {_PENDING_NOTICE_S:g} s: Ray has not placed its actor "
                      f"yet (it asks for {wanted}); `ray status` shows what the cluster offers", file=sys.stderr,
                      flush=True)

    def _searcher_exited(self, s: _Child, r: int, now: float) -> int | None:
        self._each_tick()  # its last lines first
        if r == 0:  # not a failure Ray would see: it ended by itself (e.g. it judged itself orphaned)
            print(f"\n{s.role} exited by itself (code 0) although no stop was requested; starting it again",
                  file=sys.stderr, flush=True)
            s.start()
            return None
        if s.ran_out_of_memory():
            return self._searcher_out_of_memory(s)
        budget = self.config.system.max_searcher_restarts
        why = self._why(s, r)
        print(f"\n{s.role} failed ({why}); Ray restarted it {max(self.starts[s.role] - 1, 0)} times and has "
              f"given up (system.max_searcher_restarts={budget}).\n{s.tail()}", file=sys.stderr, flush=True)
        return 1

    def _trainer_failed(self, code: int, now: float) -> int | None:
        self._each_tick()
        if self.failed_trainer.ran_out_of_memory():
            return self._trainer_out_of_memory(code)
        ckpt = self._resume_point()
        t = self.trainer
        why = self._why(t, code)
        restarts = max(self.starts["trainer"] - 1, 0)
        print(f"\ntrainer failed ({why}); Ray restarted it {restarts} times "
              f"(system.max_trainer_restarts={self.config.system.max_trainer_restarts}).\n{t.tail()}\n"
              f"to continue from {ckpt}: {self._resume_command()}",
              file=sys.stderr, flush=True)
        return code if code > 0 else 1

    def _why(self, c: _Child, code: int) -> str:
        """How the role's process ended ('killed by signal 9 (SIGKILL)'), else what Ray said."""
        died = c.died if isinstance(c, _RayChild) else None
        return self.exits.get(c.role) or died or describe_exit(code)

    def _shutdown(self) -> None:
        for c in self.children:
            if isinstance(c, _RayChild):
                c.final = True
        super()._shutdown()
        self._each_tick()  # the roles' last lines (final evaluation, checkpoint)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def connect(address: str | None) -> bool:
    """Connect to the Ray cluster at `address` ("auto", "host:port", "ray://host:port"), or start
    a local one; reuse a connection the caller made. True when this call connected."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"log_to_driver": False}  # role output arrives through the logs
    if address is None:
        kwargs["include_dashboard"] = False
    else:
        kwargs["address"] = address
    try:
        ray.init(**kwargs)
    except ConnectionError as e:
        raise ConfigError(f"--ray-address={address}: cannot connect to a Ray cluster ({e}); start one with "
                          "`ray start --head` or leave --ray-address out to start a local one") from None
    return True


def placement_problems(spec: RaySpec, num_searchers: int, nodes: Sequence[Mapping[str, Any]]) -> list[str]:
    """Why Ray could never place the roles on these nodes (`ray.nodes()` entries), so that the
    launcher refuses at once instead of Ray waiting forever: a role no single alive node can
    hold (resources or labels), or more CPUs/GPUs in total than the cluster has."""
    alive = [n for n in nodes if n.get("Alive", True)]
    problems = []
    for kind in ("trainer", "searcher") if num_searchers else ("trainer",):
        need = {"CPU": getattr(spec, f"{kind}_cpus"), "GPU": getattr(spec, f"{kind}_gpus"),
                **getattr(spec, f"{kind}_resources")}
        labels = {k: v for k, v in getattr(spec, f"{kind}_labels").items()
                  if not str(v).startswith("!") and "(" not in str(v)}  # plain equality only
        fits = [n for n in alive
                if all(n.get("Resources", {}).get(r, 0.0) >= amount for r, amount in need.items() if amount > 0)
                and all(n.get("Labels", {}).get(k) == v for k, v in labels.items())]
        if not fits:
            wanted = ", ".join(f"{amount:g} {r}" for r, amount in need.items() if amount > 0) or "nothing"
            problems.append(
                f"no node of the Ray cluster can hold a {kind} ({wanted}"
                f"{f', labels {labels}' if labels else ''}; see system.ray.{kind}_*): the nodes offer "
                + "; ".join(sorted({_offer(n) for n in alive}) or ["no node is alive"])
            )
    for name in ("CPU", "GPU"):
        low = name.lower()
        need_total = getattr(spec, f"trainer_{low}s") + num_searchers * getattr(spec, f"searcher_{low}s")
        have = sum(n.get("Resources", {}).get(name, 0.0) for n in alive)
        if need_total > have:
            problems.append(f"the roles need {need_total:g} {name}s (system.ray.trainer_{low}s + {num_searchers} x "
                            f"system.ray.searcher_{low}s) but the Ray cluster has {have:g}")
    return problems


def _offer(node: Mapping[str, Any]) -> str:
    res = node.get("Resources", {})
    custom = {k: v for k, v in res.items() if k not in ("CPU", "GPU", "memory", "object_store_memory")
              and not k.startswith("node:") and not k.startswith("accelerator_type:")}
    return (f"{res.get('CPU', 0):g} CPU, {res.get('GPU', 0):g} GPU" + "".join(f", {v:g} {k}" for k, v in custom.items()))


def check_cluster(config: ExperimentConfig, num_searchers: int) -> None:
    """Refuse a placement the cluster can never satisfy, and say when its GPUs go unused."""
    import ray

    problems = placement_problems(config.system.ray, num_searchers, ray.nodes())
    if problems:
        raise ConfigError("; ".join(problems) + ". Lower the requests (--set system.ray.KEY=VALUE) or add nodes")
    spec = config.system.ray
    gpus = sum(n.get("Resources", {}).get("GPU", 0.0) for n in ray.nodes() if n.get("Alive", True))
    if gpus > 0 and spec.trainer_gpus == 0 and spec.searcher_gpus == 0:
        print(f"note: the Ray cluster has {gpus:g} GPUs but no role asks for one "
              "(system.ray.trainer_gpus / searcher_gpus are 0): every role runs on CPU", file=sys.stderr, flush=True)


def launch(config: ExperimentConfig, run_dir: Path, *, resume: bool = False, quiet: bool = False,
           address: str | None = None, store: str | None = None) -> int:
    """Run the experiment to completion with its roles as Ray actors; returns the exit code."""
    import_ray()
    run_dir = run_dir.resolve()  # the actors run in other directories, on other nodes
    with session(config, run_dir, resume=resume):
        connected = connect(address)
        try:
            commands = role_commands(config, run_dir, resume=resume, extra=[f"--store={store}"] if store else [])
            check_cluster(config, len(commands) - 1)
            sysc = config.system
            children = []
            for role, index, args in commands:
                kind = role.split("-")[0]
                budget = sysc.max_trainer_restarts if kind == "trainer" else sysc.max_searcher_restarts
                children.append(_RayChild(
                    role, args, {}, run_dir / "logs" / f"{role}.log", config=config, index=index,
                    options=actor_options(sysc.ray, kind, max_restarts=budget),
                ))
            trainer, *searchers = children
            return RaySupervisor(config, run_dir, trainer, searchers, quiet=quiet).run()
        finally:
            if connected:
                import ray

                ray.shutdown()

