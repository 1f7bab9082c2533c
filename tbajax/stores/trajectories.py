"""The `Trajectory` codec over the jagged column store: one store per searcher (its only writer),
any number of tailing readers.

Layout of one store (``<run>/trajectories/searcher-<i>/``), see `tbajax.stores.jagged` for the
commit protocol and writer fencing:

    commit.json          {"format", "store_id", "searcher_id", "writer_epoch", "rows", "prompt_tokens",
                          "response_tokens"}
    rows_i64/            int64 [rows, 10]: ids, offsets into the flat arrays, lengths, status, flags
    rows_f64/            float64 [rows, 2]: reward, wall time
    prompt_tokens/       int32 [sum of prompt lengths]        (jagged: concatenated, no padding)
    response_tokens/     int32 [sum of response lengths]
    behavior_logprobs/   float32, aligned with response_tokens
    reference_logprobs/  float32, aligned with response_tokens (read only for rows flagged has-ref)
    rows_extras/         int64 [rows, 2]: start, length of the row's extras in `extras`
    extras/              uint8 [sum of extras lengths]: each row's scorer extras as UTF-8 JSON
    token_versions/      int32, aligned with response_tokens: the param version of each token
                         (read only for rows flagged mixed-versions; a row from one version
                         has every token at its policy_version and stores nothing here)

Format versions: v3 (written) adds `token_versions`; v2 stores (no such column) still load, every
token at its row's policy_version, and a re-opened v2 store takes more single-version rows (a
row whose tokens span versions cannot be written to it: start a new run directory).
"""

from __future__ import annotations

import os
import re
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tbajax.stores.jagged import COMMIT_KEY, Column, JaggedReader, JaggedWriter, Layout, StoreError
from tbajax.stores.urls import TRAJECTORIES_DIR, join_url, list_keys, open_kvstore, to_url
from tbajax.trajectory import RewardStatus, Trajectory

FORMAT = "tbajax.trajectories.v3"  # v2: scorer extras per row; v3: per-token param versions
FORMAT_V2 = "tbajax.trajectories.v2"
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
FLAG_MIXED_VERSIONS = 4  # the row's tokens come from several param versions (see token_versions/)

LAYOUT_V2 = Layout(
    FORMAT_V2,
    {
        "rows_i64": Column("int64", (len(I64_COLUMNS),), (ROW_CHUNK, len(I64_COLUMNS)), 0, "rows"),
        "rows_f64": Column("float64", (len(F64_COLUMNS),), (ROW_CHUNK, len(F64_COLUMNS)), 0.0, "rows"),
        "prompt_tokens": Column("int32", (), (FLAT_CHUNK,), 0, "prompt_tokens"),
        "response_tokens": Column("int32", (), (FLAT_CHUNK,), 0, "response_tokens"),
        "behavior_logprobs": Column("float32", (), (FLAT_CHUNK,), 0.0, "response_tokens"),
        "reference_logprobs": Column("float32", (), (FLAT_CHUNK,), "NaN", "response_tokens"),
        "rows_extras": Column("int64", (2,), (ROW_CHUNK, 2), 0, "rows"),
        "extras": Column("uint8", (), (FLAT_CHUNK,), 0, "extras_bytes"),
    },
)
LAYOUT = Layout(
    FORMAT,
    {**LAYOUT_V2.columns, "token_versions": Column("int32", (), (FLAT_CHUNK,), 0, "response_tokens")},
)
LAYOUTS = (LAYOUT, LAYOUT_V2)  # newest first: new stores are v3, v2 stores are read as they are

_SEARCHER_DIR = re.compile(r"^searcher-(\d+)/" + re.escape(COMMIT_KEY) + "$")

TrajectoryStoreError = StoreError  # the store on disk is not what this reader/writer expects


_INT32 = np.iinfo(np.int32)


def _as_int32(x: Any, what: str, index: int) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise ValueError(f"trajectory {index}: {what} must be a 1-D integer array, got {a.dtype}{list(a.shape)}")
    if a.dtype == np.int32:  # what the sampler gives: nothing to range-check
        return a
    if a.size and (a.min() < _INT32.min or a.max() > _INT32.max):
        raise ValueError(f"trajectory {index}: {what} has values outside int32")
    return a.astype(np.int32, copy=False)


def _as_float32(x: Any, what: str, index: int) -> np.ndarray:
    a = np.asarray(x, dtype=np.float32)
    if a.ndim != 1:
        raise ValueError(f"trajectory {index}: {what} must be 1-D, got shape {list(a.shape)}")
    return a


