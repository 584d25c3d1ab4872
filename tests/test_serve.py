"""`wsync serve` / `wsync pull`: a folder of checkpoints served over tcp, pulled, resumed, bit-exact."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from wsync.checkpoint import Checkpoint, read_checkpoint, write_checkpoint
from wsync.subscriber import WaitTimeout
from wsync.serve import replica_metadata
from wsync.serve import find_versions, pull, read_replica, serve
from wsync.snapshot import as_state, digest

from helpers import TOKEN, TOKEN_HEX, free_port, settle


def _series(root, n, rng, size=50_000):
    """n checkpoints step_0000.. of a bf16-like state, each a sparse change of the one before."""
    state = {"w": rng.integers(0, 1 << 16, size, dtype=np.uint16).view(np.uint16),
             "b": rng.standard_normal(300).astype(np.float32)}
    states = []
    for i in range(n):
        if i:
            w = state["w"].copy()
            idx = rng.choice(size, size // 100, replace=False)
            w[idx] += 1
            state = {"w": w, "b": state["b"] + np.float32(i)}
        write_checkpoint(root / f"step_{i:04d}", Checkpoint(as_state(state), None, {}))
        states.append(state)
    settle(root)
    return states


def _token_file(folder) -> str:
    path = folder / "token"
    path.write_text(TOKEN_HEX + "\n")
    return str(path)


def _serving(src, **kw):
    stop = threading.Event()
    addr = {}

    def log(line):
        if line.startswith("serving"):
            addr["a"] = line.split(" at ")[1]

    t = threading.Thread(target=serve, args=(src, "tcp://127.0.0.1:0"),
                         kwargs=dict(token=TOKEN, stop=stop.is_set, poll_s=0.2, settle_s=0.5, log=log, **kw), daemon=True)
    t.start()
    deadline = time.monotonic() + 60  # only to turn a hang into a failure
    while "a" not in addr:
        assert time.monotonic() < deadline and t.is_alive(), "serve never said where it listens"
        time.sleep(0.05)
    return addr["a"], stop, t


def test_find_versions(tmp_path, rng):
    _series(tmp_path, 3, rng)
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert [v for v, _ in find_versions(tmp_path)] == [0, 1, 2]
    assert find_versions(tmp_path / "step_0001") == [(0, tmp_path / "step_0001")]
    with pytest.raises(FileNotFoundError):
        find_versions(tmp_path / "missing")


def test_pull_newest_then_resume_with_deltas_only(tmp_path, rng):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    states = _series(src, 3, rng)
    addr, stop, t = _serving(src, keyframe_every=50)
    try:
        assert pull(addr, out, token=TOKEN, timeout=30, progress=False) == 2
        got = read_checkpoint(out).state
        assert digest(got) == digest(as_state(states[2]))
        # two more versions appear in the watched folder; the next pull fetches only their deltas
        more = _series(tmp_path / "more", 5, np.random.default_rng(1234))  # same rng seed as the fixture
        for i in (3, 4):
            os.replace(tmp_path / "more" / f"step_{i:04d}", src / f"step_{i:04d}")
        replica, layouts = read_replica(out)
        assert layouts  # saved with the weights, so the next pull can take deltas
        assert replica.version == 2
        assert pull(addr, out, token=TOKEN, timeout=30, version=4, progress=False) == 4
        assert digest(read_checkpoint(out).state) == digest(as_state(more[4]))
    finally:
        stop.set()
        t.join(10)


def test_pull_with_wrong_token_gets_nothing(tmp_path, rng):
    src = tmp_path / "src"
    src.mkdir()
    _series(src, 1, rng)
    addr, stop, t = _serving(src)
    try:
        # nobody can prove a wrong token's "no" came from the publisher, so it is retried, then named
        with pytest.raises(WaitTimeout, match="prove the shared token"):
            pull(addr, tmp_path / "out", token=b"the-wrong-token-16", connect_timeout=2, timeout=30, progress=False)
        assert not (tmp_path / "out").exists()
    finally:
        stop.set()
        t.join(10)


@pytest.mark.slow
def test_killed_pull_leaves_last_good_version(tmp_path, rng):
    """Kill `wsync pull` mid-transfer: OUT still holds the previous version, intact, and a new pull finishes."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    states = _series(src, 2, rng, size=4_000_000)
    first = as_state(states[0])  # a replica as pull leaves it: weights, version, digest and layouts
    write_checkpoint(out, Checkpoint(first, None, replica_metadata(first, 0)))
    addr, stop, t = _serving(src, codec="raw")  # raw: big enough to kill mid-flight
    try:
        env = dict(os.environ, PYTHONPATH=os.getcwd(), WSYNC_PROGRESS="1")  # the bar, though stderr is a pipe
        p = subprocess.Popen([sys.executable, "-m", "wsync.cli", "pull", addr, "-o", str(out), "--token-file", _token_file(tmp_path)],
                             stderr=subprocess.PIPE, text=True, env=env)
        seen = ""
        while "bucket" not in seen:  # the progress bar is drawn: bytes are flowing (it ends no line until done)
            ch = p.stderr.read(1)
            assert ch, seen
            seen += ch
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        replica, layouts = read_replica(out)
        assert layouts  # saved with the weights, so the next pull can take deltas
        assert replica.version in (0, 1)  # killed before or after the atomic write, never between
        assert digest(replica.state) == digest(as_state(states[replica.version]))
        assert pull(addr, out, token=TOKEN, timeout=30, progress=False) == 1
        assert digest(read_checkpoint(out).state) == digest(as_state(states[1]))
    finally:
        stop.set()
        t.join(10)


