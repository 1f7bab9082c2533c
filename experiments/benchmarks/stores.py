"""Store throughput: param publish/load latency vs raw disk bandwidth, trajectory append/read.

    python experiments/benchmarks/stores.py [--quick] [--json PATH] [--dir DIR]
    python experiments/benchmarks/stores.py --lora [--quick] [--json PATH]   # LoRA rows only

Raw bandwidth is measured in the same run on the same directory, alternating with the store: a
file of the same byte count written with fsync, then read back into a fresh buffer (the read is
from the page cache when the file fits in RAM, and so are the store loads: compare like with
like). `x_raw` is the store's time over the raw time for the same bytes (1.0 = disk speed;
`raw_over_ours` is its inverse); "publish+load" is the round trip a searcher waits for after a
trainer step, and `meets_1_5x` says whether it is within 1.5x of the raw write + read. Times are
the best of the repeats (`ms_median`, `x_raw_median`: their medians). The "fixed cost" rows
publish and load 16 floats: what a version costs whatever its size. A publish is timed until searchers can see
the version (collecting old versions runs behind it). Param sizes are in floats (fp32 on the
trainer side); bfloat16 rows cast on publish (half the bytes) and load into bf16 targets.

LoRA rows: a 50M-parameter Llama (vocab 32000, width 512, 8 layers) with r = 8 adapters on every
projection; "publish adapters" is what a LoRA trainer writes per sync (system.publish=auto),
"load adapters + merge" what a searcher does with it (restore, then fold the adapters into its
resident base weights once), against publishing and loading all the weights. `bytes_vs_full` is
the adapter version's params.bin size over the full version's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import machine, print_table, write_json  # noqa: E402

from tbajax.stores import (  # noqa: E402
    ParamPublisher,
    ParamReader,
    TrajectoryReader,
    TrajectoryWriter,
    param_store_url,
    trajectory_store_url,
)
from tbajax.trajectory import Trajectory  # noqa: E402

MB = 1e6


def raw_write_read(path: Path, data: np.ndarray) -> tuple[float, float]:
    """(seconds to write `data` to a new file + fsync, seconds to read it back into a new buffer)
    once: what any store has to do with the same bytes, done the plainest fast way."""
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    back = np.empty(data.nbytes, np.uint8)
    with open(path, "rb", buffering=0) as f:
        got = f.readinto(back)
    read_s = time.perf_counter() - t0
    assert got == data.nbytes
    path.unlink()
    return write_s, read_s


def make_params(n_floats: int, leaves: int = 8) -> dict[str, jax.Array]:
    per = n_floats // leaves
    key = jax.random.key(0)
    return {f"w{i}": jax.random.normal(jax.random.fold_in(key, i), (per,), jnp.float32) for i in range(leaves)}


def _stats(times: list[float]) -> tuple[float, float]:
    return min(times), float(np.median(times))


def bench_params(directory: Path, n_floats: int, repeats: int) -> list[dict]:
    """Publish (until searchers can see the version) and load, each against a raw write+fsync and
    read of the same number of bytes, measured alternately in the same loop (best of `repeats`;
    the median is kept too). A bf16 publish includes the fp32 -> bf16 cast of the trainer's params;
    "cast alone" times that cast (jitted, the whole tree) to show what the publish overlaps."""
    params = jax.block_until_ready(make_params(n_floats))
    nbytes = sum(x.nbytes for x in params.values())
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    size = f"{n_floats / 1e6:g}M"
    cast = jax.jit(lambda t: jax.tree.map(lambda x: x.astype(jnp.bfloat16), t))
    rows = []
    for dtype, stored in (("float32", nbytes), ("bfloat16", nbytes // 2)):
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.dtype(dtype)), params)
        data = np.random.default_rng(0).integers(0, 255, stored, dtype=np.uint8)
        run = directory / f"run-{dtype}-{n_floats}"
        url = param_store_url(run)
        publisher = ParamPublisher(url, "bench", dtype=dtype, keep=2)
        reader = ParamReader(url, "bench-reader")
        t = {k: [] for k in ("raw_w", "raw_r", "pub", "load", "cast")}
        for _ in range(repeats):
            w, r = raw_write_read(directory / "raw.bin", data)
            t["raw_w"].append(w)
            t["raw_r"].append(r)
            t0 = time.perf_counter()
            version = publisher.publish(params)
            t["pub"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            loaded = jax.block_until_ready(reader.restore(version, target, sharding))
            t["load"].append(time.perf_counter() - t0)
            assert loaded["w0"].dtype == jnp.dtype(dtype)
            del loaded
            if dtype == "bfloat16":
                t0 = time.perf_counter()
                jax.block_until_ready(cast(params))
                t["cast"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(100):
            reader.latest_version()
        pointer_us = (time.perf_counter() - t0) / 100 * 1e6
        publisher.close()
        reader.close()
        shutil.rmtree(run)
        (w, w_med), (r, r_med) = _stats(t["raw_w"]), _stats(t["raw_r"])
        (pub, pub_med), (load, load_med) = _stats(t["pub"]), _stats(t["load"])
        both = [p + lo for p, lo in zip(t["pub"], t["load"])]
        raw_both = [a + b for a, b in zip(t["raw_w"], t["raw_r"])]
        mb = stored / MB

        def row(what: str, s: float, med: float, raw: float | None = None, raw_med: float | None = None,
                **extra) -> dict:
            out = {"what": what, "size": size, "MB": mb, "ms": 1e3 * s, "ms_median": 1e3 * med,
                   "MB_s": mb / s}
            if raw is not None:
                out.update(raw_ms=1e3 * raw, x_raw=s / raw, raw_over_ours=raw / s, x_raw_median=med / raw_med)
            return {**out, **extra}

        rows += [
            row(f"raw write+fsync ({dtype} bytes)", w, w_med),
            row(f"raw read ({dtype} bytes)", r, r_med),
            row(f"publish {dtype}", pub, pub_med, w, w_med),
            row(f"load {dtype} into {dtype}", load, load_med, r, r_med, latest_version_us=pointer_us),
            row(f"publish+load {dtype}", min(both), float(np.median(both)), min(raw_both),
                float(np.median(raw_both)), meets_1_5x=min(both) <= 1.5 * min(raw_both)),
        ]
        if t["cast"]:
            rows.append(row("cast fp32->bf16 alone (jitted)", *_stats(t["cast"])))
    return rows


def bench_fixed_cost(directory: Path, repeats: int = 20) -> list[dict]:
    """A publish + load of 16 floats: the per-version cost that does not scale with the bytes
    (directory, marker and pointer writes with their fsyncs, the lease, the manifest)."""
    url = param_store_url(directory / "run-tiny")
    publisher = ParamPublisher(url, "bench", dtype="float32", keep=2)
    reader = ParamReader(url, "bench-reader")
    params = {"w": jnp.ones((16,), jnp.float32)}
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    pub, load = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        version = publisher.publish(params)
        pub.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        jax.block_until_ready(reader.restore(version, params, sharding))
        load.append(time.perf_counter() - t0)
    publisher.close()
    shutil.rmtree(directory / "run-tiny")
    return [{"what": "publish 16 floats (fixed cost)", "size": "16", "ms": 1e3 * min(pub),
             "ms_median": 1e3 * float(np.median(pub))},
            {"what": "load 16 floats (fixed cost)", "size": "16", "ms": 1e3 * min(load),
             "ms_median": 1e3 * float(np.median(load))}]


LORA_MODEL = dict(model_type="llama", vocab_size=32000, hidden_size=512, intermediate_size=1376, num_layers=8,
                  num_heads=8, num_kv_heads=4, head_dim=64, tie_word_embeddings=False)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def bench_lora(directory: Path, repeats: int, rank: int = 8) -> list[dict]:
    """Adapter-only publish + searcher-side load and merge vs a full publish + load, same model."""
    from flax import nnx

    from tbajax.models import CausalLM, ModelConfig
    from tbajax.models.lora import LoraConfig, adapter_arrays, adapter_manifest, init_lora
    from tbajax.system.publishing import SearcherParams

    cfg = ModelConfig(**LORA_MODEL)
    abstract = nnx.state(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    rng = np.random.default_rng(0)
    base = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape, np.float32) * 0.02), abstract)
    lora = LoraConfig(rank=rank, alpha=2.0 * rank, targets=LORA_TARGETS)
    adapters = init_lora(base, lora, jax.random.key(0))
    adapters = {n: {"a": p["a"], "b": p["a"].replace(jnp.full(p["b"].shape, 1e-3, p["b"].dtype))}
                for n, p in adapters.items()}  # non-zero B: a trained adapter's bytes and work
    full_tree, adapter_tree = nnx.to_pure_dict(base), adapter_arrays(adapters)
    meta = adapter_manifest(base, lora)
    resident = SearcherParams(base, None, lora)
    url = param_store_url(directory / "run-lora")
    publisher = ParamPublisher(url, "bench", dtype="float32", keep=2)
    reader = ParamReader(url, "bench-reader")
    times: dict[str, list[float]] = {k: [] for k in ("pub_full", "load_full", "pub_lora", "load_lora", "merge")}
    sizes = {}
    for _ in range(repeats):
        for kind, tree, m in (("full", full_tree, {"kind": "full"}), ("lora", adapter_tree, meta)):
            t0 = time.perf_counter()
            version = publisher.publish(tree, m)
            times[f"pub_{kind}"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            restored, _ = reader.restore_for(version, resident.target)
            jax.block_until_ready(restored)
            times[f"load_{kind}"].append(time.perf_counter() - t0)
            sizes[kind] = (directory / "run-lora" / "params" / str(version) / "params.bin").stat().st_size
        t0 = time.perf_counter()  # what SearcherParams.load adds for an adapter version, once per version
        jax.block_until_ready(resident.merge(restored, lora))
        times["merge"].append(time.perf_counter() - t0)
    publisher.close()
    shutil.rmtree(directory / "run-lora")
    best = {k: min(v) for k, v in times.items()}
    size = f"{cfg.num_params() / 1e6:.0f}M, r={rank}"
    ratio = sizes["lora"] / sizes["full"]
    rows = []
    for kind, what in (("full", "all weights"), ("lora", "adapters")):
        mb = sizes[kind] / MB
        rows += [
            {"what": f"LoRA run: publish {what}", "size": size, "MB": mb, "ms": 1e3 * best[f"pub_{kind}"],
             "MB_s": mb / best[f"pub_{kind}"], "bytes_vs_full": sizes[kind] / sizes["full"],
             "time_vs_full": best[f"pub_{kind}"] / best["pub_full"]},
            {"what": f"LoRA run: load {what}", "size": size,
             "MB": mb, "ms": 1e3 * best[f"load_{kind}"], "MB_s": mb / best[f"load_{kind}"],
             "bytes_vs_full": sizes[kind] / sizes["full"], "time_vs_full": best[f"load_{kind}"] / best["load_full"]},
        ]
    rows.append({"what": "LoRA run: merge adapters into the resident base", "size": size, "ms": 1e3 * best["merge"],
                 "time_vs_full": best["merge"] / best["load_full"]})
    assert ratio <= 0.02, f"adapter-only publish is {ratio:.2%} of a full one"
    return rows


def make_rows(n: int, prompt_len: int, response_len: int, seed: int) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = int(rng.integers(prompt_len // 2, prompt_len + 1))
        r = int(rng.integers(response_len // 2, response_len + 1))
        out.append(
            Trajectory(
                prompt_id=i, group_id=i // 8,
                prompt_tokens=rng.integers(0, 150_000, p, dtype=np.int32),
                response_tokens=rng.integers(0, 150_000, r, dtype=np.int32),
                behavior_logprobs=-rng.random(r, dtype=np.float32),
                reference_logprobs=-rng.random(r, dtype=np.float32),
                reward=1.0, wall_time=time.time(),
            )
        )
    return out


def payload_bytes(rows: list[Trajectory]) -> int:
    tokens = sum(4 * (len(t.prompt_tokens) + 3 * len(t.response_tokens)) for t in rows)
    return tokens + 96 * len(rows)  # + the fixed per-row record


def bench_trajectories(directory: Path, appends: int, rows_per_append: int, prompt_len: int,
                       response_len: int) -> list[dict]:
    url = trajectory_store_url(directory / "run-traj", 0)
    batches = [make_rows(rows_per_append, prompt_len, response_len, seed) for seed in range(appends)]
    nbytes = sum(payload_bytes(b) for b in batches)
    n = appends * rows_per_append
    writer = TrajectoryWriter(url, 0)
    tail = TrajectoryReader(url)
    append_s, tail_s = 0.0, 0.0
    for batch in batches:
        t0 = time.perf_counter()
        writer.append(batch)
        append_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        got = tail.read_new()
        tail_s += time.perf_counter() - t0
        assert len(got) == len(batch)
    t0 = time.perf_counter()
    everything = TrajectoryReader(url).read_new()
    bulk_s = time.perf_counter() - t0
    assert len(everything) == n
    shutil.rmtree(directory / "run-traj")
    shape = f"{rows_per_append}x(P{prompt_len},R{response_len})"
    return [
        {"what": "traj append", "size": shape, "MB": nbytes / MB, "ms": 1e3 * append_s / appends,
         "MB_s": nbytes / append_s / MB, "rows_s": n / append_s},
        {"what": "traj tail read_new", "size": shape, "MB": nbytes / MB, "ms": 1e3 * tail_s / appends,
         "MB_s": nbytes / tail_s / MB, "rows_s": n / tail_s},
        {"what": "traj bulk read", "size": f"{n} rows", "MB": nbytes / MB, "ms": 1e3 * bulk_s,
         "MB_s": nbytes / bulk_s / MB, "rows_s": n / bulk_s},
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes (seconds on a laptop CPU)")
    ap.add_argument("--json", default=None, help="write results to this JSON file")
    ap.add_argument("--dir", default=None, help="directory to benchmark (default: a fresh temp dir)")
    ap.add_argument("--lora", action="store_true", help="only the LoRA rows (adapter-only vs full publish)")
    args = ap.parse_args()

    sizes = [1_000_000, 10_000_000] if args.quick else [10_000_000, 100_000_000]
    repeats = 5 if args.quick else 7
    traj = dict(appends=10, rows_per_append=64, prompt_len=128, response_len=512)
    if not args.quick:
        traj.update(appends=50, rows_per_append=128, response_len=1024)

    load_start = os.getloadavg()[0]
    directory = Path(tempfile.mkdtemp(prefix="bench-stores-", dir=args.dir))
    try:
        rows = []
        if not args.lora:
            rows += bench_fixed_cost(directory)
            for n in sizes:  # the smaller size is cheap: more repeats against a shared machine's noise
                rows += bench_params(directory, n, repeats * (3 if n == min(sizes) else 1))
            rows += bench_trajectories(directory, **traj)
        rows += bench_lora(directory, repeats)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"directory: {directory} ({jax.default_backend()}, {os.cpu_count()} CPUs)")
    print_table(rows, ["what", "size", "MB", "ms", "ms_median", "MB_s", "raw_ms", "x_raw", "x_raw_median",
                       "raw_over_ours", "bytes_vs_full", "time_vs_full", "rows_s",
                       "latest_version_us"])
    name = {"benchmark": "stores_lora"} if args.lora else {}
    command = "python experiments/benchmarks/stores.py" + " --lora" * args.lora + " --quick" * args.quick
    write_json(args.json, {**name, "machine": machine(), "quick": args.quick, "directory": str(directory),
                           "command": command, "load_average_1m_start": load_start,
                           "load_average_1m_end": os.getloadavg()[0], "rows": rows})


if __name__ == "__main__":
    main()
