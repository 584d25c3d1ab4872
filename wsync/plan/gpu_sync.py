"""Whole syncs measured on a GPU (`wsync bench gpu-sync`), as `wsync plan transfer --backend cuda` reads them.

The codec speeds the planner otherwise uses for a GPU are kernel figures (a
`cuda` codec run) or HBM bounds: they leave out what a sync does around the
kernels (copies to and from the host, checksums, the transport, the engine's
load). wsync bench gpu-sync times the whole thing, publish() on a trainer process to
the version live in an engine process's CUDA parameters, so where such a run
exists it prices the device path:

- the `dense.raw_local` stage (raw over local://, no network) for full
  weights and LoRA adapters, `dense.delta_local` for deltas: the engine's
  apply time is the apply term, and the rest of publish -> live (publish,
  encode, the local transport) the encode term; a link's wire time is then
  added on top, so the local transport counts twice (a small overstatement);
- with the `moe` stages too, the seconds per tensor beyond the bytes, from the
  many-tensor state against the dense one.

A stage counts only if it ran whole and its engine ended bit-exact. Runs come
from the packaged measured inputs (measured.py: `*gpu_sync*.json` in
benchmarks/results and one folder down, the runbook's folders); only full-size
runs on a CUDA device count, the newest (by the time the run wrote down) first.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import measured
from .codec_speeds import CodecSpeed, TensorCost

STAGE = {"full": "raw_local", "lora": "raw_local", "delta": "delta_local"}
NO_RUN = ("no end-to-end GPU run in the measured inputs yet (`wsync bench gpu-sync --size full` on a GPU, or the "
          "runbook's gpu-sync step, then scripts/planner_inputs.py)")


@dataclass(frozen=True)
class GpuSyncRun:
    file: str  # the results file, relative to benchmarks/results
    data: dict

    @property
    def gpu(self) -> str:
        return (self.data.get("machine") or {}).get("gpu") or "?"

    @property
    def where(self) -> str:
        return f"{self.file} ({self.gpu}, {self.data.get('created', '?')})"

    def stage(self, state: str, kind: str) -> dict | None:
        """The stage's record when it can be priced from: it ran whole, with timed versions, and ended bit-exact."""
        st = (self.data.get("stages") or {}).get(f"{state}.{kind}")
        if not isinstance(st, dict) or not st.get("ok") or st.get("exact") is not True:
            return None
        p2l = st.get("publish_to_live_s") or {}
        if not p2l.get("median") or p2l.get("n", 0) < 1:
            return None
        return st

    def state_bytes(self, state: str) -> float | None:
        return ((self.data.get("states") or {}).get(state) or {}).get("bytes")


def gpu_sync_files() -> list[GpuSyncRun]:
    """Every `wsync bench gpu-sync` result in the measured inputs, any device or size."""
    return [GpuSyncRun(e["file"], e) for e in measured.inputs().get("gpu_sync") or []]


def _usable(r: GpuSyncRun) -> bool:
    return r.data.get("size") == "full" and str((r.data.get("machine") or {}).get("device", "")).startswith("cuda")


def newest_gpu_sync(gpu: str | None = None) -> GpuSyncRun | None:
    """The newest full-size run on a CUDA device; with `gpu` (h100, h200, ...), the newest on that GPU if any."""
    runs = sorted((r for r in gpu_sync_files() if _usable(r)),
                  key=lambda r: (str(r.data.get("created", "")), r.file))
    if gpu:
        same = [r for r in runs if gpu.lower() in r.gpu.lower()]
        runs = same or runs
    return runs[-1] if runs else None


