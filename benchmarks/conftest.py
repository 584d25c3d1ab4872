"""Benchmark fixtures: RL snapshots generated once and cached (see wsync_bench.snapshots).

    python -m pytest benchmarks/ --benchmark-only            # small model, quick
    WSYNC_BENCH_SIZE=bench python -m pytest benchmarks/ ...  # the 64M-parameter model
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


@pytest.fixture(scope="session", params=[1e-6, 1e-5], ids=lambda lr: f"lr{lr:g}")
def snapshot_pair(request):
    """(base, new) TensorBits states one optimizer step apart, loaded into memory."""
    from wsync_bench.snapshots import SnapshotConfig, default_cache_dir, ensure_snapshots
    from wsync.checkpoint import read_checkpoint
    from wsync.snapshot import TensorBits

    cfg = SnapshotConfig(size=os.environ.get("WSYNC_BENCH_SIZE", "small"), lr=request.param, steps=1)
    paths = ensure_snapshots(default_cache_dir(cfg), cfg)
    load = lambda p: {n: TensorBits(t.dtype, t.shape, np.array(t.bits)) for n, t in read_checkpoint(p).state.items()}
    return load(paths[0]), load(paths[1])
