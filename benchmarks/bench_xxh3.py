"""wsync's own XXH3-64 (csrc/xxh3.h) against python-xxhash, measured in the same run on one core.

    python benchmarks/bench_xxh3.py [--json benchmarks/results/<date>-<cpu>-xxh3.json]

Rows: the header built three ways (AVX2, SSE2, plain C++; one-shot hash of
one buffer), wsync._cpu's checksum (the 1 MiB block tree, one thread, the
product path), and xxhash.xxh3_64_intdigest, the baseline every ratio is
taken against. Two sizes: 1 MiB (the checksum block: in cache, compute-bound)
and 256 MiB (from memory). Rounds interleave the rows and the best of each is
kept, because the machines this runs on are shared. Every row's digest is
checked against xxhash's first.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ.setdefault("WSYNC_THREADS", "1")  # before wsync._cpu starts its threads

import numpy as np  # noqa: E402
import xxhash  # noqa: E402


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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="write the results here (the CPU is named in them)")
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args(argv)
    result = {"cpu": cpu_name(), "cores_used": 1, "date": datetime.date.today().isoformat(), "sizes": {}}
    for size in (1 << 20, 256 << 20):
        result["sizes"][f"{size >> 20} MiB"] = m = measure(size, args.rounds)
        print(f"{size >> 20} MiB on {result['cpu']}:")
        for name, r in m.items():
            print(f"  {name:45s} {r['GB/s']:7.2f} GB/s  {r['vs python-xxhash']:5.2f}x python-xxhash")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
