"""Multi-tensor kernels: a Table (many pieces back to back) means its concatenation, byte for byte.

Every kernel that takes a tensor's bits also takes a wsync.tables.Table.
Positions, chunks and checksums are those of the gathered stream, so each
call on tables must give exactly what the reference gives on the gathered
arrays: sections, positions, values, checksums and the bits written. The
tables here are cut badly on purpose: empty pieces, 1-element pieces, a piece
spanning many chunks, boundaries that fall inside chunks and 1 MiB blocks.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from wsync.checksum import BLOCK, checksum
from wsync.codecs import delta_ref
from wsync.codecs.base import Overwritten
from wsync.errors import FormatError
from wsync.tables import Table

from conftest import backend_params
from kernel_cases import ORDERS, WIDTHS, assert_same_sections, make_case, make_pair, outcome

C = delta_ref.CHUNK_ELEMS


# the Table kernels are the reference's and the C++ backend's
on_table_backends = pytest.mark.parametrize("kernels", backend_params(("ref", "cpu")), indirect=True)


def cut(a: np.ndarray, rng, style: int = 0) -> Table:
    """a as a Table of separately allocated copies, cut unevenly (style varies the cuts)."""
    n = len(a)
    points = [0, n]
    if n:
        points += list(rng.integers(0, n + 1, size=int(rng.integers(1, 12))))  # arbitrary, may repeat: empty pieces
        i = int(rng.integers(0, n))
        points += [i, min(n, i + 1)]  # a 1-element piece
        if style % 2 and n > 2 * C:  # one piece spanning more than two chunks, cut mid-chunk
            lo = int(rng.integers(0, n - 2 * C))
            points = [p for p in points if not lo < p < lo + 2 * C + 7] + [lo, min(n, lo + 2 * C + 7)]
        if style % 3 == 2:  # many small pieces in one stretch
            lo = int(rng.integers(0, n))
            points += list(range(lo, min(n, lo + 3000), int(rng.integers(1, 300))))
    points = sorted(points) + [0, 0, n, n][: 2 + style % 3]  # empty pieces at the ends too
    points.sort()
    pieces = [a[points[k]:points[k + 1]].copy() for k in range(len(points) - 1)]
    t = Table(pieces, a.dtype)
    assert t.nbytes == a.nbytes and np.array_equal(t.gather().view(np.uint8), a.view(np.uint8))
    return t


def same_bits(x, y) -> bool:
    x = x.gather() if isinstance(x, Table) else x
    y = y.gather() if isinstance(y, Table) else y
    return x.dtype == y.dtype and x.tobytes() == y.tobytes()


def snapshot(t: Table) -> list[bytes]:
    return [p.tobytes() for p in t.pieces]


# Sizes per width: small, around a chunk, several chunks, and past a 1 MiB block.
def sizes(width: int) -> list[int]:
    return [0, 1, 77, C - 1, C + 1, 3 * C + 5, BLOCK // width + C // 3 + 11]


CASES = [(w, o, n, d) for w in WIDTHS for n in sizes(w) for o, d in
         [(ORDERS[(n + w) % 3], 0.01), (ORDERS[(n + w + 1) % 3], 0.4)]]


@pytest.mark.parametrize("width,order,n,density", CASES)
@on_table_backends
def test_tables_equal_gathered(kernels, width, order, n, density):
    seed = n * 8 + width
    rng = np.random.default_rng(seed)
    old, new = make_pair(seed, width, order, n, density)
    to, tn = cut(old, rng, 0), cut(new, rng, 1)  # old and new cut in different places
    want = delta_ref.encode(old, new, order)
    want_old, want_new = checksum(old), checksum(new)

    # encode, plain and fused, on tables and on a table against an array
    assert_same_sections(kernels.delta_encode(to, tn, order), want)
    assert_same_sections(kernels.delta_encode(old, tn, order), want)
    sec, s_old, s_new = kernels.delta_encode_checksummed(to, tn, order)
    assert_same_sections(sec, want)
    assert (s_old, s_new) == (want_old, want_new)
    sec, s_old, s_new = kernels.delta_encode_checksummed(to, new, order, old_sum=False)
    assert_same_sections(sec, want)
    assert (s_old, s_new) == (None, want_new)
    assert kernels.checksum(to) == want_old and kernels.checksum(tn) == want_new

    # decode
    pos, values = delta_ref.decode(old, want, order)
    p, v = kernels.delta_decode(to, want, order)
    assert p.dtype == pos.dtype and v.dtype == values.dtype
    assert np.array_equal(p, pos) and v.tobytes() == values.tobytes()
    p, v, s = kernels.delta_decode_checksummed(to, want, order)
    assert np.array_equal(p, pos) and v.tobytes() == values.tobytes() and s == want_old

    # apply out of place: into a fresh array, and into a table cut elsewhere
    before = snapshot(to)
    out, a, b = kernels.delta_apply(to, want, order)
    assert isinstance(out, np.ndarray) and same_bits(out, new) and (a, b) == (want_old, want_new)
    tout = cut(np.zeros_like(old), rng, 2)
    out, a, b = kernels.delta_apply(to, want, order, out=tout)
    assert out is tout and same_bits(tout, new) and (a, b) == (want_old, want_new)
    out, a, b = kernels.delta_apply(old, want, order, out=cut(np.zeros_like(old), rng, 1))
    assert same_bits(out, new) and (a, b) == (want_old, want_new)
    assert snapshot(to) == before, "delta_apply wrote into old"

    # apply in place, then undo through Overwritten.restore and through put()
    tb = cut(old, rng, 2)
    ow, a, b = kernels.delta_apply_inplace(tb, want, order)
    assert same_bits(tb, new) and (a, b) == (want_old, want_new)
    assert np.array_equal(ow.positions, pos) and ow.values.tobytes() == old[pos].tobytes()
    ow.restore(tb)
    assert same_bits(tb, old)
    kernels.delta_apply_inplace(tb, want, order)
    kernels.put(tb, ow.positions, ow.values)
    assert same_bits(tb, old)

    # the publisher's mirror: dst takes src's bits at the changed positions
    dst = cut(old, rng, 1)
    kernels.write_changes(dst, tn, want)
    assert same_bits(dst, new)
    flat = old.copy()
    kernels.write_changes(flat, tn, want)
    assert same_bits(flat, new)
    dst = cut(old, rng, 0)
    kernels.write_changes(dst, new, want)
    assert same_bits(dst, new)

    # copy with checksum: gather, scatter, table to table
    flat = np.empty_like(new)
    assert kernels.copy_checksummed(tn, flat) == want_new and same_bits(flat, new)
    t = cut(np.zeros_like(new), rng, 1)
    assert kernels.copy_checksummed(new, t) == want_new and same_bits(t, new)
    t = cut(np.zeros_like(new), rng, 2)
    assert kernels.copy_checksummed(tn, t) == want_new and same_bits(t, new)


@pytest.mark.parametrize("width", WIDTHS)
@on_table_backends
def test_empty_tables(kernels, width):
    dt = np.dtype(f"<u{width}")
    empty = np.zeros(0, dt)
    sec = delta_ref.encode(empty, empty, "uint")
    for t in (Table([], dt), Table([empty.copy(), empty.copy()], dt)):
        assert_same_sections(kernels.delta_encode(t, t, "uint"), sec)
        assert kernels.checksum(t) == checksum(empty)
        ow, a, b = kernels.delta_apply_inplace(t, sec, "uint")
        assert len(ow.positions) == 0 and a == b == checksum(empty)
        assert kernels.copy_checksummed(empty, t) == checksum(empty)
        kernels.put(t, np.zeros(0, np.int64), empty)


@on_table_backends
def test_bad_sections_leave_every_piece_unchanged(kernels):
    """Hostile sections: the table refuses exactly what the reference refuses, and an
    in-place apply that fails puts every piece back as it was."""
    rng = np.random.default_rng(7)
    pick = lambda lo, hi: int(rng.integers(lo, hi, endpoint=True))  # noqa: E731
    seen = set()
    for i in range(120):
        old, sec, order = make_case(pick)
        want = outcome(lambda: delta_ref.decode(old, sec, order))
        seen.add(want[0])
        t = cut(old, rng, i)
        before = snapshot(t)
        got = outcome(lambda: kernels.delta_decode(t, sec, order))
        assert got[0] == want[0] and (want[0] == "ok" or got[1] == want[1])
        got = outcome(lambda: kernels.delta_apply_inplace(t, sec, order))
        assert got[0] == want[0]
        if want[0] != "ok":
            assert got[1] == want[1]
            assert snapshot(t) == before, "a refused in-place apply changed a piece"
            with pytest.raises(FormatError):
                kernels.delta_apply(t, sec, order, out=cut(np.zeros_like(old), rng, i + 1))
        else:
            new = old.copy()
            new[want[1][0]] = want[1][1]
            assert same_bits(t, new)
            got[1][0].restore(t)
            assert snapshot(t) == before
    assert seen == {"ok", "FormatError"}


@pytest.mark.parametrize("width", WIDTHS)
@on_table_backends
def test_put_and_restore_round_trip(kernels, width):
    rng = np.random.default_rng(width)
    n = 2 * C + 333
    base = rng.integers(0, 256, size=n * width, dtype=np.uint8).view(f"<u{width}")
    t = cut(base, rng, 2)
    pos = rng.permutation(n)[: n // 7].astype(np.int64)  # any order, no repeats
    values = rng.integers(0, 256, size=len(pos) * width, dtype=np.uint8).view(base.dtype)
    saved = Overwritten(t.take(pos), pos)
    kernels.put(t, pos, values)
    want = base.copy()
    want[pos] = values
    assert same_bits(t, want)
    saved.restore(t)
    assert same_bits(t, base)
    flat = base.copy()
    kernels.put(flat, pos, values)
    assert same_bits(flat, want)

    # a position outside the stream: ValueError, and nothing written, not even the valid ones before it
    for bad in (n, -1, 1 << 40):
        before = snapshot(t)
        with pytest.raises(ValueError):
            kernels.put(t, np.array([0, 1, bad, 2], np.int64), values[:4])
        assert snapshot(t) == before


def test_whole_tensor_restore():
    base = np.arange(1000, dtype=np.uint16)
    t = cut(base, np.random.default_rng(3), 2)
    saved = Overwritten(t.gather())
    t.scatter(np.zeros(1000, np.uint16))
    saved.restore(t)
    assert same_bits(t, base)


# ---- the extension's own checks on table arguments ---------------------------------


def test_cpu_validates_tables(cpu_kernels):
    cpu = cpu_kernels._cpu
    a = np.arange(10, dtype=np.uint16)
    b = np.arange(6, dtype=np.uint16)
    addrs = np.array([a.ctypes.data, b.ctypes.data], np.int64)
    good = (addrs, np.array([0, 20, 32], np.int64))
    assert cpu.checksum(good) == int(checksum(np.concatenate([a, b])), 16)
    for starts, why in [([1, 20, 32], "starts\\[0\\]"), ([0, 20, 12], "decrease"), ([0, 20], "starts"),
                        ([0, 20, 32, 32], "starts")]:
        with pytest.raises(ValueError, match=why):
            cpu.checksum((addrs, np.array(starts, np.int64)))
    odd = (addrs, np.array([0, 19, 31], np.int64))  # whole bytes, but not whole 2-byte elements
    cpu.checksum(odd)  # checksums take any bytes
    with pytest.raises(ValueError, match="piece 0 has 19 bytes"):
        cpu.delta_encode(odd, odd, 2, "uint")
    with pytest.raises(ValueError, match="piece 0 has 19 bytes"):
        cpu.put(odd, np.zeros(0, np.int64), b"", 2)
    with pytest.raises(TypeError):
        cpu.checksum((addrs.astype(np.int32), good[1]))
    with pytest.raises(TypeError):
        cpu.checksum((addrs, good[1], good[1]))


def test_cpu_rejects_read_only_tables(cpu_kernels):
    k = cpu_kernels
    a = np.arange(10, dtype=np.uint16)
    a.flags.writeable = False
    t = Table([a], a.dtype)
    sec = delta_ref.encode(a, a, "uint")
    with pytest.raises(TypeError):
        k.delta_apply_inplace(t, sec, "uint")
    with pytest.raises(TypeError):
        k.put(t, np.zeros(0, np.int64), np.zeros(0, np.uint16))


@pytest.mark.parametrize("total", [1, 63, 64, 65, 128, 239, 240, 241, 255, 256, 257, 1023, 1024, 1025, 1088, 4096,
                                   70_001, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 333])
@pytest.mark.parametrize("step", [1, 3, 63, 64, 65, 1000, 1024, 2048, 4000])
def test_block_hash_over_any_cut_is_xxh3_of_the_bytes(total, step):
    """The C++ block hash fed span by span (csrc/xxh3_stream.h) equals one-shot xxh3 of the gathered bytes for
    every length (xxh3's short paths, stripe and 1 KiB block edges, the last stripe split across pieces) and
    every cut (pieces shorter than a stripe, straddling stripes, aligned blocks)."""
    cpu = pytest.importorskip("wsync.backends.cpu")._import_extension()
    if total > 8 * step * 1000:  # keep piece counts sane for the small steps
        step = max(step, total // 2000 + 1)
    a = np.random.default_rng(total * 7 + step).integers(0, 256, total, dtype=np.uint8)
    t = Table([a[i:i + step].copy() for i in range(0, total, step)], a.dtype)
    assert f"{cpu.checksum(t.arg()):016x}" == checksum(a)


def test_block_hash_baseline_build_agrees(tmp_path):
    """The same cuts hashed by the baseline (SSE2) build, as a CPU without AVX2 would (WSYNC_NO_AVX2)."""
    pytest.importorskip("wsync.backends.cpu")._import_extension()
    import os
    import subprocess
    import sys

    code = ("import sys; sys.path.insert(0, 'tests'); import numpy as np; from test_tables import *\n"
            "for total in (1, 240, 241, 1025, 70_001, BLOCK + 1):\n"
            "    for step in (1, 63, 65, 2048):\n"
            "        test_block_hash_over_any_cut_is_xxh3_of_the_bytes(total, step)\n"
            "print('ok')")
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "WSYNC_NO_AVX2": "1"},
                       capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
