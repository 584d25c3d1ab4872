"""wsync bench gpu-sync: the end-to-end GPU benchmark, its logic run on a CPU.

The suite's small size on --device cpu goes through everything a GPU run
does: a trainer process and an engine process, real Publisher and Subscriber
over local:// and tcp loopback, every stage, the JSON and the summary, and a
byte-for-byte comparison of the engine's parameters with the trainer's at the
end of each sync stage.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from wsync_bench import gpu_sync as mod

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def small_cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-sync")
    r = subprocess.run([sys.executable, "-m", "wsync.cli", "bench", "gpu-sync", "--size", "small", "--device", "cpu",
                        "--versions", "2", "--time-limit", "150", "--out", str(out)], capture_output=True, text=True,
                       cwd=ROOT, timeout=240)
    return r, out


@pytest.mark.slow  # the whole suite, at small size
def test_small_size_on_cpu_runs_every_stage_bit_exact(small_cpu_run):
    r, out = small_cpu_run
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads((out / "gpu_sync.json").read_text())
    names = ["setup"] + [f"{s}.{k}" for s in ("dense", "moe")
                         for k in ("build", "d2d", "raw_local", "delta_local", "delta_tcp")]
    assert data["bench"] == "gpu_sync" and data["stage_names"] == names
    assert set(data["stages"]) == set(names)
    assert all(data["stages"][n]["ok"] and data["stages"][n]["error"] is None for n in names), data["stages"]
    assert data["exact"] is True and data["complete"] is True
    assert data["size"] == "small" and data["device"].startswith("cpu (")  # the device is named
    m = data["machine"]
    assert m["cpu"] and m["torch"] and m["device"] == "cpu" and m["gpu"] is None
    assert data["states"]["dense"]["tensors"] == 4 * 11 + 3 and data["states"]["moe"]["tensors"] == 600
    for s in ("dense", "moe"):
        d2d = data["stages"][f"{s}.d2d"]
        assert d2d["timer"] == "perf_counter" and d2d["copy_s"]["n"] == d2d["foreach_copy_s"]["n"] >= 1
        for kind, transport, codec in (("raw_local", "local://", "raw"), ("delta_local", "local://", "delta"),
                                       ("delta_tcp", "tcp://", "delta")):
            st = data["stages"][f"{s}.{kind}"]
            assert (st["transport"], st["codec"]) == (transport, codec)
            assert st["exact"] is True and st["mismatched"] == [] and st["tensors_compared"] == \
                data["states"][s]["tensors"]
            assert len(st["versions"]) == 2 and st["stopped"] is None
            assert st["first"]["keyframe"] is True and st["first"]["version"] == 0
            assert st["publish_to_live_s"]["n"] == st["blocked_s"]["n"] == 2  # every timed version recorded
            for v in st["versions"]:
                assert v["wire_bytes"] and v["received_bytes"] == v["wire_bytes"]
            if codec == "delta":  # 1% of values moved: far less than the state on the wire, applied as deltas
                assert st["keyframes"] == 0 and st["wire_bytes"]["max"] < data["states"][s]["bytes"] / 4
            else:
                assert st["wire_bytes"]["min"] >= data["states"][s]["bytes"]
            assert set(st["memory"]) == {"trainer", "engine"}
            assert "rss_extra_bytes" in st["memory"]["engine"]["open"]
    md = (out / "gpu_sync.md").read_text()
    assert "cpu (" in md and "bit-exact: **True**" in md and "dense.delta_tcp" in md and "moe.raw_local" in md


@pytest.mark.slow  # needs the suite's run; tests/test_plan_gpu_sync.py reads results in the fast tier
def test_the_planner_reads_what_the_bench_writes(small_cpu_run, tmp_path, monkeypatch):
    from wsync.plan import measured
    from wsync.plan.gpu_sync import e2e_speed, e2e_tensor_cost, newest_gpu_sync

    _, out = small_cpu_run
    data = json.loads((out / "gpu_sync.json").read_text())
    packaged = measured.inputs()  # the planner's inputs, with this folder's runs as scripts/planner_inputs.py adds them
    monkeypatch.setattr(measured, "inputs", lambda: {**packaged, "gpu_sync": measured.extract(tmp_path)["gpu_sync"]})
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "gpu_sync.json").write_text(json.dumps(data))
    assert newest_gpu_sync() is None  # a CPU run of the suite is no GPU measurement
    data["size"], data["machine"]["device"], data["machine"]["gpu"] = "full", "cuda:0", "NVIDIA H100 80GB HBM3"
    (tmp_path / "run" / "gpu_sync.json").write_text(json.dumps(data))
    run = newest_gpu_sync()
    assert run is not None
    for kind in ("full", "delta"):
        s = e2e_speed(kind, run)
        assert s is not None and s.basis == "measured" and s.encode_gbps > 0 and s.apply_gbps > 0
        assert e2e_tensor_cost(kind, run) is not None


def test_full_size_has_the_real_shapes():
    cfg, dense = mod.dense_shapes("full")
    d = mod.describe_shapes(dense)
    assert d["tensors"] == 36 * 11 + 3 and d["params"] == 8_190_735_360 and d["bytes"] == 16_381_470_720
    shapes = dict(dense)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (4096, 4096)
    assert shapes["model.layers.35.self_attn.k_proj.weight"] == (1024, 4096)
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (128,)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (4096, 12288)
    assert shapes["model.embed_tokens.weight"] == shapes["lm_head.weight"] == (151936, 4096)  # untied
    _, moe = mod.moe_shapes("full", 20_000, 48)
    assert len(moe) == len(dict(moe)) == 20_000
    assert moe[0] == ("model.layers.0.mlp.experts.0.gate_proj.weight", (48, 2048))
    assert moe[2] == ("model.layers.0.mlp.experts.0.down_proj.weight", (2048, 48))
    assert moe[-1][0].startswith("model.layers.52.")  # 128 experts x 3 per layer


@pytest.mark.slow  # digests of 12M bf16 values, five times over
def test_the_digest_sees_one_byte():
    import torch

    side = mod.Side("cpu")
    g = torch.Generator().manual_seed(0)
    side.named = {"big": torch.randn(3 << 22, generator=g).to(torch.bfloat16),  # over one digest chunk
                  **{f"small.{i}": torch.randn(1000 + i, generator=g).to(torch.bfloat16) for i in range(50)}}
    before = side.digests()
    for name, at in (("big", (3 << 22) - 1), ("small.7", 500)):
        bits = side.named[name].view(torch.int16)
        bits[at] += 1
        after = side.digests()
        assert after[name] != before[name] and all(after[n] == before[n] for n in before if n != name)
        bits[at] -= 1
    assert side.digests() == before
