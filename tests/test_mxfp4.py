"""MXFP4 dequantization must match transformers' GPT-OSS loader bit for bit."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from tbajax.models.mxfp4 import (
    QUANTIZED_SUFFIXES,
    DequantizingReader,
    MXFP4Error,
    dequantize,
    dequantize_transposed,
)
from tbajax.models.safetensors_io import CheckpointError, SafetensorsReader, write_safetensors


def _reference(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """transformers' dequantization (with its transpose(1, 2)) in float32."""
    torch = pytest.importorskip("torch")
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    out = mxfp4.convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                           dtype=torch.float32)
    return out.numpy()


def _random(shape: tuple[int, ...], low: int, high: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, shape, dtype=np.uint8)
    scales = rng.integers(low, high + 1, shape[:-1], dtype=np.uint8)
    return blocks, scales


def _assert_bitwise_equal(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    np.testing.assert_array_equal(actual.view(np.uint32), expected.view(np.uint32))  # also -0.0 vs +0.0


def test_matches_transformers_realistic_scales():
    blocks, scales = _random((3, 8, 2, 16), 110, 140)
    expected = _reference(blocks, scales)
    _assert_bitwise_equal(np.swapaxes(dequantize(blocks, scales), -1, -2), expected)
    _assert_bitwise_equal(dequantize_transposed(blocks, scales), expected)


@pytest.mark.parametrize("scale", [0, 1, 126, 127, 254])
def test_matches_transformers_extreme_exponents(scale: int):
    blocks = np.arange(256, dtype=np.uint8).reshape(1, 2, 8, 16)  # every byte once
    scales = np.full((1, 2, 8), scale, np.uint8)
    out = dequantize_transposed(blocks, scales)
    assert np.isfinite(out).all() == (scale < 254)  # 4.0 * 2**127 overflows float32, in torch too
    _assert_bitwise_equal(out, _reference(blocks, scales))


def test_all_exponents_including_overflow_match_torch_ldexp():
    """Every (byte, scale) pair, scale 255 included, where 1.0 * 2**128 overflows to inf as in torch."""
    blocks = np.tile(np.arange(256, dtype=np.uint8).reshape(16, 16), (256, 1)).reshape(1, 256, 16, 16)
    scales = np.repeat(np.arange(256, dtype=np.uint8), 16).reshape(1, 256, 16)
    _assert_bitwise_equal(dequantize_transposed(blocks, scales), _reference(blocks, scales))


def test_hand_computed_values():
    # low nibble 1 -> +0.5 (even element), high nibble 2 -> +1.0 (odd element); 2**(128 - 127) = 2
    out = dequantize(np.array([[0x21]], np.uint8), np.array([128], np.uint8))  # one group of one byte
    np.testing.assert_array_equal(out, np.array([1.0, 2.0], np.float32))
    # code 9 -> -0.5, code 0xF -> -6.0; 2**(127 - 127) = 1
    out = dequantize(np.array([[0xF9]], np.uint8), np.array([127], np.uint8))
    np.testing.assert_array_equal(out, np.array([-0.5, -6.0], np.float32))
    # code 8 is -0.0; 2**(125 - 127) = 0.25
    out = dequantize(np.array([[[0x78, 0x10]]], np.uint8), np.array([[125]], np.uint8))
    np.testing.assert_array_equal(out, np.array([[-0.0, 1.5, 0.0, 0.125]], np.float32))
    assert np.signbit(out[0, 0]) and not np.signbit(out[0, 2])


def test_output_shape_and_groups():
    blocks, scales = _random((2, 3, 4, 16), 120, 130)
    out = dequantize(blocks, scales)
    assert out.shape == (2, 3, 4 * 32) and out.dtype == np.float32
    # group g of row (e, r) holds values 32g..32g+31, all scaled by that group's exponent
    np.testing.assert_array_equal(out[1, 2, 64:96], dequantize(blocks[1, 2, 2:3], scales[1, 2, 2:3]))


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, "bfloat16", np.float16])
def test_low_precision_output_is_the_exact_cast(dtype):
    blocks, scales = _random((2, 4, 3, 16), 120, 134)
    out = dequantize(blocks, scales, dtype=dtype)
    full = dequantize(blocks, scales)
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(out.astype(np.float32), full)


