"""Model configs as data: parameter counts and checkpoint bytes against published totals."""
from __future__ import annotations

import json

import pytest

from wsync.errors import WsyncError
from wsync.plan.models import PlanError, from_hf_config, get_model, model_names
from wsync.plan.params import (active_params, breakdown, checkpoint_bytes, kv_bytes_per_token, sites, total_params,
                               weight_bytes)


@pytest.mark.parametrize("name, total, active, tol", [
    ("qwen3-8b", 8.19e9, 8.19e9, 0.005),          # model card: 8.2B
    ("qwen3-30b-a3b", 30.5e9, 3.3e9, 0.02),       # model card: 30.5B total, 3.3B activated
    ("qwen3-235b-a22b", 235e9, 22e9, 0.01),       # model card: 235B total, 22B activated
    ("glm-4.7", 358e9, 32e9 + 1.55e9, 0.005),     # HF shows 358B; 32B active excludes embed+head (1.55B)
    ("kimi-k2.6", 1.027e12, 32.9e9, 0.01),        # "1T total, 32B active": 1.0265T text + 0.47B vision
])
def test_published_totals(name, total, active, tol):
    m = get_model(name)
    assert total_params(m) == pytest.approx(total, rel=tol)
    assert active_params(m) == pytest.approx(active, rel=max(tol, 0.02))


@pytest.mark.parametrize("name, exact", [
    ("llama-3.1-8b", 8_030_261_248),   # safetensors parameter count of meta-llama/Llama-3.1-8B
    ("llama-3.1-70b", 70_553_706_496),  # and of Llama-3.1-70B
])
def test_exact_counts(name, exact):
    assert total_params(get_model(name)) == exact


def test_kimi_checkpoint_bytes_match_the_shard_listing():
    # The K2.5/K2.6 checkpoint holds 554.27 GiB of tensors: INT4 experts packed in int32, bf16 group
    # scales (1 per 32 weights), an int32[2] shape per expert matrix, everything else bf16.
    b = checkpoint_bytes(get_model("kimi-k2.6"))
    assert b / 2**30 == pytest.approx(554.27, abs=0.01)
    assert b / 1e9 == pytest.approx(595.2, rel=1e-3)
    assert weight_bytes(get_model("kimi-k2.6"), "bf16") > 3 * b  # bf16 would be 2.05 TB


def test_glm_checkpoint_includes_mtp_layer_with_its_own_embeddings():
    m = get_model("glm-4.7")
    parts = breakdown(m)
    assert parts["mtp"] == pytest.approx(5.54e9, rel=0.01)
    assert checkpoint_bytes(m) / 1e9 == pytest.approx(716.7, rel=1e-4)


@pytest.mark.parametrize("name", model_names())
def test_breakdown_sums_and_sites_are_consistent(name):
    m = get_model(name)
    parts = breakdown(m)
    assert sum(parts.values()) == total_params(m)
    assert all(v >= 0 for v in parts.values())
    assert sum(s.params for s in sites(m)) < total_params(m)
    assert active_params(m) <= total_params(m)
    assert kv_bytes_per_token(m) > 0


def test_mla_caches_latent_not_heads():
    kimi, llama = get_model("kimi-k2.6"), get_model("llama-3.1-70b")
    assert kv_bytes_per_token(kimi) == 61 * (512 + 64) * 2
    assert kv_bytes_per_token(llama) == 80 * 2 * 8 * 128 * 2


def test_user_config_file(tmp_path):
    cfg = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
           "vocab_size": 100, "tie_word_embeddings": True}
    p = tmp_path / "tiny" / "config.json"
    p.parent.mkdir()
    p.write_text(json.dumps(cfg))
    m = get_model(str(p.parent))
    # embeddings (tied) + per layer 4*64*64 attention + 3*64*128 MLP + 2*64 norms, + final norm
    assert total_params(m) == 100 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64
    assert m.head_dim == 16 and m.num_kv_heads == 4


def test_bad_input_raises_plan_error(tmp_path):
    with pytest.raises(PlanError, match="unknown model"):
        get_model("no-such-model")
    with pytest.raises(PlanError, match="lacks 'vocab_size'"):
        from_hf_config({"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
                        "intermediate_size": 8}, name="x", source="test")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(WsyncError, match="not valid JSON"):
        get_model(str(bad))
    with pytest.raises(PlanError, match="not modelled"):
        from_hf_config({"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1, "intermediate_size": 8,
                        "vocab_size": 8, "quantization_config": {"quant_method": "fp8"}}, name="x", source="t")
    with pytest.raises(PlanError, match="unknown dtype"):
        weight_bytes(get_model("qwen3-8b"), "fp7")


def test_every_catalog_entry_names_its_source():
    for n in model_names():
        assert get_model(n).source.startswith("https://huggingface.co/")
