"""Published model configs, key for key as in each repo's config.json, with their source.

Only the keys the systems model reads are kept. Two keys are wsync's own, not
Hugging Face's, because config.json does not say them and the checkpoint does:
`mtp_own_embeddings` (the MTP layer ships private copies of the embedding and
the LM head, seen as `model.layers.92.embed_tokens` / `shared_head.head` in
GLM-4.x) and `moe_router_bias` (an fp32 `e_score_correction_bias` per MoE layer).
Checks against published totals are in tests/test_plan_models.py.
"""
from __future__ import annotations

HF = "https://huggingface.co/{}/blob/main/config.json"

_QWEN3_8B = {
    "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": "bfloat16",
}

_QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "vocab_size": 151936, "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": "bfloat16",
}

_QWEN3_235B_A22B = {
    "model_type": "qwen3_moe", "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
    "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "vocab_size": 151936, "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": "bfloat16",
}

_LLAMA31_8B = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": "bfloat16",
}

_LLAMA31_70B = {
    "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
    "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
    "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": "bfloat16",
}

# GLM-4.7 keeps the GLM-4.5 architecture (Glm4MoeForCausalLM); 92 layers, the first 3 dense,
# plus one MTP layer (num_nextn_predict_layers) that the checkpoint ships as layer 92.
_GLM47 = {
    "model_type": "glm4_moe", "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536,
    "num_hidden_layers": 92, "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
    "n_routed_experts": 160, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "vocab_size": 151552, "tie_word_embeddings": False, "attention_bias": True, "use_qk_norm": True,
    "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16",
    "mtp_own_embeddings": True, "moe_router_bias": True,
}

# Kimi K2.6 (KimiK25ForConditionalGeneration, the K2.5 architecture): a DeepSeek-V3-style text
# model with MLA, 384 routed experts stored as INT4 (group 32, bf16 scales; attention, shared
# experts, the dense layer and lm_head stay bf16), plus the MoonViT vision tower in bf16.
_KIMI_K26 = {
    "model_type": "kimi_k25",
    "text_config": {
        "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 64,
        "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 384, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "first_k_dense_replace": 1, "moe_layer_freq": 1, "topk_method": "noaux_tc",
        "vocab_size": 163840, "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
        "torch_dtype": "bfloat16",
    },
    "quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "group_size": 32, "strategy": "group", "symmetric": True, "type": "int"}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    },
    "vision_config": {
        "vt_hidden_size": 1152, "vt_intermediate_size": 4304, "vt_num_hidden_layers": 27,
        "vt_num_attention_heads": 16, "patch_size": 14, "init_pos_emb_height": 64, "init_pos_emb_width": 64,
        "merge_kernel_size": [2, 2], "mm_hidden_size": 1152, "mm_projector_type": "patchmerger",
        "text_hidden_size": 7168,
    },
}

# Kimi K2 (moonshotai/Kimi-K2-Instruct, DeepseekV3ForCausalLM): the text model K2.6 keeps, key for key. The
# repository ships it FP8 block-quantized (e4m3, 128x128 blocks), a quantization the systems model does not price;
# it is counted here in bf16, the dtype the published sharded-transfer figures (256 -> 128 GPUs) move from the trainer.
_KIMI_K2 = {**_KIMI_K26["text_config"], "model_type": "kimi_k2"}

CATALOG: dict[str, dict] = {
    "qwen3-8b": {"source": HF.format("Qwen/Qwen3-8B"), "config": _QWEN3_8B},
    "qwen3-30b-a3b": {"source": HF.format("Qwen/Qwen3-30B-A3B"), "config": _QWEN3_30B_A3B},
    "qwen3-235b-a22b": {"source": HF.format("Qwen/Qwen3-235B-A22B"), "config": _QWEN3_235B_A22B},
    "llama-3.1-8b": {"source": HF.format("meta-llama/Llama-3.1-8B"), "config": _LLAMA31_8B},
    "llama-3.1-70b": {"source": HF.format("meta-llama/Llama-3.1-70B"), "config": _LLAMA31_70B},
    "glm-4.7": {
        "source": HF.format("zai-org/GLM-4.7"), "config": _GLM47,
        "notes": "355B main model + one MTP layer with its own embedding/head copies = 358.3B in the checkpoint.",
    },
    "kimi-k2": {
        "source": HF.format("moonshotai/Kimi-K2-Instruct"), "config": _KIMI_K2,
        "notes": "The 1T text model of K2.x in bf16 (2.05 TB); the repository's checkpoint is FP8 (half that).",
    },
    "kimi-k2.6": {
        "source": HF.format("moonshotai/Kimi-K2.6"), "config": _KIMI_K26,
        "notes": "Same architecture and config keys as Kimi-K2.5; routed experts are INT4 on disk, so the "
                 "checkpoint (595.1 GB) is far below 2 bytes x 1.03T parameters.",
    },
}

ALIASES = {
    "qwen/qwen3-8b": "qwen3-8b", "qwen3 8b": "qwen3-8b",
    "qwen/qwen3-30b-a3b": "qwen3-30b-a3b", "qwen/qwen3-235b-a22b": "qwen3-235b-a22b",
    "meta-llama/llama-3.1-8b": "llama-3.1-8b", "meta-llama/llama-3.1-70b": "llama-3.1-70b",
    "zai-org/glm-4.7": "glm-4.7", "glm4.7": "glm-4.7",
    "moonshotai/kimi-k2-instruct": "kimi-k2", "kimi-k2-instruct": "kimi-k2",
    "moonshotai/kimi-k2.6": "kimi-k2.6", "kimi-2.6": "kimi-k2.6", "kimi2.6": "kimi-k2.6", "kimi-k26": "kimi-k2.6",
}