def test_jax_bfloat16_dtype():
    jnp = pytest.importorskip("jax.numpy")
    blocks, scales = _random((1, 2, 1, 16), 110, 140)
    out = dequantize(blocks, scales, dtype=jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(out.astype(np.float32), dequantize(blocks, scales))


@pytest.mark.parametrize(
    "blocks, scales, match",
    [
        (np.zeros((2, 3, 16), np.uint8), np.zeros((2, 4), np.uint8), "need scales of shape"),
        (np.zeros((2, 3, 16), np.uint8), np.zeros((2, 3, 1), np.uint8), "need scales of shape"),
        (np.zeros((16,), np.uint8), np.zeros((), np.uint8), "need scales of shape"),
        (np.zeros((2, 3, 16), np.int32), np.zeros((2, 3), np.uint8), "must be uint8"),
        (np.zeros((2, 3, 16), np.uint8), np.zeros((2, 3), np.float32), "must be uint8"),
    ],
)
def test_invalid_inputs(blocks: np.ndarray, scales: np.ndarray, match: str):
    with pytest.raises(ValueError, match=match):
        dequantize(blocks, scales)


def test_transposed_needs_three_axes():
    with pytest.raises(ValueError, match="at least 3 axes"):
        dequantize_transposed(np.zeros((3, 16), np.uint8), np.zeros((3,), np.uint8))


# GPT-OSS-like toy sizes: E experts, H hidden, I intermediate
E, H, I = 2, 64, 32


def _gpt_oss_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    gate_up_blocks, gate_up_scales = _random((E, 2 * I, H // 32, 16), 115, 135, seed)
    down_blocks, down_scales = _random((E, H, I // 32, 16), 115, 135, seed + 1)
    prefix = "model.layers.0.mlp.experts."
    return {
        prefix + "gate_up_proj_blocks": gate_up_blocks,
        prefix + "gate_up_proj_scales": gate_up_scales,
        prefix + "gate_up_proj_bias": np.arange(E * 2 * I, dtype=np.float32).reshape(E, 2 * I),
        prefix + "down_proj_blocks": down_blocks,
        prefix + "down_proj_scales": down_scales,
        "model.embed_tokens.weight": np.ones((8, H), ml_dtypes.bfloat16),
    }


def _reader(path: Path, tensors: dict[str, np.ndarray]) -> DequantizingReader:
    write_safetensors(path / "model.safetensors", tensors)
    return DequantizingReader(SafetensorsReader(path))


def test_reader_presents_dequantized_tensors(tmp_path: Path):
    tensors = _gpt_oss_tensors()
    reader = _reader(tmp_path, tensors)
    prefix = "model.layers.0.mlp.experts."
    assert reader.directory == tmp_path
    assert reader.keys() == sorted([prefix + "down_proj", prefix + "gate_up_proj",
                                    prefix + "gate_up_proj_bias", "model.embed_tokens.weight"])
    assert prefix + "gate_up_proj" in reader and prefix + "down_proj" in reader
    for name in tensors:
        if name.endswith(QUANTIZED_SUFFIXES):
            assert name not in reader
    assert "missing" not in reader
    assert reader.shape(prefix + "gate_up_proj") == (E, H, 2 * I)
    assert reader.shape(prefix + "down_proj") == (E, I, H)
    for name in ("gate_up_proj", "down_proj"):
        out = reader.get(prefix + name)
        expected = _reference(tensors[prefix + name + "_blocks"], tensors[prefix + name + "_scales"])
        _assert_bitwise_equal(out, expected)
        assert out.shape == reader.shape(prefix + name)
        assert out.flags.c_contiguous and out.flags.writeable and out.flags.owndata


def test_reader_passes_other_tensors_through(tmp_path: Path):
    tensors = _gpt_oss_tensors()
    reader = _reader(tmp_path, tensors)
    for name in ("model.layers.0.mlp.experts.gate_up_proj_bias", "model.embed_tokens.weight"):
        assert name in reader
        assert reader.shape(name) == tensors[name].shape
        out = reader.get(name)
        assert out.dtype == tensors[name].dtype
        np.testing.assert_array_equal(out, tensors[name])
    with pytest.raises(CheckpointError, match="not in the checkpoint"):
        reader.get("missing")


def test_reader_without_quantized_tensors_is_transparent(tmp_path: Path):
    tensors = {"a": np.ones((2, 3), np.float32), "b_bias": np.zeros(4, np.float32)}
    reader = _reader(tmp_path, tensors)
    assert reader.keys() == ["a", "b_bias"]
    np.testing.assert_array_equal(reader.get("a"), tensors["a"])


@pytest.mark.parametrize("drop", QUANTIZED_SUFFIXES)
def test_reader_rejects_unpaired_tensor(tmp_path: Path, drop: str):
    tensors = _gpt_oss_tensors()
    del tensors["model.layers.0.mlp.experts.down_proj" + drop]
    kept = "model.layers.0.mlp.experts.down_proj" + ({*QUANTIZED_SUFFIXES} - {drop}).pop()
    write_safetensors(tmp_path / "model.safetensors", tensors)
    with pytest.raises(MXFP4Error, match=f"'{kept}' has no matching") as info:
        DequantizingReader(SafetensorsReader(tmp_path))
    assert isinstance(info.value, CheckpointError)


def test_reader_rejects_mismatched_shapes(tmp_path: Path):
    tensors = _gpt_oss_tensors()
    tensors["model.layers.0.mlp.experts.down_proj_scales"] = np.zeros((E, H, 3), np.uint8)
    write_safetensors(tmp_path / "model.safetensors", tensors)
    with pytest.raises(MXFP4Error, match="down_proj_blocks.*does not match"):
        DequantizingReader(SafetensorsReader(tmp_path))


def test_reader_rejects_both_forms(tmp_path: Path):
    tensors = _gpt_oss_tensors()
    tensors["model.layers.0.mlp.experts.down_proj"] = np.zeros((E, I, H), np.float32)
    write_safetensors(tmp_path / "model.safetensors", tensors)
    with pytest.raises(MXFP4Error, match="holds both"):
        DequantizingReader(SafetensorsReader(tmp_path))


def test_a_gpt_oss_checkpoint_with_mxfp4_experts_loads_dequantized(tmp_path: Path):
    """A GPT-OSS checkpoint as OpenAI released theirs (experts as MXFP4 blocks and scales, a
    quantization_config) loads with its experts dequantized: the same params as the unquantized
    checkpoint that transformers' dequantization gives, and the same logits as transformers
    running that one. Another quantization method is refused, naming what to do."""
    import json

    import jax
    import jax.numpy as jnp
    import torch
    from transformers import AutoModelForCausalLM

    from tbajax.models import ModelConfig, UnsupportedModelError, load_model
    from tbajax.sharding import MeshConfig, make_mesh
    from tests.conftest import build_tiny_hf_checkpoint, logits_of

    # MXFP4 packs groups of 32 along each projection's input: widths of 64 and 32
    base = build_tiny_hf_checkpoint(tmp_path / "base", "gpt_oss", hidden_size=64, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, intermediate_size=32, num_local_experts=4,
                                    num_experts_per_tok=2, sliding_window=4, swiglu_limit=0.3,
                                    layer_types=["sliding_attention", "full_attention"])
    reader = SafetensorsReader(base)
    config = json.loads((base / "config.json").read_text())
    quantized, plain = {}, {}
    rng = np.random.default_rng(5)
    for name in reader.keys():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            quantized[name] = plain[name] = np.asarray(reader.get(name))
            continue
        experts, inputs, outputs = reader.shape(name)
        blocks = rng.integers(0, 256, (experts, outputs, inputs // 32, 16), dtype=np.uint8)
        scales = rng.integers(121, 125, (experts, outputs, inputs // 32), dtype=np.uint8)  # values up to ~0.2
        quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
        plain[name] = _reference(blocks, scales)
    for directory, tensors, extra in ((tmp_path / "mxfp4", quantized, {"quantization_config": {
            "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}}),
                                      (tmp_path / "plain", plain, {})):
        directory.mkdir()
        write_safetensors(directory / "model.safetensors", tensors)
        (directory / "config.json").write_text(json.dumps({**config, **extra}))

    ours, unquantized = load_model(tmp_path / "mxfp4"), load_model(tmp_path / "plain")
    # on a mesh every device dequantizes its own shard alone: inputs split in 16s (half an MXFP4
    # group), outputs in halves
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2), devices=jax.devices()[:8])
    sharded = load_model(tmp_path / "mxfp4", mesh=mesh)
    for name in ("expert_gate_up", "expert_down"):
        want = np.asarray(getattr(unquantized.layers, name)[...])
        np.testing.assert_array_equal(np.asarray(getattr(ours.layers, name)[...]), want)
        on_mesh = getattr(sharded.layers, name)[...]
        assert len(on_mesh.sharding.device_set) == 8 and not on_mesh.sharding.is_fully_replicated
        np.testing.assert_array_equal(np.asarray(on_mesh), want)
    ids = rng.integers(3, config["vocab_size"], (2, 9))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "plain", dtype=torch.float32).eval()
    with torch.no_grad():
        want = theirs(input_ids=torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(logits_of(ours, jnp.asarray(ids)), want, atol=1e-4)

    with pytest.raises(UnsupportedModelError, match="quant_method='gptq'.*dequantize it first"):
        ModelConfig.from_hf({**config, "quantization_config": {"quant_method": "gptq", "bits": 4}})


@pytest.mark.parametrize("index", [
    (slice(None), slice(None), slice(None)),
    (slice(1, 3), slice(5, 40), slice(3, 9)),  # inputs from inside one group to inside another
    (slice(2, 3), slice(32, 64), slice(None)),  # whole groups
    (slice(0, 1), slice(63, 64)),  # the last input, every output
])
def test_reader_dequantizes_only_the_part_asked_for(tmp_path: Path, index):
    """A part of an MXFP4 tensor (what one device holds of it) equals that part of the whole."""
    blocks, scales = _random((3, 10, 2, 16), 120, 130, seed=4)  # 3 experts, 10 outputs, 64 inputs
    write_safetensors(tmp_path / "model.safetensors", {"w_blocks": blocks, "w_scales": scales,
                                                      "plain": np.arange(12, dtype=np.float32).reshape(3, 4)})
    reader = DequantizingReader(SafetensorsReader(tmp_path))
    whole = reader.get("w")
    _assert_bitwise_equal(reader.get("w", index), np.ascontiguousarray(whole[index]))
    np.testing.assert_array_equal(reader.get("plain", (slice(1, 2),)), reader.get("plain")[1:2])
