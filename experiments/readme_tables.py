"""Write the measured-figure tables of the README and of the benchmarks' record from the committed
result files, so every number they state traces to a file a script in this repo produced.

    python experiments/readme_tables.py            # print the tables
    python experiments/readme_tables.py --write    # replace the generated blocks in both documents
    python experiments/readme_tables.py --check    # exit 1 if either is out of date

Sources: `experiments/results/<run>/summary.json` (+ `config.json` beside it) for the experiment
runs (README.md's `runs` block), and `experiments/results/benchmarks/*.json` /
`experiments/results/chaos/*.json`, each written by a script's `--json PATH`
(`experiments/results/benchmarks/README.md`'s `benchmarks` block). A block is the text between
`<!-- generated:NAME -->` and `<!-- /generated:NAME -->`; its links are relative to its document.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "experiments" / "results"
README = REPO / "README.md"
BENCHMARKS_RECORD = RESULTS / "benchmarks" / "README.md"

# Tables shown per result file: {list key in the JSON: columns}; a file not listed here shows its
# "rows" (or "results") with the first scalar columns. "total" is a single summary line.
TABLES: dict[str, dict[str, list[str]]] = {
    "forward": {"rows": ["model", "size", "batch", "seq", "tbajax_tok_s", "torch_tok_s", "ratio", "ratio_min",
                         "ratio_max", "before_tok_s", "speedup", "temp_mb", "before_temp_mb", "stub_tok_s",
                         "torch_stub_tok_s", "stub_ratio", "attention_ms", "torch_attention_ms"]},
    "train_step": {
        "rows": ["size", "batch", "tbajax_tok_s", "torch_tok_s", "ratio", "ratio_min", "ratio_max"],
        "objective_rows": ["size", "objective", "reference_forward", "xla_gflop", "flop_saving", "best_step_s",
                           "time_saving"],
        "window_rows": ["size", "prompt", "arm", "xla_gflop", "flop_saving", "best_step_s", "time_saving"],
    },
    "mxfp4": {"rows": ["arm", "experts", "values_M", "seconds", "values_per_s_M", "x_transformers",
                       "gpt-oss-20b_s", "gpt-oss-120b_s"]},
    "backward_layouts": {"rows": ["size", "batch", "precision", "arm", "generic_dots", "xla_gflop", "step_s",
                                  "best_step_s", "vs_now", "vs_now_min", "vs_now_max", "first_loss",
                                  "first_grad_norm"]},
    "reward_scoring": {"rows": ["size", "k", "prompt_tokens", "response_tokens", "real_tokens", "packed_tokens",
                                "packed_s", "rows_s", "torch_s", "packed_vs_rows", "packed_vs_torch", "rows_vs_torch",
                                "max_abs_diff_packed_torch"]},
    "stores": {"rows": ["what", "size", "MB", "ms", "MB_s", "x_raw"]},
    "stores_baseline": {"rows": ["what", "size", "MB", "ms", "MB_s", "x_raw"]},
    "stores_lora": {"rows": ["what", "size", "MB", "ms", "MB_s", "bytes_vs_full", "time_vs_full"]},
    "trainer_loop": {"rows": ["loop", "steps", "vs_serial", "idle_share", "idle_bound", "steps_per_s", "step_ms", "prep_ms"]},
    "sampler_quick": {"rows": ["model", "batch", "prompt_len", "new_tokens", "ours_tok_s", "ours_decode_tok_s",
                               "torch_tok_s", "ratio", "roofline_frac"]},
    "sampler": {"rows": ["model", "batch", "prompt_len", "new_tokens", "ours_tok_s", "ours_decode_tok_s",
                         "torch_tok_s", "torch_threads", "ratio", "roofline_frac", "ours_step_ms",
                         "ours_matmul_ms", "ours_attention_ms", "torch_matmul_ms", "bound_ratio", "bandwidth_frac"]},
    "redteam_trainer_memory": {"arms": ["arm", "rss_after_load_mb", "state_mb", "rss_after_updates_mb", "update_s"],
                               "ratios_after_over_before": ["rss_after_updates_mb", "state_mb", "update_s"]},
    "continuous_batching": {
        "rows": ["engine", "samples", "tokens", "seconds", "samples_per_s", "tokens_per_s", "slot_occupancy",
                 "vs_static", "step_ms", "moves", "pauses"],
        "workload": ["prompts", "num_samples", "median_len", "max_len", "cap", "decode_slots", "decode_chunk"],
        "swap": ["load_s", "load_and_prepare_s", "swap_s", "decode_step_s", "publish_to_swapped_s",
                 "publish_to_first_token_est_s", "publish_to_first_chunk_done_s"],
    },
    "head_chunks": {"memory": ["model", "rows", "length", "logits_mb", "steps", "whole_temp_mb", "chunked_temp_mb",
                               "temp_ratio", "whole_total_mb", "chunked_total_mb"],
                    "heads": ["head", "rows", "length", "vocab", "steps", "logits_mb", "whole_temp_mb",
                              "chunked_temp_mb", "whole_s", "chunked_s", "time_ratio", "time_ratio_min",
                              "time_ratio_max", "ideal_ratio"]},
    "decode_head": {"rows": ["model", "rows", "hidden", "vocab", "dot_ms", "fused_ms", "unfused_ms", "ratio",
                             "ratio_min", "ratio_max", "overhead"]},
    "transpose_fusion": {"rows": ["producer", "shape", "MB", "fused_ms", "unfused_ms", "producer_only_ms", "ratio"]},
    "batched_dot": {"rows": ["shape", "xla_gflops", "torch_gflops", "xla_vs_torch", "xla_1core_gflops",
                             "torch_1core_gflops", "xla_cores_speedup", "torch_cores_speedup"]},
    "dot_backend": {"rows": ["program", "size", "ynnpack_s", "eigen_s", "ratio", "ratio_min", "ratio_max"]},
    "dot_backend_emitters": {"rows": ["program", "size", "mlir_emitters_s", "legacy_emitters_s", "ratio",
                                      "ratio_min", "ratio_max", "mlir_emitters_compile_s",
                                      "legacy_emitters_compile_s", "compile_ratio"]},
    "compile_cache": {"medians": ["arm", "launcher_wall_s", "run_wall_s", "trainer_wait_s", "first_generate_s",
                                  "first_eval_s", "wall_vs_off", "first_generate_vs_off"],
                      "rows": ["round", "arm", "launcher_wall_s", "first_generate_s", "first_eval_s", "cache_files",
                               "cache_mb"]},
    "test_suite": {"rows": ["arm", "xla_flags", "wall_s", "x_first_arm", "passed", "failed", "skipped",
                            "matmul_gflops"]},
    "packed_groups": {"results": ["layout", "tokens_in_step", "step_s", "speedup", "token_ratio",
                                  "estimated_speedup", "auto_picks", "loss_rel_diff"],
                      "block_rows": ["width", "default_uses_blocks", "causal_blocks_s", "whole_rows_s",
                                     "blocks_speedup"]},
    "op_profile": {"rows": ["program", "model", "size", "batch", "tokens", "wall_ms", "op_ms", "attention_share",
                            "matmul_share", "lm_head_share", "sampling_share", "other_share"],
                   "part_rows": ["program", "model", "size", "batch", "part", "direction", "ms", "share"]},
    "chaos": {"total": ["scenarios", "scenarios_sane", "kills_survived", "rows_committed", "rows_read_back",
                        "torn_rows", "duplicated_rows", "row_count_ever_went_down", "versions_monotone"]},
}
# sampler.py's files carry no "benchmark" key: these names show the sampler's columns
TABLES.update({name: TABLES["sampler"] for name in (
    "sampler_before_decode_fixes", "sampler_before_serving_layout", "sampler_smollm2",
    "sampler_smollm2_before_serving_layout", "sampler_before_out_major", "sampler_smollm2_before_out_major",
    "sampler_0.5B", "sampler_0.5B_before_out_major", "sampler_pythia410M", "sampler_pythia410M_before_out_major",
    "sampler_pythia410M_before_mha_attention", "sampler_before_decode_phases", "sampler_long",
    "sampler_long_one_cache", "sampler_bf16", "sampler_bf16_before_fp32_accumulation", "sampler_amd_epyc",
    "sampler_amd_epyc_before_weight_first", "sampler_gemma2", "sampler_gemma3", "sampler_amd_epyc_avx512", "sampler_qwen3_moe",
    "sampler_gpt_oss")})
TABLES["sampler_cpu_devices"] = {"rows": ["model", "batch", "prompt_len", "new_tokens", "ours_tok_s", "ours_step_ms",
                                          "roofline_frac", "torch_tok_s", "torch_threads", "ratio", "mesh_devices",
                                          "mesh_s", "mesh_speedup", "mesh_ratio", "mesh_roofline_frac"]}
TABLES["sampler_cpu_devices_with_torch"] = TABLES["sampler_cpu_devices"]
TABLES["sampler_amd_epyc_avx512_cpu_devices"] = TABLES["sampler_cpu_devices"]
TABLES["backward_layouts_bf16"] = TABLES["backward_layouts"]
TABLES.update({name: TABLES["forward"] for name in ("forward_bf16", "forward_bf16_before_fp32_accumulation",
                                                    "forward_amd_epyc", "forward_amd_epyc_avx512")})
TABLES.update({name: TABLES["train_step"] for name in (
    "train_step_bf16", "train_step_bf16_before_fp32_accumulation",
    "train_step_bf16_before_row_major_transpose", "train_step_amd_epyc",
    "train_step_amd_epyc_earlier", "train_step_amd_epyc_avx512", "train_step_qwen3_moe", "train_step_gpt_oss")})
TABLES["shared_prompt"] = {"rows": ["model", "shape", "prompts_x_k", "tokens", "shared_tok_s", "copied_tok_s",
                                     "speedup", "shared_kv_mb", "copied_kv_mb", "same_rows", "torch_tok_s",
                                     "shared_vs_torch", "copied_vs_torch"]}
TABLES["continuous_shared_prompt"] = {"rows": ["workload", "arm", "prompts_x_k", "prompt_tokens", "slots", "pool",
                                                "seconds", "samples_per_s", "vs_copied", "vs_copied_min",
                                                "vs_copied_max", "slot_occupancy", "kv_mb", "identical",
                                                "samples"]}
TABLES["continuous_schedule"] = {"rows": ["shape", "prompts", "pool_factor", "pool", "decode_steps",
                                           "steps_vs_pool_2x", "occupancy", "chunks", "steps_over_ideal"]}
TABLES["decode_attention_cores"] = {"rows": ["shape", "b_kv_g_d_slots_layers", "cache_MB", "cores", "ms_1core",
                                              "ms_all_cores", "speedup", "GB_s_1core", "GB_s_all_cores",
                                              "read_GB_s_1thread", "read_GB_s_all_threads", "ideal_ms_all_cores",
                                              "ms_over_ideal"]}
TABLES["searcher_reference"] = {"rows": ["model", "shape", "prompts_x_k", "tokens", "packed_s", "rows_s",
                                          "sample_only_s", "speedup", "reference_saving", "max_abs_diff"]}
TABLES["bf16_matmul"] = {"rows": ["product", "rows", "in", "out", "plain_gflops", "fp32_acc_gflops",
                                  "before_gflops", "torch_gflops", "speedup", "plain_vs_torch",
                                  "fp32_acc_vs_torch", "plain_max_err", "fp32_acc_max_err"]}

TABLES["weight_first"] = {
    "rows": ["dtype", "weight", "rows", "in_major_ms", "rows_first_ms", "weight_first_ms", "torch_ms",
             "weight_first_speedup", "weight_first_vs_torch", "rows_first_vs_torch"],
    "sampler_rows": ["model", "batch", "tokens", "weight_first_s", "rows_first_s", "speedup", "same_tokens_frac"],
}
TABLES["weight_first_smollm2"] = TABLES["weight_first"]
TABLES["fsdp_sampling"] = {"rows": ["model", "batch", "tokens", "devices", "arm", "s", "tok_s", "vs_data",
                                     "all_gathers", "prepare_s", "rows_as_data_mesh"]}


# Absolute times and rates: shown only when the file records the machine's matmul rate (machines of
# one kind differ ~3x in speed); ratios measured in one run are shown always.
ABSOLUTE = {"update_s", "tbajax_tok_s", "torch_tok_s", "step_s", "best_step_s", "ms", "MB_s", "ours_tok_s",
            "ours_decode_tok_s", "wall_time_s", "seconds", "samples_per_s", "tokens_per_s", "load_s", "swap_s",
            "decode_step_s", "load_and_prepare_s", "publish_to_swapped_s", "publish_to_first_token_est_s",
            "publish_to_first_chunk_done_s", "step_ms",
            "ynnpack_s", "eigen_s", "mlir_emitters_s", "legacy_emitters_s", "mlir_emitters_compile_s",
            "legacy_emitters_compile_s", "wall_s", "launcher_wall_s", "run_wall_s", "trainer_wait_s",
            "first_generate_s", "first_eval_s", "ours_step_ms", "ours_matmul_ms", "torch_matmul_ms",
            "ours_attention_ms", "xla_gflops", "torch_gflops", "xla_1core_gflops", "torch_1core_gflops",
            "fused_ms", "unfused_ms", "producer_only_ms", "wall_ms", "op_ms", "plain_gflops",
            "fp32_acc_gflops", "before_gflops", "mesh_s", "before_tok_s", "stub_tok_s", "torch_stub_tok_s",
            "attention_ms", "torch_attention_ms", "shared_tok_s", "copied_tok_s", "packed_s", "rows_s",
            "sample_only_s", "ms_1core", "ms_all_cores", "ideal_ms_all_cores", "GB_s_1core", "GB_s_all_cores",
            "read_GB_s_1thread", "read_GB_s_all_threads", "in_major_ms", "rows_first_ms", "weight_first_ms",
            "torch_ms", "weight_first_s", "rows_first_s", "prepare_s", "s", "tok_s"}


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v != v:
            return "nan"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        if abs(v) >= 1 or v == 0:
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return f"{v:.3g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    columns = [c for c in columns if any(c in r for r in rows)]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def _machine(info: dict[str, Any] | None) -> str:
    if not info:
        return "machine not recorded"
    parts = [f"{info.get('cpu_count', '?')} CPU cores" if info.get("backend", "cpu") == "cpu" else str(info.get("backend"))]
    if info.get("cpu_model"):
        parts[0] += f" ({info['cpu_model']}; {', '.join(info.get('cpu_flags') or []) or 'no AVX flags'})"
    if info.get("matmul_gflops"):
        parts.append(f"{info['matmul_gflops']:.0f} GFLOP/s fp32 matmul measured in the same run")
    else:
        parts.append("matmul rate not recorded")
    if info.get("load_average_1m") is not None:
        parts.append(f"load average {info['load_average_1m']:.1f} while measuring")
    parts.append(f"jax {info.get('jax', '?')}, Python {info.get('python', '?')}, {info.get('date', 'date not recorded')}")
    return "; ".join(parts)


def _tables(name: str, payload: dict[str, Any]) -> list[tuple[list[dict[str, Any]], list[str]]]:
    spec = TABLES.get(name)
    if spec is None:
        key = "rows" if "rows" in payload else "results"
        rows = [r for r in payload.get(key, []) if isinstance(r, dict)]
        if not rows:
            return []
        return [(rows, [k for k, v in rows[0].items() if isinstance(v, (int, float, str, bool))][:9])]
    out = []
    for key, columns in spec.items():
        value = payload.get(key)
        rows = [value] if isinstance(value, dict) else [r for r in (value or []) if isinstance(r, dict)]
        if rows:
            out.append((rows, columns))
    return out


def _link(path: Path, doc: Path) -> str:
    """`path` as a link target from `doc` (relative, as a markdown renderer resolves it)."""
    return Path(os.path.relpath(path, doc.parent)).as_posix()


def benchmarks_block(doc: Path) -> str:
    out = []
    files = sorted((RESULTS / "benchmarks").glob("*.json")) + sorted((RESULTS / "chaos").glob("*.json"))
    for path in files:
        payload = json.loads(path.read_text())
        name = payload.get("benchmark") or (path.parent.name if path.parent.name != "benchmarks" else path.stem)
        tables = _tables(name, payload)
        if not tables:
            continue
        rel = _link(path, doc)
        info = payload.get("machine")
        if info is None and "matmul_flops" in payload:  # the sampler benchmark's own layout
            info = {"cpu_count": payload.get("cpus"), "jax": payload.get("jax"),
                    "matmul_gflops": payload["matmul_flops"] / 1e9}
        out.append(f"**`{name}`** ([{path.name}]({rel}); {_machine(info)})\n")
        timed = bool((info or {}).get("matmul_gflops"))
        for rows, columns in tables:
            shown = columns if timed else [c for c in columns if c not in ABSOLUTE]
            out.append(_table(rows, shown) + "\n")
        if payload.get("command"):
            out.append(f"`{payload['command']}`\n")
    return "\n".join(out).rstrip()


def _eval_change(s: dict[str, Any]) -> str:
    metric = s.get("eval_metric", "accuracy")
    start = s.get("eval_score_start", s.get("eval_accuracy_start"))
    end = s.get("eval_score_end", s.get("eval_accuracy_end"))
    if start is None or end is None:
        return ""
    if metric == "accuracy":
        return f"accuracy {start:.1%} → {end:.1%}"
    if metric == "attack_success_rate":  # red-teaming: success alone hides a collapse to a few attacks
        a, b = s.get("eval_start", {}), s.get("eval_end", {})
        extra = [f"{label} {_fmt(a[k])} → {_fmt(b[k])}" for k, label in
                 (("eval_num_unique_successful", "unique successful"), ("eval_diversity", "diversity"))
                 if k in a and k in b]
        return "; ".join([f"ASR {start:.1%} → {end:.1%}", *extra])
    return f"{metric} {start:.3g} → {end:.3g}"


def _run_row(path: Path, doc: Path) -> dict[str, Any]:
    s = json.loads(path.read_text())
    timed = "wall_time_s" in s and bool((s.get("machine") or {}).get("matmul_gflops"))
    row: dict[str, Any] = {
        "run": f"[{path.parent.relative_to(RESULTS)}]({_link(path, doc)})",
        "objective": s.get("objective", ""),
        "eval: start → end": _eval_change(s),
        "steps": s.get("trainer_steps", ""),
        # an absolute time means something only next to the matmul rate measured in the same run
        "wall time": f"{s['wall_time_s']:.0f} s" if timed else "no matmul rate recorded",
        "samples": s.get("samples_generated", ""),
        "trainer wait": f"{s['trainer_wait_s']:.0f} s" if timed and "trainer_wait_s" in s else "",
        "lag mean / max": f"{s['policy_lag_mean']:.2f} / {s['policy_lag_max']}" if "policy_lag_mean" in s else "not recorded",
        "machine": _machine(s.get("machine")),
    }
    return row


def runs_block(doc: Path) -> str:
    rows = [_run_row(p, doc) for p in sorted(RESULTS.glob("**/summary.json"))]
    if not rows:
        return "(no committed runs)"
    return _table(rows, list(rows[0]))


# document -> the blocks it holds
DOCUMENTS: dict[Path, dict[str, Callable[[Path], str]]] = {
    README: {"runs": runs_block},
    BENCHMARKS_RECORD: {"benchmarks": benchmarks_block},
}


def render(text: str, doc: Path) -> str:
    """`text` (the content of `doc`) with its generated blocks made from the result files."""
    for name, make in DOCUMENTS[doc].items():
        pattern = re.compile(rf"(<!-- generated:{name} -->\n)(?:.*?\n)?(<!-- /generated:{name} -->)", re.DOTALL)
        if not pattern.search(text):
            raise SystemExit(f"{doc.relative_to(REPO)} has no <!-- generated:{name} --> block")
        text = pattern.sub(lambda m: m.group(1) + make(doc) + "\n" + m.group(2), text)
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the generated blocks of both documents")
    mode.add_argument("--check", action="store_true", help="exit 1 when a document differs from the files")
    args = ap.parse_args()
    if not (args.write or args.check):
        for doc, blocks in DOCUMENTS.items():
            for name, make in blocks.items():
                print(f"## {doc.relative_to(REPO)}: {name}\n{make(doc)}\n")
        return 0
    stale = []
    for doc in DOCUMENTS:
        current = doc.read_text()
        fresh = render(current, doc)
        if fresh == current:
            continue
        if args.write:
            doc.write_text(fresh)
            print(f"updated {doc.relative_to(REPO)}")
        else:
            stale.append(str(doc.relative_to(REPO)))
    if stale:
        print(f"generated tables out of date in {', '.join(stale)}: run python experiments/readme_tables.py --write")
        return 1
    if args.check:
        print("the generated tables match the result files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
