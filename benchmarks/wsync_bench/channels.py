"""`wsync bench channels`: how long a channel takes to roll back, or to promote, until every engine serves it.

    wsync bench channels [--size small] [--engines 8] [--steps 3] [--rounds 3] [--out DIR]
    wsync bench channels --size bench --engines 4 --out benchmarks/results   # 1 GiB of bf16

A rollback is what an operator reaches for when production misbehaves, so the
time until every engine serves the older version is the figure that matters.
The hub can send it two ways: as a reverse delta (from the release the engines
hold back to the older bytes) or as a keyframe (the whole state). Both run here
through the same steps in the same run, and their ratio is the result;
promotion, as a delta and as a keyframe, comes out of the same rounds.

A Channels hub (tcp loopback, with a token) and --engines engines following its
prod channel. The trainer's state (bf16, a dense decoder's tensors of uneven
sizes, a few hundred at the bench size; `layout`) takes RL-like steps: about 1%
of its values move by one or two representable values, as wsync_bench.many.step
makes them. Each round: a step is offered and promoted (v_old), --steps more
are offered and promoted one by one, then the channel rolls back to v_old.
Training goes on after a rollback, so a round's first promotion spans the steps
since v_old ("promote-after-rollback"); the others span one. The rounds run
twice, on two hubs that differ only in their channel publisher's codec: delta
with keyframe_every=0 (the first release is the only keyframe, the rollback is
a reverse delta), and raw (every release, the rollback too, a keyframe).

Timed: from the hub.promote() / hub.rollback() call to each engine's commit
(its on_commit, on CLOCK_MONOTONIC, which every process on the host shares);
"all live" is the last engine. Offering is not timed: a trainer offers when it
publishes, long before anyone promotes. After every release each engine's
Shadow.digest() must equal snapshot.digest of the state generated here (and the
hub's record), and the release must have reached every engine as its mode says
(delta or keyframe); anything else stops the run.

Engines run in child processes (`python -m wsync_bench.channels engine ...`):
in this process, 8 subscribers would share one interpreter lock with the hub's
encoder and its 8 senders, and the wait would partly measure that lock; as
processes they contend only for the cores. Engines on hosts of their own would
not contend at all, so on 2 cores "all live" is an upper bound (every engine's
bytes are received, checked and written by the same 2 cores), and the ratios
between the modes are what carries over to other machines.

Each engine is a Shadow whose tensors are allocated up front and written in
place, keyframes included (`Held`, which has no replace()), as engines.HF
writes into a model's own parameters; Shadow.replace would allocate a new state
at every keyframe, and the times would include that. Even so a subscriber holds
a keyframe whole before it applies it (a version is all or nothing), and more
while applying it, so an engine process needs about 3x the state at a
keyframe: 8 engines of 1 GiB do not fit in 24 GB beside the hub, whose
process holds --steps + 1 promoted versions and a new candidate, the publisher's
newest encoded release and the trainer's state. `memory_estimate` adds this up,
and the run refuses to start where that exceeds MemAvailable.
"""
from __future__ import annotations

import datetime as dt
import json
import math
import os
import queue
import secrets
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

# hidden, intermediate, key/value width, vocabulary: a dense decoder's shapes, scaled to the size
FAMILIES = {"tiny": (128, 352, 32, 4000), "small": (512, 1408, 128, 16000), "bench": (1024, 2816, 256, 32000)}
SIZES = {"tiny": 4 << 20, "small": 64 << 20, "bench": 1 << 30}
# keyframe_every=1 would not make the rollback a keyframe on the wire: a keyframe release is also kept as a delta
# from the release before, and an engine holding that one is sent the delta. A raw codec sends every release whole.
MODES = {"reverse-delta": {"keyframe_every": 0}, "keyframe": {"codec": "raw"}}
DENSITY = 0.01  # fraction of values an RL step moves (wsync_bench.many.step)
PROCESS_BYTES = 64 << 20  # a process before its weights: the interpreter, numpy, wsync
ENV = dict(os.environ, PYTHONUNBUFFERED="1", WSYNC_PROGRESS="0",
           PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))


