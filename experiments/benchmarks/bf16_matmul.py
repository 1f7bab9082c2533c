"""bf16 matmuls on XLA:CPU: a plain bf16 product vs one accumulated in fp32 (`layers.matmul`),
against torch's bf16 `linear` and XLA's own fp32 product of the same shape.

    python experiments/benchmarks/bf16_matmul.py [--quick] [--json PATH]

XLA:CPU runs `dot(bf16, bf16) -> bf16` in a generic kernel, but `dot(bf16, bf16) -> fp32` in
YNNPACK's, which use the CPU's AMX / AVX-512 BF16 units where it has them. tbajax's layers ask for
the fp32 result and round it to bf16 (`tbajax.models.layers.matmul`); this benchmark times the
two forms at the shapes of the decoders' weight products: a few rows (a decode step) and a
training batch (16 x 128 tokens), for the 50M model's MLP and LM head and a 0.5B-class layer.
Rates are GFLOP/s of the median of alternating calls (all arms take turns); ratios are against
torch's bf16 `linear` (weights stored [out, in], as nn.Linear holds them) measured in the same
rounds. `fp32 GFLOP/s` is XLA's fp32 product of the same shape, for scale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]

# (rows, in, out): the 50M model's gate/up and LM head, a 0.5B-class MLP product
SHAPES = [(m, d, f) for m in (32, 128, 2048) for d, f in ((512, 3072), (512, 16384), (896, 4864))]
QUICK = [(32, 512, 3072), (2048, 512, 3072)]


def rates(shapes: list[tuple[int, int, int]], rounds: int) -> list[dict[str, Any]]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from common import median_seconds_in_turns

    from tbajax.models.layers import matmul

    rows = []
    for m, d, f in shapes:
        rng = np.random.default_rng(0)
        x, w = rng.standard_normal((m, d), np.float32), rng.standard_normal((d, f), np.float32) * d**-0.5
        xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
        plain = jax.jit(lambda a, b: jnp.einsum("md,df->mf", a, b)).lower(xb, wb).compile()
        ours = jax.jit(lambda a, b: matmul("md,df->mf", a, b)).lower(xb, wb).compile()
        x32, w32 = jnp.asarray(x), jnp.asarray(w)
        fp32 = jax.jit(lambda a, b: a @ b).lower(x32, w32).compile()
        tx, tw = torch.from_numpy(x).bfloat16(), torch.from_numpy(np.ascontiguousarray(w.T)).bfloat16()
        exact = x.astype(np.float64) @ w.astype(np.float64)
        errors = {
            "plain": np.abs(np.asarray(plain(xb, wb), np.float64) - exact).max(),
            "fp32 accumulated": np.abs(np.asarray(ours(xb, wb), np.float64) - exact).max(),
            "torch": np.abs(torch.nn.functional.linear(tx, tw).double().numpy() - exact).max(),
        }
        calls = {
            "plain": lambda: jax.block_until_ready(plain(xb, wb)),
            "fp32 accumulated": lambda: jax.block_until_ready(ours(xb, wb)),
            "torch": lambda: torch.nn.functional.linear(tx, tw),
            "fp32": lambda: jax.block_until_ready(fp32(x32, w32)),
        }
        flops = 2.0 * m * d * f
        g = {k: flops / seconds / 1e9 for k, seconds in median_seconds_in_turns(calls, rounds).items()}
        rows.append({
            "rows": m, "in": d, "out": f,
            "plain_gflops": g["plain"], "fp32_acc_gflops": g["fp32 accumulated"],
            "torch_gflops": g["torch"], "fp32_gflops": g["fp32"],
            "speedup": g["fp32 accumulated"] / g["plain"],
            "plain_vs_torch": g["plain"] / g["torch"],
            "fp32_acc_vs_torch": g["fp32 accumulated"] / g["torch"],
            "plain_max_err": float(errors["plain"]), "fp32_acc_max_err": float(errors["fp32 accumulated"]),
            "torch_max_err": float(errors["torch"]),
        })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="two shapes, few rounds")
    ap.add_argument("--json", help="write the figures to this path")
    args = ap.parse_args()
    from common import keep_freed_memory, machine, machine_line, print_table, write_json

    keep_freed_memory()
    shapes, rounds = (QUICK, 5) if args.quick else (SHAPES, 21)
    info = machine()
    rows = rates(shapes, rounds)
    print(f"bf16 matmul x[rows, in] @ w[in, out] (GFLOP/s, median of {rounds} alternating calls)")
    print(machine_line(info))
    print_table(rows, ["rows", "in", "out", "plain_gflops", "fp32_acc_gflops", "torch_gflops", "fp32_gflops",
                       "speedup", "plain_vs_torch", "fp32_acc_vs_torch", "plain_max_err", "fp32_acc_max_err",
                       "torch_max_err"])
    print("plain = jnp.einsum on bf16 (bf16 result); fp32_acc = layers.matmul (fp32 result rounded to bf16); "
          "max_err = largest |result - fp64 product|")
    write_json(args.json, {"benchmark": "bf16_matmul", "machine": info, "rows": rows})


if __name__ == "__main__":
    main()
