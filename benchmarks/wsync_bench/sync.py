"""`wsync bench sync`: publish -> live on a subscriber, end to end, full weights vs delta.

The trainer side publishes consecutive RL snapshots (the realistic bf16 series
of benchmarks/wsync_bench/snapshots.py, or any folder of checkpoints); a subscriber runs in
its own process (inside a network namespace when the link is an emulated WAN)
and reports the moment each version is committed. Latency of a version is
commit time minus publish() time, both on the host's CLOCK_MONOTONIC, which
namespaces share. Each mode (raw every version vs delta) runs the same versions
through the same link in the same run, so the ratio is what to read.
"""
from __future__ import annotations

import json
import secrets
import os
import subprocess
import sys
import time
from pathlib import Path

MODES = {"full": dict(codec="raw"), "delta": dict(codec="delta", tier="packed"),
         # the delta path before the mirror (mirror.py): publish() copies the state, the encoder reads the copy
         "delta-copied": dict(codec="delta", tier="packed", live=False),
         "delta-sparse": dict(codec="delta", tier="sparse")}


def subscriber_main(argv=None) -> None:
    """Child process: follow ADDRESS into a host-memory engine; print one JSON line per committed version."""
    from wsync import engines
    from wsync.subscriber import Subscriber

    address, token, last = argv or sys.argv[1:4]
    eng = engines.Shadow()
    arrivals: dict[int, list[float]] = {}  # version -> [first bucket, last bucket] arrival times

    def progress(version, bucket, count, nbytes):
        arrivals.setdefault(version, [time.monotonic(), 0.0])[1] = time.monotonic()

    sub = Subscriber(address, engine=eng, token=token or None, progress=progress)
    print(json.dumps({"ready": True}), flush=True)
    v = -1
    while v != int(last):
        v = sub.wait_for(v + 1, timeout=600)
        now = time.monotonic()
        committed = sub.stats.last
        first, last_bucket = arrivals.get(v, [now, now])
        print(json.dumps({"version": v, "t": now, "first_bucket_t": first, "last_bucket_t": last_bucket,
                          "bytes": committed.bytes, "apply_s": committed.apply_s, "digest": eng.digest()}),
              flush=True)
    sub.close()


def publisher_main(argv=None) -> None:
    """Child process: load the checkpoints, listen, then publish version N whenever N arrives on stdin."""
    from wsync.checkpoint import read_checkpoint
    from wsync.snapshot import digest
    from wsync.sync import Publisher

    listen, token, mode, bucket_bytes, *paths = argv or sys.argv[1:]
    states = [read_checkpoint(p).state for p in paths]
    pub = Publisher(listen, token=token, bucket_bytes=int(bucket_bytes), keyframe_every=0, **MODES[mode])
    print(json.dumps({"address": pub.address, "digests": [digest(s) for s in states]}), flush=True)
    pub.wait_for_subscribers(1, timeout=120)
    for line in sys.stdin:
        v = int(line)
        t0 = time.monotonic()
        pub.publish(states[v], version=v)
        print(json.dumps({"published": v, "t": t0, "snapshot_s": time.monotonic() - t0}), flush=True)
        pub.flush(timeout=600)
        print(json.dumps({"encode_s": pub.stats.encode_s.get(v)}), flush=True)
    pub.close()


def run_mode(mode: str, paths: list, *, listen: str = "tcp://127.0.0.1:0", wan=None, token: str | None = None,
             bucket_bytes: int = 16 << 20) -> dict:
    """Publish version 0 (warm-up keyframe, not timed) then each later one; time each from publish to commit."""
    token = token or secrets.token_hex(16)  # a fresh one per run (tokens.py: at least 16 bytes)
    pub = _spawn(wan, "a", "publisher_main", listen, token, mode, str(bucket_bytes), *map(str, paths))
    sub = None
    try:
        hello = _expect(pub, "address")
        sub = _spawn(wan, "b", "subscriber_main", hello["address"], token, str(len(paths) - 1))
        _expect(sub, "ready")
        rows = []
        for v in range(len(paths)):
            pub.stdin.write(f"{v}\n")
            pub.stdin.flush()
            published = _expect(pub, "published")
            t0 = published["t"]
            got = _expect(sub, "version")
            enc = _expect(pub, "encode_s")["encode_s"]
            if got["version"] != v or got["digest"] != hello["digests"][v]:
                raise RuntimeError(f"{mode}: subscriber holds version {got['version']} digest {got['digest']}, "
                                   f"expected version {v} digest {hello['digests'][v]}")
            if v:
                rows.append({"version": v, "latency_s": got["t"] - t0, "bytes": got["bytes"],
                             "first_bucket_s": got["first_bucket_t"] - t0, "last_bucket_s": got["last_bucket_t"] - t0,
                             "snapshot_s": published["snapshot_s"], "apply_s": got["apply_s"], "encode_s": enc})
        return {"mode": mode, "versions": rows, "exact": True,
                "mean_latency_s": sum(r["latency_s"] for r in rows) / len(rows),
                "mean_bytes": sum(r["bytes"] for r in rows) / len(rows)}
    finally:
        for p in (pub, sub):
            if p is not None:
                p.kill()
                p.wait()