@dataclass(kw_only=True)
class Config:
    size: str = "small"  # a key of SIZES: the state's bytes and FAMILIES shapes
    mib: int | None = None  # the state's MiB instead of SIZES[size] (the shapes stay the size's)
    engines: int = 8  # engines following the channel, each a process
    steps: int = 3  # promotions between v_old and the rollback to it
    rounds: int = 3  # rounds reported
    warmup: int = 1  # rounds run first and left out of the figures
    seed: int = 0  # the state's values and every step's: the same bytes in both modes
    timeout: float = 600.0  # seconds a release may take to reach every engine


def layout(size: str, mib: int | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a bf16 decoder of about SIZES[size] bytes (or `mib` MiB): embeddings, layers of
    attention and MLP matrices with their norms, lm_head."""
    h, inter, kv, vocab = FAMILIES[size]
    per_layer = [("self_attn.q_proj.weight", (h, h)), ("self_attn.k_proj.weight", (kv, h)),
                 ("self_attn.v_proj.weight", (kv, h)), ("self_attn.o_proj.weight", (h, h)),
                 ("mlp.gate_proj.weight", (inter, h)), ("mlp.up_proj.weight", (inter, h)),
                 ("mlp.down_proj.weight", (h, inter)), ("input_layernorm.weight", (h,)),
                 ("post_attention_layernorm.weight", (h,))]
    layer_bytes = 2 * sum(math.prod(s) for _, s in per_layer)
    outer_bytes = 2 * (2 * vocab * h + h)
    layers = max(1, round(((mib << 20 if mib else SIZES[size]) - outer_bytes) / layer_bytes))
    out = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        out += [(f"model.layers.{i}.{name}", shape) for name, shape in per_layer]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]


def state_bytes(size: str, mib: int | None = None) -> int:
    return 2 * sum(math.prod(s) for _, s in layout(size, mib))


def memory_estimate(cfg: Config) -> int:
    """Peak bytes of a run: every engine at a keyframe (its weights, the keyframe staged whole, and what applying
    it holds beside them); the hub's promoted versions and a new candidate, its publisher's newest encoded
    release and the one being encoded (the raw mode's are whole states) and a bucket per engine (a frozen
    keyframe is encoded for each subscriber, a bucket at a time); the trainer's state."""
    from wsync.sync import PublisherConfig

    s = state_bytes(cfg.size, cfg.mib)
    hub = (cfg.steps + 5) * s + cfg.engines * PublisherConfig().bucket_bytes + PROCESS_BYTES
    return cfg.engines * (3 * s + PROCESS_BYTES) + hub


def bf16_state(size: str, mib: int | None, seed: int) -> dict:
    """A fresh state: N(0, 0.02) values rounded to bf16 bit patterns (wsync_bench.many.random_bf16)."""
    from wsync.bits import TensorBits
    from wsync.dtypes import DTYPES

    from .many import random_bf16

    rng = np.random.default_rng(seed)
    return {name: TensorBits(DTYPES["BF16"], shape, random_bf16(rng, math.prod(shape)))
            for name, shape in layout(size, mib)}


def step(state: dict, rng) -> None:
    """One RL step, in place: about DENSITY of each tensor's values move by +-1 or +-2 representable values
    (wsync_bench.many.step without its copy, so the trainer holds one state however many steps it takes)."""
    for tb in state.values():
        n = tb.bits.size
        idx = rng.integers(0, n, rng.binomial(n, DENSITY))
        tb.bits[idx] = (tb.bits[idx].astype(np.int32) + rng.choice([-2, -1, 1, 2], size=len(idx))).astype(np.uint16)


class Held:
    """A Shadow whose memory every version is written into, keyframes too: without replace(), the Subscriber
    applies a keyframe in place like a delta, as an inference engine loads the weights it already holds."""

    def __init__(self, shadow):
        self.shadow, self.version = shadow, None

    def tensors(self) -> dict:
        return self.shadow.state

    def load(self, named) -> None:
        self.shadow.load(named)


def engine_main(argv: list[str]) -> None:
    """Child process: ADDRESS TOKEN_HEX SIZE MIB (0: the size's own). One JSON line per commit; a `digest` line
    on stdin asks for the engine's digest and this process's peak memory."""
    from wsync.bits import TensorBits
    from wsync.dtypes import DTYPES
    from wsync.engines import Shadow
    from wsync.subscriber import Subscriber

    address, token_hex, size, mib = argv
    zeros = {n: TensorBits(DTYPES["BF16"], s, np.zeros(math.prod(s), np.uint16))
             for n, s in layout(size, int(mib) or None)}
    engine, lock = Held(Shadow(zeros)), threading.Lock()

    def emit(msg: dict) -> None:
        with lock:  # commits are reported from the subscriber's thread, digests from this one
            print(json.dumps(msg), flush=True)

    def committed(c: dict) -> None:
        emit({"commit": c["version"], "t": time.monotonic(), "bytes": c["bytes"], "keyframe": c["keyframe"],
              "version": (c["note"] or {}).get("version"), "apply_s": c["apply_s"]})

    sub = Subscriber(address, engine=engine, token=bytes.fromhex(token_hex), on_commit=committed)
    emit({"ready": os.getpid()})
    for line in sys.stdin:
        if line.strip() == "digest":
            emit({"digest": engine.shadow.digest(), "release": sub.version,
                  "peak_rss": _proc("/proc/self/status", "VmHWM")})
    sub.close()


def _proc(path: str, key: str) -> int | None:
    """A `key: N kB` field of a /proc file, in bytes (None where there is none)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class Engines:
    """The engine processes, each read by a thread of its own into a queue, so that every wait has a deadline."""

    def __init__(self, address: str, token: bytes, cfg: Config):
        self.timeout = cfg.timeout
        argv = [sys.executable, "-m", "wsync_bench.channels", "engine", address, token.hex(), cfg.size,
                str(cfg.mib or 0)]
        self.procs = [subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV)
                      for _ in range(cfg.engines)]
        self.queues = [queue.Queue() for _ in self.procs]
        for p, q in zip(self.procs, self.queues):
            threading.Thread(target=_read_lines, args=(p, q), daemon=True).start()
        try:
            for i in range(len(self.procs)):
                self._next(i, "ready", 120.0)
        except BaseException:
            self.close()
            raise

    def commits(self, release: int) -> list[dict]:
        """Each engine's report of committing `release` (earlier commits it reports on the way are skipped)."""
        out = []
        for i in range(len(self.procs)):
            while (msg := self._next(i, "commit", self.timeout))["commit"] < release:
                pass
            if msg["commit"] != release:
                raise RuntimeError(f"engine {i} committed release {msg['commit']}, expected {release}")
            out.append(msg)
        return out

    def digests(self) -> list[dict]:
        for p in self.procs:
            p.stdin.write("digest\n")
            p.stdin.flush()
        return [self._next(i, "digest", self.timeout) for i in range(len(self.procs))]

    def _next(self, i: int, key: str, timeout: float) -> dict:
        try:
            msg = self.queues[i].get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"engine {i} said nothing for {timeout:g}s while {key!r} was awaited") from None
        if msg is None:
            raise RuntimeError(f"engine {i} exited (code {self.procs[i].poll()}) before reporting {key!r}")
        if key not in msg:
            raise RuntimeError(f"engine {i} said {msg}, expected {key!r}")
        return msg

    def close(self) -> None:
        for p in self.procs:
            try:
                p.stdin.close()
                p.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                p.kill()
                p.wait()


