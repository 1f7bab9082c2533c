"""Forward-pass tokens/s: tbajax's Flax decoders vs torch transformers, same checkpoint and batch.

    python experiments/benchmarks/forward.py [--quick] [--models M ...] [--dtype bfloat16] [--compare NAME]
                                             [--json PATH]

Rows (`--models`): a Llama-style causal LM, a GPT-NeoX (Pythia-style: partial rotary, parallel
residual) causal LM, and a GPT-NeoX reward model (`*ForSequenceClassification`, one label) scored
at each row's last real token of a right-padded batch (`load_scorer(...).score` vs the torch
model's pooled logits); `gemma3`, a Gemma 3 text model (five layers of six windowed to 128
positions, `common.make_gemma3_checkpoint`) and `gemma2`, a Gemma 2 (every other layer windowed,
scores and logits soft-capped, `common.make_gemma2_checkpoint`) and `qwen3_moe`, a Qwen3-MoE (8
experts a layer, 2 a token, `common.make_qwen3_moe_checkpoint`), not run by default. Both sides
hold and compute in fp32 (or both in bf16 with `--dtype bfloat16`) on this machine's CPU; compile
time is reported separately from steady state. The two sides take turns call by call
(`common.timed_in_turns`): the ratio is the median over rounds of torch's / tbajax's time, tok/s
come from each side's best call.

`--compare NAME` times the causal-LM rows it applies to once more against the same forward with
one piece of tbajax replaced by what it was before (`COMPARISONS`), the two arms taking turns
(three times as many rounds as against torch):
`before_tok_s` from that arm's median time, `speedup` = its median time / tbajax's, and both
programs' temporary memory as XLA plans it (`temp_mb`, `before_temp_mb`).
  gelu: `layers.gelu_exact` (erf-based, as torch's kernel) vs `jax.nn.gelu(approximate=False)`
        (erfc-based); GPT-NeoX rows.
  stack_slicing: the layer scan with `layers.scan_layers` (bf16 weights sliced as integers
        on CPU) vs a plain `jax.lax.scan` over the weights; with `--dtype bfloat16`.

`--attention-stub` splits the causal-LM rows' time into attention and the rest: both sides are
timed again with their attention replaced by the same stand-in (q plus the keys and values, each
kv head repeated over its query group: the same shapes, no softmax), tbajax's `self_attention`
without a cache and torch's `scaled_dot_product_attention`, all four arms taking turns.
`stub_ratio` = torch's stubbed time / ours (the rest of the model), `attention_ms` /
`torch_attention_ms` = each side's full time minus its stubbed time.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any
from unittest import mock

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import torch  # noqa: E402
from common import (  # noqa: E402
    PAD, SIZES, keep_freed_memory, machine, machine_line, make_gemma2_checkpoint, make_gemma3_checkpoint,
    make_llama_checkpoint, make_neox_checkpoint, make_qwen3_moe_checkpoint,
    median_seconds_in_turns, peak_rss_mb, print_table, timed_in_turns, write_json,
)
from flax import nnx  # noqa: E402
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification  # noqa: E402

from tbajax.models import decoder, layers, load_model, load_scorer  # noqa: E402


def erfc_gelu(x: jax.Array) -> jax.Array:
    """`layers.gelu_exact` as it was before (jax.nn.gelu's erfc form), for `--compare gelu`."""
    return jax.nn.gelu(x, approximate=False)


@dataclasses.dataclass(frozen=True)
class Comparison:
    """`module.attribute` replaced by `before` in the compared arm, for the rows of `models`."""

    module: Any
    attribute: str
    before: Any
    models: tuple[str, ...]


COMPARISONS = {
    "gelu": Comparison(layers, "gelu_exact", erfc_gelu, ("neox",)),
    "stack_slicing": Comparison(decoder, "scan_layers", jax.lax.scan, ("llama", "neox")),
}


MODELS = ("llama", "neox", "neox_rm", "gemma2", "gemma3", "qwen3_moe")
STUB_ORIGINAL = layers.self_attention


def stub_self_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: Any, cache: Any, dtype: Any,
                        *rest: Any) -> Any:
    """`layers.self_attention` for `--attention-stub`: the cache path as before, else q + k + v."""
    if cache is not None:
        return STUB_ORIGINAL(q, k, v, mask, cache, dtype, *rest)
    g = q.shape[2] // k.shape[2]
    return q + jnp.repeat(k, g, axis=2) + jnp.repeat(v, g, axis=2), None


def stub_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """torch's `scaled_dot_product_attention` for `--attention-stub`: q + k + v ([b, heads, t, d])."""
    g = q.shape[1] // k.shape[1]
    return q + k.repeat_interleave(g, 1) + v.repeat_interleave(g, 1)


def attention_split(fwd_ours: Any, build_stubbed: Any, torch_fwd: Any, n: int, rounds: int) -> dict[str, float]:
    """Both sides with and without their attention (`--attention-stub`), the four arms in turns."""
    with mock.patch.object(layers, "self_attention", stub_self_attention):
        stubbed = build_stubbed()

    def torch_stubbed() -> None:
        with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", stub_sdpa):
            torch_fwd()

    med = median_seconds_in_turns({"ours": fwd_ours, "ours_stub": stubbed, "torch": torch_fwd,
                                   "torch_stub": torch_stubbed}, rounds, warmup=1)
    return {"stub_tok_s": n / med["ours_stub"], "torch_stub_tok_s": n / med["torch_stub"],
            "stub_ratio": med["torch_stub"] / med["ours_stub"],
            "attention_ms": 1e3 * (med["ours"] - med["ours_stub"]),
            "torch_attention_ms": 1e3 * (med["torch"] - med["torch_stub"])}


