"""The run's own copy of its policy's architecture and tokenizer, in RUN_DIR/model/.

A run's weights live in its param store and checkpoints, but what they mean (the HF config.json)
and how text becomes tokens (the tokenizer files) came from `model.checkpoint`, a path on the
machine that trained or a hub cache. The trainer copies both into the run directory when it
starts, so that `tbajax.export`, `tbajax.evaluate --run-dir` and `tbajax.samples` work on a run
directory moved to another machine or whose base checkpoint was moved or deleted. Only a LoRA
run's merged export still reads the base checkpoint: its frozen weights are not copied.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from tbajax.config import ExperimentConfig, apply_overrides
from tbajax.models.locate import TOKENIZER_FILES, resolve_checkpoint

log = logging.getLogger(__name__)

MODEL_DIR = "model"
SOURCE_FILE = "source.json"  # which checkpoint and tokenizer the copy came from


def keep_model_files(run_dir: Path, config: ExperimentConfig) -> Path:
    """Copy the base checkpoint's config.json and the run's tokenizer files into RUN_DIR/model/
    (written whole or not at all); a resumed run keeps the copy it started with."""
    target = Path(run_dir) / MODEL_DIR
    if (target / "config.json").is_file():
        return target
    tmp = target.with_name(f".{MODEL_DIR}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    checkpoint = resolve_checkpoint(config.model.checkpoint)
    shutil.copy2(checkpoint / "config.json", tmp / "config.json")
    tokenizer = config.model.tokenizer
    if tokenizer is None or Path(tokenizer).expanduser().is_dir():
        directory = checkpoint if tokenizer is None else Path(tokenizer).expanduser()
        copied = [name for name in TOKENIZER_FILES if (directory / name).is_file()]
        for name in copied:
            shutil.copy2(directory / name, tmp / name)
    else:  # a hub id (the trainer has it cached by now): the files transformers writes for it
        from tbajax.tokenizers import load_tokenizer

        load_tokenizer(tokenizer).save_pretrained(tmp)
    (tmp / SOURCE_FILE).write_text(json.dumps(
        {"checkpoint": config.model.checkpoint, "tokenizer": tokenizer}, indent=2) + "\n")
    shutil.rmtree(target, ignore_errors=True)  # a copy cut short before it held config.json
    os.replace(tmp, target)
    return target


def run_model_dir(run_dir: Path) -> Path | None:
    """RUN_DIR/model, or None for a run whose trainer predates the copy (or never started)."""
    target = Path(run_dir) / MODEL_DIR
    return target if (target / "config.json").is_file() else None


def architecture_dir(run_dir: Path, config: ExperimentConfig) -> Path:
    """Where the run's config.json is read from: its own copy, else (an older run) the base
    checkpoint, which must then still be reachable."""
    own = run_model_dir(run_dir)
    if own is not None:
        return own
    log.info("%s has no model/ copy (its trainer predates it); reading the architecture from "
             "model.checkpoint=%s", run_dir, config.model.checkpoint)
    return resolve_checkpoint(config.model.checkpoint)


def with_run_tokenizer(run_dir: Path, config: ExperimentConfig) -> ExperimentConfig:
    """`config` reading its tokenizer from the run's own copy, where the run has one."""
    own = run_model_dir(run_dir)
    if own is None:
        return config
    return apply_overrides(config, [f"model.tokenizer={json.dumps(str(own))}"])
