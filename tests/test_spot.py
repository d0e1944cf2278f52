"""The spot notice watcher (rayhybrid/cluster/spot.py) against fake AWS and GCP metadata
servers on 127.0.0.1, which check the real request formats: the AWS fake hands out a token
only to a PUT with the TTL header and answers 401 to a GET without that token; the GCP fake
answers 403 without `Metadata-Flavor: Google`. No Ray, and no request leaves the machine: the
metadata URLs of the environment point at a closed local port in every test."""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import socket
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rayhybrid.cluster import spot
from rayhybrid.cluster.spot import Notice, SpotWatcher, detect_cloud, read_notice

CLOUDS = ["aws", "gcp"]


class Fake:
    """A metadata server's state: `notice_after` polls answer "no notice" before the notice
    (None: never a notice); `polls` counts the well-formed notice requests."""

    def __init__(self, cloud: str):
        self.cloud = cloud
        self.notice_after: int | None = None
        self.polls = 0
        self.deadline = int(time.time()) + 120
        self.action = "terminate"
        self.body: str | None = None  # AWS: a raw instance-action body instead of the JSON
        self.puts = 0
        self.refused = 0
        self.tokens: list[str] = []
        self.valid: set[str] = set()
        self.expire_at: int | None = None  # AWS: every token expires after this many polls
        self.lock = threading.Lock()
        self.url = ""

    def noticed(self) -> bool:
        return self.notice_after is not None and self.polls > self.notice_after

    def aws_body(self) -> str:
        when = datetime.fromtimestamp(self.deadline, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        return self.body if self.body is not None else json.dumps({"action": self.action, "time": when})


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def answer(self, status: int, text: str = "") -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_PUT(self):
        fake: Fake = self.server.fake
        if fake.cloud != "aws" or self.path != "/latest/api/token":
            return self.answer(404)
        if self.headers.get("X-aws-ec2-metadata-token-ttl-seconds") != "21600":
            return self.answer(400, "missing TTL header")
        with fake.lock:
            token = "tok-" + secrets.token_hex(16)
            fake.puts += 1
            fake.tokens.append(token)
            fake.valid.add(token)
        return self.answer(200, token)

    def do_GET(self):
        fake: Fake = self.server.fake
        if fake.cloud == "aws":
            return self.aws_get(fake)
        if self.path != "/computeMetadata/v1/instance/preempted":
            return self.answer(404)
        if self.headers.get("Metadata-Flavor") != "Google":
            return self.answer(403, "Missing Metadata-Flavor:Google header")
        with fake.lock:
            fake.polls += 1
            noticed = fake.noticed()
        return self.answer(200, "TRUE" if noticed else "FALSE")

    def aws_get(self, fake: Fake):
        if self.path != "/latest/meta-data/spot/instance-action":
            return self.answer(404)
        with fake.lock:
            if self.headers.get("X-aws-ec2-metadata-token") not in fake.valid:
                fake.refused += 1
                return self.answer(401)
            fake.polls += 1
            if fake.expire_at is not None and fake.polls == fake.expire_at:
                fake.valid.clear()
            noticed = fake.noticed()
        return self.answer(200, fake.aws_body()) if noticed else self.answer(404)


@contextlib.contextmanager
def serving(cloud: str):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.fake = Fake(cloud)
    server.fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server.fake
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def closed_url() -> str:
    """A local port where nothing listens: connections are refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture(autouse=True)
def no_real_metadata(monkeypatch):
    """Whatever a test forgets to pass, nothing is sent to 169.254.169.254 or Google."""
    monkeypatch.setenv(spot.AWS_URL_ENV, closed_url())
    monkeypatch.setenv(spot.GCP_URL_ENV, closed_url())


@pytest.fixture(params=CLOUDS)
def fake(request):
    with serving(request.param) as fake:
        yield fake


def urls(fake: Fake) -> dict[str, str]:
    return {f"{fake.cloud}_url": fake.url}


def wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_the_fakes_refuse_malformed_requests():
    """The fakes are strict, so the module's passing tests prove its request formats."""
    with serving("aws") as aws, serving("gcp") as gcp:
        for req in (
            urllib.request.Request(aws.url + "/latest/api/token", data=b"", method="PUT"),  # no TTL header
            urllib.request.Request(aws.url + spot.AWS_NOTICE_PATH),  # no token
            urllib.request.Request(aws.url + spot.AWS_NOTICE_PATH, headers={"X-aws-ec2-metadata-token": "forged"}),
            urllib.request.Request(gcp.url + spot.GCP_NOTICE_PATH),  # no Metadata-Flavor
        ):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=2)
            err.value.close()
            assert err.value.code in (400, 401, 403)
        assert aws.polls == gcp.polls == 0 and aws.refused == 2


