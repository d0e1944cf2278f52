"""What one node says of itself, in a small task pinned to it (and what the driver says of
itself, the same way): the Python version, the versions of the packages a run imports, a digest
of rayhybrid's code, the devices torch sees, whether the checkpoint store takes a small file
and whether the datasets the config names can be listed. Every answer is plain data (a dict),
every failure a short reason with no secret in it.

No Ray here: `rayhybrid.check.nodes` runs `node_facts` in the tasks.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import platform
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from rayhybrid.storage.store import PROBE_DIR, Store, one_line, redact_url, round_trip

PACKAGES = (
    "torch",
    "ray",
    "rayhybrid",
    "numpy",
    "fsspec",
    "hydra-core",
    "transformers",
    "safetensors",
    "torchao",
)
"""The distributions whose versions every node must share with the driver (plus the checkpoint
store's fsspec package, `store_package`)."""


@dataclass(frozen=True)
class Request:
    """What a node is asked to check. `store`: checkpoint.dir and its storage_options (None:
    not checked); `datasets`: (setting, path or URL) with data.storage_options."""

    packages: tuple[str, ...] = PACKAGES
    gpu: bool = False
    store: tuple[str, dict] | None = None
    datasets: tuple[tuple[str, str], ...] = ()
    data_options: dict = field(default_factory=dict)


def node_facts(req: Request) -> dict:
    """This process's node, as the checks compare it: {"host", "python", "packages": {name:
    version or None}, "code": digest, "devices": {...}, "store": reason or None, "datasets":
    {setting: reason or None}}."""
    return {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "packages": {name: version(name) for name in req.packages},
        "code": code_digest(),
        "devices": devices(req.gpu),
        "store": store_reason(*req.store) if req.store else None,
        "datasets": {setting: dataset_reason(url, req.data_options) for setting, url in req.datasets},
    }


def version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def code_digest() -> str | None:
    """The first 12 hex digits of a SHA-256 over rayhybrid's .py files (relative path and
    content, sorted) where this process imports it from: two copies of one version that differ
    (an older install, another checkout) differ here."""
    spec = importlib.util.find_spec("rayhybrid")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] == "conf":
            continue  # an installed copy's rayhybrid.conf package (conf/ beside it in a checkout)
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def devices(gpu: bool) -> dict:
    """On CPU: {"kind": "cpu", "backend": "gloo"} (torch is not imported). On GPUs: what torch
    sees ({"kind": "cuda", "count", "names", "cuda", "nccl"}), or why it sees nothing."""
    if not gpu:
        return {"kind": "cpu", "backend": "gloo", "count": 0, "names": []}
    try:
        import torch
        import torch.distributed as dist

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
        nccl = dist.is_available() and dist.is_nccl_available()
        return {
            "kind": "cuda",
            "backend": "nccl",
            "count": count,
            "names": names,
            "cuda": torch.version.cuda,
            "nccl": nccl,
        }
    except Exception as err:  # noqa: BLE001 - a broken install is an answer too
        return {"kind": "cuda", "backend": "nccl", "count": 0, "names": [], "error": one_line(err)}


def store_package(url: str) -> str | None:
    """The distribution that serves `url`'s protocol (s3fs for s3://), None for a path or a
    protocol fsspec serves itself."""
    if "://" not in url:
        return None
    from fsspec.registry import known_implementations

    impl = known_implementations.get(url.split("://", 1)[0], {}).get("class", "")
    top = impl.split(".", 1)[0]
    if not top or top == "fsspec":
        return None
    return (importlib.metadata.packages_distributions().get(top) or [top])[0]


def store_reason(url: str, options: dict) -> str | None:
    """None when a small file can be written, read back and deleted under `url`; else what
    failed, in a few words (redacted)."""
    try:
        store = Store.open(url, options)
    except Exception as err:  # noqa: BLE001 - any client error: the store cannot be used
        return f"cannot write there ({one_line(err)})"
    path = store.join(PROBE_DIR, f"check-{uuid.uuid4().hex}")
    reason = round_trip(store, path, b"rayhybrid.check")
    if reason is None and store.local:
        with contextlib.suppress(OSError):  # left when another probe is in it
            Path(path).parent.rmdir()
    return reason


def dataset_reason(url: str, options: dict) -> str | None:
    """None when `url` (a file or a directory, a path or a URL) can be listed."""
    try:
        store = Store.open(url, options)
        if any(ch in url for ch in "*?["):  # a glob of text files
            if not store.fs.glob(store.root):
                return f"{redact_url(url)} matches no file"
        else:
            store.fs.info(store.root or url)
    except FileNotFoundError:
        return f"{redact_url(url)} is not there"
    except Exception as err:  # noqa: BLE001
        return f"cannot list {redact_url(url)} ({one_line(err)})"
    return None
