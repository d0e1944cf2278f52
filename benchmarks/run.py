"""rayhybrid's benchmarks against the alternatives; writes BENCHMARKS.md and prints one table.

    python benchmarks/run.py --quick          # 13 minutes on a 2-core CPU machine (6 of them checkpoints)
    python benchmarks/run.py                  # more steps and more cases
    python benchmarks/run.py --only scaling,schedules

Each benchmark runs its cases one after another in fresh processes and reports ratios measured
in this one invocation (absolute times on a shared or small machine say little). Results go
to benchmarks/results.json and BENCHMARKS.md (each section with the command that produced it;
the hand-written "Figures from development runs" section is kept as it is). Not part of the
test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

# Big enough that compute dominates a step on one CPU thread per rank (~0.5 s per micro-batch
# pass), small enough for minutes: 4 layers, d 256, seq 128, vocab 2048.
MODEL = ["model.n_layers=4", "model.d_model=256", "model.n_heads=4", "model.vocab_size=2048", "data.seq_len=128"]
QUIET = ["checkpoint.every=0", "train.log_every=100"]


def scaling(tmp: Path, quick: bool) -> dict:
    """Throughput of dp2, pp2 (1F1B, 8 micro-batches) and tp2 relative to one rank, same
    global batch (16) and micro-batch (2); with what bounds them on this machine: the same
    one-rank job run twice at once (no communication at all), and the all-reduce's cost."""
    steps, rounds = (8, 1) if quick else (16, 2)
    base = [*MODEL, *QUIET, "train.global_batch_size=16", "train.micro_batch_size=2", f"train.steps={steps}"]
    cases = {"1 rank": [], "dp2": ["+topology=dp2"], "pp2 (1F1B, 8 mb)": ["+topology=pp2"], "tp2": ["+topology=tp2"]}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(rounds):  # rounds interleave the cases, so a slow spell of the machine hits all of them
        for i, (name, extra) in enumerate(cases.items()):
            _, records, _ = common.train([*base, *extra], tmp / f"scaling-{r}-{i}")
            times[name] += [x["step_time_s"] for x in records[2:]]
    one = statistics.median(times["1 rank"])
    rows = [
        {"case": name, "step_s": statistics.median(t), "speedup": one / statistics.median(t)}
        for name, t in times.items()
    ]
    # The ceiling: two independent one-rank jobs at once, against one alone (the same launcher).
    args = [*MODEL, "train.global_batch_size=16", "train.micro_batch_size=2", "--steps", str(steps)]
    alone = common.baseline("torchrun_train.py", args, launcher=common.torchrun(1))
    pair = common.baselines_at_once([("torchrun_train.py", args, common.torchrun(1))] * 2)
    alone_s = statistics.median(alone["step_times_s"][2:])
    pair_s = statistics.median([t for r in pair for t in r["step_times_s"][2:]])
    allreduce = common.baseline("allreduce.py", [], launcher=common.torchrun(2))
    return {
        "rows": rows,
        "ceiling": 2 * alone_s / pair_s,
        "alone_step_s": alone_s,
        "pair_step_s": pair_s,
        "allreduce": allreduce["rows"],
        "backend": allreduce["backend"],
        "steps": steps,
        "rounds": rounds,
    }


