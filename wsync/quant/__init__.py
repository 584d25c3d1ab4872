"""Quantized weights on the wire, byte-identical to the engine's own quantizer.

A rollout engine that serves a quantized model holds codes and scales in its checkpoint's format. Sending it
BF16 and letting it quantize costs BF16's bytes on the wire and hides what the engine made of them; quantizing on the trainer gets it wrong unless it is the engine's arithmetic to the bit. Here it
is: ``ref.py`` is compressed-tensors' INT4 / INT8 quantizers and vLLM's block FP8 cast, step by step, checked
byte for byte against their code; the C++ and CUDA kernels are checked against ``ref.py``::

    q = wsync.quant.from_config("path/to/quantized/checkpoint")   # or the HF config, or the dict
    pub = Publisher("tcp://0.0.0.0:7070", token=tok, quantize=q)
    pub.publish(model.state_dict(), version=v)   # bf16 in; codes and scales, as the engine loads them, out

Codes and scales are tensors like any other: deltas, digests and transactions cover them.
"""
from __future__ import annotations

from .config import from_config, read_config
from .quantizer import Quantizer, Rule
from .ref import QuantizeError
from .schemes import Fp8Block, Int4Group, Int8Channel, Output, Scheme

__all__ = ["Fp8Block", "Int4Group", "Int8Channel", "Output", "QuantizeError", "Quantizer", "Rule", "Scheme",
           "as_quantizer", "from_config", "read_config"]


def as_quantizer(q, *, backend: str | None = None) -> Quantizer | None:
    """A Quantizer for a ``quantize=`` argument: a Quantizer, or anything from_config reads; None stays None."""
    if q is None or isinstance(q, Quantizer):
        return q
    return from_config(q, backend=backend)
