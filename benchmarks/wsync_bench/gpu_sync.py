"""publish -> live on one device, end to end through the public API: a trainer process and an engine process.

    wsync bench gpu-sync --size full           # full size on cuda:0, into benchmarks/results/
    wsync bench gpu-sync --size full --time-limit 225 --out benchmarks/results/<date>-<gpu>-runbook
    wsync bench gpu-sync --device cpu --out /tmp/gpu-sync   # the logic at the small size, on a CPU

Two processes share the device. The trainer holds a state of bf16 tensors and
publishes it with wsync.Publisher; the engine holds an nn.Module whose
parameters have the same names and shapes, on the same device, and follows
it with wsync.Subscriber(engine=wsync.engines.HF(model)). Nothing but the
public API is called. Per state (`dense`: Qwen3-8B's shapes; `moe`: 20,000
expert tensors of Qwen3-30B-A3B's shapes with a narrower intermediate, so
that both sides fit beside the dense state's peak), random bf16 made on the
device, the stages are:

  build        both processes allocate their tensors (the trainer's random, the engine's zeros)
  d2d          the floor: torch copy_ of the whole state into a second copy on the same device
  raw_local    codec raw over local://: every version whole
  delta_local  codec delta over local://: per version, --density of the values moved by 1-2 bf16
               steps in place on the trainer's tensors, as an optimizer step would
  delta_tcp    the same over tcp://127.0.0.1 (with a token, as across machines)

Per version: publish -> live (from the trainer calling publish() to the
engine's on_commit, after a device synchronize there; both ends read
CLOCK_MONOTONIC, which every process on a host shares), the trainer's time
blocked inside publish(), bytes on the wire (Publisher.stats) and received,
the engine's apply time, whether the version landed as a keyframe (a delta
the engine refused comes again whole), and in each process the bytes wsync
copied between device and host (wsync.backends.transfers(), where it exists). Version 0 of each stage is the
first sync of a fresh subscriber, reported apart from the timed ones. Per
stage: extra device memory in each process against the stage's start
(torch's allocator: peak and held; device-wide used memory too, which also
sees other allocators), host RSS, and bit-exactness: a digest of every
tensor's bytes computed on the device in each process, compared.

Every stage runs under a share of --time-limit; one that fails or runs out of
time records why and the next one runs (a process that stops answering is
killed and started again). OUT/gpu_sync.json and OUT/gpu_sync.md are written
after every stage, so a run cut short keeps what it measured.
"""
from __future__ import annotations

import datetime
import gc
import json
import multiprocessing as mp
import os
import resource
import signal
import statistics
import subprocess
import time
import traceback
import zlib
from pathlib import Path

from .results import options

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its benchmarks/results is the default --out

BENCH = "gpu_sync"  # the marker `wsync plan transfer --backend cuda` looks for
SCHEMA = 1
STATES = ("dense", "moe")
SYNCS = {"raw_local": ("local", "raw"), "delta_local": ("local", "delta"), "delta_tcp": ("tcp", "delta")}
KINDS = ("build", "d2d", *SYNCS)
# shares of the time limit: the sync stages of the dense state are the readings wanted most
WEIGHTS = {"setup": 1.0, "build": 1.0, "d2d": 0.5, "raw_local": 3.0, "delta_local": 3.5, "delta_tcp": 3.0}
STATE_WEIGHT = {"dense": 1.0, "moe": 0.5}
# a cold start (first torch import, CUDA context) or a 16 GB allocation may need more than its share
FLOOR_S = {"setup": 60.0, "build": 30.0, "d2d": 10.0}
TOKEN = "wsync-bench-gpu-sync"
QWEN3_8B = dict(layers=36, hidden=4096, intermediate=12288, q_heads=32, kv_heads=8, head_dim=128, vocab=151936)
QWEN3_30B_A3B = dict(hidden=2048, moe_intermediate=768, experts=128, layers=48)


