"""Trainer-step tokens/s: tbajax's jitted TB step vs torch transformers + torch.optim.AdamW.

    python experiments/benchmarks/train_step.py [--quick] [--json PATH] [--precision fp32|bf16]
        [--scanned | --unrolled] [--prompt N]

tbajax's layers are applied as the trainer's default `model.scan_layers="auto"` applies them
(unrolled at these depths, `tbajax.models.config.scan_layers_for`), or as one scan (`--scanned`),
or unrolled (`--unrolled`); each row records which (`scan_layers`).

One step = reference forward (no grad) + policy forward + VarGrad TB loss + backward + AdamW,
on the same Llama-style checkpoint and the same batch (groups of K = 4, rows of a `--prompt`-token
prompt and a response filling the row) on both sides. Both score the response tokens only: tbajax
through the batch's scored windows (`Batch.scored`, built by `collate`), torch through
transformers' `logits_to_keep` (as TRL's GRPO trainer does), so neither projects the prompt's
positions onto the vocabulary. Each
side runs in its own process so that its peak RSS is its own; compile (tbajax) and first-step
(torch) times are reported apart from the steady state, and the step is split into phases
(reference forward / policy forward + backward / optimizer) to show where the time goes.

The two processes take turns, round by round: a round is one timed step of one side while the
other waits (blocked, using no CPU) for its turn. The ratio is the median over rounds of the
torch / tbajax step-time ratio of each round pair, so a shared machine's speed drift (minutes
long, tens of percent) hits both sides of a pair alike; ratio_min / ratio_max give the spread.
The first-step loss and gradient norm of both sides are printed too: same weights, same batch,
so they must agree (a parity check of the whole loss and backward pass).

A second table (tbajax only) times the `dr_grpo` step as declared (it reads no reference
log-probs, so the step runs no reference forward) against the same objective declared to read
everything (the reference forward the step ran for it before objectives declared their inputs),
interleaved round by round; a third, the TB step with the scored windows against the same step
scoring every position (a batch without `scored`, the row layout before the windows).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT)]

import numpy as np  # noqa: E402
from common import (  # noqa: E402
    keep_freed_memory, machine, machine_line, make_gpt_oss_checkpoint, make_llama_checkpoint,
    make_qwen3_moe_checkpoint, peak_rss_mb,
    print_table, write_json,
)

GROUP = 4  # K samples per prompt
PROMPT = 16  # default prompt tokens per row (the rest of the row is the scored response)
TEMPERATURE = 0.7
BETA = 0.05
LR = 1e-5


def make_batch(rows: int, seq: int, vocab: int, prompt: int = PROMPT, seed: int = 0) -> dict[str, np.ndarray]:
    """Full rows (no padding): a prompt shared by each group of K, then a random response."""
    r = np.random.default_rng(seed)
    tokens = r.integers(3, vocab, (rows, seq)).astype(np.int32)
    for g in range(rows // GROUP):
        tokens[g * GROUP : (g + 1) * GROUP, :prompt] = tokens[g * GROUP, :prompt]
    loss_mask = np.zeros((rows, seq), bool)
    loss_mask[:, prompt:] = True
    return {
        "tokens": tokens,
        "attention_mask": np.ones((rows, seq), bool),
        "loss_mask": loss_mask,
        "reward": r.integers(0, 2, rows).astype(np.float32),
        "group_id": (np.arange(rows) // GROUP).astype(np.int32),
    }


def trainer_config(precision: str = "fp32") -> Any:
    """The benchmarks' trainer config: fp32 master weights, fp32 or bf16 compute."""
    from tbajax.training import LRSchedule, OptimizerConfig, TrainerConfig

    return TrainerConfig(optimizer=OptimizerConfig(lr=LRSchedule(peak=LR)), temperature=TEMPERATURE,
                         compute_dtype="float32" if precision == "fp32" else "bfloat16")


