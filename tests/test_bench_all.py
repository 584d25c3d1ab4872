"""`wsync bench all`: the README block rendered from a run's JSON, the disk/HTTP peers, and one real small run."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from wsync_bench import report
from wsync_bench.all import Sizes, stem
from wsync.errors import MismatchError

from bench_helpers import HW, synthetic_run


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


def test_readme_block_is_replaced_between_the_markers(tmp_path, capsys):
    from wsync.cli import main

    run = tmp_path / "run.json"
    run.write_text(json.dumps(synthetic_run()))
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{report.BEGIN}\nold table\n{report.END}\noutro\n")
    assert main(["bench", "report", str(run), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith(f"{report.END}\noutro\n")
    assert "old table" not in text and "shardcast HTTP (loopback)" in text
    readme.write_text("no markers here\n")
    capsys.readouterr()
    assert main(["bench", "report", str(run), "--readme", str(readme)]) == 2
    assert "marker" in capsys.readouterr().err and readme.read_text() == "no markers here\n"


def test_a_codec_only_run_still_renders_the_codec_table():
    doc = {"date": "2026-11-21", "hardware": HW, "runs": synthetic_run()["suites"]["codec"]["runs"]}
    text = report.table_for(doc)
    assert "**127.0x**" in text and text.rstrip().endswith("backend cpu.")


def test_full_report_names_plots_and_suite_times():
    md = report.full_report(synthetic_run(), plots=["run.png"])
    assert md.startswith("# wsync bench all (--size bench)") and "![run.png](run.png)" in md and "codec 10s" in md


def test_results_are_named_by_date_and_hardware():
    assert stem(HW, "2026-11-21") == "2026-11-21-xeon-2core-nogpu"
    assert stem({**HW, "cpu": "AMD EPYC 7763 64-Core", "gpu": "H100"}, "2026-01-02") == "2026-01-02-amdepyc77636-2core-gpu"
    assert Sizes.small().transport_bytes < Sizes().transport_bytes


def test_cli_registers_bench_all():
    from wsync.cli import parser

    a = parser().parse_args(["bench", "all", "--suites", "codec", "--no-wan"])
    assert a.size == "small" and a.suites == ["codec"] and a.no_wan  # the smoke-test sizes unless asked
    assert parser().parse_args(["bench", "all", "--size", "bench"]).size == "bench"


def test_bench_reshard_runs_its_small_model_unless_asked():
    from wsync.cli import parser
    from wsync_bench import reshard

    assert parser().parse_args(["bench", "reshard"]).size == "small"
    assert parser().parse_args(["bench", "reshard", "--size", "bench"]).size == "bench"
    assert reshard.SIZES["small"]["hidden"] < reshard.SIZES["bench"]["hidden"]


def _tiny_state():
    from wsync.dtypes import DTYPES
    from wsync.snapshot import TensorBits

    rng = np.random.default_rng(0)
    bf16 = DTYPES["BF16"]
    return {f"layer{i}.weight": TensorBits(bf16, (8, 16), rng.integers(0, 2**16, 128, dtype=np.uint16))
            for i in range(3)}


def test_safetensors_peer_is_exact_and_catches_damage(tmp_path):
    import torch

    from wsync_bench import dist_peers

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
    from wsync_bench import dist_peers

    why = dist_peers.shardcast_unavailable()
    if why:
        pytest.skip(why)
    res = dist_peers.shardcast_path(dist_peers.to_torch(_tiny_state()), tmp_path, repeats=1, shard_bytes=300)
    assert res["exact"] and res["runs"][0]["download_s"] > 0


@pytest.mark.slow
def test_bench_all_small_for_real(tmp_path):
    r = subprocess.run([sys.executable, "-m", "wsync.cli", "bench", "all", "--size", "small", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=900, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(next(tmp_path.glob("*-small.json")).read_text())
    assert doc["size"] == "small" and doc["command"] == "wsync bench all --size small"
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
    md = next(tmp_path.glob("*-small.md")).read_text()
    assert report.all_tables(doc) in md and "FAILED" not in md