def overhead(tmp: Path, quick: bool) -> dict:
    """The same model, parallelism and trainer code launched by torchrun (plain processes, no
    Ray) and by rayhybrid (Ray actors driven step by step): steady-state step time, as seen
    inside the ranks and as wall time between steps; runs alternate, A B B A ..., so a slow
    spell of the machine does not favour one (goal: within 5%)."""
    steps, pairs = (12, 2) if quick else (30, 3)
    topologies = ["dp2", "pp2"] if quick else ["dp2", "pp2", "tp2"]
    base = [*MODEL, "train.global_batch_size=16", "train.micro_batch_size=2"]
    rows = []
    for topo in topologies:
        ours: dict[str, list[float]] = {"step": [], "wall": [], "runs": []}
        theirs: dict[str, list[float]] = {"step": [], "wall": [], "runs": []}
        for i in range(2 * pairs):
            if i % 4 in (0, 3):  # A B B A: each launcher goes first as often as second
                _, records, _ = common.train(
                    [*base, *QUIET, f"+topology={topo}", f"train.steps={steps}"], tmp / f"overhead-{topo}-{i}"
                )
                ours["step"] += [r["step_time_s"] for r in records[2:]]
                ours["runs"].append(statistics.median(r["step_time_s"] for r in records[2:]))
                ours["wall"] += common.intervals([r["time"] for r in records[1:]])
                losses = [r["loss"] for r in records]
            else:
                r = common.baseline(
                    "torchrun_train.py",
                    [*base, f"+topology={topo}", "--steps", str(steps)],
                    launcher=common.torchrun(2),
                )
                theirs["step"] += r["step_times_s"][2:]
                theirs["runs"].append(statistics.median(r["step_times_s"][2:]))
                theirs["wall"] += common.intervals(r["step_walls"][1:])
                ref = r["losses"]
        # Each run's median in-step time, in the order run: how much the machine moved meanwhile.
        row = {
            "case": topo,
            "same_losses": _close(ref, losses),
            "rayhybrid_runs_s": ours["runs"],
            "torchrun_runs_s": theirs["runs"],
        }
        for key in ("step", "wall"):
            row[f"rayhybrid_{key}_s"] = statistics.median(ours[key])
            row[f"torchrun_{key}_s"] = statistics.median(theirs[key])
            row[f"{key}_ratio"] = row[f"rayhybrid_{key}_s"] / row[f"torchrun_{key}_s"]
        rows.append(row)
    return {"rows": rows, "steps": steps, "runs_each": pairs}


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
        theirs = common.baseline("raytrain_train.py", [*tiny, *topo, "--steps", "2", "--num-workers", str(ranks)])
        rows.append(
            {
                "ranks": ranks,
                "rayhybrid_s": first,
                "raytrain_s": theirs["first_step_wall"] - theirs["launched_wall"],
                "raytrain_startup": {"ray_init_s": theirs["ray_init_s"], **theirs["startup"]},
            }
        )
    return {"rows": rows}


RECOVERY = [
    "+topology=dp2_pp2_tp2",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "data.seq_len=32",
    "checkpoint.every=3",
    "train.steps=10",
    "train.log_every=100",
]


def recovery(tmp: Path, quick: bool) -> dict:
    """Kill to the first step after it, broken down, in one invocation: dp2_pp2_tp2 with rank 5
    SIGKILLed after step 5, healed from its peer (the default) and restored from the checkpoint
    (fault.heal=false); rank 3 SIGKILLed while step 6's checkpoint uploads; rank 5 stopped
    (SIGSTOP, fault.step_timeout_s=5); a node killed outright (dp2 on a 2-node Cluster); and Ray
    Train with FailureConfig (8 DDP workers, a checkpoint every step)."""
    cases = {
        "peer heal": _recovery_case(tmp / "heal", [], _after_step(5, 5)),
        "checkpoint restore": _recovery_case(tmp / "restore", ["fault.heal=false"], _after_step(5, 5)),
        "upload in flight": _recovery_case(tmp / "upload", [], _uploading(6, 3)),
        "stopped rank": _recovery_case(tmp / "stop", ["fault.step_timeout_s=5"], _after_step(5, 5, signal.SIGSTOP)),
        "node killed outright": _node_outright(tmp / "node"),
    }
    theirs = common.baseline(
        "raytrain_train.py",
        [
            "train.global_batch_size=8",
            "train.micro_batch_size=1",
            "data.seq_len=32",
            "--num-workers",
            "8",
            "--steps",
            "10",
            "--kill-at",
            "5",
        ],
    )
    return {"cases": cases, "raytrain": theirs}


RECORD = (
    "healed",
    "steps_redone",
    "bytes_sent",
    "total_s",
    "detect_s",
    "teardown_s",
    "place_s",
    "init_s",
    "restore_s",
    "first_step_s",
)


