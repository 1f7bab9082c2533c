"""XLA:CPU compiler options for each kind of tbajax program, in one process. `--compare dots`
(default): its YNNPACK dot fusions (the default) vs its own Eigen dots
(`tbajax.models.scorer.sequence_scoring_compiler_options`); `--compare emitters`: its MLIR fusion
emitters (the default) vs its older elemental IR emitters (`xla_cpu_use_fusion_emitters=false`,
what the default test run compiles with, `tests/conftest.py`), run time and compile time.

    python experiments/benchmarks/dot_backend.py [--compare dots|emitters] [--quick] [--json PATH]

Each program is lowered once and compiled twice, with and without the option; the two
executables then run in alternating rounds on the same inputs, so the machine's drift hits both
alike. Rows: a GPT-NeoX reward model's forward and a Llama causal LM's forward (right-padded
16 x 256), the sampler's prefill + decode (`generate`, 32 prompts of 64 tokens, 64 new tokens) and
the TB train step (16 x 128), at 10M and 50M. tbajax uses Eigen dots for its sequence-scoring
programs (reward models, classifiers) and XLA's default for everything else: this benchmark is
where that choice comes from. ratio = default time / the other arm's time (> 1: the other arm
faster); compile_ratio the same for the compile. CPU only.
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
LEGACY_EMITTERS = {"xla_cpu_use_fusion_emitters": False}


# name -> compiler options (None: XLA's defaults); the first arm is the reference
Arms = dict[str, "dict[str, Any] | None"]
COMPARISONS: dict[str, Arms] = {
    # XLA:CPU's dot kernels: its YNNPACK fusions (default) vs its Eigen dots
    "dots": {"ynnpack": None, "eigen": EIGEN},
    # how XLA:CPU generates each loop fusion: its MLIR fusion emitters (default) vs its older
    # elemental IR emitters (what the default test run compiles with, at LLVM level 0: conftest.py)
    "emitters": {"mlir_emitters": None, "legacy_emitters": LEGACY_EMITTERS},
}


def alternate(lowered: Any, make_args: Callable[[], tuple], rounds: int, arms: Arms) -> dict[str, Any]:
    """Compile `lowered` once per arm (timing each compile, in the arms' order), warm each up, then
    time them in alternating rounds (fresh arguments each call, for programs that donate them).
    ratio = first arm's time / second arm's, paired round by round."""
    compiled, compile_s = {}, {}
    for name, options in arms.items():
        t0 = time.perf_counter()
        compiled[name] = lowered.compile() if options is None else lowered.compile(compiler_options=options)
        compile_s[name] = time.perf_counter() - t0
    for c in compiled.values():
        jax.block_until_ready(c(*make_args()))
    times: dict[str, list[float]] = {k: [] for k in compiled}
    for _ in range(rounds):
        for k, c in compiled.items():
            args = jax.block_until_ready(make_args())
            t0 = time.perf_counter()
            jax.block_until_ready(c(*args))
            times[k].append(time.perf_counter() - t0)
    first, second = arms
    paired = [a / b for a, b in zip(times[first], times[second])]
    return {**{f"{k}_s": min(v) for k, v in times.items()},
            **{f"{k}_compile_s": v for k, v in compile_s.items()},
            "compile_ratio": compile_s[first] / compile_s[second],
            "ratio": statistics.median(paired), "ratio_min": min(paired), "ratio_max": max(paired),
            "times": times}


def padded_batch(rows: int, seq: int, vocab: int) -> tuple[jax.Array, jax.Array]:
    rng = np.random.RandomState(0)
    lengths = rng.randint(seq // 2, seq + 1, rows)
    mask = np.arange(seq)[None, :] < lengths[:, None]
    return jnp.asarray(np.where(mask, rng.randint(3, vocab, (rows, seq)), PAD), jnp.int32), jnp.asarray(mask)


def reward_model_row(size: str, rounds: int, arms: Arms) -> dict[str, Any]:
    from tbajax.models import load_scorer
    from tbajax.models.scorer import sequence_scores

    scorer = load_scorer(make_neox_checkpoint(size, reward_model=True))
    graphdef, state = nnx.split(scorer.model)
    tokens, mask = padded_batch(16, 256, scorer.config.vocab_size)
    fn = jax.jit(lambda s, t, m: sequence_scores(nnx.merge(graphdef, s), t, m))
    timed = alternate(fn.lower(state, tokens, mask), lambda: (state, tokens, mask), rounds, arms)
    return {"program": "reward model forward (GPT-NeoX)", **timed}


def forward_row(ckpt: Path, rounds: int, arms: Arms) -> dict[str, Any]:
    from tbajax.models import load_model

    model = load_model(ckpt)
    graphdef, state = nnx.split(model)
    tokens, mask = padded_batch(16, 256, model.config.vocab_size)
    fn = jax.jit(lambda s, t, m: nnx.merge(graphdef, s)(t, attention_mask=m)[0])
    return {"program": "causal LM forward (Llama)", **alternate(fn.lower(state, tokens, mask),
                                                               lambda: (state, tokens, mask), rounds, arms)}


def generate_row(ckpt: Path, rounds: int, arms: Arms) -> dict[str, Any]:
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
        timed = alternate(lowered, make_args, rounds, arms)
    return {"program": f"generate (prefill + {new} decode steps)", **timed}


def train_step_row(ckpt: Path, rounds: int, arms: Arms) -> dict[str, Any]:
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
                                                    lambda: (jax.device_put(host), batch), rounds, arms)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare", choices=sorted(COMPARISONS), default="dots",
                    help="dots: YNNPACK vs Eigen dots (default); emitters: MLIR vs legacy fusion emitters")
    ap.add_argument("--quick", action="store_true", help="10M only, 3 rounds instead of 7")
    ap.add_argument("--json", help="write the figures to this path")
    args = ap.parse_args()
    keep_freed_memory()
    if jax.default_backend() != "cpu":
        raise SystemExit("dot_backend.py compares XLA:CPU compiler options; run it on a CPU backend")
    arms = COMPARISONS[args.compare]
    rounds = 3 if args.quick else 7
    rows = []
    for size in ("10M",) if args.quick else ("10M", "50M"):
        with tempfile.TemporaryDirectory(prefix="bench-dots-") as d:
            llama = make_llama_checkpoint(size, d)
            rows += [{**reward_model_row(size, rounds, arms), "size": size}]
            rows += [{**make_row(llama, rounds, arms), "size": size}
                     for make_row in (forward_row, generate_row, train_step_row)]
    info = machine()
    first, second = arms
    print(f"XLA:CPU per program, {first} (default) vs {second} ({arms[second]})")
    print(machine_line(info))
    print_table(rows, ["program", "size", f"{first}_s", f"{second}_s", "ratio", "ratio_min", "ratio_max",
                       f"{first}_compile_s", f"{second}_compile_s", "compile_ratio"])
    print(f"ratio = median over alternating rounds of {first} time / {second} time (> 1: {second} faster); "
          f"seconds: best call; compile_ratio = {first} compile time / {second}'s")
    name = "dot_backend" if args.compare == "dots" else f"dot_backend_{args.compare}"
    write_json(args.json, {"benchmark": name, "compare": args.compare, "arms": arms, "machine": info,
                           "rows": rows})


if __name__ == "__main__":
    main()
