"""Train the GPT on local text files (byte-level tokens) with a chosen topology.

    python examples/train_on_text.py                                   # Python's own json/*.py sources, pp2_tp2
    python examples/train_on_text.py --path '~/books/*.txt' --topology dp2_pp2_tp2 --steps 300

Nothing is downloaded: by default the text is the source of Python's `json` package, which
every Python installation has. Any rayhybrid override can follow `--`, e.g.
`-- model.n_layers=8 train.lr=1e-3`.
"""

from __future__ import annotations

import argparse
import json
import os

import rayhybrid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--path",
        default=os.path.join(os.path.dirname(json.__file__), "*.py"),
        help="a text file, a directory of *.txt files or a glob (default: Python's json/*.py)",
    )
    parser.add_argument("--topology", default="pp2_tp2", help="a topology preset, e.g. dp2, pp2_tp2, dp2_pp2_tp2")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--run-dir", default=None, help="where outputs go (default: outputs/<date>/<time>)")
    parser.add_argument("overrides", nargs="*", help="more rayhybrid overrides, after --")
    args = parser.parse_args()

    summary = rayhybrid.train(
        [
            f"+topology={args.topology}",
            "data=text",
            f"data.path={args.path}",
            "data.seq_len=64",
            f"train.steps={args.steps}",
            *args.overrides,
        ],
        run_dir=args.run_dir,
    )
    print(
        f"{summary['status']}: loss {summary['initial_loss']:.3f} -> {summary['final_loss']:.3f} "
        f"({summary['final_loss'] / 0.6931:.2f} bits/byte) in {summary['wall_s']:.0f}s; outputs in {summary['run_dir']}"
    )


if __name__ == "__main__":
    main()
