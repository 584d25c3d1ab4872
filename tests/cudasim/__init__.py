"""wsim: the unmodified CUDA device code of csrc/*.cu, executed on the CPU (one fiber per GPU thread).

No GPU runs in CI, so this is where the kernels themselves run there: wsim.h
stands in for the CUDA built-ins (strictly: barriers, warp collectives and
shared memory fail where the hardware would be undefined), g++ compiles the .cu
files unchanged after it, and this module drives the result:

    sim = load()                                  # build (cached by content hash) and load
    sim.launch("delta_check", grid, block, args, schedule="reverse")
    rt = SimRuntime(sim, "random", seed=3)        # what wsync.backends.cuda._Launcher runs on,
    kernels = cuda._KernelsOver(rt)               # in place of cupy's RawModule and memory

Arguments follow cupy's rules (arrays are device pointers, numpy scalars are
passed at their own width) and are checked against the kernel's parameter
list; each array is copied into a buffer with junk and unmapped pages around
it for the launch, so a kernel that reads or writes past an argument, or writes
through a const one, fails the launch.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CSRC = ROOT / "csrc"
SCHEDULES = {"forward": 0, "reverse": 1, "random": 2, "round_robin": 3}
WARN = ["-Wall", "-Wextra", "-Werror", "-Wno-unknown-pragmas"]
# popcnt inline rather than libgcc's loop (every x86-64 CPU since 2008 has it; the scheduler counts runnable threads)
ARCH = ["-mpopcnt"] if platform.machine() in ("x86_64", "AMD64") else []
FLAGS = ["-std=c++17", "-O2", "-fPIC", "-shared", "-fvisibility=hidden", *ARCH, *WARN]
# AddressSanitizer and UBSan; -O1 keeps the build short and the reports readable
SAN_FLAGS = ["-std=c++17", "-O1", "-g", "-fPIC", "-shared", "-fvisibility=hidden", "-fno-omit-frame-pointer", *ARCH,
             "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", *WARN]


class SimError(RuntimeError):
    """A kernel broke a rule of CUDA (divergent barrier, bad mask, deadlock, memory fault), or was launched wrong."""


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def default_sources() -> list[Path]:
    """Every kernel source of wsync, plus the test-only probe kernels."""
    return sorted(CSRC.glob("*.cu")) + [HERE / "probes.cu"]


def _cache_root() -> Path:
    return Path(os.environ.get("WSYNC_CUDASIM_CACHE") or Path(tempfile.gettempdir()) / "wsync-cudasim")


def _tu(sources: list[Path], kernels: list[str] | None) -> str:
    lines = ['#include "wsim.h"'] + [f'#include "{s}"' for s in sources]
    if kernels is not None:
        lines.append("#define WSIM_KERNELS(X) " + " ".join(f"X({k})" for k in kernels))
        lines.append('#include "wsim_api.h"')
    return "\n".join(lines) + "\n"


def _digest(cxx: str, flags: list[str], sources: list[Path], include_dirs: list[Path]) -> str:
    h = hashlib.sha256()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    h.update(f"{cxx}\n{version}\n{flags}\n".encode())
    # which files are compiled, not only which bytes are visible: two builds over one directory differ
    h.update(("\n".join(map(str, sources)) + "\0").encode())
    files = set(sources)
    for d in include_dirs:
        files.update(p for p in d.iterdir() if p.suffix in (".h", ".cuh", ".cu", ".inc"))
    for p in sorted(files):
        h.update(str(p).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:24]


def build(sources: list[Path] | None = None, *, sanitize: bool = False, include_dirs: list[Path] = (),
          extra_flags: list[str] = ()) -> Path:
    """Compile sources after wsim.h into a shared library; reuse a build of the same bytes and flags."""
    cxx = compiler()
    if cxx is None:
        raise FileNotFoundError("no C++ compiler (g++) on PATH: wsim compiles the CUDA sources with it")
    sources = [Path(s).resolve() for s in (sources or default_sources())]
    incs = [HERE, *(Path(d).resolve() for d in include_dirs), *sorted({s.parent for s in sources})]
    flags = [*(SAN_FLAGS if sanitize else FLAGS), *extra_flags, *(f"-I{d}" for d in incs)]
    out_dir = _cache_root() / _digest(cxx, flags, sources, incs)
    so = out_dir / "wsim.so"
    if so.exists():
        return so
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=out_dir))
    try:
        tu = work / "tu.cpp"
        tu.write_text(_tu(sources, None))
        pre = subprocess.run([cxx, "-E", "-P", *flags, str(tu)], capture_output=True, text=True)
        if pre.returncode:
            raise SimError(f"preprocessing failed:\n{pre.stderr[-6000:]}")
        kernels = re.findall(r'section\s*\(\s*"\.text\.wsim_kernel"\s*\)\s*\)\s*\)\s*void\s+(\w+)\s*\(', pre.stdout)
        tu.write_text(_tu(sources, sorted(set(kernels), key=kernels.index)))
        r = subprocess.run([cxx, *flags, str(tu), "-o", str(work / "wsim.so"), "-ldl"], capture_output=True,
                           text=True)
        if r.returncode:
            raise SimError(f"wsim build failed:\n{r.stderr[-8000:]}")
        os.replace(work / "wsim.so", so)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return so


@dataclass(frozen=True)
class Param:
    size: int  # bytes of the parameter itself
    is_ptr: bool
    pointee: int  # bytes of what a pointer parameter points to
    is_const: bool


@dataclass(frozen=True)
class Kernel:
    index: int
    name: str
    params: tuple[Param, ...]


def run_driver(so: Path, *extra: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Runs cudasim.driver on the harness build `so` in a subprocess (its own process, so a sanitizer's
    preload or a crash stays there); returns what it said."""
    env = dict(env or os.environ)
    tests = HERE.parent
    env["PYTHONPATH"] = os.pathsep.join([str(tests), str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "cudasim.driver", str(so), *extra], capture_output=True, text=True,
                          env=env, cwd=tests, timeout=timeout)


