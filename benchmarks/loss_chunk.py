"""train.loss_chunk on CPU, A/B in one process: Llama debug with a 32k vocabulary, seq 256,
micro-batch 8 (2,048 tokens), one gloo rank. Tokens/s of steps 2 on, the trainers alternating
A B B A, and the memory meter's steady peak (metrics.memory=true, steps 2 and 3) with the loss
whole (0) and in chunks.

    PYTHONPATH=$PWD python benchmarks/loss_chunk.py [--steps 5] [--rounds 2] [--chunks 0,1024,256]
"""

from __future__ import annotations

import argparse
import socket
import statistics

import torch

from rayhybrid.parallel.mesh import init_process_group
from rayhybrid.preflight import load_config

BASE = [
    "model=llama3_debug",
    "model.vocab_size=32768",
    "data.seq_len=256",
    "train.micro_batch_size=8",
    "train.global_batch_size=8",
]


def measure(chunks: list[int], steps: int, rounds: int) -> tuple[dict[int, float], dict[int, float]]:
    """(median tokens/s, steady peak MB) per chunk setting, on this process's one rank."""
    from rayhybrid.trainer.loop import Trainer

    cpu = torch.device("cpu")
    speed: dict[int, list[float]] = {c: [] for c in chunks}
    for r in range(rounds):
        for chunk in chunks if r % 2 == 0 else chunks[::-1]:
            tr = Trainer(load_config([*BASE, f"train.loss_chunk={chunk}"]), rank=0, device=cpu)
            speed[chunk] += [tr.train_step().metrics["tokens_per_s"] for _ in range(steps)][1:]
            del tr
    peaks = {}
    for chunk in chunks:
        tr = Trainer(load_config([*BASE, f"train.loss_chunk={chunk}", "metrics.memory=true"]), rank=0, device=cpu)
        step_peaks = [max(tr.train_step().metrics["peak_mb"].values()) for _ in range(3)]
        peaks[chunk] = min(step_peaks[1:])  # with AdamW's state (made by the first step)
        del tr
    return {c: statistics.median(v) for c, v in speed.items()}, peaks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--chunks", default="0,1024,256")
    args = parser.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]
    torch.set_num_threads(2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_process_group(rank=0, world_size=1, master_addr="127.0.0.1", master_port=port, device=torch.device("cpu"))
    speed, peaks = measure(chunks, args.steps, args.rounds)
    for c in chunks:
        print(
            f"loss_chunk={c:5d}: {speed[c]:8.0f} tokens/s ({speed[c] / speed[chunks[0]]:.3f}x), peak {peaks[c]:7.1f} MB"
        )


if __name__ == "__main__":
    main()
