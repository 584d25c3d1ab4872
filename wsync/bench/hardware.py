"""Names the machine a benchmark ran on; every saved result carries it."""
from __future__ import annotations

import os
import platform


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe() -> dict:
    import numpy as np

    info = {
        "host": platform.node(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "gpu": None,
    }
    try:
        import zstandard

        info["zstandard"] = zstandard.__version__
    except ImportError:
        pass
    from ..backends import backend

    info["wsync_backend"] = str(backend())
    return info


def one_line(info: dict) -> str:
    return f"{info['cpu']}, {info['cores']} cores, {info['gpu'] or 'no GPU'}, wsync backend {info['wsync_backend']}"
