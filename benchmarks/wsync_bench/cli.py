"""The suites of `wsync bench`: wsync's command line finds this module through the `wsync.commands` entry
point of wsync-bench's pyproject.toml and hands it the subcommands of `bench`.

Each suite module adds its own parser with add_parsers(subparsers) and imports nothing heavy at module level:
the parser is built on every call of `wsync`.
"""
from __future__ import annotations

import importlib
from pathlib import Path

# Optional packages the harness needs beyond wsync's own, all in wsync-bench's `all` extra.
EXTRA = 'pip install -e "./benchmarks[all]"'
PACKAGES = {"torch", "transformers", "safetensors", "peft", "matplotlib", "zipnn"}

SIZES_HELP = "generated model size: tiny (0.2M params), small (7M), bench (64M); default small"

SUITES = ["wsync_bench.transport", "wsync_bench.sync", "wsync_bench.reshard", "wsync_bench.all", "wsync_bench.loop",
          "wsync_bench.kernels", "wsync_bench.peers", "wsync_bench.wan_bench", "wsync_bench.report",
          "wsync_bench.metrics_idle", "wsync_bench.xxh3", "wsync_bench.serve_memory",
          "wsync_bench.unpolled", "wsync_bench.integrations",
          "wsync_bench.lora_sync", "wsync_bench.make_snapshots",
          "wsync_bench.codec_v2", "wsync_bench.cuda", "wsync_bench.gpu_sync",
          "wsync_bench.tcp", "wsync_bench.quant", "wsync_bench.channels"]


def install_hint(package: str) -> str | None:
    """What to install for a package of the `all` extra; None where wsync's own extras name it."""
    return EXTRA if package in PACKAGES else None


def _codec(a) -> None:
    if a.shape == "moe":
        from .many import main

        a.repeats = a.repeats or 31
    else:
        a.repeats = a.repeats or 3
        from .codec import main

    main(a)


def add_parsers(bench) -> None:
    """Add every suite to `bench` (the subparsers of `wsync bench`)."""
    bc = bench.add_parser("codec", help="our codec vs peer schemes on consecutive snapshots",
                          epilog="Sizes (2 cores here): default small, ~4 min the first time (it generates 0.5 GB "
                                 "of snapshots), ~10 s after; tiny: seconds; bench: ~15 min the first time, 4.4 GB "
                                 "of snapshots, then a few minutes. --shape moe generates nothing: about a minute.")
    bc.add_argument("--base", type=Path, help="base checkpoint (default: generated RL snapshots)")
    bc.add_argument("--new", type=Path, help="new checkpoint")
    bc.add_argument("--size", default="small", choices=["tiny", "small", "bench"], help=SIZES_HELP)
    bc.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5],
                    help="learning rates of the generated snapshot series (default 1e-6 1e-5)")
    bc.add_argument("--gaps", type=int, nargs="+", default=[1, 4, 16],
                    help="steps between the two snapshots compared (default 1 4 16)")
    bc.add_argument("--repeats", type=int, default=None, help="timed rounds, best kept (default 3; --shape moe 31)")
    bc.add_argument("--json", type=Path, help="also write results as JSON to this file")
    bc.add_argument("--quiet", action="store_true", help="no progress bars (they show only on a terminal anyway)")
    bc.add_argument("--shape", default="dense", choices=["dense", "moe"],
                    help="moe: many small tensors vs one tensor of the same size, side by side (no snapshots)")
    bc.add_argument("--tensors", type=int, default=20_000, help="--shape moe: how many tensors")
    bc.add_argument("--elems", type=int, default=1024, help="--shape moe: elements per tensor")
    bc.add_argument("--density", type=float, default=0.01, help="--shape moe: fraction of elements changed")
    bc.set_defaults(fn=_codec)
    for mod in SUITES:
        importlib.import_module(mod).add_parsers(bench)
    for suite in bench.choices.values():
        suite.set_defaults(install_hint=install_hint)
