"""Run the kernels of one wsim build through wsync.backends.cuda against delta_ref, in a process of its own.

Usage: python -m cudasim.driver PATH_TO_WSIM_SO [--mode quick|medium|full] [--seed N]

Used where a test must not share its process with the kernels: the
AddressSanitizer/UBSan build (python is not instrumented, so libasan is
preloaded) and the planted mutants (a broken kernel may write anywhere). The
first disagreement ends the run: it prints "FAIL <what>: <detail>" and exits 1;
a clean run prints "ok" with its counts. Harness errors (SimError) and memory
faults are failures too.
"""
from __future__ import annotations

import argparse
import sys
import traceback

import numpy as np

from . import Sim, SimError, SimRuntime
from .cases import corruptions, make_case, misaligned, sections_equal


class Failed(Exception):
    pass


def check_delta(kern, rng, width, order, n, density, offset=0):
    from wsync.codecs import delta_ref

    old, new = make_case(rng, width, order, n, density)
    if offset:
        old, new = misaligned(old, offset), misaligned(new, offset)
    ref = delta_ref.encode(old, new, order)
    got = kern.delta_encode(old, new, order)
    if not sections_equal(got, ref):
        raise Failed(f"encode differs from delta_ref: width {width} {order} n={n} density={density}")
    pos, values = kern.delta_decode(old, got, order)
    rpos, rvalues = delta_ref.decode(old, ref, order)
    if pos.tobytes() != rpos.tobytes() or values.tobytes() != rvalues.tobytes():
        raise Failed(f"decode differs from delta_ref: width {width} {order} n={n} density={density}")
    live = np.array(old, copy=True)
    undo = kern.launcher.apply(live, got, order, undo=True)
    if live.tobytes() != new.tobytes():
        raise Failed(f"apply differs from new: width {width} {order} n={n}")
    kern.launcher.restore(live, undo)
    if live.tobytes() != old.tobytes():
        raise Failed(f"restore differs from old: width {width} {order} n={n}")


def check_corrupt(kern, rng, width, order, n):
    from wsync.codecs import delta_ref
    from wsync.errors import FormatError

    old, new = make_case(rng, width, order, n, 0.05)
    sec = delta_ref.encode(old, new, order)
    for what, bad in corruptions(sec, n, old, order):
        try:
            delta_ref.decode(old, bad, order)
            want = None
        except FormatError as e:
            want = str(e)
        live = old.copy()
        try:
            kern.launcher.apply(live, bad, order, undo=True)
            got = None
        except FormatError as e:
            got = str(e)
        if got != want:
            raise Failed(f"{what}: apply says {got!r}, delta_ref {want!r}")
        if live.tobytes() != old.tobytes():
            raise Failed(f"{what}: the weights changed under bad sections")


def check_digests(kern, rng):
    from wsync.checksum import BLOCK, block_digests

    sizes = [0, 1, 17, 240, 241, 1024, 1025, 4096 + 63, BLOCK - 1, BLOCK, 2 * BLOCK + 17]
    bufs = [rng.integers(0, 256, size=s, dtype=np.uint8) for s in sizes]
    bufs.append(misaligned(rng.integers(0, 256, size=5000, dtype=np.uint8), 3))
    for b, d in zip(bufs, kern.launcher.block_digests(bufs)):
        if d.tobytes() != block_digests(b).tobytes():
            raise Failed(f"xxh3 of {b.nbytes} bytes differs from wsync.checksum")


def check_fused(kern, rng, n):
    import torch

    from wsync.backends import cuda
    from wsync.codecs import delta_ref

    before = (rng.standard_normal(n) * 0.02).astype(np.float32)
    after = before + (rng.standard_normal(n) * 1e-4).astype(np.float32)
    nan = cuda.torch_bf16_nan_bits("cpu")
    got = cuda.sections_to_host(kern.launcher.encode_bf16_from_f32(before.view(np.uint32), after.view(np.uint32), nan),
                                np.uint16)
    b16 = torch.from_numpy(before).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    a16 = torch.from_numpy(after).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    if not sections_equal(got, delta_ref.encode(b16, a16, "float")):
        raise Failed(f"fused bf16 detection differs from delta_ref (n={n})")


ALL = [(w, o) for w in (1, 2, 4, 8) for o in ("float", "int", "uint")]
# mode: (width/order pairs, sizes, densities, misaligned host views)
MODES = {
    "quick": ([(2, "float"), (1, "int"), (8, "uint"), (4, "float")], (1000, 65537), (0.02, 1.0), False),
    "medium": (ALL, (1, 999, 65537), (0.01, 1.0), True),
    "full": (ALL, (1, 1000, 65535, 65536, 65537, 2 * 65536 + 300), (0.0, 0.01, 0.5, 1.0), True),
}


def run(sim: Sim, mode: str, seed: int) -> dict:
    from wsync.backends import cuda

    combos, sizes, densities, views = MODES[mode]
    counts = {"delta": 0, "corrupt": 0, "digests": 0, "fused": 0}
    schedules = ("forward", "reverse", "random")
    for si, sched in enumerate(schedules):
        kern = cuda._KernelsOver(SimRuntime(sim, sched, seed + si))
        rng = np.random.default_rng(seed * 31 + si)
        check_digests(kern, rng)
        counts["digests"] += 1
        for j, (w, o) in enumerate(combos):
            for n in sizes:
                for density in densities:
                    check_delta(kern, rng, w, o, n, density, offset=(j + n) % 3 * 2 if views else 0)
                    counts["delta"] += 1
        for w, o in combos[:2]:
            check_corrupt(kern, rng, w, o, 2 * 65536 + 300)
            counts["corrupt"] += 1
        check_fused(kern, rng, 70_001)
        counts["fused"] += 1
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("so")
    ap.add_argument("--mode", choices=sorted(MODES), default="full")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    from pathlib import Path

    sim = Sim(Path(args.so))
    try:
        counts = run(sim, args.mode, args.seed)
    except Failed as e:
        print(f"FAIL mismatch: {e}", flush=True)
        return 1
    except SimError as e:
        print(f"FAIL harness: {e}", flush=True)
        return 1
    except Exception as e:  # a FormatError where none was due, or worse
        print(f"FAIL exception: {type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}", flush=True)
        return 1
    print("ok", counts, "sanitized" if sim.sanitized else "", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
