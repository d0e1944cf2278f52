"""docs/design.md stays true to the code it names. Every invariant's "Enforced by" and "Checked
by" bullet names code in backticks beside the files it lives in: each file must exist, and each
name must be found in one of the bullet's files (a class, function, attribute or test of that
name). Every other path the design names must exist too. The design drifted before (issue 38):
`StepMetrics` said to live in `driver/records.py`, a fault kind missing, `prepare/` missing from
the import diagram."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DESIGN = (ROOT / "docs" / "design.md").read_text()

PATH = re.compile(r"^(?:rayhybrid|tests|benchmarks|examples|conf|docs)/[\w./-]*$")
NAME = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*$")
EXTERNAL = ("ray.", "torch.", "hydra.", "omegaconf.", "fsspec.", "dcp.")
"""Names of the libraries rayhybrid builds on, which a bullet may cite beside its own code."""


def bullets(label: str) -> list[str]:
    """The text of every `- <label>:` bullet, continuation lines included."""
    found = []
    for match in re.finditer(rf"^( *)- {label}:(.*?)(?=^\1- |^\d+\. |^#|\Z)", DESIGN, re.MULTILINE | re.DOTALL):
        found.append(" ".join(match.group(2).split()))
    return found


def ticked(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


def defines(source: str, name: str) -> bool:
    """Whether `source` defines or assigns `name` (a class, a function, a module or class
    attribute, a dataclass field, an instance attribute) or, for a short constant, names it."""
    n = re.escape(name)
    pattern = rf"(?:\b(?:class|def)\s+{n}\b|^\s*{n}\s*[:=]|\bself\.{n}\s*[:=]|^\s*{n}\s*,|\b{n}\s*=\s*)"
    return re.search(pattern, source, re.MULTILINE) is not None


def cases() -> list[tuple[str, str, tuple[str, ...]]]:
    out = []
    for label in ("Enforced by", "Checked by"):
        for text in bullets(label):
            names = ticked(text)
            paths = tuple(p for p in names if PATH.match(p) and p.endswith(".py"))
            for name in names:
                if name.endswith(".py") or name.startswith(EXTERNAL):
                    continue
                if NAME.match(name) and not PATH.match(name):
                    out.append((label, name, paths))
    return out


def test_the_design_has_enforced_and_checked_bullets():
    assert len(bullets("Enforced by")) >= 9 and len(bullets("Checked by")) >= 9


@pytest.mark.parametrize("path", sorted({p.rstrip("/") for p in ticked(DESIGN) if PATH.match(p)}))
def test_every_path_the_design_names_exists(path):
    assert (ROOT / path).exists(), f"docs/design.md names {path}, which does not exist"


@pytest.mark.parametrize(("label", "name", "paths"), cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_name_of_an_invariant_is_in_the_files_it_names(label, name, paths):
    """Enforced by: `Topology.rank` beside `rayhybrid/config/topology.py` means both parts are
    defined in one of the bullet's files. Checked by: the tests' files name what they check."""
    assert paths, f"docs/design.md ({label}) names `{name}` in a bullet that names no file"
    sources = [(ROOT / p).read_text() for p in paths if (ROOT / p).exists()]
    parts = name.split(".")
    if label == "Checked by":
        found = any(all(re.search(rf"\b{re.escape(part)}\b", src) for part in parts) for src in sources)
    else:
        found = any(all(defines(src, part) for part in parts) for src in sources)
    assert found, f"docs/design.md ({label}) names `{name}`, which none of {', '.join(paths)} has"


@pytest.mark.parametrize("name", sorted({t for t in ticked(DESIGN) if re.match(r"^[\w]+\.py$", t)}))
def test_every_module_the_design_names_by_file_name_exists(name):
    assert list((ROOT / "rayhybrid").rglob(name)) or list((ROOT / "tests").glob(name)), name
