"""Checkpoints on any fsspec store (rayhybrid/storage.py, checkpoint_store.py, trainer/checkpoint.py):
opening stores, the commit marker, asynchronous DCP saves, secrets, the start-up probe and the
config. Each store test runs on a local directory and on s3:// served by moto on 127.0.0.1
(tests/s3.py and benchmarks/s3.py; every AWS client of the process points at a dead loopback port first, so nothing
reaches a real cloud). One process, a 1-rank gloo group; no Ray."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import threading
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from fsspec.registry import known_implementations
from omegaconf import OmegaConf

from benchmarks.s3 import DEAD_ENDPOINT, env
from rayhybrid.config.compose import normalize_overrides
from rayhybrid.config.schema import CheckpointConfig, Config
from rayhybrid.errors import ConfigError
from rayhybrid.preflight import load_config, scrub_run_files
from rayhybrid.storage import checkpoints as cs
from rayhybrid.storage.store import (
    PROBE_DIR,
    Store,
    check_probe,
    forwarded_env,
    is_remote,
    is_secret,
    one_line,
    open_store,
    redact,
    redact_url,
    remove_probe,
    round_trip,
    scrub,
    secret_values,
    write_probe,
)
from rayhybrid.trainer import checkpoint as ckpt
from tests.distributed import free_port
from tests.s3 import objects, s3_session

BUCKET = "rayhybrid-tests"


@pytest.fixture(scope="module")
def s3():
    """moto's S3 endpoint, with AWS_ENDPOINT_URL and test credentials set and a bucket made;
    the environment and s3fs's instance cache are restored afterwards."""
    with s3_session(BUCKET) as endpoint:
        yield endpoint


@pytest.fixture(params=["local", "s3"])
def url(request, tmp_path):
    """A fresh checkpoint root: a local directory, or a prefix of the moto bucket."""
    if request.param == "local":
        return str(tmp_path / "ckpts")
    request.getfixturevalue("s3")
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}/ckpts"


@pytest.fixture
def store(url):
    return Store.open(url)


def write_step(store: Store, step: int, shard: bytes = b"x" * 100, metadata: bool = True) -> str:
    """What DCP leaves in a step directory: a shard, then .metadata (when the save completed)."""
    path = cs.begin(store, step)
    store.write_bytes(f"{path}/__0_0.distcp", shard)
    if metadata:
        store.write_bytes(f"{path}/.metadata", b"meta")
    return path


def commit_step(store: Store, step: int, **kwargs) -> str:
    path = write_step(store, step, **kwargs)
    cs.commit(store, path, {"step": step})
    return path


def steps(paths: list[str]) -> list[int]:
    return [cs.step_of(p) for p in paths]


# -- Store.open ---------------------------------------------------------------------------------


def test_open_local_forms(tmp_path, monkeypatch):
    """A path, a file:// URL and ~ all give the same absolute local root."""
    monkeypatch.setenv("HOME", str(tmp_path))
    target = str(tmp_path / "ckpts")
    for given in (target, f"file://{target}", "~/ckpts", target + "/"):
        store = Store.open(given)
        assert store.local and store.url == store.root == target, given
        assert store.url_of(store.join("step_1")) == f"{target}/step_1"
    assert not is_remote(target) and not is_remote(f"file://{target}") and is_remote("s3://b/x")


def test_open_s3_root(s3):
    store = Store.open(f"s3://{BUCKET}/runs/a/", {"endpoint_url": s3})
    assert not store.local
    assert (store.url, store.root, store.options) == (f"s3://{BUCKET}/runs/a", f"{BUCKET}/runs/a", {"endpoint_url": s3})
    path = store.join("step_00000001", "meta.json")
    assert path == f"{BUCKET}/runs/a/step_00000001/meta.json"
    assert store.url_of(path) == f"s3://{path}" and store.relative(f"s3://{path}") == path


def missing_package_protocol() -> str:
    """A protocol fsspec knows whose package is not installed here (gs:// without gcsfs, ...)."""
    for protocol in ("gs", "az", "oci", "box"):
        module = known_implementations[protocol]["class"].split(".")[0]
        if importlib.util.find_spec(module) is None:
            return protocol
    raise AssertionError("gcsfs, adlfs, ocifs and boxfs are all installed: pick another protocol")


