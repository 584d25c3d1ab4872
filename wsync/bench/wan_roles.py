"""Processes the WAN harness runs inside its namespaces: probes of the emulated link, and tcp:// ends.

    python -m wsync.bench.wan_roles probe-server --host IP            # prints its port
    python -m wsync.bench.wan_roles probe --host IP --port P rtt 20   # prints {"rtt_s": median}
    python -m wsync.bench.wan_roles probe --host IP --port P rate N   # one plain TCP stream, N bytes
    python -m wsync.bench.wan_roles serve --host IP --size N --seed S --opts JSON  # prints its address
    python -m wsync.bench.wan_roles fetch --address A --size N --seed S --opts JSON

``serve`` sends one message of N seeded random bytes to the first subscriber
and waits for its verdict; ``fetch`` receives it and compares it byte for byte
with the same bytes made from the seed. Each prints one JSON line of results.
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import time

import numpy as np


def payload(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def probe_server(a) -> None:
    srv = socket.create_server((a.host, 0))
    print(srv.getsockname()[1], flush=True)
    while True:
        c, _ = srv.accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mode = c.recv(1)
        if mode == b"e":  # echo single bytes
            while (b := c.recv(1)):
                c.sendall(b)
        elif mode == b"s":  # sink: read to EOF, then answer one byte
            while c.recv(1 << 20):
                pass
            c.sendall(b"k")
        c.close()


def probe(a) -> None:
    c = socket.create_connection((a.host, a.port))
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if a.what == "rtt":
        c.sendall(b"e")
        times = []
        for _ in range(a.n):
            t = time.perf_counter()
            c.sendall(b"p")
            c.recv(1)
            times.append(time.perf_counter() - t)
        print(json.dumps({"rtt_s": sorted(times)[len(times) // 2], "min_s": min(times)}), flush=True)
    else:
        c.sendall(b"s")
        data = memoryview(bytes(a.n))
        t = time.perf_counter()
        c.sendall(data)
        c.shutdown(socket.SHUT_WR)
        c.recv(1)
        dt = time.perf_counter() - t
        print(json.dumps({"bytes": a.n, "seconds": dt, "mbit": a.n * 8 / dt / 1e6}), flush=True)


def serve(a) -> None:
    from wsync.transports import Message, listen

    opts = json.loads(a.opts)
    data = payload(a.size, a.seed)
    lst = listen(f"tcp://{a.host}:0", **opts)
    print(lst.address, flush=True)
    link = lst.accept(timeout=60)
    t = time.perf_counter()
    link.send(Message("payload", {"seed": a.seed}, [data]))
    verdict = link.recv(timeout=a.timeout)
    dt = time.perf_counter() - t
    print(json.dumps({"seconds": dt, "mbit": a.size * 8 / dt / 1e6, "reconnects": link.reconnects,
                      **verdict.meta}), flush=True)
    link.close()
    lst.close()


def fetch(a) -> None:
    from wsync.transports import Message, connect

    link = connect(a.address, **json.loads(a.opts))
    print("connected", flush=True)
    t = time.perf_counter()
    m = link.recv(timeout=a.timeout)
    dt = time.perf_counter() - t
    got = np.frombuffer(m.blobs[0], dtype=np.uint8)
    want = payload(a.size, a.seed)
    exact = got.shape == want.shape and bool(np.array_equal(got, want))  # byte for byte
    link.send(Message("verdict", {"exact": exact, "fetch_reconnects": link.reconnects}))
    link.flush(30)
    print(json.dumps({"exact": exact, "seconds": dt, "reconnects": link.reconnects}), flush=True)
    link.close()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="role", required=True)
    p = sub.add_parser("probe-server")
    p.add_argument("--host", required=True)
    p = sub.add_parser("probe")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("what", choices=["rtt", "rate"])
    p.add_argument("n", type=int)
    for name in ("serve", "fetch"):
        p = sub.add_parser(name)
        p.add_argument("--host" if name == "serve" else "--address", required=True)
        p.add_argument("--size", type=int, required=True)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--opts", default="{}", help="tcp options as JSON")
        p.add_argument("--timeout", type=float, default=600)
    a = ap.parse_args(argv)
    {"probe-server": probe_server, "probe": probe, "serve": serve, "fetch": fetch}[a.role](a)


if __name__ == "__main__":
    sys.exit(main())
