"""Progress bars (wsync.progress): off in a pipe or log, on when forced, never with --quiet; the disk use said first."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from wsync import progress

ROOT = Path(__file__).resolve().parents[1]
BAR = ("\r", "█", "scheme/s", "step/s")  # what a drawn tqdm bar leaves in its output


def _cli(args, data_dir, **env):
    """`wsync ...` as a user runs it, with stderr piped (not a terminal)."""
    e = {k: v for k, v in os.environ.items() if k != "WSYNC_PROGRESS"}
    e.update(WSYNC_BENCH_DATA=str(data_dir), **env)
    r = subprocess.run([sys.executable, "-m", "wsync.cli", *args], capture_output=True, env=e, cwd=ROOT, timeout=600)
    # decoded by hand: text=True would turn the bar's \r into \n and hide it
    r.stdout, r.stderr = r.stdout.decode(), r.stderr.decode()
    return r


CODEC = ["bench", "codec", "--size", "tiny", "--lr", "1e-6", "--gaps", "1", "--repeats", "1"]


@pytest.fixture(scope="module")
def piped(tmp_path_factory):
    """One real `bench codec` on the tiny model with stderr piped; it generates the snapshots the others reuse."""
    data = tmp_path_factory.mktemp("snapshots")
    return data, _cli(CODEC, data)


def test_piped_stderr_gets_no_bar_but_the_disk_use_first(piped):
    data, r = piped
    assert r.returncode == 0, r.stderr[-2000:]
    assert not any(b in r.stderr for b in BAR), r.stderr[-2000:]
    assert "| wsync-packed |" in r.stdout and "\r" not in r.stdout
    said = r.stderr.index("will generate 2 snapshots of the tiny model")
    assert "KB in " + str(data / "tiny-lr1e-06-s0") in r.stderr
    assert "WSYNC_BENCH_DATA" in r.stderr
    assert said < r.stderr.index("step 1/1")  # before the work, not after it


def test_forced_on_draws_bars_with_rate(piped):
    data, _ = piped
    r = _cli(CODEC, data, WSYNC_PROGRESS="1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "\r" in r.stderr and "scheme/s" in r.stderr and "bench codec" in r.stderr
    assert "will generate" not in r.stderr  # cached: nothing is written, so nothing is announced


def test_quiet_beats_forced(piped):
    data, _ = piped
    r = _cli([*CODEC, "--quiet"], data, WSYNC_PROGRESS="1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert not any(b in r.stderr for b in BAR)


@pytest.mark.parametrize("env,quiet,tty,on", [
    ("", False, False, False), ("", False, True, True), ("1", False, False, True), ("0", False, True, False),
    ("1", True, True, False),
])
def test_enabled(monkeypatch, env, quiet, tty, on):
    monkeypatch.setenv("WSYNC_PROGRESS", env)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty, raising=False)
    progress.configure(quiet=quiet)
    try:
        assert progress.enabled() is on
        assert isinstance(progress.bar(3, "x"), progress._Off) is not on
    finally:
        progress.configure(quiet=False)


def test_snapshot_generation_shows_a_bar_when_forced(monkeypatch, capsys, tmp_path):
    from wsync_bench.snapshots import SnapshotConfig, ensure_snapshots

    monkeypatch.setenv("WSYNC_PROGRESS", "1")
    ensure_snapshots(tmp_path / "s", SnapshotConfig(size="tiny", steps=1, warmup_steps=1))
    err = capsys.readouterr().err
    assert "will generate 2 snapshots" in err and str(tmp_path / "s") in err
    assert "\r" in err and "snapshots tiny" in err and "step/s" in err


def test_snapshot_size_is_estimated_before_the_model_is_built():
    from wsync_bench.snapshots import SIZES, SnapshotConfig, build_model, estimate_bytes, estimate_params, param_count

    assert estimate_params("tiny") == param_count(build_model(SnapshotConfig(size="tiny")))
    # the bench model is sized so its two series take about 4.2 GiB on disk
    assert 4.3e9 < 2 * estimate_bytes(SnapshotConfig(size="bench")) < 4.5e9
    assert set(SIZES) == {"tiny", "small", "bench"}


def test_pull_shows_a_bar_per_version_when_forced(monkeypatch, capsys, tmp_path):
    from wsync.serve import pull
    from wsync.sync import Publisher

    monkeypatch.setenv("WSYNC_PROGRESS", "1")
    state = {"w": np.arange(40_000, dtype=np.uint16), "b": np.ones(64, np.float32)}
    with Publisher("tcp://127.0.0.1:0", token=b"progress-token-16b") as pub:
        pub.publish(state, version=3)
        assert pull(pub.address, tmp_path / "replica", token=b"progress-token-16b", timeout=60) == 3
    err = capsys.readouterr().err
    assert "version 3" in err and "100%" in err and "KB" in err and "\r" in err


def test_pull_bar_is_none_when_off(monkeypatch):
    monkeypatch.setenv("WSYNC_PROGRESS", "0")
    assert progress.pull_bar() is None


def test_import_wsync_does_not_import_tqdm():
    r = subprocess.run([sys.executable, "-c", "import sys, wsync, wsync.progress; print('tqdm' in sys.modules)"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.stdout.strip() == "False", r.stderr
