"""CudaKernels' device entry points on a fake runtime: the right device, the right stream, nothing read early.

tests/cudasim/fakert.py runs the real kernels (on the CPU harness) but fakes
devices, streams and events, logs every launch, event, wait, sync and
record_stream, and fails any read of device memory that is not ordered after
the kernel that wrote it. These are the host-side bugs a GPU run would show
only as rare wrong bytes: sections copied to the host before the kernel that
fills them has run; sections or undo buffers read on another stream without an
event or record_stream; a tensor hashed or encoded on a device that does not
hold it; 16-byte elements.
"""
from __future__ import annotations

import numpy as np
import pytest

from wsync.backends import cuda
from wsync.checksum import checksum
from wsync.codecs import delta_ref

cudasim = pytest.importorskip("cudasim")
from cudasim.cases import make_case, sections_equal  # noqa: E402
from cudasim.fakert import DeviceMismatch, FakeRuntime, FakeTensor, StreamRace  # noqa: E402

N = 70_001  # two chunks


@pytest.fixture
def rt(sim):
    return FakeRuntime(sim)


@pytest.fixture
def kern(rt):
    return cuda.CudaKernels(runtime=rt)


def pair(width=2, order="float", n=N, device=0, seed=1):
    old, new = make_case(np.random.default_rng(seed), width, order, n, 0.02)
    return old, new, FakeTensor(old, device), FakeTensor(new, device)


# ---- 1. the copy to the host waits for the fill ---------------------------------------------------


def test_sections_to_host_waits_for_the_kernels_on_torchs_stream(rt, kern):
    old, new, told, tnew = pair()
    s = rt.new_stream(0)
    with rt.torch_stream(s):  # with torch.cuda.stream(s): encode_device(...)
        sec = kern.encode_device(told, tnew, "float")
    assert {e[3] for e in rt.launches()} == {s}  # every kernel on torch's stream
    with pytest.raises(StreamRace, match="delta_fill_u16_float"):  # what the old sections_to_host did
        sec.gaps.get()
    host = cuda.sections_to_host(sec, np.uint16)  # waits for `ready`, then copies
    assert sections_equal(host, delta_ref.encode(old, new, "float"))
    assert ("sync", s, sec.ready.seq) in rt.log and sec.ready.seq == len(rt.launches())


def test_fused_sections_wait_too(rt, kern):
    rng = np.random.default_rng(2)
    before = (rng.standard_normal(N) * 0.02).astype(np.float32)
    after = before + (rng.standard_normal(N) * 1e-3).astype(np.float32)
    s = rt.new_stream(0)
    with rt.torch_stream(s):
        sec = kern.fused_change_detect(FakeTensor(before), FakeTensor(after), nan_bits=(0x7FFF, 0x7FFF))
    with pytest.raises(StreamRace, match="fused_fill_bf16"):
        sec.steps.get()
    import torch

    b16 = torch.from_numpy(before).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    a16 = torch.from_numpy(after).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert sections_equal(cuda.sections_to_host(sec, np.uint16), delta_ref.encode(b16, a16, "float"))


# ---- 2. buffers used on another stream: an event to wait for, and record_stream --------------------


def test_use_on_orders_another_stream_and_records_the_memory(rt, kern):
    _, _, told, tnew = pair()
    s1, s2 = rt.new_stream(0), rt.new_stream(0)
    with rt.torch_stream(s1):
        sec = kern.encode_device(told, tnew, "float")
    with rt.cupy_stream(s2), pytest.raises(StreamRace):  # a transport reading on its own stream, unordered
        sec.table.get()
    sec.use_on(s2)
    assert ("wait", s2, s1, sec.ready.seq) in rt.log
    recorded = {(e[1], e[3]) for e in rt.log if e[0] == "record_stream"}
    for a in (sec.table, sec.gaps, sec.steps, sec.escapes):
        assert (a.ctypes.data, s2) in recorded
    with rt.cupy_stream(s2):
        sec.table.get(), sec.gaps.get(), sec.steps.get()  # ordered now


def test_apply_on_another_stream_waits_for_the_encode(rt, kern):
    """Encode on the trainer's stream, apply on the engine's (a colocated engine): the apply's
    kernels read the sections only after the event the encode left."""
    old, new, told, tnew = pair()
    s1, s2 = rt.new_stream(0), rt.new_stream(0)
    with rt.torch_stream(s1):
        sec = kern.encode_device(told, tnew, "float")
    live = FakeTensor(old.copy())
    with rt.torch_stream(s2):
        undo = kern.apply_device(live, sec, "float", undo=True)
    assert ("wait", s2, s1, sec.ready.seq) in rt.log
    assert live.data.tobytes() == new.tobytes()
    assert undo.ready.stream == s2
    s3 = rt.new_stream(0)
    with rt.torch_stream(s3):  # the undo is put back from yet another stream
        kern.restore_device(live, undo)
    assert ("wait", s3, s2, undo.ready.seq) in rt.log
    assert live.data.tobytes() == old.tobytes()
    undo.use_on(s1)
    assert (undo.saved.ctypes.data, s1) in {(e[1], e[3]) for e in rt.log if e[0] == "record_stream"}


