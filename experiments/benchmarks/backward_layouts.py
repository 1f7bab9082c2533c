"""The train step's backward products as laid out now vs as they were, in one process.

    python experiments/benchmarks/backward_layouts.py [--quick] [--json PATH] [--precision fp32|bf16]

Three backward products contract the token axis of both operands: attention's key and value
gradients (the query rows, in `layers._row_grads`), the weight gradient of a projection whose
output is narrower than its input (`layers.linear`, grouped k / v), and the LM head's weight
gradient (`batch.head_logprobs`). XLA:CPU ran the forms they had (`ds^T q`, `x^T g^T`, `dz^T h`
then transposed) with its generic dot emitter; they now transpose the small operand first (a
kernel of its own, `layers.unfused_transpose`) so that the product is one that XLA:CPU's library
kernels take, and transpose a small result after where its layout needs it.

Arms: the code as it is ("now"), each of the three products in its earlier form alone, and all
three in their earlier forms (the code before the change); the earlier forms are kept in this
script as the reference. Each arm is the TB train step of `train_step.py` (Llama 10M / 50M,
16 x 128 tokens, response windows scored; fp32 compute, or bf16 with `--precision bf16`, where
every weight gradient reads a row-major x^T and the narrow form does not arise), compiled once;
the arms take turns step by step, in a rotating order. Per arm: the generic `dot` ops in XLA's
optimized program (products outside library-kernel fusions; machine-independent), XLA's flop
count, the median step and the median over rounds of the arm's step time / the "now" step time of
the same round (> 1: "now" is faster), and the first step's loss and gradient norm (the same
batch and weights: they agree).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from tbajax import batch as batch_module  # noqa: E402
from tbajax.models import layers as L  # noqa: E402

Array = jax.Array


# ----------------------------------------------------------------------------- earlier forms


def earlier_row_grads(keys_d_major: bool, softcap: float | None, sink: Array | None, xs: tuple[Array, ...]
                      ) -> tuple[Array, Array, Array, None]:
    """`layers._row_grads` as it was: dk and dv contract the query rows of p / ds and q / g (no
    soft-capping, no sinks: the benchmark's models take none)."""
    assert softcap is None and sink is None
    qi, ki, vi, mi, oi, top, total, gi = xs
    rows, kv, gt, d = qi.shape
    p = jnp.exp(L._row_scores(qi, ki, mi, keys_d_major, None)[0] - top) / total
    gf = gi.astype(jnp.float32)
    dv = L._bdot(p.reshape(rows, kv, gt, -1), gf.reshape(rows, kv, gt, d), 2, 2)  # [rows, kv, s, d]
    dp = L._bdot(gf.reshape(rows, kv, gt, d), vi.astype(jnp.float32), 3, 3).reshape(p.shape)
    delta = (gf * oi.astype(jnp.float32)).sum(-1, keepdims=True)
    ds = jnp.where(mi[:, None, None], p * (dp - delta), 0.0).reshape(rows, kv, gt, -1) * (d**-0.5)
    dq = L._bdot(ds, ki.astype(jnp.float32), 3, 3 if keys_d_major else 2)
    if keys_d_major:
        dk = L._bdot(qi.astype(jnp.float32), ds, 2, 2)  # [rows, kv, d, s]
    else:
        dk = L._bdot(ds, qi.astype(jnp.float32), 2, 2)  # [rows, kv, s, d]
    return dq.astype(qi.dtype), dk.astype(ki.dtype), dv.astype(vi.dtype), None


def earlier_linear_bwd(residuals: tuple[Array, Array], g: Array) -> tuple[Array, Array]:
    """`layers.linear`'s VJP as it was: a g narrower than x is transposed and read as x^T g^T."""
    x, w = residuals
    dx = L.matmul("...f,df->...d", g, w)
    d, f = w.shape
    xs, gs = x.reshape(-1, d), g.reshape(-1, f)
    if jnp.result_type(xs, gs) in L._LOW_PRECISION:
        dw = L.matmul("dn,nf->df", L.row_major_transpose(xs), gs)
    elif d <= f:
        dw = L.matmul("dn,nf->df", L.unfused_transpose(xs), gs)
    else:
        dw = L.matmul("nd,fn->df", xs, L.unfused_transpose(gs))
    return dx, dw.astype(w.dtype)


def earlier_head_bwd(softcap: float | None, residuals, g: Array):
    """`batch.head_logprobs`'s VJP as it was: d W = (dz^T (h / T))^T (no soft-capping)."""
    assert softcap is None
    b = batch_module
    scaled, head, targets, temperature, z, logz = residuals
    dz, dtemp_unit = b._cotangents(z, targets, b._UNIT_TEMPERATURE, logz, g)
    dz = b._vocab_sharded(dz.astype(scaled.dtype))
    dhidden = jnp.einsum("...v,dv->...d", dz, head, preferred_element_type=jnp.float32) / temperature
    flat_h = scaled.reshape(-1, scaled.shape[-1])
    flat_dz = dz.reshape(-1, dz.shape[-1])
    dhead = jnp.einsum("nv,nd->vd", flat_dz, flat_h, preferred_element_type=jnp.float32).T
    dtemp = (dtemp_unit / temperature).astype(temperature.dtype)
    return dhidden.astype(scaled.dtype), dhead.astype(head.dtype), b._int_zeros(targets), dtemp


@contextlib.contextmanager
def earlier(attention: bool = False, linear: bool = False, head: bool = False) -> Iterator[None]:
    """Trace with the named backward products in their earlier forms (restored after)."""
    row_grads = L._row_grads
    try:
        if attention:
            L._row_grads = earlier_row_grads
        if linear:
            L.linear.defvjp(L._linear_fwd, earlier_linear_bwd)
        if head:
            batch_module._whole_head_logprobs.defvjp(batch_module._head_fwd, earlier_head_bwd)
        yield
    finally:
        L._row_grads = row_grads
        L.linear.defvjp(L._linear_fwd, L._linear_bwd)
        batch_module._whole_head_logprobs.defvjp(batch_module._head_fwd, batch_module._head_bwd)


ARMS: dict[str, dict[str, bool]] = {
    "now": {},
    "attention dk/dv as before": {"attention": True},
    "narrow weight grads as before": {"linear": True},
    "LM head grad as before": {"head": True},
    "all three as before": {"attention": True, "linear": True, "head": True},
}


# ----------------------------------------------------------------------------- measurement


def generic_dots(hlo: str) -> int:
    """Dot instructions of an optimized XLA:CPU program outside its library-kernel fusions (a
    fusion marked `__ynn_fusion`, whose body holds the dot): the products its generic dot emitter
    runs, whether on their own or inside another fusion."""
    library = set(re.findall(r"\bfusion\(.*?calls=(%[\w.\-]+).*__ynn_fusion", hlo))
    count, computation = 0, None
    for line in hlo.splitlines():
        head = re.match(r"(?:ENTRY )?(%[\w.\-]+) ", line)
        if head and not line.startswith(" "):
            computation = head.group(1)
        elif computation not in library and re.search(r"= \S+ dot\(", line):
            count += 1
    return count


def bench(size: str, rows: int, seq: int, rounds: int, precision: str) -> list[dict[str, Any]]:
    from common import make_llama_checkpoint
    from train_step import _vocab, tb_batch, trainer_config

    from tbajax.models import load_model
    from tbajax.training import init_train_state, make_train_step

    with tempfile.TemporaryDirectory(prefix=f"bench-layouts-{size}-") as d:
        ckpt = make_llama_checkpoint(size, d)
        vocab = _vocab(ckpt)
        model = load_model(ckpt, scan_layers="auto")
    config = trainer_config(precision)
    graphdef, state = init_train_state(model, config)
    del model
    batch = tb_batch(rows, seq, vocab)
    steps, states, info = {}, {}, {}
    for name, which in ARMS.items():
        with earlier(**which):
            compiled = make_train_step(graphdef, config, "tb").lower(state, batch).compile()
        cost = compiled.cost_analysis() or {}
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        steps[name], states[name] = compiled, jax.tree.map(lambda x: x.copy(), state)
        states[name], out = compiled(states[name], batch)  # warm-up; the first step of each arm
        info[name] = {"generic_dots": generic_dots(compiled.as_text()),
                      "xla_gflop": float(cost.get("flops", float("nan"))) / 1e9,
                      "first_loss": float(out.metrics["loss"]),
                      "first_grad_norm": float(out.metrics["grad_norm"])}
    del state
    names = list(ARMS)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            t0 = time.perf_counter()
            states[name], out = steps[name](states[name], batch)
            out.metrics["loss"].block_until_ready()
            times[name].append(time.perf_counter() - t0)
    rows_out = []
    for name in names:
        paired = [t / n for t, n in zip(times[name], times["now"])]
        rows_out.append({"size": size, "batch": f"{rows}x{seq}", "precision": precision, "arm": name,
                         **info[name],
                         "step_s": float(np.median(times[name])), "best_step_s": min(times[name]),
                         "vs_now": float(np.median(paired)), "vs_now_min": min(paired),
                         "vs_now_max": max(paired), "step_times": times[name]})
    return rows_out


def main() -> None:
    # imported here, not at the top: tests import this module's earlier forms, and another
    # folder's `common` module must stay importable in their process
    from common import keep_freed_memory, machine, machine_line, print_table, write_json

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10M only, 8 x 128 tokens, 3 rounds (< 1 min)")
    ap.add_argument("--json", help="write the figures to this path")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                    help="compute dtype of the step (fp32 master weights either way)")
    args = ap.parse_args()
    keep_freed_memory()
    cases = [("10M", 8, 128, 3)] if args.quick else [("10M", 16, 128, 15), ("50M", 16, 128, 10)]
    rows = [r for size, n, seq, rounds in cases for r in bench(size, n, seq, rounds, args.precision)]
    info = machine()
    print(f"TB train step ({args.precision} compute, layers unrolled), the backward products now vs in their "
          "earlier forms")
    print(machine_line(info))
    print_table(rows, ["size", "batch", "arm", "generic_dots", "xla_gflop", "step_s", "best_step_s", "vs_now",
                       "vs_now_min", "vs_now_max", "first_loss", "first_grad_norm"])
    print("generic_dots: dot ops XLA:CPU runs with its generic emitter; vs_now: median over rounds of the "
          "arm's step time / the 'now' step time of the round (> 1: now is faster)")
    write_json(args.json, {"benchmark": "backward_layouts", "precision": args.precision, "machine": info,
                           "rows": rows})


if __name__ == "__main__":
    main()
