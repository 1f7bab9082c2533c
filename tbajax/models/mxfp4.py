"""MXFP4 dequantization for loading GPT-OSS checkpoints.

OpenAI's released GPT-OSS checkpoints (e.g. openai/gpt-oss-20b) store the MoE expert weights in
MXFP4: each `<name>_blocks` uint8 tensor [..., G, 16] packs two FP4 (E2M1) codes per byte, and
`<name>_scales` [..., G] holds one shared power-of-two exponent (bias 127) per group of 32 values.
tbajax trains in bf16/fp32 and has no FP4 kernels, so these tensors are dequantized on load, as
transformers does without its triton kernels (`transformers/integrations/mxfp4.py`,
`convert_moe_packed_tensors`), giving bit-identical values in the unquantized checkpoint layout.
"""

from __future__ import annotations

import functools
import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import numpy as np
from numpy.typing import DTypeLike

from tbajax.models.safetensors_io import CheckpointError

# E2M1 values indexed by their 4-bit code (sign bit 3); the same table as transformers' FP4_VALUES.
FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
QUANTIZED_SUFFIXES = ("_blocks", "_scales")


class MXFP4Error(CheckpointError):
    """A checkpoint's MXFP4 tensors are incomplete or inconsistent."""


@functools.cache
def _pair_table() -> np.ndarray:
    """[256 * 256] uint64; entry `scale * 256 + byte` holds, as two float32, the byte's (low, high)
    nibble values times 2**(scale - 127).

    Built with float32 ldexp, which is exact (and saturates to inf only when the true value
    overflows), like torch.ldexp. Looking values up instead of scaling them makes dequantizing a
    single gather of 8-byte words (several times faster than gathering [2] float32 rows), with no
    temporary besides a uint16 index.
    """
    codes = np.arange(256)
    values = np.asarray(FP4_VALUES, np.float32)
    pairs = np.stack([values[codes & 0x0F], values[codes >> 4]], axis=-1)  # [byte, 2]
    exponents = (np.arange(256) - SCALE_BIAS).astype(np.int32)
    with np.errstate(over="ignore"):
        table = np.ldexp(pairs[None], exponents[:, None, None])  # [scale, byte, 2]
    table = np.ascontiguousarray(table, np.float32).view(np.uint64).reshape(-1)
    table.setflags(write=False)
    return table


def _check(blocks: np.ndarray, scales: np.ndarray) -> None:
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.ndim < 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks of shape {blocks.shape} need scales of shape {blocks.shape[:-1]}, "
                         f"got {scales.shape} (expected [..., groups, bytes] and [..., groups])")


def dequantize(blocks: np.ndarray, scales: np.ndarray, dtype: DTypeLike = np.float32) -> np.ndarray:
    """[..., G, B] uint8 codes and [..., G] uint8 exponents -> [..., G * 2B] values in `dtype`.

    The low nibble of each byte is the even element and the high nibble the odd one. Values are
    computed in float32 (exactly torch.ldexp's float32 result) and then cast; FP4 values times powers
    of two are exact in bf16 too. Unlike transformers this does not transpose the result.
    """
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    _check(blocks, scales)
    index = (scales.astype(np.uint16) << 8)[..., None] | blocks
    values = np.take(_pair_table(), index).view(np.float32)  # [..., G, 2B]
    out = values.reshape(*scales.shape[:-1], blocks.shape[-2] * blocks.shape[-1] * 2)
    return out if np.dtype(dtype) == np.float32 else out.astype(dtype)


ROWS_PER_TASK = 512  # output rows a thread dequantizes at once (GPT-OSS's projections: 2,880 / 5,760)


