"""`wsync plan transfer --published`: every figure of both published tables beside wsync's recomputation from
the inputs each table states, worked out here again in exact arithmetic, and the notes on what does not follow."""
from __future__ import annotations

import contextlib
import io
import json
import re
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import pytest

from wsync.cli import main
from wsync.plan import published as pub
from wsync.plan import published_tables as tables

SEED = Path(__file__).resolve().parents[2] / "shared" / "SEED_TABLES.md"

# The published figures, pinned: (model, size, TCP, RDMA, reference GPUs, saving) and (model, size, full, delta).
TABLE_1 = [
    ("Qwen3 8B", "16.3 GB (BF16)", "2.62 s", "41 ms", "1x8 H100", "$0.21"),
    ("Qwen3-30B-A3B", "61.1 GB (BF16)", "9.78 s", "153 ms", "1x8 H100", "$0.77"),
    ("Qwen3-30B-A3B LoRA (r=32, shared-outer)", "1.0 GB (BF16)", "160 ms", "2.5 ms", "1x8 H100", "$0.013"),
    ("GLM 4.7", "716.7 GB (BF16)", "114.67 s", "1.79 s", "4x8 B200", "$36.12"),
    ("GLM-4.7 LoRA (r=32, shared-outer)", "4.7 GB (BF16)", "752 ms", "11.75 ms", "4x8 B200", "$0.24"),
    ("GLM-4.7 LoRA (r=32, per-expert)", "18.8 GB (BF16)", "3.01 s", "47 ms", "4x8 B200", "$0.95"),
    ("Kimi 2.6", "595.2 GB (INT4 MoE / BF16 attn)", "95.23 s", "1.49 s", "16x8 H200", "$119.99"),
    ("Kimi 2.6 LoRA (r=32, shared-outer)", "9.4 GB (BF16)", "1.50 s", "23.5 ms", "16x8 H200", "$1.90"),
    ("Kimi 2.6 LoRA (r=32, per-expert)", "41.0 GB (BF16)", "6.56 s", "102.5 ms", "16x8 H200", "$8.27"),
]
TABLE_2 = [
    ("Qwen3 8B", "16 GB (BF16)", "12.8 s", "0.26 s"),
    ("Qwen3 30B-A3B", "60 GB (BF16)", "48 s", "0.96 s"),
    ("GLM 4.7 (~355B)", "357 GB (BF16)", "285.6 s", "5.73 s"),
    ("Kimi K2.6 (~1T)", "595.2 GB (INT4, MoE / BF16 attn)", "480 s", "9.6 s"),
]
# (TCP s - RDMA s) x GPUs x $0.01 from the printed times of each row of table 1, exactly
SAVING_FROM_PRINTED_TIMES = ["0.20632", "0.77016", "0.0126", "36.1216", "0.23688", "0.94816", "119.9872", "1.88992",
                             "8.2656"]
TCP, RDMA, WAN, KEEP, USD = Fraction(50), Fraction(3200), Fraction(10), Fraction(2, 100), Fraction(1, 100)


def _num(cell: str) -> Fraction:
    """A published cell in seconds, GB or USD."""
    n = Fraction(re.search(r"\d+(?:\.\d+)?", cell).group())
    return n / 1000 if re.match(r"[\d.]+ ms", cell) else n


def _gpus(cell: str) -> int:
    a, b = re.match(r"(\d+)x(\d+)", cell).groups()
    return int(a) * int(b)


def _dec(x: Fraction) -> str:
    """Every recomputation here terminates: write it out in full."""
    assert _factors(x.denominator) <= {2, 5}, x
    return format((Decimal(x.numerator) / Decimal(x.denominator)).normalize(), "f")


def _factors(n: int) -> set[int]:
    out, p = set(), 2
    while n > 1:
        while n % p == 0:
            out.add(p)
            n //= p
        p += 1
    return out


def _unit(cell: str, x: Fraction) -> str:
    """x written in the published cell's own unit, as the command prints a recomputation."""
    if cell.startswith("$"):
        return f"${_dec(x)}"
    if re.match(r"[\d.]+ ms", cell):
        return f"{_dec(x * 1000)} ms"
    return f"{_dec(x)} s"


@pytest.fixture(scope="module")
def out() -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["plan", "transfer", "--published"]) == 0
    return buf.getvalue()


@pytest.fixture(scope="module")
def as_json() -> dict:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["plan", "transfer", "--published", "--json"]) == 0
    return json.loads(buf.getvalue())


def _line(out: str, model: str, table: int) -> str:
    """The model's row of table 1 or 2 as printed."""
    part = out.split("\nTable 2: ")[table - 1].split("\nNotes on figures")[0]
    (line,) = [x for x in part.splitlines() if x.startswith(model + "  ")]
    return line


