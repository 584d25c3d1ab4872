"""`wsync bench all`: the README block rendered from a run's JSON, the disk/HTTP peers, and one real quick run."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from wsync.bench import report
from wsync.bench.all import Sizes, stem
from wsync.errors import MismatchError

HW = {"host": "box", "cpu": "Intel(R) Xeon(R) Processor", "cores": 2, "gpu": None, "python": "3.11",
      "numpy": "2", "wsync_backend": "cpu (cuda unavailable: no driver)"}


def _scheme(name, ratio, enc=1.0):
    return {"name": name, "bytes": int(1e6 / ratio), "ratio_vs_raw": ratio, "bits_per_changed": 3.0,
            "encode_gbps": enc, "decode_gbps": enc, "exact": True}


def _transport(name, raw, ours):
    return {"transport": name, "size": 256 << 20, "runs": {"raw": {"gbps_median": raw}, "ours": {"gbps_median": ours}},
            "ratio_median": ours / raw}


def synthetic_run() -> dict:
    codec_run = {"label": "bench model, lr 1e-06, gap 1", "bound": {"density": 0.0118, "ratio_vs_raw": 140.1,
                                                                     "n_total": 1000, "total_bits": 1, "bits_per_changed": 2},
                 "schemes": [_scheme("wsync-packed", 127.0, 0.68), _scheme("wsync-sparse", 55.5), _scheme("raw", 1.0),
                             _scheme("xor_zstd", 64.7), _scheme("pulse", 56.6), {"name": "zipnn", "skipped": "not here"}],
                 "summary": {"density": 0.0118, "packed_ratio": 127.0, "packed_vs_xor_zstd": 1.96,
                             "packed_over_bound": 0.103, "sparse_ratio": 55.5, "all_exact": True}}
    sync = lambda mode, s, mb: {"mode": mode, "mean_latency_s": s, "mean_bytes": mb * 1e6, "exact": True}  # noqa: E731
    return {
        "kind": "wsync bench all", "date": "2026-11-21T20:00:00", "quick": False, "command": "wsync bench all",
        "hardware": HW, "hardware_line": "Xeon, 2 cores", "load_average_before": [1.0, 1.0, 1.0],
        "load_average_after": [2.0, 2.0, 2.0],
        "suites": {
            "codec": {"runs": [codec_run], "suite_seconds": 10.0},
            "transport": {"tcp": _transport("tcp", 2.5, 2.4), "gloo": _transport("gloo", 3.5, 3.3),
                          "local": _transport("local", 4.0, 3.0), "ucx": {"skipped": "ucxx does not import"},
                          "nccl": {"skipped": "needs two CUDA GPUs"}},
            "sync": {"source": "generated bench snapshots, lr 1e-06", "model_bytes": 128.5e6,
                     "loopback": {"link": {"kind": "loopback"}, "results": [sync("full", 0.444, 128.5),
                                                                             sync("delta", 0.222, 1.01)]},
                     "wan": {"link": {"kind": "wan", "rate_mbit": 200.0, "rtt_ms": 40.0, "loss": 0.005},
                             "results": [sync("full", 6.29, 128.5), sync("delta", 0.349, 1.01)]},
                     "suite_seconds": 60.0},
            "peers": {"checkpoint": "x", "suite_seconds": 3.0,
                      "safetensors": {"name": "safetensors save -> copy -> load", "bytes": 128.5e6,
                                      "seconds_median": 0.888, "exact": True},
                      "shardcast": {"name": "shardcast HTTP (loopback)", "bytes": 128.5e6, "seconds_median": 1.776,
                                    "exact": True}},
            "lora": {"error": "RuntimeError: bench_lora_sync.py exited 1: boom", "suite_seconds": 1.0},
        },
    }


def test_all_tables_render_every_suite_side_by_side():
    text = report.all_tables(synthetic_run())
    assert "Intel(R) Xeon(R) Processor, 2 cores, no GPU, wsync backend cpu." in text  # hardware, named once
    assert "| bench model, lr 1e-06, gap 1 | 1.18% | **127.0x** | 55.5x | 64.7x | 56.6x | 140.1x |" in text  # no zipnn column
    assert "| tcp | plain sockets (sendall / recv_into) | 256 MiB | 2.50 | 2.40 | 0.96x |" in text
    assert "| gloo | torch.distributed broadcast (gloo) | 256 MiB | 3.50 | 3.30 | 0.94x |" in text
    assert "- ucx: skipped, ucxx does not import" in text
    assert "| loopback | wsync delta | 0.222 | 1.01 | 2.00x | yes |" in text
    assert "| loopback | safetensors save -> copy -> load | 0.888 | 128.50 | 0.50x | yes |" in text
    assert "| loopback | shardcast HTTP (loopback) | 1.776 | 128.50 | 0.25x | yes |" in text
    assert "| WAN 200 Mbit/s, 40 ms, 0.5% loss | wsync delta | 0.349 | 1.01 | 18.02x | yes |" in text
    assert "- lora: FAILED, RuntimeError: bench_lora_sync.py exited 1: boom" in text
    assert text.count("Measured ") == 1  # the codec table does not repeat the hardware line


def test_lora_and_skipped_wan_rows():
    doc = synthetic_run()
    doc["suites"]["lora"] = {
        "model": {"arch": "Qwen3", "params": 20e6, "lora_rank": 16, "lora_params": 400e3}, "run": {"steps": 5},
        "transport": "tcp loopback", "lanes": {
            "full": {"bytes_per_version": 40e6, "bytes_vs_full": 1.0, "seconds_per_version": 0.2, "time_vs_full": 1.0},
            "lora": {"bytes_per_version": 0.8e6, "bytes_vs_full": 0.02, "seconds_per_version": 0.02,
                     "time_vs_full": 0.1}}}
    doc["suites"]["sync"]["wan"] = {"skipped": "needs root (network namespaces, veth, tc)"}
    text = report.all_tables(doc)
    assert "| lora | 0.800 MB | 0.0200x | 20.0 ms | 0.100x |" in text
    assert "- WAN: skipped, needs root" in text
    assert "WAN 200" not in text


def test_readme_block_is_replaced_between_the_markers(tmp_path):
    run = tmp_path / "run.json"
    run.write_text(json.dumps(synthetic_run()))
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{report.BEGIN}\nold table\n{report.END}\noutro\n")
    report.main([str(run), "--readme", str(readme)])
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith(f"{report.END}\noutro\n")
    assert "old table" not in text and "shardcast HTTP (loopback)" in text
    readme.write_text("no markers here\n")
    with pytest.raises(ValueError, match="marker"):
        report.main([str(run), "--readme", str(readme)])


def test_a_codec_only_run_still_renders_the_codec_table():
    doc = {"date": "2026-11-21", "hardware": HW, "runs": synthetic_run()["suites"]["codec"]["runs"]}
    text = report.table_for(doc)
    assert "**127.0x**" in text and text.rstrip().endswith("backend cpu.")


def test_full_report_names_plots_and_suite_times():
    md = report.full_report(synthetic_run(), plots=["run.png"])
    assert md.startswith("# wsync bench all (full)") and "![run.png](run.png)" in md and "codec 10s" in md


def test_results_are_named_by_date_and_hardware():
    assert stem(HW, "2026-11-21") == "2026-11-21-xeon-2core-nogpu"
    assert stem({**HW, "cpu": "AMD EPYC 7763 64-Core", "gpu": "H100"}, "2026-01-02") == "2026-01-02-amdepyc77636-2core-gpu"
    assert Sizes.quick().transport_bytes < Sizes().transport_bytes


def test_cli_registers_bench_all():
    from wsync.cli import parser

    a = parser().parse_args(["bench", "all", "--quick", "--suites", "codec", "--no-wan"])
    assert a.quick and a.suites == ["codec"] and a.no_wan


def _tiny_state():
    from wsync.dtypes import DTYPES
    from wsync.snapshot import TensorBits

    rng = np.random.default_rng(0)
    bf16 = DTYPES["BF16"]
    return {f"layer{i}.weight": TensorBits(bf16, (8, 16), rng.integers(0, 2**16, 128, dtype=np.uint16))
            for i in range(3)}


def test_safetensors_peer_is_exact_and_catches_damage(tmp_path):
    import torch

    from wsync.bench import dist_peers

    state = _tiny_state()
    tensors = dist_peers.to_torch(state)
    assert tensors["layer0.weight"].dtype == torch.bfloat16
    res = dist_peers.safetensors_path(tensors, tmp_path, repeats=1)
    assert res["exact"] and res["bytes"] == 3 * 128 * 2 and res["runs"][0]["seconds"] > 0
    bad = {k: v.clone() for k, v in tensors.items()}
    bad["layer1.weight"].view(torch.int16)[0, 0] ^= 1  # one flipped bit
    with pytest.raises(MismatchError, match="layer1.weight"):
        dist_peers._exact(tensors, bad, "test")


def test_shardcast_peer_over_loopback(tmp_path):
    from wsync.bench import dist_peers

    why = dist_peers.shardcast_unavailable()
    if why:
        pytest.skip(why)
    res = dist_peers.shardcast_path(dist_peers.to_torch(_tiny_state()), tmp_path, repeats=1, shard_bytes=300)
    assert res["exact"] and res["runs"][0]["download_s"] > 0


@pytest.mark.slow
def test_bench_all_quick_for_real(tmp_path):
    r = subprocess.run([sys.executable, "-m", "wsync.cli", "bench", "all", "--quick", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=900, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(next(tmp_path.glob("*-quick.json")).read_text())
    su = doc["suites"]
    assert set(su) == {"codec", "transport", "sync", "peers", "lora", "moe", "reshard"}
    assert all(m["same_bytes_on_every_engine_rank"] for m in su["reshard"]["modes"].values())
    moe = su["moe"]["results"]  # many small tensors beside one of the same size: every path bit-exact
    assert moe["one"]["exact"] and moe["many"]["exact"] and moe["many"]["payload_bytes"] > 0
    assert all(row["exact"] for row in su["codec"]["runs"][0]["schemes"] if "exact" in row)
    assert {"tcp", "gloo", "local"} <= {k for k, v in su["transport"].items() if "ratio_median" in v}
    assert all(x["exact"] for x in su["sync"]["loopback"]["results"])
    assert su["peers"]["safetensors"]["exact"]
    assert set(su["lora"]["lanes"]) == {"full", "delta", "lora"}
    md = next(tmp_path.glob("*-quick.md")).read_text()
    assert report.all_tables(doc) in md and "FAILED" not in md
