"""A quantized checkpoint in the planner: its layout (codes, scales, BF16 rest) adds up to the checkpoint, its delta
is each part's elements x the fraction measured to change x the bytes measured per change, the Kimi rows name
both and where the numbers come from, and every other model's rows are what they were."""
from __future__ import annotations

import json

import pytest

from wsync.cli import main
from wsync.plan import measured
from wsync.plan import published as pub
from wsync.plan.catalog import CATALOG
from wsync.plan.models import get_model, model_names
from wsync.plan.params import breakdown, checkpoint_bytes, checkpoint_parts
from wsync.plan.quant import QUANT_LR, quantized_delta
from wsync.plan.transfer import LINKS, Codec, codec_label, parse_codec, payload_bytes, sync_cost

KIMI = get_model("kimi-k2.6")
INT8 = {"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}}}}


def _scheme(config, lr=QUANT_LR, codes=0.001, scales=0.01, rest=0.02):
    return {"config": config, "exact": True, "quantize_vs_bf16_delta_encode": 1.0, "per_version": {lr: {
        "fraction_changed": {"codes": codes, "scales": scales, "bf16_rest": rest, "bf16_quantized": 0.03,
                             "rest": rest},
        "bytes_per_changed": {"codes": 2.0, "scales": 3.0, "rest": 1.5}, "versions": 2}}}


def _inputs(**schemes) -> dict:
    return {"quant": {"file": "2026-01-01-test-quant.json", "machine": {"cpu": "Test CPU", "cores": 2, "gpu": None,
                                                                        "backend": "cpu"},
                      "source": "generated bench snapshots, lr 1e-06, 2 consecutive step(s) each", "experts": 8,
                      "schemes": schemes}}


KIMI_RUN = _inputs(int8=_scheme(INT8, codes=0.5), kimi=_scheme(CATALOG["kimi-k2.6"]["config"]["quantization_config"]))


@pytest.fixture
def measured_kimi(monkeypatch):
    data = {**measured.inputs(), **KIMI_RUN}
    monkeypatch.setattr(measured, "inputs", lambda: data)


@pytest.mark.parametrize("name", model_names())
def test_the_layout_adds_up_to_the_checkpoint(name):
    m = get_model(name)
    parts = checkpoint_parts(m)
    assert int(sum(parts.values())) == checkpoint_bytes(m)
    if m.quant is None:
        assert list(parts) == ["rest"]
        return
    experts = breakdown(m)["routed_experts"]  # Kimi quantizes exactly its routed experts
    assert parts["codes"] == experts * m.quant.bits / 8
    assert parts["scales"] == experts // m.quant.group_size * m.quant.scale_bytes
    assert parts["rest"] + parts["codes"] + parts["scales"] + parts["shapes"] == pytest.approx(checkpoint_bytes(m))


def test_the_delta_prices_each_part_from_its_measured_fraction():
    qd = quantized_delta(KIMI, KIMI_RUN)
    parts = checkpoint_parts(KIMI)
    want = {"codes": parts["codes"] / 0.5 * 0.001 * 2.0, "scales": parts["scales"] / 2 * 0.01 * 3.0,
            "rest": parts["rest"] / 2 * 0.02 * 1.5}
    assert {k: p.delta_bytes for k, p in qd.parts.items()} == pytest.approx(want)
    assert qd.bytes == pytest.approx(sum(want.values()))
    assert qd.layout == "int4-g32"
    assert "2026-01-01-test-quant.json: scheme kimi, lr 1e-06, 2 version(s)" in qd.source and "Test CPU" in qd.source


def test_only_a_run_of_the_same_format_at_the_rl_learning_rate_prices_a_delta():
    assert quantized_delta(KIMI, _inputs(int8=_scheme(INT8))) is None  # INT8 channels are not Kimi's INT4 groups
    kimi_qc = CATALOG["kimi-k2.6"]["config"]["quantization_config"]
    g64 = json.loads(json.dumps(kimi_qc).replace('"group_size": 32', '"group_size": 64'))
    assert quantized_delta(KIMI, _inputs(kimi=_scheme(g64))) is None
    assert quantized_delta(KIMI, _inputs(kimi=_scheme(kimi_qc, lr="1e-05"))) is None
    assert quantized_delta(KIMI, {"quant": None}) is None
    assert quantized_delta(get_model("qwen3-8b"), KIMI_RUN) is None


def test_kimi_rows_use_the_quantized_layout_and_the_measured_delta(measured_kimi):
    qd = quantized_delta(KIMI)
    full = checkpoint_bytes(KIMI)
    assert payload_bytes(KIMI, parse_codec("full")) == (full, full)
    assert payload_bytes(KIMI, parse_codec("delta")) == (pytest.approx(qd.bytes), full)
    assert codec_label(KIMI, parse_codec("full")) == "full int4-g32"
    assert codec_label(KIMI, parse_codec("delta")) == f"delta int4-g32 -{1 - qd.bytes / full:.1%}"
    s = sync_cost(KIMI, LINKS["wan-10g"], parse_codec("delta"))
    assert s.wire_bytes == pytest.approx(qd.bytes) and s.codec.startswith("delta int4-g32 -")
    # a saving given on the command line prices every model alike, Kimi included; so does counting it in a dtype
    assert payload_bytes(KIMI, parse_codec("delta", saving=0.98))[0] == pytest.approx(full * 0.02)
    assert codec_label(KIMI, parse_codec("delta", saving=0.98)) == "delta -98%"
    assert payload_bytes(KIMI, Codec(kind="delta", saving=0.9))[0] == pytest.approx(full * 0.1)  # as it always was
    bf16 = payload_bytes(KIMI, parse_codec("delta"), "bf16")
    assert bf16[0] == pytest.approx(bf16[1] * 0.02) and codec_label(KIMI, parse_codec("full"), "bf16") == "full"


@pytest.mark.parametrize("name", [n for n in model_names() if get_model(n).quant is None])
def test_every_other_model_prices_its_delta_as_before(measured_kimi, name):
    m = get_model(name)
    full = checkpoint_bytes(m)
    assert payload_bytes(m, parse_codec("delta")) == (pytest.approx(full * 0.02), full)
    assert codec_label(m, parse_codec("delta")) == "delta -98%" and codec_label(m, parse_codec("full")) == "full"


def test_the_transfer_table_names_the_layout_and_the_run(measured_kimi, capsys):
    assert main(["plan", "transfer", "--model", "kimi-k2.6", "--model", "qwen3-8b", "--link", "wan-10g"]) == 0
    out = capsys.readouterr().out
    qd = quantized_delta(KIMI)
    assert "kimi-k2.6  full int4-g32 " in out and f"kimi-k2.6  delta int4-g32 -{1 - qd.bytes / 595148192736:.1%}" in out
    assert "qwen3-8b   delta -98% " in out
    assert ("kimi-k2.6 full int4-g32: the checkpoint as stored, INT4 codes 507.343 GB + scales 63.418 GB + "
            "weight_shape 0.001 GB + BF16 rest 24.387 GB = 595.148 GB") in out
    assert "kimi-k2.6 delta int4-g32, per version: INT4 codes 0.100% changed x 2.00 B = 2.029 GB + " in out
    assert f"; {qd.bytes / 1e9:.3f} GB. Measured: 2026-01-01-test-quant.json: scheme kimi" in out
    assert main(["plan", "transfer", "--model", "kimi-k2.6", "--model", "qwen3-8b", "--link", "wan-10g",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    kimi = {r["codec"].split()[0]: r for r in rows if r["model"] == "kimi-k2.6"}
    assert kimi["full"]["layout_gb"] == {k: v / 1e9 for k, v in checkpoint_parts(KIMI).items()}
    assert kimi["delta"]["quant_delta"]["parts"]["codes"]["delta_gb"] == pytest.approx(2.029, abs=1e-3)
    assert "quant_delta" not in kimi["full"] and "layout_gb" not in kimi["lora"]
    assert all("layout_gb" not in r and "quant_delta" not in r for r in rows if r["model"] == "qwen3-8b")


def test_without_a_run_of_its_format_the_delta_row_says_so(monkeypatch, capsys):
    data = {**measured.inputs(), "quant": None}
    monkeypatch.setattr(measured, "inputs", lambda: data)
    assert main(["plan", "transfer", "--model", "kimi-k2.6", "--link", "wan-10g", "--codec", "delta"]) == 0
    out = capsys.readouterr().out
    assert "kimi-k2.6  delta -98% " in out
    assert "kimi-k2.6 delta: no measured run of its int4-g32 format in the measured inputs" in out


def test_the_published_notes_follow_kimi_from_its_layout(measured_kimi):
    notes = pub.notes()
    assert any("the model's checkpoint is 595.1 GB (INT4 codes 507.3 GB, scales 63.4 GB, BF16 rest 24.4 GB)" in n
               for n in notes)
    qd = quantized_delta(KIMI)
    delta = next(n for n in notes if n.startswith("Kimi 2.6's delta is 2% of 595.2 GB in table 2 by assumption"))
    assert f"{qd.bytes / 1e9:.2f} GB" in delta and f"{qd.bytes * 8 / 10e9:.2f} s at 10 Gbit/s" in delta
    assert "2026-01-01-test-quant.json" in delta


def test_the_packaged_inputs_price_kimi_from_a_committed_run():
    entry = measured.inputs()["quant"]
    assert entry is not None and entry["file"].endswith("-quant.json")
    qd = quantized_delta(KIMI)
    assert qd is not None and entry["file"] in qd.source
    per = entry["schemes"]["kimi"]["per_version"][QUANT_LR]
    assert entry["schemes"]["kimi"]["exact"]
    assert 0 < qd.bytes < 0.02 * checkpoint_bytes(KIMI)
    # what the measurement is about: an INT4 code changes far less often than the BF16 values it is made from
    assert per["fraction_changed"]["codes"] < per["fraction_changed"]["bf16_quantized"]
