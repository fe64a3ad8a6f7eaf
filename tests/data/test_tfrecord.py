"""TFRecord files of Examples read without TensorFlow (alma_jax/data/tfrecord.py)."""

import struct

import pytest

from alma_jax.data import tfrecord


def _varint(v: int) -> bytes:
  out = bytearray()
  while True:
    byte, v = v & 0x7F, v >> 7
    out.append(byte | (0x80 if v else 0))
    if not v:
      return bytes(out)


def _field(number: int, payload: bytes) -> bytes:  # length-delimited
  return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _example(features: dict) -> bytes:
  """A serialized tf.train.Example, written by the wire format's rules."""
  entries = b""
  for name, (kind, values) in features.items():
    if kind == "bytes":
      inner = b"".join(_field(1, v) for v in values)
      feature = _field(1, inner)
    elif kind == "floats":
      feature = _field(2, _field(1, struct.pack(f"<{len(values)}f", *values)))
    elif kind == "packed":
      feature = _field(3, _field(1, b"".join(_varint(v % (1 << 64)) for v in values)))
    else:  # int64s unpacked, one varint field per value
      feature = _field(3, b"".join(_varint(1 << 3) + _varint(v % (1 << 64)) for v in values))
    entries += _field(1, _field(1, name.encode()) + _field(2, feature))
  return _field(1, entries)


def _record(payload: bytes) -> bytes:
  return struct.pack("<Q", len(payload)) + b"\0" * 4 + payload + b"\0" * 4


def test_an_example_s_bytes_and_int64_features_by_name_floats_left_out():
  buf = _example({"image": ("bytes", [b"\x89PNG...", b""]), "label": ("packed", [7, 0, 300]),
                  "id": ("unpacked", [-2, 2 ** 40]), "weights": ("floats", [0.5, 1.5])})
  assert tfrecord.example(buf) == {"image": [b"\x89PNG...", b""], "label": [7, 0, 300],
                                   "id": [-2, 2 ** 40]}


def test_records_are_read_in_file_order_and_a_cut_file_is_an_error(tmp_path):
  payloads = [_example({"label": ("packed", [i])}) for i in range(3)]
  path = tmp_path / "f.tfrecord"
  data = b"".join(_record(p) for p in payloads)
  path.write_bytes(data)
  assert list(tfrecord.records(str(path))) == payloads
  for cut in (len(data) - 1, 5):  # inside a record's payload; inside a header
    path.write_bytes(data[:cut])
    with pytest.raises(tfrecord.RecordError, match="cut short|runs past the end"):
      list(tfrecord.records(str(path)))


def test_a_message_that_runs_past_its_end_is_an_error():
  buf = _example({"label": ("packed", [1])})
  with pytest.raises(tfrecord.RecordError, match="runs past the end"):
    tfrecord.example(buf[:-1])