def test_no_notice(fake):
    assert read_notice(fake.cloud, **urls(fake)) is None
    assert fake.polls == 1  # a well-formed request, answered "no notice"
    assert fake.puts == (1 if fake.cloud == "aws" else 0)


def test_notice(fake):
    fake.notice_after = 0
    before = time.time()
    notice = read_notice(fake.cloud, **urls(fake))
    after = time.time()
    assert isinstance(notice, Notice) and notice.cloud == fake.cloud
    if fake.cloud == "aws":
        assert notice.deadline_s == fake.deadline
        assert "terminate" in notice.detail and "Z" in notice.detail
    else:
        assert before + 30 <= notice.deadline_s <= after + 30
        assert "preempted" in notice.detail


def test_aws_notice_actions_and_unreadable_time():
    with serving("aws") as aws:
        aws.notice_after, aws.action = 0, "hibernate"
        assert "hibernate" in read_notice("aws", aws_url=aws.url).detail
        aws.body = "not json"  # a 200 is a notice all the same: AWS's two minutes from now
        notice = read_notice("aws", aws_url=aws.url)
        assert notice is not None and abs(notice.deadline_s - (time.time() + 120)) < 5


def test_unreachable_server_is_no_notice(fake):
    start = time.monotonic()
    assert read_notice(fake.cloud, **{f"{fake.cloud}_url": closed_url()}) is None
    assert time.monotonic() - start < 0.5


