"""Parity of our Flax decoder with torch transformers, the KV-cache path, and HF checkpoint I/O."""

import dataclasses
import functools
import json
import math
import re
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM

from tests.conftest import assert_serving_layout_converts_back, logits_of
from tbajax.models import (
    CausalLM,
    CheckpointError,
    KVCache,
    ModelConfig,
    UnsupportedModelError,
    load_model,
    positions_from_mask,
    save_model,
    serving,
)
from tbajax.models import layers as L
from tbajax.models.serving import ServingParams

FAMILIES = ["llama", "llama_tied_rope3", "qwen2", "qwen2_tied", "qwen3", "mistral", "olmo2", "phi3", "gemma2",
            "gemma3", "qwen2_window", "smollm3", "smollm3_window", "granite", "gemma", "olmo3", "qwen3_moe",
            "mixtral", "olmoe", "qwen2_moe", "gpt_oss"]


def _batch(seed: int = 0, b: int = 4, t: int = 11, vocab: int = 101):
    rng = np.random.RandomState(seed)
    ids = rng.randint(3, vocab, (b, t))
    mask = np.ones((b, t), np.int64)
    mask[1, :4] = 0  # left padding
    mask[2, -3:] = 0  # right padding
    mask[3, :2] = 0
    mask[3, -2:] = 0
    return ids, mask


def _torch_logits(directory: Path, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    pos = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos)
        )
    return out.logits.numpy()


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_torch_transformers(tiny_checkpoint, family):
    directory = tiny_checkpoint(family)
    ids, mask = _batch()
    ref = _torch_logits(directory, ids, mask)
    model = load_model(directory)
    ours = logits_of(model, ids, mask)
    real = mask.astype(bool)
    assert np.abs(ours - ref)[real].max() <= 1e-4


@pytest.mark.parametrize("family", ["mistral", "phi3"])
def test_a_sliding_window_matches_torch_transformers(tmp_path, family):
    """Mistral's and Phi-3's sliding window (4 positions here) over 11-token rows with left and
    right padding: the same logits as transformers, which windows them too; without the window
    they differ (the test sees it in force). The config round-trips through config.json."""
    from tests.conftest import TINY_FAMILIES, build_tiny_hf_checkpoint

    spec = {**TINY_FAMILIES[family], "sliding_window": 4}
    directory = build_tiny_hf_checkpoint(tmp_path, spec.pop("model_type"), **spec)
    ids, mask = _batch()
    ref = _torch_logits(directory, ids, mask)
    model = load_model(directory)
    assert model.config.sliding_window == 4
    assert ModelConfig.from_hf(model.config.to_hf()) == model.config
    real = mask.astype(bool)
    assert np.abs(logits_of(model, ids, mask) - ref)[real].max() <= 1e-4
    unwindowed = nnx.merge(*nnx.split(CausalLM(dataclasses.replace(model.config, sliding_window=None),
                                               rngs=nnx.Rngs(0)))[:1], nnx.state(model))
    assert np.abs(logits_of(unwindowed, ids, mask) - ref)[real].max() > 1e-2


def test_a_sliding_window_is_read_where_it_changes_attention(tiny_checkpoint):
    hf = json.loads((tiny_checkpoint("mistral") / "config.json").read_text())
    assert hf["sliding_window"] is None and ModelConfig.from_hf(hf).sliding_window is None
    # a window as long as the context never cuts anything off
    assert ModelConfig.from_hf({**hf, "sliding_window": hf["max_position_embeddings"]}).sliding_window is None
    assert ModelConfig.from_hf({**hf, "sliding_window": 64}).sliding_window == 64
    with pytest.raises(UnsupportedModelError, match="sliding_window is read and written for"):
        dataclasses.replace(ModelConfig.from_hf({**hf, "model_type": "llama"}), sliding_window=8)
    # Qwen2 (a transformers v4 config.json): the window on the layers from max_window_layers on
    qwen = {**hf, "model_type": "qwen2", "num_hidden_layers": 3, "sliding_window": 8, "max_window_layers": 1}
    assert ModelConfig.from_hf(qwen).sliding_window is None  # use_sliding_window unset
    windowed = ModelConfig.from_hf({**qwen, "use_sliding_window": True})
    assert windowed.sliding_window == 8
    assert windowed.layer_types == ("full_attention", "sliding_attention", "sliding_attention")
    assert ModelConfig.from_hf(windowed.to_hf()) == windowed


def test_smollm3_nope_layers_are_read_and_in_force(tiny_checkpoint):
    """SmolLM3's NoPE layers (`no_rope_layers`: 0 for a layer without RoPE) and its window on them
    (`use_sliding_window`) read from config.json, written back, and in force: with RoPE on every
    layer the logits are not transformers'. Layers without RoPE are refused for other families."""
    for name, types in (("smollm3", None), ("smollm3_window", ("full_attention", "sliding_attention"))):
        model = load_model(tiny_checkpoint(name))
        cfg = model.config
        assert (cfg.rope_layers, cfg.layer_types) == ((True, False), types)
        assert ModelConfig.from_hf(cfg.to_hf()) == cfg
        kinds, kind_of = cfg.layer_kinds()
        assert [k.without_rope for k in kinds] == [False, True] and kind_of == (0, 1)
        ids, mask = _batch()
        ref, real = _torch_logits(tiny_checkpoint(name), ids, mask), mask.astype(bool)
        roped = nnx.merge(*nnx.split(CausalLM(dataclasses.replace(cfg, rope_layers=None, layer_types=None),
                                              rngs=nnx.Rngs(0)))[:1], nnx.state(model))
        assert np.abs(logits_of(roped, ids, mask) - ref)[real].max() > 1e-2
    llama = ModelConfig(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=2,
                        num_heads=2, num_kv_heads=2, head_dim=4)
    with pytest.raises(UnsupportedModelError, match="rope_layers .* not llama"):
        dataclasses.replace(llama, rope_layers=(True, False))


def test_granite_multipliers_are_read_and_in_force(tiny_checkpoint):
    """Granite's four scales read, written back, and each in force: with any one of them at its
    plain value the logits are not transformers'. Other families refuse them."""
    model = load_model(tiny_checkpoint("granite"))
    cfg = model.config
    plain = {"embedding_multiplier": 1.0, "residual_multiplier": 1.0, "attention_multiplier": None,
             "logits_scaling": 1.0}
    assert [getattr(cfg, k) for k in plain] == [6.0, 0.3, 0.05, 4.0]
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    ids, mask = _batch()
    ref, real = _torch_logits(tiny_checkpoint("granite"), ids, mask), mask.astype(bool)
    assert np.abs(logits_of(model, ids, mask) - ref)[real].max() <= 1e-4
    for name, value in plain.items():
        off = nnx.merge(*nnx.split(CausalLM(dataclasses.replace(cfg, **{name: value}), rngs=nnx.Rngs(0)))[:1],
                        nnx.state(model))
        assert np.abs(logits_of(off, ids, mask) - ref)[real].max() > 1e-3, name  # ours match to ~1e-6
    llama = ModelConfig(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=2,
                        num_heads=2, num_kv_heads=2, head_dim=4)
    with pytest.raises(UnsupportedModelError, match="logits_scaling read and written for"):
        dataclasses.replace(llama, logits_scaling=2.0)


def test_gemma_reads_the_legacy_gelu_as_transformers_does(tiny_checkpoint):
    """Gemma 1's released configs say hidden_act "gelu" and mean the tanh approximation."""
    hf = json.loads((tiny_checkpoint("gemma") / "config.json").read_text())
    assert ModelConfig.from_hf({**hf, "hidden_act": "gelu"}).hidden_act == "gelu_pytorch_tanh"
    assert ModelConfig.from_hf(hf).to_hf()["hidden_act"] == "gelu_pytorch_tanh"
    with pytest.raises(UnsupportedModelError, match="hidden_activation='silu'"):
        ModelConfig.from_hf({**hf, "hidden_act": "silu"})


def test_olmo3_scales_rope_on_its_full_attention_layers_only(tiny_checkpoint):
    """OLMo 3's YaRN is on its full-attention layers: the windowed ones rotate plainly (their own
    base, `local_rope_theta`); with YaRN on both kinds the logits are not transformers'. Read from
    transformers v5's RoPE per layer type and from a v4 `rope_scaling`, written back."""
    model = load_model(tiny_checkpoint("olmo3"))
    cfg = model.config
    assert (cfg.layer_types, cfg.sliding_window, cfg.local_rope_theta) == (
        ("sliding_attention", "full_attention"), 4, cfg.rope_theta)
    assert cfg.rope_scaling.rope_type == "yarn" and ModelConfig.from_hf(cfg.to_hf()) == cfg
    v4 = {k: v for k, v in cfg.to_hf().items() if k != "rope_parameters"}
    v4.update(rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling.to_hf())
    assert ModelConfig.from_hf(v4) == cfg
    ids, mask = _batch(t=20)
    ref, real = _torch_logits(tiny_checkpoint("olmo3"), ids, mask), mask.astype(bool)
    assert np.abs(logits_of(model, ids, mask) - ref)[real].max() <= 1e-4
    everywhere = nnx.merge(*nnx.split(CausalLM(dataclasses.replace(cfg, local_rope_theta=None),
                                               rngs=nnx.Rngs(0)))[:1], nnx.state(model))
    assert np.abs(logits_of(everywhere, ids, mask) - ref)[real].max() > 1e-3


def test_a_smollm3_3b_config_reads_as_transformers_reads_it():
    """SmolLM3-3B's shapes (36 layers, every fourth without RoPE, tied embeddings; its config.json
    written out here without the hub): the NoPE layers and the size as transformers builds them."""
    from transformers import AutoConfig

    hf = {"model_type": "smollm3", "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
          "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 128256, "rope_theta": 5e6,
          "max_position_embeddings": 65536, "tie_word_embeddings": True, "no_rope_layer_interval": 4,
          "use_sliding_window": False, "sliding_window": None, "rms_norm_eps": 1e-6}
    cfg = ModelConfig.from_hf(hf)
    theirs = AutoConfig.for_model(**hf)
    with torch.device("meta"):
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(theirs).parameters())
    assert cfg.num_params() == size
    assert [int(r) for r in cfg.rope_layers] == theirs.no_rope_layers and cfg.rope_layers.count(False) == 9
    assert cfg.layer_types is None and cfg.sliding_window is None
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


