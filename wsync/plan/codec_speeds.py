"""Encode/apply speeds of our codecs, read from the benchmark results this repo keeps.

`wsync bench codec --json` writes `benchmarks/results/<date>-<host>-codec.json`:
per snapshot pair (learning rate, step gap) and per scheme, the compression
ratio and encode/decode GB/s of model bytes, with the hardware named. The
planner takes the newest such file and, for a delta, the run whose measured
saving is nearest to the one assumed, so speed and density belong together.
When no results file is reachable (an installed wheel), the figures below,
copied from the 2026-11-21 run, stand in and say so.

`wsync bench codec` times the reference backend. For a delta the planner
prefers the C++ backend's end-to-end speeds from the newest
`*-kernels.json` (`python -m wsync.bench.kernels`, the `cpu` backend's
encode/apply GB/s, measured on the sparse tier). The packed tier adds a zstd
stage the kernels file does not time; its cost per model byte is taken from
the codec file as the packed-minus-sparse time of the same run, since both
backends hand that stage to the same zstd library.
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


def newest_kernels(directory: Path = RESULTS_DIR) -> Path | None:
    files = sorted(directory.glob("*-kernels.json")) if directory.is_dir() else []
    return files[-1] if files else None


def kernel_speed(path: Path, backend: str = "cpu") -> tuple[float, float, float, str]:
    """(encode GB/s, apply GB/s, saving, where) of `backend` in a `wsync.bench.kernels` results file."""
    try:
        data = json.loads(path.read_text())
        b = data["backends"][backend]
        enc, app = float(b["encode_gbps"]), float(b["apply_gbps"])
        saving = 1.0 - b["payload_bytes"] / data["model_bytes"]
        hw = data.get("hardware", {})
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ZeroDivisionError) as e:
        raise PlanError(f"cannot read the {backend!r} backend from kernel results {path}: {e!r}") from e
    where = (f"{path.name}: backend {backend} ({b.get('threads', '?')} threads), sparse tier at "
             f"{data.get('density', 0):.2%} density, {hw.get('cpu', '?')}, {hw.get('cores', '?')} cores")
    return enc, app, saving, where


def measured_speed(kind: str, *, saving: float = 0.98, tier: str = "packed", results: Path | None = None,
                   kernels: Path | None = None) -> CodecSpeed:
    """Speed of codec `kind` (full, delta, lora): C++ kernels for a delta when measured, else the codec file.

    An explicit `results` file is used as given; the kernels file is looked up only when
    neither is named.
    """
    ref, label = _codec_speed(kind, saving=saving, tier=tier, results=results)
    if kind != "delta":
        return ref
    path = kernels or (None if results else newest_kernels())
    if path is None:
        return ref
    enc, app, k_saving, where = kernel_speed(path)
    if tier == "sparse":
        return CodecSpeed(encode_gbps=enc, apply_gbps=app, saving=k_saving,
                          source=f"{where}; preferred over the ref backend's {ref.encode_gbps:.2f}/"
                                 f"{ref.apply_gbps:.2f} GB/s ({ref.source})")
    sparse, _ = _codec_speed(kind, saving=ref.saving, tier="sparse", results=results, label=label)
    # seconds per model byte of the zstd stage = packed - sparse, same run, same library in every backend
    z_enc = max(1 / ref.encode_gbps - 1 / sparse.encode_gbps, 0.0)
    z_app = max(1 / ref.apply_gbps - 1 / sparse.apply_gbps, 0.0)
    return CodecSpeed(encode_gbps=1 / (1 / enc + z_enc), apply_gbps=1 / (1 / app + z_app), saving=ref.saving,
                      source=f"{where}, plus the zstd stage timed as packed - sparse in {ref.source}")


def _codec_speed(kind: str, *, saving: float, tier: str, results: Path | None,
                 label: str | None = None) -> tuple[CodecSpeed, str | None]:
    """Speed of codec `kind` from the newest `wsync bench codec` file (or the built-in copy), and its run label.

    With `label`, only that run is read (the packed and sparse figures of one run belong together).
    """
    key = f"delta/{tier}" if kind == "delta" else kind
    if key not in SCHEMES:
        raise PlanError(f"no measured speed for codec {kind!r} tier {tier!r}; use full, lora, or delta "
                        "with tier packed or sparse")
    scheme = SCHEMES[key]
    path = results or newest_results()
    if path is None:
        s, enc, app = _FALLBACK[scheme]
        return CodecSpeed(encode_gbps=enc, apply_gbps=app, saving=s, source=_FALLBACK_SOURCE), None
    runs, where = _runs(path)
    found = []
    for run in runs:
        for sch in run.get("schemes", []):
            if sch.get("name") == scheme and label in (None, run["label"]):
                found.append((1.0 - 1.0 / sch["ratio_vs_raw"], sch["encode_gbps"], sch["decode_gbps"], run["label"]))
    if not found:
        raise PlanError(f"{path} has no {scheme!r} runs; re-run `wsync bench codec --json` or pass speeds")
    if kind == "delta":  # the run whose density matches the assumed saving
        s, enc, app, label = min(found, key=lambda f: abs(f[0] - saving))
    else:  # raw speed barely depends on the snapshots: take the median run
        s, enc, app, label = sorted(found, key=lambda f: f[1])[len(found) // 2]
    return CodecSpeed(encode_gbps=enc, apply_gbps=app, saving=s, source=f"{where}; {scheme}, {label}"), label


@dataclass(frozen=True, kw_only=True)
class TensorCost:
    """Seconds each tensor adds to a sync beyond its bytes, at each end (from `wsync bench codec --shape moe`)."""

    encode_s: float
    apply_s: float
    source: str = ""


# 2026-11-23, AMD EPYC 2 cores, cpu backend: 20,000 x 1,024 bf16 vs one tensor, 1% changed. Format 2 codes
# segments, so the extra cost per tensor measured at or below the noise (taken as zero here); format 1 (wsync 0.1)
# paid ~100 us per tensor at each end, on the same machine and states.
_TENSOR_FALLBACK = TensorCost(encode_s=0.0, apply_s=0.0,
                              source="built-in copy of the 2026-11-23 EPYC 2-core moe run (format 2: no measurable "
                                     "per-tensor cost)")


def newest_moe(directory: Path = RESULTS_DIR) -> Path | None:
    files = sorted(directory.glob("*-moe.json")) if directory.is_dir() else []
    return files[-1] if files else None


def tensor_cost(path: Path | None = None) -> TensorCost:
    """The per-tensor cost the newest many-vs-one benchmark measured (negative noise counts as zero)."""
    path = path or newest_moe()
    if path is None:
        return _TENSOR_FALLBACK
    try:
        data = json.loads(path.read_text())
        per = data["per_tensor_s"]
        hw = data.get("hardware", {})
        enc, app = max(float(per["encode_s"]), 0.0), max(float(per["apply_s"]), 0.0)
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise PlanError(f"cannot read the per-tensor cost in {path}: {e!r}") from e
    return TensorCost(encode_s=enc, apply_s=app,
                      source=f"{path.name}: {data.get('tensors')} x {data.get('elems')} vs one tensor, "
                             f"{hw.get('cpu', '?')}, {hw.get('cores', '?')} cores")
