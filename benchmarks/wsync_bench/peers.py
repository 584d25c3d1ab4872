"""What others ship for delta weight sync, run side by side with the same data.

The delta codec claims to beat what RL frameworks already use, so the claim is
measured against faithful re-implementations of those schemes, plus the
information-theoretic bound it is chasing:

- ``xor_zstd``: slime's disk-delta sync. Per tensor, XOR of the old and new
  bytes, zstd level 1, unchanged tensors left out
  (THUDM/slime ``slime/backends/megatron_utils/update_weight/update_weight_from_disk_delta.py``,
  ``_encode_delta``: ``diff = new ^ old`` on the uint8 view, then
  ``zstandard.ZstdCompressor(level=1).compress(diff)``).
- ``pulse``: PULSESync (Miahi & Belilovsky, arXiv 2602.03839) as deployed in
  one-covenant/grail ``grail/infrastructure/sparse_codec.py``: sorted indices of
  changed elements, gap-coded, downscaled to the narrowest unsigned type that
  fits, followed by the new values' raw bits; all tensors in one buffer and one
  zstd level-1 frame over it. ``pulse_v2`` is the same without downscaling
  (grail's ``encode_sparse_delta_v2``: int32 gaps).
- ``zipnn``: the zipnn library's delta mode (``ZipNN(delta_compressed_type=
  "byte")``, ``compress(new, delta_second_data=base)``), which XORs the
  buffers and byte-groups + Huffman-codes the result (zipnn/zipnn
  ``tests/simple_tests.py`` "Delta(byte)", ``scripts/zipnn_compress_file_delta.py``).
- ``raw``: the new bytes verbatim, the baseline every ratio is against.

A state is ``dict[str, np.ndarray]`` of flat unsigned bit-pattern views
(uint16 for bf16/fp16, uint32 for fp32, uint8 for fp8). Blobs use one tiny
length-prefixed layout of ours (never pickle) and decode only against the base
they were made from.
"""
from __future__ import annotations

import math
import struct
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import zstandard

from wsync.codecs import delta_ref
from wsync.errors import BackendUnavailable, FormatError, MismatchError

State = dict[str, np.ndarray]

_UNSIGNED = {np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32), np.dtype(np.uint64)}


def check_pair(base: State, new: State) -> None:
    """Same names, dtypes and sizes, flat unsigned bit patterns: what every peer assumes."""
    if base.keys() != new.keys():
        raise MismatchError(f"tensor names differ: {sorted(base.keys() ^ new.keys())[:5]}")
    for name, b in base.items():
        n = new[name]
        if b.dtype != n.dtype or b.shape != n.shape or b.ndim != 1:
            raise MismatchError(f"{name}: base {b.dtype}{b.shape} vs new {n.dtype}{n.shape}; "
                                f"both must be the same flat array")
        if b.dtype not in _UNSIGNED:
            raise MismatchError(f"{name}: dtype {b.dtype} is not a bit-pattern view; "
                                f"pass arr.view(np.uint16) (bf16/fp16), uint32 (fp32) or uint8 (fp8)")


# --- the blob layout: magic | u32 count | count x (u16 len, name, u64 len, payload) ---

def pack_frames(magic: bytes, frames: list[tuple[str, bytes]]) -> bytes:
    parts = [magic, struct.pack("<I", len(frames))]
    for name, payload in frames:
        raw = name.encode()
        parts += [struct.pack("<H", len(raw)), raw, struct.pack("<Q", len(payload)), payload]
    return b"".join(parts)


def unpack_frames(magic: bytes, blob) -> list[tuple[str, memoryview]]:
    mv = memoryview(blob)
    if bytes(mv[:4]) != magic:
        raise FormatError(f"bad magic {bytes(mv[:4])!r}, expected {magic!r}")
    pos, (count,) = 8, _unpack("<I", mv, 4)
    frames = []
    for _ in range(count):
        (nlen,) = _unpack("<H", mv, pos)
        name = bytes(_take(mv, pos + 2, nlen)).decode()
        (plen,) = _unpack("<Q", mv, pos + 2 + nlen)
        pos += 10 + nlen
        frames.append((name, _take(mv, pos, plen)))
        pos += plen
    if pos != len(mv):
        raise FormatError(f"{len(mv) - pos} trailing bytes after {count} frames")
    return frames


def _take(mv: memoryview, pos: int, n: int) -> memoryview:
    # Lengths come off the wire; a lying one must not read past the end.
    if pos + n > len(mv):
        raise FormatError(f"truncated: need {n} bytes at offset {pos}, have {len(mv) - pos}")
    return mv[pos:pos + n]


