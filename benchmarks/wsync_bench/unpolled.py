"""Resident memory of a poll-mode subscriber whose engine never polls, against the two-version bound.

    wsync bench unpolled [--versions 25] [--mib 16] [--json out.json]

A publisher in a child process sends raw versions of ``--mib`` MiB each (one
uint16 tensor of random bits, new every version) over tcp:// on loopback, with
a token. This process is the subscriber, ``apply="poll"``, with an engine (a
Shadow holding a tensor of that size). Version 0 warms up: the engine polls it
(imports, threads and the link's first receive buffers are paid for there).
Then ``--versions`` more arrive and the engine does not poll. The resident set
(VmRSS) is read after the warm-up (the baseline), as each version's last
bucket lands, and once the publisher has flushed. Target: it grows by at most
two versions' bytes (one waiting to be applied, one arriving) once the versions
are in. The peak is reported too: it also counts versions still on their way,
which the link may hold up to what its sockets buffer. Then one poll
must commit the newest version, bit for bit (its bytes are compared with the
publisher's, regenerated here from the same seed). The growth from when the
link came up, before the warm-up, is reported too.

A run where a wsync without the bound is installed gives the "before" figure
with the same suite; the hardware is named in what it saves (lscpu). The
publisher is a child process, `python -m wsync_bench.unpolled VERSIONS MIB`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

from wsync.hardware import cpu_model

TOKEN = b"bench-unpolled-token-0123"


def state(v: int, n: int) -> dict:
    return {"w": np.random.default_rng(1000 + v).integers(0, 1 << 16, n, dtype=np.uint16)}


def rss(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def publisher(versions: int, n: int) -> None:
    """The child: listen, say where, wait for the go, publish every version, flush, say so."""
    from wsync.sync import Publisher

    with Publisher("tcp://127.0.0.1:0", token=TOKEN, codec="raw") as pub:
        print(pub.address, flush=True)
        pub.wait_for_subscribers(1, timeout=60)
        print("joined", flush=True)
        sys.stdin.readline()
        pub.publish(state(0, n), version=0)  # the warm-up version, which the engine applies
        pub.flush(timeout=300)
        print("warm", flush=True)
        sys.stdin.readline()  # the subscriber took its baseline
        for v in range(1, versions + 1):
            pub.publish(state(v, n), version=v)
        pub.flush(timeout=300)
        print("published", flush=True)
        sys.stdin.readline()  # keep the link up until the subscriber has measured


def subscriber(args) -> dict:
    from wsync.engines import Shadow
    from wsync.subscriber import Subscriber

    n = (args.mib << 20) // 2
    one = 2 * n
    child = subprocess.Popen([sys.executable, "-m", "wsync_bench.unpolled", str(args.versions), str(args.mib)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        address = child.stdout.readline().strip()
        engine = Shadow({"w": np.zeros(n, np.uint16)})
        samples, last = [], threading.Event()

        def progress(version, bucket, buckets, nbytes):
            if bucket == buckets:
                samples.append((version, rss()))
                if version == args.versions:
                    last.set()

        with Subscriber(address, engine=engine, token=TOKEN, apply="poll", progress=progress) as sub:
            if child.stdout.readline().strip() != "joined":
                raise RuntimeError("the publisher saw no subscriber")
            linked = rss()
            child.stdin.write("go\n")
            child.stdin.flush()
            if child.stdout.readline().strip() != "warm":
                raise RuntimeError("the publisher did not send the warm-up version")
            sub.wait_for(0, timeout=120)  # polls it: the engine serves version 0, the link's buffers are warm
            samples.clear()
            base = rss()
            child.stdin.write("go\n")
            child.stdin.flush()
            if child.stdout.readline().strip() != "published" or not last.wait(300):
                raise RuntimeError("the publisher did not finish")
            after = rss()  # "published" came after the publisher's flush: the newest is staged (acked once staged)
            stats = sub.stats
            t0 = time.perf_counter()
            newest = sub.poll()
            poll_s = time.perf_counter() - t0
            committed = sub.stats.versions
            exact = newest == args.versions and \
                engine.state["w"].bits.tobytes() == state(args.versions, n)["w"].tobytes()
            child.stdin.write("done\n")
            child.stdin.flush()
    finally:
        try:
            child.wait(60)
        except subprocess.TimeoutExpired:
            child.kill()
    growth = [r - base for _, r in samples]
    return {
        "cpu": f"{cpu_model()}, {os.cpu_count()} CPUs",
        "versions": args.versions,
        "version_bytes": one,
        "bound_bytes": 2 * one,
        "rss_linked": linked,
        "baseline_rss": base,
        "growth_from_linked_after_all": after - linked,
        "growth_after_all": after - base,
        "growth_peak_sampled": max(growth),
        "growth_per_version": growth,
        "growth_after_all_in_versions": round((after - base) / one, 3),
        "growth_peak_in_versions": round(max(growth) / one, 3),
        "staged_at_end": stats.staged,
        "staged_bytes_at_end": stats.staged_bytes,
        "versions_committed": committed,  # the warm-up and the newest: the ones in between were superseded
        "poll_s": poll_s,
        "exact": exact,
        # the target: what it holds once the versions are in; the peak also counts versions still arriving
        "met": exact and after - base <= 2 * one,
        "peak_within_bound": max(growth) <= 2 * one,
    }


def add_parsers(bench) -> None:
    ap = bench.add_parser("unpolled", help="resident memory of a poll-mode subscriber whose engine never polls",
                          description=__doc__.splitlines()[0],
                          epilog="Default 25 versions of 16 MiB: a few seconds here (2 cores).")
    ap.add_argument("--versions", type=int, default=25, help="versions sent after the warm-up one (default 25)")
    ap.add_argument("--mib", type=int, default=16, help="MiB of each version (default 16)")
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--label", default="", help="what tree this is (e.g. a commit), saved with the result")
    ap.set_defaults(fn=main)


def main(args) -> None:
    out = {"label": args.label, **subscriber(args)}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":  # the publisher, a child process of the suite: VERSIONS MIB
    publisher(int(sys.argv[1]), (int(sys.argv[2]) << 20) // 2)
