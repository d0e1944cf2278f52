"""`python -m rayhybrid.check [--json] [check.json=PATH] [--no-bandwidth] [overrides...]`: check
each node a run of this configuration will use, before the run.

Takes the same Hydra overrides as `python -m rayhybrid`, checks them the same way and connects
to Ray as a run does (cluster.address, RAY_ADDRESS, else a local Ray). On each node that can
hold a pipeline stage, a small task checks: the devices torch sees against the topology (tp
GPUs on one node; on CPU, gloo), the Python packages' versions against the driver's, the
checkpoint store (a small file written and deleted under checkpoint.dir) and the datasets the
config names (listed). Then the all-reduce bandwidth inside each node (2 processes) and between
nodes (one process per node, in pairs) on the run's backend, against cluster.intra_node_gbps
and cluster.inter_node_gbps (a figure under half of it is a problem); --no-bandwidth skips it.

Prints one line per problem, naming the node and the fix, then a table of the figures per node.
--json prints the same as one JSON object instead; check.json=PATH also writes it to PATH.

Exit codes: 0 no problem, 1 problems, 2 bad configuration (one line on stderr).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rayhybrid.preflight import exit_codes


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return
    as_json, bandwidth = "--json" in argv, "--no-bandwidth" not in argv
    out = [a.split("=", 1)[1] for a in argv if a.startswith("check.json=")]
    overrides = [a for a in argv if a not in ("--json", "--no-bandwidth") and not a.startswith("check.json=")]
    with exit_codes("rayhybrid.check"):
        problems = run(overrides, as_json, bandwidth, Path(out[-1]) if out else None)
    sys.exit(1 if problems else 0)


def run(overrides: list[str], as_json: bool, bandwidth: bool, out: Path | None) -> int:
    """Check, print, write check.json=PATH; returns the number of problems."""
    import ray

    from rayhybrid.check.report import text
    from rayhybrid.check.run import check_cluster
    from rayhybrid.cluster.connect import connect, resolve_shape
    from rayhybrid.errors import ConfigError
    from rayhybrid.preflight import ensure_logging, load_config

    cfg = load_config(overrides)
    ensure_logging()
    started = connect(cfg)
    try:
        checked = check_cluster(cfg, resolve_shape(cfg), bandwidth=bandwidth)
    finally:
        if started:
            ray.shutdown()
    if not checked.nodes:
        raise ConfigError("topology", "no node of the cluster can hold a pipeline stage of the run; add nodes")
    record = checked.record()
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1) if as_json else text(checked, cfg, store_checked=bool(cfg.checkpoint.dir)))
    return len(checked.problems)


if __name__ == "__main__":
    main()