def _unpack(fmt: str, mv: memoryview, pos: int) -> tuple:
    return struct.unpack(fmt, _take(mv, pos, struct.calcsize(fmt)))


def _frames_to_state(base: State, frames, rebuild) -> State:
    """Tensors a blob leaves out are unchanged; the rest are rebuilt from (base, payload)."""
    payloads = dict(frames)
    if len(payloads) != len(frames) or not payloads.keys() <= base.keys():
        extra = sorted(payloads.keys() - base.keys())
        raise MismatchError(f"blob names tensors twice or ones the base lacks: {extra[:5]}")
    return {name: rebuild(b, payloads[name]) if name in payloads else b.copy() for name, b in base.items()}


def _bits_from(payload, like: np.ndarray) -> np.ndarray:
    if len(payload) != like.nbytes:
        raise FormatError(f"payload is {len(payload)} bytes, tensor is {like.nbytes}")
    return np.frombuffer(payload, dtype=like.dtype)


# --- peers ---------------------------------------------------------------------

class Peer(ABC):
    """One compression scheme: encode (base, new) to bytes, decode (base, bytes) to new."""

    name: str = ""

    def available(self) -> bool:
        return True

    @property
    def why_unavailable(self) -> str:
        return ""

    @abstractmethod
    def encode(self, base: State, new: State) -> bytes: ...

    @abstractmethod
    def decode(self, base: State, blob: bytes) -> State: ...


class RawPeer(Peer):
    name = "raw"

    def encode(self, base: State, new: State) -> bytes:
        check_pair(base, new)
        return pack_frames(b"WPRW", [(k, v.tobytes()) for k, v in new.items()])

    def decode(self, base: State, blob: bytes) -> State:
        return _frames_to_state(base, unpack_frames(b"WPRW", blob), lambda b, p: _bits_from(p, b).copy())


@dataclass(kw_only=True)
class XorZstdPeer(Peer):
    # slime hard-codes level 1: the diff is mostly zero bytes, so higher levels buy little.
    level: int = 1
    name: str = "xor_zstd"

    def encode(self, base: State, new: State) -> bytes:
        check_pair(base, new)
        cctx = zstandard.ZstdCompressor(level=self.level)
        frames = []
        for name, n in new.items():
            diff = np.bitwise_xor(n, base[name])
            if diff.any():  # slime ships only tensors that changed
                frames.append((name, cctx.compress(diff)))
        return pack_frames(b"WPXZ", frames)

    def decode(self, base: State, blob: bytes) -> State:
        dctx = zstandard.ZstdDecompressor()

        def rebuild(b: np.ndarray, payload) -> np.ndarray:
            diff = _zstd_decompress(dctx, payload, b.nbytes)
            return np.bitwise_xor(b, _bits_from(diff, b))

        return _frames_to_state(base, unpack_frames(b"WPXZ", blob), rebuild)


def _zstd_decompress(dctx, payload, max_size: int) -> bytes:
    try:
        # A frame that claims more than the tensor could need is refused before
        # zstd allocates for it.
        claimed = zstandard.frame_content_size(payload)
        if claimed > max_size:
            raise FormatError(f"zstd frame claims {claimed} bytes, at most {max_size} expected")
        return dctx.decompress(payload, max_output_size=max_size)
    except zstandard.ZstdError as e:
        raise FormatError(f"zstd frame does not decode: {e}") from e


# Index codes for PULSE gaps; grail picks uint8/uint16/int32 by the largest value.
_GAP_DTYPES = [np.dtype("<u1"), np.dtype("<u2"), np.dtype("<u4"), np.dtype("<u8")]


