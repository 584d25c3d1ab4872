"""`wsync bench reshard`: sharded trainer ranks into tensor-parallel engine ranks, point to point vs rank-0 funnel.

    wsync bench reshard [--size small|bench] [--trainers 4 --engines 2 --layers 4 --hidden 768 ...] [--json OUT]

Two paths move the same versions of the same model (a Qwen3-shaped state,
FSDP2 Shard(0) over the trainer ranks, vLLM's TP layout over the engine ranks), in one run,
each in its own processes (rank processes: reshard_ranks.py; tcp loopback, or --transport gloo|ucx|local):

- **sharded**: each trainer rank publishes its pieces straight to the engine
  ranks that need them (wsync.shard), and every engine rank commits together;
- **gather**: the funnel most frameworks run today: a gloo gather of every
  shard to trainer rank 0, which publishes the full state with one Publisher
  to every engine rank; each engine rank slices what it needs.

Each in two modes: **full** (every version raw) and **delta** (a keyframe,
then deltas of `density` changed values). Per version: bytes through the
busiest rank (sent plus received, trainer or engine) against the total moved,
and publish -> committed time (the first trainer's publish() to the last
engine rank's tensors written). Reported as ratios sharded/gather and against
the issue's targets (busiest <= 1.1/min(M, N) of the total; time <= 0.6x the
gather path; delta <= 2% of full bytes). Both paths end each version with the
same bytes on every engine rank (checked: xxh3 of each rank's tensors).
"""
from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import statistics
from pathlib import Path

from wsync.hardware import describe

from .transport import free_port

# --size: "small" is a smoke test of both paths, "bench" the 100 MB model the committed runs used
SIZES = {"small": {"layers": 2, "hidden": 256, "inter": 512, "vocab": 4096, "heads": 4, "kv_heads": 2, "head_dim": 64},
         "bench": {"layers": 4, "hidden": 768, "inter": 2048, "vocab": 16384, "heads": 12, "kv_heads": 4,
                   "head_dim": 64}}


class _Ranks:
    """The trainer and engine rank processes, and the pipes that drive them."""

    def __init__(self, spec: dict):
        from .reshard_ranks import engine_main, trainer_main

        ctx, port = mp.get_context("spawn"), free_port()
        self.t, self.e, self.procs = [], [], []
        for rank in range(spec["m"]):
            a, b = ctx.Pipe()
            self.procs.append(ctx.Process(target=trainer_main, args=(rank, spec, b, port), daemon=True))
            self.t.append(a)
        for rank in range(spec["n"]):
            a, b = ctx.Pipe()
            self.procs.append(ctx.Process(target=engine_main, args=(rank, spec, b), daemon=True))
            self.e.append(a)
        for p in self.procs:
            p.start()

    def ask(self, conns, *cmd) -> list:
        for c in conns:
            c.send(cmd)
        return [self.recv(c) for c in conns]

    def recv(self, conn, timeout: float = 600.0):
        """A rank's reply; a rank that died (its traceback is on stderr) ends the run instead of hanging it."""
        waited = 0.0
        while not conn.poll(1.0):
            waited += 1.0
            dead = [p.name for p in self.procs if not p.is_alive()]
            if dead or waited > timeout:
                raise RuntimeError(f"bench reshard: rank processes {dead or 'alive'} gave no reply to a command")
        return conn.recv()

    def close(self) -> None:
        for c in self.t + self.e:
            c.send(("exit",))
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def _path(ranks: _Ranks, path: str, codec: str, versions: int) -> list[dict]:
    """One path in one mode: versions 0..versions (0 warms up, and is the keyframe of a delta run)."""
    if path == "sharded":
        addr = ranks.ask(ranks.t[:1], "sharded", codec, None)[0]
        ranks.ask(ranks.t[1:], "sharded", codec, addr)
    else:
        addr = ranks.ask(ranks.t, "gather", codec)[0]
    ranks.ask(ranks.e, path, addr)
    rows, before = [], [0] * len(ranks.e)
    for v in range(versions + 1):
        for c in ranks.t:
            c.send(("publish", v))
        ends = ranks.ask(ranks.e, "await", v)
        starts = [ranks.recv(c) for c in ranks.t]
        got = [b - before[r] for r, (_, _, b) in enumerate(ends)]
        before = [b for _, _, b in ends]
        rows.append({"version": v, "seconds": max(t for t, _, _ in ends) - min(t for t, _ in starts),
                     "digests": [d for _, d, _ in ends], "received": got, "gathered": starts[0][1]})
    sent = ranks.ask(ranks.t, "bytes")
    for row in rows:
        row["sent"] = [s.get(row["version"]) or 0 for s in sent]
    # engine ranks first: a coordinator that leaves before its members is a lost link they warn of and redial
    ranks.ask(ranks.e, "stop")
    ranks.ask(ranks.t, "stop")
    return rows


