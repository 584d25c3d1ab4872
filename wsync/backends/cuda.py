"""The CUDA backend: the delta format and the checksum as GPU kernels (csrc/delta_cuda.cu).

Why a GPU backend: the weights of a trainer and of a rollout engine already sit
in GPU memory, and a sync should not drag them through the host to find the 1%
that changed. The kernels are compiled at run time by NVRTC through cupy's
RawModule, so installing wsync needs no CUDA toolkit, only `wsync[cuda]`
(cupy-cuda12x and nvidia-cuda-nvrtc-cu12). The output is byte-identical to
``wsync.codecs.delta_ref``, which the test suite checks.

Two faces:
- the ``Kernels`` protocol (``delta_encode``, ``delta_decode``, ``checksum``) on
  numpy arrays, which copies them to the GPU and the results back, so the codec
  layer can run on this backend like on any other;
- GPU-native entry points on torch CUDA tensors (or cupy arrays), shared with
  torch through DLPack and run on torch's current stream for the tensor's own
  device, with no host copy: ``encode_device``, ``apply_device`` /
  ``restore_device``, ``digest_device`` / ``digests_device`` and
  ``fused_change_detect``. Their sections stay on the GPU (cupy arrays in a
  ``DeviceSections``); ``sections_to_host`` brings them back. The ``packed``
  tier's zstd stage runs on the host after that copy: only the `sparse`
  sections are built on the GPU.

The ``v2`` tier is decoded on the GPU too (``v2_decode`` in the protocol,
``v2_decode_device`` for a CUDA base; csrc/ws_v2_cuda.cu, a warp per chunk
whose lanes count and place the changes while one reads the codes with the C++
backend's own decoder); v2 is encoded on the host, by the C++ encoder (the
reference where the extension is not built).

Streams. Device sections and undo buffers are written on the stream that was
current when they were made, from torch's caching allocator for that stream.
Each carries ``ready``, an event recorded after the last kernel that writes
it: ``sections_to_host`` waits for it, ``apply_device`` / ``restore_device``
make the current stream wait for it, and ``use_on(stream)`` does both things a
reader on another stream needs (wait for the event, and record_stream so the
allocator does not hand the memory out while that stream still reads it).

The host-side choreography (launch order, prefix sums, validation, error
messages, devices, streams) lives in ``_Launcher`` and ``CudaKernels`` over a
small runtime interface, so the CPU tests run it unchanged: against the kernels
themselves on CPU fibers (tests/cudasim), and against a fake runtime that
records launches, streams, events and syncs (tests/test_cuda_streams.py).
"""
from __future__ import annotations

import functools
import os
import re
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..checksum import BLOCK, checksum as host_checksum, combine
from ..tables import as_array
from ..codecs import v2_ref
from ..codecs.delta_ref import DeltaSections, nchunks
from ..errors import BackendUnavailable, FormatError
from ..manifest import CHUNK_ELEMS
from .base import Composed
from .cpu import quant_dims, quant_refuse

INSTALL_HINT = "the GPU backend needs a CUDA driver and `pip install 'wsync[cuda]'` (cupy-cuda12x, nvidia-cuda-nvrtc-cu12)"
NT = 256  # threads per block in every kernel (ws::NT)
CHUNK_WORDS = CHUNK_ELEMS // 32  # mask words per chunk (ws::CHUNK_WORDS)
ERR_ESCAPES, ERR_TABLE = 1, 2  # bits of err[1] (ws::ERR_*)
LORA_KMAX = 32  # Omega columns per lora_range_bf16 pass (ws::LORA_KMAX)
NO_ERROR = np.uint64(2**64 - 1)  # err[0] when no change lands outside its chunk
ORDERS = ("float", "int", "uint")
QUANT_NAMES = {"BF16": "bf16", "F16": "f16", "F32": "f32"}  # the quant_*_<dt> kernels' weight dtypes
WIDTHS = {1: "u8", 2: "u16", 4: "u32", 8: "u64"}
NULL = np.uint64(0)  # a null pointer argument
# delta v2 (csrc/ws_v2_cuda.cu): a warp (one block of V2_BLOCK threads) per chunk. Per-chunk tables, in u32s
# (its TABLES): first, pop; per-chunk lane pointers (NCLASS * V2_BLOCK u32s).
V2_BLOCK = 32  # ws::v2::WL: the kernel is written for one warp per block
V2_TABLES = 2 * v2_ref.NCLASS + 1
V2_PTRS = v2_ref.NCLASS * V2_BLOCK
# scratch bytes of one chunk: rank u32, d i64, off u32, step i64 per element; tables; lane pointers
V2_CHUNK_SCRATCH = CHUNK_ELEMS * (4 + 8 + 4 + 8) + 4 * V2_TABLES + 4 * V2_PTRS
V2_SCRATCH_BYTES = 256 << 20  # chunks are decoded in launches whose scratch fits this, or the runtime's budget
V2_SCRATCH_MAX = 16 << 30  # the most scratch the cupy runtime's budget takes (a quarter of free memory below it)
V2_ERRORS = ("", "position bitstream ends early", "bits left over after the last code",  # ws::v2::Err, in order
             "more changes than the model declares", "steps for a chunk without changes", "rANS stream ends early",
             "rANS state outside [2^23, 2^31)", "rANS stream does not end where it should (corrupt)",
             "escape longer than a step of this width", "escape step does not fit the element",
             "a change has no element to sit at")


def csrc_dir() -> Path:
    """Where the kernel sources are: $WSYNC_CSRC, else wsync/_csrc (where a wheel would ship
    them), else csrc/ of the source checkout this package runs from."""
    if os.environ.get("WSYNC_CSRC"):
        return Path(os.environ["WSYNC_CSRC"])
    packaged = Path(__file__).resolve().parents[1] / "_csrc"
    return packaged if packaged.is_dir() else Path(__file__).resolve().parents[2] / "csrc"


KERNEL_SOURCES = ("delta_cuda.cu", "ws_v2_cuda.cu")  # the kernels of the runtime module, in csrc_dir()


def kernel_source(paths: list[Path] | None = None) -> str:
    """The kernel sources (KERNEL_SOURCES by default) as one string, their local headers inlined once.

    One self-contained string, because cupy caches compiled modules by source
    text: with -I includes, an edited header would keep serving a stale cubin.
    """
    paths = paths or [csrc_dir() / name for name in KERNEL_SOURCES]
    seen: set[str] = set()

    def expand(p: Path) -> str:
        out = []
        for line in p.read_text().splitlines():
            m = re.match(r'\s*#include\s+"([\w.]+)"', line)
            if m:
                if m.group(1) not in seen:
                    seen.add(m.group(1))
                    out.append(expand(p.parent / m.group(1)))
            elif line.strip() != "#pragma once":
                out.append(line)
        return "\n".join(out)

    return "\n".join(expand(p) for p in paths)


