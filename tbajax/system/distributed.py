"""A trainer that runs as several JAX processes on one global mesh.

Every process of a multi-process trainer must run the same device programs in the same order
(each jitted step, each param gather, each checkpoint save is a collective), on the same batch.
So one process decides and the others follow:

- process 0 (the *primary*) tails the stores, samples the replay buffer, and publishes each
  step's decision (the step's groups of trajectories, or "stop") in the JAX coordination
  service's key-value store; the other processes block on that key, decode the identical groups
  and collate the identical host batch. The KV store is a plain RPC service (no device collective),
  so the agreement may run in a background thread while the main thread runs the device work.
- every process turns the host batch into global arrays holding only its addressable shards
  (`tbajax.sharding.host_to_global`, called inside the jitted train step's wrapper);
- only the primary writes: metrics, status, summary, the buffer's state, param versions (every
  process joins the gather, see `tbajax.stores.params`). Orbax checkpoints are written by all
  processes together (orbax coordinates them).

A failed process publishes its error under `FAILURE_KEY` and exits at once, skipping JAX's
shutdown barrier: a peer waiting on a step's key raises an error naming it; a peer inside a
collective is ended by the coordination service, which notices the missing heartbeats within
`heartbeat_timeout_s` and aborts every process with a message naming the dead task.

Single-process runs go through the same calls (`StepAgreement.decide` just calls the decision),
so the trainer has one code path.
"""

from __future__ import annotations

import io
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from tbajax.trajectory import RewardStatus, Trajectory

log = logging.getLogger(__name__)

FAILURE_KEY = "tbajax/failed"  # + "/<process id>": the error of a process that failed
STEP_KEY = "tbajax/step"  # + "/<step>": a step's decision (header), + "/<step>/<i>": its chunks
CHUNK_BYTES = 1 << 20  # below gRPC's default 4 MiB message limit, with room to spare
KEEP_STEPS = 16  # decisions kept in the KV store (the followers are at most a step or two behind)
HEARTBEAT_TIMEOUT_S = 30
POLL_S = 2.0  # a follower re-checks for a failed peer this often while it waits for a decision


class Stop:
    """The primary's decision to end the loop (a stop request reached it)."""

    def __repr__(self) -> str:
        return "STOP"


STOP = Stop()


class PeerFailedError(RuntimeError):
    """Another trainer process failed; this one cannot go on without it."""


def initialize(coordinator_address: str, num_processes: int, process_id: int, *,
               heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S, initialization_timeout_s: int = 300) -> None:
    """`jax.distributed.initialize` with CPU collectives over gloo (without them a CPU mesh that
    spans processes cannot run a collective) and a heartbeat timeout short enough that a dead
    peer ends the job in seconds rather than minutes."""
    if num_processes is None or process_id is None:
        raise ValueError("--coordinator-address needs --num-processes and --process-id")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"--process-id={process_id} must be in [0, --num-processes={num_processes})")
    if getattr(jax.config, "jax_cpu_collectives_implementation", "gloo") != "gloo":  # gloo: the default in 0.10
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address, num_processes, process_id,
        initialization_timeout=initialization_timeout_s, heartbeat_timeout_seconds=heartbeat_timeout_s,
    )
    log.info("JAX process %d of %d (coordinator %s): %d local of %d devices", process_id, num_processes,
             coordinator_address, jax.local_device_count(), jax.device_count())


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def is_primary() -> bool:
    """The process that decides batches and writes everything (the only one when single-process)."""
    return jax.process_index() == 0


def _client() -> Any:
    from jax._src.distributed import global_state

    if global_state.client is None:
        raise RuntimeError("jax.distributed is not initialized; start the process with --coordinator-address")
    return global_state.client


