"""The decode step's head: vocabulary matmul + sampling step, with and without the fusion break
(`tbajax.sampling.step.unfuse_from_producer`), against the matmul alone, in one process.

    python experiments/benchmarks/decode_head.py [--quick] [--json PATH]

XLA's CPU backend fuses the [rows, hidden] x [vocab, hidden]^T dot with the row max that the
softmax takes over its output; this measures what that fusion costs at the sampler's shapes.
Arms, each its own compiled program on the same inputs, timed in alternating rounds:
  dot       the vocabulary matmul alone (the ideal: sampling for free)
  fused     matmul + `sample_logits` (full-vocab T = 1, per-row keys) as XLA fuses it by default
  unfused   the same with the fp32 identity between them that tbajax's sampler uses on CPU
ratio = fused / unfused (> 1: the break pays); overhead = unfused / dot.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable
from unittest import mock

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from common import keep_freed_memory, machine, machine_line, print_table, write_json  # noqa: E402

from tbajax.sampling import step  # noqa: E402

# (label, rows, hidden, vocab): the sampler benchmark's 10M / 50M heads at its batch sizes, and
# SmolLM2-135M's tied head.
SHAPES = [
    ("10M", 32, 256, 8192), ("10M", 128, 256, 8192),
    ("50M", 32, 512, 24576), ("50M", 128, 512, 24576),
    ("smollm2", 64, 576, 49152), ("smollm2", 256, 576, 49152),
]


def head_programs(rows: int, hidden: int, vocab: int) -> tuple[dict[str, Callable[..., Any]], tuple]:
    kh, kw, ks = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(kh, (rows, hidden), jnp.float32)
    w = jax.random.normal(kw, (vocab, hidden), jnp.float32) * hidden**-0.5
    keys = step.sample_keys(ks, jnp.arange(rows))

    def dot(h: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.einsum("bd,vd->bv", h, w, preferred_element_type=jnp.float32)

    def sample(h: jax.Array, w: jax.Array, keys: jax.Array) -> tuple[jax.Array, jax.Array]:
        return step.sample_logits(None, dot(h, w), keys=keys)

    args = (h, w, keys)
    programs = {"dot": jax.jit(lambda h, w, keys: dot(h, w)).lower(*args).compile()}
    # a fresh function object per arm: jax caches traces by function, and the patch acts at trace time
    with mock.patch.object(step, "unfuse_from_producer", lambda x: x):
        programs["fused"] = jax.jit(lambda *a: sample(*a)).lower(*args).compile()
    programs["unfused"] = jax.jit(lambda *a: sample(*a)).lower(*args).compile()
    for name, has_break in (("fused", False), ("unfused", True)):
        if ("reduce-precision" in programs[name].as_text()) != has_break:
            raise RuntimeError(f"the {name} arm's program {'lacks' if has_break else 'has'} the fusion break")
    return programs, args


def alternate(programs: dict[str, Callable[..., Any]], args: tuple, rounds: int) -> dict[str, list[float]]:
    for p in programs.values():
        jax.block_until_ready(p(*args))
    times: dict[str, list[float]] = {k: [] for k in programs}
    for _ in range(rounds):
        for k, p in programs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(p(*args))
            times[k].append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the 50M shapes only, fewer rounds")
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    keep_freed_memory()
    info = machine()
    shapes = [s for s in SHAPES if s[0] == "50M"] if args.quick else SHAPES
    rounds = min(args.rounds, 8) if args.quick else args.rounds
    rows = []
    for label, b, d, v in shapes:
        times = alternate(*head_programs(b, d, v), rounds)
        med = {k: statistics.median(t) for k, t in times.items()}
        paired = [f / u for f, u in zip(times["fused"], times["unfused"])]
        rows.append({"model": label, "rows": b, "hidden": d, "vocab": v,
                     "dot_ms": med["dot"] * 1e3, "fused_ms": med["fused"] * 1e3,
                     "unfused_ms": med["unfused"] * 1e3,
                     "ratio": statistics.median(paired), "ratio_min": min(paired), "ratio_max": max(paired),
                     "overhead": med["unfused"] / med["dot"],
                     "dot_gflops": 2 * b * d * v / med["dot"] / 1e9, "times": times})
        print(f"  {label} {b} x {d} x {v}: done", flush=True)
    print(machine_line(info))
    print_table(rows, ["model", "rows", "hidden", "vocab", "dot_ms", "fused_ms", "unfused_ms", "ratio",
                       "overhead", "dot_gflops"])
    write_json(args.json, {"benchmark": "decode_head", "machine": info, "rounds": rounds, "rows": rows})


if __name__ == "__main__":
    main()