def test_open_missing_package_is_one_line_error():
    protocol = missing_package_protocol()
    with pytest.raises(ValueError, match=f"^{protocol}:// needs a package that is not installed") as err:
        Store.open(f"{protocol}://bucket/x")
    assert "\n" not in str(err.value)


def test_open_unknown_protocol_is_one_line_error():
    with pytest.raises(ValueError, match="nope") as err:
        Store.open("nope://bucket/x")
    assert "\n" not in str(err.value)


def test_display_hides_credentials(s3):
    store = Store.open(f"s3://AKIAXX:hunter2pw@{BUCKET}/x")
    assert store.display == f"s3://REDACTED@{BUCKET}/x"
    assert redact_url("ftp://u:p@host/a and s3://b/c") == "ftp://REDACTED@host/a and s3://b/c"
    assert one_line(OSError("cannot reach s3://u:pw@b/x\nmore")) == "OSError: cannot reach s3://REDACTED@b/x"


# -- checkpoint_store: the commit marker ---------------------------------------------------------


def test_uncommitted_is_never_latest(store):
    """A step directory with data but no meta.json (a save in flight or interrupted) is passed over."""
    assert cs.latest(store) is None and cs.step_dirs(store) == []  # the root does not exist yet
    write_step(store, 5)
    assert cs.latest(store) is None
    commit_step(store, 3)
    write_step(store, 7, metadata=False)
    assert cs.latest(store).step == 3
    assert steps(cs.uncommitted(store)) == [5, 7]
    assert steps(cs.committed(store)) == [3]
    assert steps(cs.step_dirs(store)) == [3, 5, 7]


def test_commit_records_file_sizes(store):
    path = write_step(store, 4, shard=b"y" * 123)
    meta = cs.commit(store, path, {"step": 4, "consumed_samples": 64}).meta
    assert meta == {"step": 4, "consumed_samples": 64, "files": {".metadata": 4, "__0_0.distcp": 123}}
    assert json.loads(store.read_bytes(f"{path}/meta.json")) == meta
    latest = cs.latest(store)
    assert latest.path == store.url_of(path) and latest.meta == meta
    assert latest.path.startswith("s3://" if not store.local else "/")
    assert cs.check(latest.path).meta == meta  # the URL alone opens its store


def test_commit_refuses_without_dcp_metadata(store):
    path = write_step(store, 2, metadata=False)
    with pytest.raises(ValueError, match="no DCP .metadata"):
        cs.commit(store, path, {"step": 2})
    assert not store.fs.exists(f"{path}/meta.json")
    assert cs.latest(store) is None


def test_corrupt_committed_checkpoint_is_skipped(store, caplog):
    """meta.json records every file's size: a truncated or deleted file is found without reading it."""
    old = commit_step(store, 1)
    new = commit_step(store, 2)
    store.write_bytes(f"{new}/__0_0.distcp", b"x" * 10)  # truncated
    with caplog.at_level(logging.WARNING, logger="rayhybrid.storage.checkpoints"):
        assert cs.latest(store).step == 1
    assert "skipping checkpoint" in caplog.text and "__0_0.distcp has 10 bytes, expected 100" in caplog.text
    caplog.clear()
    store.fs.rm_file(f"{old}/__0_0.distcp")
    with caplog.at_level(logging.WARNING, logger="rayhybrid.storage.checkpoints"):
        assert cs.latest(store) is None
    assert "__0_0.distcp is missing" in caplog.text
    with pytest.raises(ValueError, match="not committed"):
        cs.check(store, write_step(store, 3))


def test_retain_keeps_newest_committed(store):
    for step in (1, 2, 3, 4):
        commit_step(store, step)
    write_step(store, 5)
    write_step(store, 6, metadata=False)
    gone = cs.retain(store, keep=2)
    assert sorted(steps(gone)) == [1, 2, 5, 6]
    assert steps(cs.step_dirs(store)) == [3, 4] == steps(cs.committed(store))
    assert cs.latest(store).step == 4
    write_step(store, 7)
    assert steps(cs.retain(store, keep=0)) == [7]  # 0 keeps every committed one
    assert steps(cs.step_dirs(store)) == [3, 4]