def test_the_package_holds_every_published_figure():
    assert [r.cells for r in tables.IN_CLUSTER] == TABLE_1
    assert [r.cells for r in tables.WAN] == TABLE_2
    assert tables.IN_CLUSTER_INPUTS == {"tcp_gbit_per_s": "50", "rdma_gbit_per_s": "3200", "usd_per_gpu_s": "0.01"}
    assert tables.WAN_INPUTS == {"wan_gbit_per_s": "10", "delta_saving": "0.98"}


def _markdown_table(text: str, heading: str) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = [tuple(c.strip() for c in line.strip().strip("|").split("|")) for line in section.splitlines()
            if line.startswith("|")]
    return rows[0], [r for r in rows[2:]]


@pytest.mark.skipif(not SEED.is_file(), reason="the task's copy of the published tables is not beside this checkout")
def test_every_figure_matches_the_published_tables():
    text = SEED.read_text()
    cols, rows = _markdown_table(text, "## Table 1")
    assert cols == tables.IN_CLUSTER_COLUMNS and rows == TABLE_1 == [r.cells for r in tables.IN_CLUSTER]
    cols, rows = _markdown_table(text, "## Table 2")
    assert cols == tables.WAN_COLUMNS and rows == TABLE_2 == [r.cells for r in tables.WAN]
    assert "Assumes 50 Gbit/s over TCP and 3.2 Tbit/s over RDMA." in text
    assert "Assumes a 10 Gbit/s WAN link and that delta compression saves 98% of the weight update." in text
    assert "$0.01 per GPU-second" in text


def test_every_published_cell_is_printed_on_its_row(out):
    assert "Table 1: in-cluster weight update, NCCL over TCP vs over RDMA. Inputs: 50 Gbit/s TCP, 3.2 Tbit/s RDMA, " \
           "$0.01 per GPU-second x the reference GPU count." in out
    assert "Table 2: disaggregated RL over a WAN, full weights vs delta compression. Inputs: 10 Gbit/s WAN, delta " \
           "compression saves 98% of the weight update." in out
    for table, row in [(1, r) for r in TABLE_1] + [(2, r) for r in TABLE_2]:
        line = _line(out, row[0], table)
        for cell in row[1:]:
            assert f"  {cell} " in line + " ", (row[0], cell)


def test_table_1_times_recomputed_from_the_size(out):
    for model, size, tcp, rdma, gpus, _ in TABLE_1:
        line = _line(out, model, 1)
        gb = _num(size)
        for cell, rate in ((tcp, TCP), (rdma, RDMA)):
            assert f"  {_unit(cell, gb * 8 / rate)}" in line, (model, cell)
        assert f"{gpus} = {_gpus(gpus)}" in line


def test_table_1_saving_recomputed_on_every_row(out):
    for (model, size, tcp, rdma, gpus, usd), want in zip(TABLE_1, SAVING_FROM_PRINTED_TIMES):
        n = _gpus(gpus)
        printed = (_num(tcp) - _num(rdma)) * n * USD
        assert _dec(printed) == want, model
        recomputed = (_num(size) * 8 / TCP - _num(size) * 8 / RDMA) * n * USD
        line = _line(out, model, 1)
        cells = re.split(r"\s{2,}", line.strip())
        assert cells[-3:-1] == [usd, f"${want}" + ("" if model != "Kimi 2.6 LoRA (r=32, shared-outer)" else " !")], \
            (model, cells)
        assert cells[-1] == f"${_dec(recomputed)}", (model, cells)
    assert "saving = (TCP s - RDMA s) x GPUs x $0.01" in out


def test_table_2_recomputed_from_the_size_and_the_saving(out):
    for model, size, full, delta in TABLE_2:
        cells = re.split(r"\s{2,}", _line(out, model, 2).strip())
        t = _num(size) * 8 / WAN
        assert cells[:3] == [model, size, full]
        assert cells[3].removesuffix(" !") == f"{_dec(t)} s"
        assert cells[4] == delta
        assert cells[5].removesuffix(" !") == f"{_dec(_num(full) * KEEP)} s"
        assert cells[6].removesuffix(" !") == f"{_dec(t * KEEP)} s"