def fail_fast(error: BaseException) -> None:
    """Report `error` to the peers and end this process now (exit code 1).

    A normal exit would run JAX's shutdown barrier, which waits for peers that may be blocked
    forever in a collective this process will never join."""
    message = f"{type(error).__name__}: {error}"
    traceback.print_exception(error, file=sys.stderr)
    print(f"trainer process {jax.process_index()} failed: {message}", file=sys.stderr, flush=True)
    try:
        _client().key_value_set(f"{FAILURE_KEY}/{jax.process_index()}", message[:4000])
    except Exception as e:  # noqa: BLE001 - the service may be gone with process 0
        print(f"(could not tell the other trainer processes: {e})", file=sys.stderr, flush=True)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def failed_peers(client: Any) -> dict[int, str]:
    """{process id: error} of the processes that reported a failure."""
    try:
        entries = client.key_value_dir_get(FAILURE_KEY)
    except Exception:  # noqa: BLE001 - no such directory yet
        return {}
    return {int(k.rsplit("/", 1)[-1]): v for k, v in entries}


# -- groups of trajectories <-> bytes ---------------------------------------------------------

_INT_FIELDS = ("prompt_id", "group_id", "reward_status", "finished", "policy_version", "searcher_id")
_FLOAT_FIELDS = ("reward", "wall_time")


def encode_groups(groups: Sequence[Sequence[Trajectory]]) -> bytes:
    """The groups as one self-describing blob (npz): per-row scalars as int64 / float64 columns
    (floats round-trip exactly), token and log-prob arrays concatenated, extras as JSON."""
    rows = [t for g in groups for t in g]
    ints = np.array([[int(getattr(t, f)) for f in _INT_FIELDS]
                     + [len(t.prompt_tokens), len(t.response_tokens), t.reference_logprobs is not None]
                     for t in rows], np.int64).reshape(len(rows), len(_INT_FIELDS) + 3)
    arrays = {
        "sizes": np.array([len(g) for g in groups], np.int64),
        "ints": ints,
        "floats": np.array([[float(getattr(t, f)) for f in _FLOAT_FIELDS] for t in rows],
                           np.float64).reshape(len(rows), len(_FLOAT_FIELDS)),
        "prompt_tokens": _concat([t.prompt_tokens for t in rows], np.int32),
        "response_tokens": _concat([t.response_tokens for t in rows], np.int32),
        "behavior_logprobs": _concat([t.behavior_logprobs for t in rows], np.float32),
        "reference_logprobs": _concat([t.reference_logprobs for t in rows if t.reference_logprobs is not None],
                                      np.float32),
        "token_versions": _concat([t.token_versions for t in rows], np.int32),
    }
    if any(t.extras for t in rows):
        extras = [dict(t.extras) if t.extras is not None else None for t in rows]
        arrays["extras"] = np.frombuffer(json.dumps(extras, allow_nan=True).encode(), np.uint8)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def decode_groups(blob: bytes) -> list[list[Trajectory]]:
    with np.load(io.BytesIO(blob), allow_pickle=False) as z:
        flat = {k: z[k] for k in z.files}
    extras = json.loads(flat["extras"].tobytes()) if "extras" in flat else None
    rows, p, r, ref = [], 0, 0, 0
    for i, (ints, floats) in enumerate(zip(flat["ints"].tolist(), flat["floats"].tolist())):
        *values, plen, rlen, has_ref = ints
        fields: dict[str, Any] = dict(zip(_INT_FIELDS, values))
        fields["reward_status"] = RewardStatus(fields["reward_status"])
        fields["finished"] = bool(fields["finished"])
        fields.update(zip(_FLOAT_FIELDS, floats))
        reference = None
        if has_ref:
            reference, ref = flat["reference_logprobs"][ref:ref + rlen], ref + rlen
        rows.append(Trajectory(prompt_tokens=flat["prompt_tokens"][p:p + plen],
                               response_tokens=flat["response_tokens"][r:r + rlen],
                               behavior_logprobs=flat["behavior_logprobs"][r:r + rlen],
                               reference_logprobs=reference, extras=extras[i] if extras else None,
                               token_versions=flat["token_versions"][r:r + rlen], **fields))
        p, r = p + plen, r + rlen
    groups, start = [], 0
    for n in flat["sizes"].tolist():
        groups.append(rows[start:start + n])
        start += n
    return groups