def test_retain_removes_legacy_tmp_dirs(tmp_path):
    store = Store.open(tmp_path)
    (tmp_path / ".tmp-step_00000003").mkdir()
    commit_step(store, 1)
    assert cs.retain(store, keep=1) == [str(tmp_path / ".tmp-step_00000003")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]


def test_begin_uncommits_and_empties_a_step(store):
    """A step saved again (a run that went back past it) is never readable half-rewritten."""
    path = commit_step(store, 7)
    assert cs.begin(store, 7) == path
    assert cs.latest(store) is None and cs.committed(store) == []
    store.fresh()
    if store.local:
        assert store.fs.ls(path) == []
    else:
        assert not store.fs.exists(path) and objects(store.url, os.environ["AWS_ENDPOINT_URL"]) == {}


def test_s3_layout_is_written_in_place(s3):
    """On S3 the shards and the marker are objects under step_<N>/ (no temporary name, no rename)."""
    store = Store.open(f"s3://{BUCKET}/layout")
    commit_step(store, 9)
    assert sorted(objects(store.url, s3)) == [
        f"{BUCKET}/layout/step_00000009/.metadata",
        f"{BUCKET}/layout/step_00000009/__0_0.distcp",
        f"{BUCKET}/layout/step_00000009/meta.json",
    ]


# -- Saver: real DCP saves on a 1-rank gloo group -----------------------------------------------


@pytest.fixture(scope="module")
def gloo():
    assert not dist.is_initialized()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        yield dist.new_group(), dist.new_group(backend="gloo")
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