# -- serve --no-watch says why it served nothing; pull says what it waits for -----------------------

def test_serve_no_watch_with_no_valid_file_fails_naming_each_one(tmp_path, capsys):
    from wsync.cli import main as cli

    src = tmp_path / "src"
    src.mkdir()
    (src / "model.bin").write_bytes(b"\0" * 64)
    (src / "step_0001.safetensors").write_bytes(b"\xff" * 64)  # a header length that does not fit the file
    (src / "step_0002").mkdir()
    settle(src)
    assert cli(["serve", str(src), "--listen", "127.0.0.1:0", "--no-watch", "--flush-timeout", "30"]) == 2
    err = capsys.readouterr().err
    assert "nothing to serve" in err
    assert "model.bin: not a .safetensors file" in err
    assert "step_0001.safetensors: " in err and "header length" in err
    assert "step_0002: a folder with no .safetensors file or index" in err
    (src / "step_0001.safetensors").unlink()
    (src / "step_0002").rmdir()
    (src / "model.bin").unlink()
    assert cli(["serve", str(src), "--listen", "127.0.0.1:0", "--no-watch"]) == 2
    assert f"{src} is empty" in capsys.readouterr().err


def test_serve_no_watch_that_served_nobody_exits_nonzero(tmp_path, rng, capsys):
    from wsync.cli import main as cli

    src = tmp_path / "src"
    src.mkdir()
    _series(src, 1, rng, size=1000)
    assert cli(["serve", str(src), "--listen", "127.0.0.1:0", "--no-watch", "--flush-timeout", "0.5"]) == 2
    out = capsys.readouterr()
    assert "published version 0 " in out.out
    assert "served nobody: no subscriber took version 0" in out.err


def test_serve_no_watch_returns_once_a_subscriber_took_the_newest(tmp_path, rng):
    src = tmp_path / "src"
    src.mkdir()
    states = _series(src, 2, rng, size=1000)
    lines, result = [], {}

    def run():
        try:
            serve(src, "tcp://127.0.0.1:0", token=TOKEN, watch=False, settle_s=0.5, log=lines.append, flush_timeout=60)
            result["ok"] = True
        except BaseException as e:  # noqa: BLE001
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    deadline = time.monotonic() + 60  # only to turn a hang into a failure
    while not any(line.startswith("waiting up to") for line in lines):
        assert time.monotonic() < deadline and t.is_alive(), (lines, result)
        time.sleep(0.02)
    addr = lines[0].split(" at ")[1]
    assert pull(addr, tmp_path / "out", token=TOKEN, timeout=30, progress=False) == 1
    t.join(30)
    assert result == {"ok": True}
    assert digest(read_checkpoint(tmp_path / "out").state) == digest(as_state(states[1]))


def test_pull_says_what_it_waits_for_every_few_seconds(tmp_path):
    from wsync.subscriber import WaitTimeout

    addr = f"tcp://127.0.0.1:{free_port()}"
    said = []
    with pytest.raises(WaitTimeout, match="announced no version within 1.5s"):
        pull(addr, tmp_path / "out", connect_timeout=1.5, progress=False, say=said.append, say_every=0.4)
    assert len(said) >= 2, said
    assert all(line.startswith(f"waiting for {addr}: nothing listening, ") and line.endswith(" of 1.5")
               for line in said), said
