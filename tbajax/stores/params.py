"""Versioned parameter store: the trainer publishes, searchers load the newest complete version.

Layout of ``<run>/params/``:

    <v>/params.bin          every leaf's bytes (C order) at 64-byte aligned offsets, then the
                            manifest {"format", "bytes", "leaves": [{"path", "shape", "dtype",
                            "offset"}], "meta"} as JSON, then a 16-byte footer (magic, JSON length);
                            "meta" is the publisher's description of what the leaves are (e.g.
                            LoRA adapters and their config, `tbajax.models.lora.adapter_manifest`)
    <v>/commit_success.txt  created after params.bin is on disk (one fsync): a version is complete
                            exactly when it has this marker
    latest.json             {"format", "run_id", "version", "step", "dtype", "time"}: newest complete version
    readers/<id>.json       {"version", "time", "pid", "host"}: a searcher's lease while it loads a version
    pins/<v>.json           {"version", "step", "time", ...}: a version kept until its reader unpins it
                            (the trainer pins the versions of its eval steps for the evaluator)

One flat file per version, not a general checkpoint format: a publish is one sequential write and
one fsync, a load one sequential read, so both run at the disk's (or page cache's) speed; orbax
spent most of a publish on metadata, per-array files and their fsyncs. Trainer checkpoints
(`tbajax.training.checkpoint`) still use orbax: they are rare and need its generality.

What keeps a publish at the speed of a plain write + fsync of the same bytes:
- a cast (fp32 trainer params published as bf16) is done once, where the leaf lives: on an
  accelerator on the device before the transfer (half the bytes cross), all transfers started at
  once; on the host in jitted chunks of ~1M elements dispatched a few chunks ahead of the writer,
  so XLA casts chunk k+1 while chunk k is written (a whole-tree cast first, then the write, cost
  2.6-3.7x a raw write of the bf16 bytes: `experiments/benchmarks/stores.py`);
- no copies besides the one into the page cache: uncast host leaves are written from their own
  memory, cast chunks from the (cache-hot) cast output;
- the kernel is told to start writing back every 8 MB as it is written (Linux sync_file_range),
  so the closing fsync waits for the last few MB, not for all of them;
- of the directory fsyncs that order data -> marker -> pointer, the one for the new version's
  directory entry runs while the data is written.

The pointer is replaced only after a version is complete, in one atomic single-key write, so a
searcher never sees an incomplete version as latest. Versions only grow: a restarted trainer
continues above both the pointer and every directory on disk. Garbage collection keeps the last
`keep` complete versions, every version under a live lease, and every pinned version. A lease
lives while its reader loads (it times out); a pin is durable until `unpin`: it is how a version
that a slower reader must still see (an eval step's params for the evaluator role) outlives the
`keep` newer versions published meanwhile. The manifest records the trainer step of each version
(`version_step`), so a reader names the step whose params it used without trusting the pointer.

The lease closes the race "searcher reads the pointer, trainer deletes that version" except
when `keep` newer versions get published between a searcher's pointer read and its lease write
(microseconds against a publish period of seconds); `restore` re-checks the version after
taking the lease and then says plainly that it is gone, so the caller can load the newest one.

Multi-host: a leaf sharded over several processes is gathered (`process_allgather`, a collective:
every process calls `publish`) and process 0 alone writes the version, the pointer and collects.
Each loading process reads the whole leaves it needs any shard of and places its own shards.
Bucket URLs (gs://, s3://) write each file as one object through tensorstore, marker last.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import collections
import dataclasses
import functools
import io
import json
import logging
import os
import re
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from tbajax.stores.urls import (
    delete_key,
    list_keys,
    local_path,
    open_kvstore,
    path_for_orbax,
    read_json,
    to_url,
    write_json,
)

FORMAT = "tbajax.params.v1"
LATEST_KEY = "latest.json"
READERS_DIR = "readers"
PINS_DIR = "pins"
COMMIT_MARKER = "commit_success.txt"
DATA_FILE = "params.bin"
VERSION_FORMAT = "tbajax.params.flat.v1"
_MAGIC = b"TBAJAXP1"  # footer: magic + little-endian u64 length of the manifest JSON before it
_FOOTER = struct.Struct("<8sQ")
_ALIGN = 64  # leaf offsets in params.bin: aligned views for any dtype
PUBLISH_DTYPES = ("float32", "bfloat16", "float16")

log = logging.getLogger(__name__)

_VERSION_DIR = re.compile(r"^(\d+)(\.orbax-checkpoint-tmp.*)?$")  # temp dirs of orbax-era versions too
_READER_ID = re.compile(r"^[A-Za-z0-9_.-]+$")


class ParamStoreError(RuntimeError):
    """The param store is in a state this process must not silently work around."""


class ParamPointerCorrupt(ParamStoreError):
    """latest.json exists but is not JSON (a trainer can rebuild it from the version dirs)."""


class ParamVersionError(LookupError):
    """A requested version does not exist (never published, incomplete, or garbage-collected)."""


@dataclasses.dataclass(frozen=True)
class PublishedVersion:
    version: int
    run_id: str
    step: int | None
    dtype: str | None
    time: float


def cast_floating(params: Any, dtype: str | None) -> Any:
    """Cast floating leaves to `dtype` (None keeps them); integer leaves are left alone."""
    if dtype is not None and dtype not in PUBLISH_DTYPES:
        raise ValueError(f"publish dtype must be one of {PUBLISH_DTYPES} or None, got {dtype!r}")

    def one(path: Any, x: Any) -> Any:
        if isinstance(x, np.generic):
            x = np.asarray(x)
        if not isinstance(x, (jax.Array, np.ndarray)):
            raise TypeError(
                f"param leaf {jax.tree_util.keystr(path)} is a {type(x).__name__}, not an array: publish a "
                "pure pytree of arrays, e.g. nnx.to_pure_dict(nnx.state(model, nnx.Param))"
            )
        if dtype is None or not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == jnp.dtype(dtype):
            return x
        return x.astype(dtype)

    return jax.tree_util.tree_map_with_path(one, params)


def abstract_target(target: Any, shardings: Any = None) -> Any:
    """ShapeDtypeStructs with a sharding on every leaf, from a target pytree (+ optional shardings).

    `shardings` is a pytree matching `target`, one Sharding for all leaves, or None to use each
    target leaf's own `.sharding`. A missing sharding is an error rather than a guess: the trainer's
    devices are not this process's, so its placement cannot be reused.
    """
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(target)
    if shardings is None:
        shard_leaves = [getattr(x, "sharding", None) for _, x in leaves_with_path]
    elif isinstance(shardings, jax.sharding.Sharding):
        shard_leaves = [shardings] * len(leaves_with_path)
    else:
        try:
            shard_leaves = treedef.flatten_up_to(shardings)
        except (ValueError, TypeError) as e:
            raise ValueError(f"shardings do not match the structure of the target: {e}") from e
    out = []
    for (path, x), s in zip(leaves_with_path, shard_leaves):
        if not isinstance(s, jax.sharding.Sharding):
            raise ValueError(
                f"no sharding for target leaf {jax.tree_util.keystr(path)}: pass shardings= (a pytree, or one "
                "Sharding for all leaves) or a target whose leaves carry .sharding"
            )
        out.append(jax.ShapeDtypeStruct(tuple(x.shape), x.dtype, sharding=s))
    return jax.tree_util.tree_unflatten(treedef, out)


def layout(names: list[str], arrays: list[Any], meta: dict[str, Any] | None = None,
           step: int | None = None) -> dict[str, Any]:
    """The manifest of a version: each leaf's path, shape, dtype and aligned offset in params.bin,
    the publisher's `meta` (JSON; {} when none) and the trainer `step` whose params these are
    (None: not said). `arrays` need only .shape and .dtype."""
    leaves, offset = [], 0
    for name, a in zip(names, arrays):
        dtype = np.dtype(a.dtype)
        nbytes = int(np.prod(a.shape, dtype=np.int64)) * dtype.itemsize
        leaves.append({"path": name, "shape": list(a.shape), "dtype": str(dtype), "offset": offset})
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return {"format": VERSION_FORMAT, "bytes": offset, "leaves": leaves, "meta": dict(meta or {}),
            "step": None if step is None else int(step)}


_CHUNK = 1 << 20  # elements per host cast piece: a few MB, cast while the previous piece is written
_AHEAD = 3  # cast pieces dispatched before the writer needs them


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """One leaf to write: its source (a host or device array, maybe not yet in the stored dtype),
    the dtype it is stored as, and the casts of its pieces when they had to be dispatched early."""

    name: str
    source: Any
    dtype: np.dtype
    pieces: tuple[Any, ...] = ()

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.source.shape)


@functools.partial(jax.jit, static_argnames="dtype")
def _cast(x: jax.Array, dtype: np.dtype) -> jax.Array:
    return x.astype(dtype)


@functools.partial(jax.jit, static_argnames=("rows", "dtype"))
def _cast_rows(x: jax.Array, start: jax.Array, rows: int, dtype: np.dtype) -> jax.Array:
    """Rows [start, start + rows) of `x`, cast: one piece of a host leaf's cast (compiled once per
    leaf shape and piece size; the start is traced)."""
    return jax.lax.dynamic_slice_in_dim(x, start, rows, axis=0).astype(dtype)


def _row_pieces(shape: tuple[int, ...], chunk: int) -> list[tuple[int, int]]:
    """(first row, rows) pieces of about `chunk` elements covering axis 0 of `shape`."""
    per_row = int(np.prod(shape[1:], dtype=np.int64))
    step = max(1, chunk // max(per_row, 1))
    return [(r, min(step, shape[0] - r)) for r in range(0, shape[0], step)]


def _dispatch_casts(x: jax.Array, dtype: np.dtype, chunk: int) -> Iterator[jax.Array]:
    """The casts of a host jax leaf's pieces, each dispatched (asynchronously) when asked for."""
    if x.ndim == 0:
        yield _cast(x, dtype)
        return
    for start, rows in _row_pieces(x.shape, chunk):
        yield _cast_rows(x, start, rows, dtype)