def _concat(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
    return np.concatenate([np.asarray(a, dtype) for a in parts]) if parts else np.zeros(0, dtype)


# -- the per-step agreement -------------------------------------------------------------------


class StepAgreement:
    """Process 0 decides each step (its groups, or STOP); every process gets the same decision.

        groups = agreement.decide(step, lambda: STOP if stop() else draw())

    On the primary `decide` calls the decision; STOP or a list of groups is published under the
    step's key, anything else (None, an exception object saying why there is no batch yet) is
    returned to the primary alone, which decides again. Elsewhere the decision is not
    called: `decide` blocks until the primary's decision for `step` arrives (or a peer reports a
    failure: PeerFailedError naming it). Single-process: `decide` is the decision.
    `share(name, value)` hands one JSON value from the primary to all (e.g. the run id).
    Thread-safe for one caller at a time per step (the KV client works from any thread).
    """

    def __init__(self, *, namespace: str = STEP_KEY, poll_s: float = POLL_S, client: Any = None):
        self.multiprocess = is_multiprocess()
        self.primary = is_primary()
        self.namespace = namespace
        self.poll_s = poll_s
        self._client = client if client is not None or not self.multiprocess else _client()
        self.published: list[int] = []
        self.wait_s = 0.0  # followers: time spent waiting for decisions
        self.bytes_sent = 0

    def decide(self, step: int, decision: Callable[[], Any]) -> Any:
        if not self.multiprocess:
            return decision()
        if self.primary:
            value = decision()
            if value is STOP or isinstance(value, (list, tuple)):
                self._publish(step, value)
            return value
        return self._receive(step)

    def share(self, name: str, value: Callable[[], Any]) -> Any:
        """The primary's `value()` (JSON), on every process (once per name and session).

        Also the way to hold the followers after work process 0 does alone (building and running
        the evaluator): they wait here, in the KV store, with no deadline, rather than inside the
        next device collective, where gloo (CPU) gives up after 30 s."""
        if not self.multiprocess:
            return value()
        key = f"tbajax/shared/{name}"
        if self.primary:
            v = value()
            self._client.key_value_set(key, json.dumps(v))
            return v
        return json.loads(self._wait(key, f"the primary's {name}"))

    def _publish(self, step: int, value: Any) -> None:
        key = f"{self.namespace}/{step}"
        if value is STOP:
            header = {"kind": "stop", "chunks": 0}
        else:
            blob = encode_groups(value)
            chunks = [blob[i:i + CHUNK_BYTES] for i in range(0, len(blob), CHUNK_BYTES)] or [b""]
            for i, c in enumerate(chunks):
                self._client.key_value_set_bytes(f"{key}/{i}", c)
            header = {"kind": "groups", "chunks": len(chunks)}
            self.bytes_sent += len(blob)
        self._client.key_value_set(key, json.dumps(header))  # last: its presence means complete
        self.published.append(step)
        while len(self.published) > KEEP_STEPS:
            self._delete(self.published.pop(0))

    def _delete(self, step: int) -> None:
        key = f"{self.namespace}/{step}"
        try:
            self._client.key_value_delete(key)  # and the chunks under key/ (a directory delete)
        except Exception as e:  # noqa: BLE001 - cleanup only
            log.debug("could not delete %s: %s", key, e)

    def _receive(self, step: int) -> Any:
        key = f"{self.namespace}/{step}"
        t0 = time.perf_counter()
        header = json.loads(self._wait(key, f"trainer step {step}'s batch from process 0"))
        if header["kind"] == "stop":
            out: Any = STOP
        else:
            blob = b"".join(self._client.blocking_key_value_get_bytes(f"{key}/{i}", 60_000)
                            for i in range(header["chunks"]))
            out = decode_groups(blob)
        self.wait_s += time.perf_counter() - t0
        return out

    def _wait(self, key: str, what: str) -> str:
        """The value of `key` once set; PeerFailedError as soon as a peer reports a failure. A
        peer that dies without reporting ends this process through the coordination service's
        heartbeats (it aborts every task), so waiting needs no deadline of its own."""
        waited = 0.0
        while True:
            try:
                return self._client.blocking_key_value_get(key, int(self.poll_s * 1000))
            except Exception as e:  # noqa: BLE001 - jax raises XlaRuntimeError (DEADLINE_EXCEEDED)
                if "DEADLINE_EXCEEDED" not in str(e) and "timed out" not in str(e).lower():
                    raise PeerFailedError(f"waiting for {what}: the coordination service failed: {e}") from None
            waited += self.poll_s
            failed = failed_peers(self._client)
            if failed:
                raise PeerFailedError(
                    f"waiting for {what}: trainer process(es) "
                    + "; ".join(f"{pid} failed ({msg})" for pid, msg in sorted(failed.items()))
                    + ". Fix that error and restart every trainer process with --resume")
            if waited in (60.0, 600.0) or (waited > 600 and waited % 3600 < self.poll_s):
                log.info("still waiting for %s after %.0f s (process 0 waits for trainable data)", what, waited)


def primary_only(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` on the primary, a no-op returning None elsewhere (metrics, status and summary writes)."""
    if is_primary():
        return fn

    def skipped(*args: Any, **kwargs: Any) -> None:
        return None

    return skipped


class NullMetrics:
    """A MetricsWriter that writes nothing (followers: only the primary writes metrics)."""

    def write(self, step: int, scalars: Any) -> dict[str, Any]:
        return {"step": int(step), **dict(scalars)}

    def close(self) -> None:
        pass


def gather_to_host(tree: Any) -> Any:
    """Every leaf as a host numpy array; leaves that span processes are gathered first
    (`process_allgather`: a collective, so every process must call this, in the same order)."""
    from jax.experimental import multihost_utils

    def one(x: Any) -> Any:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(one, tree)


class PrimaryEvaluation:
    """Evaluation of a trainer whose mesh may span processes.

    Single-process: `build(policy, mesh)` on the trainer's mesh, as before. Multi-process, the
    sampler's host-side loop (prompts in, tokens out, graded on the host) is one process's job:
    every process joins the gather of the params to the host (a collective), and process 0 alone
    samples and grades, on its own devices laid out as a searcher's (`local_mesh`); the others
    get NaN scores (they write nothing). Costs one params gather per evaluation and, on
    process 0, one host copy of the params on its devices while it evaluates.
    """

    def __init__(self, build: Callable[[Any, Any], Any], policy: Any, mesh: Any, local_mesh: Callable[[], Any],
                 agreement: StepAgreement):
        from tbajax.sharding import spans_processes

        self.spread = spans_processes(mesh)
        self.inner = None
        self.agreement = agreement
        self.runs = 0
        if not self.spread:
            self.inner = build(policy, mesh)
        else:
            host = self._host_model(policy)
            if is_primary():
                self.inner = build(host, local_mesh())
            agreement.share("evaluator-ready", lambda: True)  # followers wait here, not in a collective

    @property
    def metric(self) -> str:
        return self.inner.metric if self.inner is not None else "eval_score"

    def run(self, policy: Any) -> dict[str, float]:
        if not self.spread:
            return self.inner.run(policy)
        host = self._host_model(policy)
        out = self.inner.run(host) if self.inner is not None else {"eval_score": float("nan")}
        self.runs += 1
        self.agreement.share(f"evaluated-{self.runs}", lambda: True)
        return out

    @staticmethod
    def _host_model(policy: Any) -> Any:
        from flax import nnx

        graphdef, state = nnx.split(policy)
        return nnx.merge(graphdef, gather_to_host(state))
