"""What the tests against a real vLLM share (imported once vLLM is: helpers.import_or_skip): a tiny random
Qwen3 checkpoint, RL-like versions of it, and transformers' greedy tokens to compare vLLM's with.

Two kernel libraries round bf16 differently, so tokens are compared only on the prompts whose greedy path
transformers decides by at least MARGIN logits at every step.
"""
from __future__ import annotations

import copy

import torch
import transformers

_g = torch.Generator().manual_seed(123)
POOL = [torch.randint(0, 512, (int(n),), generator=_g).tolist() for n in torch.randint(2, 9, (64,), generator=_g)]
NEW_TOKENS = 4
MARGIN = 1.5  # logits: well above how far bf16 and fp32 computations of this model's logits differ


def checkpoint(path: str, positions: int = 256):
    """A tiny random Qwen3, saved as a checkpoint vLLM loads; returns the trainer's copy (embedding and output
    matrices scaled up: logits spread over ~16, so most greedy steps are decided by more than MARGIN).
    positions: its max_position_embeddings (the longest sequence vLLM will serve it)."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=positions, tie_word_embeddings=False)
    model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 1.0)
        model.lm_head.weight.normal_(0, 1.0)
    model = model.to(torch.bfloat16).eval()
    model.save_pretrained(path)
    return model


def rl_version(model, gen: torch.Generator) -> None:
    """A new version: 5% of every tensor's elements move by a relative step of up to 30%."""
    with torch.no_grad():
        for p in model.parameters():
            mask = torch.rand(p.shape, generator=gen) < 0.05
            step = (torch.rand(p.shape, generator=gen) * 0.6 - 0.3).to(p.dtype)
            p.add_(torch.where(mask, p * step, torch.zeros_like(p)))


@torch.no_grad()
def reference(model) -> tuple[dict, dict]:
    """transformers' greedy tokens for every pool prompt, {prompt: tokens}, and the part of it decided by
    MARGIN or more at every step (the prompts compared with vLLM).

    Computed in fp32 from the model's bf16 values (a copy: the trainer's model stays as published), all
    prompts of one length as a batch, one step at a time without a cache."""
    ref = copy.deepcopy(model).float()
    every, out = {}, {}
    for n in sorted({len(p) for p in POOL}):
        batch = [p for p in POOL if len(p) == n]
        ids, lead = torch.tensor(batch), torch.full((len(batch),), float("inf"))
        for _ in range(NEW_TOKENS):
            top = ref(ids).logits[:, -1].topk(2)
            lead = torch.minimum(lead, top.values[:, 0] - top.values[:, 1])
            ids = torch.cat([ids, top.indices[:, :1]], dim=1)
        every.update({tuple(p): ids[i, n:].tolist() for i, p in enumerate(batch)})
        out.update({tuple(p): every[tuple(p)] for i, p in enumerate(batch) if lead[i] >= MARGIN})
    assert len(out) >= 3, f"only {len(out)} prompts decided by {MARGIN} logits: the comparison would be thin"
    return every, out


def greedy():
    import vllm

    return vllm.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def vllm_tokens(llm, prompts) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], greedy(), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]
