"""The suite's process leaves with pytest's exit status, before anything the interpreter's
finalization would run (tests/conftest.py `pytest_unconfigure`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CRASH_AT_EXIT = """
import atexit, os, signal

def test_one():
    atexit.register(os.kill, os.getpid(), signal.SIGSEGV)  # as a crash in the finalization would
    assert {outcome}
"""


@pytest.mark.parametrize(("outcome", "status"), [("True", 0), ("False", 1)])
def test_a_crash_after_the_report_does_not_change_the_exit_status(tmp_path, outcome, status):
    test = tmp_path / "test_crash.py"
    test.write_text(CRASH_AT_EXIT.format(outcome=outcome))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", str(test)]
    done = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == status, done.stdout + done.stderr
    assert ("1 passed" if status == 0 else "1 failed") in done.stdout
