"""Causal attention alone, forward and VJP: tbajax's row loop (one row a step, with and without the
causal key blocks; `layers.rows_per_step` rows a step, with them: what the models run) vs the
whole batch's scores materialised at once vs torch's fused SDPA.

    python experiments/benchmarks/attention.py [--quick] [--json PATH]

Shapes are those of the decoders in `forward.py` / `train_step.py`: 10M (16 x 256, 8 heads over 4
KV heads of 32), the 10M train step (16 x 128), the 50M train step (16 x 128, 8 over 4 of 64) and
GPT-NeoX 50M (16 x 256, 8 heads of 64). "whole batch" is the same grouped-query math with every
row's [kv, g*t, s] scores materialised together (what `layers.attention` did before the row
loop). The VJP is of sum(out * w) for a fixed random w. fp32; all arms take turns round by
round and the figures are medians, so the machine's drift hits every arm alike; ratio = torch
time / arm time (> 1: faster than torch).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from unittest import mock
from pathlib import Path
from typing import Any, Callable

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import keep_freed_memory, machine, machine_line, print_table, write_json  # noqa: E402

from tbajax.models import layers  # noqa: E402
from tbajax.models.layers import _MASK_VALUE, attention  # noqa: E402

SHAPES = {
    "10M": (16, 256, 8, 4, 32), "10M train": (16, 128, 8, 4, 32), "50M train": (16, 128, 8, 4, 64),
    "NeoX 50M": (16, 256, 8, 8, 64),
}


def whole_batch(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention with the whole batch's scores materialised (q [b,t,h,d], k/v
    [b,kv,s,d])."""
    b, t, h, d = q.shape
    kv = k.shape[1]
    g = h // kv
    qg = q.reshape(b, t, kv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, kv, g * t, d)
    scores = jax.lax.dot_general(qg, k, (((3,), (3,)), ((0, 1), (0, 1))), preferred_element_type=jnp.float32)
    scores = jnp.where(mask[:, None, None], scores.reshape(b, kv, g, t, -1) * d**-0.5, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).reshape(b, kv, g * t, -1)
    out = jax.lax.dot_general(probs, v, (((3,), (2,)), ((0, 1), (0, 1))))
    return out.reshape(b, kv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)


def one_row_a_step(f: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """`f` traced with a loop step of one batch row (the row loop before `layers.rows_per_step`)."""
    def traced(*args: jax.Array) -> jax.Array:
        with mock.patch.object(layers, "ROW_SCORES_BUDGET", 0):
            return f(*args)
    return traced


def bench(label: str, shape: tuple[int, ...], rounds: int) -> list[dict[str, Any]]:
    b, t, h, kv, d = shape
    r = np.random.default_rng(0)
    sizes = ((b, t, h, d), (b, kv, t, d), (b, kv, t, d), (b, t, h, d))
    qn, kn, vn, wn = (r.normal(size=size).astype(np.float32) for size in sizes)
    q, k, v, w = map(jnp.asarray, (qn, kn, vn, wn))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool))[None], (b, t, t))
    arms_jax = {
        "whole batch": lambda q, k, v: whole_batch(q, k, v, mask),
        "row loop": one_row_a_step(lambda q, k, v: attention(q, k, v, mask)),
        "row loop + causal blocks": one_row_a_step(lambda q, k, v: attention(q, k, v, mask, causal=True)),
        "rows_per_step + causal blocks": lambda q, k, v: attention(q, k, v, mask, causal=True),
    }
    calls: dict[str, dict[str, Callable[[], Any]]] = {"forward": {}, "vjp": {}}
    for name, f in arms_jax.items():
        fwd = jax.jit(f)
        grad = jax.jit(jax.grad(lambda q, k, v, f=f: (f(q, k, v) * w).sum(), argnums=(0, 1, 2)))
        calls["forward"][name] = lambda fwd=fwd: fwd(q, k, v).block_until_ready()
        calls["vjp"][name] = lambda grad=grad: jax.block_until_ready(grad(q, k, v))
    tq, tk, tv, tw = (torch.tensor(x) for x in (qn.transpose(0, 2, 1, 3), kn, vn, wn.transpose(0, 2, 1, 3)))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def torch_fwd() -> None:
        with torch.inference_mode():
            sdpa(tq, tk, tv, is_causal=True, enable_gqa=True)

    def torch_vjp() -> None:
        qq, kk, vv = (x.clone().requires_grad_() for x in (tq, tk, tv))
        (sdpa(qq, kk, vv, is_causal=True, enable_gqa=True) * tw).sum().backward()

    calls["forward"]["torch SDPA"] = torch_fwd
    calls["vjp"]["torch SDPA"] = torch_vjp
    rows = []
    for kind, arms in calls.items():
        times: dict[str, list[float]] = {name: [] for name in arms}
        for fn in arms.values():
            fn()  # compile / warm up
        for _ in range(rounds):
            for name, fn in arms.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        ref = statistics.median(times["torch SDPA"])
        for name, ts in times.items():
            med = statistics.median(ts)
            rows.append({"shape": label, "b_t_h_kv_d": "x".join(map(str, shape)), "pass": kind, "arm": name,
                         "ms": med * 1e3, "vs_torch": ref / med})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the 10M shape only, 3 rounds")
    ap.add_argument("--json", help="write the figures to this path")
    args = ap.parse_args()
    keep_freed_memory()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    shapes = {"10M": SHAPES["10M"]} if args.quick else SHAPES
    rows = [row for label, shape in shapes.items() for row in bench(label, shape, 3 if args.quick else 9)]
    info = {**machine(), "torch_threads": torch.get_num_threads()}
    print(f"causal attention, fp32, torch {torch.__version__} at {info['torch_threads']} threads")
    print(machine_line(info))
    print_table(rows, ["shape", "b_t_h_kv_d", "pass", "arm", "ms", "vs_torch"])
    print("ms: median over rounds (all arms take turns); vs_torch = torch SDPA time / arm time (> 1: faster)")
    write_json(args.json, {"benchmark": "attention", "machine": info, "rows": rows})


if __name__ == "__main__":
    main()
