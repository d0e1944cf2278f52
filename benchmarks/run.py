"""rayhybrid's benchmarks against the alternatives; writes BENCHMARKS.md and prints one table.

    python benchmarks/run.py --quick          # under 10 minutes on a 2-core CPU machine
    python benchmarks/run.py                  # more steps and more cases
    python benchmarks/run.py --only scaling,schedules

Each benchmark runs its cases one after another in fresh processes and reports ratios measured
in this one invocation (absolute times on a shared or small machine say little). Results go
to benchmarks/results.json and BENCHMARKS.md (each section with the command that produced it).
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

# Big enough that compute dominates a step on one CPU thread per rank (~0.5 s per micro-batch
# pass), small enough for minutes: 4 layers, d 256, seq 128, vocab 2048.
MODEL = ["model.n_layers=4", "model.d_model=256", "model.n_heads=4", "model.vocab_size=2048", "data.seq_len=128"]
QUIET = ["checkpoint.every=0", "train.log_every=100"]


def scaling(tmp: Path, quick: bool) -> dict:
    """Throughput of dp2, pp2 (1F1B, 8 micro-batches) and tp2 relative to one rank, same
    global batch (16) and micro-batch (2)."""
    steps = 6 if quick else 15
    base = [*MODEL, *QUIET, "train.global_batch_size=16", "train.micro_batch_size=2", f"train.steps={steps}"]
    cases = {"1 rank": [], "dp2": ["+topology=dp2"], "pp2 (1F1B, 8 mb)": ["+topology=pp2"], "tp2": ["+topology=tp2"]}
    rows = []
    for name, extra in cases.items():
        summary, records, _ = common.train([*base, *extra], tmp / f"scaling-{len(rows)}")
        rows.append({"case": name, "step_s": common.steady_step_s(records), "tokens_per_s": summary["mean_tokens_per_s"]})
    one = rows[0]["step_s"]
    for row in rows:
        row["speedup"] = one / row["step_s"]
    return {"rows": rows, "note": "physical limit on 2 cores: 2.0x"}


def overhead(tmp: Path, quick: bool) -> dict:
    """The same model and parallelism launched by torchrun (no Ray) and by rayhybrid: steady-state
    step time ratio (goal: within 5%)."""
    steps = 8 if quick else 20
    topologies = ["+topology=dp2", "+topology=pp2"] if quick else ["+topology=dp2", "+topology=pp2", "+topology=tp2"]
    base = [*MODEL, "train.global_batch_size=16", "train.micro_batch_size=2"]
    rows = []
    for topo in topologies:
        _, records, _ = common.train([*base, *QUIET, topo, f"train.steps={steps}"], tmp / f"overhead-{len(rows)}")
        ours = common.steady_step_s(records)
        theirs = common.baseline(
            "torchrun_train.py", [*base, topo, "--steps", str(steps)],
            launcher=[common.PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
        )
        ref = sorted(theirs["step_times_s"][1:])[len(theirs["step_times_s"][1:]) // 2]
        rows.append({"case": topo.split("=")[1], "rayhybrid_step_s": ours, "torchrun_step_s": ref, "ratio": ours / ref,
                     "same_losses": _close(theirs["losses"], [r["loss"] for r in records])})
    return {"rows": rows}


def _close(a: list[float], b: list[float]) -> bool:
    n = min(len(a), len(b))
    return n > 0 and all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a[:n], b[:n]))


def startup(tmp: Path, quick: bool) -> dict:
    """Seconds from the command to the first completed step, 1 and 8 ranks, against Ray Train's
    TorchTrainer with as many workers training the same model (DDP)."""
    rows = []
    tiny = ["train.global_batch_size=8", "train.micro_batch_size=1", "train.steps=2", *QUIET]
    for ranks, topo in ((1, []), (8, ["topology.dp=8"])):
        _, _, first = common.train([*tiny, *topo], tmp / f"startup-{ranks}")
        theirs = common.baseline("raytrain_train.py", [*tiny, *topo, "--steps", "2", "--workers", str(ranks)])
        rows.append({"ranks": ranks, "rayhybrid_s": first, "raytrain_s": theirs["first_step_wall"] - theirs["launched_wall"]})
    return {"rows": rows}


def recovery(tmp: Path, quick: bool) -> dict:
    """kill -9 of rank 5 of dp2_pp2_tp2 mid-run: seconds to the first step after, broken down;
    against Ray Train with FailureConfig (8 DDP workers, a checkpoint every step)."""
    overrides = ["+topology=dp2_pp2_tp2", "train.global_batch_size=8", "train.micro_batch_size=2", "data.seq_len=32",
                 "checkpoint.every=3", "train.steps=10", "train.log_every=100"]
    run = common.Run(overrides, tmp / "recovery")
    run.wait_for_step(5)
    run.kill_rank(5)
    summary = run.finish()
    (rec,) = summary["recoveries"]
    ours = {k: rec.get(k) for k in ("total_s", "detect_s", "teardown_s", "place_s", "init_s", "restore_s", "first_step_s")}
    theirs = common.baseline(
        "raytrain_train.py",
        ["train.global_batch_size=8", "train.micro_batch_size=1", "data.seq_len=32", "--workers", "8", "--steps", "10",
         "--kill-at", "5"],
    )
    return {"rayhybrid": ours, "raytrain": theirs}


def batch_search(tmp: Path, quick: bool) -> dict:
    """Trials and wall time to find the largest micro-batch that fits, on the same trial runner
    (real trainer runs, pp2, the CPU budget): rayhybrid's search against a Lightning-style
    doubling + binary search (BatchSizeFinder's `binsearch`, starting at 2)."""
    import ray

    sys.path.insert(0, str(common.ROOT))
    from rayhybrid.cluster.connect import connect, resolve_shape
    from rayhybrid.config.compose import load_config
    from rayhybrid.tune.run import TrialHost
    from rayhybrid.tune.search import MicroBatchSearch

    budget = 12.0
    cfg = load_config(["+topology=pp2", f"tune.memory_budget_mb={budget}", "tune.steps=3"])
    rows = []
    connect(cfg)
    try:
        shape = resolve_shape(cfg)
        for name in ("rayhybrid", "lightning-style"):
            host = TrialHost(cfg, shape)
            sizes = []

            def fits(m: int) -> bool:
                sizes.append(m)
                r = host.run({"micro_batch_size": m, "num_microbatches": 2, "activation_checkpointing": False})
                return not r["oom"] and not r["error"] and r["peak_mb"] <= budget

            start = time.perf_counter()
            if name == "rayhybrid":
                search = MicroBatchSearch(budget)
                while (m := search.next()) is not None:
                    sizes.append(m)
                    r = host.run({"micro_batch_size": m, "num_microbatches": 2, "activation_checkpointing": False})
                    peaks = {k[len("peak_mb/"):]: v for k, v in r.items() if k.startswith("peak_mb/")}
                    search.observe(m, peaks, bool(r["oom"]))
                best = search.best
            else:
                best = _lightning_binsearch(fits, init=2)
            rows.append({"search": name, "trials": len(sizes), "sizes": sizes, "largest": best,
                         "wall_s": time.perf_counter() - start})
            host.shutdown()
    finally:
        ray.shutdown()
    return {"rows": rows, "budget_mb": budget}


def _lightning_binsearch(fits, init: int = 2, max_trials: int = 25) -> int:
    """PyTorch Lightning's BatchSizeFinder(mode="binsearch"): double from `init` until a size
    fails, then halve the gap between the last success and the failure."""
    low, high, size = 0, None, init
    for _ in range(max_trials):
        if fits(size):
            low = size
            if high is None:
                size *= 2
                continue
        else:
            high = size
        if high - low <= 1:
            break
        size = (low + high) // 2
    return low


def schedules(tmp: Path, quick: bool) -> dict:
    """Measured bubble fraction and peak activation memory per stage of the pipeline schedules,
    pp2 x 4 micro-batches, next to theory."""
    cases = {"gpipe": [], "1f1b": [], "interleaved_1f1b": ["topology.stages_per_rank=2"],
             "interleaved_zb": ["topology.stages_per_rank=2"], "zbv": ["topology.stages_per_rank=2"]}
    if quick:
        cases.pop("interleaved_zb")
    m, pp = 4, 2
    rows = []
    for name, extra in cases.items():
        overrides = ["+topology=pp2", f"topology.schedule={name}", *extra, *MODEL, "train.global_batch_size=8",
                     "train.micro_batch_size=2", f"train.steps={5 if quick else 10}", "metrics.memory=true", *QUIET]
        summary, records, _ = common.train(overrides, tmp / f"sched-{name}")
        v = 2 if extra else 1
        theory = (pp - 1) / (v * m + pp - 1)
        rows.append({"schedule": name, "bubble": summary["mean_bubble"], "theory_bubble": theory,
                     "activation_mb": summary.get("activation_mb_by_stage"), "peak_mb": summary.get("peak_mb_by_stage"),
                     "step_s": common.steady_step_s(records)})
    return {"rows": rows, "micro_batches": m}


BENCHMARKS = {
    "scaling": scaling, "overhead": overhead, "startup": startup, "recovery": recovery,
    "batch_search": batch_search, "schedules": schedules,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and cases (under 10 minutes)")
    parser.add_argument("--only", default="", help="comma-separated benchmark names: " + ", ".join(BENCHMARKS))
    parser.add_argument("--out", default=str(common.ROOT / "BENCHMARKS.md"))
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHMARKS)}")
    results_path = common.ROOT / "benchmarks" / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    command = "python benchmarks/run.py" + (" --quick" if args.quick else "") + (f" --only {args.only}" if args.only else "")
    with tempfile.TemporaryDirectory(prefix="rayhybrid-bench-") as tmp:
        for name in names:
            start = time.perf_counter()
            print(f"== {name}", flush=True)
            try:
                result = BENCHMARKS[name](Path(tmp), args.quick)
            except Exception as err:  # noqa: BLE001 - one broken benchmark must not lose the others
                result = {"error": f"{type(err).__name__}: {err}"[:2000]}
            result.update(seconds=round(time.perf_counter() - start, 1), command=command,
                          date=time.strftime("%Y-%m-%d %H:%M"), machine=_machine())
            results[name] = result
            results_path.write_text(json.dumps(results, indent=1) + "\n")
            print(json.dumps(result, indent=None)[:1500], flush=True)
    import report

    Path(args.out).write_text(report.markdown(results))
    print(report.table(results))


def _machine() -> str:
    import os

    return f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


if __name__ == "__main__":
    main()
