"""Regenerate the v2 golden vector (tests/golden/delta_v2.wsd) from make_golden's states.

Run only for a deliberate change of the delta-v2 format (wsync/codecs/v2_ref.py), with a format bump.

    python tests/golden/make_golden_v2.py
"""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).parent


def main() -> None:
    import wsync

    sys.path.insert(0, str(HERE))
    from make_golden import golden_states

    base, new = golden_states()
    wsync.encode(base, new, version=2, base_version=1, tier="v2", backend="ref").write(HERE / "delta_v2.wsd")
    print("wrote", HERE / "delta_v2.wsd")


if __name__ == "__main__":
    main()
