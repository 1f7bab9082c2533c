"""Cost of the per-step batch agreement of a multi-process trainer, against the step it feeds.

    python experiments/benchmarks/batch_agreement.py [--quick] [--json PATH]

Two local JAX processes (jax.distributed over localhost, gloo CPU collectives, one CPU device
each) form one 2-device mesh, as a 2-host trainer does. Every step, process 0 publishes the
step's groups of trajectories through the coordination service's key-value store
(`tbajax.system.distributed.StepAgreement`) and process 1 receives and decodes them; then both
collate the host batch and run the jitted TB train step of the shipped tiny policy on the global
batch. Reported per batch shape (median over steps):

  agree_ms    the follower's wait for the step's groups, from a barrier both passed together
              until its groups are decoded (what the agreement adds to a step's critical path:
              encode + KV set on process 0, KV get + decode on process 1)
  publish_ms  process 0's encode + KV writes alone
  step_ms     collate + the train step on the 2-process mesh (process 0's clock)
  share       agree_ms / step_ms

In the trainer the agreement for step N+1 can run while step N computes (the KV store needs no
device collective), so `share` is an upper bound on what it costs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT)]

from common import machine, print_table, write_json  # noqa: E402

CHECKPOINT = ROOT / "experiments" / "assets" / "tiny-arithmetic"
K = 8
# (groups per step, prompt tokens, response tokens, train): the tiny policy's own steps (its
# positions end at 64), then LLM-sized batches whose agreement alone is timed (a step of a model
# that long rows need takes seconds to minutes on a CPU, and far more than the agreement anywhere)
SHAPES = [(16, 12, 6, True), (64, 12, 6, True), (16, 128, 512, False), (64, 256, 1024, False)]
QUICK_SHAPES = [(16, 12, 6, True), (64, 256, 1024, False)]


def make_groups(groups: int, prompt: int, response: int, vocab: int, seed: int) -> list[list[Any]]:
    import numpy as np

    from tbajax.trajectory import Trajectory

    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        p = rng.integers(3, vocab, prompt).astype(np.int32)
        out.append([Trajectory(prompt_id=g, group_id=seed * 1000 + g, prompt_tokens=p,
                               response_tokens=rng.integers(3, vocab, response).astype(np.int32),
                               behavior_logprobs=-rng.uniform(0.1, 3, response).astype(np.float32),
                               reference_logprobs=-rng.uniform(0.1, 3, response).astype(np.float32),
                               reward=float(rng.integers(0, 2))) for _ in range(K)])
    return out


def worker(pid: int, port: int, shapes: list[tuple[int, int, int]], steps: int, out: str) -> None:
    import numpy as np

    from tbajax.system import distributed

    distributed.initialize(f"127.0.0.1:{port}", 2, pid)
    import jax

    from tbajax.models import load_model
    from tbajax.sharding import make_mesh
    from tbajax.training import PolicyUpdater
    from tbajax.training.collate import collate
    from tbajax.training.config import BetaSchedule, TrainerConfig

    client = distributed._client()
    mesh = make_mesh()  # data=2 over both processes' devices
    model = load_model(str(CHECKPOINT), mesh=mesh, param_dtype="float32", dtype="float32")
    vocab = model.config.vocab_size
    agreement = distributed.StepAgreement()
    rows = []
    step_no = 0
    for groups, prompt, response, train in shapes:
        trainer = TrainerConfig(beta=BetaSchedule(kind="constant", start=0.1), compute_reference_logprobs=False)
        updater = PolicyUpdater(model, trainer, "tb", mesh=mesh) if train else None
        agree, publish, step_t, nbytes = [], [], [], 0
        for i in range(steps + 1):  # the first step compiles: not timed
            step_no += 1
            mine = make_groups(groups, prompt, response, vocab, step_no) if pid == 0 else None
            client.wait_at_barrier(f"bench/{step_no}", 600_000)
            t0 = time.perf_counter()
            got = agreement.decide(step_no, lambda: mine)
            t1 = time.perf_counter()
            if pid == 1:  # the follower's wait, from the common barrier to decoded groups
                client.key_value_set(f"bench/agree/{step_no}", repr(t1 - t0))
            else:
                follower = float(client.blocking_key_value_get(f"bench/agree/{step_no}", 600_000))
            if train:
                batch = collate(got, beta=0.1, num_rows=groups * K, length_bucket=32)
                assert np.isfinite(updater.step(batch)["loss"])
            t2 = time.perf_counter()
            if i and pid == 0:
                agree.append(follower * 1e3)
                publish.append((t1 - t0) * 1e3)
                step_t.append((t2 - t1) * 1e3 if train else float("nan"))
        nbytes = agreement.bytes_sent // (steps + 1) if pid == 0 else 0
        if pid == 0:
            med = {k: float(np.median(v)) for k, v in (("agree_ms", agree), ("publish_ms", publish),
                                                       ("step_ms", step_t))}
            med["step_ms"] = med["step_ms"] if train else None  # JSON null, not NaN
            rows.append({"groups": groups, "rows": groups * K, "prompt": prompt, "response": response,
                         "kib": nbytes / 1024, **med, "share": med["agree_ms"] / med["step_ms"] if train else None})
        agreement.bytes_sent = 0
    if pid == 0:
        Path(out).write_text(json.dumps(rows))
    jax.distributed.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two shapes, 4 timed steps each")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per shape (default 8, quick 4)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--shapes", help=argparse.SUPPRESS)
    args = ap.parse_args()
    steps = args.steps or (4 if args.quick else 8)
    if args.worker is not None:
        worker(args.worker, args.port, [tuple(s) for s in json.loads(args.shapes)], steps, args.out)
        return
    shapes = QUICK_SHAPES if args.quick else SHAPES
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mktemp(suffix=".json")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    cmd = [sys.executable, __file__, f"--port={port}", f"--out={out}", f"--steps={steps}",
           f"--shapes={json.dumps(shapes)}"]
    procs = [subprocess.Popen([*cmd, f"--worker={i}"], env=env) for i in range(2)]
    codes = [p.wait() for p in procs]
    if codes != [0, 0]:
        raise SystemExit(f"benchmark workers failed: exit codes {codes}")
    rows = json.loads(Path(out).read_text())
    print("\nbatch agreement across 2 local processes (1 CPU device each), median per step:")
    print_table([{k: "-" if v is None else v for k, v in r.items()} for r in rows], ["groups", "rows", "prompt", "response", "kib", "agree_ms", "publish_ms", "step_ms", "share"])
    write_json(args.json, {"benchmark": "batch_agreement", "steps": steps, "k": K, "model": str(CHECKPOINT.name),
                           "rows": rows, "machine": machine()})


if __name__ == "__main__":
    main()
