"""A made-up `wsync bench all` run, as its JSON holds one, for tests of what the report renders from it."""
from __future__ import annotations

HW = {"host": "box", "cpu": "Intel(R) Xeon(R) Processor", "cores": 2, "gpu": None, "python": "3.11",
      "numpy": "2", "wsync_backend": "cpu (cuda unavailable: no driver)"}


def _scheme(name, ratio, enc=1.0):
    return {"name": name, "bytes": int(1e6 / ratio), "ratio_vs_raw": ratio, "bits_per_changed": 3.0,
            "encode_gbps": enc, "decode_gbps": enc, "exact": True}


def _transport(name, raw, ours):
    return {"transport": name, "size": 256 << 20, "runs": {"raw": {"gbps_median": raw}, "ours": {"gbps_median": ours}},
            "ratio_median": ours / raw}


def synthetic_run() -> dict:
    """Every suite of a full run, with round made-up numbers and one suite that failed."""
    codec_run = {"label": "bench model, lr 1e-06, gap 1", "bound": {"density": 0.0118, "ratio_vs_raw": 140.1,
                                                                     "n_total": 1000, "total_bits": 1, "bits_per_changed": 2},
                 "schemes": [_scheme("wsync-packed", 127.0, 0.68), _scheme("wsync-sparse", 55.5), _scheme("raw", 1.0),
                             _scheme("xor_zstd", 64.7), _scheme("pulse", 56.6), {"name": "zipnn", "skipped": "not here"}],
                 "summary": {"density": 0.0118, "packed_ratio": 127.0, "packed_vs_xor_zstd": 1.96,
                             "packed_over_bound": 0.103, "sparse_ratio": 55.5, "all_exact": True}}
    sync = lambda mode, s, mb: {"mode": mode, "mean_latency_s": s, "mean_bytes": mb * 1e6, "exact": True}  # noqa: E731
    return {
        "kind": "wsync bench all", "date": "2026-11-21T20:00:00", "size": "bench", "command": "wsync bench all --size bench",
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