def _after_step(step: int, rank: int, sig: int = signal.SIGKILL):
    def strike(run: common.Run) -> float:
        run.wait_for_step(step)
        return run.signal_rank(rank, sig)

    return strike


def _uploading(step: int, rank: int):
    def strike(run: common.Run) -> float:
        run.wait_for_line(f"checkpoint step {step}: training blocked")
        return run.signal_rank(rank, signal.SIGKILL)

    return strike


def _recovery_case(run_dir: Path, extra: list[str], strike) -> dict:
    """One run of RECOVERY with `strike` (which returns the wall time of the signal): the
    restart record and the wall time from the signal to the next step's record."""
    run = common.Run([*RECOVERY, *extra], run_dir)
    struck = strike(run)
    summary = run.finish()
    (rec,) = summary["recoveries"]
    after = next(r["time"] for r in common.steps_of(run_dir) if r["time"] > struck)
    return {"kill_to_next_step_s": round(after - struck, 2)} | {k: rec.get(k) for k in RECORD}


def _node_outright(run_dir: Path) -> dict:
    """dp2 (a rank per node) on a 2-node Cluster with the health checks docs/recovery-and-
    elasticity.md suggests; after step 4 the node of rank 0 dies at once (its raylet and its
    rank), as in a power loss; the run places the lost replica on the other node and heals it."""
    import threading

    import ray

    import rayhybrid
    from tests.clusters import add_node, local_cluster, lose_power

    with local_cluster(head_cpus=0, node_cpus=[2, 2]) as (cluster, _):
        out: dict = {}
        overrides = [o for o in RECOVERY if not o.startswith("+topology")] + ["+topology=dp2", "train.steps=9"]
        thread = threading.Thread(target=lambda: out.update(s=rayhybrid.train(overrides, run_dir=run_dir)))
        thread.start()
        while len(common.steps_of(run_dir)) < 4:
            time.sleep(0.02)
        workers = json.loads((run_dir / "workers.json").read_text())
        node = next(n for n in cluster.list_all_nodes() if n.node_id == workers[0]["node_id"])
        struck = time.time()
        cluster.remove_node(node, allow_graceful=False)
        lose_power(workers, node.node_id)
        add_node(cluster, 2)  # a spare comes up, as an autoscaler's would
        thread.join(timeout=600)
        ray.shutdown()
    (rec,) = out["s"]["recoveries"]
    after = next(r["time"] for r in common.steps_of(run_dir) if r["time"] > struck)
    return {"kill_to_next_step_s": round(after - struck, 2)} | {k: rec.get(k) for k in RECORD}


