"""What a built (non-editable) wsync carries: the CUDA kernel sources it compiles at run time, with every header
they include, found by the backend from the installed package rather than from a checkout."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("build_py")
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "-d", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def _includes(source: Path) -> set[str]:
    return set(re.findall(r'^\s*#include "([^"]+)"', source.read_text(), flags=re.M))


def test_the_kernel_sources_and_every_header_they_include_ship_in_the_package(built):
    from wsync.backends.cuda import KERNEL_SOURCES

    shipped = built / "wsync" / "_csrc"
    todo, seen = list(KERNEL_SOURCES), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        assert (shipped / name).read_bytes() == (ROOT / "csrc" / name).read_bytes(), name
        todo.extend(_includes(shipped / name))
    assert len(seen) > len(KERNEL_SOURCES)  # the walk did follow includes


def test_the_cuda_backend_reads_the_packaged_sources_not_a_checkout(built):
    env = {k: v for k, v in os.environ.items() if k != "WSYNC_CSRC"}
    env["PYTHONPATH"] = str(built)
    r = subprocess.run([sys.executable, "-c", "from wsync.backends.cuda import csrc_dir; print(csrc_dir())"],
                       capture_output=True, text=True, env=env, cwd=built, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert Path(r.stdout.strip()) == built / "wsync" / "_csrc"
