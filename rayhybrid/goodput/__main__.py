"""`python -m rayhybrid.goodput [key=value ...]`: simulate one long training run's failures,
seeded, and compare recovery strategies on the same failure trace: restart_all (every rank
from the checkpoint, Ray Train's way), replace_failed (only the failed ranks, still from the
checkpoint), peer_heal (failed ranks healed from a data-parallel peer), elastic and
elastic_no_spares (shrink without waiting for a node, grow back at a save). Restart and scaling
decisions are rayhybrid's own (rayhybrid.driver.policies). The model: docs/goodput.md.

Writes goodput.json and goodput.png to output_dir and prints a table: each strategy's effective
training time (the share of wall time whose work was kept), its checkpoint interval, and the
GPU-hours lost by cause. from_run=<run dir> takes the costs from a rayhybrid run's records,
scaled to the simulated size; costs given on the command line win. It also simulates the run
itself (its ranks, its wall time, its own costs) and shows its measured goodput (summary.json's
goodput) beside that: effective time and seconds lost by cause (goodput.json's
from_run.vs_simulated).

Exit codes: 0 done, 2 bad settings (one line on stderr).
"""

from __future__ import annotations

import sys

from rayhybrid.config.goodput import compose_goodput, given, usage
from rayhybrid.preflight import exit_codes

EXAMPLES = """Examples:
  python -m rayhybrid.goodput gpus=16384 days=54 failures=llama3 strategy=all
  python -m rayhybrid.goodput gpus=4096 failures=llama3 seeds=20 costs.save_s=30
  python -m rayhybrid.goodput gpus=4096 failures=meta from_run=outputs/2025-01-01/12-00-00
  python -m rayhybrid.goodput failures=exponential failures.mtbf_hours=5 strategy=restart_all checkpoint.interval_s=900"""


def help_text() -> str:
    head = __doc__.strip().split("\n\n")
    return "\n\n".join([head[0], "Settings (key=value):\n" + usage(), *head[1:], EXAMPLES])


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(help_text())
        return
    with exit_codes("rayhybrid.goodput"):
        cfg = compose_goodput(argv)
        from rayhybrid.goodput.from_run import apply_run
        from rayhybrid.goodput.report import table, write
        from rayhybrid.goodput.simulate import simulate

        cfg, measured = apply_run(cfg, given(argv)) if cfg.from_run else (cfg, None)
        result = simulate(cfg)
        beside = measured_beside_simulated(cfg, measured) if measured else None
        folder = write(cfg, result, measured)
        print(table(cfg, result))
        if beside:
            print(beside)
        print(f"wrote {folder / 'goodput.json'} and {folder / 'goodput.png'}")


def measured_beside_simulated(cfg, measured: dict) -> str:
    """The run's measured goodput beside the simulator's for the run itself; stored in
    `measured` (goodput.json's from_run.vs_simulated), returned as the terminal's table."""
    from pathlib import Path

    from rayhybrid.goodput.from_run import own_size, run_goodput
    from rayhybrid.goodput.report import comparison, comparison_table
    from rayhybrid.goodput.simulate import simulate

    goodput = run_goodput(Path(cfg.from_run).expanduser())
    own = own_size(cfg, measured, goodput["wall_s"])
    measured["vs_simulated"] = comparison(goodput, own, simulate(own))
    return comparison_table(measured["vs_simulated"])


if __name__ == "__main__":
    main()
