"""A fake CUDA runtime for wsync.backends.cuda.CudaKernels: devices, streams, events, a log, and a race check.

The kernels run for real (on the wsim harness, so results are real bytes);
what is faked is the asynchrony around them. Every launch, event, wait, sync,
record_stream and host read is logged with its device and stream, and every
read of device memory (a host copy, or a kernel's const argument) is checked
against the launches that wrote that memory: the read must be on the writer's
stream, or after an event on it that the host synchronized or the reader's
stream waited for. Otherwise it raises StreamRace, which on a GPU would have
been a read of half-written sections. A kernel launched on one device with an
array of another raises DeviceMismatch.

Tensors are FakeTensor (what a torch CUDA tensor shows CudaKernels: device,
dtype, shape, contiguity); device arrays are DevArray (numpy, with a device
and a `get()` that goes through the race check, as cupy's does a copy).
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import numpy as np

from . import JunkNumpy, Sim


def _box(box) -> tuple:
    return tuple(slice(a, b) for a, b in box)


class StreamRace(AssertionError):
    pass


class DeviceMismatch(AssertionError):
    pass


@dataclass(frozen=True)
class FakeStream:
    device: int
    id: int  # 0: the device's legacy default (null) stream

    def __repr__(self):
        return f"stream{self.id}@cuda:{self.device}"


@dataclass
class FakeEvent:
    rt: "FakeRuntime"
    stream: FakeStream
    seq: int  # launches on the stream before the event
    knows: dict = field(default_factory=dict)  # what the stream had waited for by then (events are transitive)

    def synchronize(self) -> None:
        self.rt.log.append(("sync", self.stream, self.seq))
        done = self.rt.host_done
        done[self.stream] = max(done.get(self.stream, 0), self.seq)


@dataclass(frozen=True)
class FakeDevice:
    index: int
    type: str = "cuda"

    def __str__(self):
        return f"cuda:{self.index}"


class FakeTensor:
    """What CudaKernels sees of a torch CUDA tensor."""

    is_cuda = True

    def __init__(self, data: np.ndarray, device: int = 0, dtype=None, logical: str | None = None):
        self.data = np.ascontiguousarray(data)
        self.device = FakeDevice(device)
        self.dtype = np.dtype(dtype) if dtype is not None else self.data.dtype
        self.shape = self.data.shape
        self.logical = logical  # the wsync dtype it stands for (a bf16 tensor's data is its <u2 bit patterns)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def numel(self) -> int:
        return self.data.size

    def data_ptr(self) -> int:
        return self.data.__array_interface__["data"][0]

    def detach(self) -> "FakeTensor":
        return self

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, key: slice) -> "FakeTensor":
        """A view, as a slice of a torch tensor is (a payload's frame of a device body)."""
        out = FakeTensor(self.data[key], self.device.index, logical=self.logical)
        out.base = self  # a view keeps what it views alive
        return out

    def is_contiguous(self) -> bool:
        return True

    def element_size(self) -> int:
        return self.dtype.itemsize


class DevArray(np.ndarray):
    """A device array: numpy memory tagged with a device; get() is a checked device-to-host copy."""

    def __array_finalize__(self, obj):
        self.gpu = getattr(obj, "gpu", None)  # (numpy 2 has a read-only ndarray.device)
        self.rt = getattr(obj, "rt", None)
        if self.rt is not None and self.flags.owndata:  # fresh memory from an operator (x - y): no old writes
            self.rt.forget(self)

    def get(self) -> np.ndarray:
        return self.rt.read(self, "get()")

    @property
    def __cuda_array_interface__(self):  # what makes wsync treat it as device memory
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ctypes.data, False), "version": 3}


@dataclass
class _Write:
    lo: int
    hi: int
    stream: FakeStream
    seq: int
    kernel: str


class FakeXp(JunkNumpy):
    """numpy whose arrays land on the runtime's current device (a fresh allocation forgets old writes)."""

    def __init__(self, rt: "FakeRuntime", seed: int = 0):
        super().__init__(seed)
        self._rt = rt

    def __getattr__(self, name):
        fn = getattr(np, name)
        if not callable(fn):
            return fn
        return lambda *a, **k: self._rt.adopt(fn(*a, **k))

    def empty(self, *a, **k):
        return self._rt.adopt(super().empty(*a, **k))

    def asarray(self, a, dtype=None):
        if isinstance(a, DevArray) and (dtype is None or np.dtype(dtype) == a.dtype):
            return a
        out = self._rt.adopt(np.array(a, dtype=dtype, copy=True))
        if not isinstance(a, DevArray):  # a host-to-device copy
            self._rt.crossed["h2d"] += out.nbytes
        return out

    def ascontiguousarray(self, a, dtype=None):
        if isinstance(a, DevArray) and a.flags.c_contiguous and (dtype is None or np.dtype(dtype) == a.dtype):
            return a
        return self.asarray(np.ascontiguousarray(a, dtype=dtype))


