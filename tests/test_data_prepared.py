"""data=prepared without Ray: where each sample comes from (packing, epochs, mixtures), what is
read from the store (ranged reads, the node cache, read-ahead), and the checks before a run.

Datasets are written in the prepared format directly (tests/prepared.py); the tool that writes
them from text, `python -m rayhybrid.prepare`, is tested in test_prepare.py, the whole run on a
cluster in test_data_cluster.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter

import numpy as np
import pytest

from benchmarks.s3 import DEAD_ENDPOINT
from rayhybrid.config.schema import Config, DataConfig
from rayhybrid.data import reader
from rayhybrid.data.packing import BLOCK, Mixture, Part
from rayhybrid.data.prepared import open_prepared
from rayhybrid.data.reader import PreparedStream
from rayhybrid.errors import ConfigError
from rayhybrid.preflight import load_config
from tests.prepared import random_documents, write_dataset
from tests.s3 import s3_session

SEQ = 16


def stream_of(documents, held=()) -> np.ndarray:
    return np.concatenate([d for i, d in enumerate(documents) if i not in set(held)])


def test_every_window_of_an_epoch_is_read_once_and_each_epoch_in_a_new_order(tmp_path):
    docs = random_documents(60, seed=3)
    ds = open_prepared(write_dataset(tmp_path / "ds", docs, shards=3))
    part = Part(ds, None, SEQ)
    assert part.windows == (sum(map(len, docs)) - 1) // SEQ
    tokens = stream_of(docs)
    firsts = {}
    for epoch in range(3):
        starts = [part.window(epoch * part.windows + j, (7, 0))[1] for j in range(part.windows)]
        assert sorted(starts) == [w * SEQ for w in range(part.windows)]  # each window once
        firsts[epoch] = starts
    assert firsts[0] != firsts[1] != firsts[2]  # shuffled anew
    assert part.window(5, (7, 0)) == part.window(5, (7, 0))  # a function of (key, j) alone
    assert part.window(5, (8, 0)) != part.window(5, (7, 0)) or part.window(6, (8, 0)) != part.window(6, (7, 0))
    # Windows pack across documents: consecutive windows share one token, EOS inside.
    stream = PreparedStream.open(DataConfig(name="prepared", path=str(tmp_path / "ds"), seq_len=SEQ), seed=7)
    for i in range(40):
        _, _, start = stream.locate(i)
        assert stream.sample(i).tolist() == tokens[start : start + SEQ + 1].tolist()


def test_held_out_documents_are_never_trained_on(tmp_path):
    docs = random_documents(80, seed=4)
    url = write_dataset(tmp_path / "ds", docs, shards=4, held_out=0.1)
    ds = open_prepared(url)
    held = ds.held_out.tolist()
    assert len(held) == 8 and held == sorted(set(held))
    cfg = DataConfig(name="prepared", path=url, seq_len=SEQ)
    train, evaluation = PreparedStream.open(cfg, seed=0), PreparedStream.held_out(cfg, seed=0)
    expected = stream_of(docs, held)
    assert train.parts[0].tokens == len(expected)
    for i in range(train.parts[0].windows):
        _, _, start = train.locate(i)
        assert train.sample(i).tolist() == expected[start : start + SEQ + 1].tolist()
    held_tokens = np.concatenate([docs[i] for i in held])
    assert evaluation.parts[0].tokens == len(held_tokens)
    for i in range(evaluation.parts[0].windows):
        _, _, start = evaluation.locate(i)
        assert evaluation.sample(i).tolist() == held_tokens[start : start + SEQ + 1].tolist()


def test_samples_do_not_depend_on_shard_boundaries(tmp_path):
    docs = random_documents(50, seed=5)
    one = PreparedStream.open(DataConfig(name="prepared", path=write_dataset(tmp_path / "a", docs, shards=1)), 1)
    five = PreparedStream.open(DataConfig(name="prepared", path=write_dataset(tmp_path / "b", docs, shards=5)), 1)
    a, _ = one.batch(0, 30)
    b, _ = five.batch(0, 30)
    assert a.equal(b)


@pytest.mark.parametrize("weights", [[0.7, 0.3], [1, 1, 2], [0.001, 0.999]])
def test_a_mixture_holds_each_dataset_in_proportion_at_every_length(weights):
    mix = Mixture(weights)
    w = np.asarray(weights) / sum(weights)
    located = [mix.locate(i) for i in range(3 * BLOCK + 123)]
    counts = np.zeros(len(w))
    for n, (d, j) in enumerate(located, start=1):
        assert j == counts[d]  # each dataset's samples in order: 0, 1, 2, ...
        counts[d] += 1
        if n in (100, 1000, BLOCK, 2 * BLOCK + 5):
            assert np.abs(counts / n - w).max() <= 1.5 / n + 1 / BLOCK
    # Any stretch, wherever it starts: dataset d's samples among [a, b) are off from (b - a) * w[d]
    # by off[d][b] - off[d][a], so by at most the spread of off[d] (here over 3 blocks and a bit).
    datasets = np.array([d for d, _ in located])
    for d in range(len(w)):
        off = np.concatenate([[0], np.cumsum(datasets == d)]) - np.arange(len(located) + 1) * w[d]
        assert off.max() - off.min() <= len(w) + 1 + len(located) / BLOCK
    assert mix.locate(77_777) == Mixture(weights).locate(77_777)


def test_a_weight_too_small_for_a_block_is_refused():
    with pytest.raises(ValueError, match="no sample"):
        Mixture([1.0, 1e-6])


class Reads:
    """Counts what a dataset's filesystem serves through `cat_ranges` (and can slow it down)."""

    def __init__(self, fs, delay: float = 0.0) -> None:
        self.fs, self.delay, self.calls, self.bytes, self.threads = fs, delay, 0, 0, set()
        self.original = fs.cat_ranges

    def __call__(self, paths, starts, ends, **kwargs):
        self.calls += 1
        self.bytes += sum(e - s for s, e in zip(starts, ends))
        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay)
        return self.original(paths, starts, ends, **kwargs)


