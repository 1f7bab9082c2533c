"""Where a checkpoint lives: a local Hugging Face directory or a hub id fetched once into the
hub cache. Free of jax, so the launcher can check a run's checkpoint before any role starts."""

from __future__ import annotations

import os
from pathlib import Path

from tbajax.models.safetensors_io import CheckpointError

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
)


def resolve_checkpoint(source: str | os.PathLike[str]) -> Path:
    """A local directory, or a hub id downloaded (or found in the cache) via huggingface_hub."""
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise CheckpointError(f"{path} has no config.json; is it a Hugging Face model directory?")
        return path
    source = str(source)
    if path.exists() or source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise CheckpointError(
            f"checkpoint {source!r} is neither a local directory nor a hub id of the form 'org/name'"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    patterns = ["config.json", "*.safetensors", "model.safetensors.index.json", *TOKENIZER_FILES]
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
    try:
        return Path(snapshot_download(source, allow_patterns=patterns, local_files_only=offline))
    except LocalEntryNotFoundError as e:
        raise CheckpointError(
            f"hub model {source!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set"
            if offline
            else f"could not download hub model {source!r} ({e})"
        ) from None
    except Exception as e:  # network errors, 404s, gated repos: one clear message
        raise CheckpointError(
            f"could not fetch hub model {source!r}: {type(e).__name__}: {e}. Download it on a machine "
            "with network access (huggingface-cli download) and pass the local directory instead."
        ) from None
