"""train.loss_chunk on CPU, A/B in one process: Llama debug with a 32k vocabulary, seq 256,
micro-batch 8 (2,048 tokens), one gloo rank. Tokens/s of steady steps, the runs alternating
A B B A, and the memory meter's peak (metrics.memory=true) with the loss whole and in chunks.

    PYTHONPATH=$PWD python benchmarks/loss_chunk.py [--steps 6] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from distributed import run_ranks  # tests/distributed.py: one gloo rank per process

BASE = [
    "model=llama3_debug",
    "model.vocab_size=32768",
    "data.seq_len=256",
    "train.micro_batch_size=8",
    "train.global_batch_size=8",
]


def _measure(rank: int, chunks: list[int], steps: int, rounds: int) -> dict:
    import torch

    from rayhybrid.preflight import load_config
    from rayhybrid.trainer.loop import Trainer

    torch.set_num_threads(2)
    speed: dict[int, list[float]] = {c: [] for c in chunks}
    order = [c for r in range(rounds) for c in (chunks if r % 2 == 0 else chunks[::-1])]
    for chunk in order:
        tr = Trainer(load_config([*BASE, f"train.loss_chunk={chunk}"]), rank=rank, device=torch.device("cpu"))
        speed[chunk] += [tr.train_step().metrics["tokens_per_s"] for _ in range(steps)][1:]
    peaks = {}
    for chunk in chunks:
        cfg = load_config([*BASE, f"train.loss_chunk={chunk}", "metrics.memory=true"])
        tr = Trainer(cfg, rank=rank, device=torch.device("cpu"))
        peaks[chunk] = min(max(tr.train_step().metrics["peak_mb"].values()) for _ in range(2))
    return {"tokens_per_s": {c: statistics.median(v) for c, v in speed.items()}, "peak_mb": peaks}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--chunks", default="0,1024")
    args = parser.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]
    (result,) = run_ranks(_measure, 1, chunks, args.steps, args.rounds, timeout=1800)
    base = result["tokens_per_s"][chunks[0]]
    for c in chunks:
        tps, peak = result["tokens_per_s"][c], result["peak_mb"][c]
        print(f"loss_chunk={c:5d}: {tps:8.0f} tokens/s ({tps / base:.3f}x), peak {peak:8.1f} MB")


if __name__ == "__main__":
    main()
