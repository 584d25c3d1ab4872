"""The CUDA harness itself (tests/cudasim): strict where the hardware is undefined, exact where it is not.

tests/cudasim/selftest.cu holds small kernels that break one rule each; the
harness must stop every one of them, under every schedule, with its reason.
The collectives, intrinsics and atomics the real kernels rely on are checked
against a model written here in numpy; shared memory must start as junk, and a
race must show up as different answers under different schedules. If any of
these went lenient, test_cuda_sim.py could pass kernels a GPU would not.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

cudasim = pytest.importorskip("cudasim")
SimError = cudasim.SimError
SCHEDULES = ("forward", "reverse", "random", "round_robin")


@pytest.fixture(scope="module")
def st():
    if cudasim.compiler() is None:
        pytest.skip("no C++ compiler on PATH: the CUDA harness compiles with g++")
    return cudasim.load([cudasim.HERE / "selftest.cu"])


# mode of st_rules -> what the harness must say (any of the alternatives: the schedule decides
# which thread notices first)
BROKEN = {
    0: r"divergent barriers",
    1: r"exited while \d+ thread\(s\) wait at __syncthreads|after \d+ thread\(s\) of the block exited",
    2: r"exited while lanes .* wait for it at __shfl_xor_sync|names lanes 0x[0-9a-f]+ that have exited|deadlock",
    3: r"mismatched masks|names lanes 0x[0-9a-f]+ that have exited|exited while lanes .* wait for it",
    4: r"leaves itself out|not in the mask",
    5: r"reads lane 20, which is not in the mask",
    6: r"exited while lanes .* wait for it|names lanes 0x[0-9a-f]+ that have exited",
    7: r"memory fault \(SIGSEGV\) .*from the start of a 512-byte argument buffer",
    8: r"memory fault|wrote past the end of argument 1",
    9: r"argument 2 is const but the kernel wrote to it",
    10: r"stack overflow",
    11: r"deadlock",
    12: r"deadlock|while lanes 0x[0-9a-f]+ of its warp wait for it",
    13: r"exited while lanes .* wait for it at __syncwarp|names lanes 0x[0-9a-f]+ that have exited",
}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("mode", sorted(BROKEN))
def test_broken_kernels_are_stopped_with_their_reason(st, mode, schedule):
    out = np.zeros(2 * 64, np.uint32)
    inp = np.arange(200, dtype=np.uint32)
    with pytest.raises(SimError, match=BROKEN[mode]):
        st.launch("st_rules", 2, 64, (np.int32(mode), out, inp), schedule, seed=mode)


def test_a_process_survives_its_faults(st):
    """After a fault or a stuck block the next launch starts clean."""
    out = np.zeros(128, np.uint32)
    for mode in (7, 10, 12, 0):
        with pytest.raises(SimError):
            st.launch("st_rules", 2, 64, (np.int32(mode), out, np.arange(200, dtype=np.uint32)), "random", seed=1)
        out[:] = 0
        st.launch("st_rules", 2, 64, (np.int32(99), out, np.arange(200, dtype=np.uint32)))
        assert out.tolist() == list(range(64)) * 2


def _model(x: np.ndarray, block: int) -> np.ndarray:
    """What st_collectives writes, per CUDA's definitions, for input words x."""
    n = len(x)
    out = np.zeros((n, 16), dtype=np.uint64)
    for w0 in range(0, n, 32):
        v = x[w0 : w0 + 32].astype(np.int64)
        lane = np.arange(32)
        out[w0 : w0 + 32, 0] = v[7]
        out[w0 : w0 + 32, 1] = v[(lane & ~7) + 3]
        out[w0 : w0 + 32, 2] = np.where(lane >= 3, v[np.maximum(lane - 3, 0)], v)
        out[w0 : w0 + 32, 3] = np.where(lane % 16 >= 3, v[np.maximum(lane - 3, 0)], v)
        out[w0 : w0 + 32, 4] = np.where(lane + 5 < 32, v[np.minimum(lane + 5, 31)], v)
        out[w0 : w0 + 32, 5] = v[lane ^ 9]
        src = lane ^ 9
        out[w0 : w0 + 32, 6] = np.where((src & ~7) > (lane & ~7), v, v[src])
        out[w0 : w0 + 32, 7] = int(sum(1 << i for i in range(32) if v[i] & 1))
        out[w0 : w0 + 32, 8] = int((v == 12345).any())
        out[w0 : w0 + 32, 9] = int((v != 12345).all())
        out[w0 : w0 + 32, 10] = int(v.sum()) & 0xFFFFFFFF
        out[w0 : w0 + 32, 11] = int((v - 1000).min()) & 0xFFFFFFFF
        out[w0 : w0 + 32, 12] = int(v.max())
        out[w0 : w0 + 32, 14] = v[31]
        out[w0 : w0 + 32, 15] = v[lane ^ 15]
    for b0 in range(0, n, block):
        out[b0 : b0 + block, 13] = int((x[b0 : b0 + block] & 1).sum())
    return out.astype(np.uint32)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_collectives_compute_what_cuda_defines(st, schedule):
    rng = np.random.default_rng(3)
    x = rng.integers(0, 1 << 31, size=3 * 96, dtype=np.uint32)
    x[40] = 12345
    out = np.zeros((len(x), 16), dtype=np.uint32)
    st.launch("st_collectives", 3, 96, (out, x), schedule, seed=2)
    assert (out == _model(x, 96)).all(), np.argwhere(out != _model(x, 96))[:10]


