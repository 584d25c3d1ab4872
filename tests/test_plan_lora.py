"""LoRA size calculator: the published figures, the layout definitions, bad input."""
from __future__ import annotations

import pytest

from wsync.plan.lora import LAYOUTS, LoraConfig, lora_bytes, lora_size
from wsync.plan.models import PlanError, from_hf_config, get_model
from wsync.plan.published import LORA_TABLE


@pytest.mark.parametrize("name, layout, rank, gb", LORA_TABLE)
def test_published_lora_figures_within_3_percent(name, layout, rank, gb):
    got = lora_bytes(get_model(name), rank=rank, layout=layout) / 1e9
    assert got == pytest.approx(gb, rel=0.03)


def test_fp32_adapters_would_not_match_the_published_figures():
    # the published sizes are bf16: fp32 doubles every one of them, far outside 3%
    for name, layout, rank, gb in LORA_TABLE:
        assert lora_bytes(get_model(name), rank=rank, layout=layout, dtype="fp32") / 1e9 > 1.9 * gb


TINY_MOE = {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 8, "intermediate_size": 32, "moe_intermediate_size": 4, "num_experts": 10,
            "num_experts_per_tok": 2, "vocab_size": 50, "tie_word_embeddings": False}


@pytest.mark.parametrize("layout, expert_params", [
    # per layer and projection: per-expert r(16+4) x 10; shared-outer r*16 once + r*4 x 10; dense: none
    ("per-expert", 3 * 10 * 2 * (16 + 4)),
    ("shared-outer", 3 * (2 * 16 + 10 * 2 * 4)),
    ("dense", 0),
])
def test_layout_formulas_on_a_tiny_moe(layout, expert_params):
    m = from_hf_config(TINY_MOE, name="tiny", source="test")
    size = lora_size(m, LoraConfig(rank=2, layout=layout))
    attention = 2 * (16 + 16) + 2 * (16 + 8) * 2 + 2 * (16 + 16)  # q, k, v, o at r=2
    assert size.params == 2 * (attention + expert_params)
    assert size.bytes == 2 * size.params


def test_shared_outer_shares_the_model_width_side():
    m = from_hf_config(TINY_MOE, name="tiny", source="test")
    by = lora_size(m, LoraConfig(rank=1, layout="shared-outer", targets=("experts",))).by_module
    # gate/up: A (1 x hidden) shared + B (expert_i x 1) per expert; down: A per expert + B (hidden x 1) shared
    assert by == {"experts.gate_proj": 2 * (16 + 10 * 4), "experts.up_proj": 2 * (16 + 10 * 4),
                  "experts.down_proj": 2 * (10 * 4 + 16)}


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "glm-4.7", "kimi-k2.6"])
def test_layouts_order_for_moe(name):
    m = get_model(name)
    dense, shared, per = (lora_bytes(m, layout=lay) for lay in ("dense", "shared-outer", "per-expert"))
    assert dense < shared < per


def test_layout_does_not_matter_for_dense_models():
    m = get_model("llama-3.1-8b")
    sizes = {lay: lora_bytes(m, layout=lay) for lay in LAYOUTS}
    assert len(set(sizes.values())) == 1
    # r=16 on q,k,v,o,gate,up,down of 32 layers: 16 * (4096+4096 + 2*(4096+1024) + 4096+4096 + 2*(4096+14336)
    # + 14336+4096) * 32
    per_layer = 16 * (8192 + 2 * 5120 + 8192 + 2 * 18432 + 18432)
    assert lora_bytes(m, rank=16) == 2 * 32 * per_layer


def test_targets_select_modules_and_groups():
    m = get_model("qwen3-8b")
    attn = lora_size(m, LoraConfig(targets=("attention",))).params
    qv = lora_size(m, LoraConfig(targets=("q_proj", "v_proj"))).params
    assert qv == 36 * 32 * ((4096 + 4096) + (4096 + 1024))
    assert qv < attn < lora_size(m).params


def test_mtp_layers_can_be_left_out():
    m = get_model("glm-4.7")
    assert lora_size(m, LoraConfig(include_mtp=False)).params < lora_size(m).params


def test_bad_lora_input():
    m = get_model("qwen3-8b")
    with pytest.raises(PlanError, match="layout"):
        lora_size(m, LoraConfig(layout="sideways"))
    with pytest.raises(PlanError, match="rank"):
        lora_size(m, LoraConfig(rank=0))
    with pytest.raises(PlanError, match="match nothing"):
        lora_size(m, LoraConfig(targets=("kv_b_proj",)))
