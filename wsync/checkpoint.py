"""Safetensors files and Hugging Face checkpoint folders, read by mmap and written atomically.

We parse safetensors ourselves (an 8-byte header length, a JSON header, then
raw little-endian data) because the codecs want bit-pattern views of every
dtype, bf16 and fp8 included, without a copy and without torch. Files we write
load with the `safetensors` library unchanged.
"""
from __future__ import annotations

import json
import mmap
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import dtypes
from .errors import FormatError
from .fsutil import atomic_write
from .bits import State, TensorBits

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER = 100 << 20  # the safetensors library's own limit


@dataclass
class Checkpoint:
    state: State
    layout: dict[str, str] | None = None  # tensor name -> shard file, for folders
    metadata: dict[str, str] = field(default_factory=dict)  # safetensors __metadata__ (first shard)


def read_safetensors(path) -> tuple[State, dict[str, str]]:
    path = Path(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise FormatError(f"{path}: {size} bytes is too short for a safetensors file")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    (hlen,) = struct.unpack_from("<Q", mm)
    if hlen > MAX_HEADER or 8 + hlen > size:
        raise FormatError(f"{path}: header length {hlen} does not fit a {size}-byte file")
    try:
        header = json.loads(mm[8 : 8 + hlen])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"{path}: header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data = np.frombuffer(mm, dtype=np.uint8, offset=8 + hlen)
    state = {name: _view(path, name, info, data) for name, info in header.items()}
    return state, metadata


def _view(path: Path, name: str, info, data: np.ndarray) -> TensorBits:
    try:
        dt = dtypes.by_name(info["dtype"])
        shape = tuple(int(s) for s in info["shape"])
        begin, end = (int(x) for x in info["data_offsets"])
    except (KeyError, TypeError, ValueError) as e:
        raise FormatError(f"{path}: bad header entry for {name!r}: {e}") from None
    nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if min(shape, default=0) < 0 or not 0 <= begin <= end <= len(data) or end - begin != nbytes:
        raise FormatError(f"{path}: tensor {name!r} {dt.name}{list(shape)} has bad data offsets [{begin}, {end}]")
    return TensorBits(dt, shape, data[begin:end].view(dt.bits_dtype))


def write_safetensors(path, state: State, metadata: dict[str, str] | None = None) -> None:
    """Write atomically; tensors aligned to 8 bytes in name order."""
    header, offset = {}, 0
    names = sorted(state)
    for name in names:
        tb = state[name]
        header[name] = {"dtype": tb.dtype.name, "shape": list(tb.shape), "data_offsets": [offset, offset + tb.nbytes]}
        offset += tb.nbytes
    if metadata:
        header["__metadata__"] = dict(metadata)
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)
    with atomic_write(path) as f:
        f.write(struct.pack("<Q", len(hbytes)))
        f.write(hbytes)
        for name in names:
            f.write(memoryview(state[name].bits).cast("B"))


def read_checkpoint(path) -> Checkpoint:
    """A .safetensors file, or a folder with model.safetensors or a sharded index."""
    path = Path(path)
    if path.is_file():
        state, meta = read_safetensors(path)
        return Checkpoint(state, None, meta)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such safetensors file or checkpoint folder")
    if (path / INDEX_NAME).is_file():
        return _read_sharded(path)
    if (path / SINGLE_NAME).is_file():
        state, meta = read_safetensors(path / SINGLE_NAME)
        return Checkpoint(state, {n: SINGLE_NAME for n in state}, meta)
    raise FileNotFoundError(f"{path}: folder has neither {SINGLE_NAME} nor {INDEX_NAME}")


def _read_sharded(path: Path) -> Checkpoint:
    try:
        weight_map = json.loads((path / INDEX_NAME).read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise FormatError(f"{path / INDEX_NAME}: not a safetensors index ({e})") from None
    state, meta, seen = {}, {}, {}
    for shard in sorted(set(weight_map.values())):
        if Path(shard).name != shard:
            raise FormatError(f"{path / INDEX_NAME}: shard name {shard!r} must be a plain file name")
        tensors, m = read_safetensors(path / shard)
        meta = meta or m
        for name, tb in tensors.items():
            state[name] = tb
            seen[name] = shard
    if seen != weight_map:
        missing = sorted(set(weight_map) - set(seen))[:5]
        raise FormatError(f"{path}: index and shards disagree (e.g. {missing or sorted(set(seen) - set(weight_map))[:5]})")
    return Checkpoint(state, dict(weight_map), meta)


def write_checkpoint(path, ckpt: Checkpoint, *, copy_from=None) -> None:
    """Write a .safetensors file, or (when `path` has no suffix) a checkpoint folder.

    Folders follow ckpt.layout (one shard per file name, plus an index when there
    is more than one) and receive copies of copy_from's other files (config,
    tokenizer). The folder appears complete or not at all.
    """
    path = Path(path)
    if path.suffix == ".safetensors":
        write_safetensors(path, ckpt.state, ckpt.metadata)
        return
    layout = ckpt.layout or {n: SINGLE_NAME for n in ckpt.state}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))  # same filesystem: the rename is atomic
    try:
        if copy_from is not None and Path(copy_from).is_dir():
            for f in Path(copy_from).iterdir():
                if f.is_file() and f.suffix != ".safetensors" and f.name != INDEX_NAME:
                    shutil.copy2(f, tmp / f.name)
        shards: dict[str, State] = {}
        for name, tb in ckpt.state.items():
            shards.setdefault(layout.get(name, SINGLE_NAME), {})[name] = tb
        for shard, tensors in shards.items():
            write_safetensors(tmp / shard, tensors, ckpt.metadata)
        if len(shards) > 1 or SINGLE_NAME not in shards:
            index = {"metadata": {"total_size": sum(tb.nbytes for tb in ckpt.state.values())}, "weight_map": dict(sorted(layout.items()))}
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2))
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
