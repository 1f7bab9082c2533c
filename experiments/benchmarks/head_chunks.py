"""The trainer's vocabulary projection + log-softmax in chunks of tokens (`model.head_chunk_tokens`,
`tbajax.batch.head_logprobs`) against all tokens at once: memory and time.

    python experiments/benchmarks/head_chunks.py [--quick] [--json PATH]

Memory: XLA's buffer assignment (`compiled.memory_analysis()`, no arrays allocated) for the value
and gradient of the policy's log-probs of every token, a whole model at Qwen2.5-0.5B's and
Qwen2.5-7B's shapes (fp32 params, bf16 compute, full remat: `experiments/math_qwen.py`'s trainer),
16 rows (one group of K = 16) at math-run lengths; the reference is the same program with the
whole projection (chunk None, the code before). The figures are this platform's buffer
assignment (CPU here); a GPU's differs in its scratch, not in the [tokens, vocab] logits.

Time: the head alone (value and gradient of sum(g * log-probs) by hidden states and head, fp32)
at Qwen2.5's and SmolLM2's vocabularies, chunked and whole in alternating rounds. The chunked
backward computes each chunk's logits again: 4 vocabulary matmuls instead of 3, so 1.33x the
head's matmul time is the expected cost (`ideal_ratio`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import (  # noqa: E402
    keep_freed_memory,
    machine,
    machine_line,
    print_table,
    timed_in_turns,
    write_json,
)
from flax import nnx  # noqa: E402

from tbajax.batch import HEAD_CHUNK_BYTES, head_chunk_steps, head_logprobs, hidden_token_logprobs  # noqa: E402
from tbajax.models import CausalLM, ModelConfig  # noqa: E402

# Qwen2.5's shapes (HF config.json values), as math_qwen's trainer runs them
QWEN = {
    "qwen2.5-0.5B": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                         num_heads=14, num_kv_heads=2, head_dim=64, tie_word_embeddings=True),
    "qwen2.5-7B": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                       num_heads=28, num_kv_heads=4, head_dim=128, tie_word_embeddings=False),
}
ROWS = 16  # one group of K = 16 samples per micro-batch (math_qwen)
LENGTHS = (512, 1024, 2048, 4096)
# (label, rows, length, hidden, vocab) of the timed head-alone arms
HEADS = [("qwen2.5-0.5B head", 2, 1024, 896, 151936), ("smollm2 head", 16, 512, 576, 49152)]
MIB = 2**20


def model_memory(name: str, length: int, chunk: Any) -> dict[str, float]:
    """Scratch and total bytes XLA assigns to the policy's value and gradient (compiled only)."""
    cfg = ModelConfig(model_type="qwen2", qkv_bias=True, param_dtype="float32", dtype="bfloat16", remat="full",
                      scan_layers=True, head_chunk_tokens=chunk, **QWEN[name])
    graphdef, params = nnx.split(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0))))
    tokens = jax.ShapeDtypeStruct((ROWS, length), jnp.int32)
    weights = jax.ShapeDtypeStruct((ROWS, length), jnp.float32)

    def loss(params: Any, tokens: jax.Array, weights: jax.Array) -> jax.Array:
        model = nnx.merge(graphdef, params)
        hidden, _ = model.hidden_states(tokens)
        return (hidden_token_logprobs(hidden, model.head_weight(), tokens, 1.0, chunk) * weights).sum()

    stats = jax.jit(jax.value_and_grad(loss)).lower(params, tokens, weights).compile().memory_analysis()
    return {"temp_mb": stats.temp_size_in_bytes / MIB,
            "total_mb": (stats.temp_size_in_bytes + stats.argument_size_in_bytes + stats.output_size_in_bytes
                         - stats.alias_size_in_bytes) / MIB}


