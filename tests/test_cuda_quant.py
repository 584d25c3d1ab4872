"""The quantizers' CUDA kernels on device tensors (CudaKernels.quantize, what wsync.quant.Quantizer calls for a
CUDA weight), run on the CPU-fiber harness behind a fake CUDA runtime that counts what crosses to the host.

The codes and scales are written into the caller's device buffers and equal the reference byte for byte; the
only bytes that come back to the host are the kernel's non-finite flag (one u64), and wsync's count of what
crosses (backends.transfers) says so, unless there is a non-finite element, which is then named with the
reference's QuantizeError. The kernels' arithmetic on every shape class,
dtype and edge value, under each thread schedule, is tests/test_quant_kernels.py's.
"""
from __future__ import annotations

import numpy as np
import pytest

from quant_cases import DTYPES, SCHEMES, SHAPES, empty_outputs, fits, non_finite, same, weight
from wsync import backends
from wsync.quant import Int4Group, QuantizeError

pytest.importorskip("cudasim")
from cudasim.fakert import FakeTensor  # noqa: E402


def on_device(arrays, device: int = 0, logical: str | None = None) -> list:
    return [FakeTensor(np.array(a), device, logical=logical) for a in arrays]


def run(scheme, bits, dtype, what="tensor", device=0, out_device=0):
    """(host copies of the output buffers, output buffers) after quantizing a device copy of bits."""
    t = FakeTensor(np.array(bits), device, logical=dtype)
    bufs = on_device(empty_outputs(scheme, bits, dtype), out_device)
    backends.device_kernels().quantize(scheme, t, dtype, bufs, what)
    return [b.data for b in bufs]


@pytest.mark.parametrize("scheme", SCHEMES.values(), ids=SCHEMES.keys())
@pytest.mark.parametrize("dtype", DTYPES)
def test_device_weights_quantize_into_device_buffers_with_only_the_flag_crossing(device_rt, scheme, dtype):
    for i, name in enumerate(("fused_experts", "fp8_ragged_3d", "router", "one_row")):
        shape = SHAPES[name]
        if not fits(scheme, shape):
            continue
        bits = weight(shape, dtype, i, "fp8" if scheme.kind == "fp8_block" else "int")
        before, counted = dict(device_rt.crossed), (backends.transfers().d2h, backends.transfers().h2d)
        outs = run(scheme, bits, dtype)
        crossed = {d: device_rt.crossed[d] - before[d] for d in before}
        same(outs, scheme.reference(bits, dtype), f"{name}/{dtype}")
        assert crossed["d2h"] == 8, crossed  # the flag
        assert crossed["h2d"] == (8 * len(shape) if scheme.kind == "int4_group" else 0), crossed  # weight_shape
        # and wsync's own count of what crossed (backends.transfers) says the same
        assert (backends.transfers().d2h - counted[0], backends.transfers().h2d - counted[1]) == \
            (crossed["d2h"], crossed["h2d"])
        names = [e[1] for e in device_rt.launches()[-1:]]
        assert names == [f"quant_{scheme.kind}_{dtype.lower()}"]


@pytest.mark.parametrize("scheme", SCHEMES.values(), ids=SCHEMES.keys())
@pytest.mark.parametrize("bad", [["+inf"], ["nan", "-inf"]], ids="/".join)
def test_a_non_finite_device_weight_is_named_as_the_reference_names_it(device_rt, scheme, bad):
    bits = non_finite((3, 130, 192), "BF16", [(2, 100, 5), (1, 7, 150)][:len(bad)], bad)
    with pytest.raises(QuantizeError) as theirs:
        scheme.reference(bits, "BF16", "experts.w13_weight")
    with pytest.raises(QuantizeError) as ours:
        run(scheme, bits, "BF16", "experts.w13_weight")
    assert str(ours.value) == str(theirs.value)


def test_buffers_on_another_gpu_are_refused(device_rt):
    bits = weight(SHAPES["router"], "BF16", 1, "int")
    with pytest.raises(ValueError, match="different GPUs"):
        run(Int4Group(32), bits, "BF16", device=0, out_device=1)


def test_a_weight_on_the_second_gpu_runs_there(device_rt):
    scheme = SCHEMES["fp8_block"]
    bits = weight(SHAPES["fp8_edges"], "F16", 2, "fp8")
    outs = run(scheme, bits, "F16", device=1, out_device=1)
    same(outs, scheme.reference(bits, "F16"), "fp8_edges on cuda:1")
    assert device_rt.launches()[-1][2] == 1


@pytest.mark.gpu
def test_on_a_gpu_the_quantizer_writes_the_references_bytes_into_device_memory():
    """The same kernels on a real GPU (cupy's runtime, torch's CUDA tensors), through the Quantizer a Publisher
    uses: every scheme, dtype and shape class, its outputs on the device, byte for byte the reference's."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from wsync.errors import BackendUnavailable
    from wsync.quant import Quantizer

    try:
        backends.device_kernels()
    except BackendUnavailable as e:
        pytest.skip(str(e))
    torch_dtype = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    uint = {"BF16": torch.int16, "F16": torch.int16, "F32": torch.int32}
    for key, scheme in SCHEMES.items():
        q = Quantizer([(["re:.*"], scheme)])  # every matrix, the router included
        for dtype in DTYPES:
            state = {f"{name}.weight": torch.from_numpy(np.array(weight(shape, dtype, i, "none")).view(
                         {"BF16": np.int16, "F16": np.int16, "F32": np.int32}[dtype])).view(torch_dtype[dtype]).cuda()
                     for i, (name, shape) in enumerate(SHAPES.items()) if fits(scheme, shape)}
            out = q(state)
            for name, w in state.items():
                bits = w.view(uint[dtype]).cpu().numpy().view(np.uint16 if dtype != "F32" else np.uint32)
                outputs = scheme.outputs(tuple(w.shape), dtype)
                assert all(out[o.name(name)].is_cuda for o in outputs)
                got = [out[o.name(name)].cpu().contiguous().view(-1).view(torch.uint8).numpy() for o in outputs]
                want = [np.ascontiguousarray(r).reshape(-1).view(np.uint8) for r in scheme.reference(bits, dtype, name)]
                same(got, want, f"{key} {name} {dtype}")