def add_parsers(bench) -> None:
    p = bench.add_parser("gpu-sync", help="publish -> live on one device through the public API, trainer and engine "
                                          "processes", description=__doc__.splitlines()[0],
                         epilog="Default small (the same structure scaled down): about 20 s with --device cpu here (2 "
                                "cores); --size full (16.4 GB dense state): up to its --time-limit, 900 s. --device "
                                "cpu runs the logic on a CPU.")
    p.add_argument("--size", choices=["full", "small"], default="small",
                   help="full: the real shapes (16.4 GB dense state); small: the same structure scaled down "
                        "(default small)")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (cpu: the script's logic, small sizes)")
    p.add_argument("--out", type=Path, help="folder for gpu_sync.json and gpu_sync.md "
                   "(default benchmarks/results/<date>-<device>-gpu-sync)")
    p.add_argument("--states", default=",".join(STATES), help="comma-separated: dense, moe (default both)")
    p.add_argument("--versions", type=int, help="timed versions per sync stage after version 0 (default 5; small 3)")
    p.add_argument("--density", type=float, default=0.01, help="fraction of values a delta version moves")
    p.add_argument("--tier", choices=["packed", "sparse"], default=None,
                   help="the delta stages' tier (default: sparse over local://, whose payloads stay on the device; "
                        "packed over tcp://)")
    p.add_argument("--moe-tensors", type=int, help="expert tensors of the moe state (default 20000; small 600)")
    p.add_argument("--moe-intermediate", type=int,
                   help="the moe state's expert intermediate size (real: 768; default 48; small 16)")
    p.add_argument("--time-limit", type=float, help="seconds for the whole run (default 900; small 120)")
    p.set_defaults(fn=main)


def settle(a):
    """The options the size leaves open, filled in from it; ValueError for options that cannot run."""
    small = a.size == "small"
    a.versions = a.versions if a.versions is not None else (3 if small else 5)
    a.moe_tensors = a.moe_tensors or (600 if small else 20_000)
    a.moe_intermediate = a.moe_intermediate or (16 if small else 48)
    a.time_limit = a.time_limit or (120.0 if small else 900.0)
    a.states = [s for s in a.states.split(",") if s]
    if not set(a.states) <= set(STATES) or not a.states:
        raise ValueError(f"--states takes {', '.join(STATES)}")
    if a.versions < 1 or not 0 < a.density < 1:
        raise ValueError("--versions must be >= 1 and --density in (0, 1)")
    if not (a.device == "cpu" or a.device.startswith("cuda")):
        raise ValueError("--device is cuda, cuda:N or cpu")
    return a


# -- the states ------------------------------------------------------------------------------------


def dense_shapes(size: str) -> tuple[dict, list]:
    """Qwen3-8B's tensors (untied embed and lm_head, q_norm/k_norm), or the same structure scaled down."""
    c = dict(QWEN3_8B) if size == "full" else dict(layers=4, hidden=256, intermediate=768, q_heads=4, kv_heads=2,
                                                    head_dim=64, vocab=2048)
    h, hd, q, kv, inter = c["hidden"], c["head_dim"], c["q_heads"], c["kv_heads"], c["intermediate"]
    out = [("model.embed_tokens.weight", (c["vocab"], h))]
    for i in range(c["layers"]):
        pre = f"model.layers.{i}."
        out += [(pre + "self_attn.q_proj.weight", (q * hd, h)), (pre + "self_attn.k_proj.weight", (kv * hd, h)),
                (pre + "self_attn.v_proj.weight", (kv * hd, h)), (pre + "self_attn.o_proj.weight", (h, q * hd)),
                (pre + "self_attn.q_norm.weight", (hd,)), (pre + "self_attn.k_norm.weight", (hd,)),
                (pre + "mlp.gate_proj.weight", (inter, h)), (pre + "mlp.up_proj.weight", (inter, h)),
                (pre + "mlp.down_proj.weight", (h, inter)),
                (pre + "input_layernorm.weight", (h,)), (pre + "post_attention_layernorm.weight", (h,))]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (c["vocab"], h))]
    return c, out


def moe_shapes(size: str, tensors: int, intermediate: int) -> tuple[dict, list]:
    """`tensors` expert weights named and shaped as Qwen3-30B-A3B's (layer by layer, 128 experts of gate, up and
    down each), with the expert intermediate size narrowed to `intermediate`."""
    h = QWEN3_30B_A3B["hidden"] if size == "full" else 64
    e = QWEN3_30B_A3B["experts"]
    c = dict(hidden=h, moe_intermediate=intermediate, experts=e, tensors=tensors,
             real=dict(QWEN3_30B_A3B) if size == "full" else None)
    out = []
    for i in range(tensors):
        layer, rest = divmod(i, e * 3)
        expert, proj = divmod(rest, 3)
        name = f"model.layers.{layer}.mlp.experts.{expert}.{('gate_proj', 'up_proj', 'down_proj')[proj]}.weight"
        out.append((name, (h, intermediate) if proj == 2 else (intermediate, h)))
    return c, out


def state_shapes(state: str, args) -> tuple[dict, list]:
    if state == "dense":
        return dense_shapes(args.size)
    return moe_shapes(args.size, args.moe_tensors, args.moe_intermediate)


def describe_shapes(shapes: list) -> dict:
    n = sum(_numel(s) for _, s in shapes)
    return {"tensors": len(shapes), "params": n, "bytes": 2 * n, "dtype": "bfloat16"}


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


# -- the worker processes --------------------------------------------------------------------------

_P = (1 << 61) - 1  # the digests' modulus: per-chunk sums stay below 2**57, so int64 never overflows
_CHUNK = 1 << 24  # bytes per digest step (its int64 temporaries are 8x that)


