"""TensorBoard event files of a run, written without TensorFlow.

`tensorboard --logdir=<workdir or sweep root>` follows a run while it trains:

* per time step t (`step` = t): `stream/test_error`, `stream/cer` (the sum
  of the test errors so far), `stream/num_params`, `stream/comp_paper_tflops`
  and `stream/comp_tflops` (cumulative training compute), `stream/comp_total_tflops`
  and `stream/comp_paper_total_tflops` (the same with growth's passes over
  data: `Log.comp_total`, `Log.comp_paper_total`), `stream/wall_s`;
* per epoch (`step` = epochs trained so far over the run):
  `epoch/train_loss`, `epoch/val_accuracy` and `epoch/t` (the stage's t);
* `Writer.config`: the resolved config as text (`config`, a table of its
  fields, in the Text tab) and as the run's hyperparameters (the HParams tab:
  every field by its dotted path);
* `Writer.summary`: every number of the summary as `summary/<metric>` at the
  last step (the HParams tab's metrics), and the end of the session.

An event file is a sequence of TFRecords (length, masked CRC-32C of the
length, data, masked CRC-32C of the data), each an `Event` protocol buffer;
this module encodes the few fields it needs by hand (and decodes them, to
resume). A resumed run rewrites its event file: the per-step scalars of the
records it resumed with, then the per-epoch scalars of their stages; those
of a later stage (cut short) are dropped, so the file holds each step once.
A stage that continues from its save (`Writer.stage_resumed`) gets its
epochs before the save back.
"""

from __future__ import annotations

import json
import math
import os
import struct
import time
from typing import Iterator, Sequence

from alma_jax.outputs import io_utils


def flatten(tree, prefix: str = "") -> dict:
  """Nested dicts -> {"a.b.c": leaf} (an empty dict is a leaf)."""
  if isinstance(tree, dict) and tree:
    return {k: v for key, sub in tree.items() for k, v in flatten(sub, f"{prefix}{key}.").items()}
  return {prefix[:-1]: tree}

FILE_PREFIX = "events.out.tfevents."
FILE_SUFFIX = ".alma_jax"
STREAM, EPOCH, SUMMARY = "stream/", "epoch/", "summary/"

# -- CRC-32C (Castagnoli), as TFRecord frames use it ------------------------------------------------
def _crc_table(poly: int = 0x82F63B78) -> list[int]:
  table = []
  for i in range(256):
    c = i
    for _ in range(8):
      c = (c >> 1) ^ poly if c & 1 else c >> 1
    table.append(c)
  return table


_TABLE = _crc_table()


def crc32c(data: bytes) -> int:
  crc = 0xFFFFFFFF
  for b in data:
    crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
  crc = crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def frame(data: bytes) -> bytes:
  """One TFRecord holding `data`."""
  length = struct.pack("<Q", len(data))
  return length + struct.pack("<I", _masked(length)) + data + struct.pack("<I", _masked(data))


def read_frames(path: str) -> Iterator[bytes]:
  """The records of a TFRecord file, up to the first incomplete or corrupt one."""
  with open(path, "rb") as f:
    buf = f.read()
  pos = 0
  while pos + 12 <= len(buf):
    length = buf[pos:pos + 8]
    (n,) = struct.unpack("<Q", length)
    if struct.unpack("<I", buf[pos + 8:pos + 12])[0] != _masked(length) or pos + 16 + n > len(buf):
      return
    data = buf[pos + 12:pos + 12 + n]
    if struct.unpack("<I", buf[pos + 12 + n:pos + 16 + n])[0] != _masked(data):
      return
    yield data
    pos += 16 + n


# -- the Event protocol buffer (wall_time=1 double, step=2 int64, file_version=3,
#    summary=5 {value=1 {tag=1, simple_value=2 float, tensor=8, metadata=9}}) -------------------
def _varint(n: int) -> bytes:
  out = bytearray()
  n &= (1 << 64) - 1
  while True:
    b = n & 0x7F
    n >>= 7
    out.append(b | (0x80 if n else 0))
    if not n:
      return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
  return _varint(number << 3 | wire) + payload


