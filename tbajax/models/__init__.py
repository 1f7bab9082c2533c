"""Flax NNX decoders (Llama, Qwen2/2.5, Qwen3, GPT-NeoX/Pythia, GPT-2), sequence-classification
scorers on top of them, and Hugging Face checkpoint I/O."""

from tbajax.models.config import ModelConfig, RopeScaling, UnsupportedModelError
from tbajax.models.decoder import CausalLM, KVCache, packed_attention_mask, positions_from_mask
from tbajax.models.hf import load_config, load_model, resolve_checkpoint, save_model
from tbajax.models.safetensors_io import CheckpointError
from tbajax.models.scorer import SequenceScorer, load_scorer

__all__ = [
    "CausalLM",
    "CheckpointError",
    "KVCache",
    "ModelConfig",
    "RopeScaling",
    "SequenceScorer",
    "UnsupportedModelError",
    "load_config",
    "load_model",
    "load_scorer",
    "packed_attention_mask",
    "positions_from_mask",
    "resolve_checkpoint",
    "save_model",
]
