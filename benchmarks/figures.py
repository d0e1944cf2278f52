"""How figures are written in BENCHMARKS.md: numbers (`fmt`), sizes (`size`), markdown tables
(`table`) and the line under each section's heading that says how it was measured (`header`)."""

from __future__ import annotations


def fmt(x, digits=2, pct=False):
    if x is None:
        return "n/a"
    return f"{x:.1%}" if pct else f"{x:.{digits}f}"


def header(r: dict) -> str:
    failed = f"**Failed**: `{r['error']}`\n\n" if "error" in r else ""
    return failed + f"Command: `{r['command']}` ({r['date']}, {r['machine']}, {r['seconds']} s)\n\n"


def table(heads: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(heads) + " |", "|" + " --- |" * len(heads)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n\n"


def size(n: int) -> str:
    return f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB"
