#!/usr/bin/env python3
"""Write the planner's measured inputs (wsync/plan/data/measured.json) from benchmarks/results.

`wsync plan` reads only that file, so an installed wheel answers as a checkout does; run this after adding a
results file the planner prices from (codec, kernels, moe, gpu_sync, loop or quant runs) and commit what it writes.
The output is deterministic: the same results give the same bytes. --check exits 1, writing nothing, when the
committed file differs from what the results give now.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from wsync.plan import measured  # noqa: E402 - after the checkout is on the path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results", help="the results folder")
    p.add_argument("--out", type=Path, default=measured.DATA, help="the file to write")
    p.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    a = p.parse_args(argv)
    if not a.results.is_dir():
        p.error(f"no results folder at {a.results}")
    text = measured.render(measured.extract(a.results))
    if a.check:
        same = a.out.is_file() and a.out.read_text() == text
        print(f"{a.out}: {'up to date' if same else 'differs from ' + str(a.results) + '; rerun without --check'}")
        return 0 if same else 1
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(text)
    print(f"wrote {a.out} from {a.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
