"""GPU throughput of the CUDA backend, each figure beside a baseline measured in the same run.

    wsync bench cuda --size full --json benchmarks/results/<date>-h100-cuda.json
    wsync bench cuda                 # small sizes (the default), a smoke run

What it measures, and the targets of the issue "Fast codec backends":
  encode   GB/s of bf16 model bytes through encode_device, against torch's
           device-to-device copy of the same bytes: >= 60% of the copy, and
           >= 1 TB/s on an H100
  apply    ms to apply a 1%-dense delta in place to 8B bf16 parameters (with
           and without the undo buffer): < 10 ms
  digest   GB/s of digest_device (xxh3 tree) against the same copy
  fused    fused_change_detect on fp32 masters against the torch AdamW step
           that produced them, on the same tensors: < 10% of the step
  v2       a delta-v2 tensor (issue "codec v2") decoded on the GPU and applied
           in place, against the same delta's v1 sections applied in place and
           the C++ decoder on the host's cores (the baseline it has to beat;
           no target in the issue)
Every stage checks its output too (sections against delta_ref on a slice,
digests before and after apply/restore, fused against a bf16 cast + encode),
because a fast wrong kernel is worth nothing. Timings use CUDA events on
torch's stream, after warm-up; the median of the repeats is reported.
"""
from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

GIB = 1 << 30


def add_parsers(bench) -> None:
    p = bench.add_parser("cuda", help="GPU throughput of the CUDA backend beside a device-to-device copy (a GPU)",
                         description=__doc__.splitlines()[0],
                         epilog="Default small (0.25 GiB encodes, 2.5e8 parameters applied; numbers not "
                                "comparable): a minute or two on an H100; --size full (4 GiB, 8e9): several minutes. "
                                "Without a CUDA GPU it says so and exits 3.")
    p.add_argument("--size", choices=["small", "full"], default="small",
                   help="small: a smoke run; full: the sizes the targets are stated at (default small); the "
                        "size options below override either")
    p.add_argument("--json", metavar="OUT", type=Path, help="write the results (with the device name) here")
    p.add_argument("--encode-gib", type=float, help="bf16 bytes per encode call, GiB (full 4, small 0.25)")
    p.add_argument("--apply-params", type=float, help="bf16 parameters the delta is applied to (full 8e9, small 2.5e8)")
    p.add_argument("--density", type=float, default=0.01, help="fraction of elements that change (default 0.01)")
    p.add_argument("--adamw-params", type=float, help="fp32 parameters of the AdamW comparison (full 1e9, small 5e7)")
    p.add_argument("--tensor-mib", type=float, default=64.0, help="size of each AdamW parameter tensor, MiB (default 64)")
    p.add_argument("--v2-mib", type=float, help="bf16 MiB of the v2 stage's tensor (full 512, small 64)")
    p.add_argument("--stages", default="encode,apply,fused,v2", help="comma-separated stages to run (default all)")
    p.add_argument("--repeat", type=int, help="timed runs per figure, median kept (full 10, small 3)")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs first (default 3)")
    p.set_defaults(fn=main)


SIZES = {"full": dict(encode_gib=4.0, apply_params=8e9, adamw_params=1e9, v2_mib=512.0, repeat=10),
         "small": dict(encode_gib=0.25, apply_params=2.5e8, adamw_params=5e7, v2_mib=64.0, repeat=3)}


def sized(args):
    """The options the size leaves open, filled in from it."""
    for k, v in SIZES[args.size].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