def batch_search(tmp: Path, quick: bool) -> dict:
    """Trials and wall time to find the largest micro-batch that fits, on the same trial runner
    (real trainer runs, pp2, the CPU budget): rayhybrid's search against a Lightning-style
    doubling + binary search (BatchSizeFinder's `binsearch`, starting at 2)."""
    import ray

    sys.path.insert(0, str(common.ROOT))
    from rayhybrid.cluster.connect import connect, resolve_shape
    from rayhybrid.preflight import load_config
    from rayhybrid.tune import space
    from rayhybrid.tune.memory_search import MicroBatchSearch
    from rayhybrid.tune.run import TrialHost, base_point
    from rayhybrid.tune.trials import peaks_from_result

    budgets = (12.0,) if quick else (12.0, 40.0)
    rows = []
    connect(load_config(["+topology=pp2"]))
    try:
        for budget in budgets:
            cfg = load_config(["+topology=pp2", f"tune.memory_budget_mb={budget}", "tune.steps=3"])
            shape = resolve_shape(cfg)
            for name in ("rayhybrid", "lightning-style"):
                host, sizes = TrialHost(cfg, shape), []

                def trial(m: int, host=host, sizes=sizes) -> dict:
                    sizes.append(m)
                    return host.run({"micro_batch_size": m, "num_microbatches": 2, "activation_checkpointing": False})

                start = time.perf_counter()
                if name == "rayhybrid":
                    # The probes where `python -m rayhybrid.tune` puts them: the planner's largest
                    # size under the budget less the margin, and half of it.
                    largest = space.largest_planned(
                        cfg, lambda m, cfg=cfg: base_point(cfg, False, m), budget * (1 - cfg.tune.margin)
                    )
                    search = MicroBatchSearch(budget, probes=space.planned_probes(largest, (1, 2)))
                    while (m := search.next()) is not None:
                        r = trial(m)
                        search.observe(m, peaks_from_result(r), bool(r["oom"]))
                    best = search.best
                else:
                    best = _lightning_binsearch(
                        lambda m, budget=budget: (
                            not (r := trial(m))["oom"] and not r["error"] and r["peak_mb"] <= budget
                        ),
                        init=2,
                    )
                rows.append(
                    {
                        "budget_mb": budget,
                        "search": name,
                        "trials": len(sizes),
                        "sizes": sizes,
                        "largest": best,
                        "wall_s": time.perf_counter() - start,
                    }
                )
                host.shutdown()
    finally:
        ray.shutdown()
    return {"rows": rows}


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
    """Measured bubble fraction, peak memory and peak saved activations per pipeline rank of the
    schedules, pp2 x 4 micro-batches, next to theory: the bubble formula, and the memory
    `python -m rayhybrid.plan` predicts by walking the schedule's order (rayhybrid.plan.estimate)."""
    sys.path.insert(0, str(common.ROOT))
    from rayhybrid.plan.estimate import bubble_fraction, rank_memory
    from rayhybrid.preflight import load_config

    cases = {
        "gpipe": [],
        "1f1b": [],
        "interleaved_1f1b": ["topology.stages_per_rank=2"],
        "interleaved_zb": ["topology.stages_per_rank=2"],
        "zbv": ["topology.stages_per_rank=2"],
    }
    if quick:
        cases.pop("interleaved_zb")
    m, pp = 4, 2
    rows = []
    for name, extra in cases.items():
        overrides = [
            "+topology=pp2",
            f"topology.schedule={name}",
            *extra,
            *MODEL,
            "train.global_batch_size=8",
            "train.micro_batch_size=2",
            f"train.steps={5 if quick else 10}",
            "metrics.memory=true",
            *QUIET,
        ]
        _, records, _ = common.train(overrides, tmp / f"sched-{name}")
        cfg = load_config(overrides)
        theory, formula = bubble_fraction(name, pp, m, 2 if extra else 1)
        plan = [rank_memory(cfg, r) for r in range(pp)]
        last = records[-1]  # "rank<r>/stage<s>/<phase>": MB, once the optimizer state exists

        def per_rank(metric: str, last=last) -> list[float]:
            return [max(v for k, v in last[metric].items() if k.startswith(f"rank{r}/")) for r in range(pp)]

        rows.append(
            {
                "schedule": name,
                "bubble": statistics.median(r["bubble"] for r in records[1:]),
                "theory_bubble": theory,
                "formula": formula,
                "activation_mb": per_rank("activation_mb"),
                "plan_activation_mb": [p.saved_peak / 2**20 for p in plan],
                "in_flight": [{str(k): v for k, v in p.max_in_flight.items()} for p in plan],
                "peak_mb": per_rank("peak_mb"),
                "plan_peak_mb": [p.total / 2**20 for p in plan],
                "step_s": common.steady_step_s(records),
            }
        )
    return {"rows": rows, "micro_batches": m}


# About 100x the tiny default model's parameters (0.23M): 8 layers of d 512, 25M.
BIG_MODEL = ["model.n_layers=8", "model.d_model=512", "model.n_heads=8"]


