"""A CPU platform for verl 0.9.1, which ships CUDA, NPU and ROCm ones only (and falls back to CUDA).

Registered through verl's own plugin hook (``PlatformRegistry.register``), loaded in every Ray worker
by ``VERL_USE_EXTERNAL_MODULES=verl_cpu_platform`` and chosen by ``VERL_PLATFORM=cpu``: verl's FSDP
engine then places tensors on "cpu" and its process groups use gloo. Used by tests/test_verl_real.py.
"""
import os
from contextlib import nullcontext

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry


class HostDevice:
    """torch.cpu plus the memory calls verl makes on torch.cuda (the host keeps no allocator cache: zeros)."""

    _ZERO = ("memory_reserved", "memory_allocated", "max_memory_allocated", "max_memory_reserved")
    _NOOP = ("empty_cache", "reset_peak_memory_stats", "ipc_collect", "set_device")

    def __getattr__(self, name):
        if name in self._ZERO:
            return lambda *a, **k: 0
        if name in self._NOOP:
            return lambda *a, **k: None
        if name == "is_available":
            return lambda: True
        if name == "mem_get_info":  # (free, total) bytes, as torch.cuda.mem_get_info
            return lambda *a, **k: (os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"),
                                    os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        return getattr(torch.cpu, name)


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    device_name = "cpu"
    vendor_name = "cpu"
    device_module = HostDevice()

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return True

    def current_device(self):
        return torch.device("cpu")  # verl passes it to .to(): an index would mean the first accelerator

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"  # nothing to hide on CPU; verl reads it only when set

    def nvtx_range(self, msg: str):
        return nullcontext()

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None