def bench(model_name: str, size: str, batch: int, seq: int, repeats: int, dtype: str = "float32",
          compare: Comparison | None = None, attention_stub: bool = False) -> dict:
    vocab = SIZES[size]["vocab_size"]
    compared_here = False
    rng = np.random.RandomState(0)
    ids = rng.randint(3, vocab, (batch, seq))
    mask = np.ones((batch, seq), np.int64)
    if model_name == "llama":
        directory = make_llama_checkpoint(size)
    elif model_name == "gemma3":
        directory = make_gemma3_checkpoint(size)
    elif model_name == "gemma2":
        directory = make_gemma2_checkpoint(size)
    elif model_name == "qwen3_moe":
        directory = make_qwen3_moe_checkpoint(size)
    else:
        directory = make_neox_checkpoint(size, reward_model=model_name == "neox_rm")
    if model_name == "neox_rm":  # right-padded prompt + response rows of different lengths
        lengths = rng.randint(seq // 2, seq + 1, batch)
        mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)
        ids = np.where(mask == 1, ids, PAD)
        scorer = load_scorer(directory, param_dtype=dtype, dtype=dtype)
        config = scorer.config
        tokens, jmask = jnp.asarray(ids), jnp.asarray(mask)
        ours = lambda: scorer.score(tokens, jmask).block_until_ready()  # noqa: E731
        ref = AutoModelForSequenceClassification.from_pretrained(directory, dtype=getattr(torch, dtype))
        ref = ref.eval()
    else:
        model = load_model(directory, param_dtype=dtype, dtype=dtype)
        config = model.config
        graphdef, state = nnx.split(model)
        fwd = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)[0])
        tokens = jnp.asarray(ids)
        ours = lambda: fwd(state, tokens).block_until_ready()  # noqa: E731
        compared_here = compare is not None and model_name in compare.models
        ref = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype)).eval()
    tids, tmask = torch.tensor(ids), torch.tensor(mask)

    def torch_fwd() -> None:
        with torch.inference_mode():
            ref(input_ids=tids, attention_mask=tmask)

    t = timed_in_turns(ours, torch_fwd, repeats)
    n = int(mask.sum())
    compared = {}
    if compared_here:  # compiled after timed_in_turns, whose first call times our compile
        assert compare is not None
        with mock.patch.object(compare.module, compare.attribute, compare.before):
            before = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)[0]).lower(state, tokens).compile()
        arms = {"now": ours, "before": lambda: before(state, tokens).block_until_ready()}
        med = median_seconds_in_turns(arms, 3 * repeats, warmup=1)  # effects of a few percent
        temp = [f.memory_analysis().temp_size_in_bytes / 2**20 for f in (fwd.lower(state, tokens).compile(), before)]
        compared = {"before_tok_s": n / med["before"], "speedup": med["before"] / med["now"],
                    "temp_mb": temp[0], "before_temp_mb": temp[1]}
    if attention_stub and model_name != "neox_rm":
        def build_stubbed() -> Any:
            stubbed = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)[0]).lower(state, tokens).compile()
            return lambda: stubbed(state, tokens).block_until_ready()

        compared.update(attention_split(ours, build_stubbed, torch_fwd, n, 3 * repeats))
    return {
        "model": model_name,
        "size": size,
        "params_M": config.num_params() / 1e6,
        "batch": batch,
        "seq": seq,
        "dtype": dtype,
        "tbajax_tok_s": n / t["best_s"]["ours"],
        "torch_tok_s": n / t["best_s"]["theirs"],
        "ratio": t["ratio"],
        "ratio_min": t["ratio_min"],
        "ratio_max": t["ratio_max"],
        "compile_s": t["first_s"]["ours"],
        **compared,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one small size, few repeats")
    ap.add_argument("--json", help="write the figures to this path")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="weights and compute dtype of both sides (default float32)")
    ap.add_argument("--compare", choices=sorted(COMPARISONS), help="time the rows with one change undone too")
    ap.add_argument("--models", nargs="+", choices=MODELS, default=["llama", "neox", "neox_rm"],
                    help="rows to run (default: llama neox neox_rm)")
    ap.add_argument("--attention-stub", action="store_true",
                    help="time both sides with attention stubbed out too (attention vs the rest)")
    args = ap.parse_args()
    keep_freed_memory()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.quick:
        cases = [(m, "10M", 8, 128) for m in args.models]
    else:
        cases = [(m, s, 16, 256) for s in ("10M", "50M") for m in args.models]
    compare = COMPARISONS[args.compare] if args.compare else None
    rows = [bench(m, s, b, t, 3 if args.quick else 7, args.dtype, compare, args.attention_stub)
            for m, s, b, t in cases]
    info = {**machine(), "torch_threads": torch.get_num_threads(), "peak_rss_mb": peak_rss_mb()}
    print(f"forward pass, {args.dtype}, torch {torch.__version__} at {info['torch_threads']} threads")
    print(machine_line(info))
    columns = ["model", "size", "params_M", "batch", "seq", "tbajax_tok_s", "torch_tok_s", "ratio", "ratio_min",
               "ratio_max", "compile_s"]
    columns += ["before_tok_s", "speedup", "temp_mb", "before_temp_mb"] if compare else []
    columns += ["stub_tok_s", "torch_stub_tok_s", "stub_ratio", "attention_ms", "torch_attention_ms"] \
        if args.attention_stub else []
    print_table(rows, columns)
    print("ratio = median over alternating rounds of torch time / tbajax time (>1: tbajax faster); tok/s: "
          "best call of each side; tokens = real (unpadded) tokens")
    write_json(args.json, {"benchmark": "forward", "models": args.models, "dtype": args.dtype,
                           "compare": args.compare,
                           "attention_stub": args.attention_stub, "machine": info, "rows": rows})


if __name__ == "__main__":
    main()
