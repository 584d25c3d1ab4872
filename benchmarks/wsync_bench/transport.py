"""`wsync bench transport`: one message of SIZE bytes through our transport, beside a raw baseline.

Two worker processes (a sender and a receiver, started fresh with
``python -m wsync_bench.transport``) run the raw baseline and our Link in
turns, ``repeats`` times each after a warm-up. The receiver times each move
(from its "ready" byte on a side socket to the last byte in hand, checksum
checks included for our Link, as a caller would see it) and checks every
received buffer against the sender's xxh3-64. Results are ratios against the
baseline of the same run, with the hardware named. nccl needs two CUDA GPUs
(one per worker); where they are missing, run() raises BackendUnavailable with
the reason ``bench all`` prints beside its skipped row (the CLI exits 3).
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time

TRANSPORTS = ("tcp", "ucx", "gloo", "nccl", "local")


def add_parsers(subparsers) -> None:
    p = subparsers.add_parser("transport", help="GB/s of one message through a transport vs a raw baseline",
                              epilog="Default --size 256M: about 5 s here over tcp (2 cores); --size 1G: about four "
                                     "times that. wsync bench tcp measures MAC and TLS links too.")
    p.add_argument("--transport", required=True, choices=TRANSPORTS,
                   help="the link to measure (nccl needs two CUDA GPUs; without them this exits 3)")
    p.add_argument("--size", default="256M", help="message bytes, e.g. 1048576, 256M, 1G (default 256M)")
    p.add_argument("--streams", type=int, default=1, help="tcp: parallel streams (the baseline uses as many sockets)")
    p.add_argument("--chunk", default="64M", help="gloo/nccl: bytes per collective (default 64M)")
    p.add_argument("--repeats", type=int, default=5, help="timed moves of each kind after one warm-up (default 5)")
    p.add_argument("--json", metavar="OUT", help="also write the result as JSON here")
    p.set_defaults(fn=_cli)


def _cli(a) -> None:
    from wsync.transports.options import parse_size

    res = run(a.transport, parse_size(a.size), streams=a.streams, repeats=a.repeats, chunk=parse_size(a.chunk))
    print(report(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


def run(transport: str, size: int, *, streams: int = 1, repeats: int = 5, chunk: int = 64 << 20, timeout: float = 600) -> dict:
    """Run both workers and collect their timings; raises WsyncError if any received byte was wrong."""
    from wsync.errors import TransportError
    from wsync.hardware import describe

    if transport not in TRANSPORTS or size < 1 or repeats < 1 or streams < 1:
        raise ValueError(f"need --transport in {TRANSPORTS}, --size >= 1, --repeats >= 1 and --streams >= 1")
    why = nccl_unavailable() if transport == "nccl" else ucx_unavailable() if transport == "ucx" else None
    if why:
        from wsync.errors import BackendUnavailable

        raise BackendUnavailable(f"bench transport {transport} skipped, {why}")
    with tempfile.TemporaryDirectory(prefix="wsync-bench-") as tmp:
        spec = {"transport": transport, "size": size, "streams": streams, "repeats": repeats, "chunk": chunk,
                "side_port": free_port(), "port": free_port(), "raw_port": free_port(), "seed": 7,
                "token": secrets.token_hex(16), "name": f"bench-{secrets.token_hex(4)}", "raw_path": os.path.join(tmp, "raw.sock")}
        procs = {role: _spawn(role, spec) for role in ("recv", "send")}
        outs = {}
        try:
            for role, p in procs.items():
                outs[role] = p.communicate(timeout=timeout)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
    failed = [role for role, p in procs.items() if p.returncode != 0]
    if failed:
        why = "; ".join(f"{r} worker (exit {procs[r].returncode}): {outs.get(r, ('', ''))[1].strip()[-1500:]}" for r in procs)
        raise TransportError(f"bench {' and '.join(failed)} worker failed. {why}")
    rows = [json.loads(line) for line in outs["recv"][0].splitlines() if line.startswith("{")]
    _check_rows(rows)
    return _summarise(spec, rows, describe())


def ucx_unavailable() -> str | None:
    """Why the ucx bench cannot run here, in one line (None: it can). Checked before the workers start:
    without ucxx each of them would end in a traceback of its own."""
    try:
        import ucxx  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means no ucx here
        return f"ucxx does not import ({type(e).__name__}: {e}); pip install -e \".[ucx]\" (ucxx-cu12)"
    return None


def nccl_unavailable() -> str | None:
    """Why the nccl bench cannot run here, in one line (None: it can). Checked before the workers start:
    without NCCL or a second GPU they would fail deep in torch.distributed, with two tracebacks."""
    try:
        import torch
        import torch.distributed as dist
    except Exception as e:  # noqa: BLE001 - any import failure means no nccl here
        return f"needs two CUDA GPUs (torch does not import: {type(e).__name__})"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nccl = dist.is_available() and dist.is_nccl_available()
    if gpus >= 2 and nccl:
        return None
    return f"needs two CUDA GPUs (this machine: {gpus}" + ("" if nccl else ", and this torch has no NCCL") + ")"


def _check_rows(rows: list[dict]) -> None:
    from wsync.errors import TransportError

    bad = [r for r in rows if not r["ok"]]
    if bad:
        raise TransportError(f"{len(bad)} moves delivered wrong bytes, e.g. {bad[0]}")


def _summarise(spec: dict, rows: list[dict], hw: dict) -> dict:
    out = {"transport": spec["transport"], "size": spec["size"], "streams": spec["streams"], "chunk": spec["chunk"],
           "repeats": spec["repeats"], "hardware": hw, "checked": "xxh3-64 of every received buffer", "runs": {}}
    for kind in ("raw", "ours"):
        secs = [r["seconds"] for r in rows if r["kind"] == kind and not r["warmup"]]
        gbps = [spec["size"] / s / 1e9 for s in secs]
        out["runs"][kind] = {"seconds": secs, "gbps_median": statistics.median(gbps), "gbps_best": max(gbps)}
    out["ratio_median"] = out["runs"]["ours"]["gbps_median"] / out["runs"]["raw"]["gbps_median"]
    out["ratio_best"] = out["runs"]["ours"]["gbps_best"] / out["runs"]["raw"]["gbps_best"]
    return out


def report(res: dict) -> str:
    from .results import one_line

    raw, ours = res["runs"]["raw"], res["runs"]["ours"]
    extra = f", {res['streams']} streams" if res["transport"] == "tcp" else ""
    return (f"{res['transport']}: {res['size']:,} bytes{extra}, {res['repeats']} repeats, every byte checked\n"
            f"  raw baseline  {raw['gbps_median']:.2f} GB/s median, {raw['gbps_best']:.2f} best\n"
            f"  wsync link    {ours['gbps_median']:.2f} GB/s median, {ours['gbps_best']:.2f} best\n"
            f"  ratio         {res['ratio_median']:.1%} median, {res['ratio_best']:.1%} best\n"
            f"  on {one_line(res['hardware'])}")


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(role: str, spec: dict) -> subprocess.Popen:
    env = {**os.environ, "UCX_TLS": os.environ.get("UCX_TLS", "tcp,sm,self")} if spec["transport"] == "ucx" else None
    return subprocess.Popen([sys.executable, "-m", "wsync_bench.transport", role, json.dumps(spec)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


# -- inside a worker process ------------------------------------------------------------


def payload(size: int, seed: int):
    """Incompressible-looking bytes, cheap to make: a random MiB tiled, each copy stamped with its index."""
    import numpy as np

    block = np.random.default_rng(seed).integers(0, 256, 1 << 20, dtype=np.uint8)
    out = np.empty(size, dtype=np.uint8)
    n = size >> 20
    rows = out[: n << 20].reshape(n, 1 << 20)
    rows[:] = block
    rows[:, :8] = np.arange(n, dtype=np.uint64).view(np.uint8).reshape(n, 8)
    out[n << 20:] = block[: size - (n << 20)]
    return out


def worker(role: str, spec: dict) -> None:
    import xxhash

    from .transport_pairs import make

    side = _side_channel(role, spec["side_port"])
    data = payload(spec["size"], spec["seed"]) if role == "send" else None
    if role == "send":
        side.sendall(xxhash.xxh3_64_digest(data))
        expected = None
    else:
        expected = _recv_n(side, 8)
    pair = make(spec["transport"], role, spec)
    for rep in range(1 + spec["repeats"]):
        for kind in ("raw", "ours"):
            move = pair.raw if kind == "raw" else pair.ours
            if role == "send":
                _recv_n(side, 1)  # the receiver is ready
                move(data)
                continue
            side.sendall(b"R")
            t0 = time.perf_counter()
            got = move(None)
            dt = time.perf_counter() - t0
            ok = len(memoryview(got).cast("B")) == spec["size"] and xxhash.xxh3_64_digest(got) == expected
            del got  # let our link recycle the buffer, as a subscriber does after applying
            print(json.dumps({"kind": kind, "rep": rep, "warmup": rep == 0, "seconds": dt, "ok": ok}), flush=True)
    # The sender closes only once everything arrived: a send may complete locally while bytes are in flight.
    side.sendall(b"D") if role == "recv" else _recv_n(side, 1)
    pair.close()
    side.close()


def _side_channel(role: str, port: int) -> socket.socket:
    if role == "recv":
        srv = socket.create_server(("127.0.0.1", port))
        s = srv.accept()[0]
        srv.close()
        return s
    deadline = time.monotonic() + 60
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port))
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _recv_n(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        more = sock.recv(n - len(buf))
        if not more:
            raise ConnectionError("bench peer went away")
        buf += more
    return buf


if __name__ == "__main__":
    worker(sys.argv[1], json.loads(sys.argv[2]))