# google/gemma-3-1b-it's config.json as published (transformers 4.50 layout: no layer_types, the
# local RoPE base beside the global one)
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid",
    "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "initializer_range": 0.02,
    "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text",
    "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144,
}


def test_the_published_gemma3_1b_config_reads_as_transformers_reads_it():
    """No weights (no network here): the layer kinds, RoPE and size transformers builds from the
    real config.json, and from the one we write back."""
    from transformers import AutoConfig

    cfg = ModelConfig.from_hf(GEMMA3_1B)
    ignored = ("architectures", "transformers_version", "torch_dtype")
    theirs = AutoConfig.for_model(**{k: v for k, v in GEMMA3_1B.items() if k not in ignored})
    with torch.device("meta"):
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(theirs).parameters())
    assert cfg.num_params() == size == 999_885_952
    assert list(cfg.layer_types) == theirs.layer_types and cfg.layer_types.count("full_attention") == 4
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.sliding_window) == (1e6, 1e4, 512)
    assert cfg.eos_token_ids == (1, 106)
    ours = AutoConfig.for_model(**{k: v for k, v in cfg.to_hf().items() if k != "architectures"})
    assert (ours.layer_types, ours.rope_parameters, ours.query_pre_attn_scalar, ours.sliding_window) == (
        theirs.layer_types, theirs.rope_parameters, 256, 512)


def test_a_multimodal_gemma3_checkpoint_loads_its_text_model(tmp_path):
    """Gemma 3 4B and up are Gemma3ForConditionalGeneration checkpoints (model_type gemma3): their
    text model loads (the text_config, its defaults filled in as transformers fills them; the
    tensors under language_model.model., as transformers writes them, or under
    model.language_model.), the vision tower is not read, and text-only logits are the whole
    model's. The export is the text model (gemma3_text), which transformers loads alike."""
    from safetensors.numpy import load_file, save_file
    from transformers import AutoConfig, Gemma3ForConditionalGeneration

    text = dict(hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=12, vocab_size=101, max_position_embeddings=128,
                sliding_window=4, query_pre_attn_scalar=16,
                layer_types=["sliding_attention", "full_attention"])
    vision = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=16, patch_size=8)
    config = AutoConfig.for_model("gemma3", text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                  image_token_index=100, boi_token_index=98, eoi_token_index=99,
                                  eos_token_id=[1, 2], pad_token_id=0)
    torch.manual_seed(0)
    whole = Gemma3ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for p in whole.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    whole.save_pretrained(tmp_path / "v4")
    ids, mask = _batch()
    ids = np.minimum(ids, 97)  # text tokens only
    with torch.no_grad():
        ref = whole(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                    position_ids=torch.tensor(np.maximum(np.cumsum(mask, -1) - 1, 0))).logits.numpy()
    tensors = load_file(tmp_path / "v4" / "model.safetensors")
    assert any(k.startswith("language_model.model.") for k in tensors)
    assert any(k.startswith("vision_tower.") for k in tensors)
    (tmp_path / "v5").mkdir()
    shutil.copy(tmp_path / "v4" / "config.json", tmp_path / "v5" / "config.json")
    save_file({re.sub(r"^language_model\.model\.", "model.language_model.",
                      re.sub(r"^(vision_tower|multi_modal_projector)\.", r"model.\1.", k)): v
               for k, v in tensors.items()}, tmp_path / "v5" / "model.safetensors")
    real = mask.astype(bool)
    for layout in ("v4", "v5"):
        model = load_model(tmp_path / layout)
        assert model.config.model_type == "gemma3_text" and model.config.eos_token_ids == (1, 2)
        assert model.config.local_rope_theta == 1e4 and model.config.rope_theta == 1e6  # filled in
        assert np.abs(logits_of(model, ids, mask) - ref)[real].max() <= 1e-4, layout
    out = save_model(model, tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["model_type"] == "gemma3_text"
    assert np.abs(_torch_logits(out, ids, mask) - ref)[real].max() <= 1e-5


# google/gemma-2-2b-it's config.json fields (transformers 4.42 layout: no layer_types, no
# rope_parameters), written out here from the model card's config (no network to fetch it)
GEMMA2_2B = {
    "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid",
    "eos_token_id": [1, 107], "final_logit_softcapping": 30.0, "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304,
    "initializer_range": 0.02, "intermediate_size": 9216, "max_position_embeddings": 8192,
    "model_type": "gemma2", "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
    "sliding_window": 4096, "torch_dtype": "float32", "transformers_version": "4.42.4", "use_cache": True,
    "vocab_size": 256000,
}


def test_a_gemma2_2b_config_reads_as_transformers_reads_it():
    """Gemma 2 2B's layer kinds (even layers slide), caps and size as transformers builds them from
    the config, and from the one we write back."""
    from transformers import AutoConfig

    cfg = ModelConfig.from_hf(GEMMA2_2B)
    ignored = ("architectures", "transformers_version", "torch_dtype")
    theirs = AutoConfig.for_model(**{k: v for k, v in GEMMA2_2B.items() if k not in ignored})
    with torch.device("meta"):
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(theirs).parameters())
    assert cfg.num_params() == size == 2_614_341_888
    assert list(cfg.layer_types) == theirs.layer_types and cfg.layer_types[:2] == ("sliding_attention",
                                                                                    "full_attention")
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping, cfg.sliding_window) == (50.0, 30.0, 4096)
    assert cfg.local_rope_theta is None and not cfg.qk_norm and cfg.eos_token_ids == (1, 107)
    ours = AutoConfig.for_model(**{k: v for k, v in cfg.to_hf().items() if k != "architectures"})
    for field in ("layer_types", "rope_parameters", "query_pre_attn_scalar", "sliding_window",
                  "attn_logit_softcapping", "final_logit_softcapping", "head_dim"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    with pytest.raises(ValueError, match="attention='cudnn' has no score soft-capping"):
        dataclasses.replace(cfg, dtype="bfloat16", attention="cudnn")
    with pytest.raises(ValueError, match="final_logit_softcapping=0.0 must be a number > 0"):
        dataclasses.replace(cfg, final_logit_softcapping=0.0)
    llama = ModelConfig(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=1,
                        num_heads=2, num_kv_heads=2, head_dim=4)
    with pytest.raises(UnsupportedModelError, match="attn_logit_softcapping is read and written for"):
        dataclasses.replace(llama, attn_logit_softcapping=50.0)


# openai/gpt-oss-20b's config.json (its architecture fields), MXFP4 experts and all
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2880, "intermediate_size": 2880, "num_attention_heads": 64,
    "num_key_value_heads": 8, "num_hidden_layers": 24, "num_local_experts": 32, "num_experts_per_tok": 4,
    "experts_per_token": 4, "layer_types": ["sliding_attention", "full_attention"] * 12, "sliding_window": 128,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 150000,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "original_max_position_embeddings": 4096, "truncate": False},
    "swiglu_limit": 7.0, "tie_word_embeddings": False, "vocab_size": 201088, "eos_token_id": 200002,
    "pad_token_id": 199999, "router_aux_loss_coef": 0.9, "output_router_logits": False,
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
}


def test_gpt_oss_20b_config_reads_and_writes_back_as_transformers_builds_it():
    """GPT-OSS-20B's layer kinds, YaRN, experts and size as transformers builds them from its
    config, and from the one we write back (unquantized); attention sinks refuse cuDNN's attention
    and every other model type."""
    from transformers import AutoConfig

    cfg = ModelConfig.from_hf(GPT_OSS_20B)
    ignored = ("architectures", "quantization_config", "experts_per_token")
    theirs = AutoConfig.for_model(**{k: v for k, v in GPT_OSS_20B.items() if k not in ignored})
    with torch.device("meta"):
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(theirs).parameters())
    assert cfg.num_params() == size
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.expert_intermediate_size) == (32, 4, 2880)
    assert cfg.attention_sinks and (cfg.swiglu_limit, cfg.swiglu_alpha, cfg.sliding_window) == (7.0, 1.702, 128)
    assert cfg.rope_scaling.rope_type == "yarn" and not cfg.rope_scaling.truncate
    written = cfg.to_hf()
    assert "quantization_config" not in written
    ours = AutoConfig.for_model(**{k: v for k, v in written.items() if k != "architectures"})
    for field in ("layer_types", "sliding_window", "swiglu_limit", "num_local_experts", "num_experts_per_tok",
                  "head_dim", "attention_bias", "router_aux_loss_coef"):
        assert getattr(ours, field) == getattr(theirs, field), field
    # ours also writes out YaRN's attention factor, which transformers derives: 0.1 ln(factor) + 1
    assert {k: v for k, v in ours.rope_parameters.items() if k != "attention_factor"} == theirs.rope_parameters
    assert ours.rope_parameters["attention_factor"] == pytest.approx(0.1 * np.log(32.0) + 1)
    assert ModelConfig.from_hf(written) == cfg
    with pytest.raises(ValueError, match="attention='cudnn' has no attention sinks"):
        dataclasses.replace(cfg, dtype="bfloat16", attention="cudnn")
    llama = ModelConfig(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=1,
                        num_heads=2, num_kv_heads=2, head_dim=4)
    with pytest.raises(UnsupportedModelError, match="attention_sinks and swiglu_limit are read and written"):
        dataclasses.replace(llama, attention_sinks=True)


def _longrope_phi3(directory: Path) -> Path:
    """A tiny Phi-3 with LongRoPE, as Phi-3.5-mini / Phi-4-mini: 3 short and 3 long factors for its
    6 rotary dims, pretrained on 16 positions of 128 (attention factor sqrt(1 + ln 8 / ln 16))."""
    from tests.conftest import TINY_FAMILIES, build_tiny_hf_checkpoint

    spec = {**TINY_FAMILIES["phi3"], "max_position_embeddings": 128, "original_max_position_embeddings": 16,
            "rope_scaling": {"type": "longrope", "short_factor": [1.6, 1.3, 1.05],
                             "long_factor": [2.1, 5.3, 5.7]}}
    return build_tiny_hf_checkpoint(directory, spec.pop("model_type"), **spec)


