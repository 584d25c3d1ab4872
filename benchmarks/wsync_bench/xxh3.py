"""wsync's own XXH3-64 (csrc/xxh3.h) against python-xxhash, measured in the same run on one core.

    wsync bench xxh3 [--json benchmarks/results/<date>-<cpu>-xxh3.json]

Rows: the header built three ways (AVX2, SSE2, plain C++; one-shot hash of
one buffer), wsync._cpu's checksum (the 1 MiB block tree, one thread, the
product path), and xxhash.xxh3_64_intdigest, the baseline every ratio is
taken against. Two sizes: 1 MiB (the checksum block: in cache, compute-bound)
and 256 MiB (from memory). Rounds interleave the rows and the best of each is
kept, because the machines this runs on are shared. Every row's digest is
checked against xxhash's first. The three builds of the header come from the checkout's tests/cudasim, so
this suite runs from a checkout.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import xxhash

ROOT = Path(__file__).resolve().parents[2]  # the checkout: tests/cudasim builds the header's variants


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def rows(buf: np.ndarray) -> dict:
    from cudasim import xxh3_probe

    from wsync.checksum import checksum

    ptr, n = buf.ctypes.data, buf.nbytes  # resolved once: the call itself is what is timed
    out = {f"wsync xxh3.h {k}": ((lambda f: lambda _b: f(ptr, n))(f), None) for k, f in xxh3_probe.load_raw().items()}
    try:
        from wsync.backends.cpu import CpuKernels

        cpu = CpuKernels()._cpu
        out["wsync._cpu checksum (block tree, 1 thread)"] = (cpu.checksum, checksum)
    except Exception as e:  # no extension built: the other rows still say something
        print(f"(no wsync._cpu row: {e})", file=sys.stderr)
    out["python-xxhash xxh3_64"] = (xxhash.xxh3_64_intdigest, None)
    return out


def measure(size: int, rounds: int) -> dict:
    buf = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    table = rows(buf)
    want = xxhash.xxh3_64_intdigest(buf)
    for name, (fn, ref) in table.items():
        got = fn(buf)
        assert (f"{got:016x}" == ref(buf)) if ref else got == want, f"{name} disagrees with python-xxhash"
    best = {name: float("inf") for name in table}
    reps = max(1, (256 << 20) // size)
    for _ in range(rounds):
        for name, (fn, _) in table.items():
            t = time.perf_counter()
            for _ in range(reps):
                fn(buf)
            best[name] = min(best[name], (time.perf_counter() - t) / reps)
    base = best["python-xxhash xxh3_64"]
    return {name: {"GB/s": round(size / s / 1e9, 2), "vs python-xxhash": round(base / s, 3)} for name, s in best.items()}


def add_parsers(bench) -> None:
    p = bench.add_parser("xxh3", help="wsync's XXH3-64 (csrc/xxh3.h, three builds) against python-xxhash, one core",
                         description=__doc__.splitlines()[0],
                         epilog="One size pair (1 MiB, 256 MiB): a few seconds here (2 cores), plus compiling the "
                                "header three ways the first time. From a checkout (it builds tests/cudasim's "
                                "probe).")
    p.add_argument("--json", type=Path, help="write the results here (the CPU is named in them)")
    p.add_argument("--rounds", type=int, default=9, help="interleaved timed rounds, best kept (default 9)")
    p.set_defaults(fn=main)


def main(args) -> None:
    os.environ.setdefault("WSYNC_THREADS", "1")  # before wsync._cpu starts its threads (on its first use)
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))
    result = {"cpu": cpu_name(), "cores_used": 1, "date": datetime.date.today().isoformat(), "sizes": {}}
    for size in (1 << 20, 256 << 20):
        result["sizes"][f"{size >> 20} MiB"] = m = measure(size, args.rounds)
        print(f"{size >> 20} MiB on {result['cpu']}:")
        for name, r in m.items():
            print(f"  {name:45s} {r['GB/s']:7.2f} GB/s  {r['vs python-xxhash']:5.2f}x python-xxhash")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
