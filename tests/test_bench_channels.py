"""Smoke run of `wsync bench channels` at its smallest size: the command line end to end, into a results folder.

    python -m pytest tests/test_bench_channels.py -m slow

It checks what does not depend on the machine: every release reached every engine bit-exact (the suite stops
otherwise), each mode sent what it claims (deltas, keyframes), the rollback spans the promotions since v_old,
a keyframe carries the whole state and a delta a small part of it, and the files name the hardware. Times are
only checked to be there, never compared.
"""
from __future__ import annotations

import json

import pytest

from wsync.cli import main
from wsync_bench import channels

pytestmark = pytest.mark.slow  # engine processes and two hubs: seconds, so CI's slow stage


def test_channels_smoke_run_saves_exact_rollbacks_and_promotions_with_the_hardware(tmp_path, capsys):
    args = ["bench", "channels", "--size", "tiny", "--engines", "2", "--steps", "2", "--rounds", "1",
            "--warmup", "0", "--out", str(tmp_path)]
    assert main(args) == 0
    assert "rollback keyframe over delta" in capsys.readouterr().out
    (js,) = tmp_path.glob("*-channels-4mib-2eng.json")
    assert js.with_suffix(".md").read_text().startswith("# wsync bench channels")
    doc = json.loads(js.read_text())
    assert doc["hardware"]["cpu"] and doc["hardware"]["cores"] >= 1 and doc["hardware_line"]
    assert doc["command"].startswith("wsync bench channels --size tiny")
    size = doc["state"]["bytes"]
    assert size == channels.state_bytes("tiny") and doc["state"]["tensors"] == len(channels.layout("tiny"))

    assert [r["mode"] for r in doc["results"]] == list(channels.MODES)
    for r in doc["results"]:
        ops = r["ops"]
        assert [op["kind"] for op in ops] == ["initial", "promote", "promote", "promote", "rollback"]
        assert all(op["exact"] and len(op["wire_bytes"]) == 2 for op in ops)
        assert [op["release"] for op in ops] == list(range(len(ops)))
        rollback = ops[-1]
        assert rollback["version"] == ops[1]["version"] and rollback["span_steps"] == 2
        assert ops[0]["keyframe"] and all(op["keyframe"] == (r["mode"] == "keyframe") for op in ops[1:])
        for op in ops:
            assert 0 <= op["first_live_s"] <= op["all_live_s"] and op["call_s"] >= 0
            if op["keyframe"]:
                assert min(op["wire_bytes"]) >= size
            else:  # a step moves about 1% of the values: its delta is a small part of the state
                assert max(op["wire_bytes"]) < size / 4

    s = doc["summary"]
    for mode in channels.MODES:
        assert set(s[mode]) == {"promote", "rollback"} and all(k["exact"] for k in s[mode].values())
    assert s["keyframe"]["rollback"]["keyframe"] and not s["reverse-delta"]["rollback"]["keyframe"]
    for kind in ("rollback", "promote"):
        r = doc["ratios"][f"{kind}_keyframe_over_delta"]
        assert r["wire_bytes"] > 4 and r["all_live_s"] > 0
    assert 0 < doc["engine_peak_rss"] and doc["memory_estimate"] > 2 * size


def test_the_memory_check_refuses_a_run_that_cannot_fit(monkeypatch):
    monkeypatch.setattr(channels, "_proc", lambda path, key: 1 << 30)
    with pytest.raises(ValueError, match="needs about"):
        channels.run(channels.Config(size="bench", engines=8))