def _on_host(x: Any) -> bool:
    """Whether `x`'s bytes are already in this process's memory (numpy, or the CPU backend)."""
    return isinstance(x, np.ndarray) or all(d.platform == "cpu" for d in x.devices())


def _publish_leaves(tree: Any, dtype: str | None, detach: bool) -> list[_Leaf]:
    """The leaves of a param tree as the writer needs them.

    Floating leaves are stored as `dtype` (None: as they are). Device (accelerator) leaves are
    cast there, where it is cheap, and their transfers to the host start at once, all of them, so
    that transferring leaf k+1 overlaps writing leaf k. Host leaves are cast by the writer, piece
    by piece (`_pieces`). With `detach` nothing may read the caller's buffers after this returns
    (the caller may donate or delete them as soon as `publish(wait=False)` returns): uncast leaves
    are copied to the host now, and the casts of host leaves' pieces are all dispatched now (jax
    keeps a donated input alive until the computations already reading it are done).
    """
    if dtype is not None and dtype not in PUBLISH_DTYPES:
        raise ValueError(f"publish dtype must be one of {PUBLISH_DTYPES} or None, got {dtype!r}")
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(x, np.generic):
            x = np.asarray(x)
        if not isinstance(x, (jax.Array, np.ndarray)):
            raise TypeError(
                f"param leaf {jax.tree_util.keystr(path)} is a {type(x).__name__}, not an array: publish a "
                "pure pytree of arrays, e.g. nnx.to_pure_dict(nnx.state(model, nnx.Param))"
            )
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            x = multihost_utils.process_allgather(x, tiled=True)  # collective: every process publishes
        name, stored, pieces = jax.tree_util.keystr(path), np.dtype(x.dtype), ()
        if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating):
            stored = jnp.dtype(dtype)
        if isinstance(x, np.ndarray):
            if detach:
                with np.errstate(over="ignore"):  # out of range -> inf, as jax's cast does
                    x = np.array(x, dtype=stored, copy=True)
        elif not _on_host(x):
            if x.dtype != stored:
                x = _cast(x, stored)
            elif detach:
                x = np.array(x, copy=True)  # the caller's buffer: copy it before returning
            if isinstance(x, jax.Array):
                x.copy_to_host_async()
        elif x.dtype != stored and detach:
            pieces = tuple(_dispatch_casts(x, stored, _CHUNK))
        elif detach:
            x = np.array(x, copy=True)
        out.append(_Leaf(name, x, stored, pieces))
    return out