@dataclass(kw_only=True)
class PulsePeer(Peer):
    # True: narrowest unsigned gap type (grail's v3.1 "optimal" idea, on flat
    # indices because a flat state has no row length); False: int32 gaps as in
    # grail's v2, int64 where a tensor has >= 2**31 elements.
    downscale: bool = True
    level: int = 1
    name: str = "pulse"

    def encode(self, base: State, new: State) -> bytes:
        check_pair(base, new)
        frames = []
        for name, n in new.items():
            idx = np.flatnonzero(n != base[name])
            if idx.size:  # grail leaves unchanged tensors out of the patch
                frames.append((name, self._tensor_record(idx, n[idx])))
        payload = pack_frames(b"WPPS", frames)
        return b"WPPZ" + zstandard.ZstdCompressor(level=self.level).compress(payload)

    def _tensor_record(self, idx: np.ndarray, values: np.ndarray) -> bytes:
        # First entry absolute, then gaps: sorted indices become small integers.
        gaps = np.diff(idx, prepend=0)
        code = self._gap_code(int(gaps.max()), int(idx[-1]))
        head = struct.pack("<QB", idx.size, code)
        return head + gaps.astype(_GAP_DTYPES[code]).tobytes() + values.tobytes()

    def _gap_code(self, max_gap: int, max_index: int) -> int:
        if not self.downscale:
            return 2 if max_index < 2**31 else 3
        return next(c for c, dt in enumerate(_GAP_DTYPES) if max_gap <= np.iinfo(dt).max)

    def decode(self, base: State, blob: bytes) -> State:
        mv = memoryview(blob)
        if bytes(mv[:4]) != b"WPPZ":
            raise FormatError(f"bad magic {bytes(mv[:4])!r}, expected b'WPPZ'")
        dctx = zstandard.ZstdDecompressor()
        # The patch can never be bigger than every tensor sent as (u64 index, value).
        limit = 8 + sum(len(k.encode()) + 19 + 8 * v.size + v.nbytes for k, v in base.items())
        payload = _zstd_decompress(dctx, mv[4:], limit)
        return _frames_to_state(base, unpack_frames(b"WPPS", payload), _pulse_apply)


def _pulse_apply(b: np.ndarray, rec) -> np.ndarray:
    count, code = _unpack("<QB", rec, 0)
    if code >= len(_GAP_DTYPES) or count > b.size:
        raise FormatError(f"bad PULSE record: {count} entries, gap code {code}, tensor of {b.size}")
    gap_dt = _GAP_DTYPES[code]
    if len(rec) != 9 + count * (gap_dt.itemsize + b.itemsize):
        raise FormatError(f"PULSE record is {len(rec)} bytes, header promises {count} entries")
    gaps = np.frombuffer(rec, dtype=gap_dt, count=count, offset=9)
    values = np.frombuffer(rec, dtype=b.dtype, count=count, offset=9 + count * gap_dt.itemsize)
    idx = np.cumsum(gaps, dtype=np.uint64)
    # Out-of-range positions would write outside the tensor: refuse, do not clip.
    if count and (idx.max() >= b.size or (count > 1 and not gaps[1:].all())):
        raise FormatError("PULSE indices out of range or not strictly increasing")
    out = b.copy()
    out[idx.astype(np.int64)] = values
    return out


# zipnn picks its byte grouping from a dtype name; 16-bit patterns are assumed
# bf16 (the RL case). Any name is still lossless: grouping only moves bytes.
_ZIPNN_DTYPE = {1: "float8_e4m3fn", 2: "bfloat16", 4: "float32"}


@dataclass(kw_only=True)
class ZipnnPeer(Peer):
    # 0 lets zipnn choose (min(cpu_count, 16)); the other peers are single-threaded.
    threads: int = 0
    name: str = "zipnn"

    def available(self) -> bool:
        return not self.why_unavailable

    @property
    def why_unavailable(self) -> str:
        try:
            import zipnn  # noqa: F401
        except Exception as e:  # a broken wheel raises more than ImportError
            return (f"zipnn not importable ({type(e).__name__}: {e}); pip install -e './benchmarks[all]' "
                    "(zipnn builds from source: needs a C compiler)")
        return ""

    def _codec(self, itemsize: int):
        if not self.available():
            raise BackendUnavailable(self.why_unavailable)
        if itemsize not in _ZIPNN_DTYPE:
            raise MismatchError(f"zipnn has no {8 * itemsize}-bit float mode")
        import zipnn

        return zipnn.ZipNN(input_format="byte", bytearray_dtype=_ZIPNN_DTYPE[itemsize],
                           delta_compressed_type="byte", threads=self.threads)

    def encode(self, base: State, new: State) -> bytes:
        check_pair(base, new)
        frames = []
        for name, n in new.items():
            # zipnn XORs the two buffers itself; that is its documented delta mode.
            blob = self._codec(n.itemsize).compress(n.view(np.uint8).data,
                                                    delta_second_data=base[name].view(np.uint8).data)
            frames.append((name, bytes(blob)))
        return pack_frames(b"WPZN", frames)

    def decode(self, base: State, blob: bytes) -> State:
        def rebuild(b: np.ndarray, payload) -> np.ndarray:
            try:
                out = self._codec(b.itemsize).decompress(bytes(payload), delta_second_data=b.view(np.uint8).data)
            except (ValueError, RuntimeError, IndexError) as e:
                raise FormatError(f"zipnn payload does not decode: {e}") from e
            return _bits_from(out, b).copy()

        return _frames_to_state(base, unpack_frames(b"WPZN", blob), rebuild)


