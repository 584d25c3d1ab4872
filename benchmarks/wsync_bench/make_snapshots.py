"""Generate (or reuse) the bf16 training snapshots the delta benchmarks read.

    wsync bench snapshots --size bench --lr 1e-6 1e-5 --steps 16

Each lr gets its own directory `<out>/<size>-lr<lr>-s<seed>` (17 bf16 copies of
the model: 2.2 GB for the bench size, 0.25 GB for small). What will be written
where is said on stderr before the work starts, then a progress bar on a
terminal; stdout gets one line per (lr, gap): density and step distribution of
step_0000 -> step_gap, the numbers the delta codec's design rests on.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parsers(bench) -> None:
    p = bench.add_parser("snapshots", help="generate (or reuse) the bf16 training snapshots the codec suites read",
                         description=__doc__.splitlines()[0],
                         epilog="Default small (7M params, 0.25 GB per lr): a few minutes here (2 cores); tiny "
                                "(0.2M, 6 MB per lr): seconds; bench (64M, 2.2 GB per lr): ~15 min. Needs "
                                "transformers (pip install -e \"./benchmarks[all]\").")
    p.add_argument("--out", type=Path, default=None,
                   help="root directory (default: $WSYNC_BENCH_DATA or ~/.cache/wsync/snapshots)")
    p.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5],
                   help="learning rates, a series each (default 1e-6 1e-5)")
    p.add_argument("--steps", type=int, default=16, help="optimizer steps saved after the warm-up (default 16)")
    p.add_argument("--size", choices=["tiny", "small", "bench"], default="small",
                   help="model preset: bench 64M params (2.2 GB per lr), small 7M (0.25 GB), tiny 0.2M (6 MB); "
                        "default small")
    p.add_argument("--seed", type=int, default=0, help="random seed of the model and the data (default 0)")
    p.add_argument("--gaps", type=int, nargs="+", default=[1, 4, 16],
                   help="steps between the snapshot pairs whose change statistics are printed (default 1 4 16)")
    p.add_argument("--force", action="store_true", help="regenerate even if the cache matches")
    p.set_defaults(fn=main)


def report(cfg, out_dir: Path, paths: list[Path], gaps) -> None:
    from .snapshots import load_meta, snapshot_change_stats, snapshot_pairs

    meta = load_meta(out_dir) or {}
    for gap, old, new in snapshot_pairs(paths, gaps):
        s = snapshot_change_stats(old, new)
        print(f"{cfg.size} params={meta.get('param_count')} lr={cfg.lr:g} gap={gap:>2} "
              f"density={s['density']:.4%} |step|==1: {s['frac_step1']:.2%} "
              f"==2: {s['frac_step2']:.2%} <=127: {s['frac_le127']:.3%}", flush=True)


def main(args: argparse.Namespace) -> None:
    from .snapshots import SnapshotConfig, announce, default_cache_dir, ensure_snapshots, make_snapshots

    cfgs = [SnapshotConfig(size=args.size, lr=lr, steps=args.steps, seed=args.seed) for lr in args.lr]
    if not args.force:  # --force rewrites cached ones too; announce() counts only what is missing
        announce(cfgs, root=args.out)
    for cfg in cfgs:
        out_dir = default_cache_dir(cfg, root=args.out)
        paths = make_snapshots(out_dir, cfg) if args.force else ensure_snapshots(out_dir, cfg)
        report(cfg, out_dir, paths, args.gaps)
