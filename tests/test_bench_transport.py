"""`wsync bench transport` end to end on small sizes: both runs happen, bytes are checked, a baseline is reported."""
from __future__ import annotations

import json

import pytest
import xxhash

from wsync_bench import transport as bench
from wsync.cli import main as cli


@pytest.mark.parametrize("transport", ["local", pytest.param("gloo", marks=pytest.mark.slow)])
def test_cli_reports_baseline_and_ours(transport, tmp_path, capsys):
    if transport == "gloo":
        pytest.importorskip("torch")
    out = tmp_path / "r.json"
    assert cli(["bench", "transport", "--transport", transport, "--size", "3M", "--repeats", "2",
                "--chunk", "1M", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "raw baseline" in text and "wsync link" in text and "ratio" in text
    res = json.loads(out.read_text())
    assert res["transport"] == transport and res["size"] == 3 << 20
    for kind in ("raw", "ours"):
        run = res["runs"][kind]
        assert len(run["seconds"]) == 2 and all(s > 0 for s in run["seconds"]) and run["gbps_median"] > 0
    assert res["ratio_median"] == pytest.approx(res["runs"]["ours"]["gbps_median"] / res["runs"]["raw"]["gbps_median"])
    assert res["hardware"]["cpu"] and res["checked"].startswith("xxh3")


@pytest.mark.slow
def test_ucx_bench_runs_where_ucxx_is_installed():
    pytest.importorskip("ucxx")
    res = bench.run("ucx", 1 << 20, repeats=1)
    assert res["runs"]["raw"]["gbps_median"] > 0 and res["runs"]["ours"]["gbps_median"] > 0


def test_payload_is_stamped_so_pieces_cannot_swap_unnoticed():
    a = bench.payload((3 << 20) + 5, 7)
    assert len(a) == (3 << 20) + 5
    blocks = [a[i << 20:(i + 1) << 20].tobytes() for i in range(3)]
    assert len(set(blocks)) == 3  # equal MiB blocks would hide reordered pieces
    assert xxhash.xxh3_64_digest(a) == xxhash.xxh3_64_digest(bench.payload((3 << 20) + 5, 7))


def test_summary_ratios():
    rows = [{"kind": k, "rep": r, "warmup": r == 0, "seconds": s, "ok": True}
            for r, (raw, ours) in enumerate([(9.0, 9.0), (1.0, 2.0), (1.0, 1.0), (2.0, 2.0)]) for k, s in (("raw", raw), ("ours", ours))]
    spec = {"transport": "tcp", "size": 10**9, "streams": 1, "chunk": 1, "repeats": 3}
    res = bench._summarise(spec, rows, {"cpu": "x"})
    assert res["runs"]["raw"]["seconds"] == [1.0, 1.0, 2.0]  # the warm-up is left out
    assert res["runs"]["raw"]["gbps_median"] == 1.0 and res["runs"]["ours"]["gbps_median"] == 0.5
    assert res["ratio_median"] == 0.5 and res["ratio_best"] == 1.0


def test_bad_arguments_exit_2(capsys):
    assert cli(["bench", "transport", "--transport", "local", "--size", "12Q"]) == 2
    assert "bad size" in capsys.readouterr().err
    assert cli(["bench", "transport", "--transport", "local", "--size", "1M", "--repeats", "0"]) == 2


def test_wrong_bytes_fail_the_run():
    from wsync.errors import TransportError

    rows = [{"kind": "ours", "rep": 1, "warmup": False, "seconds": 1.0, "ok": True},
            {"kind": "ours", "rep": 2, "warmup": False, "seconds": 1.0, "ok": False}]
    with pytest.raises(TransportError, match="1 moves delivered wrong bytes"):
        bench._check_rows(rows)
