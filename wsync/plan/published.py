"""The published tables recomputed: every figure from the inputs its table states, and from the model configs.

The figures themselves are data (published_tables.py). Each is recomputed with
exact arithmetic (fractions), so "does it follow" means: the recomputation,
rounded to the places the figure was printed with, is the printed figure.
The model-config recomputation is the planner's own (catalog + params), held to
1% (a LoRA row's figures 3%) plus the figure's own rounding. Units:
GB = 1e9 bytes, Gbit/s = 1e9 bit/s, as the tables use them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from fractions import Fraction

from . import published_tables as tables
from .lora import LoraConfig, lora_size
from .models import get_model
from .params import breakdown, checkpoint_bytes, checkpoint_parts, total_params, weight_bytes
from .quant import quantized_delta

USD_PER_GPU_S = Fraction(tables.IN_CLUSTER_INPUTS["usd_per_gpu_s"])
TCP_GBIT = Fraction(tables.IN_CLUSTER_INPUTS["tcp_gbit_per_s"])
RDMA_GBIT = Fraction(tables.IN_CLUSTER_INPUTS["rdma_gbit_per_s"])
WAN_GBIT = Fraction(tables.WAN_INPUTS["wan_gbit_per_s"])
WAN_DELTA_SAVING = Fraction(tables.WAN_INPUTS["delta_saving"])
IDLE_USD_PER_GPU_S = float(USD_PER_GPU_S)  # the tables' price of an idle GPU-second, as the planner's default

_SCALE = {"s": Fraction(1), "ms": Fraction(1, 1000), "GB": Fraction(1), "$": Fraction(1)}


@dataclass(frozen=True)
class Figure:
    """One published cell: its text, the digits as printed and their unit."""

    text: str
    digits: str
    unit: str  # s, ms, GB or $

    @property
    def value(self) -> Fraction:
        """In seconds, GB or USD."""
        return Fraction(self.digits) * _SCALE[self.unit]

    def rounds_to(self, x: Fraction) -> bool:
        """Whether `x`, rounded half up to the places this figure was printed with, is this figure."""
        places = Decimal(self.digits).as_tuple().exponent
        mine = _decimal(x / _SCALE[self.unit]).quantize(Decimal(1).scaleb(places), rounding=ROUND_HALF_UP)
        return mine == Decimal(self.digits)

    def approx(self, x: float) -> str:
        """`x` in this figure's unit to 4 significant digits (a model-config figure, not exact)."""
        n = f"{float(x / _SCALE[self.unit]):.4g}"
        return f"${n}" if self.unit == "$" else f"{n} {self.unit}"

    def show(self, x: Fraction) -> str:
        """`x` in this figure's unit, written out exactly (a recomputation, beside the published text)."""
        n = exact(x / _SCALE[self.unit])
        return f"${n}" if self.unit == "$" else f"{n} {self.unit}"


def figure(cell: str) -> Figure:
    m = re.match(r"(\$)?(\d+(?:\.\d+)?)(?:\s*(ms|s|GB)\b)?", cell.strip())
    if not m or not (m.group(1) or m.group(3)):
        raise ValueError(f"not a published figure: {cell!r}")
    return Figure(cell, m.group(2), m.group(3) or "$")


def gpu_count(cell: str) -> int:
    """'16x8 H200' -> 128: nodes x GPUs per node."""
    m = re.match(r"(\d+)x(\d+)\s", cell)
    if not m:
        raise ValueError(f"not a GPU count: {cell!r}")
    return int(m.group(1)) * int(m.group(2))


def _decimal(x: Fraction) -> Decimal:
    return Decimal(x.numerator) / Decimal(x.denominator)


def exact(x: Fraction) -> str:
    """A terminating decimal written out in full; anything else to 6 places with a '~'."""
    d = _decimal(x)
    text = format(d.normalize(), "f")
    if "." in text and len(text.split(".")[1]) > 8:
        return "~" + format(d.quantize(Decimal("0.000001"), rounding=ROUND_HALF_UP).normalize(), "f")
    return text


def seconds(gb: Fraction | float, gbit_per_s: Fraction | float) -> Fraction | float:
    return gb * 8 / gbit_per_s


