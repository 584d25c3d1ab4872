"""Planted bugs in the CUDA kernels must fail the harness: it cannot quietly become lenient.

Each mutant (tests/cudasim/mutants.py) is a text patch to a copy of csrc/,
built with the harness and run by tests/cudasim/driver.py in a process of its
own (a broken kernel may write anywhere). Every one must end the run with a
failure: a harness error (a rule of CUDA broken, a memory fault) or bytes that
differ from delta_ref. The AddressSanitizer run (test_cuda_sim_asan.py) covers
the over-read that only a byte-exact bounds check can see.
"""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

cudasim = pytest.importorskip("cudasim")
from cudasim.mutants import MUTANTS, apply  # noqa: E402


@pytest.fixture(scope="module")
def builds():
    if cudasim.compiler() is None:
        pytest.skip("no C++ compiler on PATH: the CUDA harness compiles with g++")
    with ThreadPoolExecutor(max_workers=2) as pool:  # two cores: two builds at a time
        sos = list(pool.map(lambda m: cudasim.build([apply(m)]), MUTANTS))
    return dict(zip((m.name for m in MUTANTS), sos))


@pytest.mark.build
def test_the_unmutated_kernels_pass_the_same_run():
    """The control: without a planted bug the quick run is clean, so a failure below is the mutant's."""
    if cudasim.compiler() is None:
        pytest.skip("no C++ compiler on PATH")
    r = cudasim.run_driver(cudasim.build([cudasim.CSRC / "delta_cuda.cu"]), "--mode", "quick")
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout[-3000:] + r.stderr[-3000:]


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
@pytest.mark.build
def test_mutant_is_caught(builds, mutant):
    r = cudasim.run_driver(builds[mutant.name], "--mode", "quick")
    assert r.returncode != 0, f"{mutant.name} ({mutant.why}) passed the harness:\n{r.stdout[-2000:]}"
    assert re.match(mutant.expect, r.stdout), f"{mutant.name}: not the failure expected:\n{r.stdout[-2000:]}{r.stderr[-3000:]}"


def test_every_patch_still_applies():
    from cudasim.mutants import ASAN_ONLY

    for m in MUTANTS + ASAN_ONLY:
        assert (cudasim.CSRC / m.file).read_text().count(m.old) == 1, m.name
