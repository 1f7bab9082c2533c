"""Where a program's time goes: an XLA profile of tbajax's decode step, forward pass and train step,
split by the part of the model each op belongs to.

    python experiments/benchmarks/op_profile.py [--quick] [--json PATH] [--programs decode forward train_step]

Each program runs a few times under `jax.profiler.trace`. Every op XLA:CPU runs (a fusion, a
kernel, a copy) is a trace event that names its HLO module and instruction; the module's optimized
HLO, dumped by XLA in this run, gives the instruction's `op_name`, whose named scopes
(`tbajax.op_scopes`) say which part it belongs to: weight matmuls, attention, KV-cache writes,
norms, the LM head, sampling, ... An op that XLA fused from several parts counts under all of
their names joined ("attention+matmul": a fusion cannot be split); its direction is "backward"
when it comes from a VJP and "forward" otherwise (the optimizer update too). Loop and call ops are not
counted (their time is their body's). On a multi-core CPU two ops may run at once, so op time
can add up to more than the wall time: shares are of op time, and the wall time is measured
apart, without the profiler. Written for and run on XLA:CPU; not tried on a GPU.

Rows: the sampler's decode step (Llama 10M / 50M of `sampler.py`, batch 32 and 128, 64 prompt +
128 new tokens; per decode step, prefill apart; fp32, or bf16 with --decode-dtype), the forward
pass (Llama and GPT-NeoX 50M, 16 x 256) and the TB train step (10M and 50M, 16 x 128, as `train_step.py`).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]

import jax  # noqa: E402
import numpy as np  # noqa: E402

from tbajax.op_scopes import PARTS, PHASES  # noqa: E402

# The benchmark helpers (`common`, `sampler`, ...) are imported where they are used: tests import
# this module's parsing functions, and a module named `common` cached here would shadow
# experiments/studies/common.py for every later import in the same process.

LOOP_OPCODES = {"while", "conditional", "call"}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*? ([a-z][\w\-]*)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"calls=%?([\w.\-]+)")


# ----------------------------------------------------------------------------- HLO and trace


def scopes_of(op_name: str) -> tuple[str | None, str | None, bool]:
    """(innermost part, phase, backward?) named in an HLO op_name such as
    'jit(fn)/while/body/decode/attention/reduce_sum' or '.../transpose(jvp(matmul))/dot_general'."""
    words = re.findall(r"[A-Za-z_]+", op_name)
    parts = [w for w in words if w in PARTS]
    phase = next((w for w in words if w in PHASES), None)
    return (parts[-1] if parts else None), phase, "transpose(" in op_name  # JAX's name for a VJP


class Module:
    """One optimized HLO module: for each instruction of its non-fused computations, its opcode and
    the scopes of every op in it (all of a fusion's ops)."""

    def __init__(self, text: str):
        computations: dict[str, list[tuple[str, str, str, str | None]]] = {}
        current: list[tuple[str, str, str, str | None]] | None = None
        for line in text.splitlines():
            head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+) .*\{\s*$", line)
            if head and not line.startswith(" "):
                current = computations.setdefault(head.group(1), [])
                continue
            m = _INSTRUCTION.match(line)
            if m and current is not None:
                name_m, calls_m = _OP_NAME.search(line), _CALLS.search(line)
                current.append((m.group(1), m.group(2), name_m.group(1) if name_m else "",
                                calls_m.group(1) if calls_m else None))
        self.ops: dict[str, tuple[str, list[str]]] = {}
        for instructions in computations.values():
            for name, opcode, op_name, calls in instructions:
                names = [op_name]
                if opcode == "fusion" and calls in computations:
                    names = [n for _, _, n, _ in computations[calls] if n] or names
                self.ops[name] = (opcode, names)

    def label(self, instruction: str) -> tuple[str, str | None, bool, str]:
        """(part label, phase, backward?, opcode) of a top-level instruction."""
        opcode, names = self.ops.get(instruction, ("?", []))
        scopes = [scopes_of(n) for n in names]
        parts = sorted({p for p, _, _ in scopes if p}) or ["other"]
        phase = next((ph for _, ph, _ in scopes if ph), None)
        backward = bool(scopes) and all(b for _, _, b in scopes)
        return "+".join(parts), phase, backward, opcode


@dataclasses.dataclass(frozen=True)
class Capture:
    """Where a run's profiles come from: the directory XLA dumps every compiled module's optimized
    HLO to, and where traces go (None: a temporary directory each)."""

    hlo_dir: str
    trace_root: str | None = None


def dump_hlo(trace_root: str | None = None) -> Capture:
    """Have XLA write the optimized HLO of every module this process compiles to a new directory
    (XLA reads the flag when jax starts its backend: call this before anything runs)."""
    directory = tempfile.mkdtemp(prefix="op-profile-hlo-")
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_dump_to={directory} --xla_dump_hlo_as_text".strip()
    return Capture(directory, trace_root)


def load_modules(dump_dir: str) -> dict[int, Module]:
    """The modules XLA dumped, by program id (the number in their file name)."""
    out = {}
    for path in Path(dump_dir).glob("module_*after_optimizations.txt"):
        out[int(path.name.split(".")[0].removeprefix("module_"))] = Module(path.read_text())
    return out


def op_seconds(trace_dir: str) -> dict[tuple[int, str], float]:
    """Seconds per (program id, HLO instruction) over every op event of a trace."""
    paths = sorted(Path(trace_dir).rglob("*.xplane.pb"))
    if not paths:
        raise RuntimeError(f"jax.profiler wrote no trace under {trace_dir}")
    seconds: dict[tuple[int, str], float] = collections.Counter()
    for plane in jax.profiler.ProfileData.from_file(str(paths[-1])).planes:
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if "hlo_op" in stats and "program_id" in stats:
                    seconds[(int(stats["program_id"]), str(stats["hlo_op"]))] += event.duration_ns * 1e-9
    return seconds


def profile(run: Callable[[], Any], calls: int, capture: Capture) -> list[dict[str, Any]]:
    """Op seconds of `calls` runs (after one untimed run), by (part, phase, direction), largest first,
    each with its three largest ops."""
    run()
    trace_dir = tempfile.mkdtemp(prefix="op-profile-trace-", dir=capture.trace_root)
    with jax.profiler.trace(trace_dir):
        for _ in range(calls):
            run()
    modules = load_modules(capture.hlo_dir)
    groups: dict[tuple[str, str | None, bool], dict[str, Any]] = {}
    for (program, instruction), s in op_seconds(trace_dir).items():
        module = modules.get(program)
        if module is None:
            continue
        part, phase, backward, opcode = module.label(instruction)
        if opcode in LOOP_OPCODES:
            continue
        g = groups.setdefault((part, phase, backward), {"part": part, "phase": phase,
                                                       "direction": "backward" if backward else "forward",
                                                       "s": 0.0, "ops": collections.Counter()})
        g["s"] += s / calls
        g["ops"][f"{opcode} {instruction}"] += s / calls
    rows = sorted(groups.values(), key=lambda g: -g["s"])
    for g in rows:
        g["top_ops"] = [[name, s] for name, s in g.pop("ops").most_common(3)]
    return rows


def summarise(name: str, setting: dict[str, Any], groups: list[dict[str, Any]], wall_s: float | None,
              per: float, phase: str | None = None) -> dict[str, Any]:
    """A result row: op ms by part (per `per` units of the program: calls or decode steps)."""
    chosen = [g for g in groups if phase is None or g["phase"] == phase]
    total = sum(g["s"] for g in chosen)
    parts = [{
        "part": g["part"], "direction": g["direction"], "ms": g["s"] / per * 1e3,
        "share": g["s"] / total if total else 0.0,
        "top_ops": [[op, s / per * 1e3] for op, s in g["top_ops"]],
    } for g in chosen]
    wall_ms = None if wall_s is None else wall_s / per * 1e3
    return {"program": name, **setting, "wall_ms": wall_ms, "op_ms": total / per * 1e3, "parts": parts}


# ----------------------------------------------------------------------------- programs


def decode_rows(sizes: list[str], batches: list[int], prompt_len: int, new_tokens: int, calls: int,
                capture: Capture, dtype: str = "float32") -> list[dict]:
    import sampler as bench_sampler
    from common import best_seconds

    from tbajax.models import load_model
    from tbajax.sampling import Sampler, SamplingConfig

    rows = []
    for size in sizes:
        directory = Path(tempfile.mkdtemp(prefix=f"op-profile-{size}-"))
        bench_sampler.build_random_llama(directory, bench_sampler.SIZES[size])
        model = load_model(directory, param_dtype=dtype, dtype=dtype)
        sampler = Sampler(model, max_cache_length=prompt_len + new_tokens, min_prompt_bucket=prompt_len)
        config = SamplingConfig(max_new_tokens=new_tokens, temperature=1.0, stop_token_ids=())
        for batch in batches:
            prompts = bench_sampler.prompts_for(batch, prompt_len, model.config.vocab_size)

            def run(prompts: list[list[int]] = prompts) -> None:
                sampler.sample(prompts, config, jax.random.key(0))

            groups = profile(run, calls, capture)
            wall = best_seconds(run, calls)
            setting = {"model": "llama", "size": size, "batch": batch, "tokens": f"{prompt_len}+{new_tokens}",
                       "dtype": dtype}
            steps = new_tokens - 1
            rows.append(summarise("decode step", setting, groups, wall, steps, phase="decode"))
            rows[-1]["wall_ms_note"] = "a whole generate call / decode steps (prefill included)"
            rows.append(summarise("prefill", setting, groups, None, 1, phase="prefill"))
    return rows


def forward_rows(models: list[str], size: str, batch: int, seq: int, calls: int,
                 capture: Capture) -> list[dict]:
    import jax.numpy as jnp
    from common import best_seconds, make_llama_checkpoint
    from flax import nnx
    from forward import make_neox_checkpoint

    from tbajax.models import load_model

    rows = []
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 8000, (batch, seq)))
    for name in models:
        directory = make_llama_checkpoint(size) if name == "llama" else make_neox_checkpoint(size)
        graphdef, state = nnx.split(load_model(directory))
        forward = jax.jit(lambda s, t, g=graphdef: nnx.merge(g, s)(t)[0])

        def run(forward: Any = forward, state: Any = state) -> None:
            forward(state, tokens).block_until_ready()

        groups = profile(run, calls, capture)
        rows.append(summarise("forward", {"model": name, "size": size, "batch": batch, "tokens": seq}, groups,
                              best_seconds(run, calls), 1))
    return rows


