"""Connecting to Ray: `cluster.address`, else `RAY_ADDRESS`, else a local Ray on 127.0.0.1."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import socket
import sys
import time

import ray

from rayhybrid.cluster.placement import ReplicaShape, alive_nodes, autoscaled
from rayhybrid.config.schema import Config
from rayhybrid.config.topology import Layout
from rayhybrid.errors import ConfigError
from rayhybrid.storage.store import forwarded_env, one_line

log = logging.getLogger(__name__)

_LOCAL: tuple[str, dict[str, str]] | None = None
"""The local Ray that `connect` started last (its GCS address) and the storage settings
(`forwarded_env`) its processes inherited from the driver's environment."""


def connect(cfg: Config) -> bool:
    """Make sure Ray is initialised; returns True when this call started a local Ray (which
    the caller then shuts down). An already initialised Ray (a notebook, a test) is reused."""
    if ray.is_initialized():
        return False
    setting = "cluster.address" if cfg.cluster.address else "RAY_ADDRESS"
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS", "")
    if address:
        join(address, setting, cfg.cluster.connect_timeout_s)
        return False
    ranks = Layout.of(cfg).world_size
    num_cpus = cfg.cluster.num_cpus or max(int(ranks * cfg.cluster.cpus_per_rank + 0.999), os.cpu_count() or 1)
    # Ray warns on every local start that token authentication (its default) is on; keep the
    # default and the terminal quiet (RAY_AUTH_MODE still chooses).
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    global _LOCAL
    inherited = forwarded_env()  # the raylet, and so every worker, starts with this environment
    ray.init(
        address="local",  # always a fresh local Ray, never a stray `ray start` cluster
        num_cpus=num_cpus,
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        logging_level=logging.WARNING,
        log_to_driver=True,
        _system_config=local_system_config(cfg),
    )
    _LOCAL = (ray.get_runtime_context().gcs_address, inherited)
    return True


def inherited_env() -> dict[str, str]:
    """The storage settings the workers of the current Ray have without being forwarded: those
    of the driver's environment when `connect` started this Ray locally (its workers inherit
    it); none for a Ray the run joined or did not start."""
    if _LOCAL is None or not ray.is_initialized() or ray.get_runtime_context().gcs_address != _LOCAL[0]:
        return {}
    return dict(_LOCAL[1])


def local_system_config(cfg: Config) -> dict:
    """Ray's system config for the local Ray that `connect` starts. Without
    `cluster.ray_metrics`, metrics collection is off (`enable_metrics_collection`, the
    system-config form of RAY_enable_metrics_collection=0): the GCS, the raylet, the driver and
    every worker skip their stats exporter (their logs say "Disabled stats."), and the raylet
    starts its dashboard agent with --disable-metrics-collection, so the agent runs no
    Prometheus endpoint (the node's MetricsExportPort is -1) and records nothing. A cluster
    the run joins keeps its own settings."""
    return {} if cfg.cluster.ray_metrics else {"enable_metrics_collection": False}


def join(address: str, setting: str, timeout_s: float) -> None:
    """Connect to the cluster at `address` ("auto", "ip:port" or "ray://ip:port"): exit 2 with
    one line when nothing answers there within `timeout_s`, or when it refuses the token.

    Token authentication: see `_authenticate`. It uses Ray's private token setup; in a Ray
    where that moved, the run connects as `ray.init` does by itself, after one warning line
    (RAY_AUTH_MODE=token then turns token mode on)."""
    from ray.exceptions import AuthenticationError

    token = _token_setup()
    if address != "auto":
        _wait_for_port(address, setting, timeout_s)
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    try:
        if token is None:
            pass
        elif address == "auto" or address.startswith("ray://"):
            token.maybe_enable_token_auth_if_token_available(warn_if_disabled=False)  # what Ray does for "auto"
        else:
            _authenticate(address, token)
        log.info("connecting to the Ray cluster at %s", address)
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)
    except AuthenticationError as err:
        has_token = os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
        saved = token is not None and token._get_default_token_path().exists()
        what = "refused the token" if has_token or saved else "asks for a token"
        raise ConfigError(
            "RAY_AUTH_TOKEN",
            f"the Ray cluster at {address} ({setting}) {what} ({one_line(err).split('. ')[0]}); set RAY_AUTH_TOKEN, "
            "or RAY_AUTH_TOKEN_PATH, to the cluster's token (`ray get-auth-token` prints it on the head node)",
        ) from None
    except ConnectionError as err:
        raise ConfigError(setting, f"cannot connect to a Ray cluster at {address}: {one_line(err)}; {_FIX}") from None


