"""`wsync plan transfer --backend cuda` reads whole syncs measured on a GPU (`wsync bench gpu-sync`'s
JSON, carried into the measured inputs) before kernel figures, and says so when there is none yet."""
from __future__ import annotations

import json

import pytest

from wsync.cli import main
from wsync.plan import measured
from wsync.plan.gpu_speeds import codec_speed
from wsync.plan.gpu_sync import e2e_tensor_cost, newest_gpu_sync

DENSE, MOE, TENSORS = 16e9, 4e9, 20_000


def _stage(codec: str, p2l: float, apply_s: float, wire: float, *, exact=True, keyframes=0, tier="packed") -> dict:
    def s(x):
        return {"min": x, "median": x, "max": x, "n": 3}

    return {"ok": True, "error": None, "transport": "local://", "codec": codec,
            "tier": tier if codec == "delta" else None, "publish_to_live_s": s(p2l), "apply_s": s(apply_s), "blocked_s": s(0.01), "wire_bytes": s(wire),
            "keyframes": keyframes, "exact": exact}


def _run(path, *, gpu="NVIDIA H100 80GB HBM3", device="cuda:0", size="full", created="2026-12-01T10:00:00+00:00",
         raw=(2.0, 0.5), delta=(1.0, 0.25), delta_exact=True):
    """A `wsync bench gpu-sync` result: per stage publish -> live and the engine's apply (seconds)."""
    # the moe stages: the dense stages' per-byte time for 4 GB, plus 1e-5 s (encode) and 2e-6 s (apply) per tensor
    def moe(p2l, apply_s):
        enc, app = (p2l - apply_s) * MOE / DENSE + TENSORS * 1e-5, apply_s * MOE / DENSE + TENSORS * 2e-6
        return enc + app, app

    stages = {"dense.d2d": {"ok": True, "copy_s": {"median": 0.01}},
              "dense.raw_local": _stage("raw", *raw, DENSE), "dense.delta_local": _stage("delta", *delta, 3.2e8,
                                                                                           exact=delta_exact),
              "dense.delta_tcp": {"ok": False, "error": "WaitTimeout: engine still at version 0", "exact": None},
              "moe.raw_local": _stage("raw", *moe(*raw), MOE), "moe.delta_local": _stage("delta", *moe(*delta), 8e7)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "bench": "gpu_sync", "schema": 1, "created": created, "size": size, "device": f"{device} ({gpu})",
        "machine": {"device": device, "gpu": gpu if device != "cpu" else None, "cpu": "Xeon"},
        "states": {"dense": {"bytes": DENSE, "tensors": 399}, "moe": {"bytes": MOE, "tensors": TENSORS}},
        "stage_names": list(stages), "stages": stages}))
    return path


@pytest.fixture
def results(tmp_path, monkeypatch):
    packaged = measured.inputs()  # the codec runs the package ships, and these GPU runs as the script would add them
    monkeypatch.setattr(measured, "inputs", lambda: {**packaged, "gpu_sync": measured.extract(tmp_path)["gpu_sync"]})
    return tmp_path