def _bytes_field(number: int, data: bytes) -> bytes:
  return _field(number, 2, _varint(len(data)) + data)


def event(wall_time: float, step: int = 0, scalars: dict[str, float] | None = None,
          file_version: str | None = None, values: Sequence[bytes] = ()) -> bytes:
  """An encoded Event: a file-version header, or scalars and encoded Summary.Values (`values`,
  e.g. `text_value`, `hparams_value`) at `step`."""
  out = _field(1, 1, struct.pack("<d", wall_time)) + _field(2, 0, _varint(step))
  if file_version is not None:
    out += _bytes_field(3, file_version.encode())
  encoded = [_bytes_field(1, tag.encode()) + _field(2, 5, struct.pack("<f", float(v)))
             for tag, v in (scalars or {}).items()] + list(values)
  if encoded:
    out += _bytes_field(5, b"".join(_bytes_field(1, v) for v in encoded))
  return out


# Plugin summaries: Summary.Value {tag=1, tensor=8 TensorProto {dtype=1, tensor_shape=2
# {dim=2 {size=1}}, float_val=5, string_val=8}, metadata=9 SummaryMetadata {plugin_data=1
# {plugin_name=1, content=2}}}.
_DT_FLOAT, _DT_STRING = 1, 7


def _plugin_value(tag: str, plugin: str, content: bytes, tensor: bytes) -> bytes:
  metadata = _bytes_field(1, _bytes_field(1, plugin.encode()) + _bytes_field(2, content))
  return _bytes_field(1, tag.encode()) + _bytes_field(8, tensor) + _bytes_field(9, metadata)


def text_value(tag: str, text: str) -> bytes:
  """A Summary.Value of the Text plugin: `text` (Markdown) as a scalar string tensor."""
  tensor = (_field(1, 0, _varint(_DT_STRING)) + _bytes_field(2, b"")
            + _bytes_field(8, text.encode()))
  return _plugin_value(tag, "text", b"", tensor)


def _protobuf_value(v) -> bytes:
  """A google.protobuf.Value: a number, bool or string (other values as JSON text)."""
  if isinstance(v, bool):
    return _field(4, 0, _varint(int(v)))
  if isinstance(v, (int, float)):
    return _field(2, 1, struct.pack("<d", float(v)))
  return _bytes_field(3, (v if isinstance(v, str) else json.dumps(v, sort_keys=True)).encode())


# The HParams plugin: HParamsPluginData {version=1, session_start_info=3 {hparams=1 map<string,
# Value>, start_time_secs=5}, session_end_info=4 {status=1, end_time_secs=2}}; its tensor is an
# empty float tensor.
HPARAMS_START_TAG, HPARAMS_END_TAG = "_hparams_/session_start_info", "_hparams_/session_end_info"
STATUS_SUCCESS = 1
_EMPTY_FLOATS = _field(1, 0, _varint(_DT_FLOAT)) + _bytes_field(2, _bytes_field(2, b""))


def hparams_start_value(hparams: dict, start_time: float) -> bytes:
  """The HParams plugin's session start: the hyperparameters of the run."""
  entries = b"".join(
      _bytes_field(1, _bytes_field(1, k.encode()) + _bytes_field(2, _protobuf_value(v)))
      for k, v in hparams.items())
  info = entries + _field(5, 1, struct.pack("<d", start_time))
  return _plugin_value(HPARAMS_START_TAG, "hparams", _bytes_field(3, info), _EMPTY_FLOATS)


