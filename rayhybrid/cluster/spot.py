"""Watching for the cloud's notice that this spot (preemptible) VM is about to be reclaimed.

AWS and GCP tell a spot VM, through its instance metadata server, shortly before they take it
back; nobody tells Ray. A `SpotWatcher` polls that server and, on the first notice, calls its
`drain(notice)` callback once with the time the node goes, then stops polling.

What it reads (the base URLs are settable: constructor arguments, or the environment variables
RAYHYBRID_AWS_METADATA_URL and RAYHYBRID_GCP_METADATA_URL, so tests point them at 127.0.0.1):

- AWS (IMDSv2): `PUT http://169.254.169.254/latest/api/token` with the header
  `X-aws-ec2-metadata-token-ttl-seconds: 21600` answers a session token; then
  `GET http://169.254.169.254/latest/meta-data/spot/instance-action` with the header
  `X-aws-ec2-metadata-token: <token>` answers 404 (no notice) or 200 with
  `{"action": "terminate", "time": "2026-11-26T14:05:00Z"}` (action terminate, stop or
  hibernate); the deadline is that time, about two minutes ahead. A GET answered 401 means the
  token expired: the watcher fetches a new one and asks again. The token is a secret: it is
  never logged. In a container behind a bridge network, IMDSv2's default hop limit (1) drops
  the token's answer and the watcher finds no cloud: raise the instance's hop limit to 2.
- GCP: `GET http://metadata.google.internal/computeMetadata/v1/instance/preempted` with the
  header `Metadata-Flavor: Google` answers `TRUE` or `FALSE`; GCP gives about 30 s, so on
  `TRUE` the deadline is now + 30 s. (Plain polling; the `?wait_for_change=true` long poll is
  not used.)

It costs nothing without a cloud: `start()` probes both metadata servers once, in parallel and
bounded by a short timeout (a failed connect, or at most `timeout_s`), and starts nothing when
neither answers. It never blocks training: it polls in a daemon thread of its own, every
request has a timeout, and network errors count as "no notice", never as an exception. The
proxy settings of the environment are ignored: a metadata request never leaves the machine's
link. Bad settings (interval_s <= 0, an unknown cloud name, a base URL that is not http(s))
raise ValueError.

This module knows nothing of Ray. rayhybrid/cluster/spot_watch.py wires `drain` to Ray:
`NodeSpotWatch`, a small actor pinned to one node, holds a `SpotWatcher` whose callback calls
`ray._raylet.GcsClient(address).drain_node(node_id_hex, reason, message, deadline_ms)` with the
reason from Ray's own enum (`DrainNodeReason.DRAIN_NODE_REASON_PREEMPTION`, `preemption_reason`)
and `deadline_ms = int(notice.deadline_s * 1000)`; it answers `(is_accepted, rejection_message)`,
and a refusal is logged. rayhybrid/driver/preemption.py starts them: `DrainWatch` probes the
driver's own node for a cloud (`detect_cloud`, in the background, when `cluster.spot_notices`)
and, if it finds one, calls `start_watchers` for each node the run uses that has none yet;
from there the run's drain watch moves off a draining node. The callback runs in the watcher's
thread.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import queue
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

log = logging.getLogger("rayhybrid")

AWS_URL = "http://169.254.169.254"
GCP_URL = "http://metadata.google.internal"
AWS_URL_ENV = "RAYHYBRID_AWS_METADATA_URL"
GCP_URL_ENV = "RAYHYBRID_GCP_METADATA_URL"
CLOUDS = ("aws", "gcp")

AWS_TOKEN_PATH = "/latest/api/token"
AWS_NOTICE_PATH = "/latest/meta-data/spot/instance-action"
AWS_TOKEN_TTL_S = 21600
GCP_NOTICE_PATH = "/computeMetadata/v1/instance/preempted"

AWS_NOTICE_S = 120.0
"""AWS's warning time: the deadline when an instance-action's time cannot be read."""
GCP_NOTICE_S = 30.0
"""GCP's warning time: a preempted VM gets about 30 s."""

# No proxy: the metadata server is link-local, and HTTP(S)_PROXY must not carry a request
# (and a token) off the machine.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(frozen=True)
class Notice:
    """A cloud's notice that this VM will be reclaimed."""

    cloud: str
    """"aws" or "gcp"."""
    deadline_s: float
    """The time.time() at which the node goes."""
    detail: str
    """What the metadata server said, e.g. "spot/instance-action terminate at 2026-...Z"."""