def _encode(
    trajs: Sequence[Trajectory], commit: Mapping[str, int], searcher_id: int, layout: Layout = LAYOUT
) -> dict[str, np.ndarray]:
    """Row tables and flat arrays for one append, offsets continuing after the committed extents."""
    n = len(trajs)
    prompts, responses, behavior, reference, extras, versions = [], [], [], [], [], []
    i64 = np.zeros((n, len(I64_COLUMNS)), np.int64)
    extras_index = np.zeros((n, 2), np.int64)
    f64 = np.zeros((n, len(F64_COLUMNS)), np.float64)
    for i, t in enumerate(trajs):
        if not isinstance(t, Trajectory):
            raise TypeError(f"trajectory {i}: expected tbajax.trajectory.Trajectory, got {type(t).__name__}")
    any_ref = any(t.reference_logprobs is not None for t in trajs)
    any_mixed = any(t.mixed_versions for t in trajs)
    if any_mixed and "token_versions" not in layout.columns:
        i = next(i for i, t in enumerate(trajs) if t.mixed_versions)
        raise ValueError(
            f"trajectory {i} has tokens from several param versions, but this store is format "
            f"{layout.format}, which has no per-token versions: write to a new run directory"
        )
    for i, t in enumerate(trajs):
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
        if any_mixed:
            versions.append(_as_int32(t.token_versions, "token_versions", i))
        flags = (
            (FLAG_FINISHED if t.finished else 0)
            | (FLAG_HAS_REFERENCE if t.reference_logprobs is not None else 0)
            | (FLAG_MIXED_VERSIONS if t.mixed_versions else 0)
        )
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
        blob = _encode_extras(t.extras, i)
        extras.append(blob)
        extras_index[i, 1] = len(blob)
    extras_index[:, 0] = commit["extras_bytes"] + np.concatenate([[0], np.cumsum(extras_index[:, 1])[:-1]])
    plen, rlen = i64[:, _I["prompt_len"]], i64[:, _I["response_len"]]
    i64[:, _I["prompt_start"]] = commit["prompt_tokens"] + np.concatenate([[0], np.cumsum(plen)[:-1]])
    i64[:, _I["response_start"]] = commit["response_tokens"] + np.concatenate([[0], np.cumsum(rlen)[:-1]])
    out = {
        "rows_i64": i64,
        "rows_f64": f64,
        "prompt_tokens": np.concatenate(prompts),
        "response_tokens": np.concatenate(responses),
        "behavior_logprobs": np.concatenate(behavior),
        "rows_extras": extras_index,
    }
    if any_ref:
        out["reference_logprobs"] = np.concatenate(reference)
    if any_mixed:
        out["token_versions"] = np.concatenate(versions)
    if extras_index[:, 1].any():
        out["extras"] = np.frombuffer(b"".join(extras), np.uint8)
    return out


