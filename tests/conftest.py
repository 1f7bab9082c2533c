"""Test setup: 8 fake CPU devices for sharding tests, no hub access, tiny HF checkpoints."""

import functools
import os
import re

# Tests check behaviour, not speed. On a small CPU most of a test's time is compiling. Two XLA:CPU
# flags cut that: optimisation level 0 skips LLVM's optimisation passes, and
# `xla_cpu_use_fusion_emitters=false` generates each loop fusion with XLA's older elemental
# emitters instead of its MLIR pipeline. XLA's HLO passes still run; the older emitters fuse a few
# dynamic-update-slices differently. The default test run took 390 s without the second flag and
# 252 s with it (`test_suite.json`, 240 GFLOP/s fp32 matmul measured before each run;
# `experiments/benchmarks/test_suite.py`). Float results may
# differ from an optimised build by reassociation only, within every test's tolerance; tests that
# compare two runs bit for bit run both under the same flags. Benchmarks and real runs keep XLA's
# defaults: at level 2 the older emitters ran every program 0-6% longer, and compiled the sampler's
# generate slower too (`dot_backend_emitters.json`).
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def _xla_knows(flags: str) -> bool:
    """Whether this jaxlib's XLA accepts `flags`: it aborts the whole process at backend start on
    one it does not know (jax 0.11 dropped `xla_cpu_use_fusion_emitters`), so a child asks."""
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    return subprocess.run(probe, env=env, capture_output=True, timeout=300).returncode == 0


def _fast_compile_flags(flags: str) -> str:
    """`flags` plus the FAST_COMPILE_FLAGS this XLA knows. xdist's workers inherit the result (and
    the note of what was left out) from the controller, so only the controller asks XLA."""
    missing = [f for f in FAST_COMPILE_FLAGS if f.split("=")[0] not in flags
               and f not in os.environ.get("TBAJAX_TEST_UNKNOWN_XLA_FLAGS", "").split()]
    if missing and not _xla_knows(" ".join(missing)):
        unknown = [f for f in missing if not _xla_knows(f)]
        os.environ["TBAJAX_TEST_UNKNOWN_XLA_FLAGS"] = " ".join(unknown)
        missing = [f for f in missing if f not in unknown]
    return " ".join([flags, *missing]).strip()


_flags = os.environ.get("XLA_FLAGS")
if _flags is None:
    _flags = "--xla_force_host_platform_device_count=8"
_flags = _fast_compile_flags(_flags)
os.environ["XLA_FLAGS"] = _flags
# what the role processes that tests start get: one CPU device each (as a user's run), same compile flags
ROLE_XLA_FLAGS = re.sub(r"--xla_force_host_platform_device_count=\S+", "", _flags).strip()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent XLA compilation cache for the whole session, inherited by the role processes the
# system tests start: the trainer and searcher of every small run compile the same programs, and
# on 2 CPU cores compiling is most of such a test. Results do not change; only compiles are reused.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="tbajax-test-xla-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import pytest  # noqa: E402