def _traffic(rows: list[dict], path: str, n: int) -> list[dict]:
    """Bytes per rank per version: sent + received, for every trainer and engine rank."""
    out = []
    for row in rows:
        if path == "sharded":
            ranks = row["sent"] + row["received"]
            total = sum(row["sent"])
        else:  # rank 0 received the gather and sent the version to every engine rank
            to_engines = n * row["sent"][0]
            ranks = [row["gathered"] + to_engines] + [row["gathered"] // max(1, len(row["sent"]) - 1)] * \
                (len(row["sent"]) - 1) + row["received"]
            total = row["gathered"] + to_engines
        out.append({"version": row["version"], "seconds": row["seconds"], "busiest": max(ranks), "total": total})
    return out


def run(m: int = 4, n: int = 2, dims: dict | None = None, density: float = 0.01, full_versions: int = 3,
        delta_versions: int = 5, transport: str = "tcp") -> dict:
    spec = {"m": m, "n": n, "dims": dims or SIZES["bench"], "density": density, "transport": transport}
    from .reshard_ranks import make_plan

    plan = make_plan(spec)
    model_bytes = sum(2 * _numel(p.shape) for p in plan.trainer.params.values())
    ranks = _Ranks(spec)
    res = {"kind": "wsync bench reshard", "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "hardware": describe(), "trainer_ranks": m, "engine_ranks": n, "dims": spec["dims"],
           "transport": transport,
           "density": density, "model_bytes": model_bytes, "plan_bytes_by_trainer": plan.bytes_by_trainer(),
           "plan_bytes_by_engine": plan.bytes_by_engine(), "modes": {}}
    try:
        for mode, codec, versions in (("full", "raw", full_versions), ("delta", "delta", delta_versions)):
            lanes = {path: _path(ranks, path, codec, versions) for path in ("sharded", "gather")}
            same = all(a["digests"] == b["digests"] for a, b in zip(lanes["sharded"], lanes["gather"]))
            res["modes"][mode] = _summary({p: _traffic(r, p, n)[1:] for p, r in lanes.items()}, m, n, same)
    finally:
        ranks.close()
    d, f = res["modes"]["delta"]["sharded"], res["modes"]["full"]["sharded"]
    res["delta_vs_full_bytes"] = d["total_bytes"] / f["total_bytes"]
    return res


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _summary(lanes: dict, m: int, n: int, same: bool) -> dict:
    out = {"same_bytes_on_every_engine_rank": same}
    for path, rows in lanes.items():
        out[path] = {"seconds_median": statistics.median(r["seconds"] for r in rows),
                     "busiest_bytes": statistics.median(r["busiest"] for r in rows),
                     "total_bytes": statistics.median(r["total"] for r in rows)}
        out[path]["busiest_share"] = out[path]["busiest_bytes"] / out[path]["total_bytes"]
    s, g = out["sharded"], out["gather"]
    out["time_vs_gather"] = s["seconds_median"] / g["seconds_median"]
    out["busiest_vs_gather"] = s["busiest_bytes"] / g["busiest_bytes"]
    out["busiest_target"] = 1.1 / min(m, n)
    return out


def render(res: dict) -> str:
    mb = res["model_bytes"] / 1e6
    lines = [f"{res['trainer_ranks']} trainer ranks (FSDP2 Shard(0)) -> {res['engine_ranks']} engine ranks (vLLM TP), "
             f"Qwen3-shaped {mb:.1f} MB bf16, {res['density']:.0%} changed per version, "
             f"{res.get('transport', 'tcp')} on loopback; "
             f"{res['hardware'].get('cpu')}, {res['hardware'].get('cores')} cores", "",
             "| mode | path | publish -> committed | vs gather | busiest rank | share of total (target) | total |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for mode, r in res["modes"].items():
        for path in ("sharded", "gather"):
            p = r[path]
            vs = f"{r['time_vs_gather']:.2f}x" if path == "sharded" else "1x"
            target = f" (<= {r['busiest_target']:.2f})" if path == "sharded" else ""
            lines.append(f"| {mode} | {path} | {p['seconds_median'] * 1e3:.0f} ms | {vs} | "
                         f"{p['busiest_bytes'] / 1e6:.2f} MB | {p['busiest_share']:.2f}{target} | "
                         f"{p['total_bytes'] / 1e6:.2f} MB |")
    lines += ["", f"delta versions move {res['delta_vs_full_bytes']:.2%} of a full version's bytes (target <= 2%); "
              "engine ranks hold the same bytes on both paths: "
              + str(all(r["same_bytes_on_every_engine_rank"] for r in res["modes"].values()))]
    return "\n".join(lines)


def main(a) -> None:
    dims = dict(SIZES[a.size])
    dims.update({k: v for k, v in (("layers", a.layers), ("hidden", a.hidden), ("vocab", a.vocab)) if v})
    res = run(a.trainers, a.engines, dims, a.density, a.full_versions, a.delta_versions, a.transport)
    print(render(res))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str) + "\n")
        print(f"wrote {a.json}")


