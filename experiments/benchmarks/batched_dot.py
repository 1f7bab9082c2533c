"""Batched matmuls (attention's shapes) on XLA:CPU vs torch `bmm`, on all cores and on one.

    python experiments/benchmarks/batched_dot.py [--quick] [--json PATH]

Attention is a batch of small matmuls (one per batch row and head: q k^T and p v), and on this
CPU tbajax's causal attention runs at about half of torch's fused kernel (`attention.py`). This
benchmark isolates the kernel underneath: `jnp.einsum("bmk,bkn->bmn")` (a dot_general with a
batch dimension) against `torch.bmm`, at the shapes of the decoders' attention, beside a plain
2-D matmul of the same flops. Each side runs twice: in this process (all cores) and in a child
process pinned to one core (`os.sched_setaffinity` before jax or torch starts its thread pool).
`cores_speedup` = rate on all cores / rate on one core: how much of the machine a kernel uses.
Rates are GFLOP/s of the median of alternating calls; fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]

# (name, batch, m, k, n): q k^T and p v of one attention row-loop step and of a whole layer, and a
# 2-D matmul of a similar flop count
SHAPES = [
    ("q k^T, 16 x 8 heads, 256 x 64 x 256", 128, 256, 64, 256),
    ("p v, 16 x 8 heads, 256 x 256 x 64", 128, 256, 256, 64),
    ("q k^T, 2 rows x 8 heads, 64 x 64 x 256", 16, 64, 64, 256),
    ("2-D: 4096 x 512 x 1024", 1, 4096, 512, 1024),
]
QUICK = [SHAPES[0], SHAPES[3]]


def rates(shapes: list[tuple], rounds: int) -> list[dict[str, Any]]:
    """GFLOP/s of XLA's batched dot and of torch.bmm per shape, the two alternating call by call."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from common import median_seconds_in_turns

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    out = []
    for name, b, m, k, n in shapes:
        rng = np.random.default_rng(0)
        x, w = rng.standard_normal((b, m, k), np.float32), rng.standard_normal((b, k, n), np.float32)
        jx, jw = jnp.asarray(x), jnp.asarray(w)
        tx, tw = torch.from_numpy(x), torch.from_numpy(w)
        ours = jax.jit(lambda a, c: jnp.einsum("bmk,bkn->bmn", a, c)).lower(jx, jw).compile()
        calls = {"xla": lambda: jax.block_until_ready(ours(jx, jw)), "torch": lambda: torch.bmm(tx, tw)}
        seconds = median_seconds_in_turns(calls, rounds)
        flops = 2.0 * b * m * k * n
        out.append({"shape": name, "xla_gflops": flops / seconds["xla"] / 1e9,
                    "torch_gflops": flops / seconds["torch"] / 1e9})
    return out


def one_core(shapes: list[tuple], rounds: int) -> list[dict[str, Any]]:
    """`rates` in a child process pinned to one core."""
    code = (f"import os, sys, json; os.sched_setaffinity(0, {{{min(os.sched_getaffinity(0))}}}); "
            f"sys.path[:0] = {[str(Path(__file__).resolve().parent)]!r}; import batched_dot; "
            f"print(json.dumps(batched_dot.rates({shapes!r}, {rounds})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="two shapes, few rounds")
    ap.add_argument("--json", help="write the figures to this path")
    args = ap.parse_args()
    from common import keep_freed_memory, machine, machine_line, print_table, write_json

    keep_freed_memory()
    shapes, rounds = (QUICK, 5) if args.quick else (SHAPES, 21)
    info = machine()
    single = one_core(shapes, rounds)
    rows = []
    for all_cores, one in zip(rates(shapes, rounds), single):
        rows.append({
            **all_cores,
            "xla_vs_torch": all_cores["xla_gflops"] / all_cores["torch_gflops"],
            "xla_1core_gflops": one["xla_gflops"], "torch_1core_gflops": one["torch_gflops"],
            "xla_cores_speedup": all_cores["xla_gflops"] / one["xla_gflops"],
            "torch_cores_speedup": all_cores["torch_gflops"] / one["torch_gflops"],
        })
    print(f"batched fp32 matmul, {info['cpu_count']} cores vs 1 (GFLOP/s, median of {rounds} alternating calls)")
    print(machine_line(info))
    print_table(rows, ["shape", "xla_gflops", "torch_gflops", "xla_vs_torch", "xla_1core_gflops",
                       "torch_1core_gflops", "xla_cores_speedup", "torch_cores_speedup"])
    write_json(args.json, {"benchmark": "batched_dot", "machine": info, "rows": rows})


if __name__ == "__main__":
    main()
