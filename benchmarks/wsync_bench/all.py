"""`wsync bench all`: every suite and every peer that installs here, in one run, one report.

    wsync bench all                 # tiny sizes (--size small): a smoke test, not numbers to compare
    wsync bench all --size bench    # the sizes the committed runs used (its --help says how long)

Suites: codec (our delta tiers vs XOR+zstd-1, PULSE, zipnn on consecutive RL
snapshots), transport (tcp, gloo = torch.distributed broadcast, local, ucx where
installed; each beside its raw baseline), sync (publish -> live, full vs delta,
loopback and an emulated WAN when network namespaces can be built), the
whole-checkpoint paths others use (safetensors save -> copy -> load, shardcast
over HTTP) on the same weights as the sync suite, and LoRA (full vs delta vs
adapter-only sync of a peft run). A suite that cannot run says why in the
report instead of failing the rest. Writes `<out>/<date>-<host>[-small].{json,md}` and
PNG plots when matplotlib is installed (out: --out, default
~/.cache/wsync/results; `--out benchmarks/results` for a run to commit);
`wsync bench report` turns the JSON into the tables of docs/results.md.
"""
from __future__ import annotations

import datetime as dt
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

from wsync import progress

from .report import SMALL_NOTE
from .results import default_results_dir, stem



@dataclass(kw_only=True)
class Sizes:
    """What each suite runs on: the defaults are `--size bench`, `small()` is `--size small`."""

    snapshots: str = "bench"  # model preset of the generated snapshots (codec, sync, disk/HTTP peers)
    codec_lrs: tuple = (1e-6, 1e-5)  # learning rates of the snapshot series
    codec_gaps: tuple = (1, 4, 16)  # optimizer steps between the compared snapshots
    codec_repeats: int = 3  # timed rounds per scheme (best is kept)
    transport_bytes: int = 256 << 20  # one message through each transport
    transport_repeats: int = 5  # timed moves per transport and baseline
    sync_versions: int = 12  # timed versions after the warm-up keyframe (latency varies with each version's losses)
    sync_modes: tuple = ("full", "delta", "delta-sparse")
    wan: str = "200,40,0.005"  # emulated WAN: Mbit/s, RTT ms, loss
    peer_repeats: int = 3  # safetensors / shardcast rounds
    lora_args: tuple = ()  # extra arguments of wsync bench lora-sync (its defaults when empty)
    moe_tensors: int = 20_000  # many small tensors vs one tensor of the same size (x 1,024 bf16 elements each)
    moe_repeats: int = 15  # interleaved rounds of one and many tensors (best kept)
    reshard_size: str = "bench"  # model preset of 4 trainer ranks -> 2 engine ranks (reshard.SIZES)
    suites: tuple = ("codec", "transport", "sync", "peers", "lora", "moe", "reshard")

    @classmethod
    def small(cls) -> "Sizes":
        return cls(snapshots="tiny", codec_lrs=(1e-6,), codec_gaps=(1,), codec_repeats=1, transport_bytes=4 << 20,
                   transport_repeats=2, sync_versions=2, sync_modes=("full", "delta"), wan="200,10,0.0",
                   peer_repeats=2, moe_tensors=2_000, moe_repeats=1, reshard_size="small", lora_args=("--steps", "2", "--hidden", "64", "--layers", "2", "--vocab", "512",
                                              "--seq", "16"))


@dataclass(kw_only=True)
class Options:
    sizes: Sizes = field(default_factory=Sizes)
    size: str = "bench"  # the preset `sizes` came from (--size), recorded in the results
    wan: bool = True  # run the WAN rows when namespaces can be built
    ucx: bool = True  # run ucx when ucxx imports
    out: Path = field(default_factory=default_results_dir)  # where the .json/.md/.png go (--out)


def _guard(name: str, fn, *args, **kw) -> dict:
    """Run one suite; an exception becomes {'error': ...} in the results rather than ending the run."""
    t = time.perf_counter()
    progress.write(f"== {name}", file=sys.stderr)
    try:
        res = fn(*args, **kw)
    except Exception as e:  # noqa: BLE001 - a broken suite is reported, the others still run
        traceback.print_exc()
        res = {"error": f"{type(e).__name__}: {e}"}
    res["suite_seconds"] = time.perf_counter() - t
    return res


def codec_suite(s: Sizes) -> dict:
    from . import codec
    from .snapshots import default_cache_dir, ensure_snapshots, snapshot_pairs

    runs = []
    cfgs = _codec_series(s)
    with progress.bar(len(cfgs) * len(s.codec_gaps) * len(codec.schemes({})), "codec", unit="scheme",
                      leave=False) as bar:
        for cfg in cfgs:
            paths = ensure_snapshots(default_cache_dir(cfg), cfg)
            for g, b, n in snapshot_pairs(paths, gaps=s.codec_gaps):
                run = codec.compare(b, n, repeats=s.codec_repeats, label=f"{s.snapshots} model, lr {cfg.lr:g}, gap {g}",
                                    bar=bar)
                run["summary"] = codec.summary(run)
                runs.append(run)
    return {"runs": runs}