_LOADED: dict[Path, "Sim"] = {}


def load(sources: list[Path] | None = None, **kw) -> "Sim":
    so = build(sources, **kw)
    if so not in _LOADED:
        _LOADED[so] = Sim(so)
    return _LOADED[so]


class Sim:
    """A loaded wsim build: its kernels by name and their launches."""

    def __init__(self, path: Path):
        self.path = path
        lib = self.lib = ctypes.CDLL(str(path))
        lib.wsim_kernel_name.restype = ctypes.c_char_p
        lib.wsim_launch.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                    ctypes.c_ulonglong, ctypes.c_char_p, ctypes.c_int]
        lib.wsim_alloc.restype = ctypes.c_void_p
        lib.wsim_alloc.argtypes = [ctypes.c_size_t, ctypes.c_uint, ctypes.c_ulonglong]
        lib.wsim_free.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong]
        self.sanitized = bool(lib.wsim_sanitized())
        self.kernels: dict[str, Kernel] = {}
        q = (ctypes.c_int * 4)()
        for k in range(lib.wsim_kernel_count()):
            params = []
            for p in range(lib.wsim_kernel_nparams(k)):
                lib.wsim_kernel_param(k, p, q)
                params.append(Param(q[0], bool(q[1]), q[2], bool(q[3])))
            name = lib.wsim_kernel_name(k).decode()
            self.kernels[name] = Kernel(k, name, tuple(params))

    def launch(self, name: str, grid, block, args, schedule: str = "forward", seed: int = 0) -> None:
        """Run kernel `name` over grid x block threads (ints or 3-tuples); raise SimError on any fault."""
        k = self.kernels.get(name)
        if k is None:
            raise SimError(f"no kernel named {name!r} in {self.path.name}")
        if len(args) != len(k.params):
            raise SimError(f"{name} takes {len(k.params)} arguments, got {len(args)}")
        grid3, block3 = (ctypes.c_uint * 3)(*_dim3(grid)), (ctypes.c_uint * 3)(*_dim3(block))
        storage = (ctypes.c_uint64 * max(1, len(args)))()
        argv = (ctypes.c_void_p * max(1, len(args)))()
        bufs = []  # (position, array, device address, junk seed, original bytes of a const argument)
        try:
            for i, (a, p) in enumerate(zip(args, k.params)):
                storage[i] = self._marshal(name, i, a, p, bufs, seed)
                argv[i] = ctypes.addressof(storage) + 8 * i
            _no_overlap(name, [(i, a) for i, a, *_ in bufs])
            msg = ctypes.create_string_buffer(4096)
            rc = self.lib.wsim_launch(k.index, grid3, block3, argv, SCHEDULES[schedule], seed, msg, len(msg))
        finally:
            problems = self._release(name, k, bufs)
        if rc:
            raise SimError(f"{name} ({schedule} schedule): {msg.value.decode(errors='replace')}")
        if problems:
            raise SimError(f"{name} ({schedule} schedule): " + "; ".join(problems))

    def _marshal(self, name, i, a, p: Param, bufs, seed) -> int:
        where = f"{name} argument {i}"
        if p.is_ptr:
            if type(a) is np.uint64:  # a raw device address, or NULL
                return int(a)
            if not isinstance(a, np.ndarray):
                raise SimError(f"{where}: a pointer parameter takes an array or np.uint64, got {type(a).__name__}")
            if not a.flags.c_contiguous:
                raise SimError(f"{where}: the array is not contiguous")
            if a.ctypes.data % a.dtype.itemsize:
                raise SimError(f"{where}: {a.dtype} data at an address that is not a multiple of "
                               f"{a.dtype.itemsize} (a GPU faults on the misaligned access)")
            if a.dtype.itemsize != p.pointee:
                raise SimError(f"{where}: {a.dtype} elements ({a.dtype.itemsize} bytes) for a pointer to "
                               f"{p.pointee}-byte values")
            if not p.is_const and not a.flags.writeable:
                raise SimError(f"{where}: a read-only array for a non-const pointer")
            jseed = (seed * 1_000_003 + i * 7919 + 17) & (2**63 - 1)
            dev = self.lib.wsim_alloc(a.nbytes, a.ctypes.data % 16, jseed)
            if not dev:
                raise MemoryError(f"{where}: cannot map {a.nbytes} bytes")
            ctypes.memmove(dev, a.ctypes.data, a.nbytes)
            bufs.append((i, a, dev, jseed, a.tobytes() if p.is_const else None))
            return dev
        if isinstance(a, np.ndarray) or not isinstance(a, np.generic):
            raise SimError(f"{where}: a {p.size}-byte scalar parameter takes a numpy scalar (cupy sizes Python "
                           f"ints its own way), got {type(a).__name__}")
        if a.dtype.itemsize != p.size:
            raise SimError(f"{where}: a {a.dtype} ({a.dtype.itemsize} bytes) for a {p.size}-byte parameter")
        return int.from_bytes(a.tobytes().ljust(8, b"\0"), "little")

    def _release(self, name, k: Kernel, bufs) -> list[str]:
        problems = []
        for i, a, dev, jseed, const_bytes in bufs:
            if const_bytes is None:
                ctypes.memmove(a.ctypes.data, dev, a.nbytes)
            elif ctypes.string_at(dev, a.nbytes) != const_bytes:
                problems.append(f"argument {i} is const but the kernel wrote to it")
            r = self.lib.wsim_free(dev, jseed)
            if r == 1:
                problems.append(f"the kernel wrote before the start of argument {i}")
            elif r == 2:
                problems.append(f"the kernel wrote past the end of argument {i} ({a.nbytes} bytes)")
        return problems


