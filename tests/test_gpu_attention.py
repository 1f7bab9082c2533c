"""cuDNN's fused attention (`model.attention=cudnn`) against tbajax's own, on an NVIDIA GPU: the
log-probs and gradients of the trainer's three batch layouts, a left-padded forward, and the
searchers' prompt pass. Skipped elsewhere; `experiments/benchmarks/gpu_check.sh` runs it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tbajax.models import ModelConfig
from tbajax.training.collate import collate
from tbajax.training.loss import sequence_logprobs
from tbajax.trajectory import Trajectory
from tests.conftest import numpy_model_parts

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs an NVIDIA GPU")

# head_dim 64 and bf16 compute: a shape and dtype cuDNN's fused attention takes
CONFIG = ModelConfig(model_type="llama", vocab_size=128, hidden_size=256, intermediate_size=512, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=64, dtype="bfloat16")


def _parts(attention: str) -> tuple[nnx.GraphDef, nnx.State]:
    return numpy_model_parts(dataclasses.replace(CONFIG, attention=attention), scale=0.05)


def _left_padded(seed: int, length: int, starts: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """Random tokens [len(starts), length] and their mask, row i real from slot starts[i] on."""
    tokens = np.random.default_rng(seed).integers(3, CONFIG.vocab_size, (len(starts), length))
    real = np.arange(length)[None, :] >= np.array(starts)[:, None]
    return jnp.asarray(tokens, jnp.int32), jnp.asarray(real)


def _groups() -> list[list[Trajectory]]:
    r = np.random.default_rng(1)
    groups = []
    for g, (prompt_len, lengths) in enumerate([(24, (70, 12, 40)), (37, (5, 64, 33))]):
        prompt = r.integers(3, CONFIG.vocab_size, prompt_len).astype(np.int32)
        groups.append([Trajectory(g, g, prompt, r.integers(3, CONFIG.vocab_size, n).astype(np.int32),
                                  np.zeros(n, np.float32), float(r.random())) for n in lengths])
    return groups


@pytest.mark.parametrize("layout", ["rows", "packed", "strided"])
def test_cudnn_attention_scores_like_ours(layout):
    batch = collate(_groups(), beta=0.5, pack_microbatches=None if layout == "rows" else 1,
                    pack_strided=layout == "strided")
    ours, params = _parts("xla")
    cudnn, _ = _parts("cudnn")
    weights = jnp.asarray(np.random.default_rng(2).normal(size=batch.loss_mask.shape), jnp.float32)

    def run(graphdef):
        def loss(p, b):  # the batch as an argument: device arrays, as the trainer passes it
            lp = sequence_logprobs(graphdef, p, b, 1.0)
            return (jnp.where(b.loss_mask, lp, 0.0) * weights).sum(), lp
        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params, batch)

    (_, want), want_grads = run(ours)
    (_, got), got_grads = run(cudnn)
    mask = np.asarray(batch.loss_mask)
    np.testing.assert_allclose(np.where(mask, np.asarray(got), 0), np.where(mask, np.asarray(want), 0),
                               atol=0.1, rtol=0.02)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got_grads), jax.tree.leaves(want_grads)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        err = np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-6)
        assert err < 0.05, (jax.tree_util.keystr(path), err)


def test_cudnn_attention_forward_over_left_padding():
    ours, params = _parts("xla")
    cudnn, _ = _parts("cudnn")
    tokens, real = _left_padded(3, 96, (0, 5, 31, 64))

    def logits(graphdef):
        return jax.jit(lambda p: nnx.merge(graphdef, p)(tokens, attention_mask=real)[0])(params)

    want, got = np.asarray(logits(ours)), np.asarray(logits(cudnn))
    keep = np.asarray(real)[..., None]
    np.testing.assert_allclose(np.where(keep, got, 0), np.where(keep, want, 0), atol=0.1, rtol=0.02)


def test_cudnn_prompt_pass_emits_the_same_cache():
    """The searchers' prompt pass (`serving.prompt_pass`, left-padded prompts): the last hidden
    state and every layer's emitted keys and values, cuDNN against ours."""
    from tbajax.models.decoder import positions_from_mask
    from tbajax.models.serving import ServingParams, prompt_pass

    ours, params = _parts("xla")
    cudnn, _ = _parts("cudnn")
    tokens, real = _left_padded(4, 64, (0, 9, 30, 63))

    def run(graphdef):
        def f(p):
            model = nnx.merge(graphdef, p)
            positions = positions_from_mask(real)
            return prompt_pass(model.config, ServingParams.of(model), tokens, real, positions)
        return jax.jit(f)(params)

    (want_h, want_k, want_v), (got_h, got_k, got_v) = run(ours), run(cudnn)
    np.testing.assert_allclose(np.asarray(got_h, np.float32), np.asarray(want_h, np.float32),
                               atol=0.1, rtol=0.02)
    keep_k, keep_v = np.asarray(real)[:, None, None, :], np.asarray(real)[:, None, :, None]
    for layer, (gk, wk, gv, wv) in enumerate(zip(got_k, want_k, got_v, want_v)):
        np.testing.assert_allclose(np.where(keep_k, np.asarray(gk, np.float32), 0),
                                   np.where(keep_k, np.asarray(wk, np.float32), 0), atol=0.1, rtol=0.02,
                                   err_msg=f"keys of layer {layer}")
        np.testing.assert_allclose(np.where(keep_v, np.asarray(gv, np.float32), 0),
                                   np.where(keep_v, np.asarray(wv, np.float32), 0), atol=0.1, rtol=0.02,
                                   err_msg=f"values of layer {layer}")