def head_program(rows: int, length: int, hidden: int, vocab: int, chunk: Any) -> tuple[Any, tuple, float]:
    r = np.random.default_rng(0)
    h = jnp.asarray(r.normal(size=(rows, length, hidden)), jnp.float32)
    w = jnp.asarray(r.normal(size=(hidden, vocab)) * hidden**-0.5, jnp.float32)
    targets = jnp.asarray(r.integers(0, vocab, (rows, length)), jnp.int32)
    g = jnp.asarray(r.normal(size=(rows, length)), jnp.float32)

    def loss(h: jax.Array, w: jax.Array) -> jax.Array:
        return (head_logprobs(h, w, targets, jnp.float32(1.0), chunk) * g).sum()

    program = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(h, w).compile()
    return program, (h, w), program.memory_analysis().temp_size_in_bytes / MIB


def time_heads(rounds: int, heads: list[tuple[str, int, int, int, int]]) -> list[dict[str, Any]]:
    rows = []
    for label, b, t, d, v in heads:
        arms = {name: head_program(b, t, d, v, chunk) for name, chunk in (("whole", None), ("chunked", "auto"))}
        calls = {name: (lambda p=program, a=args: jax.block_until_ready(p(*a)))
                 for name, (program, args, _) in arms.items()}
        timed = timed_in_turns(calls["chunked"], calls["whole"], rounds)
        times = {"whole": timed["times"]["theirs"], "chunked": timed["times"]["ours"]}
        whole, chunked = (statistics.median(times[k]) for k in ("whole", "chunked"))
        paired = [c / w for c, w in zip(times["chunked"], times["whole"])]
        rows.append({"head": label, "rows": b, "length": t, "hidden": d, "vocab": v,
                     "steps": head_chunk_steps("auto", (b, t, d), v), "logits_mb": b * t * v * 4 / MIB,
                     "whole_temp_mb": arms["whole"][2], "chunked_temp_mb": arms["chunked"][2],
                     "whole_s": whole, "chunked_s": chunked, "time_ratio": statistics.median(paired),
                     "time_ratio_min": min(paired), "time_ratio_max": max(paired), "ideal_ratio": 4 / 3,
                     "whole_gflops": 3 * 2 * b * t * d * v / whole / 1e9, "times": times})
        print(f"  {label} {b} x {t}: done", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="0.5B memory and the first head only, 3 rounds")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    keep_freed_memory()
    info = machine()
    models = ["qwen2.5-0.5B"] if args.quick else list(QWEN)
    memory = []
    for name in models:
        for length in LENGTHS:
            whole, chunked = model_memory(name, length, None), model_memory(name, length, "auto")
            vocab = QWEN[name]["vocab_size"]
            memory.append({"model": name, "rows": ROWS, "length": length,
                           "logits_mb": ROWS * length * vocab * 4 / MIB,
                           "steps": head_chunk_steps("auto", (ROWS, length, QWEN[name]["hidden_size"]), vocab),
                           "whole_temp_mb": whole["temp_mb"], "chunked_temp_mb": chunked["temp_mb"],
                           "temp_ratio": chunked["temp_mb"] / whole["temp_mb"],
                           "whole_total_mb": whole["total_mb"], "chunked_total_mb": chunked["total_mb"]})
            print(f"  {name} {ROWS} x {length}: compiled", flush=True)
    heads = time_heads(3 if args.quick else args.rounds, HEADS[:1] if args.quick else HEADS)
    print(machine_line(info))
    print(f"auto chunk: {HEAD_CHUNK_BYTES / MIB:.0f} MiB of fp32 logits")
    print_table(memory, ["model", "rows", "length", "logits_mb", "steps", "whole_temp_mb", "chunked_temp_mb",
                         "temp_ratio", "whole_total_mb", "chunked_total_mb"])
    print_table(heads, ["head", "rows", "length", "vocab", "steps", "logits_mb", "whole_temp_mb", "chunked_temp_mb",
                        "whole_s", "chunked_s", "time_ratio", "ideal_ratio", "whole_gflops"])
    write_json(args.json, {"benchmark": "head_chunks", "machine": info, "auto_chunk_bytes": HEAD_CHUNK_BYTES,
                           "rounds": 3 if args.quick else args.rounds, "memory": memory, "heads": heads})


if __name__ == "__main__":
    main()