def _pieces(
    leaves: list[_Leaf], chunk: int = _CHUNK, ahead: int = _AHEAD
) -> Iterator[tuple[int, np.ndarray]]:
    """(leaf index, contiguous host array) pieces whose bytes, in order, are each leaf's stored bytes.

    A host leaf that needs a cast comes in pieces of about `chunk` elements whose casts (jitted, on
    the leaf's CPU device) are dispatched `ahead` pieces before the caller asks for them: XLA runs
    them on its threads while the caller writes the previous piece, so a bf16 publish costs about
    a write of the bf16 bytes, not a cast of the whole tree and then a write. Small pieces keep the
    cast output in cache until it is written and bound the memory in flight. Everything else is
    one piece per leaf (a CPU array's own memory, or the host copy of a device array)."""

    def jobs() -> Iterator[tuple[int, Any]]:
        for i, leaf in enumerate(leaves):
            x = leaf.source
            if leaf.pieces:
                yield from ((i, p) for p in leaf.pieces)
            elif x.dtype == leaf.dtype:
                yield i, x
            elif isinstance(x, np.ndarray):  # numpy leaves (and multi-host gathered ones)
                flat = np.ascontiguousarray(x).reshape(-1)
                for s in range(0, flat.size, chunk):
                    with np.errstate(over="ignore"):  # out of range -> inf, as jax's cast does
                        cast = flat[s : s + chunk].astype(leaf.dtype)
                    yield i, cast
            else:
                yield from ((i, p) for p in _dispatch_casts(x, leaf.dtype, chunk))

    pending: collections.deque[tuple[int, Any]] = collections.deque()
    for job in jobs():
        pending.append(job)
        if len(pending) > ahead:
            i, x = pending.popleft()
            yield i, _host(x)
    while pending:
        i, x = pending.popleft()
        yield i, _host(x)


def _host(x: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x))


