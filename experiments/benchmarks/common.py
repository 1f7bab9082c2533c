"""Shared bits of the benchmark scripts: timing, memory, tiny HF checkpoints, table/JSON output."""

from __future__ import annotations

import json
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Llama-style sizes used across benchmarks (~10M and ~50M parameters).
SIZES: dict[str, dict[str, int]] = {
    "10M": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=8,
                num_key_value_heads=4, vocab_size=8192),
    "50M": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4, vocab_size=16384),
}


def median_seconds_in_turns(calls: dict[str, Callable[[], Any]], rounds: int,
                            warmup: int = 3) -> dict[str, float]:
    """Median seconds of each blocking call, the calls taking turns round by round (after `warmup`
    untimed rounds: compile, thread pools, first touch of outputs), so a shared machine's drift
    hits every arm alike."""
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(warmup):
        for fn in calls.values():
            fn()
    for _ in range(rounds):
        for k, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def host_devices_flag(argv: list[str], xla_flags: str) -> str:
    """XLA_FLAGS with the host device count of a `--cpu-devices N` in argv (unchanged without one),
    for a script to set before it imports jax: XLA reads the count when it opens its CPU backend."""
    count = None
    for i, arg in enumerate(argv):
        if arg == "--cpu-devices" and i + 1 < len(argv):
            count = argv[i + 1]
        elif arg.startswith("--cpu-devices="):
            count = arg.split("=", 1)[1]
    if count is None:
        return xla_flags
    return f"{xla_flags} --xla_force_host_platform_device_count={int(count)}".strip()


def make_llama_checkpoint(size: str, directory: str | None = None) -> Path:
    """A random-init Llama-style HF checkpoint (save_pretrained), loadable by torch and tbajax."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = Path(directory or tempfile.mkdtemp(prefix=f"bench-{size}-"))
    cfg = AutoConfig.for_model("llama", max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                               **SIZES[size])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).float().save_pretrained(directory)
    return directory


PAD = 0  # the pad id of the generated GPT-NeoX checkpoints


def make_neox_checkpoint(size: str, reward_model: bool = False, directory: str | None = None) -> Path:
    """A random-init GPT-NeoX checkpoint shaped like SIZES[size] (rotary_pct 0.25, parallel
    residual, as Pythia), as a causal LM or a one-label sequence classifier."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    s = SIZES[size]
    directory = Path(directory or tempfile.mkdtemp(prefix=f"bench-neox-{size}-"))
    cfg = AutoConfig.for_model(
        "gpt_neox", hidden_size=s["hidden_size"], intermediate_size=4 * s["hidden_size"],
        num_hidden_layers=s["num_hidden_layers"], num_attention_heads=s["num_attention_heads"],
        vocab_size=s["vocab_size"], rotary_pct=0.25, use_parallel_residual=True,
        max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=PAD, num_labels=1,
    )
    torch.manual_seed(0)
    cls = AutoModelForSequenceClassification if reward_model else AutoModelForCausalLM
    cls.from_config(cfg).float().save_pretrained(directory)
    return directory


def make_gemma3_checkpoint(size: str, directory: str | None = None, window: int = 128) -> Path:
    """A random-init Gemma 3 text checkpoint shaped like SIZES[size]: five layers of six attend
    within `window` positions (RoPE base 1e4), every sixth to all (base 1e6), as Gemma 3 1B."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    s = SIZES[size]
    directory = Path(directory or tempfile.mkdtemp(prefix=f"bench-gemma3-{size}-"))
    layers = s["num_hidden_layers"]
    head_dim = s["hidden_size"] // s["num_attention_heads"]
    cfg = AutoConfig.for_model(
        "gemma3_text", **s, head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=window,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
        max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=PAD,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).float().save_pretrained(directory)
    return directory


def make_gemma2_checkpoint(size: str, directory: str | None = None, window: int = 128) -> Path:
    """A random-init Gemma 2 checkpoint shaped like SIZES[size]: every other layer (the even ones)
    attends within `window` positions, the rest to all, with Gemma 2's soft-caps (scores at 50,
    logits at 30). torch transformers runs Gemma 2's attention eagerly (its SDPA path takes no
    soft-capping), as it would for a user."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    s = SIZES[size]
    directory = Path(directory or tempfile.mkdtemp(prefix=f"bench-gemma2-{size}-"))
    head_dim = s["hidden_size"] // s["num_attention_heads"]
    cfg = AutoConfig.for_model(
        "gemma2", **s, head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=window,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=PAD,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).float().save_pretrained(directory)
    return directory