def test_phi3_longrope_matches_torch_transformers(tmp_path):
    """LongRoPE: a call whose longest position is within the pretraining length (16) takes the
    short factors, a longer one the long factors at all its positions, as transformers chooses;
    cos / sin scaled by the attention factor. The config round-trips, transformers reads ours, and
    factors that do not fit the rotary dims are refused."""
    from transformers import AutoConfig

    model = load_model(_longrope_phi3(tmp_path))
    s = model.config.rope_scaling
    assert (s.rope_type, s.original_max_position_embeddings, s.factor) == ("longrope", 16, 8.0)
    assert s.attention_factor == pytest.approx(math.sqrt(1 + math.log(8) / math.log(16)))
    shorter = dataclasses.replace(s, original_max_position_embeddings=64)  # never the long factors
    as_short = nnx.merge(*nnx.split(CausalLM(dataclasses.replace(model.config, rope_scaling=shorter),
                                             rngs=nnx.Rngs(0)))[:1], nnx.state(model))
    for t in (11, 24):  # positions up to 10: the short factors; up to 23: the long ones
        ids, mask = _batch(t=t)
        ref, real = _torch_logits(tmp_path, ids, mask), mask.astype(bool)
        assert np.abs(logits_of(model, ids, mask) - ref)[real].max() <= 1e-4, t
        gap = np.abs(logits_of(as_short, ids, mask) - ref)[real].max()
        assert gap <= 1e-4 if t == 11 else gap > 1e-2, (t, gap)
    hf = model.config.to_hf()
    assert ModelConfig.from_hf(hf) == model.config
    theirs = AutoConfig.for_model(**{k: v for k, v in hf.items() if k != "architectures"}).rope_parameters
    assert (theirs["rope_type"], theirs["original_max_position_embeddings"]) == ("longrope", 16)
    assert (theirs["short_factor"], theirs["long_factor"]) == ([1.6, 1.3, 1.05], [2.1, 5.3, 5.7])
    with pytest.raises(UnsupportedModelError, match="6 rotary dims need 3 of each"):
        dataclasses.replace(model.config, rope_scaling=dataclasses.replace(s, short_factor=(1.0, 1.0)))


@pytest.mark.parametrize("family, scaling", [
    ("qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}),
    # DeepSeek's form: the attention factor from mscale / mscale_all_dim, a narrower ramp
    ("llama", {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "mscale": 0.707,
               "mscale_all_dim": 1.0, "beta_fast": 16}),
], ids=["qwen3", "llama_mscale"])
def test_yarn_rope_matches_torch_transformers(tmp_path, family, scaling):
    """YaRN (Qwen2.5 / Qwen3 past 32k, DeepSeek): frequencies ramped between kept and divided by
    the factor, cos / sin times the attention factor: transformers' logits, a config that
    round-trips, and logits that differ without the scaling (it is in force)."""
    from tests.conftest import TINY_FAMILIES, build_tiny_hf_checkpoint

    spec = {**TINY_FAMILIES[family], "rope_scaling": scaling}
    model = load_model(build_tiny_hf_checkpoint(tmp_path, spec.pop("model_type"), **spec))
    assert model.config.rope_scaling.rope_type == "yarn"
    assert ModelConfig.from_hf(model.config.to_hf()) == model.config
    ids, mask = _batch(t=20)
    ref, real = _torch_logits(tmp_path, ids, mask), mask.astype(bool)
    assert np.abs(logits_of(model, ids, mask) - ref)[real].max() <= 1e-4
    plain = nnx.merge(*nnx.split(CausalLM(dataclasses.replace(model.config, rope_scaling=None),
                                          rngs=nnx.Rngs(0)))[:1], nnx.state(model))
    assert np.abs(logits_of(plain, ids, mask) - ref)[real].max() > 1e-2


def test_phi3_longrope_decode_past_the_pretraining_length_matches_transformers(tmp_path):
    """One token a step with a KV cache, from a 12-token prompt to position 21: transformers takes
    the long factors for the steps past position 15 and keeps the keys cached before in their
    short rotation; our cached pass gives the same logits step for step (teacher-forced)."""
    directory = _longrope_phi3(tmp_path)
    model = load_model(directory)
    torch_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    b, prompt, total = 2, 12, 22
    ids = np.random.RandomState(2).randint(3, 101, (b, total))
    ref = []
    with torch.no_grad():
        out = torch_model(input_ids=torch.tensor(ids[:, :prompt]), use_cache=True)
        ref.append(out.logits[:, -1].numpy())
        for t in range(prompt, total - 1):
            out = torch_model(input_ids=torch.tensor(ids[:, t:t + 1]), past_key_values=out.past_key_values,
                              use_cache=True)
            ref.append(out.logits[:, -1].numpy())
    step = nnx.jit(lambda m, ids, pos, mask, cache: m(ids, pos, mask, cache))
    pos, mask = jnp.broadcast_to(jnp.arange(total), (b, total)), jnp.ones((b, total), bool)
    ids = jnp.asarray(ids)
    cache = KVCache.init(model.config, b, total + 2)
    logits, cache = step(model, ids[:, :prompt], pos[:, :prompt], mask[:, :prompt], cache)
    ours = [logits[:, -1]]
    for t in range(prompt, total - 1):
        logits, cache = step(model, ids[:, t:t + 1], pos[:, t:t + 1], mask[:, t:t + 1], cache)
        ours.append(logits[:, -1])
    np.testing.assert_allclose(np.stack(ours, 1), np.stack(ref, 1), atol=1e-4)
    full = logits_of(model, np.asarray(ids), np.ones((b, total)))  # one call: long factors everywhere
    assert np.abs(full[:, total - 2] - ref[-1]).max() > 1e-3  # so the steps past 15 are not a full pass


@pytest.mark.parametrize(
    "family, weight_first",
    [("llama", True), ("qwen2", True), ("qwen3", True), ("olmo2", True), ("phi3", True), ("qwen2", False),
     ("mistral_window", True), ("gemma2", True), ("gemma3", True), ("smollm3_window", True),
     ("granite", True), ("gemma", True), ("olmo3", True), ("qwen3_moe", True), ("mixtral", True),
     ("olmoe", True), ("qwen2_moe", True), ("gpt_oss", True)],
)
def test_kv_cache_decode_matches_full_forward(tiny_checkpoint, family, weight_first, monkeypatch):
    """Prefill a left-padded prompt, then decode token by token: same logits as one forward.
    weight_first: the few rows' products take the weight as their left operand
    (`layers.out_major_product`), as a sampler's do at up to 64 rows; else rows first."""
    if not weight_first:
        monkeypatch.setattr(L, "WEIGHT_FIRST_MAX_ROWS", 0)
    model = load_model(tiny_checkpoint(family))
    rng = np.random.RandomState(1)
    b, prompt, new = 3, 6, 5
    ids = rng.randint(3, 101, (b, prompt + new))
    mask = np.ones((b, prompt + new), bool)
    mask[1, :2] = False  # left-padded prompts of different lengths
    mask[2, :5] = False
    # jitted: eager dispatch compiles every primitive of the forward separately (~160 compiles)
    forward = nnx.jit(lambda m, ids, mask: m(ids, attention_mask=mask)[0])
    step = nnx.jit(lambda m, ids, pos, mask, cache: m(ids, pos, mask, cache))
    full = forward(model, jnp.asarray(ids), jnp.asarray(mask))
    pos = positions_from_mask(jnp.asarray(mask))
    cache = KVCache.init(model.config, b, prompt + new + 3)
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    logits, cache = step(model, ids[:, :prompt], pos[:, :prompt], mask[:, :prompt], cache)
    steps = [logits[:, -1]]
    for t in range(prompt, prompt + new - 1):
        logits, cache = step(model, ids[:, t : t + 1], pos[:, t : t + 1], mask[:, t : t + 1], cache)
        steps.append(logits[:, -1])
    decoded = np.stack([np.asarray(s) for s in steps], axis=1)
    np.testing.assert_allclose(decoded, np.asarray(full[:, prompt - 1 : -1]), atol=1e-4)
    assert int(cache.index) == prompt + new - 1

    # the sampler's layout (llama: per-layer weights with q/k/v and gate/up fused, o_proj a
    # matrix, the head vocab-major) is a copy of the same weights: it converts back exactly
    params = nnx.jit(ServingParams.of)(model)
    # (a mixture-of-experts MLP keeps its experts as they are)
    moe = model.config.num_experts is not None
    fused = {"qkv_proj", "o_proj"} if moe else {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert {name + L.OUT_MAJOR for name in fused} <= params.layers[0].keys()  # all four [out, in]
    assert not fused & params.layers[0].keys() and "q_proj" not in params.layers[0]
    assert_serving_layout_converts_back(model, params)

    # the prompt pass attends over the prompt's own keys (no cache) and hands back the keys and
    # values the cached path wrote at the prompt's real tokens (a padding column's differ: its
    # query sees no key), and the last column's logits
    @jax.jit
    def prompt_pass(params, ids, mask, pos):
        last, keys, values = serving.prompt_pass(model.config, params, ids, mask, pos)
        return serving.logits(model.config, params, last), keys, values

    first, keys, values = prompt_pass(params, ids[:, :prompt], mask[:, :prompt], pos[:, :prompt])
    np.testing.assert_allclose(np.asarray(first), np.asarray(full[:, prompt - 1]), atol=1e-4)
    cache = KVCache.init(model.config, b, prompt + new + 3)
    _, cache = step(model, ids[:, :prompt], pos[:, :prompt], mask[:, :prompt], cache)
    real = np.asarray(mask[:, :prompt])
    for layer in range(model.config.num_layers):
        k_ours, k_cached = np.asarray(keys[layer]), np.asarray(cache.k[layer][..., :prompt])
        v_ours, v_cached = np.asarray(values[layer]), np.asarray(cache.v[layer][:, :, :prompt])
        for row in range(b):
            cols = real[row]
            np.testing.assert_allclose(k_ours[row][..., cols], k_cached[row][..., cols], atol=1e-5)
            np.testing.assert_allclose(v_ours[row][:, cols], v_cached[row][:, cols], atol=1e-5)


def test_bf16_compute_and_remat(tiny_checkpoint):
    directory = tiny_checkpoint("qwen2")
    ids, mask = _batch()

    @nnx.jit  # eager op-by-op dispatch compiles every primitive separately: 10x slower here
    def logits(model):
        return model(jnp.asarray(ids), attention_mask=jnp.asarray(mask))[0]

    ref = np.asarray(logits(load_model(directory)))
    out = np.asarray(logits(load_model(directory, dtype="bfloat16")))
    assert out.dtype == np.float32 and np.isfinite(out).all()
    assert np.abs(out - ref)[mask.astype(bool)].max() < 0.1  # bf16 rounding, same function
    pure_bf16 = load_model(directory, param_dtype="bfloat16", dtype="bfloat16")
    assert nnx.state(pure_bf16, nnx.Param)["layers"]["q_proj"][...].dtype == jnp.bfloat16

    @nnx.jit
    def grads(model):
        return nnx.grad(lambda m: logits(m).mean())(model)

    g_plain = grads(load_model(directory))
    g_remat = grads(load_model(directory, remat="full"))
    for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_remat)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "qwen2_tied", "qwen3", "mistral", "olmo2", "phi3", "gemma2",
                                    "gemma3", "qwen2_window", "smollm3_window", "granite", "gemma",
                                    "olmo3", "qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "gpt_oss"])
def test_export_round_trip_loads_in_torch(tiny_checkpoint, tmp_path, family):
    directory = tiny_checkpoint(family)
    model = load_model(directory)
    out = save_model(model, tmp_path / "export", max_shard_bytes=40_000)  # force several shards
    assert (out / "model.safetensors.index.json").exists()
    ids, mask = _batch(3)
    ref = _torch_logits(directory, ids, mask)
    again = _torch_logits(out, ids, mask)
    ours = np.asarray(load_model(out)(jnp.asarray(ids), attention_mask=jnp.asarray(mask))[0])
    real = mask.astype(bool)
    assert np.abs(again - ref)[real].max() <= 1e-5
    assert np.abs(ours - ref)[real].max() <= 1e-4


def test_export_bf16_and_tokenizer_files(tiny_checkpoint, tmp_path):
    directory = tiny_checkpoint("llama")
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    out = save_model(load_model(directory), tmp_path / "bf16", dtype="bfloat16", tokenizer_source=tok)
    assert (out / "tokenizer.json").exists()
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16


def test_random_init_model_exports_and_matches_torch(tmp_path):
    cfg = ModelConfig(
        model_type="llama", vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, eos_token_id=2,
    )
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    out = save_model(model, tmp_path / "m")
    ids = np.random.RandomState(0).randint(0, 50, (2, 7))
    mask = np.ones_like(ids)
    ours = logits_of(model, ids)
    assert np.abs(ours - _torch_logits(out, ids, mask)).max() <= 1e-4
    assert abs(cfg.num_params() - sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))) == 0


