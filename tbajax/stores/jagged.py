"""A generic append-only jagged column store: one fenced writer, any number of tailing readers.

A store is a set of zarr3 arrays (through tensorstore) plus one small commit record,
``commit.json``. Every array is indexed along its first axis by one of the record's *extents*
(counters such as ``rows`` or ``response_tokens``): row tables use ``rows``, jagged columns use
the total length of what they concatenate. The arrays have a fixed, huge shape (only written
chunks exist), so nothing is ever resized and a reader never needs new metadata.

Commit protocol (levanter's jagged store does the same): an append writes its data past the
committed extents, waits until it is durable, then replaces ``commit.json`` in one atomic
single-key write conditional on the record's storage generation. Readers read ``commit.json``
first and read nothing beyond its extents, so they never see a partial or zero-filled row. A
crash between the two steps leaves unreferenced data that the next append overwrites. A tail
chunk shared by committed and new rows is replaced as a whole (rename on file systems, object put
on buckets) and holds the same committed bytes, so committed rows never change under a reader.

Writer fencing: opening a writer takes a new *writer epoch* by rewriting the commit record
(conditionally, so two writers opening at once cannot both win). Every append first checks that
the record is still the one this writer last wrote, so a stale (zombie) writer's next append
fails before it writes any data, and its commit could not land anyway. What no kvstore can fence
is a zombie that had already passed that check when its replacement opened (a writer paused for
seconds between the check and its data write); that is why a supervisor must kill a writer's
whole process before starting its replacement, which SIGKILL does.

Format versions: a reader or writer takes the layouts it understands, newest first. A new store
is created in the newest; an existing one is read (and appended to) in the layout its commit
record names, so stores written by an older format version stay readable after a column is added.

This module knows nothing about what the columns mean; ``tbajax.stores.trajectories`` is the
codec that maps `Trajectory` rows onto it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from tbajax.stores.urls import join_url, open_kvstore, read_json, to_url, write_json

log = logging.getLogger(__name__)

COMMIT_KEY = "commit.json"
CAPACITY = 2**40  # rows or flat elements; chunks that were never written take no space
FAULT_PAUSE_ENV = "TBAJAX_FAULT_PAUSE_BEFORE_COMMIT_S"


class StoreError(RuntimeError):
    """The store on disk is not what this reader/writer expects (corrupt, replaced, shared, fenced)."""


@dataclasses.dataclass(frozen=True)
class Column:
    """One array: its dtype, per-element trailing shape, chunk shape, fill value, and the extent
    (commit-record counter) that indexes its first axis."""

    dtype: str
    trailing: tuple[int, ...]
    chunk: tuple[int, ...]
    fill: Any
    extent: str


@dataclasses.dataclass(frozen=True)
class Layout:
    """The columns of one store format; `format` is written into, and checked against, the commit."""

    format: str
    columns: Mapping[str, Column]

    @property
    def extents(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(c.extent for c in self.columns.values()))


def open_arrays(url: str, layout: Layout, create: bool) -> dict[str, ts.TensorStore]:
    # No chunk cache: every read goes to storage, so a long-lived handle sees new commits.
    context = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
    futures = {}
    for name, col in layout.columns.items():
        spec: dict[str, Any] = {
            "driver": "zarr3",
            "kvstore": to_url(join_url(url, name)) + "/",
            "recheck_cached_data": True,
            "recheck_cached_metadata": "open",
        }
        if create:
            spec["metadata"] = {
                "shape": [CAPACITY, *col.trailing],
                "data_type": col.dtype,
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(col.chunk)}},
                "fill_value": col.fill,
            }
        futures[name] = ts.open(spec, create=create, open=True, context=context)
    arrays = {}
    for name, fut in futures.items():
        try:
            arrays[name] = fut.result()
        except ValueError as e:
            raise StoreError(f"cannot open array {name!r} of store {url}: {e}") from e
        col = layout.columns[name]
        if arrays[name].dtype.name != col.dtype or tuple(arrays[name].shape[1:]) != col.trailing:
            raise StoreError(
                f"array {name!r} of {url} has dtype {arrays[name].dtype.name} shape {arrays[name].shape}; "
                f"expected {col.dtype} [*, {col.trailing}]: written by another format version?"
            )
    return arrays


Layouts = Layout | Sequence[Layout]


def _as_layouts(layouts: Layouts) -> tuple[Layout, ...]:
    out = (layouts,) if isinstance(layouts, Layout) else tuple(layouts)
    if not out:
        raise ValueError("need at least one store layout")
    return out


def layout_of(commit: Mapping[str, Any], url: str, layouts: Layouts) -> Layout:
    """The layout among `layouts` that the commit record's format names."""
    known = _as_layouts(layouts)
    for layout in known:
        if commit.get("format") == layout.format:
            return layout
    raise StoreError(
        f"{url}/{COMMIT_KEY} has format {commit.get('format')!r}, this code reads "
        + " or ".join(repr(x.format) for x in known)
    )


