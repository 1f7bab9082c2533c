"""Store locations as URLs, and small JSON records written atomically through tensorstore.

Every store lives under a run URL: a local path (turned into ``file://``), ``gs://`` or ``s3://``.
Small records (commit counters, pointers, leases) go through a tensorstore kvstore because a
single-key write is atomic on all three: the ``file`` driver writes ``<key>.__lock`` and renames
it over the key (with fsync), GCS and S3 replace whole objects.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import tensorstore as ts

TRAJECTORIES_DIR = "trajectories"
PARAMS_DIR = "params"


def to_url(location: str | os.PathLike[str]) -> str:
    """A store URL without a trailing slash; plain paths become absolute ``file://`` URLs."""
    s = os.fspath(location)
    if "://" in s:
        scheme = s.split("://", 1)[0]
        if not scheme.isidentifier():
            raise ValueError(f"{s!r} is not a valid store URL (scheme {scheme!r})")
        return s.rstrip("/")
    return "file://" + os.path.abspath(s)


def join_url(url: str, *parts: str) -> str:
    return "/".join([to_url(url), *(p.strip("/") for p in parts)])


def local_path(url: str) -> Path | None:
    """The filesystem path of a ``file://`` URL, else None (bucket URLs)."""
    url = to_url(url)
    return Path(url[len("file://") :]) if url.startswith("file://") else None


def path_for_orbax(url: str) -> Any:
    """What orbax/epath accept: a local path for ``file://``, the URL itself for buckets."""
    from etils import epath

    p = local_path(url)
    return epath.Path(p if p is not None else to_url(url))


def trajectory_store_url(run_url: str | os.PathLike[str], searcher_id: int) -> str:
    return join_url(to_url(run_url), TRAJECTORIES_DIR, f"searcher-{int(searcher_id)}")


def param_store_url(run_url: str | os.PathLike[str]) -> str:
    return join_url(to_url(run_url), PARAMS_DIR)


def open_kvstore(url: str) -> ts.KvStore:
    """A kvstore rooted at `url` (keys are relative paths under it)."""
    return ts.KvStore.open(to_url(url) + "/").result()


def read_json(kv: ts.KvStore, key: str) -> tuple[dict[str, Any] | None, bytes]:
    """(record, storage generation); (None, generation) when the key does not exist."""
    res = kv.read(key).result()
    if res.state != "value":
        return None, res.stamp.generation
    try:
        record = json.loads(res.value)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{key!r} under {kv.path!r} is not valid JSON ({e}); "
            "the store is corrupted, delete or repair that record"
        ) from e
    if not isinstance(record, dict):
        raise ValueError(f"{key!r} under {kv.path!r} holds {type(record).__name__}, expected a JSON object")
    return record, res.stamp.generation


JSON_RECORD_BLOCK = 4096


def write_json(kv: ts.KvStore, key: str, record: dict[str, Any], if_equal: bytes | None = None) -> bytes | None:
    """Atomically replace `key`; with `if_equal`, only if its generation is unchanged.

    Returns the new generation, or None when the conditional write lost (someone else wrote).

    The encoding is padded with spaces to a multiple of `JSON_RECORD_BLOCK` bytes. tensorstore's
    file driver writes a value into `<key>.__lock` and renames it; a writer SIGKILLed in between
    leaves that file behind, and the next write reuses it without truncating, so a shorter value
    would come back followed by the tail of the dead writer's one ("Extra data" in the JSON).
    With every record of a key the same padded size, the next write covers all of it.
    """
    data = json.dumps(record, sort_keys=True).encode()
    data += b" " * (-len(data) % JSON_RECORD_BLOCK)
    stamp = kv.write(key, data, if_equal=if_equal).result()
    return stamp.generation or None


def delete_key(kv: ts.KvStore, key: str) -> None:
    kv.write(key, None).result()


def list_keys(kv: ts.KvStore, prefix: str = "") -> list[str]:
    """Keys under `prefix` (recursive), relative to the kvstore root."""
    if prefix:
        rng = ts.KvStore.KeyRange(inclusive_min=prefix.encode(), exclusive_max=_prefix_end(prefix.encode()))
        keys = kv.list(rng).result()
    else:
        keys = kv.list().result()
    return sorted(k.decode() for k in keys)


def _prefix_end(prefix: bytes) -> bytes:
    """Smallest key greater than every key that starts with `prefix`."""
    b = bytearray(prefix)
    while b and b[-1] == 0xFF:
        b.pop()
    if not b:
        return b""
    b[-1] += 1
    return bytes(b)
