"""`python -m rayhybrid.tune +topology=dp2_pp2_tp2 [model=...] [tune.memory_budget_mb=...]`.

Finds the largest micro-batch that fits every stage, then the fastest configuration under it,
with short runs of the real trainer (see rayhybrid/tune/). Writes tune_results.csv, best.yaml,
memory.png, throughput.png and tune_summary.json into the run directory (hydra.run.dir=...
chooses it) and prints the command to train with the result. On CPU, tune.memory_budget_mb is
required, and trials are ranked by the busiest rank's CPU time (on GPUs by wall time).

A fixed global batch: tune.global_batch_size=G tries only micro-batches that divide G / dp,
each with the micro-batches that make up G; 'tune.global_batch_size=${train.global_batch_size}'
keeps the training one.
  python -m rayhybrid.tune +topology=pp2 tune.memory_budget_mb=8 tune.global_batch_size=32

The fastest layout: tune.search=layout tune.devices=N searches dp x pp x tp, the schedule,
dp_shard, checkpointing and the micro-batch at a fixed global batch, skipping what the planner
puts over the budget (at most tune.max_trials trials; the model needs a planner memory model).
  python -m rayhybrid.tune model=gpt3_xl tune.search=layout tune.devices=8

Exit codes: 0 done, 1 the search failed (or nothing fitted), 2 bad configuration, 130 interrupted.
"""

from __future__ import annotations

import sys

from rayhybrid.preflight import exit_codes


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
