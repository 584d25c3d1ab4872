"""The CUDA decoder of delta v2 (csrc/ws_v2_cuda.cu), run on CPU fibers (tests/cudasim): byte for byte v2_ref.

A warp per chunk counts and places, one lane reading the codes with ws_v2.cuh's decode_codes; the host part
is the CUDA backend's own (wsync.backends.cuda._Launcher.v2_decode: parsing the model and the index, batching
chunks, compacting the changes and building the v1 sections), over the harness's runtime, whose fresh device memory is junk as cudaMalloc's is. Each case runs
under the forward, reverse and random schedules; corrupt chunks must come back as FormatError, never a fault.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import examples

from wsync.backends import cuda
from wsync.codecs import delta_ref, v2_ref
from wsync.errors import FormatError

cudasim = pytest.importorskip("cudasim")
from codec_helpers import delta_pair, gpu_decode, same_sections, v2_case  # noqa: E402

C = delta_ref.CHUNK_ELEMS


@pytest.mark.parametrize("name,n", [("BF16", 2 * C + 4099), ("F32", C + 1), ("I8", 5000), ("U64", 3000),
                                    ("F8_E5M2", C - 1), ("BF16", C + 2), ("BF16", C + 5)])
@pytest.mark.parametrize("schedule", ["forward", "reverse", "random"])
def test_kernel_decodes_what_the_reference_decodes(sim, name, n, schedule):
    dt, old, parts = v2_case(name, n, seed=n)
    assert same_sections(gpu_decode(sim, old, parts, dt, schedule), v2_ref.decode(old, parts, dt))


def test_chunks_in_several_launches(sim, monkeypatch):
    """A tensor whose scratch does not fit one launch is decoded a chunk per launch: the same sections."""
    monkeypatch.setattr(cuda, "V2_SCRATCH_BYTES", cuda.V2_CHUNK_SCRATCH)
    rt = cudasim.SimRuntime(sim, "random", seed=3)
    dt, old, parts = v2_case("BF16", 3 * C + 777, seed=4)
    assert same_sections(gpu_decode(sim, old, parts, dt, runtime=rt), v2_ref.decode(old, parts, dt))
    assert rt.launched.count("v2_decode_2") == 4


def test_the_runtimes_budget_sizes_the_launches(sim):
    """A runtime that knows its free memory (cupy's) sets the scratch per launch; blocks are V2_BLOCK threads."""

    class Budgeted(cudasim.SimRuntime):
        def v2_scratch_budget(self) -> int:
            return 2 * cuda.V2_CHUNK_SCRATCH

    rt = Budgeted(sim, "random", seed=5)
    dt, old, parts = v2_case("BF16", 4 * C + 9, seed=6)
    assert same_sections(gpu_decode(sim, old, parts, dt, runtime=rt), v2_ref.decode(old, parts, dt))
    assert rt.launched.count("v2_decode_2") == 3 and set(rt.blocks) == {cuda.V2_BLOCK}


def test_torch_fp8_cuda_tensors_count_as_device_arrays():
    """torch's __cuda_array_interface__ raises KeyError for dtypes numpy lacks (float8_*): found on an H200,
    where every fp8 call of the CUDA backend failed. A stand-in with that property, as torch 2.11 has it."""

    class Fp8Tensor:
        def __init__(self, is_cuda: bool):
            self.is_cuda = is_cuda

        @property
        def __cuda_array_interface__(self):
            if not self.is_cuda:
                raise AttributeError("not a CUDA tensor")
            raise KeyError("torch.float8_e4m3fn")

    assert cuda._is_device_array(Fp8Tensor(True)) and not cuda._is_device_array(Fp8Tensor(False))
    assert not cuda._is_device_array(np.zeros(3))


def test_cuda_backend_encodes_v2_with_the_cpp_encoder(sim, monkeypatch):
    """No CUDA encoder: the backend's v1 sections (from the GPU kernels) go to the C++ encoder on the host,
    the reference's bytes without the reference's Python; without the extension, the reference itself."""
    from wsync.bits import TensorBits
    from wsync.codecs import delta

    dt, old, new = delta_pair("BF16", 3 * C + 4099, np.random.default_rng(5))
    want = v2_ref.encode(old, delta_ref.encode(old, new, dt.order), dt)
    k = cuda._KernelsOver(cudasim.SimRuntime(sim, "random", seed=6))
    assert cuda._host_kernels() is not None, "the C++ extension is part of the install (setup.py builds it)"

    def no_reference(*a, **kw):
        raise AssertionError("the reference encoder ran")

    monkeypatch.setattr(v2_ref, "encode", no_reference)
    enc = delta.measure(TensorBits(dt, old.shape, old), TensorBits(dt, new.shape, new), tier="v2", kernels=k)
    assert enc.kind == "delta-v2" and enc.parts == want
    monkeypatch.undo()
    monkeypatch.setattr(cuda, "_host_kernels", lambda: None)
    assert k.v2_encode(old, k.delta_encode(old, new, dt.order), dt) == want


def test_kernel_refuses_corrupt_chunks_as_the_reference_does(sim):
    """Bit flips in the chunk streams: the kernel reports an error exactly where the reference raises."""
    dt, old, parts = v2_case("BF16", C + 2000, seed=1, density=0.005)
    rng = np.random.default_rng(2)
    for part in ("pos", "steps"):
        for _ in range(8):
            b = bytearray(parts[part])
            b[int(rng.integers(len(b)))] ^= 1 << int(rng.integers(8))
            bad = {**parts, part: bytes(b)}
            try:
                want = v2_ref.decode(old, bad, dt)
            except FormatError:
                want = None
            try:
                got = gpu_decode(sim, old, bad, dt, "random")
            except FormatError:
                got = None
            assert (want is None) == (got is None), part
            if want is not None:
                assert same_sections(want, got)


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**40), st.integers(0, 2**40)), min_size=1, max_size=40),
       st.binary(max_size=12), st.integers(0, 3), st.sampled_from(["exact", "under", "over", "cut"]))
def test_the_index_read_with_numpy_is_the_references(lens, junk, where, how):
    """cuda.v2_index_lengths (numpy) returns what v2_ref.read_index returns, and refuses what it refuses:
    good indexes, and ones with junk spliced in, cut short, or limits that the lengths do not meet."""
    out = bytearray()
    for a, b in lens:
        v2_ref.put_varint(out, a)
        v2_ref.put_varint(out, b)
    if how == "cut":
        out = out[: len(out) * where // 4] + junk
    pos_len, steps_len = sum(a for a, _ in lens), sum(b for _, b in lens)
    if how == "under":
        pos_len -= where
    elif how == "over":
        steps_len += where
    index, nc = bytes(out), len(lens)
    try:
        want = np.array(v2_ref.read_index(index, nc, pos_len, steps_len), np.uint64).reshape(nc, 2)
    except FormatError:
        with pytest.raises(FormatError):
            cuda.v2_index_lengths(index, nc, pos_len, steps_len)
        return
    got = cuda.v2_index_lengths(index, nc, pos_len, steps_len)
    assert got.dtype == np.uint64 and got.tobytes() == want.tobytes()


def test_overlong_varints_take_the_references_path():
    """Ten-byte varints (zero continuation bytes: legal for the reference) are left to it, and agree."""
    index = bytes([0x80] * 9 + [0x00]) + bytes([5])
    assert cuda.v2_index_lengths(index, 1, 0, 5).tolist() == [[0, 5]]