def e2e_speed(kind: str, run: GpuSyncRun, *, tier: str = "packed", gpu: str | None = None) -> CodecSpeed | None:
    """Encode and apply GB/s of model bytes for codec `kind`, from the run's dense stage (None: not measured)."""
    name = STAGE.get(kind)
    st = name and run.stage("dense", name)
    size = run.state_bytes("dense")
    if not st or not size:
        return None
    p2l = st["publish_to_live_s"]["median"]
    apply_s = (st.get("apply_s") or {}).get("median") or 0.0
    apply_s = min(max(apply_s, 0.0), p2l)
    rest = p2l - apply_s
    if rest <= 0 or apply_s <= 0:  # one of the two not timed apart: each end gets half of the whole
        rest = apply_s = p2l / 2
    wire = (st.get("wire_bytes") or {}).get("median")
    saving = max(0.0, 1.0 - wire / size) if kind == "delta" and wire else 0.0
    notes = []
    if kind == "delta" and st.get("tier") and st.get("tier") != tier:
        notes.append(f"measured with tier {st['tier']}, --tier {tier} asked")
    if gpu and gpu.lower() not in run.gpu.lower():
        notes.append(f"measured on {run.gpu}, not the {gpu} asked")
    if kind == "delta" and st.get("keyframes"):  # a refused delta comes again whole: it is priced as it ran
        notes.append(f"{st['keyframes']} of {st['publish_to_live_s']['n']} versions landed as keyframes")
    source = (f"{run.where}: measured end to end, {name} ({st.get('transport')} {st.get('codec')}"
              f"{' ' + st['tier'] if st.get('tier') else ''}, {size / 1e9:.1f} GB state, "
              f"{st['publish_to_live_s']['n']} versions): publish -> live median {p2l:.3g} s, of which the engine's "
              f"apply {apply_s:.3g} s; encode = the rest (publish, encode, the local transport)")
    if notes:
        source += "; " + "; ".join(notes)
    return CodecSpeed(encode_gbps=size / rest / 1e9, apply_gbps=size / apply_s / 1e9, saving=saving, source=source,
                      backend="cuda", basis="measured")


def e2e_tensor_cost(kind: str, run: GpuSyncRun) -> TensorCost | None:
    """Seconds per tensor at each end beyond the bytes: the moe state's stage against the dense state's."""
    name = STAGE.get(kind)
    dense, moe = (run.stage(s, name) if name else None for s in ("dense", "moe"))
    db, mb = run.state_bytes("dense"), run.state_bytes("moe")
    tensors = ((run.data.get("states") or {}).get("moe") or {}).get("tensors")
    if not (dense and moe and db and mb and tensors):
        return None

    def split(st):
        p2l = st["publish_to_live_s"]["median"]
        app = min(max((st.get("apply_s") or {}).get("median") or 0.0, 0.0), p2l)
        return p2l - app, app

    (d_enc, d_app), (m_enc, m_app) = split(dense), split(moe)
    enc = max(m_enc - mb * d_enc / db, 0.0) / tensors
    app = max(m_app - mb * d_app / db, 0.0) / tensors
    return TensorCost(encode_s=enc, apply_s=app,
                      source=f"{run.where}: measured end to end, {tensors:,}-tensor moe state against the dense one "
                             f"({name}); what the moe stage took beyond the dense stage's per-byte time, per tensor")


def stage_lines(run: GpuSyncRun) -> list[str]:
    """One line per stage of the run, for the plan's output."""
    out = []
    d = run.data
    for name in d.get("stage_names") or []:
        st = (d.get("stages") or {}).get(name) or {}
        state, _, kind = name.partition(".")
        if kind == "d2d" and st.get("ok"):
            c = st["copy_s"]["median"]
            out.append(f"{name}: device-to-device copy {c:.3g} s ({(run.state_bytes(state) or 0) / c / 1e9:.0f} GB/s)")
        elif kind in ("raw_local", "delta_local", "delta_tcp"):
            if not st.get("ok") or not st.get("publish_to_live_s"):
                out.append(f"{name}: no reading ({str(st.get('error') or 'not run').splitlines()[0][:100]})")
                continue
            p, b = st["publish_to_live_s"], (st.get("blocked_s") or {}).get("median")
            wire = (st.get("wire_bytes") or {}).get("median")
            out.append(f"{name}: publish -> live min {p['min']:.3g} / median {p['median']:.3g} s over {p['n']} "
                       f"versions, trainer blocked in publish() {'?' if b is None else format(b, '.3g')} s, "
                       f"{'?' if wire is None else format(wire / 1e9, '.3g')} GB per version, "
                       + (f"{st.get('keyframes', 0)} landed as keyframes, " if st.get("codec") == "delta" else "")
                       + f"bit-exact {st.get('exact')}")
    return out
