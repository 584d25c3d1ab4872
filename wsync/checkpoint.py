"""Safetensors files and Hugging Face checkpoint folders, read by mmap and written atomically.

We parse safetensors ourselves (an 8-byte header length, a JSON header, then
raw little-endian data) because the codecs want bit-pattern views of every
dtype, bf16 and fp8 included, without a copy and without torch. Files we write
load with the `safetensors` library unchanged.

Folders are written next to their destination and swapped in whole
(fsutil.replace_folder); a shard name, from our own layout, a payload's or an
index, must be a plain ``*.safetensors`` file name, so it cannot point outside
the folder; an existing destination is replaced only if wsync wrote it.
"""
from __future__ import annotations

import json
import mmap
import os
import shutil
import stat
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import dtypes, safejson
from .bits import State, TensorBits
from .errors import FormatError
from .fsutil import MARKER, TEMP_TAG, atomic_write, check_inside, check_output, child, clean_stale, \
    plain_name, replace_folder, temp_sibling

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER = 100 << 20  # the safetensors library's own limit
RESERVED = ("__metadata__",)  # header keys safetensors keeps for itself: a tensor so named would vanish


@dataclass
class Checkpoint:
    state: State
    layout: dict[str, str] | None = None  # tensor name -> shard file, for folders
    metadata: dict[str, str] = field(default_factory=dict)  # safetensors __metadata__ (first shard)


def check_tensor_names(names) -> None:
    """Refuse a tensor name safetensors reserves: written, it would silently replace the file's metadata."""
    for r in RESERVED:
        if r in names:
            raise FormatError(f"tensor name {r!r} is reserved by safetensors (its header keeps file metadata "
                              f"under it), so no checkpoint could hold it; rename the tensor")


def shard_name(name, tensor: str | None = None) -> str:
    """name, if it can be a shard of a folder we write or read: a plain file name ending in .safetensors."""
    what = "shard file name" + (f" (of tensor {tensor!r})" if tensor is not None else "")
    plain_name(name, what)
    if not name.endswith(".safetensors"):
        raise FormatError(f"{what} {name!r} refused: a shard must be a plain file name ending in .safetensors")
    return name


def read_safetensors(path, *, private: bool = False) -> tuple[State, dict[str, str]]:
    """The tensors of a safetensors file as views of one mapping of it (no copy), and its metadata.

    private: a copy-on-write mapping, writable, whose writes stay in this process (the file never
    changes); only the pages written become this process's own memory. Default: read-only."""
    path = Path(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise FormatError(f"{path}: {size} bytes is too short for a safetensors file")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY if private else mmap.ACCESS_READ)
    (hlen,) = struct.unpack_from("<Q", mm)
    if hlen > MAX_HEADER or 8 + hlen > size:
        raise FormatError(f"{path}: header length {hlen} does not fit a {size}-byte file")
    try:
        header = safejson.loads(mm[8 : 8 + hlen], what=f"{path}: header")
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
    check_tensor_names(state)
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


def read_checkpoint(path, *, inside=None, private: bool = False) -> Checkpoint:
    """A .safetensors file, or a folder with model.safetensors or a sharded index, mapped (read_safetensors).

    inside: a folder every file read must resolve into (FormatError otherwise), so
    a symlink cannot make a reader of one folder read files from elsewhere.
    private: writable copy-on-write mappings (see read_safetensors)."""
    path = Path(path)

    def checked(p: Path) -> Path:
        return p if inside is None else check_inside(inside, p)

    if path.is_file():
        state, meta = read_safetensors(checked(path), private=private)
        return Checkpoint(state, None, meta)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such safetensors file or checkpoint folder")
    if (path / INDEX_NAME).is_file():
        return _read_sharded(path, checked, private)
    if (path / SINGLE_NAME).is_file():
        state, meta = read_safetensors(checked(path / SINGLE_NAME), private=private)
        return Checkpoint(state, {n: SINGLE_NAME for n in state}, meta)
    raise FileNotFoundError(f"{path}: folder has neither {SINGLE_NAME} nor {INDEX_NAME}")


