"""TensorBoard event files read back record by record (tensorboardX's own protobuf and CRC),
so that a test sees exactly what TensorBoard would show."""

from __future__ import annotations

import struct
from pathlib import Path

from tensorboardX.proto.event_pb2 import Event
from tensorboardX.record_writer import masked_crc32c


def read_events(folder: Path) -> list[Event]:
    """Every event in the event files under ``folder``: TFRecord framing (length, masked
    CRC-32C of the length, the serialized ``Event``, masked CRC-32C of it), CRCs checked."""
    out = []
    for path in sorted(folder.rglob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            head = data[pos:pos + 8]
            (length,), (head_crc,) = struct.unpack("<Q", head), struct.unpack(
                "<I", data[pos + 8:pos + 12])
            body = data[pos + 12:pos + 12 + length]
            (body_crc,) = struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])
            assert head_crc == masked_crc32c(head) and body_crc == masked_crc32c(body)
            out.append(Event.FromString(body))
            pos += 16 + length
    return out


def scalars_of(folder: Path) -> dict[tuple[str, int], float]:
    return {(v.tag, e.step): v.simple_value for e in read_events(folder)
            for v in e.summary.value if v.WhichOneof("value") == "simple_value"}


def texts_of(folder: Path) -> dict[tuple[str, int], str]:
    return {(v.tag, e.step): v.tensor.string_val[0].decode() for e in read_events(folder)
            for v in e.summary.value if v.metadata.plugin_data.plugin_name == "text"}