# ----------------------------------------------------------------------------- bad input


def _copy(directory: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(directory, dst)
    return dst


def _edit_config(directory: Path, **changes) -> None:
    cfg = json.loads((directory / "config.json").read_text())
    cfg.update(changes)
    (directory / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"model_type": "mamba"}, "model_type='mamba'"),
        ({"model_type": "gemma3"}, "a gemma3 config.json without a text_config"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}}, "'dynamic'"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_unsupported_config_is_refused(tiny_checkpoint, tmp_path, changes, message):
    d = _copy(tiny_checkpoint("qwen2"), tmp_path)
    _edit_config(d, **changes)
    with pytest.raises(UnsupportedModelError, match=message):
        load_model(d)


def test_v4_config_layout_is_read():
    cfg = ModelConfig.from_hf(
        dict(
            model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
            num_attention_heads=2, rope_theta=5e5,
            rope_scaling={"type": "linear", "factor": 2.0},
        )
    )
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling.factor == 2.0 and cfg.num_kv_heads == 2


def test_scan_layers_auto_unrolls_shallow_models_only():
    from tbajax.models.config import UNROLLED_MAX_LAYERS, scan_layers_for

    def hf(layers: int) -> dict:
        return dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16,
                    num_hidden_layers=layers, num_attention_heads=2)

    assert scan_layers_for("auto", UNROLLED_MAX_LAYERS) is False
    assert scan_layers_for("auto", UNROLLED_MAX_LAYERS + 1) is True
    assert scan_layers_for(True, 1) is True and scan_layers_for(False, 64) is False
    assert ModelConfig.from_hf(hf(2), scan_layers="auto").scan_layers is False
    assert ModelConfig.from_hf(hf(UNROLLED_MAX_LAYERS + 1), scan_layers="auto").scan_layers is True
    assert ModelConfig.from_hf(hf(2)).scan_layers is True  # load_model's default stays the scan
    with pytest.raises(ValueError, match="choose true, false or 'auto'"):
        ModelConfig.from_hf(hf(2), scan_layers="yes")
    with pytest.raises(ValueError, match="'auto' is resolved by ModelConfig.from_hf"):
        dataclasses.replace(ModelConfig.from_hf(hf(2)), scan_layers="auto")


def test_missing_weights_file(tiny_checkpoint, tmp_path):
    d = _copy(tiny_checkpoint("llama"), tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(d)


def test_shape_mismatch_names_the_tensor(tiny_checkpoint, tmp_path):
    d = _copy(tiny_checkpoint("llama"), tmp_path)
    _edit_config(d, intermediate_size=128)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.\w+_proj\.weight. has shape .*implies .*128"):
        load_model(d)


def test_missing_tensor_is_named(tiny_checkpoint, tmp_path):
    d = _copy(tiny_checkpoint("qwen2_tied"), tmp_path)
    _edit_config(d, tie_word_embeddings=False)
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load_model(d)


def test_hub_id_while_offline_fails_fast(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(CheckpointError, match="HF_HUB_OFFLINE"):
        load_model("Qwen/Qwen2.5-7B")
    with pytest.raises(CheckpointError, match="neither a local directory"):
        load_model(tmp_path / "does-not-exist")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_hand_written_vjps_match_autodiff(dtype):
    """head_logprobs / tempered_logprobs (incl. the temperature's gradient), linear (both layouts
    of its weight gradient) and swiglu against autodiff of the plain compositions."""
    from tbajax.batch import hidden_token_logprobs, tempered_logprobs
    from tbajax.models.layers import linear, swiglu

    r = np.random.default_rng(0)  # numpy inputs: eager jax.random ops would compile one by one
    hidden = jnp.asarray(r.normal(size=(3, 7, 16)), dtype)
    head = jnp.asarray(r.normal(size=(16, 29)) * 0.3, dtype)
    tokens = jnp.asarray(r.integers(0, 29, (3, 7)))
    weights = jnp.asarray(r.normal(size=(3, 7)), jnp.float32)
    tol = 1e-5 if dtype == jnp.float32 else 3e-2

    def plain(h, w, t):
        logits = jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32)[:, :-1] / t
        lp = jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)[..., 0]
        return (jnp.pad(lp, ((0, 0), (1, 0))) * weights).sum()

    def fused(h, w, t):
        return (hidden_token_logprobs(h, w, tokens, t) * weights).sum()

    t = jnp.float32(0.7)
    want = jax.jit(jax.grad(plain, argnums=(0, 1, 2)))(hidden, head, t)  # jit: eager dispatch compiles op by op
    got = jax.jit(jax.grad(fused, argnums=(0, 1, 2)))(hidden, head, t)
    np.testing.assert_allclose(jax.jit(fused)(hidden, head, t), jax.jit(plain)(hidden, head, t), rtol=tol)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == (dtype if a.ndim else jnp.float32)
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=tol * 10, rtol=tol)
    logits = jnp.asarray(r.normal(size=(5, 29)) * 2, jnp.float32)
    targets = tokens[0, :5]
    d_t = jax.jit(jax.grad(lambda t: (tempered_logprobs(logits, targets, t) * weights[0, :5]).sum()))(t)
    d_t_plain = jax.jit(jax.grad(
        lambda t: (jnp.take_along_axis(jax.nn.log_softmax(logits / t), targets[:, None], -1)[:, 0]
                   * weights[0, :5]).sum()
    ))(t)
    np.testing.assert_allclose(d_t, d_t_plain, rtol=1e-5)

    x = jnp.asarray(r.normal(size=(2, 5, 16)), dtype)
    for shape in ((16, 24), (16, 8)):  # d <= f transposes x, d > f transposes the cotangent
        w = jnp.asarray(r.normal(size=shape) * 0.2, dtype)
        g_lin = jax.jit(jax.grad(lambda x, w: (linear(x, w).astype(jnp.float32) ** 2).sum(), argnums=(0, 1)))(x, w)
        g_ref = jax.jit(jax.grad(lambda x, w: (jnp.einsum("btd,df->btf", x, w).astype(jnp.float32) ** 2).sum(),
                                 argnums=(0, 1)))(x, w)
        for a, b in zip(g_lin, g_ref):
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=tol * 10, rtol=tol)
    up = jnp.asarray(r.normal(size=x.shape), dtype)
    g_sw = jax.jit(jax.grad(lambda a, b: (swiglu(a, b).astype(jnp.float32) ** 2).sum(), argnums=(0, 1)))(x, up)
    g_ref = jax.jit(jax.grad(lambda a, b: ((jax.nn.silu(a) * b).astype(jnp.float32) ** 2).sum(),
                             argnums=(0, 1)))(x, up)
    for a, b in zip(g_sw, g_ref):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=tol * 10, rtol=tol)


def test_head_logprobs_divide_the_hidden_states_by_the_temperature_not_the_logits():
    """`head_logprobs` tempers (h / T) @ W: no vocab-sized divide in its program or its VJP's, and
    the log-probs and the temperature's gradient are those of log_softmax((h @ W) / T) in fp64."""
    from tbajax.batch import head_logprobs

    r = np.random.default_rng(2)
    h = jnp.asarray(r.normal(size=(2, 5, 8)), jnp.float32)
    w = jnp.asarray(r.normal(size=(8, 37)) * 0.5, jnp.float32)
    targets = jnp.asarray(r.integers(0, 37, (2, 5)), jnp.int32)
    t = jnp.float32(0.6)
    loss = lambda h, w, t: head_logprobs(h, w, targets, t).sum()  # noqa: E731
    for program in (jax.jit(loss), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))):
        hlo = program.lower(h, w, t).compile().as_text()
        assert not [ln for ln in hlo.splitlines() if "divide(" in ln and "37]" in ln.split("divide(")[0]]
    z = np.einsum("btd,dv->btv", np.asarray(h, np.float64), np.asarray(w, np.float64)) / 0.6
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    want = np.take_along_axis(logp, np.asarray(targets)[..., None], -1)[..., 0]
    np.testing.assert_allclose(jax.jit(lambda h, w, t: head_logprobs(h, w, targets, t))(h, w, t), want,
                               rtol=1e-5, atol=1e-5)
    # d/dT sum log p(target) = -sum(onehot - softmax(z)) * z / T
    p = np.exp(logp)
    onehot = np.eye(37)[np.asarray(targets)]
    want_dt = -np.sum((onehot - p) * z) / 0.6
    np.testing.assert_allclose(jax.jit(jax.grad(loss, argnums=2))(h, w, t), want_dt, rtol=1e-4)


