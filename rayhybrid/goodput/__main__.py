"""`python -m rayhybrid.goodput [key=value ...]`: simulate one long training run's failures,
seeded, and compare recovery strategies on the same failure trace: restart_all (every rank
from the checkpoint, Ray Train's way), replace_failed (only the failed ranks, still from the
checkpoint), peer_heal (failed ranks healed from a data-parallel peer), elastic and
elastic_no_spares (shrink without waiting for a node, grow back at a save). Restart and scaling
decisions are rayhybrid's own (rayhybrid.driver.policies). The model: docs/goodput.md.

Writes goodput.json and goodput.png to output_dir and prints a table: each strategy's effective
training time (the share of wall time whose work was kept), its checkpoint interval, and the
GPU-hours lost by cause. from_run=<run dir> takes the costs from a rayhybrid run's records,
scaled to the simulated size; costs given on the command line win.

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
        folder = write(cfg, result, measured)
        print(table(cfg, result))
        print(f"wrote {folder / 'goodput.json'} and {folder / 'goodput.png'}")


if __name__ == "__main__":
    main()
