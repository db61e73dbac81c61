"""The suite's guard of the box-wide memory-tier root (tests/conftest.py): a test creating anything under
/dev/shm/trainguard fails, naming the path (tests left job folders there, `j`, `link`, `sleeper-<hash>`, `mn`,
one per run, for good)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent


def test_a_test_creating_a_folder_under_the_box_wide_root_fails_naming_it(tmp_path: Path) -> None:
    # The guarded root is a stand-in: the suite runs on several workers, and a folder made in the real one would fail
    # whichever test another worker ran meanwhile. The guard's code is the same for any root.
    box = tmp_path / "box-shm"
    name = f"tg-guard-test-{uuid.uuid4().hex[:10]}"
    made = os.path.join(box, name, "replicas")
    suite = tmp_path / "suite"
    suite.mkdir()
    shutil.copy(TESTS / "conftest.py", suite / "conftest.py")
    (suite / "test_litter.py").write_text(
        f"import os\n\ndef test_litters():\n    os.makedirs({made!r})\n\n\ndef test_clean(tmp_path):\n"
        "    (tmp_path / 'x').mkdir()\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite)],
                         cwd=suite, capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=str(TESTS),  # its tg_testutil
                                  TRAINGUARD_TEST_SHM_GUARD="1", TG_TEST_BOX_SHM_ROOT=str(box)))
    out = run.stdout + run.stderr
    # test_litters passes, then its teardown fails naming the path; test_clean (its own tmp_path) passes
    assert "2 passed, 1 error" in out and "ERROR test_litter.py::test_litters" in out, out
    assert f"'{made}'] under the box-wide memory-tier root {box}" in out, out


def test_a_session_started_inside_the_suite_uses_and_removes_a_root_of_its_own(tmp_path: Path) -> None:
    """Each session makes its memory-tier root and removes it at its end. A pytest started inside the suite (every
    pytest-xdist worker of `make test`, or this test's) inherited the root the outer conftest had put in the
    environment, used it, and removed an unused one of its own: each parallel run left its workers' shared root
    in /dev/shm for good."""
    outer = os.environ["TRAINGUARD_CHECKPOINT_SHM_DIR"]
    if not os.path.basename(outer).startswith("trainguard-test-session-"):
        import pytest

        pytest.skip("the memory-tier root was named by the user, not by the suite")
    suite = tmp_path / "suite"
    suite.mkdir()
    used = tmp_path / "used-root"
    shutil.copy(TESTS / "conftest.py", suite / "conftest.py")
    (suite / "test_inner.py").write_text(
        "import os\n\ndef test_uses_its_root():\n    root = os.environ['TRAINGUARD_CHECKPOINT_SHM_DIR']\n"
        f"    os.makedirs(os.path.join(root, 'job'))\n    open({str(used)!r}, 'w').write(root)\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite)],
                         cwd=suite, capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=str(TESTS)))
    assert "1 passed" in run.stdout + run.stderr, run.stdout + run.stderr
    inner = used.read_text()
    try:
        assert inner != outer, "the inner session used the outer session's root"
        assert not os.path.exists(inner), f"the inner session left its root {inner} behind"
    finally:
        if inner != outer:
            shutil.rmtree(inner, ignore_errors=True)