def _head_inputs(rows: int, length: int, width: int, vocab: int, dtype=jnp.float32, seed: int = 3):
    r = np.random.default_rng(seed)
    return (jnp.asarray(r.normal(size=(rows, length, width)), dtype),
            jnp.asarray(r.normal(size=(width, vocab)) * width**-0.5, dtype),
            jnp.asarray(r.integers(0, vocab, (rows, length)), jnp.int32),
            jnp.asarray(r.normal(size=(rows, length)), jnp.float32))


def _head_value_and_grads(chunk, h, w, targets, g):
    from tbajax.batch import head_logprobs

    def loss(h, w, t):
        out = head_logprobs(h, w, targets, t, chunk)
        return (out * g).sum(), out
    grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    (_, out), grads = grad_fn(h, w, jnp.float32(0.7))
    return out, grads


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("chunk", [1, 6, 7, 36, 90])
def test_chunked_head_logprobs_equal_the_whole_projection(chunk, dtype):
    """A chunk at a time along the length axis (3 rows x 13 positions: chunks of 1 position, of 2
    (6 and 7 tokens: padded to 14 positions), of 12 (36 tokens: padded to 24) and all 39 tokens at
    once (90)): the same log-probs and gradients (hidden, head, temperature) as all at once."""
    h, w, targets, g = _head_inputs(3, 13, 8, 37, dtype)
    want_out, want_grads = _head_value_and_grads(None, h, w, targets, g)
    out, grads = _head_value_and_grads(chunk, h, w, targets, g)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(out, want_out, rtol=tol, atol=tol)
    for got, want in zip(grads, want_grads):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=tol, atol=tol)


@pytest.mark.parametrize("chunk", [None, 6])
def test_soft_capped_head_logprobs_match_the_plain_formula(chunk):
    """Gemma 2's soft-capped logits, log_softmax(cap tanh((h @ W) / cap) / T) (the cap before the
    temperature), all at once and 2 positions a chunk: the log-probs and the gradients of h, W
    and T equal autodiff of the plain formula, with logits well beyond the cap."""
    from tbajax.batch import head_logprobs

    h, w, targets, g = _head_inputs(3, 13, 8, 37)
    w, cap, t = w * 4, 1.5, jnp.float32(0.7)

    def plain(h, w, t):
        z = cap * jnp.tanh(jnp.einsum("rld,dv->rlv", h, w) / cap) / t
        return jnp.take_along_axis(jax.nn.log_softmax(z, -1), targets[..., None], -1)[..., 0]

    def ours(h, w, t):
        return head_logprobs(h, w, targets, t, chunk, softcap=cap)

    assert np.abs(np.asarray(jnp.einsum("rld,dv->rlv", h, w))).max() > 3 * cap
    np.testing.assert_allclose(jax.jit(ours)(h, w, t), plain(h, w, t), rtol=1e-5, atol=1e-5)
    weighted = lambda f: lambda h, w, t: (f(h, w, t) * g).sum()  # noqa: E731
    got = jax.jit(jax.grad(weighted(ours), argnums=(0, 1, 2)))(h, w, t)
    want = jax.grad(weighted(plain), argnums=(0, 1, 2))(h, w, t)
    for a, b, what in zip(got, want, ("hidden", "head", "temperature")):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5, err_msg=what)


def test_head_chunk_steps_by_hand():
    from tbajax.batch import HEAD_CHUNK_BYTES, head_chunk_steps

    assert HEAD_CHUNK_BYTES // (4 * 151936) == 1766  # "auto" at Qwen2.5's vocabulary
    # 16 rows: 1766 // 16 = 110 positions a step, 1024 / 110 -> 10 steps
    assert head_chunk_steps("auto", (16, 1024, 896), 151936) == 10
    assert head_chunk_steps("auto", (2, 800, 896), 151936) == 1  # 1,600 tokens fit one chunk
    assert head_chunk_steps(None, (16, 4096, 896), 151936) == 1
    assert head_chunk_steps(100, (4, 100, 8), 50) == 4  # 25 positions a step
    assert head_chunk_steps(3, (4, 10, 8), 50) == 10  # more rows than the chunk: a position a step
    assert head_chunk_steps(100, (2, 3, 10, 8), 50) == 1  # leading axes count as rows: 60 tokens
    # rows split over devices: each device's tokens count (16 rows over 4 devices: 4 rows, 441 positions
    # a step, 3 steps; over 16 devices 1,024 tokens a device fit one chunk)
    assert head_chunk_steps("auto", (16, 1024, 896), 151936, shards=4) == 3
    assert head_chunk_steps("auto", (16, 1024, 896), 151936, shards=16) == 1
    for bad in (0, -5, 2.5, True, "all"):
        with pytest.raises(ValueError, match="head_chunk_tokens"):
            head_chunk_steps(bad, (4, 10, 8), 50)


def test_chunked_head_holds_a_chunk_of_logits_not_all_of_them():
    """XLA's buffer assignment for the value and gradient: 4 x 512 tokens of an 8,192-word vocabulary
    hold 64 MiB of fp32 logits at once; in chunks of 256 tokens (4 rows x 64 positions) the
    program's scratch memory is a few chunks' logits (8 MiB each)."""
    from tbajax.batch import head_logprobs

    h, w, targets, g = _head_inputs(4, 512, 16, 8192)

    def temp_bytes(chunk) -> int:
        loss = lambda h, w: (head_logprobs(h, w, targets, jnp.float32(1.0), chunk) * g).sum()  # noqa: E731
        program = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(h, w).compile()
        return program.memory_analysis().temp_size_in_bytes

    whole, chunked = temp_bytes(None), temp_bytes(256)
    logits, chunk_logits = 4 * 512 * 8192 * 4, 256 * 8192 * 4
    assert whole >= logits, (whole, logits)
    assert chunked <= 3 * chunk_logits, (chunked, chunk_logits)  # a chunk's logits, their gradient, scratch


def test_chunked_head_on_a_mesh_matches_one_device():
    """Rows sharded over the data axis, the vocabulary over the tensor axis: each chunk takes every
    row, so the sharded program gives the one-device log-probs and gradients."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from tbajax.sharding import MeshConfig, make_mesh

    h, w, targets, g = _head_inputs(4, 9, 8, 64)
    want_out, want_grads = _head_value_and_grads(None, h, w, targets, g)
    mesh = make_mesh(MeshConfig(data=4, fsdp=1, tensor=2))
    rows, vocab = NamedSharding(mesh, P("data")), NamedSharding(mesh, P(None, "tensor"))
    with jax.set_mesh(mesh):
        out, grads = _head_value_and_grads(8, jax.device_put(h, rows), jax.device_put(w, vocab),
                                           jax.device_put(targets, rows), jax.device_put(g, rows))
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, want_grads):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_project_matches_the_einsum_of_a_multi_axis_weight_and_its_gradients():
    """`project` (q_proj-like [d, heads, head_dim] and o_proj-like [heads, head_dim, d] weights)
    equals the einsum it replaces in the family blocks, value and gradients."""
    from tbajax.models.layers import project

    r = np.random.default_rng(1)
    h = jnp.asarray(r.normal(size=(2, 5, 16)), jnp.float32)
    w_in = jnp.asarray(r.normal(size=(16, 4, 3)) * 0.2, jnp.float32)
    w_out = jnp.asarray(r.normal(size=(4, 3, 16)) * 0.2, jnp.float32)

    def ours(h, w_in, w_out):
        return (project(jnp.tanh(project(h, w_in)), w_out, in_axes=2) ** 2).sum()

    def plain(h, w_in, w_out):
        q = jnp.tanh(jnp.einsum("btd,dhk->bthk", h, w_in))
        return (jnp.einsum("bthk,hkd->btd", q, w_out) ** 2).sum()

    np.testing.assert_allclose(jax.jit(ours)(h, w_in, w_out), jax.jit(plain)(h, w_in, w_out), rtol=1e-5)
    got = jax.jit(jax.grad(ours, argnums=(0, 1, 2)))(h, w_in, w_out)
    want = jax.jit(jax.grad(plain, argnums=(0, 1, 2)))(h, w_in, w_out)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_orient_for_decode_moves_named_weights_out_major_and_undoes_exactly():
    """Named weights move to name + OUT_MAJOR as [out, in], unnamed ones stay; `decode_product`
    gives the same product from either layout; undo is exact."""
    r = np.random.default_rng(2)
    p = {
        "big": jnp.asarray(r.normal(size=(6, 5)), jnp.float32),
        "small": jnp.asarray(r.normal(size=(6, 4)), jnp.float32),
        "norm": jnp.ones((6,), jnp.float32),
    }
    oriented = L.orient_for_decode(p, ("big",))
    assert set(oriented) == {"big" + L.OUT_MAJOR, "small", "norm"} and set(p) == {"big", "small", "norm"}
    np.testing.assert_array_equal(oriented["big" + L.OUT_MAJOR], np.asarray(p["big"]).T)
    x = jnp.asarray(r.normal(size=(2, 3, 6)), jnp.float32)
    for name in ("big", "small"):
        np.testing.assert_allclose(L.decode_product(x, oriented, name), x @ p[name], rtol=1e-5, atol=1e-6)
    back = L.undo_orient(oriented)
    assert set(back) == set(p)
    for name, value in p.items():
        np.testing.assert_array_equal(back[name], value)


@pytest.mark.parametrize("rows", [(1, 3), (4, 16), (5, 16)])  # 3, 64: weight first; 80: rows first
@pytest.mark.parametrize("out_dtype", [None, jnp.float32])
def test_out_major_product_is_x_times_w_transposed(rows, out_dtype):
    """x [..., in] times w [out, in]: the same product whichever operand goes first, in bf16 too
    (accumulated in fp32; `out_dtype` fp32 keeps it); on CPU, up to 64 rows, XLA runs it as
    w x^T: the optimized program's product writes [out, rows] (the transpose not folded back)."""
    r = np.random.default_rng(4)
    x32 = r.normal(size=(*rows, 24)).astype(np.float32)
    w32 = r.normal(size=(40, 24)).astype(np.float32)
    for dtype in (jnp.float32, jnp.bfloat16):
        x, w = jnp.asarray(x32, dtype), jnp.asarray(w32, dtype)
        fn = jax.jit(lambda x, w: L.out_major_product(x, w, out_dtype))
        got = fn(x, w)
        want = np.asarray(x, np.float32) @ np.asarray(w, np.float32).T
        assert got.shape == (*rows, 40) and got.dtype == (out_dtype or dtype)
        tol = 1e-5 if dtype == jnp.float32 or out_dtype else 2e-2
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol * 10)
        hlo = fn.lower(x, w).compile().as_text()
        n = int(np.prod(rows))
        first = re.search(rf"\[40,{n}\]\{{1,0\}} (dot|fusion)\(", hlo) is not None
        assert first == (n <= L.WEIGHT_FIRST_MAX_ROWS), hlo


