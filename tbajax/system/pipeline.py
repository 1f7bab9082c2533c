"""The pieces that let the trainer loop overlap host work with device work.

`Prefetcher` runs one host job (drawing the next batch) in a background thread; `UpdateClock`
timestamps when each update was dispatched and when the device finished it, which gives the
trainer's idle share; `BackgroundPublish` copies params to the host and hands them to the param
store off the main thread, so a publish does not make the loop wait for the update it publishes.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

log = logging.getLogger(__name__)

_STOP = object()


class Prefetcher:
    """One host job at a time, run in a background thread; its result waits in a queue of one.

    p.request(job)      # starts job() in the thread (at most one job outstanding)
    result = p.get()    # waits for it; an exception raised by job() is re-raised here, with
                        # the thread's traceback (the same exception object)
    p.close()           # stops the thread (waits for a running job to end)

    `inline=True` runs the job in the caller's thread at `request` (the serial loop: the same
    code path without the overlap).
    """

    def __init__(self, name: str = "prefetch", *, inline: bool = False):
        self.inline = inline
        self._outstanding = False
        self._result: tuple[bool, Any] | None = None  # inline: (ok, value or exception)
        self._closed = False
        if not inline:
            self._jobs: queue.Queue[Any] = queue.Queue(maxsize=1)
            self._results: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=1)
            self._thread = threading.Thread(target=self._work, name=name, daemon=True)
            self._thread.start()

    @property
    def outstanding(self) -> bool:
        """Whether a job was requested and its result not yet taken with `get`."""
        return self._outstanding

    def request(self, job: Callable[[], Any]) -> None:
        if self._closed:
            raise RuntimeError("Prefetcher.request after close()")
        if self._outstanding:
            raise RuntimeError("Prefetcher.request while a job is outstanding: get() its result first")
        self._outstanding = True
        if self.inline:
            self._result = _call(job)
        else:
            self._jobs.put(job)

    def get(self, timeout: float | None = None) -> Any:
        """The outstanding job's result (re-raising its exception); TimeoutError after `timeout` s."""
        if not self._outstanding:
            raise RuntimeError("Prefetcher.get without a request()")
        if self.inline:
            assert self._result is not None
            ok, value = self._result
            self._result = None
        else:
            try:
                ok, value = self._results.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"the prefetch job did not finish within {timeout} s") from None
        self._outstanding = False
        if not ok:
            raise value
        return value

    def close(self, timeout: float = 120.0) -> None:
        """Stop the thread once its current job (if any) ends; a result nobody took is dropped."""
        if self._closed:
            return
        self._closed = True
        if self.inline:
            return
        while True:  # make room for the stop marker: the job queue holds at most one
            try:
                self._jobs.put(_STOP, timeout=0.1)
                break
            except queue.Full:
                if not self._thread.is_alive():
                    break
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the %s thread is still running a job %.0f s after close(); leaving it (daemon)",
                        self._thread.name, timeout)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            self._results.put(_call(job))

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _call(job: Callable[[], Any]) -> tuple[bool, Any]:
    try:
        return True, job()
    except BaseException as e:  # noqa: BLE001 - handed to the caller's thread, which re-raises it
        return False, e


class PollBackoff:
    """How long a poll that found nothing sleeps: `first_s`, doubling up to `max_s`, back to
    `first_s` once a poll finds something (`reset`). A producer that is a few milliseconds away is
    noticed within a few milliseconds, where a fixed 50 ms poll added 25 ms on average to every
    wait (the trainer waits for the searchers' newest rows at nearly every step of the default
    run); a long wait still wakes only every `max_s`."""

    def __init__(self, first_s: float = 0.002, max_s: float = 0.05):
        if not 0 < first_s <= max_s:
            raise ValueError(f"PollBackoff needs 0 < first_s <= max_s, got {first_s}, {max_s}")
        self.first_s, self.max_s = first_s, max_s
        self._next = first_s

    def sleep(self) -> float:
        """Sleep for the next interval; returns it."""
        wait, self._next = self._next, min(self._next * 2, self.max_s)
        time.sleep(wait)
        return wait

    def reset(self) -> None:
        self._next = self.first_s