def check_commit(commit: dict[str, Any], url: str, layout: Layout) -> dict[str, Any]:
    layout = layout_of(commit, url, layout)
    for key in layout.extents:
        if not isinstance(commit.get(key), int) or commit[key] < 0:
            raise StoreError(f"{url}/{COMMIT_KEY} has a bad {key!r}: {commit.get(key)!r}")
    return commit


def _grown_extents(layout: Layout, data: Mapping[str, np.ndarray]) -> dict[str, int]:
    """How much each extent grows: the columns sharing an extent must bring equally many elements."""
    grow: dict[str, int] = {}
    for name, values in data.items():
        if name not in layout.columns:
            raise KeyError(f"no column {name!r} in store format {layout.format} (have {sorted(layout.columns)})")
        extent = layout.columns[name].extent
        if grow.setdefault(extent, len(values)) != len(values):
            raise ValueError(
                f"columns on extent {extent!r} have different lengths ({grow[extent]} vs {len(values)} for {name!r})"
            )
    return grow


class JaggedWriter:
    """The single writer of one store; each `append` is one atomic commit.

    `header` holds fixed fields of the commit record (e.g. the owning searcher); re-opening a
    store with a different header is refused before anything is written. `layouts`: one layout,
    or several known format versions newest first; a new store gets the newest, an existing one
    keeps its own (`self.layout`). Re-opening after a crash continues after the last committed
    element (uncommitted data is simply overwritten) and fences off any older writer still
    holding the store (see the module docstring).
    """

    def __init__(self, url: str | os.PathLike[str], layouts: Layouts, header: Mapping[str, Any] | None = None):
        self.url = to_url(url)
        header = dict(header or {})
        self._kv = open_kvstore(self.url)
        commit, generation = read_json(self._kv, COMMIT_KEY)
        layout = _as_layouts(layouts)[0] if commit is None else layout_of(commit, self.url, layouts)
        self.layout = layout
        if commit is None:
            self._arrays = open_arrays(self.url, layout, create=True)
            commit = {"format": layout.format, "store_id": uuid.uuid4().hex, **header,
                      **{e: 0 for e in layout.extents}, "writer_epoch": 1}
            what = "created"
        else:
            check_commit(commit, self.url, layout)
            for key, value in header.items():
                if commit.get(key) != value:
                    raise StoreError(f"{self.url} belongs to {key} {commit.get(key)!r}, not {value!r}")
            self._arrays = open_arrays(self.url, layout, create=False)
            commit = dict(commit, writer_epoch=int(commit.get("writer_epoch", 0)) + 1)
            what = "re-opened"
        new_generation = write_json(self._kv, COMMIT_KEY, commit, if_equal=generation)
        if new_generation is None:
            raise StoreError(f"another writer {what} {self.url} at the same time (one writer per store)")
        self._commit, self._generation = commit, new_generation

    @property
    def epoch(self) -> int:
        return int(self._commit["writer_epoch"])

    @property
    def extents(self) -> dict[str, int]:
        """The committed extents: where the next append's data starts in each indexed array."""
        return {e: int(self._commit[e]) for e in self.layout.extents}

    def append(self, data: Mapping[str, np.ndarray]) -> dict[str, int]:
        """Write `data` (column -> new elements) past the committed extents, then commit it.

        Returns the committed extents after this call."""
        grow = self.write_data(data)
        return self.commit(grow)

    def write_data(self, data: Mapping[str, np.ndarray]) -> dict[str, int]:
        """Step 1 of an append: check the fence, then write everything past the committed extents,
        durably. Returns how much each extent grows (the argument of `commit`)."""
        grow = _grown_extents(self.layout, data)
        self.check_fence()
        futures = []
        for name, values in data.items():
            if len(values):
                start = self._commit[self.layout.columns[name].extent]
                futures.append(self._arrays[name][start : start + len(values)].write(values))
        for f in futures:
            f.result()
        _fault_pause(self.url, self._commit, grow)
        return grow

    def commit(self, grow: Mapping[str, int]) -> dict[str, int]:
        """Step 2: publish the new extents in one atomic, conditional write of the commit record."""
        commit = dict(self._commit, **{e: self._commit[e] + int(grow.get(e, 0)) for e in self.layout.extents})
        generation = write_json(self._kv, COMMIT_KEY, commit, if_equal=self._generation)
        if generation is None:
            raise self._fenced_error()
        self._commit, self._generation = commit, generation
        return self.extents

    def check_fence(self) -> None:
        """Raise unless the commit record is still the one this writer last wrote."""
        _, generation = read_json(self._kv, COMMIT_KEY)
        if generation != self._generation:
            raise self._fenced_error()

    def _fenced_error(self) -> StoreError:
        current, _ = read_json(self._kv, COMMIT_KEY)
        epoch = None if current is None else current.get("writer_epoch")
        return StoreError(
            f"the commit record of {self.url} changed under this writer (epoch {self.epoch}, store now at "
            f"epoch {epoch}): another writer opened or is appending to the same store, so this one is "
            "fenced off and wrote nothing (one writer per store; give each searcher its own searcher id)"
        )