def _read_lines(proc, q: queue.Queue) -> None:
    for line in proc.stdout:
        q.put(json.loads(line))
    q.put(None)


def run_mode(mode: str, cfg: Config) -> dict:
    """The rounds on a hub whose channel publisher is configured for `mode`; every release timed and checked."""
    from wsync.channels import Channels
    from wsync.snapshot import digest

    token = secrets.token_bytes(16)  # a fresh one per run (tokens.py: at least 16 bytes)
    rng = np.random.default_rng(cfg.seed + 1)  # the steps: the same in both modes
    trainer = bf16_state(cfg.size, cfg.mib, cfg.seed)
    # every engine is caught up before the next release, so catch-up history beyond the newest release is never
    # read; the default (two whole states in the raw mode) would only take memory from the engines
    opts = {**MODES[mode], "history_bytes": state_bytes(cfg.size, cfg.mib)}
    ops, peak = [], 0
    with Channels(("prod",), token=token, keep=cfg.steps + 1, candidates=1, **opts) as hub:
        pool = Engines(hub.address("prod"), token, cfg)
        try:
            _wait_joined(hub, cfg.engines)
            served, version = 0, 0

            def release(kind: str, rnd: int, do, want: str, span: int) -> None:
                nonlocal peak
                op = _timed(pool, do, want, mode)
                peak = max(peak, op.pop("peak_rss"))
                ops.append({"kind": kind, "round": rnd, "span_steps": span, **op})

            def promote(rnd: int) -> str:
                nonlocal served, version
                if version:
                    step(trainer, rng)
                want = digest(trainer)
                hub.offer(trainer, version)
                span = version - served
                kind = "initial" if rnd < 0 else "promote" if span == 1 else "promote-after-rollback"
                release(kind, rnd, lambda v=version: hub.promote(v, why="bench"), want, span)
                served, version = version, version + 1
                return want

            promote(-1)  # release 0: the first keyframe, in both modes
            for rnd in range(cfg.warmup + cfg.rounds):
                v_old, old = version, promote(rnd)
                for _ in range(cfg.steps):
                    promote(rnd)
                release("rollback", rnd, lambda v=v_old: hub.rollback(to=v, why="bench"), old, served - v_old)
                served = v_old
        finally:
            pool.close()
    return {"mode": mode, "publisher_opts": opts, "ops": ops, "engine_peak_rss": peak}


