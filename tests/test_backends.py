"""Every backend that loads here produces the reference's bytes: sections, decoded values, checksums.

The reference (wsync.codecs.delta_ref, wsync.checksum) is the spec; a backend
that cannot load on this machine shows up as a skip carrying its reason.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import examples

from wsync import backends
from wsync.checksum import BLOCK, checksum
from wsync.codecs import delta_ref
from wsync.errors import FormatError

from kernel_cases import ORDERS, WIDTHS, assert_same_sections, check_case, make_case, make_pair, specials

C = delta_ref.CHUNK_ELEMS


# ---- inputs -------------------------------------------------------------------


SIZES = (0, 1, 2, 63, 64, 65, 1000, C - 1, C, C + 1, 2 * C + 3, 3 * C)
pairs = st.builds(
    lambda seed, width, order, n, density: (make_pair(seed, width, order, n, density), order),
    seed=st.integers(0, 2**32 - 1),
    width=st.sampled_from(WIDTHS),
    order=st.sampled_from(ORDERS),
    n=st.one_of(st.sampled_from(SIZES), st.integers(0, 3 * C + 100)),
    density=st.one_of(st.sampled_from([0.0, 1e-4, 0.01, 0.3, 1.0]), st.floats(0, 1)),
)


# ---- encode and decode ----------------------------------------------------------


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=pairs)
def test_encode_decode_match_reference(kernels, case):
    (old, new), order = case
    want = delta_ref.encode(old, new, order)
    got = kernels.delta_encode(old, new, order)
    assert_same_sections(got, want)
    sec, old_sum, new_sum = kernels.delta_encode_checksummed(old, new, order)
    assert_same_sections(sec, want)
    assert (old_sum, new_sum) == (checksum(old), checksum(new))
    check_case(kernels, old, want, order)
    pos, values = kernels.delta_decode(old, want, order)
    ref_pos, ref_values = delta_ref.decode(old, want, order)
    assert pos.dtype == ref_pos.dtype and values.dtype == ref_values.dtype
    assert np.array_equal(pos, ref_pos) and np.array_equal(values, ref_values)
    out = old.copy()
    out[pos] = values
    assert out.tobytes() == new.tobytes()


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("order", ORDERS)
def test_every_step_boundary(kernels, width, order):
    """Steps -129..129 from every special value and around zero: the i8/escape boundary exactly."""
    dt = np.dtype(f"<u{width}")
    starts = np.concatenate([specials(width, order), delta_ref.unkey(np.arange(-3, 4).astype(dt) + dt.type(1 << (8 * width - 1)), order)])
    steps = np.arange(-129, 130)
    old = np.repeat(starts, len(steps)).astype(dt)
    new = delta_ref.unkey((delta_ref.monotone_key(old, order) + np.tile(steps, len(starts)).astype(dt)).astype(dt), order)
    want = delta_ref.encode(old, new, order)
    assert_same_sections(kernels.delta_encode(old, new, order), want)
    assert all(np.array_equal(a, b) for a, b in zip(kernels.delta_decode(old, want, order), delta_ref.decode(old, want, order)))


def test_short_last_chunk_and_chunk_edges(kernels):
    n = 3 * C + 7
    old = np.zeros(n, np.uint16)
    new = old.copy()
    new[[0, C - 1, C, 2 * C - 1, 2 * C, 3 * C - 1, 3 * C, n - 1]] = [1, 0x8001, 0x7F80, 2, 3, 0xFFFF, 0x8000, 5]
    for order in ORDERS:
        want = delta_ref.encode(old, new, order)
        assert_same_sections(kernels.delta_encode(old, new, order), want)


@pytest.mark.parametrize("width", WIDTHS)
def test_fused_kernels_across_checksum_blocks(kernels, width):
    """Fused kernels hash 1 MiB blocks as they go: several blocks, a short last one, every call agreeing."""
    old, new = make_pair(width, width, "float", (3 * BLOCK + 7 * width) // width + 1, 0.01)
    sec, old_sum, new_sum = kernels.delta_encode_checksummed(old, new, "float")
    assert_same_sections(sec, delta_ref.encode(old, new, "float"))
    assert (old_sum, new_sum) == (checksum(old), checksum(new))
    out, old_sum2, new_sum2 = kernels.delta_apply(old, sec, "float")
    assert out.tobytes() == new.tobytes() and (old_sum2, new_sum2) == (old_sum, new_sum)
    given_out = np.full_like(old, 7)
    out, *_ = kernels.delta_apply(old, sec, "float", out=given_out)
    assert out is given_out and given_out.tobytes() == new.tobytes()
    assert kernels.delta_decode_checksummed(old, sec, "float")[2] == old_sum
    bits = old.copy()
    overwritten, old_sum3, new_sum3 = kernels.delta_apply_inplace(bits, sec, "float")
    assert bits.tobytes() == new.tobytes() and (old_sum3, new_sum3) == (old_sum, new_sum)
    overwritten.restore(bits)
    assert bits.tobytes() == old.tobytes()


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("density", [0.0, 1e-3, 0.05, 1.0])
def test_write_changes_makes_a_copy_of_old_into_new(kernels, width, density):
    """The publisher's mirror step: encode hashing only new, then copy the changed elements across, byte-exact."""
    old, new = make_pair(3 + width, width, "float", 3 * C + 17, density)
    sec, old_sum, new_sum = kernels.delta_encode_checksummed(old, new, "float", old_sum=False)
    assert old_sum is None and new_sum == checksum(new)
    assert_same_sections(sec, delta_ref.encode(old, new, "float"))
    mirror = old.copy()
    kernels.write_changes(mirror, new, sec)
    assert mirror.tobytes() == new.tobytes()
    assert (delta_ref.positions(sec, len(old)) == np.flatnonzero(old != new)).all()