def _read_sharded(path: Path, checked, private: bool = False) -> Checkpoint:
    try:
        weight_map = safejson.loads(checked(path / INDEX_NAME).read_text(), what=str(path / INDEX_NAME))["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        raise FormatError(f"{path / INDEX_NAME}: not a safetensors index ({e})") from None
    state, meta, seen = {}, {}, {}
    for shard in shards:
        try:
            shard_name(shard)
        except FormatError as e:
            raise FormatError(f"{path / INDEX_NAME}: {e}") from None
        tensors, m = read_safetensors(checked(path / shard), private=private)
        meta = meta or m
        for name, tb in tensors.items():
            state[name] = tb
            seen[name] = shard
    if seen != weight_map:
        missing = sorted(set(weight_map) - set(seen))[:5]
        raise FormatError(f"{path}: index and shards disagree (e.g. {missing or sorted(set(seen) - set(weight_map))[:5]})")
    return Checkpoint(state, dict(weight_map), meta)


def write_checkpoint(path, ckpt: Checkpoint, *, copy_from=None, extra: dict[str, bytes] | None = None) -> None:
    """Write a .safetensors file, or (when `path` has no suffix) a checkpoint folder.

    Folders follow ckpt.layout (one shard per file name, plus an index when there
    is more than one) and receive copies of copy_from's other files (config,
    tokenizer) and the `extra` files (name -> bytes). The folder appears complete
    or not at all, and replaces only a folder wsync wrote (fsutil.check_output):
    this is the one place `delta apply` and `pull` write folders. `extra` is for
    folders only.
    """
    path = Path(path)
    if path.suffix == ".safetensors":
        write_safetensors(path, ckpt.state, ckpt.metadata)
        return
    shards = _shards(ckpt)
    for name in extra or {}:
        if name in shards or name in (INDEX_NAME, MARKER):
            raise FormatError(f"extra file {name!r} would overwrite a file of the checkpoint itself")
    path = Path(os.path.abspath(path))  # "-o ." is the folder cwd names, beside its siblings (links not resolved)
    check_output(path)  # refuse before writing anything
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(path)  # a killed run's temp folder, if its process is gone
    tmp = temp_sibling(path, folder=True)  # same filesystem: the swap is atomic
    try:
        _copy_others(copy_from, tmp)
        for shard, tensors in shards.items():
            write_safetensors(child(tmp, shard, "shard file name"), tensors, ckpt.metadata)
        if len(shards) > 1 or SINGLE_NAME not in shards:
            weight_map = {n: shard for shard, tensors in shards.items() for n in tensors}
            index = {"metadata": {"total_size": sum(tb.nbytes for tb in ckpt.state.values())},
                     "weight_map": dict(sorted(weight_map.items()))}
            with atomic_write(tmp / INDEX_NAME) as f:
                f.write(json.dumps(index, indent=2).encode())
        for name, data in (extra or {}).items():
            with atomic_write(child(tmp, name, "extra file name")) as f:
                f.write(data)
        replace_folder(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def prepare_output(path) -> None:
    """For commands that will write_checkpoint(path), before their work: refuse what write_checkpoint
    would refuse, and remove what a killed earlier run left beside path (fsutil.clean_stale)."""
    path = Path(os.path.abspath(path))
    if path.suffix != ".safetensors":
        check_output(path)
    clean_stale(path)


def _shards(ckpt: Checkpoint) -> dict[str, State]:
    """The tensors of each shard file, every file name checked before it can become a path."""
    layout = ckpt.layout or {}
    shards: dict[str, State] = {}
    for name, tb in ckpt.state.items():
        shard = layout.get(name, SINGLE_NAME)
        if shard not in shards:
            shard_name(shard, name)
        shards.setdefault(shard, {})[name] = tb
    return shards


def _copy_others(copy_from, tmp: Path) -> None:
    """The base folder's other files (config, tokenizer), not its weights or wsync's own files.

    A file is read only if it lies in the base folder, links resolved: a link
    to a file elsewhere in it is copied as that file, a link out of it is
    skipped (and said), so a base folder cannot make wsync copy a file from
    anywhere else on the machine into the output."""
    if copy_from is None or not Path(copy_from).is_dir():
        return
    base = Path(copy_from)
    for f in sorted(base.iterdir()):
        if f.suffix == ".safetensors" or f.name in (INDEX_NAME, MARKER) or TEMP_TAG in f.name or not f.is_file():
            continue
        real, top = f.resolve(), base.resolve()
        if top not in real.parents:
            print(f"wsync: not copying {f.name}: it is a symlink to {real}, outside {base}", file=sys.stderr)
            continue
        try:
            fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as e:  # it became a link since: not followed
            print(f"wsync: not copying {f.name} from {base}: {e}", file=sys.stderr)
            continue
        with os.fdopen(fd, "rb") as src:
            st = os.fstat(src.fileno())
            if not stat.S_ISREG(st.st_mode):
                continue
            with open(tmp / f.name, "xb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
                os.fchmod(dst.fileno(), stat.S_IMODE(st.st_mode))
                dst.flush()
                os.fsync(dst.fileno())
        os.utime(tmp / f.name, ns=(st.st_atime_ns, st.st_mtime_ns))
