"""csrc/xxh3.h built three ways (AVX2, SSE2, plain C++) into a small library, for its tests and benchmark.

Each variant is its own translation unit, compiled as wsync._cpu compiles
them (the AVX2 one under `#pragma GCC target("avx2")`), with one extern "C"
entry: the one-shot XXH3-64 of a buffer. Built with the system compiler and
cached by content hash beside the harness builds.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from . import CSRC, _cache_root, compiler

VARIANTS = {
    "avx2": '#pragma GCC target("avx2")\n#include <immintrin.h>\n#define WS_XXH3_AVX2 1\n',
    "sse2": "",
    "scalar": "#define WS_XXH3_SCALAR 1\n",
}


def available() -> list[str]:
    """Variants this CPU runs (AVX2 only where the CPU has it)."""
    x86 = platform.machine() in ("x86_64", "AMD64")
    out = ["scalar"] + (["sse2"] if x86 else [])
    if x86 and "avx2" in Path("/proc/cpuinfo").read_text():
        out.insert(0, "avx2")
    return out


def build() -> Path:
    cxx = compiler()
    if cxx is None:
        raise FileNotFoundError("no C++ compiler (g++) on PATH")
    x86 = platform.machine() in ("x86_64", "AMD64")
    variants = {k: v for k, v in VARIANTS.items() if x86 or k == "scalar"}
    srcs = {k: f"{v}#include \"xxh3.h\"\nextern \"C\" __attribute__((visibility(\"default\"))) unsigned long long "
               f"xxh3_{k}(const void* p, unsigned long long n) {{ return ws::xxh3_64(p, n); }}\n"
            for k, v in variants.items()}
    flags = ["-O3", "-std=c++17", "-fPIC", "-shared", "-fvisibility=hidden", "-Wall", "-Wextra", "-Werror", f"-I{CSRC}"]
    h = hashlib.sha256(repr((srcs, flags, cxx)).encode())
    for name in ("xxh3.h", "ws_common.cuh"):
        h.update((CSRC / name).read_bytes())
    out = _cache_root() / f"xxh3-{h.hexdigest()[:16]}" / "xxh3probe.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=out.parent))
    try:
        files = []
        for k, src in srcs.items():
            (work / f"{k}.cpp").write_text(src)
            files.append(str(work / f"{k}.cpp"))
        r = subprocess.run([cxx, *flags, *files, "-o", str(work / "x.so")], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"xxh3 probe build failed:\n{r.stderr[-6000:]}")
        os.replace(work / "x.so", out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def load_raw() -> dict:
    """{variant: ctypes function (address, length) -> int} for the variants this CPU runs."""
    lib = ctypes.CDLL(str(build()))
    fns = {}
    for k in available():
        f = getattr(lib, f"xxh3_{k}")
        f.restype, f.argtypes = ctypes.c_uint64, [ctypes.c_void_p, ctypes.c_uint64]
        fns[k] = f
    return fns


def load() -> dict:
    """{variant: fn(numpy array) -> int} for the variants this CPU runs."""
    return {k: (lambda f: lambda a: int(f(a.ctypes.data, a.nbytes)))(f) for k, f in load_raw().items()}