def test_out_major_product_limit_is_per_batch_shard():
    """Under a data mesh of 2, 128 rows are 64 a device: each device's product goes weight first."""
    from tbajax.sharding import MeshConfig, make_mesh

    mesh = make_mesh(MeshConfig(data=2), devices=jax.devices()[:2])
    r = np.random.default_rng(5)
    x, w = r.normal(size=(128, 24)).astype(np.float32), r.normal(size=(40, 24)).astype(np.float32)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, jax.NamedSharding(mesh, jax.P("data")))
        fn = jax.jit(lambda x, w: L.out_major_product(x, w))
        np.testing.assert_allclose(fn(xs, w), x @ w.T, rtol=1e-5, atol=1e-5)
        hlo = fn.lower(xs, w).compile().as_text()
    assert re.search(r"\[40,64\]\{1,0\} (dot|fusion)\(", hlo), hlo


def test_unfused_transpose_is_the_transpose_whatever_its_first_element():
    """The CPU lowering keeps the transpose in a conditional (so XLA cannot fuse it into its
    producer or fold it into a product); both branches transpose, so a NaN or negative first
    element changes nothing."""
    from tbajax.models.layers import unfused_transpose

    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    f = jax.jit(lambda a: unfused_transpose(a * 2.0))
    for first in (5.0, -5.0, np.nan):
        x[0, 0] = first
        np.testing.assert_array_equal(f(x), (x * 2).T)
    assert unfused_transpose(jnp.zeros((0, 3))).shape == (3, 0)
    assert "conditional" in f.lower(x).compile().as_text()
    # batched (the attention VJP's operands): the last two axes swap
    x4 = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5) - 7
    np.testing.assert_array_equal(jax.jit(unfused_transpose)(x4), x4.swapaxes(-1, -2))


def test_backward_products_take_xla_cpu_library_kernels():
    """The token-contracting products of the backward (attention's dk / dv, a narrow projection's
    weight gradient, the LM head's) compile on CPU to no generic `dot` op (XLA's fallback emitter,
    several times slower than its library kernels), where their earlier forms, which
    `experiments/benchmarks/backward_layouts.py` keeps as its reference, compile to some."""
    from experiments.benchmarks.backward_layouts import earlier, generic_dots
    from tbajax.batch import head_logprobs

    rng = np.random.default_rng(4)
    b, t, heads, kv, d = 2, 128, 4, 2, 32
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, n, d)), jnp.float32) for n in (heads, kv, kv))
    causal = L.CausalMask(jnp.tril(jnp.ones((t, t), bool))[None].repeat(b, 0))
    targets = jnp.asarray(rng.integers(0, 512, 256), jnp.int32)
    cases = {
        "attention": (lambda q, k, v: (L.self_attention(q, k, v, causal, None, jnp.float32)[0] ** 2).sum(),
                      (q, k, v)),
        "linear": (lambda x, w: jnp.tanh(L.linear(x, w)).sum(),  # d w for a g narrower than x
                   (jnp.asarray(rng.standard_normal((256, 128)), jnp.float32),
                    jnp.asarray(rng.standard_normal((128, 64)), jnp.float32))),
        "head": (lambda h, w: head_logprobs(h, w, targets, jnp.float32(0.7)).sum(),
                 (jnp.asarray(rng.standard_normal((256, 64)), jnp.float32),
                  jnp.asarray(rng.standard_normal((64, 512)) / 8, jnp.float32))),
    }
    for name, (loss, args) in cases.items():
        counts = []
        for before in (False, True):
            with earlier(**{name: before}):
                grad = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))
                counts.append(generic_dots(grad.lower(*args).compile().as_text()))
        assert counts[0] == 0 and counts[1] > 0, (name, counts)


def test_own_kernel_is_the_identity_with_its_gradient():
    """`own_kernel` (a scanned layer's bias kept out of its consumers' loop fusions) returns its
    input whatever the first element, passes gradients through, and on CPU stays a conditional."""
    from tbajax.models.layers import own_kernel

    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    f = jax.jit(lambda a: own_kernel(a * 2.0))
    for first in (5.0, -5.0, np.nan):
        x[0, 0] = first
        np.testing.assert_array_equal(f(x), x * 2)
    y = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    grad = jax.jit(jax.grad(lambda a: (own_kernel(a) * y).sum()))(np.ones((3, 4), np.float32))
    np.testing.assert_array_equal(grad, y)
    assert "conditional" in f.lower(x).compile().as_text()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_scan_layers_is_lax_scan_without_an_fp32_copy_of_a_low_precision_stack(dtype):
    """`layers.scan_layers` gives lax.scan's outputs and gradients bit for bit (weights, carry and
    an fp32 weight beside them), and on CPU its program holds no fp32 array of a bf16 stack's
    shape (XLA's hoisted convert of the whole stack, which lax.scan's program has)."""
    rng = np.random.default_rng(0)
    stacked = {"w": jnp.asarray(rng.standard_normal((3, 8, 8)) * 0.3, dtype),
               "b": jnp.asarray(rng.standard_normal((3, 8)), jnp.float32)}
    x = jnp.asarray(rng.standard_normal((4, 8)), dtype)

    def body(h, p):
        return jnp.tanh(h @ p["w"] + p["b"].astype(h.dtype)), (h * 2).sum()

    def loss(scan, s, h):
        out, ys = scan(body, h, s)
        return out.astype(jnp.float32).sum() + ys.astype(jnp.float32).sum()

    got = jax.jit(lambda s, h: L.scan_layers(body, h, s))(stacked, x)
    want = jax.jit(lambda s, h: jax.lax.scan(body, h, s))(stacked, x)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    grads = [jax.jit(jax.grad(lambda s, h, f=f: loss(f, s, h), argnums=(0, 1)))(stacked, x)
             for f in (L.scan_layers, jax.lax.scan)]
    jax.tree.map(np.testing.assert_array_equal, *grads)
    assert float(jnp.abs(grads[0][0]["w"].astype(jnp.float32)).max()) > 0
    if dtype == jnp.bfloat16:  # (lax.scan's program has that copy under jax 0.10's XLA, not 0.11's)
        hlo = jax.jit(lambda s, h: L.scan_layers(body, h, s)).lower(stacked, x).compile().as_text()
        assert "f32[3,8,8]" not in hlo


def test_gelu_exact_matches_torch_gelu_and_its_gradient_in_fp32_and_bf16():
    """The erf form (`layers.gelu_exact`) against torch's "gelu" over the range that matters, the
    tails included (where the erfc form is the more precise one): values within fp32 rounding,
    gradients too (in the negative tail both lose the digits that 1 + erf cancels: an absolute
    1e-6); a bf16 input is computed in fp32 and rounded once, as torch does (to within one bf16
    step: the two erf approximations may round either side of a midpoint)."""
    x = np.concatenate([np.linspace(-12, 12, 2001), [-30.0, -6.5, 0.0, 1e-6, 30.0]]).astype(np.float32)
    tx = torch.tensor(x, requires_grad=True)
    torch.nn.functional.gelu(tx).sum().backward()
    want = torch.nn.functional.gelu(tx).detach().numpy()
    np.testing.assert_allclose(L.gelu_exact(jnp.asarray(x)), want, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda a: L.gelu_exact(a).sum())(jnp.asarray(x)), tx.grad.numpy(),
                               rtol=2e-6, atol=2e-6)
    got16 = np.asarray(L.gelu_exact(jnp.asarray(x, jnp.bfloat16)).astype(jnp.float32))
    want16 = torch.nn.functional.gelu(torch.tensor(x).bfloat16()).float().numpy()
    np.testing.assert_allclose(got16, want16, rtol=2**-7, atol=2e-5)


def test_matmul_accumulates_bf16_in_fp32_and_leaves_fp32_alone():
    """`layers.matmul`: fp32 operands give jnp.einsum's program; bf16 ones a product with an fp32
    result on CPU (YNNPACK's bf16 kernels), rounded back to bf16, and gradients through `linear`."""
    from tbajax.models.layers import linear, matmul

    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((5, 64), np.float32), rng.standard_normal((64, 24), np.float32) / 8
    fp32 = jax.jit(lambda a, b: matmul("md,df->mf", a, b))
    plain = jax.jit(lambda a, b: jnp.einsum("md,df->mf", a, b))
    assert fp32.lower(x, w).as_text() == plain.lower(x, w).as_text()

    xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    bf16 = jax.jit(lambda a, b: matmul("md,df->mf", a, b))
    out = bf16(xb, wb)
    assert out.dtype == jnp.bfloat16
    hlo = bf16.lower(xb, wb).compile().as_text()
    assert any(" f32[5,24]" in ln and ("dot(" in ln or "__ynn_fusion" in ln) for ln in hlo.splitlines())
    # the fp32-accumulated product, rounded once: within half a bf16 ulp of the exact product of
    # the bf16 operands
    exact = np.asarray(xb, np.float64) @ np.asarray(wb, np.float64)
    np.testing.assert_allclose(np.asarray(out, np.float64), exact, rtol=2**-8, atol=1e-6)

    g = rng.standard_normal((5, 24), np.float32)
    loss = lambda a, b: (linear(a, b).astype(jnp.float32) * g).sum()  # noqa: E731
    dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(xb, wb)
    assert dx.dtype == dw.dtype == jnp.bfloat16
    gb, x64, w64 = (np.asarray(a, np.float64) for a in (jnp.asarray(g, jnp.bfloat16), xb, wb))
    np.testing.assert_allclose(np.asarray(dx, np.float64), gb @ w64.T, rtol=2**-7, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dw, np.float64), x64.T @ gb, rtol=2**-7, atol=1e-5)