TINY_FAMILIES: dict[str, dict[str, Any]] = {
    # GQA 6 query heads over 2 KV heads, odd vocab, untied
    "llama": dict(model_type="llama"),
    "llama_tied_rope3": dict(
        model_type="llama",
        tie_word_embeddings=True,
        max_position_embeddings=256,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen2": dict(model_type="qwen2"),
    "qwen2_tied": dict(model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", head_dim=24, tie_word_embeddings=True),
    "mistral": dict(model_type="mistral", sliding_window=None, rope_theta=1e6),
    # each query sees itself and the 3 positions before it
    "mistral_window": dict(model_type="mistral", sliding_window=4, rope_theta=1e6),
    # the window on the layers from max_window_layers on: the second
    "qwen2_window": dict(model_type="qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1),
    # a windowed layer (RoPE base 100) and a full one (base 1e4, linearly scaled); scores scaled by
    # 16 ** -0.5 rather than head_dim's
    "gemma3": dict(model_type="gemma3_text", head_dim=12, sliding_window=4, query_pre_attn_scalar=16,
                   layer_types=["sliding_attention", "full_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
    # Gemma 1: Llama's layout with Gemma's norms, GeGLU and scaled embeddings; the legacy "gelu"
    "gemma": dict(model_type="gemma", head_dim=12, hidden_act="gelu"),
    # Gemma 3's layer kinds with one RoPE base, no q/k norms, and soft-capping: caps this low squash
    # the tiny model's scores and logits (of up to ~1.3) visibly
    "gemma2": dict(model_type="gemma2", head_dim=12, sliding_window=4, query_pre_attn_scalar=16,
                   attn_logit_softcapping=0.5, final_logit_softcapping=1.0),
    # NoPE on every second layer (the second of two; SmolLM3 3B: every fourth), tied embeddings
    "smollm3": dict(model_type="smollm3", no_rope_layer_interval=2, tie_word_embeddings=True),
    # and its window on the NoPE layers (use_sliding_window: each NoPE layer windowed to 4 positions)
    "smollm3_window": dict(model_type="smollm3", no_rope_layer_interval=2, use_sliding_window=True,
                           sliding_window=4),
    # Granite's multipliers, far from one so each shows
    "granite": dict(model_type="granite", embedding_multiplier=6.0, residual_multiplier=0.3,
                    attention_multiplier=0.05, logits_scaling=4.0, tie_word_embeddings=True),
    "olmo2": dict(model_type="olmo2", rms_norm_eps=1e-6),
    # 4 experts of 32 (Qwen3-MoE) / 96 (Mixtral) a layer, each token through 2 of them
    "qwen3_moe": dict(model_type="qwen3_moe", head_dim=24, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True),
    # Qwen2-MoE: q/k/v biases, 4 routed experts of 32 (top 2, not renormalised) and a shared expert of 40
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=40, norm_topk_prob=False),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6),
    # OLMoE: norms over whole q / k projections, 4 experts of 32, top 2 not renormalised
    "olmoe": dict(model_type="olmoe", num_experts=4, num_experts_per_tok=2, intermediate_size=32,
                  rms_norm_eps=1e-6, eos_token_id=2),
    # GPT-OSS: attention sinks, a windowed layer and a full one, YaRN, 4 biased experts of 32 (top 2)
    # whose clamped SwiGLU clamps at 0.3 (7 in the released models): low enough to clamp here
    "gpt_oss": dict(model_type="gpt_oss", head_dim=12, num_local_experts=4, num_experts_per_tok=2,
                    intermediate_size=32, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                    swiglu_limit=0.3, rms_norm_eps=1e-6),
    # a windowed layer (plain RoPE) and a full one with YaRN (pretrained on 16 positions)
    "olmo3": dict(model_type="olmo3", rms_norm_eps=1e-6, sliding_window=4,
                  layer_types=["sliding_attention", "full_attention"],
                  rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
    # fused q/k/v and gate/up weights; 6 of each head's 12 dims rotate
    "phi3": dict(model_type="phi3", partial_rotary_factor=0.5, pad_token_id=0),
}


def build_tiny_hf_checkpoint(directory: Path, model_type: str, seed: int = 0, **overrides: Any) -> Path:
    """A tiny random torch transformers model saved with save_pretrained (the parity reference)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs: dict[str, Any] = dict(
        hidden_size=72,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        vocab_size=101,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # HF zero-inits biases and ones-inits norms: perturb all
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(directory)
    return directory


def logits_of(model: Any, ids: Any, attention_mask: Any = None, positions: Any = None) -> Any:
    """model(ids, positions, attention_mask)'s logits as numpy, through one jitted forward: eager
    dispatch compiles every primitive of a forward on its own (40-160 small compiles a call)."""
    import jax.numpy as jnp
    import numpy as np

    def arr(x: Any) -> Any:
        return None if x is None else jnp.asarray(x)

    return np.asarray(_jitted_forward()(model, arr(ids), arr(positions), arr(attention_mask)))


def wandb_history(run_dir: Path, run_id: str) -> list[dict[str, Any]]:
    """The history rows (`run.log` calls) of an offline W&B run under `run_dir`/wandb, read from
    its .wandb files (every offline session of that run id, oldest first). The file is a header
    (":W&B", 2 magic bytes, a version byte) and then LevelDB's log format: 32 KiB blocks of records
    (CRC, length, type: full / first / middle / last) that each hold a `Record` protobuf."""
    import json
    import re
    import struct

    from wandb.proto import wandb_internal_pb2

    # a session's directory is offline-run-<second it started>-<run id>, with "-1", "-2", ... after
    # it for a later session that started within the same second
    session = re.compile(rf"offline-run-(\d{{8}}_\d{{6}})-{re.escape(run_id)}(?:-(\d+))?")
    sessions = []
    for directory in (Path(run_dir) / "wandb").glob("offline-run-*"):
        m = session.fullmatch(directory.name)
        if m and (directory / f"run-{run_id}.wandb").is_file():
            sessions.append((m.group(1), int(m.group(2) or 0), directory / f"run-{run_id}.wandb"))
    rows: list[dict[str, Any]] = []
    for *_, path in sorted(sessions):
        blob, pos, pending, chunks = path.read_bytes(), 7, b"", []
        assert blob[:4] == b":W&B", path
        while pos + 7 <= len(blob):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
                pos += 32768 - pos % 32768
                continue
            _, n, kind = struct.unpack("<IHB", blob[pos:pos + 7])
            data, pos = blob[pos + 7:pos + 7 + n], pos + 7 + n
            if kind in (1, 2):
                pending = data
            elif kind in (3, 4):
                pending += data
            if kind in (1, 4):
                chunks.append(pending)
        for chunk in chunks:
            record = wandb_internal_pb2.Record.FromString(chunk)
            if record.WhichOneof("record_type") == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item}
                rows.append({k: v for k, v in items.items() if not k.startswith("_")})
    return rows


def numpy_model_parts(config: Any, scale: float = 0.1, seed: int = 0) -> tuple[Any, Any]:
    """(graphdef, params) of a `CausalLM` of `config` with numpy weights ~N(0, scale) (norms ~1):
    no PRNG kernels to compile."""
    import jax
    import numpy as np
    from flax import nnx

    from tbajax.models import CausalLM

    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)

    def init(path: Any, x: Any) -> Any:
        w = (rng.standard_normal(x.shape) * scale).astype(np.float32)
        return 1.0 + w if "norm" in jax.tree_util.keystr(path) else w

    return graphdef, jax.tree_util.tree_map_with_path(init, abstract)


def assert_serving_layout_converts_back(model: Any, params: Any) -> None:
    """The sampler's layout of `model`'s weights (`serving.ServingParams`) converts back to the
    model's params exactly (same names, same values)."""
    import jax
    import numpy as np
    from flax import nnx

    from tbajax.models import serving

    back = jax.jit(lambda p: serving.stacked_params(model.config, p))(params)

    def flat(tree: Any) -> dict[str, Any]:
        return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)}

    original = flat(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    assert flat(back).keys() == original.keys()
    for name, value in flat(back).items():
        np.testing.assert_array_equal(value, original[name], err_msg=name)


@functools.cache
def _jitted_forward() -> Callable[..., Any]:
    from flax import nnx

    return nnx.jit(lambda model, ids, positions, mask: model(ids, positions, mask)[0])


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """tiny_checkpoint(family) -> directory of a saved tiny HF model (built once per session)."""
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            spec = dict(TINY_FAMILIES[family])
            d = tmp_path_factory.mktemp(f"hf-{family}")
            cache[family] = build_tiny_hf_checkpoint(d, spec.pop("model_type"), **spec)
        return cache[family]

    return get


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """qwen_tokenizer_dir(variant) -> directory of the real Qwen tokenizer. Building one takes ~5 s
    (151k BPE ranks), so it is built once per test run and shared by the pytest-xdist workers."""
    from filelock import FileLock

    from tbajax.tokenizers import build_qwen_tokenizer

    shared = tmp_path_factory.getbasetemp().parent  # the same for every worker of this run

    def get(variant: str) -> Path:
        directory = shared / f"qwen-tokenizer-{variant}"
        with FileLock(str(directory) + ".lock"):
            if not (directory / "tokenizer.json").is_file():
                build_qwen_tokenizer(directory, variant)
        return directory

    return get


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under `-n 2 --dist loadgroup` (the README's command) every test that starts role processes
    runs on one worker, one at a time: each such run wants both cores and has deadlines, while the
    other worker takes the in-process tests (mostly single-threaded XLA compiles)."""
    for item in items:
        if item.get_closest_marker("processes"):
            item.add_marker(pytest.mark.xdist_group("processes"))