PEERS: dict[str, Peer] = {p.name: p for p in [
    RawPeer(), XorZstdPeer(), PulsePeer(), PulsePeer(downscale=False, name="pulse_v2"), ZipnnPeer(),
]}


# --- the bound ------------------------------------------------------------------

def monotone_key(bits: np.ndarray) -> np.ndarray:
    """Unsigned float bit patterns -> keys of the same dtype, ordered like the floats.

    Negative patterns are inverted and positive ones get the sign bit set, so
    -0.0 sits just below +0.0 and key(new) - key(old) counts representable steps
    across zero and exponent boundaries alike.
    """
    if bits.dtype not in _UNSIGNED:
        raise TypeError(f"expected an unsigned bit-pattern array, got {bits.dtype}")
    return delta_ref.monotone_key(bits, "float")


def _h2(p: float) -> float:
    return 0.0 if p <= 0.0 or p >= 1.0 else -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def _steps(base: State, new: State) -> np.ndarray:
    parts = [np.zeros(0, np.int64)]
    for name, b in base.items():
        mask = new[name] != b
        kn, ko = monotone_key(new[name][mask]), monotone_key(b[mask])
        if kn.itemsize < 8:  # widths up to 32 bits: exact in int64
            parts.append(kn.astype(np.int64) - ko.astype(np.int64))
        else:  # 64-bit keys: the wrapped difference read as signed
            parts.append((kn - ko).view(np.int64))
    return np.concatenate(parts)


def entropy_bound_bits(base: State, new: State) -> dict:
    """Bits an ideal coder needs if positions are i.i.d. Bernoulli and steps i.i.d.

    Positions cost n_total * H2(density); steps cost n_changed * H(empirical step
    distribution), pooled over all tensors. Clustering of changes or per-tensor
    step statistics would let a coder go lower, so this is the bound for the
    model the delta codec assumes, not for every possible coder.
    """
    check_pair(base, new)
    steps = _steps(base, new)
    n_total = sum(b.size for b in base.values())
    n_changed = int(steps.size)
    density = n_changed / n_total if n_total else 0.0
    position_bits = n_total * _h2(density)
    _, counts = np.unique(steps, return_counts=True)
    p = counts / max(n_changed, 1)
    step_bits = n_changed * float(-(p * np.log2(p)).sum())
    total = position_bits + step_bits
    raw_bits = 8 * sum(n.nbytes for n in new.values())
    return {"n_total": n_total, "n_changed": n_changed, "density": density,
            "position_bits": position_bits, "step_bits": step_bits, "total_bits": total,
            "bits_per_changed": total / n_changed if n_changed else 0.0,
            "ratio_vs_raw": raw_bits / total if total else math.inf}


# --- measuring --------------------------------------------------------------------

def states_equal(a: State, b: State) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)


def _best_time(fn, repeats: int):
    best, result = math.inf, None
    for _ in range(max(repeats, 1)):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def run_peer(peer: Peer, base: State, new: State, repeats: int = 3) -> dict:
    """Size, speed and exactness of one peer on one (base, new) pair.

    Warms up once, then takes the best of ``repeats`` for encode and decode.
    GB/s is model bytes (the new state's nbytes) per second, 1 GB = 1e9 bytes.
    """
    if not peer.available():
        raise BackendUnavailable(f"peer {peer.name!r}: {peer.why_unavailable}")
    model_bytes = sum(n.nbytes for n in new.values())
    n_changed = sum(int(np.count_nonzero(new[k] != base[k])) for k in new)
    peer.decode(base, peer.encode(base, new))  # warm-up: imports, allocator, caches
    t_enc, blob = _best_time(lambda: peer.encode(base, new), repeats)
    t_dec, out = _best_time(lambda: peer.decode(base, blob), repeats)
    bits = 8 * len(blob)
    return {"name": peer.name, "bytes": len(blob), "exact": states_equal(out, new),
            "ratio_vs_raw": model_bytes / len(blob),
            "bits_per_changed": bits / n_changed if n_changed else math.inf,
            "encode_gbps": model_bytes / t_enc / 1e9 if t_enc > 0 else math.inf,
            "decode_gbps": model_bytes / t_dec / 1e9 if t_dec > 0 else math.inf}


# --- a synthetic RL step, and the table --------------------------------------------