def _dim3(x) -> tuple[int, int, int]:
    t = (int(x),) if np.isscalar(x) else tuple(int(v) for v in x)
    return (t + (1, 1, 1))[:3]


def _no_overlap(name: str, arrays) -> None:
    spans = sorted((a.ctypes.data, a.ctypes.data + a.nbytes, i) for i, a in arrays if a.nbytes)
    for (s0, e0, i0), (s1, _, i1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise SimError(f"{name}: arguments {i0} and {i1} overlap in memory")


class JunkNumpy:
    """numpy as device memory: `empty` hands out junk as cudaMalloc does, so output nobody wrote
    shows; an array not aligned to its element size can only be host memory, so asarray and
    ascontiguousarray copy it (cupy's host-to-device copy lands aligned, too)."""

    def __init__(self, seed: int = 0):
        self._rng = np.random.default_rng(seed)

    def __getattr__(self, name):
        return getattr(np, name)

    def asarray(self, a, dtype=None):
        a = np.asarray(a, dtype=dtype)
        return a if a.flags.aligned else a.copy()

    def ascontiguousarray(self, a, dtype=None):
        a = np.ascontiguousarray(a, dtype=dtype)
        return a if a.flags.aligned else a.copy()

    def empty(self, shape, dtype=float, order="C"):
        a = np.empty(shape, dtype=dtype, order=order)
        if a.nbytes:
            a.reshape(-1).view(np.uint8)[:] = self._rng.integers(0, 256, size=a.nbytes, dtype=np.uint8)
        return a


class SimRuntime:
    """The runtime wsync.backends.cuda._Launcher drives, with wsim in place of cupy: numpy arrays
    are device memory, launches run every thread of the real kernels on fibers under one schedule."""

    def __init__(self, sim: Sim, schedule: str = "forward", seed: int = 0):
        from wsync.backends import cuda

        self.sim, self.schedule, self.seed = sim, schedule, seed
        self.block = cuda.NT
        self.xp = JunkNumpy(seed)
        self.launched: list[str] = []
        self.blocks: list[int] = []  # threads per block of each launch

    def launch(self, name: str, grid: int, args: tuple, block: int | None = None) -> None:
        self.launched.append(name)
        self.blocks.append(block or self.block)
        self.sim.launch(name, grid, block or self.block, args, self.schedule, self.seed * 7919 + len(self.launched))

    @staticmethod
    def to_host(x) -> np.ndarray:
        return np.array(x, copy=True)

    @staticmethod
    def ptr(x) -> int:
        return x.ctypes.data