def test_write_changes_refuses_a_position_off_its_chunk(kernels):
    old, new = make_pair(9, 2, "float", 2 * C, 0.01)
    sec = delta_ref.encode(old, new, "float")
    sec.gaps = sec.gaps.copy()
    sec.gaps[-1] = 65535
    with pytest.raises(FormatError, match="lands at offset"):
        kernels.write_changes(old.copy(), new, sec)
    with pytest.raises(ValueError):
        kernels.write_changes(np.empty(5, old.dtype), new, sec)


def test_inplace_refusal_puts_back_earlier_chunks(kernels):
    """A bad change in the last chunk, after earlier chunks were written: the base comes back whole."""
    old, new = make_pair(5, 2, "float", 4 * C, 0.05)
    sec = delta_ref.encode(old, new, "float")
    sec.gaps = sec.gaps.copy()
    sec.gaps[-1] = 65535  # the last change walks off its chunk
    bits = old.copy()
    with pytest.raises(FormatError, match="lands at offset"):
        kernels.delta_apply_inplace(bits, sec, "float")
    assert bits.tobytes() == old.tobytes()


def test_out_must_be_separate(kernels):
    old, new = make_pair(1, 2, "float", 1000, 0.1)
    sec = delta_ref.encode(old, new, "float")
    with pytest.raises(ValueError, match="overlap"):
        kernels.delta_apply(old, sec, "float", out=old)
    with pytest.raises(ValueError):
        kernels.delta_apply(old, sec, "float", out=np.empty(999, old.dtype))


