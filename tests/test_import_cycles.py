"""scripts/import_cycles.py: the checkout has no import circles, and a circle (a deferred import included) fails."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "import_cycles.py"


def check(root=None):
    args = [sys.executable, str(SCRIPT)] + ([str(root)] if root else [])
    return subprocess.run(args, capture_output=True, text=True, timeout=60)


def write(root, files):
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_the_checkout_has_no_import_cycles():
    r = check()
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_cycle_through_a_deferred_relative_import_is_reported_with_its_lines(tmp_path):
    write(tmp_path, {
        "wsync/__init__.py": "",
        "wsync/a.py": "from .b import x\n",
        "wsync/b.py": "x = 1\n\ndef f():\n    from . import a\n",
        "wsync/c.py": "from wsync import a\n",  # imports into the circle, is not part of it
    })
    r = check(tmp_path)
    assert r.returncode == 1
    assert "wsync.a, wsync.b" in r.stdout and "wsync.c" not in r.stdout
    assert "wsync/a.py:1" in r.stdout and "wsync/b.py:4" in r.stdout


def test_a_package_importing_its_own_children_is_not_a_cycle(tmp_path):
    write(tmp_path, {
        "trainer/__init__.py": "from .loop import run\n",
        "trainer/loop.py": "from .task import sample\n\ndef run():\n    pass\n",
        "trainer/task.py": "from . import sample_size\nsample = 1\n",
        "trainer/sample_size.py": "n = 4\n",
    })
    assert check(tmp_path).returncode == 0
    # edges from a package's __init__ to its own modules are left out, so only the children's circle counts
    write(tmp_path, {"trainer/task.py": "from .loop import run\nsample = 1\n"})
    r = check(tmp_path)
    assert r.returncode == 1 and "trainer.loop, trainer.task" in r.stdout


def test_two_subpackages_importing_each_other_are_a_cycle_though_no_two_modules_are(tmp_path):
    write(tmp_path, {
        "wsync/__init__.py": "",
        "wsync/shadow.py": "x = 1\n",
        "wsync/engines/__init__.py": "",
        "wsync/engines/vllm_shard.py": "def f():\n    from ..shard.route import route\n",
        "wsync/shard/__init__.py": "",
        "wsync/shard/route.py": "route = 1\n",
        "wsync/shard/stage.py": "from ..engines.shadow import x\n",
        "wsync/engines/shadow.py": "x = 1\n",
    })
    r = check(tmp_path)
    assert r.returncode == 1
    assert "import cycle among 2 packages: wsync.engines, wsync.shard" in r.stdout
    assert "wsync/engines/vllm_shard.py:2" in r.stdout and "wsync/shard/stage.py:1" in r.stdout
    assert "among 2 modules" not in r.stdout  # no module imports one that imports it back
    # the host-state type below both packages: the circle is gone
    write(tmp_path, {"wsync/shard/stage.py": "from ..shadow import x\n"})
    assert check(tmp_path).returncode == 0
