"""Encode/apply speeds of our codecs, read from the benchmark results this repo keeps.

`wsync bench codec --json` writes `benchmarks/results/<date>-<host>-codec.json`:
per snapshot pair (learning rate, step gap) and per scheme, the compression
ratio and encode/decode GB/s of model bytes, with the hardware named. The
planner takes the newest such file and, for a delta, the run whose measured
saving is nearest to the one assumed, so speed and density belong together.
When no results file is reachable (an installed wheel), the figures below,
copied from the 2026-11-21 run, stand in and say so.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .models import PlanError

RESULTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"

# scheme names in the results file per codec kind (LoRA adapters travel as raw tensors)
SCHEMES = {"full": "raw", "lora": "raw", "delta/packed": "wsync-packed", "delta/sparse": "wsync-sparse"}

# 2026-11-21, Intel Xeon 2 cores, no GPU, ref backend: (saving, encode GB/s, apply GB/s) at lr 1e-6 gap 1
_FALLBACK = {"raw": (0.0, 0.70, 2.02), "wsync-packed": (1 - 1 / 127.0, 0.68, 0.76),
             "wsync-sparse": (1 - 1 / 55.5, 0.86, 0.84)}
_FALLBACK_SOURCE = "built-in copy of 2026-11-21 Xeon 2-core ref-backend run (lr 1e-6, gap 1)"


@dataclass(frozen=True, kw_only=True)
class CodecSpeed:
    encode_gbps: float  # GB of model (or adapter) bytes encoded per second, one worker
    apply_gbps: float  # GB applied per second on the engine side, one worker
    saving: float = 0.0  # measured fraction of bytes saved in the run the speeds come from
    source: str = ""  # file, run and hardware the numbers were measured on

    def __post_init__(self):
        if self.encode_gbps <= 0 or self.apply_gbps <= 0:
            raise PlanError(f"codec speeds must be positive GB/s, got encode {self.encode_gbps}, "
                            f"apply {self.apply_gbps}")


def newest_results(directory: Path = RESULTS_DIR) -> Path | None:
    files = sorted(directory.glob("*codec*.json")) if directory.is_dir() else []
    return files[-1] if files else None


def _runs(path: Path) -> tuple[list[dict], str]:
    try:
        data = json.loads(path.read_text())
        hw = data.get("hardware", {})
        backend = str(hw.get("wsync_backend", "?")).split()[0]
        where = f"{path.name}: {hw.get('cpu', '?')}, {hw.get('cores', '?')} cores, gpu {hw.get('gpu')}, backend {backend}"
        return data["runs"], where
    except (OSError, json.JSONDecodeError, KeyError) as e:
        raise PlanError(f"cannot read codec results {path}: {e}") from e


def measured_speed(kind: str, *, saving: float = 0.98, tier: str = "packed",
                   results: Path | None = None) -> CodecSpeed:
    """Speed of codec `kind` (full, delta, lora) from the newest results file, or the built-in copy."""
    key = f"delta/{tier}" if kind == "delta" else kind
    if key not in SCHEMES:
        raise PlanError(f"no measured speed for codec {kind!r} tier {tier!r}; use full, lora, or delta "
                        "with tier packed or sparse")
    scheme = SCHEMES[key]
    path = results or newest_results()
    if path is None:
        s, enc, app = _FALLBACK[scheme]
        return CodecSpeed(encode_gbps=enc, apply_gbps=app, saving=s, source=_FALLBACK_SOURCE)
    runs, where = _runs(path)
    found = []
    for run in runs:
        for sch in run.get("schemes", []):
            if sch.get("name") == scheme:
                found.append((1.0 - 1.0 / sch["ratio_vs_raw"], sch["encode_gbps"], sch["decode_gbps"], run["label"]))
    if not found:
        raise PlanError(f"{path} has no {scheme!r} runs; re-run `wsync bench codec --json` or pass speeds")
    if kind == "delta":  # the run whose density matches the assumed saving
        s, enc, app, label = min(found, key=lambda f: abs(f[0] - saving))
    else:  # raw speed barely depends on the snapshots: take the median run
        s, enc, app, label = sorted(found, key=lambda f: f[1])[len(found) // 2]
    return CodecSpeed(encode_gbps=enc, apply_gbps=app, saving=s, source=f"{where}; {scheme}, {label}")
