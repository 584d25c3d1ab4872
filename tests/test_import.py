"""`import wsync` must work on a bare CPU machine: no cupy, ucxx, vllm, sglang, not even torch."""
from __future__ import annotations

import subprocess
import sys
import textwrap


def test_import_with_heavy_dependencies_blocked():
    code = textwrap.dedent(
        """
        import sys
        BLOCKED = ("cupy", "ucxx", "ucp", "vllm", "sglang", "torch", "transformers", "peft")
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"{name} is blocked in this test")
        sys.meta_path.insert(0, Block())
        import numpy as np
        import wsync
        print(wsync.backend())
        base = {"w": np.arange(1000, dtype=np.float32)}
        new = {"w": base["w"] + np.float32(1)}
        out = wsync.apply(base, wsync.encode(base, new))
        assert out["w"].tobytes() == new["w"].tobytes()
        assert not any(m.split(".")[0] in BLOCKED for m in sys.modules), sorted(sys.modules)
        print("ok")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("ok")
