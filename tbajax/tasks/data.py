"""Getting problems: local JSONL/JSON/parquet files, the HF hub (only when `datasets` is installed
and the hub is reachable), and hash-based train/eval assignment for generated problems."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

_TRUE = {"1", "true", "yes", "on"}


class DatasetUnavailableError(FileNotFoundError):
    """The data of a task cannot be found locally and cannot be fetched; the message says how to provide it."""


def split_of(key: str, seed: int, eval_fraction: float) -> str:
    """'eval' or 'train' for a generated problem, decided by a hash of its content, so the two
    splits are disjoint by construction whatever the generation order or sizes."""
    if not (0.0 < eval_fraction < 1.0):
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    digest = hashlib.blake2b(f"{seed}\x00{key}".encode(), digest_size=8).digest()
    u = int.from_bytes(digest, "little") / 2.0**64
    return "eval" if u < eval_fraction else "train"


def draw_for_split(
    split: str,
    index: int,
    *,
    seed: int,
    eval_fraction: float,
    candidate: Callable[[int, int], Any],
    key: Callable[[Any], str],
    max_tries: int = 4096,
) -> Any:
    """Item `index` of `split`: the first of `candidate(index, 0), candidate(index, 1), ...` whose
    content hash falls in `split` (rejection sampling against `split_of`)."""
    for attempt in range(max_tries):
        item = candidate(index, attempt)
        if split_of(key(item), seed, eval_fraction) == split:
            return item
    raise RuntimeError(f"no {split} item among {max_tries} candidates (eval_fraction={eval_fraction} too extreme?)")


class LazyProblems(Sequence):
    """A fixed-length sequence whose item i is made on demand by `make(i)` (for large generated splits)."""

    def __init__(self, length: int, make: Callable[[int], Any]):
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        self._length = length
        self._make = make

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._length))]
        if i < 0:
            i += self._length
        if not (0 <= i < self._length):
            raise IndexError(f"problem index {i} out of range for {self._length} problems")
        return self._make(i)


def hub_offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in _TRUE for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows of a .jsonl, .json (a list of objects, or {"data": [...]}) or .parquet file."""
    p = Path(path)
    if not p.is_file():
        raise DatasetUnavailableError(f"data file {str(p)!r} does not exist")
    name = p.name.lower()
    if name.endswith(".jsonl"):
        rows = []
        with p.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{p}:{lineno}: not valid JSON: {e}") from None
        return rows
    if name.endswith(".json"):
        data = json.loads(p.read_text(encoding="utf-8"))
        if isinstance(data, Mapping) and "data" in data:
            data = data["data"]
        if not isinstance(data, list):
            raise ValueError(f"{p}: expected a JSON list of objects (or {{'data': [...]}})")
        return list(data)
    if name.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError(f"reading {p} needs pyarrow (pip install pyarrow), or convert it to .jsonl") from None
        return pq.read_table(p).to_pylist()
    raise ValueError(f"{p}: unsupported data file type; use .jsonl, .json or .parquet")


def find_split_files(data_path: str | os.PathLike, names: Sequence[str]) -> list[Path]:
    """Files for a split under `data_path`: a path with '{split}' in it is formatted with each name;
    a directory is searched (recursively) for NAME.jsonl / NAME.json / NAME.parquet / NAME-*.parquet."""
    text = os.fspath(data_path)
    if "{split}" in text:
        return [Path(text.format(split=n)) for n in names if Path(text.format(split=n)).is_file()][:1]
    root = Path(text)
    if root.is_file():
        raise ValueError(
            f"data_path {text!r} is a single file: give a directory holding one file per split "
            f"(e.g. {names[0]}.jsonl), a pattern with '{{split}}', or the per-split train_path / eval_path"
        )
    if not root.is_dir():
        return []
    for n in names:
        for pattern in (f"{n}.jsonl", f"{n}.json", f"{n}.parquet"):
            hits = sorted(root.rglob(pattern))
            if hits:
                return hits[:1]
        hits = sorted(root.rglob(f"{n}-*.parquet"))  # sharded HF hub layout
        if hits:
            return hits
    return []


def load_hub_split(hub_id: str, hub_config: str | None, hub_split: str) -> list[dict[str, Any]]:
    import datasets  # only reached when installed and online

    ds = datasets.load_dataset(hub_id, hub_config, split=hub_split)
    return [dict(row) for row in ds]


def load_split_records(
    *,
    task: str,
    split: str,
    fields: str,
    split_names: Sequence[str],
    data_path: str | None,
    split_path: str | None,
    hub: tuple[str, str | None, str] | None,
) -> list[dict[str, Any]]:
    """Records of one split: an explicit file, else files under `data_path`, else the HF hub via
    `datasets` when installed and online; anything else fails at once with how to provide the data."""
    if split_path is not None:
        return read_records(split_path)
    if data_path is not None:
        files = find_split_files(data_path, split_names)
        if not files:
            raise DatasetUnavailableError(
                f"{task}: no {split} data under data_path={data_path!r} (looked for "
                f"{' / '.join(n + '.jsonl|.json|.parquet' for n in split_names)}). "
                f"Provide files with fields {fields}, or set task.{split}_path=FILE"
            )
        return [row for f in files for row in read_records(f)]
    how = (
        f"Provide it locally: --set task.data_path=DIR (a folder with {split_names[0]}.jsonl or "
        f"{split_names[0]}.parquet, fields {fields}) or --set task.{split}_path=FILE"
    )
    if hub is None:
        raise DatasetUnavailableError(f"{task}: no {split} data configured. {how}")
    hub_id, hub_config, hub_split = hub
    if importlib.util.find_spec("datasets") is None:
        raise DatasetUnavailableError(
            f"{task}: {split} data not found locally and the `datasets` package is not installed to fetch "
            f"{hub_id!r} from the HF hub. {how}; or pip install datasets and run online"
        )
    if hub_offline():
        raise DatasetUnavailableError(
            f"{task}: {split} data not found locally and the HF hub is offline (HF_HUB_OFFLINE / "
            f"HF_DATASETS_OFFLINE is set), so {hub_id!r} cannot be fetched. {how}"
        )
    return load_hub_split(hub_id, hub_config, hub_split)


def reasoning_gym_split(
    name: str,
    split: str,
    n: int,
    *,
    seed: int,
    eval_fraction: float,
    key: Callable[[dict], str],
    config: Mapping[str, Any] | None = None,
) -> list[dict]:
    """The first `n` items of reasoning-gym dataset `name` (generated offline from `seed`) whose
    content hash falls in `split`, so train and eval are disjoint by construction."""
    try:
        import reasoning_gym
    except ImportError:
        raise ImportError(
            f"the reasoning-gym source ({name}) needs reasoning-gym (pip install reasoning-gym); "
            "it generates problems offline"
        ) from None
    share = eval_fraction if split == "eval" else 1.0 - eval_fraction
    size = int(n / share * 1.2) + 64
    out: list[dict] = []
    j = 0
    while len(out) < n:
        # reasoning-gym derives item j from (seed, j) only, so a larger dataset extends a smaller one.
        ds = reasoning_gym.create_dataset(name, seed=seed, size=size, **dict(config or {}))
        while j < size and len(out) < n:
            item = ds[j]
            j += 1
            if split_of(key(item), seed, eval_fraction) == split:
                out.append(item)
        size *= 2
    return out
