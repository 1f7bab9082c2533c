"""Lazy, zero-copy safetensors reading and writing (single file or sharded with an index).

Our own ~100-line reader instead of `safetensors.numpy` because we need bf16 (via ml_dtypes)
and memory-mapped views: loading a 7B checkpoint into a sharded mesh reads each tensor slice
straight from the page cache, never a full copy of the model in host memory.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


@functools.cache
def _dtypes() -> dict[str, np.dtype]:
    """Safetensors dtype names -> numpy dtypes. Built on first use: ml_dtypes (for BF16) costs
    over a second to import, which the launcher's header check never needs."""
    import ml_dtypes

    table = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
             "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
    return {k: np.dtype(v) for k, v in table.items()}


INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(FileNotFoundError):
    """A checkpoint directory is missing files or tensors."""


class SafetensorsReader:
    """All tensors of a checkpoint directory, opened lazily as memory maps."""

    def __init__(self, directory: str | os.PathLike[str]):
        self.directory = Path(directory)
        index = self.directory / INDEX_FILE
        if index.exists():
            weight_map: Mapping[str, str] = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif (self.directory / SINGLE_FILE).exists():
            files = [SINGLE_FILE]
        else:
            found = sorted(p.name for p in self.directory.glob("*.safetensors"))
            if len(found) == 1:
                files = found
            else:
                raise CheckpointError(
                    f"no {SINGLE_FILE} or {INDEX_FILE} in {self.directory} "
                    f"(found: {found or 'no .safetensors files'}); export the model as safetensors "
                    "(transformers: save_pretrained(..., safe_serialization=True))"
                )
        self._entries: dict[str, tuple[Path, str, tuple[int, ...], int, int]] = {}
        for name in files:
            path = self.directory / name
            if not path.exists():
                raise CheckpointError(f"{path} is listed in {INDEX_FILE} but missing")
            for key, entry in _read_header(path).items():
                self._entries[key] = (path, *entry)
        self._maps: dict[Path, np.memmap] = {}

    def keys(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[2]

    def get(self, name: str) -> np.ndarray:
        """A read-only memory-mapped view of one tensor."""
        path, dtype_name, shape, start, end = self._entry(name)
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        return self._maps[path][start:end].view(_dtypes()[dtype_name]).reshape(shape)

    def _entry(self, name: str) -> tuple[Path, str, tuple[int, ...], int, int]:
        try:
            return self._entries[name]
        except KeyError:
            raise CheckpointError(
                f"tensor {name!r} is not in the checkpoint at {self.directory}"
            ) from None


def _read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """Entries of one file's header, each checked against the file: a header that is cut, not
    JSON, or whose tensors reach past the end of the data (a file truncated by a failed copy or
    a full disk) is a CheckpointError naming the file, found before any tensor is read."""

    def corrupt(why: str) -> CheckpointError:
        return CheckpointError(
            f"{path} is corrupt or truncated: {why}; download or export the checkpoint again"
        )

    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise corrupt(f"{size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise corrupt(f"the header says it is {n} bytes but only {size - 8} follow")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise corrupt(f"the {n}-byte header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise corrupt("the header is not a JSON object")
    base = 8 + n
    data_size = size - base
    out = {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype_name, shape, (start, end) = meta["dtype"], tuple(int(d) for d in meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise corrupt(f"tensor {key!r} has a malformed header entry {meta!r}") from None
        if dtype_name not in _ITEMSIZE:
            raise CheckpointError(f"{path}: tensor {key!r} has unsupported dtype {dtype_name}")
        expected = int(np.prod(shape, dtype=np.int64)) * _ITEMSIZE[dtype_name]
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end) or end - start != expected:
            raise corrupt(f"tensor {key!r} of shape {list(shape)} {dtype_name} needs {expected} bytes but its "
                          f"offsets are {[start, end]}")
        if end > data_size:
            raise corrupt(f"tensor {key!r} ends at data byte {end} but the file holds only {data_size} bytes of data")
        out[key] = (dtype_name, shape, base + start, base + end)
    return out


def write_safetensors(path: str | os.PathLike[str], tensors: Mapping[str, np.ndarray]) -> None:
    """Write one safetensors file (format: u64 header size, JSON header, raw little-endian data)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    arrays = []
    names = {v: k for k, v in _dtypes().items()}
    for key in sorted(tensors):
        a = np.ascontiguousarray(tensors[key])
        if a.dtype not in names:
            raise TypeError(f"tensor {key!r}: dtype {a.dtype} cannot be written to safetensors")
        header[key] = {"dtype": names[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep the data 8-byte aligned
    tmp = Path(f"{path}.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            f.write(a.tobytes())
    os.replace(tmp, path)


def write_sharded(
    directory: str | os.PathLike[str],
    tensors: Iterable[tuple[str, np.ndarray]],
    max_shard_bytes: int = 5 * 2**30,
) -> list[str]:
    """Write tensors into one file, or several plus `model.safetensors.index.json` when large.

    `tensors` may be a generator so that only one shard is held in host memory at a time.
    """
    directory = Path(directory)
    shards: list[dict[str, np.ndarray]] = [{}]
    sizes = [0]
    names: list[str] = []
    weight_map: dict[str, int] = {}
    total = 0

    def flush(i: int) -> None:
        name = f"model-{i + 1:05d}.safetensors"
        write_safetensors(directory / name, shards[i])
        names.append(name)
        shards[i] = {}

    for key, a in tensors:
        if sizes[-1] and sizes[-1] + a.nbytes > max_shard_bytes:
            flush(len(shards) - 1)
            shards.append({})
            sizes.append(0)
        shards[-1][key] = a
        sizes[-1] += a.nbytes
        weight_map[key] = len(shards) - 1
        total += a.nbytes
    if len(shards) == 1:
        write_safetensors(directory / SINGLE_FILE, shards[0])
        return [SINGLE_FILE]
    flush(len(shards) - 1)
    # rename to the HF convention model-0000i-of-0000n.safetensors
    n = len(names)
    final = []
    for i, name in enumerate(names):
        new = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(directory / name, directory / new)
        final.append(new)
    index = {"metadata": {"total_size": total}, "weight_map": {k: final[i] for k, i in weight_map.items()}}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return final
