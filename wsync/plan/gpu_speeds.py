"""Which codec speeds `wsync plan transfer` prices with, GPU clusters included.

Most measured inputs come from CPU machines. A trainer on GPUs encodes where its
weights already are, with wsync's CUDA kernels (wsync.backends.cuda), so a plan
for a GPU cluster wants their speed. A whole sync measured on a GPU
(`wsync bench gpu-sync`, read by gpu_sync.py) is used first; else a
measured `cuda` codec run; until someone runs either on
a GPU, the honest figure is an upper bound: the bytes each kernel must move
through HBM, over the GPU's HBM bandwidth. A bound is labelled as one wherever
it is shown (`CodecSpeed.basis == "bound"`), never passed off as a measurement.
"""
from __future__ import annotations

from dataclasses import replace

from . import measured
from .codec_speeds import CodecSpeed, codec_results, measured_speed, zstd_stage
from .gpu_sync import e2e_speed, newest_gpu_sync
from .loop import get_gpu
from .models import PlanError

BACKENDS = "fastest (default), ref, cpu, cuda[:GPU], gpu-bound:GPU"


def bytes_moved(kind: str, saving: float) -> tuple[float, float]:
    """(encode, apply) bytes of HBM traffic per model byte that no kernel can avoid.

    delta encode reads base and new and writes the sections; apply reads the
    sections, writes the changed values and reads every weight once for the
    digest the engine checks. Raw (full, LoRA) encode reads the weights once for
    their digest; apply copies the received bytes into place (read + write).
    """
    if kind == "delta":
        wire = 1.0 - saving
        return 2.0 + wire, 1.0 + 2.0 * wire
    return 1.0, 2.0


def _host_zstd(saving: float) -> tuple[float, float, str]:
    """The packed tier's zstd stage in s/GB, as measured on a host (the CUDA backend runs it on the CPU)."""
    for r in reversed(codec_results()):
        stage = zstd_stage(r, saving)
        if stage:
            return stage[0], stage[1], f"measured on a host CPU as packed - sparse in {stage[3]}"
    raise PlanError(f"no codec run with both delta tiers in {measured.WHERE} to time the packed tier's zstd stage; "
                    "use --tier sparse")


def gpu_bound(kind: str, *, gpu: str = "h100", saving: float = 0.98, tier: str = "packed") -> CodecSpeed:
    """The fastest a GPU kernel could encode and apply on `gpu`: HBM bandwidth over the bytes it must move."""
    g = get_gpu(gpu)
    enc_b, app_b = bytes_moved(kind, saving)
    per_gb = 1e9 / (g.hbm_tbps * 1e12)
    enc_s, app_s = enc_b * per_gb, app_b * per_gb
    source = (f"upper bound: {g.name} HBM {g.hbm_tbps} TB/s over {enc_b:.2f} (encode) / {app_b:.2f} "
              f"(apply) bytes moved per model byte")
    if kind == "delta" and tier == "packed":
        z_enc, z_app, where = _host_zstd(saving)
        enc_s, app_s = enc_s + z_enc, app_s + z_app
        source += f"; plus the packed tier's zstd stage on the host ({where}); --tier sparse leaves it out"
    return CodecSpeed(encode_gbps=1 / enc_s, apply_gbps=1 / app_s, saving=saving, source=source,
                      backend=f"gpu-bound:{gpu.lower()}", basis="bound")


def codec_speed(kind: str, *, saving: float = 0.98, tier: str = "packed", backend: str = "fastest") -> CodecSpeed:
    """The speed `--backend` names: a measured backend; for cuda, a whole sync measured on a GPU, else a measured
    `cuda` codec run, else the GPU's bound."""
    name, _, gpu = backend.lower().partition(":")
    if name == "gpu-bound":
        return gpu_bound(kind, gpu=gpu or "h100", saving=saving, tier=tier)
    if name == "cuda":  # a whole sync measured on a GPU first: the kernels alone leave out what surrounds them
        run = newest_gpu_sync(gpu=gpu or None)
        e2e = run and e2e_speed(kind, run, tier=tier, gpu=gpu or None)
        if e2e:
            return e2e
        try:
            return measured_speed(kind, saving=saving, tier=tier, backend="cuda")
        except PlanError:
            b = gpu_bound(kind, gpu=gpu or "h100", saving=saving, tier=tier)
            return replace(b, source=f"no cuda run in the measured inputs; {b.source}")
    if name in ("fastest", "ref", "cpu") and not gpu:
        return measured_speed(kind, saving=saving, tier=tier, backend=name)
    raise PlanError(f"unknown backend {backend!r}; use one of {BACKENDS} (GPU: h100, h200, b200, a100)")
