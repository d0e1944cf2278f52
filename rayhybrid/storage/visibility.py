"""Before training: can every node that hosts ranks reach `checkpoint.dir`, and does it see
what the driver wrote there? The driver writes a marker; a task on each node reads it and
writes, reads back and deletes a file of its own. A node-local path on a multi-node cluster,
an unreachable bucket or missing credentials end the run with exit 2 and one line, instead of
checkpoints scattered over the nodes' own disks that no recovery can load."""

from __future__ import annotations

import concurrent.futures
import logging

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rayhybrid.errors import ConfigError
from rayhybrid.storage.store import UNSEEN, Store, check_probe, one_line, remove_probe, write_probe

log = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 60.0


@ray.remote(num_cpus=0, max_retries=0)
def _probe(url: str, options: dict, marker: str, token: str) -> str | None:
    return check_probe(Store.open(url, options), marker, token)


def _fix(store: Store, default: bool, unseen: bool = False) -> str:
    """What to do: `unseen`: the node reached a store, but not the driver's."""
    if default:
        return (
            "checkpoint.dir is not set, so checkpoints would go to the driver's run directory; set "
            "checkpoint.dir to a bucket URI (s3://bucket/prefix, gs://...) or a mount every node shares"
        )
    if store.local:
        return "use a bucket URI (s3://bucket/prefix, gs://...) or a mount every node shares"
    if unseen:
        return (
            "every node must reach the same store as the driver: give the nodes the driver's endpoint and "
            "account (AWS_*, FSSPEC_* or ~/.aws on the node), or set them in checkpoint.storage_options"
        )
    return "check the bucket, the credentials and the endpoint (the store's environment variables, e.g. AWS_*, or checkpoint.storage_options)"


def check_storage(store: Store, nodes: list[str], env: dict[str, str], *, default: bool = False) -> None:
    """Raise ConfigError("checkpoint.dir", ...) naming the first node of `nodes` that cannot use
    `store` (the driver first). `env`: the environment the workers get (forwarded settings);
    `default`: checkpoint.dir was not set (the run directory's checkpoints/ is used)."""
    what = f"{store.display}{' (the default: checkpoint.dir is not set)' if default else ''}"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a client may retry for minutes
        try:
            marker, token = pool.submit(write_probe, store).result(timeout=CHECK_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise ConfigError(
                "checkpoint.dir", f"{what}: the driver got no answer within {CHECK_TIMEOUT_S:g}s; {_fix(store, False)}"
            ) from None
        except Exception as err:  # noqa: BLE001 - any client error: the store cannot be used
            raise ConfigError(
                "checkpoint.dir", f"{what}: the driver cannot write there ({one_line(err)}); {_fix(store, False)}"
            ) from None
    try:
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        runtime_env = {"env_vars": env} if env else None
        refs = {
            node: _probe.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False), runtime_env=runtime_env
            ).remote(store.url, store.options, marker, token)
            for node in nodes
        }
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=CHECK_TIMEOUT_S)
        for node, ref in refs.items():
            if ref not in ready:
                reason = f"did not answer within {CHECK_TIMEOUT_S:g}s"
            else:
                try:
                    reason = ray.get(ref)
                except ray.exceptions.RayError as err:
                    reason = f"could not run the check ({one_line(err)})"
            if reason:
                raise ConfigError(
                    "checkpoint.dir",
                    f"{what}: node {ips.get(node, '?')} ({node[:8]}) {reason}; "
                    + _fix(store, default, unseen=reason.startswith(UNSEEN)),
                )
        log.debug("checkpoint.dir %s: seen by %d node(s)", store.display, len(nodes))
    finally:
        remove_probe(store, marker)
