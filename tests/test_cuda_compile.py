"""The CUDA sources compile for the GPUs we target, warning-free, with nothing spilled.

No GPU is needed: nvcc builds cubins for sm_80 (A100) and sm_90 (H100/H200)
ahead of time, and NVRTC (through cupy, when installed) builds the exact
string wsync.backends.cuda hands it at run time. A kernel that compiles only
with one of them, or that spills registers to local memory (a slow path the
GPU would not warn about), fails here rather than on someone's cluster.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from wsync.backends import cuda

CSRC = Path(__file__).resolve().parents[1] / "csrc"
SOURCES = sorted(CSRC.glob("*.cu"))
ARCHS = ("sm_80", "sm_90")


def _nvcc() -> str | None:
    return shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if Path(p).exists()), None)


@pytest.fixture(scope="module")
def nvcc_results(tmp_path_factory):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found on PATH or in /usr/local/cuda/bin: install the CUDA toolkit to check csrc/*.cu")
    out = tmp_path_factory.mktemp("cubins")

    def build(job):
        src, arch = job
        cmd = [nvcc, "-cubin", f"-arch={arch}", "-std=c++17", "-Werror", "all-warnings", "-Xptxas", "-v",
               str(src), "-o", str(out / f"{src.stem}.{arch}.cubin")]
        return job, subprocess.run(cmd, capture_output=True, text=True)

    with ThreadPoolExecutor(max_workers=2) as pool:  # two archs at once: ~6 s instead of ~12 s
        return dict(pool.map(build, [(s, a) for s in SOURCES for a in ARCHS]))


def test_there_are_sources():
    assert SOURCES, f"no .cu files in {CSRC}"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.name)
def test_nvcc_builds_without_warnings_or_spills(nvcc_results, src, arch):
    r = nvcc_results[(src, arch)]
    assert r.returncode == 0, f"nvcc -arch={arch} {src.name} failed:\n{r.stderr[-6000:]}"
    spills = re.findall(r"(\d+) bytes spill stores", r.stderr)
    assert spills and all(s == "0" for s in spills), f"register spills in {src.name} for {arch}:\n{r.stderr[-6000:]}"


def _nvrtc_program():
    """cupy's NVRTC wrapper, or a skip saying what is missing."""
    try:
        from cupy.cuda import compiler
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()  # loads libnvrtc: fails without nvidia-cuda-nvrtc-cu12
        return compiler._NVRTCProgram
    except Exception as e:  # cupy missing, libnvrtc missing, or cupy's private API moved
        pytest.skip(f"NVRTC through cupy is not available here ({type(e).__name__}: {e}); "
                    "pip install 'wsync[cuda]' to check the run-time build")


def test_nvrtc_builds_the_runtime_source():
    # One arch: nvcc above covers both; this checks NVRTC's front end takes the inlined string.
    program = _nvrtc_program()
    prog = program(cuda.kernel_source(), name="delta_cuda.cu", method="cubin")
    cubin, _ = prog.compile(options=("--gpu-architecture=sm_90", "-std=c++17"))
    assert len(cubin) > 0
