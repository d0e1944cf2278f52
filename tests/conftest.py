"""Test set-up: the repository root on sys.path (for `rayhybrid` and `tests.distributed`,
also under a plain `pytest`, and in the spawned rank processes, which inherit sys.path) and
the `gpu` marker. No Ray here."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (NCCL, CUDA memory); skipped without one")
    config.addinivalue_line(
        "markers",
        "slow: a test of seconds to minutes (Ray clusters, recovery, the soak); "
        'the quick tier is `python -m pytest -m "not slow"`',
    )