@dataclass(frozen=True, kw_only=True)
class Recomputed:
    """One published figure and what its table's own inputs make of it."""

    table: int  # 1: in cluster, 2: WAN
    row: str  # the row's Model cell
    column: str  # the column's heading
    published: Figure
    ways: tuple[tuple[str, Fraction], ...]  # (how, value): each recomputation from the stated inputs

    def follows(self, i: int = 0) -> bool:
        return self.published.rounds_to(self.ways[i][1])


def in_cluster_row(r: tables.Row) -> list[Recomputed]:
    """Table 1's figures of one row: TCP and RDMA time from the size, the saving from the times."""
    name, size_c, tcp_c, rdma_c, gpus_c, usd_c = r.cells
    size, tcp, rdma, usd = figure(size_c), figure(tcp_c), figure(rdma_c), figure(usd_c)
    gpus = gpu_count(gpus_c)
    cols = tables.IN_CLUSTER_COLUMNS
    t_tcp, t_rdma = seconds(size.value, TCP_GBIT), seconds(size.value, RDMA_GBIT)
    gb = exact(size.value)

    def rec(col, fig, *ways):
        return Recomputed(table=1, row=name, column=cols[col], published=fig, ways=ways)

    return [
        rec(2, tcp, (f"{gb} GB at {exact(TCP_GBIT)} Gbit/s", t_tcp)),
        rec(3, rdma, (f"{gb} GB at {exact(RDMA_GBIT)} Gbit/s", t_rdma)),
        rec(5, usd, (f"(published TCP - RDMA) x {gpus} GPUs x ${exact(USD_PER_GPU_S)}",
                     (tcp.value - rdma.value) * gpus * USD_PER_GPU_S),
            (f"(recomputed TCP - RDMA) x {gpus} GPUs x ${exact(USD_PER_GPU_S)}",
             (t_tcp - t_rdma) * gpus * USD_PER_GPU_S)),
    ]


def wan_row_figures(r: tables.Row) -> list[Recomputed]:
    """Table 2's figures of one row: the full time from the size, the delta from the full time."""
    name, size_c, full_c, delta_c = r.cells
    size, full, delta = figure(size_c), figure(full_c), figure(delta_c)
    cols = tables.WAN_COLUMNS
    t_full = seconds(size.value, WAN_GBIT)
    keep = 1 - WAN_DELTA_SAVING
    pct = exact(keep * 100)
    return [
        Recomputed(table=2, row=name, column=cols[2], published=full,
                   ways=((f"{exact(size.value)} GB at {exact(WAN_GBIT)} Gbit/s", t_full),)),
        Recomputed(table=2, row=name, column=cols[3], published=delta,
                   ways=((f"{pct}% of the published full time", full.value * keep),
                         (f"{pct}% of the recomputed full time", t_full * keep))),
    ]


def recomputed() -> list[Recomputed]:
    """Every figure of both tables that follows from others, recomputed from the table's stated inputs."""
    return ([x for r in tables.IN_CLUSTER for x in in_cluster_row(r)]
            + [x for r in tables.WAN for x in wan_row_figures(r)])


# The tables as numbers (catalog name, GB, seconds), for the comparisons with the model configs.
TRANSFER_TABLE = [(r.model, float(figure(r.cells[1]).value), float(figure(r.cells[2]).value),
                   float(figure(r.cells[3]).value)) for r in tables.IN_CLUSTER if r.lora is None]
LORA_TABLE = [(r.model, r.lora[0], r.lora[1], float(figure(r.cells[1]).value)) for r in tables.IN_CLUSTER if r.lora]
WAN_TABLE = [(r.model, float(figure(r.cells[1]).value), float(figure(r.cells[2]).value),
              float(figure(r.cells[3]).value)) for r in tables.WAN]


def _model_gb(r: tables.Row) -> float:
    m = get_model(r.model)
    if r.lora:
        return lora_size(m, LoraConfig(rank=r.lora[1], layout=r.lora[0])).bytes / 1e9
    return checkpoint_bytes(m) / 1e9