@pytest.mark.parametrize("size", [0, 1, BLOCK - 1, BLOCK + 3, 3 * BLOCK + 7])
def test_copy_checksummed(kernels, size):
    src = np.random.default_rng(size).integers(0, 256, size=size, dtype=np.uint8)
    dst = np.zeros_like(src)
    assert kernels.copy_checksummed(src, dst) == checksum(src)
    assert dst.tobytes() == src.tobytes()
    dst16 = np.zeros(size // 2, np.uint16)
    assert kernels.copy_checksummed(memoryview(src.tobytes()[: 2 * (size // 2)]), dst16) == checksum(src[: 2 * (size // 2)])
    assert dst16.tobytes() == src.tobytes()[: 2 * (size // 2)]


def test_strided_input(kernels):
    rng = np.random.default_rng(3)
    old = rng.integers(0, 1 << 16, size=2 * 70_000, dtype=np.uint16)[::2]
    new = old.copy()
    new[::97] += 1
    assert_same_sections(kernels.delta_encode(old, new, "float"), delta_ref.encode(old, new, "float"))


# ---- bad input --------------------------------------------------------------------


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_hostile_sections_fail_like_the_reference(kernels, data):
    """Forged sections raise FormatError with the reference's message, or decode to exactly its arrays."""
    old, sec, order = make_case(lambda lo, hi: data.draw(st.integers(lo, hi)))
    check_case(kernels, old, sec, order)


def test_known_lies(kernels):
    """Each of the reference's checks, once by hand."""
    old = np.zeros(10, np.uint16)
    u4, u2, i1 = (lambda *v: np.array(v, "<u4")), (lambda *v: np.array(v, "<u2")), (lambda *v: np.array(v, np.int8))
    cases = [
        delta_ref.DeltaSections(u4(1), u2(0), i1(1), u2()),  # table length
        delta_ref.DeltaSections(u4(11, 0), u2(*[0] * 11), i1(*[1] * 11), u2()),  # more changes than elements
        delta_ref.DeltaSections(u4(1, 2), u2(0), i1(-128), u2(1, 2)),  # more escapes than changes
        delta_ref.DeltaSections(u4(2, 0), u2(0), i1(1), u2()),  # section sizes
        delta_ref.DeltaSections(u4(2, 0), u2(3, 8), i1(1, 1), u2()),  # position outside the chunk
        delta_ref.DeltaSections(u4(1, 1), u2(3), i1(5), u2(7)),  # escape count vs markers
        delta_ref.DeltaSections(u4(2, 1), u2(3, 0), i1(-128, -128), u2(7)),  # markers exceed escapes
    ]
    for sec in cases:
        assert check_case(kernels, old, sec, "float") == "FormatError"


# ---- checksum ------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 7])
def test_checksum_matches_reference(kernels, size):
    data = np.random.default_rng(size).integers(0, 256, size=size, dtype=np.uint8)
    want = checksum(data)
    assert kernels.checksum(data) == want
    assert kernels.checksum(data.tobytes()) == want
    assert kernels.checksum(memoryview(data.tobytes())) == want
    if size % 2 == 0:
        assert kernels.checksum(data.view(np.uint16)) == want


def test_threads_survive_fork(kernels):
    """A forked child (multiprocessing's default on Linux) gets working kernel threads of its own."""
    import os

    data = np.random.default_rng(9).integers(0, 256, size=8 * BLOCK + 5, dtype=np.uint8)
    want = checksum(data)
    assert kernels.checksum(data) == want  # the parent's threads are running now
    pid = os.fork()
    if pid == 0:  # child: report through the exit status only
        ok = kernels.checksum(data) == want and kernels.copy_checksummed(data, np.empty_like(data)) == want
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_concurrent_callers(kernels):
    """Kernels release the GIL: callers on several Python threads at once all get exact answers."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(11)
    old, new = make_pair(11, 2, "float", 6 * C + 17, 0.02)
    sec = delta_ref.encode(old, new, "float")
    data = [rng.integers(0, 256, size=3 * BLOCK + i, dtype=np.uint8) for i in range(6)]

    def job(i):
        out, _, new_sum = kernels.delta_apply(old, sec, "float")
        return kernels.checksum(data[i]) == checksum(data[i]) and out.tobytes() == new.tobytes() and new_sum == checksum(new)

    with ThreadPoolExecutor(4) as ex:
        assert all(ex.map(job, range(6)))


def test_auto_never_sends_host_arrays_to_the_gpu_backend(monkeypatch):
    """Even where the GPU backend loads, auto picks the host kernels: on host arrays a GPU can only copy up,
    run and copy back. Device tensors go to device_kernels() instead."""
    loaded = []

    def fake_load(name):
        loaded.append(name)
        return ("kernels", name)

    monkeypatch.setattr(backends, "_load", fake_load)
    monkeypatch.setattr(backends, "_cache", {})
    monkeypatch.setattr(backends, "_device", [])
    monkeypatch.delenv("WSYNC_BACKEND", raising=False)
    assert backends.kernels() == ("kernels", "cpu")
    assert backends.backend().name == "cpu"
    assert "cuda" not in loaded
    assert backends.device_kernels() == ("kernels", "cuda")
    assert backends.kernels("cuda") == ("kernels", "cuda")  # by name, still honoured


def test_an_extension_lacking_an_entry_point_fails_the_backend_check(monkeypatch):
    """A wsync._cpu built from older sources (a stand-in module without v2_decode) is refused whole, naming what
    it lacks, and auto passes over it to the reference: select() alone decides which kernels run."""
    import types

    from wsync.backends import cpu
    from wsync.errors import BackendUnavailable

    stale = types.ModuleType("wsync._cpu")
    for name in cpu.SYMBOLS:
        if name != "v2_decode":
            setattr(stale, name, object())
    monkeypatch.setattr(cpu, "_import_extension", lambda: stale)
    monkeypatch.setattr(backends, "_cache", {})
    monkeypatch.delenv("WSYNC_BACKEND", raising=False)
    with pytest.raises(BackendUnavailable, match="lacks v2_decode: it was built from older sources; rebuild"):
        backends.kernels("cpu")
    k, info = backends.select("auto")
    assert k.name == "ref" and "lacks v2_decode" in info.reason
    stale.v2_decode = object()
    monkeypatch.setattr(backends, "_cache", {})
    assert backends.kernels("cpu")._cpu is stale
