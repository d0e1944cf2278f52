"""Before training: can every node that hosts ranks reach `checkpoint.dir`, and does it see
what the driver wrote there? The driver writes a marker; a task on each node reads it and
writes, reads back and deletes a file of its own. A node-local path on a multi-node cluster,
an unreachable bucket or missing credentials end the run with exit 2 and one line, instead of
checkpoints scattered over the nodes' own disks that no recovery can load.

The same tasks check two more things that must be one for every node: a prepared dataset on a
local path (`check_datasets`: each node reads the driver's index.json there), and where
`python -m rayhybrid.prepare` writes (`check_storage` with `setting="output"`)."""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rayhybrid.errors import ConfigError
from rayhybrid.storage.store import UNSEEN, Store, check_probe, is_remote, one_line, remove_probe, write_probe

log = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 60.0


@ray.remote(num_cpus=0, max_retries=0)
def _on_node(fn, *args) -> str | None:
    return fn(*args)


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


def first_refusal(nodes: list[str], env: dict[str, str], fn, *args) -> tuple[str, str] | None:
    """Run `fn(*args)` in a task pinned to each of `nodes` (with the workers' environment
    `env`); None when it returned None everywhere, else (the first other node, as "node IP
    (id)", and its reason: what `fn` returned, or that the task could not run or answer)."""
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    runtime_env = {"env_vars": env} if env else None
    refs = {
        node: _on_node.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False), runtime_env=runtime_env
        ).remote(fn, *args)
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
            return f"node {ips.get(node, '?')} ({node[:8]})", reason
    return None


def check_storage(
    store: Store,
    nodes: list[str],
    env: dict[str, str],
    *,
    default: bool = False,
    setting: str = "checkpoint.dir",
    fix: str = "",
) -> None:
    """Raise ConfigError(setting, ...) naming the first node of `nodes` that cannot use `store`
    (the driver first). `env`: the environment the workers get (forwarded settings);
    `default`: checkpoint.dir was not set (the run directory's checkpoints/ is used); `fix`:
    what to do, in place of checkpoint.dir's advice."""
    what = f"{store.display}{' (the default: checkpoint.dir is not set)' if default else ''}"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a client may retry for minutes
        try:
            marker, token = pool.submit(write_probe, store).result(timeout=CHECK_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise ConfigError(
                setting, f"{what}: the driver got no answer within {CHECK_TIMEOUT_S:g}s; {fix or _fix(store, False)}"
            ) from None
        except Exception as err:  # noqa: BLE001 - any client error: the store cannot be used
            raise ConfigError(
                setting, f"{what}: the driver cannot write there ({one_line(err)}); {fix or _fix(store, False)}"
            ) from None
    try:
        found = first_refusal(nodes, env, _probe, store.url, store.options, marker, token)
        if found:
            node, reason = found
            advice = fix or _fix(store, default, unseen=reason.startswith(UNSEEN))
            raise ConfigError(setting, f"{what}: {node} {reason}; {advice}")
        log.debug("%s %s: seen by %d node(s)", setting, store.display, len(nodes))
    finally:
        remove_probe(store, marker)


INDEX = "index.json"  # a prepared dataset's commit marker (rayhybrid.data.prepared.INDEX)
DATASET_FIX = (
    "put the dataset on a mount every node shares, or prepare it to a bucket "
    "(python -m rayhybrid.prepare output=s3://bucket/prefix, gs://...)"
)


def index_digest(url: str) -> str | None:
    """The SHA-256 of the prepared dataset's index.json at `url`, as this process reads it
    (None: there is none)."""
    store = Store.open(url)
    try:
        return hashlib.sha256(store.read_bytes(store.join(INDEX))).hexdigest()
    except FileNotFoundError:
        return None


def _sees_dataset(url: str, digest: str) -> str | None:
    try:
        seen = index_digest(url)
    except Exception as err:  # noqa: BLE001 - any error: the node cannot read it
        return f"cannot read its {INDEX} ({one_line(err)})"
    if seen is None:
        return f"does not see its {INDEX} (a disk of its own?)"
    return None if seen == digest else "sees another dataset there (a disk of its own?)"


def check_datasets(datasets: list[tuple[str, str]], nodes: list[str], env: dict[str, str]) -> None:
    """Before training: every node of `nodes` but the driver's sees each prepared dataset of
    `datasets` ((setting, path or URL): `data.packing.prepared_sources`) that is on a local
    path as the driver does (the same index.json); else a ConfigError naming its setting.
    Datasets in object stores are left to the readers."""
    local = [(setting, url) for setting, url in datasets if not is_remote(url)]
    if local and nodes:
        here = ray.get_runtime_context().get_node_id()
        nodes = [n for n in nodes if n != here]
    for setting, url in local if nodes else []:
        digest = index_digest(url)
        if digest is None:
            continue  # the data checks refused it already, or it went since: the readers say so
        found = first_refusal(nodes, env, _sees_dataset, url, digest)
        if found:
            node, reason = found
            raise ConfigError(setting, f"{url}: {node} {reason}; {DATASET_FIX}")
        log.debug("%s %s: seen by %d node(s)", setting, url, len(nodes))