def test_a_silent_server_costs_at_most_the_timeout():
    """A server that accepts the connection and never answers (a listening socket never
    accepted): the request times out, and detection still answers within its timeout."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        start = time.monotonic()
        assert read_notice("gcp", gcp_url=url, timeout_s=0.2) is None
        assert detect_cloud(aws_url=url, gcp_url=url, timeout_s=0.2) is None
        assert time.monotonic() - start < 1.0


def test_detect_cloud(fake):
    assert detect_cloud(**urls(fake)) == fake.cloud
    assert fake.polls == (1 if fake.cloud == "gcp" else 0)  # AWS: only the token PUT
    assert fake.puts == (1 if fake.cloud == "aws" else 0)


def test_detect_no_cloud_quickly():
    start = time.monotonic()
    assert detect_cloud(aws_url=closed_url(), gcp_url=closed_url()) is None
    assert detect_cloud() is None  # the environment's URLs (closed ports here)
    assert time.monotonic() - start < 0.5


def test_urls_from_the_environment(fake, monkeypatch):
    monkeypatch.setenv(spot.AWS_URL_ENV if fake.cloud == "aws" else spot.GCP_URL_ENV, fake.url)
    fake.notice_after = 0
    assert detect_cloud() == fake.cloud
    assert read_notice(fake.cloud).cloud == fake.cloud


def test_watcher_drains_once_on_a_notice(fake):
    fake.notice_after = 3
    calls: list[Notice] = []
    drained = threading.Event()
    watcher = SpotWatcher(lambda n: (calls.append(n), drained.set()), interval_s=0.05, **urls(fake))
    assert watcher.start() is True and watcher.cloud == fake.cloud
    assert drained.wait(5)
    assert wait_for(lambda: not watcher.running)
    time.sleep(0.2)  # four intervals: no more polls, no second drain
    assert len(calls) == 1 and calls[0].cloud == fake.cloud and watcher.notice == calls[0]
    assert fake.polls == 4
    watcher.stop()


def test_stop_ends_the_thread(fake):
    calls = []
    watcher = SpotWatcher(calls.append, cloud=fake.cloud, interval_s=0.05, **urls(fake))
    assert watcher.start() is True and watcher.running
    assert wait_for(lambda: fake.polls >= 2)
    watcher.stop()
    assert not watcher.running
    polls = fake.polls
    time.sleep(0.2)
    assert fake.polls == polls and calls == [] and watcher.notice is None


def test_start_without_a_cloud_starts_nothing():
    calls = []
    watcher = SpotWatcher(calls.append, interval_s=0.05)
    start = time.monotonic()
    assert watcher.start() is False
    assert time.monotonic() - start < 1.0
    assert not watcher.running and watcher.cloud is None and calls == []
    watcher.stop()  # harmless


def expire_then_notice(aws: Fake) -> list[Notice]:
    """A watcher on `aws` whose token expires after the 2nd poll; the notice comes at the 4th."""
    aws.expire_at, aws.notice_after = 2, 3
    calls: list[Notice] = []
    watcher = SpotWatcher(calls.append, cloud="aws", interval_s=0.05, aws_url=aws.url)
    assert watcher.start()
    assert wait_for(lambda: calls and not watcher.running)
    watcher.stop()
    return calls


def test_aws_token_expiry():
    with serving("aws") as aws:
        calls = expire_then_notice(aws)
        assert len(calls) == 1 and calls[0].deadline_s == aws.deadline
        assert aws.refused == 1  # one 401 for the old token
        assert aws.puts == 2 and len(set(aws.tokens)) == 2  # then a new token, and polling went on
        assert aws.polls == 4


def test_an_expired_token_is_replaced_within_the_poll():
    """The 401 costs no poll: the same read fetches a new token and asks again."""
    with serving("aws") as aws:
        reader = spot._Reader("aws", aws.url, None, timeout_s=1.0)
        assert reader.read() is None and aws.puts == 1
        aws.valid.clear()  # the token expires
        aws.notice_after = 1
        notice = reader.read()
        assert notice is not None and notice.deadline_s == aws.deadline
        assert aws.refused == 1 and aws.puts == 2 and aws.polls == 2


def test_the_token_is_never_logged(caplog):
    caplog.set_level(logging.DEBUG, logger="rayhybrid")
    with serving("aws") as aws:
        detect_cloud(aws_url=aws.url)
        expire_then_notice(aws)
        assert len(aws.tokens) == 3  # detection's, the watcher's first, and the one after the 401
    assert "spot notice from aws" in caplog.text  # the one line of the notice
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
    for token in aws.tokens:
        assert token not in caplog.text


def test_a_failing_drain_is_logged_and_ends_the_watcher(caplog):
    def drain(notice):
        raise RuntimeError("GCS unreachable")

    with serving("gcp") as gcp:
        gcp.notice_after = 0
        watcher = SpotWatcher(drain, cloud="gcp", interval_s=0.05, gcp_url=gcp.url)
        assert watcher.start()
        assert wait_for(lambda: not watcher.running)
        assert gcp.polls == 1 and watcher.notice is not None
    assert "drain callback failed" in caplog.text and "GCS unreachable" in caplog.text


@pytest.mark.parametrize(
    ("make", "setting"),
    [
        (lambda: SpotWatcher(print, interval_s=0), "interval_s"),
        (lambda: SpotWatcher(print, interval_s=-1.0), "interval_s"),
        (lambda: SpotWatcher(print, timeout_s=0), "timeout_s"),
        (lambda: SpotWatcher(print, cloud="azure"), "cloud"),
        (lambda: read_notice("azure"), "cloud"),
        (lambda: read_notice("aws", aws_url="169.254.169.254"), "aws_url"),
        (lambda: detect_cloud(gcp_url="metadata.google.internal"), "gcp_url"),
    ],
)
def test_bad_settings_are_one_line_errors(make, setting):
    with pytest.raises(ValueError) as err:
        make()
    message = str(err.value)
    assert message.startswith(setting) and "\n" not in message


def test_a_bad_poll_interval_is_a_config_error():
    from rayhybrid.config.compose import compose, to_config
    from rayhybrid.errors import ConfigError
    from rayhybrid.preflight import check

    with pytest.raises(ConfigError, match=r"cluster.spot_poll_s: must be positive, got 0"):
        check(to_config(compose(["cluster.spot_poll_s=0"])))


def test_the_drain_reason_is_rays_own_preemption_member(monkeypatch):
    """The watcher actor asks Ray to drain its node with the reason from Ray's own enum
    (`DrainNodeReason.DRAIN_NODE_REASON_PREEMPTION` of its autoscaler protobuf), read when it
    drains, never a copied number: with the enum's member renumbered, the new number goes."""
    import ray._raylet
    from ray.core.generated import autoscaler_pb2

    from rayhybrid.cluster.spot_watch import NodeSpotWatch

    calls = []

    class Gcs:
        def __init__(self, address):
            self.address = address

        def drain_node(self, *args):
            calls.append((self.address, *args))
            return True, ""

    monkeypatch.setattr(ray._raylet, "GcsClient", Gcs)
    watch = NodeSpotWatch("127.0.0.1:6379", "ab" * 28, interval_s=5.0)
    notice = Notice("gcp", 1000.5, "instance/preempted TRUE")
    watch._drain(notice)
    real = autoscaler_pb2.DrainNodeReason.DRAIN_NODE_REASON_PREEMPTION
    assert calls == [("127.0.0.1:6379", "ab" * 28, real, "gcp spot notice: instance/preempted TRUE", 1000500)]
    monkeypatch.setattr(autoscaler_pb2, "DrainNodeReason", type("Reasons", (), {"DRAIN_NODE_REASON_PREEMPTION": 7}))
    watch._drain(notice)
    assert calls[-1][2] == 7
