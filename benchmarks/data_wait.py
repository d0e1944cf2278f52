"""How long each step waits for its data, per kind of data: one rank in this process (gloo on
CPU, no Ray), a model whose step is tens of milliseconds, as on a GPU's step of the issue
(39: 0.37 s steps of Llama 3.2 1B waited 30-70 ms for synthetic samples).

    PYTHONPATH=. python benchmarks/data_wait.py                    # every kind, 40 steps each
    PYTHONPATH=<old checkout> python benchmarks/data_wait.py       # the same against older code
    python benchmarks/data_wait.py synthetic --steps 60 -- data.seq_len=128

Prints, per kind: the median step time, the mean data wait, and the data wait as a share of the
step time (sum of waits / sum of step times), over the steps after the first (whose batch no
step before it could read ahead). Only `Trainer` and `train_step` are used, so it runs against
any rayhybrid since data_wait_s was a metric.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

MODEL = ["model=gpt_tiny", "data.seq_len=64", "train.global_batch_size=16", "train.micro_batch_size=16"]
KINDS = ("synthetic", "text", "tokens", "prepared")


def data_settings(kind: str, tmp: Path) -> list[str]:
    """The overrides that train on `kind`, with its data written under `tmp`."""
    rng = np.random.default_rng(0)
    if kind == "text":
        (tmp / "corpus.txt").write_bytes(bytes(rng.integers(32, 127, 1 << 20, dtype=np.uint8)))
        return ["data=text", f"data.path={tmp / 'corpus.txt'}"]
    if kind == "tokens":
        np.save(tmp / "tokens.npy", rng.integers(0, 256, 1 << 20, dtype=np.uint16))
        return ["data=tokens", f"data.path={tmp / 'tokens.npy'}"]
    if kind == "prepared":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from prepared import write_dataset  # the tests' writer of prepared datasets

        docs = [rng.integers(1, 256, int(n)).tolist() for n in rng.integers(50, 2000, 1000)]
        return ["data=prepared", f"data.path={write_dataset(tmp / 'ds', docs, vocab_size=256)}"]
    return ["data=synthetic"]


def measure(overrides: list[str], steps: int) -> dict:
    from rayhybrid.preflight import load_config
    from rayhybrid.trainer.loop import Trainer

    trainer = Trainer(load_config(overrides), rank=0, device=torch.device("cpu"))
    records = [trainer.train_step().metrics for _ in range(steps)][1:]
    trainer.stream.close()
    waits, times = [r["data_wait_s"] for r in records], [r["step_time_s"] for r in records]
    return {
        "step_ms": 1000 * statistics.median(times),
        "wait_ms": 1000 * statistics.mean(waits),
        "wait_pct": 100 * sum(waits) / sum(times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kinds", nargs="*", default=list(KINDS))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("overrides", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    extra = [o for o in args.overrides if o != "--"]
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.kinds:
            r = measure([*MODEL, *data_settings(kind, Path(tmp)), *extra], args.steps)
            print(
                f"{kind:10s} step {r['step_ms']:6.1f} ms | data wait {r['wait_ms']:6.3f} ms | "
                f"{r['wait_pct']:5.2f}% of step time"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
