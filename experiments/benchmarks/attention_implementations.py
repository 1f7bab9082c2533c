"""The trainer's attention (forward and VJP, bf16) by implementation, on whatever backend JAX runs:
for a GPU session (`gpu_check.sh`) what `model.attention` should be there.

    python experiments/benchmarks/attention_implementations.py [--quick] [--json PATH]

Arms, all on the same causal, right-padded batch:
  - "ours, CPU steps": tbajax's row loop with a CPU's cache-sized loop steps
    (`layers.ROW_SCORES_BUDGET`), what every backend ran before the loop steps became
    platform-dependent: the reference ("vs CPU steps" = its time / the arm's);
  - "ours": `model.attention=xla` as it runs here (on a GPU, `ACCELERATOR_ROW_SCORES_BUDGET`
    steps; on CPU the same program as the reference);
  - "jax.nn xla": `jax.nn.dot_product_attention(implementation="xla")`, every row's scores and
    probabilities materialised (autodiff keeps the probabilities for the VJP);
  - "cudnn": `model.attention=cudnn` (`layers.cudnn_attention`), where cuDNN runs (else left out,
    with the reason printed); "vs cudnn" = its time / the arm's.
Shapes: Qwen2.5-0.5B's heads (14 query heads over 2 KV heads of 64) at 16 x 1024 and 64 x 256
tokens (rows x length; --quick: 4 x 128). The arms take turns round by round and the figures
are medians.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable
from unittest import mock

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import machine, machine_line, median_seconds_in_turns, print_table, write_json  # noqa: E402

from tbajax.models import layers  # noqa: E402

HEADS = (14, 2, 64)  # query heads, KV heads, head_dim: Qwen2.5-0.5B
SHAPES = {"16x1024": (16, 1024), "64x256": (64, 256)}


def cpu_steps(f: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """`f` traced with the CPU's loop-step budget on every platform."""
    def traced(*args: jax.Array) -> jax.Array:
        with mock.patch.object(layers, "ACCELERATOR_ROW_SCORES_BUDGET", layers.ROW_SCORES_BUDGET):
            return f(*args)
    return traced


def bench(label: str, b: int, t: int, rounds: int) -> tuple[list[dict[str, Any]], str | None]:
    h, kv, d = HEADS
    r = np.random.default_rng(0)
    q, k, v, w = (jnp.asarray(r.normal(size=s), jnp.bfloat16) for s in ((b, t, h, d), (b, t, kv, d),
                                                                      (b, t, kv, d), (b, t, h, d)))
    lengths = r.integers(t // 4, t + 1, b)
    real = np.arange(t)[None, :] < lengths[:, None]
    mask = jnp.asarray(np.tril(np.ones((t, t), bool))[None] & real[:, None, :])

    def ours(q, k, v):
        return layers.attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask, causal=True)

    arms: dict[str, Callable[..., jax.Array]] = {
        "ours, CPU steps": cpu_steps(ours),
        "ours": ours,
        "jax.nn xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask[:, None],
                                                                   implementation="xla"),
        "cudnn": lambda q, k, v: layers.cudnn_attention(q, k, v, mask, causal=True),
    }
    calls: dict[str, dict[str, Callable[[], Any]]] = {"forward": {}, "vjp": {}}
    skipped = None
    for name, f in arms.items():
        fwd = jax.jit(f)
        grad = jax.jit(jax.grad(lambda q, k, v, f=f: (f(q, k, v).astype(jnp.float32) * w).sum(),
                                argnums=(0, 1, 2)))
        try:
            fwd.lower(q, k, v)
        except RuntimeError as e:  # cuDNN where it cannot run: say why, time the others
            skipped = f"{name}: {e}"
            continue
        calls["forward"][name] = lambda fwd=fwd: fwd(q, k, v).block_until_ready()
        calls["vjp"][name] = lambda grad=grad: jax.block_until_ready(grad(q, k, v))
    rows = []
    for kind, fns in calls.items():
        seconds = median_seconds_in_turns(fns, rounds, warmup=2)
        for name, s in seconds.items():
            row = {"shape": label, "pass": kind, "arm": name, "ms": s * 1e3,
                   "vs_cpu_steps": seconds["ours, CPU steps"] / s}
            if "cudnn" in seconds:
                row["vs_cudnn"] = seconds["cudnn"] / s
            rows.append(row)
    return rows, skipped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 x 128 only, 3 rounds")
    ap.add_argument("--json", help="write the figures to this path")
    args = ap.parse_args()
    shapes = {"4x128": (4, 128)} if args.quick else SHAPES
    rows, skipped = [], None
    for label, (b, t) in shapes.items():
        got, skipped = bench(label, b, t, 3 if args.quick else 10)
        rows.extend(got)
    info = {**machine(), "backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind)}
    print(f"the trainer's causal attention in bf16 on {info['device']} ({info['backend']}), "
          f"heads {HEADS[0]} over {HEADS[1]} KV of {HEADS[2]}")
    print(machine_line(info))
    if skipped:
        print(f"left out: {skipped}")
    print_table(rows, ["shape", "pass", "arm", "ms", "vs_cpu_steps", "vs_cudnn"])
    print("ms: median over rounds (the arms take turns); vs_X = X's time / the arm's (> 1: faster than X)")
    write_json(args.json, {"benchmark": "attention_implementations", "machine": info, "left_out": skipped,
                           "rows": rows})


if __name__ == "__main__":
    main()
