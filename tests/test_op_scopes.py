"""Named scopes label the parts of compiled programs (`tbajax.op_scopes`), and the profile tool
(`experiments/benchmarks/op_profile.py`) reads them back from optimized HLO."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarks.op_profile import Module, scopes_of
from tbajax import op_scopes as S
from tbajax.models import load_model
from tbajax.models.serving import KVCache, ServingParams, cached_pass, logits

HLO = """\
HloModule jit_fn

%fused_computation.1 (param_0: f32[4,8], param_1: f32[8,8]) -> f32[4,8] {
  %param_0 = f32[4,8]{1,0} parameter(0)
  %param_1 = f32[8,8]{1,0} parameter(1)
  %dot.1 = f32[4,8]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(fn)/while/body/decode/matmul/dot_general"}
  ROOT %add.1 = f32[4,8]{1,0} add(%dot.1, %param_0), metadata={op_name="jit(fn)/while/body/decode/attention/add"}
}

ENTRY %main.2 (p0: f32[4,8], p1: f32[8,8]) -> f32[4,8] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p1 = f32[8,8]{1,0} parameter(1)
  %ynn_fusion.1 = f32[4,8]{1,0} fusion(%p0, %p1), kind=kCustom, calls=%fused_computation.1, metadata={op_name="jit(fn)/while/body/decode/attention/add"}
  %dot.2 = f32[4,8]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(fn)/transpose(jvp(matmul))/dot_general"}
  ROOT %transpose.3 = f32[4,8]{1,0} copy(%dot.2), metadata={op_name="jit(fn)/prefill/attention/transpose"}
}
"""


def test_scopes_of_reads_the_innermost_part_the_phase_and_the_direction():
    assert scopes_of("jit(fn)/while/body/decode/attention/kv_write/dynamic_update_slice") == (
        S.KV_WRITE, S.DECODE, False)
    assert scopes_of("jit(step)/transpose(jvp(matmul))/dot_general") == (S.MATMUL, None, True)
    # jnp.transpose is an op, not a VJP
    assert scopes_of("jit(fn)/prefill/attention/transpose") == (S.ATTENTION, S.PREFILL, False)
    assert scopes_of("jit(fn)/jit(_where)/select_n") == (None, None, False)


def test_a_fusion_counts_under_every_part_fused_into_it():
    module = Module(HLO)
    assert module.label("ynn_fusion.1") == ("attention+matmul", S.DECODE, False, "fusion")
    assert module.label("dot.2") == ("matmul", None, True, "dot")
    assert module.label("transpose.3") == ("attention", S.PREFILL, False, "copy")
    assert module.label("missing") == ("other", None, False, "?")


def test_a_decode_step_program_names_its_parts(tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama"))
    cfg = model.config
    cache = KVCache.init(cfg, 2, 8)

    def step(params: ServingParams, cache: KVCache, tokens: jax.Array) -> jax.Array:
        positions, mask = jnp.zeros((2, 1), jnp.int32), jnp.ones((2, 1), bool)
        hidden, cache = cached_pass(cfg, params, tokens, positions, mask, cache)
        return logits(cfg, params, hidden[:, 0]), cache

    params = jax.jit(ServingParams.of)(model)
    text = jax.jit(step).lower(params, cache, jnp.ones((2, 1), jnp.int32)).compile().as_text()
    module = Module(text)
    labels = {module.label(name)[0] for name in module.ops}
    found = {part for label in labels for part in label.split("+")}
    assert {S.MATMUL, S.ATTENTION, S.KV_WRITE, S.NORM, S.ROPE, S.EMBED, S.LM_HEAD} <= found, labels


def test_backward_ops_keep_the_scopes_of_the_code_they_differentiate(tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama"))
    from flax import nnx

    graphdef, state = nnx.split(model)

    def loss(state: nnx.State, tokens: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, state)(tokens)[0].sum()

    tokens = jnp.asarray(np.arange(16).reshape(2, 8) % model.config.vocab_size)
    text = jax.jit(jax.grad(loss)).lower(state, tokens).compile().as_text()
    module = Module(text)
    backward = {module.label(name)[0] for name in module.ops if module.label(name)[2]}
    assert any(S.MATMUL in label for label in backward), backward
    assert any(S.ATTENTION in label for label in backward), backward


def test_group_shares_put_every_fused_attention_op_under_attention():
    from experiments.benchmarks.op_profile import group_of, with_group_shares

    assert group_of("attention+matmul") == "attention"
    assert group_of("kv_write+matmul+rope") == "attention"
    assert group_of("activation+matmul") == "matmul"
    assert group_of("lm_head+norm") == "lm_head"
    assert group_of("norm") == "other"
    parts = [{"part": "attention+matmul", "ms": 3.0}, {"part": "matmul", "ms": 1.0}]
    row = with_group_shares({"parts": parts})
    assert row["attention_share"] == 0.75 and row["matmul_share"] == 0.25 and row["other_share"] == 0.0
