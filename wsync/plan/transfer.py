"""Weight-update time per link and codec: wire time, and the whole sync with encode and apply.

The published tables price a sync as bytes / line rate. That is the floor; a
real update also encodes on the trainer and applies on the engine, at the
codec speeds of the packaged measured inputs (measured.py; overridable). This
module computes both, says which term dominates, and prices the idle GPU time.
Units: GB = 1e9 bytes, Gbit/s = 1e9 bit/s.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from .codec_speeds import CodecSpeed, TensorCost, measured_speed, tensor_cost
from .lora import LoraConfig, lora_size
from .models import ModelConfig, PlanError
from .params import tensor_count, weight_bytes
from .published import IDLE_USD_PER_GPU_S
from .quant import QuantDelta, layout_name, quantized_delta


@dataclass(frozen=True, kw_only=True)
class LinkModel:
    """A network path between trainer and engines."""

    name: str
    gbit_per_s: float  # line rate
    efficiency: float = 1.0  # achieved share of line rate; 1.0 is the published tables' ideal
    latency_s: float = 0.0  # fixed cost per sync (connection, handshake, commit round trip)

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes * 8.0 / (self.gbit_per_s * 1e9 * self.efficiency)


LINKS = {
    "tcp-50g": LinkModel(name="tcp-50g", gbit_per_s=50.0),
    "rdma-3.2t": LinkModel(name="rdma-3.2t", gbit_per_s=3200.0),  # 8 x 400 Gbit/s NICs
    "wan-10g": LinkModel(name="wan-10g", gbit_per_s=10.0),
    "tcp-100g": LinkModel(name="tcp-100g", gbit_per_s=100.0),
    "ib-400g": LinkModel(name="ib-400g", gbit_per_s=400.0),
    "wan-1g": LinkModel(name="wan-1g", gbit_per_s=1.0),
}


def parse_link(spec: str) -> LinkModel:
    """A preset name, or a rate such as '25g', '400gbit', '3.2t' (Gbit/s unless a 't'/'m' says otherwise)."""
    if spec in LINKS:
        return LINKS[spec]
    m = re.fullmatch(r"(?:(\w+)[-:])?([\d.]+)\s*([mgt]?)(?:bit)?(?:/s)?", spec.strip().lower())
    if not m:
        raise PlanError(f"unknown link {spec!r}; use one of {', '.join(LINKS)} or a rate like 25g, 3.2t, 800m")
    scale = {"m": 1e-3, "g": 1.0, "": 1.0, "t": 1e3}[m.group(3)]
    rate = float(m.group(2)) * scale
    if rate <= 0:
        raise PlanError(f"link rate must be positive, got {spec!r}")
    return LinkModel(name=spec, gbit_per_s=rate)


@dataclass(frozen=True, kw_only=True)
class Codec:
    """What goes on the wire."""

    kind: str = "full"  # full | delta | lora
    saving: float = 0.98  # delta: fraction of full bytes removed (98% = 50x smaller)
    lora: LoraConfig = field(default_factory=LoraConfig)  # lora: adapter shape
    tier: str = "packed"  # delta tier whose measured speed is used
    # delta of a quantized checkpoint: sized from the measured fractions of its codes, scales and BF16 rest that
    # change per version (quantized_delta) instead of `saving`, where the measured inputs have its format
    # (parse_codec sets it unless a saving is given)
    quant_measured: bool = False

    @property
    def label(self) -> str:
        if self.kind == "delta":
            return f"delta -{self.saving:.0%}"
        if self.kind == "lora":
            return f"lora r{self.lora.rank} {self.lora.layout}"
        return "full"


def parse_codec(kind: str, *, saving: float | None = None, lora: LoraConfig | None = None) -> Codec:
    """saving: what a delta removes from every model's bytes; None: 0.98 (the published tables' assumption), and a
    quantized checkpoint's delta from its measured densities (quantized_delta) where the measured inputs allow."""
    if kind not in ("full", "delta", "lora"):
        raise PlanError(f"unknown codec {kind!r}; use full, delta or lora")
    if saving is not None and not 0.0 <= saving < 1.0:
        raise PlanError(f"delta saving must be in [0, 1), got {saving}")
    return Codec(kind=kind, saving=0.98 if saving is None else saving, lora=lora or LoraConfig(),
                 quant_measured=saving is None)


def _quant_delta(m: ModelConfig, codec: Codec, dtype: str | None) -> QuantDelta | None:
    if codec.kind != "delta" or not codec.quant_measured or dtype is not None:
        return None
    return quantized_delta(m)


def payload_bytes(m: ModelConfig, codec: Codec, dtype: str | None = None) -> tuple[float, float]:
    """(bytes on the wire, bytes the codec reads/writes at each end)."""
    full = weight_bytes(m, dtype)
    if codec.kind == "full":
        return full, full
    if codec.kind == "delta":  # encode reads old + new weights; speeds are quoted per model byte
        qd = _quant_delta(m, codec, dtype)
        return (full * (1.0 - codec.saving) if qd is None else qd.bytes), full
    adapter = lora_size(m, codec.lora).bytes
    return adapter, adapter


def codec_label(m: ModelConfig, codec: Codec, dtype: str | None = None) -> str:
    """The codec as a row names it: a quantized checkpoint's full and delta rows name its layout."""
    if codec.kind == "full" and m.quant and dtype is None:
        return f"full {layout_name(m)}"
    qd = _quant_delta(m, codec, dtype)
    if qd is not None:
        return f"delta {qd.layout} -{1.0 - qd.bytes / weight_bytes(m):.1%}"
    return codec.label


