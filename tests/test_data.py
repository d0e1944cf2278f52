"""The sample stream (docs/design.md, invariant 4): samples are a function of (data config, seed, index)
alone, and dp rank r of step k reads its contiguous share of global samples [k*G, (k+1)*G)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from rayhybrid.config.schema import DataConfig
from rayhybrid.data.streams import MarkovStream, WindowStream, build_stream, replica_shard, uniform_loss

VOCAB = 256


def is_window(row: np.ndarray, tokens: np.ndarray) -> bool:
    """Whether `row` is a contiguous window of `tokens`."""
    n = len(row)
    windows = np.lib.stride_tricks.sliding_window_view(np.asarray(tokens, dtype=np.int64), n)
    return bool((windows == row).all(axis=1).any())


def check_batch(stream, start: int, count: int, seq_len: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, targets = stream.batch(start, count)
    assert inputs.shape == targets.shape == (count, seq_len)
    assert inputs.dtype == targets.dtype == torch.int64
    assert int(inputs.min()) >= 0 and int(inputs.max()) < vocab
    # Targets are the inputs shifted by one token.
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    for i in range(count):
        row = torch.from_numpy(np.array(stream.sample(start + i), dtype=np.int64))
        assert torch.equal(torch.cat([inputs[i], targets[i, -1:]]), row)
    return inputs, targets


# ---- synthetic Markov stream ------------------------------------------------------------


def test_markov_same_index_same_sample_across_instances():
    a = MarkovStream(VOCAB, 32, 4, seed=3)
    b = MarkovStream(VOCAB, 32, 4, seed=3)
    for index in [0, 1, 7, 1000, 123_456]:
        assert np.array_equal(a.sample(index), b.sample(index))
    # Reading order does not matter: a sample depends on its index only.
    assert np.array_equal(a.sample(5), a.sample(5))
    xa, ya = a.batch(40, 8)
    b.batch(0, 3)
    xb, yb = b.batch(40, 8)
    assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_markov_differs_by_index_and_seed():
    a = MarkovStream(VOCAB, 32, 4, seed=0)
    c = MarkovStream(VOCAB, 32, 4, seed=1)
    assert not np.array_equal(a.sample(0), a.sample(1))
    assert not np.array_equal(a.sample(0), c.sample(0))


def test_markov_batch_shape_and_shift():
    stream = MarkovStream(VOCAB, 16, 4, seed=0)
    check_batch(stream, 10, 5, 16, VOCAB)


def test_dp_shares_concatenate_to_the_global_batch():
    stream = MarkovStream(VOCAB, 16, 4, seed=0)
    whole_x, whole_y = stream.batch(16, 8)
    for dp in (1, 2, 4, 8):
        parts = [stream.batch(s.start, s.count) for s in (replica_shard(16, 8, dp, r) for r in range(dp))]
        assert torch.equal(torch.cat([x for x, _ in parts]), whole_x)
        assert torch.equal(torch.cat([y for _, y in parts]), whole_y)


@pytest.mark.parametrize("branching", [1, 2, 4, 16])
def test_markov_chain_structure(branching):
    stream = MarkovStream(64, 64, branching, seed=0)
    successors: dict[int, set[int]] = {}
    for i in range(200):
        row = stream.sample(i)
        for a, b in itertools.pairwise(row):
            successors.setdefault(int(a), set()).add(int(b))
    assert max(len(s) for s in successors.values()) <= branching


@pytest.mark.parametrize("vocab,branching", [(256, 4), (256, 16), (64, 2), (32, 32)])
def test_loss_floor_between_zero_and_uniform(vocab, branching):
    stream = MarkovStream(vocab, 16, branching, seed=0)
    assert stream.loss_floor is not None
    assert 0 < stream.loss_floor < math.log(vocab)
    # Each row has `branching` successors, so its entropy is at most log(branching).
    assert stream.loss_floor <= math.log(branching) + 1e-9
    assert uniform_loss(vocab) == pytest.approx(math.log(vocab))


def test_loss_floor_of_a_deterministic_chain_is_zero():
    assert MarkovStream(64, 16, 1, seed=0).loss_floor == pytest.approx(0.0, abs=1e-12)


def test_build_stream_synthetic():
    cfg = DataConfig(name="synthetic", seq_len=24, branching=3)
    a, b = build_stream(cfg, VOCAB, seed=7), build_stream(cfg, VOCAB, seed=7)
    assert isinstance(a, MarkovStream)
    xa, _ = check_batch(a, 0, 4, 24, VOCAB)
    xb, _ = b.batch(0, 4)
    assert torch.equal(xa, xb)


# ---- replica shards ---------------------------------------------------------------------


@pytest.mark.parametrize("global_batch", [8, 16, 24])
@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_replica_shard_covers_step_disjointly(global_batch, dp):
    if global_batch % dp:
        pytest.skip("dp must divide the global batch")
    for step in range(4):
        consumed = step * global_batch
        shards = [replica_shard(consumed, global_batch, dp, r) for r in range(dp)]
        assert all(s.count == global_batch // dp for s in shards)
        samples = [i for s in shards for i in range(s.start, s.start + s.count)]
        # In dp-rank order, contiguous, disjoint, and exactly this step's samples.
        assert samples == list(range(step * global_batch, (step + 1) * global_batch))


# ---- text and token files ---------------------------------------------------------------

TEXT = ("The quick brown fox jumps over the lazy dog. " * 20).encode() + bytes(range(256))


def test_text_file_stream(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(TEXT)
    cfg = DataConfig(name="text", path=str(path), seq_len=16)
    stream = build_stream(cfg, VOCAB, seed=0)
    assert isinstance(stream, WindowStream)
    inputs, targets = check_batch(stream, 0, 8, 16, VOCAB)
    blob = np.frombuffer(TEXT, dtype=np.uint8)
    for i in range(8):
        assert is_window(stream.sample(i), blob)
    # Deterministic across instances, and addressed by index.
    again = build_stream(cfg, VOCAB, seed=0)
    x2, y2 = again.batch(0, 8)
    assert torch.equal(inputs, x2) and torch.equal(targets, y2)
    assert any(not np.array_equal(stream.sample(i), stream.sample(i + 1)) for i in range(8))


def test_text_directory_and_glob(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"a" * 100)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_bytes(b"b" * 100)
    (tmp_path / "ignored.md").write_bytes(b"c" * 100)
    for path in [str(tmp_path), str(tmp_path / "**" / "*.txt")]:
        stream = build_stream(DataConfig(name="text", path=path, seq_len=8), VOCAB, seed=0)
        seen = set()
        for i in range(200):
            seen |= set(stream.sample(i).tolist())
        assert seen <= {ord("a"), ord("b"), ord("\n")}
        assert {ord("a"), ord("b")} <= seen


def test_text_errors(tmp_path):
    with pytest.raises(ValueError, match="data.path"):
        build_stream(DataConfig(name="text", path=str(tmp_path / "missing.txt"), seq_len=8), VOCAB, seed=0)
    short = tmp_path / "short.txt"
    short.write_bytes(b"tiny")
    with pytest.raises(ValueError, match="seq_len"):
        build_stream(DataConfig(name="text", path=str(short), seq_len=8), VOCAB, seed=0)


def test_unknown_data_name():
    with pytest.raises(ValueError, match="data.name"):
        build_stream(DataConfig(name="nope"), VOCAB, seed=0)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64])
def test_tokens_npy_stream(tmp_path, dtype):
    vocab = 1000
    tokens = np.random.default_rng(0).integers(0, vocab, size=5000).astype(dtype)
    path = tmp_path / "tokens.npy"
    np.save(path, tokens)
    cfg = DataConfig(name="tokens", path=str(path), seq_len=32)
    stream = build_stream(cfg, vocab, seed=1)
    assert isinstance(stream, WindowStream)
    inputs, targets = check_batch(stream, 3, 6, 32, vocab)
    for i in range(3, 9):
        assert is_window(stream.sample(i), tokens)
    x2, y2 = build_stream(cfg, vocab, seed=1).batch(3, 6)
    assert torch.equal(inputs, x2) and torch.equal(targets, y2)


@pytest.mark.parametrize("token_dtype", ["uint16", "uint32"])
def test_tokens_raw_bin_stream(tmp_path, token_dtype):
    vocab = 50_000
    tokens = np.random.default_rng(0).integers(0, vocab, size=3000).astype(token_dtype)
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    stream = build_stream(DataConfig(name="tokens", path=str(path), seq_len=16, token_dtype=token_dtype), vocab, seed=0)
    check_batch(stream, 0, 4, 16, vocab)
    for i in range(4):
        assert is_window(stream.sample(i), tokens)


def test_window_stream_reaches_the_last_window():
    # 10 tokens, seq_len 8: windows of 9 start at 0 or 1; the final token must be a target.
    stream = WindowStream(np.arange(10), 8, 0, "x")
    starts = {int(stream.sample(i)[0]) for i in range(200)}
    assert starts == {0, 1}
    with pytest.raises(ValueError, match="fewer than data.seq_len"):
        WindowStream(np.arange(8), 8, 0, "x")


def test_markov_chain_over_a_gpt3_vocabulary_builds_in_seconds():
    """The chain is kept sparse: a dense 50304 x 50304 transition matrix would need 20 GB and
    minutes of power iteration before the first step."""
    import time

    import numpy as np

    from rayhybrid.data.streams import MarkovStream

    start = time.perf_counter()
    stream = MarkovStream(vocab_size=50304, seq_len=16, branching=4, seed=0)
    assert time.perf_counter() - start < 20
    pi = stream.stationary
    probs = np.diff(np.concatenate([np.zeros((len(pi), 1)), stream.cdf], axis=1), axis=1)
    moved = np.bincount(stream.successors.ravel(), weights=(pi[:, None] * probs).ravel(), minlength=len(pi))
    assert np.abs(moved - pi).sum() < 1e-6  # stationary: one step of the chain leaves it unchanged
    assert 0 < stream.loss_floor < np.log(4)


# ---- vectorised synthetic data, bit for bit as the per-sample and per-row loops were --------


def per_sample_walk(stream: MarkovStream, index: int) -> np.ndarray:
    """Sample `index` as MarkovStream.sample drew it before it was vectorised: one token at a
    time, a searchsorted per token."""
    from rayhybrid.data.streams import _rng

    u = _rng(stream.seed, index, stream.key).random(stream.seq_len + 1)
    out = np.empty(stream.seq_len + 1, dtype=np.int64)
    state = int(np.searchsorted(stream.stationary_cdf, u[0], side="right"))
    out[0] = state
    for t in range(1, stream.seq_len + 1):
        state = int(stream.successors[state, np.searchsorted(stream.cdf[state], u[t], side="right")])
        out[t] = state
    return out


@pytest.mark.parametrize("vocab,seq_len,branching,seed", [(256, 64, 4, 0), (256, 33, 1, 5), (1000, 40, 16, 3)])
def test_markov_batches_are_the_per_sample_walk_bit_for_bit(vocab, seq_len, branching, seed):
    train = MarkovStream(vocab, seq_len, branching, seed)
    for stream in (train, train.held_out()):
        for start, count in ((0, 1), (7, 5), (1000, 16), (123456789, 3)):
            want = np.stack([per_sample_walk(stream, start + i) for i in range(count)])
            assert np.array_equal(stream.rows(start, count), want)
            inputs, targets = stream.batch(start, count)
            assert torch.equal(inputs, torch.from_numpy(want[:, :-1])) and torch.equal(
                targets, torch.from_numpy(want[:, 1:])
            )


@pytest.mark.parametrize("vocab,k", [(1, 1), (5, 5), (256, 4), (256, 64), (300, 7), (20001, 4), (20001, 500)])
def test_chain_successors_are_numpys_choice_bit_for_bit(vocab, k):
    """`chain.successors` draws what a `rng.choice(vocab, k, replace=False)` per row drew, and
    leaves the generator where they left it (the Dirichlet draws that follow are the same);
    20001 x 500 is numpy's tail-shuffle case, which takes the loop."""
    from rayhybrid.data.chain import successors

    ours, theirs = np.random.default_rng([3, 0x5EED]), np.random.default_rng([3, 0x5EED])
    got = successors(ours, vocab, k)
    want = np.stack([theirs.choice(vocab, size=k, replace=False) for _ in range(vocab)])
    assert got.dtype == want.dtype and np.array_equal(got, want)
    assert ours.bit_generator.state == theirs.bit_generator.state
    assert np.array_equal(ours.dirichlet(np.ones(k), size=4), theirs.dirichlet(np.ones(k), size=4))