def _gb(r: tables.Row) -> str:
    """The size cell without its dtype: '357 GB'."""
    return r.cells[1].split(" (")[0]


def notes() -> list[str]:
    """What the figures imply where they do not follow from their inputs, and what their sizes are."""
    out = []
    t1 = {r.model: r for r in tables.IN_CLUSTER if r.lora is None}
    for r in tables.IN_CLUSTER:
        for x in in_cluster_row(r):
            if x.follows(0):
                continue
            p = x.published
            if x.column == tables.IN_CLUSTER_COLUMNS[5]:
                why = (f"{x.ways[1][0]} gives {p.show(x.ways[1][1])}: the saving was worked out before the times "
                       "were rounded" if x.follows(1) else "neither way gives it")
            else:
                gb = _model_gb(r)
                rate = TCP_GBIT if "TCP" in x.column else RDMA_GBIT
                t = Fraction(gb) * 8 / rate
                why = f"the model's {gb:.2f} GB gives {p.approx(t)}"
                size = figure(r.cells[1]).value
                if p.rounds_to(t):
                    why += ", which rounds to it"
                    if int(gb * 10) / 10 == float(size):
                        why += f": the size column truncates {gb:.2f} GB to {exact(size)} GB"
            out.append(f"Table 1, {x.row}, {x.column}: {x.ways[0][0]} gives {p.show(x.ways[0][1])}, printed {p.text}; "
                       f"{why}")
    rounded = []
    for r in tables.WAN:
        size = figure(r.cells[1])
        full, delta = wan_row_figures(r)
        one = t1.get(r.model)
        if one is not None and figure(one.cells[1]).value != size.value:
            rounded.append(f"{r.cells[0]} {exact(size.value)} GB (table 1: {exact(figure(one.cells[1]).value)} GB)")
        if not full.follows():
            gb = full.published.value * WAN_GBIT / 8
            out.append(f"Table 2, {r.cells[0]}: {full.published.text} is {exact(gb)} GB at {exact(WAN_GBIT)} Gbit/s; "
                       f"{exact(size.value)} GB gives {full.published.show(full.ways[0][1])} "
                       f"({float(full.ways[0][1]):.1f} s)")
        if not delta.follows():
            out.append(f"Table 2, {r.cells[0]}: {delta.ways[0][0]} is {delta.published.show(delta.ways[0][1])}, "
                       f"printed as {delta.published.text}")
    if rounded:
        out.append("Table 2 uses rounded sizes: " + "; ".join(rounded))
    for r in tables.WAN:
        m, one = get_model(r.model), t1.get(r.model)
        size = figure(r.cells[1]).value
        says_bf16 = "BF16" in r.cells[1] and "INT4" not in r.cells[1]
        if says_bf16 and one is not None and size < figure(one.cells[1]).value * 3 / 4:
            n = total_params(m)
            out.append(f"{r.cells[0]} is {_gb(one)} BF16 in table 1 but {_gb(r)} \"BF16\" in table 2: "
                       f"{float(size) * 1e9 / n:.2f} bytes per parameter of the model's {n / 1e9:.1f}B, "
                       "about one byte per parameter (FP8-sized), not BF16")
    for r in tables.IN_CLUSTER:
        m = get_model(r.model)
        if r.lora is None and "INT4" in r.cells[1] and m.quant:
            parts = checkpoint_parts(m)
            out.append(f"{r.cells[0]}'s {_gb(r)} is the INT4 checkpoint (routed experts {m.quant.bits}-bit, group "
                       f"{m.quant.group_size}) with BF16 attention: the model's checkpoint is "
                       f"{checkpoint_bytes(m) / 1e9:.1f} GB (INT4 codes {parts['codes'] / 1e9:.1f} GB, scales "
                       f"{parts['scales'] / 1e9:.1f} GB, BF16 rest {parts['rest'] / 1e9:.1f} GB); in BF16 it would "
                       f"be {weight_bytes(m, 'bf16') / 1e9:.1f} GB")
            qd = quantized_delta(m)
            if qd is not None:
                out.append(f"{r.cells[0]}'s delta is 2% of {_gb(r)} in table 2 by assumption; at the fractions of "
                           f"its codes, scales and BF16 rest measured to change per version it is "
                           f"{qd.bytes / 1e9:.2f} GB ({1 - qd.bytes / checkpoint_bytes(m):.1%} saved), "
                           f"{qd.bytes * 8 / (float(WAN_GBIT) * 1e9):.2f} s at {exact(WAN_GBIT)} Gbit/s "
                           f"(`wsync plan transfer --model {m.name}`; {qd.source})")
        if r.lora is None and breakdown(m)["mtp"] and m.mtp_own_embeddings:
            out.append(f"{r.cells[0]}'s {_gb(r)} includes the MTP layer with its own embedding and head copies "
                       f"({breakdown(m)['mtp'] * 2 / 1e9:.1f} GB)")
    out.append("LoRA sizes are bf16 adapters on every linear layer; fp32 would double them")
    return out


