"""A real S3 server to measure against (and to test against: tests/s3.py builds on this): moto's
server mode on 127.0.0.1, in a thread of this process.

    with loopback_aws():              # first: no client can reach a real cloud from here on
        with moto_server() as endpoint:
            os.environ["AWS_ENDPOINT_URL"] = endpoint
            make_bucket("ckpts", endpoint)

`loopback_aws` points every AWS client of this process, and of every process started from it
meanwhile (Ray nodes, training runs), at a dead loopback port and removes any credentials, so a
client that lost its endpoint fails here instead of reaching AWS.
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


def make_bucket(name: str, endpoint: str) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=endpoint, key="testing", secret="testing", skip_instance_cache=True)
    fs.mkdir(name)