def _codec_series(s: Sizes) -> list:
    """One snapshot series per lr, at least as long as the sync suite's, so both read the same folder."""
    from .snapshots import SnapshotConfig

    steps = max(max(s.codec_gaps), SnapshotConfig().steps)
    return [SnapshotConfig(size=s.snapshots, lr=lr, steps=steps) for lr in s.codec_lrs]


def ucx_unavailable() -> str | None:
    from .transport import ucx_unavailable

    return ucx_unavailable()


def transport_suite(s: Sizes, ucx: bool = True) -> dict:
    from . import transport

    out = {}
    for name in ("tcp", "gloo", "local", "ucx", "nccl"):
        # ucx, nccl: the same line `bench transport --transport ucx|nccl` exits with
        why = transport.ucx_unavailable() if name == "ucx" else transport.nccl_unavailable() if name == "nccl" else None
        if name == "ucx" and not ucx:
            why = "left out (--no-ucx)"
        if why:
            out[name] = {"skipped": why}
            continue
        out[name] = _guard(f"transport {name}", transport.run, name, s.transport_bytes, repeats=s.transport_repeats)
        out[name].pop("hardware", None)  # named once for the whole run
    return out


def _snapshot_paths(s: Sizes) -> list:
    from .snapshots import SnapshotConfig, ensure_snapshots

    return ensure_snapshots(None, SnapshotConfig(size=s.snapshots, lr=1e-6))[: s.sync_versions + 1]


def sync_suite(s: Sizes, wan: bool = True) -> dict:
    from . import sync
    from .wan import unavailable

    paths = _snapshot_paths(s)
    out = {"source": f"generated {s.snapshots} snapshots, lr 1e-06", "model_bytes": _model_bytes(paths[0])}
    out["loopback"] = {"link": {"kind": "loopback"}, "results": [sync.run_mode(m, paths) for m in s.sync_modes]}
    why = "left out (--no-wan)" if not wan else unavailable()
    if why:
        out["wan"] = {"skipped": why}
        return out
    from .wan import WanLink

    rate, rtt, loss = (float(x) for x in s.wan.split(","))
    with WanLink(rate_mbit=rate, rtt_ms=rtt, loss=loss) as link:
        res = [sync.run_mode(m, paths, listen=f"tcp://{link.ip_a}:0", wan=link) for m in s.sync_modes]
    out["wan"] = {"link": {"kind": "wan", "rate_mbit": rate, "rtt_ms": rtt, "loss": loss}, "results": res}
    return out


def _model_bytes(path) -> int:
    from wsync.checkpoint import read_checkpoint

    return sum(tb.nbytes for tb in read_checkpoint(path).state.values())


def peers_suite(s: Sizes) -> dict:
    """Whole-checkpoint paths of others on version 1 of the sync suite's snapshots."""
    from wsync.checkpoint import read_checkpoint
    from .dist_peers import run_peers

    path = _snapshot_paths(s)[1]
    res = run_peers(read_checkpoint(path).state, repeats=s.peer_repeats)
    return {"checkpoint": str(path), **res}


def lora_suite(s: Sizes) -> dict:
    with tempfile.TemporaryDirectory(prefix="wsync-lora-") as tmp:
        r = subprocess.run([sys.executable, "-m", "wsync.cli", "bench", "lora-sync", *s.lora_args, "--out", tmp],
                           capture_output=True, text=True, timeout=1800)
        if r.returncode:
            raise RuntimeError(f"wsync bench lora-sync exited {r.returncode}: {r.stderr.strip()[-1500:]}")
        res = json.loads(next(Path(tmp).glob("*.json")).read_text())
    res.pop("hardware", None)
    for lane in res["lanes"].values():
        lane.pop("versions", None)  # per-version rows stay in the suite's own results files
    return res


def moe_suite(s: Sizes) -> dict:
    """Encode, apply, payload and publish -> live of many small tensors vs one tensor, side by side."""
    from . import many

    return many.run(tensors=s.moe_tensors, repeats=s.moe_repeats)


def reshard_suite(s: Sizes) -> dict:
    """Sharded trainer ranks into TP engine ranks, point to point beside the gather-to-rank-0 path."""
    from . import reshard

    if s.reshard_size == "small":
        return reshard.run(dims=reshard.SIZES["small"], full_versions=1, delta_versions=2)
    return reshard.run(dims=reshard.SIZES[s.reshard_size])


