"""`from_run=<run dir>`: the costs of a real rayhybrid run, scaled to the simulated size.

    cfg, measured = apply_run(cfg, given(argv))   # costs.* from the run, unless given

The medians of the run's `metrics.jsonl` records (each figure's own median) are turned into
`costs.*` for a job of `gpus` GPUs; W is the run's ranks (dp x pp x tp of its last step
record), N the simulated job's GPUs, b and B the checkpoint bytes per rank of the run and of
the simulated job:

    detect_s  = detect_s                                 size-independent (assumed)
    replace_s = teardown_s + place_s                     size-independent (assumed)
                + init_s x log2(N) / log2(W)             grows with log2 of the ranks (assumed)
                + max(restore_s x B / b, bytes / storage)  per-rank bandwidth kept (assumed)
                + max(0, first_step_s - step_time_s)     the first step's warm-up
    restart_s = replace_s                                rayhybrid measures only its own recovery
    heal_s    = the same, from the restarts healed from peers, their transfer scaled like a
                restore but with no storage floor (network, per rank)

replace_s comes from the restarts that restored a checkpoint (all of them, for a run without
that record field or without such a restart); heal_s keeps its setting when no restart healed.
    save_s    = blocked_s x B / b                        (a synchronous save: at least bytes / storage)
    step_s    = step_time_s                              same work per replica (assumed)

The checkpoint's bytes are the sizes in the newest committed checkpoint's meta.json ("files"),
found by rayhybrid's own `checkpoints.latest` (any store) under summary.json's checkpoint_dir;
`costs.checkpoint_gb` is the simulated model's, else the run's. Without a readable meta.json,
restore and save are not scaled. Costs given on the command line are kept as given. A record
without a figure this reads (a restart's timings, a reported save's upload_s and async, the last
step's dp, pp and tp) is a ConfigError naming the field, never a cost of 0.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path

from rayhybrid.config.goodput import GoodputConfig
from rayhybrid.errors import ConfigError
from rayhybrid.storage import checkpoints as checkpoint_store

FIX = "give the directory of a rayhybrid run with at least one restart (its metrics.jsonl has restart records)"
MEASURED = ("detect_s", "teardown_s", "place_s", "init_s", "restore_s", "first_step_s")
SAVE_FIELDS = ("upload_s", "async")
"""What a checkpoint record that reports its save (blocked_s not null) must hold besides."""


def fail(message: str) -> ConfigError:
    return ConfigError("from_run", f"{message}; {FIX}")


def read_records(run_dir: Path) -> list[dict]:
    """metrics.jsonl's records; a ConfigError naming from_run when there is none to read."""
    path = run_dir / "metrics.jsonl"
    if not run_dir.is_dir():
        raise fail(f"{run_dir} is not a directory")
    try:
        lines = path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise fail(f"cannot read {path} ({type(err).__name__})") from None


def holds(key: str, value: object) -> bool:
    """A figure from_run reads: a number (never a boolean), or for "async" a boolean."""
    return (
        isinstance(value, bool) if key == "async" else isinstance(value, (int, float)) and not isinstance(value, bool)
    )


def require(path: Path, records: list[dict], kind: str, fields: tuple[str, ...]) -> None:
    """Every record holds each of `fields`; else a ConfigError naming the first field missing:
    a missing figure is never taken as 0."""
    for record in records:
        for key in (k for k in fields if not holds(k, record.get(k))):
            what = "has no" if key not in record else f"has {json.dumps(record[key])} for"
            which = f"restart {record.get('restart', '?')}" if kind == "restart" else f"step {record.get('step', '?')}"
            raise ConfigError(
                "from_run",
                f"{path}: the {kind} record of {which} {what} {key!r}; "
                f"give a run whose {kind} records hold {', '.join(fields)} (as this rayhybrid writes them)",
            )


def median(records: list[dict], key: str) -> float:
    values = [float(r[key]) for r in records]
    return statistics.median(values) if values else 0.0


