"""The benchmark harness is its own distribution (wsync-bench, in benchmarks/): nothing of it ships in wsync's
wheel, and no module of wsync imports it (wsync's command line finds it through an entry point)."""
from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _imported(path: Path) -> set[str]:
    """Top-level names of every module `path` imports, at module level or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_no_module_of_wsync_or_the_reference_loop_imports_the_harness():
    importing = [str(p.relative_to(ROOT)) for root in ("wsync", "trainer") for p in sorted((ROOT / root).rglob("*.py"))
                 if "wsync_bench" in _imported(p)]
    assert importing == []


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    (tmp_path / "m.py").write_text("def f():\n    from wsync_bench.codec import main\n")
    assert "wsync_bench" in _imported(tmp_path / "m.py")


def test_wsync_packages_hold_no_harness_module():
    """What setuptools packs into wsync's wheel, by the rule pyproject.toml gives it."""
    from setuptools import find_packages

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = find_packages(str(ROOT), include=find["include"])
    assert packages and all(not p.startswith("wsync_bench") and ".bench" not in f".{p}" for p in packages)
    modules = {f.stem for p in packages for f in (ROOT / p.replace(".", "/")).glob("*.py")}
    assert {"api", "cli", "hardware", "loop"} <= modules  # the glob saw wsync's and trainer's modules
    assert not [m for m in modules if m.startswith("bench")]
    assert not (ROOT / "wsync" / "bench").exists()


@pytest.mark.build  # builds the wheel, compiling the C++ backend (about a minute on 2 cores)
def test_the_built_wheel_holds_no_benchmark_harness(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(ROOT),
                        "-w", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    wheel, = tmp_path.glob("wsync-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "wsync/cli.py" in names and "wsync/hardware.py" in names and "trainer/loop.py" in names
    assert "wsync/_csrc/delta_cuda.cu" in names and "wsync/plan/data/measured.json" in names  # what it reads at run time
    assert {n.split("/")[0] for n in names} == {"wsync", "trainer", "-".join(wheel.name.split("-")[:2]) + ".dist-info"}, names
    assert not [n for n in names if "bench" in Path(n).parts[1:-1] or Path(n).name.startswith("bench")], names


def test_wsync_bench_registers_its_suites_under_the_bench_command():
    meta = tomllib.loads((ROOT / "benchmarks" / "pyproject.toml").read_text())["project"]
    assert meta["entry-points"]["wsync.commands"] == {"bench": "wsync_bench.cli:add_parsers"}
    assert "wsync" in meta["dependencies"]