def test_a_llama3_vocabulary_chain_is_the_same_and_several_times_faster_to_build():
    """At 128256 tokens the per-row loop took most of the chain's 0.71 s of every rank's start; the vectorised
    draw is the same chain (its Lemire rejections included: a few at this size)."""
    import time

    from rayhybrid.data.chain import successors

    vocab = 128256
    ours, theirs = np.random.default_rng([0, 0x5EED]), np.random.default_rng([0, 0x5EED])
    fast = time.perf_counter()
    got = successors(ours, vocab, 4)
    fast = time.perf_counter() - fast
    slow = time.perf_counter()
    want = np.stack([theirs.choice(vocab, size=4, replace=False) for _ in range(vocab)])
    slow = time.perf_counter() - slow
    assert np.array_equal(got, want) and ours.bit_generator.state == theirs.bit_generator.state
    assert fast < slow / 4, (fast, slow)


# ---- read ahead, keyed by sample index -----------------------------------------------------


def test_read_ahead_is_keyed_by_sample_and_a_jump_drops_what_it_left_behind():
    """What a stream read ahead is handed out only for the same samples; a position that jumps
    (restore, heal, resize: another start or another count) reads its own, and `keep` drops
    the rest. The held-out stream never sees the training stream's."""
    stream = MarkovStream(VOCAB, 32, 4, seed=0)
    fresh = MarkovStream(VOCAB, 32, 4, seed=0)
    stream.prefetch(16, 8)
    stream.prefetch(24, 8)
    held = stream.held_out()
    assert torch.equal(held.batch(16, 8)[0], fresh.held_out().batch(16, 8)[0])
    assert torch.equal(stream.batch(16, 4)[0], fresh.batch(16, 4)[0])  # another count: read now
    assert torch.equal(stream.batch(8, 8)[0], fresh.batch(8, 8)[0])  # a jump back
    stream.keep([(40, 8)])
    assert not stream._ahead  # (24, 8) dropped, nothing else asked for
    stream.prefetch(40, 8)
    got = stream.take(40, 8)
    assert torch.equal(got, torch.from_numpy(fresh.rows(40, 8)))
    stream.close()


