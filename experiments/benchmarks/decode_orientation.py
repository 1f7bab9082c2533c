"""Which way round a sampler should hold its weights, per dtype: [in, out] or output-major [out, in].

    python experiments/benchmarks/decode_orientation.py [--quick] [--rounds 15] [--json PATH]

A decode step multiplies a few rows of activations by every weight; XLA:CPU's speed at such a
product depends on how the weight lies in memory, and not the same way for fp32 and bf16. Each
row times `layers.matmul` (what the decode step runs: a bf16 product accumulated in fp32) of x
[rows, in] with the same weight held both ways, in alternating rounds, beside torch's `linear`
on its [out, in] weight in the same dtype. Shapes: the 50M benchmark model's q/k/v, gate/up, down
and LM head, and a 0.5B-class (Qwen2.5-0.5B) MLP product and head, at the sampler benchmark's
decode batches (32, 128) and a prompt pass (2,048 rows). `out_major_speedup` = the [in, out]
time / the [out, in] time: above 1, output-major is faster.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]

# (label, in, out)
WEIGHTS = [
    ("50M qkv", 512, 1024), ("50M gate/up", 512, 3072), ("50M down", 1536, 512), ("50M head", 512, 16384),
    ("0.5B gate/up", 896, 9728), ("0.5B down", 4864, 896), ("0.5B head", 896, 151936),
]
ROWS = (32, 128, 2048)
QUICK = [("50M gate/up", 512, 3072), ("50M head", 512, 16384)]


def one_row(dtype: str, label: str, rows: int, d: int, f: int, rounds: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from common import median_seconds_in_turns

    from tbajax.models.layers import matmul

    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, d), np.float32)
    w = rng.standard_normal((d, f), np.float32) * d**-0.5
    jdt = jnp.dtype(dtype)
    xj, w_in, w_out = jnp.asarray(x, jdt), jnp.asarray(w, jdt), jnp.asarray(np.ascontiguousarray(w.T), jdt)
    in_major = jax.jit(lambda a, b: matmul("md,df->mf", a, b)).lower(xj, w_in).compile()
    out_major = jax.jit(lambda a, b: matmul("md,fd->mf", a, b)).lower(xj, w_out).compile()
    tdt = getattr(torch, dtype)
    tx, tw = torch.from_numpy(x).to(tdt), torch.from_numpy(np.ascontiguousarray(w.T)).to(tdt)
    a, b = np.asarray(in_major(xj, w_in), np.float32), np.asarray(out_major(xj, w_out), np.float32)
    if not np.allclose(a, b, rtol=2e-2, atol=2e-2):
        raise RuntimeError(f"{label}: the two layouts give different products")
    seconds = median_seconds_in_turns({
        "in_major": lambda: jax.block_until_ready(in_major(xj, w_in)),
        "out_major": lambda: jax.block_until_ready(out_major(xj, w_out)),
        "torch": lambda: torch.nn.functional.linear(tx, tw),
    }, rounds)
    flops = 2.0 * rows * d * f
    return {
        "dtype": dtype, "weight": label, "rows": rows, "in": d, "out": f,
        "weight_mb": d * f * jdt.itemsize / 2**20,
        "in_major_ms": seconds["in_major"] * 1e3, "out_major_ms": seconds["out_major"] * 1e3,
        "torch_ms": seconds["torch"] * 1e3,
        "out_major_speedup": seconds["in_major"] / seconds["out_major"],
        "best_vs_torch": seconds["torch"] / min(seconds["in_major"], seconds["out_major"]),
        "in_major_gflops": flops / seconds["in_major"] / 1e9,
        "out_major_gflops": flops / seconds["out_major"] / 1e9,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="two weights at 32 rows, few rounds")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", help="write the figures to this path")
    args = ap.parse_args()
    import torch

    from common import keep_freed_memory, machine, machine_line, print_table, write_json

    keep_freed_memory()
    info = machine()
    weights, rows_list, rounds = (QUICK, (32,), 5) if args.quick else (WEIGHTS, ROWS, args.rounds)
    rows = []
    for dtype in ("float32", "bfloat16"):
        for label, d, f in weights:
            for r in rows_list:
                if r * d * f > 2**31:  # a prompt pass through a 0.5B head: seconds a call, skipped
                    continue
                rows.append(one_row(dtype, label, r, d, f, rounds))
                print(f"  {dtype} {label} x {r} rows: done", flush=True)
    print(f"x [rows, in] times a weight held [in, out] or [out, in] (`layers.matmul`; median of {rounds} "
          "alternating calls); torch = F.linear on [out, in], same dtype")
    print(machine_line(info))
    print_table(rows, ["dtype", "weight", "rows", "in", "out", "weight_mb", "in_major_ms", "out_major_ms",
                       "torch_ms", "out_major_speedup", "best_vs_torch"])
    write_json(args.json, {"benchmark": "decode_orientation", "machine": info, "rounds": rounds,
                           "torch_threads": torch.get_num_threads(), "rows": rows})


if __name__ == "__main__":
    main()
