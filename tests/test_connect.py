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
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.clusters import ray_start_head
from tests.distributed import free_port
from tests.test_cli import REPO, assert_one_line_error, run_cli

pytestmark = pytest.mark.slow

RUN = [
    "train.steps=2",
    "checkpoint.every=0",
    "data.seq_len=32",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
]


def home_with_token(root: Path) -> Path:
    home = root / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text(uuid.uuid4().hex)
    return home


@contextlib.contextmanager
def ray_head(tmp: Path, home: Path, auth: bool, dashboard_port: int = 0):
    """`ray start --head --block` on a free port; yields its address ip:port. With
    `dashboard_port`, the dashboard too (Ray Jobs' HTTP address)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["HOME"] = str(home)
    if not auth:
        env["RAY_AUTH_MODE"] = "disabled"
    args = [f"--port={port}", "--num-cpus=2", f"--include-dashboard={bool(dashboard_port)}".lower()]
    if dashboard_port:  # and its job agent's port: 52365, unless told, may be taken by another Ray here
        args += [f"--dashboard-port={dashboard_port}", f"--dashboard-agent-listen-port={free_port()}"]
    with ray_start_head(args, env, tmp, [port, dashboard_port] if dashboard_port else [port]):
        yield f"127.0.0.1:{port}"


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


def test_a_job_larger_than_a_cluster_without_autoscaler_exits_2_at_once(token_head, tmp_path):
    """Every head runs Ray's autoscaler monitor; without an autoscaling config it is a read-only
    one that mirrors the nodes. That is not an autoscaler that can add nodes: a job larger than
    the cluster stops at once, not after waiting cluster.placement_timeout_s for nodes."""
    address, home = token_head
    probe = (
        "import json, time\n"
        "import ray\n"
        "from ray._private.ray_constants import DEBUG_AUTOSCALING_STATUS\n"
        "from ray.experimental.internal_kv import _internal_kv_get\n"
        "from rayhybrid.cluster.placement import autoscaled\n"
        f"ray.init(address='{address}', logging_level='ERROR')\n"
        "deadline = time.monotonic() + 60\n"
        "while 'autoscaler_report' not in json.loads(_internal_kv_get(DEBUG_AUTOSCALING_STATUS) or '{}'):\n"
        "    assert time.monotonic() < deadline, 'the monitor never reported'\n"
        "    time.sleep(0.5)\n"
        "print('autoscaled', autoscaled())\n"
    )
    env = {**os.environ, "HOME": str(home), "RAY_AUTH_MODE": "token", "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    seen = subprocess.run(
        [sys.executable, "-c", probe], check=False, env=env, capture_output=True, text=True, timeout=120
    )
    assert "autoscaled False" in seen.stdout, seen.stdout + seen.stderr[-3000:]
    start = time.monotonic()
    proc = cli(
        [
            "+topology=dp4",
            *RUN,
            "train.global_batch_size=8",
            f"cluster.address={address}",
            f"hydra.run.dir={tmp_path}/run",
        ],
        tmp_path,
        home,
    )
    assert_one_line_error(proc, "4 ranks", "ask for 4 CPUs", "has 2 on 1 node")
    assert time.monotonic() - start < 60  # the default cluster.placement_timeout_s is 120


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


def test_ray_jobs_submit_and_stop(tmp_path):
    """How most users run on a shared cluster: `ray job submit --address http://head:8265 --
    python -m rayhybrid ...` (Ray's CLI, like an explicit address, needs RAY_AUTH_MODE=token
    for a cluster with token authentication). `ray job stop` sends the driver SIGTERM: it
    saves a checkpoint of the step it is at and stops."""
    home = home_with_token(tmp_path)
    dashboard = free_port()
    ray = str(Path(sys.executable).parent / "ray")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(HOME=str(home), RAY_AUTH_MODE="token")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    jobs = ["--address", f"http://127.0.0.1:{dashboard}"]
    with ray_head(tmp_path, home, auth=True, dashboard_port=dashboard):
        done = tmp_path / "done"
        submit = [ray, "job", "submit", *jobs, "--", sys.executable, "-m", "rayhybrid", *RUN, f"hydra.run.dir={done}"]
        proc = _submit(submit, env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert json.loads((done / "summary.json").read_text())["status"] == "completed"

        stopped = tmp_path / "stopped"
        args = [*RUN[1:], "train.steps=100000", "checkpoint.every=1000", f"hydra.run.dir={stopped}"]
        submit = [ray, "job", "submit", *jobs, "--no-wait", "--", sys.executable, "-m", "rayhybrid", *args]
        out = _submit(submit, env)
        job_id = re.search(r"raysubmit_\w+", out.stdout + out.stderr).group(0)
        deadline = time.monotonic() + 240
        metrics = stopped / "metrics.jsonl"
        while not metrics.exists() or metrics.read_text().count('"loss"') < 3:
            assert time.monotonic() < deadline, "the job did not get to step 3"
            time.sleep(0.2)
        subprocess.run([ray, "job", "stop", *jobs, job_id], env=env, capture_output=True, timeout=120, check=True)
        deadline = time.monotonic() + 60
        summary_path = stopped / "summary.json"
        while not summary_path.exists():
            assert time.monotonic() < deadline, "no summary after ray job stop"
            time.sleep(0.2)
    summary = json.loads(summary_path.read_text())
    assert summary["status"] == "interrupted" and "SIGTERM" in summary["error"]
    assert summary["last_checkpoint"] == str(stopped / "checkpoints" / f"step_{summary['steps']:08d}")


def _submit(cmd: list[str], env: dict) -> subprocess.CompletedProcess:
    """`ray job submit`, again while the head's job agent is still starting."""
    deadline = time.monotonic() + 60
    while True:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
        if "No available agent" not in proc.stdout + proc.stderr or time.monotonic() > deadline:
            return proc
        time.sleep(2)


@pytest.mark.slow
def test_a_local_rays_workers_are_not_forwarded_the_settings_they_inherited(monkeypatch):
    """The local Ray that `connect` starts hands the driver's environment to its workers: the
    spawner forwards only the storage settings changed or added since (an actor without a
    runtime environment can then take a worker process Ray started ahead)."""
    import ray

    from rayhybrid.cluster.connect import connect, inherited_env
    from rayhybrid.cluster.spawn import Spawner
    from rayhybrid.preflight import load_config

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://before")
    assert not ray.is_initialized()
    cfg = load_config(["cluster.num_cpus=1"])
    assert connect(cfg)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://after")
        monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "p")
        assert Spawner(cfg, None, None).env == {"AWS_ENDPOINT_URL": "http://after", "GOOGLE_CLOUD_PROJECT": "p"}
        got = ray.get(ray.remote(num_cpus=0)(lambda: os.environ.get("AWS_REGION")).remote())
        assert got == "eu-west-1"  # inherited, not forwarded
    finally:
        ray.shutdown()
    assert inherited_env() == {}
    assert Spawner(cfg, None, None).env["AWS_REGION"] == "eu-west-1"  # no Ray of its own: forwarded