def test_device_feed_on_cpu_hands_out_what_the_stream_reads_and_reads_ahead_in_a_thread(monkeypatch):
    from rayhybrid.data.feed import DeviceFeed

    stream, fresh = MarkovStream(VOCAB, 32, 4, seed=1), MarkovStream(VOCAB, 32, 4, seed=1)
    threads = []
    real = MarkovStream.rows

    def rows(self, start, count):
        import threading

        if self is stream:
            threads.append(threading.current_thread().name)
        return real(self, start, count)

    monkeypatch.setattr(MarkovStream, "rows", rows)
    feed = DeviceFeed(stream, torch.device("cpu"))
    assert stream.pin_memory is False  # pinning needs an accelerator
    for step in range(4):
        key, upcoming = (8 * step, 8), [(8 * (step + 1), 8), (8 * (step + 2), 8)]
        inputs, targets = feed.take(key)
        feed.ahead(upcoming)
        want = fresh.batch(*key)
        assert torch.equal(inputs, want[0]) and torch.equal(targets, want[1])
    assert threads[0] == "MainThread" and all(t.startswith("rayhybrid-read-ahead") for t in threads[1:])
    feed.take((4, 8))  # a jump: read now, right
    feed.ahead([(12, 8)])
    assert set(stream._ahead) == {(12, 8)}
    feed.close()