def test_row_major_transpose_is_the_transpose_written_in_blocks():
    """`row_major_transpose` (x^T for a bf16 weight gradient) is bitwise x.T; on CPU it is row
    blocks joined by a concatenate when the rows divide into TRANSPOSE_BLOCKS, and `linear`'s
    bf16 weight gradient through it is the fp64 product's, rounded."""
    from tbajax.models.layers import TRANSPOSE_BLOCKS, linear, row_major_transpose

    rng = np.random.default_rng(1)
    rows = 4 * TRANSPOSE_BLOCKS
    x = jnp.asarray(rng.standard_normal((rows, 24)), jnp.bfloat16)
    f = jax.jit(row_major_transpose)
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(x).T)
    assert "concatenate" in f.lower(x).compile().as_text()
    odd = jnp.asarray(rng.standard_normal((rows + 1, 24)), jnp.bfloat16)  # not in blocks: x.T as is
    np.testing.assert_array_equal(np.asarray(jax.jit(row_major_transpose)(odd)), np.asarray(odd).T)

    w = jnp.asarray(rng.standard_normal((24, 40)) / 5, jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal((rows, 40)), jnp.bfloat16)
    # g an argument, as a backward pass's is: with g a constant, XLA splits the product along the
    # blocks into bf16 x bf16 -> fp32 dots of its own, which jax 0.11's XLA:CPU cannot run
    loss = lambda a, b, c: (linear(a, b).astype(jnp.float32) * c.astype(jnp.float32)).sum()  # noqa: E731
    dw = jax.jit(jax.grad(loss, argnums=1))(x, w, g)
    exact = np.asarray(x, np.float64).T @ np.asarray(g, np.float64)
    np.testing.assert_allclose(np.asarray(dw, np.float64), exact, rtol=2**-7, atol=1e-5)


