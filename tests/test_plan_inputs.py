"""The planner's measured inputs ship inside the package: one generated file, the same answers from a copy of the
package alone as from the checkout, and output that says where the inputs come from."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from wsync.cli import main
from wsync.plan import measured

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
SCRIPT = REPO / "scripts" / "planner_inputs.py"


def test_the_committed_file_is_what_the_script_writes_now(tmp_path):
    out = tmp_path / "measured.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == measured.DATA.read_bytes()
    assert measured.render(measured.extract(RESULTS)).encode() == measured.DATA.read_bytes()
    r = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "up to date" in r.stdout, r.stdout + r.stderr


def test_the_script_check_fails_on_a_stale_file(tmp_path):
    stale = tmp_path / "measured.json"
    stale.write_text(measured.DATA.read_text().replace('"cores": 2', '"cores": 3', 1))
    r = subprocess.run([sys.executable, str(SCRIPT), "--check", "--out", str(stale)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and "differs" in r.stdout


def test_every_input_names_its_results_file_and_machine():
    data = measured.inputs()
    entries = data["codec"] + data["gpu_sync"] + [data[k] for k in ("kernels", "moe", "loop", "quant") if data[k]]
    assert data["codec"] and data["kernels"] and data["moe"] and data["loop"] and data["quant"]
    for e in entries:
        assert (RESULTS / e["file"]).is_file(), e["file"]
        assert e["machine"].get("cpu") or e["machine"].get("gpu"), e["file"]
    assert [e["file"] for e in data["codec"]] == sorted(e["file"] for e in data["codec"])


def test_the_planner_reads_no_path_outside_the_package():
    for path in (REPO / "wsync" / "plan").glob("*.py"):
        text = path.read_text()
        assert "parents[" not in text and "benchmarks\" / \"results" not in text, path.name


def _plan(pythonpath: Path, cwd: Path, *argv: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    r = subprocess.run([sys.executable, "-m", "wsync.cli", "plan", *argv], capture_output=True, text=True,
                       timeout=300, env=env, cwd=cwd)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_a_copy_of_the_package_alone_gives_the_same_answers(tmp_path):
    """As from a wheel: the package without benchmarks/ (or anything else of the checkout) beside it."""
    alone = tmp_path / "site"
    shutil.copytree(REPO / "wsync", alone / "wsync", ignore=shutil.ignore_patterns("__pycache__"))
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    checks = [("transfer", "--model", "qwen3-30b-a3b", "--json"),
              ("transfer", "--model", "kimi-k2.6", "--backend", "cuda", "--json"),
              ("transfer", "--model", "qwen3-8b", "--backend", "ref", "--codec", "delta", "--tier", "sparse", "--json"),
              ("validate", "--seeds", "1", "--json")]
    for argv in checks:
        copy = json.loads(_plan(alone, elsewhere, *argv))
        here = json.loads(_plan(REPO, REPO, *argv))
        assert copy == here, argv
    text = _plan(alone, elsewhere, "transfer", "--model", "qwen3-8b")
    assert f"measured inputs: {measured.WHERE}" in text
    assert str(REPO) not in text


def test_help_and_output_name_the_measured_inputs(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "transfer", "--help"])
    assert e.value.code == 0
    assert "wsync/plan/data/measured.json" in " ".join(capsys.readouterr().out.split())
    assert main(["plan", "transfer", "--model", "qwen3-8b", "--link", "tcp-50g"]) == 0
    out = capsys.readouterr().out
    assert "measured inputs: wsync/plan/data/measured.json (scripts/planner_inputs.py, from benchmarks/results)" in out
    assert any(e["file"] in out for e in measured.inputs()["codec"])  # each speed names its results file


def test_the_package_data_ships_every_file_the_package_reads():
    """Everything under wsync/ that is not Python is read at run time; pyproject's package-data must name it."""
    spec = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = {p for pkg, patterns in spec.items() for pattern in patterns
               for p in (REPO / pkg.replace(".", "/")).glob(pattern)}
    data = {p for p in (REPO / "wsync").rglob("*.json")}
    assert measured.DATA in data and REPO / "wsync/engines/signatures.json" in data
    assert data <= shipped, sorted(str(p.relative_to(REPO)) for p in data - shipped)