def test_device_feed_stages_the_next_batch_once_it_is_read_and_a_jump_drops_it(monkeypatch):
    """The CUDA path's bookkeeping, with the copy to the device stood in for (no GPU here):
    `stage` (called once the step's work is queued) starts the next batch's copy when its
    samples are read, once; `take` hands out that copy; a jump drops what was staged."""
    from rayhybrid.data.feed import DeviceFeed

    stream = MarkovStream(VOCAB, 32, 4, seed=1)
    feed = DeviceFeed(stream, torch.device("cpu"))
    copies = []
    feed.cuda = True  # the bookkeeping of a CUDA feed; its copies recorded instead of made
    monkeypatch.setattr(feed, "_to_device", lambda host: copies.append(host) or host.clone())
    feed.ahead([(8, 8), (16, 8)])
    if (8, 8) in stream._ahead:  # not staged by `ahead` itself: read by the time the step's work is queued
        stream._ahead[(8, 8)].result()
    feed.stage()
    feed.stage()  # once
    assert list(feed.staged) == [(8, 8)] and len(copies) == 1
    assert torch.equal(copies[0], MarkovStream(VOCAB, 32, 4, seed=1).tensor(8, 8))
    feed.ahead([(40, 8)])  # a jump (a restore): the staged batch is not the next one any more
    assert feed.staged == {} and set(stream._ahead) == {(40, 8)}
    feed.close()
    assert feed.upcoming == [] and feed.staged == {}