def counted(stream: PreparedStream, delay: float = 0.0) -> list[Reads]:
    out = []
    for part in stream.parts:
        reads = Reads(part.dataset.fs, delay)
        part.dataset.fs = _Patched(part.dataset.fs, reads)
        out.append(reads)
    return out


class _Patched:
    def __init__(self, fs, cat_ranges) -> None:
        self._fs, self.cat_ranges = fs, cat_ranges

    def __getattr__(self, name):
        return getattr(self._fs, name)


@pytest.fixture(scope="module")
def s3():
    with s3_session("data") as endpoint:
        yield endpoint


def test_a_batch_reads_only_its_windows_byte_ranges_from_s3(s3):
    docs = random_documents(400, seed=6)
    url = write_dataset("s3://data/web", docs, shards=2)
    stream = PreparedStream.open(DataConfig(name="prepared", path=url, seq_len=SEQ), seed=0)
    (reads,) = counted(stream)
    inputs, targets = stream.batch(10, 8)
    expected = stream_of(docs)
    for row, i in enumerate(range(10, 18)):
        start = stream.locate(i)[2]
        assert inputs[row].tolist() == expected[start : start + SEQ].tolist()
        assert targets[row].tolist() == expected[start + 1 : start + SEQ + 1].tolist()
    shard_bytes = sum(s["tokens"] for s in stream.parts[0].dataset.index.shards) * 2
    assert reads.calls == 1  # every range of the batch in one batched call
    assert reads.bytes <= 8 * (SEQ + 1) * 2 < shard_bytes / 10  # the windows' bytes (a window may span shards)


def test_the_node_cache_serves_what_was_read_before(s3, tmp_path):
    url = write_dataset("s3://data/cached", random_documents(300, seed=7), shards=3)
    cfg = DataConfig(name="prepared", path=url, seq_len=SEQ, cache_dir=str(tmp_path / "cache"))
    first = PreparedStream.open(cfg, seed=0)
    (reads,) = counted(first)
    a, _ = first.batch(0, 64)
    assert reads.calls == 1 and list((tmp_path / "cache").rglob("stream.*"))
    again = PreparedStream.open(cfg, seed=0)  # another rank of the node, or a restarted one
    (reads_again,) = counted(again)
    b, _ = again.batch(0, 64)
    assert a.equal(b) and reads_again.calls == 0


