"""Scoring completions in separate processes, so a grader can hang or crash without harming us.

Each worker is a process with its own pipe and serves one sample at a time; the parent gives each
sample a deadline and multiplexes over all pipes and process sentinels with
`multiprocessing.connection.wait`. A sample past its deadline gets TIMEOUT (its worker is killed
and replaced), a raising grader gets ERROR (exception text logged), a worker that dies (os._exit,
segfault) is replaced and its sample scored again on the fresh one: ERROR only if that one dies too.
A death need not be the grader's: 255 is the exit code CPython's forkserver reports when it could
not deliver a worker's status (python/cpython#140867 shows such failures under load), and one test
run on a loaded 2-core machine lost a math-verify sample that way. Workers start with `spawn` or
`forkserver`, never `fork`: the caller is a multi-threaded JAX process. Workers say "ready" after start-up, and
the clock of a sample only starts when a ready worker receives it, so slow imports in a fresh
worker never count as a grader timeout.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import math
import multiprocessing as mp
import pickle
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any, NamedTuple

from tbajax.imports import load_file_as
from tbajax.tasks.base import Problem, Task
from tbajax.trajectory import RewardStatus

log = logging.getLogger(__name__)

_READY = "ready"
WORKER_DEATHS_PER_SAMPLE = 2  # a sample whose workers die this many times gets ERROR


class RewardResult(NamedTuple):
    reward: float
    status: RewardStatus
    error: str | None = None  # exception text / reason when status is ERROR or TIMEOUT


def call_reward(fn: Callable[[str, Any], Any], completion: str, answer: Any) -> RewardResult:
    """Run a reward function, turning exceptions and malformed results into ERROR results."""
    try:
        out = fn(completion, answer)
    except BaseException as e:  # noqa: BLE001 - includes SystemExit from a grader calling sys.exit
        if isinstance(e, KeyboardInterrupt):
            raise
        return RewardResult(0.0, RewardStatus.ERROR, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}")
    try:
        reward, status = out
        reward = float(reward)
        status = RewardStatus(status)
    except (TypeError, ValueError) as e:
        return RewardResult(0.0, RewardStatus.ERROR, f"reward function returned {out!r}, expected (float, RewardStatus): {e}")
    if not math.isfinite(reward):
        return RewardResult(0.0, RewardStatus.ERROR, f"reward function returned a non-finite reward {reward}")
    return RewardResult(reward, status)


def _source_modules(fn: Any, answer: Any) -> tuple[tuple[str, str], ...]:
    """(module name, file) of the reward function and the answer's type, so a worker can load a
    module that is not importable by name (a task file loaded by path) under the same name."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    out = []
    for name in {getattr(fn, "__module__", None), type(answer).__module__}:
        if not name or name in ("__main__", "builtins"):
            continue
        file = getattr(sys.modules.get(name), "__file__", None)
        if file:
            out.append((name, file))
    return tuple(sorted(out))


def _ensure_modules(modules: tuple[tuple[str, str], ...]) -> None:
    for name, file in modules:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
            continue
        except ModuleNotFoundError:
            pass
        load_file_as(name, file)


def _worker_main(conn: Connection) -> None:
    conn.send(_READY)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        modules, payload = msg
        try:
            _ensure_modules(modules)
            fn, completion, answer = pickle.loads(payload)
        except Exception as e:  # noqa: BLE001
            conn.send(
                (
                    0.0,
                    int(RewardStatus.ERROR),
                    f"the reward worker cannot load the reward function or answer: {type(e).__name__}: {e}. "
                    "Reward functions must be importable (module level in an importable module or task file)",
                )
            )
            continue
        r = call_reward(fn, completion, answer)
        conn.send((float(r.reward), int(r.status), r.error))


class _Worker:
    def __init__(self, ctx: mp.context.BaseContext, name: str):
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_worker_main, args=(child,), name=name, daemon=True)
        self.process.start()
        child.close()
        self.ready = False
        self.job: int | None = None  # index of the sample being scored
        self.deadline = math.inf

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


def _answer(item: Any) -> Any:
    return item.answer if isinstance(item, Problem) else item