def _wait_joined(hub, n: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while (have := hub.status()["channels"]["prod"]["subscribers"]) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{have} of {n} engines connected to the channel after {timeout:g}s")
        time.sleep(0.05)


def _timed(pool: Engines, do, want: str, mode: str) -> dict:
    """Run `do` (a promote or a rollback), wait for every engine to commit its release, check their bytes."""
    t0 = time.monotonic()
    rec = do()
    call_s = time.monotonic() - t0
    got = pool.commits(rec.release)
    held = pool.digests()
    wrong = [i for i, h in enumerate(held) if h["digest"] != want or h["release"] != rec.release]
    if wrong or rec.digest != want:
        raise RuntimeError(f"release {rec.release} (version {rec.version}): engines {wrong} do not hold the "
                           f"bytes of version {rec.version} (hub recorded {rec.digest}, generated {want})")
    keyframes = [g["keyframe"] for g in got]
    expect = mode == "keyframe" or rec.release == 0
    if any(k != expect for k in keyframes):
        raise RuntimeError(f"release {rec.release} reached the engines as keyframe={keyframes}; a {mode} run "
                           f"sends {'keyframes' if expect else 'deltas'}, and its figures would not be of that")
    live = [g["t"] - t0 for g in got]
    return {"release": rec.release, "version": rec.version, "call_s": call_s, "first_live_s": min(live),
            "all_live_s": max(live), "wire_bytes": [g["bytes"] for g in got], "keyframe": expect,
            "apply_s_max": max(g["apply_s"] for g in got), "exact": True,
            "peak_rss": max(h["peak_rss"] or 0 for h in held)}


def summarize(results: list[dict], warmup: int) -> dict:
    """Per mode and kind of release: median, min and max of each time over the reported rounds; wire bytes per
    engine (median)."""
    out = {}
    for r in results:
        kinds = {}
        for op in r["ops"]:
            if op["round"] >= warmup:
                kinds.setdefault(op["kind"], []).append(op)
        out[r["mode"]] = {kind: _stats(ops) for kind, ops in kinds.items()}
    return out


def _stats(ops: list[dict]) -> dict:
    def three(key: str) -> dict:
        xs = [op[key] for op in ops]
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}

    return {"n": len(ops), "all_live_s": three("all_live_s"), "first_live_s": three("first_live_s"),
            "call_s": three("call_s"), "wire_bytes": statistics.median(b for op in ops for b in op["wire_bytes"]),
            "keyframe": all(op["keyframe"] for op in ops), "span_steps": sorted({op["span_steps"] for op in ops}),
            "exact": all(op["exact"] for op in ops)}