class UpdateClock:
    """When each update was dispatched and when the device finished it, and the idle time between.

    A watcher thread blocks on a small output of each dispatched update (`ready`) and stamps the
    moment it is ready, so completion times are the device's, not the moment the loop got round
    to checking the result (in the pipelined loop that is one update later).

    Definitions (host `time.perf_counter` seconds, this session's updates 2, 3, ...):
      idle_n  = max(0, dispatch_n - done_{n-1} - paused_n)   # no update of the loop in flight
      cycle_n = done_n - done_{n-1} - paused_n               # wall time the update took to come round
    where paused_n is the time spent in evaluation and checkpoint writes between the two updates
    (scheduled pauses, the same in every loop; `pause`). Data waits (an empty buffer) are idle.
    `idle_share` = sum(idle_n) / sum(cycle_n). The first update of a session (compilation) counts
    in neither.
    """

    def __init__(self) -> None:
        self._watcher = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="update-clock")
        self._dispatch: dict[int, float] = {}
        self._done: dict[int, concurrent.futures.Future[float]] = {}
        self._paused: dict[int, float] = {}
        self._pending_pause = 0.0
        self.idle_s = 0.0
        self.wall_s = 0.0

    def dispatched(self, update: int, at: float, ready: Any) -> None:
        self._dispatch[update] = at
        self._paused[update], self._pending_pause = self._pending_pause, 0.0
        self._done[update] = self._watcher.submit(_ready_at, ready)

    def pause(self, seconds: float) -> None:
        """Time spent on evaluation/checkpoints since the last update finished (not idle, not wall)."""
        self._pending_pause += seconds

    def finished(self, update: int) -> float:
        """Update `update` was checked: returns its idle gap (0.0 for a session's first update)
        and adds it to the totals."""
        done = self._done[update].result()
        previous = self._done.pop(update - 1, None)
        dispatch, paused = self._dispatch.pop(update), self._paused.pop(update)
        if previous is None:
            return 0.0
        before = previous.result()
        idle = max(0.0, dispatch - before - paused)
        self.idle_s += idle
        self.wall_s += max(0.0, done - before - paused)
        return idle

    @property
    def idle_share(self) -> float:
        return self.idle_s / self.wall_s if self.wall_s > 0 else float("nan")

    def close(self) -> None:
        self._watcher.shutdown(wait=False, cancel_futures=True)


def _ready_at(ready: Any) -> float:
    jax.block_until_ready(ready)
    return time.perf_counter()


@jax.jit
def _copy_tree(tree: Any) -> Any:
    """A device-side copy of a tree of arrays, in one dispatch (outputs never alias inputs that
    are not donated)."""
    return jax.tree.map(jnp.copy, tree)


class BackgroundPublish:
    """`publisher.publish(params)` without making the caller wait for the update behind `params`.

    The pipelined loop dispatches update n+1 right after publishing n's params, and that update
    donates them; so this takes a device-side copy of the params (cheap: one on-device copy,
    freed once the host has its copy) and runs the publish call (host copy, then the store's own
    background write) in a worker thread. The version number is the publisher's `next_version`,
    known at once, so the buffer can mark the sync before the write finishes (as with
    `publish(wait=False)`). At most one publish call is outstanding: the next one waits for it,
    which bounds the copies in flight and keeps the publisher's own backpressure.

    `threaded=False` publishes in the caller's thread (the serial loop; and a multi-process
    trainer, whose publish gathers sharded params collectively: collectives must be issued in
    the same order by every process, which a second thread would not guarantee).
    """

    def __init__(self, publisher: Any, *, threaded: bool):
        self.publisher = publisher
        self.threaded = threaded
        self._worker = (concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="publish-params")
                        if threaded else None)
        self._pending: concurrent.futures.Future[int] | None = None

    def publish(self, params: Any, meta: dict[str, Any] | None = None, *, step: int,
                pin: dict[str, Any] | None = None) -> int:
        if self._worker is None:
            return self.publisher.publish(params, meta, step=step, wait=False, pin=pin)
        self.join()
        version = self.publisher.next_version
        snapshot = _copy_tree(params)
        self._pending = self._worker.submit(self._publish, snapshot, meta, step, version, pin)
        return version

    def _publish(self, snapshot: Any, meta: dict[str, Any] | None, step: int, version: int,
                 pin: dict[str, Any] | None = None) -> int:
        got = self.publisher.publish(snapshot, meta, step=step, wait=False, pin=pin)
        if got != version:
            raise RuntimeError(f"published params of step {step} as version {got}, expected {version}: "
                               "something else published through the same ParamPublisher")
        return got

    def join(self) -> None:
        """Wait for the outstanding publish call (not the store's write); re-raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        try:
            self.join()
        finally:
            if self._worker is not None:
                self._worker.shutdown(wait=True)
