"""Metrics sinks: our TensorBoard event files (the framing and protos that tensorboardX writes, decoded by
its protos) and the Weights & Biases runs of `system.wandb` (read back from W&B's offline files)."""

import struct

import pytest

from tbajax.system.metrics import MetricsWriter, read_metrics
from tbajax.system.tensorboard import ScalarEventWriter, crc32c, event_bytes, masked_crc32c


def _records(path):
    """(data) of every TFRecord in the file, checking both CRCs."""
    blob, out, i = path.read_bytes(), [], 0
    while i < len(blob):
        (n,) = struct.unpack("<Q", blob[i:i + 8])
        assert struct.unpack("<I", blob[i + 8:i + 12])[0] == masked_crc32c(blob[i:i + 8])
        data = blob[i + 12:i + 12 + n]
        assert struct.unpack("<I", blob[i + 12 + n:i + 16 + n])[0] == masked_crc32c(data)
        out.append(data)
        i += 16 + n
    return out


def test_crc32c_known_values():
    assert crc32c(b"") == 0
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4: 32 bytes of zeros


def test_events_equal_tensorboardx_protos(tmp_path):
    from tensorboardX.proto.event_pb2 import Event

    Event.FromString(event_bytes(1.5, file_version="brain.Event:2"))
    w = ScalarEventWriter(tmp_path / "tb")
    scalars = [("loss", 0.25, 1), ("eval_accuracy", 0.625, 1), ("loss", -3.5, 1000), ("big", 1e30, 2**40)]
    for tag, value, step in scalars:
        w.add_scalar(tag, value, step)
    w.close()
    (path,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    events = [Event.FromString(d) for d in _records(path)]
    assert events[0].file_version == "brain.Event:2" and events[0].wall_time > 0
    got = [(e.summary.value[0].tag, e.summary.value[0].simple_value, e.step) for e in events[1:]]
    assert got == [(t, pytest.approx(v, rel=1e-7), s) for t, v, s in scalars]
    # the same bytes tensorboardX's own proto serializer gives
    ref = Event(wall_time=2.0, step=7)
    ref.summary.value.add(tag="loss", simple_value=0.5)
    assert event_bytes(2.0, 7, tag="loss", value=0.5) == ref.SerializeToString()


def test_metrics_writer_writes_jsonl_and_flushed_events(tmp_path):
    from tensorboardX.proto.event_pb2 import Event

    m = MetricsWriter(tmp_path, "trainer")
    m.write(3, {"loss": 1.25, "nan": float("nan"), "flag": True, "name": "x"})
    (path,) = (tmp_path / "tensorboard" / "trainer").glob("events.*")
    events = [Event.FromString(d) for d in _records(path)]  # readable before close: flushed per write
    assert [(e.summary.value[0].tag, e.step) for e in events[1:]] == [("loss", 3)]
    m.close()
    assert read_metrics(tmp_path, "trainer")[0]["loss"] == 1.25


def test_wandb_runs_are_named_by_run_directory_and_role(tmp_path):
    from tbajax.config import WandbSpec
    from tbajax.system.wandb_logging import loggable, wandb_names

    run = tmp_path / "k=2 m=0.4.seed0"
    group, run_id, name = wandb_names(run, "searcher-1", WandbSpec())
    assert group.startswith("k-2-m-0-4-seed0-") and len(group) == len("k-2-m-0-4-seed0-") + 8
    assert (run_id, name) == (f"{group}-searcher-1", "k=2 m=0.4.seed0/searcher-1")
    assert wandb_names(tmp_path / "elsewhere" / run.name, "trainer", WandbSpec())[0] != group  # another path
    assert wandb_names(run, "trainer", WandbSpec(group="mine"))[:2] == ("mine", "mine-trainer")
    assert loggable({"step": 3, "time": 1e9, "role": "trainer", "loss": 0.5, "nan": float("nan"),
                     "done": True, "event": "resume", "versions": [1, 2]}) == {
        "step": 3, "loss": 0.5, "nan": pytest.approx(float("nan"), nan_ok=True)}


def test_metrics_writer_logs_each_record_to_an_offline_wandb_run(tmp_path):
    """What `system.wandb` logs, read back from W&B's own offline files: every record's numbers,
    against its own step, and a restarted role continues its W&B run (a resumed trainer may log
    a step again)."""
    from tbajax.config import WandbSpec
    from tbajax.system.wandb_logging import WandbRun, wandb_names
    from tests.conftest import wandb_history

    spec = WandbSpec(project="tbajax-test", mode="offline")
    config = {"name": "tiny", "train": {"steps": 3}}
    first = MetricsWriter(tmp_path, "trainer", wandb=WandbRun(spec, tmp_path, "trainer", config))
    for step in (1, 2, 3):
        first.write(step, {"loss": 1.0 / step, "event": "x"})
    first.close()
    again = MetricsWriter(tmp_path, "trainer", wandb=WandbRun(spec, tmp_path, "trainer", config))
    again.write(2, {"loss": 0.125})
    again.close()
    run_id = wandb_names(tmp_path, "trainer", spec)[1]
    assert wandb_history(tmp_path, run_id) == [
        {"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}, {"step": 3, "loss": 1.0 / 3},
        {"step": 2, "loss": 0.125}]


def test_wandb_without_its_package_is_a_config_error(monkeypatch):
    import sys

    from tbajax.config import ConfigError
    from tbajax.system.wandb_logging import import_wandb

    monkeypatch.setitem(sys.modules, "wandb", None)  # as on an install without the extra
    with pytest.raises(ConfigError, match=r"needs the wandb package: pip install 'tbajax\[wandb\]'"):
        import_wandb()