class Side:
    """What both processes do: hold a state on the device, digest it, and account for memory."""

    def __init__(self, device: str):
        import torch

        self.torch, self.device = torch, torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            if self.device.index is None:
                self.device = torch.device("cuda", 0)
            torch.cuda.set_device(self.device)  # wsync's own threads may start elsewhere; ours stay here
        self.state_name: str | None = None
        self.named: dict = {}
        self._mark: dict = {}

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def cmd_info(self) -> dict:
        torch = self.torch
        from wsync.hardware import describe

        import wsync

        info = describe() | {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "wsync": wsync.__version__,
                             "pid": os.getpid(), "device": str(self.device)}
        if self.cuda:
            props = torch.cuda.get_device_properties(self.device)
            info |= {"gpu": props.name, "gpu_memory_gib": props.total_memory / (1 << 30),
                     "capability": f"{props.major}.{props.minor}"}
        return info

    def free(self) -> None:
        self.named, self.state_name = {}, None
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()

    def digests(self) -> dict:
        """name -> [dtype, shape, s1, s2]: two position-weighted sums of the tensor's bytes, on its device.

        Small tensors go in batches (one launch sequence per batch, not per tensor), so a state of 20,000 costs
        about what one of its size does. A byte changed anywhere changes both sums; equal digests on both ends
        stand for equal bytes."""
        torch, dev = self.torch, self.device
        i64 = torch.int64
        sums, batch, batch_bytes = {}, [], 0

        def weighted(x, pos):
            x = x.to(i64)
            return x * (pos * 40503 % 16777213 + 1), x * (pos * 69069 % 16777199 + 1)

        def run_batch():
            flat = torch.cat([b for _, b in batch]) if len(batch) > 1 else batch[0][1]
            sizes = torch.tensor([b.numel() for _, b in batch], device=dev)
            ids = torch.repeat_interleave(torch.arange(len(batch), device=dev), sizes)
            starts = torch.cumsum(sizes, 0) - sizes
            pos = torch.arange(flat.numel(), device=dev, dtype=i64) - starts[ids]
            a, b = weighted(flat, pos)
            s1 = torch.zeros(len(batch), dtype=i64, device=dev).index_add_(0, ids, a) % _P
            s2 = torch.zeros(len(batch), dtype=i64, device=dev).index_add_(0, ids, b) % _P
            for k, (name, _) in enumerate(batch):
                sums[name] = torch.stack([s1[k], s2[k]])
            batch.clear()

        for name, t in self.named.items():
            b = t.detach().contiguous().reshape(-1).view(torch.uint8)
            if b.numel() >= _CHUNK:
                s = torch.zeros(2, dtype=i64, device=dev)
                for at in range(0, b.numel(), _CHUNK):
                    x = b[at : at + _CHUNK]
                    a, c = weighted(x, torch.arange(at, at + x.numel(), device=dev, dtype=i64))
                    s = (s + torch.stack([a.sum(), c.sum()])) % _P
                sums[name] = s
                continue
            batch.append((name, b))
            batch_bytes += b.numel()
            if batch_bytes >= _CHUNK:
                run_batch()
                batch_bytes = 0
        if batch:
            run_batch()
        names = list(sums)
        values = torch.stack([sums[n] for n in names]).cpu().tolist() if names else []
        return {n: [str(self.named[n].dtype), list(self.named[n].shape), *v] for n, v in zip(names, values)}

    def cmd_digest(self) -> dict:
        t = time.monotonic()
        d = self.digests()
        return {"digests": d, "seconds": time.monotonic() - t}

    def mark(self) -> None:
        """The start of a stage's memory accounting."""
        gc.collect()
        self._mark = {"rss": _rss()}
        if self.cuda:
            torch = self.torch
            self.sync()
            torch.cuda.reset_peak_memory_stats(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            self._mark |= {"alloc": torch.cuda.memory_allocated(self.device), "used": total - free}

    def memory(self) -> dict:
        """Bytes above the mark: torch's peak and what it holds now, device-wide used, host RSS."""
        m = self._mark
        out = {"rss_extra_bytes": _rss() - m.get("rss", 0),
               "rss_lifetime_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        if self.cuda:
            torch = self.torch
            free, total = torch.cuda.mem_get_info(self.device)
            out |= {"extra_peak_bytes": torch.cuda.max_memory_allocated(self.device) - m["alloc"],
                    "extra_held_bytes": torch.cuda.memory_allocated(self.device) - m["alloc"],
                    "device_used_extra_bytes": (total - free) - m["used"]}
        return out


def _pcie() -> dict | None:
    """Bytes wsync copied between device and host in this process so far, where wsync counts them."""
    try:
        from wsync import backends

        t = backends.transfers()
        return {"d2h": int(t.d2h), "h2d": int(t.h2d)}
    except (AttributeError, ImportError, TypeError):
        return None


def _pcie_since(before: dict | None, after: dict | None) -> dict | None:
    if before is None or after is None:
        return None
    return {k: after[k] - before[k] for k in after}


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Trainer(Side):
    def __init__(self, device: str):
        super().__init__(device)
        self.pub = None
        self._pcie_at_publish = None

    def cmd_build(self, state: str, shapes: list, seed: int) -> dict:
        torch = self.torch
        if self.state_name == state:
            return {"seconds": 0.0, "cached": True}
        self.free()
        t = time.monotonic()
        g = torch.Generator(device=self.device).manual_seed(seed)
        named = {}
        for name, shape in shapes:
            x = torch.empty(shape, dtype=torch.bfloat16, device=self.device)
            x.normal_(0.0, 0.02, generator=g)
            named[name] = x
        self.sync()
        self.named, self.state_name = named, state
        return {"seconds": time.monotonic() - t}

    def cmd_d2d(self, repeat: int) -> dict:
        """The same bytes copied device to device, tensor by tensor and with one _foreach_copy_."""
        torch = self.torch
        src = list(self.named.values())
        dst = [torch.empty_like(x) for x in src]

        def loop():
            for d, s in zip(dst, src):
                d.copy_(s)

        out = {"timer": "cuda events" if self.cuda else "perf_counter"}
        for label, fn in (("copy", loop), ("foreach_copy", lambda: torch._foreach_copy_(dst, src))):
            fn()  # warm-up
            times = [self._time(fn) for _ in range(repeat)]
            out[f"{label}_s"] = summary(times)
        if not all(torch.equal(d.view(torch.uint8), s.view(torch.uint8)) for d, s in zip(dst, src)):
            raise AssertionError("the device-to-device copy differs from its source")
        dst.clear()  # the copies go before the next stage needs the memory
        self.free_cache()
        return out

    def free_cache(self) -> None:
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()

    def _time(self, fn) -> float:
        if not self.cuda:
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t
        torch = self.torch
        self.sync()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def cmd_open(self, address: str, codec: str, tier: str, token: str | None) -> dict:
        import wsync

        self.mark()
        self.pub = wsync.Publisher(address, codec=codec, tier=tier, keyframe_every=0, token=token)
        return {"address": self.pub.address}

    def cmd_subscribers(self, timeout: float) -> int:
        return self.pub.wait_for_subscribers(1, timeout=timeout)

    def perturb(self, density: float, seed: int) -> None:
        """About `density` of every tensor's values moved by 1 or 2 representable bf16 steps, in place."""
        torch = self.torch
        g = torch.Generator(device=self.device).manual_seed(seed)
        with torch.no_grad():
            for x in self.named.values():
                bits = x.view(torch.int16).view(-1)
                k = max(1, round(bits.numel() * density))
                idx = torch.randint(0, bits.numel(), (k,), device=self.device, generator=g)
                size = torch.randint(1, 3, (k,), device=self.device, generator=g, dtype=torch.int16)
                sign = torch.randint(0, 2, (k,), device=self.device, generator=g, dtype=torch.int16) * 2 - 1
                bits[idx] = bits[idx] + size * sign

    def cmd_publish(self, version: int, perturb: bool, density: float, seed: int) -> dict:
        t = time.monotonic()
        if perturb:
            self.perturb(density, seed)
        self.sync()  # the update is done before the clock starts, as after an optimizer step
        self._pcie_at_publish = _pcie()
        t0 = time.monotonic()
        self.pub.publish(self.named, version=version)
        t1 = time.monotonic()
        return {"t0": t0, "blocked_s": t1 - t0, "perturb_s": t0 - t}

    def cmd_flush(self, version: int, timeout: float) -> dict:
        self.pub.flush(timeout=timeout)
        st = self.pub.stats
        return {"wire_bytes": st.bytes.get(version), "encode_s": st.encode_s.get(version),
                "history_bytes": st.history_bytes, "pcie_bytes": _pcie_since(self._pcie_at_publish, _pcie())}

    def cmd_close(self) -> dict:
        mem = {"open": self.memory()}
        if self.pub is not None:
            self.pub.close()
            self.pub = None
        gc.collect()
        mem["closed"] = self.memory()
        return mem


class Engine(Side):
    def __init__(self, device: str):
        super().__init__(device)
        import threading

        self.model = self.sub = None
        self.cv = threading.Condition()
        self.commits: dict = {}
        self._pcie_at_commit = None

    def cmd_build(self, state: str, shapes: list, seed: int) -> dict:
        torch = self.torch
        if self.state_name == state:
            return {"seconds": 0.0, "cached": True}
        self.model = None
        self.free()
        t = time.monotonic()
        root = torch.nn.Module()
        for name, shape in shapes:
            *path, leaf = name.split(".")
            m = root
            for part in path:
                child = m._modules.get(part)
                if child is None:
                    child = torch.nn.Module()
                    m.add_module(part, child)
                m = child
            m.register_parameter(leaf, torch.nn.Parameter(
                torch.zeros(shape, dtype=torch.bfloat16, device=self.device), requires_grad=False))
        self.sync()
        self.model, self.state_name = root, state
        self.named = dict(root.named_parameters())
        return {"seconds": time.monotonic() - t}

    def free(self) -> None:
        self.model = None
        super().free()

    def cmd_subscribe(self, address: str, token: str | None) -> dict:
        import wsync

        self.mark()
        with self.cv:
            self.commits, self._rx, self._rx_last, self._rx_at_commit, self._rx_version = {}, 0, 0, 0, None
            self._pcie_at_commit = _pcie()
        self.sub = wsync.Subscriber(address, engine=wsync.engines.HF(self.model), token=token,
                                    on_commit=self._committed, progress=self._progress)
        return {}

    def _progress(self, version, bucket, count, nbytes) -> None:
        with self.cv:
            if bucket == 1 or version != self._rx_version:  # a new delivery: nbytes counts from zero again
                self._rx_last, self._rx_version = 0, version
            self._rx += nbytes - self._rx_last
            self._rx_last = nbytes

    def _committed(self, info: dict) -> None:
        self.sync()  # live means in the parameters, not queued on a stream
        t = time.monotonic()
        pcie = _pcie()
        with self.cv:
            self.commits[info["version"]] = {"t_commit": t, "keyframe": info["keyframe"], "apply_s": info["apply_s"],
                                             "committed_bytes": info["bytes"],
                                             "received_bytes": self._rx - self._rx_at_commit,
                                             "pcie_bytes": _pcie_since(self._pcie_at_commit, pcie)}
            self._rx_at_commit, self._pcie_at_commit = self._rx, pcie
            self.cv.notify_all()

    def cmd_wait(self, version: int, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        self.sub.wait_for(version, timeout=timeout)
        with self.cv:  # wait_for can return before on_commit has run
            while version not in self.commits:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"version {version} served but on_commit not called within {timeout:.0f} s")
                self.cv.wait(left)
            rec = dict(self.commits[version])
        st = self.sub.stats
        err = self.sub.error
        return rec | {"failures": st.failures, "error": None if err is None else str(err)[:300]}

    def cmd_close(self) -> dict:
        mem = {"open": self.memory()}
        if self.sub is not None:
            self.sub.close()
            self.sub = None
        gc.collect()
        mem["closed"] = self.memory()
        return mem


def worker_main(role: str, conn, device: str) -> None:
    """A worker process: commands (name, kwargs) in, ("ok", result) or ("err", text) out, until quit or EOF."""
    try:
        side = (Trainer if role == "trainer" else Engine)(device)
    except BaseException as e:  # noqa: BLE001 - said to the orchestrator, which records it
        conn.send(("err", f"{role} could not start: {e!r}\n{traceback.format_exc()}"))
        return
    conn.send(("ok", os.getpid()))
    while True:
        try:
            cmd, kw = conn.recv()
        except (EOFError, OSError):
            return
        if cmd == "quit":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(side, "cmd_" + cmd)(**kw)))
        except BaseException as e:  # noqa: BLE001 - every failure goes back as text, the worker lives on
            conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"))


