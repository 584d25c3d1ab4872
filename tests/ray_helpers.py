"""The Ray tests' shared start: torch, transformers and ray, or a skip (a failure with WSYNC_REQUIRE_RAY=1)."""
from __future__ import annotations

import os

import pytest


def require_ray():
    """Call at module level; returns the ray module."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    try:
        import ray
    except ImportError:
        if os.environ.get("WSYNC_REQUIRE_RAY") == "1":
            pytest.fail("WSYNC_REQUIRE_RAY=1 but ray is not installed (pip install ray==2.60.0)", pytrace=False)
        pytest.skip("ray is not installed (pip install ray==2.60.0)", allow_module_level=True)
    return ray