def read_all(url: str, cache_dir: str = "", counter: list | None = None) -> np.ndarray:
    """Every training sample of one epoch of the dataset at `url` (seed 0), in order."""
    stream = PreparedStream.open(DataConfig(name="prepared", path=url, seq_len=SEQ, cache_dir=cache_dir), seed=0)
    if counter is not None:
        counter.extend(counted(stream))
    return stream.batch(0, stream.parts[0].windows)[0].numpy()


@pytest.mark.parametrize("chunk", [None, 64])  # the node's 1 MiB chunks, and chunks that span shards
def test_two_layouts_of_one_corpus_read_their_own_tokens_through_one_cache(tmp_path, monkeypatch, chunk):
    """Two prepares of one corpus cut the stream into other shards (another workers=, another
    store) but have one fingerprint: a node cache kept by shard would serve one layout's bytes
    at the other's offsets."""
    if chunk:
        monkeypatch.setattr(reader, "CACHE_CHUNK", chunk)
    docs = random_documents(300, seed=16)
    two, seven = write_dataset(tmp_path / "two", docs, shards=2), write_dataset(tmp_path / "seven", docs, shards=7)
    a, b = open_prepared(two).index, open_prepared(seven).index
    assert a.fingerprint == b.fingerprint and a.shards != b.shards
    cache, tokens = str(tmp_path / "cache"), stream_of(docs)
    truth = {url: read_all(url) for url in (two, seven)}  # without the cache
    stream = PreparedStream.open(DataConfig(name="prepared", path=two, seq_len=SEQ), seed=0)
    for i, row in enumerate(truth[two]):
        start = stream.locate(i)[2]
        assert row.tolist() == tokens[start : start + SEQ].tolist()
    assert np.array_equal(truth[two], truth[seven])  # the samples do not depend on the shards
    # The first fills the cache (one batched read); the other layout, then the first again,
    # read their own tokens from it, and nothing from the store.
    for url, calls in ((two, 1), (seven, 0), (two, 0)):
        reads: list = []
        assert np.array_equal(read_all(url, cache, reads), truth[url]), url
        assert reads[0].calls == calls, url


def test_a_cached_chunk_of_the_wrong_size_is_read_again(tmp_path, monkeypatch):
    monkeypatch.setattr(reader, "CACHE_CHUNK", 256)
    url = write_dataset(tmp_path / "ds", random_documents(200, seed=17), shards=3)
    cache = tmp_path / "cache"
    truth = read_all(url)
    assert np.array_equal(read_all(url, str(cache)), truth)
    chunks = sorted(p for p in cache.rglob("*") if p.is_file())
    assert len(chunks) > 4 and not [p for p in chunks if ".tmp-" in p.name]
    chunks[1].write_bytes(chunks[1].read_bytes()[:100])  # cut short (a disk that filled, a stray copy)
    chunks[2].write_bytes(chunks[2].read_bytes() * 2)  # too long
    reads: list = []
    assert np.array_equal(read_all(url, str(cache), reads), truth)
    assert reads[0].calls == 1 and reads[0].bytes == 2 * 256  # the two chunks again, and only them
    assert chunks[1].stat().st_size == chunks[2].stat().st_size == 256


def test_read_ahead_fetches_the_next_steps_while_this_one_trains(tmp_path):
    url = write_dataset(tmp_path / "ds", random_documents(200, seed=8), shards=2)
    stream = PreparedStream.open(DataConfig(name="prepared", path=url, seq_len=SEQ, read_ahead=2), seed=0)
    (reads,) = counted(stream, delay=0.3)
    cold = time.perf_counter()
    stream.batch(0, 8)
    cold = time.perf_counter() - cold
    stream.prefetch(8, 8)
    time.sleep(0.6)  # "training"
    warm = time.perf_counter()
    got, _ = stream.batch(8, 8)
    warm = time.perf_counter() - warm
    assert cold >= 0.3 and warm < 0.1, (cold, warm)
    assert any(name.startswith("rayhybrid-read-ahead") for name in reads.threads)
    fresh = PreparedStream.open(DataConfig(name="prepared", path=url, seq_len=SEQ, read_ahead=0), seed=0)
    assert got.equal(fresh.batch(8, 8)[0])  # the same samples as read on demand
    stream.close()


