"""Any torch nn.Module (a transformers model included) as a wsync engine.

Weights are written into the live parameters and buffers in place, never
reallocated, so code holding references to them (a generation loop, a CUDA
graph, an optimizer) keeps working across updates. Tied weights (one storage
under two names, like embed_tokens and lm_head) travel once, under the first
name in state_dict order; the Publisher drops the same aliases on its side.

Names: the engine presents its tensors under the *publisher's* names, so a
trainer can publish its own state_dict unchanged:

- ``rename``: a callable from an engine name to the publisher's name (e.g. a
  trainer that wraps the model in a module with a prefix);
- ``names``: a dict from publisher names to engine names (inverted here);
- ``fused``: engine tensors that stack several trainer tensors (vLLM-style
  ``qkv_proj`` = q/k/v, ``gate_up_proj`` = gate/up) are presented as views of
  their slices, so each trainer tensor is written straight into its rows and the
  digest is computed from the live fused parameter itself, exactly.

Generating while updates arrive: with ``Subscriber(apply="poll")`` the
generation thread calls ``sub.poll()`` between decode steps, so no lock is
needed. With ``apply="background"`` build the engine with ``guarded=True``
and hold ``engine.lock`` around each forward pass (or each ``generate``):
the Subscriber then decodes into a host copy and writes the live weights
(``load``, or on a GPU the device apply) under the lock, so a forward pass
never sees half a version. Unguarded background updates write in place with no copy, and a
concurrent forward pass may read a mix of two versions.

Quantized models: a transformers load of a compressed-tensors checkpoint that keeps its weights compressed
holds codes and scales as parameters (``weight_packed``, ``weight_scale``, ``weight_shape``; an int8
``weight``), and the engine syncs them like any other tensor (``Publisher(quantize=...)`` sends them). Its
first forward pass would decompress the model in place into new parameters, which the engine's bound memory
no longer is, so an engine on such a model refuses that forward pass instead of letting updates go unseen.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from ..backends.device import is_device
from ..errors import MismatchError
from ..snapshot import TensorBits, as_state, digest, to_bits, unique_tensors
from ..tables import Table
from . import moe


@dataclass(kw_only=True, frozen=True)
class Fused:
    """One engine tensor holding several trainer tensors stacked along `dim`."""

    fused: str  # the engine's module name, one dotted segment: "qkv_proj", "gate_up_proj"
    parts: tuple[str, ...]  # the trainer's module names, in stacking order: ("q_proj", "k_proj", "v_proj")
    sizes: tuple[int, ...] | None = None  # length of each part along dim; None: equal parts
    dim: int = 0  # the stacking dimension (0: output rows of a Linear weight and its bias)

    def split(self, name: str, t) -> dict:
        """{trainer name: view of t} when `name` is one of this layout's fused tensors, else {}."""
        segs = name.split(".")
        if self.fused not in segs:
            return {}
        at = segs.index(self.fused)
        sizes = self.sizes or _equal(t.shape[self.dim], len(self.parts), name)
        if sum(sizes) != t.shape[self.dim]:
            raise MismatchError(f"{name}: parts {dict(zip(self.parts, sizes))} add up to {sum(sizes)} along dim "
                                f"{self.dim}, the tensor has {t.shape[self.dim]}; fix Fused(sizes=...)")
        out, off = {}, 0
        for part, n in zip(self.parts, sizes):
            out[".".join(segs[:at] + [part] + segs[at + 1:])] = t.narrow(self.dim, off, n)
            off += n
        return out


