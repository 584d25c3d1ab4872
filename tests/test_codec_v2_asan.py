"""Delta v2's C++ kernels under AddressSanitizer: mutated payloads never read or write out of bounds.

The extension is rebuilt with -fsanitize=address (asan_helpers.asan_build) once per test session.
tests/asan_driver_v2.py runs honest and mutated cases against it in a subprocess, beside the reference; the
seeded corpus (tests/fuzz/make_v2_corpus.py) is replayed on it through the planes and the portable code,
and must get the answers the plain build gives (test_codec_v2_corpus.py checks those against the reference).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asan_helpers import run_driver

pytestmark = pytest.mark.build  # ASan/UBSan builds: the `build` tier, not the default run
CASES = 120  # each case runs every width's encoder and decoder, honest and mutated
ROOT = Path(__file__).resolve().parent.parent
FUZZ = ROOT / "tests" / "fuzz"


def test_v2_cases_under_asan(asan_extension):
    run_driver("asan_driver_v2.py", *asan_extension, CASES, 3)


def _replay(corpus: Path, out: Path, env: dict, *module) -> list:
    r = subprocess.run([sys.executable, str(FUZZ / "replay_v2_corpus.py"), str(corpus), str(out), "cpu", *module],
                       capture_output=True, text=True, env=env, timeout=600)
    assert "AddressSanitizer" not in r.stderr, r.stderr[-5000:]
    assert r.returncode == 0, r.stderr[-5000:]
    return json.loads(out.read_text())["outcomes"]


def test_v2_corpus_under_asan(asan_extension, tmp_path):
    sys.path.insert(0, str(FUZZ))
    import make_v2_corpus

    so, env = asan_extension
    want = make_v2_corpus.checked_in()
    corpus = tmp_path / "corpus.bin"
    corpus.write_bytes(make_v2_corpus.build(int(want["seed"]), int(want["subjects"]), int(want["per_subject"]))[0])
    plain_env = {k: v for k, v in os.environ.items() if k not in ("WSYNC_V2_PORTABLE", "WSYNC_NO_AVX2")}
    plain_env["PYTHONPATH"] = env["PYTHONPATH"]
    plain = _replay(corpus, tmp_path / "plain.json", plain_env)
    for switches in ({}, {"WSYNC_V2_PORTABLE": "1"}):
        run_env = {k: v for k, v in env.items() if k not in ("WSYNC_V2_PORTABLE", "WSYNC_NO_AVX2")} | switches
        got = _replay(corpus, tmp_path / "asan.json", run_env, "--module", str(so))
        assert got == plain, (switches, next(i for i, (a, b) in enumerate(zip(got, plain)) if a != b))
