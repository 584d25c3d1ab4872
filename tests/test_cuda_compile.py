"""The CUDA sources compile for the GPUs we target, warning-free, with nothing spilled.

No GPU is needed: nvcc builds cubins for sm_80 (A100) and sm_90 (H100/H200)
ahead of time, and NVRTC (libnvrtc from the nvidia-cuda-nvrtc-cu12 wheel,
called through its C API as cupy does) builds the exact string
wsync.backends.cuda hands it at run time, for both targets. A kernel that compiles only
with one of them, or that spills registers to local memory (a slow path the
GPU would not warn about), fails here rather than on someone's cluster.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
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

    with ThreadPoolExecutor(max_workers=2) as pool:  # two archs at once: CI's two cores both compile
        return dict(pool.map(build, [(s, a) for s in SOURCES for a in ARCHS]))


def test_there_are_sources():
    assert SOURCES, f"no .cu files in {CSRC}"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.name)
@pytest.mark.build
def test_nvcc_builds_without_warnings_or_spills(nvcc_results, src, arch):
    r = nvcc_results[(src, arch)]
    assert r.returncode == 0, f"nvcc -arch={arch} {src.name} failed:\n{r.stderr[-6000:]}"
    spills = re.findall(r"(\d+) bytes spill stores", r.stderr)
    assert spills and all(s == "0" for s in spills), f"register spills in {src.name} for {arch}:\n{r.stderr[-6000:]}"


def _libnvrtc() -> ctypes.CDLL:
    """libnvrtc from the nvidia-cuda-nvrtc-cu12 wheel (a dev dependency), else the system's, else a skip."""
    spec = importlib.util.find_spec("nvidia.cuda_nvrtc")
    dirs = [Path(p) / "lib" for p in (spec.submodule_search_locations or [])] if spec else []
    names = [str(p) for d in dirs for p in sorted(d.glob("libnvrtc.so.*")) if "alt" not in p.name]
    names += [n for n in (ctypes.util.find_library("nvrtc"),) if n]
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    pytest.skip("libnvrtc not found: pip install nvidia-cuda-nvrtc-cu12 (in wsync[dev] and wsync[cuda])")


def _nvrtc_compile(lib, src: str, arch: str) -> tuple[int, str, bytes]:
    """NVRTC's C API, as cupy's RawModule calls it: (result, log, cubin)."""
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"delta_cuda.cu", 0, None, None) == 0
    try:
        opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17"]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        n = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetProgramLog(prog, log)
        cubin = b""
        if rc == 0:
            lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
            buf = ctypes.create_string_buffer(n.value)
            lib.nvrtcGetCUBIN(prog, buf)
            cubin = buf.raw
        return rc, log.value.decode(errors="replace"), cubin
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.build
def test_nvrtc_builds_the_runtime_source(arch):
    """The exact string wsync.backends.cuda hands cupy's RawModule, through NVRTC, for each target:
    it compiles without a warning, to a cubin that holds every kernel the engine launches."""
    lib = _libnvrtc()
    rc, log, cubin = _nvrtc_compile(lib, cuda.kernel_source(), arch)
    assert rc == 0, f"NVRTC ({arch}) failed:\n{log[-6000:]}"
    assert "warning" not in log.lower(), log[-6000:]
    assert cubin[:4] == b"\x7fELF"
    names = {f"delta_{k}_{w}_{o}" for k in ("count", "fill", "decode", "apply") for w in cuda.WIDTHS.values()
             for o in cuda.ORDERS}
    names |= {f"delta_restore_{w}" for w in cuda.WIDTHS.values()}
    names |= {"delta_check", "fused_count_bf16", "fused_fill_bf16", "xxh3_blocks", "lora_range_bf16"}
    names |= {f"quant_{k}_{d}" for k in ("int4_group", "int8_channel", "fp8_block") for d in cuda.QUANT_NAMES.values()}
    names |= {f"v2_decode_{w}" for w in (1, 2, 4, 8)}  # csrc/ws_v2_cuda.cu, in the same module
    missing = sorted(n for n in names if n.encode() + b"\0" not in cubin)
    assert not missing, f"kernels missing from the {arch} cubin: {missing}"


def test_nvrtc_reports_errors():
    lib = _libnvrtc()
    rc, log, _ = _nvrtc_compile(lib, 'extern "C" __global__ void k() { undefined_thing(); }', "sm_80")
    assert rc != 0 and "undefined_thing" in log
