"""1,000 idle connections to a Publisher's metrics endpoint: threads before, during, and a scrape's answer.

    wsync bench metrics-idle [--connections 1000]
"""
from __future__ import annotations

import socket
import threading
import time
import urllib.request


def add_parsers(bench) -> None:
    p = bench.add_parser("metrics-idle", help="threads of a metrics endpoint holding idle connections, and a scrape",
                         description=__doc__.splitlines()[0],
                         epilog="One size: about 10 s here (2 cores). Needs prometheus_client (pip install -e "
                                "\".[metrics]\").")
    p.add_argument("--connections", type=int, default=1000, help="idle connections held open (default 1000)")
    p.set_defaults(fn=main)


def main(a) -> None:
    from wsync.metrics import PublisherMetrics

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    m = PublisherMetrics(port)
    try:
        base = threading.active_count()
        conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(a.connections)]
        try:
            time.sleep(1.0)
            peak = threading.active_count()
            t0 = time.perf_counter()
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
            print(f"threads: {base} before, {peak} with {a.connections} idle connections; scrape {len(body)} bytes "
                  f"in {(time.perf_counter() - t0) * 1e3:.1f} ms")
        finally:
            for c in conns:
                c.close()
    finally:
        m.close()