def measured_records(run_dir: Path, records: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """The restart records, the checkpoint records that report their save, the step records;
    a ConfigError when there is no restart, or a record lacks a figure this reads."""
    restarts = [r for r in records if r.get("event") == "restart"]
    saves = [r for r in records if r.get("event") == "checkpoint" and r.get("blocked_s") is not None]
    steps = [r for r in records if "event" not in r and "step_time_s" in r]
    path = run_dir / "metrics.jsonl"
    if not restarts:
        raise fail(f"{path} has no restart records")
    require(path, restarts, "restart", MEASURED)
    require(path, saves, "checkpoint", SAVE_FIELDS)
    require(path, steps[-1:], "step", ("dp", "pp", "tp"))
    return restarts, saves, steps


def committed_meta(run_dir: Path, checkpoints: list[dict]) -> tuple[str, dict] | None:
    """The newest committed, complete checkpoint's (path, meta.json) of the run, or None: found
    by rayhybrid's own `checkpoints.latest` under summary.json's checkpoint_dir (else the
    directory of the newest checkpoint record's path), on any store the run used."""
    try:
        root = json.loads((run_dir / "summary.json").read_text()).get("checkpoint_dir") or ""
    except (OSError, ValueError):
        root = ""
    paths = [r["path"] for r in sorted(checkpoints, key=lambda r: r.get("step", 0)) if r.get("path")]
    root = root or (paths[-1].rstrip("/").rsplit("/", 1)[0] if paths else "")
    try:
        found = checkpoint_store.latest(root) if root else None
    except (OSError, ValueError):  # a store this machine cannot reach: restore and save unscaled
        return None
    return (found.path, found.meta) if found is not None else None


def apply_run(cfg: GoodputConfig, given: set[str]) -> tuple[GoodputConfig, dict]:
    """cfg with the run's costs scaled to the GPUs the job uses (whole replicas), except those
    in `given`; and what was measured and how it was scaled (goodput.json's "from_run")."""
    gpus = cfg.gpus // cfg.replica_gpus * cfg.replica_gpus
    run_dir = Path(cfg.from_run).expanduser()
    records = read_records(run_dir)
    restarts, saves, steps = measured_records(run_dir, records)
    last = steps[-1] if steps else {}
    ranks = int(last.get("dp", 1)) * int(last.get("pp", 1)) * int(last.get("tp", 1))
    healed = [r for r in restarts if r.get("healed") == "peer"]
    restored = [r for r in restarts if r.get("healed") != "peer"] or restarts
    m = {key: median(restored, key) for key in MEASURED}
    h = {key: median(healed, key) for key in MEASURED}
    m["step_time_s"] = median(steps, "step_time_s")
    m["blocked_s"], m["upload_s"] = median(saves, "blocked_s"), median(saves, "upload_s")

    found = committed_meta(run_dir, [r for r in records if r.get("event") == "checkpoint"])
    run_bytes = sum(found[1]["files"].values()) if found else 0
    sim_bytes = cfg.costs.checkpoint_gb * 1e9 or run_bytes
    per_rank = (sim_bytes / gpus) / (run_bytes / ranks) if run_bytes else 1.0
    floor = sim_bytes / (cfg.costs.storage_gbps * 1e9) if cfg.costs.storage_gbps and sim_bytes else 0.0
    growth = math.log2(max(gpus, 2)) / math.log2(max(ranks, 2))
    sync = not any(r.get("async") for r in saves)

    def recovery(p: dict, transfer: float) -> float:
        return (
            p["teardown_s"]
            + p["place_s"]
            + p["init_s"] * growth
            + transfer
            + max(0.0, p["first_step_s"] - m["step_time_s"])
        )

    costs = {
        **({"heal_s": recovery(h, h["restore_s"] * per_rank)} if healed else {}),
        "detect_s": m["detect_s"],
        "replace_s": recovery(m, max(m["restore_s"] * per_rank, floor)),
        "restart_s": recovery(m, max(m["restore_s"] * per_rank, floor)),
        "save_s": max(m["blocked_s"] * per_rank, floor if sync else 0.0) if saves else cfg.costs.save_s,
        "step_s": m["step_time_s"] or cfg.costs.step_s,
    }
    kept = {k: v for k, v in costs.items() if f"costs.{k}" not in given}
    measured = {
        "run_dir": str(run_dir),
        "records": {"restart": len(restarts), "healed": len(healed), "checkpoint": len(saves), "step": len(steps)},
        "ranks": ranks,
        "replica_ranks": int(last.get("pp", 1)) * int(last.get("tp", 1)),
        "medians": {k: round(v, 3) for k, v in m.items()},
        **({"heal_medians": {k: round(v, 3) for k, v in h.items()}} if healed else {}),
        "checkpoint": {"path": found[0] if found else None, "bytes": run_bytes, "simulated_bytes": sim_bytes},
        "scale": {"init_log2_ranks": round(growth, 4), "bytes_per_rank": per_rank, "storage_floor_s": floor},
        "costs": {k: round(v, 3) for k, v in kept.items()},
        "given": sorted(f"costs.{k}" for k in costs if f"costs.{k}" in given),
    }
    return dataclasses.replace(cfg, costs=dataclasses.replace(cfg.costs, **kept)), measured


GOODPUT_FIX = "give the directory of a run that ended and recorded its goodput (summary.json's goodput)"


def run_goodput(run_dir: Path) -> dict:
    """The run's measured goodput, summary.json's `goodput` ({"seconds": {cause: s}, "wall_s",
    "effective_time", "processes"}, the driver's wall-clock record); a ConfigError naming
    from_run when it is not there."""
    path = run_dir / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ConfigError("from_run", f"cannot read {path} ({type(err).__name__}); {GOODPUT_FIX}") from None
    goodput = summary.get("goodput") if isinstance(summary, dict) else None
    complete = isinstance(goodput, dict) and isinstance(goodput.get("seconds"), dict)
    if not complete or not all(holds(k, goodput.get(k)) for k in ("wall_s", "effective_time")):
        raise ConfigError(
            "from_run", f"{path} has no goodput (seconds by cause, wall_s, effective_time); {GOODPUT_FIX}"
        )
    return goodput


def own_size(cfg: GoodputConfig, measured: dict, wall_s: float) -> GoodputConfig:
    """The simulator's settings for the run itself: its ranks, in replicas of its pp x tp ranks,
    over its wall time, with its own costs unscaled (the run's checkpoint, no storage floor, no
    cost from the command line); the failure setting is the command line's."""
    ranks, replica = measured["ranks"], measured["replica_ranks"]
    own = dataclasses.replace(
        cfg,
        gpus=ranks,
        replica_gpus=replica,
        gpus_per_node=math.gcd(cfg.gpus_per_node, replica),
        days=wall_s / 86400.0,
        costs=dataclasses.replace(cfg.costs, checkpoint_gb=0.0, storage_gbps=0.0),
        elastic=dataclasses.replace(cfg.elastic, min_dp=min(cfg.elastic.min_dp, ranks // replica)),
    )
    return apply_run(own, set())[0]
