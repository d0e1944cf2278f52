"""`python -m rayhybrid.tune +topology=dp2_pp2_tp2 [model=...] [tune.memory_budget_mb=...]`.

Finds the largest micro-batch that fits every stage, then the fastest configuration under it,
with short runs of the real trainer (see rayhybrid/tune/). Writes tune_results.csv, best.yaml,
memory.png and throughput.png into the run directory (hydra.run.dir=... chooses it) and prints
the command to train with the result.

Exit codes: 0 done, 1 the search failed (or nothing fitted), 2 bad configuration, 130 interrupted.
"""

from __future__ import annotations

import sys

from rayhybrid.__main__ import exit_codes


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return
    from rayhybrid.tune.run import tune_main

    run_dir = None
    overrides = []
    for arg in argv:
        if arg.startswith("hydra.run.dir="):
            run_dir = arg.split("=", 1)[1]
        else:
            overrides.append(arg)
    with exit_codes("rayhybrid.tune"):
        tune_main(overrides, run_dir=run_dir)


if __name__ == "__main__":
    main()
