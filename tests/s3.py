"""A real S3 server for tests: moto's server mode on 127.0.0.1, in a thread of the test process.

    with loopback_aws():              # first: no client can reach a real cloud from here on
        with moto_server() as endpoint:
            os.environ["AWS_ENDPOINT_URL"] = endpoint
            make_bucket("ckpts")

`loopback_aws` points every AWS client of this process, and of every process started from it
meanwhile (Ray nodes), at a dead loopback port and removes any credentials, so a client that
lost its endpoint fails here instead of reaching AWS.
"""

from __future__ import annotations

import contextlib
import logging
import os

DEAD_ENDPOINT = "http://127.0.0.1:9"  # the discard port: nothing listens there
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@contextlib.contextmanager
def env(**values: str | None):
    """Set (or with None, remove) environment variables; restore them afterwards."""
    before = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def loopback_aws():
    names = [
        k for k in os.environ if k.startswith("AWS_") and k not in ("AWS_ENDPOINT_URL", "AWS_EC2_METADATA_DISABLED")
    ]
    with env(**dict.fromkeys(names), AWS_ENDPOINT_URL=DEAD_ENDPOINT, AWS_EC2_METADATA_DISABLED="true"):
        yield


@contextlib.contextmanager
def moto_server():
    """Start moto's S3 server on a free loopback port; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # verbose=False leaves the request log on
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@contextlib.contextmanager
def moto_process():
    """An S3 server of its own in another process (moto's servers in one process share their
    buckets); yields its endpoint URL."""
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(endpoint, timeout=1)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "moto's server did not start"
                time.sleep(0.2)
        yield endpoint
    finally:
        proc.kill()
        proc.wait()


def make_bucket(name: str, endpoint: str) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=endpoint, key="testing", secret="testing", skip_instance_cache=True)
    fs.mkdir(name)


def objects(url: str, endpoint: str) -> dict[str, bytes]:
    """Every object under `url` (s3://bucket/prefix) -> its content."""
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=endpoint, key="testing", secret="testing", skip_instance_cache=True)
    return {path: fs.cat_file(path) for path in fs.find(url)}


@contextlib.contextmanager
def s3_session(bucket: str):
    """moto's S3 server on loopback, AWS_ENDPOINT_URL and test credentials set, `bucket` made;
    yields the endpoint. The environment and s3fs's instance cache are restored afterwards (no
    client built for another endpoint is reused, before or after)."""
    import s3fs

    with contextlib.ExitStack() as stack:
        stack.enter_context(loopback_aws())  # first: a client that loses its endpoint fails here
        endpoint = stack.enter_context(moto_server())
        stack.enter_context(env(AWS_ENDPOINT_URL=endpoint, **CREDENTIALS))
        stack.callback(s3fs.S3FileSystem.clear_instance_cache)
        s3fs.S3FileSystem.clear_instance_cache()
        make_bucket(bucket, endpoint)
        yield endpoint
