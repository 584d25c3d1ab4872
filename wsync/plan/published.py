"""The published figures the systems model must reproduce, and where they do not add up.

Each figure is kept with the assumptions it states. `audit()` recomputes every
one twice: from the published size (does the figure follow from its own
numbers?) and from the model config (does it follow from the model?). Units:
GB = 1e9 bytes, Gbit/s = 1e9 bit/s, as the tables use them.
"""
from __future__ import annotations

from dataclasses import dataclass

IDLE_USD_PER_GPU_S = 0.01  # the tables' price of an idle GPU-second
TCP_GBIT, RDMA_GBIT, WAN_GBIT = 50.0, 3200.0, 10.0
WAN_DELTA_SAVING = 0.98

# (model, size GB, seconds at 50 Gbit/s TCP, seconds at 3.2 Tbit/s RDMA); tolerance 1%
TRANSFER_TABLE = [
    ("qwen3-8b", 16.3, 2.62, 0.041),
    ("qwen3-30b-a3b", 61.1, 9.78, 0.153),
    ("glm-4.7", 716.7, 114.67, 1.79),
    ("kimi-k2.6", 595.2, 95.23, 1.49),
]
# Over a 10 Gbit/s WAN: (model, full sync s, delta sync s with 98% of bytes saved, idle-GPU USD saved per sync and
# GPU at IDLE_USD_PER_GPU_S). None marks a figure of the published table that this repository holds no copy of:
# the model's value is printed for it, and it is checked as soon as the figure is filled in here. Tolerance 1%.
WAN_TABLE = [
    ("qwen3-8b", 12.8, 0.26, None),
    ("qwen3-30b-a3b", None, None, None),
    ("glm-4.7", None, None, None),
    ("kimi-k2.6", None, None, None),
]
WAN_ROW = WAN_TABLE[0][:3]

# (model, layout, rank, GB); tolerance 3%
LORA_TABLE = [
    ("qwen3-30b-a3b", "shared-outer", 32, 1.0),
    ("glm-4.7", "shared-outer", 32, 4.7),
    ("glm-4.7", "per-expert", 32, 18.8),
    ("kimi-k2.6", "shared-outer", 32, 9.4),
    ("kimi-k2.6", "per-expert", 32, 41.0),
]


@dataclass(frozen=True, kw_only=True)
class Check:
    figure: str  # what was published, in words
    published: float | None  # None: the table has it, this repository has no copy (see WAN_TABLE)
    from_own_numbers: float | None  # recomputed from the published size and rate (None: no own numbers)
    from_model: float  # recomputed from the model config
    note: str  # why they differ, when they do

    def error(self, which: str = "from_model") -> float | None:
        v = getattr(self, which)
        if self.published is None or v is None:
            return None
        return abs(v - self.published) / self.published

    @property
    def tolerance(self) -> float:
        return 0.03 if "LoRA" in self.figure else 0.01  # as each table states


def seconds(gb: float, gbit_per_s: float) -> float:
    return gb * 8.0 / gbit_per_s


def _transfer_checks() -> list[Check]:
    from .models import get_model
    from .params import checkpoint_bytes

    out = []
    for name, gb, tcp_s, rdma_s in TRANSFER_TABLE:
        model_gb = checkpoint_bytes(get_model(name)) / 1e9
        note = ""
        if name == "qwen3-8b":
            note = (f"16.3 GB at 50 Gbit/s is {seconds(16.3, TCP_GBIT):.3f} s, not 2.62 s; 2.62 s follows from the "
                    f"model's {model_gb:.2f} GB (8.19B x 2 bytes), which rounds to 16.4 GB: the size was truncated")
        elif name == "kimi-k2.6":
            note = "595.2 GB is the INT4 checkpoint (routed experts 4-bit, group 32); bf16 would be 2053.8 GB"
        elif name == "glm-4.7":
            note = "716.7 GB includes the MTP layer with its own embedding and head copies (11.1 GB)"
        out.append(Check(figure=f"{name} size GB", published=gb, from_own_numbers=None, from_model=model_gb,
                         note=note if name != "qwen3-8b" else "published size truncated (16.38 GB)"))
        for link, rate, pub in (("TCP 50 Gbit/s", TCP_GBIT, tcp_s), ("RDMA 3.2 Tbit/s", RDMA_GBIT, rdma_s)):
            out.append(Check(figure=f"{name} full sync s, {link}", published=pub,
                             from_own_numbers=seconds(gb, rate), from_model=seconds(model_gb, rate), note=note))
    return out


def wan_row(name: str) -> tuple[float, float, float]:
    """(full sync s, delta sync s, idle USD saved per sync and GPU) of `name` over the WAN, from its config."""
    from .models import get_model
    from .params import checkpoint_bytes

    full = seconds(checkpoint_bytes(get_model(name)) / 1e9, WAN_GBIT)
    delta = full * (1 - WAN_DELTA_SAVING)
    return full, delta, (full - delta) * IDLE_USD_PER_GPU_S


