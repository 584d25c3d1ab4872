"""Names the machine a run happened on: every saved measurement carries this, so a number is never read
without the CPU, cores and codec backend that produced it."""
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
    from .backends import backend

    info["wsync_backend"] = str(backend())
    return info