class FakeTrainer:
    """The attributes Saver and state_dict use: one stage, its optimizer, the groups, the step."""

    def __init__(self, groups, seed: int, step: int = 0) -> None:
        torch.manual_seed(seed)
        module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        self.stages = [(0, module)]
        self.optimizers = [torch.optim.AdamW(module.parameters(), lr=0.1)]
        self.world_group, self.upload_group = groups
        self.step = step

    def train(self) -> None:
        module, opt = self.stages[0][1], self.optimizers[0]
        module(torch.randn(3, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        self.step += 1

    def meta(self) -> dict:
        """What the trainer's `Checkpoints` commits with a save (`trainer_meta`), in short."""
        return {"step": self.step, "consumed_samples": 8 * self.step}

    def tensors(self) -> dict[str, torch.Tensor]:
        module, opt = self.stages[0][1], self.optimizers[0]
        out = {f"param.{k}": v.detach().clone() for k, v in module.state_dict().items()}
        for i, state in enumerate(opt.state_dict()["state"].values()):
            out.update({f"optim.{i}.{k}": torch.as_tensor(v).clone() for k, v in state.items()})
        return out


@pytest.fixture
def saver(gloo, url):
    """A trained FakeTrainer and an asynchronous Saver for `url` (keep 2); closed at the end."""
    trainer = FakeTrainer(gloo, seed=0)
    trainer.train()
    saver = ckpt.Saver(trainer, url, {}, keep=2, async_save=True, upload_group=trainer.upload_group)
    yield saver
    saver.wait()
    saver.close()


@pytest.fixture
def gate(monkeypatch):
    """An event the DCP writers made meanwhile wait for in write_data: an upload in progress."""
    event = threading.Event()
    make = ckpt.writer

    def gated_writer(*args, **kwargs):
        out = make(*args, **kwargs)
        write_data = out.write_data

        def wait_then_write(plan, planner):
            assert event.wait(30), "the test never let the upload go on"
            return write_data(plan, planner)

        out.write_data = wait_then_write
        return out

    monkeypatch.setattr(ckpt, "writer", gated_writer)
    yield event
    event.set()


def meta_exists(saver, step: int) -> bool:
    saver.store.fresh()
    return saver.store.fs.exists(saver.store.join(cs.name_for(step), "meta.json"))


def test_async_save_commits_after_upload(saver, gate):
    """save() returns while the upload is held; meta.json appears only once it is done."""
    record = saver.save(saver.trainer.meta())
    assert record.step == 1 and record.asynchronous and record.upload_s is None and record.finished == ()
    assert record.pending and record.error is None
    assert record.path == saver.store.url_of(saver.store.join("step_00000001"))
    assert saver.poll() == [] and not meta_exists(saver, 1) and cs.latest(saver.store) is None
    gate.set()
    [done] = saver.wait()
    assert done.step == 1 and done.error is None and not done.pending
    assert done.upload_s >= 0 and 0 <= done.blocked_s == record.blocked_s
    assert meta_exists(saver, 1) and cs.latest(saver.store).meta["consumed_samples"] == 8
    assert saver.wait() == [] and saver.poll() == []


def test_next_save_waits_for_previous(saver, gate):
    saver.save(saver.trainer.meta())
    saver.trainer.train()
    threading.Timer(0.3, gate.set).start()
    record = saver.save(saver.trainer.meta())  # blocks until step 1 is uploaded and committed
    assert record.waited_s >= 0.25 and record.blocked_s >= record.waited_s
    [first] = record.finished
    assert first.step == 1 and first.upload_s is not None and first.error is None
    [second] = saver.wait()
    assert second.step == 2 and second.error is None
    assert steps(cs.committed(saver.store)) == [1, 2]


@pytest.mark.parametrize("async_save", [True, False])
def test_save_then_load_restores_exactly(gloo, url, async_save):
    trainer = FakeTrainer(gloo, seed=0)
    trainer.train()
    trainer.train()
    saver = ckpt.Saver(trainer, url, {}, keep=2, async_save=async_save, upload_group=trainer.upload_group)
    record = saver.save(saver.trainer.meta())
    rng = torch.get_rng_state()
    if async_save:
        assert record.upload_s is None
        [record] = saver.wait()
    assert record.upload_s >= 0 and record.blocked_s >= 0 and record.error is None
    assert record.asynchronous == async_save
    saver.close()
    latest = cs.latest(Store.open(url))
    assert latest.step == 2 and latest.path == record.path

    other = FakeTrainer(gloo, seed=1)
    torch.rand(5)  # move the RNG on: load must bring it back
    before = other.tensors()
    ckpt.load(other, latest.path)
    expected, loaded = trainer.tensors(), other.tensors()
    assert sorted(loaded) == sorted(expected) and len(expected) == 4 + 4 * 3
    assert not torch.equal(before["param.0.weight"], expected["param.0.weight"])
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name
    assert torch.equal(torch.get_rng_state(), rng)


def test_storage_options_reach_dcp(gloo, s3, monkeypatch, request):
    """With the environment's endpoint dead, a save and a load given endpoint_url in
    checkpoint.storage_options still reach moto: the options are not dropped on the way to DCP."""
    import s3fs

    monkeypatch.setenv("AWS_ENDPOINT_URL", DEAD_ENDPOINT)
    s3fs.S3FileSystem.clear_instance_cache()  # no client made for moto from the environment
    request.addfinalizer(s3fs.S3FileSystem.clear_instance_cache)  # nor, later, one for the dead endpoint
    url, options = f"s3://{BUCKET}/options", {"endpoint_url": s3, "config_kwargs": {"retries": {"max_attempts": 1}}}
    trainer = FakeTrainer(gloo, seed=0)
    trainer.train()
    saver = ckpt.Saver(trainer, url, options, keep=1, async_save=True, upload_group=trainer.upload_group)
    saver.save(saver.trainer.meta())
    [record] = saver.wait()
    saver.close()
    assert record.error is None, record
    assert f"{BUCKET}/options/step_00000001/meta.json" in objects(url, s3)
    assert cs.latest(Store.open(url, options)).step == 1
    other = FakeTrainer(gloo, seed=1)
    ckpt.load(other, record.path, options)
    assert torch.equal(other.tensors()["param.1.bias"], trainer.tensors()["param.1.bias"])


@pytest.fixture
def failing(monkeypatch):
    """The DCP writers made meanwhile raise in write_data: a store that refuses the upload."""
    make = ckpt.writer

    def failing_writer(*args, **kwargs):
        out = make(*args, **kwargs)

        def write_data(plan, planner):
            raise OSError("disk on fire")

        out.write_data = write_data
        return out

    return lambda: monkeypatch.setattr(ckpt, "writer", failing_writer)


def test_failed_upload_is_reported_not_committed(saver, failing):
    """A write that fails in the upload thread becomes a record with a one-line "error" naming
    it (the thread writes with DCP's writer directly, so the error is the writer's own, not
    DCP's CheckpointException); the previous checkpoint stays the latest."""
    saver.save(saver.trainer.meta())
    assert saver.wait()[0].error is None
    failing()
    saver.trainer.train()
    saver.save(saver.trainer.meta())
    [failed] = saver.wait()
    assert failed.step == 2 and failed.upload_s is None
    assert failed.error.startswith("OSError") and "\n" not in failed.error
    assert not meta_exists(saver, 2)
    assert cs.latest(saver.store).step == 1
    assert steps(cs.committed(saver.store)) == [1]


def test_failed_upload_error_names_the_cause(saver, failing):
    failing()
    saver.save(saver.trainer.meta())
    [failed] = saver.wait()
    assert "disk on fire" in failed.error, failed.error


def test_close_abandons_the_upload(saver, gate):
    """close() while the upload runs (a failed world): the save is never committed."""
    saver.save(saver.trainer.meta())
    saver.close()
    gate.set()
    [abandoned] = saver.wait()
    assert abandoned.step == 1 and abandoned.error.startswith("abandoned")
    assert not meta_exists(saver, 1) and cs.latest(saver.store) is None


# -- secrets ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,secret",
    [
        ("secret", True),
        ("aws_secret_access_key", True),
        ("sas_token", True),
        ("aws_session_token", True),
        ("account_key", True),
        ("checkpoint.storage_options.password", True),
        ("AZURE_STORAGE_CONNECTION_STRING", True),
        ("token_dtype", False),
        ("credentials_file", False),
        ("tokens_per_s", False),
        ("endpoint_url", False),
        ("key_prefix", False),
    ],
)
def test_is_secret(name, secret):
    assert is_secret(name) is secret


def test_redact_nested_values_urls_and_overrides():
    config = {
        "dir": "s3://AKIA:pw123@bucket/run",
        "storage_options": {"key": "AKIA", "secret": "pw123", "token": "", "endpoint_url": "http://h:9000"},
        "overrides": ["checkpoint.storage_options.secret=pw123", "train.steps=5", "++x.password=abc"],
        "tokens_per_s": 1000.0,
    }
    assert redact(config) == {
        "dir": "s3://REDACTED@bucket/run",
        "storage_options": {"key": "REDACTED", "secret": "REDACTED", "token": "", "endpoint_url": "http://h:9000"},
        "overrides": ["checkpoint.storage_options.secret=REDACTED", "train.steps=5", "++x.password=REDACTED"],
        "tokens_per_s": 1000.0,
    }
    assert config["storage_options"]["secret"] == "pw123"  # a copy, the original untouched


def test_secret_values_and_scrub():
    options = {"secret": "s3cr3t-value", "client_kwargs": {"aws_session_token": "tok-123"}, "region": "eu", "key": "k"}
    found = secret_values(options, "s3://AKIA:pw123@bucket/x", "/local/path")
    assert found == ["s3cr3t-value", "AKIA:pw123", "tok-123"]  # longest first; "k" is too short to scrub
    text = "secret: s3cr3t-value\nuser: AKIA:pw123\ntoken=tok-123 region: eu"
    assert scrub(text, found) == "secret: REDACTED\nuser: REDACTED\ntoken=REDACTED region: eu"


SECRET_CFG = Config(
    checkpoint=CheckpointConfig(
        dir="s3://AKIA:pw123@bucket/run", storage_options={"secret": "s3cr3t-value", "endpoint_url": "http://h"}
    )
)


def run_files(tmp_path) -> Path:
    """A run's .hydra directory as api.run and Hydra write it: the config, the overrides, and
    hydra.yaml with the overrides joined into one string."""
    hydra = tmp_path / ".hydra"
    hydra.mkdir()
    OmegaConf.save(OmegaConf.structured(SECRET_CFG), hydra / "config.yaml")
    OmegaConf.save(
        OmegaConf.create(["checkpoint.storage_options.secret=s3cr3t-value", "train.steps=5"]), hydra / "overrides.yaml"
    )
    (hydra / "hydra.yaml").write_text(
        "hydra:\n  job:\n    override_dirname: checkpoint.storage_options.secret=s3cr3t-value,train.steps=5\n"
    )
    (hydra / "unrelated.yaml").write_text("a: 1\n")
    return hydra


def test_scrub_run_files(tmp_path):
    hydra = run_files(tmp_path)
    assert "s3cr3t-value" in (hydra / "config.yaml").read_text()
    scrub_run_files(hydra, SECRET_CFG)
    for path in hydra.iterdir():
        text = path.read_text()
        assert "s3cr3t-value" not in text and "pw123" not in text, path
    config = (hydra / "config.yaml").read_text()
    assert "dir: s3://REDACTED@bucket/run" in config and "endpoint_url: http://h" in config
    hydra_yaml = (hydra / "hydra.yaml").read_text()
    assert "override_dirname: checkpoint.storage_options.secret=REDACTED,train.steps=5" in hydra_yaml
    assert yaml.safe_load((hydra / "overrides.yaml").read_text()) == [
        "checkpoint.storage_options.secret=REDACTED",
        "train.steps=5",
    ]
    assert (hydra / "unrelated.yaml").read_text() == "a: 1\n"


def test_scrubbed_run_files_stay_valid_yaml(tmp_path):
    hydra = run_files(tmp_path)
    scrub_run_files(hydra, SECRET_CFG)
    config = yaml.safe_load((hydra / "config.yaml").read_text())
    assert config["checkpoint"]["storage_options"] == {"secret": "REDACTED", "endpoint_url": "http://h"}


def test_forwarded_env():
    environ = {
        "AWS_ACCESS_KEY_ID": "a",
        "AWS_ENDPOINT_URL": "http://h",
        "GOOGLE_APPLICATION_CREDENTIALS": "/k.json",
        "AZURE_STORAGE_ACCOUNT": "acct",
        "FSSPEC_S3_ENDPOINT_URL": "http://h",
        "PATH": "/bin",
        "HOME": "/root",
        "MY_AWS_KEY": "x",
        "aws_access_key_id": "lower",
        "CUDA_VISIBLE_DEVICES": "0",
    }
    assert forwarded_env(environ) == {
        "AWS_ACCESS_KEY_ID": "a",
        "AWS_ENDPOINT_URL": "http://h",
        "GOOGLE_APPLICATION_CREDENTIALS": "/k.json",
        "AZURE_STORAGE_ACCOUNT": "acct",
        "FSSPEC_S3_ENDPOINT_URL": "http://h",
    }
    with env(AWS_REGION="eu-west-1", RAYHYBRID_UNRELATED="1"):
        got = forwarded_env()
    assert got["AWS_REGION"] == "eu-west-1" and "RAYHYBRID_UNRELATED" not in got
    assert all(k.startswith(("AWS_", "GOOGLE_", "GCLOUD_", "CLOUDSDK_", "GCE_", "AZURE_", "FSSPEC_")) for k in got)


# -- the start-up probe -------------------------------------------------------------------------


def test_probe_on_a_shared_store(store):
    marker, token = write_probe(store)
    assert marker.startswith(store.join(PROBE_DIR)) and store.read_bytes(marker) == token.encode()
    assert check_probe(Store.open(store.url), marker, token) is None  # another client of the same store
    store.fresh()
    assert store.fs.ls(store.join(PROBE_DIR), detail=False) == [marker]  # the node's own file is gone
    remove_probe(store, marker)
    store.fresh()
    assert not store.fs.exists(marker)
    assert check_probe(store, marker, token).startswith("does not see the marker")


def test_probe_memory_store_in_process():
    """memory:// is shared by everything in one process: it sees the marker; a path that was
    never written (another disk) does not."""
    url = f"memory://probe-{uuid.uuid4().hex[:8]}"
    driver = Store.open(url)
    marker, token = write_probe(driver)
    try:
        assert check_probe(Store.open(url), marker, token) is None
        assert check_probe(Store.open(url), marker, "another-token").startswith("sees a different file")
        reason = check_probe(Store.open(url), driver.join(PROBE_DIR, "nobody.marker"), token)
        assert reason.startswith("does not see the marker the driver wrote there")
    finally:
        driver.fs.rm(driver.root, recursive=True)


def test_probe_missing_bucket_is_a_reason(s3):
    store = Store.open("s3://no-such-bucket-rayhybrid/run")
    reason = check_probe(store, store.join(PROBE_DIR, "x.marker"), "token")
    assert reason.startswith("does not see the marker")


def test_probe_unreachable_store_is_a_reason(s3):
    """A client error (here: nothing listens at the endpoint) is a reason too, in one line."""
    store = Store.open(
        f"s3://{BUCKET}/run", {"endpoint_url": DEAD_ENDPOINT, "config_kwargs": {"retries": {"max_attempts": 1}}}
    )
    reason = check_probe(store, store.join(PROBE_DIR, "x.marker"), "token")
    assert reason.startswith("cannot read it (EndpointConnectionError") and "\n" not in reason


def test_round_trip_names_what_failed(tmp_path, monkeypatch):
    """The write, read back and delete that the start-up probe and `python -m rayhybrid.check`
    both run: None and nothing left; a path under a file cannot be written; a store that reads
    back other bytes than it wrote is named for it."""
    store = Store.open(str(tmp_path / "run"))
    assert round_trip(store, store.join("probe"), b"x") is None and not store.fs.exists(store.join("probe"))
    (tmp_path / "file").write_text("")
    under_a_file = Store.open(str(tmp_path / "file"))
    assert round_trip(under_a_file, under_a_file.join("probe"), b"x").startswith("cannot write there (")
    monkeypatch.setattr(Store, "read_bytes", lambda self, path: b"y")
    assert round_trip(store, store.join("probe"), b"x") == "cannot read back what it wrote"


# -- config -------------------------------------------------------------------------------------


def test_config_storage_options_and_async_save():
    cfg = load_config(["checkpoint.storage_options.endpoint_url=http://x", "checkpoint.async_save=false"])
    assert cfg.checkpoint.storage_options == {"endpoint_url": "http://x"}
    assert cfg.checkpoint.async_save is False
    assert load_config([]).checkpoint.async_save is True
    assert normalize_overrides(["checkpoint.storage_options.a=1", "++checkpoint.storage_options.b=2", "x.y=3"]) == [
        "++checkpoint.storage_options.a=1",
        "++checkpoint.storage_options.b=2",
        "x.y=3",
    ]


def test_open_store_unknown_protocol_is_config_error():
    """One way to open a setting's store: a one-line ConfigError naming the setting it was
    given, never with credentials (checkpoint.dir, data.path, prepare's input, ...)."""
    for setting in ("checkpoint.dir", "data.path", "input"):
        with pytest.raises(ConfigError) as err:
            open_store("nope://u:pw123@x", {}, setting=setting)
        assert err.value.setting == setting
        assert "pw123" not in str(err.value) and "\n" not in str(err.value)
    assert open_store("memory://x/", {}, setting="output").url == "memory://x"


def test_scrub_run_files_removes_the_data_stores_secrets(tmp_path):
    """data.storage_options (and a user:password in data.path) are secrets like checkpoint's:
    none is left in the files Hydra keeps of a run."""
    cfg = Config(
        data=dataclasses.replace(
            Config().data,
            path="s3://AKIA:pw456@bucket/ds",
            storage_options={"secret": "data-s3cr3t", "key": "AKIAdata"},
        )
    )
    hydra = tmp_path / ".hydra"
    hydra.mkdir()
    OmegaConf.save(OmegaConf.structured(cfg), hydra / "config.yaml")
    (hydra / "overrides.yaml").write_text("- data.storage_options.secret=data-s3cr3t\n")
    scrub_run_files(hydra, cfg)
    for path in hydra.iterdir():
        text = path.read_text()
        assert not any(s in text for s in ("data-s3cr3t", "AKIAdata", "pw456")), (path, text)
    assert yaml.safe_load((hydra / "config.yaml").read_text())["data"]["storage_options"]["secret"] == "REDACTED"
    assert redact(dataclasses.asdict(cfg))["data"]["storage_options"] == {"secret": "REDACTED", "key": "REDACTED"}


def test_data_storage_options_compose_like_checkpoints():
    cfg = load_config(["data.storage_options.endpoint_url=http://x", "data.storage_options.key=k"])
    assert cfg.data.storage_options == {"endpoint_url": "http://x", "key": "k"}