@dataclass(frozen=True, kw_only=True)
class Check:
    """A published figure against the planner's model-config recomputation."""

    figure: str  # what was published, in words
    published: float
    from_own_numbers: float | None  # recomputed from the table's stated inputs (None: a size, an input itself)
    from_model: float  # recomputed from the model config
    tolerance: float  # 1% (a LoRA row's 3%), plus the published figure's own rounding

    def error(self, which: str = "from_model") -> float | None:
        v = getattr(self, which)
        if v is None:
            return None
        return abs(v - self.published) / self.published


def _check(what: str, fig: Figure, own: Fraction | None, model: float, base: float = 0.01) -> Check:
    half_unit = float(Decimal(1).scaleb(Decimal(fig.digits).as_tuple().exponent)) / 2
    tol = base + half_unit / float(Decimal(fig.digits))
    return Check(figure=what, published=float(fig.value), from_own_numbers=None if own is None else float(own),
                 from_model=model, tolerance=tol)


def audit() -> list[Check]:
    """Every published figure against the model configs (sizes, times, savings of both tables)."""
    out = []
    for r in tables.IN_CLUSTER:
        gb = _model_gb(r)
        label = r.model + (f" LoRA r={r.lora[1]} {r.lora[0]}" if r.lora else "")
        tcp_m, rdma_m = seconds(gb, float(TCP_GBIT)), seconds(gb, float(RDMA_GBIT))
        tcp, rdma, usd = in_cluster_row(r)
        gpus = gpu_count(r.cells[4])
        base = 0.03 if r.lora else 0.01  # a LoRA row's times and saving carry its size's error
        out += [_check(f"{label} size GB", figure(r.cells[1]), None, gb, base),
                _check(f"{label} full sync s, TCP 50 Gbit/s", tcp.published, tcp.ways[0][1], tcp_m, base),
                _check(f"{label} full sync s, RDMA 3.2 Tbit/s", rdma.published, rdma.ways[0][1], rdma_m, base),
                _check(f"{label} USD saved per step, {gpus} GPUs", usd.published, usd.ways[0][1],
                       (tcp_m - rdma_m) * gpus * IDLE_USD_PER_GPU_S, base)]
    for r in tables.WAN:
        full, delta = wan_row_figures(r)
        m_full, m_delta, _ = wan_row(r.model)
        model_gb = checkpoint_bytes(get_model(r.model)) / 1e9
        out += [_check(f"{r.model} size GB in the WAN table", figure(r.cells[1]), None, model_gb),
                _check(f"{r.model} full sync s, WAN 10 Gbit/s", full.published, full.ways[0][1], m_full),
                _check(f"{r.model} delta sync s, 98% saved, WAN 10 Gbit/s", delta.published, delta.ways[0][1], m_delta)]
    return out


def wan_row(name: str) -> tuple[float, float, float]:
    """(full sync s, delta sync s, idle USD saved per sync and GPU) of `name` over the WAN, from its config."""
    full = seconds(checkpoint_bytes(get_model(name)) / 1e9, float(WAN_GBIT))
    delta = full * (1 - float(WAN_DELTA_SAVING))
    return full, delta, (full - delta) * IDLE_USD_PER_GPU_S


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
