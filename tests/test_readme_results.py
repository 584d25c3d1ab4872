"""Every figure in the README's headline table is what a committed results file says, rounded as printed.

Each check reads the file the README's row links to, computes the figure the way the row states it, and looks
for that text in the README: a re-run committed without updating the README, or a README edit without a
run behind it, fails here.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from trainer.cli import add_arguments

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = (ROOT / "README.md").read_text()


def _json(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _headline_row(word: str) -> str:
    """The headline table's row whose result cell holds `word`."""
    table = README.split("## Headline results", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and word in line.split(" | ")[0]]
    assert len(rows) == 1, f"one headline row mentions {word!r}, found {len(rows)}"
    return rows[0]


def _latency(sync_suite: dict, link: str, mode: str) -> float:
    return next(r["mean_latency_s"] for r in sync_suite[link]["results"] if r["mode"] == mode)


def test_wan_row_is_both_machines_committed_sync_suites():
    row = _headline_row("emulated WAN")
    epyc = _json("2026-11-23-amdepyc-2core-nogpu.json")["suites"]["sync"]
    full, delta = _latency(epyc, "wan", "full"), _latency(epyc, "wan", "delta")
    assert f"{full / delta:.1f}x sooner" in row and f"{delta:.3f} s vs {full:.3f} s (AMD EPYC)" in row
    xeon = _json("2026-11-22-xeon-2core-nogpu.json")["suites"]["sync"]
    full, delta = _latency(xeon, "wan", "full"), _latency(xeon, "wan", "delta")
    assert f"{full / delta:.1f}x on the Xeon ({delta:.3f} s vs {full:.3f} s)" in row


def test_codec_row_is_the_first_line_of_the_committed_codec_table():
    row = _headline_row("packed delta")
    table_row = next(line for line in README.splitlines() if line.startswith("| bench model, lr 1e-06, gap 1 |"))
    cells = [c.strip() for c in table_row.strip("|").split("|")]
    assert f"packed delta {cells[2].strip('*')} smaller than raw bf16, {cells[7]} slime's XOR+zstd-1" in row


def test_codec_v2_row_spans_every_committed_run():
    row = _headline_row("codec v2")
    runs = [r["tiers"]["v2"] for r in _json("2026-11-27-amdepyc-2core-nogpu-codec-v2-planes-r1.json")["runs"]]
    bits = [t["bits_per_changed"]["total"] for t in runs]
    vs = [t["vs_xor_zstd"] for t in runs]
    assert f"{min(bits):.2f}-{max(bits):.2f} bits per change, {min(vs):.2f}-{max(vs):.2f}x XOR+zstd-1" in row


def test_many_tensors_row_is_the_committed_moe_ratios():
    row = _headline_row("20,000 tensors")
    r = _json("2026-11-23-amdepyc-2core-nogpu-moe.json")["ratios"]
    assert (f"{r['encode_s']:.2f}x one tensor of 20.48M to encode, {r['apply_s']:.2f}x to apply, "
            f"{r['publish_live_s']:.2f}x publish -> live") in row


def test_lora_row_is_the_committed_lora_lane():
    row = _headline_row("LoRA")
    lora = _json("2026-11-23-amdepyc-2core-nogpu.json")["suites"]["lora"]["lanes"]["lora"]
    assert f"{lora['bytes_vs_full']:.4f}x the bytes, {lora['time_vs_full']:.3f}x the time" in row


def test_tcp_row_is_the_committed_auth_run():
    row = _headline_row("record MACs")
    t = _json("2026-11-23-amdepyc-2core-nogpu-tcp-auth.json")
    assert (f"{t['tcp_mac_streams1_gbps']:.2f} GB/s on 1 stream, {t['tcp_mac_streams4_gbps']:.2f} on 4 "
            f"({t['tcp_mac_streams1_vs_plain']:.2f}x / {t['tcp_mac_streams4_vs_plain']:.2f}x the link without a "
            f"token; TLS {t['tcp_tls_streams1_gbps']:.2f} / {t['tcp_tls_streams4_gbps']:.2f})") in row


