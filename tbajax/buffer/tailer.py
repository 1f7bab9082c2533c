"""Feed new rows from the per-searcher trajectory stores into a buffer.

The tailer only needs a store reader that reports how many rows are committed and reads a
range of them (`TrajectorySource`; `tbajax.stores.trajectories.TrajectoryReader` is one). Cursors are not checkpointed: after a restart a fresh
tailer re-reads every store from row 0 into a fresh buffer, which rebuilds the same state
(see `tbajax.buffer.replay`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tbajax.buffer.replay import ReplayBuffer
from tbajax.trajectory import Trajectory


class TrajectorySource(Protocol):
    """A read-only view of one append-only trajectory store."""

    def committed_rows(self) -> int:
        """Rows committed so far (re-opening the store if needed to see new ones)."""
        ...

    def read(self, start: int, stop: int) -> Sequence[Trajectory]:
        """Rows [start, stop), all committed; may return fewer only if it returns at least one."""
        ...


class Tailer:
    """Reads each source from its cursor to its committed end, in a fixed source order."""

    def __init__(self, sources: Sequence[TrajectorySource] = (), chunk_rows: int = 4096) -> None:
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
        self._sources: list[TrajectorySource] = list(sources)
        self._cursors: list[int] = [0] * len(self._sources)
        self.chunk_rows = chunk_rows

    def add_source(self, source: TrajectorySource) -> None:
        """A new searcher store appeared; it is read from row 0."""
        self._sources.append(source)
        self._cursors.append(0)

    @property
    def cursors(self) -> tuple[int, ...]:
        return tuple(self._cursors)

    def poll(self, buffer: ReplayBuffer, max_rows: int | None = None) -> int:
        """Add every committed row not yet read (at most `max_rows`); returns how many were read."""
        total = 0
        for i, source in enumerate(self._sources):
            end = int(source.committed_rows())
            if end < self._cursors[i]:
                raise RuntimeError(
                    f"source {i} reports {end} rows but {self._cursors[i]} were already read: "
                    "trajectory stores must be append-only"
                )
            while self._cursors[i] < end:
                if max_rows is not None and total >= max_rows:
                    return total
                stop = min(end, self._cursors[i] + self.chunk_rows)
                if max_rows is not None:
                    stop = min(stop, self._cursors[i] + max_rows - total)
                rows = source.read(self._cursors[i], stop)
                n = len(rows)
                if not 0 < n <= stop - self._cursors[i]:
                    raise RuntimeError(
                        f"source {i} returned {n} rows for range [{self._cursors[i]}, {stop})"
                    )
                buffer.add(rows)
                self._cursors[i] += n
                total += n
        return total
