"""Faults and recovery: corrupt files, bad rows, failing graders, and an async run whose searcher
and trainer are killed at random moments (incl. mid-append) and resumed."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from tbajax.training import Checkpointer
from tbajax.training.state import TrainState


def _state(step: int) -> TrainState:
    return TrainState(params={"w": jnp.full(3, float(step))}, opt_state=(), ref_params=None,
                      step=jnp.int32(step), rng=jnp.zeros(2, jnp.uint32))


def test_truncated_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    ckpt = Checkpointer(tmp_path / "ckpt", max_to_keep=None)
    for step in (2, 4):
        ckpt.save(_state(step), {"step": step})
    ckpt.wait()
    for f in (tmp_path / "ckpt" / "4" / "state").rglob("*"):
        if f.is_file() and f.name != "commit_success.txt":
            f.write_bytes(f.read_bytes()[:7])  # a disk that filled up mid-save, say
    with caplog.at_level(logging.WARNING):
        state, extra = Checkpointer(tmp_path / "ckpt").restore(_state(0))
    assert int(state.step) == 2 and extra == {"step": 2}
    np.testing.assert_array_equal(np.asarray(state.params["w"]), [2.0, 2.0, 2.0])
    assert "ckpt/4 cannot be read" in caplog.text and "skipping unreadable newer checkpoint(s) [4]" in caplog.text
    for f in (tmp_path / "ckpt" / "2" / "state").rglob("*"):
        if f.is_file() and f.name != "commit_success.txt":
            f.write_bytes(b"")
    with pytest.raises(RuntimeError, match=r"none of the checkpoints .* step 4: .*step 2: .*Move the checkpoints"):
        Checkpointer(tmp_path / "ckpt").restore(_state(0))
