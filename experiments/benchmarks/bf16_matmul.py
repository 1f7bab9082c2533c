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

The weight-gradient rows (`product` "x^T g", at the training shapes) time dW = x^T g, which
contracts the token axis: plain = the bf16 einsum; `fp32_acc` = what `layers.linear`'s VJP runs
(x^T written row-major by `layers.row_major_transpose`, then `layers.matmul`); `before` = the
same product after `layers.unfused_transpose`, which XLA:CPU turned into an fp32 product; torch =
`x.t() @ g` in bf16. max_err is against the fp64 product of the fp32 operands for x w (their
rounding to bf16 included) and of the bf16 operands for x^T g.
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
# (tokens, in, out) of weight gradients: the 50M model's gate/up, down and LM head, a 0.5B-class MLP
GRAD_SHAPES = [(2048, 512, 3072), (2048, 1536, 512), (2048, 512, 16384), (2048, 896, 4864)]
QUICK_GRAD = [(2048, 512, 3072)]


def _row(product: str, shape: tuple[int, int, int], calls: dict[str, Any], outputs: dict[str, Any],
         exact: Any, rounds: int) -> dict[str, Any]:
    """One table row: GFLOP/s of each arm (`calls` takes turns: "plain", "ours", "torch", "fp32"
    and optionally "before") and the largest error of each output against `exact`."""
    import numpy as np

    from common import median_seconds_in_turns

    rows, d, f = shape
    flops = 2.0 * rows * d * f
    g = {k: flops / seconds / 1e9 for k, seconds in median_seconds_in_turns(calls, rounds).items()}
    err = {k: float(np.abs(np.asarray(v, np.float64) - exact).max()) for k, v in outputs.items()}
    base = g.get("before", g["plain"])
    return {
        "product": product, "rows": rows, "in": d, "out": f,
        "plain_gflops": g["plain"], "fp32_acc_gflops": g["ours"],
        **({"before_gflops": g["before"]} if "before" in g else {}),
        "torch_gflops": g["torch"], "fp32_gflops": g["fp32"], "speedup": g["ours"] / base,
        "plain_vs_torch": g["plain"] / g["torch"], "fp32_acc_vs_torch": g["ours"] / g["torch"],
        "plain_max_err": err["plain"], "fp32_acc_max_err": err["ours"], "torch_max_err": err["torch"],
    }


def rates(shapes: list[tuple[int, int, int]], rounds: int) -> list[dict[str, Any]]:
    """x w: x [rows, in] times w [in, out]."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

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
        calls = {
            "plain": lambda: jax.block_until_ready(plain(xb, wb)),
            "ours": lambda: jax.block_until_ready(ours(xb, wb)),
            "torch": lambda: torch.nn.functional.linear(tx, tw),
            "fp32": lambda: jax.block_until_ready(fp32(x32, w32)),
        }
        outputs = {"plain": plain(xb, wb), "ours": ours(xb, wb),
                   "torch": torch.nn.functional.linear(tx, tw).double().numpy()}
        exact = x.astype(np.float64) @ w.astype(np.float64)  # of the fp32 operands
        rows.append(_row("x w", (m, d, f), calls, outputs, exact, rounds))
    return rows


def grad_rates(shapes: list[tuple[int, int, int]], rounds: int) -> list[dict[str, Any]]:
    """x^T g: the weight gradient of x [tokens, in] and g [tokens, out]."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from tbajax.models.layers import matmul, row_major_transpose, unfused_transpose

    rows = []
    for n, d, f in shapes:
        rng = np.random.default_rng(0)
        x, g = rng.standard_normal((n, d), np.float32), rng.standard_normal((n, f), np.float32)
        xb, gb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(g, jnp.bfloat16)
        plain = jax.jit(lambda a, b: jnp.einsum("nd,nf->df", a, b)).lower(xb, gb).compile()
        ours = jax.jit(lambda a, b: matmul("dn,nf->df", row_major_transpose(a), b)).lower(xb, gb).compile()
        before = jax.jit(lambda a, b: matmul("dn,nf->df", unfused_transpose(a), b)).lower(xb, gb).compile()
        x32, g32 = jnp.asarray(x), jnp.asarray(g)
        fp32 = jax.jit(lambda a, b: matmul("dn,nf->df", unfused_transpose(a), b)).lower(x32, g32).compile()
        tx, tg = torch.from_numpy(x).bfloat16(), torch.from_numpy(g).bfloat16()
        calls = {
            "plain": lambda: jax.block_until_ready(plain(xb, gb)),
            "ours": lambda: jax.block_until_ready(ours(xb, gb)),
            "before": lambda: jax.block_until_ready(before(xb, gb)),
            "torch": lambda: tx.t() @ tg,
            "fp32": lambda: jax.block_until_ready(fp32(x32, g32)),
        }
        outputs = {"plain": plain(xb, gb), "ours": ours(xb, gb), "torch": (tx.t() @ tg).double().numpy()}
        exact = np.asarray(xb, np.float64).T @ np.asarray(gb, np.float64)  # of the bf16 operands
        rows.append(_row("x^T g", (n, d, f), calls, outputs, exact, rounds))
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
    rows = rates(shapes, rounds) + grad_rates(QUICK_GRAD if args.quick else GRAD_SHAPES, rounds)
    print(f"bf16 products x[rows, in] @ w[in, out] and x^T g (GFLOP/s, median of {rounds} alternating calls)")
    print(machine_line(info))
    print_table(rows, ["product", "rows", "in", "out", "plain_gflops", "fp32_acc_gflops", "before_gflops",
                       "torch_gflops", "fp32_gflops", "speedup", "plain_vs_torch", "fp32_acc_vs_torch",
                       "plain_max_err", "fp32_acc_max_err", "torch_max_err"])
    print("plain = jnp.einsum on bf16 (bf16 result); fp32_acc = layers.matmul (fp32 result rounded to bf16; "
          "x^T g: after layers.row_major_transpose); before (x^T g) = after layers.unfused_transpose; "
          "speedup = fp32_acc / plain (x w) or fp32_acc / before (x^T g); "
          "max_err = largest |result - fp64 product|")
    write_json(args.json, {"benchmark": "bf16_matmul", "machine": info, "rows": rows})


if __name__ == "__main__":
    main()