# -- the checks before a run ------------------------------------------------------------------


def refused(*overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        load_config(list(overrides))
    return err.value


def test_the_checks_refuse_what_cannot_train(tmp_path):
    docs = random_documents(40, seed=9)
    good = write_dataset(tmp_path / "good", docs, vocab_size=300)
    base = ["data=prepared", "data.seq_len=16", "model.vocab_size=320"]
    load_config([*base, f"data.path={good}"])  # accepted

    err = refused(*base, f"data.path={write_dataset(tmp_path / 'half', docs, commit=False)}")
    assert err.setting == "data.path" and "no committed prepared dataset" in err.message
    assert "python -m rayhybrid.prepare" in err.message
    err = refused("data=prepared", "model.vocab_size=256", f"data.path={good}")
    assert err.setting == "model.vocab_size" and "300 ids" in err.message
    tiny = write_dataset(tmp_path / "tiny", [[5, 6, 0]], vocab_size=300)
    err = refused(*base, f"data.path={tiny}")
    assert err.setting == "data.path" and "fewer than one window" in err.message
    err = refused(*base, f"data.path={good}", "data.val_fraction=0.1")
    assert err.setting == "data.val_fraction" and "val_fraction=" in err.message
    err = refused(*base, f"data.path={good}", "eval.every=5")
    assert err.setting == "eval.every" and "holds none out" in err.message
    err = refused(*base, f"data.path={good}", f"data.mix=[{{path:{good},weight:1}}]")
    assert err.setting == "data.mix"
    other = write_dataset(tmp_path / "other", docs, tokenizer_sha="another")
    err = refused(*base, f"data.mix=[{{path:{good},weight:1}},{{path:{other},weight:1}}]")
    assert err.setting == "data.mix[1].path" and "same tokenizer" in err.message
    err = refused(*base, f"data.mix=[{{path:{good},weight:1}},{{path:{other},weight:0}}]")
    assert err.setting == "data.mix[1].weight"
    err = refused("data=text", f"data.path={tmp_path}", "model=gpt3_small")
    assert err.setting == "data.name" and "rayhybrid.prepare" in err.message


def test_a_tokenizer_other_than_the_checkpoints_is_refused(tmp_path):
    from rayhybrid.data.checks import check_prepared_datasets
    from tests.tokenizer import make_tokenizer

    ckpt = make_tokenizer(tmp_path / "hf")  # a checkpoint directory that ships its tokenizer
    (ckpt / "config.json").write_text(json.dumps({"eos_token_id": 0, "bos_token_id": 1}))
    sha = hashlib.sha256((ckpt / "tokenizer.json").read_bytes()).hexdigest()
    docs = random_documents(40, seed=10)
    base = ["data=prepared", "data.seq_len=16", "model.vocab_size=512"]

    def with_init_from(url: str):
        cfg = load_config([*base, f"data.path={url}"])
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init_from=str(ckpt)))

    check_prepared_datasets(with_init_from(write_dataset(tmp_path / "same", docs, tokenizer_sha=sha)))  # accepted
    with pytest.raises(ConfigError) as err:
        check_prepared_datasets(with_init_from(write_dataset(tmp_path / "other", docs, tokenizer_sha="another")))
    assert err.value.setting == "data.path" and f"tokenizer={ckpt}" in err.value.message


