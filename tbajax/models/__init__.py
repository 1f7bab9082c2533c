"""Flax NNX decoders (Llama, Mistral, Qwen2/2.5, Qwen3, Qwen2-MoE, Qwen3-MoE, Mixtral, SmolLM3, Granite,
OLMo 2 / 3, OLMoE, Phi-3 / Phi-4, Gemma 1, 2 and 3, GPT-NeoX/Pythia, GPT-2), sequence-classification
scorers on top of them, encoders (BERT, RoBERTa), LoRA, and Hugging Face checkpoint I/O."""

from tbajax._lazy import lazy_exports

_EXPORTS = {  # public name -> the submodule that defines it
    "ModelConfig": "config",
    "RopeScaling": "config",
    "UnsupportedModelError": "config",
    "CausalLM": "decoder",
    "KVCache": "serving",
    "ServingParams": "serving",
    "packed_attention_mask": "decoder",
    "positions_from_mask": "decoder",
    "Encoder": "encoders",
    "EncoderConfig": "encoders",
    "SentencePooling": "encoders",
    "embed_texts": "encoders",
    "load_classifier": "encoders",
    "load_encoder": "encoders",
    "save_encoder": "encoders",
    "load_config": "hf",
    "load_model": "hf",
    "resolve_checkpoint": "locate",
    "save_model": "hf",
    "LoraConfig": "lora",
    "apply_lora": "lora",
    "init_lora": "lora",
    "load_peft_adapter": "lora",
    "merge_lora": "lora",
    "save_peft_adapter": "lora",
    "CheckpointError": "safetensors_io",
    "SequenceScorer": "scorer",
    "load_scorer": "scorer",
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
