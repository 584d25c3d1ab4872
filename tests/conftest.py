"""Shared test helpers: states of bit patterns, byte-level comparisons, payload surgery."""
from __future__ import annotations

import faulthandler
import json
import os

import numpy as np
import pytest
import xxhash

from wsync.payload import HEADER

try:  # CI's verl venv runs a few test files without [dev], so without hypothesis
    from hypothesis import settings as hypothesis_settings
except ModuleNotFoundError:
    hypothesis_settings = None
if hypothesis_settings is not None:
    # Property tests draw fewer examples in the default run, and their full counts where WSYNC_HYPOTHESIS=full
    # (CI's slow-tier stage); a test naming its own max_examples scales it by the profile (helpers.examples()).
    hypothesis_settings.register_profile("fast", max_examples=20)
    hypothesis_settings.register_profile("full", max_examples=100)
    hypothesis_settings.load_profile(os.environ.get("WSYNC_HYPOTHESIS", "fast"))


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


HANG_S = float(os.environ.get("WSYNC_TEST_HANG_S", "900"))  # far above what the slowest test here takes
_STDERR: list[int] = []


def pytest_configure(config):
    _STDERR.append(os.dup(2))  # the terminal's stderr, before pytest captures fd 2 around each test


@pytest.fixture(autouse=True)
def _hang_guard():
    """A test still running after HANG_S seconds ends the run: every thread's stack goes to the terminal and the
    process exits 1, so a hung thread fails CI at once and says where it hangs."""
    faulthandler.dump_traceback_later(HANG_S, exit=True, file=_STDERR[0] if _STDERR else 2)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def backend_params(only: tuple[str, ...] | None = None) -> list:
    """Every backend that loads here (of `only`, when given); the others show up as skips with their reason."""
    from wsync import backends
    from wsync.errors import BackendUnavailable

    out = []
    for name in backends.REGISTRY:
        if only is not None and name not in only:
            continue
        try:
            backends.kernels(name)
            out.append(name)
        except BackendUnavailable as e:
            out.append(pytest.param(name, marks=pytest.mark.skip(reason=str(e))))
    return out


@pytest.fixture(scope="module", params=backend_params())
def kernels(request):
    """The delta kernels of each backend that loads here (a test narrows the list with an indirect
    parametrize of `kernels`)."""
    from wsync import backends

    return backends.kernels(request.param)


@pytest.fixture
def groups():
    """Makes shard_helpers.Group's (m trainer ranks here, n engine-rank processes) and closes each at the end."""
    from shard_helpers import Group

    made = []
    yield lambda *a, **k: made.append(Group(*a, **k)) or made[-1]
    for g in made:
        g.close()


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


@pytest.fixture(scope="module")
def vllm_env():
    """The environment every vLLM process of a module reads: the token (its RPCs carry only the token's id), and
    a KV cache of 1 GiB rather than a share of the machine's memory. Yields the MonkeyPatch, for a module's own."""
    from helpers import TOKEN

    mp = pytest.MonkeyPatch()
    mp.setenv("WSYNC_TOKEN", TOKEN.hex())
    mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    yield mp
    mp.undo()


@pytest.fixture(scope="session")
def cpu_kernels():
    """The C++ backend; CI checks the extension built (.ci/run), so this skips only where no compiler is."""
    from wsync import backends
    from wsync.errors import BackendUnavailable

    try:
        return backends.kernels("cpu")
    except BackendUnavailable as e:
        pytest.skip(str(e))


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


@pytest.fixture(scope="session")
def asan_extension(tmp_path_factory):
    """wsync._cpu built under AddressSanitizer and the environment to load it in: one build for every ASan
    test of the session (asan_helpers.asan_build skips without g++ or libasan)."""
    from asan_helpers import asan_build

    return asan_build(tmp_path_factory.mktemp("asan"))
