"""Encode/apply speeds of our codecs, from the measured inputs the package ships (measured.py).

Two kinds of results file carry codec runs: `wsync bench codec --json`
(`*-codec.json`, runs at the top) and `wsync bench all` (`<date>-<host>.json`,
runs under suites.codec). Each run gives, per snapshot pair (learning rate,
step gap) and scheme, the compression ratio and encode/decode GB/s of model
bytes, and the file names its hardware and the wsync backend that ran (`ref`,
the readable Python reference; `cpu`, the C++ kernels; `cuda`).

A sync is priced with the fastest backend anyone measured, because that is the
one a user runs: the reference backend is the spec, not the product. Every file
is a candidate; for a delta, the run whose measured saving is nearest to the one
assumed, so speed and density belong together; the fastest encode wins, and the
speed's `source` names its file, backend and hardware, and the others it beat.
`wsync bench kernels --json` files (`*-kernels.json`) add each backend's
sparse-tier kernels; the packed tier's zstd stage, which they do not time, is
taken from a codec run as its packed-minus-sparse time, since every backend
hands that stage to the same zstd library.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from . import measured
from .models import PlanError

# scheme names in the results file per codec kind (LoRA adapters travel as raw tensors)
SCHEMES = {"full": "raw", "lora": "raw", "delta/packed": "wsync-packed", "delta/sparse": "wsync-sparse"}


@dataclass(frozen=True, kw_only=True)
class CodecSpeed:
    encode_gbps: float  # GB of model (or adapter) bytes encoded per second, one worker
    apply_gbps: float  # GB applied per second on the engine side, one worker
    saving: float = 0.0  # measured fraction of bytes saved in the run the speeds come from
    source: str = ""  # file, run, backend and hardware the numbers were measured on
    backend: str = ""  # ref, cpu, cuda: the wsync backend that ran (or the GPU a bound is for)
    basis: str = "measured"  # measured | bound (what hardware allows, not a run) | given (command line)

    def __post_init__(self):
        if self.encode_gbps <= 0 or self.apply_gbps <= 0:
            raise PlanError(f"codec speeds must be positive GB/s, got encode {self.encode_gbps}, "
                            f"apply {self.apply_gbps}")


@dataclass(frozen=True)
class _Runs:
    """The codec runs of one results file, with what they ran on."""

    file: str
    runs: list
    backend: str
    where: str


def _where(file: str, m: dict) -> str:
    return f"{file}: backend {m.get('backend', '?')}, {m.get('cpu', '?')}, {m.get('cores', '?')} cores, {m.get('gpu') or 'no GPU'}"


def _runs(entry: dict) -> _Runs:
    m = entry.get("machine") or {}
    return _Runs(entry["file"], entry["runs"], m.get("backend", "?"), _where(entry["file"], m))


def read_runs(path: Path) -> _Runs | None:
    """The codec runs in a `bench codec` or `bench all` file named by the caller; None for a file that has none."""
    entry = measured.codec_entry(path)
    return _runs(entry) if entry else None


def codec_results() -> list[_Runs]:
    """Every results file with codec runs in the measured inputs, oldest first."""
    return [_runs(e) for e in measured.inputs()["codec"]]


def newest_results() -> str | None:
    found = codec_results()
    return found[-1].file if found else None


def newest_kernels() -> dict | None:
    return measured.inputs().get("kernels")


def kernel_backends(kernels: dict) -> list[str]:
    return sorted(kernels["backends"])


def kernel_speed(kernels: dict, backend: str = "cpu") -> tuple[float, float, float, str]:
    """(encode GB/s, apply GB/s, saving, where) of `backend` in a kernels entry (measured.kernels_entry)."""
    try:
        b = kernels["backends"][backend]
        enc, app = float(b["encode_gbps"]), float(b["apply_gbps"])
        saving = 1.0 - b["payload_bytes"] / kernels["model_bytes"]
    except (KeyError, TypeError, ZeroDivisionError) as e:
        raise PlanError(f"cannot read the {backend!r} backend from kernel results {kernels.get('file')}: {e!r}") from e
    m = kernels.get("machine") or {}
    where = (f"{kernels['file']}: backend {backend} ({b.get('threads', '?')} threads), sparse tier at "
             f"{kernels.get('density', 0):.2%} density, {m.get('cpu', '?')}, {m.get('cores', '?')} cores")
    return enc, app, saving, where


def _scheme(kind: str, tier: str) -> str:
    key = f"delta/{tier}" if kind == "delta" else kind
    if key not in SCHEMES:
        raise PlanError(f"no measured speed for codec {kind!r} tier {tier!r}; use full, lora, or delta "
                        "with tier packed or sparse")
    return SCHEMES[key]


def _run(r: _Runs, kind: str, *, saving: float, tier: str, label: str | None = None) -> tuple | None:
    """(saving, encode GB/s, apply GB/s, run label) of one file's run for codec `kind`; with `label`, that run."""
    scheme = _scheme(kind, tier)
    found = [(1.0 - 1.0 / s["ratio_vs_raw"], s["encode_gbps"], s["decode_gbps"], run.get("label", "?"))
             for run in r.runs for s in run.get("schemes", [])
             if s.get("name") == scheme and "encode_gbps" in s and label in (None, run.get("label"))]
    if not found:
        return None
    if kind == "delta":  # the run whose density matches the assumed saving
        return min(found, key=lambda f: abs(f[0] - saving))
    return sorted(found, key=lambda f: f[1])[len(found) // 2]  # raw barely depends on the snapshots: the median


def _pick(r: _Runs, kind: str, *, saving: float, tier: str) -> CodecSpeed | None:
    run = _run(r, kind, saving=saving, tier=tier)
    if run is None:
        return None
    s, enc, app, label = run
    return CodecSpeed(encode_gbps=enc, apply_gbps=app, saving=s, backend=r.backend,
                      source=f"{r.where}; {_scheme(kind, tier)}, {label}")


def zstd_stage(r: _Runs, saving: float) -> tuple[float, float, float, str] | None:
    """(encode s/GB, apply s/GB, saving, where) the packed tier's zstd stage adds: packed - sparse of one run."""
    packed = _run(r, "delta", saving=saving, tier="packed")
    sparse = packed and _run(r, "delta", saving=saving, tier="sparse", label=packed[3])
    if not sparse:
        return None
    z_enc = max(1 / packed[1] - 1 / sparse[1], 0.0)
    z_app = max(1 / packed[2] - 1 / sparse[2], 0.0)
    return z_enc, z_app, packed[0], f"{r.where}; {packed[3]}"


def _with_kernels(kernels: dict, backend: str, codec: _Runs | None, *, saving: float, tier: str) -> CodecSpeed | None:
    """A backend's sparse-tier kernels, plus (packed tier) the zstd stage timed in a codec run."""
    enc, app, k_saving, where = kernel_speed(kernels, backend)
    if tier == "sparse":
        return CodecSpeed(encode_gbps=enc, apply_gbps=app, saving=k_saving, source=where, backend=backend)
    stage = zstd_stage(codec, saving) if codec else None
    if stage is None:  # without a zstd timing the kernels say nothing about the packed tier
        return None
    z_enc, z_app, z_saving, zsrc = stage
    return CodecSpeed(encode_gbps=1 / (1 / enc + z_enc), apply_gbps=1 / (1 / app + z_app), saving=z_saving,
                      source=f"{where}, plus the zstd stage timed as packed - sparse in {zsrc}", backend=backend)


def candidates(kind: str, *, saving: float = 0.98, tier: str = "packed", results: Path | None = None,
               kernels: Path | None = None) -> list[CodecSpeed]:
    """Every measured speed for codec `kind`: one per codec results file, one per backend of a kernels file.

    An explicit `results` file is used as given; the packaged kernels are used only when
    neither is named.
    """
    _scheme(kind, tier)
    if results is not None:
        one = read_runs(results)
        sources = [one] if one else []
    else:
        sources = codec_results()
    found = [s for s in (_pick(r, kind, saving=saving, tier=tier) for r in sources) if s]
    k = measured.kernels_entry(kernels) if kernels is not None else None if results else newest_kernels()
    if kind == "delta" and k is not None:
        zsrc = next((r for r in reversed(sources) if zstd_stage(r, saving)), None)
        found += [s for s in (_with_kernels(k, b, zsrc, saving=saving, tier=tier) for b in kernel_backends(k)) if s]
    return found


def measured_speed(kind: str, *, saving: float = 0.98, tier: str = "packed", results: Path | None = None,
                   kernels: Path | None = None, backend: str = "fastest") -> CodecSpeed:
    """Speed of codec `kind` (full, delta, lora): the fastest measured, or the named backend's fastest.

    The fastest wins because it is what a user would run; its source lists what it beat, so
    a reader can see the reference backend's figure was there and not used.
    """
    found = candidates(kind, saving=saving, tier=tier, results=results, kernels=kernels)
    ran = sorted({s.backend for s in found})
    if backend != "fastest":
        found = [s for s in found if s.backend == backend]
    if not found:
        scheme = _scheme(kind, tier)
        if results is not None:
            raise PlanError(f"{results} has no {scheme!r} runs{'' if backend == 'fastest' else ' of backend ' + backend}"
                            "; re-run `wsync bench codec --json` or pass speeds")
        raise PlanError(f"no {scheme!r} speeds measured with backend {backend!r} in {measured.WHERE} (measured: "
                        f"{', '.join(ran) or 'none'}); run `wsync bench codec --json` with that backend")
    best = max(found, key=lambda s: s.encode_gbps)
    rest = [s for s in found if s is not best]
    if rest:
        beaten = ", ".join(f"{s.backend} {s.encode_gbps:.2f}" for s in sorted(rest, key=lambda s: -s.encode_gbps))
        best = replace(best, source=f"{best.source}; fastest of {len(found)} measured (encode GB/s of the others: "
                                    f"{beaten})")
    return best


@dataclass(frozen=True, kw_only=True)
class TensorCost:
    """Seconds each tensor adds to a sync beyond its bytes, at each end (from `wsync bench codec --shape moe`)."""

    encode_s: float
    apply_s: float
    source: str = ""


def tensor_cost(path: Path | None = None) -> TensorCost:
    """The per-tensor cost the newest many-vs-one benchmark measured, or that of the file named (noise below zero
    counts as zero)."""
    entry = measured.moe_entry(path) if path is not None else measured.inputs().get("moe")
    if entry is None:
        raise PlanError(f"no per-tensor cost in {measured.WHERE}: run `wsync bench codec --shape moe --json` into "
                        "benchmarks/results and regenerate, or pass --per-tensor-us")
    per, m = entry["per_tensor_s"], entry.get("machine") or {}
    return TensorCost(encode_s=max(per["encode_s"], 0.0), apply_s=max(per["apply_s"], 0.0),
                      source=f"{entry['file']}: {entry.get('tensors')} x {entry.get('elems')} vs one tensor, "
                             f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores")
