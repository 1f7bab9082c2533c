"""Flax NNX decoders (Llama, Qwen2/2.5, Qwen3, GPT-NeoX/Pythia, GPT-2), sequence-classification
scorers on top of them, encoders (BERT, RoBERTa), LoRA, and Hugging Face checkpoint I/O."""

from tbajax.models.config import ModelConfig, RopeScaling, UnsupportedModelError
from tbajax.models.decoder import CausalLM, KVCache, packed_attention_mask, positions_from_mask
from tbajax.models.encoders import (
    Encoder,
    EncoderConfig,
    SentencePooling,
    embed_texts,
    load_classifier,
    load_encoder,
    save_encoder,
)
from tbajax.models.hf import load_config, load_model, resolve_checkpoint, save_model
from tbajax.models.lora import (
    LoraConfig,
    apply_lora,
    init_lora,
    load_peft_adapter,
    merge_lora,
    save_peft_adapter,
)
from tbajax.models.safetensors_io import CheckpointError
from tbajax.models.scorer import SequenceScorer, load_scorer

__all__ = [
    "CausalLM",
    "CheckpointError",
    "Encoder",
    "EncoderConfig",
    "KVCache",
    "LoraConfig",
    "ModelConfig",
    "RopeScaling",
    "SentencePooling",
    "SequenceScorer",
    "UnsupportedModelError",
    "apply_lora",
    "embed_texts",
    "init_lora",
    "load_classifier",
    "load_config",
    "load_encoder",
    "load_model",
    "load_peft_adapter",
    "load_scorer",
    "merge_lora",
    "packed_attention_mask",
    "positions_from_mask",
    "resolve_checkpoint",
    "save_encoder",
    "save_model",
    "save_peft_adapter",
]
