"""`wsync bench sync`: publish -> live on a subscriber, end to end, full weights vs delta.

The trainer side publishes consecutive RL snapshots (the realistic bf16 series
of wsync/bench/snapshots.py, or any folder of checkpoints); a subscriber runs in
its own process (inside a network namespace when the link is an emulated WAN)
and reports the moment each version is committed. Latency of a version is
commit time minus publish() time, both on the host's CLOCK_MONOTONIC, which
namespaces share. Each mode (raw every version vs delta) runs the same versions
through the same link in the same run, so the ratio is what to read.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

MODES = {"full": dict(codec="raw"), "delta": dict(codec="delta", tier="packed"),
         "delta-sparse": dict(codec="delta", tier="sparse")}


def subscriber_main(argv=None) -> None:
    """Child process: follow ADDRESS into a host-memory engine; print one JSON line per committed version."""
    from .. import engines
    from ..sync import Subscriber

    address, token, last = argv or sys.argv[1:4]
    eng = engines.Shadow()
    sub = Subscriber(address, engine=eng, token=token or None)
    print(json.dumps({"ready": True}), flush=True)
    v = -1
    while v != int(last):
        v = sub.wait_for(v + 1, timeout=600)
        now = time.monotonic()
        stats = sub.stats["last"]
        print(json.dumps({"version": v, "t": now, "bytes": stats["bytes"], "apply_s": stats["apply_s"],
                          "digest": eng.digest()}), flush=True)
    sub.close()


def run_mode(mode: str, states: list, *, listen: str, netns: str | None = None, token: str = "wsync-bench",
             bucket_bytes: int = 16 << 20) -> dict:
    """Publish states[0] (warm-up keyframe, not timed) then each later state; time each to commit."""
    from ..snapshot import digest
    from ..sync import Publisher

    pub = Publisher(listen, token=token, bucket_bytes=bucket_bytes, keyframe_every=0, **MODES[mode])
    cmd = [sys.executable, "-c", "from wsync.bench.sync import subscriber_main; subscriber_main()",
           pub.address, token, str(len(states) - 1)]
    if netns:
        cmd = ["ip", "netns", "exec", netns] + cmd
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                          os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    try:
        _expect(child, "ready")
        pub.wait_for_subscribers(1, timeout=60)
        rows = []
        for v, state in enumerate(states):
            t0 = time.monotonic()
            pub.publish(state, version=v)
            msg = _expect(child, "version")
            if msg["version"] != v or msg["digest"] != digest(state):
                raise RuntimeError(f"{mode}: subscriber holds {msg['version']} with digest {msg['digest']}, "
                                   f"expected version {v} digest {digest(state)}")
            if v:
                rows.append({"version": v, "latency_s": msg["t"] - t0, "bytes": msg["bytes"],
                             "apply_s": msg["apply_s"], "encode_s": pub.stats["encode_s"].get(v)})
        return {"mode": mode, "versions": rows,
                "mean_latency_s": sum(r["latency_s"] for r in rows) / len(rows),
                "mean_bytes": sum(r["bytes"] for r in rows) / len(rows)}
    finally:
        child.kill()
        child.wait()
        pub.close()


def _expect(child, key: str) -> dict:
    line = child.stdout.readline()
    if not line:
        raise RuntimeError(f"subscriber process exited (code {child.poll()}) before reporting {key}")
    msg = json.loads(line)
    if key not in msg:
        raise RuntimeError(f"subscriber said {msg}, expected {key}")
    return msg


def load_states(a) -> tuple[list, str]:
    from ..checkpoint import read_checkpoint

    if a.src:
        from ..serve import find_versions

        paths = [p for _, p in find_versions(a.src)][: a.versions + 1]
        return [read_checkpoint(p).state for p in paths], str(a.src)
    from .snapshots import SnapshotConfig, ensure_snapshots

    paths = ensure_snapshots(None, SnapshotConfig(size=a.size, lr=a.lr))[: a.versions + 1]
    return [read_checkpoint(p).state for p in paths], f"generated {a.size} snapshots, lr {a.lr:g}"


def main(a) -> None:
    from .hardware import describe, one_line

    states, source = load_states(a)
    model_bytes = sum(tb.nbytes for tb in states[0].values())
    link = {"kind": "loopback"}
    results = []
    if a.wan:
        from .wan import WanLink

        rate, rtt, loss = (float(x) for x in a.wan.split(","))
        with WanLink(rate_mbit=rate, rtt_ms=rtt, loss=loss) as wan:
            link = {"kind": "wan", "rate_mbit": rate, "rtt_ms": rtt, "loss": loss}
            for mode in a.modes:
                results.append(_run_wan(mode, states, wan, a))
    else:
        for mode in a.modes:
            results.append(run_mode(mode, states, listen="tcp://127.0.0.1:0", bucket_bytes=a.bucket_bytes))
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


def _run_wan(mode, states, wan, a) -> dict:
    return run_mode(mode, states, listen=f"tcp://{wan.server_ip}:0", netns=wan.client_ns,
                    bucket_bytes=a.bucket_bytes)


def add_parsers(bench) -> None:
    p = bench.add_parser("sync", help="end-to-end publish -> live on a subscriber, full vs delta")
    p.add_argument("--src", type=Path, help="folder of checkpoints (default: generated RL snapshots)")
    p.add_argument("--size", default="small", choices=["tiny", "small", "bench"])
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--versions", type=int, default=4, help="timed versions after the warm-up keyframe")
    p.add_argument("--modes", nargs="+", default=["full", "delta"], choices=list(MODES))
    p.add_argument("--bucket-bytes", type=int, default=16 << 20)
    p.add_argument("--wan", help="RATE_MBIT,RTT_MS,LOSS: run across an emulated WAN between network namespaces")
    p.add_argument("--json", type=Path)
    p.set_defaults(fn=main)