def test_a_refusal_is_one_line_and_exit_code_2(tmp_path):
    half = write_dataset(tmp_path / "half", random_documents(20), commit=False)
    proc = subprocess.run(
        [sys.executable, "-m", "rayhybrid", "data=prepared", f"data.path={half}", "model.vocab_size=320"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "data.path" in lines[0] and "Traceback" not in proc.stderr


def test_the_trace_counts_every_sample_of_a_mixture(tmp_path):
    web = write_dataset(tmp_path / "web", random_documents(120, seed=11), shards=3)
    code = write_dataset(tmp_path / "code", random_documents(60, seed=12), shards=2)
    cfg = DataConfig(name="prepared", seq_len=SEQ, mix=({"path": web, "weight": 0.7}, {"path": code, "weight": 0.3}))
    stream = PreparedStream.open(cfg, seed=3)
    seen = [stream.provenance(i) for i in range(1000)]
    shares = Counter(name for name, _, _ in seen)
    assert abs(shares[web] / 1000 - 0.7) < 0.01 and abs(shares[code] / 1000 - 0.3) < 0.01
    for url, part in zip((web, code), stream.parts):
        epoch0 = [s for name, e, s in seen if name == url and e == 0]
        assert sorted(epoch0) == [w * SEQ for w in range(part.windows)]  # a whole epoch, each window once


def test_a_checkpoint_resumes_only_on_the_data_it_was_trained_on(tmp_path):
    """The driver refuses a resume on other data, from the config alone, before any worker
    starts (driver.compatibility.check_fits with data.identity.data_identity): one ConfigError
    line naming the setting. The workers no longer ask (their restore loads what it is given)."""
    import inspect

    from rayhybrid.data.identity import data_identity
    from rayhybrid.driver.compatibility import check_fits
    from rayhybrid.storage.checkpoints import Checkpoint
    from rayhybrid.trainer import checkpoint as trainer_checkpoint

    web = write_dataset(tmp_path / "web", random_documents(60, seed=13))
    code = write_dataset(tmp_path / "code", random_documents(60, seed=14))
    mix_cfg = DataConfig(name="prepared", mix=({"path": web, "weight": 3}, {"path": code}))
    other_cfg = DataConfig(name="prepared", mix=({"path": web, "weight": 1}, {"path": code}))
    mix, other = PreparedStream.open(mix_cfg, 0), PreparedStream.open(other_cfg, 0)
    assert mix.identity()["weights"] == [0.75, 0.25] and mix.identity() != other.identity()
    # What the driver computes is what the stream records in its checkpoints.
    assert data_identity(mix_cfg) == mix.identity() and data_identity(other_cfg) == other.identity()

    def run(data: DataConfig):
        return Config(data=data, train=dataclasses.replace(Config().train, global_batch_size=8))

    def ckpt(data: dict) -> Checkpoint:
        return Checkpoint(str(tmp_path / "ckpt" / "step_00000004"), {"step": 4, "global_batch_size": 8, "data": data})

    check_fits(ckpt(mix.identity()), run(mix_cfg), data_identity(mix_cfg))  # the same data: fine
    with pytest.raises(ConfigError) as err:
        check_fits(ckpt(mix.identity()), run(other_cfg), data_identity(other_cfg))
    assert err.value.setting == "data.mix" and "trained on other data (weights [0.75, 0.25] there" in str(err.value)
    assert "\n" not in str(err.value)
    only_web = DataConfig(name="prepared", path=web)
    with pytest.raises(ConfigError) as err:
        check_fits(ckpt(mix.identity()), run(only_web), data_identity(only_web))
    assert err.value.setting == "data.path" and "datasets" in str(err.value)
    # A checkpoint of the same data read in the former epoch order (a full permutation drawn per
    # epoch, before the identity named its order) would read other samples: refused too.
    former = {k: v for k, v in mix.identity().items() if k != "order"}
    with pytest.raises(ConfigError) as err:
        check_fits(ckpt(former), run(mix_cfg), data_identity(mix_cfg))
    assert err.value.setting == "checkpoint.dir" and "order None there, 2 here" in str(err.value), str(err.value)
    # Other kinds of data: synthetic after prepared is refused by name.
    with pytest.raises(ConfigError) as err:
        check_fits(ckpt(mix.identity()), run(DataConfig()), data_identity(DataConfig()))
    assert err.value.setting == "data.name" and "'MarkovStream' here" in str(err.value)
    # The old path, a ValueError from every rank after the join, is gone.
    restore = inspect.getsource(trainer_checkpoint.restore)
    assert "identity" not in restore and "global_batch_size" not in restore and "ValueError" not in restore


def test_a_prepared_dataset_on_s3_is_read_with_credentials_in_data_storage_options_alone(tmp_path):
    """No AWS credentials or endpoint in the environment (a dead loopback endpoint instead):
    data.storage_options alone reaches the bucket, for the checks before a run, the training
    stream, its held-out stream and the driver's data identity."""
    import s3fs

    from rayhybrid.data.identity import data_identity
    from tests.s3 import CREDENTIALS, env, loopback_aws, make_bucket, moto_server

    docs = random_documents(200, seed=21)
    with loopback_aws(), moto_server() as endpoint:
        s3fs.S3FileSystem.clear_instance_cache()
        with env(AWS_ENDPOINT_URL=endpoint, **CREDENTIALS):
            make_bucket("only-options", endpoint)
            url = write_dataset("s3://only-options/ds", docs, shards=2, held_out=0.1)
        s3fs.S3FileSystem.clear_instance_cache()
        assert "AWS_ACCESS_KEY_ID" not in os.environ and os.environ["AWS_ENDPOINT_URL"] == DEAD_ENDPOINT
        base = ["data=prepared", f"data.path={url}", f"data.seq_len={SEQ}", "model.vocab_size=320", "eval.every=5"]
        with pytest.raises(ConfigError) as err:  # as before: the environment's store, unreachable
            load_config(base)
        assert err.value.setting == "data.path"
        options = [
            f"data.storage_options.{k}={v}" for k, v in (("endpoint_url", endpoint), ("key", "k-1"), ("secret", "s-1"))
        ]
        cfg = load_config([*base, *options])  # the checks read the index and lengths with them
        stream = PreparedStream.open(cfg.data, seed=0)
        inputs, _ = stream.batch(0, 4)
        start = stream.locate(0)[2]
        train_docs = [d for i, d in enumerate(docs) if i not in set(stream.parts[0].dataset.held_out.tolist())]
        assert inputs[0].tolist() == stream_of(train_docs)[start : start + SEQ].tolist()
        assert PreparedStream.held_out(cfg.data, seed=0).batch(0, 2)[0].shape == (2, SEQ)
        assert data_identity(cfg.data) == stream.identity()
        s3fs.S3FileSystem.clear_instance_cache()


def test_open_prepared_is_importable_from_the_data_package(tmp_path):
    from rayhybrid.data import open_prepared as public

    docs = random_documents(5, seed=15)
    ds = public(write_dataset(tmp_path / "ds", docs, shards=2))
    assert ds.num_documents == 5 and ds.document(4).tolist() == docs[4] and ds.tokenizer["eos_id"] == 0


def test_the_step_line_shows_the_wait_for_data():
    from rayhybrid.driver.runlog import step_line

    metrics = {"step": 3, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1000.0, "step_time_s": 0.25}
    line = step_line({**metrics, "data_wait_s": 0.012, "val_loss": 2.4}, total=10)
    assert line.endswith("| 0.25s/step | data wait 12.0ms | val_loss 2.4000"), line


def test_the_drivers_data_identity_is_what_every_kind_of_stream_records(tmp_path):
    """data_identity (the driver's, from the config alone, no torch) equals what the training
    stream of each kind of data records in its checkpoints: else check_fits would refuse a
    resume on the very data it was trained on, or let another through."""
    from rayhybrid.data.identity import data_identity
    from rayhybrid.data.streams import build_stream

    (tmp_path / "book.txt").write_text("a few words of text " * 50)
    np.arange(500, dtype=np.uint16).tofile(tmp_path / "ids.bin")
    web = write_dataset(tmp_path / "web", random_documents(60, seed=16))
    code = write_dataset(tmp_path / "code", random_documents(60, seed=17))
    for data in (
        DataConfig(seq_len=SEQ),
        DataConfig(name="text", path=str(tmp_path / "book.txt"), seq_len=SEQ),
        DataConfig(name="tokens", path=str(tmp_path / "ids.bin"), seq_len=SEQ),
        DataConfig(name="prepared", path=web, seq_len=SEQ),
        DataConfig(name="prepared", mix=({"path": web, "weight": 0.3}, {"path": code, "weight": 0.7}), seq_len=SEQ),
    ):
        assert data_identity(data) == build_stream(data, 320, seed=1).identity(), data.name