def test_without_the_wait_the_fake_sees_the_race(rt, kern):
    """The check the tests above rely on: a reader on another stream with no wait is caught."""
    _, _, told, tnew = pair()
    s1, s2 = rt.new_stream(0), rt.new_stream(0)
    with rt.torch_stream(s1):
        sec = kern.encode_device(told, tnew, "float")
    with rt.cupy_stream(s2), pytest.raises(StreamRace, match="delta_check argument 3"):
        rt.launch("delta_check", 2, (np.uint64(0), np.uint64(N), np.uint32(2), sec.table,
                                     rt.xp.zeros(2, np.uint64), rt.xp.zeros(2, np.uint64), sec.gaps, sec.steps,
                                     sec.escapes.view(np.uint8), np.uint64(0), np.uint64(0),
                                     rt.xp.zeros(2, np.uint64)))


# ---- 3. the buffer's own device ---------------------------------------------------------------------


def test_checksum_runs_on_the_buffers_device(rt, kern):
    data = np.random.default_rng(3).integers(0, 256, 3 * 2**20 + 5, dtype=np.uint8)
    t = FakeTensor(data, device=1)
    assert rt.device == 0  # the current device is another one
    assert kern.checksum(t) == checksum(data)
    assert kern.digest_device(t) == checksum(data)
    assert [e[2] for e in rt.launches()] == [1, 1]


def test_inputs_on_two_devices_are_refused(rt, kern):
    old, new, told, _ = pair()
    t1 = FakeTensor(new, device=1)
    with pytest.raises(ValueError, match=r"old on cuda:0, new on cuda:1"):
        kern.encode_device(told, t1, "float")
    with pytest.raises(ValueError, match=r"tensors\[0\] on cuda:0, tensors\[1\] on cuda:1"):
        kern.digests_device([told, t1])
    with pytest.raises(ValueError, match="different GPUs"):
        kern.fused_change_detect(FakeTensor(np.zeros(10, np.float32), 0), FakeTensor(np.ones(10, np.float32), 1))
    with rt.torch_stream(rt.new_stream(0)):
        sec = kern.encode_device(told, FakeTensor(new), "float")
    with pytest.raises(ValueError, match=r"weights on cuda:1, sections.table on cuda:0"):
        kern.apply_device(FakeTensor(old.copy(), device=1), sec, "float")
    assert not [e for e in rt.launches() if e[2] == 1]  # refused before any launch


def test_everything_runs_on_the_inputs_device_and_its_torch_stream(rt, kern):
    old, new, told, tnew = pair(device=1)
    s = rt.new_stream(1)
    with rt.torch_stream(s):
        sec = kern.encode_device(told, tnew, "float")
        kern.apply_device(FakeTensor(old.copy(), 1), sec, "float")
    assert {(e[2], e[3]) for e in rt.launches()} == {(1, s)}


def test_v2_decoded_on_the_base_device_applies_on_another_stream(rt, kern):
    """A delta-v2 tensor decoded against a CUDA base (a warp per chunk, its counts read back on its own
    stream), applied from another stream: the apply waits for the decode's event, the bytes are the new ones."""
    from codec_helpers import delta_pair

    from wsync.codecs import v2_ref

    dt, old, new = delta_pair("BF16", 2 * N + 5, np.random.default_rng(4), density=0.01)
    parts = v2_ref.encode(old, delta_ref.encode(old, new, dt.order), dt)
    live = FakeTensor(old.copy(), 1)
    s1, s2 = rt.new_stream(1), rt.new_stream(1)
    with rt.torch_stream(s1):
        sec = kern.v2_decode_device(live, parts, dt)
    assert {(e[2], e[3]) for e in rt.launches()} == {(1, s1)} and "v2_decode_2" in {e[1] for e in rt.launches()}
    with rt.torch_stream(s2):
        kern.apply_device(live, sec, "float", undo=False)
    assert ("wait", s2, s1, sec.ready.seq) in rt.log
    assert live.data.tobytes() == new.tobytes()


def test_a_launch_with_another_devices_array_is_caught(rt):
    with pytest.raises(DeviceMismatch):
        rt.launch("delta_check", 1, (np.uint64(0), np.uint64(1), np.uint32(1),
                                     FakeTensor(np.zeros(2, np.uint32), 1) and rt.bits(FakeTensor(np.zeros(2, np.uint32), 1)),
                                     *[rt.xp.zeros(1, np.uint64)] * 2, rt.xp.zeros(0, np.uint16),
                                     rt.xp.zeros(0, np.int8), rt.xp.zeros(0, np.uint8), np.uint64(0), np.uint64(0),
                                     rt.xp.zeros(2, np.uint64)))


# ---- 4. 16-byte elements ---------------------------------------------------------------------------


def test_sixteen_byte_elements_are_refused_with_a_reason_and_hashed(rt, kern):
    data = np.random.default_rng(4).standard_normal(1000) + 1j
    t = FakeTensor(data.astype(np.complex128))
    with pytest.raises(TypeError, match=r"1-, 2-, 4- or 8-byte elements, got complex128 \(16 bytes\)"):
        kern.encode_device(t, t, "float")
    with pytest.raises(TypeError, match="16 bytes"):
        kern.apply_device(t, delta_ref.encode(np.zeros(1000, np.uint64), np.zeros(1000, np.uint64), "uint"), "uint")
    assert kern.digest_device(t) == checksum(data.astype(np.complex128).view(np.uint8))
    host = cuda._KernelsOver(cudasim.SimRuntime(rt.sim))
    with pytest.raises(TypeError, match="16 bytes"):
        host.delta_encode(np.zeros(4, np.complex128), np.ones(4, np.complex128), "float")
