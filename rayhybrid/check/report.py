"""What `python -m rayhybrid.check` prints: one line per problem, then a table of the figures
per node (the driver's first), and the verdict."""

from __future__ import annotations

from rayhybrid.check.bandwidth import expected
from rayhybrid.check.run import Checked
from rayhybrid.config.schema import Config

COLUMNS = ("node", "ip", "python", "torch", "ray", "rayhybrid", "devices", "store", "data", "intra GB/s", "inter GB/s")


def _devices(d: dict) -> str:
    if d.get("kind") == "cpu":
        return "cpu, gloo"
    names = ", ".join(d.get("names") or []) or "none"
    return f"{d.get('count', 0)} x {names}, nccl"


def _ok(reason, checked: bool = True) -> str:
    if not checked:
        return "-"
    return "ok" if not reason else "FAILS"


def _gbps(value) -> str:
    if value is None:
        return "-"
    return value if isinstance(value, str) else f"{value:.3g}"


def rows(checked: Checked, store_checked: bool) -> list[list[str]]:
    d = checked.driver
    p = d["packages"]
    out = [["driver", "", d["python"], p.get("torch") or "-", p.get("ray") or "-", _code(d), "", "", "", "", ""]]
    for n in checked.nodes:
        f = checked.facts.get(n.id)
        if not isinstance(f, dict):
            out.append([n.id[:8], n.ip, "no answer", *[""] * 8])
            continue
        fig = checked.figures.get(n.id, {})
        data = f.get("datasets") or {}
        out.append(
            [
                n.id[:8],
                n.ip,
                f["python"],
                f["packages"].get("torch") or "-",
                f["packages"].get("ray") or "-",
                _code(f),
                _devices(f["devices"]),
                _ok(f.get("store"), store_checked),
                "-" if not data else ("ok" if not any(data.values()) else "FAILS"),
                _gbps(fig.get("intra_gbps")),
                _gbps(fig.get("inter_gbps")),
            ]
        )
    return out


def _code(facts: dict) -> str:
    return f"{facts['packages'].get('rayhybrid') or '-'} ({facts.get('code') or '?'})"


def table(table_rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [list(COLUMNS), *table_rows]) for i in range(len(COLUMNS))]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [list(COLUMNS), *table_rows]
    ]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def text(checked: Checked, cfg: Config, store_checked: bool) -> str:
    """The problems, the table, what the bandwidth was held against, the verdict."""
    out = [p.line for p in checked.problems]
    if out:
        out.append("")
    out.append(table(rows(checked, store_checked)))
    if checked.figures:
        intra, inter = expected(cfg, checked.gpu)
        out.append(
            f"all-reduce bus bandwidth, {'nccl' if checked.gpu else 'gloo'}: the run counts on {intra:g} GB/s inside "
            f"a node (cluster.intra_node_gbps) and {inter:g} between nodes (cluster.inter_node_gbps)"
        )
    n = len(checked.problems)
    verdict = f"{n} problem(s)" if n else "no problem"
    out.append(f"{verdict} on {len(checked.nodes)} node(s), checked in {checked.seconds:.1f}s")
    return "\n".join(out)
