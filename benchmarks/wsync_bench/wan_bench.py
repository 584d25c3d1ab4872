"""Measurements across a WanLink: the link itself (RTT, one plain TCP stream) and tcp:// transfers.

    wsync bench wan --rate 200 --rtt 40 --loss 0.005 --size-mib 128 --streams 1 4 \\
        [--congestion bbr cubic] [--json out.json]

For each congestion control and stream count, one message of --size-mib
random bytes goes from a publisher in namespace a to a subscriber in namespace
b, which checks it byte for byte. Throughput is reported as a fraction of the
configured link rate, beside a plain-socket baseline measured the same way on
the same link just before: the same bytes over as many plain TCP connections
(``sendall`` in one thread each, same congestion control), so a ceiling of
the emulation shows up in both. The CPU seconds the delay line spent during
each run are recorded too: it is a Python process sharing the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time

from wsync.hardware import cpu_model

from .wan import WanLink


def measure_rtt(wan: WanLink, n: int = 15) -> float:
    """Median round trip of one byte over a TCP connection from a to b, in seconds."""
    srv = wan.python("b", "-m", "wsync_bench.wan_roles", "probe-server", "--host", wan.ip_b)
    port = srv.stdout.readline().strip()
    r = wan.exec("a", *_py(), "-m", "wsync_bench.wan_roles", "probe", "--host", wan.ip_b, "--port", port, "rtt",
                 str(n))
    srv.kill()
    return json.loads(r.stdout)["rtt_s"]


def measure_rate(wan: WanLink, nbytes: int, streams: int = 1, congestion: str | None = None) -> float:
    """Bits per second of plain TCP (sendall) from a to b over `streams` connections together."""
    srv = wan.python("b", "-m", "wsync_bench.wan_roles", "probe-server", "--host", wan.ip_b)
    port = srv.stdout.readline().strip()
    extra = ["--streams", str(streams)] + (["--congestion", congestion] if congestion else [])
    r = wan.exec("a", *_py(), "-m", "wsync_bench.wan_roles", "probe", "--host", wan.ip_b, "--port", port, "rate",
                 str(nbytes), *extra, timeout=600)
    srv.kill()
    return json.loads(r.stdout)["mbit"] * 1e6


def transfer(wan: WanLink, size: int, *, seed: int = 0, opts: dict | None = None, during=None,
             timeout: float = 600) -> dict:
    """One tcp:// message of size seeded bytes from a (listening) to b (dialling).

    during(wan), if given, runs in a thread once the subscriber is connected (e.g. to cut the link).
    Returns the publisher's results merged with the subscriber's ("exact" is its byte-for-byte verdict).
    """
    o = json.dumps(opts or {})
    pub = wan.python("a", "-m", "wsync_bench.wan_roles", "serve", "--host", wan.ip_a, "--size", str(size),
                     "--seed", str(seed), "--opts", o, "--timeout", str(timeout))
    address = pub.stdout.readline().strip()
    if not address.startswith("tcp://"):
        raise RuntimeError(f"publisher did not start: {address} {pub.stderr.read()}")
    sub = wan.python("b", "-m", "wsync_bench.wan_roles", "fetch", "--address", address, "--size", str(size),
                     "--seed", str(seed), "--opts", o, "--timeout", str(timeout))
    if sub.stdout.readline().strip() != "connected":
        raise RuntimeError(f"subscriber did not connect: {sub.stderr.read()}")
    side = threading.Thread(target=during, args=(wan,)) if during else None
    if side:
        side.start()
    out_sub, err_sub = sub.communicate(timeout=timeout)
    out_pub, err_pub = pub.communicate(timeout=60)
    if side:
        side.join()
    if sub.returncode or pub.returncode:
        raise RuntimeError(f"transfer failed:\nsubscriber: {err_sub[-2000:]}\npublisher: {err_pub[-2000:]}")
    res = {**json.loads(out_sub.splitlines()[-1]), **json.loads(out_pub.splitlines()[-1])}
    res["logs"] = err_sub + err_pub
    return res


def hardware() -> str:
    """CPU model and core count, for results files."""
    return f"{cpu_model()}, {os.cpu_count()} cores, no GPU"


def _py() -> list[str]:
    import sys

    return ["env", "PYTHONPATH=" + os.pathsep.join(os.path.abspath(p or ".") for p in sys.path), sys.executable]


def add_parsers(bench) -> None:
    ap = bench.add_parser("wan", help="tcp:// across an emulated WAN link beside plain sockets (root: namespaces)",
                          description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                          epilog="Default 128 MiB, 1 and 4 streams: about a minute at 200 Mbit/s (root, for the "
                                 "network namespaces; without them it says so and exits 3).")
    ap.add_argument("--rate", type=float, default=200.0, help="link rate, Mbit/s")
    ap.add_argument("--rtt", type=float, default=40.0, help="added round-trip time, ms")
    ap.add_argument("--loss", type=float, default=0.005, help="per-packet loss probability")
    ap.add_argument("--size-mib", type=int, default=128, help="MiB of each transfer (default 128)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4], help="stream counts to run (default 1 4)")
    ap.add_argument("--congestion", nargs="+", default=[None], help="TCP congestion control(s), e.g. bbr cubic")
    ap.add_argument("--repeat", type=int, default=1, help="transfers per congestion control and stream count")
    ap.add_argument("--opts", default="{}", help="more tcp:// options for both ends, as JSON")
    ap.add_argument("--no-baseline", action="store_true", help="skip the plain-socket run before each transfer")
    ap.add_argument("--json", help="also write the results here")
    ap.set_defaults(fn=main)


def main(a) -> None:
    res = {"hardware": hardware(), "load_avg_before": os.getloadavg()[0], "rate_mbit": a.rate, "rtt_ms": a.rtt,
           "loss": a.loss, "size_bytes": a.size_mib << 20, "opts": json.loads(a.opts), "runs": []}
    with WanLink(rate_mbit=a.rate, rtt_ms=a.rtt, loss=a.loss) as wan:
        res["measured_rtt_ms"] = measure_rtt(wan) * 1000
        res["plain_tcp_stream_mbit"] = measure_rate(wan, min(a.size_mib, 64) << 20) / 1e6
        print(f"link: {a.rate} Mbit/s, RTT {res['measured_rtt_ms']:.1f} ms measured, loss {a.loss}; "
              f"one plain TCP stream {res['plain_tcp_stream_mbit']:.0f} Mbit/s", flush=True)
        for cc in a.congestion:
            for n in a.streams:
                for _ in range(a.repeat):
                    opts = {**json.loads(a.opts), "streams": n, **({"congestion": cc} if cc else {})}
                    run = {"congestion": cc or "system", "streams": n}
                    if not a.no_baseline:
                        plain = measure_rate(wan, a.size_mib << 20, n, cc) / 1e6
                        run.update(plain_mbit=plain, plain_fraction_of_link=plain / a.rate)
                    t0, cpu0 = time.time(), wan.delay_cpu()
                    r = transfer(wan, a.size_mib << 20, opts=opts)
                    run.update(mbit=r["mbit"], fraction_of_link=r["mbit"] / a.rate, exact=r["exact"],
                               wall_s=time.time() - t0, delay_line_cpu_s=wan.delay_cpu() - cpu0)
                    if "plain_mbit" in run:
                        run["vs_plain"] = r["mbit"] / run["plain_mbit"]
                    res["runs"].append(run)
                    print(json.dumps(run), flush=True)
        res["delay_line"] = None
    res["delay_line"] = wan.delay_stats
    res["load_avg_after"] = os.getloadavg()[0]
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)

