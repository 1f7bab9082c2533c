"""Append-only trajectory stores: one writer (a searcher) per store, any number of tailing readers.

Layout of one store (``<run>/trajectories/searcher-<i>/``), zarr3 arrays through tensorstore:

    commit.json          {"format", "store_id", "searcher_id", "rows", "prompt_tokens", "response_tokens"}
    rows_i64/            int64 [rows, 10]: ids, offsets into the flat arrays, lengths, status, flags
    rows_f64/            float64 [rows, 2]: reward, wall time
    prompt_tokens/       int32 [sum of prompt lengths]        (jagged: concatenated, no padding)
    response_tokens/     int32 [sum of response lengths]
    behavior_logprobs/   float32, aligned with response_tokens
    reference_logprobs/  float32, aligned with response_tokens (read only for rows flagged has-ref)

The arrays have a fixed, huge shape (only written chunks exist), so nothing is ever resized and
a reader never needs new metadata. Commit protocol (levanter's jagged store does the same): an
append writes its data past the committed extents, waits until it is durable, then replaces
``commit.json`` in one atomic single-key write. Readers read ``commit.json`` first and read
nothing beyond its extents, so they never see a partial or zero-filled row. A crash between the
two steps leaves unreferenced data that the next append overwrites. A tail chunk shared by
committed and new rows is replaced as a whole (rename on file systems, object put on buckets)
and holds the same committed bytes, so committed rows never change under a reader.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from tbajax.stores.urls import (
    TRAJECTORIES_DIR,
    join_url,
    list_keys,
    open_kvstore,
    read_json,
    to_url,
    write_json,
)
from tbajax.trajectory import RewardStatus, Trajectory

FORMAT = "tbajax.trajectories.v1"
COMMIT_KEY = "commit.json"
CAPACITY = 2**40  # rows or flat elements; chunks that were never written take no space
ROW_CHUNK = 4096
FLAT_CHUNK = 65536

I64_COLUMNS = (
    "prompt_id",
    "group_id",
    "prompt_start",
    "prompt_len",
    "response_start",
    "response_len",
    "policy_version",
    "searcher_id",
    "reward_status",
    "flags",
)
F64_COLUMNS = ("reward", "wall_time")
_I = {name: i for i, name in enumerate(I64_COLUMNS)}
_F = {name: i for i, name in enumerate(F64_COLUMNS)}
FLAG_FINISHED = 1
FLAG_HAS_REFERENCE = 2

# name -> (dtype, trailing shape, chunk, fill value)
_ARRAYS: dict[str, tuple[str, tuple[int, ...], tuple[int, ...], Any]] = {
    "rows_i64": ("int64", (len(I64_COLUMNS),), (ROW_CHUNK, len(I64_COLUMNS)), 0),
    "rows_f64": ("float64", (len(F64_COLUMNS),), (ROW_CHUNK, len(F64_COLUMNS)), 0.0),
    "prompt_tokens": ("int32", (), (FLAT_CHUNK,), 0),
    "response_tokens": ("int32", (), (FLAT_CHUNK,), 0),
    "behavior_logprobs": ("float32", (), (FLAT_CHUNK,), 0.0),
    "reference_logprobs": ("float32", (), (FLAT_CHUNK,), "NaN"),
}

_SEARCHER_DIR = re.compile(r"^searcher-(\d+)/" + re.escape(COMMIT_KEY) + "$")


class TrajectoryStoreError(RuntimeError):
    """The store on disk is not what this reader/writer expects (corrupt, replaced, shared)."""


def _open_arrays(url: str, create: bool) -> dict[str, ts.TensorStore]:
    # No chunk cache: every read goes to storage, so a long-lived handle sees new commits.
    context = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
    futures = {}
    for name, (dtype, trailing, chunk, fill) in _ARRAYS.items():
        spec: dict[str, Any] = {
            "driver": "zarr3",
            "kvstore": to_url(join_url(url, name)) + "/",
            "recheck_cached_data": True,
            "recheck_cached_metadata": "open",
        }
        if create:
            spec["metadata"] = {
                "shape": [CAPACITY, *trailing],
                "data_type": dtype,
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk)}},
                "fill_value": fill,
            }
        futures[name] = ts.open(spec, create=create, open=True, context=context)
    arrays = {}
    for name, fut in futures.items():
        try:
            arrays[name] = fut.result()
        except ValueError as e:
            raise TrajectoryStoreError(f"cannot open array {name!r} of trajectory store {url}: {e}") from e
        dtype, trailing, _, _ = _ARRAYS[name]
        if arrays[name].dtype.name != dtype or tuple(arrays[name].shape[1:]) != trailing:
            raise TrajectoryStoreError(
                f"array {name!r} of {url} has dtype {arrays[name].dtype.name} shape {arrays[name].shape}; "
                f"expected {dtype} [*, {trailing}]: written by another format version?"
            )
    return arrays


def _check_commit(commit: dict[str, Any], url: str) -> dict[str, Any]:
    if commit.get("format") != FORMAT:
        raise TrajectoryStoreError(
            f"{url}/{COMMIT_KEY} has format {commit.get('format')!r}, this code reads {FORMAT!r}"
        )
    for key in ("rows", "prompt_tokens", "response_tokens", "searcher_id"):
        if not isinstance(commit.get(key), int) or commit[key] < 0:
            raise TrajectoryStoreError(f"{url}/{COMMIT_KEY} has a bad {key!r}: {commit.get(key)!r}")
    return commit


def _as_int32(x: Any, what: str, index: int) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise ValueError(f"trajectory {index}: {what} must be a 1-D integer array, got {a.dtype}{list(a.shape)}")
    if a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
        raise ValueError(f"trajectory {index}: {what} has values outside int32")
    return a.astype(np.int32, copy=False)


def _as_float32(x: Any, what: str, index: int) -> np.ndarray:
    a = np.asarray(x, dtype=np.float32)
    if a.ndim != 1:
        raise ValueError(f"trajectory {index}: {what} must be 1-D, got shape {list(a.shape)}")
    return a


def _encode(trajs: Sequence[Trajectory], commit: dict[str, Any], searcher_id: int) -> dict[str, np.ndarray]:
    """Row tables and flat arrays for one append, offsets continuing after the committed extents."""
    n = len(trajs)
    prompts, responses, behavior, reference = [], [], [], []
    i64 = np.zeros((n, len(I64_COLUMNS)), np.int64)
    f64 = np.zeros((n, len(F64_COLUMNS)), np.float64)
    any_ref = any(t.reference_logprobs is not None for t in trajs)
    for i, t in enumerate(trajs):
        if not isinstance(t, Trajectory):
            raise TypeError(f"trajectory {i}: expected tbajax.trajectory.Trajectory, got {type(t).__name__}")
        if t.searcher_id != searcher_id:
            raise ValueError(
                f"trajectory {i} has searcher_id {t.searcher_id} but this store belongs to searcher "
                f"{searcher_id}: each searcher appends to its own store"
            )
        p = _as_int32(t.prompt_tokens, "prompt_tokens", i)
        r = _as_int32(t.response_tokens, "response_tokens", i)
        prompts.append(p)
        responses.append(r)
        behavior.append(_as_float32(t.behavior_logprobs, "behavior_logprobs", i))
        if any_ref:
            ref = t.reference_logprobs
            reference.append(
                np.full(len(r), np.nan, np.float32) if ref is None else _as_float32(ref, "reference_logprobs", i)
            )
        flags = (FLAG_FINISHED if t.finished else 0) | (FLAG_HAS_REFERENCE if t.reference_logprobs is not None else 0)
        i64[i, _I["prompt_id"]] = t.prompt_id
        i64[i, _I["group_id"]] = t.group_id
        i64[i, _I["prompt_len"]] = len(p)
        i64[i, _I["response_len"]] = len(r)
        i64[i, _I["policy_version"]] = t.policy_version
        i64[i, _I["searcher_id"]] = t.searcher_id
        i64[i, _I["reward_status"]] = int(RewardStatus(t.reward_status))
        i64[i, _I["flags"]] = flags
        f64[i, _F["reward"]] = float(t.reward)
        f64[i, _F["wall_time"]] = float(t.wall_time)
    plen, rlen = i64[:, _I["prompt_len"]], i64[:, _I["response_len"]]
    i64[:, _I["prompt_start"]] = commit["prompt_tokens"] + np.concatenate([[0], np.cumsum(plen)[:-1]])
    i64[:, _I["response_start"]] = commit["response_tokens"] + np.concatenate([[0], np.cumsum(rlen)[:-1]])
    out = {
        "rows_i64": i64,
        "rows_f64": f64,
        "prompt_tokens": np.concatenate(prompts),
        "response_tokens": np.concatenate(responses),
        "behavior_logprobs": np.concatenate(behavior),
    }
    if any_ref:
        out["reference_logprobs"] = np.concatenate(reference)
    return out


def _decode(
    i64: np.ndarray,
    f64: np.ndarray,
    flat: dict[str, np.ndarray],
    p0: int,
    r0: int,
) -> list[Trajectory]:
    out = []
    for row, frow in zip(i64, f64):
        ps, pl = int(row[_I["prompt_start"]]) - p0, int(row[_I["prompt_len"]])
        rs, rl = int(row[_I["response_start"]]) - r0, int(row[_I["response_len"]])
        flags = int(row[_I["flags"]])
        out.append(
            Trajectory(
                prompt_id=int(row[_I["prompt_id"]]),
                group_id=int(row[_I["group_id"]]),
                prompt_tokens=flat["prompt_tokens"][ps : ps + pl],
                response_tokens=flat["response_tokens"][rs : rs + rl],
                behavior_logprobs=flat["behavior_logprobs"][rs : rs + rl],
                reward=float(frow[_F["reward"]]),
                reward_status=RewardStatus(int(row[_I["reward_status"]])),
                finished=bool(flags & FLAG_FINISHED),
                policy_version=int(row[_I["policy_version"]]),
                searcher_id=int(row[_I["searcher_id"]]),
                wall_time=float(frow[_F["wall_time"]]),
                reference_logprobs=(
                    flat["reference_logprobs"][rs : rs + rl] if flags & FLAG_HAS_REFERENCE else None
                ),
            )
        )
    return out


class TrajectoryWriter:
    """The single writer of one searcher's store; each `append` is one atomic commit.

    Re-opening after a crash continues after the last committed row (uncommitted data is simply
    overwritten). A second live writer on the same store is a misconfiguration that is detected,
    not supported: an append first checks that the commit record is unchanged since this writer
    last wrote it (so it does not overwrite rows another writer committed), and the commit
    itself is conditional on that too. Only a race inside that check-then-write window could
    still clobber data, which is why each searcher must own its store.
    """

    def __init__(self, url: str | os.PathLike[str], searcher_id: int):
        self.url = to_url(url)
        self.searcher_id = int(searcher_id)
        self._kv = open_kvstore(self.url)
        commit, generation = read_json(self._kv, COMMIT_KEY)
        if commit is None:
            self._arrays = _open_arrays(self.url, create=True)
            commit = {
                "format": FORMAT,
                "store_id": uuid.uuid4().hex,
                "searcher_id": self.searcher_id,
                "rows": 0,
                "prompt_tokens": 0,
                "response_tokens": 0,
            }
            new_generation = write_json(self._kv, COMMIT_KEY, commit, if_equal=generation)
            if new_generation is None:
                raise TrajectoryStoreError(f"another writer created {self.url} at the same time")
            generation = new_generation
        else:
            _check_commit(commit, self.url)
            if commit["searcher_id"] != self.searcher_id:
                raise TrajectoryStoreError(
                    f"{self.url} belongs to searcher {commit['searcher_id']}, not {self.searcher_id}"
                )
            self._arrays = _open_arrays(self.url, create=False)
        self._commit = commit
        self._generation = generation

    def committed_rows(self) -> int:
        return int(self._commit["rows"])

    def append(self, trajectories: Sequence[Trajectory]) -> int:
        """Write and commit `trajectories`; returns the committed row count after this call."""
        if not trajectories:
            return self.committed_rows()
        data = self._write_data(trajectories)
        return self._commit_rows(data)

    def _write_data(self, trajectories: Sequence[Trajectory]) -> dict[str, np.ndarray]:
        """Step 1 of an append: write everything past the committed extents, durably."""
        c = self._commit
        data = _encode(trajectories, c, self.searcher_id)
        _, generation = read_json(self._kv, COMMIT_KEY)
        if generation != self._generation:
            raise self._shared_store_error()
        starts = {
            "rows_i64": c["rows"],
            "rows_f64": c["rows"],
            "prompt_tokens": c["prompt_tokens"],
            "response_tokens": c["response_tokens"],
            "behavior_logprobs": c["response_tokens"],
            "reference_logprobs": c["response_tokens"],
        }
        futures = []
        for name, values in data.items():
            if len(values):
                start = starts[name]
                futures.append(self._arrays[name][start : start + len(values)].write(values))
        for f in futures:
            f.result()
        return data

    def _commit_rows(self, data: dict[str, np.ndarray]) -> int:
        """Step 2: publish the new extents in one atomic write of the commit record."""
        c = self._commit
        commit = dict(
            c,
            rows=c["rows"] + len(data["rows_i64"]),
            prompt_tokens=c["prompt_tokens"] + len(data["prompt_tokens"]),
            response_tokens=c["response_tokens"] + len(data["response_tokens"]),
        )
        generation = write_json(self._kv, COMMIT_KEY, commit, if_equal=self._generation)
        if generation is None:
            raise self._shared_store_error()
        self._commit, self._generation = commit, generation
        return int(commit["rows"])

    def _shared_store_error(self) -> TrajectoryStoreError:
        return TrajectoryStoreError(
            f"the commit record of {self.url} changed under this writer: another writer is appending "
            "to the same store (one writer per store; give each searcher its own searcher id)"
        )


class TrajectoryReader:
    """Tails one store: `read_new` returns the rows committed since the previous call.

    `cursor` (the next row to read) is what a trainer checkpoints; resume with
    ``TrajectoryReader(url, start_row=cursor)``.
    """

    def __init__(self, url: str | os.PathLike[str], start_row: int = 0):
        if start_row < 0:
            raise ValueError(f"start_row must be >= 0, got {start_row}")
        self.url = to_url(url)
        self._kv = open_kvstore(self.url)
        self._cursor = int(start_row)
        self._arrays: dict[str, ts.TensorStore] | None = None
        self._store_id: str | None = None

    @property
    def cursor(self) -> int:
        return self._cursor

    def _read_commit(self) -> dict[str, Any] | None:
        commit, _ = read_json(self._kv, COMMIT_KEY)
        if commit is None:
            return None
        _check_commit(commit, self.url)
        if self._store_id is None:
            self._store_id = commit["store_id"]
        elif commit["store_id"] != self._store_id:
            raise TrajectoryStoreError(
                f"{self.url} was deleted and re-created while this reader was tailing it; "
                "its row numbers no longer match this reader's cursor"
            )
        return commit

    def committed_rows(self) -> int:
        commit = self._read_commit()
        return 0 if commit is None else int(commit["rows"])

    def read_new(self, max_rows: int | None = None) -> list[Trajectory]:
        """Rows committed since the last call (at most `max_rows`); [] when there are none."""
        rows = self.committed_rows()
        if self._cursor > rows:
            raise TrajectoryStoreError(
                f"reader cursor {self._cursor} is past the {rows} committed rows of {self.url}: "
                "the store was truncated or replaced, or start_row came from another run"
            )
        stop = rows if max_rows is None else min(rows, self._cursor + max_rows)
        if stop == self._cursor:
            return []
        out = self._read_range(self._cursor, stop)
        self._cursor = stop
        return out

    def read(self, start: int, stop: int) -> list[Trajectory]:
        """Committed rows [start, stop) without moving the cursor."""
        rows = self.committed_rows()
        if not 0 <= start <= stop <= rows:
            raise IndexError(f"rows [{start}, {stop}) are outside the {rows} committed rows of {self.url}")
        return self._read_range(start, stop) if stop > start else []

    def _read_range(self, start: int, stop: int) -> list[Trajectory]:
        if self._arrays is None:
            self._arrays = _open_arrays(self.url, create=False)
        a = self._arrays
        i64_f, f64_f = a["rows_i64"][start:stop].read(), a["rows_f64"][start:stop].read()
        i64, f64 = i64_f.result(), f64_f.result()
        plen, rlen = i64[:, _I["prompt_len"]], i64[:, _I["response_len"]]
        pstart, rstart = i64[:, _I["prompt_start"]], i64[:, _I["response_start"]]
        # Rows of a store are contiguous in the flat arrays; anything else means corruption.
        if not (np.array_equal(pstart[1:], (pstart + plen)[:-1]) and np.array_equal(rstart[1:], (rstart + rlen)[:-1])):
            raise TrajectoryStoreError(f"rows [{start}, {stop}) of {self.url} have inconsistent offsets")
        p0, p1 = int(pstart[0]), int(pstart[-1] + plen[-1])
        r0, r1 = int(rstart[0]), int(rstart[-1] + rlen[-1])
        names = ["prompt_tokens", "response_tokens", "behavior_logprobs"]
        if np.any(i64[:, _I["flags"]] & FLAG_HAS_REFERENCE):
            names.append("reference_logprobs")
        spans = {"prompt_tokens": (p0, p1)}
        futures = {n: a[n][slice(*spans.get(n, (r0, r1)))].read() for n in names}
        flat = {n: np.asarray(f.result()) for n, f in futures.items()}
        return _decode(i64, f64, flat, p0, r0)


def discover_searcher_stores(run_url: str | os.PathLike[str]) -> dict[int, str]:
    """{searcher id: store URL} for every store under ``<run>/trajectories/`` with a commit record."""
    kv = open_kvstore(join_url(to_url(run_url), TRAJECTORIES_DIR))
    found = {}
    for key in list_keys(kv, "searcher-"):
        m = _SEARCHER_DIR.match(key)
        if m:
            found[int(m.group(1))] = join_url(to_url(run_url), TRAJECTORIES_DIR, f"searcher-{m.group(1)}")
    return dict(sorted(found.items()))
