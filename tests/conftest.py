"""Shared test helpers: states of bit patterns, byte-level comparisons, payload surgery."""
from __future__ import annotations

import faulthandler
import json
import os

import numpy as np
import pytest
import xxhash

from wsync.payload import HEADER


def bits_equal(a, b) -> bool:
    """Byte equality of two tensors/arrays (never allclose)."""
    return _bytes(a) == _bytes(b)


def _bytes(t) -> bytes:
    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t).tobytes() + str(t.dtype).encode() + str(t.shape).encode()
    import torch

    t = t.detach().cpu().contiguous()
    if t.numel() == 0:
        return str(t.dtype).encode() + str(tuple(t.shape)).encode()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() + str(t.dtype).encode() + str(tuple(t.shape)).encode()


def states_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(bits_equal(a[k], b[k]) for k in a)


def rewrite_manifest(blob: bytes, mutate) -> bytes:
    """Edit a payload's manifest JSON and re-seal its header, so only the lie remains."""
    _, version, mlen, blen, _ = HEADER.unpack_from(blob)
    doc = json.loads(blob[HEADER.size : HEADER.size + mlen])
    mutate(doc)
    m = json.dumps(doc).encode()
    body = blob[HEADER.size + mlen :]
    return HEADER.pack(b"\x89WSYNC\r\n", version, len(m), blen, xxhash.xxh3_64_intdigest(m)) + m + body


HANG_S = float(os.environ.get("WSYNC_TEST_HANG_S", "900"))  # far above the slowest test here (~2 min)
_STDERR: list[int] = []


def pytest_configure(config):
    _STDERR.append(os.dup(2))  # the terminal's stderr, before pytest captures fd 2 around each test


@pytest.fixture(autouse=True)
def _hang_guard():
    """A test still running after HANG_S seconds ends the run: every thread's stack goes to the terminal and the
    process exits 1. Without it a hung thread held CI until its time limit, with nothing said of where."""
    faulthandler.dump_traceback_later(HANG_S, exit=True, file=_STDERR[0] if _STDERR else 2)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def backend_params() -> list:
    """Every backend that loads here; the others show up as skips with their reason."""
    from wsync import backends
    from wsync.errors import BackendUnavailable

    out = []
    for name in backends.REGISTRY:
        try:
            backends.kernels(name)
            out.append(name)
        except BackendUnavailable as e:
            out.append(pytest.param(name, marks=pytest.mark.skip(reason=str(e))))
    return out


@pytest.fixture(scope="module", params=backend_params())
def each_backend(request):
    """Run a whole module once per backend (modules opt in with usefixtures)."""
    import os

    old = os.environ.get("WSYNC_BACKEND")
    os.environ["WSYNC_BACKEND"] = request.param
    yield request.param
    if old is None:
        os.environ.pop("WSYNC_BACKEND", None)
    else:
        os.environ["WSYNC_BACKEND"] = old


@pytest.fixture(scope="session")
def sim():
    """The CUDA kernels of csrc/*.cu compiled for the CPU harness (tests/cudasim): a fiber per GPU thread."""
    cudasim = pytest.importorskip("cudasim")
    if cudasim.compiler() is None:
        pytest.skip("no C++ compiler on PATH: the CUDA harness compiles csrc/*.cu with g++")
    return cudasim.load()


@pytest.fixture
def device_rt(sim):
    """A fake CUDA runtime over the harness's kernels (tests/cudasim/fakert.py), installed as wsync's device
    kernels for the test: device tensors are its FakeTensors, and it counts what crosses to the host."""
    from cudasim.fakert import FakeRuntime

    from wsync import backends
    from wsync.backends import cuda

    rt = FakeRuntime(sim, ndevices=2)
    backends.use_device_kernels(cuda.CudaKernels(runtime=rt))
    yield rt
    backends.use_device_kernels(None)
