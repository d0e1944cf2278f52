"""BENCHMARKS.md and the printed table, from benchmarks/results.json: each benchmark's section
and line are its module's (`suite.BENCHMARKS`); this module puts them together and keeps the
hand-written section of an earlier BENCHMARKS.md."""

from __future__ import annotations

from pathlib import Path

from suite import BENCHMARKS

INTRO = (
    "# Benchmarks\n\n"
    "Written by `python benchmarks/run.py` (see its docstring), which runs every case in fresh processes, one "
    "after another. Every ratio below is between runs of one invocation on the machine named; absolute times "
    "on a small shared machine say little. Not part of the test suite.\n\n"
    "The model, unless a section says otherwise: GPT, 4 layers, d 256, 4 heads, vocabulary 2048, sequence 128, "
    "float32, one torch thread per rank, gloo.\n"
)


KEPT_HEADING = "## Figures from development runs"
"""A section of BENCHMARKS.md that results.json does not hold (figures measured by hand while
rayhybrid was developed): a rerun keeps it as it is."""


def kept_section(previous: str, heading: str = KEPT_HEADING) -> str:
    """The `heading` section of `previous` (an earlier BENCHMARKS.md), verbatim from its
    heading to the next "## " heading or the end; "" when it has none."""
    lines = previous.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == heading), None)
    if start is None:
        return ""
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "".join(lines[start:end])


def markdown(results: dict, previous: str = "") -> str:
    """BENCHMARKS.md: a section per benchmark in `results`, then the kept section of `previous`.
    A benchmark that only some machines can run (one with a `HEADING` and `unmeasured()`: the
    GPU's) and that `results` lacks keeps its section of `previous`, else says it is unmeasured."""
    sections = "".join(_section(name, results, previous) for name in BENCHMARKS)
    return INTRO + "\n" + sections + kept_section(previous)


def _section(name: str, results: dict, previous: str) -> str:
    module = BENCHMARKS[name]
    if name in results:
        return module.section(results[name])
    if hasattr(module, "unmeasured"):
        return kept_section(previous, module.HEADING) or module.unmeasured()
    return ""


def write(path: Path, results: dict) -> None:
    """Rewrite `path` (BENCHMARKS.md) from `results`, keeping its hand-written section."""
    previous = path.read_text() if path.exists() else ""
    path.write_text(markdown(results, previous))


def table(results: dict) -> str:
    """One line per benchmark: the figures that matter."""
    lines = []
    for name, r in results.items():
        if "error" in r:
            lines.append(f"{name:13s} FAILED {r['error'][:100]}")
        elif name in BENCHMARKS:
            lines.append(f"{name:13s} " + BENCHMARKS[name].summary(r))
    return "\n".join(lines)
