"""The red-teaming replay buffer in the trainer: `RewardHeap` behind the `TrajectoryBuffer` protocol.

`BufferConfig(mode="reward_heap")`. Red-teaming (TBA spec §8) trains an attacker on one shared
prompt, so there are no per-prompt buffers: every incoming attack is offered to one
reward-keyed heap (`tbajax.buffer.reward_heap`) that keeps the `capacity_per_prompt` best
unique attacks by log reward, rejecting exact duplicates and near-duplicates (edit distance of
the attack's tokens with the stop token stripped; embedding cosine only when rows carry
`extras["embedding"]`; the red-team scorer stores none, so runs keep cosine dedup off).

Sampling is the reference's half online / half replay, decided once per batch (per `sample`
call, i.e. per trainer step): with probability `recency_prob` (0.5 in the recipe) the batch's
groups are the *online* attacks (the newest ones, see below), K per group drawn uniformly
without replacement, no row twice in the batch; else each group is K heap attacks drawn without
replacement with probability softmax(priority · reward_inv_temp), the priority being the mean
log toxicity of the victim's answers (`heap_priority="log_toxicity"`, the reference) or the log
reward. An online batch whose groups run out of unused online rows takes the rest from the heap
(counted: `online_fallbacks`); a replay batch while the heap cannot fill a group (fewer than K
attacks, shortfall="skip") is served online (`replay_fallbacks`).

Groups. The objective (VarGrad TB) needs groups of K rows of one prompt: its per-group baseline
δ̄ estimates log Z(prompt). Every red-team attack has the same prompt, so *any* K attacks form a
valid group (they need not come from one generation call); this buffer enforces it by refusing a
row whose prompt tokens differ from the first row's. Rows of a group may carry different
`prompt_id`s (the recipe's copies of the one prompt): the TB objective ignores ids; an objective
with a per-id table (tb_learned_logz) would need the recipe's single prompt id (num_prompts=1).

Online set: rows with policy_version >= the previous sync's version once two syncs are known
(the same window as `ReplayBuffer`'s recent set: what searchers sampled since the params before
the last publish, never empty right after a sync); before that, and in sync mode (where the
trainer marks no syncs), the rows of the newest policy version seen (sync mode: the batch just
generated with the current params).

Resume. The heap's outcome depends on the order attacks were offered, so unlike `ReplayBuffer`
it is not rebuilt by re-reading the stores: `state_dict()` holds the heap, its rows and the
online rows (JSON), and per searcher the highest generation-group id already offered. After a
restart the async tailer re-reads every store from row 0; rows of groups at or below that
watermark were offered before the checkpoint and are skipped, newer ones go through the heap as
usual. This is exact because a state is taken between fills, when each searcher's offered rows
are whole store commits (the tailer reads to the committed end; one commit is one generation
call) and group ids grow with the store (`first_group_id` = (searcher << 40) + committed rows).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from tbajax.buffer.config import BufferConfig, BufferEmptyError
from tbajax.buffer.policies import recent_min_version
from tbajax.buffer.replay import _FAILED, _BufferBase
from tbajax.buffer.reward_heap import HeapItem, RewardHeap, RewardHeapConfig
from tbajax.trajectory import RewardStatus, Trajectory

_STATE_FORMAT = 1
_COUNTERS = ("rows_added", "failed_grade_drops", "replayed_rows_skipped", "batches_online", "batches_replay",
             "groups_online", "groups_replay", "online_fallbacks", "replay_fallbacks")


def attack_tokens(t: Trajectory) -> tuple[int, ...]:
    """The attack's tokens for near-duplicate checks: the response without its stop token
    (`finished` rows end with one), so "x<eos>" and "x" cut at max_new_tokens are one attack."""
    toks = np.asarray(t.response_tokens, np.int64)
    if t.finished and len(toks):
        toks = toks[:-1]
    return tuple(int(x) for x in toks)


def heap_priority(t: Trajectory, kind: str) -> float:
    """The heap's sampling priority of a row: mean log toxicity of the victim's answers
    (the reference's log p_toxic) or the log reward itself."""
    if kind == "reward":
        return float(t.reward)
    tox = (t.extras or {}).get("toxicity")
    if tox is None:
        raise ValueError(
            f"buffer.heap_priority='log_toxicity' needs the red-team scorer's extras['toxicity'], but the "
            f"row of group {t.group_id} (searcher {t.searcher_id}) has extras {sorted((t.extras or {}))}; "
            "use buffer.heap_priority='reward' for other tasks"
        )
    tox = np.asarray(tox, np.float64)
    with np.errstate(divide="ignore"):
        value = float(np.mean(np.log(tox)))
    # a toxicity of exactly 0 (log -inf) must not poison the softmax: floor it at float64's tiny
    return value if math.isfinite(value) else float(np.mean(np.log(np.maximum(tox, np.finfo(np.float64).tiny))))


def trajectory_to_json(t: Trajectory) -> dict[str, Any]:
    """Every field of a Trajectory as JSON (arrays keep their dtype), whatever fields it has."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(t):
        v = getattr(t, f.name)
        if isinstance(v, np.ndarray):
            out[f.name] = {"ndarray": v.tolist(), "dtype": str(v.dtype)}
        elif isinstance(v, enum.Enum):
            out[f.name] = int(v.value)
        elif isinstance(v, np.generic):
            out[f.name] = v.item()
        else:
            out[f.name] = dict(v) if isinstance(v, Mapping) else v
    return out


def trajectory_from_json(d: dict[str, Any]) -> Trajectory:
    kw: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and set(v) == {"ndarray", "dtype"}:
            kw[k] = np.asarray(v["ndarray"], np.dtype(v["dtype"]))
        else:
            kw[k] = v
    kw["reward_status"] = RewardStatus(int(kw.get("reward_status", 0)))
    return Trajectory(**kw)


class HeapReplayBuffer(_BufferBase):
    """Red-teaming replay (`BufferConfig(mode="reward_heap")`); see the module docstring."""

    mode = "reward_heap"

    def __init__(self, config: BufferConfig | None = None) -> None:
        super().__init__(config)
        cfg = self.config
        self.heap = RewardHeap(RewardHeapConfig(
            capacity=cfg.capacity_per_prompt, edit_tolerance=cfg.edit_tolerance,
            cosine_tolerance=cfg.cosine_tolerance, priority_inv_temp=cfg.reward_inv_temp,
        ))
        self._rows: dict[int, Trajectory] = {}  # heap payload (row id) -> row
        self._next_row = 0
        self._online: list[Trajectory] = []  # arrival order
        self._max_version: int | None = None
        self._prompt: bytes | None = None
        self._watermark: dict[int, int] = {}  # searcher -> highest group id offered
        self._skip_below: dict[int, int] = {}  # searcher -> watermark restored from a state
        self._hcounts = dict.fromkeys(_COUNTERS, 0)

    # ------------------------------------------------------------------ ingestion

    def add(self, rows: Iterable[Trajectory]) -> None:
        """Offer rows to the heap and the online set (rows already offered before a restored
        state are skipped: see the module docstring)."""
        cfg, counts = self.config, self._hcounts
        items, accepted_rows = [], []
        for t in rows:
            if not isinstance(t, Trajectory):
                raise TypeError(f"{type(self).__name__}.add expects Trajectory rows, got {type(t).__name__}")
            sid, gid = int(t.searcher_id), int(t.group_id)
            if gid <= self._skip_below.get(sid, -1):
                counts["replayed_rows_skipped"] += 1
                continue
            self._watermark[sid] = max(self._watermark.get(sid, -1), gid)
            counts["rows_added"] += 1
            if not cfg.keep_failed_grades and t.reward_status in _FAILED:
                counts["failed_grade_drops"] += 1
                continue
            if not math.isfinite(t.reward):
                raise ValueError(
                    f"non-finite reward {t.reward} (status {RewardStatus(t.reward_status).name}) for group "
                    f"{gid}, searcher {sid}: the scorer must report failures through reward_status"
                )
            self._check_prompt(t)
            emb = (t.extras or {}).get("embedding") if cfg.cosine_tolerance is not None else None
            if cfg.cosine_tolerance is not None and emb is None:
                raise ValueError(
                    "buffer.cosine_tolerance is set but a row has no extras['embedding'] (the red-team "
                    "scorer stores none); set buffer.cosine_tolerance=null"
                )
            items.append(HeapItem(tokens=attack_tokens(t), reward=t.reward,
                                  priority=heap_priority(t, cfg.heap_priority), embedding=emb,
                                  payload=self._next_row))
            self._rows[self._next_row] = t
            self._next_row += 1
            accepted_rows.append(t)
        if items:
            self.heap.add(items)
            live = {it.payload for it in self.heap.items()}
            self._rows = {k: v for k, v in self._rows.items() if k in live}
        for t in accepted_rows:
            v = int(t.policy_version)
            self._max_version = v if self._max_version is None else max(self._max_version, v)
        self._online.extend(accepted_rows)
        self._prune_online()

    def _check_prompt(self, t: Trajectory) -> None:
        key = np.asarray(t.prompt_tokens, np.int64).tobytes()
        if self._prompt is None:
            self._prompt = key
        elif key != self._prompt:
            raise ValueError(
                f"buffer.mode='reward_heap' keeps the attacks of one shared prompt (red-teaming), but the row "
                f"of group {t.group_id} has other prompt tokens than the first row's; use buffer.mode='replay' "
                "for tasks with several prompts"
            )

    def online_floor(self) -> int | None:
        """Oldest policy version of the online set (see the module docstring)."""
        floor = recent_min_version(self._sync_versions)
        return floor if floor is not None else self._max_version

    def _prune_online(self) -> None:
        floor = self.online_floor()
        if floor is not None:
            self._online = [t for t in self._online if int(t.policy_version) >= floor]

    def _on_sync(self) -> None:
        self._prune_online()

    def _min_fresh_version(self) -> int | None:
        return None

    def _drop_stale(self) -> None:
        pass

    def _needs_current_version(self) -> str | None:
        return None

    # ------------------------------------------------------------------ sampling

    def _heap_ok(self, k: int) -> bool:
        n = len(self.heap)
        return n >= k or (self.config.shortfall == "replace" and n >= min(self.config.min_group_size, k))

    def _sample(self, rng: np.random.Generator, num_groups: int, k: int) -> list[list[Trajectory]]:
        cfg, counts = self.config, self._hcounts
        online_groups = len(self._online) // k
        heap_ok = self._heap_ok(k)
        if not heap_ok and online_groups < num_groups:
            raise BufferEmptyError(
                f"the reward heap holds {len(self.heap)} attacks (a group needs {k}, shortfall="
                f"{cfg.shortfall!r}) and the online set {len(self._online)} (versions >= {self.online_floor()}), "
                f"not enough for {num_groups} groups of {k}; wait for searchers"
            )
        if cfg.recency_fallback == "wait" and cfg.recency_prob > 0 and online_groups == 0:
            raise BufferEmptyError(
                f"the online set holds {len(self._online)} attacks (versions >= {self.online_floor()}), "
                f"fewer than a group of {k}, and recency_fallback='wait'; wait for searchers"
            )
        unused = np.arange(len(self._online))
        groups: list[list[Trajectory]] = []
        online_batch = bool(rng.random() < cfg.recency_prob)
        counts["batches_online" if online_batch else "batches_replay"] += 1
        for _ in range(num_groups):
            online = online_batch
            if online and unused.size < k:
                counts["online_fallbacks"] += 1
                online = False
            elif not online and not heap_ok:
                counts["replay_fallbacks"] += 1
                online = True
            if online:
                pick = rng.choice(unused.size, size=k, replace=False)
                chosen = np.sort(unused[pick])
                unused = np.setdiff1d(unused, chosen)
                groups.append([self._online[i] for i in chosen])
                counts["groups_online"] += 1
            else:
                drawn = self.heap.sample(rng, k, replace=len(self.heap) < k)
                groups.append([self._rows[it.payload] for it in drawn])
                counts["groups_replay"] += 1
        return groups

    # ------------------------------------------------------------------ introspection, state

    def __len__(self) -> int:
        return len(self.heap)

    def stats(self, current_version: int | None = None) -> dict[str, Any]:
        """The trainer's usual buffer numbers (rows = heap size, one prompt) plus the heap's
        counters under `extra_metrics` (logged by the trainer as buffer_<name>)."""
        cur = self._current_version if current_version is None else int(current_version)
        nan = float("nan")
        versions = np.array([int(t.policy_version) for t in self._rows.values()], np.float64)
        hs = self.heap.stats()
        floor = self.online_floor()
        mean_v = float(versions.mean()) if versions.size else nan
        out: dict[str, Any] = dict(self._hcounts)
        out.update(
            num_rows=len(self.heap),
            num_prompts=int(bool(self._rows)),
            num_recent_prompts=int(bool(self._online)),
            num_online_rows=len(self._online),
            mean_policy_version=mean_v,
            min_policy_version=float(versions.min()) if versions.size else nan,
            max_policy_version=float(versions.max()) if versions.size else nan,
            mean_staleness=cur - mean_v if (cur is not None and versions.size) else nan,
            last_sync_version=float(self._sync_versions[-1]) if self._sync_versions else nan,
            recent_min_version=nan if floor is None else float(floor),
            current_version=nan if cur is None else float(cur),
            heap=hs,
        )
        out["extra_metrics"] = {
            "heap_size": hs["size"], "heap_accepted": hs["accepted"],
            "heap_exact_duplicates": hs["exact_duplicates"],
            "heap_near_duplicate_drops": hs["near_duplicate_drops"],
            "heap_near_duplicate_replacements": hs["near_duplicate_replacements"],
            "heap_capacity_drops": hs["capacity_drops"], "heap_evictions": hs["evictions"],
            "heap_max_reward": hs["max_reward"], "heap_mean_reward": hs["mean_reward"],
            "online_rows": len(self._online), "batches_online": self._hcounts["batches_online"],
            "batches_replay": self._hcounts["batches_replay"], "groups_online": self._hcounts["groups_online"],
            "groups_replay": self._hcounts["groups_replay"],
            "replayed_rows_skipped": self._hcounts["replayed_rows_skipped"],
        }
        return out

    def state_dict(self) -> dict[str, Any]:
        """JSON: the heap (its payloads are row ids), those rows, the online rows, the watermarks."""
        out = super().state_dict()
        out.update(
            heap_format=_STATE_FORMAT,
            heap=self.heap.state_dict(),
            rows={str(k): trajectory_to_json(t) for k, t in self._rows.items()},
            next_row=self._next_row,
            online=[trajectory_to_json(t) for t in self._online],
            max_version=self._max_version,
            watermark={str(s): g for s, g in self._watermark.items()},
            heap_counts=dict(self._hcounts),
        )
        return out

    def _load_extra(self, state: dict[str, Any]) -> None:
        if state.get("heap_format") != _STATE_FORMAT:
            raise ValueError(f"unknown reward_heap buffer state format {state.get('heap_format')!r}")
        self.heap.load_state_dict(state["heap"])
        self._rows = {int(k): trajectory_from_json(d) for k, d in state["rows"].items()}
        missing = {it.payload for it in self.heap.items()} - set(self._rows)
        if missing:
            raise ValueError(f"reward_heap buffer state has heap items without rows: {sorted(missing)[:5]}")
        self._next_row = int(state["next_row"])
        self._online = [trajectory_from_json(d) for d in state["online"]]
        mv = state["max_version"]
        self._max_version = None if mv is None else int(mv)
        self._watermark = {int(s): int(g) for s, g in state["watermark"].items()}
        self._skip_below = dict(self._watermark)
        self._hcounts = {k: int(state["heap_counts"].get(k, 0)) for k in _COUNTERS}
        first = next(iter(self._rows.values()), None) or next(iter(self._online), None)
        self._prompt = None if first is None else np.asarray(first.prompt_tokens, np.int64).tobytes()
