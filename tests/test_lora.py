"""LoRA: exact identity at init, gradients reach adapters only, merged export and PEFT adapters
match torch (transformers + peft) logits, adapter size for r = 8 on a 50M Llama, clear errors."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from tbajax.models import CausalLM, ModelConfig, load_model, save_model
from tbajax.models.encoders import load_encoder, save_encoder
from tbajax.models.lora import (
    LoraConfig,
    adapter_arrays,
    adapter_nbytes,
    apply_lora,
    init_lora,
    load_peft_adapter,
    lora_specs,
    merge_lora,
    save_peft_adapter,
    split_axes,
)
from tbajax.models.safetensors_io import SafetensorsReader
from tbajax.sharding import MeshConfig, logical_to_spec, make_mesh, param_shardings

ALL_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOKENS = np.array([[5, 6, 7, 8, 9, 10, 11], [0, 0, 12, 13, 14, 15, 16], [17, 18, 19, 20, 0, 0, 0]])
MASK = (TOKENS != 0).astype(np.int32)


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state):
    return nnx.merge(graphdef, state)(jnp.asarray(TOKENS), attention_mask=jnp.asarray(MASK))[0]


def _logits(model: CausalLM) -> np.ndarray:
    return np.asarray(_forward(*nnx.split(model)))


def _randomise_b(adapters, seed: int = 1, std: float = 0.1):
    """Non-zero B so exported deltas are visible (init has B = 0)."""
    out = {}
    for i, (name, pair) in enumerate(sorted(adapters.items())):
        b = pair["b"]
        noise = jax.random.normal(jax.random.fold_in(jax.random.key(seed), i), b.shape, b.dtype) * std
        out[name] = {"a": pair["a"], "b": nnx.Param(noise, **b.get_metadata())}
    return out


def test_split_axes_reads_input_and_output_from_logical_axes():
    heads = ("q_heads", "head_dim")
    assert split_axes("q", ("layers", "embed", *heads)) == (("layers",), ("embed",), heads)
    assert split_axes("o", ("layers", *heads, "embed")) == (("layers",), heads, ("embed",))
    assert split_axes("down", ("layers", "mlp", "embed")) == (("layers",), ("mlp",), ("embed",))
    assert split_axes("lm_head", ("embed", "vocab")) == ((), ("embed",), ("vocab",))
    with pytest.raises(ValueError, match="embedding table"):
        split_axes("embed_tokens", ("vocab", "embed"))
    with pytest.raises(ValueError, match="only matrices"):
        split_axes("input_norm", ("layers", "norm"))


def test_init_equals_base_exactly_and_gradients_change_only_adapters(tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama"))
    cfg = LoraConfig(rank=4, alpha=8.0, targets=ALL_PROJ)
    graphdef, base = nnx.split(model, nnx.Param)
    adapters = init_lora(base, cfg, jax.random.key(0))
    assert sorted(adapters) == sorted(f"layers.{n}" for n in ALL_PROJ)
    assert adapters["layers.o_proj"]["a"].shape == (2, 6, 12, 4)  # [layers, heads, head_dim, r]
    assert adapters["layers.q_proj"]["b"].shape == (2, 4, 6, 12)  # [layers, r, heads, head_dim]
    assert adapters["layers.q_proj"]["a"].get_metadata()["logical_axes"] == ("layers", "embed", None)
    tokens, mask = jnp.asarray(TOKENS), jnp.asarray(MASK)

    def logits(params):
        return nnx.merge(graphdef, params)(tokens, attention_mask=mask)[0]

    def loss(ad):  # next-token NLL; the base params are closed over, never differentiated
        logp = jax.nn.log_softmax(logits(apply_lora(base, ad, cfg))[:, :-1])
        nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
        return jnp.sum(nll * mask[:, 1:]) / jnp.sum(mask[:, 1:])

    base_fwd = jax.jit(logits)
    lora_fwd = jax.jit(lambda ad: logits(apply_lora(base, ad, cfg)))
    grad_fn = jax.jit(jax.value_and_grad(loss))

    # at init (B = 0) every weight, hence every logit, is bit-identical to the base
    merged = jax.jit(lambda ad: apply_lora(base, ad, cfg))(adapters)
    for x, y in zip(jax.tree.leaves(merged), jax.tree.leaves(base)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    base_logits = np.asarray(base_fwd(base))
    np.testing.assert_array_equal(np.asarray(lora_fwd(adapters)), base_logits)

    before = [np.asarray(x) for x in jax.tree.leaves(base)]
    l0, g = grad_fn(adapters)
    assert jax.tree.structure(g) == jax.tree.structure(adapters)  # gradients exist for adapters only
    for name, pair in g.items():
        assert not np.any(np.asarray(pair["a"][...])), name  # dL/dA = 0 while B = 0
        assert np.abs(np.asarray(pair["b"][...])).max() > 0, name

    def sgd(ad, grads, lr=0.5):
        return jax.tree.map(lambda p, d: p - lr * d, ad, grads)

    step1 = sgd(adapters, g)
    l1, g1 = grad_fn(step1)
    step2 = sgd(step1, g1)
    assert float(l1) < float(l0)
    for name in adapters:
        np.testing.assert_array_equal(np.asarray(step1[name]["a"][...]), np.asarray(adapters[name]["a"][...]))
        assert not np.array_equal(np.asarray(step2[name]["a"][...]), np.asarray(step1[name]["a"][...]))
    for x, y in zip(jax.tree.leaves(base), before):  # the base never moved
        np.testing.assert_array_equal(np.asarray(x), y)
    np.testing.assert_array_equal(np.asarray(base_fwd(base)), base_logits)  # reference = base, adapters off
    assert not np.allclose(np.asarray(lora_fwd(step2)), base_logits)
    pure = jax.tree.structure({n: {"a": 0, "b": 0} for n in adapters})
    assert jax.tree.structure(adapter_arrays(step2)) == pure  # publishable as plain arrays


def test_merged_export_and_peft_adapter_match_torch(tiny_checkpoint, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    directory = tiny_checkpoint("llama")
    model = load_model(directory)
    cfg = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "o_proj", "down_proj", "up_proj"))
    adapters = _randomise_b(init_lora(nnx.state(model, nnx.Param), cfg, jax.random.key(0)))
    merged = merge_lora(model, adapters, cfg)
    ours = _logits(merged)
    assert np.abs(ours - _logits(model)).max() > 0.1  # the adapters really change the model
    real = MASK.astype(bool)

    out = save_model(merged, tmp_path / "merged")
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(out).eval()(
            input_ids=torch.tensor(TOKENS), attention_mask=torch.tensor(MASK)
        ).logits.numpy()
    np.testing.assert_allclose(ref[real], ours[real], atol=1e-4)

    peft_dir = save_peft_adapter(
        tmp_path / "adapter", model, adapters, cfg, base_model_name_or_path=str(directory)
    )
    meta = json.loads((peft_dir / "adapter_config.json").read_text())
    assert meta["r"] == 4 and meta["lora_alpha"] == 8.0 and meta["task_type"] == "CAUSAL_LM"
    assert meta["target_modules"] == [
        "mlp.down_proj", "mlp.up_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj"
    ]
    reader = SafetensorsReader(peft_dir)
    pre = "base_model.model.model.layers."
    assert reader.shape(pre + "1.self_attn.o_proj.lora_A.weight") == (4, 72)  # [r, in]
    assert reader.shape(pre + "1.self_attn.v_proj.lora_B.weight") == (24, 4)  # [out, r]
    assert reader.shape(pre + "0.mlp.down_proj.lora_A.weight") == (4, 96)
    assert len(reader.keys()) == 2 * 2 * 5
    base = AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(base, peft_dir).eval()(
            input_ids=torch.tensor(TOKENS), attention_mask=torch.tensor(MASK)
        ).logits.numpy()
    np.testing.assert_allclose(peft_logits[real], ours[real], atol=1e-4)


def test_gemma3_adapters_merge_and_export_as_transformers_and_peft_apply_them(tiny_checkpoint, tmp_path):
    """Gemma 3 (a windowed and a full layer, norms as offsets from one): the merged export and the
    PEFT adapters give transformers our adapted logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    directory = tiny_checkpoint("gemma3")
    model = load_model(directory)
    cfg = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "k_proj", "gate_proj", "down_proj"))
    adapters = _randomise_b(init_lora(nnx.state(model, nnx.Param), cfg, jax.random.key(0)))
    ours = _logits(merge_lora(model, adapters, cfg))
    assert np.abs(ours - _logits(model)).max() > 0.1
    real = MASK.astype(bool)
    merged = save_model(merge_lora(model, adapters, cfg), tmp_path / "merged")
    peft_dir = save_peft_adapter(tmp_path / "adapter", model, adapters, cfg, base_model_name_or_path=str(directory))
    with torch.no_grad():
        inputs = dict(input_ids=torch.tensor(TOKENS), attention_mask=torch.tensor(MASK))
        ref = AutoModelForCausalLM.from_pretrained(merged).eval()(**inputs).logits.numpy()
        base = AutoModelForCausalLM.from_pretrained(directory).eval()
        peft_logits = PeftModel.from_pretrained(base, peft_dir).eval()(**inputs).logits.numpy()
    np.testing.assert_allclose(ref[real], ours[real], atol=1e-4)
    np.testing.assert_allclose(peft_logits[real], ours[real], atol=1e-4)


