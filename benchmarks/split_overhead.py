"""What the MFU split costs a step (rayhybrid/trainer/split.py), A/B in one invocation:

    python benchmarks/split_overhead.py [topology ...]     # default: tp2 pp2 dp2

For each topology, two gloo ranks on CPU (spawned here, no Ray) train the same model; rounds of
steps alternate, A B B A ..., between the split measured (A: the step clock on, its waits
hooked) and not (B: the clock off and torch's functions as they were), so a slow spell of the
machine does not favour one. Prints each topology's median step time both ways and their
ratio, and the clock's own cost: the parts (and hooked waits) a step opens, and a part's
cost in a tight loop. Not part of the suite (benchmarks/suite.py): a check of one feature.
"""

from __future__ import annotations

import json
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ROUNDS, STEPS = 24, 2
MODEL = ["train.global_batch_size=16", "train.micro_batch_size=2", "data.seq_len=64"]


def hooks() -> list[tuple[object, str]]:
    """Where `split.install` hooked torch: (owner, attribute)."""
    import importlib

    from rayhybrid.trainer.split import HOOKS

    found = []
    for module, owner, names, _, _ in HOOKS:
        target = importlib.import_module(module)
        target = getattr(target, owner) if owner else target
        found += [(target, name) for name in names]
    return found


def switch(trainer, on: bool, saved: dict) -> None:
    """A: the clock and the hooks; B: neither (torch's own functions back in place)."""
    from rayhybrid.trainer import split

    for owner, name in hooks():
        current = getattr(owner, name)
        saved.setdefault((owner, name), (current, getattr(current, "__wrapped__", current)))
        setattr(owner, name, saved[(owner, name)][0 if on else 1])
    clock = trainer.timeline.clock
    clock.begin = type(clock).begin.__get__(clock) if on else (lambda: None)
    split.ACTIVE = None


def rank_main(rank: int, world: int, port: int, topology: str, out: str) -> None:
    from rayhybrid.parallel.mesh import init_process_group
    from rayhybrid.preflight import load_config
    from rayhybrid.trainer.loop import Trainer

    torch.set_num_threads(1)
    init_process_group(
        rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port, device=torch.device("cpu")
    )
    cfg = load_config([f"topology={topology}", *MODEL])
    trainer = Trainer(cfg, rank=rank, device=torch.device("cpu"))
    for _ in range(2):  # warm-up
        trainer.train_step()
    times: dict[str, list[float]] = {"A": [], "B": []}
    saved: dict = {}
    parts = count_parts(trainer)
    for r in range(ROUNDS):
        mode = "A" if r % 4 in (0, 3) else "B"
        switch(trainer, mode == "A", saved)
        times[mode] += [trainer.train_step().metrics["step_time_s"] for _ in range(STEPS)]
    switch(trainer, True, saved)
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "parts_per_step": parts}))


def count_parts(trainer) -> int:
    """The parts (hooked waits included) one step opens."""
    clock = trainer.timeline.clock
    counted = [0]
    enter = clock.enter

    def counting(name, comm):
        counted[0] += 1
        enter(name, comm)

    clock.enter = counting
    trainer.train_step()
    del clock.enter
    return counted[0]


def part_cost_us(n: int = 200_000) -> float:
    """One part opened and closed on a running clock, in microseconds (a tight loop)."""
    from rayhybrid.trainer.split import StepClock

    clock = StepClock()
    clock.begin()
    part = clock.part("compute")
    start = time.perf_counter()
    for _ in range(n):
        with part:
            pass
    cost = (time.perf_counter() - start) / n * 1e6
    clock.end()
    return cost


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(topologies: list[str]) -> None:
    import tempfile

    cost = part_cost_us()
    print(f"a part (enter and leave) on a running clock: {cost:.2f} us")
    for topology in topologies:
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "times.json")
            mp.spawn(rank_main, args=(2, free_port(), topology, out), nprocs=2, join=True)
            result = json.loads(Path(out).read_text())
        a, b = (statistics.median(result["times"][m]) for m in ("A", "B"))
        parts = result["parts_per_step"]
        print(
            f"{topology}: split on {a * 1e3:.2f} ms, off {b * 1e3:.2f} ms, ratio {a / b:.4f} "
            f"({len(result['times']['A'])} steps each; {parts} parts a step, about {parts * cost / 1e3:.3f} ms "
            f"= {parts * cost / 1e6 / b:.2%} of a step by the tight loop)"
        )


if __name__ == "__main__":
    main(sys.argv[1:] or ["tp2", "pp2", "dp2"])