def tb_batch(rows: int, seq: int, vocab: int, prompt: int = PROMPT, scored: bool = True) -> Any:
    """`make_batch` as the trainer's `Batch` on the device (no reference / behaviour log-probs yet);
    `scored`: with its response windows (`Batch.scored`), so that the vocabulary projection skips
    the prompt as torch's `logits_to_keep` does."""
    import jax

    from tbajax.batch import Batch
    from tbajax.training.collate import scored_windows

    b = make_batch(rows, seq, vocab, prompt)
    zeros = np.zeros((rows, seq), np.float32)
    return jax.device_put(Batch(
        tokens=b["tokens"], attention_mask=b["attention_mask"], loss_mask=b["loss_mask"],
        behavior_logprobs=zeros, reference_logprobs=zeros, reward=b["reward"], group_id=b["group_id"],
        sample_mask=np.ones(rows, bool), policy_version=np.zeros(rows, np.int32),
        prompt_id=np.zeros(rows, np.int32), beta=np.float32(BETA),
        token_versions=np.zeros((rows, seq), np.int32), current_version=np.int32(0),
        scored=scored_windows(b["loss_mask"], 1) if scored else None))


def take_turn() -> None:
    """Block until the coordinator gives this worker the machine (see the module docstring)."""
    print("TURN", flush=True)
    if not sys.stdin.readline():
        raise SystemExit("the coordinator went away")


# ----------------------------------------------------------------------------- tbajax side


