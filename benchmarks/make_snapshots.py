"""Generate (or reuse) the bf16 training snapshots the delta benchmarks read.

    python benchmarks/make_snapshots.py --size bench --lr 1e-6 1e-5 --steps 16

Each lr gets its own directory `<out>/<size>-lr<lr>-s<seed>` (17 bf16 copies of
the model: 2.2 GB for the bench size, 0.25 GB for small). What will be written
where is said on stderr before the work starts, then a progress bar on a
terminal; stdout gets one line per (lr, gap): density and step distribution of
step_0000 -> step_gap, the numbers the delta codec's design rests on.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Runs from a checkout without `pip install -e .`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wsync.bench.snapshots import (  # noqa: E402
    SIZES, SnapshotConfig, announce, default_cache_dir, ensure_snapshots, load_meta,
    make_snapshots, snapshot_change_stats, snapshot_pairs,
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None,
                   help="root directory (default: $WSYNC_BENCH_DATA or ~/.cache/wsync/snapshots)")
    p.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--size", choices=sorted(SIZES), default="bench",
                   help="model preset: bench 64M params (2.2 GB per lr), small 7M (0.25 GB), tiny 0.2M (6 MB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gaps", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--force", action="store_true", help="regenerate even if the cache matches")
    return p.parse_args(argv)


def report(cfg: SnapshotConfig, out_dir: Path, paths: list[Path], gaps) -> None:
    meta = load_meta(out_dir) or {}
    for gap, old, new in snapshot_pairs(paths, gaps):
        s = snapshot_change_stats(old, new)
        print(f"{cfg.size} params={meta.get('param_count')} lr={cfg.lr:g} gap={gap:>2} "
              f"density={s['density']:.4%} |step|==1: {s['frac_step1']:.2%} "
              f"==2: {s['frac_step2']:.2%} <=127: {s['frac_le127']:.3%}", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    cfgs = [SnapshotConfig(size=args.size, lr=lr, steps=args.steps, seed=args.seed) for lr in args.lr]
    if not args.force:  # --force rewrites cached ones too; announce() counts only what is missing
        announce(cfgs, root=args.out)
    for cfg in cfgs:
        out_dir = default_cache_dir(cfg, root=args.out)
        paths = make_snapshots(out_dir, cfg) if args.force else ensure_snapshots(out_dir, cfg)
        report(cfg, out_dir, paths, args.gaps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