# -- the orchestrator ------------------------------------------------------------------------------


class StageError(Exception):
    """A stage failed in a way that leaves its workers usable."""


class WorkerLost(StageError):
    """A worker died or stopped answering: it is killed and started again for the next stage."""


class Worker:
    def __init__(self, role: str, device: str):
        self.role, self.device = role, device
        self.proc = self.conn = None
        self.state: str | None = None  # the state it holds, as far as the orchestrator knows
        self.pid = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def start(self) -> None:
        ctx = mp.get_context("spawn")  # a fresh interpreter: CUDA cannot be forked
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(self.role, child, self.device), name=f"gpu-sync-{self.role}")
        self.proc.start()
        child.close()
        self.state = None

    def send(self, cmd: str, **kw) -> None:
        try:
            self.conn.send((cmd, kw))
        except (OSError, ValueError) as e:
            raise WorkerLost(f"{self.role} process is gone ({e!r}, exit code {self.proc.exitcode})") from e

    def recv(self, what: str, timeout: float):
        if not self.conn.poll(max(timeout, 0.05)):
            raise WorkerLost(f"{self.role}: no answer to {what} within {max(timeout, 0):.0f} s")
        try:
            tag, out = self.conn.recv()
        except (EOFError, OSError) as e:
            self.proc.join(2)
            raise WorkerLost(f"{self.role} process died during {what} (exit code {self.proc.exitcode})") from e
        if tag == "err":
            raise StageError(f"{self.role} {what}: {out.strip()}")
        return out

    def call(self, cmd: str, wait_s: float, /, **kw):
        """cmd(**kw) in the worker, its answer awaited for up to wait_s seconds."""
        self.send(cmd, **kw)
        return self.recv(cmd, wait_s)

    def stop(self, grace: float = 5.0) -> None:
        if self.proc is None:
            return
        if self.proc.is_alive():
            try:
                self.conn.send(("quit", {}))
                self.proc.join(grace)
            except (OSError, ValueError):
                pass
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(grace)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(grace)
        self.proc = None
        self.state = None


