"""Our TensorBoard event files: the framing and protos that tensorboardX writes, decoded by its protos."""

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
