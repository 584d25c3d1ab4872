"""Builds of wsync._cpu under AddressSanitizer, and the driver processes that load them (python itself is not
instrumented, so libasan is preloaded into a subprocess)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("delta_cpu.cpp", "xxh3_avx2.cpp", "ws_v2_cpu.cpp")  # setup.py's, for wsync._cpu


def _libasan(gxx: str) -> str | None:
    r = subprocess.run([gxx, "-print-file-name=libasan.so"], capture_output=True, text=True)
    path = r.stdout.strip()
    return path if r.returncode == 0 and os.path.isabs(path) and os.path.exists(path) else None


def _build(gxx: str, out: Path) -> Path:
    so = out / f"_cpu{sysconfig.get_config_var('EXT_SUFFIX')}"
    cmd = [gxx, "-std=c++17", "-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer", "-pthread",
           "-shared", "-fPIC", f"-I{ROOT / 'csrc'}", f"-I{sysconfig.get_paths()['include']}",
           *(str(ROOT / "csrc" / f) for f in SOURCES), "-o", str(so)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"ASan build failed:\n{r.stderr[-3000:]}"
    return so


def asan_build(tmp_path: Path) -> tuple[Path, dict]:
    """wsync._cpu built with ASan, and the environment a driver process loads it in; skips without g++ or
    libasan."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found: cannot build the AddressSanitizer variant of wsync._cpu")
    libasan = _libasan(gxx)
    if libasan is None:
        pytest.skip(f"{gxx} has no libasan.so (install the compiler's libasan package)")
    so = _build(gxx, tmp_path)
    env = dict(os.environ, LD_PRELOAD=libasan, ASAN_OPTIONS="detect_leaks=0:halt_on_error=1", WSYNC_THREADS="2",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    return so, env


def run_driver(driver: str, so: Path, env: dict, *args) -> None:
    """Runs tests/<driver> on the ASan build; ASan must stay silent and the driver print "ok"."""
    r = subprocess.run([sys.executable, str(ROOT / "tests" / driver), str(so), *map(str, args)],
                       capture_output=True, text=True, env=env, cwd=ROOT / "tests", timeout=600)
    assert "AddressSanitizer" not in r.stderr, r.stderr[-5000:]
    assert r.returncode == 0, r.stderr[-5000:]
    assert r.stdout.startswith("ok"), r.stdout