def _base_url(url: str | None, env: str, default: str, setting: str) -> str:
    """The base URL of a metadata server: the argument, else the environment, else the cloud's."""
    url = url or os.environ.get(env) or default
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{setting}={url!r} is not a base URL: give one like http://127.0.0.1:8080 (or set {env})")
    return url.rstrip("/")


def _check_cloud(cloud: str | None) -> None:
    if cloud is not None and cloud not in CLOUDS:
        raise ValueError(f"cloud={cloud!r} is not known: use 'aws', 'gcp', or None to detect it")


def _check_positive(value: float, setting: str, example: str) -> None:
    if not value > 0:
        raise ValueError(f"{setting} must be > 0 (got {value!r}): {example}")


def _request(method: str, url: str, headers: dict[str, str], timeout_s: float) -> tuple[int, str] | None:
    """(status, body) of one request, or None when the server cannot be reached or answers
    garbage. Never raises on network errors, and never logs the headers (they hold the token)."""
    data = b"" if method == "PUT" else None
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with _OPENER.open(req, timeout=timeout_s) as resp:
            return resp.status, resp.read(65536).decode("utf-8", "replace")
    except urllib.error.HTTPError as err:
        err.close()
        return err.code, ""
    except (OSError, http.client.HTTPException, ValueError) as err:  # refused, timeout, reset, bad answer
        log.debug("metadata %s %s failed: %s", method, url, type(err).__name__)
        return None


