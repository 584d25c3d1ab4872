"""Golden vectors pin the bytes of format 2 (segments: tensors of one dtype back to back). Changing them is a format version bump.

The packed tier's bytes also depend on the zstd encoder, so for it we pin what
the frames decompress to and that the stored file still applies.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import wsync
from wsync.checkpoint import read_safetensors
from wsync.codecs import delta_ref
from wsync.payload import Payload

from conftest import bits_equal

pytestmark = pytest.mark.usefixtures("each_backend")

GOLDEN = Path(__file__).parent / "golden"


@pytest.fixture(scope="module")
def states():
    import sys

    sys.path.insert(0, str(GOLDEN))
    from make_golden import golden_states

    return golden_states()


@pytest.mark.parametrize("name,kw", [("delta_sparse", dict(tier="sparse")), ("raw", dict(codec="raw"))])
def test_encoder_output_is_pinned(states, name, kw):
    base, new = states
    got = wsync.encode(base, new, version=2, base_version=1, **kw).to_bytes()
    assert got == (GOLDEN / f"{name}.wsd").read_bytes()


def test_packed_sections_are_pinned(states):
    base, new = states
    golden_sparse = Payload.read(GOLDEN / "delta_sparse.wsd")
    golden_packed = Payload.read(GOLDEN / "delta_packed.wsd")
    from wsync.codecs.delta import _packed_sections, _sparse_sections
    from wsync.dtypes import by_name

    for s_spec, p_spec in zip(golden_sparse.manifest.tensors, golden_packed.manifest.tensors):
        assert (s_spec.name, s_spec.checksum) == (p_spec.name, p_spec.checksum)
        if s_spec.kind != "delta-sparse":
            continue
        bits_dt = by_name(s_spec.dtype).bits_dtype
        a = _sparse_sections(s_spec, golden_sparse.parts(s_spec), bits_dt)
        b = _packed_sections(p_spec, golden_packed.parts(p_spec), bits_dt)
        for f in ("table", "gaps", "steps", "escapes"):
            assert getattr(a, f).tobytes() == getattr(b, f).tobytes(), (s_spec.name, f)


@pytest.mark.parametrize("name", ["delta_sparse", "delta_packed", "raw"])
def test_golden_files_apply(name):
    base, _ = read_safetensors(GOLDEN / "base.safetensors")
    new, _ = read_safetensors(GOLDEN / "new.safetensors")
    out = wsync.apply_state(base, Payload.read(GOLDEN / f"{name}.wsd"))
    assert out.keys() == new.keys()
    for k in new:
        assert (out[k].dtype, out[k].shape) == (new[k].dtype, new[k].shape)
        assert bits_equal(out[k].bits, new[k].bits), k


def test_layout_by_hand():
    """The sparse sections of a tiny bf16 change, written out by hand from the spec."""
    # 1.0 = 0x3F80, 2.0 = 0x4000, -1.0 = 0xBF80, +0.0 = 0x0000
    old = np.array([0x3F80, 0x4000, 0xBF80, 0x0000, 0x3F80, 0x3F80], dtype="<u2")
    new = np.array([0x3F81, 0x4000, 0xBF81, 0x8000, 0x3F80, 0x4000], dtype="<u2")
    sec = delta_ref.encode(old, new, "float")
    assert sec.table.tolist() == [4, 1]  # one chunk: 4 changes, 1 escape
    assert sec.gaps.tolist() == [0, 1, 0, 1]  # positions 0, 2, 3, 5
    # +1 key; -1.0 -> next more negative is one key down; +0.0 -> -0.0 is one key down;
    # 1.0 -> 2.0 is 128 keys up: an escape
    assert sec.steps.tolist() == [1, -1, -1, -128]
    assert sec.escapes.tolist() == [0x4000]
    assert sec.escapes.dtype == np.dtype("<u2")
    pad = np.zeros(100, "<u2")  # unchanged tail, so the delta beats storing the tensor raw
    payload = wsync.encode({"w": _bf16(np.r_[old, pad])}, {"w": _bf16(np.r_[new, pad])}, tier="sparse")
    spec = payload.manifest.tensors[0]
    assert spec.parts == {"table": 8, "gaps": 8, "steps": 4, "escapes": 2}
    assert bytes(payload.frame(spec)) == bytes.fromhex("04000000 01000000 0000 0100 0000 0100 01ffff80 0040".replace(" ", ""))


def _bf16(bits):
    from wsync.dtypes import DTYPES
    from wsync.snapshot import TensorBits

    return TensorBits(DTYPES["BF16"], bits.shape, bits)


def test_header_layout():
    blob = (GOLDEN / "raw.wsd").read_bytes()
    assert blob[:8] == b"\x89WSYNC\r\n"
    assert int.from_bytes(blob[8:12], "little") == 2
