"""Check wsync's vLLM / SGLang adapters against the frameworks' released source, and refresh the snapshot.

    python scripts/check_engine_signatures.py                       # our calls vs the kept snapshot
    python scripts/check_engine_signatures.py --download --write    # fetch the newest wheels (no deps), re-snapshot
    python scripts/check_engine_signatures.py --wheel vllm-0.33.0-*.whl --wheel sglang-0.5.23-*.whl

Wheels are fetched with `pip download <pkg>[==ver] --no-deps` and read as zip files: nothing is installed or
imported. The snapshot (wsync/engines/signatures.json) keeps only the signatures our adapters use.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from wsync.engines import signatures as S  # noqa: E402

PACKAGES = {"vllm": "vllm", "sglang": "sglang"}


def download(pkg: str, version: str | None, into: str) -> str:
    spec = f"{pkg}=={version}" if version else pkg
    subprocess.run([sys.executable, "-m", "pip", "download", spec, "--no-deps", "-d", into, "-q"], check=True)
    return sorted(glob.glob(os.path.join(into, f"{pkg}-*.whl")))[-1]


def snapshot_of(pkg: str, wheel: str) -> dict:
    version = re.match(rf"{pkg}-([^-]+)-", os.path.basename(wheel)).group(1)
    sha = hashlib.sha256(open(wheel, "rb").read()).hexdigest()
    return {"version": version, "source": f"PyPI wheel {os.path.basename(wheel)} (sha256 {sha}), read with ast by "
                                          "scripts/check_engine_signatures.py", "signatures": S.read_wheel(wheel, S.targets()[pkg])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheel", action="append", default=[], help="a vllm or sglang wheel to read")
    ap.add_argument("--download", action="store_true", help="pip download the wheels (--no-deps)")
    ap.add_argument("--vllm-version"), ap.add_argument("--sglang-version")
    ap.add_argument("--write", action="store_true", help="replace the snapshot with what the wheels say")
    args = ap.parse_args()
    snap = S.load_snapshot()
    wheels = {pkg: w for w in args.wheel for pkg in PACKAGES if os.path.basename(w).startswith(pkg + "-")}
    with tempfile.TemporaryDirectory() as tmp:
        if args.download:
            for pkg in PACKAGES:
                wheels.setdefault(pkg, download(pkg, getattr(args, f"{pkg}_version"), tmp))
        for pkg, wheel in wheels.items():
            fresh = snapshot_of(pkg, wheel)
            if fresh["signatures"] != snap[pkg]["signatures"]:
                print(f"{pkg} {fresh['version']}: signatures differ from the snapshot ({snap[pkg]['version']})")
            snap[pkg] = fresh
    problems = S.check(snap)
    for p in problems:
        print("MISMATCH", p)
    if args.write and not problems:
        S.SNAPSHOT.write_text(json.dumps(snap, indent=1, sort_keys=True) + "\n")
        print(f"wrote {S.SNAPSHOT}")
    print("ok" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
