"""Which codec speeds `wsync plan transfer` prices with: the fastest measured backend, a GPU bound
labelled as one, and an output that names where every speed came from."""
from __future__ import annotations

import json

import pytest

from wsync.cli import main
from wsync.plan import codec_speeds as cs
from wsync.plan import measured
from wsync.plan.gpu_speeds import bytes_moved, codec_speed, gpu_bound
from wsync.plan.models import PlanError


def _codec_file(path, backend: str, cpu: str, packed: float, sparse: float, raw: float):
    """A `wsync bench codec --json` file with one run (saving 98% packed, 95% sparse) measured on `backend`."""
    schemes = [{"name": "wsync-packed", "ratio_vs_raw": 50.0, "encode_gbps": packed, "decode_gbps": packed},
               {"name": "wsync-sparse", "ratio_vs_raw": 20.0, "encode_gbps": sparse, "decode_gbps": sparse},
               {"name": "raw", "ratio_vs_raw": 1.0, "encode_gbps": raw, "decode_gbps": raw}]
    path.write_text(json.dumps({"hardware": {"cpu": cpu, "cores": 2, "gpu": None,
                                             "wsync_backend": f"{backend} (cuda unavailable)"},
                                "runs": [{"label": "run a", "schemes": schemes}]}))
    return path


@pytest.fixture
def two_backends(tmp_path, monkeypatch):
    """A results folder with a ref run and a faster C++ (cpu) run, as the repo's own folder holds."""
    _codec_file(tmp_path / "2026-01-01-a-codec.json", "ref", "Xeon", packed=0.5, sparse=0.8, raw=0.7)
    bench_all = {"kind": "wsync bench all", "hardware": {"cpu": "EPYC", "cores": 2, "wsync_backend": "cpu"},
                 "suites": {"codec": {"runs": [{"label": "run b", "schemes": [
                     {"name": "wsync-packed", "ratio_vs_raw": 50.0, "encode_gbps": 4.0, "decode_gbps": 5.0},
                     {"name": "wsync-sparse", "ratio_vs_raw": 20.0, "encode_gbps": 8.0, "decode_gbps": 8.0},
                     {"name": "raw", "ratio_vs_raw": 1.0, "encode_gbps": 6.0, "decode_gbps": 9.0}]}]}}}
    (tmp_path / "2026-01-02-b.json").write_text(json.dumps(bench_all))
    (tmp_path / "2026-01-02-b-loop.json").write_text(json.dumps({"runs": [{"mode": "sync"}]}))  # not codec runs
    (tmp_path / "2026-01-02-b-moe.json").write_text(json.dumps({"tensors": 20000, "elems": 1024, "hardware": {},
                                                                "per_tensor_s": {"encode_s": 0.0, "apply_s": 0.0}}))
    monkeypatch.setattr(measured, "inputs", lambda: measured.extract(tmp_path))  # what the script would write
    return tmp_path


def test_fastest_measured_backend_is_chosen(two_backends):
    for kind, tier, want in (("full", "packed", 6.0), ("delta", "packed", 4.0), ("delta", "sparse", 8.0)):
        s = cs.measured_speed(kind, tier=tier)
        assert (s.encode_gbps, s.backend, s.basis) == (want, "cpu", "measured")
        assert "2026-01-02-b.json: backend cpu, EPYC, 2 cores" in s.source
        assert "fastest of 2 measured" in s.source and "ref 0." in s.source  # what it beat is named


def test_a_named_backend_is_used_even_when_slower(two_backends):
    s = cs.measured_speed("full", backend="ref")
    assert (s.encode_gbps, s.backend) == (0.7, "ref") and "2026-01-01-a-codec.json" in s.source
    with pytest.raises(PlanError, match="backend 'cuda'.*measured: cpu, ref"):
        cs.measured_speed("full", backend="cuda")