class RewardPool:
    """Score (completion, problem) pairs of a task with a per-sample timeout in worker processes.

    `score` returns `(reward, status)` per item in order; `score_detailed` also the error text.
    Tasks with `cheap_reward=True` are scored in this process (exceptions still become ERROR).
    One `score` call runs at a time (calls from several threads are serialised).
    """

    def __init__(
        self,
        num_workers: int,
        timeout_s: float,
        *,
        start_method: str = "forkserver",
        max_start_failures: int = 3,
        startup_timeout_s: float = 120.0,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(f"start_method must be 'spawn' or 'forkserver' (fork is unsafe with JAX), got {start_method!r}")
        if start_method not in mp.get_all_start_methods():
            raise ValueError(f"start method {start_method!r} is not available here; use 'spawn'")
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.max_start_failures = max_start_failures
        self.startup_timeout_s = startup_timeout_s
        self._ctx = mp.get_context(start_method)
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._spawned = 0
        self._closed = False
        self.restarts = 0  # workers replaced after a timeout or crash

    # -- lifecycle -----------------------------------------------------------------------------

    def _start_worker(self) -> _Worker:
        self._spawned += 1
        return _Worker(self._ctx, f"reward-worker-{self._spawned}")

    def _ensure_workers(self) -> None:
        while len(self._workers) < self.num_workers:
            self._workers.append(self._start_worker())

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self._workers.remove(w)
        self.restarts += 1
        self._workers.append(self._start_worker())

    def close(self) -> None:
        """Stop all workers (politely, then by force)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for w in self._workers:
                try:
                    w.conn.send(None)
                except (OSError, ValueError):
                    pass
            for w in self._workers:
                w.process.join(timeout=1.0)
                w.kill()
            self._workers.clear()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:  # last resort; call close()
        for w in getattr(self, "_workers", []):
            try:
                w.process.kill()
            except Exception:  # noqa: BLE001
                pass

    # -- scoring -------------------------------------------------------------------------------

    def score(self, task: Task, items: Sequence[tuple[str, Any]]) -> list[tuple[float, RewardStatus]]:
        """(reward, status) for each (completion, problem-or-answer) pair, in order."""
        return [(r.reward, r.status) for r in self.score_detailed(task, items)]

    def score_detailed(self, task: Task, items: Sequence[tuple[str, Any]]) -> list[RewardResult]:
        jobs = [(completion, _answer(item)) for completion, item in items]
        if task.cheap_reward:
            results = [call_reward(task.reward_fn, c, a) for c, a in jobs]
        else:
            results = self.run(task.reward_fn, jobs)
        for i, r in enumerate(results):
            if r.status == RewardStatus.ERROR:
                log.error("task %s: reward of sample %d failed: %s", task.name, i, r.error)
            elif r.status == RewardStatus.TIMEOUT:
                log.warning("task %s: reward of sample %d timed out: %s", task.name, i, r.error)
        return results

    def run(self, fn: Callable[[str, Any], Any], jobs: Sequence[tuple[str, Any]]) -> list[RewardResult]:
        """Score `(completion, answer)` jobs with `fn` in the workers (no logging, no fast path)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardPool is closed")
            return self._run(fn, jobs)

    def _run(self, fn: Callable[[str, Any], Any], jobs: Sequence[tuple[str, Any]]) -> list[RewardResult]:
        results: list[RewardResult | None] = [None] * len(jobs)
        pending = deque(range(len(jobs)))
        deaths = [0] * len(jobs)  # workers lost while scoring each sample
        self._ensure_workers()
        start_failures = 0
        last_progress = time.monotonic()

        while pending or any(w.job is not None for w in self._workers):
            # hand out work to ready, idle workers; the sample's clock starts now
            for w in list(self._workers):
                while pending and w.ready and w.job is None and w in self._workers:
                    i = pending.popleft()
                    try:
                        payload = pickle.dumps((fn, *jobs[i]), protocol=pickle.HIGHEST_PROTOCOL)
                    except Exception as e:  # noqa: BLE001 - an unpicklable function or answer
                        results[i] = RewardResult(0.0, RewardStatus.ERROR, f"cannot send the sample to a worker: {e!r}")
                        continue
                    try:
                        w.conn.send((_source_modules(fn, jobs[i][1]), payload))
                    except (OSError, EOFError):  # the worker died while idle
                        pending.appendleft(i)
                        self._replace(w)
                        break
                    w.job, w.deadline = i, time.monotonic() + self.timeout_s

            now = time.monotonic()
            busy_deadlines = [w.deadline for w in self._workers if w.job is not None]
            wait_s = max(0.0, min(busy_deadlines) - now) if busy_deadlines else 1.0
            handles = {}
            for w in self._workers:
                handles[w.conn] = w
                handles[w.process.sentinel] = w
            ready = wait(list(handles), timeout=wait_s)

            dead: list[_Worker] = []
            for h in ready:
                w = handles[h]
                if w in dead:
                    continue
                if h is w.conn:
                    try:
                        msg = w.conn.recv()
                    except (EOFError, OSError):
                        dead.append(w)
                        continue
                    if msg == _READY:
                        w.ready, start_failures, last_progress = True, 0, time.monotonic()
                    elif w.job is not None:
                        reward, status, error = msg
                        results[w.job] = RewardResult(reward, RewardStatus(status), error)
                        w.job, w.deadline, last_progress = None, math.inf, time.monotonic()
                elif not w.process.is_alive() and not (w.conn.poll() if not w.conn.closed else False):
                    dead.append(w)
            for w in dead:
                w.process.join(timeout=1.0)  # its pipe closed: it is exiting, collect the exit code
                code = w.process.exitcode
                if w.job is not None:
                    i = w.job
                    deaths[i] += 1
                    if deaths[i] < WORKER_DEATHS_PER_SAMPLE:
                        log.warning("reward worker died (exit code %s) while scoring a sample; scoring it again "
                                    "on a fresh worker", code)
                        pending.appendleft(i)
                    else:
                        results[i] = RewardResult(
                            0.0, RewardStatus.ERROR,
                            f"reward worker died (exit code {code}) while scoring this sample, "
                            f"{deaths[i]} times on fresh workers",
                        )
                elif not w.ready:
                    start_failures += 1
                    log.error("reward worker failed to start (exit code %s)", code)
                self._replace(w)

            now = time.monotonic()
            for w in list(self._workers):
                if w.job is not None and now >= w.deadline:
                    results[w.job] = RewardResult(
                        0.0, RewardStatus.TIMEOUT, f"reward function ran past {self.timeout_s:g} s; worker killed"
                    )
                    self._replace(w)

            stuck = not any(w.ready for w in self._workers) and now - last_progress > self.startup_timeout_s
            if pending and (start_failures >= self.max_start_failures or stuck):
                reason = (
                    f"reward workers failed to start {start_failures} times in a row"
                    if start_failures >= self.max_start_failures
                    else f"no reward worker became ready within {self.startup_timeout_s:g} s"
                )
                log.error("%s; %d samples get status ERROR", reason, len(pending))
                while pending:
                    results[pending.popleft()] = RewardResult(0.0, RewardStatus.ERROR, reason)

        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]
