"""Reads a TensorBoard event file with Debian's python3-protobuf and prints what it holds as JSON.

Independent of the C++ writer: the TFRecord framing and both masked CRC32Cs are checked here with
a CRC32C written in Python, and the Event/Summary messages are decoded by protobuf's own parser
from descriptors declared below (the few fields of tensorflow/core/util/event.proto and
summary.proto that scalars use).

usage: read_tfevents.py EVENT_FILE      exit 0 and JSON on stdout; exit 2 if protobuf is missing
"""
import json
import struct
import sys

try:
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
except ImportError:
    print("python3-protobuf not installed", file=sys.stderr)
    sys.exit(2)


def crc32c(data: bytes) -> int:
    table = crc32c.table
    if table is None:
        table = []
        for b in range(256):
            c = b
            for _ in range(8):
                c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
            table.append(c)
        crc32c.table = table
    crc = 0xFFFFFFFF
    for byte in data:
        crc = (crc >> 8) ^ table[(crc ^ byte) & 0xFF]
    return crc ^ 0xFFFFFFFF


crc32c.table = None


def masked(crc: int) -> int:
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def event_class():
    F = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name="rlh_event_subset.proto", package="tensorflow",
                                             syntax="proto3")
    value = fdp.message_type.add(name="SummaryValue")
    value.field.add(name="tag", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    value.field.add(name="simple_value", number=2, type=F.TYPE_FLOAT, label=F.LABEL_OPTIONAL)
    summary = fdp.message_type.add(name="Summary")
    summary.field.add(name="value", number=1, type=F.TYPE_MESSAGE, label=F.LABEL_REPEATED,
                      type_name=".tensorflow.SummaryValue")
    event = fdp.message_type.add(name="Event")
    event.field.add(name="wall_time", number=1, type=F.TYPE_DOUBLE, label=F.LABEL_OPTIONAL)
    event.field.add(name="step", number=2, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
    event.field.add(name="file_version", number=3, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    event.field.add(name="summary", number=5, type=F.TYPE_MESSAGE, label=F.LABEL_OPTIONAL,
                    type_name=".tensorflow.Summary")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    desc = pool.FindMessageTypeByName("tensorflow.Event")
    if hasattr(message_factory, "GetMessageClass"):
        return message_factory.GetMessageClass(desc)
    return message_factory.MessageFactory(pool).GetPrototype(desc)


def main(path: str) -> None:
    Event = event_class()
    data = open(path, "rb").read()
    pos, events = 0, []
    while pos < len(data):
        if len(data) - pos < 12:
            raise SystemExit(f"{path}: truncated record header at byte {pos}")
        header = data[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        (len_crc,) = struct.unpack("<I", data[pos + 8:pos + 12])
        if len_crc != masked(crc32c(header)):
            raise SystemExit(f"{path}: bad length CRC at byte {pos}")
        payload = data[pos + 12:pos + 12 + length]
        if len(payload) != length or pos + 16 + length > len(data):
            raise SystemExit(f"{path}: truncated record at byte {pos}")
        (data_crc,) = struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])
        if data_crc != masked(crc32c(payload)):
            raise SystemExit(f"{path}: bad data CRC at byte {pos}")
        ev = Event()
        ev.ParseFromString(payload)
        events.append({
            "wall_time": ev.wall_time,
            "step": ev.step,
            "file_version": ev.file_version,
            "values": [[v.tag, v.simple_value] for v in ev.summary.value],
        })
        pos += 16 + length
    json.dump(events, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1])