def make_qwen3_moe_checkpoint(size: str, directory: str | None = None) -> Path:
    """A random-init Qwen3-MoE checkpoint with SIZES[size]'s attention and 8 experts a layer, each
    token through 2 of them, each expert a quarter of the dense MLP's width (so a token's expert
    work is half the dense model's, its expert weights twice the dense model's)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    s = SIZES[size]
    directory = Path(directory or tempfile.mkdtemp(prefix=f"bench-qwen3moe-{size}-"))
    cfg = AutoConfig.for_model(
        "qwen3_moe", **s, head_dim=s["hidden_size"] // s["num_attention_heads"], num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=s["intermediate_size"] // 4, norm_topk_prob=True,
        max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=PAD,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).float().save_pretrained(directory)
    return directory


def make_gpt_oss_checkpoint(size: str, directory: str | None = None) -> Path:
    """A random-init GPT-OSS checkpoint with SIZES[size]'s attention (biased, with sinks, every other
    layer windowed to 128 positions, YaRN as the released models) and the experts of
    `make_qwen3_moe_checkpoint` (8 a layer, 2 a token, a quarter of the dense width), biased and
    under the clamped SwiGLU."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    s = dict(SIZES[size])
    directory = Path(directory or tempfile.mkdtemp(prefix=f"bench-gptoss-{size}-"))
    layers = s["num_hidden_layers"]
    cfg = AutoConfig.for_model(
        "gpt_oss", **{**s, "intermediate_size": s["intermediate_size"] // 4},
        head_dim=s["hidden_size"] // s["num_attention_heads"], num_local_experts=8, num_experts_per_tok=2,
        sliding_window=128,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=PAD,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).float().save_pretrained(directory)
    return directory


def timed_in_turns(ours: Callable[[], Any], theirs: Callable[[], Any], repeats: int) -> dict[str, Any]:
    """Time two blocking calls in alternating rounds (ours, theirs, ours, ...) after one untimed
    call each (compile / warm-up), so a shared machine's speed drift hits both sides of a round
    alike. Returns each side's first-call and best seconds, and the median, min and max over
    rounds of theirs / ours (> 1: ours faster)."""
    first = {}
    for name, fn in (("ours", ours), ("theirs", theirs)):
        t0 = time.perf_counter()
        fn()
        first[name] = time.perf_counter() - t0
    times: dict[str, list[float]] = {"ours": [], "theirs": []}
    for _ in range(repeats):
        for name, fn in (("ours", ours), ("theirs", theirs)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    paired = [t / o for o, t in zip(times["ours"], times["theirs"])]
    return {"first_s": first, "best_s": {k: min(v) for k, v in times.items()}, "times": times,
            "ratio": statistics.median(paired), "ratio_min": min(paired), "ratio_max": max(paired)}


def best_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """Best time of a blocking call over `repeats` calls, after one untimed warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def keep_freed_memory() -> str:
    """Configure the host allocator as `python -m tbajax.main` does for every role process
    (`tbajax.system.host_memory`); a benchmark calls it first thing, so both sides of its
    comparison run with it ($TBAJAX_HOST_MALLOC=system measures glibc's defaults instead)."""
    from tbajax.system.host_memory import keep_freed_memory as keep

    return keep()


def machine() -> dict[str, Any]:
    """Where a figure was measured, with the machine's fp32 matmul rate measured now (the same
    record a run's summary.json carries) and the host allocator mode in effect."""
    from tbajax.system.host_memory import effective_mode
    from tbajax.system.metrics import machine_info

    return {**machine_info(), "host_malloc": effective_mode()}


def machine_line(info: dict[str, Any]) -> str:
    """One line naming the machine a table was measured on (its speed measured in the same run)."""
    return (f"machine: {info.get('cpu_model') or info.get('cpu')} ({', '.join(info.get('cpu_flags') or []) or 'no flags read'}), "
            f"{info['cpu_count']} cores, fp32 matmul {info['matmul_gflops']:.0f} GFLOP/s, "
            f"load average {info['load_average_1m']:.1f}, jax {info['jax']}")


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2))
        print(f"wrote {path}")
