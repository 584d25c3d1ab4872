"""LoRA on routed experts stored as 3-D tensors, and the adapter tensor layout wsync syncs for it.

PEFT has no LoRA for a fused experts module (``gate_up_proj`` [E, 2I, H],
``down_proj`` [E, H, I], as in transformers' Qwen3-MoE), so this module
defines one, with the two layouts of ``wsync.plan.lora``. Each of gate, up and
down gets its own factors, named ``<experts>.<proj>.lora_A`` / ``.lora_B``
(proj in gate_proj, up_proj, down_proj); E experts, rank r:

=============  ==========================  ==========================
layout         gate_proj / up_proj         down_proj
=============  ==========================  ==========================
per-expert     A [E, r, H]   B [E, I, r]   A [E, r, I]   B [E, H, r]
shared-outer   A [r, H]      B [E, I, r]   A [E, r, I]   B [H, r]
=============  ==========================  ==========================

Shared-outer shares the factor on the model-width side (the hidden state that
gate/up read and down writes) across experts, which is why it is several times
smaller. Expert e computes ``W_e x + scale * B_e (A_e x)`` for each projection,
with A_e / B_e the shared matrix when it is shared. The base tensors keep their
names (the wrapper takes over the same Parameter objects), so a full sync and
an adapter sync of the same model use the names the model already has.
"""
from __future__ import annotations

import functools

LAYOUTS = ("per-expert", "shared-outer")


def is_adapter(name: str) -> bool:
    """The selector for engines.HF(select=...): adapter tensors only."""
    return ".lora_A" in name or ".lora_B" in name


def adapter_shapes(*, experts: int, hidden: int, inter: int, rank: int, layout: str) -> dict[str, tuple]:
    """Shapes of one experts module's adapter tensors, by relative name."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    shared = layout == "shared-outer"
    out = {}
    for proj, d_in, d_out in (("gate_proj", hidden, inter), ("up_proj", hidden, inter), ("down_proj", inter, hidden)):
        outer_in, outer_out = proj != "down_proj", proj == "down_proj"  # which side touches the hidden state
        out[f"{proj}.lora_A"] = (rank, d_in) if shared and outer_in else (experts, rank, d_in)
        out[f"{proj}.lora_B"] = (d_out, rank) if shared and outer_out else (experts, d_out, rank)
    return out


def attach(model, *, rank: int, layout: str, alpha: float | None = None, experts_attr: str = "experts") -> int:
    """Replace every `experts_attr` module holding 3-D gate_up_proj/down_proj with an ExpertsLoRA; return how many."""
    import torch

    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if name == experts_attr and isinstance(getattr(child, "gate_up_proj", None), torch.nn.Parameter)]
    for parent, name, child in targets:
        setattr(parent, name, ExpertsLoRA(child, rank=rank, layout=layout, alpha=alpha))
    return len(targets)


def _factors(shapes: dict, proj: str, like):
    import torch

    f = torch.nn.Module()
    for which in ("lora_A", "lora_B"):
        t = torch.zeros(shapes[f"{proj}.{which}"], dtype=like.dtype, device=like.device)
        if which == "lora_A":  # B starts at zero, so a fresh adapter leaves the model unchanged
            torch.nn.init.normal_(t, std=1.0 / shapes[f"{proj}.{which}"][-1] ** 0.5)
        f.register_parameter(which, torch.nn.Parameter(t))
    return f


@functools.cache
def _module_class():
    """The nn.Module subclass, made on first use so importing this module does not import torch."""
    import torch

    class ExpertsLoRAImpl(torch.nn.Module):
        def __init__(self, experts, *, rank: int, layout: str, alpha: float | None):
            super().__init__()
            self.num_experts, self.act_fn = experts.num_experts, experts.act_fn
            self.gate_up_proj, self.down_proj = experts.gate_up_proj, experts.down_proj  # same Parameters
            e, two_i, h = experts.gate_up_proj.shape
            shapes = adapter_shapes(experts=e, hidden=h, inter=two_i // 2, rank=rank, layout=layout)
            self.layout, self.scale = layout, (alpha if alpha is not None else rank) / rank
            self.lora = torch.nn.Module()  # its own namespace: the base already has a down_proj
            for proj in ("gate_proj", "up_proj", "down_proj"):
                self.lora.add_module(proj, _factors(shapes, proj, experts.gate_up_proj))

        def _lora(self, proj: str, x, e: int):
            f = getattr(self.lora, proj)
            a = f.lora_A if f.lora_A.dim() == 2 else f.lora_A[e]
            b = f.lora_B if f.lora_B.dim() == 2 else f.lora_B[e]
            return (x @ a.t()) @ b.t() * self.scale

        def forward(self, hidden_states, top_k_index, top_k_weights):
            import torch.nn.functional as F

            out = torch.zeros_like(hidden_states)
            hit = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
            for e in range(self.num_experts):
                pos, tok = torch.where(hit[e])
                if tok.numel() == 0:
                    continue
                x = hidden_states[tok]
                gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
                gate, up = gate + self._lora("gate_proj", x, e), up + self._lora("up_proj", x, e)
                y = self.act_fn(gate) * up
                y = F.linear(y, self.down_proj[e]) + self._lora("down_proj", y, e)
                out.index_add_(0, tok, (y * top_k_weights[tok, pos, None]).to(out.dtype))
            return out

    return ExpertsLoRAImpl


def ExpertsLoRA(experts, *, rank: int, layout: str, alpha: float | None = None):
    """A module computing `experts` (Qwen3-MoE style, 3-D weights) plus LoRA in the given layout."""
    return _module_class()(experts, rank=rank, layout=layout, alpha=alpha)