def _spawn(wan, side: str, fn: str, *args: str):
    code = f"from wsync_bench.sync import {fn}; {fn}()"
    if wan is not None:
        return wan.python(side, "-c", code, *args, stderr=None)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                          os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)


def _expect(child, key: str) -> dict:
    line = child.stdout.readline()
    if not line:
        raise RuntimeError(f"benchmark process exited (code {child.poll()}) before reporting {key}")
    msg = json.loads(line)
    if key not in msg:
        raise RuntimeError(f"benchmark process said {msg}, expected {key}")
    return msg


def load_paths(a) -> tuple[list, str]:
    if a.src:
        from wsync.serve import find_versions

        return [p for _, p in find_versions(a.src)][: a.versions + 1], str(a.src)
    from .snapshots import SnapshotConfig, ensure_snapshots, require_generator

    cfg = SnapshotConfig(size=a.size, lr=a.lr)
    require_generator([cfg], instead="publish a folder of checkpoints of yours with --src")
    paths = ensure_snapshots(None, cfg)[: a.versions + 1]
    return paths, f"generated {a.size} snapshots, lr {a.lr:g}"


def main(a) -> None:
    from wsync.hardware import describe

    from .results import one_line

    from wsync.checkpoint import read_checkpoint

    paths, source = load_paths(a)
    model_bytes = sum(tb.nbytes for tb in read_checkpoint(paths[0]).state.values())
    link = {"kind": "loopback"}
    results = []
    if a.wan:
        from .wan import WanLink

        rate, rtt, loss = (float(x) for x in a.wan.split(","))
        with WanLink(rate_mbit=rate, rtt_ms=rtt, loss=loss) as wan:
            link = {"kind": "wan", "rate_mbit": rate, "rtt_ms": rtt, "loss": loss}
            for mode in a.modes:
                results.append(run_mode(mode, paths, listen=f"tcp://{wan.ip_a}:0", wan=wan,
                                        bucket_bytes=a.bucket_bytes))
    else:
        for mode in a.modes:
            results.append(run_mode(mode, paths, bucket_bytes=a.bucket_bytes))
    run = {"hardware": describe(), "source": source, "model_bytes": model_bytes, "link": link, "results": results}
    base = next((r for r in results if r["mode"] == "full"), None)
    print(f"# wsync bench sync: {source}, {model_bytes / 1e6:.1f} MB model, link {link}, {one_line(run['hardware'])}")
    print(f"{'mode':<14}{'latency s':>12}{'wire MB':>10}{'vs full':>10}")
    for r in results:
        ratio = base["mean_latency_s"] / r["mean_latency_s"] if base else float("nan")
        r["speedup_vs_full"] = ratio
        print(f"{r['mode']:<14}{r['mean_latency_s']:>12.3f}{r['mean_bytes'] / 1e6:>10.2f}{ratio:>9.1f}x")
    if a.json:
        Path(a.json).write_text(json.dumps(run, indent=2))


def add_parsers(bench) -> None:
    p = bench.add_parser("sync", help="end-to-end publish -> live on a subscriber, full vs delta",
                         epilog="Sizes (2 cores here): default small, ~1 min the first time (generating its "
                                "snapshots), ~5 s after; tiny: seconds; bench: ~15 min the first time (about 2 GB of "
                                "snapshots); --wan adds the emulated link's transfer times.")
    p.add_argument("--src", type=Path, help="folder of checkpoints (default: generated RL snapshots)")
    p.add_argument("--size", default="small", choices=["tiny", "small", "bench"],
                   help="generated snapshot model size (default: small)")
    p.add_argument("--lr", type=float, default=1e-6, help="learning rate of the generated snapshots (default: 1e-6)")
    p.add_argument("--versions", type=int, default=12, help="timed versions after the warm-up keyframe")
    p.add_argument("--modes", nargs="+", default=["full", "delta"], choices=list(MODES),
                   help="what to move per version, side by side (default: full delta)")
    p.add_argument("--bucket-bytes", type=int, default=16 << 20,
                   help="publisher bucket size in bytes (default: 16 MiB)")
    p.add_argument("--wan", help="RATE_MBIT,RTT_MS,LOSS: run across an emulated WAN between network namespaces")
    p.add_argument("--json", type=Path, help="also write the results to this JSON file")
    p.set_defaults(fn=main)
