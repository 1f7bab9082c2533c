"""A transpose that XLA:CPU fuses into its producer vs `layers.unfused_transpose`, one process.

    python experiments/benchmarks/transpose_fusion.py [--quick] [--json PATH]

The weight gradient of a projection transposes one operand (`layers.linear`'s VJP). Left to
itself, XLA:CPU fuses the transpose into the loop that produces that operand and runs the loop in
the transposed order. Each row is such a producer + transpose of a [tokens, width] fp32 array, as
the train step has them: a key gradient through RoPE's VJP plus another gradient term, a
dynamic slice of a scan's stacked residuals, and an elementwise product. "fused" is the plain `x.T`, "unfused" is `unfused_transpose` (the transpose in a `cond`
of its own), and "producer only" is the same program without the transpose, for scale. The arms
take turns call by call; times are medians; ratio = fused / unfused (> 1: the unfused transpose
is faster).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import keep_freed_memory, machine, machine_line, print_table, write_json  # noqa: E402

from tbajax.models.layers import apply_rope, rope_tables, unfused_transpose  # noqa: E402

LAYERS = 8


def producers(tokens: int, width: int) -> dict[str, tuple[Callable[..., jax.Array], tuple]]:
    """name -> (producer, its arguments): each returns a [tokens, width] array."""
    rng = np.random.default_rng(0)
    a, b = (jnp.asarray(rng.standard_normal((tokens, width), np.float32)) for _ in range(2))
    stacked = jnp.asarray(rng.standard_normal((LAYERS, tokens, width), np.float32))
    batch, head_dim = 16, 64
    heads, seq = width // head_dim, tokens // batch
    grad = jnp.asarray(rng.standard_normal((batch, heads, seq, head_dim), np.float32))  # heads-major
    positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
    cos, sin = rope_tables(1.0 / 10000 ** (np.arange(0, head_dim, 2) / head_dim), positions)

    def rope_backward(g: jax.Array, c: jax.Array, s: jax.Array, residual: jax.Array) -> jax.Array:
        """The key gradient as the attention's VJP hands it over (heads-major), through RoPE's
        VJP, plus another gradient term, as [tokens, width]."""
        token_major = g.transpose(0, 2, 1, 3)
        _, vjp = jax.vjp(lambda k: apply_rope(k, c, s), token_major)
        return vjp(token_major)[0].reshape(tokens, width) + residual

    return {
        "RoPE backward + gradient sum": (rope_backward, (grad, cos, sin, a)),
        "dynamic slice of stacked residuals": (
            lambda s, i: jax.lax.dynamic_index_in_dim(s, i, keepdims=False), (stacked, jnp.int32(3))),
        "elementwise product": (lambda x, y: x * y, (a, b)),
    }


def bench(tokens: int, width: int, rounds: int) -> list[dict[str, Any]]:
    rows = []
    for name, (make, args) in producers(tokens, width).items():
        arms = {
            "fused": jax.jit(lambda *a, make=make: make(*a).T),
            "unfused": jax.jit(lambda *a, make=make: unfused_transpose(make(*a))),
            "producer only": jax.jit(lambda *a, make=make: make(*a)),
        }
        want = np.asarray(arms["fused"](*args))
        np.testing.assert_allclose(np.asarray(arms["unfused"](*args)), want, rtol=1e-5, atol=1e-5)
        times: dict[str, list[float]] = {k: [] for k in arms}
        for _ in range(rounds):
            for k, fn in arms.items():
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*args))
                times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v[1:]) for k, v in times.items()}  # the first call compiles
        rows.append({"producer": name, "shape": f"{tokens}x{width}", "MB": tokens * width * 4 / 1e6,
                     "fused_ms": med["fused"] * 1e3, "unfused_ms": med["unfused"] * 1e3,
                     "producer_only_ms": med["producer only"] * 1e3, "ratio": med["fused"] / med["unfused"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one shape, few rounds")
    ap.add_argument("--json", help="write the figures to this path")
    args = ap.parse_args()
    keep_freed_memory()
    # [tokens, width] of the 50M train step (16 x 128 tokens): the hidden size and a kv projection
    shapes = [(2048, 512)] if args.quick else [(2048, 512), (2048, 256)]
    rounds = 6 if args.quick else 31
    rows = [r for tokens, width in shapes for r in bench(tokens, width, rounds)]
    info = machine()
    print(f"producer + transpose, fp32, medians of {rounds - 1} alternating calls")
    print(machine_line(info))
    print_table(rows, ["producer", "shape", "MB", "fused_ms", "unfused_ms", "producer_only_ms", "ratio"])
    print("ratio = fused / unfused (> 1: the transpose as a kernel of its own is faster)")
    write_json(args.json, {"benchmark": "transpose_fusion", "machine": info, "rows": rows})


if __name__ == "__main__":
    main()
