"""The house rules of docs/design.md ("Layers and what each owns"), read from the source: each
package imports only floors below its own, no modules import each other round a circle (lazy
imports counted), the package root keeps only the public entry points, no class is over 250
lines and no function over 60, and validating a config never imports torch. Beside the package:
benchmarks/ imports nothing from tests/, and README.md is a front page under 300 lines whose
links resolve. `python tests/test_house.py` prints the figures."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rayhybrid"

FLOORS = {
    "rayhybrid.errors": 0,
    "rayhybrid.config": 1,
    "rayhybrid.parallel": 2,
    "rayhybrid.storage": 2,
    "rayhybrid.faults": 2,
    "rayhybrid.data": 3,
    "rayhybrid.models": 3,
    "rayhybrid.tracking": 3,
    "rayhybrid.trainer": 4,
    "rayhybrid.cluster": 5,
    "rayhybrid.check": 5.5,
    "rayhybrid.driver": 6,
    "rayhybrid.plan": 6,
    "rayhybrid.preflight": 7,
    "rayhybrid.tune": 8,
    "rayhybrid.export": 8,
    "rayhybrid.prepare": 8,
    "rayhybrid.goodput": 8,
    "rayhybrid.plan.__main__": 9,
    "rayhybrid.check.__main__": 9,
    "rayhybrid.api": 9,
    "rayhybrid.__main__": 9,
    "rayhybrid": 10,
}
"""The floor of each room (a package or a root module; the longest matching name wins). An
import goes to a lower floor, or stays in its own room; two rooms on one floor never import
each other. The trainer, models and parallel code sit below the cluster, so they never see Ray;
configuration sits on the ground floor with the errors, so it imports no concern."""

ROOT_MODULES = {"__init__.py", "__main__.py", "api.py", "errors.py", "preflight.py"}
MAX_CLASS_LINES, MAX_FUNCTION_LINES = 250, 60


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room(module: str) -> str:
    candidates = [name for name in FLOORS if module == name or module.startswith(name + ".")]
    assert candidates, f"{module} belongs to no room of FLOORS: give its package a floor"
    return max(candidates, key=len)


def internal_imports(path: Path) -> set[str]:
    """The rayhybrid modules `path` imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("rayhybrid"):
            if node.module == "rayhybrid":
                found.update(f"rayhybrid.{alias.name}" for alias in node.names)
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("rayhybrid"))
    return found


def sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def import_graph() -> dict[str, set[str]]:
    """Module -> the rayhybrid modules it imports, at module level or inside functions.
    `from package import name` counts as an import of the submodule package.name where there is
    one (that is the module it loads), else of the package."""
    modules = {module_name(path): path for path in sources()}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("rayhybrid"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    found.add(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names if alias.name.startswith("rayhybrid"))
        graph[name] = {target for target in found if target in modules and target != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm): each
    is a set of modules that import one another round a circle, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def arrows_up() -> list[str]:
    bad = []
    for path in sources():
        here = room(module_name(path))
        for target in internal_imports(path):
            there = room(target)
            if there != here and FLOORS[there] >= FLOORS[here]:
                bad.append(
                    f"{module_name(path)} -> {target} ({here} floor {FLOORS[here]}, {there} floor {FLOORS[there]})"
                )
    return sorted(bad)


def spans() -> list[tuple[int, str, str]]:
    """(lines, kind, where) of every class and function in the package."""
    out = []
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                out.append((node.end_lineno - node.lineno + 1, kind, f"{path.relative_to(PACKAGE.parent)}:{node.name}"))
    return out


def test_no_import_runs_up_the_layers():
    assert arrows_up() == []


def test_no_import_circles():
    """No two rayhybrid modules import each other round a circle, directly or through others,
    counting the imports inside functions: a lazy import written round a circle hides it, it
    does not break it (data/reader.py and data/streams.py, plan/estimate.py and plan/memory.py,
    now plan/peak_memory.py, were two)."""
    assert import_cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def imports_of_tests(directory: Path) -> list[str]:
    """Every import of the `tests` package (or a module of it) by a Python file under
    `directory`, at module level or inside functions, as "file: module"."""
    found = []
    for path in sorted(directory.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            found += [f"{path.relative_to(directory.parent)}: {n}" for n in names if n.split(".")[0] == "tests"]
    return found


def test_benchmarks_import_nothing_from_the_tests():
    """The benchmarks stand on their own: what they share with the tests (the loopback S3
    server, clusters of several raylets) lives in benchmarks/ and the tests import it from there,
    never the other way round."""
    assert imports_of_tests(PACKAGE.parent / "benchmarks") == []


FRONT_PAGE_MAX_LINES = 300
"""README.md is the front page: what rayhybrid is, the quick start and a short tour; the detail
is in docs/*.md, which it links to."""

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _headings(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings, as GitHub makes them."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    return {
        re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.*)$", text, re.MULTILINE)
    }


def relative_links(page: Path) -> list[tuple[str, str | None]]:
    """(link, None when it resolves, else why not) for each relative link of a Markdown page
    outside code blocks: the file must exist and an #anchor must name one of its headings."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    out = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path) if path else page
        why = None
        if not dest.exists():
            why = "no such file"
        elif anchor and dest.suffix == ".md" and anchor not in _headings(dest):
            why = f"{dest.name} has no heading #{anchor}"
        out.append((target, why))
    return out


def test_the_readme_is_a_front_page_whose_links_resolve():
    root = PACKAGE.parent
    lines = len((root / "README.md").read_text().splitlines())
    assert lines < FRONT_PAGE_MAX_LINES, f"README.md has {lines} lines; move detail to docs/*.md"
    links = {page.name: relative_links(page) for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]}
    assert len(links["README.md"]) >= 10  # the finder finds them
    assert {
        name: [(t, why) for t, why in found if why] for name, found in links.items() if any(w for _, w in found)
    } == {}


def test_the_link_check_finds_a_broken_link(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n\n## Some Heading, here\n")
    page = tmp_path / "README.md"
    page.write_text("[a](a.md) [b](a.md#some-heading-here) [c](a.md#nowhere) [d](gone.md) [e](https://x.y/z)\n")
    assert relative_links(page) == [
        ("a.md", None),
        ("a.md#some-heading-here", None),
        ("a.md#nowhere", "a.md has no heading #nowhere"),
        ("gone.md", "no such file"),
    ]


def test_the_root_keeps_only_the_public_entry_points():
    assert {p.name for p in PACKAGE.glob("*.py")} == ROOT_MODULES


def test_configuration_imports_nothing_above_it():
    for path in (PACKAGE / "config").glob("*.py"):
        for target in internal_imports(path):
            assert target == "rayhybrid.errors" or target.startswith("rayhybrid.config"), f"{path.name} -> {target}"


def test_no_class_over_250_and_no_function_over_60_lines():
    too_long = [
        f"{where}: {lines} lines"
        for lines, kind, where in spans()
        if lines > (MAX_CLASS_LINES if kind == "class" else MAX_FUNCTION_LINES)
    ]
    assert too_long == []


def test_every_package_is_installed():
    """`pip install .` (CI, users) ships the packages pyproject.toml lists: every package of
    the source tree must be there, or an installed rayhybrid lacks it."""
    text = (PACKAGE.parent / "pyproject.toml").read_text()
    block = text.split("\npackages = [", 1)[1].split("]", 1)[0]  # [tool.setuptools] packages
    listed = {line.strip().strip('",') for line in block.splitlines() if line.strip()}
    found = {module_name(init) for init in PACKAGE.rglob("__init__.py")}
    assert found - listed == set()


def test_validation_never_imports_torch(tmp_path):
    """A config with data.val_fraction used to load the trainer's data module (and torch) to
    find the held-out cut; `python -m rayhybrid.plan` promises not to import torch."""
    (tmp_path / "book.txt").write_text("a few words of text " * 200)
    code = (
        "import sys\n"
        "from rayhybrid.preflight import load_config\n"
        f"cfg = load_config(['data=text', 'data.path={tmp_path / 'book.txt'}', 'data.val_fraction=0.1', 'eval.every=5'])\n"
        "assert cfg.data.val_fraction == 0.1\n"
        "assert 'torch' not in sys.modules, 'validation imported torch'\n"
        "assert 'ray' not in sys.modules, 'validation imported ray'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr


def private_reaches() -> list[str]:
    """Module-level functions that reach into another object's private members (`group._get`):
    a class's encapsulation must not span files. A dependency's private name (listed, with why,
    in tests/test_private_apis.py) is exempt."""
    from tests.test_private_apis import PRIVATE

    allowed = {re.split(r"[.#]", p.path)[-1] for p in PRIVATE}
    bad = []
    for path in sources():
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            args = node.args
            params = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
            for sub in ast.walk(node):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id in params
                    and sub.attr.startswith("_")
                    and not sub.attr.startswith("__")
                    and sub.attr not in allowed
                ):
                    bad.append(f"{module_name(path)}.{node.name}: {sub.value.id}.{sub.attr}")
    return sorted(set(bad))


def test_no_module_level_function_reaches_into_another_objects_private_members():
    assert private_reaches() == []


def shared_names() -> dict[str, list[str]]:
    """Module file names (but __init__ and __main__) found in more than one package."""
    where: dict[str, list[str]] = {}
    for path in sources():
        if path.name not in ("__init__.py", "__main__.py"):
            where.setdefault(path.name, []).append(str(path.parent.relative_to(PACKAGE.parent)))
    return {name: dirs for name, dirs in where.items() if len(dirs) > 1}


def test_a_name_in_two_rooms_is_one_concept_the_design_names():
    """Two modules of one name in different packages are the same concept at two layers (or in
    two parallel rooms), and docs/design.md's "One name in two rooms" says which; otherwise one
    is renamed (three heal modules, two checkpoint modules and two open_stores were the cost)."""
    design = (PACKAGE.parent / "docs" / "design.md").read_text()
    section = design.split("### One name in two rooms", 1)[1].split("\\n### ", 1)[0]
    unexplained = sorted(name for name in shared_names() if f"`{name}`" not in section)
    assert unexplained == [], f"name these in docs/design.md's 'One name in two rooms', or rename: {unexplained}"


if __name__ == "__main__":
    figures = spans()
    classes = sorted((s for s in figures if s[1] == "class"), reverse=True)[:3]
    functions = sorted((s for s in figures if s[1] == "function"), reverse=True)[:3]
    modules = sorted((len(p.read_text().splitlines()), str(p.relative_to(PACKAGE.parent))) for p in sources())
    print(f"arrows up: {len(arrows_up())}")
    print(f"import circles: {import_cycles(import_graph())}")
    print("largest classes:", ", ".join(f"{w} {n}" for n, _, w in classes))
    print("largest functions:", ", ".join(f"{w} {n}" for n, _, w in functions))
    print("largest modules:", ", ".join(f"{w} {n}" for n, w in modules[-3:]))
    print(f"root modules: {sorted(p.name for p in PACKAGE.glob('*.py'))}")
