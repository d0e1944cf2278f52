"""Where a run's files live: a local path, a shared mount, or any fsspec URL (s3://, gs://, ...),
for checkpoints, prepared data and `python -m rayhybrid.prepare`'s input and output alike.

    store = open_store("s3://bucket/runs/a", {"endpoint_url": ...}, setting="checkpoint.dir")
    store.join("step_00000050", "meta.json")     # a path inside it, in the filesystem's own form
    store.url_of(path)                           # the same path as a URL, for DCP and for users

`open_store` is the one way a setting's store is opened (checkpoint.dir with
checkpoint.storage_options, data.path, data.val_path and data.mix with data.storage_options,
prepare's input and output with its storage_options): a one-line ConfigError naming the setting
when it cannot be. Credentials come the way each store's users expect: its environment variables
and files (for S3: AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ~/.aws/...), or the setting's
`storage_options` handed to fsspec. The driver forwards the environment variables (`forwarded_env`) to the workers through
Ray's runtime environment, so nodes started without them still reach the store. Secrets never
leave the process in clear: `redact` is applied wherever a setting is written or logged.

No torch, no Ray here.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from rayhybrid.errors import ConfigError

# Environment variables the workers need to reach a store as the driver does. Listed by
# prefix: every setting of the AWS, Google Cloud and Azure SDKs and clients, and fsspec's own.
FORWARDED_PREFIXES = ("AWS_", "GOOGLE_", "GCLOUD_", "CLOUDSDK_", "GCE_", "AZURE_", "FSSPEC_")
# Setting names whose values are secrets (storage_options keys, environment variable names).
_SECRET_WORDS = {"key", "secret", "token", "password", "passwd", "credential", "credentials", "sas", "signature"}
_OVERRIDE = re.compile(r"^(\+{0,2}[\w.\-]+)=(.*)$", re.DOTALL)
_USERINFO = re.compile(r"([a-zA-Z][\w+.-]*://)[^/@\s]*@")
REDACTED = "REDACTED"  # a plain YAML scalar (unlike "***", which YAML reads as an alias)


def is_secret(name: str) -> bool:
    """Whether a setting called `name` holds a secret: its last word (split at `.`, `_`, `-`)
    is key, secret, token, password, ... (``secret``, ``aws_session_token``, ``account_key``;
    not ``token_dtype`` or ``credentials_file``)."""
    name = name.lower().rsplit(".", 1)[-1]
    return re.split(r"[^a-z0-9]+", name)[-1] in _SECRET_WORDS or name.endswith("connection_string")


def redact(value: Any, name: str = "") -> Any:
    """`value` with every secret replaced by REDACTED: values under secret-looking keys, and the
    user:password part of URLs. Works on nested dicts and lists (configs, records)."""
    if isinstance(value, dict):
        return {
            k: REDACTED if is_secret(str(k)) and v not in (None, "") else redact(v, str(k)) for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v, name) for v in value)
    if isinstance(value, str):
        override = _OVERRIDE.match(value)  # a command-line override, KEY=VALUE
        if override and is_secret(override.group(1)):
            return f"{override.group(1)}={REDACTED}"
        return redact_url(value)
    return value


def secret_values(options: dict, *urls: str) -> list[str]:
    """The secrets in `options` (values under secret keys, nested too) and in the user:password
    part of `urls`: what `scrub` removes from text written in any form (YAML, joined overrides)."""
    found = []
    for key, value in options.items():
        if isinstance(value, dict):
            found += secret_values(value)
        elif is_secret(str(key)) and value not in (None, ""):
            found.append(str(value))
    for url in urls:
        match = re.search(r"[a-zA-Z][\w+.-]*://([^/@\s]*)@", url)
        if match and match.group(1):
            found.append(match.group(1))
    return sorted({s for s in found if len(s) >= 3}, key=len, reverse=True)


def scrub(text: str, secrets: list[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, REDACTED)
    return text


def redact_url(url: str) -> str:
    """``s3://KEY:SECRET@bucket/x`` -> ``s3://REDACTED@bucket/x``; other strings unchanged."""
    return _USERINFO.sub(lambda m: f"{m.group(1)}{REDACTED}@", url)


def forwarded_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The driver's environment variables that configure storage clients (see FORWARDED_PREFIXES)."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k.startswith(FORWARDED_PREFIXES)}


def is_remote(url: str) -> bool:
    return "://" in url and not url.startswith("file://")


