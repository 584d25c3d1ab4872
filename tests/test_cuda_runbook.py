"""benchmarks/gpu_runbook.sh: the steps a lent GPU must run are all there, and without a GPU it says so.

The book itself needs a GPU; here it is checked as far as a CPU machine can:
it parses, its dry run lists every step (device, kernel tests, harness suites,
the three compute-sanitizer tools, the throughput benchmark and the
end-to-end sync benchmark into benchmarks/results), and a real run on a
machine without a GPU stops with a reason instead of writing empty results.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "benchmarks" / "gpu_runbook.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def run(*args, env=None):
    return subprocess.run(["bash", str(BOOK), *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)


def test_it_parses():
    assert subprocess.run(["bash", "-n", str(BOOK)], capture_output=True).returncode == 0


@pytest.mark.parametrize("mode", [[], ["--quick"], ["--lease"]])
def test_dry_run_lists_every_step(mode):
    r = run("--dry-run", *mode)
    assert r.returncode == 0, r.stderr
    steps = [line.split("]")[0].lstrip("[") for line in r.stdout.splitlines() if line.startswith("[")]
    sanitizers = ["compute-sanitizer memcheck", "compute-sanitizer racecheck", "compute-sanitizer synccheck"]
    if mode == ["--lease"]:  # the GPU steps only, the readings first, each under a time limit
        assert steps == ["device", "gpu-sync", "other-gpu-tests", "kernels-on-gpu", "throughput"]
        lines = r.stdout.splitlines()
        assert all(line.startswith(f"[{s}] timeout ") for s, line in zip(steps, lines))
        # one device call: the steps' limits leave a 15-minute loan room for the machine's start and a rerun
        assert sum(int(re.search(r"timeout -k \d+ (\d+)", x).group(1)) for x in lines) <= 400
    else:
        assert steps == ["device", "kernels-on-gpu", "harness-suites", "other-gpu-tests", *sanitizers, "throughput",
                         "gpu-sync"]
        assert "timeout" not in r.stdout
    assert "tests/test_cuda_kernels.py" in r.stdout and "-m wsync.cli bench cuda" in r.stdout
    assert "--json benchmarks/results/" in r.stdout
    throughput = r.stdout.split("[throughput]")[1].splitlines()[0]
    quick = mode == ["--quick"]
    assert ("--size small" in throughput) == quick and ("--size full" in throughput) != quick


@pytest.mark.parametrize("mode", [[], ["--quick"], ["--lease"]])
def test_the_end_to_end_step_writes_into_the_books_folder(mode):
    r = run("--dry-run", *mode)
    line = next(x for x in r.stdout.splitlines() if x.startswith("[gpu-sync]"))
    assert "-m wsync.cli bench gpu-sync" in line and "--out benchmarks/results/" in line
    assert re.search(r"--out benchmarks/results/[^ ]*-runbook$", line)  # beside the other steps' results
    assert ("--size small" in line) == (mode == ["--quick"]) and ("--size full" in line) != (mode == ["--quick"])
    own = float(re.search(r"--time-limit (\d+)", line).group(1))
    if mode == ["--lease"]:  # the bench stops itself, and writes what it has, before the step is killed
        step = float(re.search(r"timeout -k \d+ (\d+)", line).group(1))
        assert own < step


def test_without_a_gpu_it_stops_with_a_reason():
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
        if r.returncode == 0 and "GPU" in r.stdout:
            pytest.skip("a GPU is visible: the book would run for real")
    r = run()
    assert r.returncode == 3 and "no GPU here" in r.stderr


def test_unknown_options_are_refused():
    assert run("--fast").returncode == 2
