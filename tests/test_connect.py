"""Connecting to a Ray cluster someone started with `ray start --head`, as README.md says:
with token authentication (Ray 2.60 turns it on when a token exists) and without, by
`cluster.address=ip:port` and by RAY_ADDRESS; and the one-line errors for a wrong token and
for an address where nothing listens.

Each head runs in a process group of its own, with HOME in a temporary directory (its
~/.ray/auth_token is the token "available locally"), and is stopped by that group: never
`ray stop`, which would kill every Ray on the machine."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.test_cli import assert_one_line_error, run_cli

pytestmark = pytest.mark.slow

RUN = [
    "train.steps=2",
    "checkpoint.every=0",
    "data.seq_len=32",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def home_with_token(root: Path) -> Path:
    home = root / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text(uuid.uuid4().hex)
    return home


@contextlib.contextmanager
def ray_head(tmp: Path, home: Path, auth: bool):
    """`ray start --head --block` on a free port; yields its address ip:port."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["HOME"] = str(home)
    if not auth:
        env["RAY_AUTH_MODE"] = "disabled"
    ray = Path(sys.executable).parent / "ray"
    cmd = [str(ray), "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false", "--block"]
    temp = Path("/tmp") / f"rh-{uuid.uuid4().hex[:8]}"  # short: Ray's socket paths have a length limit
    cmd.append(f"--temp-dir={temp}")
    log = open(tmp / f"head-{port}.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert proc.poll() is None, (tmp / f"head-{port}.log").read_text()
            assert time.monotonic() < deadline, "the head did not start"
            time.sleep(0.5)
        yield f"127.0.0.1:{port}"
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=15)
        log.close()


def cli(args: list[str], tmp: Path, home: Path, **env: str) -> subprocess.CompletedProcess:
    return run_cli(args, cwd=tmp, timeout=240, env_extra={"HOME": str(home), **env})


def completed(proc: subprocess.CompletedProcess, run_dir: Path) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 2
    return summary


@pytest.fixture(scope="module")
def token_head(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("token-head")
    home = home_with_token(tmp)
    with ray_head(tmp, home, auth=True) as address:
        yield address, home


def test_token_cluster_by_cluster_address(token_head, tmp_path):
    """The issue's case: a head with token authentication, the token in ~/.ray/auth_token, and
    an explicit ip:port (Ray turns token mode on for "auto" only)."""
    address, home = token_head
    proc = cli([*RUN, f"cluster.address={address}", f"hydra.run.dir={tmp_path}/run"], tmp_path, home)
    completed(proc, tmp_path / "run")


def test_token_cluster_by_ray_address(token_head, tmp_path):
    address, home = token_head
    proc = cli([*RUN, f"hydra.run.dir={tmp_path}/run"], tmp_path, home, RAY_ADDRESS=address)
    completed(proc, tmp_path / "run")


def test_wrong_token_is_one_line_naming_the_token_setting(token_head, tmp_path):
    address, home = token_head
    start = time.monotonic()
    proc = cli(
        [*RUN, f"cluster.address={address}", f"hydra.run.dir={tmp_path}/run"], tmp_path, home, RAY_AUTH_TOKEN="0" * 32
    )
    assert_one_line_error(proc, "RAY_AUTH_TOKEN", address, "refused the token", "ray get-auth-token")
    assert time.monotonic() - start < 60  # not Ray's 20 s of retries and a traceback


def test_cluster_without_authentication_while_a_token_exists(tmp_path):
    home = home_with_token(tmp_path)  # a token here must not make the driver insist on it
    with ray_head(tmp_path, home, auth=False) as address:
        proc = cli([*RUN, f"cluster.address={address}", f"hydra.run.dir={tmp_path}/run"], tmp_path, home)
        completed(proc, tmp_path / "run")


@pytest.mark.parametrize("how", ["cluster.address", "RAY_ADDRESS"])
def test_nothing_listening_exits_2_within_the_timeout(tmp_path, how):
    address = f"127.0.0.1:{free_port()}"  # free: nothing listens there
    args = ["cluster.connect_timeout_s=3", f"hydra.run.dir={tmp_path}/run"]
    env = {"RAY_ADDRESS": address} if how == "RAY_ADDRESS" else {}
    if how == "cluster.address":
        args.append(f"cluster.address={address}")
    start = time.monotonic()
    proc = cli(args, tmp_path, Path.home(), **env)
    elapsed = time.monotonic() - start
    assert_one_line_error(proc, how, address, "nothing answers", "cluster.connect_timeout_s", "ray start --head")
    assert elapsed < 3 + 30, elapsed  # the timeout, plus starting Python and composing the config