def run_all(o: Options) -> dict:
    """Every suite in `o.sizes.suites`; returns the results document (also what `report` renders)."""
    from wsync.hardware import describe

    from .results import one_line

    hw = describe()
    doc = {"kind": "wsync bench all", "date": dt.datetime.now().isoformat(timespec="seconds"), "size": o.size,
           "command": f"wsync bench all --size {o.size}", "hardware": hw,
           "hardware_line": one_line(hw), "load_average_before": os.getloadavg(), "sizes": asdict(o.sizes),
           "suites": {}}
    s, suites = o.sizes, doc["suites"]
    if {"codec", "sync", "peers"} & set(s.suites):
        from .snapshots import SnapshotConfig, announce

        # codec's lr series and the sync/peers series (lr 1e-6, 16 steps) share folders: said once, before any work
        announce(_codec_series(s) + [SnapshotConfig(size=s.snapshots, lr=1e-6)])
    runs = {"codec": lambda: _guard("codec", codec_suite, s),
            "transport": lambda: transport_suite(s, ucx=o.ucx),
            "sync": lambda: _guard("sync", sync_suite, s, wan=o.wan),
            "peers": lambda: _guard("peers (safetensors, shardcast)", peers_suite, s),
            "lora": lambda: _guard("lora", lora_suite, s),
            "moe": lambda: _guard("moe", moe_suite, s),
            "reshard": lambda: _guard("reshard", reshard_suite, s)}
    todo = [name for name in runs if name in s.suites]
    with progress.bar(len(todo), "bench all", unit="suite") as bar:
        for name in todo:
            bar.set_postfix_str(name)
            suites[name] = runs[name]()
            bar.update()
    doc["load_average_after"] = os.getloadavg()
    return doc


def write(doc: dict, out: Path) -> list[Path]:
    """`<date>-<host>.json` and `.md`, plus plots; returns the paths written."""
    from .report import full_report, plot_all, run_size

    out.mkdir(parents=True, exist_ok=True)
    base = out / (stem(doc["hardware"], doc["date"][:10]) + ("-small" if run_size(doc) == "small" else ""))
    js, md = base.with_suffix(".json"), base.with_suffix(".md")
    js.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    pngs = plot_all(doc, base)
    md.write_text(full_report(doc, plots=[p.name for p in pngs]) + "\n")
    return [js, md, *pngs]


# Packages a suite needs beyond wsync's own dependencies: snapshots are generated with transformers, a peer
# saves and loads with safetensors, lora-sync trains a PEFT adapter. Checked before anything runs, so a
# missing one is a line naming the extra (wsync's CLI), not a run that fails suite by suite.
NEEDS = {"codec": ("transformers",), "sync": ("transformers",), "peers": ("safetensors",), "lora": ("transformers", "peft")}


def check_needs(suites) -> None:
    for suite in suites:
        for module in NEEDS.get(suite, ()):
            importlib.import_module(module)


def _cli(a) -> None:
    sizes = Sizes.small() if a.size == "small" else Sizes()
    if a.suites:
        sizes.suites = tuple(a.suites)
    check_needs(sizes.suites)
    out = a.out or default_results_dir()
    if a.size == "small":
        print(f"note: {SMALL_NOTE}", file=sys.stderr, flush=True)
    doc = run_all(Options(sizes=sizes, size=a.size, wan=not a.no_wan, ucx=not a.no_ucx, out=out))
    for p in write(doc, out):
        print(f"wrote {p}")
    if a.size == "small":  # again at the end, beside the numbers, where it is read
        print(f"note: {SMALL_NOTE}")
    errors = [f"{k}: {v['error']}" for k, v in _flat(doc["suites"]) if "error" in v]
    if errors:
        from wsync.errors import WsyncError

        raise WsyncError("some suites failed (results written anyway): " + "; ".join(errors))


def _flat(suites: dict):
    for k, v in suites.items():
        yield k, v
        if k == "transport":
            yield from ((f"transport {n}", r) for n, r in v.items())


def add_parsers(bench) -> None:
    p = bench.add_parser("all", help="every benchmark suite and peer, one report (default --size small: about a "
                                     "minute)",
                         epilog="Sizes (2 cores here): --size small (the default), tiny sizes, about 1 min (a smoke "
                                "test, not numbers to compare); --size bench, the sizes the committed runs used, "
                                "about 7 min once the bench snapshots are cached, plus ~15 min and 4.4 GB to "
                                "generate them the first time.")
    p.add_argument("--size", default="small", choices=["small", "bench"],
                   help="small (default): tiny sizes, a smoke test of every suite; bench: the committed runs' sizes")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for .json/.md/.png (default ~/.cache/wsync/results; benchmarks/results for a run "
                        "to commit)")
    p.add_argument("--quiet", action="store_true", help="no progress bars (they show only on a terminal anyway)")
    p.add_argument("--suites", nargs="+", choices=list(Sizes().suites), help="run only these suites")
    p.add_argument("--no-wan", action="store_true", help="skip the emulated WAN rows even where namespaces work")
    p.add_argument("--no-ucx", action="store_true", help="skip ucx even where ucxx imports")
    p.set_defaults(fn=_cli)
