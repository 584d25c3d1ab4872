"""Processes the WAN harness runs inside its namespaces: probes of the emulated link, and tcp:// ends.

    python -m wsync_bench.wan_roles probe-server --host IP            # prints its port
    python -m wsync_bench.wan_roles probe --host IP --port P rtt 20   # prints {"rtt_s": median}
    python -m wsync_bench.wan_roles probe --host IP --port P rate N [--streams K] [--congestion CC]
                                    # N bytes over K plain TCP streams (sendall, one thread each)
    python -m wsync_bench.wan_roles serve --host IP --size N --seed S --opts JSON  # prints its address
    python -m wsync_bench.wan_roles fetch --address A --size N --seed S --opts JSON

``serve`` sends one message of N seeded random bytes to the first subscriber;
``fetch`` answers "got" the moment it holds the whole message (every frame
already checked against its xxh3), which stops the publisher's clock, and only
then compares it byte for byte with the same bytes made from the seed (made
before connecting, so their making is not timed) and sends its verdict. Each
prints one JSON line of results.
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time

import numpy as np


def payload(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def probe_server(a) -> None:
    srv = socket.create_server((a.host, 0))
    print(srv.getsockname()[1], flush=True)
    while True:
        c, _ = srv.accept()
        threading.Thread(target=_probe_conn, args=(c,), daemon=True).start()  # several streams at once


def _probe_conn(c: socket.socket) -> None:
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    mode = c.recv(1)
    if mode == b"e":  # echo single bytes
        while (b := c.recv(1)):
            c.sendall(b)
    elif mode == b"s":  # sink: read to EOF into one reused buffer, then answer one byte
        buf = bytearray(1 << 20)
        while c.recv_into(buf):
            pass
        c.sendall(b"k")
    c.close()


def probe(a) -> None:
    if a.what == "rtt":
        c = socket.create_connection((a.host, a.port))
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c.sendall(b"e")
        times = []
        for _ in range(a.n):
            t = time.perf_counter()
            c.sendall(b"p")
            c.recv(1)
            times.append(time.perf_counter() - t)
        print(json.dumps({"rtt_s": sorted(times)[len(times) // 2], "min_s": min(times)}), flush=True)
    else:
        socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(a.streams)]
        for s in socks:
            if a.congestion:  # before connect, as tcp:// does
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, a.congestion.encode())
            s.connect((a.host, a.port))
            s.sendall(b"s")
        data = memoryview(bytes(a.n))
        cut = [a.n * k // a.streams for k in range(a.streams + 1)]

        def push(k: int) -> None:
            socks[k].sendall(data[cut[k]: cut[k + 1]])
            socks[k].shutdown(socket.SHUT_WR)
            socks[k].recv(1)  # the sink has read every byte

        t = time.perf_counter()
        threads = [threading.Thread(target=push, args=(k,)) for k in range(a.streams)]
        [th.start() for th in threads]
        [th.join() for th in threads]
        dt = time.perf_counter() - t
        print(json.dumps({"bytes": a.n, "streams": a.streams, "seconds": dt, "mbit": a.n * 8 / dt / 1e6}), flush=True)


def serve(a) -> None:
    from wsync.transports import Message, listen

    opts = json.loads(a.opts)
    data = payload(a.size, a.seed)
    lst = listen(f"tcp://{a.host}:0", **opts)
    print(lst.address, flush=True)
    link = lst.accept(timeout=60)
    t = time.perf_counter()
    link.send(Message("payload", {"seed": a.seed}, [data]))
    link.recv(timeout=a.timeout)  # "got": the subscriber holds every byte
    dt = time.perf_counter() - t
    verdict = link.recv(timeout=a.timeout)
    print(json.dumps({"seconds": dt, "mbit": a.size * 8 / dt / 1e6, "reconnects": link.reconnects,
                      **verdict.meta}), flush=True)
    link.close()
    lst.close()


def fetch(a) -> None:
    from wsync.transports import Message, connect

    want = payload(a.size, a.seed)
    link = connect(a.address, **json.loads(a.opts))
    print("connected", flush=True)
    t = time.perf_counter()
    m = link.recv(timeout=a.timeout)
    dt = time.perf_counter() - t
    link.send(Message("got"))
    got = np.frombuffer(m.blobs[0], dtype=np.uint8)
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
    p.add_argument("--streams", type=int, default=1, help="rate: parallel TCP connections")
    p.add_argument("--congestion", help="rate: TCP_CONGESTION for each connection (default: the system's)")
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
