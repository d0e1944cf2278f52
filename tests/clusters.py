"""Ray heads for tests: `ray start --head` in a process group of its own (`ray_start_head`).
Clusters of several raylets on one machine are benchmarks/clusters.py's (`local_cluster`,
`add_node`, `lose_power`), which the benchmarks use as well.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path


@contextlib.contextmanager
def ray_start_head(args: list[str], env: dict, log_dir: Path, ports: list[int]):
    """`ray start --head --block ARGS` in a process group of its own, until every port in
    `ports` accepts connections; stopped by that group afterwards (never `ray stop`, which
    would kill every Ray on the machine)."""
    temp = Path("/tmp") / f"rh-{uuid.uuid4().hex[:8]}"  # short: Ray's socket paths have a length limit
    cmd = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", f"--temp-dir={temp}", *args]
    log_path = log_dir / f"head-{ports[0]}.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(OSError):
                for port in ports:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the head did not start"
            time.sleep(0.5)
        yield
    finally:
        # `ray start --block` outlives a SIGTERM by 15 s or more (measured: the whole 15 s wait
        # every time), while its raylet and GCS, in the same group, go at once; the group's
        # SIGKILL after a short grace ends what is left the same way, 12 s sooner per head.
        for sig, grace in ((signal.SIGTERM, 3), (signal.SIGKILL, 15)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace)
        log.close()
