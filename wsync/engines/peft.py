"""A running PEFT (LoRA) model as a wsync engine: only the adapter tensors travel.

The trainer trains a LoRA adapter; the engine serves the same frozen base with
the same adapter config. Each version is just the adapter state, named the way
``peft.get_peft_model_state_dict`` names it (adapter name removed), so the
bytes moved are the adapter's, and the subscriber writes them into the live
``lora_A`` / ``lora_B`` parameters of the running ``PeftModel`` in place.
Generation can go on meanwhile, with the same two options as ``engines.HF``
(``apply="poll"`` between decode steps, or ``guarded=True`` and
``engine.lock`` around forward passes).

Trainer side::

    pub.publish(wsync.engines.peft.adapter_state(peft_model), version=step)

Both sides must hold the same frozen base: ``base_digest`` of each can be
compared once at start-up (the adapter stream never carries the base).
"""
from __future__ import annotations

from ..snapshot import as_state, digest
from ..snapshot import storage_key, unique_tensors
from .hf import HF


def adapter_state(model, adapter_name: str = "default") -> dict:
    """The adapter tensors of a PeftModel, as the trainer publishes them (views; Publisher copies)."""
    from peft.utils import get_peft_model_state_dict

    sd = get_peft_model_state_dict(model, state_dict=model.state_dict(keep_vars=True), adapter_name=adapter_name,
                                   save_embedding_layers=False)
    return {n: t.detach() for n, t in sd.items()}


def base_digest(model, adapter_name: str = "default") -> str:
    """Digest of everything that is not this adapter: the frozen base both sides must share."""

    adapter = {storage_key(t) for t in adapter_state(model, adapter_name).values()}
    base = {n: t.detach() for n, t in unique_tensors(model.state_dict(keep_vars=True)).items()
            if storage_key(t) not in adapter and ".lora_" not in n}
    return digest(as_state(base))


class PEFT(HF):
    """engines.HF over the adapter tensors of one adapter of a PeftModel."""

    def __init__(self, model, *, adapter_name: str = "default", **kw):
        super().__init__(model, **kw)
        self.adapter_name = adapter_name
        if not hasattr(model, "peft_config") or adapter_name not in model.peft_config:
            from ..errors import MismatchError

            have = sorted(getattr(model, "peft_config", {}) or {})
            raise MismatchError(f"the model has no PEFT adapter {adapter_name!r} (adapters: {have}); wrap it with "
                                f"peft.get_peft_model(model, LoraConfig(...), adapter_name=...) first")

    def _named(self) -> dict:
        return adapter_state(self.model, self.adapter_name)

    def base_digest(self) -> str:
        return base_digest(self.model, self.adapter_name)


def config_dict(model, adapter_name: str = "default") -> dict:
    """The adapter's LoraConfig as plain JSON values (what vLLM's adapter folder and SGLang's loader read)."""
    import json

    raw = model.peft_config[adapter_name].to_dict()
    return json.loads(json.dumps(raw, default=lambda v: sorted(v) if isinstance(v, (set, frozenset)) else str(v)))
