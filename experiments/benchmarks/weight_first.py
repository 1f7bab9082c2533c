"""Which operand goes first in a sampler's few-row weight products: rows first (x w^T) or the
weight first (w x^T, transposed after), `layers.out_major_product`.

    python experiments/benchmarks/weight_first.py [--quick] [--rounds 15] [--json PATH]

Products: x [rows, in] times each weight of the 10M, 50M and 0.5B-class sampler models (q/k/v,
gate/up, down, LM head) in fp32 and bf16 (accumulated in fp32, as `layers.matmul` does), at 32,
64, 128 and 256 rows, three ways in alternating calls: rows first against the weight held
[in, out] (the layout small weights had before) and output-major [out, in], and weight first
against [out, in]; each is the program `out_major_product` compiles (its row limit
`WEIGHT_FIRST_MAX_ROWS` set per way). The reference, torch's `linear` on [out, in], is timed
right after, not in turns (its threads spin on after a call and slow whatever runs next).

Sampler: one `Sampler.sample` call (64 prompt + 128 new tokens, T = 1, no early stop) of the 10M
and 50M benchmark models (`sampler.py`'s), batch 32 and 128, with the weight-first products (the
sampler's default) and with rows first everywhere, in alternating calls. At batch 128 the decode
step has more rows than the limit: both arms run the same program there (a check on the noise).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]

# (label, in, out): the sampler benchmark's 10M / 50M models and Qwen2.5-0.5B's MLP and head
WEIGHTS = [
    ("10M qkv", 256, 512), ("10M gate/up", 256, 1408), ("10M down", 704, 256), ("10M head", 256, 8192),
    ("50M qkv", 512, 1024), ("50M gate/up", 512, 2816), ("50M down", 1408, 512), ("50M head", 512, 24576),
    ("0.5B gate/up", 896, 9728), ("0.5B down", 4864, 896),
]
ROWS = (32, 64, 128, 256)
QUICK = [("50M gate/up", 512, 2816), ("50M head", 512, 24576)]


def _compiled(rows_limit: int, x: Any, w: Any) -> Any:
    """`out_major_product` compiled with its row limit at `rows_limit` (read when tracing)."""
    import jax

    from tbajax.models import layers as L

    saved = L.WEIGHT_FIRST_MAX_ROWS
    L.WEIGHT_FIRST_MAX_ROWS = rows_limit
    try:
        # a function of its own: jax caches a function's trace, and would reuse the other limit's
        return jax.jit(lambda x, w: L.out_major_product(x, w)).lower(x, w).compile()
    finally:
        L.WEIGHT_FIRST_MAX_ROWS = saved


def product_row(dtype: str, label: str, rows: int, d: int, f: int, rounds: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from common import median_seconds_in_turns

    from tbajax.models.layers import matmul

    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, d), np.float32)
    w = rng.standard_normal((f, d), np.float32) * d**-0.5  # [out, in]
    jdt = jnp.dtype(dtype)
    xj, w_out, w_in = jnp.asarray(x, jdt), jnp.asarray(w, jdt), jnp.asarray(np.ascontiguousarray(w.T), jdt)
    in_major = jax.jit(lambda a, b: matmul("md,df->mf", a, b)).lower(xj, w_in).compile()
    rows_first, weight_first = _compiled(0, xj, w_out), _compiled(1 << 30, xj, w_out)
    outs = [np.asarray(fn(xj, b), np.float32) for fn, b in
            ((in_major, w_in), (rows_first, w_out), (weight_first, w_out))]
    if not all(np.allclose(o, outs[0], rtol=2e-2, atol=2e-2) for o in outs[1:]):
        raise RuntimeError(f"{label}: the three products differ")
    tdt = getattr(torch, dtype)
    tx, tw = torch.from_numpy(x).to(tdt), torch.from_numpy(w).to(tdt)
    seconds = median_seconds_in_turns({
        "in_major": lambda: jax.block_until_ready(in_major(xj, w_in)),
        "rows_first": lambda: jax.block_until_ready(rows_first(xj, w_out)),
        "weight_first": lambda: jax.block_until_ready(weight_first(xj, w_out)),
    }, rounds)
    # torch apart: its OpenMP threads spin for a while after each call, slowing a call that
    # follows at once (alternated with ours, every XLA product here took up to 2x as long)
    seconds |= median_seconds_in_turns({"torch": lambda: torch.nn.functional.linear(tx, tw)}, rounds)
    before = min(seconds["in_major"], seconds["rows_first"])  # the better rows-first layout
    return {
        "dtype": dtype, "weight": label, "rows": rows, "in": d, "out": f,
        **{f"{k}_ms": v * 1e3 for k, v in seconds.items()},
        "weight_first_speedup": before / seconds["weight_first"],
        "weight_first_vs_torch": seconds["torch"] / seconds["weight_first"],
        "rows_first_vs_torch": seconds["torch"] / before,
        "weight_first_gflops": 2.0 * rows * d * f / seconds["weight_first"] / 1e9,
    }


def sampler_rows(sizes: list[str], batches: list[int], rounds: int, prompt_len: int = 64,
                 new_tokens: int = 128) -> list[dict[str, Any]]:
    import jax

    import sampler as bench_sampler
    from common import median_seconds_in_turns

    from tbajax.models import layers as L
    from tbajax.models import load_model
    from tbajax.sampling import Sampler, SamplingConfig

    out = []
    config = SamplingConfig(max_new_tokens=new_tokens, temperature=1.0, stop_token_ids=())
    for size in sizes:
        directory = Path(tempfile.mkdtemp(prefix=f"weight-first-{size}-"))
        bench_sampler.build_random_llama(directory, bench_sampler.SIZES[size])
        model = load_model(directory)
        for batch in batches:
            prompts = bench_sampler.prompts_for(batch, prompt_len, model.config.vocab_size)
            samplers = {}
            for arm, limit in (("weight_first", L.WEIGHT_FIRST_MAX_ROWS), ("rows_first", 0)):
                saved = L.WEIGHT_FIRST_MAX_ROWS
                L.WEIGHT_FIRST_MAX_ROWS = limit
                try:  # compiled now, with this arm's limit
                    s = Sampler(model, max_cache_length=prompt_len + new_tokens, min_prompt_bucket=prompt_len)
                    s.sample(prompts, config, jax.random.key(0))
                finally:
                    L.WEIGHT_FIRST_MAX_ROWS = saved
                samplers[arm] = s
            # the same keys: rows whose 128 tokens all agree (products that round differently can
            # tip a sampled token, and every later one with it)
            a, b = (samplers[arm].sample(prompts, config, jax.random.key(1)).tokens for arm in samplers)
            agree = float((a == b).all(axis=1).mean())
            key = jax.random.key(2)
            calls = {arm: (lambda s=s: s.sample(prompts, config, key)) for arm, s in samplers.items()}
            seconds = median_seconds_in_turns(calls, rounds, warmup=1)
            out.append({
                "model": size, "batch": batch, "tokens": f"{prompt_len}+{new_tokens}",
                "weight_first_s": seconds["weight_first"], "rows_first_s": seconds["rows_first"],
                "speedup": seconds["rows_first"] / seconds["weight_first"],
                "weight_first_tok_s": batch * new_tokens / seconds["weight_first"],
                "same_tokens_frac": agree,
            })
            print(f"  sampler {size} x {batch}: done", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="two weights at 32 rows, the 10M sampler at 32")
    ap.add_argument("--rounds", type=int, default=15, help="alternating calls per product")
    ap.add_argument("--sampler-rounds", type=int, default=5, help="alternating calls per sampler setting")
    ap.add_argument("--sampler-models", nargs="+", default=["10M", "50M"],
                    help="`sampler.py` models for the sampler rows (e.g. smollm2-135M 0.5B)")
    ap.add_argument("--sampler-batch", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--no-products", action="store_true", help="the sampler rows only")
    ap.add_argument("--json", help="write the figures to this path")
    args = ap.parse_args()
    import torch

    from common import keep_freed_memory, machine, machine_line, print_table, write_json

    from tbajax.models import layers as L

    keep_freed_memory()
    info = machine()
    quick = args.quick
    weights, rows_list, rounds = (QUICK, (32,), 5) if quick else (WEIGHTS, ROWS, args.rounds)
    products = []
    for dtype in () if args.no_products else ("float32", "bfloat16"):
        for label, d, f in weights:
            for r in rows_list:
                products.append(product_row(dtype, label, r, d, f, rounds))
        print(f"  {dtype} products: done", flush=True)
    sampled = sampler_rows(["10M"] if quick else args.sampler_models, [32] if quick else args.sampler_batch,
                           2 if quick else args.sampler_rounds)
    print(f"x [rows, in] times a weight (`layers.out_major_product` / `layers.matmul`; median of {rounds} "
          "alternating calls): rows first against [in, out] and [out, in], weight first against [out, in]; "
          "torch = F.linear on [out, in], same dtype; weight_first_speedup = the better rows-first time / "
          "the weight-first time")
    print(machine_line(info))
    if products:
        print_table(products, ["dtype", "weight", "rows", "in_major_ms", "rows_first_ms", "weight_first_ms",
                               "torch_ms", "weight_first_speedup", "weight_first_vs_torch",
                               "rows_first_vs_torch"])
    print("\nSampler.sample, weight first (up to the row limit) against rows first everywhere, alternating "
          "calls (median); speedup = rows-first time / weight-first time")
    print_table(sampled, ["model", "batch", "tokens", "weight_first_s", "rows_first_s", "speedup",
                          "weight_first_tok_s", "same_tokens_frac"])
    write_json(args.json, {"benchmark": "weight_first", "machine": info, "rounds": rounds,
                           "sampler_rounds": args.sampler_rounds, "torch_threads": torch.get_num_threads(),
                           "rows_first_max_rows": 0, "weight_first_max_rows": L.WEIGHT_FIRST_MAX_ROWS,
                           "rows": products, "sampler_rows": sampled})


if __name__ == "__main__":
    main()
