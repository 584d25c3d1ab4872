"""`wsync bench quant`: the MoE-shaped state is the snapshot cut into experts and nothing else, the counts of
changed codes and scales are what the quantized states hold, every delta it sizes applies bit for bit, and a
run writes its results where results go."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from wsync.dtypes import DTYPES
from wsync.snapshot import TensorBits
from wsync_bench import quant

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(base, new) paths of two consecutive tiny snapshots, generated here."""
    from wsync_bench.snapshots import SnapshotConfig, ensure_snapshots

    paths = ensure_snapshots(tmp_path_factory.mktemp("snap"), SnapshotConfig(size="tiny", steps=1, warmup_steps=1))
    return paths[0], paths[1]


def _unpacked(words: np.ndarray) -> np.ndarray:
    """The eight 4-bit codes of each int32 word, by bytes (little-endian), not by shifts of the word."""
    b = words.view(np.uint8)
    return np.stack([b & 0xF, b >> 4], axis=-1).reshape(-1)


def test_moe_shaped_cuts_mlps_into_experts_that_put_back_together_are_the_mlp(pair):
    state = quant.load(pair[0])
    moe = quant.moe_shaped(state, experts=2, dense_layers=1)
    assert "model.layers.0.mlp.gate_proj.weight" in moe  # the dense layer keeps its MLP
    assert not any(".layers.1.mlp.gate_proj" in n for n in moe)
    for proj, axis in (("gate", 0), ("up", 0), ("down", 1)):
        whole = state[f"model.layers.1.mlp.{proj}_proj.weight"]
        parts = [moe[f"model.layers.1.mlp.experts.{e}.{proj}_proj.weight"] for e in range(2)]
        joined = np.concatenate([p.bits.reshape(p.shape) for p in parts], axis=axis)
        assert joined.tobytes() == whole.bits.reshape(whole.shape).tobytes()
    kept = {n for n in state if ".layers.1.mlp." not in n}
    assert all(moe[n].bits.tobytes() == state[n].bits.tobytes() for n in kept)
    assert sum(t.numel for t in moe.values()) == sum(t.numel for t in state.values())
    with pytest.raises(ValueError, match="does not split into 5 experts"):
        quant.moe_shaped(state, experts=5, dense_layers=0)


def test_changed_nibbles_counts_each_code_of_a_word():
    a = np.array([0x00000000, 0x12345678, -1], np.int32)
    b = np.array([0x10000001, 0x12345678, 0x7FFFFFFF], np.int32)
    ta, tb = (TensorBits(DTYPES["I32"], (3,), x) for x in (a, b))
    assert quant.changed_nibbles(ta, tb) == (3, 24)
    assert quant.changed_nibbles(ta, ta) == (0, 24)


def test_a_pair_counts_what_the_quantized_states_hold(pair):
    from wsync.quant import from_config

    base, new = (quant.moe_shaped(quant.load(p), 2, 1) for p in pair)
    cfg = quant.scheme_config("kimi")
    row = quant.measure_pair(from_config(cfg), base, new)
    assert row["exact"]
    qb, qn = from_config(cfg)(base), from_config(cfg)(new)
    packed = [n for n in qn if n.endswith("weight_packed")]
    # only the routed experts are INT4 in Kimi's format: layer 1's six expert matrices here
    assert sorted(packed) == sorted(f"model.layers.1.mlp.experts.{e}.{p}_proj.weight_packed"
                                    for e in range(2) for p in ("gate", "up", "down"))
    codes = sum(int(np.count_nonzero(_unpacked(qb[n].bits) != _unpacked(qn[n].bits))) for n in packed)
    scales = [n.replace("_packed", "_scale") for n in packed]
    assert row["changed"]["codes"] == codes and row["elements"]["codes"] == 8 * sum(qn[n].numel for n in packed)
    assert row["changed"]["scales"] == sum(int(np.count_nonzero(qb[n].bits != qn[n].bits)) for n in scales)
    sources = [n.replace("_packed", "") for n in packed]
    assert row["changed"]["bf16_quantized"] == sum(int(np.count_nonzero(base[n].bits != new[n].bits)) for n in sources)
    rest = [n for n in new if n not in sources]
    assert row["elements"]["bf16_rest"] == sum(new[n].numel for n in rest)
    raw = sum(row["parts"][k]["raw_bytes"] for k in quant.PARTS)
    shapes = sum(qn[n].nbytes for n in qn if n.endswith("weight_shape"))
    assert raw + shapes == sum(t.nbytes for t in qn.values())
    b = row["bytes"]
    assert b["quant_full"] < b["bf16_full"] and 0 < b["quant_delta"] < b["quant_full"]
    assert 0 < b["bf16_delta"] < b["bf16_full"]


