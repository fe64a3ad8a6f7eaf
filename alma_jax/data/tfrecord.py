"""TFRecord files of `tf.train.Example`s, read without TensorFlow.

tensorflow_datasets stores a prepared split as TFRecord shards: each record is
a little-endian uint64 length, a 4-byte CRC of the length, the payload and a
4-byte CRC of the payload; the payload is a serialized `tf.train.Example`, a
map from feature names to lists of bytes, floats or int64s. This module reads
the records and the bytes and int64 lists of each Example with the protobuf
wire format's rules; importing TensorFlow for the same costs seconds.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

_HEADER = 12  # uint64 length, uint32 CRC of the length
_FOOTER = 4  # uint32 CRC of the payload


class RecordError(ValueError):
  """A file that is not a well-formed TFRecord file of Examples."""


def records(path: str) -> Iterator[bytes]:
  """The payloads of the records of the TFRecord file at `path`, in file order."""
  with open(path, "rb") as f:
    data = f.read()
  pos, end = 0, len(data)
  while pos < end:
    if pos + _HEADER > end:
      raise RecordError(f"{path}: a record header is cut short at byte {pos}")
    (length,) = struct.unpack_from("<Q", data, pos)
    start = pos + _HEADER
    pos = start + length + _FOOTER
    if pos > end:
      raise RecordError(f"{path}: a record of {length} bytes at byte {start} runs past the end")
    yield data[start:start + length]


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
  value = shift = 0
  while True:
    if pos >= len(buf):
      raise RecordError("a varint runs past the end of its message")
    byte = buf[pos]
    pos += 1
    value |= (byte & 0x7F) << shift
    if byte < 0x80:
      return value, pos
    shift += 7


def _fields(buf: bytes, start: int, end: int) -> Iterator[tuple[int, int, int | None]]:
  """(field number, start, end) of each length-delimited field of the message in
  buf[start:end], and (field number, value, None) of each varint field."""
  pos = start
  while pos < end:
    key, pos = _varint(buf, pos)
    number, wire_type = key >> 3, key & 7
    if wire_type == 2:
      length, pos = _varint(buf, pos)
      if pos + length > end:
        raise RecordError(f"field {number} runs past the end of its message")
      yield number, pos, pos + length
      pos += length
    elif wire_type == 0:
      value, pos = _varint(buf, pos)
      yield number, value, None
    elif wire_type == 5:  # fixed32 (a float list's unpacked values)
      yield number, pos, pos + 4
      pos += 4
    elif wire_type == 1:  # fixed64
      yield number, pos, pos + 8
      pos += 8
    else:
      raise RecordError(f"field {number} has wire type {wire_type}, not used by Examples")


# tf.train.Example: 1 features; Features: 1 map<string, Feature> entries (1 key, 2 value);
# Feature: oneof 1 bytes_list, 2 float_list, 3 int64_list; each list: 1 repeated value.
_BYTES, _FLOATS, _INT64S = 1, 2, 3


def example(buf: bytes) -> dict[str, list[bytes] | list[int]]:
  """The bytes and int64 features of a serialized `tf.train.Example` (float features are
  left out), by name."""
  out = {}
  for number, start, end in _fields(buf, 0, len(buf)):
    if number != 1 or end is None:
      continue
    for entry, s, e in _fields(buf, start, end):
      if entry != 1 or e is None:
        continue
      name, value = None, None
      for part, ps, pe in _fields(buf, s, e):
        if part == 1 and pe is not None:
          name = buf[ps:pe].decode("utf-8")
        elif part == 2 and pe is not None:
          value = (ps, pe)
      if name is None or value is None:
        continue
      for kind, ks, ke in _fields(buf, *value):
        if ke is None or kind not in (_BYTES, _INT64S):
          continue
        items = []
        for _, vs, ve in _fields(buf, ks, ke):
          if kind == _BYTES:
            items.append(buf[vs:ve])
          elif ve is None:  # an unpacked int64
            items.append(vs)
          else:  # packed int64s
            pos = vs
            while pos < ve:
              v, pos = _varint(buf, pos)
              items.append(v)
        out[name] = [v - (1 << 64) if kind == _INT64S and v >= 1 << 63 else v for v in items]
  return out
