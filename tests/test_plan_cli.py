"""`wsync plan ...` runs end to end, every subcommand with --json, and stays light to import."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest

from wsync.cli import main


def run_json(capsys, *argv):
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_models(capsys):
    rows = run_json(capsys, "models")
    assert {r["model"] for r in rows} >= {"qwen3-8b", "qwen3-30b-a3b", "glm-4.7", "kimi-k2.6"}


def test_transfer_published(capsys):
    out = run_json(capsys, "transfer", "--published")
    bad = [c["figure"] for c in out["checks"] if c["error_vs_model"] > c["tolerance"]]
    # the WAN table's rounded sizes, and GLM 4.7's one byte per parameter, against the model configs
    assert bad == ["qwen3-8b full sync s, WAN 10 Gbit/s", "qwen3-30b-a3b delta sync s, 98% saved, WAN 10 Gbit/s",
                   "glm-4.7 size GB in the WAN table", "glm-4.7 full sync s, WAN 10 Gbit/s",
                   "glm-4.7 delta sync s, 98% saved, WAN 10 Gbit/s"]
    assert main(["plan", "transfer", "--published"]) == 0
    text = capsys.readouterr().out
    assert "do not follow" in text and "truncates" in text
    # every row of both tables, every column (sizes, TCP, RDMA; WAN full, delta, cost saving), from the model
    for row in ("kimi-k2.6      595.1      95.22        1.488", "qwen3-30b-a3b   48.85    0.977     0.4787",
                "glm-4.7        573.34   11.467     5.6187", "kimi-k2.6      476.12    9.522     4.6660"):
        assert row in text
    assert "usd_saved" in text and "not in repo" not in text  # every published figure is held in the package


def test_transfer_rows(capsys):
    rows = run_json(capsys, "transfer", "--model", "qwen3-8b", "--link", "tcp-50g", "--codec", "full",
                    "--codec", "lora", "--encode-gbps", "1000", "--apply-gbps", "1000", "--gpus", "8")
    full = rows[0]
    assert full["wire_s"] == pytest.approx(2.62, rel=0.01)
    assert full["idle_usd"] == pytest.approx(8 * 0.01 * full["pipelined_s"])
    assert rows[1]["codec"].startswith("lora") and rows[1]["gb"] < 1


def test_lora(capsys):
    out = run_json(capsys, "lora", "--model", "kimi-k2.6", "--rank", "32", "--layout", "per-expert")
    assert out["gb"] == pytest.approx(41.0, rel=0.03)
    assert main(["plan", "lora", "--model", "glm-4.7", "--layout", "shared-outer"]) == 0
    assert "GB" in capsys.readouterr().out


def test_loop(capsys):
    out = run_json(capsys, "loop", "--samples-per-step", "16", "--max-batch", "8", "--infer-gpus", "2",
                   "--steps", "4", "--warmup-steps", "1", "--response-mean", "256")
    assert out["results"]["sync"]["staleness_max"] == 0
    assert out["results"]["async"]["staleness_max"] <= 1
    assert out["decode_curve"][0]["batch"] == 1


def test_sweep_with_plot(capsys, tmp_path):
    png = tmp_path / "pareto.png"
    out = run_json(capsys, "sweep", "--total-gpus", "4", "--train-splits", "1", "2", "--batches", "8",
                   "--caps", "0", "1", "--samples-per-step", "16", "--steps", "3", "--warmup-steps", "1",
                   "--response-mean", "256", "--png", str(png))
    assert len(out["points"]) == 4 and any(p["pareto"] for p in out["points"])
    if importlib.util.find_spec("matplotlib") is None:
        assert out["png"] is None and not png.exists()
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sandboxes(capsys):
    out = run_json(capsys, "sandboxes", "--rate", "5", "--actions", "10", "--action-latency", "1",
                   "--startup", "10", "--failure-rate", "0")
    assert out["plan"]["mean_in_use"] == pytest.approx(100)
    assert out["plan"]["pool_size"] > 100


def test_bad_input_exits_2(capsys):
    assert main(["plan", "lora", "--model", "nope"]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert main(["plan", "transfer", "--link", "fast"]) == 2
    assert main(["plan", "sandboxes", "--rate", "-1"]) == 2


def test_plan_cli_imports_nothing_heavy():
    code = textwrap.dedent("""
        import sys
        import wsync.plan.cli, wsync.plan.models, wsync.plan.transfer, wsync.plan.sweep
        heavy = [m for m in ("torch", "matplotlib", "transformers", "cupy") if m in sys.modules]
        assert not heavy, heavy
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_route_prints_the_plan(capsys):
    out = run_json(capsys, "route", "--model", "qwen3-8b", "--trainer", "fsdp:4", "--engine", "vllm:tp=2")
    assert (out["trainer_ranks"], out["engine_ranks"]) == (4, 2) and len(out["hash"]) == 32
    assert out["total_bytes"] == sum(out["bytes_by_engine"]) == sum(out["bytes_by_trainer"])
    assert out["busiest_bytes"] <= out["ideal_bytes"] * 1.1
    assert main(["plan", "route", "--model", "qwen3-8b", "--trainer", "hsdp:2x2", "--engine", "hf:tp=3,replicas=2"]) == 0
    text = capsys.readouterr().out
    assert "4 trainer ranks -> 6 engine ranks" in text and "busiest:" in text and "x ideal" in text


def test_route_refuses_what_the_engine_refuses(capsys):
    assert main(["plan", "route", "--model", "qwen3-8b", "--engine", "vllm:tp=3"]) == 2
    assert "num_attention_heads = 32" in capsys.readouterr().err
    assert main(["plan", "route", "--model", "kimi-k2", "--engine", "vllm:tp=8"]) == 2
    assert "multi-head latent attention" in capsys.readouterr().err
    assert main(["plan", "route", "--model", "qwen3-8b", "--trainer", "zero3:4"]) == 2
    assert "fsdp:N" in capsys.readouterr().err


def test_transfer_sharded(capsys):
    rows = run_json(capsys, "transfer", "--model", "kimi-k2", "--trainer-ranks", "256", "--engine-ranks", "128",
                    "--link", "ib-400g", "--codec", "full")
    assert rows[0]["wire_bytes"] == pytest.approx(rows[0]["total_bytes"] / 128)
    assert rows[0]["wire_s"] == pytest.approx(0.321, abs=0.001)
    rows = run_json(capsys, "transfer", "--model", "qwen3-8b", "--trainer-ranks", "8", "--engine-ranks", "4",
                    "--from-plan", "--link", "ib-400g", "--codec", "full")
    assert rows[0]["busiest_basis"].startswith("plan fsdp:8 -> vllm:tp=4")
    assert main(["plan", "transfer", "--model", "kimi-k2", "--trainer-ranks", "256", "--engine-ranks", "128",
                 "--link", "ib-400g", "--codec", "full"]) == 0
    out = capsys.readouterr().out
    assert "Perplexity: 1.3 s" in out and "vLLM sharded RDT: 7.53 s" in out
    assert main(["plan", "transfer", "--trainer-ranks", "8"]) == 2