def add_parsers(bench) -> None:
    p = bench.add_parser("reshard", help="sharded trainer ranks -> TP engine ranks: point to point vs gather to rank 0",
                         epilog="Sizes (2 cores here): --size small (the default), a tiny model, about 10 s (a smoke "
                                "test, not numbers to compare); --size bench, the 100 MB model the committed runs "
                                "used, about 30 s.")
    p.add_argument("--trainers", type=int, default=4, help="trainer ranks (FSDP2 Shard(0)), default 4")
    p.add_argument("--engines", type=int, default=2, help="engine ranks (tensor parallel), default 2")
    p.add_argument("--size", default="small", choices=list(SIZES),
                   help="model preset: small (default), a tiny model for a smoke test; bench, the 100 MB model")
    sized = lambda k: f"(default: the --size preset's, {' / '.join(f'{v[k]} {n}' for n, v in SIZES.items())})"
    p.add_argument("--layers", type=int, help=f"decoder layers {sized('layers')}")
    p.add_argument("--hidden", type=int, help=f"hidden size {sized('hidden')}")
    p.add_argument("--vocab", type=int, help=f"vocabulary {sized('vocab')}")
    p.add_argument("--density", type=float, default=0.01, help="fraction of values changed per version")
    p.add_argument("--full-versions", type=int, default=3, help="timed full versions after a warm-up one")
    p.add_argument("--delta-versions", type=int, default=5, help="timed delta versions after the keyframe")
    p.add_argument("--transport", default="tcp", choices=("tcp", "gloo", "ucx", "local"),
                   help="both paths' data links: the sharded path's (trainer, engine) pairs and the gather path's "
                        "rank-0 Publisher (gloo: a broadcast group of rank 0 and every engine rank); default tcp")
    p.add_argument("--json", type=Path, help="also write the results to this JSON file")
    p.set_defaults(fn=main)
