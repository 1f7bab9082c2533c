"""Build the task and tokenizer an experiment names (shared by every role)."""

from __future__ import annotations

import dataclasses
from typing import Any

from tbajax.config import ExperimentConfig
from tbajax.models import resolve_checkpoint
from tbajax.tasks.base import Task, get_task
from tbajax.tokenizers import check_tokenizer, load_tokenizer


def load_task(config: ExperimentConfig) -> Task:
    task = get_task(config.task.name, **dict(config.task.options))
    if config.task.chat_template and not task.chat:
        task = dataclasses.replace(task, chat=True)
    return task


def tokenizer_source(config: ExperimentConfig) -> Any:
    return config.model.tokenizer or resolve_checkpoint(config.model.checkpoint)


def check_tokenizer_for(config: ExperimentConfig) -> None:
    check_tokenizer(tokenizer_source(config))


def load_tokenizer_for(config: ExperimentConfig) -> Any:
    tokenizer = load_tokenizer(tokenizer_source(config))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