@pytest.mark.parametrize("name", quant.SCHEME_NAMES)
def test_every_scheme_applies_bit_for_bit_and_is_timed_against_the_bf16_encode(pair, name):
    res = quant.run([("step 0 -> 1", 1e-6, *pair)], experts=2, dense_layers=1, rounds=1, schemes=(name,))
    s = res["schemes"][name]
    assert s["exact"] and s["quantized_weights"] > 0
    t = s["timing"]
    assert t["ratio"] == pytest.approx(t["quantize_s"] / t["bf16_delta_encode_s"])
    assert t["quantize_kernel"].startswith("wsync.backends.")
    assert t["reference_ratio"] == pytest.approx(t["quantize_reference_s"] / t["bf16_delta_encode_s"])
    per = s["per_version"]["1e-06"]
    assert per["versions"] == 1 and set(per["bytes"]) == {"bf16_full", "bf16_delta", "quant_full", "quant_delta"}
    assert 0 < per["fraction_changed"]["codes"] <= 1
    row = s["versions"][0]
    for part in quant.PARTS:
        p = row["parts"][part]
        assert 0 < p["empty_delta_bytes"] < p["delta_bytes"]
        assert per["bytes_per_changed"][part] == (p["delta_bytes"] - p["empty_delta_bytes"]) / row["changed"][part]


def test_the_suite_is_a_bench_subcommand(capsys):
    from wsync.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "quant", "--help"])
    assert e.value.code == 0
    assert "--experts" in capsys.readouterr().out


@pytest.mark.slow  # generates a tiny snapshot series in a fresh cache
def test_a_run_writes_its_results_to_the_cache_never_the_checkout(tmp_path):
    before = {p.name for p in (ROOT / "benchmarks" / "results").iterdir()}
    home = tmp_path / "home"
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(ROOT)}
    env.pop("WSYNC_BENCH_DATA", None)
    r = subprocess.run([sys.executable, "-m", "wsync.cli", "bench", "quant", "--size", "tiny", "--lr", "1e-6",
                        "--experts", "2", "--rounds", "1"], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = home / ".cache" / "wsync" / "results"
    js = next(out.glob("*-quant.json"))
    doc = json.loads(js.read_text())
    assert doc["command"].startswith("wsync bench quant --size tiny") and set(doc["schemes"]) == set(quant.SCHEME_NAMES)
    assert js.with_suffix(".md").read_text().startswith("# wsync bench quant on ")
    assert {p.name for p in (ROOT / "benchmarks" / "results").iterdir()} == before


def test_a_shorter_series_reads_the_longer_one_cached_instead_of_replacing_it(monkeypatch, tmp_path):
    from dataclasses import replace

    from wsync_bench.snapshots import SnapshotConfig, default_cache_dir, ensure_snapshots

    monkeypatch.setenv("WSYNC_BENCH_DATA", str(tmp_path))
    longer = SnapshotConfig(size="tiny", steps=2, warmup_steps=1)
    ensure_snapshots(default_cache_dir(longer), longer)
    assert quant._series(replace(longer, steps=1)) == longer
    other = replace(longer, steps=1, seed=1)  # another run in another folder: as asked
    assert quant._series(other) == other
    assert quant._series(replace(longer, steps=3)).steps == 3  # longer than the cache: generated anew
