"""The snapshot generator yields what the delta codec is benchmarked on:
bf16 files with stable names, sparse bit-level changes, reused from cache."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from wsync_bench.snapshots import (
    SnapshotConfig, default_cache_dir, ensure_snapshots, monotone_key,
    snapshot_change_stats, snapshot_pairs,
)

STEPS = 4


def tiny_config(**overrides) -> SnapshotConfig:
    # Few warm-up steps and a short batch keep the module quick enough for the default run.
    fields = dict(size="tiny", lr=1e-5, steps=STEPS, seed=0, batch=4, seq_len=32, warmup_steps=3)
    return SnapshotConfig(**(fields | overrides))


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    cfg = tiny_config()
    out = default_cache_dir(cfg, root=tmp_path_factory.mktemp("snapshots"))
    return cfg, out, ensure_snapshots(out, cfg)


def test_files_and_meta(generated):
    cfg, out, paths = generated
    assert [p.name for p in paths] == [f"step_{k:04d}.safetensors" for k in range(STEPS + 1)]
    assert all(p.is_file() for p in paths)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["config"]["lr"] == cfg.lr
    assert 0 < meta["param_count"] < 1_000_000
    assert len(meta["loss"]) == len(meta["step_seconds"]) == STEPS


def test_bf16_and_same_names(generated):
    _, _, paths = generated
    first = load_file(str(paths[0]))
    assert all(t.dtype == torch.bfloat16 for t in first.values())
    assert "lm_head.weight" in first  # untied: the head is its own tensor
    for path in paths[1:]:
        snap = load_file(str(path))
        assert snap.keys() == first.keys()
        assert all(snap[n].shape == first[n].shape for n in first)


def test_consecutive_snapshots_sparse_but_not_equal(generated):
    _, _, paths = generated
    for old, new in zip(paths, paths[1:]):
        stats = snapshot_change_stats(old, new)
        assert 0 < stats["density"] < 0.5, (old.name, new.name, stats)
        # Changed values mostly move by a single representable step.
        assert stats["frac_step1"] > 0.5, stats


def test_ensure_reuses_cache(generated):
    cfg, out, paths = generated
    before = {p: p.stat().st_mtime_ns for p in [*paths, out / "meta.json"]}
    again = ensure_snapshots(out, tiny_config())
    assert again == paths
    assert {p: p.stat().st_mtime_ns for p in before} == before


def test_changed_config_regenerates(tmp_path):
    out = tmp_path / "run"
    ensure_snapshots(out, tiny_config(steps=2))
    paths = ensure_snapshots(out, tiny_config(steps=1))
    assert len(paths) == 2
    assert sorted(p.name for p in out.glob("step_*")) == [p.name for p in paths]


def test_snapshot_pairs():
    paths = [f"p{k}" for k in range(6)]
    assert snapshot_pairs(paths, gaps=(1, 4, 16)) == [(1, "p0", "p1"), (4, "p0", "p4")]


def test_monotone_key_orders_like_floats():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    values = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy()
    finite = np.isfinite(values) & (bits != 0x8000)  # -0 and +0 compare equal
    order = np.argsort(values[finite], kind="stable")
    keys = monotone_key(bits[finite])[order]
    assert np.all(np.diff(keys.astype(np.int32)) > 0)


def test_bad_size_rejected():
    with pytest.raises(ValueError, match="size must be one of"):
        SnapshotConfig(size="huge")