@dataclass(frozen=True)
class Store:
    """A checkpoint root: `url` as the user gave it, the fsspec filesystem, the root path in
    that filesystem's own form (no protocol for s3: ``bucket/prefix``)."""

    url: str
    options: dict = field(default_factory=dict)
    fs: Any = None
    root: str = ""

    @classmethod
    def open(cls, url: str | os.PathLike, options: dict | None = None) -> Store:
        """Raises ValueError with a one-line reason when the URL's protocol is unknown or its
        package is not installed (e.g. s3fs for s3://)."""
        url = os.fspath(url)
        if not is_remote(url):
            url = os.path.abspath(os.path.expanduser(url.removeprefix("file://")))
        options = dict(options or {})
        try:
            fs, root = fsspec.core.url_to_fs(url, **options)
        except ImportError as err:
            protocol = url.split("://", 1)[0]
            raise ValueError(f"{protocol}:// needs a package that is not installed ({one_line(err)})") from None
        except (ValueError, TypeError) as err:
            raise ValueError(one_line(err)) from None
        return cls(url=url.rstrip("/"), options=options, fs=fs, root=root.rstrip("/"))

    @property
    def local(self) -> bool:
        """A POSIX filesystem (a node's disk or a shared mount), as opposed to an object store."""
        return isinstance(self.fs, LocalFileSystem)

    @property
    def display(self) -> str:
        """The URL without credentials, for logs, records and errors."""
        return redact_url(self.url)

    def join(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def url_of(self, path: str) -> str:
        """A path of this store as a URL (a plain path for local stores)."""
        return path if self.local else self.fs.unstrip_protocol(path)

    def relative(self, path_or_url: str) -> str:
        """A path or URL under this store -> the path in the filesystem's own form."""
        text = os.fspath(path_or_url)
        if self.local:
            return os.path.abspath(text.removeprefix("file://"))
        return self.fs._strip_protocol(text)

    def fresh(self) -> None:
        """Forget cached listings (s3fs, gcsfs cache them), so the next read sees the store now."""
        self.fs.invalidate_cache()

    def write_bytes(self, path: str, data: bytes) -> None:
        """Write one small object whole: an atomic PUT on object stores, a write to a temporary
        file, fsync and rename on POSIX."""
        if self.local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            return
        self.fs.pipe_file(path, data)

    def read_bytes(self, path: str) -> bytes:
        return self.fs.cat_file(path)


def write_json(store: Store, name: str, data) -> None:
    """`data` as indented JSON in the object `name` under the store's root, written whole
    (`Store.write_bytes`): tracking.json, goodput.json, a prepared dataset's index.json."""
    store.write_bytes(store.join(name), (json.dumps(data, indent=1) + "\n").encode())


def open_store(url: str | os.PathLike, options: dict | None = None, *, setting: str) -> Store:
    """The store at `url`, opened with `options` (the setting's storage_options): the one way a
    setting's store is opened. A one-line ConfigError naming `setting` when the protocol is
    unknown, its package is not installed (s3fs for s3://) or fsspec refuses the options; the
    URL is shown without credentials."""
    url = os.fspath(url)
    validate_url(setting, url)
    try:
        return Store.open(url, options)
    except ValueError as err:
        missing = "not installed" in str(err)
        fix = (
            "install the store's fsspec package (e.g. s3fs, gcsfs)"
            if missing
            else "check the URL and its storage_options"
        )
        raise ConfigError(setting, f"{redact_url(url)}: {err}; {fix}") from None


def one_line(err: BaseException) -> str:
    """An error as `Type: first line of its message`, short enough for a one-line message. DCP's
    CheckpointException lists its ranks first and their errors after: the first rank's error."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, (cause, _) = next(iter(sorted(failures.items(), key=lambda kv: kv[0])))
        return f"{type(err).__name__}: rank {rank}: {one_line(cause)}"[:300]
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return redact_url(f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__)[:300]


# -- the start-up check: does every node see what the driver wrote? ------------------------------

PROBE_DIR = ".rayhybrid-probe"
UNSEEN = ("does not see", "sees a different")  # how check_probe's reasons begin when another store is seen


def write_probe(store: Store) -> tuple[str, str]:
    """The driver writes a marker holding a fresh token; returns (its path, the token)."""
    token = uuid.uuid4().hex
    path = store.join(PROBE_DIR, f"{token}.marker")
    store.write_bytes(path, token.encode())
    return path, token


def check_probe(store: Store, marker: str, token: str) -> str | None:
    """On a node: None when it reads the driver's marker and can write, read back and delete a
    file of its own next to it; else what it could not do, in a few words."""
    try:
        store.fresh()
        seen = store.read_bytes(marker).decode(errors="replace")
    except FileNotFoundError:
        return f"{UNSEEN[0]} the marker the driver wrote there (a disk of its own, or another store)"
    except Exception as err:  # noqa: BLE001 - any client error means the node cannot read it
        return f"cannot read it ({one_line(err)})"
    if seen != token:
        return f"{UNSEEN[1]} file where the driver wrote its marker (a disk of its own?)"
    return round_trip(store, f"{marker}.{uuid.uuid4().hex[:8]}", token.encode())


def round_trip(store: Store, path: str, data: bytes) -> str | None:
    """None when `data` can be written to `path`, read back the same and deleted; else what
    failed, in a few words: "cannot read back what it wrote" or "cannot write there (<error>)"."""
    try:
        store.write_bytes(path, data)
        if store.read_bytes(path) != data:
            return "cannot read back what it wrote"
        store.fs.rm_file(path)
    except Exception as err:  # noqa: BLE001 - any client error: the store cannot be used
        return f"cannot write there ({one_line(err)})"
    return None


def remove_probe(store: Store, marker: str) -> None:
    try:
        store.fs.rm_file(marker)
        if store.local:
            os.rmdir(os.path.dirname(marker))
    except OSError:
        pass


def validate_url(setting: str, url: str) -> None:
    """A URL's protocol must be one fsspec knows, with its package installed (s3fs for s3://):
    a one-line `ConfigError` naming `setting` otherwise. A plain path passes."""
    if "://" not in url:
        return
    import fsspec

    protocol = url.split("://", 1)[0]
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError as err:
        raise ConfigError(
            setting, f"{redact_url(url)} needs a package that is not installed ({one_line(err)})"
        ) from None
    except ValueError:
        raise ConfigError(
            setting, f"unknown storage protocol {protocol}:// in {redact_url(url)}; use a path or s3://, gs://, ..."
        ) from None
