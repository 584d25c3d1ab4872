"""Where benchmark results land (--out, else a cache folder, never the checkout), one host tag for all of them,
the --size small note, the codec table without an n/a zipnn column, and the loop's sync-vs-async plot."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from wsync.hardware import describe
from wsync_bench import report
from wsync_bench.results import host_tag, stem

from bench_helpers import synthetic_run

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _results_now() -> set[str]:
    return {p.name for p in RESULTS.iterdir()}


@pytest.mark.slow  # a `bench all` run at its default size, small
def test_bench_all_writes_to_the_cache_by_default_and_says_small_is_a_smoke_test(tmp_path):
    before = _results_now()
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    cwd.mkdir()
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "wsync.cli", "bench", "all", "--suites", "moe"],
                       capture_output=True, text=True, env=env, cwd=cwd, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = home / ".cache" / "wsync" / "results"
    files = sorted(p.name for p in out.iterdir())
    assert f"{stem(describe())}-small.json" in files and f"{stem(describe())}-small.md" in files
    assert not list(cwd.iterdir()) and _results_now() == before
    assert "smoke test, not numbers to compare" in r.stdout.splitlines()[-1]  # last thing printed, beside the paths
    md = next(out.glob("*-small.md")).read_text()
    assert f"**Note:** {report.SMALL_NOTE}" in md


@pytest.mark.slow  # trains a tiny LoRA for two steps
def test_lora_sync_writes_to_the_cache_by_default_never_the_checkout(tmp_path):
    before = _results_now()
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    cwd.mkdir()
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "wsync.cli", "bench", "lora-sync", "--steps", "2", "--hidden", "64",
                        "--layers", "2", "--vocab", "512", "--seq", "16"],
                       capture_output=True, text=True, env=env, cwd=cwd, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = home / ".cache" / "wsync" / "results"
    assert sorted(p.suffix for p in out.glob("*-lora-sync.*")) == [".json", ".md"]
    assert not list(cwd.iterdir()) and _results_now() == before


def test_a_bench_run_carries_no_small_note():
    assert "Note:" not in report.all_tables(synthetic_run())
    assert report.SMALL_NOTE in report.all_tables({**synthetic_run(), "size": "small"})


def test_results_with_a_quick_flag_and_no_size_render_as_small_or_bench():
    run = synthetic_run()
    del run["size"]
    assert report.run_size({**run, "quick": True}) == "small"
    assert report.SMALL_NOTE in report.all_tables({**run, "quick": True})
    assert report.run_size({**run, "quick": False}) == "bench"
    assert "Note:" not in report.all_tables({**run, "quick": False})


def test_codec_table_leaves_out_zipnn_when_it_did_not_run():
    codec = synthetic_run()["suites"]["codec"]
    text = report.codec_table({**codec, "hardware": {}, "date": ""}, hardware=False)
    assert "zipnn |" not in text.splitlines()[0] and report.ZIPNN_MISSING in text
    assert "| bench model, lr 1e-06, gap 1 | 1.18% | **127.0x** | 55.5x | 64.7x | 56.6x | 140.1x |" in text
    ran = dict(codec["runs"][0]["schemes"][0], name="zipnn", ratio_vs_raw=50.0)
    codec["runs"][0]["schemes"][-1] = ran
    text = report.codec_table({**codec, "hardware": {}, "date": ""}, hardware=False)
    assert "| PULSE | zipnn |" in text and "| 56.6x | 50.0x | 140.1x |" in text and report.ZIPNN_MISSING not in text


def test_readme_codec_table_is_the_committed_run_rendered():
    import json

    doc = json.loads((RESULTS / "2026-11-23-amdepyc-2core-nogpu.json").read_text())
    table = report.codec_table({**doc["suites"]["codec"], "hardware": doc["hardware"], "date": doc["date"]},
                               hardware=False)
    assert table in (ROOT / "README.md").read_text()


def test_host_tag_names_the_chip_cores_and_gpu():
    assert host_tag({"cpu": "Intel(R) Xeon(R) Platinum", "cores": 2, "gpu": None}) == "xeon-2core-nogpu"
    assert host_tag({"cpu": "AMD EPYC", "cores": 2, "gpu": None}) == "amdepyc-2core-nogpu"
    assert stem({"cpu": "AMD EPYC", "cores": 8, "gpu": "H100"}, "2026-01-02") == "2026-01-02-amdepyc-8core-gpu"


def _fake_history(mode: str, n: int = 30) -> list[dict]:
    return [{"step": i + 1, "t": 0.1 * (i + 1) * (1 if mode == "async" else 3), "reward": 0.1 + 0.01 * (i % 7),
             "samples_per_s": 100.0 + i, "staleness": {"0": 8} if mode == "sync" else {"0": 4, str(i % 4): 4}}
            for i in range(n)]


def _fake_run(cfg):
    class Result:
        summary = {"samples_per_s": 100.0 if cfg.mode == "sync" else 200.0, "tokens_per_s": 1000.0, "wall_s": 1.0,
                   "reward_first": 0.1, "reward_last": 0.2, "dropped_stale": 0, "staleness_hist": {"0": 1},
                   "versions_spanned_hist": {"1": 1}, "trainer": {"idle_pct": 1.0}, "samplers": {"idle_pct": 1.0},
                   "sync": {}, "history": _fake_history(cfg.mode)}
    return Result()


@pytest.mark.parametrize("give_out", [True, False])
def test_bench_loop_writes_where_told_with_the_shared_host_tag(monkeypatch, tmp_path, give_out):
    pytest.importorskip("matplotlib")
    import trainer.loop

    from wsync import cli

    monkeypatch.setattr(trainer.loop, "run", _fake_run)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    before = _results_now()
    out = tmp_path / "out" if give_out else tmp_path / "home" / ".cache" / "wsync" / "results"
    assert cli.main(["bench", "loop", "--repeats", "1", "--quiet"] + (["--out", str(out)] if give_out else [])) == 0
    name = f"{stem(describe())}-loop"  # the same tag `wsync bench all` names its files with
    assert sorted(p.name for p in out.iterdir()) == [f"{name}.json", f"{name}.png"]
    assert _results_now() == before


def test_loop_plot_smooths_and_has_three_panels(tmp_path):
    pytest.importorskip("matplotlib")
    from trainer.metrics import mean_staleness, plot, plot_runs, rolling_mean

    assert rolling_mean([1, 2, 3, 4], 2) == [1, 1.5, 2.5, 3.5]
    assert mean_staleness({"staleness": {"0": 2, "2": 2}}) == 1.0
    png = tmp_path / "both.png"
    assert plot_runs([{"label": "sync", "mode": "sync", "steps": _fake_history("sync")},
                      {"label": "async", "mode": "async", "steps": _fake_history("async")}], png, "t")
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert plot(_fake_history("async"), tmp_path / "one.png", "async")  # `wsync loop --png`: one run, same panels


def test_plot_draws_what_it_was_given(tmp_path, monkeypatch):
    """Three axes; per run a faint raw reward line under its rolling mean, throughput and staleness."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from trainer.metrics import plot_runs

    figs = []
    monkeypatch.setattr(plt, "close", lambda fig: figs.append(fig))
    plot_runs([{"label": "sync", "mode": "sync", "steps": _fake_history("sync")},
               {"label": "async", "mode": "async", "steps": _fake_history("async")}], tmp_path / "p.png")
    rw, tp, st = figs[0].axes
    assert len(rw.lines) == 4 and [ln.get_alpha() for ln in rw.lines[::2]] == [0.25, 0.25]
    assert [ln.get_label() for ln in tp.lines] == ["sync", "async"] and len(st.lines) == 2
    assert max(st.lines[0].get_ydata()) == 0 and max(st.lines[1].get_ydata()) > 0