def run_jax(ckpt: str, rows: int, seq: int, repeats: int, precision: str, layers: str = "auto",
            prompt: int = PROMPT) -> dict[str, Any]:
    """layers: "auto" (the trainer's default), "scanned" or "unrolled"."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import optax

    from tbajax.models import load_model
    from tbajax.training import accumulate_gradients, init_train_state, make_train_step, sequence_logprobs
    from tbajax.training.state import make_trainable_optimizer
    from tbajax.objectives import resolve_objective
    from tbajax.objectives.registry import EVERYTHING

    model = load_model(ckpt, scan_layers={"auto": "auto", "scanned": True, "unrolled": False}[layers])
    scan_layers = model.config.scan_layers
    config = trainer_config(precision)
    graphdef, state = init_train_state(model, config)
    del model
    batch = tb_batch(rows, seq, _vocab(ckpt), prompt)
    step = make_train_step(graphdef, config, "tb")
    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # a list in older jax
    flops = float(cost.get("flops", float("nan")))
    t0 = time.perf_counter()
    state, out = compiled(state, batch)
    first_loss, first_grad_norm = float(out.metrics["loss"]), float(out.metrics["grad_norm"])
    first_s = time.perf_counter() - t0

    objective, obj_config = resolve_objective("tb")
    fwd = jax.jit(lambda p, bb: sequence_logprobs(graphdef, p, bb, TEMPERATURE).sum())
    fwd = fwd.lower(state.params, batch).compile()
    grad = jax.jit(
        lambda p, r, bb: accumulate_gradients(
            p, r, bb, graphdef=graphdef, objective=objective, objective_config=obj_config, config=config
        )[:2]
    ).lower(state.params, state.ref_params, batch).compile()
    # the optimizer's update alone (as the step applies it: clip, AdamW, x -lr), timed on its own
    # rather than as step time minus gradient time, a difference of two noisy medians
    tx = make_trainable_optimizer(config.optimizer, with_aux=False)

    def update(params: Any, opt_state: Any, grads: Any) -> Any:
        updates, new_opt_state = tx.update(grads, opt_state, (params, None), lr=jnp.float32(1e-6))
        return optax.apply_updates((params, None), updates)[0], new_opt_state

    opt = jax.jit(update).lower(state.params, state.opt_state, (state.params, None)).compile()

    # rounds interleave the four measurements, so load drift on a shared machine hits all alike;
    # the step of each round is paired with torch's step of the same round
    times, fwd_t, grad_t, opt_t = [], [], [], []
    for _ in range(repeats):
        take_turn()
        t0 = time.perf_counter()
        fwd(state.params, batch).block_until_ready()
        t1 = time.perf_counter()
        (grads, _), _ = jax.block_until_ready(grad(state.params, state.ref_params, batch))
        t2 = time.perf_counter()
        jax.block_until_ready(opt(state.params, state.opt_state, (grads, None)))
        t3 = time.perf_counter()
        state, o = compiled(state, batch)  # donates the old state
        o.metrics["loss"].block_until_ready()
        t4 = time.perf_counter()
        fwd_t.append(t1 - t0)
        grad_t.append(t2 - t1)
        opt_t.append(t3 - t2)
        times.append(t4 - t3)
    step_s, fwd_s, grad_s, opt_s = (float(np.median(x)) for x in (times, fwd_t, grad_t, opt_t))
    take_turn()  # the arms below run while torch has finished
    spec, obj_config = resolve_objective("dr_grpo")
    objective_steps = _timed_arms(
        {"dr_grpo": (spec, obj_config, batch),
         "dr_grpo (reads everything)": (dataclasses.replace(spec, inputs=EVERYTHING), obj_config, batch)},
        model_state=state, graphdef=graphdef, config=config, repeats=repeats)
    tb, tb_config = resolve_objective("tb")
    window_steps = _timed_arms(
        {"tb, scored windows": (tb, tb_config, batch),
         "tb, every position": (tb, tb_config, dataclasses.replace(batch, scored=None))},
        model_state=state, graphdef=graphdef, config=config, repeats=repeats)
    return {
        "compile_s": compile_s,
        "first_step_s": first_s,
        "step_s": step_s,
        "step_times": times,
        "first_loss": first_loss,
        "first_grad_norm": first_grad_norm,
        "phase_ref_fwd_s": fwd_s,
        "phase_policy_fwd_bwd_s": grad_s - fwd_s,
        "phase_optimizer_s": opt_s,
        "xla_flops": flops,
        "objective_steps": objective_steps,
        "window_steps": window_steps,
        "peak_rss_mb": peak_rss_mb(),
        "threads": os.cpu_count(),
        "version": jax.__version__,
        "scan_layers": scan_layers,
    }


def _timed_arms(arms: dict[str, tuple[Any, Any, Any]], *, model_state, graphdef, config, repeats) -> dict:
    """Step seconds (median and best) and XLA's flop count of each arm (name -> objective spec,
    its config, batch), timed in alternating rounds, each arm from its own copy of the state. The
    flop count does not depend on the machine's load."""
    import jax

    from tbajax.training import make_train_step

    steps, states, flops = {}, {}, {}
    for name, (spec, obj_config, batch) in arms.items():
        states[name] = jax.tree.map(lambda x: x.copy(), model_state)
        step = make_train_step(graphdef, config, spec, obj_config)
        steps[name] = step.lower(states[name], batch).compile()
        cost = steps[name].cost_analysis() or {}
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        flops[name] = float(cost.get("flops", float("nan")))
        states[name], out = steps[name](states[name], batch)  # warm-up
        out.metrics["loss"].block_until_ready()
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(max(repeats, 5)):
        for name, (_, _, batch) in arms.items():
            t0 = time.perf_counter()
            states[name], out = steps[name](states[name], batch)
            out.metrics["loss"].block_until_ready()
            times[name].append(time.perf_counter() - t0)
    return {name: {"step_s": float(np.median(t)), "best_step_s": float(min(t)), "step_times": t,
                   "xla_gflop": flops[name] / 1e9}
            for name, t in times.items()}


# ----------------------------------------------------------------------------- torch side


