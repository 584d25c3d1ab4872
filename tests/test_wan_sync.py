"""Sync across a real (emulated) WAN: publisher in one network namespace, subscriber in another.

The link is rate-limited, delayed and lossy (benchmarks/wsync_bench/wan.py). Every check
is on bytes: run_mode verifies the subscriber's digest of each version, and the
pulled folders are compared with the published checkpoints.
"""
from __future__ import annotations

import json
import signal

import numpy as np
import pytest

from wsync_bench import wan as wanmod
from wsync_bench.sync import run_mode
from wsync.checkpoint import Checkpoint, read_checkpoint, write_checkpoint
from wsync.serve import replica_metadata
from wsync.snapshot import as_state, digest

from helpers import TOKEN_HEX, settle

WHY = wanmod.unavailable()
pytestmark = [pytest.mark.skipif(WHY is not None, reason=f"no WAN emulation here: {WHY}"), pytest.mark.slow]


def _series(root, n, size, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.integers(0, 1 << 16, size, dtype=np.uint16)
    paths = []
    for i in range(n):
        if i:
            w = w.copy()
            w[rng.choice(size, size // 100, replace=False)] += 1
        p = root / f"step_{i:04d}"
        write_checkpoint(p, Checkpoint(as_state({"w": w, "b": np.full(64, i, np.float32)}), None, {}))
        paths.append(p)
    return paths


def test_full_and_delta_sync_across_the_wan_bit_exact(tmp_path):
    paths = _series(tmp_path, 3, 1 << 20)
    with wanmod.WanLink(rate_mbit=200, rtt_ms=40, loss=0.005) as wan:
        for mode in ("full", "delta"):
            r = run_mode(mode, paths, listen=f"tcp://{wan.ip_a}:0", wan=wan, bucket_bytes=1 << 20)
            assert r["exact"] and len(r["versions"]) == 2
    assert r["mean_bytes"] < (2 << 20) / 10  # the delta run moved a small fraction of the 2 MB


def _serve(wan, src, codec: str):
    p = wan.python("a", "-m", "wsync.cli", "serve", str(src), "--listen", f"tcp://{wan.ip_a}:47070",
                   "--token", TOKEN_HEX, "--codec", codec, stdout=None)
    return p  # not waited for: a pull redials until the listener is up


def _pull(wan, out, **popen):
    return wan.python("b", "-m", "wsync.cli", "pull", f"tcp://{wan.ip_a}:47070", "-o", str(out),
                      "--token", TOKEN_HEX, **popen)


def _bar_drawn(p) -> None:
    """Read p's stderr until its progress bar names a bucket: a version is on the wire (a bar ends no line)."""
    seen = ""
    while "bucket" not in seen:
        ch = p.stderr.read(1)
        assert ch, seen
        seen += ch


def test_pull_killed_mid_transfer_comes_back_at_last_good_version(tmp_path, monkeypatch):
    monkeypatch.setenv("WSYNC_PROGRESS", "1")  # pull's bar, though its stderr is a pipe
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    paths = _series(src, 2, 8 << 20)  # 16 MB per version: seconds at 50 Mbit/s
    base = read_checkpoint(paths[0]).state
    write_checkpoint(out, Checkpoint(base, None, replica_metadata(base, 0)))
    settle(src)
    with wanmod.WanLink(rate_mbit=50, rtt_ms=40, loss=0.005) as wan:
        server = _serve(wan, src, "raw")
        try:
            p = _pull(wan, out)
            _bar_drawn(p)  # version 1 is on the wire
            p.send_signal(signal.SIGKILL)
            p.wait(10)
            held = read_checkpoint(out)
            assert held.metadata["wsync_version"] == "0" and digest(held.state) == digest(base)
            # a connection cut in the middle of the next pull is resumed by the transport
            p = _pull(wan, out)
            _bar_drawn(p)
            assert wan.cut() > 0
            assert p.wait(120) == 0, p.stderr.read()
        finally:
            server.kill()
            server.wait()
    got = read_checkpoint(out)
    assert got.metadata["wsync_version"] == "1"
    assert digest(got.state) == digest(read_checkpoint(paths[1]).state)
    assert json.loads((out / "wsync-version.json").read_text())["version"] == 1