def checkpoints(tmp: Path, quick: bool) -> dict:
    """What a checkpoint costs training, asynchronous (the default) against synchronous, into S3
    (moto's server on 127.0.0.1, in this process) and onto local disk, for the tiny default model
    and one about 100x larger; one rank, a save every few steps. Per run: the time blocked per
    save and the upload's time (checkpoint events), and step times while an upload is in flight
    against steps with none (see _checkpoint_stats)."""
    # A save every `every` steps and at the last; the larger model's upload takes several steps.
    models = {
        "tiny": {"overrides": [], "steps": 20 if quick else 30, "every": 5},
        "8 x 512": {
            "overrides": [*BIG_MODEL, "train.global_batch_size=4", "train.micro_batch_size=4"],
            "steps": 20 if quick else 40,
            "every": 10,
        },
    }
    cases = [  # (model, store, async): async, sync; then sync, async: a slow spell favours neither
        (model, store, asynchronous)
        for m, model in enumerate(models)
        for s, store in enumerate(("local", "s3"))
        for asynchronous in ((True, False) if (m + s) % 2 == 0 else (False, True))
    ]
    rows = []
    # loopback_aws first: nothing started from here on can reach a real cloud.
    with common.loopback_aws(), common.moto_server() as endpoint:
        aws = {**common.CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}
        common.make_bucket("bench", endpoint)
        for i, (model, store, asynchronous) in enumerate(cases):
            name = f"{i}-{store}-{'async' if asynchronous else 'sync'}"
            where = f"s3://bench/{name}" if store == "s3" else str(tmp / f"ckpt-{name}")
            m = models[model]
            overrides = [
                *m["overrides"],
                f"train.steps={m['steps']}",
                f"checkpoint.every={m['every']}",
                "train.log_every=100",
                f"checkpoint.dir={where}",
                f"checkpoint.async_save={str(asynchronous).lower()}",
            ]
            load, cpu = os.getloadavg()[0], time.process_time()
            summary, _, _ = common.train(overrides, tmp / f"ckpt-run-{name}", extra_env=aws)
            cpu = time.process_time() - cpu  # this process's CPU: almost all moto's, serving S3
            rows.append(
                {
                    "model": model,
                    "params": summary["params"],
                    "store": store,
                    "async": asynchronous,
                    **_checkpoint_stats(common.records_of(tmp / f"ckpt-run-{name}")),
                    "summary": summary["checkpoints"],
                    "train_s": summary["train_s"],
                    "load": [round(load, 2), round(os.getloadavg()[0], 2)],  # 1-minute load average, before/after
                    "server_cpu_s": round(cpu, 2),
                }
            )
    for row in rows:
        if row["async"]:
            (sync,) = [x for x in rows if (x["model"], x["store"], x["async"]) == (row["model"], row["store"], False)]
            row["blocked_vs_sync"] = (
                row["blocked_s"] / sync["blocked_s"] if row["blocked_s"] and sync["blocked_s"] else None
            )
    return {"rows": rows, "models": models}


def _checkpoint_stats(records: list[dict], warmup: int = 2) -> dict:
    """One run's checkpoint costs, from its metrics.jsonl records in order.

    A save of step s starts right after step s's record; its commit is recorded ("checkpoint"
    event, or "checkpoint_failed") after the record of the first step that ended with the upload
    done, or at the next save, which waits for it. The steps in between ran with the upload in
    flight (the last of them perhaps only in part); a synchronous save's event comes before the
    next step, so it has none. Steps 1..`warmup` count in neither group."""
    saves = [r for r in records if r.get("event") == "checkpoint"]
    failed = [r for r in records if r.get("event") == "checkpoint_failed"]
    saved_at = {r["step"] for r in saves + failed}
    inflight: set[int] = set()
    uploading, quiet, after_save, pauses, gaps = [], [], [], [], []
    last, outlasted = None, 0
    for r in records:
        if r.get("event") in ("checkpoint", "checkpoint_failed"):
            inflight.discard(r["step"])
            # Reported after the next save's step: the upload took the whole interval, and the
            # next save may have waited for it (within its time blocked).
            outlasted += last is not None and last["step"] != r["step"] and last["step"] in saved_at
        elif "event" not in r:
            k = r["step"]
            if k > warmup:
                (uploading if inflight else quiet).append(r["step_time_s"])
                if k - 1 in saved_at:
                    after_save.append(r["step_time_s"])
                if last is not None:  # the driver's wall between two step records, less the step
                    (pauses if k - 1 in saved_at else gaps).append(r["time"] - last["time"] - r["step_time_s"])
            if k in saved_at:
                inflight.add(k)
            last = r

    def median(xs):
        return statistics.median(xs) if xs else None

    pause, gap = median(pauses), median(gaps)
    return {
        "saves": len(saves),
        "failed": [f"step {r['step']}: {r['error']}" for r in failed],
        "blocked_s": median([r["blocked_s"] for r in saves]),
        "upload_s": median([r["upload_s"] for r in saves]),
        "blocked_all_s": [r["blocked_s"] for r in saves],
        "upload_all_s": [r["upload_s"] for r in saves],
        # The wall time the driver saw a save add between two steps (save call less a step's usual call)
        "driver_pause_s": pause - gap if pause is not None and gap is not None else None,
        "outlasted": outlasted,
        "after_save_s": median(after_save),
        "uploading_steps": len(uploading),
        "uploading_s": median(uploading),
        "quiet_steps": len(quiet),
        "quiet_s": median(quiet),
        "quiet_quartiles_s": statistics.quantiles(quiet, n=4) if len(quiet) >= 2 else None,
        "slowdown": median(uploading) / median(quiet) if uploading and quiet else None,
    }