def run_torch(ckpt: str, rows: int, seq: int, repeats: int, precision: str,
              prompt: int = PROMPT) -> dict[str, Any]:
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    # SDPA, torch's fused attention, where transformers has it; GPT-OSS's sinks have only the eager path
    eager = json.loads((Path(ckpt) / "config.json").read_text())["model_type"] == "gpt_oss"
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32,
                                                 attn_implementation="eager" if eager else "sdpa")
    model.train()
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    b = {k: torch.from_numpy(v) for k, v in make_batch(rows, seq, _vocab(ckpt), prompt).items()}
    tokens, attn = b["tokens"].long(), b["attention_mask"].long()
    keep = seq - prompt + 1  # the logits of positions prompt - 1 ... seq - 1, as TRL's GRPO keeps them
    mask = b["loss_mask"][:, prompt:].float()
    gid = b["group_id"].long()
    n_groups = int(gid.max()) + 1
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")

    def seq_logprob(m: torch.nn.Module) -> torch.Tensor:
        with autocast:
            logits = m(input_ids=tokens, attention_mask=attn, logits_to_keep=keep).logits
        lp = torch.log_softmax(logits[:, :-1].float() / TEMPERATURE, dim=-1)
        picked = lp.gather(-1, tokens[:, prompt:, None])[..., 0]
        return (picked * mask).sum(-1)

    def vargrad_tb(s: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        delta = s - r - b["reward"] / BETA
        count = torch.zeros(n_groups).index_add_(0, gid, torch.ones_like(delta))
        mean = torch.zeros(n_groups).index_add_(0, gid, delta.detach()) / count
        per_group = torch.zeros(n_groups).index_add_(0, gid, (delta - mean[gid]) ** 2) / count
        return per_group.mean()

    phases = {"ref": [], "fwd_bwd": [], "opt": []}
    grad_norms: list[float] = []

    def one_step() -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            r = seq_logprob(ref)
        t1 = time.perf_counter()
        loss = vargrad_tb(seq_logprob(model), r)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        t2 = time.perf_counter()
        if not grad_norms:  # parity check only: not timed as part of any phase
            squares = sum((q.grad.double() ** 2).sum() for q in model.parameters())
            grad_norms.append(float(torch.sqrt(squares)))
            t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
            phases[k].append(v)
        return float(loss)

    t0 = time.perf_counter()
    first_loss = one_step()
    first_s = time.perf_counter() - t0
    for v in phases.values():
        v.clear()
    times = []
    for _ in range(repeats):
        take_turn()
        t0 = time.perf_counter()
        one_step()
        times.append(time.perf_counter() - t0)
    take_turn()
    step_s = float(np.median(times))
    return {
        "compile_s": 0.0,
        "first_step_s": first_s,
        "step_s": step_s,
        "step_times": times,
        "first_loss": first_loss,
        "first_grad_norm": grad_norms[0],
        "phase_ref_fwd_s": float(np.median(phases["ref"])),
        "phase_policy_fwd_bwd_s": float(np.median(phases["fwd_bwd"])),
        "phase_optimizer_s": float(np.median(phases["opt"])),
        "peak_rss_mb": peak_rss_mb(),
        "threads": torch.get_num_threads(),
        "version": torch.__version__,
    }


def _vocab(ckpt: str | Path) -> int:
    return int(json.loads((Path(ckpt) / "config.json").read_text())["vocab_size"])


def worker(args: argparse.Namespace) -> None:
    keep_freed_memory()  # both sides (common.keep_freed_memory)
    if args.worker == "jax":
        result = run_jax(args.ckpt, args.rows, args.seq, args.repeats, args.precision, args.layers,
                         args.prompt)
    else:
        result = run_torch(args.ckpt, args.rows, args.seq, args.repeats, args.precision, args.prompt)
    print("RESULT " + json.dumps(result))


class Worker:
    """One side's process. It sets up (load, compile, first step) on start, then runs one timed
    round each time it is given the turn, and prints RESULT after its last turn."""

    def __init__(self, side: str, ckpt: Path, rows: int, seq: int, repeats: int, precision: str,
                 layers: str = "auto", prompt: int = PROMPT):
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), TRANSFORMERS_VERBOSITY="error")
        env.pop("XLA_FLAGS", None)  # one real CPU device, no fake-device splitting
        cmd = [sys.executable, __file__, "--worker", side, "--ckpt", str(ckpt), "--rows", str(rows),
               "--seq", str(seq), "--repeats", str(repeats), "--precision", precision, "--layers", layers,
               "--prompt", str(prompt)]
        self.side = side
        self.stderr = tempfile.TemporaryFile(mode="w+")  # a pipe could fill up and stall the worker
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     text=True, env=env)
        self.result: dict[str, Any] | None = None

    def wait_turn(self) -> None:
        """Until the worker blocks for its next turn (or has printed its result and exited)."""
        for line in self.proc.stdout:  # type: ignore[union-attr]
            if line.startswith("TURN"):
                return
            if line.startswith("RESULT "):
                self.result = json.loads(line[len("RESULT "):])
        code = self.proc.wait()
        if code or self.result is None:
            self.stderr.seek(0)
            raise RuntimeError(f"{self.side} worker failed (exit {code}):\n{self.stderr.read()[-4000:]}")

    def give_turn(self) -> None:
        self.proc.stdin.write("go\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]


def run_pair(ckpt: Path, rows: int, seq: int, repeats: int, precision: str, layers: str,
             prompt: int = PROMPT) -> tuple[dict, dict]:
    """Both sides' results, their timed rounds taken in turns (jax, torch, jax, torch, ...)."""
    jax_side = Worker("jax", ckpt, rows, seq, repeats, precision, layers, prompt)
    jax_side.wait_turn()  # set up alone: torch starts once tbajax has compiled and warmed up
    torch_side = Worker("torch", ckpt, rows, seq, repeats, precision, prompt=prompt)
    torch_side.wait_turn()
    try:
        for _ in range(repeats + 1):  # the last turn: each side finishes (tbajax's extra arms) alone
            for w in (jax_side, torch_side):
                w.give_turn()
                w.wait_turn()
    finally:
        for w in (jax_side, torch_side):
            if w.proc.poll() is None:
                w.proc.kill()
    assert jax_side.result is not None and torch_side.result is not None
    return jax_side.result, torch_side.result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="10M only, 8 x 128 tokens, 2 timed steps (< 1 min on an idle 2-core CPU)")
    ap.add_argument("--json", help="write the figures to this path")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                    help="fp32 everywhere, or bf16 compute (tbajax: fp32 master weights; torch: autocast)")
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--scanned", action="store_const", dest="layers", const="scanned",
                     help="tbajax with model.scan_layers=true (the layers as one scan)")
    how.add_argument("--unrolled", action="store_const", dest="layers", const="unrolled",
                     help="tbajax with model.scan_layers=false (layers unrolled in the forward and backward)")
    ap.add_argument("--layers", choices=("auto", "scanned", "unrolled"), help=argparse.SUPPRESS)
    ap.add_argument("--prompt", type=int, default=PROMPT,
                    help=f"prompt tokens of each row (default {PROMPT}); the rest is the scored response")
    ap.add_argument("--model", choices=("llama", "qwen3_moe", "gpt_oss"), default="llama",
                    help="llama (default); qwen3_moe: the same attention, 8 experts a layer, 2 a token "
                         "(`common.make_qwen3_moe_checkpoint`); gpt_oss: GPT-OSS's attention (biases, "
                         "sinks, a window of 128 on every other layer) and those experts, biased "
                         "(`common.make_gpt_oss_checkpoint`)")
    ap.set_defaults(layers="auto")
    ap.add_argument("--worker", choices=("jax", "torch"), help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=int, default=16, help=argparse.SUPPRESS)
    ap.add_argument("--seq", type=int, default=128, help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return

    cases = [("10M", 8, 128, 2)] if args.quick else [("10M", 16, 128, 7), ("50M", 16, 128, 7)]
    rows, details = [], []
    for size, n, seq, repeats in cases:
        with tempfile.TemporaryDirectory(prefix=f"bench-train-{size}-") as d:
            make = {"qwen3_moe": make_qwen3_moe_checkpoint, "gpt_oss": make_gpt_oss_checkpoint}
            ckpt = make.get(args.model, make_llama_checkpoint)(size, d)
            params = _num_params(ckpt)
            ours, theirs = run_pair(ckpt, n, seq, repeats, args.precision, args.layers, args.prompt)
        tokens = n * seq
        paired = [t / o for o, t in zip(ours["step_times"], theirs["step_times"])]
        rows.append({
            "size": size, "model": args.model, "params_M": params / 1e6, "batch": f"{n}x{seq}", "prompt": args.prompt,
            "tbajax_tok_s": tokens / ours["step_s"], "torch_tok_s": tokens / theirs["step_s"],
            "ratio": float(np.median(paired)), "ratio_min": min(paired), "ratio_max": max(paired),
            "rounds": len(paired), "scan_layers": ours["scan_layers"],
            "compile_s": ours["compile_s"], "torch_first_s": theirs["first_step_s"],
            "tbajax_rss_MB": ours["peak_rss_mb"], "torch_rss_MB": theirs["peak_rss_mb"],
        })
        for side, r in (("tbajax", ours), ("torch", theirs)):
            details.append({
                "size": size, "side": side, "step_s": r["step_s"],
                "ref_fwd_s": r["phase_ref_fwd_s"], "policy_fwd_bwd_s": r["phase_policy_fwd_bwd_s"],
                "optimizer_s": r["phase_optimizer_s"], "first_loss": r["first_loss"],
                "first_grad_norm": r["first_grad_norm"],
                "GFLOP_s": ours["xla_flops"] / r["step_s"] / 1e9,
            })
        rows[-1]["_raw"] = {"tbajax": ours, "torch": theirs}

    objective_rows = [
        {"size": row["size"], "objective": name, "reference_forward": name != "dr_grpo", **saving}
        for row in rows
        for name, saving in _savings(row["_raw"]["tbajax"]["objective_steps"], "dr_grpo (reads everything)")
    ]
    window_rows = [
        {"size": row["size"], "prompt": args.prompt, "arm": name, **saving}
        for row in rows
        for name, saving in _savings(row["_raw"]["tbajax"]["window_steps"], "tb, every position")
    ]

    info = {**machine(), "load_avg": os.getloadavg()}
    how_applied = ", ".join(f"{r['size']}: {'scanned' if r['scan_layers'] else 'unrolled'}" for r in rows)
    print(f"trainer step (ref fwd + policy fwd/bwd + AdamW), VarGrad TB, {args.precision}, "
          f"layers {args.layers} ({how_applied}), "
          f"{info['cpu_count']} CPU cores, load avg {info['load_avg'][0]:.1f}")
    print(machine_line(info))
    print_table(rows, ["size", "model", "params_M", "batch", "tbajax_tok_s", "torch_tok_s", "ratio", "ratio_min", "ratio_max",
                       "compile_s", "torch_first_s", "tbajax_rss_MB", "torch_rss_MB"])
    print("ratio = median over rounds of torch step time / tbajax step time, the sides taking turns round by "
          "round (>1: tbajax faster); tok/s from each side's median step; rss = peak of each side's process")
    print("\nwhere the time goes (median seconds per step; GFLOP/s = XLA's flop count of the step / time)")
    print_table(details, ["size", "side", "step_s", "ref_fwd_s", "policy_fwd_bwd_s", "optimizer_s",
                          "GFLOP_s", "first_loss", "first_grad_norm"])
    print("\nskipping the reference forward (dr_grpo reads no reference log-probs); step_s: median, "
          "time_saving: from the best of the alternating rounds")
    print_table(objective_rows, ["size", "objective", "reference_forward", "xla_gflop", "flop_saving",
                                 "step_s", "best_step_s", "time_saving"])
    print(f"\nscoring the response tokens only (the batch's scored windows) against every position, "
          f"{args.prompt}-token prompts; same columns")
    print_table(window_rows, ["size", "prompt", "arm", "xla_gflop", "flop_saving", "step_s", "best_step_s",
                              "time_saving"])
    write_json(args.json, {"benchmark": "train_step", "precision": args.precision,
                           "layers": args.layers, "prompt": args.prompt, "torch_logits_to_keep": True,
                           "machine": info, "rows": rows, "phases": details, "objective_rows": objective_rows,
                           "window_rows": window_rows})


def _savings(arms: dict[str, dict], baseline: str) -> list[tuple[str, dict]]:
    """Each arm's flops, step times and what it saves against the `baseline` arm."""
    base = arms[baseline]
    return [(name, {"xla_gflop": a["xla_gflop"], "flop_saving": 1.0 - a["xla_gflop"] / base["xla_gflop"],
                    "step_s": a["step_s"], "best_step_s": a["best_step_s"],
                    "time_saving": 1.0 - a["best_step_s"] / base["best_step_s"]})
            for name, a in arms.items()]


def _num_params(ckpt: Path) -> int:
    from tbajax.models import ModelConfig

    return ModelConfig.from_hf(json.loads((ckpt / "config.json").read_text())).num_params()


if __name__ == "__main__":
    main()