def test_shared_memory_starts_as_junk(st):
    out = np.zeros(4 * 256, dtype=np.uint32)
    st.launch("st_shared_junk", 4, 256, (out, np.int32(0)))
    per_block = out.reshape(4, 256)
    assert (per_block != 0).mean() > 0.9  # not zero-filled
    assert len({row.tobytes() for row in per_block}) == 4  # fresh junk every block


def test_a_race_shows_under_some_schedule(st):
    """Thread 0 writes shared memory that others read with no barrier between: the schedules disagree."""
    seen = set()
    for schedule in SCHEDULES:
        out = np.zeros(128, dtype=np.uint32)
        st.launch("st_race", 1, 128, (np.int32(1), out), schedule, seed=4)
        seen.add(bool((out == 42).all()))
        out[:] = 0
        st.launch("st_race", 1, 128, (np.int32(0), out), schedule, seed=4)  # with the barrier: always right
        assert (out == 42).all()
    assert seen == {True, False}


def test_intrinsics_and_atomics(st):
    rng = np.random.default_rng(5)
    n = 64
    x = rng.integers(0, 1 << 32, size=n + 1, dtype=np.uint64).astype(np.uint32)
    x[:4] = [0, 1, 0x80000000, 0xFFFFFFFF]
    out = np.zeros(8 * n, dtype=np.uint32)
    acc = np.array([0, 2**64 - 1, 0, 0], dtype=np.uint64)
    st.launch("st_intrinsics", 2, 32, (x, out, acc), "random", seed=6)
    o = out.reshape(n, 8).astype(np.int64)
    for t in range(n):
        a, b = int(x[t]), int(x[t + 1])
        assert o[t, 0] == bin(a).count("1")
        assert o[t, 1] == (32 - a.bit_length())
        assert o[t, 2] == ((a & -a).bit_length() if a else 0)
        assert o[t, 3] == (((b << 32 | a) << (t & 31)) >> 32) & 0xFFFFFFFF
        assert o[t, 4] == ((b << 32 | a) >> (t & 31)) & 0xFFFFFFFF
        assert o[t, 5] == int(f"{a:032b}"[::-1], 2)
        assert o[t, 6] == ((((a << 20 | b) & (2**64 - 1)) * 0x9E3779B97F4A7C15 >> 64) >> 7) & 0xFFFFFFFF
        v = b << 32 | a
        assert o[t, 7] == sum(((v >> (8 * ((0x5140 >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))
    xs = [int(v) for v in x[:n]]
    assert acc.tolist() == [sum(xs), min(xs), np.bitwise_or.reduce(x[:n]).item(), max(xs)]


# ---- launches the way cupy takes them, checked against the kernel's parameters --------------------------


@pytest.mark.parametrize("args,why", [
    ((np.int64(0), np.zeros(128, np.uint32), np.zeros(4, np.uint32)), r"a int64 \(8 bytes\) for a 4-byte parameter"),
    ((0, np.zeros(128, np.uint32), np.zeros(4, np.uint32)), r"takes a numpy scalar"),
    ((np.int32(99), np.zeros(128, np.uint16), np.zeros(4, np.uint32)), r"uint16 elements .* 4-byte values"),
    ((np.int32(99), np.zeros((128, 2), np.uint32)[:, 0], np.zeros(4, np.uint32)), r"not contiguous"),
    ((np.int32(99), np.zeros(128, np.uint32)), r"takes 3 arguments, got 2"),
])
def test_wrong_arguments_are_refused(st, args, why):
    with pytest.raises(SimError, match=why):
        st.launch("st_rules", 2, 64, args)


def test_overlapping_and_read_only_arguments_are_refused(st):
    buf = np.zeros(256, np.uint32)
    with pytest.raises(SimError, match="overlap"):
        st.launch("st_rules", 2, 64, (np.int32(99), buf[:128], buf[100:]))
    ro = np.zeros(128, np.uint32)
    ro.flags.writeable = False
    with pytest.raises(SimError, match="read-only array for a non-const pointer"):
        st.launch("st_rules", 2, 64, (np.int32(99), ro, np.zeros(4, np.uint32)))


@pytest.mark.parametrize("grid,block", [(0, 64), (1, 0), (1, 1025)])
def test_invalid_configurations_are_refused(st, grid, block):
    with pytest.raises(SimError, match="invalid configuration"):
        st.launch("st_rules", grid, block, (np.int32(99), np.zeros(128, np.uint32), np.zeros(4, np.uint32)))


def test_partial_warps(st):
    """A block of 48 threads: its second warp has 16 lanes; a full mask there names lanes that do not exist."""
    out = np.zeros(48, np.uint32)
    with pytest.raises(SimError, match="do not exist"):
        st.launch("st_rules", 1, 48, (np.int32(14), out, np.zeros(4, np.uint32)))
    st.launch("st_rules", 1, 48, (np.int32(99), out, np.zeros(4, np.uint32)))
    assert out.tolist() == list(range(48))


@pytest.mark.build
def test_builds_are_cached_by_content(tmp_path):
    src = tmp_path / "k.cu"
    src.write_text('extern "C" __global__ void k1(unsigned* o) { o[threadIdx.x] = threadIdx.x; }\n')
    a = cudasim.build([src])
    assert cudasim.build([src]) == a
    src.write_text(src.read_text() + "// edited\n")
    assert cudasim.build([src]) != a
    assert set(cudasim.Sim(cudasim.build([src])).kernels) == {"k1"}


def test_sources_are_the_repository_kernels():
    assert cudasim.CSRC == Path(__file__).resolve().parents[1] / "csrc"
    assert (cudasim.CSRC / "delta_cuda.cu") in cudasim.default_sources()