def dequantize_transposed(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """[..., R, G, B] and [..., R, G] -> [..., G * 2B, R] float32, i.e. transformers'
    `convert_moe_packed_tensors(...).transpose(1, 2)` (GPT-OSS's unquantized expert layout).

    Dequantizes ROWS_PER_TASK rows of one leading index (one expert) at a time, so that the
    transpose stays in cache and never needs a second full-size copy, on a thread per core
    (numpy's lookups and copies release the GIL): `experiments/benchmarks/mxfp4.py` times it
    against one thread over whole experts.
    """
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    _check(blocks, scales)
    if blocks.ndim < 3:
        raise ValueError(f"MXFP4 blocks to transpose need at least 3 axes [..., rows, groups, bytes], "
                         f"got shape {blocks.shape}")
    *prefix, rows, groups, width = blocks.shape
    out = np.empty((*prefix, groups * 2 * width, rows), np.float32)
    n = math.prod(prefix)
    flat_out = out.reshape(n, groups * 2 * width, rows)
    flat_blocks = blocks.reshape(n, rows, groups, width)
    flat_scales = scales.reshape(n, rows, groups)

    def one(task: tuple[int, int]) -> None:
        i, start = task
        rows_ = slice(start, start + ROWS_PER_TASK)
        flat_out[i, :, rows_] = dequantize(flat_blocks[i, rows_], flat_scales[i, rows_]).T

    tasks = [(i, start) for i in range(n) for start in range(0, rows, ROWS_PER_TASK)]
    with ThreadPoolExecutor(max(1, min(len(tasks), os.cpu_count() or 1))) as pool:
        list(pool.map(one, tasks))
    return out



class TensorReader(Protocol):
    """What DequantizingReader needs of a reader (SafetensorsReader has it)."""

    directory: object

    def keys(self) -> list[str]: ...

    def __contains__(self, name: str) -> bool: ...

    def get(self, name: str) -> np.ndarray: ...

    def shape(self, name: str) -> tuple[int, ...]: ...


class DequantizingReader:
    """A reader that shows each MXFP4 pair `X_blocks` + `X_scales` as one float32 tensor `X`.

    Loaders written for unquantized checkpoints then read GPT-OSS's released checkpoints unchanged:
    `X` has the layout of the unquantized tensor (transformers' transpose(1, 2)), its shape is known
    without dequantizing, and every other tensor passes through untouched.
    """

    def __init__(self, reader: TensorReader):
        self.reader = reader
        self.directory = reader.directory
        self._pairs = _find_pairs(reader)
        self._hidden = {name + suffix for name in self._pairs for suffix in QUANTIZED_SUFFIXES}
        self._keys = sorted([k for k in reader.keys() if k not in self._hidden] + list(self._pairs))

    def keys(self) -> list[str]:
        return list(self._keys)

    def __contains__(self, name: str) -> bool:
        return name in self._pairs or (name not in self._hidden and name in self.reader)

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._pairs:
            *prefix, rows, groups, width = self.reader.shape(self._pairs[name][0])
            return (*prefix, groups * 2 * width, rows)
        return self.reader.shape(name)

    def get(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """The tensor, or its part `index` (unit-step slices, leading axes first); a dequantized,
        transposed, fresh float32 array for an MXFP4 pair, of which only the experts, output rows
        and groups of 32 inputs that `index` covers are dequantized (a device's shard of a
        120B model's experts, not the whole layer's)."""
        if name not in self._pairs:
            tensor = self.reader.get(name)
            return tensor if index is None else tensor[index]
        blocks, scales = (self.reader.get(n) for n in self._pairs[name])
        shape, index = self.shape(name), index or ()
        *lead, inputs, outputs = [range(*s.indices(n)) for s, n in
                                  zip((*index, *[slice(None)] * (len(shape) - len(index))), shape)]
        if any(r.step != 1 for r in (*lead, inputs, outputs)):
            raise ValueError(f"MXFP4 tensor {name!r} is read in unit-step slices, got {index}")
        group = 2 * blocks.shape[-1]  # inputs per group
        first, last = inputs.start // group, -(-inputs.stop // group)
        part = tuple(slice(r.start, r.stop) for r in lead) + (slice(outputs.start, outputs.stop),
                                                              slice(first, last))
        values = dequantize_transposed(blocks[part], scales[part])  # [..., groups' inputs, outputs]
        start, stop = inputs.start - first * group, inputs.stop - first * group
        return values if (start, stop) == (0, values.shape[-2]) else values[..., start:stop, :]


def _find_pairs(reader: TensorReader) -> dict[str, tuple[str, str]]:
    """{X: (X_blocks, X_scales)} for the reader's MXFP4 tensors, checked for completeness and shape
    when the reader is built, so that a broken checkpoint fails before any weight is loaded."""
    blocks_suffix, scales_suffix = QUANTIZED_SUFFIXES
    keys = set(reader.keys())
    bases = {k[: -len(s)] for k in keys for s in QUANTIZED_SUFFIXES if k.endswith(s)}
    pairs = {}
    for base in sorted(bases):
        blocks, scales = base + blocks_suffix, base + scales_suffix
        for present, missing in ((blocks, scales), (scales, blocks)):
            if present in keys and missing not in keys:
                raise MXFP4Error(f"MXFP4 tensor {present!r} has no matching {missing!r} in the checkpoint at "
                                 f"{reader.directory}")
        if base in keys:
            raise MXFP4Error(f"checkpoint at {reader.directory} holds both {base!r} and its MXFP4 pair "
                             f"{blocks!r} / {scales!r}")
        _check_pair_shapes(reader, blocks, scales)
        pairs[base] = (blocks, scales)
    return pairs


def _check_pair_shapes(reader: TensorReader, blocks: str, scales: str) -> None:
    blocks_shape, scales_shape = tuple(reader.shape(blocks)), tuple(reader.shape(scales))
    if len(blocks_shape) < 3 or blocks_shape[:-1] != scales_shape:
        raise MXFP4Error(f"MXFP4 tensor {blocks!r} of shape {list(blocks_shape)} does not match {scales!r} "
                         f"of shape {list(scales_shape)} (expected [..., rows, groups, bytes] and "
                         f"[..., rows, groups]) in the checkpoint at {reader.directory}")