def _bf16_bits(x: np.ndarray) -> np.ndarray:
    import torch  # the trainer's own cast (round to nearest even), not a re-derivation

    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def synthetic_rl_step(n: int = 16 * 2**20, lr: float = 1e-6, seed: int = 0,
                      update: str = "sign") -> tuple[State, State]:
    """(base, new) bf16 patterns around one optimizer step of an RL trainer.

    fp32 master weights ~ N(0, 0.02) take an Adam-like step and are re-cast to
    bf16. ``update="sign"``: every weight moves by exactly +-lr (Adam when
    gradients agree, and its first step). ``"adam_noise"``: lr * m/sqrt(v) for
    pure-noise gradients, ~N(0, sqrt((1-b1)/(1+b1))) = N(0, 0.23) at b1 = 0.9,
    the regime where most updates fall under half a bf16 ulp.
    A quarter of ``n`` is an embedding, the rest 12 equal matrices; 8 norm
    vectors at 1.0 never change at this lr, as in real models.
    """
    if update not in ("sign", "adam_noise"):
        raise ValueError(f"update must be 'sign' or 'adam_noise', got {update!r}")
    rng = np.random.default_rng(seed)
    sizes = {"embed": n // 4, **{f"layers.{i}.w": (n - n // 4) // 12 for i in range(12)}}
    base, new = {}, {}
    for name, size in sizes.items():
        master = rng.normal(0.0, 0.02, size).astype(np.float32)
        if update == "sign":
            ratio = rng.choice(np.array([-1.0, 1.0], np.float32), size)
        else:
            ratio = rng.normal(0.0, math.sqrt(0.1 / 1.9), size)
        step = (lr * ratio).astype(np.float32)
        base[name], new[name] = _bf16_bits(master), _bf16_bits(master + step)
    for i in range(8):
        ones = np.ones(1024, np.float32)
        base[f"layers.{i}.norm"], new[f"layers.{i}.norm"] = _bf16_bits(ones), _bf16_bits(ones + np.float32(lr))
    return base, new


def _table(base: State, new: State, repeats: int) -> str:
    bound = entropy_bound_bits(base, new)
    raw = sum(v.nbytes for v in new.values())
    lines = ["| peer | bytes | ratio vs raw | bits/changed | encode GB/s | decode GB/s | exact |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for peer in PEERS.values():
        if not peer.available():
            lines.append(f"| {peer.name} | skipped: {peer.why_unavailable} | | | | | |")
            continue
        r = run_peer(peer, base, new, repeats)
        lines.append(f"| {r['name']} | {r['bytes']:,} | {r['ratio_vs_raw']:.1f} | {r['bits_per_changed']:.2f} "
                     f"| {r['encode_gbps']:.2f} | {r['decode_gbps']:.2f} | {r['exact']} |")
    lines.append(f"| entropy bound | {bound['total_bits'] / 8:,.0f} | {bound['ratio_vs_raw']:.1f} "
                 f"| {bound['bits_per_changed']:.2f} | | | |")
    head = (f"{bound['n_total']:,} elements, {raw:,} bytes, density {bound['density']:.4%} "
            f"(positions {bound['position_bits'] / max(bound['n_changed'], 1):.2f} + "
            f"steps {bound['step_bits'] / max(bound['n_changed'], 1):.2f} bits/changed)")
    return head + "\n\n" + "\n".join(lines)


def add_parsers(bench) -> None:
    ap = bench.add_parser("peers", help="the peer schemes side by side on a synthetic RL step (no snapshots)",
                          description="peers side by side on a synthetic RL step",
                          epilog="Default 16Mi weights: a few seconds here (2 cores); --n sets the size.")
    ap.add_argument("--n", type=int, default=16 * 2**20, help="weights, bf16 elements (default 16Mi)")
    ap.add_argument("--lr", type=float, default=1e-6, help="learning rate of the step (default 1e-6)")
    ap.add_argument("--update", choices=["sign", "adam_noise"], default="sign",
                    help="sign: every weight moves by exactly +-lr; adam_noise: lr * m/sqrt(v) of noisy gradients "
                         "(default sign)")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds, best kept (default 3)")
    ap.set_defaults(fn=main)


def main(args) -> None:
    import os
    import platform

    print(f"# peers on {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
          f"numpy {np.__version__}, zstandard {zstandard.__version__}")
    print(f"synthetic RL step: lr {args.lr:g}, update {args.update}")
    print(_table(*synthetic_rl_step(args.n, args.lr, update=args.update), args.repeats))

