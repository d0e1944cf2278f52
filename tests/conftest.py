"""Test set-up: the repository root on sys.path (for `rayhybrid` and `tests.distributed`,
also under a plain `pytest`, and in the spawned rank processes, which inherit sys.path) and
the `gpu` marker. No Ray here."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# No run in the tests probes a real cloud's metadata server for spot notices (cluster.spot_notices):
# the discard port on loopback, where nothing listens. Tests of the watcher point these at their
# own fake servers.
os.environ.setdefault("RAYHYBRID_AWS_METADATA_URL", "http://127.0.0.1:9")
os.environ.setdefault("RAYHYBRID_GCP_METADATA_URL", "http://127.0.0.1:9")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (NCCL, CUDA memory); skipped without one")
    config.addinivalue_line(
        "markers",
        "slow: a test of seconds to minutes (Ray clusters, recovery, the soak); "
        'the quick tier is `python -m pytest -m "not slow"`',
    )
