"""XLA:CPU's dot kernels for each kind of tbajax program: its YNNPACK fusions (the default) vs its
own Eigen dots (`tbajax.models.scorer.sequence_scoring_compiler_options`), in one process.

    python experiments/benchmarks/dot_backend.py [--quick] [--json PATH]

Each program is lowered once and compiled twice, with and without the option; the two
executables then run in alternating rounds on the same inputs, so the machine's drift hits both
alike. Rows: a GPT-NeoX reward model's forward and a Llama causal LM's forward (right-padded
16 x 256), the sampler's prefill + decode (`generate`, 32 prompts of 64 tokens, 64 new tokens) and
the TB train step (16 x 128), at 10M and 50M. tbajax uses Eigen dots for its sequence-scoring
programs (reward models, classifiers) and XLA's default for everything else: this benchmark is
where that choice comes from. ratio = default time / Eigen time (> 1: Eigen faster). CPU only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import (  # noqa: E402
    keep_freed_memory, machine, machine_line, make_llama_checkpoint, print_table, write_json,
)
from flax import nnx  # noqa: E402
from forward import PAD, make_neox_checkpoint  # noqa: E402

EIGEN = {"xla_cpu_experimental_ynn_fusion_type": ""}  # = sequence_scoring_compiler_options() on CPU


def alternate(lowered: Any, make_args: Callable[[], tuple], rounds: int) -> dict[str, Any]:
    """Compile `lowered` both ways, warm each up, then time them in alternating rounds (fresh
    arguments each call, for programs that donate them)."""
    arms = {"ynnpack": lowered.compile(), "eigen": lowered.compile(compiler_options=EIGEN)}
    for c in arms.values():
        jax.block_until_ready(c(*make_args()))
    times: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(rounds):
        for k, c in arms.items():
            args = jax.block_until_ready(make_args())
            t0 = time.perf_counter()
            jax.block_until_ready(c(*args))
            times[k].append(time.perf_counter() - t0)
    paired = [y / e for y, e in zip(times["ynnpack"], times["eigen"])]
    return {"ynnpack_s": min(times["ynnpack"]), "eigen_s": min(times["eigen"]),
            "ratio": statistics.median(paired), "ratio_min": min(paired), "ratio_max": max(paired),
            "times": times}


def padded_batch(rows: int, seq: int, vocab: int) -> tuple[jax.Array, jax.Array]:
    rng = np.random.RandomState(0)
    lengths = rng.randint(seq // 2, seq + 1, rows)
    mask = np.arange(seq)[None, :] < lengths[:, None]
    return jnp.asarray(np.where(mask, rng.randint(3, vocab, (rows, seq)), PAD), jnp.int32), jnp.asarray(mask)


def reward_model_row(size: str, rounds: int) -> dict[str, Any]:
    from tbajax.models import load_scorer
    from tbajax.models.scorer import sequence_scores

    scorer = load_scorer(make_neox_checkpoint(size, reward_model=True))
    graphdef, state = nnx.split(scorer.model)
    tokens, mask = padded_batch(16, 256, scorer.config.vocab_size)
    fn = jax.jit(lambda s, t, m: sequence_scores(nnx.merge(graphdef, s), t, m))
    return {"program": "reward model forward (GPT-NeoX)", **alternate(fn.lower(state, tokens, mask),
                                                                     lambda: (state, tokens, mask), rounds)}


def forward_row(ckpt: Path, rounds: int) -> dict[str, Any]:
    from tbajax.models import load_model

    model = load_model(ckpt)
    graphdef, state = nnx.split(model)
    tokens, mask = padded_batch(16, 256, model.config.vocab_size)
    fn = jax.jit(lambda s, t, m: nnx.merge(graphdef, s)(t, attention_mask=m)[0])
    return {"program": "causal LM forward (Llama)", **alternate(fn.lower(state, tokens, mask),
                                                               lambda: (state, tokens, mask), rounds)}


def generate_row(ckpt: Path, rounds: int) -> dict[str, Any]:
    from tbajax.models import load_model
    from tbajax.sampling import core
    from tbajax.sampling.sampler import PreparedParams, _jit_generate
    from tbajax.sharding import MeshConfig, make_mesh

    model = load_model(ckpt)
    mesh = make_mesh(MeshConfig(), devices=jax.devices()[:1])
    params = PreparedParams.from_model(model, mesh).params  # the serving layout, as the sampler's
    new = 64
    spec = core.DecodeSpec(max_new_tokens=new, top_k=0, use_top_p=False, greedy=False, stop_token_ids=(),
                           pad_token_id=PAD)
    rows = 32
    tokens = jnp.asarray(np.random.RandomState(0).randint(3, model.config.vocab_size, (rows, 64)), jnp.int32)
    mask = jnp.ones((rows, 64), bool)
    knobs = core.Knobs(temperature=jnp.float32(1.0), top_p=jnp.float32(1.0), min_new_tokens=jnp.int32(0))
    phases = core.phase_slots(64, new, 64)  # the decode phases of the Sampler's default
    cache = jax.jit(lambda: core.init_cache(model.config, rows, phases[-1]))

    def make_args() -> tuple:
        return (params, cache(), tokens, mask, jnp.ones(rows, bool), jax.random.key(0), knobs,
                jnp.full(rows, new, jnp.int32))

    with jax.set_mesh(mesh):
        lowered = _jit_generate(model.config, 1, spec, phases).lower(*make_args())
        return {"program": f"generate (prefill + {new} decode steps)", **alternate(lowered, make_args, rounds)}


def train_step_row(ckpt: Path, rounds: int) -> dict[str, Any]:
    from train_step import tb_batch, trainer_config

    from tbajax.models import load_model
    from tbajax.training import init_train_state, make_train_step

    config = trainer_config("fp32")
    model = load_model(ckpt)
    graphdef, state = init_train_state(model, config)
    batch = tb_batch(16, 128, model.config.vocab_size, scored=False)  # every position, as it was measured
    step = make_train_step(graphdef, config, "tb")
    host = jax.device_get(state)  # the step donates its state: a fresh copy per call
    return {"program": "TB train step", **alternate(step.lower(state, batch),
                                                    lambda: (jax.device_put(host), batch), rounds)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10M only, 3 rounds instead of 7")
    ap.add_argument("--json", help="write the figures to this path")
    args = ap.parse_args()
    keep_freed_memory()
    if jax.default_backend() != "cpu":
        raise SystemExit("dot_backend.py compares XLA:CPU's dot kernels; run it on a CPU backend")
    rounds = 3 if args.quick else 7
    rows = []
    for size in ("10M",) if args.quick else ("10M", "50M"):
        with tempfile.TemporaryDirectory(prefix="bench-dots-") as d:
            llama = make_llama_checkpoint(size, d)
            for row in (reward_model_row(size, rounds), forward_row(llama, rounds), generate_row(llama, rounds),
                        train_step_row(llama, rounds)):
                rows.append({**row, "size": size})
    info = machine()
    print("XLA:CPU dot kernels per program, YNNPACK fusions (default) vs Eigen (sequence_scoring_compiler_options)")
    print(machine_line(info))
    print_table(rows, ["program", "size", "ynnpack_s", "eigen_s", "ratio", "ratio_min", "ratio_max"])
    print("ratio = median over alternating rounds of YNNPACK time / Eigen time (> 1: Eigen faster); seconds: best call")
    write_json(args.json, {"benchmark": "dot_backend", "machine": info, "rows": rows})


if __name__ == "__main__":
    main()