def train_step_rows(sizes: list[str], rows_per_batch: int, seq: int, calls: int,
                    capture: Capture) -> list[dict]:
    from common import best_seconds, make_llama_checkpoint
    from train_step import tb_batch, trainer_config

    from tbajax.models import load_model
    from tbajax.training import init_train_state, make_train_step

    out = []
    for size in sizes:
        model = load_model(make_llama_checkpoint(size), scan_layers="auto")
        config = trainer_config("fp32")
        graphdef, state = init_train_state(model, config)
        batch = tb_batch(rows_per_batch, seq, model.config.vocab_size)  # response windows, as train_step.py
        step = make_train_step(graphdef, config, "tb").lower(state, batch).compile()
        holder = [state]

        def run() -> None:
            holder[0], o = step(holder[0], batch)  # donates the old state
            o.metrics["loss"].block_until_ready()

        groups = profile(run, calls, capture)
        out.append(summarise("train step (TB)", {"model": "llama", "size": size, "batch": rows_per_batch,
                                                 "tokens": seq}, groups, best_seconds(run, calls), 1))
    return out


# ----------------------------------------------------------------------------- report


GROUPS = ("attention", "matmul", "lm_head", "sampling", "other")


def group_of(label: str) -> str:
    """The coarse group of a part label: an op with any attention or KV-write part in it counts as
    attention (XLA fuses the value product with the output projection, the scores with RoPE), then
    the LM head, sampling, weight matmuls (fused with a norm or an activation or not); the rest
    (norms, RoPE, activations, embedding, log-probs, objective, optimizer) is other."""
    parts = set(label.split("+"))
    if parts & {"attention", "kv_write"}:
        return "attention"
    for group in ("lm_head", "sampling", "matmul"):
        if group in parts:
            return group
    return "other"


