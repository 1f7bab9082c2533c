"""TensorBoard scalar event files, written directly (TFRecord framing + hand-encoded Event protos).

A run writes scalars only. Writing the 50-byte records ourselves keeps TensorBoard output free
of dependencies: tensorboardX imports torch whenever it is installed (3+ s at the start of
every role process), and the tensorboard package brings protobuf and its own stack. The file is
what TensorBoard, tensorboardX and `tf.summary` write: `events.out.tfevents.<time>.<host>`, a
`brain.Event:2` header record, then one Event per (step, tag) with a `simple_value` summary.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path


def _crc32c_table() -> tuple[int, ...]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return tuple(table)


_CRC32C = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), the checksum of TFRecord framing."""
    crc = 0xFFFFFFFF
    for b in data:
        crc = _CRC32C[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(data: bytes) -> bytes:
    """One record: length, masked CRC of the length, data, masked CRC of the data."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 fields: two's complement, as protobuf does
    out = bytearray()
    while True:
        low = n & 0x7F
        n >>= 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _field_bytes(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event_bytes(wall_time: float, step: int = 0, *, tag: str | None = None, value: float = 0.0,
                file_version: str | None = None) -> bytes:
    """A serialized `tensorflow.Event`: wall_time (1, double), step (2, int64), file_version
    (3, string) or summary (5) holding one Summary.Value {tag (1), simple_value (2, float)}."""
    out = b"\x09" + struct.pack("<d", wall_time)
    if step:
        out += b"\x10" + _varint(step)
    if file_version is not None:
        out += _field_bytes(3, file_version.encode())
    if tag is not None:
        summary_value = _field_bytes(1, tag.encode()) + b"\x15" + struct.pack("<f", value)
        out += _field_bytes(5, _field_bytes(1, summary_value))
    return out


class ScalarEventWriter:
    """Appends scalar events to one new event file in `log_dir`; flushes on every `flush()`."""

    def __init__(self, log_dir: str | Path):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        name = f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}.{os.getpid()}"
        self.path = self.log_dir / name
        self._file = open(self.path, "ab")
        self._file.write(tfrecord(event_bytes(now, file_version="brain.Event:2")))
        self._file.flush()

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._file.write(tfrecord(event_bytes(time.time(), int(step), tag=tag, value=float(value))))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