def test_rows_per_step_takes_the_batch_when_its_scores_fit_else_a_divisor_within_half():
    from tbajax.models.layers import ROW_SCORES_BUDGET, rows_per_step

    mib = 1 << 20
    assert ROW_SCORES_BUDGET == 8 * mib
    assert rows_per_step(16, mib // 2) == 16  # 16 x 128 at 4 kv heads x 2 query groups: 8 MiB
    assert rows_per_step(16, 2 * mib) == 2  # 16 x 256: 32 MiB > 8, and 2 rows fill half
    assert rows_per_step(6, 100, budget=599) == 2  # 600 > 599; half the budget holds 2 rows
    assert rows_per_step(7, 100, budget=599) == 1  # 7 is prime: one row a step
    assert rows_per_step(4, 10 * mib) == 1  # one row beyond the budget still takes a step
    assert rows_per_step(4, 100, budget=0) == 1


@pytest.mark.parametrize("softcap,sinks", [(None, False), (0.7, False), (None, True)])
@pytest.mark.parametrize("h,kv", [(6, 2), (4, 4)])
def test_attention_after_a_shared_prompt_equals_attention_over_copied_prompts(h, kv, softcap, sinks):
    """One new token per row over its prompt's keys held once per prompt plus its own row's
    cache equals `cached_attention` over each row's prompt copied in front of its own slots:
    grouped queries and multi-head (g = 1), left padding, an all-padding prompt, masked slots
    holding NaN-free garbage; plain and soft-capped scores, and attention sinks (a logit per
    head in the softmax's denominator). The latter, one token's multiply-reduce attention, equals
    a plain softmax."""
    from tbajax.models.layers import PromptKV, attention_after_prompt, cached_attention

    r = np.random.default_rng(1)
    n, k, d, p, s = 3, 4, 8, 5, 7
    b = n * k
    q = jnp.asarray(r.normal(size=(b, 1, h, d)), jnp.float32)
    pk, pv = (jnp.asarray(r.normal(size=shape), jnp.float32) for shape in ((n, kv, d, p), (n, kv, p, d)))
    kt, v = (jnp.asarray(r.normal(size=shape), jnp.float32) for shape in ((b, kv, d, s), (b, kv, s, d)))
    pvalid = np.arange(p)[None, :] >= np.array([0, 2, p])[:, None]  # left padding; prompt 2: padding only
    valid = np.arange(s)[None, :] < r.integers(1, s + 1, b)[:, None]  # each row's own tokens
    sink = jnp.asarray(r.normal(size=h), jnp.float32) if sinks else None
    got = jax.jit(attention_after_prompt, static_argnums=5)(q, kt, v, jnp.asarray(valid[:, None]),
                                                            PromptKV(pk, pv, jnp.asarray(pvalid)), softcap, sink)
    rep = functools.partial(jnp.repeat, repeats=k, axis=0)
    full_valid = np.concatenate([np.repeat(pvalid, k, 0), valid], 1)[:, None]
    keys, values = jnp.concatenate([rep(pk), kt], 3), jnp.concatenate([rep(pv), v], 2)
    want = cached_attention(q, keys, values, jnp.asarray(full_valid), softcap, sink)
    assert got.shape == (b, 1, h, d)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    heads = np.repeat(np.arange(kv), h // kv)  # query head -> its kv head
    scores = np.einsum("bhd,bhds->bhs", np.asarray(q[:, 0], np.float64),
                       np.asarray(keys, np.float64)[:, heads])
    scores = scores * d**-0.5 if softcap is None else softcap * np.tanh(scores * d**-0.5 / softcap)
    scores = np.where(full_valid, scores, -np.inf)  # [b, 1, s] over the heads
    if sinks:  # a column of the sink logits, its probability dropped
        scores = np.concatenate([scores, np.broadcast_to(np.asarray(sink)[None, :, None], (b, h, 1))], -1)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs = (probs / probs.sum(-1, keepdims=True))[..., :keys.shape[-1]]
    plain = np.einsum("bhs,bhsd->bhd", probs, np.asarray(values)[:, heads])
    live = full_valid[:, 0].any(-1)  # a row that sees no key is a uniform average here, not there
    np.testing.assert_allclose(np.asarray(want)[live, 0], plain[live], atol=1e-5)
    with pytest.raises(ValueError, match="one token per row"):
        attention_after_prompt(jnp.concatenate([q, q], 1), kt, v, jnp.asarray(valid[:, None]),
                               PromptKV(pk, pv, jnp.asarray(pvalid)))


@pytest.mark.parametrize("softcap,sinks", [(None, False), (0.7, False), (None, True)])
@pytest.mark.parametrize("h,kv", [(4, 2), (4, 4)], ids=["gqa", "mha"])
def test_attention_after_a_pooled_prompt_equals_attention_over_copied_prompts(h, kv, softcap, sinks):
    """A pool of prompts (continuous batching): rows in any order, each the sample j of the pool
    entry its table names, equal to `cached_attention` over its prompt copied in front of its own
    slots (with attention sinks too). Also: an entry with no live sample, a table entry left
    pointing at a row that now continues another prompt (stale), and a row that holds no sample,
    which stays finite."""
    from tbajax.models.layers import PromptKV, attention_after_prompt, cached_attention

    r = np.random.default_rng(2)
    n, k, d, p, s, b = 4, 3, 8, 5, 6, 7  # 4 pool entries of K = 3; 7 rows
    q = jnp.asarray(r.normal(size=(b, 1, h, d)), jnp.float32)
    pk, pv = (jnp.asarray(r.normal(size=shape), jnp.float32) for shape in ((n, kv, d, p), (n, kv, p, d)))
    kt, v = (jnp.asarray(r.normal(size=shape), jnp.float32) for shape in ((b, kv, d, s), (b, kv, s, d)))
    pvalid = np.arange(p)[None, :] >= np.array([0, 2, 1, p])[:, None]  # entry 3: empty
    valid = np.arange(s)[None, :] < r.integers(1, s + 1, b)[:, None]
    # entry 0: rows 4, 0 (its sample 2 has ended); entry 1: rows 2, 5, 1; entry 2: row 6, and its
    # sample 0 still names row 5, which has since gone to entry 1 (stale); row 3 holds no sample
    samples = np.array([[4, 0, b], [2, 5, 1], [5, b, 6], [b, b, b]])
    owner = {4: (0, 0), 0: (0, 1), 2: (1, 0), 5: (1, 1), 1: (1, 2), 6: (2, 2)}
    entry = np.array([owner[i][0] * k + owner[i][1] if i in owner else 0 for i in range(b)])
    sink = jnp.asarray(r.normal(size=h), jnp.float32) if sinks else None
    got = jax.jit(attention_after_prompt, static_argnums=5)(q, kt, v, jnp.asarray(valid[:, None]), PromptKV(
        pk, pv, jnp.asarray(pvalid), jnp.asarray(samples, jnp.int32), jnp.asarray(entry, jnp.int32)), softcap,
        sink)
    assert got.shape == (b, 1, h, d) and np.isfinite(np.asarray(got)).all()
    of = np.array([owner[i][0] if i in owner else 0 for i in range(b)])
    full_valid = np.concatenate([pvalid[of], valid], 1)[:, None]
    want = cached_attention(q, jnp.concatenate([pk[of], kt], 3), jnp.concatenate([pv[of], v], 2),
                            jnp.asarray(full_valid), softcap, sink)
    live = sorted(owner)
    np.testing.assert_allclose(np.asarray(got)[live], np.asarray(want)[live], atol=1e-5)


def test_causal_blocks_after_shared_keys_match_a_plain_softmax():
    """Causal query blocks with more keys than queries (a response after its prompt, as
    `strided_group_attention` runs it): query j may see the first 40 keys (some padding) and its
    own span's keys up to j; forward and VJP against a plain softmax over the whole mask."""
    from tbajax.models.layers import _MASK_VALUE, attention, causal_blocks

    r = np.random.default_rng(3)
    b, h, kv, d, t, o = 3, 4, 2, 8, 128, 40
    assert causal_blocks(t) == 4
    q = jnp.asarray(r.normal(size=(b, t, h, d)), jnp.float32)
    k, v = (jnp.asarray(r.normal(size=(b, kv, o + t, d)), jnp.float32) for _ in range(2))
    shared = np.arange(o)[None, :] >= np.array([0, 7, 13])[:, None]  # left-padded prompts
    own = np.arange(t)[None, :] < np.array([t, 100, 64])[:, None]  # right-padded responses
    mask = jnp.asarray(np.concatenate([
        np.broadcast_to(shared[:, None, :], (b, t, o)),
        np.tril(np.ones((t, t), bool))[None] & own[:, None, :],
    ], axis=-1))
    weights = jnp.asarray(r.normal(size=(b, t, h, d)), jnp.float32)

    def plain(q, k, v):
        kh, vh = (jnp.repeat(x, h // kv, axis=1) for x in (k, v))
        scores = jnp.einsum("bthd,bhsd->bhts", q, kh) * d**-0.5
        probs = jax.nn.softmax(jnp.where(mask[:, None], scores, _MASK_VALUE), axis=-1)
        return jnp.einsum("bhts,bhsd->bthd", probs, vh)

    def loss(f):
        return lambda q, k, v: (f(q, k, v) * weights).sum()

    blocked = lambda q, k, v: attention(q, k, v, mask, causal=True)  # noqa: E731
    np.testing.assert_allclose(np.asarray(jax.jit(blocked)(q, k, v)), np.asarray(plain(q, k, v)), atol=1e-5)
    got = jax.jit(jax.grad(loss(blocked), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(plain), argnums=(0, 1, 2))(q, k, v)
    for a, w, what in zip(got, want, "qkv"):
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), atol=1e-4, rtol=1e-5, err_msg=f"d{what}")


@pytest.mark.parametrize("dtype,t,budget,softcap,sinks", [
    (jnp.float32, 6, None, None, False), (jnp.bfloat16, 6, None, None, False),
    (jnp.float32, 128, None, None, False), (jnp.float32, 6, 0, None, False), (jnp.float32, 6, 3000, None, False),
    (jnp.float32, 128, 0, None, False), (jnp.float32, 6, 3000, 0.7, False), (jnp.float32, 128, None, 0.7, False),
    (jnp.float32, 6, 3000, None, True), (jnp.float32, 128, None, 0.7, True),
])
def test_attention_and_its_vjp_match_a_plain_softmax(dtype, t, budget, softcap, sinks, monkeypatch):
    """The row-looped attention (and its flash-style VJP) against a plain einsum softmax, for
    grouped queries, right padding, a query row that sees no key, both key layouts and (t = 128)
    the causal query blocks that skip the keys above the diagonal; with all rows in one loop
    step (the default budget here), one row a step (budget 0) and two rows in each of 3 steps;
    with the scores soft-capped (Gemma 2's cap * tanh(score / cap), a cap below the scores); and
    with GPT-OSS's attention sinks, as transformers' eager attention has them (a logit per head
    concatenated to the scores, its probability dropped), their gradient included."""
    from tbajax.models import layers
    from tbajax.models.layers import _MASK_VALUE, attention, cached_attention, causal_blocks

    assert [causal_blocks(n) for n in (6, 40, 64, 96, 128, 256)] == [1, 1, 2, 2, 4, 4]
    r = np.random.default_rng(0)
    b, h, kv, d = 6, 4, 2, 8
    if budget is not None:
        monkeypatch.setattr(layers, "ROW_SCORES_BUDGET", budget)
    # a row's scores: kv x (g t) x t fp32 = 576 bytes at t = 6; 3000 bytes: 2 rows a step
    assert layers.rows_per_step(b, kv * (h // kv) * t * t * 4) == {None: b, 0: 1, 3000: 2}[budget]
    q, k, v = (jnp.asarray(r.normal(size=shape), dtype) for shape in ((b, t, h, d), (b, kv, t, d), (b, kv, t, d)))
    causal = np.tril(np.ones((t, t), bool))
    real = np.arange(t)[None, :] < np.array([t, t - 2, t, t - 1, t, t - 3])[:, None]
    mask = causal[None] & real[:, None, :]
    mask[2, 1] = False  # a query that attends to nothing: a uniform average, no gradient to q or k
    mask = jnp.asarray(mask)
    weights = jnp.asarray(r.normal(size=(b, t, h, d)), jnp.float32)
    sink = jnp.asarray(r.normal(size=h) + 1.0, jnp.float32) if sinks else None  # logits near the scores'

    def plain(q, k, v, sk=None):
        kh = jnp.repeat(k, h // kv, axis=1).astype(jnp.float32)  # [b, h, s, d]
        vh = jnp.repeat(v, h // kv, axis=1).astype(jnp.float32)
        scores = jnp.einsum("bthd,bhsd->bhts", q.astype(jnp.float32), kh) * d**-0.5
        if softcap is not None:
            scores = softcap * jnp.tanh(scores / softcap)
        scores = jnp.where(mask[:, None], scores, _MASK_VALUE)
        if sk is None:
            probs = jax.nn.softmax(scores, axis=-1)
        else:
            column = jnp.broadcast_to(sk[None, :, None, None], (*scores.shape[:-1], 1))
            probs = jax.nn.softmax(jnp.concatenate([scores, column], -1), axis=-1)[..., :-1]
        return jnp.einsum("bhts,bhsd->bthd", probs, vh)

    variants = {
        "heads-major keys": lambda q, k, v, sk=None: attention(q, k, v, mask, softcap=softcap, sinks=sk),
        "d-major keys": lambda q, k, v, sk=None: cached_attention(q, k.swapaxes(2, 3), v, mask, softcap, sk),
        "causal blocks": lambda q, k, v, sk=None: attention(q, k, v, mask, causal=True, softcap=softcap, sinks=sk),
    }
    args, argnums = ((q, k, v, sink), (0, 1, 2, 3)) if sinks else ((q, k, v), (0, 1, 2))
    # the causal blocks average a blind query's values over its own block's keys, not all keys
    # (padding output that no real position reads): compare the queries that see a key
    sees = np.asarray(mask).any(-1)[..., None, None]
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    for name, f in variants.items():
        w = weights * sees if name == "causal blocks" else weights
        loss = lambda f: lambda *a: (f(*a).astype(jnp.float32) * w).sum()  # noqa: E731
        out = jax.jit(f)(*args)
        assert out.dtype == dtype and out.shape == (b, t, h, d), name
        want_out = np.asarray(jax.jit(plain)(*args))
        np.testing.assert_allclose(np.where(sees, np.asarray(out, np.float32), 0), np.where(sees, want_out, 0),
                                   atol=tol * 3, err_msg=name)
        want = jax.jit(jax.grad(loss(plain), argnums=argnums))(*args)
        got = jax.jit(jax.grad(loss(f), argnums=argnums))(*args)
        for a, w_, what in zip(got, want, ["q", "k", "v", "sinks"]):
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(w_, np.float32), atol=tol * 10,
                                       rtol=tol, err_msg=f"{name}: d{what}")
        assert not np.asarray(got[0][2, 1]).any(), name  # the blind query gets no gradient


def test_attention_loops_over_rows_on_cpu_only(monkeypatch):
    """The attention loop takes a CPU's cache-sized steps on CPU and, where the budgets differ, the
    accelerator's larger steps elsewhere (`platform_dependent`, resolved while compiling). Here one
    row a step on CPU against all rows in one step: the CPU program keeps its loop, and the forward
    and VJP of the platform-dependent attention equal the one-step attention, run on CPU (the steps
    a GPU takes)."""
    from tbajax.models import layers
    from tbajax.models.layers import attention

    r = np.random.default_rng(4)
    b, h, kv, d, t = 4, 4, 2, 8, 64
    q = jnp.asarray(r.normal(size=(b, t, h, d)), jnp.float32)
    k, v = (jnp.asarray(r.normal(size=(b, kv, t, d)), jnp.float32) for _ in range(2))
    real = np.arange(t)[None, :] < np.array([t, 50, 33, 1])[:, None]
    mask = jnp.asarray(np.tril(np.ones((t, t), bool))[None] & real[:, None, :])
    weights = jnp.asarray(r.normal(size=(b, t, h, d)), jnp.float32) * real[:, :, None, None]

    def run(budget: int) -> tuple[Any, ...]:
        monkeypatch.setattr(layers, "ROW_SCORES_BUDGET", budget)
        f = lambda q, k, v: attention(q, k, v, mask, causal=True)  # noqa: E731
        grads = jax.jit(jax.grad(lambda q, k, v: (f(q, k, v) * weights).sum(), argnums=(0, 1, 2)))
        loops = grads.lower(q, k, v).compile().as_text().count(" while(")
        return jax.jit(f)(q, k, v), grads(q, k, v), loops

    row_bytes = kv * (h // kv) * t * t * 4
    assert layers.rows_per_step(b, row_bytes, 0) == 1
    assert layers.rows_per_step(b, row_bytes, layers.ACCELERATOR_ROW_SCORES_BUDGET) == b
    out_cpu, grads_cpu, loops_cpu = run(0)
    out_one, grads_one, loops_one = run(layers.ACCELERATOR_ROW_SCORES_BUDGET)
    assert loops_cpu == 2 and loops_one == 0, (loops_cpu, loops_one)  # forward and VJP loops; none
    np.testing.assert_allclose(np.asarray(out_cpu), np.asarray(out_one), atol=1e-5)
    for a, w, what in zip(grads_cpu, grads_one, "qkv"):
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), atol=1e-4, err_msg=f"d{what}")


def test_cudnn_attention_asks_for_a_gpu_and_bf16(tiny_checkpoint):
    """model.attention=cudnn: refused with fp32 compute (config time), and where cuDNN cannot run
    (this CPU) the forward fails while tracing with what to set instead. Its values against
    tbajax's own attention are checked on a GPU (`tests/test_gpu_attention.py`)."""
    from tbajax.models import load_model

    tiny_llama_dir = tiny_checkpoint("llama")
    with pytest.raises(ValueError, match="attention='cudnn' computes in bfloat16"):
        load_model(tiny_llama_dir, attention="cudnn")
    with pytest.raises(ValueError, match="choose one of"):
        load_model(tiny_llama_dir, attention="flash")
    model = load_model(tiny_llama_dir, dtype="bfloat16", attention="cudnn")
    tokens = jnp.ones((2, 8), jnp.int32)
    with pytest.raises(RuntimeError, match="model.attention=xla"):
        jax.jit(lambda t: model(t)[0])(tokens)