def _encode_extras(extras: Mapping[str, Any] | None, index: int) -> bytes:
    if not extras:
        return b""
    try:
        return json.dumps(extras, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()
    except (TypeError, ValueError) as e:
        raise ValueError(f"trajectory {index}: extras must be JSON-serialisable ({e})") from None


def _decode(
    i64: np.ndarray,
    f64: np.ndarray,
    flat: dict[str, np.ndarray],
    p0: int,
    r0: int,
    extras_index: np.ndarray,
) -> list[Trajectory]:
    """Rows from one read; each row's arrays are copies, so a row kept in a buffer does not pin
    the whole read block (up to thousands of rows) in memory."""
    out = []
    e0 = int(extras_index[0, 0]) if len(extras_index) else 0
    for row, frow, (es, el) in zip(i64, f64, extras_index):
        ps, pl = int(row[_I["prompt_start"]]) - p0, int(row[_I["prompt_len"]])
        rs, rl = int(row[_I["response_start"]]) - r0, int(row[_I["response_len"]])
        flags = int(row[_I["flags"]])
        out.append(
            Trajectory(
                prompt_id=int(row[_I["prompt_id"]]),
                group_id=int(row[_I["group_id"]]),
                prompt_tokens=flat["prompt_tokens"][ps : ps + pl].copy(),
                response_tokens=flat["response_tokens"][rs : rs + rl].copy(),
                behavior_logprobs=flat["behavior_logprobs"][rs : rs + rl].copy(),
                reward=float(frow[_F["reward"]]),
                reward_status=RewardStatus(int(row[_I["reward_status"]])),
                finished=bool(flags & FLAG_FINISHED),
                policy_version=int(row[_I["policy_version"]]),
                searcher_id=int(row[_I["searcher_id"]]),
                wall_time=float(frow[_F["wall_time"]]),
                reference_logprobs=(
                    flat["reference_logprobs"][rs : rs + rl].copy() if flags & FLAG_HAS_REFERENCE else None
                ),
                extras=json.loads(flat["extras"][es - e0 : es - e0 + el].tobytes()) if el else None,
                token_versions=(  # None: every token at policy_version (also every v2 row)
                    flat["token_versions"][rs : rs + rl].copy() if flags & FLAG_MIXED_VERSIONS else None
                ),
            )
        )
    return out


class TrajectoryWriter:
    """The single writer of one searcher's store; each `append` is one atomic commit.

    Re-opening after a crash continues after the last committed row (uncommitted data is simply
    overwritten) and takes a new writer epoch, so a stale writer of the same store (a zombie
    searcher) fails on its next append before writing anything (see `tbajax.stores.jagged`).
    """

    def __init__(self, url: str | os.PathLike[str], searcher_id: int):
        self.url = to_url(url)
        self.searcher_id = int(searcher_id)
        self._store = JaggedWriter(self.url, LAYOUTS, {"searcher_id": self.searcher_id})

    @property
    def epoch(self) -> int:
        return self._store.epoch

    def committed_rows(self) -> int:
        return self._store.extents["rows"]

    def append(self, trajectories: Sequence[Trajectory]) -> int:
        """Write and commit `trajectories`; returns the committed row count after this call."""
        if not trajectories:
            return self.committed_rows()
        grow = self._write_data(trajectories)
        return self._store.commit(grow)["rows"]

    def _write_data(self, trajectories: Sequence[Trajectory]) -> dict[str, int]:
        """Step 1 of an append (tests call it alone to leave uncommitted data behind)."""
        return self._store.write_data(
            _encode(trajectories, self._store.extents, self.searcher_id, self._store.layout)
        )


class TrajectoryReader:
    """Tails one store: `read_new` returns the rows committed since the previous call.

    `cursor` is the next row `read_new` returns; start another reader there with
    ``TrajectoryReader(url, start_row=cursor)``. (The trainer does not checkpoint it: on resume
    it re-reads every store from row 0 and the buffer state drops the groups already consumed.)
    Reads format v3 and v2 stores (see the module docstring).
    """

    def __init__(self, url: str | os.PathLike[str], start_row: int = 0):
        if start_row < 0:
            raise ValueError(f"start_row must be >= 0, got {start_row}")
        self.url = to_url(url)
        self._store = JaggedReader(self.url, LAYOUTS)
        self._cursor = int(start_row)

    @property
    def cursor(self) -> int:
        return self._cursor

    def committed_rows(self) -> int:
        commit = self._store.read_commit()
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
        tables = self._store.read({"rows_i64": (start, stop), "rows_f64": (start, stop),
                                   "rows_extras": (start, stop)})
        i64, f64, ext = tables["rows_i64"], tables["rows_f64"], tables["rows_extras"]
        plen, rlen = i64[:, _I["prompt_len"]], i64[:, _I["response_len"]]
        pstart, rstart = i64[:, _I["prompt_start"]], i64[:, _I["response_start"]]
        # Rows of a store are contiguous in the flat arrays; anything else means corruption.
        if not (np.array_equal(pstart[1:], (pstart + plen)[:-1]) and np.array_equal(rstart[1:], (rstart + rlen)[:-1])):
            raise TrajectoryStoreError(f"rows [{start}, {stop}) of {self.url} have inconsistent offsets")
        p0, p1 = int(pstart[0]), int(pstart[-1] + plen[-1])
        r0, r1 = int(rstart[0]), int(rstart[-1] + rlen[-1])
        spans = {"prompt_tokens": (p0, p1), "response_tokens": (r0, r1), "behavior_logprobs": (r0, r1)}
        if np.any(i64[:, _I["flags"]] & FLAG_HAS_REFERENCE):
            spans["reference_logprobs"] = (r0, r1)
        if np.any(i64[:, _I["flags"]] & FLAG_MIXED_VERSIONS):
            if "token_versions" not in self._store.layout.columns:
                raise TrajectoryStoreError(
                    f"rows [{start}, {stop}) of {self.url} are flagged mixed-versions but the store is "
                    f"format {self._store.layout.format}, which has no token_versions column: corrupt store"
                )
            spans["token_versions"] = (r0, r1)
        if ext[:, 1].any():
            if not np.array_equal(ext[1:, 0], (ext[:, 0] + ext[:, 1])[:-1]):
                raise TrajectoryStoreError(f"rows [{start}, {stop}) of {self.url} have inconsistent extras offsets")
            spans["extras"] = (int(ext[0, 0]), int(ext[-1, 0] + ext[-1, 1]))
        return _decode(i64, f64, self._store.read(spans), p0, r0, ext)


def discover_searcher_stores(run_url: str | os.PathLike[str]) -> dict[int, str]:
    """{searcher id: store URL} for every store under ``<run>/trajectories/`` with a commit record."""
    kv = open_kvstore(join_url(to_url(run_url), TRAJECTORIES_DIR))
    found = {}
    for key in list_keys(kv, "searcher-"):
        m = _SEARCHER_DIR.match(key)
        if m:
            found[int(m.group(1))] = join_url(to_url(run_url), TRAJECTORIES_DIR, f"searcher-{m.group(1)}")
    return dict(sorted(found.items()))
