"""Regenerate the golden vectors. Run only for a deliberate format change, with a format version bump.

    python tests/golden/make_golden.py
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

HERE = Path(__file__).parent


def golden_states():
    """A small base/new pair built from arithmetic only (no RNG), covering every dtype family."""
    i = np.arange(70_000, dtype=np.uint32)  # crosses a chunk boundary
    bf16_base = ((i * 2654435761) >> 16).astype(np.uint16)  # Knuth hash: every bit pattern class
    bf16_new = bf16_base.copy()
    step = np.array([1, -1, 2, 0, 300, -3], dtype=np.int64)  # 300: escape
    idx = np.flatnonzero(i % 97 == 5)
    bf16_new[idx] = (bf16_base[idx].astype(np.int64) + step[np.arange(len(idx)) % 6]).astype(np.uint16)
    f32_base = np.linspace(-2, 2, 1001, dtype=np.float32)
    f32_new = f32_base.copy()
    f32_new[::50] = np.nextafter(f32_new[::50], np.float32(np.inf))
    # format 2: tensors of one dtype form one segment, so a second bf16 tensor makes a segment of two pieces
    # whose chunks cross the boundary between them (70,000 + 3,000 elements)
    j = np.arange(3000, dtype=np.uint32)
    bf16_b = ((j * 40503) >> 3).astype(np.uint16)
    bf16_b_new = bf16_b.copy()
    bf16_b_new[j % 61 == 7] += 1
    base = {
        "model.layers.0.mlp.weight": bf16_base,
        "model.layers.1.mlp.weight": bf16_b,
        "model.norm.weight": f32_base,
        "model.counter": np.array([7, -3, 0], dtype=np.int64),
        "model.fp8": (np.arange(256, dtype=np.uint16) & 0xFF).astype(np.uint8),
        "model.scalar": np.array(0.5, dtype=np.float16),
        "model.empty": np.zeros((0, 4), dtype=np.float32),
    }
    new = dict(base)
    new["model.layers.0.mlp.weight"] = bf16_new
    new["model.layers.1.mlp.weight"] = bf16_b_new
    new["model.norm.weight"] = f32_new
    new["model.counter"] = np.array([8, -3, 1 << 40], dtype=np.int64)
    new["model.fp8"] = base["model.fp8"][::-1].copy()
    return _typed(base), _typed(new)


def _typed(state):
    """bf16 and fp8 have no numpy dtype; the golden inputs carry them as TensorBits."""
    from wsync.dtypes import DTYPES
    from wsync.snapshot import TensorBits, to_bits

    out = {}
    for name, a in state.items():
        if name == "model.layers.0.mlp.weight":
            out[name] = TensorBits(DTYPES["BF16"], (70, 1000), a)
        elif name == "model.layers.1.mlp.weight":
            out[name] = TensorBits(DTYPES["BF16"], (30, 100), a)
        elif name == "model.fp8":
            out[name] = TensorBits(DTYPES["F8_E4M3"], (16, 16), a)
        else:
            out[name] = to_bits(a)
    return out


def main() -> None:
    import wsync
    from wsync.checkpoint import write_safetensors

    base, new = golden_states()
    write_safetensors(HERE / "base.safetensors", base)
    write_safetensors(HERE / "new.safetensors", new)
    for name, kw in [("delta_sparse", dict(tier="sparse")), ("delta_packed", dict(tier="packed")), ("raw", dict(codec="raw"))]:
        wsync.encode(base, new, version=2, base_version=1, **kw).write(HERE / f"{name}.wsd")
    print("wrote", sorted(p.name for p in HERE.iterdir()))


if __name__ == "__main__":
    main()
