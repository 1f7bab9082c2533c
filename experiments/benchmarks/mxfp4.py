"""MXFP4 dequantization on load (GPT-OSS's experts): tbajax's numpy path against transformers'.

    python experiments/benchmarks/mxfp4.py [--experts N] [--rounds N] [--json PATH]

GPT-OSS's released checkpoints hold every expert weight as MXFP4 blocks and scales;
`tbajax.models.mxfp4.DequantizingReader` dequantizes them while loading (into the unquantized
layout, [E, in, out] float32). This times it against transformers' own dequantization
(`integrations.mxfp4.convert_moe_packed_tensors`, torch on every core, float32 out, with the
transpose to the same layout) and against its own earlier form (one thread, whole experts: each
expert dequantized, then transposed into place) on the same random blocks and scales:
`--experts` experts of one GPT-OSS-20B layer's gate_up_proj (5,760 x 2,880) and down_proj
(2,880 x 2,880). A copy of the output's bytes (numpy, one core) is the memory-speed bound of
writing them. The arms take turns round by
round; each row gives the median seconds, values per second, its ratio to torch's time (> 1:
faster than transformers) and what the whole model's experts would take at that rate (values
only: the loader also reads the files and places the weights). The host allocator is set as in
every role process (`common.keep_freed_memory`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT)]

import numpy as np  # noqa: E402
from common import keep_freed_memory, machine, machine_line, print_table, write_json  # noqa: E402

from tbajax.models.mxfp4 import dequantize, dequantize_transposed  # noqa: E402

HIDDEN = EXPERT = 2880  # GPT-OSS-20B and 120B: hidden size and expert width alike
# the experts' values (gate_up + down, every layer) of the released models
MODELS = {"gpt-oss-20b": 24 * 32 * (2 * EXPERT * HIDDEN + HIDDEN * EXPERT),
          "gpt-oss-120b": 36 * 128 * (2 * EXPERT * HIDDEN + HIDDEN * EXPERT)}


def random_pair(experts: int, rows: int, inputs: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Blocks [E, rows, inputs / 32, 16] and scales [E, rows, inputs / 32] as the checkpoints hold
    them (scales near 2^-6: the released weights' range)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (experts, rows, inputs // 32, 16), dtype=np.uint8)
    scales = rng.integers(118, 126, (experts, rows, inputs // 32), dtype=np.uint8)
    return blocks, scales


def arms(pairs: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, Callable[[], Any]]:
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.set_num_threads(os.cpu_count() or 1)
    torch_pairs = [(torch.from_numpy(b), torch.from_numpy(s)) for b, s in pairs]
    values = sum(b.size * 2 for b, _ in pairs)
    source, target = np.ones(values, np.float32), np.empty(values, np.float32)

    def ours() -> None:
        for blocks, scales in pairs:
            dequantize_transposed(blocks, scales)

    def earlier() -> None:  # `dequantize_transposed` as it was: one thread, one whole expert at a time
        for blocks, scales in pairs:
            out = np.empty((blocks.shape[0], blocks.shape[2] * 32, blocks.shape[1]), np.float32)
            for e in range(blocks.shape[0]):
                out[e] = dequantize(blocks[e], scales[e]).T

    def transformers_() -> None:
        for blocks, scales in torch_pairs:
            convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).contiguous()

    return {"tbajax (numpy)": ours, "tbajax, earlier (one thread, whole experts)": earlier,
            "transformers (torch)": transformers_,
            "copy of the output's bytes": lambda: np.copyto(target, source)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=4, help="experts of one layer to dequantize (default 4)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds, the arms taking turns (default 5)")
    ap.add_argument("--json", help="write the figures to this path")
    args = ap.parse_args()

    keep_freed_memory()  # the host allocator as every role process (the loader's) has it
    info = machine()
    pairs = [random_pair(args.experts, 2 * EXPERT, HIDDEN, 0), random_pair(args.experts, HIDDEN, EXPERT, 1)]
    values = sum(b.size * 2 for b, _ in pairs)
    calls = arms(pairs)
    for fn in calls.values():  # warm-up: lookup tables, thread pools, first touch
        fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    torch_s = statistics.median(times["transformers (torch)"])
    rows = []
    for name, ts in times.items():
        seconds = statistics.median(ts)
        rows.append({"arm": name, "experts": args.experts, "values_M": values / 1e6, "seconds": seconds,
                     "values_per_s_M": values / seconds / 1e6, "x_transformers": torch_s / seconds,
                     **{f"{model}_s": total / (values / seconds) for model, total in MODELS.items()}})
    print(f"MXFP4 -> float32 [E, in, out], {args.experts} experts of one GPT-OSS-20B layer "
          f"(gate_up + down, {values / 1e6:.0f}M values), median of {args.rounds} rounds taken in turns")
    print_table(rows, ["arm", "values_M", "seconds", "values_per_s_M", "x_transformers", "gpt-oss-20b_s",
                       "gpt-oss-120b_s"])
    print("x_transformers: transformers' time / the arm's (> 1: faster); gpt-oss-*_s: the whole model's "
          "experts at that rate")
    print(machine_line(info))
    write_json(args.json, {"benchmark": "mxfp4", "machine": info, "rounds": args.rounds, "rows": rows})


if __name__ == "__main__":
    main()