def check_table(n: int, table: np.ndarray, n_gaps: int, n_steps: int, n_escapes: int) -> tuple[np.ndarray, np.ndarray]:
    """The table checks of delta_ref.decode, with its messages; returns (counts, escape counts) as int64."""
    nc = nchunks(n)
    if len(table) != 2 * nc:
        raise FormatError(f"chunk table has {len(table)} entries, expected {2 * nc}")
    counts = table[:nc].astype(np.int64)
    esc_counts = table[nc:].astype(np.int64)
    clen = chunk_lengths(n)
    bad = np.flatnonzero((counts > clen) | (esc_counts > counts))
    if len(bad):
        c = int(bad[0])
        raise FormatError(f"chunk {c}: {counts[c]} changes, {esc_counts[c]} escapes for {clen[c]} elements")
    total, total_esc = int(counts.sum()), int(esc_counts.sum())
    if (n_gaps, n_steps, n_escapes) != (total, total, total_esc):
        raise FormatError(
            f"section sizes gaps={n_gaps} steps={n_steps} escapes={n_escapes} "
            f"disagree with the chunk table ({total} changes, {total_esc} escapes)"
        )
    return counts, esc_counts


def chunk_lengths(n: int) -> np.ndarray:
    nc = nchunks(n)
    clen = np.full(nc, CHUNK_ELEMS, dtype=np.int64)
    if nc:
        clen[-1] = n - (nc - 1) * CHUNK_ELEMS
    return clen


def exclusive(counts: np.ndarray) -> np.ndarray:
    """Where each chunk's entries start in a section (u64, as the kernels read it)."""
    return (np.cumsum(counts, dtype=np.uint64) - counts.astype(np.uint64)).astype(np.uint64)


def chunk_of(counts: np.ndarray, i: int) -> int:
    """The chunk that change #i belongs to (empty chunks share a start; the last of them owns it)."""
    return int(np.searchsorted(np.cumsum(counts) - counts, i, side="right") - 1)


def outside_message(n: int, counts: np.ndarray, gaps_head: np.ndarray, first_bad: int) -> str:
    """delta_ref's message for the first change that lands outside its chunk.

    gaps_head holds the gaps from the start of that change's chunk up to and
    including it; the offset is recomputed in int64, as delta_ref does.
    """
    c = chunk_of(counts, first_bad)
    offset = int((gaps_head.astype(np.int64) + 1).sum() - 1)
    return f"change #{first_bad} lands at offset {offset} of chunk {c}, which has {chunk_lengths(n)[c]} elements"


@dataclass
class Undo:
    """What apply_device overwrote, in section order, to put back with restore_device."""

    sections: DeltaSections
    saved: object  # device array of the old bit patterns
    chg_base: object  # device u64 [nchunks]: where each chunk's changes start
    esc_base: object
    ready: object = None  # event after the apply that wrote `saved` (device entry points only)
    runtime: object = field(default=None, repr=False, compare=False)

    def use_on(self, stream) -> "Undo":
        """Before another stream reads this undo: order it after the apply, keep the memory for it."""
        _use_on(self.runtime, self.ready, stream, (self.saved, self.chg_base, self.esc_base, *_arrays(self.sections)))
        return self


@dataclass
class DeviceSections(DeltaSections):
    """Sections built on the GPU (encode_device, fused_change_detect): cupy arrays written on the
    stream that was current for the input, with `ready` recorded after the last kernel that writes them."""

    ready: object = None
    runtime: object = field(default=None, repr=False, compare=False)

    def use_on(self, stream) -> "DeviceSections":
        """Before reading these sections on another stream (a transport's, an engine's): make that stream
        wait for the kernels that write them, and record them as in use there, so torch's caching
        allocator does not hand the memory out again while that stream still reads it."""
        _use_on(self.runtime, self.ready, stream, _arrays(self))
        return self


def _arrays(sec: DeltaSections) -> tuple:
    return (sec.table, sec.gaps, sec.steps, sec.escapes)


def _use_on(rt, ready, stream, arrays) -> None:
    if rt is None:
        return
    if ready is not None:
        rt.wait(stream, ready)
    for a in arrays:
        if a is not None and _is_device_array(a):
            rt.record_stream(a, stream)