def test_kernels_of_a_faster_backend_win_over_codec_runs(two_backends):
    k = two_backends / "x-kernels.json"
    k.write_text(json.dumps({"hardware": {"cpu": "t", "cores": 2}, "model_bytes": 1000, "density": 0.01,
                             "backends": {"cpu": {"threads": 2, "encode_gbps": 16.0, "apply_gbps": 16.0,
                                                  "payload_bytes": 15},
                                          "ref": {"threads": 1, "encode_gbps": 1.0, "apply_gbps": 1.0,
                                                  "payload_bytes": 15}}}))
    s = cs.measured_speed("delta", tier="sparse")  # the newest *-kernels.json is read unasked
    assert (s.encode_gbps, s.backend) == (16.0, "cpu") and "x-kernels.json" in s.source


def test_gpu_bound_is_hbm_bandwidth_over_bytes_moved():
    assert bytes_moved("delta", 0.98) == pytest.approx((2.02, 1.04))  # read base + new, write 2%
    s = gpu_bound("delta", gpu="h100", saving=0.98, tier="sparse")
    assert s.encode_gbps == pytest.approx(3350 / 2.02) and s.apply_gbps == pytest.approx(3350 / 1.04)
    assert s.basis == "bound" and s.backend == "gpu-bound:h100"
    assert "upper bound" in s.source and "H100" in s.source and "3.35 TB/s" in s.source
    packed = gpu_bound("delta", gpu="h100", saving=0.98, tier="packed")  # zstd stays on the host
    assert packed.encode_gbps < s.encode_gbps / 10 and "zstd stage on the host" in packed.source
    with pytest.raises(PlanError, match="unknown GPU"):
        gpu_bound("full", gpu="tpu9")


def test_cuda_uses_a_measured_run_when_there_is_one(two_backends):
    bound = codec_speed("full", backend="cuda")
    assert bound.basis == "bound" and "no cuda run" in bound.source
    assert codec_speed("full", backend="cuda:h200").encode_gbps == pytest.approx(4800.0)
    _codec_file(two_backends / "2026-01-03-gpu-codec.json", "cuda", "EPYC", packed=20.0, sparse=900.0, raw=1000.0)
    got = codec_speed("full", backend="cuda")
    assert (got.encode_gbps, got.basis, got.backend) == (1000.0, "measured", "cuda")
    with pytest.raises(PlanError, match="unknown backend"):
        codec_speed("full", backend="tpu")


def test_output_names_its_speed_sources(two_backends, capsys):
    assert main(["plan", "transfer", "--model", "qwen3-8b", "--link", "rdma-3.2t"]) == 0
    out = capsys.readouterr().out
    assert "codec speeds (GB/s of model bytes per worker, --backend fastest)" in out
    assert "full: encode 6, apply 9 GB/s, measured; 2026-01-02-b.json: backend cpu, EPYC, 2 cores" in out
    assert "--backend cuda" in out  # a CPU-measured plan points GPU users at GPU speeds
    assert main(["plan", "transfer", "--model", "qwen3-8b", "--backend", "gpu-bound:h100", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["speed_basis"] for r in rows} == {"bound"} and {r["speeds"] for r in rows} == {"gpu-bound:h100"}
    assert main(["plan", "transfer", "--model", "qwen3-8b", "--backend", "gpu-bound:h100"]) == 0
    assert "BOUND, not measured" in capsys.readouterr().out
    assert main(["plan", "transfer", "--model", "qwen3-8b", "--backend", "nope"]) == 2
    assert "unknown backend 'nope'" in capsys.readouterr().err


def test_without_measured_inputs_it_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(measured, "inputs", lambda: measured.extract(tmp_path / "none"))
    for kind in ("delta", "full"):
        with pytest.raises(PlanError, match=r"no '.*' speeds measured with backend 'fastest' in wsync/plan/data/"
                                            r"measured\.json \(scripts/planner_inputs\.py"):
            cs.measured_speed(kind)
    with pytest.raises(PlanError, match="no per-tensor cost in wsync/plan/data/measured.json"):
        cs.tensor_cost()
    with pytest.raises(PlanError, match="zstd stage; use --tier sparse"):
        codec_speed("delta", backend="gpu-bound:h100")
    assert codec_speed("delta", backend="gpu-bound:h100", tier="sparse").basis == "bound"  # needs no measurement