def _peft_applies_our_adapters(directory, targets: tuple[str, ...], tmp_path):
    """(model, adapters, PEFT adapter dir): random adapters on `targets` of the checkpoint's model,
    exported as a PEFT adapter that transformers + PEFT apply to the logits we compute merged."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = load_model(directory)
    cfg = LoraConfig(rank=4, alpha=8.0, targets=targets)
    adapters = _randomise_b(init_lora(nnx.state(model, nnx.Param), cfg, jax.random.key(0)))
    ours = _logits(merge_lora(model, adapters, cfg))
    assert np.abs(ours - _logits(model)).max() > 0.1  # the adapters really change the model
    peft_dir = save_peft_adapter(tmp_path / "adapter", model, adapters, cfg,
                                 base_model_name_or_path=str(directory))
    base = AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        theirs = PeftModel.from_pretrained(base, peft_dir).eval()(
            input_ids=torch.tensor(TOKENS), attention_mask=torch.tensor(MASK)
        ).logits.numpy()
    real = MASK.astype(bool)
    np.testing.assert_allclose(theirs[real], ours[real], atol=1e-4)
    return model, adapters, peft_dir


def test_adapters_on_fused_projections_export_as_peft_adapters_of_fused_modules(tiny_checkpoint, tmp_path):
    """Phi-3's q/k/v and gate/up weights are fused in the checkpoint and here: one adapter per fused
    weight, which PEFT applies to the same fused module (its target names qkv_proj, gate_up_proj)."""
    directory = tiny_checkpoint("phi3")
    model, adapters, peft_dir = _peft_applies_our_adapters(directory, ("qkv_proj", "gate_up_proj"), tmp_path)
    assert json.loads((peft_dir / "adapter_config.json").read_text())["target_modules"] == [
        "mlp.gate_up_proj", "self_attn.qkv_proj"]
    # qkv_proj is held per KV head here: its adapter's rows go out in HF's order and come back
    again_cfg, again = load_peft_adapter(peft_dir, model)
    assert (again_cfg.rank, sorted(again_cfg.targets)) == (4, ["layers.gate_up_proj", "layers.qkv_proj"])
    for name, pair in adapters.items():
        for k in ("a", "b"):
            np.testing.assert_array_equal(np.asarray(again[name][k][...]), np.asarray(pair[k][...]))


def test_peft_trained_adapter_loads_into_our_model(tiny_checkpoint, tmp_path):
    import peft
    from transformers import AutoModelForCausalLM

    directory = tiny_checkpoint("llama")
    torch.manual_seed(0)
    pcfg = peft.LoraConfig(r=3, lora_alpha=5, target_modules=["q_proj", "v_proj", "down_proj"])
    torch_model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(directory).eval(), pcfg).eval()
    with torch.no_grad():
        for name, p in torch_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
        ref = torch_model(input_ids=torch.tensor(TOKENS), attention_mask=torch.tensor(MASK)).logits.numpy()
    torch_model.save_pretrained(tmp_path / "peft")
    model = load_model(directory)
    cfg, adapters = load_peft_adapter(tmp_path / "peft", model)
    assert cfg.rank == 3 and cfg.alpha == 5.0
    assert sorted(cfg.targets) == ["layers.down_proj", "layers.q_proj", "layers.v_proj"]
    real = MASK.astype(bool)
    np.testing.assert_allclose(_logits(merge_lora(model, adapters, cfg))[real], ref[real], atol=1e-4)
    # and our own export reads back bit for bit
    again_cfg, again = load_peft_adapter(save_peft_adapter(tmp_path / "ours", model, adapters, cfg), model)
    assert again_cfg == cfg
    for name in adapters:
        for k in ("a", "b"):
            np.testing.assert_array_equal(np.asarray(again[name][k][...]), np.asarray(adapters[name][k][...]))
    meta = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    (tmp_path / "peft" / "adapter_config.json").write_text(json.dumps({**meta, "use_rslora": True}))
    with pytest.raises(NotImplementedError, match="use_rslora=True"):
        load_peft_adapter(tmp_path / "peft", model)


def test_adapter_bytes_for_rank_8_on_a_50m_llama_are_under_2_percent():
    cfg = ModelConfig(
        model_type="llama", vocab_size=32000, hidden_size=512, intermediate_size=1376,
        num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64, tie_word_embeddings=False,
    )
    abstract = nnx.state(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    full = adapter_nbytes(abstract)
    assert full == cfg.num_params() * 4 and 45e6 < cfg.num_params() < 60e6
    lora = LoraConfig(rank=8, alpha=16.0, targets=ALL_PROJ)
    adapters = jax.eval_shape(lambda: init_lora(abstract, lora, jax.random.key(0)))
    d, f, q, kv = 512, 1376, 512, 256
    per_layer = 8 * ((d + q) + 2 * (d + kv) + (q + d) + 2 * (d + f) + (f + d))
    assert adapter_nbytes(adapters) == 8 * per_layer * 4  # hand count: r·(in + out) per projection
    assert adapter_nbytes(adapters) / full <= 0.02
    small = adapter_nbytes(adapters)
    print(f"r=8 adapters: {small / 2**20:.2f} MiB = {small / full:.2%} of {full / 2**20:.0f} MiB")


def test_lora_on_an_encoder_is_the_same_transform(tmp_path):
    """BERT: merged export and PEFT adapter (feature extraction) equal our merged encoder."""
    from peft import PeftModel
    from transformers import AutoModel, BertConfig

    torch.manual_seed(0)
    hf_cfg = BertConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                        vocab_size=53, max_position_embeddings=16)
    src = tmp_path / "bert"
    AutoModel.from_config(hf_cfg).float().eval().save_pretrained(src)
    enc = load_encoder(src)
    cfg = LoraConfig(rank=2, alpha=6.0, targets=("q_proj", "v_proj", "o_proj", "up_proj"))
    adapters = _randomise_b(init_lora(nnx.state(enc, nnx.Param), cfg, jax.random.key(0)), std=0.3)
    merged = merge_lora(enc, adapters, cfg)
    tokens, mask = TOKENS % 53, MASK
    ours = np.asarray(merged.hidden_states(jnp.asarray(tokens), jnp.asarray(mask)))
    assert np.abs(ours - np.asarray(enc.hidden_states(jnp.asarray(tokens), jnp.asarray(mask)))).max() > 0.05
    batch = dict(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask))
    with torch.no_grad():
        exported = save_encoder(merged, tmp_path / "merged")
        ref = AutoModel.from_pretrained(exported).eval()(**batch).last_hidden_state
        peft_dir = save_peft_adapter(tmp_path / "adapter", enc, adapters, cfg)
        via_peft = PeftModel.from_pretrained(AutoModel.from_pretrained(src).eval(), peft_dir).eval()(**batch)
    np.testing.assert_allclose(ref.numpy(), ours, atol=1e-5)
    np.testing.assert_allclose(via_peft.last_hidden_state.numpy(), ours, atol=1e-5)
    assert json.loads((peft_dir / "adapter_config.json").read_text())["target_modules"] == [
        "attention.output.dense", "attention.self.query", "attention.self.value", "intermediate.dense"
    ]


def test_adapters_shard_like_their_weights(tiny_checkpoint):
    directory = tiny_checkpoint("llama")
    cfg = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "o_proj", "down_proj"))
    model = load_model(directory)
    adapters = _randomise_b(init_lora(nnx.state(model, nnx.Param), cfg, jax.random.key(0)))
    ref = _logits(merge_lora(model, adapters, cfg))
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    graphdef, base = nnx.split(load_model(directory, mesh=mesh), nnx.Param)
    sharded = init_lora(base, cfg, jax.random.key(0), mesh=mesh)
    a = sharded["layers.q_proj"]["a"][...]  # [layers, embed, r]: embed split over fsdp like q_proj's
    assert a.sharding.spec == logical_to_spec(("layers", "embed", None), a.shape, mesh)
    assert a.addressable_shards[0].data.shape == (2, 36, 4)
    b = sharded["layers.o_proj"]["b"][...]  # [layers, r, embed]
    assert b.sharding.spec == logical_to_spec(("layers", None, "embed"), b.shape, mesh)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(adapters["layers.q_proj"]["a"][...]))
    placed = jax.device_put(adapters, param_shardings(sharded, mesh))  # e.g. adapters received
    with jax.set_mesh(mesh):
        out = jax.jit(lambda ad: _forward(graphdef, apply_lora(base, ad, cfg)))(placed)
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5)


def test_bad_targets_and_mismatched_adapters_are_clear_errors(tiny_checkpoint):
    params = nnx.state(load_model(tiny_checkpoint("llama")), nnx.Param)
    with pytest.raises(ValueError, match="'wq' matches no weight.*layers.q_proj"):
        lora_specs(params, LoraConfig(targets=("wq",)))
    with pytest.raises(ValueError, match="only matrices"):
        lora_specs(params, LoraConfig(targets=("input_norm",)))
    with pytest.raises(ValueError, match="embedding table"):
        lora_specs(params, LoraConfig(targets=("embed_tokens",)))
    every = lora_specs(params, LoraConfig(targets=("layers.*_proj",)))
    assert sorted(every) == sorted(f"layers.{n}" for n in ALL_PROJ)
    adapters = init_lora(params, LoraConfig(targets=("q_proj",)), jax.random.key(0))
    with pytest.raises(ValueError, match="adapters cover"):
        apply_lora(params, adapters, LoraConfig(targets=("q_proj", "v_proj")))
    with pytest.raises(NotImplementedError, match="dropout"):
        LoraConfig(dropout=0.1)
    with pytest.raises(ValueError, match="rank"):
        LoraConfig(rank=0)


# ----------------------------------------------------------------------------- training with LoRA

from tests.test_training import MODEL, fresh_model, make_batch, vargrad_tb  # noqa: E402
from tbajax.training import (  # noqa: E402
    Checkpointer,
    LRSchedule,
    OptimizerConfig,
    PolicyUpdater,
    TrainerConfig,
    init_train_state,
)
from tbajax.training.state import init_lora_train_state  # noqa: E402
from tbajax.training.loss import sequence_logprobs as _sequence_logprobs  # noqa: E402

# jitted (graphdef and temperature static): eager dispatch compiles every primitive on its own
sequence_logprobs = jax.jit(_sequence_logprobs, static_argnums=(0, 3))

TRAIN_LORA = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"))
TRAIN_CONFIG = TrainerConfig(
    optimizer=OptimizerConfig(lr=LRSchedule(peak=1e-2), max_grad_norm=1.0, weight_decay=0.01),
    compute_dtype="float32",
)
_FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@functools.lru_cache(maxsize=None)
def _lora_updater_and_steps():
    """A LoRA updater after two updates, with the base and the state before them (built once)."""
    updater = PolicyUpdater(fresh_model(), TRAIN_CONFIG, vargrad_tb, lora=TRAIN_LORA, compiler_options=_FAST)
    base_before = jax.tree.map(np.array, updater.lora.params)
    before = jax.tree.map(np.array, updater.state)
    metrics = [updater.step(make_batch(seed)) for seed in (0, 1)]
    after = jax.tree.map(np.array, updater.state)
    _AFTER_TWO_STEPS.update(state=after, metrics=metrics)
    return updater, base_before, before, metrics


_AFTER_TWO_STEPS: dict = {}  # the single-device run's state and metrics after its two updates


def _leaves_by_path(tree):
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p).removesuffix(".value"): np.asarray(x) for p, x in flat}


def test_lora_step_trains_only_the_adapters_and_the_base_stays_bit_identical():
    updater, base_before, before, metrics = _lora_updater_and_steps()
    assert int(updater.state.step) == 2 and all(m["grad_norm"] > 0 for m in metrics)
    # the base: bit-identical after two updates (never donated, never optimised)
    for path, x in _leaves_by_path(updater.lora.params).items():
        assert np.array_equal(x, _leaves_by_path(base_before)[path]), path
    # the trainable params ARE the adapters: every B moved away from 0 (A too)
    assert set(updater.state.params) == {"layers.q_proj", "layers.v_proj", "layers.down_proj"}
    for name, pair in updater.state.params.items():
        assert np.abs(np.asarray(pair["b"][...])).max() > 0, name
        assert not np.array_equal(np.asarray(pair["a"][...]), np.asarray(before.params[name]["a"][...])), name
    # the merged policy differs from the base only in the adapted weights
    merged = _leaves_by_path(nnx.state(updater.policy(), nnx.Param))
    base = _leaves_by_path(base_before)
    changed = sorted(p for p in base if not np.array_equal(merged[p], base[p]))
    assert changed == ["['layers']['down_proj']", "['layers']['q_proj']", "['layers']['v_proj']"]


def test_lora_optimizer_state_covers_only_the_adapters():
    updater, base_before, _, _ = _lora_updater_and_steps()
    adapter_bytes = adapter_nbytes(updater.state.params)
    base_bytes = adapter_nbytes(base_before)
    float_leaves = [x for x in jax.tree.leaves(updater.state.opt_state) if jnp.issubdtype(x.dtype, jnp.floating)]
    # Adam's mu and nu: two leaves per adapter leaf, of the adapters' bytes each
    assert len(float_leaves) == 2 * len(jax.tree.leaves(updater.state.params))
    assert sum(x.nbytes for x in float_leaves) == 2 * adapter_bytes
    assert adapter_bytes < 0.2 * base_bytes
    assert updater.state.ref_params is None  # the reference is the base: no copy of anything
    # the full fine-tuning state of the same model, for scale: moments over every weight
    _, full = init_train_state(fresh_model(), TRAIN_CONFIG)
    full_float = [x for x in jax.tree.leaves(full.opt_state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert sum(x.nbytes for x in full_float) == 2 * base_bytes


def test_lora_reference_forward_is_the_base_model_with_adapters_disabled():
    updater, _, _, _ = _lora_updater_and_steps()
    batch = make_batch(3)
    frozen = updater.lora  # what the loss scores the reference with
    ref = sequence_logprobs(updater.graphdef, frozen.reference(), batch, 1.0)
    base_model = fresh_model()
    want = sequence_logprobs(*nnx.split(base_model, nnx.Param), batch, 1.0)
    assert np.array_equal(np.asarray(ref), np.asarray(want))
    # ... while the trained policy moved away from it
    pol = sequence_logprobs(updater.graphdef, nnx.state(updater.policy(), nnx.Param), batch, 1.0)
    assert np.abs(np.asarray(pol) - np.asarray(want)).max() > 1e-4


def test_lora_reference_resets_copy_the_adapters_not_the_base():
    """TBA′ resets the reference to the current policy: under LoRA that is base + a copy of the
    adapters (the base is never copied); before the first reset the reference is the base."""
    config = dataclasses.replace(TRAIN_CONFIG, reference_reset_every=2, reset_optimizer_on_reference_reset=True)
    updater = PolicyUpdater(fresh_model(), config, vargrad_tb, lora=TRAIN_LORA, compiler_options=_FAST)
    init_b = np.asarray(updater.state.ref_params["layers.q_proj"]["b"][...])
    assert not init_b.any()  # B = 0: this reference is exactly the base
    updater.step(make_batch(0))
    assert not np.asarray(updater.state.ref_params["layers.q_proj"]["b"][...]).any()  # no reset yet
    updater.step(make_batch(1))  # update 2: reset
    for name, pair in updater.state.params.items():
        for k in ("a", "b"):
            assert np.array_equal(np.asarray(updater.state.ref_params[name][k][...]), np.asarray(pair[k][...]))
    assert int(updater.state.adam_state.count) == 0  # moments reset with it
    frozen = dataclasses.replace(updater.lora, ref_adapters=updater.state.ref_params)
    batch = make_batch(2)
    np.testing.assert_array_equal(
        np.asarray(sequence_logprobs(updater.graphdef, frozen.reference(), batch, 1.0)),
        np.asarray(sequence_logprobs(updater.graphdef, nnx.state(updater.policy(), nnx.Param), batch, 1.0)),
    )


def test_sharded_lora_step_matches_single_device():
    """On a 2x2x2 mesh the adapters shard like their weights, the base stays where it was put,
    and two updates equal the single-device ones."""
    _lora_updater_and_steps()
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    updater = PolicyUpdater(fresh_model(), TRAIN_CONFIG, vargrad_tb, lora=TRAIN_LORA, mesh=mesh,
                            compiler_options=_FAST)
    metrics = [updater.step(make_batch(seed)) for seed in (0, 1)]
    for got, want in zip(metrics, _AFTER_TWO_STEPS["metrics"]):
        # fp32 sums over a tensor-sharded forward reduce in another order: delta_max differed by
        # 1.6e-5 relative on an AMD CPU, and by 1.2e-6 absolute (0 against 1.2e-6) on another, where
        # the adapters start at zero and delta_max is rounding alone (`test_training.assert_metrics_close`)
        assert got == pytest.approx(want, rel=3e-5, abs=1e-5)
    assert tuple(updater.state.params["layers.q_proj"]["a"][...].sharding.spec) == (None, "fsdp", None)
    assert tuple(updater.lora.params["layers"]["q_proj"][...].sharding.spec) == (None, "fsdp", "tensor", None)
    for got, want in zip(jax.tree.leaves(updater.state.params), jax.tree.leaves(_AFTER_TWO_STEPS["state"].params)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_lora_checkpoint_round_trip_restores_adapters_and_optimizer(tmp_path):
    updater, _, _, _ = _lora_updater_and_steps()
    with Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
        ckpt.save(updater.state, {"note": 1})
    saved = jax.tree.map(np.array, updater.state)
    want = updater.step(make_batch(4))
    # a restarted trainer: the base from model.checkpoint (here the same fresh model), fresh adapters
    _, _, fresh = init_lora_train_state(fresh_model(), TRAIN_CONFIG, TRAIN_LORA)
    assert np.abs(np.asarray(fresh.params["layers.q_proj"]["b"][...])).max() == 0
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        restored, extra = ckpt.restore(fresh)
    assert extra == {"note": 1} and int(restored.step) == 2
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), b), restored, saved))
    # it holds adapters + optimizer state only: far below the size of the base weights
    size = sum(f.stat().st_size for f in (tmp_path / "ckpt" / "2").rglob("*") if f.is_file())
    assert size < adapter_nbytes(updater.lora.params), size
    # and training goes on from it exactly as it did from the saved state
    updater.state = restored
    assert updater.step(make_batch(4)) == pytest.approx(want, rel=1e-6)


# ----------------------------------------------------------------------------- publishing adapters

from tbajax.config import ConfigError, apply_overrides  # noqa: E402
from tbajax.main import load_experiment  # noqa: E402
from tbajax.sampling import Sampler  # noqa: E402
from tbajax.stores import ParamPublisher, ParamReader, ParamStoreError  # noqa: E402
from tbajax.system.publishing import SearcherParams, params_to_publish  # noqa: E402

LORA_OVERRIDES = ["model.lora.rank=4", "model.lora.alpha=8", 'model.lora.targets=["q_proj","v_proj","down_proj"]']


def _run_config(*overrides: str):
    return apply_overrides(load_experiment("tiny_arithmetic"), [*LORA_OVERRIDES, *overrides])


def test_lora_config_from_overrides_and_clear_errors():
    config = _run_config()
    assert config.model.lora == TRAIN_LORA and config.system.publish == "auto"
    plain = load_experiment("tiny_arithmetic")
    assert plain.model.lora is None
    for bad, message in [
        (["model.lora.dropout=0.1"], "model.lora: LoRA dropout=0.1 is not implemented"),
        (["model.lora.rank=0"], "model.lora: LoRA rank must be >= 1"),
        (["model.lora.rnak=4"], "Did you mean 'model.lora.rank'"),
        (["model.lora.targets=q_proj"], "model.lora.targets: expected a list"),
        (["system.publish=adapters"], "model.lora is null"),
    ]:
        with pytest.raises(ConfigError, match=message):
            apply_overrides(plain, bad)


def _logits_of(graphdef, state) -> np.ndarray:
    return np.asarray(_forward(graphdef, state))


def test_adapter_only_publish_applied_by_a_searcher_gives_the_trainers_policy(tmp_path):
    updater, _, _, _ = _lora_updater_and_steps()
    config = _run_config()
    tree, meta = params_to_publish(config, updater)
    assert meta["kind"] == "lora_adapters" and meta["lora"]["rank"] == 4
    assert jax.tree.structure(tree) == jax.tree.structure(adapter_arrays(updater.state.params))
    with ParamPublisher(tmp_path / "params", "run", dtype="float32") as pub:
        adapters_v = pub.publish(tree, meta, step=2)
        full_v = pub.publish(*params_to_publish(_run_config("system.publish=full"), updater), step=2)
    sizes = {v: (tmp_path / "params" / str(v) / "params.bin").stat().st_size for v in (adapters_v, full_v)}
    assert sizes[adapters_v] < 0.2 * sizes[full_v]
    # the searcher: its own copy of the base, untouched by the trainer
    searcher_model = fresh_model()
    base = nnx.state(searcher_model, nnx.Param)
    base_before = jax.tree.map(np.array, base)
    resident = SearcherParams(base, None, config.model.lora)
    reader = ParamReader(tmp_path / "params", "searcher-0")
    merged = resident.load(reader, adapters_v)
    full = resident.load(reader, full_v)
    graphdef = nnx.graphdef(searcher_model)
    want = _logits_of(*nnx.split(updater.policy(), nnx.Param))
    np.testing.assert_allclose(_logits_of(graphdef, merged), want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(_logits_of(graphdef, full), want, rtol=0, atol=1e-6)
    assert np.abs(_logits_of(graphdef, base) - want).max() > 1e-4  # the adapters do something
    # the resident base is kept as it was, for the next version's merge
    assert jax.tree.all(jax.tree.map(np.array_equal, jax.tree.map(np.array, base), base_before))
    # what Rollouts.set_params hands the sampler fits it (same paths, shapes, dtypes)
    Sampler(searcher_model, max_cache_length=16).update_params(merged)


def test_adapters_for_another_base_or_config_are_refused_by_name(tmp_path):
    updater, _, _, _ = _lora_updater_and_steps()
    with ParamPublisher(tmp_path / "params", "run") as pub:
        version = pub.publish(*params_to_publish(_run_config(), updater), step=2)
    reader = ParamReader(tmp_path / "params", "searcher-0")
    wider = dataclasses.replace(MODEL, intermediate_size=MODEL.intermediate_size + 16)
    other = nnx.state(nnx.eval_shape(lambda: CausalLM(wider, rngs=nnx.Rngs(0))), nnx.Param)
    message = r"different base model \(layers.down_proj: trained on \[2, 64, 32\], here \[2, 80, 32\]"
    with pytest.raises(ValueError, match=message):
        SearcherParams(other, None).load(reader, version)
    base = nnx.state(fresh_model(), nnx.Param)
    with pytest.raises(ValueError, match="this searcher's run has model.lora"):
        SearcherParams(base, None, LoraConfig(rank=8, targets=TRAIN_LORA.targets)).load(reader, version)
    # a non-LoRA target handed an adapter version by mistake gets the store's own structure error
    with pytest.raises(ParamStoreError, match="does not match the target"):
        reader.restore(version, nnx.to_pure_dict(base))


FSDP_AS_TENSOR = ("system.cpu_devices_per_trainer_process=2", "system.trainer_mesh.data=1",
                  "system.trainer_mesh.fsdp=2", "rollout.fsdp_weights=tensor")


@pytest.mark.processes
@pytest.mark.parametrize("mesh", [(), FSDP_AS_TENSOR], ids=["one-device", "fsdp-as-tensor"])
def test_sync_run_with_lora_trains_adapters_and_samples_with_the_merged_policy(tmp_path, mesh):
    """`python -m tbajax.main` in sync mode with LoRA: the sampler gets the merged policy of every
    step in memory, and checkpoints hold the adapters, not the base. Also on a trainer mesh split
    over fsdp whose sampler takes the fsdp devices as tensor shards (`rollout.fsdp_weights=tensor`:
    the merged policy resharded at every step)."""
    import orbax.checkpoint as ocp

    from tbajax.system.metrics import read_metrics
    from tests.test_system import _finish, _main

    run = tmp_path / "run"
    lora = [a for o in (*LORA_OVERRIDES, *mesh) for a in ("--set", o)]
    out = _finish(_main(run, "--mode=sync", "--set", "train.steps=2", *lora), timeout=600)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["trainer_steps"] == 2, out
    log = (run / "logs" / "trainer.log").read_text()
    assert ("sampler runs on the same devices as tensor=2" in log) == bool(mesh)
    second = [r for r in read_metrics(run, "trainer") if "loss" in r][1]
    # step 2 trains on samples drawn after update 1: the policy has left the reference (the base)
    # and the sampler drew with exactly the policy the trainer scores (the merged adapters)
    assert abs(second["kl"]) > 1e-4 and abs(second["logprob_gap"]) < 1e-5, second
    state = ocp.StandardCheckpointer().restore(run / "checkpoints" / "2" / "state")
    assert sorted(state["params"]) == ["layers.down_proj", "layers.q_proj", "layers.v_proj"]
    assert state["ref_params"] is None
    if not mesh:  # checked once, on the run whose checkpoint is split over 2 devices (read onto one)
        return
    # `python -m tbajax.export`: a sync run publishes no versions, so its last checkpoint is exported,
    # the adapters merged into the base: the adapted weights moved, every other weight is the base's
    from safetensors.numpy import load_file

    from tbajax.export import main as export_main

    assert export_main([str(run)]) == 0
    exported = load_file(run / "hf" / "checkpoint-2" / "model.safetensors")
    config = json.loads((run / "config.json").read_text())
    base = load_file(Path(config["model"]["checkpoint"]) / "model.safetensors")
    assert sorted(exported) == sorted(base)
    adapted = {k for k in base if not np.array_equal(exported[k], base[k])}
    assert adapted and {k.split(".")[-2] for k in adapted} == {"q_proj", "v_proj", "down_proj"}, adapted
    # the checkpoint's adapters alone, for PEFT: over the torch base, the merged export's logits
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert export_main([str(run), "--peft", "--out", str(tmp_path / "peft")]) == 0
    ids = torch.tensor([[1, 5, 9, 3, 11, 4]])
    with torch.inference_mode():
        merged = AutoModelForCausalLM.from_pretrained(run / "hf" / "checkpoint-2").eval()(ids).logits
        base_model = AutoModelForCausalLM.from_pretrained(config["model"]["checkpoint"])
        peft = PeftModel.from_pretrained(base_model, tmp_path / "peft").eval()(ids).logits
    np.testing.assert_allclose(peft.numpy(), merged.numpy(), atol=2e-5)


def test_adapters_on_qwen2_moe_shared_expert_export_as_peft_applies_them(tiny_checkpoint, tmp_path):
    """A shared expert's projections are ordinary weights: adapters on them (and on attention) merge
    and export as PEFT adapters that transformers + PEFT apply to the same logits."""
    targets = ("q_proj", "shared_gate_proj", "shared_down_proj")
    _, _, peft_dir = _peft_applies_our_adapters(tiny_checkpoint("qwen2_moe"), targets, tmp_path)
    assert json.loads((peft_dir / "adapter_config.json").read_text())["target_modules"] == [
        "mlp.shared_expert.down_proj", "mlp.shared_expert.gate_proj", "self_attn.q_proj"]


def test_adapters_on_gpt_oss_attention_export_as_peft_applies_them(tiny_checkpoint, tmp_path):
    """GPT-OSS's biased attention projections (beside its sinks) take adapters that transformers +
    PEFT apply to the same logits; its experts refuse them as every model's do."""
    targets = ("q_proj", "k_proj", "v_proj", "o_proj")
    _, _, peft_dir = _peft_applies_our_adapters(tiny_checkpoint("gpt_oss"), targets, tmp_path)
    assert json.loads((peft_dir / "adapter_config.json").read_text())["target_modules"] == [
        f"self_attn.{name}" for name in ("k_proj", "o_proj", "q_proj", "v_proj")]


def test_adapters_on_gpt_oss_experts_export_as_peft_target_parameters(tiny_checkpoint, tmp_path):
    """Adapters on GPT-OSS's routed experts (a pair per expert, [E, in, r] and [E, r, out]) merge
    and export as PEFT's `target_parameters` adapters (its ParamWrapper layout, the two parameters
    of one module nested) that transformers + PEFT apply to the same logits; and read back."""
    targets = ("q_proj", "expert_gate_up", "expert_down")
    model, adapters, peft_dir = _peft_applies_our_adapters(tiny_checkpoint("gpt_oss"), targets, tmp_path)
    assert adapters["layers.expert_gate_up"]["a"][...].shape == (2, 4, 72, 4)  # layers, experts, in, r
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert (config["target_modules"], config["target_parameters"]) == (
        ["self_attn.q_proj"], ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    again_cfg, again = load_peft_adapter(peft_dir, model)
    assert sorted(again_cfg.targets) == ["layers.expert_down", "layers.expert_gate_up", "layers.q_proj"]
    for name, pair in adapters.items():
        for k in ("a", "b"):
            np.testing.assert_array_equal(np.asarray(again[name][k][...]), np.asarray(pair[k][...]))
