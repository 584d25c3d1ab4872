"""Every backend's quantizing kernels write wsync.quant's reference bytes (csrc/ws_quant.cuh).

The reference backend, the C++ CPU kernels and the CUDA kernels (run on the CPU-fiber harness, tests/cudasim,
under each of its thread schedules, through the host-array protocol: weight up, outputs back) quantize every
shape class of a Qwen3-MoE / Kimi-like layer (tests/quant_cases.py), in every weight dtype, with the edge
values each format meets (all-zero groups, rows and blocks; exact ties, and ties only the rounding to the
weight's dtype makes; subnormals; the largest finite values; negative zeros), byte for byte; a NaN or an
infinity is refused with the reference's QuantizeError, word for word.
"""
from __future__ import annotations

import numpy as np
import pytest

from quant_cases import DTYPES, SCHEMES, SHAPES, cases, empty_outputs, fits, non_finite, same
from wsync import backends
from wsync.backends import cuda
from wsync.quant import Int4Group, Int8Channel, Fp8Block, QuantizeError, Quantizer, Rule

cudasim = pytest.importorskip("cudasim")

# the CUDA kernels on the simulator: the random schedule in the default run, the ordered two in the slow tier
BACKENDS = ("ref", "cpu", pytest.param("cuda-forward", marks=pytest.mark.slow),
            pytest.param("cuda-reverse", marks=pytest.mark.slow), "cuda-random")


@pytest.fixture
def kernels(request, sim, cpu_kernels):
    name = request.param
    if name == "ref":
        return backends.kernels("ref")
    if name == "cpu":
        return cpu_kernels
    return cuda._KernelsOver(cudasim.SimRuntime(sim, name.split("-")[1], seed=5))


def quantized(kernels, scheme, bits, dtype, what="tensor"):
    outs = empty_outputs(scheme, bits, dtype)
    kernels.quantize(scheme, bits, dtype, outs, what)
    return outs


@pytest.mark.parametrize("kernels", BACKENDS, indirect=True)
@pytest.mark.parametrize("scheme", SCHEMES.values(), ids=SCHEMES.keys())
def test_every_shape_class_and_edge_value_is_the_reference_byte_for_byte(kernels, scheme):
    n = 0
    for name, bits, dtype in cases(scheme):
        same(quantized(kernels, scheme, bits, dtype), scheme.reference(bits, dtype), f"{kernels.name} {name}")
        n += 1
    assert n == 2 * len(DTYPES) * sum(fits(scheme, shape) for shape in SHAPES.values()) > 0


@pytest.mark.parametrize("kernels", BACKENDS, indirect=True)
@pytest.mark.parametrize("scheme", SCHEMES.values(), ids=SCHEMES.keys())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [["nan"], ["+inf"], ["-inf"], ["nan", "+inf", "-inf"]], ids="/".join)
def test_non_finite_weights_are_refused_with_the_references_words(kernels, scheme, dtype, bad):
    # the first non-finite element in flat order lies in a later row, group and block than another one
    at = [(5, 150), (2, 157), (140, 3)][:len(bad)]
    shape = (160, 192)
    bits = non_finite(shape, dtype, at, bad)
    with pytest.raises(QuantizeError) as theirs:
        scheme.reference(bits, dtype, "layers.0.mlp.down_proj.weight")
    with pytest.raises(QuantizeError) as ours:
        quantized(kernels, scheme, bits, dtype, "layers.0.mlp.down_proj.weight")
    assert str(ours.value) == str(theirs.value)
    first = min(np.ravel_multi_index(i, shape) for i in at)
    assert f"element {first} (flat index)" in str(ours.value)


@pytest.mark.parametrize("kernels", BACKENDS, indirect=True)
def test_shapes_and_dtypes_the_formats_refuse_are_the_references_errors(kernels):
    rng = np.random.default_rng(3)
    for scheme, bits, dtype in [(Int4Group(32), rng.integers(0, 0x3F00, (4, 48), dtype=np.uint16), "BF16"),
                                (Int4Group(12), rng.integers(0, 0x3F00, (4, 48), dtype=np.uint16), "BF16"),
                                (Int8Channel(), rng.integers(0, 0x3F00, (48,), dtype=np.uint16), "F16"),
                                (Fp8Block(), rng.integers(0, 0x3F00, (48,), dtype=np.uint16), "BF16"),
                                (Int8Channel(), rng.integers(0, 100, (4, 48), dtype=np.uint16), "I16")]:
        with pytest.raises(QuantizeError) as theirs:
            scheme.reference(bits, dtype, "w")
        with pytest.raises(QuantizeError) as ours:
            kernels.quantize(scheme, bits, dtype, [np.empty(1)] * 3, "w")
        assert str(ours.value) == str(theirs.value)


def test_the_quantizer_on_the_cpu_backend_makes_the_reference_backends_state(cpu_kernels):
    rng = np.random.default_rng(4)
    state = {
        "model.layers.0.self_attn.q_proj.weight": rng.integers(0, 0x3F00, (64, 96), dtype=np.uint16),
        "model.layers.0.mlp.experts.gate_up_proj.weight": rng.integers(0, 0x3F00, (4, 32, 96), dtype=np.uint16),
        "model.layers.0.mlp.gate.weight": rng.integers(0, 0x3F00, (4, 96), dtype=np.uint16),
        "model.norm.weight": rng.integers(0, 0x3F00, (96,), dtype=np.uint16),
    }
    from wsync import dtypes
    from wsync.bits import TensorBits

    tb = {k: TensorBits(dtypes.by_name("BF16"), v.shape, v.reshape(-1)) for k, v in state.items()}
    rules = [(["re:.*experts"], Int4Group(32)), (["re:.*self_attn"], Fp8Block()), (["re:.*mlp.gate$"], Int8Channel())]
    a = Quantizer([Rule(tuple(t), s) for t, s in rules], backend="cpu")(tb)
    b = Quantizer([Rule(tuple(t), s) for t, s in rules], backend="ref")(tb)
    assert a.keys() == b.keys() and len(a) == 8
    for name in a:
        assert a[name].bits.tobytes() == b[name].bits.tobytes(), name


BASELINE_RUN = """
import numpy as np
from quant_cases import SCHEMES, cases, empty_outputs, same
from wsync.backends.cpu import CpuKernels
k = CpuKernels()
for scheme in SCHEMES.values():
    for name, bits, dtype in cases(scheme):
        outs = empty_outputs(scheme, bits, dtype)
        k.quantize(scheme, bits, dtype, outs)
        same(outs, scheme.reference(bits, dtype), name)
print("ok")
"""


def test_the_cpu_kernels_without_avx2_are_the_reference_byte_for_byte(cpu_kernels):
    """The C++ loops are built twice (baseline x86-64 and AVX2, picked at run time); where AVX2 is used, the
    baseline build is what $WSYNC_NO_AVX2 runs, in a process of its own (the choice is made once per process)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    env = dict(os.environ, WSYNC_NO_AVX2="1", PYTHONPATH=os.pathsep.join([str(tests), str(tests.parent),
                                                                            os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", BASELINE_RUN], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-4000:]
