"""Baseline: rayhybrid's own `Trainer` (same model, same dp x pp x tp) launched by torchrun, no Ray.

    torchrun --standalone --nproc-per-node 2 benchmarks/baselines/torchrun_train.py +topology=dp2 --steps 5
    torchrun --standalone --nproc-per-node 8 benchmarks/baselines/torchrun_train.py +topology=dp2_pp2_tp2 --steps 5

Every argument but `--steps S` is a rayhybrid override (as for `python -m rayhybrid`); the
topology must give dp * pp * tp == --nproc-per-node. Each process runs one torch thread on CPU
(gloo). Rank 0 prints one JSON object on the last line of stdout:

    {"launcher": "torchrun", "world_size", "topology", "step_times_s", "losses",
     "step_walls", "start_wall", "agent_start_wall", "init_done_wall", "trainer_built_wall", "first_step_wall",
     "end_wall"}

`start_wall` is the earliest `time.time()` at which any rank began executing this script;
`agent_start_wall` the creation time of the torchrun agent process (this process's parent),
when it can be read. All walls are `time.time()` seconds (comparable with the caller's).
"""

import time

START_WALL = time.time()  # before any heavy import

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported

import argparse
import json
import logging
import sys
import warnings


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps to run")
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if o.startswith("-")]
    if bad:
        parser.error(f"unknown option(s) {bad}; everything but --steps must be a rayhybrid override")
    return args, overrides


def agent_start_wall():
    """Creation time of the parent (torchrun's agent) from /proc (Linux), else None."""
    try:
        with open(f"/proc/{os.getppid()}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)  # /proc/stat's btime is whole seconds
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def main(argv=None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if key not in os.environ:
            print(
                f"torchrun_train: error: ${key} is not set; launch with torchrun (see the docstring)", file=sys.stderr
            )
            return 2
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    import torch
    import torch.distributed as dist

    from rayhybrid.errors import ConfigError
    from rayhybrid.parallel.mesh import init_process_group
    from rayhybrid.preflight import load_config
    from rayhybrid.trainer.loop import Trainer

    torch.set_num_threads(1)
    # The same warnings rayhybrid's workers silence (cluster/worker.py).
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")

    try:
        cfg = load_config(overrides)
    except ConfigError as err:
        print(f"torchrun_train: error: {err}", file=sys.stderr)
        return 2
    t = cfg.topology
    if t.dp * t.pp * t.tp != world_size:
        print(  # every rank finds this; torchrun shows each one's exit code 2
            f"torchrun_train: error: topology dp={t.dp} x pp={t.pp} x tp={t.tp} = {t.dp * t.pp * t.tp} ranks, "
            f"but torchrun started WORLD_SIZE={world_size}; pass --nproc-per-node {t.dp * t.pp * t.tp} "
            f"or a topology override (e.g. +topology=dp2) whose product is {world_size}",
            file=sys.stderr,
        )
        return 2

    device = torch.device("cpu")
    init_process_group(
        rank=rank,
        world_size=world_size,
        master_addr=os.environ["MASTER_ADDR"],
        master_port=int(os.environ["MASTER_PORT"]),
        device=device,
    )
    init_done = time.time()
    trainer = Trainer(cfg, rank=rank, device=device)
    built = time.time()

    step_times, losses, walls, first_step_wall = [], [], [], None
    for _ in range(args.steps):
        metrics = trainer.train_step().metrics
        if first_step_wall is None:
            first_step_wall = time.time()
        walls.append(time.time())
        step_times.append(metrics["step_time_s"])
        losses.append(metrics["loss"])
        if rank == 0:
            print(
                f"step {metrics['step']} loss {metrics['loss']:.6f} time {metrics['step_time_s']:.3f}s", file=sys.stderr
            )

    # The earliest start of any rank (all ranks are started by the same agent, nearly at once).
    starts = [None] * world_size
    dist.all_gather_object(starts, START_WALL)
    # No destroy_process_group: the process ends with os._exit below (see there).
    if rank == 0:
        result = {
            "launcher": "torchrun",
            "world_size": world_size,
            "topology": {"dp": t.dp, "pp": t.pp, "tp": t.tp, "schedule": t.schedule},
            "steps": args.steps,
            "step_times_s": step_times,
            "losses": losses,
            "step_walls": walls,
            "start_wall": min(starts),
            "agent_start_wall": agent_start_wall(),
            "init_done_wall": init_done,
            "trainer_built_wall": built,
            "first_step_wall": first_step_wall,
            "end_wall": time.time(),
        }
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    # The result is out; skip the interpreter's teardown, where a pipeline's idle gloo threads
    # have been seen to abort the process ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