def _equal(total: int, k: int, name: str) -> tuple[int, ...]:
    if total % k:
        raise MismatchError(f"{name}: {total} rows do not split into {k} equal parts; give Fused(sizes=...)")
    return (total // k,) * k


def qkv_gate_up(q: int, kv: int) -> list[Fused]:
    """The usual vLLM/SGLang fusion: qkv_proj (q rows, then k and v with kv rows each) and gate_up_proj."""
    return [Fused(fused="qkv_proj", parts=("q_proj", "k_proj", "v_proj"), sizes=(q, kv, kv)),
            Fused(fused="gate_up_proj", parts=("gate_proj", "up_proj"))]


class HF:
    def __init__(self, model, *, rename: Callable[[str], str] | None = None, names: dict[str, str] | None = None,
                 fused: list[Fused] | tuple = (), select: Callable[[str], bool] | None = None,
                 guarded: bool = False, experts: str | None = None):
        self.model = model
        self.version: int | None = None  # the version served; the Subscriber sets it on commit
        self.rename = rename  # engine name -> publisher name
        self._from_engine = _invert(names or {})  # engine name -> publisher name, from a publisher->engine dict
        self.fused = list(fused)
        self.select = select  # keep only the engine tensors it accepts (e.g. moe_lora.is_adapter); None: all
        self.guarded = guarded  # True: tensors() are read-only, so every update goes through load() under lock
        # MoE experts under the trainer's naming (engines/moe.py): "per_expert" (the model fuses them in 3-D
        # tensors, the trainer names each expert), "fused" (the reverse), or None (same naming on both sides)
        if experts not in (None,) + moe.MODES:
            raise ValueError(f"experts must be one of {moe.MODES} or None, got {experts!r}")
        self.experts = experts
        self.lock = threading.RLock()  # held by load(); a generating thread holds it around forward passes
        _keep_compressed(model)

    # -- what the Subscriber sees ---------------------------------------------------------------

    def tensors(self) -> dict:
        live = self.live()
        # guarded: host tensors as read-only copies' sources, so every write goes through load(). Device
        # tensors stay as they are: the Subscriber applies to them on the GPU under this engine's lock, which a
        # forward pass holds too, and a host copy would only add two passes over PCIe
        if not self.guarded or all(is_device(t) for t in live.values()):
            return live
        return {n: _read_only(t) for n, t in live.items()}

    def live(self) -> dict:
        """Publisher name -> a view of the live memory holding it (writing it writes the model)."""
        out = {}
        named = moe.apply_mode({n: t.detach() for n, t in self._named().items()}, self.experts)
        for name, t in named.items():
            for part, view in ((not moe.is_virtual(t) and self._split(name, t)) or {name: t}).items():
                pub = self._name(part)
                if pub in out:
                    raise MismatchError(f"two engine tensors map to the publisher name {pub!r}; fix rename/names")
                out[pub] = view
        return out

    def _named(self) -> dict:
        named = unique_tensors(self.model.state_dict(keep_vars=True))
        return {n: t for n, t in named.items() if self.select(n)} if self.select else named

    def _split(self, name: str, t) -> dict:
        for f in self.fused:
            if parts := f.split(name, t):
                return parts
        return {}

    def _name(self, n: str) -> str:
        n = self._from_engine.get(n, n)
        return self.rename(n) if self.rename else n

    def load(self, named: dict) -> None:
        import torch

        live = self.live()
        unknown = sorted(set(named) - set(live))
        if unknown:
            raise MismatchError(f"the model has no tensors named {unknown[:5]} ({len(unknown)} unknown)")
        with self.lock, torch.no_grad():
            for name, src in named.items():
                src = src if isinstance(src, torch.Tensor) else torch.as_tensor(src)
                dst = live[name]
                if moe.is_virtual(dst):  # fused experts gathered from per-expert parameters: write each piece
                    got = to_bits(src)
                    if (got.dtype, got.shape) != (dst.dtype, dst.shape):
                        raise MismatchError(f"{name}: got {got.dtype.name}{list(got.shape)}, the model holds "
                                            f"{dst.dtype.name}{list(dst.shape)}")
                    dst.bits.scatter(got.bits)
                    continue
                if src.shape != dst.shape or src.dtype != dst.dtype:
                    raise MismatchError(f"{name}: got {src.dtype}{list(src.shape)}, the model holds "
                                        f"{dst.dtype}{list(dst.shape)}")
                dst.copy_(src)

    def digest(self) -> str:
        """Digest of the live parameters (the fused ones read through their slices), under the publisher's names."""
        with self.lock:
            return digest(as_state(self.live()))


def _keep_compressed(model) -> None:
    """Put a forward pre-hook before compressed-tensors' decompress-on-first-forward hook, so that forward pass
    fails loudly rather than swapping the parameters this engine writes for new ones it never sees."""
    if hasattr(model, "ct_decompress_hook") and not getattr(model, "_wsync_keeps_compressed", False):
        model.register_forward_pre_hook(_refuse_decompressing, prepend=True)
        model._wsync_keeps_compressed = True


def _refuse_decompressing(model, args):
    if hasattr(model, "ct_decompress_hook"):
        raise MismatchError(
            f"{type(model).__name__} holds compressed-tensors codes and scales that a wsync engine keeps in sync, "
            "and this forward pass would decompress them in place into new parameters the engine never writes "
            "(transformers has no forward pass from the compressed weights here). Run forward passes on a "
            "decompressed copy, or load with CompressedTensorsConfig(dequantize=True) and publish the weights "
            "unquantized")


def _read_only(t) -> TensorBits:
    tb = to_bits(t)
    if isinstance(tb.bits, Table):
        return TensorBits(tb.dtype, tb.shape, Table([_frozen(p) for p in tb.bits.pieces], tb.bits.dtype))
    return TensorBits(tb.dtype, tb.shape, _frozen(tb.bits))


def _frozen(a):
    view = a.view()
    view.flags.writeable = False
    return view


def _invert(names: dict[str, str]) -> dict[str, str]:
    inv = {}
    for pub, eng in names.items():
        if eng in inv:
            raise MismatchError(f"names maps both {inv[eng]!r} and {pub!r} to the engine tensor {eng!r}")
        inv[eng] = pub
    return inv