def _aws_token(base: str, timeout_s: float) -> str | None:
    """A new IMDSv2 session token, or None when no AWS metadata server answers."""
    headers = {"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)}
    answer = _request("PUT", base + AWS_TOKEN_PATH, headers, timeout_s)
    if answer is None or answer[0] != 200 or not answer[1].strip():
        return None
    return answer[1].strip()


def _gcp_preempted(base: str, timeout_s: float) -> bool | None:
    """GCP's preempted flag; None when no GCP metadata server answers."""
    answer = _request("GET", base + GCP_NOTICE_PATH, {"Metadata-Flavor": "Google"}, timeout_s)
    if answer is None or answer[0] != 200:
        return None
    return answer[1].strip().upper() == "TRUE"


def _aws_notice(body: str) -> Notice:
    """The notice of a 200 from spot/instance-action. A 200 is a notice whatever its body says:
    a time that cannot be read gives AWS's two minutes from now."""
    try:
        doc = json.loads(body)
        action, when = str(doc["action"]), str(doc["time"])
        moment = datetime.fromisoformat(when.replace("Z", "+00:00"))
    except (ValueError, KeyError, TypeError):
        return Notice("aws", time.time() + AWS_NOTICE_S, f"spot/instance-action unreadable: {body[:80]!r}")
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return Notice("aws", moment.timestamp(), f"spot/instance-action {action} at {when}")


def detect_cloud(aws_url: str | None = None, gcp_url: str | None = None, timeout_s: float = 0.5) -> str | None:
    """Which metadata server answers: "aws" (the IMDSv2 token PUT), "gcp" (the preempted flag,
    with its header), or None. Both are probed at once, and the answer comes within
    `timeout_s` whatever the network does (a slow DNS lookup of metadata.google.internal
    included); never raises on network errors."""
    _check_positive(timeout_s, "timeout_s", "the seconds to wait for a metadata server, e.g. 0.5")
    probes = {
        "aws": (_aws_token, _base_url(aws_url, AWS_URL_ENV, AWS_URL, "aws_url")),
        "gcp": (_gcp_preempted, _base_url(gcp_url, GCP_URL_ENV, GCP_URL, "gcp_url")),
    }
    answers: queue.Queue[tuple[str, bool]] = queue.Queue()
    for cloud, (probe, base) in probes.items():
        threading.Thread(
            target=lambda c=cloud, p=probe, b=base: answers.put((c, p(b, timeout_s) is not None)),
            name=f"rayhybrid-detect-{cloud}",
            daemon=True,
        ).start()
    deadline = time.monotonic() + timeout_s
    for _ in probes:
        try:
            cloud, answered = answers.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None
        if answered:
            return cloud
    return None


class _Reader:
    """One cloud's metadata server, read one poll at a time; for AWS it keeps the session
    token between polls and fetches a new one when the old one is refused (401)."""

    def __init__(self, cloud: str, aws_url: str | None, gcp_url: str | None, timeout_s: float):
        _check_cloud(cloud)
        _check_positive(timeout_s, "timeout_s", "the seconds one metadata request may take, e.g. 1.0")
        self.cloud = cloud
        self.timeout_s = timeout_s
        if cloud == "aws":
            self.base = _base_url(aws_url, AWS_URL_ENV, AWS_URL, "aws_url")
        else:
            self.base = _base_url(gcp_url, GCP_URL_ENV, GCP_URL, "gcp_url")
        self._token: str | None = None

    def read(self) -> Notice | None:
        if self.cloud == "aws":
            return self._read_aws()
        preempted = _gcp_preempted(self.base, self.timeout_s)
        if not preempted:
            return None
        return Notice("gcp", time.time() + GCP_NOTICE_S, "instance/preempted TRUE")

    def _read_aws(self) -> Notice | None:
        for _ in range(2):  # the second round only after a 401: the token expired
            if self._token is None:
                self._token = _aws_token(self.base, self.timeout_s)
                if self._token is None:
                    return None
            headers = {"X-aws-ec2-metadata-token": self._token}
            answer = _request("GET", self.base + AWS_NOTICE_PATH, headers, self.timeout_s)
            if answer is None:
                return None
            status, body = answer
            if status == 401:
                log.debug("AWS metadata token refused (expired): fetching a new one")
                self._token = None
                continue
            return _aws_notice(body) if status == 200 else None  # 404: no notice
        return None


def read_notice(
    cloud: str, aws_url: str | None = None, gcp_url: str | None = None, timeout_s: float = 1.0
) -> Notice | None:
    """One poll of `cloud`'s metadata server: its notice, or None when there is none or the
    server cannot be reached (never raises on network errors). For AWS, fetches a token first."""
    return _Reader(cloud, aws_url, gcp_url, timeout_s).read()


class SpotWatcher:
    """Polls the metadata server every `interval_s` in a daemon thread; on the first notice,
    logs one line, calls `drain(notice)` once (in that thread) and stops polling.

    `cloud` None: found by `start()` (`detect_cloud`). `timeout_s`: the most one metadata
    request may take. `aws_url`, `gcp_url`: the metadata servers' base URLs."""

    def __init__(
        self,
        drain: Callable[[Notice], None],
        cloud: str | None = None,
        interval_s: float = 5.0,
        aws_url: str | None = None,
        gcp_url: str | None = None,
        timeout_s: float = 1.0,
    ):
        _check_cloud(cloud)
        _check_positive(interval_s, "interval_s", "the seconds between polls of the metadata server, e.g. 5.0")
        _check_positive(timeout_s, "timeout_s", "the seconds one metadata request may take, e.g. 1.0")
        self.cloud = cloud
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.notice: Notice | None = None
        """The notice seen, once there is one."""
        self._drain = drain
        self._urls = (aws_url, gcp_url)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> bool:
        """Starts polling; False (and nothing started) when no cloud is found. Starting a
        watcher that runs already does nothing."""
        if self._thread is not None:
            return self.running
        cloud = self.cloud or detect_cloud(*self._urls, timeout_s=min(self.timeout_s, 0.5))
        if cloud is None:
            return False
        self.cloud = cloud
        reader = _Reader(cloud, *self._urls, timeout_s=self.timeout_s)
        self._thread = threading.Thread(target=self._run, args=(reader,), name="rayhybrid-spot-watcher", daemon=True)
        self._thread.start()
        return True

    def stop(self, wait_s: float = 5.0) -> None:
        """Ends the polling; waits at most `wait_s` for the thread (a poll in flight ends
        within its request timeouts)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(wait_s)

    def _run(self, reader: _Reader) -> None:
        while not self._stop.is_set():
            notice = reader.read()
            if notice is not None and not self._stop.is_set():
                self.notice = notice
                left = notice.deadline_s - time.time()
                log.warning(
                    "spot notice from %s (%s): draining this node, %.0fs left", notice.cloud, notice.detail, left
                )
                try:
                    self._drain(notice)
                except Exception:
                    log.exception("the drain callback failed on the spot notice")
                return
            self._stop.wait(self.interval_s)