def hparams_end_value(end_time: float, status: int = STATUS_SUCCESS) -> bytes:
  """The HParams plugin's session end (`status`: 1 success)."""
  info = _field(1, 0, _varint(status)) + _field(2, 1, struct.pack("<d", end_time))
  return _plugin_value(HPARAMS_END_TAG, "hparams", _bytes_field(4, info), _EMPTY_FLOATS)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
  n = shift = 0
  while True:
    b = buf[pos]
    n |= (b & 0x7F) << shift
    pos, shift = pos + 1, shift + 7
    if not b & 0x80:
      return n, pos


def _fields(buf: bytes) -> Iterator[tuple[int, bytes | int]]:
  pos = 0
  while pos < len(buf):
    key, pos = _read_varint(buf, pos)
    number, wire = key >> 3, key & 7
    if wire == 0:
      value, pos = _read_varint(buf, pos)
    elif wire in (1, 5):
      size = 8 if wire == 1 else 4
      value, pos = buf[pos:pos + size], pos + size
    elif wire == 2:
      size, pos = _read_varint(buf, pos)
      value, pos = buf[pos:pos + size], pos + size
    else:
      raise ValueError(f"unsupported protocol buffer wire type {wire}")
    yield number, value


def parse_event(data: bytes) -> tuple[float, int, dict[str, float]]:
  """(wall_time, step, {tag: simple_value}) of an encoded Event."""
  wall, step, scalars = 0.0, 0, {}
  for number, value in _fields(data):
    if number == 1:
      (wall,) = struct.unpack("<d", value)
    elif number == 2:
      step = value
    elif number == 5:
      for _, v in _fields(value):
        parts = dict(_fields(v))
        if 1 in parts and 2 in parts:
          scalars[parts[1].decode()] = struct.unpack("<f", parts[2])[0]
  return wall, step, scalars


# -- the writer of one output folder ------------------------------------------------------------------
def event_files(directory: str) -> list[str]:
  if not os.path.isdir(directory):
    return []
  return sorted(os.path.join(directory, n) for n in os.listdir(directory)
                if n.startswith(FILE_PREFIX) and n.endswith(FILE_SUFFIX))


def read_events(directory: str) -> list[tuple[float, int, dict[str, float]]]:
  """The events of every event file this module wrote in `directory`, in file order."""
  return [parse_event(d) for path in event_files(directory) for d in read_frames(path)]


class _Totals:
  """Running sums of the per-step scalars."""

  def __init__(self):
    self.cer = self.comp = self.comp_paper = self.growth = self.growth_macs = 0.0

  def scalars(self, r: dict) -> dict[str, float]:
    """The per-step scalars of record `r` (a Record dict), the records before it summed."""
    self.cer += r["test_error"]
    self.comp += r["train_flops"] + r.get("trigger_flops", 0.0)
    self.comp_paper += r["train_macs"] + r.get("trigger_macs", 0.0)
    self.growth += r.get("growth_flops", 0.0)
    self.growth_macs += r.get("growth_macs", 0.0)
    return {f"{STREAM}test_error": r["test_error"], f"{STREAM}cer": self.cer,
            f"{STREAM}num_params": r["num_params"],
            f"{STREAM}comp_paper_tflops": self.comp_paper * 1e-12,
            f"{STREAM}comp_tflops": self.comp * 1e-12,
            f"{STREAM}comp_total_tflops": (self.comp + self.growth) * 1e-12,
            f"{STREAM}comp_paper_total_tflops": (self.comp_paper + self.growth_macs) * 1e-12,
            f"{STREAM}wall_s": r["wall_s"]}


def _kept_epochs(events, last_t: int) -> tuple[list, list]:
  """The per-epoch events of the stages at t <= last_t (those the records hold), and those of
  later stages (cut short), each in the order written."""
  epochs = [e for e in events if f"{EPOCH}t" in e[2]]
  return ([e for e in epochs if e[2][f"{EPOCH}t"] <= last_t],
          [e for e in epochs if e[2][f"{EPOCH}t"] > last_t])


