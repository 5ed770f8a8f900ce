"""Reading an offline W&B run file: the protobuf `Record`s of a run's `.wandb` file, in order.

wandb 0.31 writes no `files/config.yaml` or `wandb-summary.json` for an offline run (those come
from `wandb sync`); everything is in the `.wandb` file, a LevelDB-style log of protobuf records,
read here with wandb's own protobuf classes. Callers skip when wandb is not installed.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# The log format of wandb's .wandb files (32 KiB blocks, 7-byte record headers).
_FILE_HEADER = struct.Struct("<4sHB")  # b":W&B", magic 0xBEE1, version 0
_RECORD_HEADER = struct.Struct("<IHB")  # checksum, length, type (full / first / middle / last)
_BLOCK = 32768


def offline_records(path: Path) -> Iterator[Any]:
    """The protobuf Records of an offline run's .wandb file, in order."""
    from wandb.proto import wandb_internal_pb2 as wandb_pb

    raw = path.read_bytes()
    ident, magic, version = _FILE_HEADER.unpack_from(raw)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    pos, pending = _FILE_HEADER.size, b""
    while pos + _RECORD_HEADER.size <= len(raw):
        left = _BLOCK - pos % _BLOCK
        if left < _RECORD_HEADER.size:  # block trailer padding
            pos += left
            continue
        _, length, kind = _RECORD_HEADER.unpack_from(raw, pos)
        if length == 0 and kind == 0:  # zero padding up to the next block
            pos += left
            continue
        data = raw[pos + _RECORD_HEADER.size:pos + _RECORD_HEADER.size + length]
        pos += _RECORD_HEADER.size + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_pb.Record()
            record.ParseFromString(pending + data)
            pending = b""
            yield record
        else:  # first or middle piece
            pending += data
