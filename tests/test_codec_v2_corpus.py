"""The seeded v2 decoder corpus (tests/fuzz/make_v2_corpus.py) replayed against the reference and the C++ paths.

Every input must get one answer from every decoder: the same v1 sections, byte for byte, or a refusal with
the same WsyncError subclass that names the same chunk, and the same count error. The C++ decoder runs as the bit planes, the planes without AVX2 and the
portable code (each a process of its own: the switches are read once per process) and must give the same
messages as well; the reference words its own. Each decoder runs in a subprocess, so a crash is a failure
with the decoder named, not a lost test run.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FUZZ = ROOT / "tests" / "fuzz"
sys.path.insert(0, str(FUZZ))

import make_v2_corpus  # noqa: E402

API_EVERY = 7  # every 7th input also goes through wsync.apply_state as a whole payload
SWITCHES = ("WSYNC_V2_PORTABLE", "WSYNC_NO_AVX2")
DECODERS = {  # name: (replay's backend, the switches it runs with)
    "reference": ("ref", {}),
    "planes": ("cpu", {}),
    "planes without AVX2": ("cpu", {"WSYNC_NO_AVX2": "1"}),
    "portable": ("cpu", {"WSYNC_V2_PORTABLE": "1"}),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    want = make_v2_corpus.checked_in()
    blob, digest = make_v2_corpus.build(int(want["seed"]), int(want["subjects"]), int(want["per_subject"]))
    path = tmp_path_factory.mktemp("v2corpus") / "corpus.bin"
    path.write_bytes(blob)
    return path, digest, make_v2_corpus.unpack(blob)


@pytest.fixture(scope="module")
def replays(corpus):
    from wsync import backends
    from wsync.errors import BackendUnavailable

    try:
        backends.kernels("cpu")
    except BackendUnavailable as e:
        pytest.skip(str(e))
    path, _, _ = corpus
    procs = {}
    for name, (backend, switches) in DECODERS.items():
        env = {k: v for k, v in os.environ.items() if k not in SWITCHES}
        env.update(switches, PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
        out = path.with_name(f"{name.replace(' ', '_')}.json")
        cmd = [sys.executable, str(FUZZ / "replay_v2_corpus.py"), str(path), str(out), backend, "--api", str(API_EVERY)]
        procs[name] = (subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), out)
    got = {}
    for name, (p, out) in procs.items():
        log, _ = p.communicate(timeout=300)
        assert p.returncode == 0, f"the {name} decoder's replay died ({p.returncode}):\n{log[-5000:]}"
        got[name] = json.loads(out.read_text())
    return got


def test_the_corpus_is_the_checked_in_one(corpus):
    _, digest, cases = corpus
    want = make_v2_corpus.checked_in()
    assert (len(cases), digest) == (int(want["inputs"]), want["sha256"]), (
        "the corpus changed: the generator, the reference encoder or what they draw from did. If that was "
        "deliberate, replay the new corpus and run tests/fuzz/make_v2_corpus.py --update")


def _same(a: list, b: list, messages: bool) -> bool:
    """One answer: the same sections, or a refusal of the same type (and message, if asked)."""
    return a[0] == b[0] and (a[0] in ("decoded", "applied") or not messages or a[1] == b[1]) and \
        (a[0] not in ("decoded", "applied") or a[1] == b[1])


def _where(message: str) -> tuple:
    """The chunk a refusal names, and whether it is for more changes than the model declares: the C++
    decoder words its errors its own way, but names the chunk and the count the reference does."""
    chunk = re.search(r"v2 chunk \d+", message)
    return chunk and chunk.group(), "more changes than the model declares" in message


def _disagreements(cases, answers: dict, key: str) -> list:
    ref = answers["reference"][key]
    bad = []
    for i, case in enumerate(cases):
        row = {name: a[key][i] for name, a in answers.items()}
        for name, got in row.items():
            refusal = got[0] not in ("decoded", "applied")
            if refusal and not got[2]:
                bad.append((case.label, name, "not a WsyncError", got))
            if not _same(ref[i], got, messages=False):
                bad.append((case.label, name, "differs from the reference", got, ref[i]))
            elif refusal and _where(got[1]) != _where(ref[i][1]):
                bad.append((case.label, name, "another chunk or count than the reference's", got, ref[i]))
            if name != "reference" and not _same(row["planes"], got, messages=True):
                bad.append((case.label, name, "differs from the planes", got, row["planes"]))
    return bad


@pytest.mark.slow  # replays the whole corpus through every decoder, one process each
def test_every_decoder_gives_every_input_the_same_answer(corpus, replays):
    _, _, cases = corpus
    bad = _disagreements(cases, replays, "outcomes")
    assert not bad, f"{len(bad)} disagreements, the first: " + "\n".join(map(repr, bad[:10]))


@pytest.mark.slow
def test_the_corpus_reaches_decodes_refusals_and_both_paths(corpus, replays):
    _, _, cases = corpus
    ref = replays["reference"]["outcomes"]
    valid = [o for c, o in zip(cases, ref) if c.label.startswith("valid ")]
    assert valid and all(o[0] == "decoded" for o in valid)
    mutated = Counter(o[0] for c, o in zip(cases, ref) if not c.label.startswith("valid "))
    assert mutated["decoded"] >= 200 and mutated["FormatError"] >= 1000, mutated  # both sides of every check
    planes, portable = replays["planes"]["v2_paths"], replays["portable"]["v2_paths"]
    assert portable[0] == 0 and portable[1] > 0
    assert planes[1] > 0  # chunks no window holds take the portable code in the planes' process too
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists() and "popcnt" in cpuinfo.read_text():
        assert planes[0] > 0, "a CPU with popcnt ran no chunk on the planes"


@pytest.mark.slow
def test_payloads_with_recomputed_checksums_reach_the_decoder(corpus, replays):
    """Whole payloads through wsync.apply_state: the decoder's refusal comes through as it is, and what it
    decodes is applied, the same tensor on every decoder."""
    _, _, cases = corpus
    sample = cases[::API_EVERY]
    bad = _disagreements(sample, replays, "api")
    for name, a in replays.items():
        for case, parts, api in zip(sample, a["outcomes"][::API_EVERY], a["api"]):
            if "bytes of delta sections for a" in str(api):
                continue  # the manifest's own size rule refuses those before any decoder sees them
            refused_the_same = parts[0] == api[0] and api[1].endswith(": " + parts[1])  # the tensor's name first
            if (parts[0] == "decoded") != (api[0] == "applied") or (parts[0] != "decoded" and not refused_the_same):
                bad.append((case.label, name, "the API's answer is not the decoder's", api, parts))
    assert not bad, f"{len(bad)} disagreements, the first: " + "\n".join(map(repr, bad[:10]))
    assert Counter(o[0] for o in replays["reference"]["api"])["applied"] >= 50
