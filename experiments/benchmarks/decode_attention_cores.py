"""A decode step's attention on one core and on all of them, against the memory bandwidth that
one and all threads read at: how far apart the attention is from what the machine could read.

    python experiments/benchmarks/decode_attention_cores.py [--quick] [--json PATH]

The program is the sampler's decode attention alone (`layers.cached_attention`, the layers in
sequence, each over its own fp32 cache of prompt + new-token slots) at the `sampler.py` models'
shapes. Each core count runs in its own child process, pinned to that many cores before jax
starts (XLA sizes its thread pool then), timed over alternating calls (median). The reference,
measured in the same child: torch summing a 256 MiB fp32 array on that many threads (read
bandwidth). ideal_ms = the cache bytes at that bandwidth; speedup = 1-core ms / all-cores ms.
A speedup near 1 means XLA:CPU runs the attention on one core: the decode step's
attention is then bound by one core's bandwidth, whatever the others do.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]

# name -> (batch, kv heads, query heads per kv head, head dim, cache slots, layers): sampler.py's
# 10M / 50M Llamas at 64 prompt + 128 new tokens (the full cache of the last decode phase)
SHAPES = {
    "10M b32": (32, 2, 2, 64, 192, 6),
    "50M b32": (32, 4, 2, 64, 192, 8),
    "50M b128": (128, 4, 2, 64, 192, 8),
}


def child(shape: tuple[int, ...], cores: int, calls: int) -> dict[str, Any]:
    os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:cores]))
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from tbajax.models.layers import cached_attention

    b, kv, g, d, s, layers = shape
    r = np.random.default_rng(0)
    q = jnp.asarray(r.normal(size=(layers, b, 1, kv * g, d)).astype(np.float32))
    kt = [jnp.asarray(r.normal(size=(b, kv, d, s)).astype(np.float32)) for _ in range(layers)]
    v = [jnp.asarray(r.normal(size=(b, kv, s, d)).astype(np.float32)) for _ in range(layers)]
    mask = jnp.ones((b, 1, s), bool)

    @jax.jit
    def step(q: jax.Array, kt: list[jax.Array], v: list[jax.Array]) -> jax.Array:
        x = jnp.zeros(q.shape[1:], jnp.float32)
        for i in range(layers):  # each layer's query depends on the last layer's output
            x = cached_attention(q[i] + x * 1e-3, kt[i], v[i], mask)
        return x

    step(q, kt, v).block_until_ready()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        step(q, kt, v).block_until_ready()
        times.append(time.perf_counter() - t0)
    torch.set_num_threads(cores)
    big = torch.ones(64 << 20)
    big.sum()
    reads = []
    for _ in range(7):
        t0 = time.perf_counter()
        big.sum()
        reads.append(time.perf_counter() - t0)
    cache_bytes = sum(x.nbytes for x in (*kt, *v))
    return {"cores": cores, "ms": statistics.median(times) * 1e3, "cache_MB": cache_bytes / 2**20,
            "read_GB_s": big.numel() * 4 / min(reads) / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the 10M shape only, fewer calls")
    ap.add_argument("--json", help="write the figures to this path")
    ap.add_argument("--child", nargs=2, metavar=("SHAPE", "CORES"), help=argparse.SUPPRESS)
    ap.add_argument("--calls", type=int, default=41)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(SHAPES[args.child[0]], int(args.child[1]), args.calls)))
        return
    from common import machine, machine_line, print_table, write_json

    all_cores = len(os.sched_getaffinity(0))
    shapes = ["10M b32"] if args.quick else list(SHAPES)
    calls = 11 if args.quick else args.calls
    rows = []
    for name in shapes:
        got = {}
        for cores in sorted({1, all_cores}):
            out = subprocess.run([sys.executable, __file__, "--child", name, str(cores), "--calls", str(calls)],
                                 capture_output=True, text=True, check=True)
            got[cores] = json.loads(out.stdout.strip().splitlines()[-1])
        one, every = got[1], got[all_cores]
        mb = one["cache_MB"]
        rows.append({
            "shape": name, "b_kv_g_d_slots_layers": "x".join(map(str, SHAPES[name])), "cache_MB": mb,
            "cores": all_cores, "ms_1core": one["ms"], "ms_all_cores": every["ms"], "speedup": one["ms"] / every["ms"],
            "GB_s_1core": mb * 2**20 / one["ms"] / 1e6, "GB_s_all_cores": mb * 2**20 / every["ms"] / 1e6,
            "read_GB_s_1thread": one["read_GB_s"], "read_GB_s_all_threads": every["read_GB_s"],
            "ideal_ms_all_cores": mb * 2**20 / every["read_GB_s"] / 1e6,
            "ms_over_ideal": every["ms"] / (mb * 2**20 / every["read_GB_s"] / 1e6),
        })
    info = machine()
    print(f"the decode step's attention (fp32 cache) on 1 and {all_cores} cores, vs torch summing 256 MiB")
    print(machine_line(info))
    print_table(rows, list(rows[0]))
    print("ms: median call; GB_s: cache bytes / ms; read_GB_s: torch.sum's read rate on as many threads; "
          "ideal_ms: the cache bytes at that rate")
    write_json(args.json, {"benchmark": "decode_attention_cores", "machine": info, "rows": rows})


if __name__ == "__main__":
    main()
