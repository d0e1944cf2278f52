"""Ray heads for tests: `ray start --head` in a process group of its own (`ray_start_head`).
Clusters of several raylets on one machine are benchmarks/clusters.py's (`local_cluster`,
`add_node`, `lose_power`), which the benchmarks use as well. Also what the fault tests do to a
node's or a standby's processes from outside: `node_pids`, `signal_all`, `gone`,
`fenced_line`, `warm_standbys` (tests/test_fencing.py, test_standby.py, test_soak.py).
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

import ray

from rayhybrid.cluster.standby import NAME_PREFIX


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


def node_pids(node) -> set[int]:
    """Every process of a `Cluster` node: the ones it started (raylet, log monitor, ...) and
    all their descendants (its agents and workers)."""
    roots = {info.process.pid for infos in node.all_processes.values() for info in infos if info.process}
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(parents.get(pid, []))
    return found


def signal_all(pids: set[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie its (stopped) parent has not reaped."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def fenced_line(pid: int) -> bool:
    """Whether the worker `pid` logged its refusal (its stderr file in Ray's session logs)."""
    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    return any("fenced off" in p.read_text(errors="replace") for p in logs.glob(f"worker-*-{pid}.err"))


def warm_standbys(timeout: float = 120, but: frozenset = frozenset()) -> dict[str, int]:
    """name -> pid of the run's warm standbys (named actors), once at least one (not in `but`) is."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        names = [n for n in ray.util.list_named_actors() if n.startswith(NAME_PREFIX) and n not in but]
        pids = {}
        for name in names:
            try:
                pids[name] = ray.get(ray.get_actor(name).warm.remote(), timeout=timeout)
            except (ValueError, ray.exceptions.RayError):  # gone meanwhile (taken over, killed)
                continue
        if pids:
            return pids
        time.sleep(0.1)
    raise TimeoutError("no warm standby")