class _Launcher:
    """Kernel launches and their host-side bookkeeping, over a runtime that provides
    xp (numpy or cupy), launch(name, grid, args), to_host(array) and ptr(array)."""

    def __init__(self, rt):
        self.rt = rt
        self.xp = rt.xp

    # ---- encode -------------------------------------------------------------------

    def encode(self, old, new, order: str) -> DeltaSections:
        _check_order(order)
        if old.shape != new.shape or old.dtype.itemsize != new.dtype.itemsize:
            raise ValueError(f"old and new differ: {old.dtype}{old.shape} vs {new.dtype}{new.shape}")
        w = width_name(new.dtype)
        return self._encode(f"delta_count_{w}_{order}", f"delta_fill_{w}_{order}", old, new, new.dtype, (0, 0))

    def encode_bf16_from_f32(self, before, after, nan_bits: tuple[int, int]) -> DeltaSections:
        """Sections of round(before) -> round(after) as bf16 patterns; before/after are fp32 bits (u32)."""
        return self._encode("fused_count_bf16", "fused_fill_bf16", before, after, np.dtype("<u2"), nan_bits)

    def _encode(self, count_k: str, fill_k: str, a, b, out_dtype, nan_bits) -> DeltaSections:
        xp, n = self.xp, len(a)
        nc = nchunks(n)
        table = xp.zeros(2 * nc, dtype="<u4")
        if nc == 0:
            return DeltaSections(table, xp.empty(0, "<u2"), xp.empty(0, np.int8), xp.empty(0, out_dtype))
        a, b = self._aligned(a, 16), self._aligned(b, 16)  # the count pass loads 16 bytes at a time
        mask = xp.empty(nc * CHUNK_WORDS, dtype="<u4")
        head = (a, b, np.uint64(n), np.uint32(nc), np.uint32(nan_bits[0]), np.uint32(nan_bits[1]))
        self.rt.launch(count_k, nc, head + (table, mask))
        counts, escs = table[:nc], table[nc:]
        inc_c, inc_e = xp.cumsum(counts, dtype=np.uint64), xp.cumsum(escs, dtype=np.uint64)
        total, total_esc = (int(x) for x in self.rt.to_host(xp.stack([inc_c[-1], inc_e[-1]])))  # the one sync
        gaps = xp.empty(total, dtype="<u2")
        steps = xp.empty(total, dtype=np.int8)
        escapes = xp.empty(total_esc, dtype=out_dtype)
        if total:
            chg_base, esc_base = inc_c - counts, inc_e - escs
            self.rt.launch(fill_k, nc, head + (mask, chg_base, esc_base, gaps, steps, escapes))
        return DeltaSections(table, gaps, steps, escapes)

    # ---- the walk: check, decode, apply, restore ------------------------------------

    def check(self, n: int, sec: DeltaSections):
        """Validate untrusted sections against an n-element tensor; FormatError, with
        delta_ref's messages, before anything is written. Returns the chunk bases."""
        counts, escs = check_table(n, self.rt.to_host(sec.table), len(sec.gaps), len(sec.steps), len(sec.escapes))
        chg_base, esc_base = self.xp.asarray(exclusive(counts)), self.xp.asarray(exclusive(escs))
        # delta_check is the u8 instance of the walk (it reads no tensor): its escapes pointer is a u8 one.
        as_bytes = DeltaSections(sec.table, sec.gaps, sec.steps, sec.escapes.view(np.uint8))
        self._walk("delta_check", n, as_bytes, chg_base, esc_base, NULL, NULL, NULL, counts)
        return chg_base, esc_base

    def decode(self, old, sec: DeltaSections, order: str):
        _check_order(order)
        width_name(old.dtype)
        sec = self._sections(sec, old.dtype)
        chg_base, esc_base = self.check(len(old), sec)
        pos = self.xp.empty(len(sec.steps), dtype=np.int64)
        values = self.xp.empty(len(sec.steps), dtype=old.dtype)
        self._walk(f"delta_decode_{width_name(old.dtype)}_{order}", len(old), sec, chg_base, esc_base, old,
                   values, pos)
        return pos, values

    def apply(self, weights, sec: DeltaSections, order: str, undo: bool) -> Undo | None:
        """In place: weights (1-D device bit patterns) become the new version, or,
        on bad sections, FormatError and weights untouched."""
        _check_order(order)
        w = width_name(weights.dtype)
        sec = self._sections(sec, weights.dtype)
        chg_base, esc_base = self.check(len(weights), sec)
        saved = self.xp.empty(len(sec.steps), dtype=weights.dtype) if undo else None
        try:
            self._walk(f"delta_apply_{w}_{order}", len(weights), sec, chg_base, esc_base, weights,
                       NULL if saved is None else saved, NULL)
        except FormatError:
            # Only if the sections changed under us after the check: put back what was written.
            if saved is not None:
                self.restore(weights, Undo(sec, saved, chg_base, esc_base))
            raise
        return Undo(sec, saved, chg_base, esc_base) if undo else None

    def restore(self, weights, undo: Undo) -> None:
        w = width_name(weights.dtype)
        self._walk(f"delta_restore_{w}", len(weights), undo.sections, undo.chg_base, undo.esc_base, weights,
                   undo.saved, NULL)

    def _walk(self, kernel, n, sec, chg_base, esc_base, weights, vals, pos, counts=None):
        nc = nchunks(n)
        if nc == 0:
            return
        err = self.xp.asarray(np.array([NO_ERROR, 0], dtype=np.uint64))
        escapes = sec.escapes if len(sec.escapes) else NULL
        self.rt.launch(kernel, nc, (weights, np.uint64(n), np.uint32(nc), sec.table, chg_base, esc_base,
                                    _or_null(sec.gaps), _or_null(sec.steps), escapes, vals, pos, err))
        first_bad, flags = (int(x) for x in self.rt.to_host(err))
        if first_bad != int(NO_ERROR):
            if counts is None:
                counts = self.rt.to_host(sec.table)[:nc].astype(np.int64)
            start = int(exclusive(counts)[chunk_of(counts, first_bad)])
            head = self.rt.to_host(sec.gaps[start : first_bad + 1])
            raise FormatError(outside_message(n, counts, head, first_bad))
        if flags & ERR_ESCAPES:
            raise FormatError("escape markers in the steps disagree with the chunk table's escape counts")
        if flags & ERR_TABLE:
            raise FormatError("the chunk table changed between its check and its use")

    def _sections(self, sec: DeltaSections, dtype) -> DeltaSections:
        """Sections as contiguous arrays of the kernels' dtypes, on the runtime's side."""
        xp = self.xp
        esc = xp.ascontiguousarray(xp.asarray(sec.escapes))
        if len(esc) and esc.dtype.itemsize != dtype.itemsize:
            raise FormatError(f"escapes are {esc.dtype.itemsize}-byte values for a {dtype.itemsize}-byte tensor")
        return DeltaSections(
            xp.ascontiguousarray(xp.asarray(sec.table), dtype="<u4"),
            xp.ascontiguousarray(xp.asarray(sec.gaps), dtype="<u2"),
            xp.ascontiguousarray(xp.asarray(sec.steps), dtype=np.int8),
            esc.view(dtype) if len(esc) else xp.empty(0, dtype),
        )

    # ---- delta v2 ------------------------------------------------------------------

    def v2_decode(self, old, parts: dict, dtype) -> DeltaSections:
        """codecs/v2_ref.decode with the chunks decoded on the GPU (old: 1-D device bits of the base).

        The host parses the model and the index with v2_ref's own checks into the flat tables the kernel
        reads; a warp per chunk (csrc/ws_v2_cuda.cu: its lanes count and place, one reads the codes with
        ws_v2.cuh's decode_codes, the C++ backend's own) leaves the chunk's changes at its offset with a
        count and an error code. They are compacted and turned into v1 sections on the device
        (v2_ref.sections_of over xp); only counts and error codes come to the host. Chunks go in launches
        whose scratch fits the runtime's budget (V2_SCRATCH_BYTES, or a quarter of the GPU's free memory up
        to V2_SCRATCH_MAX). Anything the reference refuses raises FormatError; nothing is written but
        scratch. The sections are xp arrays.
        """
        xp, n, w = self.xp, len(old), old.dtype.itemsize
        width_name(old.dtype)
        k, m, freqs = v2_ref.read_model(bytes(parts["model"]), n, n * w, w)
        nc = nchunks(n)
        lens = v2_index_lengths(bytes(parts["index"]), nc, len(parts["pos"]), len(parts["steps"]))
        at = [xp.asarray(np.concatenate([[0], np.cumsum(lens[:, i])]).astype(np.uint64)) for i in (0, 1)]
        model = [xp.asarray(a) for a in v2_model_tables(m, freqs)]
        coded = [c for c in range(v2_ref.NCLASS) if m[c]]
        lo, hi = (coded[0], coded[-1] + 1) if coded else (0, 0)
        stream = [xp.asarray(np.frombuffer(bytes(parts[p]) or b"\0", np.uint8)) for p in ("pos", "steps")]
        head = (*model, np.int32(lo), np.int32(hi), *(np.int32(x) for x in v2_ref.class_spec(dtype)), np.uint64(k))
        budget = self.rt.v2_scratch_budget() if hasattr(self.rt, "v2_scratch_budget") else V2_SCRATCH_BYTES
        batch = max(1, min(nc, budget // V2_CHUNK_SCRATCH))
        span = batch * CHUNK_ELEMS
        scratch = (xp.empty(span, np.uint32), xp.empty(span, np.int64), xp.empty(batch * V2_PTRS, np.uint32),
                   xp.empty(batch * V2_TABLES, np.uint32))
        off, step = xp.empty(span, np.uint32), xp.empty(span, np.int64)
        res = xp.empty(2 * batch, np.uint32)  # counts, then error codes: one copy to the host per launch
        got: list[tuple] = []
        total = 0
        for c0 in range(0, nc, batch):
            nb = min(batch, nc - c0)
            e0 = c0 * CHUNK_ELEMS
            ne = min(n - e0, nb * CHUNK_ELEMS)
            count, err = res[:nb], res[batch:batch + nb].view(np.int32)
            self.rt.launch(f"v2_decode_{w}", nb,
                           (old[e0:e0 + ne], np.uint64(ne), *head, stream[0], at[0][c0:], stream[1], at[1][c0:],
                            *scratch, off, step, count, err), block=V2_BLOCK)
            host = self.rt.to_host(res)
            codes = host[batch:batch + nb].view(np.int32)
            bad = np.flatnonzero(codes)
            if len(bad):
                code = int(codes[bad[0]])
                why = V2_ERRORS[code] if 0 < code < len(V2_ERRORS) else f"error {code}"
                raise FormatError(f"v2 chunk {c0 + int(bad[0])}: {why}")
            counts = host[:nb].astype(np.int64)
            total += int(counts.sum())
            if total > k:
                raise FormatError(f"v2: decoded more than the {k} changes the model declares")
            # the slots of the batch's changes: chunk j's are j * CHUNK_ELEMS + [0, counts[j]), found from the
            # counts' prefix sums (work per change, not per slot of the launch)
            ends = np.cumsum(counts)
            i = xp.arange(int(ends[-1]), dtype=np.int64)
            ch = xp.searchsorted(xp.asarray(ends), i, side="right")
            flat = ch * CHUNK_ELEMS + (i - xp.asarray(ends - counts)[ch])
            pos = ch * CHUNK_ELEMS + off[flat].astype(np.int64) + e0
            got.append((pos, step[flat]))  # copies (fancy indexing): the next launch reuses off and step
        if total != k:
            raise FormatError(f"v2: decoded {total} changes, the model declares {k}")
        pos = xp.concatenate([g[0] for g in got]) if got else xp.zeros(0, np.int64)
        d = xp.concatenate([g[1] for g in got]) if got else xp.zeros(0, np.int64)
        return v2_ref.sections_of(n, old[pos], pos, d, dtype.order, xp)

    # ---- checksums ---------------------------------------------------------------

    def block_digests(self, bufs: list) -> list[np.ndarray]:
        """xxh3-64 of every 1 MiB block of each 1-D byte array in bufs, in one launch."""
        xp = self.xp
        bufs = [self._aligned(b, 8) for b in bufs]  # the hot loop reads aligned 8-byte words
        sizes = np.array([b.nbytes for b in bufs], dtype=np.uint64)
        nblocks = (sizes + np.uint64(BLOCK - 1)) // np.uint64(BLOCK)
        first = exclusive(nblocks)
        total = int(nblocks.sum())
        out = xp.empty(total, dtype="<u8")
        if total:
            ptrs = np.array([self.rt.ptr(b) for b in bufs], dtype=np.uint64)
            grid = -(-total * 32 // NT)  # one warp per block
            self.rt.launch("xxh3_blocks", grid, (xp.asarray(ptrs), xp.asarray(sizes), xp.asarray(first),
                                                 np.uint32(len(bufs)), np.uint64(total), out))
        host = self.rt.to_host(out)
        return [host[int(f) : int(f) + int(k)] for f, k in zip(first, nblocks)]

    def digests(self, bufs: list) -> list[str]:
        return [combine(d) for d in self.block_digests(bufs)]

    # ---- the lowrank range finder --------------------------------------------------

    def lora_range(self, w_new, w_old, omega):
        """Y = (w_new - w_old) @ omega in fp32, from bf16 bit patterns w_* [m, n] (u16, row-major) and
        fp32 omega [n, K], without forming the difference: one pass over the weights per 32 columns."""
        xp = self.xp
        if w_new.shape != w_old.shape or w_new.ndim != 2 or omega.ndim != 2 or omega.shape[0] != w_new.shape[1]:
            raise ValueError(f"lora_range takes w [m, n] twice and omega [n, K]; got {w_new.shape}, {w_old.shape}, "
                             f"{omega.shape}")
        if w_new.dtype.itemsize != 2 or w_old.dtype.itemsize != 2 or omega.dtype != np.float32:
            raise TypeError(f"lora_range takes bf16 bit patterns (2-byte) and an fp32 omega; got {w_new.dtype}, "
                            f"{w_old.dtype}, {omega.dtype}")
        m, n = w_new.shape
        k = omega.shape[1]
        y = xp.empty((m, k), dtype=np.float32)
        if m == 0 or k == 0:
            return y
        a, b = xp.ascontiguousarray(w_new).view(np.uint16), xp.ascontiguousarray(w_old).view(np.uint16)
        om = xp.ascontiguousarray(omega)
        for c0 in range(0, k, LORA_KMAX):
            self.rt.launch("lora_range_bf16", m, (a, b, om, np.uint64(n), np.uint32(k), np.uint32(c0),
                                                  np.uint32(min(LORA_KMAX, k - c0)), y))
        return y

    # ---- the quantizers (wsync.quant, csrc/ws_quant.cuh) -----------------------------
    # Each takes the weight's bit patterns and the outputs as 1-D device arrays, writes the scheme's tensors
    # and returns the least flat index of a non-finite element (-1: none, and the outputs hold the result):
    # that index is the one value that comes back to the host.

    def quantize(self, kind: str, x, dtype: str, dims: tuple[int, ...], out0, out1) -> int:
        """Dispatch on the scheme's kind; dims as wsync.backends.cpu.quant_dims gives them."""
        return getattr(self, f"quantize_{kind}")(x, dtype, *dims, out0, out1)

    def quantize_int4_group(self, x, dtype: str, rows: int, k: int, group: int, packed, scale) -> int:
        ngroups = rows * (k // group)
        bad = self._no_bad()
        self.rt.launch(f"quant_int4_group_{QUANT_NAMES[dtype]}", -(-ngroups // NT),
                       (x, np.uint64(ngroups), np.uint32(group), packed, scale, bad))
        return self._first_bad(bad)

    def quantize_int8_channel(self, x, dtype: str, rows: int, k: int, codes, scale) -> int:
        bad = self._no_bad()
        self.rt.launch(f"quant_int8_channel_{QUANT_NAMES[dtype]}", rows, (x, np.uint64(k), codes, scale, bad))
        return self._first_bad(bad)

    def quantize_fp8_block(self, x, dtype: str, mats: int, m: int, n: int, bm: int, bn: int, codes, sf) -> int:
        bad = self._no_bad()
        self.rt.launch(f"quant_fp8_block_{QUANT_NAMES[dtype]}", mats * -(-m // bm) * -(-n // bn),
                       (x, np.uint64(m), np.uint64(n), np.uint32(bm), np.uint32(bn), codes, sf, bad))
        return self._first_bad(bad)

    def _no_bad(self):
        return self.xp.full(1, NO_ERROR, dtype=np.uint64)

    def _first_bad(self, bad) -> int:
        at = int(self.rt.to_host(bad)[0])
        return -1 if at == int(NO_ERROR) else at

    def _aligned(self, x, align: int):
        """x itself when its data is aligned, else an aligned copy (views with odd offsets are rare)."""
        return x if x.size == 0 or self.rt.ptr(x) % align == 0 else x.copy()


def v2_index_lengths(index: bytes, nc: int, pos_len: int, steps_len: int) -> np.ndarray:
    """v2_ref.read_index as an (nc, 2) uint64 array, its varints read with numpy: the reference's Python loop,
    one varint at a time, would take much of the GPU decode's time. The common case only: varints of at most nine
    bytes (values below 2^63) that tile the index, within their limits, summing to the sections' lengths.
    Anything else goes to the reference, which decides, and raises, as the spec says."""
    b = np.frombuffer(index, np.uint8)
    ends = np.flatnonzero(b < 0x80)
    if nc and len(ends) == 2 * nc and ends[-1] == len(b) - 1 and nc * max(pos_len, steps_len, 1) < 2**63:
        starts = np.concatenate([[0], ends[:-1] + 1])
        if int((ends - starts).max()) < 9:
            shift = 7 * (np.arange(len(b)) - np.repeat(starts, ends - starts + 1))
            lens = np.add.reduceat((b & 0x7F).astype(np.uint64) << shift.astype(np.uint64), starts).reshape(nc, 2)
            if (int(lens[:, 0].max()) <= pos_len and int(lens[:, 1].max()) <= steps_len
                    and int(lens[:, 0].sum()) == pos_len and int(lens[:, 1].sum()) == steps_len):
                return lens
    return np.array(v2_ref.read_index(index, nc, pos_len, steps_len), np.uint64).reshape(nc, 2)


def v2_model_tables(m: list[int], freqs: dict) -> tuple[np.ndarray, ...]:
    """A parsed v2 model (v2_ref.read_model) as ws_v2.cuh's ModelView reads it: m [NCLASS] u64, freq and
    cum [NCLASS * NSYM] u32, slot [NCLASS * PROB_SCALE] u8 (the rANS slot -> symbol table)."""
    freq = np.zeros((v2_ref.NCLASS, v2_ref.NSYM), np.uint32)
    cum = np.zeros_like(freq)
    slot = np.zeros((v2_ref.NCLASS, v2_ref.PROB_SCALE), np.uint8)
    for c, f in freqs.items():
        freq[c] = f
        cum[c] = np.concatenate([[0], np.cumsum(f)[:-1]])
        slot[c] = np.repeat(np.arange(v2_ref.NSYM, dtype=np.uint8), f)
    return np.array(m, np.uint64), freq.ravel(), cum.ravel(), slot.ravel()


def width_name(dtype) -> str:
    """The kernels' name for an element width; the delta kernels take 1, 2, 4 or 8 bytes."""
    itemsize = np.dtype(dtype).itemsize
    if itemsize not in WIDTHS:
        raise TypeError(f"the delta kernels take 1-, 2-, 4- or 8-byte elements, got {np.dtype(dtype)} "
                        f"({itemsize} bytes); checksums (digest_device) take any dtype")
    return WIDTHS[itemsize]


def _check_order(order: str) -> None:
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")


def _or_null(x):
    return x if len(x) else NULL


@functools.lru_cache(maxsize=1)
def _host_kernels():
    """The C++ backend, for host work that has no CUDA kernel (v2 encoding); None where it is not built."""
    from .cpu import CpuKernels

    try:
        return CpuKernels()
    except BackendUnavailable:
        return None


class _KernelsOver(Composed):
    """The Kernels protocol on numpy arrays, over a _Launcher (GPU or host emulation).

    The fused host-array operations are Composed's: on host arrays the work
    is the round trip to the GPU, which fusing would not remove. On the GPU
    itself, apply_device and digests_device are the fused path.
    """

    name = "cuda"

    def __init__(self, rt):
        self.launcher = _Launcher(rt)
        self.xp = rt.xp

    # Host tables (many tensors as one segment) are gathered into one host array first: its one copy to the
    # device is then a single transfer and a single launch, where the pieces would each need their own.

    def delta_encode(self, old: np.ndarray, new: np.ndarray, order: str) -> DeltaSections:
        xp = self.xp
        old, new = as_array(old), as_array(new)
        sec = self.launcher.encode(xp.ascontiguousarray(xp.asarray(old)), xp.ascontiguousarray(xp.asarray(new)), order)
        return sections_to_host(sec, new.dtype)

    def delta_decode(self, old: np.ndarray, sec: DeltaSections, order: str) -> tuple[np.ndarray, np.ndarray]:
        old = as_array(old)
        pos, values = self.launcher.decode(self.xp.ascontiguousarray(self.xp.asarray(old)), sec, order)
        return _host(pos), _host(values).astype(old.dtype, copy=False)

    def v2_encode(self, old, sec: DeltaSections, dtype) -> dict:
        """codecs/v2_ref.encode's bytes. There is no CUDA encoder: the base is a host array here and the
        sections came back with delta_encode, so the C++ encoder runs on the host; only where the extension is
        not built does the reference's Python, far slower, do it."""
        host = _host_kernels()
        return host.v2_encode(old, sec, dtype) if host is not None else v2_ref.encode(as_array(old), sec, dtype)

    def v2_decode(self, old: np.ndarray, parts: dict, dtype) -> DeltaSections:
        """codecs/v2_ref.decode with the chunks decoded on the GPU: the base goes up, the sections come back."""
        old = as_array(old)
        sec = self.launcher.v2_decode(self.xp.ascontiguousarray(self.xp.asarray(old)), parts, dtype)
        return sections_to_host(sec, old.dtype)

    def quantize(self, scheme, bits, dtype, outs, what="tensor"):
        """The quantizing kernels on host arrays: the weight copied up, the outputs copied back."""
        dims = quant_dims(scheme, bits.shape, dtype)
        if dims is None or not isinstance(bits, np.ndarray) or bits.dtype.itemsize != (4 if dtype == "F32" else 2):
            return super().quantize(scheme, bits, dtype, outs, what)
        xp = self.xp
        x = xp.asarray(np.ascontiguousarray(bits).reshape(-1))
        dev = [xp.empty(o.size, o.dtype) for o in outs[:2]]
        bad = self.launcher.quantize(scheme.kind, x, dtype, dims, *dev)
        if bad >= 0:
            quant_refuse(scheme, bits, dtype, bad, what)
        for o, d in zip(outs, dev):
            np.copyto(o, self.launcher.rt.to_host(d).reshape(o.shape))
        if scheme.kind == "int4_group":
            outs[2].reshape(-1).view(np.int64)[:] = bits.shape

    def checksum(self, buf) -> str:
        # Host bytes are hashed on the host: xxh3 runs at memory speed there, and a
        # round trip over PCIe would only add time. (CudaKernels hashes device buffers on their device.)
        return host_checksum(as_array(buf))


class CudaKernels(_KernelsOver):
    """wsync's kernels on an NVIDIA GPU (see the module docstring).

    runtime: what launches kernels and owns memory, streams and events; cupy's by default
    (tests pass a fake one that records what happens, or the CPU harness)."""

    name = "cuda"

    def __init__(self, runtime=None):
        super().__init__(runtime if runtime is not None else _CupyRuntime())
        self.rt = self.launcher.rt

    def checksum(self, buf) -> str:
        if _is_device_array(buf):  # hashed on the buffer's own device, not the current one
            with self._on(buf):
                return self.launcher.digests([self.rt.bits(buf, bytes_only=True)])[0]
        return host_checksum(as_array(buf))

    # ---- GPU-native entry points (torch CUDA tensors or cupy arrays) --------------

    def encode_device(self, old, new, order: str) -> DeviceSections:
        """Sections of old -> new, left on the GPU (cupy arrays), written on the current stream of
        new's device; see DeviceSections for reading them elsewhere."""
        self._one_device("encode_device", old=old, new=new)
        with self._on(new):
            return self._device_sections(self.launcher.encode(self.rt.bits(old), self.rt.bits(new), order))

    def v2_decode_device(self, base, parts: dict, dtype) -> DeviceSections:
        """The v1 sections of a delta-v2 tensor against a contiguous CUDA tensor (the base it was coded
        against), decoded on its GPU and left there, for apply_device. Bad parts raise FormatError."""
        with self._on(base):
            return self._device_sections(self.launcher.v2_decode(self.rt.bits(base), parts, dtype))

    def apply_device(self, weights, sections: DeltaSections, order: str, undo: bool = True) -> Undo | None:
        """Apply sections in place to a contiguous CUDA tensor. Bad sections raise
        FormatError and leave it untouched. With undo, returns what restore_device
        needs to put the old values back (e.g. when the engine's digest disagrees)."""
        self._one_device("apply_device", weights=weights, **_device_parts(sections))
        with self._on(weights):
            self._wait_ready(sections)
            u = self.launcher.apply(self.rt.bits(weights), sections, order, undo)
            if u is not None:
                u.ready, u.runtime = self.rt.record_event(), self.rt
            return u

    def restore_device(self, weights, undo: Undo) -> None:
        self._one_device("restore_device", weights=weights, saved=undo.saved)
        with self._on(weights):
            self._wait_ready(undo)
            self.launcher.restore(self.rt.bits(weights), undo)

    def digest_device(self, tensor) -> str:
        """wsync.checksum.checksum of a contiguous CUDA tensor's bytes, computed on its GPU."""
        return self.digests_device([tensor])[0]

    def digests_device(self, tensors) -> list[str]:
        """Checksums of many tensors (on one device) in one launch: a model's worth after a load.

        Each 1 MiB block is one warp's serial xxh3 chain, so a lone k-MiB tensor keeps only
        k warps busy; hashing all tensors together is what fills the GPU."""
        tensors = list(tensors)
        if not tensors:
            return []
        self._one_device("digests_device", **{f"tensors[{i}]": t for i, t in enumerate(tensors)})
        with self._on(tensors[0]):
            return self.launcher.digests([self.rt.bits(t, bytes_only=True) for t in tensors])

    def fused_change_detect(self, master_before, master_after, nan_bits: tuple[int, int] | None = None
                            ) -> DeviceSections:
        """Sections of bf16(master_before) -> bf16(master_after), straight from two fp32
        tensors, so the trainer keeps no bf16 copy of the model: equal to
        delta_ref.encode of their .to(torch.bfloat16) bit patterns, NaN included.
        nan_bits (for +NaN, -NaN) defaults to what torch's cast gives on that
        device, probed once."""
        for t in (master_before, master_after):
            if str(getattr(t, "dtype", "")) not in ("torch.float32", "float32"):
                raise TypeError(f"fused_change_detect takes fp32 master weights, got {getattr(t, 'dtype', type(t))}")
        if tuple(master_before.shape) != tuple(master_after.shape):
            raise ValueError(f"shapes differ: {tuple(master_before.shape)} vs {tuple(master_after.shape)}")
        self._one_device("fused_change_detect", master_before=master_before, master_after=master_after)
        with self._on(master_after):
            nan = nan_bits or self._torch_bf16_nan(master_after)
            sec = self.launcher.encode_bf16_from_f32(self.rt.bits(master_before), self.rt.bits(master_after), nan)
            return self._device_sections(sec)

    def lowrank_range(self, w_new, w_old, omega):
        """(w_new - w_old) @ omega for two bf16 CUDA matrices [m, n] and an fp32 omega [n, K], without
        materializing the difference (wsync.lowrank's range finder); a torch fp32 tensor [m, K] on their GPU."""
        import torch

        for name, t in (("w_new", w_new), ("w_old", w_old)):
            if t.dtype != torch.bfloat16 or t.dim() != 2:
                raise TypeError(f"lowrank_range: {name} must be a 2-D bfloat16 tensor, got {t.dtype} {tuple(t.shape)}")
        if omega.dtype != torch.float32:
            raise TypeError(f"lowrank_range: omega must be float32, got {omega.dtype}")
        self._one_device("lowrank_range", w_new=w_new, w_old=w_old, omega=omega)
        with self._on(w_new):
            m, n = w_new.shape
            a = self.rt.bits(w_new).reshape(m, n)
            b = self.rt.bits(w_old).reshape(m, n)
            om = self.rt.bits(omega.contiguous()).view(np.float32).reshape(omega.shape)
            return torch.from_dlpack(self.launcher.lora_range(a, b, om))

    def quantize(self, scheme, tensor, dtype, bufs, what="tensor"):
        """scheme.reference of a CUDA weight written into CUDA output buffers (wsync.quant.Quantizer's device
        path): the kernels run on the weight's device and current stream, and only the non-finite flag comes
        to the host (the weight too, to name the element, when there is one). Host arrays take the host-array
        protocol above; a shape, dtype or empty weight the kernels do not take is the reference's, on the host."""
        from . import transfers  # the process's count of bytes between device and host, as the device paths keep

        if not _is_device_array(tensor):
            return super().quantize(scheme, tensor, dtype, bufs, what)
        if hasattr(tensor, "contiguous") and not tensor.is_contiguous():
            tensor = tensor.contiguous()
        shape = tuple(int(d) for d in tensor.shape)
        self._one_device("quantize", tensor=tensor, **{f"bufs[{i}]": b for i, b in enumerate(bufs)})
        with self._on(tensor):
            x = self.rt.bits(tensor)
            outs = [self.rt.bits(b) for b in bufs]
            dims = quant_dims(scheme, shape, dtype)
            if dims is None or x.dtype.itemsize != (4 if dtype == "F32" else 2):
                host = [np.empty(o.shape, o.dtype) for o in outs]
                transfers().add(d2h=x.nbytes)
                Composed.quantize(self, scheme, self.rt.to_host(x).reshape(shape), dtype, host, what)
                for o, h in zip(outs, host):
                    o[...] = self.xp.asarray(h)
                transfers().add(h2d=sum(h.nbytes for h in host))
                return
            bad = self.launcher.quantize(scheme.kind, x, dtype, dims, outs[0], outs[1])
            transfers().add(d2h=8)  # the flag
            if scheme.kind == "int4_group":
                outs[2][...] = self.xp.asarray(np.asarray(shape, np.int64).view(np.uint64))
                transfers().add(h2d=8 * len(shape))
            if bad >= 0:
                transfers().add(d2h=x.nbytes)
                quant_refuse(scheme, self.rt.to_host(x).reshape(shape), dtype, bad, what)

    # ---- helpers -------------------------------------------------------------------

    def _on(self, t):
        return self.rt.stream_of(t)

    def _device_sections(self, sec: DeltaSections) -> DeviceSections:
        # Recorded inside _on: on the stream the kernels ran on, after the last of them.
        return DeviceSections(sec.table, sec.gaps, sec.steps, sec.escapes, ready=self.rt.record_event(),
                              runtime=self.rt)

    def _wait_ready(self, x) -> None:
        """The current stream waits for the kernels that wrote x (sections or an undo), wherever they ran."""
        ready = getattr(x, "ready", None)
        if ready is not None:
            self.rt.wait_current(ready)

    def _one_device(self, what: str, **arrays) -> None:
        devices = {name: self.rt.device_of(a) for name, a in arrays.items() if _is_device_array(a)}
        if len(set(devices.values())) > 1:
            where = ", ".join(f"{name} on cuda:{d}" for name, d in devices.items())
            raise ValueError(f"{what}: inputs on different GPUs ({where}); move them to one device first")

    @staticmethod
    def _torch_bf16_nan(t) -> tuple[int, int]:
        if not hasattr(t, "is_cuda"):  # a cupy array: assume torch's CUDA cast, cvt.rn's canonical NaN (pass nan_bits to be sure)
            return (0x7FFF, 0x7FFF)
        return torch_bf16_nan_bits(str(t.device))


def _device_parts(sec) -> dict:
    return {f"sections.{k}": getattr(sec, k) for k in ("table", "gaps", "steps", "escapes")}


@functools.lru_cache(maxsize=None)
def torch_bf16_nan_bits(device: str) -> tuple[int, int]:
    """The bf16 patterns torch's .to(torch.bfloat16) gives +NaN and -NaN on a device.

    torch disagrees with itself here (see bf16_rne in csrc/ws_common.cuh): on
    this CPU build its vectorised cast gives 0xFFFF and its scalar cast 0x7FC0;
    on sm_80+ GPUs it goes through cvt.rn.bf16.f32, whose NaN PTX documents as
    canonical (0x7FFF, to be confirmed by tests/test_cuda_kernels.py). So ask
    it, with a vector long enough for the vectorised path a model's tensors
    take. Every NaN payload of one sign maps to one pattern on each path; the
    tests check that too.
    """
    import torch

    bits = torch.tensor([0x7FC00000, -0x00400000] * 32, dtype=torch.int32).view(torch.float32).to(device)
    h = bits.to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16)
    return int(h[0]), int(h[1])


def sections_to_host(sec: DeltaSections, dtype=None) -> DeltaSections:
    """Device sections as numpy arrays with delta_ref's dtypes (for the packed tier's zstd, or the wire).

    Waits for the kernels that write them first: they ran on the stream that was current
    when they were built (torch's), and the copies below run on whichever stream is current now."""
    ready = getattr(sec, "ready", None)
    if ready is not None:
        ready.synchronize()
    esc = _host(sec.escapes)
    if dtype is not None:
        esc = esc.astype(np.dtype(dtype).newbyteorder("<"), copy=False)
    return DeltaSections(_host(sec.table).astype("<u4", copy=False), _host(sec.gaps).astype("<u2", copy=False),
                         _host(sec.steps).astype(np.int8, copy=False), esc)


def _host(x) -> np.ndarray:
    return x.get() if hasattr(x, "get") else np.asarray(x)


def _is_device_array(x) -> bool:
    if hasattr(x, "is_cuda"):  # torch: its __cuda_array_interface__ raises KeyError on dtypes numpy lacks (fp8)
        return bool(x.is_cuda)
    return hasattr(x, "__cuda_array_interface__")


def _bits(t, bytes_only: bool = False):
    """A contiguous torch CUDA tensor (or cupy array) as a 1-D cupy array of its bit
    patterns (u8 bytes if bytes_only), sharing memory through DLPack."""
    import cupy as cp

    if hasattr(t, "is_cuda"):  # torch
        if not t.is_cuda:
            raise TypeError(f"expected a CUDA tensor, got one on {t.device}")
        if not t.is_contiguous():
            raise ValueError("the tensor must be contiguous (call .contiguous() first, which copies)")
        itemsize = t.element_size()
        if t.numel() == 0:  # torch gives an empty tensor stride 0, which no view to u8 takes
            with cp.cuda.Device(t.device.index):
                x = cp.empty(0, np.uint8)
        else:
            x = cp.from_dlpack(t.detach().reshape(-1).view(_torch_u8()))  # u8: every DLPack consumer knows it
    elif isinstance(t, cp.ndarray):
        if not t.flags.c_contiguous:
            raise ValueError("the array must be C-contiguous")
        itemsize = t.dtype.itemsize
        x = t.reshape(-1).view(np.uint8)
    else:
        raise TypeError(f"expected a torch CUDA tensor or a cupy array, got {type(t).__name__}")
    if bytes_only:
        return x
    if itemsize not in WIDTHS:
        raise TypeError(f"the delta kernels take 1-, 2-, 4- or 8-byte elements, got {t.dtype} ({itemsize} bytes); "
                        "checksums (digest_device) take any dtype")
    return x.view(f"<u{itemsize}")


def _torch_u8():
    import torch

    return torch.uint8


class _CupyRuntime:
    """Launches on the current CUDA device through cupy; the module compiles once (cupy caches it on disk).

    The runtime interface CudaKernels and _Launcher use: xp, launch, to_host, ptr, bits, device_of,
    stream_of (device, stream and allocator of a tensor), record_event, wait, wait_current,
    record_stream."""

    def __init__(self):
        try:
            import cupy as cp
        except ImportError as e:
            raise BackendUnavailable(f"cupy is not installed ({e}); {INSTALL_HINT}") from e
        try:
            count = cp.cuda.runtime.getDeviceCount()
        except cp.cuda.runtime.CUDARuntimeError as e:
            code = str(e).split(":")[0]
            why = {"cudaErrorInsufficientDriver": "no usable driver", "cudaErrorNoDevice": "no GPU"}.get(code, "CUDA error")
            raise BackendUnavailable(f"{why} ({code}); {INSTALL_HINT}") from e
        if count == 0:
            raise BackendUnavailable(f"no GPU (getDeviceCount() == 0); {INSTALL_HINT}")
        srcs = [csrc_dir() / name for name in KERNEL_SOURCES]
        for src in srcs:
            if not src.exists():
                raise BackendUnavailable(f"kernel source {src} not found (set WSYNC_CSRC to wsync's csrc/)")
        try:
            self.module = cp.RawModule(code=kernel_source(srcs), options=("-std=c++17",))
            self.module.compile()
        except Exception as e:  # a missing libnvrtc, or a compiler that rejects the source
            raise BackendUnavailable(f"NVRTC could not build {', '.join(KERNEL_SOURCES)}: {str(e)[:2000]}; "
                                     f"{INSTALL_HINT}") from e
        self.cp = cp
        self.xp = cp
        self._fns: dict = {}
        # base address of each block cupy took from torch's allocator -> the torch tensor that owns it
        self._owners: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def launch(self, name: str, grid: int, args: tuple, block: int = NT) -> None:
        key = (self.cp.cuda.Device().id, name)  # a loaded function belongs to one device
        fn = self._fns.get(key)
        if fn is None:
            fn = self._fns[key] = self.module.get_function(name)
        fn((grid,), (block,), args)

    def v2_scratch_budget(self) -> int:
        """Bytes of scratch one v2 decode launch may take: a quarter of the device's free memory, within
        [V2_SCRATCH_BYTES, V2_SCRATCH_MAX]."""
        free, _ = self.cp.cuda.runtime.memGetInfo()
        return max(V2_SCRATCH_BYTES, min(free // 4, V2_SCRATCH_MAX))

    def to_host(self, x) -> np.ndarray:
        return self.cp.asnumpy(x)  # on the current stream, which is the one the kernels ran on

    def ptr(self, x) -> int:
        return x.data.ptr

    bits = staticmethod(_bits)

    def device_of(self, t) -> int:
        if hasattr(t, "is_cuda"):
            import torch

            return t.device.index if t.device.index is not None else torch.cuda.current_device()
        return t.device.id

    def stream_of(self, t):
        """For torch tensors: run on torch's current stream for t's device, so our kernels
        order after whatever torch queued (the optimizer step, a load) and before what it
        queues next, and take scratch and sections from torch's caching allocator, so a
        training process has one memory pool, not two competing for the same GPU."""
        cp = self.cp
        if hasattr(t, "is_cuda") and t.is_cuda:
            import torch

            dev = self.device_of(t)
            return _Both(cp.cuda.Device(dev),
                         cp.cuda.ExternalStream(torch.cuda.current_stream(dev).cuda_stream, dev),
                         cp.cuda.using_allocator(_torch_allocator(cp, dev, self._owners)))
        return _Both(cp.cuda.Device(t.device.id) if hasattr(t, "device") else cp.cuda.Device())

    def dtype_of(self, t):
        """The wsync dtype of a torch CUDA tensor."""
        from .. import dtypes

        return dtypes.from_torch(t.dtype)

    def empty_tensor(self, numel: int, dtype, device: int, shape: tuple | None = None):
        """A torch tensor of `dtype` (a wsync DType) on cuda:`device`, flat or of `shape`, from torch's caching
        allocator on the current stream (so torch frees it in order with the kernels queued there)."""
        import torch

        t = torch.empty(numel, dtype=getattr(torch, dtype.torch_name), device=f"cuda:{device}")
        return t.view(shape) if shape is not None else t

    def copy_box(self, dst, src, box) -> None:
        """dst (a tensor of the box's shape) = src[box], on the current stream."""
        import torch

        with torch.no_grad():
            dst.copy_(src[_box(box)])

    def write_box(self, dst, box, src) -> None:
        """dst[box] = src (a tensor of the box's shape), on the current stream."""
        import torch

        with torch.no_grad():
            dst[_box(box)].copy_(src)

    def gather_boxes(self, flat, pairs) -> None:
        """flat = the elements of each (tensor, box) pair (box None: all of it) back to back, in C order."""
        import torch

        views = [t if box is None else t[_box(box)] for t, box in pairs]
        parts = torch.split(flat, [v.numel() for v in views])
        torch._foreach_copy_([p.view(v.shape) for p, v in zip(parts, views)], views)

    def gather(self, flat, tensors) -> None:
        """flat[...] = the tensors back to back, on the current stream: one multi-tensor copy, no host work
        per tensor beyond building the views."""
        import torch

        views = list(torch.split(flat, [t.numel() for t in tensors]))
        torch._foreach_copy_(views, [t.detach().reshape(-1) for t in tensors])

    def scatter(self, flat, tensors) -> None:
        """The tensors = flat's pieces, on the current stream (the inverse of gather)."""
        import torch

        views = list(torch.split(flat, [t.numel() for t in tensors]))
        with torch.no_grad():
            torch._foreach_copy_([t.view(-1) for t in tensors], views)

    def record_event(self):
        ev = self.cp.cuda.Event(disable_timing=True)
        ev.record()  # on the current stream
        return ev

    def wait(self, stream, event) -> None:
        self._cupy_stream(stream).wait_event(event)

    def wait_current(self, event) -> None:
        self.cp.cuda.get_current_stream().wait_event(event)

    def record_stream(self, array, stream) -> None:
        """Tell torch's caching allocator that `stream` uses array's block (a no-op for memory from
        cupy's own pool, whose free blocks are kept per stream already)."""
        mem = getattr(getattr(array, "data", None), "mem", None)
        owner = self._owners.get(getattr(mem, "ptr", None))
        if owner is None:
            return
        import torch

        if not isinstance(stream, torch.cuda.Stream):
            stream = torch.cuda.ExternalStream(self._cupy_stream(stream).ptr, device=owner.device)
        owner.record_stream(stream)

    def _cupy_stream(self, stream):
        cp = self.cp
        if isinstance(stream, cp.cuda.Stream):
            return stream
        return cp.cuda.ExternalStream(int(getattr(stream, "cuda_stream", getattr(stream, "ptr", stream))))


def _box(box) -> tuple:
    return tuple(slice(a, b) for a, b in box)


def _torch_allocator(cp, device: int, owners=None):
    """A cupy allocator that takes memory from torch's caching allocator (on torch's current stream)."""
    import torch

    def alloc(size: int):
        t = torch.empty(max(size, 1), dtype=torch.uint8, device=f"cuda:{device}")
        if owners is not None:
            owners[t.data_ptr()] = t
        return cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(t.data_ptr(), size, t, device), 0)

    return alloc


class _Both:
    """Enter several context managers, leave them in reverse."""

    def __init__(self, *cms):
        self.cms = cms

    def __enter__(self):
        for cm in self.cms:
            cm.__enter__()

    def __exit__(self, *exc):
        for cm in reversed(self.cms):
            cm.__exit__(*exc)
        return False
