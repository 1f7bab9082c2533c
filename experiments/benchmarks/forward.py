"""Forward-pass tokens/s: tbajax's Flax decoder vs torch transformers, same config and batch.

    python experiments/benchmarks/forward.py [--quick] [--json PATH]

Both sides run fp32 on this machine's CPU with the same checkpoint; compile time is reported
separately from steady state.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import SIZES, machine, make_llama_checkpoint, peak_rss_mb, print_table, timed, write_json  # noqa: E402
from flax import nnx  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from tbajax.models import load_model  # noqa: E402


def bench(size: str, batch: int, seq: int, repeats: int) -> dict:
    directory = make_llama_checkpoint(size)
    vocab = SIZES[size]["vocab_size"]
    ids = np.random.RandomState(0).randint(0, vocab, (batch, seq))

    model = load_model(directory)
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)[0])
    tokens = jnp.asarray(ids)
    compile_s, ours = timed(lambda: fwd(state, tokens).block_until_ready(), repeats)

    ref = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    tids = torch.tensor(ids)

    def torch_fwd() -> None:
        with torch.inference_mode():
            ref(input_ids=tids)

    _, theirs = timed(torch_fwd, repeats)
    n = batch * seq
    return {
        "size": size,
        "params_M": model.config.num_params() / 1e6,
        "batch": batch,
        "seq": seq,
        "tbajax_tok_s": n / ours,
        "torch_tok_s": n / theirs,
        "ratio": theirs / ours,
        "compile_s": compile_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one small size, few repeats")
    ap.add_argument("--json", help="write the figures to this path")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    cases = [("10M", 8, 128)] if args.quick else [("10M", 16, 256), ("50M", 16, 256)]
    rows = [bench(s, b, t, 2 if args.quick else 5) for s, b, t in cases]
    info = {**machine(), "torch_threads": torch.get_num_threads(), "peak_rss_mb": peak_rss_mb()}
    print(f"forward pass, fp32, {info['cpu_count']} CPU cores, jax {info['jax']}, torch {torch.__version__}")
    print_table(rows, ["size", "params_M", "batch", "seq", "tbajax_tok_s", "torch_tok_s", "ratio", "compile_s"])
    print("ratio = tbajax tokens/s / torch tokens/s (>1: tbajax faster)")
    write_json(args.json, {"benchmark": "forward", "machine": info, "rows": rows})


if __name__ == "__main__":
    main()
