"""`wsync serve` holds each served file once, and `wsync pull` never a second copy of the model in memory.

These check structure, not timings: serve's keyframe is a view of the file's mapping and nothing encoded is
kept; the heap (tracemalloc, which sees numpy's arrays but not file mappings) grows by a few buckets while
serving, and by about one model while pulling (the received payloads), not two or three.
`wsync bench serve-memory` measures the resident sizes of the real commands.
"""
from __future__ import annotations

import mmap
import os
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np

import wsync.sync
from wsync.checkpoint import Checkpoint, read_checkpoint, write_checkpoint
from wsync.serve import pull, serve
from wsync.snapshot import as_state

from helpers import settle

TENSORS, PER = 32, 1 << 20  # 32 tensors of 1 Mi bf16-like elements: 64 MiB
BUCKET = 1 << 20  # many buckets, so streaming them one at a time shows
ENV = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), WSYNC_PROGRESS="0")


def _state(rng, step=0, base=None):
    if base is None:
        return {f"w{i}": rng.integers(0, 1 << 16, PER, dtype=np.uint16) for i in range(TENSORS)}
    out = {}
    for n, w in base.items():
        w = w.copy()
        w[rng.choice(PER, PER // 200, replace=False)] += np.uint16(step)
        out[n] = w
    return out


def _write(path: Path, state) -> int:
    write_checkpoint(path, Checkpoint(as_state(state), None, {}))
    settle(path)
    return sum(v.nbytes for v in state.values())


def _same(path: Path, state) -> bool:
    got = read_checkpoint(path).state
    return set(got) == set(state) and all(got[n].bits.tobytes() == v.tobytes() for n, v in state.items())


class _Serving:
    """serve(src) in a thread, its Publisher kept for inspection; .address once it listens."""

    def __init__(self, src: Path, monkeypatch, **kw):
        self.pubs, self.lines, self.stop = [], [], threading.Event()

        class Kept(wsync.sync.Publisher):
            def __init__(inner, *a, **k):
                super().__init__(*a, **k)
                self.pubs.append(inner)
        monkeypatch.setattr(wsync.sync, "Publisher", Kept)
        self.thread = threading.Thread(target=serve, args=(src, "tcp://127.0.0.1:0"), daemon=True,
                                       kwargs=dict(stop=self.stop.is_set, poll_s=0.1, settle_s=0.5,
                                                   log=self.lines.append, bucket_bytes=BUCKET, **kw))
        self.thread.start()

    def published(self, version: int) -> str:
        deadline = time.monotonic() + 60  # only to turn a hang into a failure
        while not any(line.startswith(f"published version {version} ") for line in self.lines):
            assert time.monotonic() < deadline and self.thread.is_alive(), self.lines
            time.sleep(0.02)
        return self.lines[0].split(" at ")[1]

    def close(self):
        self.stop.set()
        self.thread.join(30)


def _mapped(a: np.ndarray) -> bool:
    """Whether a's memory belongs to a file mapping (its chain of bases ends in an mmap)."""
    while isinstance(a, np.ndarray):
        a = a.base
    return isinstance(a, memoryview) and isinstance(a.obj, mmap.mmap)


def test_serve_encodes_each_pull_from_the_mapped_file_and_keeps_no_copy(tmp_path, rng, monkeypatch):
    src = tmp_path / "model.safetensors"
    state = _state(rng)
    size = _write(src, state)
    srv = _Serving(src, monkeypatch)
    try:
        addr = srv.published(0)

        def pull_elsewhere(out):
            r = subprocess.run([sys.executable, "-m", "wsync.cli", "pull", addr, "-o", str(out), "--quiet"],
                               env=ENV, capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stderr
        pull_elsewhere(tmp_path / "warm")  # what serving imports on first use (and compiles, fresh) is not counted
        tracemalloc.start()
        try:
            start = tracemalloc.get_traced_memory()[0]
            for i in range(2):  # a second subscriber costs no more than the first
                pull_elsewhere(tmp_path / f"r{i}")
            peak = tracemalloc.get_traced_memory()[1] - start
        finally:
            tracemalloc.stop()
        pub = srv.pubs[0]
        kf = pub._history.keyframe
        assert kf.encoded is None  # nothing encoded is kept: each subscriber's keyframe went out a bucket at a time
        assert all(_mapped(tb.bits) for tb in kf.state.values())  # the very pages of the file, not a copy
        assert pub._mirror.state is None and pub._spare is None
        # the buckets in flight (what the sockets' buffers hold, unacknowledged), never the model
        assert peak < size / 2, (peak, size)
        assert _same(tmp_path / "r0", state) and _same(tmp_path / "r1", state)
    finally:
        srv.close()


class _ServingElsewhere:
    """serve(src) in a child process (so this one's heap is the pull's alone); .address once it listens."""

    def __init__(self, src: Path):
        code = (f"from wsync.serve import serve; serve({str(src)!r}, 'tcp://127.0.0.1:0', poll_s=0.1, settle_s=0.5, "
                f"bucket_bytes={BUCKET}, log=lambda s: print(s, flush=True))")
        self.proc = subprocess.Popen([sys.executable, "-c", code], env=ENV, stdout=subprocess.PIPE, text=True)
        self.address = self._line("serving").split(" at ")[1].strip()

    def _line(self, start: str) -> str:
        while True:  # the child's own log; a hang here is the test's timeout
            line = self.proc.stdout.readline()
            assert line, "serve exited"
            if line.startswith(start):
                return line

    def published(self, version: int) -> None:
        self._line(f"published version {version} ")

    def close(self):
        self.proc.terminate()
        self.proc.wait(30)


def test_pull_writes_a_keyframe_through_a_mapping_and_resumes_from_one(tmp_path, rng):
    src, out = tmp_path / "src", tmp_path / "out"
    first = _state(rng)
    size = _write(src / "step_0001", first)
    srv = _ServingElsewhere(src)
    try:
        srv.published(1)
        assert pull(srv.address, tmp_path / "warm", timeout=60, progress=False) == 1  # first-use imports not counted
        tracemalloc.start()
        try:
            start = tracemalloc.get_traced_memory()[0]
            assert pull(srv.address, out, timeout=60, progress=False) == 1
            keyframe_peak = tracemalloc.get_traced_memory()[1] - start
            assert _same(out, first)
            second = _state(rng, 2, first)
            _write(src / "step_0002", second)
            srv.published(2)
            tracemalloc.reset_peak()
            start = tracemalloc.get_traced_memory()[0]
            assert pull(srv.address, out, timeout=60, progress=False) == 2  # a delta onto the replica on disk
            delta_peak = tracemalloc.get_traced_memory()[1] - start
        finally:
            tracemalloc.stop()
        # the received payloads (one model) and a bucket decoded at a time: not a decoded model beside them
        assert keyframe_peak < 1.25 * size, (keyframe_peak, size)
        assert delta_peak < size / 4, (delta_peak, size)  # the replica is mapped, not read into memory
        assert _same(out, second)
    finally:
        srv.close()


def test_frozen_versions_are_deltas_against_each_other_and_no_mirror_is_made(tmp_path, rng):
    """A frozen state is never made the publisher's mirror (it may not be written); deltas after it are still
    measured against it."""
    src = tmp_path / "a.safetensors"
    _write(src, _state(rng))
    with wsync.sync.Publisher("tcp://127.0.0.1:0", bucket_bytes=BUCKET) as pub:
        first = read_checkpoint(src).state
        pub.publish(first, version=0, frozen=True)
        pub.flush(30)
        second = {n: tb.bits.copy() for n, tb in first.items()}
        second["w0"][:10] += np.uint16(1)
        pub.publish(as_state(second), version=1, frozen=True)
        pub.flush(30)
        assert pub._mirror.state is None
        assert pub._history.deltas[1].base_version == 0  # a delta, not a second keyframe
        assert pub._history.keyframe.version == 0


def test_pull_into_a_folder_whose_parents_do_not_exist_yet(tmp_path, rng, monkeypatch):
    src = tmp_path / "model.safetensors"
    state = {n: v[:1000] for n, v in list(_state(rng).items())[:2]}
    _write(src, state)
    srv = _Serving(src, monkeypatch)
    try:
        out = tmp_path / "a" / "b" / "replica"
        assert pull(srv.published(0), out, timeout=60, progress=False) == 0
        assert _same(out, state)
        assert sorted(p.name for p in out.parent.iterdir()) == ["replica"]  # no scratch file left beside it
    finally:
        srv.close()