def _wan_checks() -> list[Check]:
    out = []
    for name, full_s, delta_s, usd in WAN_TABLE:
        m_full, m_delta, m_usd = wan_row(name)
        own = (None, None, None) if full_s is None else (None, full_s * (1 - WAN_DELTA_SAVING),
                                                         (full_s - delta_s) * IDLE_USD_PER_GPU_S)
        missing = "" if full_s is not None else "figure not copied into this repository; the model's value alone"
        notes = [missing, missing, missing]
        if name == "qwen3-8b":
            notes[0] = (f"does not follow: 16.3 GB at 10 Gbit/s is {seconds(16.3, WAN_GBIT):.2f} s and the model's "
                        f"{m_full / 0.8:.2f} GB is {m_full:.2f} s; 12.8 s would need 16.0 GB, or 16.38 GB at 10.24 "
                        "Gbit/s (a binary-prefixed 10 Gbit/s)")
            own = (seconds(16.3, WAN_GBIT), *own[1:])
            notes[1] = "follows from either full-sync time: 2% of 12.8 s is 0.256 s, 2% of 13.10 s is 0.262 s"
        if usd is None:
            notes[2] = (f"saving = (full - delta) s x ${IDLE_USD_PER_GPU_S}/GPU-s, per sync and idle GPU; "
                        "published figure not copied into this repository")
        for (what, pub, o, m), note in zip((("full sync s", full_s, own[0], m_full),
                                            ("delta sync s, 98% saved", delta_s, own[1], m_delta),
                                            ("idle USD saved per sync per GPU", usd, own[2], m_usd)), notes):
            out.append(Check(figure=f"{name} {what}, WAN 10 Gbit/s", published=pub, from_own_numbers=o,
                             from_model=m, note=note))
    return out


def _lora_checks() -> list[Check]:
    from .lora import LoraConfig, lora_size
    from .models import get_model

    out = []
    for name, layout, rank, gb in LORA_TABLE:
        got = lora_size(get_model(name), LoraConfig(rank=rank, layout=layout)).bytes / 1e9
        out.append(Check(figure=f"{name} LoRA r={rank} {layout} GB", published=gb, from_own_numbers=None,
                         from_model=got, note="bf16 adapters on every linear layer; fp32 would double it"))
    return out


def audit() -> list[Check]:
    """Every published figure, recomputed from its own numbers and from the model."""
    return _transfer_checks() + _wan_checks() + _lora_checks()


# Sharded trainers into sharded engines: (who, model, trainer GPUs, engine GPUs, seconds, source, setup
# as stated). Not in audit(): they are end-to-end times of other systems, set beside the model's wire-time floor.
RESHARD_TABLE = [
    ("Perplexity", "kimi-k2", 256, 128, 1.3,
     "https://research.perplexity.ai/articles/weight-transfer-for-rl-post-training-in-under-2-seconds",
     "BF16 trainer -> FP8 engines over RDMA WRITE; full_tensor(), projection fusion and FP8 quantization in the pipeline"),
    ("vLLM sharded RDT", "kimi-k2", None, None, 7.53, "as quoted in wsync's sharded-sync task (no public page)",
     "BF16 on 48x8 H100, 1,049 GB/s"),
]
RESHARD_RANKS = (256, 128)  # the layout the prediction is made for: Perplexity's
GPU_NIC_GBIT = 400.0  # one 400 Gbit/s NIC per H100 (eight per node: the catalog's rdma-3.2t)
RDT_GB_PER_S, RDT_GPUS = 1049.0, 48 * 8


def reshard_prediction(name: str = "kimi-k2") -> dict:
    """The model's BF16 sync from 256 trainer to 128 engine GPUs: the busiest link's bytes and their wire time."""
    from .models import get_model
    from .params import weight_bytes

    m_ranks, n_ranks = RESHARD_RANKS
    total = weight_bytes(get_model(name), "bf16")
    busiest = total / min(m_ranks, n_ranks)
    return {"model": name, "trainer_ranks": m_ranks, "engine_ranks": n_ranks, "total_gb": total / 1e9,
            "busiest_gb": busiest / 1e9, "wire_s": seconds(busiest / 1e9, GPU_NIC_GBIT), "nic_gbit": GPU_NIC_GBIT}


def reshard_lines(name: str = "kimi-k2") -> list[str]:
    """The prediction beside the published figures, one line each saying why they differ."""
    p = reshard_prediction(name)
    w = p["wire_s"]
    out = [f"{name} BF16, {p['trainer_ranks']} trainer -> {p['engine_ranks']} engine GPUs, one {GPU_NIC_GBIT:.0f} "
           f"Gbit/s NIC each: predicted {w:.3f} s on the wire ({p['busiest_gb']:.2f} GB through the busiest link = "
           f"{p['total_gb']:.1f} GB / min(M, N))"]
    for who, model, _m, _n, sec, source, setup in RESHARD_TABLE:
        if model != name:
            continue
        if who == "Perplexity":
            why = (f"{sec / w:.1f}x the floor although FP8 engines halve the bytes ({w / 2:.3f} s): the rest is the "
                   "full_tensor() gathers, fusion and quantization on the GPUs, and, if the 128 GPUs are several engine "
                   "replicas, each replica taking the whole model")
        else:
            moved = sec * RDT_GB_PER_S / 1e3
            why = (f"its own numbers move {moved:.1f} TB = {moved * 1e3 / p['total_gb']:.1f} BF16 copies (several "
                   f"engine replicas, or bytes counted more than once) at {RDT_GB_PER_S / RDT_GPUS:.2f} GB/s per GPU, "
                   f"{RDT_GB_PER_S / RDT_GPUS / (GPU_NIC_GBIT / 8):.0%} of one NIC")
        out.append(f"  {who}: {sec} s ({setup}; {source}): {why}")
    return out