def _byte_view(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(np.uint8)


def _fsync_dir(path: os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _trailer(manifest: dict[str, Any]) -> bytes:
    text = json.dumps(manifest).encode()
    return text + _FOOTER.pack(_MAGIC, len(text))


def parse_trailer(tail: bytes, size: int, where: str) -> tuple[dict[str, Any], int]:
    """(manifest, its JSON length) from the last bytes of a params.bin of `size` bytes."""
    magic, n = _FOOTER.unpack(tail[-_FOOTER.size :])
    if magic != _MAGIC or n + _FOOTER.size > len(tail):
        raise ParamStoreError(f"{where} has no {VERSION_FORMAT} footer (truncated or not a tbajax file): delete the version")
    try:
        manifest = json.loads(tail[-_FOOTER.size - n : -_FOOTER.size])
    except json.JSONDecodeError as e:
        raise ParamStoreError(f"{where} has a corrupt manifest ({e}): delete the version") from e
    if manifest.get("format") != VERSION_FORMAT or manifest.get("bytes", -1) + n + _FOOTER.size != size:
        raise ParamStoreError(f"{where} is {size} bytes, its manifest says otherwise: delete the version")
    return manifest, n


def _replace_file(path: Any, data: bytes) -> None:
    """Atomically replace a small local file (write a temp file, rename it over), without fsync:
    for leases, which only matter while their reader lives (a crash ends the lease anyway)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _write_all(fd: int, data: Any) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]  # one write() moves at most ~2 GiB


def _stream(leaves: list[_Leaf], manifest: dict[str, Any], write: Any) -> None:
    """Call `write(bytes-like)` with params.bin's content in order: each leaf at its offset,
    zero padding between, the trailer last."""
    entries = manifest["leaves"]
    ends = [e["offset"] + int(np.prod(e["shape"], dtype=np.int64)) * np.dtype(e["dtype"]).itemsize
            for e in entries]

    def check_complete(i: int, pos: int) -> None:
        if max(pos, entries[i]["offset"]) != ends[i]:
            raise ParamStoreError(f"leaf {leaves[i].name} was written short ({pos} of {ends[i]}; a bug)")

    pos, current = 0, 0
    for i, piece in _pieces(leaves):
        if i != current:
            check_complete(current, pos)
            current = i
        if pos < entries[i]["offset"]:
            write(bytes(entries[i]["offset"] - pos))
            pos = entries[i]["offset"]
        if pos + piece.nbytes > ends[i]:
            raise ParamStoreError(f"leaf {leaves[i].name} produced more bytes than its shape holds (a bug)")
        write(_byte_view(piece))
        pos += piece.nbytes
    if entries:
        check_complete(current, pos)
    write(bytes(manifest["bytes"] - pos) + _trailer(manifest))


def _sync_file_range() -> Any:
    """libc's sync_file_range (Linux), or None where there is none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_START_WRITEBACK = _sync_file_range()  # (fd, offset, nbytes, SYNC_FILE_RANGE_WRITE = 2): start, don't wait
_WRITEBACK_EVERY = 8 << 20


class _FileWriter:
    """Writes to a file descriptor, starting the disk write-back of every `_WRITEBACK_EVERY` bytes
    as soon as they are written (where the OS offers it): the final fsync then waits for the last
    few MB instead of all of them. Only a hint to the kernel: durability still comes from fsync."""

    def __init__(self, fd: int):
        self.fd, self.pos, self.flushed = fd, 0, 0

    def __call__(self, data: Any) -> None:
        _write_all(self.fd, data)
        self.pos += memoryview(data).nbytes
        if _START_WRITEBACK is not None and self.pos - self.flushed >= _WRITEBACK_EVERY:
            _START_WRITEBACK(self.fd, self.flushed, self.pos - self.flushed, 2)
            self.flushed = self.pos


def _write_local(
    directory: Any, leaves: list[_Leaf], manifest: dict[str, Any], sync: concurrent.futures.Executor
) -> None:
    """params.bin (data + manifest) with one fsync, then the commit marker, made durable by an
    fsync of the version directory. The fsync that makes the new version directory's own entry
    durable runs on `sync` while the data is written (it only has to land before the pointer)."""
    directory = os.fspath(directory)
    os.makedirs(directory)  # a fresh version number: an existing directory is another writer's
    parent = sync.submit(_fsync_dir, os.path.dirname(directory))
    try:
        fd = os.open(os.path.join(directory, DATA_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _stream(leaves, manifest, _FileWriter(fd))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.close(os.open(os.path.join(directory, COMMIT_MARKER), os.O_WRONLY | os.O_CREAT, 0o644))
        _fsync_dir(directory)  # the marker is on disk
    finally:
        parent.result()  # and so is the version directory (waited for on errors too)


def _write_objects(kv: Any, version: int, leaves: list[_Leaf], manifest: dict[str, Any]) -> None:
    """Bucket stores: params.bin as one object, then the marker."""
    blob = bytearray()
    _stream(leaves, manifest, blob.extend)
    kv.write(f"{version}/{DATA_FILE}", blob).result()
    kv.write(f"{version}/{COMMIT_MARKER}", b"").result()


def _read_exact(f: Any, out: np.ndarray, offset: int) -> None:
    view = memoryview(_byte_view(out))
    f.seek(offset)
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise ParamStoreError(f"params file ends at byte {offset + got}, expected {offset + len(view)}")
        got += n


def _aligned_empty(shape: list[int], dtype: np.dtype) -> np.ndarray:
    """An uninitialised C-order array at a 64-byte aligned address: on the CPU backend jax then
    uses the host buffer as the device buffer (no copy), which halves a load's memory traffic."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def _place(host: np.ndarray, spec: jax.ShapeDtypeStruct) -> jax.Array:
    """A global array of `spec` (shape, dtype, sharding) whose local shards are cut from `host`."""
    if host.dtype == spec.dtype:
        return jax.make_array_from_callback(spec.shape, spec.sharding, lambda idx: host[idx])
    return jax.make_array_from_callback(spec.shape, spec.sharding, lambda idx: host[idx].astype(spec.dtype))


def pin_key(version: int) -> str:
    return f"{PINS_DIR}/{int(version)}.json"


def write_pin(kv: Any, version: int, step: int | None, extra: dict[str, Any]) -> None:
    """The durable keep record of `version` (one atomic, fsynced single-key write)."""
    write_json(kv, pin_key(version), {**extra, "version": int(version), "step": step, "time": time.time()})


def read_pins(kv: Any, url: str) -> list[dict[str, Any]]:
    """Every pin record under the store, by version (a pin deleted between list and read is skipped)."""
    out = []
    for key in list_keys(kv, PINS_DIR + "/"):
        if not key.endswith(".json"):
            continue
        record, _ = read_json(kv, key)
        if record is None:
            continue
        if not isinstance(record.get("version"), int):
            raise ParamStoreError(f"pin {url}/{key} is malformed ({record!r}); delete it")
        out.append(record)
    return sorted(out, key=lambda r: r["version"])


class _VersionDirs:
    """Listing and completeness checks of version directories (shared by publisher and reader)."""

    def __init__(self, url: str):
        self.url = to_url(url)
        self.root = path_for_orbax(self.url)
        self.kv = open_kvstore(self.url)

    def path(self, version: int) -> Any:
        return self.root / str(version)

    def is_complete(self, version: int) -> bool:
        p = self.path(version)
        return p.is_dir() and (p / COMMIT_MARKER).exists()

    def entries(self) -> list[tuple[int, Any]]:
        """(version, path) of every version directory, complete or not (incl. orbax temp dirs)."""
        if not self.root.exists():
            return []
        out = []
        for p in self.root.iterdir():
            m = _VERSION_DIR.match(p.name)
            if m:
                out.append((int(m.group(1)), p))
        return sorted(out, key=lambda e: (e[0], e[1].name))

    def complete_versions(self, up_to: int) -> list[int]:
        return sorted({v for v, p in self.entries() if p.name == str(v) and v <= up_to and self.is_complete(v)})

    def pointer(self) -> tuple[PublishedVersion | None, bytes]:
        try:
            record, generation = read_json(self.kv, LATEST_KEY)
        except ValueError as e:  # not JSON: a torn or hand-edited file
            raise ParamPointerCorrupt(
                f"{self.url}/{LATEST_KEY} is corrupt ({e}); delete it: the trainer rebuilds it from the "
                "newest complete version directory (e.g. on --resume)"
            ) from e
        if record is None:
            return None, generation
        if record.get("format") != FORMAT:
            raise ParamStoreError(
                f"{self.url}/{LATEST_KEY} is not a {FORMAT} pointer ({record!r}); delete it or use another run dir"
            )
        fields = (("version", int), ("run_id", str), ("time", (int, float)))
        missing = [k for k, t in fields if not isinstance(record.get(k), t)]
        if missing:
            raise ParamStoreError(
                f"{self.url}/{LATEST_KEY} lacks a valid {', '.join(missing)} field ({record!r}); delete the file: "
                "the trainer rebuilds it from the newest complete version directory (e.g. on --resume)"
            )
        return (
            PublishedVersion(
                version=record["version"],
                run_id=str(record["run_id"]),
                step=record.get("step"),
                dtype=record.get("dtype"),
                time=float(record["time"]),
            ),
            generation,
        )

    def raw_generation(self) -> bytes:
        return self.kv.read(LATEST_KEY).result().stamp.generation


class ParamPublisher:
    """Trainer side: publish params as increasing versions and garbage-collect old ones.

    `publish(..., wait=False)` returns once the params are copied to the host (the caller may
    donate them); the write, the pointer update and garbage collection then finish in the
    background, and the next `publish`/`wait`/`close` joins them and re-raises their errors.
    In a multi-host trainer every process calls `publish` (sharded leaves are gathered
    collectively) and process 0 alone writes the version and the pointer, and collects.
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        run_id: str,
        *,
        dtype: str | None = "bfloat16",
        keep: int = 3,
        lease_timeout_s: float = 600.0,
    ):
        if dtype is not None and dtype not in PUBLISH_DTYPES:
            raise ValueError(f"publish dtype must be one of {PUBLISH_DTYPES} or None, got {dtype!r}")
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (the latest version is always kept), got {keep}")
        if not run_id:
            raise ValueError("run_id must be a non-empty string")
        self.url = to_url(url)
        self.run_id = run_id
        self.dtype = dtype
        self.keep = keep
        self.lease_timeout_s = lease_timeout_s
        self._dirs = _VersionDirs(self.url)
        try:
            pointer, self._pointer_generation = self._dirs.pointer()
        except ParamPointerCorrupt as e:
            log.warning("%s", e)
            pointer, self._pointer_generation = None, self._dirs.raw_generation()
        if pointer is None:
            pointer = self._rebuild_pointer(run_id)
        if pointer is not None and pointer.run_id != run_id:
            raise ParamStoreError(
                f"{self.url} holds params of run {pointer.run_id!r}, not {run_id!r}: resume with the same "
                "run id, or publish to a fresh run directory"
            )
        self._latest = pointer.version if pointer is not None else 0
        on_disk = max((v for v, _ in self._dirs.entries()), default=0)
        self._next_version = max(self._latest, on_disk) + 1
        self._primary = jax.process_index() == 0
        self._local = local_path(self.url)
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="param-publish")
        self._dirsync = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="param-dirsync")
        self._pending: concurrent.futures.Future[None] | None = None
        self._pending_gc: concurrent.futures.Future[list[int]] | None = None

    def _rebuild_pointer(self, run_id: str) -> PublishedVersion | None:
        """A missing (deleted) or corrupt pointer with complete version dirs on disk: point at the
        newest complete one again, so versions continue above it instead of restarting at 1."""
        complete = self._dirs.complete_versions(up_to=2**62)
        if not complete:
            return None
        if jax.process_index() != 0:
            raise ParamStoreError(f"{self.url}/{LATEST_KEY} is missing; process 0 rebuilds it, retry after it has")
        record = {"format": FORMAT, "run_id": run_id, "version": complete[-1], "step": None, "dtype": self.dtype,
                  "time": time.time(), "rebuilt": True}
        generation = write_json(self._dirs.kv, LATEST_KEY, record, if_equal=self._pointer_generation)
        if generation is None:
            raise ParamStoreError(f"{self.url}/{LATEST_KEY} changed while this publisher rebuilt it: another trainer?")
        log.warning("rebuilt %s/%s: it now points at version %d, the newest complete version directory",
                    self.url, LATEST_KEY, complete[-1])
        self._pointer_generation = generation
        return PublishedVersion(complete[-1], run_id, None, self.dtype, record["time"])

    def latest_version(self) -> int | None:
        """The newest version this publisher (or its predecessor) has made visible."""
        return self._latest or None

    @property
    def next_version(self) -> int:
        """The number the next `publish` will use (above every version dir ever written)."""
        return self._next_version

    def publish(
        self, params: Any, meta: dict[str, Any] | None = None, *, step: int | None = None, wait: bool = True,
        pin: dict[str, Any] | None = None,
    ) -> int:
        """Save `params` as the next version; returns that version number.

        meta: JSON-serialisable description stored in the version's manifest (readers get it
        from `restore_for`), e.g. that the leaves are LoRA adapters and for which base.
        pin: keep this version, whatever `keep` says, until a reader `unpin`s it; the dict (JSON)
        goes into the pin record beside "version", "step" and "time" (written before the pointer,
        so no reader sees the version unpinned)."""
        self.wait()
        meta = dict(meta or {})
        json.dumps(meta)  # not serialisable: fail here, not in the background writer
        if pin is not None:
            pin = dict(pin)
            json.dumps(pin)
        leaves = _publish_leaves(params, self.dtype, detach=not wait)
        version = self._next_version
        self._next_version += 1
        if wait:  # written by this thread: no hand-off to the writer thread and back
            self._finish(version, step, leaves, meta, pin)
        else:
            self._pending = self._executor.submit(self._finish, version, step, leaves, meta, pin)
        return version

    def wait(self) -> None:
        """Block until the last publish is visible and collected; re-raise its error if any."""
        self._join(visible_only=False)

    def _join(self, visible_only: bool) -> None:
        """Join the pending write; then, unless `visible_only`, the garbage collection queued after it.

        `publish(wait=True)` returns once searchers can load the version: deleting old versions
        (unlinking files of hundreds of MB) runs behind it and is joined by the next call."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()
        if not visible_only:
            gc, self._pending_gc = self._pending_gc, None
            if gc is not None:
                gc.result()

    def _finish(self, version: int, step: int | None, leaves: list[_Leaf], meta: dict[str, Any],
                pin: dict[str, Any] | None = None) -> None:
        if not self._primary:
            self._latest = version
            return
        manifest = layout([leaf.name for leaf in leaves], leaves, meta, step)
        if self._local is not None:
            _write_local(self._local / str(version), leaves, manifest, self._dirsync)
        else:
            _write_objects(self._dirs.kv, version, leaves, manifest)
        if pin is not None:
            write_pin(self._dirs.kv, version, step, pin)
        record = {
            "format": FORMAT,
            "run_id": self.run_id,
            "version": version,
            "step": step,
            "dtype": self.dtype,
            "time": time.time(),
        }
        generation = write_json(self._dirs.kv, LATEST_KEY, record, if_equal=self._pointer_generation)
        if generation is None:
            raise ParamStoreError(
                f"{self.url}/{LATEST_KEY} changed under this publisher: another trainer is publishing to the "
                "same run directory"
            )
        self._pointer_generation = generation
        self._latest = version
        self._pending_gc = self._executor.submit(self._collect)  # after this, on the same worker

    def gc(self) -> list[int]:
        """Delete old versions now; returns the deleted version numbers."""
        self.wait()
        return self._collect() if self._primary else []

    def leased_versions(self) -> set[int]:
        """Versions under a lease younger than `lease_timeout_s`."""
        now = time.time()
        leased = set()
        for key in list_keys(self._dirs.kv, READERS_DIR + "/"):
            if not key.endswith(".json"):
                continue
            record, _ = read_json(self._dirs.kv, key)
            if record is None:  # released between list and read
                continue
            if not isinstance(record.get("version"), int) or not isinstance(record.get("time"), (int, float)):
                raise ParamStoreError(f"lease {self.url}/{key} is malformed ({record!r}); delete it")
            if now - record["time"] < self.lease_timeout_s:
                leased.add(record["version"])
        return leased

    def pins(self) -> list[dict[str, Any]]:
        """The pin records (see `publish(pin=...)`), by version."""
        return read_pins(self._dirs.kv, self.url)

    def unpin(self, version: int) -> None:
        """Let GC collect `version` again (a pinned version whose params were rolled back)."""
        delete_key(self._dirs.kv, pin_key(version))

    def _collect(self) -> list[int]:
        entries = self._dirs.entries()
        complete = self._dirs.complete_versions(self._latest)
        kept = set(complete[-self.keep :]) | self.leased_versions() | {p["version"] for p in self.pins()}
        deleted = []
        for version, path in entries:
            if version in kept or version >= self._next_version:
                continue
            marker = path / COMMIT_MARKER
            if marker.exists():  # a half-deleted version must look incomplete
                marker.unlink()
            path.rmtree()
            deleted.append(version)
        return sorted(set(deleted))

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            self._dirsync.shutdown(wait=True)

    def __enter__(self) -> ParamPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ParamReader:
    """Searcher side: find the newest version cheaply and restore it into this process's mesh."""

    def __init__(self, url: str | os.PathLike[str], reader_id: str, *, run_id: str | None = None):
        if not _READER_ID.match(reader_id):
            raise ValueError(f"reader_id must match {_READER_ID.pattern} (it names a lease file), got {reader_id!r}")
        self.url = to_url(url)
        self.reader_id = reader_id
        self.run_id = run_id
        self._dirs = _VersionDirs(self.url)
        self._local = local_path(self.url)

    def latest(self) -> PublishedVersion | None:
        """The pointer record (one small read, never waits for the trainer); None before any publish."""
        pointer, _ = self._dirs.pointer()
        if pointer is not None and self.run_id is not None and pointer.run_id != self.run_id:
            raise ParamStoreError(f"{self.url} holds params of run {pointer.run_id!r}, expected {self.run_id!r}")
        return pointer

    def latest_version(self) -> int | None:
        pointer = self.latest()
        return None if pointer is None else pointer.version

    def versions(self) -> list[int]:
        """Complete, published versions still on storage."""
        latest = self.latest_version()
        return [] if latest is None else self._dirs.complete_versions(latest)

    def pins(self) -> list[dict[str, Any]]:
        """The pinned versions' records (`ParamPublisher.publish(pin=...)`), by version."""
        return read_pins(self._dirs.kv, self.url)

    def unpin(self, version: int) -> None:
        """Done with a pinned version: GC may collect it once `keep` newer ones exist."""
        delete_key(self._dirs.kv, pin_key(version))

    def is_available(self, version: int) -> bool:
        """Whether `version` is complete and still on storage (not garbage-collected)."""
        latest = self.latest_version()
        return latest is not None and 0 < version <= latest and self._dirs.is_complete(version)

    def version_step(self, version: int) -> int | None:
        """The trainer step recorded in `version`'s manifest (None: published without one, or
        written before manifests had steps). Reads only the file's tail."""
        self._require_available(version)
        where = f"{self.url}/{version}/{DATA_FILE}"
        if self._local is not None:
            with open(self._data_path(version), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                f.seek(max(0, size - (1 << 16)))
                tail = f.read()
                if len(tail) < _FOOTER.size:
                    raise ParamStoreError(f"{where} is {size} bytes, too short for a {VERSION_FORMAT} file")
                manifest, n = parse_trailer(tail, size, where)
                if n + _FOOTER.size > len(tail):
                    f.seek(size - n - _FOOTER.size)
                    manifest, _ = parse_trailer(f.read(), size, where)
        else:
            data = self._dirs.kv.read(f"{version}/{DATA_FILE}").result()
            if data.state != "value":
                raise self._legacy(version)
            manifest, _ = parse_trailer(data.value, len(data.value), where)
        step = manifest.get("step")
        return None if step is None else int(step)

    def _require_available(self, version: int) -> None:
        latest = self.latest_version()
        if latest is None:
            raise ParamVersionError(f"no params have been published to {self.url} yet")
        if not (isinstance(version, (int, np.integer)) and 0 < version <= latest and self._dirs.is_complete(version)):
            raise ParamVersionError(
                f"param version {version!r} is not available in {self.url}: complete versions are "
                f"{self.versions()} (latest {latest}); older ones are garbage-collected"
            )

    @contextlib.contextmanager
    def lease(self, version: int, renew_every_s: float = 30.0) -> Iterator[None]:
        """Hold a lease on `version` so the publisher's GC keeps it while inside the block.

        A heartbeat thread rewrites the lease every `renew_every_s`, so a restore slower than the
        publisher's lease timeout (a large model on a slow bucket) does not lose its version."""
        key = f"{READERS_DIR}/{self.reader_id}.json"

        def write() -> None:
            record = {"version": int(version), "time": time.time(), "pid": os.getpid(), "host": socket.gethostname()}
            if self._local is None:
                write_json(self._dirs.kv, key, record)
            else:
                _replace_file(self._local / key, json.dumps(record, sort_keys=True).encode())

        write()
        done = threading.Event()

        def heartbeat() -> None:
            while not done.wait(renew_every_s):
                try:
                    write()
                except Exception as e:  # noqa: BLE001 - a failed renewal must not kill the restore
                    log.warning("could not renew the lease %s/%s: %s", self.url, key, e)

        thread = threading.Thread(target=heartbeat, name=f"lease-{self.reader_id}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()
            if self._local is None:
                delete_key(self._dirs.kv, key)
            else:
                (self._local / key).unlink(missing_ok=True)

    def restore(self, version: int, target: Any, shardings: Any = None) -> Any:
        """Load `version` into arrays shaped/typed like `target`, placed with `shardings`.

        The searcher's mesh may differ from the trainer's: each leaf is read once and this
        process's shards of the requested sharding are cut from it. Stored dtypes are cast to
        the target's (a bf16 publish loads into bf16 without a cast).
        """
        abstract = abstract_target(target, shardings)
        return self.restore_for(version, lambda meta: abstract)[0]

    def restore_for(self, version: int, target_for: Any) -> tuple[Any, dict[str, Any]]:
        """(arrays, meta) of `version`, where the target depends on what was published:
        `target_for(meta)` gets the version's meta (see `ParamPublisher.publish`) and returns the
        target (leaves with shapes, dtypes and shardings, as `abstract_target` makes)."""
        self._require_available(version)
        with self.lease(version):
            self._require_available(version)  # GC may have deleted it before our lease landed
            return self._load(int(version), target_for)

    def _load(self, version: int, target_for: Any) -> tuple[Any, dict[str, Any]]:
        if self._local is not None:
            with open(self._data_path(version), "rb", buffering=0) as f:
                return self._load_from(version, target_for, f, os.fstat(f.fileno()).st_size)
        data = self._dirs.kv.read(f"{version}/{DATA_FILE}").result()
        if data.state != "value":
            raise self._legacy(version)
        return self._load_from(version, target_for, io.BytesIO(data.value), len(data.value))

    def _data_path(self, version: int) -> Any:
        path = self._local / str(version) / DATA_FILE
        if not path.exists():
            raise self._legacy(version)
        return path

    def _legacy(self, version: int) -> ParamStoreError:
        return ParamStoreError(
            f"{self.url}/{version} has no {DATA_FILE}: it was written in the orbax format of an older tbajax; "
            "publish a new version (restart the trainer with --resume) and load that"
        )

    def _load_from(self, version: int, target_for: Any, f: Any, size: int) -> tuple[Any, dict[str, Any]]:
        where = f"{self.url}/{version}/{DATA_FILE}"
        tail_n = min(size, 1 << 16)
        f.seek(size - tail_n)
        tail = f.read(tail_n)
        if len(tail) < _FOOTER.size:
            raise ParamStoreError(f"{where} is {size} bytes, too short for a {VERSION_FORMAT} file: delete the version")
        manifest, n = parse_trailer(tail, size, where)
        if n + _FOOTER.size > tail_n:  # a manifest of more than 64 KiB: read all of it
            f.seek(size - n - _FOOTER.size)
            manifest, _ = parse_trailer(f.read(n + _FOOTER.size), size, where)
        meta = dict(manifest.get("meta") or {})  # versions written before meta existed: {}
        abstract = target_for(meta)
        stored = {leaf["path"]: leaf for leaf in manifest["leaves"]}
        specs, treedef = jax.tree_util.tree_flatten_with_path(abstract)
        names = [jax.tree_util.keystr(path) for path, _ in specs]
        missing, unexpected = sorted(set(names) - set(stored)), sorted(set(stored) - set(names))
        if missing or unexpected:
            raise ParamStoreError(
                f"version {version} in {self.url} does not match the target: target leaves not stored "
                f"{missing[:5]}, stored leaves not in the target {unexpected[:5]}; load it with the model it "
                "was published from"
            )
        for name, (_, spec) in zip(names, specs):
            if tuple(stored[name]["shape"]) != tuple(spec.shape):
                raise ParamStoreError(
                    f"leaf {name} of version {version} in {self.url} has shape {tuple(stored[name]['shape'])}, "
                    f"the target {tuple(spec.shape)}"
                )
        # One aligned buffer for all the data, filled by one sequential read; the leaves are views
        # into it (64-byte aligned offsets: the CPU backend adopts each without a copy). One large
        # allocation and one read cost half of a buffer and a read per leaf (the page faults of
        # many mid-sized allocations dominate otherwise).
        data = _aligned_empty([manifest["bytes"]], np.dtype(np.uint8))
        _read_exact(f, data, 0)
        hosts = []
        for name in names:
            leaf = stored[name]
            dtype = np.dtype(jnp.dtype(leaf["dtype"]))
            nbytes = int(np.prod(leaf["shape"], dtype=np.int64)) * dtype.itemsize
            hosts.append(data[leaf["offset"] : leaf["offset"] + nbytes].view(dtype).reshape(leaf["shape"]))
        return jax.tree_util.tree_unflatten(treedef, [_place(h, spec) for h, (_, spec) in zip(hosts, specs)]), meta

    def close(self) -> None:
        """Nothing to release (kept so readers work as context managers)."""

    def __enter__(self) -> ParamReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