class Timer:
    """Median seconds of fn over `repeat` runs, timed with CUDA events on torch's current stream."""

    def __init__(self, torch, repeat: int, warmup: int):
        self.torch, self.repeat, self.warmup = torch, repeat, warmup

    def __call__(self, fn, before=None) -> float:
        torch = self.torch
        for _ in range(self.warmup):
            if before:
                before()
            fn()
        times = []
        for _ in range(self.repeat):
            if before:
                before()  # untimed set-up, e.g. restoring what the last apply changed
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return sorted(times)[len(times) // 2]


class InPlace:
    """bf16 weights w on the GPU, moved to the new version by the timed apply (forward) and back to the old
    one, untimed, before the next (to_old, with the reverse delta's sections)."""

    def __init__(self, k, w, back):
        self.k, self.w, self.back, self.at_new = k, w, back, False

    def to_old(self) -> None:
        if self.at_new:
            self.k.apply_device(self.w, self.back, "float", undo=False)
            self.at_new = False

    def forward(self, sections, undo: bool = False) -> None:
        self.k.apply_device(self.w, sections, "float", undo=undo)
        self.at_new = True


def random_bf16(torch, n: int, seed: int):
    """n bf16 values ~ N(0, 0.02), made slice by slice so no fp32 copy of the whole tensor is ever held."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    step = 1 << 28
    for i in range(0, n, step):
        out[i : i + step] = torch.randn(min(step, n - i), device="cuda", generator=g) * 0.02
    return out


def perturbed(torch, base, density: float, seed: int):
    """A copy of bf16 `base` with about `density` of its elements moved by one step, as RL updates move them."""
    g = torch.Generator(device=base.device).manual_seed(seed)
    new = base.clone()
    bits = new.view(torch.int16)
    idx = torch.randint(0, base.numel(), (max(1, int(base.numel() * density)),), device=base.device, generator=g)
    step = torch.randint(0, 2, idx.shape, device=base.device, generator=g, dtype=torch.int16) * 2 - 1
    bits[idx] = bits[idx] + step
    return new


def bench_copy_and_encode(torch, k, args, timer) -> dict:
    import numpy as np

    from wsync.backends.cuda import sections_to_host
    from wsync.codecs import delta_ref

    n = int(args.encode_gib * GIB) // 2
    old = random_bf16(torch, n, seed=1)
    new = perturbed(torch, old, args.density, seed=1)
    nbytes = new.numel() * new.element_size()
    dst = torch.empty_like(new)
    t_copy = timer(lambda: dst.copy_(new))
    del dst
    sec = k.encode_device(old, new, "float")
    expect_changed = int((old.view(torch.int16) != new.view(torch.int16)).sum())
    assert len(sec.steps) == expect_changed, (len(sec.steps), expect_changed)
    m = min(n, 1 << 25)  # a 64 MiB slice, checked byte for byte against the reference on the host
    part = sections_to_host(k.encode_device(old[:m], new[:m], "float"), np.uint16)
    o, w = (x[:m].view(torch.int16).cpu().numpy().view(np.uint16) for x in (old, new))
    ref = delta_ref.encode(o, w, "float")
    assert all(a.tobytes() == b.tobytes() for a, b in zip(
        (part.table, part.gaps, part.steps, part.escapes), (ref.table, ref.gaps, ref.steps, ref.escapes)))
    t_enc = timer(lambda: k.encode_device(old, new, "float"))
    t_digest = timer(lambda: k.digest_device(new))
    copy_gbps, enc_gbps, dig_gbps = nbytes / t_copy / 1e9, nbytes / t_enc / 1e9, nbytes / t_digest / 1e9
    return {
        "bytes": nbytes, "density": args.density, "n_changed": expect_changed,
        "copy_d2d_gbps": copy_gbps,
        "encode_gbps": enc_gbps, "encode_vs_copy": enc_gbps / copy_gbps,
        "digest_gbps": dig_gbps, "digest_vs_copy": dig_gbps / copy_gbps,
    }


def bench_apply(torch, k, args, timer) -> dict:
    params = int(args.apply_params)
    while True:  # as many parameters as fit, halving from the target (weights + new + encode scratch)
        try:
            w = random_bf16(torch, params, seed=2)
            new = perturbed(torch, w, args.density, seed=2)
            fwd = k.encode_device(w, new, "float")
            back = k.encode_device(new, w, "float")  # to return between timed applies without an undo buffer
            break
        except torch.cuda.OutOfMemoryError:
            w = new = fwd = back = None
            torch.cuda.empty_cache()
            params //= 2
    d_old, d_new = k.digest_device(w), k.digest_device(new)
    del new
    torch.cuda.empty_cache()
    undo = k.apply_device(w, fwd, "float", undo=True)
    assert k.digest_device(w) == d_new, "apply_device did not produce the new version"
    k.restore_device(w, undo)
    assert k.digest_device(w) == d_old, "restore_device did not bring the old version back"
    del undo

    live = InPlace(k, w, back)
    t_plain = timer(lambda: live.forward(fwd), before=live.to_old)
    t_undo = timer(lambda: live.forward(fwd, undo=True), before=live.to_old)
    live.to_old()
    assert k.digest_device(w) == d_old
    return {"params": params, "density": args.density, "n_changed": len(fwd.steps),
            "apply_ms": t_plain * 1e3, "apply_with_undo_ms": t_undo * 1e3,
            "scaled_down": params != int(args.apply_params)}


def bench_fused(torch, k, args, timer) -> dict:
    import cupy as cp

    per = max(1, int(args.tensor_mib * (1 << 20)) // 4)
    n = (int(args.adamw_params) // per) * per or per
    flat = torch.randn(n, device="cuda") * 0.02  # fp32 masters, one flat buffer as sharded optimizers keep them
    grad = torch.randn(n, device="cuda") * 1e-3
    params = [torch.nn.Parameter(v) for v in flat.view(-1, per)]  # views: the step writes into flat
    for p, gv in zip(params, grad.view(-1, per)):
        p.grad = gv
    out = {"params": n, "tensor_elems": per}
    for label, kw in (("adamw_foreach", {}), ("adamw_fused", {"fused": True})):
        opt = torch.optim.AdamW(params, lr=1e-6, **kw)
        opt.step()  # allocate the state outside the timing
        out[f"{label}_ms"] = timer(opt.step) * 1e3
        del opt
    before = flat.clone()
    torch.optim.AdamW(params, lr=1e-6).step()
    sec = k.fused_change_detect(before, flat)
    ref = k.encode_device(before.to(torch.bfloat16), flat.to(torch.bfloat16), "float")
    for a, b in zip((sec.table, sec.gaps, sec.steps, sec.escapes), (ref.table, ref.gaps, ref.steps, ref.escapes)):
        assert a.shape == b.shape and bool(cp.all(a == b)), "fused detector disagrees with cast + encode"
    out["n_changed"] = len(sec.steps)
    out["fused_detect_ms"] = timer(lambda: k.fused_change_detect(before, flat)) * 1e3
    out["fused_vs_adamw_foreach"] = out["fused_detect_ms"] / out["adamw_foreach_ms"]
    out["fused_vs_adamw_fused"] = out["fused_detect_ms"] / out["adamw_fused_ms"]
    return out


def bench_v2(torch, k, args, timer) -> dict:
    """A delta-v2 tensor decoded on the GPU (v2_decode_device) and applied in place (apply_device), against the
    same delta's v1 sections applied in place, and the C++ decoder on the host. The three decoders' sections are
    compared byte for byte first, and the weights' digest after the timed applies."""
    import time

    import numpy as np

    from wsync import dtypes
    from wsync.backends.cuda import _host_kernels, sections_to_host

    host = _host_kernels()
    if host is None:
        return {"skipped": "the C++ extension is not built (the v2 encoder would be the reference's Python)"}
    dt = dtypes.DTYPES["BF16"]
    n = int(args.v2_mib * (1 << 20)) // 2
    w = random_bf16(torch, n, seed=3)
    new = perturbed(torch, w, args.density, seed=3)
    fwd, back = k.encode_device(w, new, "float"), k.encode_device(new, w, "float")
    d_old, d_new = k.digest_device(w), k.digest_device(new)
    del new
    base = w.view(torch.int16).cpu().numpy().view(np.uint16)
    v1 = sections_to_host(fwd, np.uint16)
    t0 = time.perf_counter()
    parts = host.v2_encode(base, v1, dt)
    t_host_enc = time.perf_counter() - t0
    fields = ("table", "gaps", "steps", "escapes")
    on_gpu = sections_to_host(k.v2_decode_device(w, parts, dt), np.uint16)
    on_host = host.v2_decode(base, parts, dt)
    for got, name in ((on_gpu, "GPU"), (on_host, "C++")):
        assert all(getattr(got, f).tobytes() == getattr(v1, f).tobytes() for f in fields), f"{name} v2 decode != v1"

    live = InPlace(k, w, back)
    t_v2 = timer(lambda: live.forward(k.v2_decode_device(w, parts, dt)), before=live.to_old)
    assert k.digest_device(w) == d_new, "v2 decoded on the GPU and applied did not give the new version"
    t_v1 = timer(lambda: live.forward(fwd), before=live.to_old)
    live.to_old()
    t_dec = timer(lambda: k.v2_decode_device(w, parts, dt))
    assert k.digest_device(w) == d_old
    host_times = []
    for _ in range(max(3, args.repeat // 2)):
        t0 = time.perf_counter()
        host.v2_decode(base, parts, dt)
        host_times.append(time.perf_counter() - t0)
    t_host = sorted(host_times)[len(host_times) // 2]
    nbytes, payload = 2 * n, sum(len(bytes(p)) for p in parts.values())
    gbps = lambda t: nbytes / t / 1e9  # noqa: E731
    return {"bytes": nbytes, "density": args.density, "n_changed": len(v1.steps),
            "v2_payload_bytes": payload, "bits_per_change": 8 * payload / max(1, len(v1.steps)),
            "gpu_v2_decode_gbps": gbps(t_dec), "gpu_v2_decode_apply_gbps": gbps(t_v2),
            "gpu_v1_apply_gbps": gbps(t_v1), "gpu_v2_decode_apply_ms": t_v2 * 1e3, "gpu_v1_apply_ms": t_v1 * 1e3,
            "host_cpp_v2_decode_gbps": gbps(t_host), "host_cpp_v2_encode_gbps": gbps(t_host_enc),
            "host_threads": getattr(host, "threads", None)}


OPTIONS = ("size", "json", "encode_gib", "apply_params", "density", "adamw_params", "tensor_mib", "v2_mib", "stages",
           "repeat", "warmup")


def main(args) -> int:
    args = sized(args)
    result = {"date": datetime.date.today().isoformat(), "args": {k: str(getattr(args, k)) for k in OPTIONS}}
    try:
        import torch
    except ImportError as e:
        return finish(args, result, skipped=f"needs torch with CUDA ({e})")
    if not torch.cuda.is_available():
        return finish(args, result, skipped="needs a CUDA GPU and a CUDA build of torch")
    from wsync.backends.cuda import CudaKernels
    from wsync.hardware import describe
    from wsync.errors import BackendUnavailable

    try:
        k = CudaKernels()
    except BackendUnavailable as e:
        return finish(args, result, skipped=str(e))
    props = torch.cuda.get_device_properties(0)
    result["machine"] = describe() | {"gpu": props.name, "gpu_memory_gib": props.total_memory / GIB,
                                      "capability": f"{props.major}.{props.minor}", "torch": torch.__version__}
    result["device"] = props.name
    timer = Timer(torch, args.repeat, args.warmup)
    r = result["results"] = {}
    wanted = set(args.stages.split(","))
    stages = (("encode", bench_copy_and_encode), ("apply", bench_apply), ("fused", bench_fused), ("v2", bench_v2))
    failed = False
    for name, fn in stages:
        if name not in wanted:
            continue
        print(f"[bench_cuda] {name} ...", file=sys.stderr, flush=True)
        try:  # one stage failing (a wrong output, memory) still leaves the others' readings
            r[name] = fn(torch, k, args, timer)
        except Exception as e:
            r[name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"[bench_cuda] {name} failed: {r[name]['error']}", file=sys.stderr, flush=True)
            failed = True
        torch.cuda.empty_cache()
    h100 = "H100" in props.name
    ok = lambda s, key: s in r and key in r[s]  # noqa: E731
    result["targets"] = {
        "encode_vs_copy>=0.6": r["encode"]["encode_vs_copy"] >= 0.6 if ok("encode", "encode_vs_copy") else None,
        "encode>=1TB/s (H100)": (r["encode"]["encode_gbps"] >= 1000) if h100 and ok("encode", "encode_gbps") else None,
        "apply_8B_1pct<10ms": (r["apply"]["apply_ms"] < 10)
        if ok("apply", "apply_ms") and not r["apply"]["scaled_down"] else None,
        "fused<10%_of_adamw": r["fused"]["fused_vs_adamw_foreach"] < 0.10
        if ok("fused", "fused_vs_adamw_foreach") else None,
    }
    return finish(args, result) or (1 if failed else 0)


def finish(args, result: dict, skipped: str | None = None) -> int:
    if skipped:
        result["skipped"] = skipped
        print(f"wsync bench cuda: skipped: {skipped}", file=sys.stderr)
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(text)
    return 3 if skipped else 0
