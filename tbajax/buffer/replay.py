"""The trainer-side trajectory buffers: thin stateful shells around the pure policies.

Two data structures (a third, the red-teaming `HeapReplayBuffer`, is in `heap_buffer`) behind one small protocol (`TrajectoryBuffer`): `ReplayBuffer`, TBA's
per-prompt replay (dedup, capacity, recency and reward branches), and `GroupQueue`, whole
generation groups consumed once, oldest first (TBA′, async GRPO, the sync mode).
`make_buffer(config)` picks by `config.mode`. What they share (ingestion checks, arrival order,
sync and current versions, counters, the saved state's format) lives in `_BufferBase`.

Determinism on rebuild: every row gets an order key (policy_version, wall_time, searcher_id,
per-searcher arrival index). Rows of one searcher arrive in store order, so the key does not
depend on how the tailer interleaves searchers, and neither does anything derived from it:
which copy dedup keeps, which rows capacity evicts, the row order within a prompt, the recent
set. Re-adding all rows from the stores after a restart therefore rebuilds the same buffer;
only `state_dict()` (sync versions, current version, consumed fifo groups) must be saved.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from typing import Any, Protocol

import numpy as np

from tbajax.buffer.config import BufferConfig, BufferEmptyError
from tbajax.buffer.policies import (
    choose_branch,
    draw_group,
    recent_min_version,
    reward_logits,
    stale_log_weights,
    take_newest,
)
from tbajax.trajectory import RewardStatus, Trajectory

OrderKey = tuple[int, float, int, int]  # (policy_version, wall_time, searcher_id, arrival index)
GroupKey = tuple[int, int, int]  # (prompt_id, searcher_id, group_id)

_FAILED = (RewardStatus.TIMEOUT, RewardStatus.ERROR)
_STATE_FORMAT = 1
_COUNTERS = (
    "rows_added",
    "dedup_drops",
    "evictions",
    "stale_drops",
    "failed_grade_drops",
    "late_rows_dropped",
    "groups_recency",
    "groups_reward",
    "recency_fallbacks",
    "groups_consumed",
    "stale_groups_dropped",
)


class _PromptRows:
    """Unique responses of one prompt; a lazy-deletion min-heap finds the oldest quickly."""

    __slots__ = ("heap", "max_version", "rows")

    def __init__(self) -> None:
        self.rows: dict[bytes | tuple[bytes, OrderKey], tuple[OrderKey, Trajectory]] = {}
        self.heap: list[tuple[OrderKey, bytes]] = []
        self.max_version = -(2**62)

    def put(self, rkey: bytes, key: OrderKey, traj: Trajectory) -> None:
        self.rows[rkey] = (key, traj)
        heapq.heappush(self.heap, (key, rkey))
        self.max_version = max(self.max_version, key[0])
        if len(self.heap) > 2 * len(self.rows) + 32:  # drop entries of replaced copies
            self.heap = [(k, r) for r, (k, _) in self.rows.items()]
            heapq.heapify(self.heap)

    def oldest(self) -> tuple[OrderKey, bytes] | None:
        heap, rows = self.heap, self.rows
        while heap:
            key, rkey = heap[0]
            live = rows.get(rkey)
            if live is not None and live[0] == key:
                return key, rkey
            heapq.heappop(heap)
        return None

    def pop_oldest(self) -> Trajectory:
        entry = self.oldest()
        assert entry is not None
        heapq.heappop(self.heap)
        return self.rows.pop(entry[1])[1]

    def ordered(self) -> list[tuple[OrderKey, Trajectory]]:
        return sorted(self.rows.values(), key=lambda kv: kv[0])


class _Group:
    """Rows of one generation call (fifo_once mode), in arrival order."""

    __slots__ = ("key", "min_version", "rows")

    def __init__(self, key: OrderKey) -> None:
        self.key = key
        self.rows: list[Trajectory] = []
        self.min_version = key[0]


class TrajectoryBuffer(Protocol):
    """What the trainer process needs from a buffer (both `ReplayBuffer` and `GroupQueue`).

    Ingestion: `add(rows)` in any interleaving across searchers; `mark_sync(version)` when the
    trainer publishes params. Sampling: `sample(rng, num_groups, k, current_version)` returns
    `num_groups` groups of K rows, each from a single prompt; it raises BufferEmptyError
    (without touching `rng`) when it cannot. For draws that survive a restart, pass a generator
    derived from (seed, step), e.g. `np.random.default_rng((seed, step))`.
    """

    config: BufferConfig

    def add(self, rows: Iterable[Trajectory]) -> None: ...

    def mark_sync(self, version: int) -> None: ...

    def sample(
        self, rng: np.random.Generator, num_groups: int, k: int | None = None, current_version: int | None = None
    ) -> list[list[Trajectory]]: ...

    def __len__(self) -> int: ...

    def stats(self, current_version: int | None = None) -> dict[str, Any]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def make_buffer(config: BufferConfig) -> TrajectoryBuffer:
    """The buffer `config.mode` asks for: "replay" -> ReplayBuffer, "fifo_once" -> GroupQueue,
    "reward_heap" -> HeapReplayBuffer (red-teaming; `tbajax.buffer.heap_buffer`)."""
    if config.mode == "fifo_once":
        return GroupQueue(config)
    if config.mode == "reward_heap":
        from tbajax.buffer.heap_buffer import HeapReplayBuffer  # it builds on this module

        return HeapReplayBuffer(config)
    return ReplayBuffer(config)


class _BufferBase:
    """Shared by both buffers: row checks, the order key, versions, counters, saved state."""

    mode: str = ""

    def __init__(self, config: BufferConfig | None = None) -> None:
        self.config = config if config is not None else BufferConfig(mode=self.mode)  # type: ignore[arg-type]
        if self.config.mode != self.mode:
            raise ValueError(
                f"{type(self).__name__} is the {self.mode!r} buffer but the config has mode="
                f"{self.config.mode!r}; build buffers with tbajax.buffer.make_buffer(config)"
            )
        self._arrivals: dict[int, int] = {}  # searcher_id -> rows seen
        self._sync_versions: list[int] = []  # the last two, ascending
        self._current_version: int | None = None
        self._num_rows = 0
        self._version_sum = 0
        self._counts = dict.fromkeys(_COUNTERS, 0)

    # ------------------------------------------------------------------ ingestion

    def add(self, rows: Iterable[Trajectory]) -> None:
        """Ingest rows (any order across searchers; store order within each searcher)."""
        cfg = self.config
        counts = self._counts
        min_version = self._min_fresh_version()
        for t in rows:
            if not isinstance(t, Trajectory):
                raise TypeError(f"{type(self).__name__}.add expects Trajectory rows, got {type(t).__name__}")
            sid = int(t.searcher_id)
            arrival = self._arrivals.get(sid, 0)
            self._arrivals[sid] = arrival + 1
            counts["rows_added"] += 1
            if not cfg.keep_failed_grades and t.reward_status in _FAILED:
                counts["failed_grade_drops"] += 1
                continue
            if not math.isfinite(t.reward):
                raise ValueError(
                    f"non-finite reward {t.reward} (status {RewardStatus(t.reward_status).name}) "
                    f"for prompt {t.prompt_id}, group {t.group_id}, searcher {sid}: the grader "
                    "must report failures through reward_status, not NaN/inf rewards"
                )
            version = int(t.policy_version)
            if min_version is not None and version < min_version:
                counts["stale_drops"] += 1
                continue
            self._add_row(t, (version, float(t.wall_time), sid, arrival))

    def _add_row(self, t: Trajectory, key: OrderKey) -> None:
        raise NotImplementedError

    def _forget(self, t: Trajectory) -> None:
        self._num_rows -= 1
        self._version_sum -= int(t.policy_version)

    def mark_sync(self, version: int) -> None:
        """The trainer published params `version`: the recent set becomes rows >= the previous sync."""
        version = int(version)
        if self._sync_versions and version < self._sync_versions[-1]:
            raise ValueError(
                f"mark_sync({version}) after mark_sync({self._sync_versions[-1]}): sync versions "
                "must not decrease"
            )
        if not self._sync_versions or version > self._sync_versions[-1]:
            self._sync_versions = (self._sync_versions + [version])[-2:]
            self._on_sync()

    def _on_sync(self) -> None:
        pass

    # ------------------------------------------------------------------ versions, staleness

    def _min_fresh_version(self) -> int | None:
        """Rows older than this are dropped (None: no limit known yet)."""
        raise NotImplementedError

    def _drop_stale(self) -> None:
        raise NotImplementedError

    def _needs_current_version(self) -> str | None:
        """Why sample() needs current_version, or None when it does not."""
        raise NotImplementedError

    def _advance_version(self, current_version: int | None) -> None:
        if current_version is None:
            why = self._needs_current_version()
            if why is not None:
                raise ValueError(why)
            return
        current_version = int(current_version)
        if self._current_version is not None and current_version < self._current_version:
            raise ValueError(
                f"current_version went backwards ({self._current_version} -> {current_version}); "
                "stale rows may already have been dropped for the newer version"
            )
        changed = current_version != self._current_version
        self._current_version = current_version
        if changed:
            self._drop_stale()

    # ------------------------------------------------------------------ sampling

    def sample(
        self,
        rng: np.random.Generator,
        num_groups: int,
        k: int | None = None,
        current_version: int | None = None,
    ) -> list[list[Trajectory]]:
        """`num_groups` groups of `k` rows (default K from the config); a group never mixes prompts."""
        if not isinstance(rng, np.random.Generator):
            raise TypeError(
                f"rng must be a numpy Generator (e.g. np.random.default_rng((seed, step))), "
                f"got {type(rng).__name__}"
            )
        k = self.config.samples_per_group if k is None else int(k)
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self._advance_version(current_version)
        return self._sample(rng, num_groups, k)

    def _sample(self, rng: np.random.Generator, num_groups: int, k: int) -> list[list[Trajectory]]:
        raise NotImplementedError

    # ------------------------------------------------------------------ introspection, state

    def __len__(self) -> int:
        return self._num_rows

    def stats(self, current_version: int | None = None) -> dict[str, Any]:
        """Numbers for logging; NaN where undefined (empty buffer, unknown current version)."""
        cur = self._current_version if current_version is None else int(current_version)
        nan = float("nan")
        out: dict[str, Any] = dict(self._counts)
        n = self._num_rows
        mean_v = self._version_sum / n if n else nan
        versions, max_versions = self._layout_stats(out)
        out["num_rows"] = n
        out["mean_policy_version"] = mean_v
        out["min_policy_version"] = float(min(versions)) if versions else nan
        out["max_policy_version"] = float(max(max_versions)) if max_versions else nan
        out["mean_staleness"] = cur - mean_v if (cur is not None and n) else nan
        out["last_sync_version"] = float(self._sync_versions[-1]) if self._sync_versions else nan
        floor = recent_min_version(self._sync_versions)
        out["recent_min_version"] = nan if floor is None else float(floor)
        out["current_version"] = nan if cur is None else float(cur)
        return out

    def _layout_stats(self, out: dict[str, Any]) -> tuple[list[int], list[int]]:
        """Adds num_prompts (and the like) to `out`; returns (oldest versions, newest versions)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """The non-derivable state, JSON-able; rows themselves are rebuilt from the stores."""
        return {
            "format": _STATE_FORMAT,
            "mode": self.config.mode,
            "sync_versions": list(self._sync_versions),
            "current_version": self._current_version,
            "consumed": [],
            "recent_uses": [],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`; works before or after the rows are re-added."""
        if state.get("format") != _STATE_FORMAT:
            raise ValueError(f"unknown buffer state format {state.get('format')!r}")
        if state.get("mode") != self.config.mode:
            raise ValueError(
                f"buffer state was saved in mode {state.get('mode')!r}, this buffer is "
                f"{self.config.mode!r}"
            )
        self._sync_versions = [int(v) for v in state["sync_versions"]][-2:]
        self._load_extra(state)
        cur = state["current_version"]
        self._current_version = None if cur is None else int(cur)
        self._drop_stale()

    def _load_extra(self, state: dict[str, Any]) -> None:
        raise NotImplementedError


class ReplayBuffer(_BufferBase):
    """TBA's per-prompt replay buffer (`BufferConfig(mode="replay")`): unique responses per
    prompt up to a capacity; each group slot takes the recency branch (newest generation groups
    of a prompt with rows since the previous sync) with probability m, else the reward branch."""

    mode = "replay"

    def __init__(self, config: BufferConfig | None = None) -> None:
        super().__init__(config)
        self._prompts: dict[int, _PromptRows] = {}
        self._recent_uses: dict[GroupKey, tuple[int, int]] = {}  # group -> (uses, version)

    def _add_row(self, t: Trajectory, key: OrderKey) -> None:
        pid = int(t.prompt_id)
        pr = self._prompts.get(pid)
        if pr is None:
            pr = self._prompts[pid] = _PromptRows()
        # without dedup every row is its own entry (OrderKey is unique and rebuild-stable)
        rkey = t.response_key if self.config.dedup else (t.response_key, key)
        old = pr.rows.get(rkey)
        if old is not None:  # duplicate response: keep the newest copy
            self._counts["dedup_drops"] += 1
            if key > old[0]:
                self._version_sum += key[0] - old[0][0]
                pr.put(rkey, key, t)
            return
        if len(pr.rows) >= self.config.capacity_per_prompt:
            self._counts["evictions"] += 1
            oldest = pr.oldest()
            assert oldest is not None
            if key < oldest[0]:  # the new row is itself the oldest: it is the one evicted
                return
            self._forget(pr.pop_oldest())
        pr.put(rkey, key, t)
        self._num_rows += 1
        self._version_sum += key[0]

    def _on_sync(self) -> None:
        floor = recent_min_version(self._sync_versions)
        if floor is not None:  # groups below the recent floor can never be recent again
            self._recent_uses = {g: uv for g, uv in self._recent_uses.items() if uv[1] >= floor}

    def _min_fresh_version(self) -> int | None:
        cur, cfg = self._current_version, self.config
        if cur is not None and cfg.max_staleness is not None and cfg.staleness_mode == "drop":
            return cur - cfg.max_staleness
        return None

    def _needs_current_version(self) -> str | None:
        if self.config.max_staleness is not None:
            return "max_staleness is set: sample() needs current_version"
        return None

    def _drop_stale(self) -> None:
        floor = self._min_fresh_version()
        if floor is None:
            return
        for pid in list(self._prompts):
            pr = self._prompts[pid]
            while (oldest := pr.oldest()) is not None and oldest[0][0] < floor:
                self._forget(pr.pop_oldest())
                self._counts["stale_drops"] += 1
            if not pr.rows:
                del self._prompts[pid]

    def _sample(
        self, rng: np.random.Generator, num_groups: int, k: int
    ) -> list[list[Trajectory]]:
        cfg = self.config
        if cfg.shortfall == "skip" and k > cfg.capacity_per_prompt:
            raise ValueError(
                f"k={k} > capacity_per_prompt={cfg.capacity_per_prompt} with shortfall='skip': "
                "no prompt can ever hold enough rows"
            )
        need = k if cfg.shortfall == "skip" else min(cfg.min_group_size, k)
        eligible = sorted(p for p, pr in self._prompts.items() if len(pr.rows) >= need)
        if not eligible:
            raise BufferEmptyError(
                f"no prompt has the {need} usable rows a group of k={k} needs "
                f"(shortfall={cfg.shortfall!r}; buffer holds {self._num_rows} rows over "
                f"{len(self._prompts)} prompts, at most "
                f"{max((len(pr.rows) for pr in self._prompts.values()), default=0)} per prompt); "
                "wait for searchers"
            )
        floor = recent_min_version(self._sync_versions)
        cap = cfg.max_recent_uses
        recent = [
            p for p in eligible
            if (floor is None or self._prompts[p].max_version >= floor)
            and (cap is None or self._unused_recent_rows(p, floor) >= need)
        ]
        if not recent and cfg.recency_fallback == "wait" and cfg.recency_prob > 0:
            raise BufferEmptyError(
                f"no prompt has rows with policy_version >= {floor} (the previous sync)"
                + ("" if cap is None else f" that the recency branch has used fewer than {cap} times")
                + " and recency_fallback='wait'; wait for searchers"
            )
        groups = []
        for _ in range(num_groups):
            if choose_branch(rng, cfg.recency_prob):
                if recent:
                    i = int(rng.integers(len(recent)))
                    pid = recent[i]
                    groups.append(self._draw_recent(rng, pid, k, floor))
                    self._counts["groups_recency"] += 1
                    if cap is not None and self._unused_recent_rows(pid, floor) < need:
                        recent.pop(i)
                    continue
                self._counts["recency_fallbacks"] += 1
            pid = eligible[int(rng.integers(len(eligible)))]
            groups.append(self._draw_reward(rng, self._prompts[pid], k))
            self._counts["groups_reward"] += 1
        return groups

    def _generation_groups(self, pid: int, floor: int | None) -> list[list[tuple[OrderKey, Trajectory]]]:
        """A prompt's rows by generation group, newest group first; with a recency-use cap, only
        groups at or above the recent floor that the recency branch has not used up."""
        by_group: dict[GroupKey, list[tuple[OrderKey, Trajectory]]] = {}
        for item in self._prompts[pid].ordered():
            by_group.setdefault((pid, item[0][2], int(item[1].group_id)), []).append(item)
        cap = self.config.max_recent_uses
        if cap is not None:
            by_group = {
                g: rows for g, rows in by_group.items()
                if (floor is None or rows[-1][0][0] >= floor) and self._recent_uses.get(g, (0, 0))[0] < cap
            }
        return sorted(by_group.items(), key=lambda kv: kv[1][-1][0], reverse=True)

    def _unused_recent_rows(self, pid: int, floor: int | None) -> int:
        return sum(len(rows) for _, rows in self._generation_groups(pid, floor))

    def _draw_reward(self, rng: np.random.Generator, pr: _PromptRows, k: int) -> list[Trajectory]:
        cfg = self.config
        items = pr.ordered()
        log_w = None
        if (
            cfg.max_staleness is not None
            and cfg.staleness_mode == "weight"
            and self._current_version is not None
        ):
            versions = np.fromiter((key[0] for key, _ in items), np.int64, len(items))
            log_w = stale_log_weights(
                versions, self._current_version, cfg.max_staleness, cfg.stale_decay
            )
        rewards = np.fromiter((t.reward for _, t in items), np.float64, len(items))
        logits = reward_logits(rewards, cfg.reward_inv_temp, log_w)
        idx = draw_group(rng, logits, k, replace=len(items) < k)
        return [items[i][1] for i in idx]

    def _draw_recent(self, rng: np.random.Generator, pid: int, k: int, floor: int | None) -> list[Trajectory]:
        # Newest generation group first: a group is as new as its newest row.
        ordered = self._generation_groups(pid, floor)
        taken = take_newest(rng, [len(rows) for _, rows in ordered], k)
        chosen = sorted(
            (rows[i] for (_, rows), idx in zip(ordered, taken) for i in idx), key=lambda kv: kv[0]
        )
        if self.config.max_recent_uses is not None:
            for (gkey, rows), idx in zip(ordered, taken):
                if len(idx):
                    uses = self._recent_uses.get(gkey, (0, 0))[0]
                    self._recent_uses[gkey] = (uses + 1, rows[-1][0][0])
        if len(chosen) < k:  # shortfall="replace": top up uniformly with replacement
            extra = rng.integers(len(chosen), size=k - len(chosen))
            chosen = sorted(chosen + [chosen[i] for i in extra], key=lambda kv: kv[0])
        return [t for _, t in chosen]

    def _layout_stats(self, out: dict[str, Any]) -> tuple[list[int], list[int]]:
        versions = [o[0][0] for pr in self._prompts.values() if (o := pr.oldest())]
        max_versions = [pr.max_version for pr in self._prompts.values()]
        floor = recent_min_version(self._sync_versions)
        out["num_prompts"] = len(self._prompts)
        out["num_recent_prompts"] = (
            len(self._prompts) if floor is None else sum(v >= floor for v in max_versions)
        )
        return versions, max_versions

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out["recent_uses"] = sorted([*gkey, *uv] for gkey, uv in self._recent_uses.items())
        return out

    def _load_extra(self, state: dict[str, Any]) -> None:
        self._recent_uses = {
            (int(p), int(s), int(g)): (int(u), int(v)) for p, s, g, u, v in state.get("recent_uses", [])
        }


class GroupQueue(_BufferBase):
    """Whole generation groups, each consumed once, oldest first (`BufferConfig(mode="fifo_once")`):
    TBA′ / async GRPO, and the sync mode at async_level=0. Groups more than `async_level`
    versions older than the trainer are dropped."""

    mode = "fifo_once"

    def __init__(self, config: BufferConfig | None = None) -> None:
        super().__init__(config)
        self._groups: dict[GroupKey, _Group] = {}
        self._consumed: dict[GroupKey, int] = {}  # group -> its policy version

    def _add_row(self, t: Trajectory, key: OrderKey) -> None:
        gkey: GroupKey = (int(t.prompt_id), key[2], int(t.group_id))
        if gkey in self._consumed:
            self._counts["late_rows_dropped"] += 1
            return
        group = self._groups.get(gkey)
        if group is None:
            group = self._groups[gkey] = _Group(key)
        group.rows.append(t)
        group.min_version = min(group.min_version, key[0])
        self._num_rows += 1
        self._version_sum += key[0]

    def _min_fresh_version(self) -> int | None:
        cur = self._current_version
        return None if cur is None else cur - self.config.async_level

    def _needs_current_version(self) -> str | None:
        return "fifo_once mode needs current_version to drop stale groups"

    def _drop_stale(self) -> None:
        floor = self._min_fresh_version()
        if floor is None:
            return
        counts = self._counts
        for gkey in [g for g, grp in self._groups.items() if grp.min_version < floor]:
            group = self._groups.pop(gkey)
            counts["stale_groups_dropped"] += 1
            counts["stale_drops"] += len(group.rows)
            for t in group.rows:
                self._forget(t)
        # Consumed groups that old would be dropped as stale anyway: forget them.
        self._consumed = {g: v for g, v in self._consumed.items() if v >= floor}

    def _sample(
        self, rng: np.random.Generator, num_groups: int, k: int
    ) -> list[list[Trajectory]]:
        ready = [(g.key, gk) for gk, g in self._groups.items() if len(g.rows) >= k]
        if len(ready) < num_groups:
            raise BufferEmptyError(
                f"{len(ready)} complete groups of >= {k} rows within async_level="
                f"{self.config.async_level} of version {self._current_version}, "
                f"{num_groups} needed; the largest pending group has "
                f"{max((len(g.rows) for g in self._groups.values()), default=0)} rows (a group "
                "is ready once it holds k rows); wait for searchers"
            )
        ready.sort()
        out = []
        for _, gkey in ready[:num_groups]:
            group = self._groups.pop(gkey)
            rows = group.rows
            if len(rows) > k:  # e.g. 24 generated, K = 20 trained: a uniform subset
                idx = draw_group(rng, np.zeros(len(rows)), k, replace=False)
                rows = [rows[i] for i in idx]
            for t in group.rows:
                self._forget(t)
            self._consumed[gkey] = group.min_version
            self._counts["groups_consumed"] += 1
            out.append(rows)
        return out

    # ------------------------------------------------------------------ introspection, state

    def _layout_stats(self, out: dict[str, Any]) -> tuple[list[int], list[int]]:
        out["num_prompts"] = len({gk[0] for gk in self._groups})
        out["num_groups"] = len(self._groups)
        out["ready_groups"] = sum(len(g.rows) >= self.config.samples_per_group for g in self._groups.values())
        out["num_recent_prompts"] = out["num_prompts"]
        versions = [g.min_version for g in self._groups.values()]
        max_versions = [max(int(t.policy_version) for t in g.rows) for g in self._groups.values()]
        return versions, max_versions

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out["consumed"] = sorted([*gkey, v] for gkey, v in self._consumed.items())
        return out

    def _load_extra(self, state: dict[str, Any]) -> None:
        consumed = {(int(p), int(s), int(g)): int(v) for p, s, g, v in state["consumed"]}
        self._consumed = consumed
        for gkey in [g for g in self._groups if g in consumed]:
            group = self._groups.pop(gkey)
            self._counts["late_rows_dropped"] += len(group.rows)
            for t in group.rows:
                self._forget(t)