def test_exactly_the_figures_that_do_not_follow_are_marked(out):
    """A '!' where the recomputation, rounded half up to the printed places, is not the printed figure."""
    marked = {(x.row, x.column, how) for x in pub.recomputed() for i, (how, _) in enumerate(x.ways) if not x.follows(i)}
    assert marked == {
        ("Qwen3 8B", "NCCL over TCP", "16.3 GB at 50 Gbit/s"),
        ("Kimi 2.6 LoRA (r=32, shared-outer)", "Estimated cost savings per training step",
         "(published TCP - RDMA) x 128 GPUs x $0.01"),
        ("GLM 4.7 (~355B)", "Delta compression", "2% of the published full time"),
        ("GLM 4.7 (~355B)", "Delta compression", "2% of the recomputed full time"),
        ("Kimi K2.6 (~1T)", "Full weights transfer time", "595.2 GB at 10 Gbit/s"),
        ("Kimi K2.6 (~1T)", "Delta compression", "2% of the recomputed full time"),
    }
    tables_part = out.split("Notes on figures")[0]
    assert tables_part.count(" !") == len(marked)


def test_the_notes_are_printed(out):
    notes = out.split("Notes on figures that do not follow from their inputs, and on the sizes:\n", 1)[1]
    for want in (
        "Table 2 uses rounded sizes: Qwen3 8B 16 GB (table 1: 16.3 GB); Qwen3 30B-A3B 60 GB (table 1: 61.1 GB)",
        "Table 2, Kimi K2.6 (~1T): 480 s is 600 GB at 10 Gbit/s; 595.2 GB gives 476.16 s (476.2 s)",
        "Table 2, GLM 4.7 (~355B): 2% of the published full time is 5.712 s, printed as 5.73 s",
        "GLM 4.7 (~355B) is 716.7 GB BF16 in table 1 but 357 GB \"BF16\" in table 2: 1.00 bytes per parameter",
        "about one byte per parameter (FP8-sized), not BF16",
        "Kimi 2.6's 595.2 GB is the INT4 checkpoint (routed experts 4-bit, group 32) with BF16 attention",
        "Table 1, Qwen3 8B, NCCL over TCP: 16.3 GB at 50 Gbit/s gives 2.608 s, printed 2.62 s; the model's 16.38 GB "
        "gives 2.621 s, which rounds to it: the size column truncates 16.38 GB to 16.3 GB",
        "(published TCP - RDMA) x 128 GPUs x $0.01 gives $1.88992, printed $1.90; (recomputed TCP - RDMA) x 128 GPUs "
        "x $0.01 gives $1.89504: the saving was worked out before the times were rounded",
    ):
        assert want in notes, want
    assert [f" - {n}" for n in pub.notes()] == [x for x in notes.splitlines() if x.startswith(" - ")][:len(pub.notes())]


def test_json_has_every_figure_and_its_recomputations(as_json):
    assert as_json["tables"]["1"]["rows"] == [list(r) for r in TABLE_1]
    assert as_json["tables"]["2"]["rows"] == [list(r) for r in TABLE_2]
    figs = {(f["model"], f["column"]): f for f in as_json["recomputed"]}
    assert len(figs) == 3 * len(TABLE_1) + 2 * len(TABLE_2)  # TCP, RDMA, saving; full, delta
    for (model, *_, usd), want in zip(TABLE_1, SAVING_FROM_PRINTED_TIMES):
        f = figs[(model, "Estimated cost savings per training step")]
        assert f["published"] == usd and f["recomputed"][0]["value"] == want
    kimi = figs[("Kimi K2.6 (~1T)", "Full weights transfer time")]
    assert kimi["published_value"] == "480" and kimi["recomputed"] == [
        {"how": "595.2 GB at 10 Gbit/s", "value": "476.16", "shown": "476.16 s", "rounds_to_published": False}]
    assert as_json["notes"] == pub.notes()
    assert {c["figure"] for c in as_json["checks"]} == {c.figure for c in pub.audit()}


def test_figures_parse_and_round_half_up():
    f = pub.figure("41 ms")
    assert (f.value, f.unit, f.digits) == (Fraction(41, 1000), "ms", "41")
    assert f.rounds_to(Fraction("0.04075")) and not f.rounds_to(Fraction("0.0404"))
    assert pub.figure("0.26 s").rounds_to(Fraction("0.255"))  # half up, not to even
    assert pub.figure("$0.013").rounds_to(Fraction("0.0126")) and pub.figure("$0.013").value == Fraction(13, 1000)
    assert not pub.figure("5.73 s").rounds_to(Fraction("5.712"))
    assert pub.figure("595.2 GB (INT4 MoE / BF16 attn)").value == Fraction("595.2")
    assert pub.gpu_count("16x8 H200") == 128 and pub.gpu_count("1x8 H100") == 8
    assert pub.exact(Fraction(1, 3)) == "~0.333333" and pub.exact(Fraction("36.12168")) == "36.12168"
    for bad in ("H100", "about 5"):
        with pytest.raises(ValueError):
            pub.figure(bad)