def with_group_shares(row: dict) -> dict:
    """The row with each group's share of its op time (`<group>_share`)."""
    total = sum(p["ms"] for p in row["parts"]) or 1.0
    shares = dict.fromkeys(GROUPS, 0.0)
    for p in row["parts"]:
        shares[group_of(p["part"])] += p["ms"] / total
    return {**row, **{f"{g}_share": v for g, v in shares.items()}}


def part_rows(rows: list[dict], min_share: float = 0.05) -> list[dict]:
    """One flat row per (program row, part) with at least `min_share` of its op time, prefill rows
    left out: the benchmarks' record's table (`experiments/readme_tables.py`)."""
    return [{"program": r["program"], "model": r["model"], "size": r["size"], "batch": r["batch"],
             "part": p["part"], "direction": p["direction"], "ms": p["ms"], "share": p["share"]}
            for r in rows if r["program"] != "prefill" for p in r["parts"] if p["share"] >= min_share]


def print_rows(rows: list[dict], top: int) -> None:
    for r in rows:
        wall = "" if r["wall_ms"] is None else f", wall {r['wall_ms']:.2f} ms"
        print(f"\n{r['program']}: {r['model']} {r['size']}, batch {r['batch']}, {r['tokens']} tokens: "
              f"op time {r['op_ms']:.2f} ms{wall}")
        for p in r["parts"][:top]:
            biggest = p["top_ops"][0][0] if p["top_ops"] else ""
            share = 100 * p["share"]
            print(f"  {p['part']:28s} {p['direction']:8s} {p['ms']:9.3f} ms  {share:5.1f}%   {biggest}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10M only, small batches, one call each (< 1 min)")
    ap.add_argument("--json", help="write the figures to this path")
    ap.add_argument("--programs", nargs="+", default=["decode", "forward", "train_step"],
                    choices=["decode", "forward", "train_step"])
    ap.add_argument("--top", type=int, default=12, help="parts printed per row")
    ap.add_argument("--decode-dtype", choices=["float32", "bfloat16"], default="float32",
                    help="weights, compute and KV-cache dtype of the decode rows (default float32)")
    ap.add_argument("--keep-trace", metavar="DIR",
                    help="keep each program's trace under DIR (for TensorBoard's profile plugin or Perfetto)")
    args = ap.parse_args()
    if args.keep_trace:
        Path(args.keep_trace).mkdir(parents=True, exist_ok=True)
    from common import keep_freed_memory, machine, machine_line, write_json

    capture = dump_hlo(args.keep_trace)
    keep_freed_memory()
    calls = 1 if args.quick else 3
    rows: list[dict] = []
    if "decode" in args.programs:
        rows += decode_rows(["10M"] if args.quick else ["10M", "50M"], [8] if args.quick else [32, 128],
                            16 if args.quick else 64, 32 if args.quick else 128, calls, capture,
                            args.decode_dtype)
    if "forward" in args.programs:
        rows += forward_rows(["llama", "neox"], "10M" if args.quick else "50M", 4 if args.quick else 16,
                             64 if args.quick else 256, calls, capture)
    if "train_step" in args.programs:
        rows += train_step_rows(["10M"] if args.quick else ["10M", "50M"], 8 if args.quick else 16,
                                64 if args.quick else 128, calls, capture)
    info = machine()
    print(machine_line(info))
    print_rows(rows, args.top)
    print("\nms per decode step (decode rows), per call (prefill, forward) or per step (train); op time sums "
          "every op's duration (two ops may overlap on two cores); parts joined by + are fused ops")
    rows = [with_group_shares(r) for r in rows]
    write_json(args.json, {"benchmark": "op_profile", "machine": info, "rows": rows,
                           "part_rows": part_rows(rows)})


if __name__ == "__main__":
    main()