def summary(values: list) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


class Run:
    def __init__(self, args):
        self.args = args
        self.trainer, self.engine = Worker("trainer", args.device), Worker("engine", args.device)
        self.shapes = {s: state_shapes(s, args) for s in args.states}
        self.digest_s = 5.0  # seconds the trainer's digest takes; measured at build
        self.partial: dict = {}  # the running stage's record so far
        self.result: dict = {}

    def left(self, deadline: float) -> float:
        return deadline - time.monotonic()

    # the stages --------------------------------------------------------------------------------

    def setup(self, deadline: float) -> dict:
        started = [w for w in (self.trainer, self.engine) if not w.alive]
        for w in started:
            w.stop()
            w.start()
        try:
            pids = self.gather(started, "start", deadline)
        except StageError:
            for w in (self.trainer, self.engine):  # a half-started pair is started again whole
                w.stop()
            raise
        info = self.trainer.call("info", self.left(deadline))
        self.result["machine"] = info
        self.result["device"] = info["device"] + (f" ({info['gpu']})" if info.get("gpu") else f" ({info['cpu']})")
        return {"pids": pids}

    def ensure_workers(self, deadline: float) -> None:
        if not (self.trainer.alive and self.engine.alive):
            self.setup(deadline)

    def build(self, state: str, deadline: float) -> dict:
        self.ensure_workers(deadline)
        shapes = self.shapes[state][1]
        todo = [w for w in (self.trainer, self.engine) if w.state != state]
        for w in todo:
            w.state = None
            w.send("build", state=state, shapes=shapes, seed=1000 + STATES.index(state))
        out = self.gather(todo, "build", deadline)
        for w in todo:
            w.state = state
        if "trainer" in out:  # how long a digest of this state takes, to keep time for one at each stage's end
            d = self.trainer.call("digest", self.left(deadline))
            self.digest_s = d["seconds"]
            out["digest_s"] = d["seconds"]
        return {"build": out}

    def gather(self, workers: list, what: str, deadline: float) -> dict:
        """Every sent command's answer, by role: a failure is raised after the others are read, so that no
        answer is left in a pipe for the next command to take."""
        out, failed = {}, None
        for w in workers:
            try:
                out[w.role] = w.recv(what, self.left(deadline))
            except WorkerLost:
                raise  # both are stopped: nothing is read from them again
            except StageError as e:
                failed = failed or e
        if failed:
            raise failed
        return out

    def d2d(self, state: str, deadline: float) -> dict:
        self.build(state, deadline)
        repeat = 5 if self.args.size == "full" else 3
        return self.trainer.call("d2d", self.left(deadline), repeat=repeat)

    def sync_stage(self, state: str, stage: str, deadline: float) -> dict:
        args = self.args
        self.build(state, deadline)
        transport, codec = SYNCS[stage]
        tier = (args.tier or ("sparse" if transport == "local" else "packed")) if codec == "delta" else None
        address = f"local://gs{os.getpid()}-{state}-{stage}".replace("_", "-") if transport == "local" \
            else "tcp://127.0.0.1:0"
        token = TOKEN if transport == "tcp" else None
        rec = self.partial  # filled as it goes: a stage that fails keeps the versions it measured
        rec.update(transport=f"{transport}://", codec=codec, tier=tier, versions_asked=args.versions, stopped=None)
        versions = rec["versions"] = []
        lost = False
        phases = rec["phases_s"] = {}  # where a stage's time went, beyond the versions' own figures
        t = time.monotonic()
        try:
            got = self.trainer.call("open", self.left(deadline), address=address, codec=codec, tier=tier or "packed",
                                    token=token)
            rec["address"] = got["address"]
            self.engine.call("subscribe", self.left(deadline), address=got["address"], token=token)
            self.trainer.call("subscribers", self.left(deadline), timeout=max(self.left(deadline) - 1, 1))
            phases["connect"], t = time.monotonic() - t, time.monotonic()
            # both digests and both closes after the last version
            reserve = (5.0 if args.size == "full" else 1.0) + 3 * self.digest_s
            for v in range(args.versions + 1):
                t_v = time.monotonic()
                pub = self.trainer.call("publish", self.left(deadline), version=v, perturb=v > 0,
                                        density=args.density, seed=zlib.crc32(f"{state}/{stage}/{v}".encode()))
                live = self.engine.call("wait", self.left(deadline), version=v,
                                        timeout=max(self.left(deadline) - 1, 1))
                fl = self.trainer.call("flush", self.left(deadline), version=v,
                                       timeout=max(self.left(deadline) - 1, 1))
                one = {"version": v, "publish_to_live_s": live["t_commit"] - pub["t0"],
                       "blocked_s": pub["blocked_s"], "wire_bytes": fl["wire_bytes"],
                       "received_bytes": live["received_bytes"], "committed_bytes": live["committed_bytes"],
                       "keyframe": live["keyframe"], "apply_s": live["apply_s"], "encode_s": fl["encode_s"],
                       "engine_failures": live["failures"], "engine_error": live["error"],
                       "history_bytes": fl["history_bytes"], "trainer_pcie_bytes": fl["pcie_bytes"],
                       "engine_pcie_bytes": live["pcie_bytes"]}
                if v == 0:
                    rec["first"] = one
                else:
                    versions.append(one)
                took = time.monotonic() - t_v
                # version 0 goes whole, so its time overstates a delta's: one timed version is tried on less
                margin = 1.5 * took + reserve if versions else took + reserve / 2
                if v < args.versions and time.monotonic() + margin > deadline:
                    rec["stopped"] = f"time limit: {len(versions)} of {args.versions} timed versions"
                    break
            phases["versions"], t = time.monotonic() - t, time.monotonic()
            for w in (self.engine, self.trainer):
                w.send("digest")
            got = self.gather([self.trainer, self.engine], "digest", deadline)
            ours, theirs = got["trainer"]["digests"], got["engine"]["digests"]
            bad = sorted(n for n in set(ours) | set(theirs) if ours.get(n) != theirs.get(n))
            rec.update(exact=not bad, tensors_compared=len(ours), mismatched=bad[:10], mismatched_count=len(bad))
            phases["digests"], t = time.monotonic() - t, time.monotonic()
        except WorkerLost:
            lost = True  # both are stopped by the caller: a close could wait on the one that hangs
            raise
        finally:
            _summarize(rec, versions)
            mem = {}
            for w in (self.engine, self.trainer):  # the subscriber first: the publisher's close says bye to it
                if w.alive and not lost:
                    tc = time.monotonic()
                    try:
                        mem[w.role] = w.call("close", max(min(self.left(deadline), 60.0), 10.0))
                        phases[f"close_{w.role}"] = time.monotonic() - tc
                    except StageError as e:
                        mem[w.role] = {"error": str(e)[:300]}
                        if isinstance(e, WorkerLost):
                            lost = True
                            self.trainer.stop()
                            self.engine.stop()
            rec["memory"] = mem
        return rec

    # running them -----------------------------------------------------------------------------------

    def plan(self) -> list[tuple[str, float]]:
        stages = [("setup", WEIGHTS["setup"])]
        for s in self.args.states:
            stages += [(f"{s}.{k}", WEIGHTS[k] * STATE_WEIGHT[s]) for k in KINDS]
        return stages

    def run_stage(self, name: str, limit: float) -> dict:
        rec = {"ok": False, "error": None, "limit_s": round(limit, 1)}
        self.partial = {}
        t = time.monotonic()
        deadline = t + limit
        state, _, kind = name.partition(".")
        try:
            if name == "setup":
                got = self.setup(deadline)
            elif kind == "build":
                got = self.build(state, deadline)
            elif kind == "d2d":
                got = self.d2d(state, deadline)
            else:
                got = self.sync_stage(state, kind, deadline)
            rec.update(got)
            rec["ok"] = True
        except WorkerLost as e:
            rec.update(self.partial)
            rec["error"] = str(e)
            for w in (self.trainer, self.engine):  # the other one may be stuck on its half of the sync
                w.stop()
        except Exception as e:  # noqa: BLE001 - recorded; the next stage runs
            rec.update(self.partial)
            rec["error"] = f"{type(e).__name__}: {e}" if not isinstance(e, StageError) else str(e)
        rec["seconds"] = round(time.monotonic() - t, 3)
        return rec

    def main(self) -> dict:
        args = self.args
        start = time.monotonic()
        end = start + args.time_limit
        plan = self.plan()
        r = self.result
        r.update(bench=BENCH, schema=SCHEMA, created=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                 date=datetime.date.today().isoformat(), args=options(args),
                 size=args.size, device=args.device, commit=_commit(),
                 states={s: {"config": c, **describe_shapes(sh)} for s, (c, sh) in self.shapes.items()},
                 stage_names=[n for n, _ in plan], stages={})
        name = None
        try:
            for i, (name, weight) in enumerate(plan):
                left = end - time.monotonic()
                share = left * weight / sum(w for _, w in plan[i:])
                limit = min(left, max(share, FLOOR_S.get(name.partition(".")[2] or name, 0.0)))
                if limit < 1.0:
                    r["stages"][name] = {"ok": False, "error": "skipped: no time left", "limit_s": 0.0, "seconds": 0.0}
                else:
                    print(f"[{name}] up to {limit:.0f} s", flush=True)
                    r["stages"][name] = self.run_stage(name, limit)
                    st = r["stages"][name]
                    print(f"[{name}] {'ok' if st['ok'] else 'FAILED: ' + str(st['error']).splitlines()[0]} "
                          f"in {st['seconds']:.1f} s", flush=True)
                self.finish_stage(name, start)
        except (KeyboardInterrupt, SystemExit) as e:  # a kill from outside: keep what was measured, say where
            if name is not None and name not in r["stages"]:
                r["stages"][name] = {"ok": False, "error": f"interrupted ({type(e).__name__})", "seconds": None}
                self.finish_stage(name, start)
            raise
        finally:
            for w in (self.engine, self.trainer):
                w.stop()
        return r

    def finish_stage(self, name: str, start: float) -> None:
        r = self.result
        if name.endswith(tuple(SYNCS)) and "exact" not in r["stages"][name]:
            r["stages"][name]["exact"] = None
        r["exact"] = overall_exact(r)
        r["complete"] = all(r["stages"].get(n, {}).get("ok") for n in r["stage_names"])
        r["seconds"] = round(time.monotonic() - start, 3)
        self.write()

    def out_dir(self) -> Path:
        if self.args.out:
            return self.args.out
        gpu = self.result.get("machine", {}).get("gpu")
        slug = _slug(gpu) if gpu else ("cpu" if self.args.device == "cpu" else "unknown")
        return ROOT / "benchmarks" / "results" / f"{self.result['date']}-{slug}-gpu-sync"

    def write(self) -> None:
        out = self.out_dir()
        out.mkdir(parents=True, exist_ok=True)
        for name, text in (("gpu_sync.json", json.dumps(self.result, indent=2) + "\n"),
                           ("gpu_sync.md", markdown(self.result))):
            tmp = out / f".{name}.tmp"
            tmp.write_text(text)
            tmp.replace(out / name)