class FakeRuntime:
    """The runtime interface of CudaKernels (see _CupyRuntime), over wsim, with streams faked and checked."""

    def __init__(self, sim: Sim, ndevices: int = 2, block: int = 256):
        self.sim, self.block, self.ndevices = sim, block, ndevices
        self.xp = FakeXp(self)
        self._local = threading.local()  # cupy's current device and stream are per thread, as on a GPU
        self._lock = threading.RLock()  # one launch, copy or check at a time: the fibers and the log are shared
        self.torch_current = {d: FakeStream(d, 0) for d in range(ndevices)}  # torch.cuda.current_stream(d)
        self.crossed = {"d2h": 0, "h2d": 0}  # bytes copied between device and host, whoever asked
        self.seq: dict[FakeStream, int] = {}
        self.host_done: dict[FakeStream, int] = {}
        self.waited: dict[tuple[FakeStream, FakeStream], int] = {}
        self.writes: list[_Write] = []
        self.log: list[tuple] = []
        self._next_stream = 1

    @property
    def device(self) -> int:  # cupy's current device (this thread's)
        return getattr(self._local, "device", 0)

    @device.setter
    def device(self, d: int) -> None:
        self._local.device = d

    @property
    def current(self) -> FakeStream:  # cupy's current stream (this thread's)
        return getattr(self._local, "current", None) or FakeStream(self.device, 0)

    @current.setter
    def current(self, s: FakeStream) -> None:
        self._local.current = s

    # ---- what tests do ---------------------------------------------------------------------

    def new_stream(self, device: int = 0) -> FakeStream:
        self._next_stream += 1
        return FakeStream(device, self._next_stream)

    @contextlib.contextmanager
    def torch_stream(self, s: FakeStream):
        """`with torch.cuda.stream(s)`: torch's current stream on s's device."""
        old = self.torch_current[s.device]
        self.torch_current[s.device] = s
        try:
            yield
        finally:
            self.torch_current[s.device] = old

    @contextlib.contextmanager
    def cupy_stream(self, s: FakeStream):
        """`with cupy.cuda.Device(d), stream:` what a transport reading on its own stream does."""
        old = (self.device, self.current)
        self.device, self.current = s.device, s
        try:
            yield
        finally:
            self.device, self.current = old

    def launches(self) -> list[tuple]:
        return [e for e in self.log if e[0] == "launch"]

    # ---- the runtime interface -------------------------------------------------------------

    def launch(self, name: str, grid: int, args: tuple, block: int | None = None) -> None:
        with self._lock:
            self._launch(name, grid, args, block)

    def _launch(self, name: str, grid: int, args: tuple, block: int | None = None) -> None:
        k = self.sim.kernels[name]
        for i, (a, p) in enumerate(zip(args, k.params)):
            if isinstance(a, np.ndarray):
                dev = getattr(a, "gpu", None)
                if dev is not None and dev != self.device:
                    raise DeviceMismatch(f"{name} launched on cuda:{self.device} with argument {i} on cuda:{dev}")
                if p.is_const:
                    self._check_read(a, self.current, f"{name} argument {i}")
        seq = self.seq.get(self.current, 0) + 1
        self.seq[self.current] = seq
        self.log.append(("launch", name, self.device, self.current))
        self.sim.launch(name, grid, block or self.block, args)
        for a, p in zip(args, k.params):
            if isinstance(a, np.ndarray) and p.is_ptr and not p.is_const and a.nbytes:
                lo = a.ctypes.data
                self.writes.append(_Write(lo, lo + a.nbytes, self.current, seq, name))

    def to_host(self, x) -> np.ndarray:
        return self.read(x, "to_host")

    @staticmethod
    def ptr(x) -> int:
        return x.ctypes.data

    def bits(self, t, bytes_only: bool = False):
        if not isinstance(t, FakeTensor):
            raise TypeError(f"expected a FakeTensor, got {type(t).__name__}")
        x = t.data.reshape(-1).view(np.uint8).view(DevArray)
        x.gpu, x.rt = t.device.index, self
        if bytes_only:
            return x
        from wsync.backends.cuda import width_name

        width_name(t.dtype)  # as the real runtime's bits() refuses widths the kernels lack
        return x.view(f"<u{t.dtype.itemsize}")

    def device_of(self, t) -> int:
        return t.device.index if isinstance(t, FakeTensor) else t.gpu

    def dtype_of(self, t):
        from wsync import dtypes

        if t.logical is None:
            raise TypeError("a FakeTensor standing for a model tensor needs logical= (its wsync dtype)")
        return dtypes.by_name(t.logical)

    def empty_tensor(self, numel: int, dtype, device: int, shape: tuple | None = None) -> FakeTensor:
        with self._lock:
            data = self.xp.empty(numel, dtype.bits_dtype)  # junk-filled, as fresh device memory is
        data = np.asarray(data).view(np.ndarray)
        return FakeTensor(data.reshape(shape) if shape is not None else data, device, logical=dtype.name)

    def copy_box(self, dst: FakeTensor, src: FakeTensor, box) -> None:
        self._same_device("copy_box", dst, src)
        with self._lock:
            dst.data[...] = src.data[_box(box)]

    def write_box(self, dst: FakeTensor, box, src: FakeTensor) -> None:
        self._same_device("write_box", dst, src)
        with self._lock:
            dst.data[_box(box)] = src.data.reshape(dst.data[_box(box)].shape)

    def gather_boxes(self, flat: FakeTensor, pairs) -> None:
        self._same_device("gather_boxes", flat, *(t for t, _ in pairs))
        with self._lock:
            at, out = 0, flat.data.reshape(-1)
            for t, box in pairs:
                v = t.data if box is None else t.data[_box(box)]
                out[at : at + v.size] = v.reshape(-1)
                at += v.size

    def _same_device(self, what: str, *tensors) -> None:
        """As torch's copies: every tensor on the current device."""
        for t in tensors:
            if t.device.index != self.device:
                raise DeviceMismatch(f"{what} on cuda:{self.device} with a tensor on cuda:{t.device.index}")

    def gather(self, flat: FakeTensor, tensors) -> None:
        self._copies(flat, tensors, into_flat=True)

    def scatter(self, flat: FakeTensor, tensors) -> None:
        self._copies(flat, tensors, into_flat=False)

    def _copies(self, flat: FakeTensor, tensors, into_flat: bool) -> None:
        """Device-to-device copies on the current stream: devices must match, as torch's copy_ would need."""
        with self._lock:
            at = 0
            for t in tensors:
                if t.device.index != flat.device.index or t.device.index != self.device:
                    raise DeviceMismatch(f"a copy on cuda:{self.device} between cuda:{flat.device.index} and "
                                         f"cuda:{t.device.index}")
                n = t.data.size
                piece = flat.data.reshape(-1)[at : at + n]
                if into_flat:
                    piece[:] = t.data.reshape(-1)
                else:
                    t.data.reshape(-1)[:] = piece
                at += n
            self.log.append(("copy", "gather" if into_flat else "scatter", self.current, at))

    @contextlib.contextmanager
    def stream_of(self, t):
        dev = self.device_of(t)
        old = (self.device, self.current)
        self.device, self.current = dev, self.torch_current[dev]
        try:
            yield
        finally:
            self.device, self.current = old

    def record_event(self) -> FakeEvent:
        knows = {x: seq for (r, x), seq in self.waited.items() if r == self.current}
        ev = FakeEvent(self, self.current, self.seq.get(self.current, 0), knows)
        self.log.append(("event", self.current, ev.seq))
        return ev

    def wait(self, stream: FakeStream, ev: FakeEvent) -> None:
        self.log.append(("wait", stream, ev.stream, ev.seq))
        for x, seq in [(ev.stream, ev.seq), *ev.knows.items()]:
            self.waited[(stream, x)] = max(self.waited.get((stream, x), 0), seq)

    def wait_current(self, ev: FakeEvent) -> None:
        self.wait(self.current, ev)

    def record_stream(self, array, stream: FakeStream) -> None:
        self.log.append(("record_stream", array.ctypes.data, array.nbytes, stream))

    # ---- the checks --------------------------------------------------------------------------

    def adopt(self, x):
        """A new array on the current device: forget writes to memory it now occupies."""
        if not isinstance(x, np.ndarray):
            return x
        if not isinstance(x, DevArray):
            x = x.view(DevArray)
        x.gpu, x.rt = self.device, self
        self.forget(x)
        return x

    def forget(self, x) -> None:
        """x's memory is newly allocated: writes once made to memory at its addresses no longer count."""
        lo, hi = x.ctypes.data, x.ctypes.data + x.nbytes
        with self._lock:
            self.writes = [w for w in self.writes if w.hi <= lo or w.lo >= hi]

    def read(self, x, what: str) -> np.ndarray:
        with self._lock:
            self.log.append(("read", what, self.current, x.nbytes))
            self._check_read(x, self.current, what)
            self.crossed["d2h"] += x.nbytes
            return np.array(x, copy=True).view(np.ndarray)

    def _check_read(self, x, reader: FakeStream, what: str) -> None:
        lo, hi = x.ctypes.data, x.ctypes.data + x.nbytes
        for w in self.writes:
            if w.hi <= lo or w.lo >= hi or w.stream == reader:
                continue
            if self.host_done.get(w.stream, 0) >= w.seq or self.waited.get((reader, w.stream), 0) >= w.seq:
                continue
            raise StreamRace(f"{what} on {reader} reads memory that {w.kernel} (launch {w.seq} on {w.stream}) "
                             "writes, with no event synchronized or waited for in between")