class Writer:
  """Appends the scalars of one seed's run to its event file in `directory`."""

  def __init__(self, directory: str, records: Sequence[dict]):
    """Rewrites the directory's event file to match `records` (the records resumed with)."""
    self.directory = directory
    old_files = event_files(directory)
    old = read_events(directory)
    walls = {(step, tag): wall for wall, step, scalars in old for tag in scalars}
    last_t = int(records[-1]["t"]) if records else -1
    self.last_t = max(last_t, 0)
    epochs, self.dropped = _kept_epochs(old, last_t)
    self.epochs = max((step for _, step, _ in epochs), default=0)
    self.path = os.path.join(directory, f"{FILE_PREFIX}{int(time.time()):010d}{FILE_SUFFIX}")
    frames = [frame(event(time.time(), file_version="brain.Event:2"))]
    self.totals = _Totals()
    for r in records:
      wall = walls.get((int(r["t"]), f"{STREAM}test_error"), time.time())
      frames.append(frame(event(wall, int(r["t"]), self.totals.scalars(r))))
    frames += [frame(event(w, s, sc)) for w, s, sc in epochs]
    with io_utils.output_errors(self.path), io_utils.atomic_writer(self.path, "wb") as f:
      f.write(b"".join(frames))
    for path in old_files:
      if path != self.path:
        os.unlink(path)

  def _append(self, data: bytes) -> None:
    with io_utils.output_errors(self.path), open(self.path, "ab",
                                                  opener=io_utils.open_regular_fd) as f:
      f.write(frame(data))
      f.flush()

  def step(self, record: dict) -> None:
    """The per-step scalars of `record` (a Record dict, the one after the last written)."""
    self.last_t = int(record["t"])
    self._append(event(time.time(), self.last_t, self.totals.scalars(record)))

  def config(self, config: dict) -> None:
    """The resolved config (`workdir.config_dict`): a Markdown table of its fields as text
    `config`, and its fields (dotted paths; lists and dicts as JSON) as the run's
    hyperparameters."""
    flat = flatten(config)
    rows = "\n".join(f"| `{k}` | `{json.dumps(v, sort_keys=True, default=repr)}` |"
                     for k, v in flat.items())
    hparams = {k: v if isinstance(v, (bool, int, float, str)) else
               json.dumps(v, sort_keys=True, default=repr) for k, v in flat.items()}
    now = time.time()
    self._append(event(now, 0, values=[text_value("config", f"| field | value |\n|---|---|\n"
                                                            f"{rows}"),
                                       hparams_start_value(hparams, now)]))

  def summary(self, summary: dict) -> None:
    """Every number of `summary` (a seed's summary.json; nested ones by dotted path) as
    `summary/<metric>` at the last step written, and the end of the HParams session."""
    scalars = {f"{SUMMARY}{k}": float(v) for k, v in flatten(summary).items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)
               and math.isfinite(float(v))}
    now = time.time()
    self._append(event(now, self.last_t, scalars, values=[hparams_end_value(now)]))

  def stage_resumed(self, t: int, epoch: int) -> None:
    """The stage at `t` continues from its save at epoch `epoch`: its epochs before that one,
    which the file had before the rewrite dropped them, are written again (their scalars and
    wall times; steps after the epochs written since)."""
    again = [e for e in self.dropped if e[2].get(f"{EPOCH}t") == t][:max(epoch - 1, 0)]
    self.dropped = []
    for wall, _, scalars in again:
      self.epochs += 1
      self._append(event(wall, self.epochs, scalars))

  def epoch(self, t: int, scalars: dict[str, float]) -> None:
    """Per-epoch scalars (tags below `epoch/`; non-finite ones left out) of an epoch of the
    stage at `t`."""
    self.epochs += 1
    values = {f"{EPOCH}{k}": float(v) for k, v in dict(scalars, t=t).items()
              if math.isfinite(float(v))}
    self._append(event(time.time(), self.epochs, values))