def data(tmp: Path, quick: bool) -> dict:
    """Prepared data, end to end. (1) `python -m rayhybrid.prepare` on a generated JSON Lines
    corpus against the tokenizer's own batch encoding in a plain loop on the same cores
    (baselines/tokenize_loop.py; goal: prepare within 20%). (2) dp2 training on the prepared
    dataset in S3 (moto's server on 127.0.0.1, in this process), with read-ahead (the default,
    2 steps) and without: the share of step time the slowest rank waited for its samples (goal:
    at most 1% with it). Runs alternate A B B A."""
    # The corpus is large enough that prepare's fixed costs (Ray's start, the actors' processes)
    # are a small share; at 12 MB they were most of its time.
    megabytes, steps, pairs = (96, 12, 1) if quick else (256, 20, 2)
    corpus, tok = tmp / "corpus", tmp / "tokenizer"
    files = _corpus(corpus, megabytes)
    _tokenizer(tok, files[0], vocab_size=2048)
    loop = common.baseline("tokenize_loop.py", [str(tok), *map(str, files)])
    out = tmp / "prepared"
    started = time.perf_counter()
    proc = subprocess.run(
        [common.PY, "-m", "rayhybrid.prepare", f"input={corpus}", f"output={out}", f"tokenizer={tok}", "format=jsonl"],
        cwd=common.ROOT,
        env=common.env(),
        capture_output=True,
        text=True,
        timeout=1800,
        check=True,
    )
    wall = time.perf_counter() - started
    output = (proc.stdout + proc.stderr).splitlines()
    line = next(ln for ln in output if "tokenized and wrote" in ln)
    index = json.loads((out / "index.json").read_text())
    prepare = {
        "tokens": index["tokens"],
        "documents": index["documents"],
        "shards": len(index["shards"]),
        "wall_s": wall,
        "tokens_per_s": float(line.rsplit(",", 1)[1].split()[0]),
        "line": line.strip(),
        "actors": next((ln.split("tokenizing with ", 1)[1] for ln in output if "tokenizing with " in ln), ""),
    }
    runs = {"read-ahead 2": [], "read-ahead 0": []}
    order = [name for i in range(pairs) for name in (list(runs) if i % 2 == 0 else list(runs)[::-1])]
    with common.loopback_aws(), common.moto_server() as endpoint:
        aws = {**common.CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}
        common.make_bucket("bench", endpoint)
        import s3fs

        s3fs.S3FileSystem(endpoint_url=endpoint, key="testing", secret="testing").put(
            str(out), "bench/prepared", recursive=True
        )
        for i, name in enumerate(order):
            overrides = [*MODEL, *QUIET, "+topology=dp2", "train.global_batch_size=16", "train.micro_batch_size=2",
                         f"train.steps={steps}", "data=prepared", "data.seq_len=128", "data.path=s3://bench/prepared",
                         f"data.read_ahead={name.split()[-1]}"]  # fmt: skip
            _, records, _ = common.train(overrides, tmp / f"data-{i}", extra_env=aws)
            kept = records[2:]
            runs[name].append({"wait_s": sum(r["data_wait_s"] for r in kept),
                               "step_s": sum(r["step_time_s"] for r in kept),
                               "median_wait_ms": 1e3 * statistics.median(r["data_wait_s"] for r in kept),
                               "median_step_s": statistics.median(r["step_time_s"] for r in kept)})  # fmt: skip
    rows = [{"case": name, "share": sum(x["wait_s"] for x in xs) / sum(x["step_s"] for x in xs),
             "median_wait_ms": statistics.median(x["median_wait_ms"] for x in xs),
             "median_step_s": statistics.median(x["median_step_s"] for x in xs), "runs": len(xs)}
            for name, xs in runs.items()]  # fmt: skip
    return {"megabytes": megabytes, "steps": steps, "loop": loop, "prepare": prepare,
            "prepare_vs_loop": prepare["tokens_per_s"] / loop["tokens_per_s"], "rows": rows}  # fmt: skip