class JaggedReader:
    """Reads committed elements of one store; never reads past the commit record's extents.

    `layouts`: the known format versions; `layout` is the store's own once its commit record
    was read (None before)."""

    def __init__(self, url: str | os.PathLike[str], layouts: Layouts):
        self.url = to_url(url)
        self._layouts = _as_layouts(layouts)
        self.layout: Layout | None = None
        self._kv = open_kvstore(self.url)
        self._arrays: dict[str, ts.TensorStore] | None = None
        self._store_id: str | None = None

    def read_commit(self) -> dict[str, Any] | None:
        """The commit record (None before the first writer opened the store)."""
        commit, _ = read_json(self._kv, COMMIT_KEY)
        if commit is None:
            return None
        layout = layout_of(commit, self.url, self._layouts)
        check_commit(commit, self.url, layout)
        if self.layout is None:
            self.layout = layout
        elif layout is not self.layout:
            raise StoreError(f"{self.url} changed format under this reader ({self.layout.format} -> {layout.format})")
        if self._store_id is None:
            self._store_id = commit["store_id"]
        elif commit["store_id"] != self._store_id:
            raise StoreError(
                f"{self.url} was deleted and re-created while this reader was reading it; "
                "its row numbers no longer match what was read before"
            )
        return commit

    def read(self, spans: Mapping[str, tuple[int, int]]) -> dict[str, np.ndarray]:
        """{column: elements [start, stop)} for each requested span, read concurrently. The caller
        keeps spans inside the committed extents (this does not re-read the commit record)."""
        if self.layout is None and self.read_commit() is None:
            raise StoreError(f"{self.url} has no commit record yet: nothing to read")
        if self._arrays is None:
            assert self.layout is not None
            self._arrays = open_arrays(self.url, self.layout, create=False)
        futures = {n: self._arrays[n][a:b].read() for n, (a, b) in spans.items()}
        return {n: np.asarray(f.result()) for n, f in futures.items()}


def _fault_pause(url: str, commit: Mapping[str, Any], grow: Mapping[str, int]) -> None:
    """Fault injection for crash tests: with TBAJAX_FAULT_PAUSE_BEFORE_COMMIT_S set, sleep between
    an append's (durable) data write and its commit, so a test can kill a writer right there."""
    pause = os.environ.get(FAULT_PAUSE_ENV)
    if not pause:
        return
    log.warning("fault hook: pid %d wrote data past committed rows %d (+%d) of %s; pausing %s s before the commit",
                os.getpid(), commit.get("rows", -1), grow.get("rows", 0), url, pause)
    for h in logging.getLogger().handlers:
        h.flush()
    time.sleep(float(pause))