def test_reshard_row_is_the_committed_reshard_run():
    row = _headline_row("sharded trainer")
    m = _json("2026-11-24-amdepyc-2core-nogpu-reshard.json")["modes"]
    assert (f"{m['full']['time_vs_gather']:.2f}x a gather on rank 0 (full), "
            f"{m['delta']['time_vs_gather']:.2f}x (delta)") in row


def test_loop_row_is_the_committed_loop_runs():
    row = _headline_row("async loop")
    xeon = _json("2026-11-22-xeon-2core-nogpu-loop.json")["samples_per_s_ratio_async_over_sync"]
    assert f"{xeon[0]:.2f}x and {xeon[1]:.2f}x samples/s" in row and "(Xeon)" in row
    linked = re.findall(r"\(benchmarks/results/([^)]*amdepyc[^)]*-loop[^)]*\.json)\)", row)
    assert linked, "the loop row links an AMD EPYC loop run"
    epyc = _json(linked[0])["samples_per_s_ratio_async_over_sync"]
    assert " and ".join(f"{r:.2f}x" for r in epyc) + " on AMD EPYC" in row
    # the run was at the loop's own defaults, as the row says
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults, ran = vars(parser.parse_args([])), _json(linked[0])["args"]
    shared = ("max_staleness", "digits", "max_digits", "long_tail", "samplers", "slots", "group_size",
              "batch_groups", "lr", "refill_at", "kv_cache", "seed")
    assert {k: ran[k] for k in shared} == {k: defaults[k] for k in shared}
    # Quickstart 3's prose rounds the same run
    assert f"async\ntakes about {sum(epyc) / len(epyc):.1f}x the samples per second at the same reward" in README


def test_gpu_row_is_the_committed_h200_run():
    row = _headline_row("H200")
    r = _json("2026-11-27-h200-after-fixes/bench_cuda.json")
    assert r["device"] == "NVIDIA H200"
    enc, apply = r["results"]["encode"], r["results"]["apply"]
    assert f"encode {enc['encode_gbps'] / 1000:.2f} TB/s" in row
    assert f"8B bf16 parameters in {apply['apply_ms']:.1f} ms" in row and apply["params"] == 8_000_000_000


@pytest.mark.parametrize("link", sorted(set(re.findall(r"\]\((benchmarks/results/[^)#]+)\)", README))))
def test_every_results_link_in_the_readme_exists(link):
    assert (ROOT / link).exists(), link


def test_quantized_row_is_the_committed_quant_run():
    row = _headline_row("quantized sync")
    run = _json("2026-11-27-amdepyc-2core-nogpu-quant.json")["schemes"]
    kimi = run["kimi"]["per_version"]["1e-06"]["fraction_changed"]
    assert f"{kimi['codes']:.3%} of codes change per step vs {kimi['bf16_quantized']:.2%} of their BF16 values" in row
    ratios = {k: run[k]["timing"]["ratio"] for k in ("kimi", "int8", "fp8")}
    assert (f"quantizing costs {ratios['kimi']:.2f}x the BF16 delta encode (INT8 {ratios['int8']:.2f}x, "
            f"FP8 block {ratios['fp8']:.2f}x)") in row
    assert all(run[k]["exact"] for k in ("kimi", "int8", "fp8"))


def test_channels_row_is_the_committed_channels_runs():
    row = _headline_row("channels:")
    big = _json("2026-11-28-amdepyc-2core-nogpu-channels-1024mib-4eng.json")
    wide = _json("2026-11-28-amdepyc-2core-nogpu-channels-256mib-8eng.json")
    assert big["config"]["engines"] == 4 and wide["config"]["engines"] == 8

    def live(run, mode, kind):
        return run["summary"][mode][kind]["all_live_s"]["median"]

    delta, key = live(big, "reverse-delta", "rollback"), live(big, "keyframe", "rollback")
    assert f"in {delta:.3f} s as a reverse delta vs {key:.3f} s as a keyframe ({key / delta:.2f}x)" in row
    assert (f"in {live(wide, 'reverse-delta', 'promote'):.3f} s (delta) vs {live(wide, 'keyframe', 'promote'):.3f} s"
            in row)
    assert all(r["exact"] for run in (big, wide) for m in run["summary"].values() for r in m.values())