def test_without_a_gpu_run_it_says_so_and_prices_as_before(results, capsys):
    _run(results / "2026-12-02-amdepyc-gpu-sync" / "gpu_sync.json", device="cpu")  # the script's logic on a CPU
    _run(results / "2026-12-03-h100-small-gpu_sync.json", size="small")  # a smoke run: not the real shapes
    assert newest_gpu_sync() is None
    before = codec_speed("full", backend="cuda")
    assert before.basis == "bound" and "no cuda run" in before.source
    assert main(["plan", "transfer", "--model", "qwen3-8b", "--link", "rdma-3.2t", "--backend", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "no end-to-end GPU run in the measured inputs yet" in out and "Priced as before" in out
    assert "BOUND, not measured" in out
    assert main(["plan", "transfer", "--model", "qwen3-8b", "--backend", "cuda", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert all(r["gpu_e2e"].startswith("no end-to-end GPU run") and r["speed_basis"] == "bound" for r in rows)


def test_other_backends_do_not_mention_it(results, capsys):
    _run(results / "2026-12-01-h100-runbook" / "gpu_sync.json")
    assert main(["plan", "transfer", "--model", "qwen3-8b", "--backend", "gpu-bound:h100", "--json"]) == 0
    assert all("gpu_e2e" not in r for r in json.loads(capsys.readouterr().out))
    assert main(["plan", "transfer", "--model", "qwen3-8b", "--backend", "gpu-bound:h100"]) == 0
    assert "end to end" not in capsys.readouterr().out


def test_the_newest_gpu_run_prices_the_device_path(results, capsys):
    _run(results / "2026-11-30-h100-runbook" / "gpu_sync.json", created="2026-11-30T10:00:00+00:00", raw=(9.0, 1.0))
    _run(results / "2026-12-01-h100-runbook" / "gpu_sync.json")
    run = newest_gpu_sync()
    assert run.file == "2026-12-01-h100-runbook/gpu_sync.json"
    full = codec_speed("full", backend="cuda")  # raw over local://: apply apart, the rest is the encode side
    assert (full.basis, full.backend) == ("measured", "cuda")
    assert full.encode_gbps == pytest.approx(DENSE / 1.5 / 1e9) and full.apply_gbps == pytest.approx(DENSE / 0.5 / 1e9)
    assert "2026-12-01-h100-runbook/gpu_sync.json" in full.source and "raw_local" in full.source
    delta = codec_speed("delta", backend="cuda")
    assert delta.encode_gbps == pytest.approx(DENSE / 0.75 / 1e9) and delta.saving == pytest.approx(1 - 3.2e8 / DENSE)
    assert codec_speed("lora", backend="cuda").encode_gbps == pytest.approx(full.encode_gbps)  # adapters go raw
    cost = e2e_tensor_cost("delta", run)  # the 20,000-tensor state's time beyond its bytes, per tensor
    assert (cost.encode_s, cost.apply_s) == (pytest.approx(1e-5), pytest.approx(2e-6))

    assert main(["plan", "transfer", "--model", "qwen3-30b-a3b", "--link", "rdma-3.2t", "--backend", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "end to end, measured: 2026-12-01-h100-runbook/gpu_sync.json (NVIDIA H100 80GB HBM3" in out
    assert "dense.raw_local: publish -> live min 2 / median 2 s over 3 versions" in out
    assert "dense.delta_tcp: no reading (WaitTimeout: engine still at version 0)" in out
    assert "per-tensor cost: 2026-12-01-h100-runbook/gpu_sync.json" in out and "20,000-tensor moe state" in out
    assert main(["plan", "transfer", "--model", "qwen3-8b", "--link", "rdma-3.2t", "--backend", "cuda",
                 "--codec", "full", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["speed_basis"] == "measured" and row["gpu_e2e"].startswith("2026-12-01-h100-runbook/gpu_sync.json")
    assert row["encode_s"] == pytest.approx(row["gb"] * 1e9 / (DENSE / 1.5) + row["tensor_s"] * 1e-5 / (1e-5 + 2e-6),
                                            rel=1e-6)


def test_a_stage_that_was_not_bit_exact_is_not_priced_from(results):
    _run(results / "2026-12-01-h100-runbook" / "gpu_sync.json", delta_exact=False)
    assert codec_speed("full", backend="cuda").basis == "measured"
    delta = codec_speed("delta", backend="cuda")  # as before: no cuda codec run here, so the bound
    assert delta.basis == "bound" and "gpu_sync.json" not in delta.source
    assert e2e_tensor_cost("delta", newest_gpu_sync()) is None


def test_a_named_gpu_gets_its_own_run_when_there_is_one(results):
    _run(results / "2026-12-01-h100-runbook" / "gpu_sync.json", raw=(3.0, 1.0))
    _run(results / "2026-12-02-h200-runbook" / "gpu_sync.json", gpu="NVIDIA H200", created="2026-12-02T10:00:00+00:00")
    assert "H200" in codec_speed("full", backend="cuda").source  # the newest
    h100 = codec_speed("full", backend="cuda:h100")
    assert "H100" in h100.source and h100.encode_gbps == pytest.approx(DENSE / 2.0 / 1e9)
    b200 = codec_speed("full", backend="cuda:b200")  # none on that GPU: the newest, saying where it ran
    assert "measured on NVIDIA H200, not the b200 asked" in b200.source


def test_delta_versions_that_landed_whole_are_named(results):
    _run(results / "2026-12-01-h100-runbook" / "gpu_sync.json")
    path = results / "2026-12-01-h100-runbook" / "gpu_sync.json"
    data = json.loads(path.read_text())
    data["stages"]["dense.delta_local"]["keyframes"] = 3
    path.write_text(json.dumps(data))
    assert "3 of 3 versions landed as keyframes" in codec_speed("delta", backend="cuda").source
    assert "keyframes" not in codec_speed("full", backend="cuda").source  # raw versions are whole by design
