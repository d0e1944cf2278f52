"""Start-up: from the command to the first completed step, rayhybrid against Ray Train's
`TorchTrainer`."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import common
from figures import fmt, header, table


def run(tmp: Path, quick: bool) -> dict:
    """Seconds from the command to the first completed step, 1 and 8 ranks, against Ray Train's
    TorchTrainer with as many workers training the same model (DDP)."""
    rows = []
    tiny = ["train.global_batch_size=8", "train.micro_batch_size=1", "train.steps=2", *common.QUIET]
    for ranks, topo in ((1, []), (8, ["topology.dp=8"])):
        run = common.Run([*tiny, *topo], tmp / f"startup-{ranks}")
        run.wait_for_step(1)
        cpu = ranks_cpu_s(run.run_dir)
        summary, first = run.finish(), run.first_step_s
        theirs = common.baseline("raytrain_train.py", [*tiny, *topo, "--steps", "2", "--num-workers", str(ranks)])
        rows.append(
            {
                "ranks": ranks,
                "rayhybrid_s": first,
                "raytrain_s": theirs["first_step_wall"] - theirs["launched_wall"],
                "raytrain_startup": {"ray_init_s": theirs["ray_init_s"], **theirs["startup"]},
                "rayhybrid_startup": summary.get("startup"),
                "rank_cpu_s": statistics.mean(cpu) if cpu else None,
                "cores": os.cpu_count(),
            }
        )
    return {"rows": rows}


def ranks_cpu_s(run_dir: Path) -> list[float]:
    """CPU seconds (user and system) each rank's process has used so far, read from /proc by the
    pids in workers.json: its Ray worker's start, the imports, the build and the first step."""
    tick = os.sysconf("SC_CLK_TCK")
    out = []
    for worker in json.loads((run_dir / "workers.json").read_text()):
        try:
            with open(f"/proc/{worker['pid']}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:  # not Linux, or the process is gone
            continue
        out.append((int(fields[11]) + int(fields[12])) / tick)  # utime, stime (fields 14, 15)
    return out


def _cpu(x: dict) -> str:
    if x.get("rank_cpu_s") is None:
        return "n/a"
    return f"{fmt(x['rank_cpu_s'], 2)}, {fmt(x['ranks'] * x['rank_cpu_s'] / x['cores'], 1)}"


def section(r: dict) -> str:
    """Its section of BENCHMARKS.md."""
    out = (
        "## 3. Start-up: command to first completed step\n\nrayhybrid's command line against Ray Train's "
        "`TorchTrainer` (`benchmarks/baselines/raytrain_train.py`: DDP, the same model, data and optimizer) "
        "with as many workers; each starts a fresh local Ray. Tiny default model, 2 steps.\n\n"
    )
    out += header(r)
    if "rows" in r:
        out += table(
            [
                "ranks",
                "rayhybrid (s)",
                "Ray Train (s)",
                "Ray Train / rayhybrid",
                "CPU per rank, ranks x it / cores (s)",
                "rayhybrid's start-up (s)",
                "Ray Train's start-up (s)",
            ],
            [
                [
                    str(x["ranks"]),
                    fmt(x["rayhybrid_s"], 1),
                    fmt(x["raytrain_s"], 1),
                    fmt(x["raytrain_s"] / x["rayhybrid_s"]) + "x",
                    _cpu(x),
                    ", ".join(
                        f"{k.replace('_', ' ')} {fmt(v, 1)}" for k, v in (x.get("rayhybrid_startup") or {}).items()
                    ),
                    ", ".join(
                        f"{k[:-2].replace('_', ' ')} {fmt(v, 1)}"
                        for k, v in (x.get("raytrain_startup") or {}).items()
                        if v is not None
                    ),
                ]
                for x in r["rows"]
            ],
        )
        out += (
            "*CPU per rank* is what each rank's process had used by the first step's record (/proc, the pids of "
            "workers.json; the mean over ranks): its Ray worker's start, its imports, the model's build and the "
            "first step. With every core busy (one rank per core or more), ranks x it / cores is the least time "
            "the ranks' own work takes on this machine, after the driver's launch and Ray's start. "
            "rayhybrid's start-up is summary.json's `startup` (docs/observability.md#start-up): its phases add up to "
            "the command's start to the end of its first step, as the driver measures it. "
            "In Ray Train's columns *start group* (the controller starting the worker group) includes *last proc "
            "started* (its processes spawned) and the torch process group's set-up; *build model* is the workers "
            "importing torch and building the model, all at once on the same cores.\n\n"
        )
    return out


def summary(r: dict) -> str:
    """Its line of the printed table (after its name): the figures that matter."""
    return "  ".join(
        f"{x['ranks']} ranks: rayhybrid {x['rayhybrid_s']:.1f}s, Ray Train {x['raytrain_s']:.1f}s" for x in r["rows"]
    )