@dataclass(frozen=True, kw_only=True)
class SyncCost:
    model: str
    codec: str
    link: str
    wire_bytes: float
    wire_s: float  # bytes / rate: what the published tables print
    encode_s: float  # trainer side, from the measured codec speed
    apply_s: float  # engine side, from the measured codec speed
    pipelined_s: float  # encode, send and apply overlapped over `buckets` buckets
    serial_s: float  # encode, then send, then apply
    dominant: str  # which term bounds the pipelined time
    idle_usd_per_gpu: float  # price of one GPU idling for the pipelined sync
    speed_source: str  # where the encode/apply speeds come from
    tensors: int = 0  # tensors in the state (experts named one by one)
    tensor_s: float = 0.0  # seconds of encode + apply that are per-tensor overhead, not bytes
    tensor_source: str = ""  # where the per-tensor cost comes from
    trainer_ranks: int = 1  # sharded sync (reshard_cost): ranks sending, each over its own link
    engine_ranks: int = 1  # and ranks receiving
    total_bytes: float = 0.0  # sharded sync: all ranks' bytes on the wire; wire_bytes is then the busiest link's
    busiest_basis: str = ""  # where the busiest link's bytes come from: total / min(M, N), or a routing plan


def sync_cost(m: ModelConfig, link: LinkModel, codec: Codec, *, speed: CodecSpeed | None = None,
              dtype: str | None = None, buckets: int = 16, encode_workers: int = 1, apply_workers: int = 1,
              usd_per_gpu_s: float = IDLE_USD_PER_GPU_S, per_tensor: TensorCost | None = None,
              wire_bytes: float | None = None) -> SyncCost:
    """The whole sync of one model version, with its wire-only floor.

    per_tensor: seconds each tensor adds at each end beyond its bytes (default: the newest
    `wsync bench codec --shape moe` run); a LoRA sync moves only adapter tensors and pays none here.
    wire_bytes: the bytes through the one link that bounds the sync (default: the whole payload; a sharded
    sync passes its busiest rank's, see reshard_cost).
    """
    if buckets < 1 or encode_workers < 1 or apply_workers < 1:
        raise PlanError("buckets, encode_workers and apply_workers must be >= 1")
    wire, coded = payload_bytes(m, codec, dtype)
    wire = wire if wire_bytes is None else wire_bytes
    speed = speed or measured_speed(codec.kind, saving=codec.saving, tier=codec.tier)
    per_tensor = per_tensor or tensor_cost()
    tensors = tensor_count(m) if codec.kind != "lora" else 0
    t_enc, t_app = tensors * per_tensor.encode_s / encode_workers, tensors * per_tensor.apply_s / apply_workers
    terms = {
        "encode": coded / (speed.encode_gbps * 1e9 * encode_workers) + t_enc,
        "wire": link.seconds(wire),
        "apply": coded / (speed.apply_gbps * 1e9 * apply_workers) + t_app,
    }
    serial = sum(terms.values())
    top = max(terms, key=terms.get)
    # a pipeline of equal buckets: the slowest stage runs back to back, the others add one bucket each
    pipelined = terms[top] + (serial - terms[top]) / buckets
    return SyncCost(model=m.name, codec=codec_label(m, codec, dtype), link=link.name, wire_bytes=wire, wire_s=terms["wire"],
                    encode_s=terms["encode"], apply_s=terms["apply"], pipelined_s=pipelined, serial_s=serial,
                    dominant=top, idle_usd_per_gpu=pipelined * usd_per_gpu_s, speed_source=speed.source,
                    tensors=tensors, tensor_s=t_enc + t_app, tensor_source=per_tensor.source)


def wire_seconds(m: ModelConfig, link: LinkModel, codec: Codec | None = None, dtype: str | None = None) -> float:
    """The published tables' number: payload bytes over the line rate, nothing else."""
    return link.seconds(payload_bytes(m, codec or Codec(), dtype)[0])


def reshard_cost(m: ModelConfig, link: LinkModel, codec: Codec, trainer_ranks: int, engine_ranks: int, *,
                 busiest_full_bytes: float | None = None, basis: str = "", **kw) -> SyncCost:
    """A sharded sync: M trainer ranks send only their own slices, point to point, to N engine ranks of one engine,
    each rank over its own `link` (one NIC per GPU). With a balanced plan every engine rank receives total / N and
    every trainer rank sends total / M, so the busiest link carries total / min(M, N); encode and apply run on all
    M and N ranks at once. busiest_full_bytes: the busiest rank's bytes from a routing plan instead (full codec
    bytes; a delta scales them by its saving). kw: sync_cost's (speed, dtype, buckets, per_tensor, ...).
    """
    if trainer_ranks < 1 or engine_ranks < 1:
        raise PlanError(f"trainer and engine ranks must be >= 1, got {trainer_ranks} and {engine_ranks}")
    wire, coded = payload_bytes(m, codec, kw.get("dtype"))
    if busiest_full_bytes is None:
        busiest, basis = wire / min(trainer_ranks, engine_ranks), "total / min(M, N)"
    else:
        busiest = busiest_full_bytes * (wire / coded if coded else 1.0)
    s = sync_cost(m, link, codec, encode_workers=trainer_ranks, apply_workers=engine_ranks, wire_bytes=busiest, **kw)
    return dataclasses.replace(s, trainer_ranks=trainer_ranks, engine_ranks=engine_ranks, total_bytes=wire,
                               busiest_basis=basis)
