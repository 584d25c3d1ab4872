"""Planted bugs in the CUDA kernels: text patches applied to a copy of csrc/ at test time.

Each is a mistake a GPU would punish and a serial CPU port would not: a
missing barrier, a shuffle in a divergent branch, threads that leave a warp
early, reads past the end of a buffer. The harness must catch every one
(tests/test_cuda_sim_mutants.py); if one slips through, the harness has grown
lenient. A patch whose text no longer occurs in the source fails loudly, so an
edit of the kernels cannot quietly turn a mutant into the original.
"""
from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path

from . import CSRC, _cache_root


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    old: str  # must occur exactly once
    new: str
    why: str
    expect: str = r"FAIL (mismatch|exception|harness)"  # how the driver's first line must read


MUTANTS = [
    Mutant("missing_barrier", "delta_cuda.cu",
           "        s_max[warp] = mx;\n    }\n    __syncthreads();\n",
           "        s_max[warp] = mx;\n    }\n",
           "warp 0 of the block scan reads the warps' totals before they are all written"),
    Mutant("missing_trailing_barrier", "delta_cuda.cu",
           "    __syncthreads();  // the next call overwrites s_sum / s_max\n", "",
           "a fast warp's next scan overwrites totals a slow warp still reads"),
    Mutant("shuffle_in_divergent_branch", "delta_cuda.cu",
           "        const u64 t = __shfl_up_sync(FULL, inc, o);\n"
           "        const i32 tm = __shfl_up_sync(FULL, mx, o);\n"
           "        if (lane >= o) {\n",
           "        if (lane >= o) {\n"
           "            const u64 t = __shfl_up_sync(FULL, inc, o);\n"
           "            const i32 tm = __shfl_up_sync(FULL, mx, o);\n",
           "only the lanes that use the value take part in the shuffle", expect="FAIL harness"),
    Mutant("half_warp_exit", "delta_cuda.cu",
           "const u64 wid = (u64(blockIdx.x) * NT + threadIdx.x) / 32;",
           "const u64 wid = (u64(blockIdx.x) * NT + threadIdx.x) / 16;",
           "half-warps take different checksum blocks: past the last, half a warp leaves mid-shuffle", expect="FAIL harness"),
    Mutant("idle_threads_exit", "delta_cuda.cu",
           "    u32 changed = 0, escapes = 0;\n    // The loop bound is block-uniform",
           "    u32 changed = 0, escapes = 0;\n    if (threadIdx.x * VEC >= len) return;  // nothing to load\n"
           "    // The loop bound is block-uniform",
           "threads with no data in a short chunk return before the warp's shuffles", expect="FAIL harness"),
    Mutant("tail_over_read_walk", "delta_cuda.cu",
           "        const bool valid = i < count;\n",
           "        const bool valid = i <= count;\n",
           "the walk reads one change past its chunk's (past the sections' end in the last chunk)"),
]

# Found only by AddressSanitizer: a vector load that runs up to 15 bytes past the tensor and
# whose extra elements are then ignored (the answer stays right; the read is still out of bounds).
ASAN_ONLY = [
    Mutant("tail_over_read_vector", "delta_cuda.cu",
           "valid = v < nvec ? int(ws_min<u32>(VEC, len - v * VEC)) : 0;\n            va[u] = ",
           "valid = v < nvec ? VEC : 0;  // whole vectors\n            va[u] = ",
           "the last vector of a tensor is loaded whole"),
]


def apply(m: Mutant, csrc: Path = CSRC) -> Path:
    """A copy of csrc/ with the mutant's patch, in a directory named by its content; returns the .cu path."""
    text = (csrc / m.file).read_text()
    if text.count(m.old) != 1:
        raise ValueError(f"mutant {m.name}: its text occurs {text.count(m.old)} times in {m.file} (expected once); "
                         "update tests/cudasim/mutants.py to the kernel's current source")
    patched = text.replace(m.old, m.new)
    key = hashlib.sha256(m.name.encode() + patched.encode() + b"".join(
        p.read_bytes() for p in sorted(csrc.iterdir()) if p.is_file() and p.name != m.file)).hexdigest()[:16]
    out = _cache_root() / f"mutant-{m.name}-{key}"
    if not out.exists():
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(csrc, tmp)
        (tmp / m.file).write_text(patched)
        try:
            tmp.rename(out)
        except OSError:  # another process made it first
            shutil.rmtree(tmp, ignore_errors=True)
    return out / "delta_cuda.cu"
