"""torch is a tested range, not one version (docs/torch-versions.md): pyproject.toml declares it,
it holds the torch CI tests (the installed one) and the oldest one checked (2.11), the lines
that tell a user which torch to use name it, README says the same, and installing the project
keeps the installed torch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

from rayhybrid.errors import TESTED_TORCH
from tests.distributed import run_ranks, v_warmup_peers

REPO = Path(__file__).resolve().parents[1]
OLDEST_CHECKED = "2.11.0"  # scripts/check_torch.sh 2.11: see docs/torch-versions.md


def requirements() -> list[Requirement]:
    """Every requirement pyproject.toml lists: the dependencies and every extra's."""
    text = (REPO / "pyproject.toml").read_text()
    return [
        Requirement(r)
        for r in re.findall(r'^\s*"([A-Za-z][^"]*)",', text, re.MULTILINE)
        if not r.startswith("rayhybrid")
    ]


def declared() -> Requirement:
    (torch_req,) = [r for r in requirements() if r.name == "torch"]
    return torch_req


def test_the_range_holds_the_installed_torch_and_the_oldest_checked():
    spec = declared().specifier
    installed = Version(torch.__version__).base_version  # 2.13.0+cpu: 2.13.0
    assert installed in spec and OLDEST_CHECKED in spec, (str(spec), torch.__version__)
    assert not any(s.operator in ("==", "===") for s in spec), spec  # a range, never one version


def test_one_requirement_names_torch_and_the_messages_name_it():
    """No other dependency or extra pins torch (nor torchvision, which would), and the lines
    that say which torch to use (`TESTED_TORCH`) quote pyproject's requirement."""
    assert [r.name for r in requirements() if r.name in ("torch", "torchvision", "torchaudio")] == ["torch"]
    assert Requirement(TESTED_TORCH).specifier == declared().specifier


def test_readme_and_the_docs_state_the_declared_range():
    """README's requirements say 'PyTorch <oldest> to <newest>' (the minors the range spans) and
    docs/torch-versions.md quotes the requirement; nothing says 'use torch==<one version>'."""
    spec = declared().specifier
    (low,) = [Version(s.version) for s in spec if s.operator == ">="]
    (high,) = [Version(s.version) for s in spec if s.operator == "<"]
    newest = f"{high.major}.{high.minor - 1}"
    assert f"PyTorch {low.major}.{low.minor} to {newest} " in (REPO / "README.md").read_text()
    assert f"`{TESTED_TORCH}`" in (REPO / "docs" / "torch-versions.md").read_text()
    pinned = [
        str(path.relative_to(REPO))
        for pattern in ("rayhybrid/**/*.py", "docs/*.md", "README.md", "examples/**/*.*", "scripts/*")
        for path in REPO.glob(pattern)
        if path.is_file() and re.search(r"torch==\d", path.read_text())
    ]
    assert pinned == [], pinned


def test_installing_the_project_keeps_the_installed_torch(tmp_path):
    """What `pip install '.[test]'` (CI) needs, every requirement pyproject.toml lists, resolved
    against this environment (`--dry-run`): pip would install no torch (nor anything built on
    one) over the installed one."""
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report)]
        + [str(r) for r in requirements()],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    installs = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert not [name for name in installs if name.startswith("torch")], installs


@pytest.mark.slow  # Ray or several processes; see the quick tier in README.md
def test_a_v_schedules_warm_up_sends_nothing_to_its_own_rank():
    """zbv puts neighbouring stages on one rank; torch 2.11 warms a pipeline up with a message
    to each neighbour, which gloo cannot send to its own rank. rayhybrid's stages leave those
    out (torch 2.13 never asks for these messages: this checks the stages' answer)."""
    assert run_ranks(v_warmup_peers, 2) == [[1, 1, 1, 1], [0, 0, 0, 0]]
