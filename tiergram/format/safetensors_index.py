"""Where each tensor of a (sharded) safetensors checkpoint lies on disk, from the headers alone (never mapped)."""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_MAX_HEADER = 256 << 20  # a header larger than this is a corrupt length field, not a checkpoint
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
               "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}


@dataclass(frozen=True)
class TensorLocation:
    """One tensor's bytes: file, absolute byte offset and size, dtype and shape."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute, from the start of the file
    nbytes: int


def read_header(path: Path) -> dict[str, TensorLocation]:
    """{tensor name: location} of one safetensors file; ValueError for a broken header or a truncated shard."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path}: {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > min(_MAX_HEADER, size - 8):
            raise ValueError(f"{path}: header length {n:,} exceeds the file ({size:,} bytes): not a safetensors "
                             "file, or truncated")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: the safetensors header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header is not a JSON object")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (lo, hi) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: tensor {name!r} has a malformed header entry {info!r}") from None
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        count = math.prod(shape)
        if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi) or hi - lo != count * DTYPE_BYTES[dtype]:
            raise ValueError(f"{path}: tensor {name!r} {dtype} {list(shape)} has data_offsets {[lo, hi]}, which do "
                             f"not span its {count * DTYPE_BYTES[dtype]:,} bytes")
        start = 8 + n + lo
        if start + (hi - lo) > size:
            raise ValueError(f"{path}: tensor {name!r} ends at byte {start + hi - lo:,} but the file has {size:,} "
                             "bytes: the shard is truncated")
        out[name] = TensorLocation(name, path, dtype, shape, start, hi - lo)
    return out


def locate_tensors(ckpt_dir: str | os.PathLike, names: list[str]) -> dict[str, TensorLocation]:
    """Locations of `names` in a (sharded) checkpoint directory; ValueError names a missing tensor or shard."""
    root = Path(ckpt_dir)
    index = root / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a safetensors index (no readable 'weight_map': {e})") from None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: 'weight_map' is not an object")
    elif (root / SINGLE).is_file():
        weight_map = dict.fromkeys(read_header(root / SINGLE), SINGLE)
    else:
        raise ValueError(f"{root}: no {INDEX} and no {SINGLE}: not a safetensors checkpoint")
    where = index.name if index.is_file() else SINGLE
    missing = [n for n in names if n not in weight_map]
    if missing:
        raise ValueError(f"{root}: tensor {missing[0]!r} is not in the checkpoint ({where} lists {len(weight_map)} "
                         "tensors)")
    headers: dict[str, dict[str, TensorLocation]] = {}
    out = {}
    for name in names:
        shard = str(weight_map[name])
        if shard not in headers:
            path = root / shard
            if Path(shard).is_absolute() or ".." in Path(shard).parts:
                raise ValueError(f"{root / where}: shard name {shard!r} for {name!r} leaves the checkpoint directory")
            if not path.is_file():
                raise ValueError(f"{path}: shard of tensor {name!r} (named in {where}) does not exist")
            headers[shard] = read_header(path)
        if name not in headers[shard]:
            raise ValueError(f"{root / shard}: {where} places tensor {name!r} in this shard but its header has no "
                             "such tensor")
        out[name] = headers[shard][name]
    return out