def _token_setup():
    """Ray's private token setup (`ray._private.authentication.authentication_token_setup`), or
    None after one warning line when this Ray has moved what rayhybrid uses of it."""
    try:
        token = importlib.import_module("ray._private.authentication.authentication_token_setup")

        for name in ("maybe_enable_token_auth_if_token_available", "_get_default_token_path"):
            getattr(token, name)
        from ray._raylet import GcsClient  # noqa: F401 - _authenticate's
    except (ImportError, AttributeError) as err:
        log.warning(
            "cluster.address: this Ray's token setup moved (%s): connecting without rayhybrid's token check; "
            "set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN for a cluster that asks for one, or use ray==2.60.*",
            one_line(err),
        )
        return None
    return token


def _authenticate(address: str, token) -> None:
    """Token authentication as the cluster at `address` has it (Ray 2.60 turns it on by itself
    only for "auto"): ask its GCS without a token first; when it asks for one, turn token mode
    on (the token from RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token) and ask
    again. A refused token raises AuthenticationError at once, where ray.init would retry for
    20 s and then say only that it could not connect. An explicit RAY_AUTH_MODE is kept."""
    from ray._raylet import GcsClient
    from ray.exceptions import AuthenticationError

    with _stderr_to_devnull():  # the GCS client logs each refusal to stderr itself
        try:
            GcsClient(address=address, cluster_id=None)
            return
        except AuthenticationError:
            if "RAY_AUTH_MODE" in os.environ or not token.maybe_enable_token_auth_if_token_available(
                warn_if_disabled=False
            ):
                raise
        GcsClient(address=address, cluster_id=None)


@contextlib.contextmanager
def _stderr_to_devnull():
    """File descriptor 2 to /dev/null meanwhile (Ray's C++ client logs there directly)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


_FIX = "start one (`ray start --head`), or give the head's address (ip:6379 by default; auto on a node of the cluster)"


def _wait_for_port(address: str, setting: str, timeout_s: float) -> None:
    """Until `timeout_s`: try a TCP connection to the GCS port, so that an address where
    nothing listens fails in seconds, not after Ray's own minutes of retries."""
    target = address.removeprefix("ray://")
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ConfigError(setting, f"{address!r} is not an address; give ip:port (e.g. 10.0.0.5:6379) or auto")
    deadline, tries, reason = time.monotonic() + timeout_s, 0, ""
    while True:
        tries += 1
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(5.0, timeout_s)):
                return
        except OSError as err:
            reason = err.strerror or type(err).__name__
        if time.monotonic() >= deadline:
            break
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    raise ConfigError(
        setting,
        f"nothing answers at {address}: {tries} connection(s) in {timeout_s:g}s (cluster.connect_timeout_s), "
        f"the last: {reason}; {_FIX}",
    )


def resolve_shape(cfg: Config) -> ReplicaShape:
    """The resources one replica needs; `cluster.use_gpu=auto` uses GPUs when the cluster has any."""
    gpus = sum(node.get("Resources", {}).get("GPU", 0.0) for node in alive_nodes())
    choice = str(cfg.cluster.use_gpu).lower()
    if choice == "true" and gpus == 0 and not autoscaled():
        raise ConfigError("cluster.use_gpu", "is true but the cluster has no GPUs; set cluster.use_gpu=auto or false")
    use_gpu = choice == "true" or (choice == "auto" and gpus > 0)
    t = cfg.topology
    return ReplicaShape(pp=t.pp, tp=t.tp, use_gpu=use_gpu, cpus_per_rank=cfg.cluster.cpus_per_rank)
