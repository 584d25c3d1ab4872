"""The planner's measured inputs: one JSON file inside the package, generated from the benchmark results.

`scripts/planner_inputs.py` runs `extract()` over benchmarks/results and writes
`render()` of it to DATA; the planner reads DATA only, so an installed wheel and
a checkout give the same answers. Every entry keeps the results file it came
from and the machine that ran it. The readers of the results files' own
formats live here too, for the script and for a results file named on the
command line.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from .models import PlanError

DATA = Path(__file__).resolve().parent / "data" / "measured.json"
WHERE = "wsync/plan/data/measured.json (scripts/planner_inputs.py, from benchmarks/results)"

_SCHEME_KEYS = ("name", "ratio_vs_raw", "encode_gbps", "decode_gbps")
_KERNEL_KEYS = ("threads", "encode_gbps", "apply_gbps", "payload_bytes")
_STAGE_KEYS = ("ok", "error", "exact", "transport", "codec", "tier", "keyframes", "publish_to_live_s", "apply_s",
               "blocked_s", "wire_bytes", "copy_s")
GPU_SYNC_BENCH = "gpu_sync"


def machine(hw: dict) -> dict:
    """What a results file says about the machine it ran on: the fields the planner names."""
    hw = hw if isinstance(hw, dict) else {}
    return {"cpu": hw.get("cpu", "?"), "cores": hw.get("cores", "?"), "gpu": hw.get("gpu"),
            "backend": str(hw.get("wsync_backend", "?")).split()[0]}


def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"cannot read results {path}: {e}") from e


def codec_entry(path: Path, name: str | None = None) -> dict | None:
    """The codec runs of a `wsync bench codec --json` or `wsync bench all` file (None: it has none)."""
    data = _read(path)
    if not isinstance(data, dict):
        return None
    runs = data.get("runs") if "runs" in data else (data.get("suites") or {}).get("codec", {}).get("runs")
    if not isinstance(runs, list) or not isinstance(data.get("hardware", {}), dict):
        return None
    kept = []
    for run in runs:
        schemes = [{k: s[k] for k in _SCHEME_KEYS if k in s} for s in (run.get("schemes") or [])
                   if isinstance(run, dict) and isinstance(s, dict) and "encode_gbps" in s]
        if schemes:
            kept.append({"label": run.get("label", "?"), "schemes": schemes})
    if not kept:
        return None
    return {"file": name or path.name, "machine": machine(data.get("hardware", {})), "runs": kept}


def kernels_entry(path: Path, name: str | None = None) -> dict:
    """A `wsync bench kernels --json` file: each backend's sparse-tier kernel speeds."""
    data = _read(path)
    try:
        backends = {b: {k: v[k] for k in _KERNEL_KEYS if k in v} for b, v in data["backends"].items()}
        return {"file": name or path.name, "machine": machine(data.get("hardware", {})),
                "model_bytes": data["model_bytes"], "density": data.get("density", 0), "backends": backends}
    except (KeyError, TypeError, AttributeError) as e:
        raise PlanError(f"cannot read the backends of kernel results {path}: {e!r}") from e


def moe_entry(path: Path, name: str | None = None) -> dict:
    """A `wsync bench codec --shape moe --json` file: the seconds each tensor adds beyond its bytes."""
    data = _read(path)
    try:
        per = {k: float(data["per_tensor_s"][k]) for k in ("encode_s", "apply_s")}
    except (KeyError, TypeError, ValueError) as e:
        raise PlanError(f"cannot read the per-tensor cost in {path}: {e!r}") from e
    return {"file": name or path.name, "machine": machine(data.get("hardware", {})), "tensors": data.get("tensors"),
            "elems": data.get("elems"), "per_tensor_s": per}


def gpu_sync_entry(path: Path, name: str) -> dict | None:
    """A `wsync bench gpu-sync` result, its stages cut to what the planner prices from."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict) or data.get("bench") != GPU_SYNC_BENCH:
        return None
    stages = {n: {k: st[k] for k in _STAGE_KEYS if k in st} if isinstance(st, dict) else st
              for n, st in (data.get("stages") or {}).items()}
    return {"file": name, "machine": data.get("machine") or {}, "bench": GPU_SYNC_BENCH, "created": data.get("created"),
            "size": data.get("size"), "states": data.get("states") or {}, "stage_names": data.get("stage_names") or [],
            "stages": stages}


def loop_entry(path: Path, name: str | None = None) -> dict | None:
    """A `wsync bench loop` file: its arguments and runs, as the loop validation reads them (None: not one)."""
    data = _read(path)
    if not isinstance(data, dict) or "runs" not in data or "args" not in data:
        return None
    return {"file": name or path.name, "machine": machine(data.get("hardware", {})), "args": data["args"],
            "runs": data["runs"]}


def quant_entry(path: Path, name: str | None = None) -> dict:
    """A `wsync bench quant` file: per quantization and learning rate, the fractions of codes, scales and BF16
    values changed per version and the delta bytes per changed element of each part."""
    data = _read(path)
    try:
        schemes = {}
        for scheme, s in data["schemes"].items():
            per = {lr: {"fraction_changed": {k: float(v) for k, v in p["fraction_changed"].items()},
                        "bytes_per_changed": {k: float(v) for k, v in p["bytes_per_changed"].items()},
                        "versions": int(p["versions"])} for lr, p in s["per_version"].items()}
            schemes[scheme] = {"config": s["config"], "exact": bool(s["exact"]), "per_version": per,
                               "quantize_vs_bf16_delta_encode": float(s["timing"]["ratio"])}
        return {"file": name or path.name, "machine": machine(data.get("hardware", {})), "source": data["source"],
                "experts": data["state"]["experts"], "schemes": schemes}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise PlanError(f"cannot read the quantized deltas of {path}: {e!r}") from e


def extract(results: Path) -> dict:
    """Every measured input the planner uses, from a results folder (the newest file of a kind by name)."""
    files = sorted(results.glob("*.json")) if results.is_dir() else []
    codec = [e for e in (codec_entry(p) for p in files) if e is not None]
    kernels = sorted(results.glob("*-kernels.json"))
    moe = sorted(results.glob("*-moe.json"))
    loop = [e for e in (loop_entry(p) for p in sorted(results.glob("*-loop.json"))) if e is not None]
    quant = sorted(results.glob("*-quant.json"))
    nested = sorted(set(results.glob("*gpu_sync*.json")) | set(results.glob("*/*gpu_sync*.json")))
    gpu = [e for e in (gpu_sync_entry(p, p.relative_to(results).as_posix()) for p in nested) if e is not None]
    return {"about": "the planner's measured inputs; regenerate with python3 scripts/planner_inputs.py",
            "codec": codec, "kernels": kernels_entry(kernels[-1]) if kernels else None,
            "moe": moe_entry(moe[-1]) if moe else None, "gpu_sync": gpu,
            "loop": loop[-1] if loop else None, "quant": quant_entry(quant[-1]) if quant else None}


def render(inputs: dict) -> str:
    """The file's text: sorted keys, one layout, so the same results always give the same bytes."""
    return json.dumps(inputs, indent=1, sort_keys=True, ensure_ascii=True, allow_nan=False) + "\n"


@lru_cache(maxsize=1)
def _load() -> dict:
    try:
        return json.loads(DATA.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"the planner's measured inputs are missing or unreadable ({DATA}: {e}); "
                        "reinstall wsync, or regenerate them with python3 scripts/planner_inputs.py") from e


def inputs() -> dict:
    """The packaged measured inputs (tests replace this function to plan from other results)."""
    return _load()