WORDS_SEED = 20261125


def _corpus(directory: Path, megabytes: int, files: int = 4) -> list[Path]:
    """JSON Lines of generated prose: Zipf-distributed words of a fixed made-up lexicon, in
    sentences and documents of varied length (so BPE has merges to learn)."""
    import random

    rng = random.Random(WORDS_SEED)
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    lexicon = ["".join(rng.choices(letters, k=rng.randint(1, 9))) for _ in range(20000)]
    weights = [1 / (r + 1) for r in range(len(lexicon))]
    directory.mkdir(parents=True, exist_ok=True)
    paths, per_file = [], megabytes * 2**20 // files
    for i in range(files):
        path, size = directory / f"part-{i}.jsonl", 0
        with open(path, "w") as f:
            while size < per_file:
                words = rng.choices(lexicon, weights, k=rng.randint(20, 600))
                text = " ".join(words).capitalize() + "."
                line = json.dumps({"id": size, "text": text}) + "\n"
                f.write(line)
                size += len(line)
        paths.append(path)
    return paths


def _tokenizer(directory: Path, sample: Path, vocab_size: int) -> None:
    """A byte-level BPE trained on the first file, saved as a Hugging Face tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|eos|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    with open(sample) as f:
        tok.train_from_iterator((json.loads(line)["text"] for line in f), trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>").save_pretrained(directory)


BENCHMARKS = {
    "scaling": scaling,
    "overhead": overhead,
    "startup": startup,
    "recovery": recovery,
    "batch_search": batch_search,
    "schedules": schedules,
    "checkpoints": checkpoints,
    "data": data,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and cases (13 minutes on 2 cores)")
    parser.add_argument("--only", default="", help="comma-separated benchmark names: " + ", ".join(BENCHMARKS))
    parser.add_argument("--out", default=str(common.ROOT / "BENCHMARKS.md"))
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHMARKS)}")
    results_path = common.ROOT / "benchmarks" / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    command = (
        "python benchmarks/run.py" + (" --quick" if args.quick else "") + (f" --only {args.only}" if args.only else "")
    )
    with tempfile.TemporaryDirectory(prefix="rayhybrid-bench-") as tmp:
        for name in names:
            start = time.perf_counter()
            print(f"== {name}", flush=True)
            try:
                result = BENCHMARKS[name](Path(tmp), args.quick)
            except Exception as err:  # noqa: BLE001 - one broken benchmark must not lose the others
                result = {"error": f"{type(err).__name__}: {err}"[:2000]}
            result.update(
                seconds=round(time.perf_counter() - start, 1),
                command=command,
                date=time.strftime("%Y-%m-%d %H:%M"),
                machine=_machine(),
            )
            results[name] = result
            results_path.write_text(json.dumps(results, indent=1) + "\n")
            print(json.dumps(result, indent=None)[:1500], flush=True)
    import report

    report.write(Path(args.out), results)  # keeps BENCHMARKS.md's "Figures from development runs"
    print(report.table(results))


def _machine() -> str:
    import os

    return f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


if __name__ == "__main__":
    main()
