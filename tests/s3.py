"""S3 for tests: moto's server on loopback (benchmarks/s3.py, which the benchmarks measure
against too), and what only the tests need on top of it: a whole session with a bucket
(`s3_session`), a server in a process of its own (`moto_process`) and a bucket's objects
(`objects`).

    with s3_session("ckpts") as endpoint:    # AWS_ENDPOINT_URL and test credentials set
        ...
"""

from __future__ import annotations

import contextlib

from benchmarks.s3 import CREDENTIALS, env, loopback_aws, make_bucket, moto_server


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


def objects(url: str, endpoint: str) -> dict[str, bytes]:
    """Every object under `url` (s3://bucket/prefix) -> its content."""
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=endpoint, key="testing", secret="testing", skip_instance_cache=True)
    return {path: fs.cat_file(path) for path in fs.find(url)}


def reset_moto(endpoint: str) -> None:
    """Empty every bucket of the moto server at `endpoint` (and of the others in its process)."""
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST"), timeout=10).close()


@contextlib.contextmanager
def s3_session(bucket: str):
    """moto's S3 server on loopback, AWS_ENDPOINT_URL and test credentials set, `bucket` made;
    yields the endpoint. The environment and s3fs's instance cache are restored afterwards (no
    client built for another endpoint is reused, before or after)."""
    import s3fs

    with contextlib.ExitStack() as stack:
        stack.enter_context(loopback_aws())  # first: a client that loses its endpoint fails here
        endpoint = stack.enter_context(moto_server())
        # moto's servers in one process share their buckets: the next session starts empty.
        stack.callback(reset_moto, endpoint)
        stack.enter_context(env(AWS_ENDPOINT_URL=endpoint, **CREDENTIALS))
        stack.callback(s3fs.S3FileSystem.clear_instance_cache)
        s3fs.S3FileSystem.clear_instance_cache()
        make_bucket(bucket, endpoint)
        yield endpoint
