"""Resident memory of `wsync serve` and `wsync pull`, as multiples of the checkpoint they move.

    wsync bench serve-memory [--size-mib 1024] [--tensors 16] [--json OUT.json]

One safetensors checkpoint of --size-mib (bf16-like random bits, so nothing
compresses away) is served by a `wsync serve` child process and fetched once
by a `wsync pull` child, both over tcp:// on loopback. Reported, each divided
by the checkpoint's size:

- serve idle: VmRSS of serve once it has published, before anyone pulls;
- serve after: VmRSS of serve once the pull is done, and its VmHWM (peak) by then;
- pull peak: the pull process's maximum resident set (wait4's ru_maxrss; an
  upper bound, as a forked child starts with its parent's pages, whose size
  is saved too).

The baseline, measured in the same run, is a Python process that only
imports wsync (the interpreter, numpy and the codecs), so the part that
scales with the checkpoint can be read off. Run it where another commit's wsync
is installed to measure that commit the same way. The pulled file is compared byte
for byte with the served one; a mismatch fails the run. The CPU is named in
what is saved (lscpu).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from wsync.hardware import cpu_model

ENV = dict(os.environ, PYTHONUNBUFFERED="1", WSYNC_PROGRESS="0")  # the children run the wsync installed here


def make_checkpoint(path: Path, size: int, tensors: int, seed: int = 0) -> None:
    """A safetensors file of `tensors` bf16 tensors, written piece by piece (never whole in this process)."""
    import struct

    per = size // tensors // 2 * 2
    names = [f"layer{i:03d}.weight" for i in range(tensors)]
    header, off = {}, 0
    for n in names:
        header[n] = {"dtype": "BF16", "shape": [per // 2], "data_offsets": [off, off + per]}
        off += per
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for _ in names:
            f.write(rng.integers(0, 1 << 16, per // 2, dtype=np.uint16).tobytes())


def status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a live process, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, val = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(val.split()[0]) * 1024
    return out


def baseline_rss() -> int:
    """Peak RSS (VmHWM, read by the process itself) of a Python process that imports wsync's serve and pull."""
    code = ("import wsync, wsync.serve, wsync.sync, wsync.subscriber, pathlib; "
            "print(next(l for l in pathlib.Path('/proc/self/status').read_text().splitlines() if l.startswith('VmHWM')))")
    out = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, check=True).stdout
    return int(out.split()[1]) * 1024


def self_rss() -> int:
    return status(os.getpid())["VmRSS"]


def wait_line(proc, pattern: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"serve exited before {pattern!r}: {''.join(seen)}")
        seen.append(line)
        if pattern in line:
            return line
    raise TimeoutError(f"no {pattern!r} from serve in {timeout}s: {''.join(seen)}")


def same_bytes(a: Path, b: Path) -> bool:
    """The tensors of two safetensors files, byte for byte (headers may differ: pull adds metadata)."""
    from wsync.checkpoint import read_checkpoint

    x, y = read_checkpoint(a).state, read_checkpoint(b).state
    return set(x) == set(y) and all(x[n].dtype == y[n].dtype and x[n].shape == y[n].shape
                                    and np.array_equal(x[n].bits, y[n].bits) for n in x)


def run(size: int, tensors: int, work: Path) -> dict:
    ck = work / "model.safetensors"
    make_checkpoint(ck, size, tensors)
    size = ck.stat().st_size
    base = baseline_rss()
    serve = subprocess.Popen([sys.executable, "-m", "wsync.cli", "serve", str(ck), "--listen", "127.0.0.1:0"],
                             env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        addr = wait_line(serve, "serving", 120).split(" at ")[1].strip()
        wait_line(serve, "published version 0", 600)
        time.sleep(1.0)  # let the encoder thread settle before the idle reading
        idle = status(serve.pid)
        out = work / "replica"
        parent = self_rss()  # a forked child's ru_maxrss is at least this (its pages before exec)
        t0 = time.monotonic()
        pull = subprocess.Popen([sys.executable, "-m", "wsync.cli", "pull", addr, "-o", str(out), "--quiet"],
                                env=ENV)
        _, code, ru = os.wait4(pull.pid, 0)
        pull.returncode = os.waitstatus_to_exitcode(code)
        pull_s = time.monotonic() - t0
        if pull.returncode != 0:
            raise RuntimeError(f"pull exited {pull.returncode}")
        after = status(serve.pid)
    finally:
        serve.terminate()
        serve.wait(60)
    ok = same_bytes(ck, out / "model.safetensors")
    if not ok:
        raise RuntimeError("the pulled checkpoint differs from the served one")
    return {
        "checkpoint_bytes": size, "tensors": tensors, "baseline_rss_bytes": base,
        "serve_idle_rss_bytes": idle["VmRSS"], "serve_after_rss_bytes": after["VmRSS"],
        "serve_peak_rss_bytes": after["VmHWM"], "pull_peak_rss_bytes": ru.ru_maxrss * 1024,
        "serve_idle_x": idle["VmRSS"] / size, "serve_after_x": after["VmRSS"] / size,
        "serve_peak_x": after["VmHWM"] / size, "pull_peak_x": ru.ru_maxrss * 1024 / size,
        "baseline_x": base / size, "pull_seconds": pull_s, "bytes_identical": ok,
        "bench_parent_rss_bytes_at_pull_fork": parent,
    }


def add_parsers(bench) -> None:
    ap = bench.add_parser("serve-memory", help="resident memory of wsync serve and wsync pull, per checkpoint byte",
                          description=__doc__.splitlines()[0],
                          epilog="Default 1024 MiB: about 20 s here (2 cores), 2 GiB of temporary disk; --size-mib "
                                 "256 for a quicker look.")
    ap.add_argument("--size-mib", type=int, default=1024, help="checkpoint size, MiB (default 1024)")
    ap.add_argument("--tensors", type=int, default=16, help="tensors in the checkpoint (default 16)")
    ap.add_argument("--json", type=Path, help="write the result here")
    ap.set_defaults(fn=main)


def main(a) -> int:
    with tempfile.TemporaryDirectory(prefix="wsync-bench-serve-") as d:
        r = run(a.size_mib << 20, a.tensors, Path(d))
    r["cpu"] = f"{cpu_model()}, {os.cpu_count()} CPUs"
    r["command"] = f"wsync bench serve-memory --size-mib {a.size_mib} --tensors {a.tensors}"
    for k in ("baseline_x", "serve_idle_x", "serve_after_x", "serve_peak_x", "pull_peak_x"):
        print(f"{k:15s} {r[k]:.2f}")
    print(f"checkpoint {r['checkpoint_bytes'] / 1e9:.2f} GB, {r['cpu']}, pull {r['pull_seconds']:.1f}s, "
          f"bytes identical: {r['bytes_identical']}")
    if a.json:
        a.json.write_text(json.dumps(r, indent=2) + "\n")
    return 0
