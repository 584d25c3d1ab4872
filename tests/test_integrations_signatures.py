"""Our integrations against the frameworks' published code (signatures.json: verl 0.9.1, trl 1.16.0 and
openrlhf 0.11.2 wheels, slime and prime-rl source at the commits named there), and import lightness."""
import copy
import json
import subprocess
import sys

import pytest

from wsync.integrations import signatures


def test_every_call_and_override_fits_the_published_source():
    assert signatures.check() == []


def test_snapshot_names_versions_and_has_every_signature():
    snap = json.loads(signatures.SNAPSHOT.read_text())
    assert set(snap) == set(signatures.MODULES)
    for pkg, entry in snap.items():
        assert entry["version"] and entry["source"]
        calls, overrides = signatures.lists(pkg)
        assert all(entry["signatures"].get(f"{m}:{q}") for m, q, *_ in calls)
        assert all(entry["signatures"].get(f"{m}:{q}") for m, q in overrides)


@pytest.mark.parametrize("pkg", sorted(signatures.MODULES))
def test_a_changed_framework_signature_is_caught(pkg):
    snap = json.loads(signatures.SNAPSHOT.read_text())
    bad = copy.deepcopy(snap)
    _, overrides = signatures.lists(pkg)
    module, qual = overrides[-1]
    bad[pkg]["signatures"][f"{module}:{qual}"].insert(1, {"name": "renamed", "kind": "POSITIONAL_OR_KEYWORD",
                                                          "default": False})
    assert any(qual in p for p in signatures.check(bad))


def test_importing_integrations_imports_no_framework():
    code = ("import sys, wsync.integrations.verl, wsync.integrations.trl, wsync.integrations.openrlhf, "
            "wsync.integrations.slime, wsync.integrations.prime_rl\n"
            "print(sorted(m for m in ('verl', 'trl', 'openrlhf', 'slime', 'prime_rl', 'ray', 'vllm', 'torch') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