def ratios(summary: dict) -> dict:
    """Keyframe over delta, for the rollback and for a one-step promotion: all-live median time and wire bytes."""
    kf, dl = summary["keyframe"], summary["reverse-delta"]
    return {f"{kind}_keyframe_over_delta": {
                "all_live_s": kf[kind]["all_live_s"]["median"] / dl[kind]["all_live_s"]["median"],
                "wire_bytes": kf[kind]["wire_bytes"] / dl[kind]["wire_bytes"]} for kind in ("rollback", "promote")}


def render(doc: dict) -> str:
    c, st = doc["config"], doc["state"]
    lines = [f"# wsync bench channels: {st['bytes'] / 2**20:.0f} MiB of bf16 in {st['tensors']} tensors, "
             f"{c['engines']} engines", "",
             f"{doc['hardware_line']}; tcp loopback with a token; {c['rounds']} rounds after {c['warmup']} warm-up, "
             f"{c['steps']} promotions between v_old and the rollback to it. Times from the hub's call to the "
             "engines' commits.", "",
             "| mode | release | n | all live s, median (min-max) | first live s | hub call ms | wire MB / engine "
             "| steps spanned | exact |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for mode, kinds in doc["summary"].items():
        for kind in ("rollback", "promote", "promote-after-rollback"):
            if kind in kinds:
                k, a = kinds[kind], kinds[kind]["all_live_s"]
                lines.append(f"| {mode} | {kind} | {k['n']} | {a['median']:.3f} ({a['min']:.3f}-{a['max']:.3f}) "
                             f"| {k['first_live_s']['median']:.3f} | {1e3 * k['call_s']['median']:.2f} "
                             f"| {k['wire_bytes'] / 1e6:.2f} | {','.join(map(str, k['span_steps']))} "
                             f"| {'yes' if k['exact'] else 'NO'} |")
    lines.append("")
    for name, r in doc["ratios"].items():
        lines.append(f"- {name.replace('_', ' ')}: time x{r['all_live_s']:.2f}, wire bytes x{r['wire_bytes']:.1f}")
    lines.append(f"- peak resident memory: an engine process {doc['engine_peak_rss'] / 2**20:.0f} MiB, the hub's "
                 f"{doc['peak_rss'] / 2**20:.0f} MiB (estimated beforehand for the whole run: "
                 f"{doc['memory_estimate'] / 2**30:.1f} GiB)")
    return "\n".join(lines)


def run(cfg: Config) -> dict:
    """Both modes, one after the other (each lets go of its engines and hub before the next starts)."""
    if cfg.size not in SIZES or min(cfg.engines, cfg.steps, cfg.rounds) < 1 or cfg.warmup < 0 \
            or (cfg.mib is not None and cfg.mib < 1):
        raise ValueError(f"size must be one of {list(SIZES)}; engines, steps, rounds and mib >= 1, warmup >= 0; "
                         f"got {cfg}")
    need, have = memory_estimate(cfg), _proc("/proc/meminfo", "MemAvailable")
    if have is not None and need > have:
        raise ValueError(f"this run needs about {need / 2**30:.1f} GiB of memory at its peak and "
                         f"{have / 2**30:.1f} GiB is available; use fewer --engines or --steps, or a smaller state")
    results = [run_mode(mode, cfg) for mode in MODES]
    summary = summarize(results, cfg.warmup)
    return {"state": {"bytes": state_bytes(cfg.size, cfg.mib), "tensors": len(layout(cfg.size, cfg.mib)),
                      "dtype": "BF16", "step_density": DENSITY},
            "memory_estimate": need, "memory_available": have, "results": results, "summary": summary,
            "ratios": ratios(summary), "engine_peak_rss": max(r["engine_peak_rss"] for r in results),
            "peak_rss": _proc("/proc/self/status", "VmHWM") or 0}


def command(a) -> str:
    return (f"wsync bench channels --size {a.size}" + (f" --mib {a.mib}" if a.mib else "")
            + f" --engines {a.engines} --steps {a.steps} --rounds {a.rounds} --warmup {a.warmup}")


def main(a) -> None:
    from wsync.hardware import describe

    from .results import one_line, options, save, stem

    cfg = Config(size=a.size, mib=a.mib, engines=a.engines, steps=a.steps, rounds=a.rounds, warmup=a.warmup,
                 timeout=a.timeout)
    hw = describe()
    doc = {"kind": "wsync bench channels", "date": dt.datetime.now().isoformat(timespec="seconds"),
           "command": command(a), "options": options(a), "config": asdict(cfg), "hardware": hw,
           "hardware_line": one_line(hw), "load_average_before": os.getloadavg()}
    t0 = time.monotonic()
    doc.update(run(cfg))
    doc["seconds"], doc["load_average_after"] = time.monotonic() - t0, os.getloadavg()
    text = render(doc)
    print(text)
    mib = cfg.mib or SIZES[cfg.size] >> 20
    path = save(a.out, f"{stem(hw, doc['date'][:10])}-channels-{mib}mib-{cfg.engines}eng", doc, text)
    print(f"wrote {path} and .md ({doc['seconds']:.0f} s)")


def add_parsers(bench) -> None:
    p = bench.add_parser("channels", help="channel rollback (reverse delta vs keyframe) and promotion, from the "
                                          "hub's call to every engine serving it",
                         description=__doc__.splitlines()[0],
                         epilog="Sizes (2 cores here): default small (64 MiB, 8 engines), about 40 s and 3 GiB; tiny "
                                "(4 MiB), about 10 s; bench (1 GiB) needs about 3 GiB per engine beside the hub's "
                                "~8 GiB, so on a 24 GB machine: --size bench --engines 4, about 10 min and 20 GiB; "
                                "with 8 engines, --size bench --mib 256, about 3 min and 9 GiB. The run refuses to "
                                "start where its memory estimate exceeds what is available.")
    p.add_argument("--size", default="small", choices=list(SIZES),
                   help="state: tiny (4 MiB), small (64 MiB), bench (1 GiB in 381 tensors); default small")
    p.add_argument("--mib", type=int, default=None, help="the state's MiB instead of the size's (its shapes stay)")
    p.add_argument("--engines", type=int, default=8, help="engines following the channel, each a process (default 8)")
    p.add_argument("--steps", type=int, default=3, help="promotions between v_old and the rollback to it (default 3)")
    p.add_argument("--rounds", type=int, default=3, help="rounds reported (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="rounds run first and not reported (default 1)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a release may take to reach every engine (default 600)")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for <date>-<host>-channels-<MiB>mib-<N>eng.json/.md (default ~/.cache/wsync/results; "
                        "benchmarks/results for a run to commit)")
    p.set_defaults(fn=main)


if __name__ == "__main__" and sys.argv[1:2] == ["engine"]:  # an engine: a child process of the suite
    engine_main(sys.argv[2:])