def _summarize(rec: dict, versions: list) -> None:
    """The timed versions' figures, min / median / max."""
    for key in ("publish_to_live_s", "blocked_s", "wire_bytes", "received_bytes", "apply_s", "encode_s"):
        rec[key] = summary([x[key] for x in versions])
    rec["keyframes"] = sum(1 for x in versions if x["keyframe"])
    rec["pcie_bytes"] = {side: summary([sum(x[f"{side}_pcie_bytes"].values()) for x in versions
                                        if x[f"{side}_pcie_bytes"] is not None]) for side in ("trainer", "engine")}
    last = versions[-1] if versions else rec.get("first")
    rec["engine_failures"] = last["engine_failures"] if last else None


def overall_exact(r: dict) -> bool | None:
    """True when every sync stage compared equal; False when one differed; None while one is unchecked."""
    syncs = [st.get("exact") for n, st in r["stages"].items() if n.endswith(tuple(SYNCS))]
    expected = sum(1 for n in r["stage_names"] if n.endswith(tuple(SYNCS)))
    if any(x is False for x in syncs):
        return False
    return True if len(syncs) == expected and all(x is True for x in syncs) else None


def _slug(name: str) -> str:
    import re

    s = re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-")
    return s or "gpu"


def _commit() -> dict:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
        return {"sha": sha or None, "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"sha": None, "dirty": None}


# -- the summary -----------------------------------------------------------------------------------


def _gb(n) -> str:
    return "-" if n is None else f"{n / 1e9:.3g} GB" if n >= 1e8 else f"{n / 1e6:.3g} MB"


def _s(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def _med(d, key="median"):
    return None if not d else d.get(key)


def markdown(r: dict) -> str:
    m = r.get("machine", {})
    lines = [f"# publish -> live on one device: {r.get('device')}", ""]
    if m:
        gpu = f"{m['gpu']} ({m['gpu_memory_gib']:.0f} GiB, sm {m['capability']})" if m.get("gpu") else "no GPU"
        lines.append(f"{gpu}; CPU {m.get('cpu')} x {m.get('cores')}; torch {m.get('torch')} (CUDA "
                     f"{m.get('torch_cuda')}); wsync {m.get('wsync')}, backend {m.get('wsync_backend')}; commit "
                     f"{r['commit'].get('sha')}{' (uncommitted changes)' if r['commit'].get('dirty') else ''}; "
                     f"size {r['size']}; {r['created']}.")
    else:
        lines.append(f"size {r['size']}; {r['created']}; the workers never started (see setup).")
    lines.append("")
    for s, d in r["states"].items():
        lines.append(f"- {s}: {d['tensors']:,} bf16 tensors, {_gb(d['bytes'])} ({d['config']})")
    lines += ["", f"All sync stages bit-exact: **{r.get('exact')}**; every stage ran: {r.get('complete')}; "
              f"{r.get('seconds', 0):.0f} s.", "",
              "| stage | versions | publish->live min / median s | first (v0) s | blocked in publish() median s | "
              "bytes/version median (wire / received) | device<->host bytes/version median: trainer / engine | "
              "keyframes | exact | extra device memory, peak: trainer / engine | note |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in r["stage_names"]:
        st = r["stages"].get(name)
        if st is None:
            continue
        note = "" if st.get("ok") else str(st.get("error") or "").splitlines()[0][:120]
        if name.endswith(".d2d") and st.get("ok"):
            c = st["copy_s"]["median"]
            size = r["states"][name.split(".")[0]]["bytes"]
            lines.append(f"| {name} | - | {_s(st['copy_s']['min'])} / {_s(c)} ({size / c / 1e9:.0f} GB/s; foreach "
                         f"{_s(st['foreach_copy_s']['median'])} s) | - | - | - | - | - | - | - | {note} |")
        elif name.endswith(tuple(SYNCS)):
            mem = st.get("memory", {})
            peak = " / ".join(_gb(mem.get(w, {}).get("open", {}).get("extra_peak_bytes"))
                              for w in ("trainer", "engine"))
            first = st.get("first", {}).get("publish_to_live_s")
            pcie = " / ".join(_gb(_med((st.get("pcie_bytes") or {}).get(w))) for w in ("trainer", "engine"))
            note = note or (st.get("stopped") or "")
            n = len(st.get("versions", []))
            lines.append(f"| {name} | {n} | {_s(_med(st.get('publish_to_live_s'), 'min'))} / "
                         f"{_s(_med(st.get('publish_to_live_s')))} | {_s(first)} | {_s(_med(st.get('blocked_s')))} | "
                         f"{_gb(_med(st.get('wire_bytes')))} / {_gb(_med(st.get('received_bytes')))} | "
                         f"{pcie} | {st.get('keyframes', '-')} of {n} | {st.get('exact')} | {peak} | {note} |")
        else:
            took = st.get("seconds") or 0
            lines.append(f"| {name} | - | - | - | - | - | - | - | - | - | {note or 'ok'} in {took:.1f} s |")
    ratios = []
    for s in r["states"]:
        d2d, raw = r["stages"].get(f"{s}.d2d", {}), r["stages"].get(f"{s}.raw_local", {})
        if d2d.get("ok") and _med(raw.get("publish_to_live_s")):
            ratios.append(f"{s}: raw over local:// takes {_med(raw['publish_to_live_s']) / d2d['copy_s']['median']:.3g}"
                          f"x the device-to-device copy of the same bytes")
    if ratios:
        lines += ["", *(f"- {x}" for x in ratios)]
    lines += ["", "publish->live: publish() called on the trainer until the engine's on_commit after a device "
              "synchronize; v0 is a fresh subscriber's first (whole) sync. keyframes: timed versions that landed "
              "whole (a refused delta is followed by a keyframe). Extra device memory: torch's allocator in each "
              "process above the stage's start; gpu_sync.json also has the held bytes, device-wide used memory "
              "and host RSS.", ""]
    return "\n".join(lines)


def _terminated(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through the stage loop: the JSON is written, the workers stopped


def main(args) -> int:
    args = settle(args)
    signal.signal(signal.SIGTERM, _terminated)
    run = Run(args)
    r = run.main()
    print(f"wrote {run.out_dir() / 'gpu_sync.json'} and gpu_sync.md; exact {r.get('exact')}, "
          f"complete {r.get('complete')}", flush=True)
    return 0 if r.get("complete") and r.get("exact") else 1
