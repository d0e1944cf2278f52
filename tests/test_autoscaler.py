"""An elastic run against Ray's own autoscaler, with the fake multi-node provider that Ray's
tests use: a head with no worker nodes; the run's pending replica placement groups make the
autoscaler launch nodes; the run starts with what it gets and grows; when it ends, the
autoscaler removes the idle nodes.

`ray.cluster_utils.AutoscalingCluster` cannot be used: its config template is missing from the
wheel, and it runs `ray stop --force`, which kills every Ray on the machine. The head is
started here with `--autoscaling-config` in a process group of its own and stopped by it."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.clusters import ray_start_head
from tests.distributed import free_port
from tests.test_cli import run_cli

pytestmark = pytest.mark.slow

IDLE_TIMEOUT_MIN = 0.1  # the autoscaler removes a node idle for 6 s


def autoscaling_config(port: int) -> dict:
    return {
        "cluster_name": f"rayhybrid-{uuid.uuid4().hex[:6]}",
        "max_workers": 3,
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": IDLE_TIMEOUT_MIN,
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "gcs_address": f"127.0.0.1:{port}",
        },
        "auth": {"ssh_user": "ubuntu"},
        "head_node_type": "ray.head.default",
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
            # One replica per node: a rank takes both CPUs (cluster.cpus_per_rank=2).
            "worker": {"resources": {"CPU": 2}, "node_config": {}, "min_workers": 0, "max_workers": 3},
        },
        "docker": {},
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


@contextlib.contextmanager
def autoscaling_head(tmp: Path):
    port = free_port()
    config = tmp / "autoscaler.json"
    config.write_text(json.dumps(autoscaling_config(port)))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(AUTOSCALER_UPDATE_INTERVAL_S="1", RAY_FAKE_CLUSTER="1")
    args = [f"--port={port}", "--num-cpus=0", "--include-dashboard=false", f"--autoscaling-config={config}"]
    with ray_start_head(args, env, tmp, [port]):
        yield f"127.0.0.1:{port}"


def worker_nodes(address: str) -> int:
    """Alive nodes with CPUs (the head has none), as a separate driver sees them."""
    code = (
        "import ray, json;"
        "from ray._private.authentication.authentication_token_setup import "
        "maybe_enable_token_auth_if_token_available as token; token(warn_if_disabled=False);"
        f"ray.init(address={address!r}, logging_level='ERROR', log_to_driver=False);"
        "print('nodes:', json.dumps(sum(n['Alive'] and n['Resources'].get('CPU', 0) > 0 for n in ray.nodes())))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    # The autoscaler's own lines ("(autoscaler +0s) Removing 3 nodes ...") may reach stdout too.
    (count,) = [line.split(":", 1)[1] for line in out.stdout.splitlines() if line.startswith("nodes:")]
    return int(count)


def test_elastic_run_grows_as_the_autoscaler_adds_nodes_and_they_go_when_it_ends(tmp_path):
    run_dir = tmp_path / "run"
    with autoscaling_head(tmp_path) as address:
        args = [
            f"cluster.address={address}",
            "cluster.cpus_per_rank=2",
            "elastic.enabled=true",
            "elastic.min_dp=1",
            "elastic.max_dp=3",
            "train.global_batch_size=12",
            "train.micro_batch_size=2",
            "data.seq_len=32",
            "checkpoint.every=2",
            "train.steps=300",
            "cluster.placement_timeout_s=180",
            f"hydra.run.dir={run_dir}",
        ]
        started = time.time()
        proc = run_cli(args, cwd=tmp_path, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["topology"]["dp"] == 3
        grows = [r for r in summary["resizes"] if r["to_dp"] > r["from_dp"]]
        assert grows and grows[-1]["to_dp"] == 3
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in records if "event" not in r]
        assert [r["step"] for r in steps] == list(range(1, 301))
        first_dp3 = next(r["time"] for r in steps if r["dp"] == 3)
        print(f"\nautoscaler: pending to dp 3 in {first_dp3 - started:.1f}s (from the command's start)")
        # Idle nodes go: the run's placement groups are released, and the autoscaler removes
        # the nodes after idle_timeout_minutes.
        deadline, left = time.monotonic() + 240, worker_nodes(address)
        while left > 0:
            assert time.monotonic() < deadline, f"the autoscaler left {left} idle node(s)"
            time.sleep(3)
            left = worker_nodes(address)
