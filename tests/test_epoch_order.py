"""The order an epoch reads a prepared dataset's windows in (rayhybrid/data/packing.py): a true
permutation of the windows at every size, shuffled, the same in every process, safe to compute
from the read-ahead thread and the training thread at once, and small at a trillion tokens.

The parts here are packed over fake datasets: `Part` needs only the documents' offsets."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import tracemalloc

import numpy as np

from rayhybrid.data.packing import Mixture, Part


class Stream:
    """What `Part` reads of a PreparedDataset: documents of these lengths, no shards."""

    def __init__(self, lengths) -> None:
        self.offsets = np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))])
        self.num_documents = len(lengths)


def part_of(windows: int, seq_len: int = 1) -> Part:
    """A part of exactly `windows` windows (seq_len * windows + 1 tokens in one document)."""
    part = Part(Stream([seq_len * windows + 1]), None, seq_len)
    assert part.windows == windows
    return part


def epoch_order(part: Part, key: tuple, epoch: int) -> list[int]:
    """The windows of one epoch, in the order it reads them."""
    out = []
    for position in range(part.windows):
        e, start = part.window(epoch * part.windows + position, key)
        assert e == epoch and start % part.seq_len == 0
        out.append(start // part.seq_len)
    return out


def test_every_epoch_reads_each_window_exactly_once_at_every_size():
    sizes = [*range(1, 300), 255, 256, 257, 1000, 1023, 1024, 1025, 4097]
    for windows in sizes:
        part = part_of(windows)
        for key, epoch in [((0, 0), 0), ((0, 0), 1), ((7, 3), 5), ((2**40 + 1, 1), 0)]:
            order = epoch_order(part, key, epoch)
            assert sorted(order) == list(range(windows)), (windows, key, epoch)


def test_the_order_looks_shuffled_and_changes_with_the_epoch_and_the_seed():
    n = 2000
    part = part_of(n)
    order = np.array(epoch_order(part, (3, 0), 0))
    positions = np.arange(n)
    assert (order == positions).sum() < 10  # about one fixed point, as for a random permutation
    assert abs(np.corrcoef(positions, order)[0, 1]) < 0.1  # no trend
    gaps = np.abs(np.diff(order))
    assert 0.25 * n < gaps.mean() < 0.42 * n  # consecutive samples far apart (n / 3 at random)
    assert (gaps <= 2).sum() < 20  # hardly ever neighbours
    for other in (epoch_order(part, (3, 0), 1), epoch_order(part, (4, 0), 0), epoch_order(part, (3, 1), 0)):
        assert (np.array(other) == order).sum() < 10  # another epoch, seed or dataset: another order
    # Tiny parts are shuffled too: every order of 3 windows turns up over the epochs.
    small = part_of(3)
    assert len({tuple(epoch_order(small, (0, 0), e)) for e in range(200)}) == 6


def test_the_order_is_a_function_of_the_key_and_index_alone_in_every_process():
    code = (
        "from tests.test_epoch_order import part_of\n"
        "p = part_of(100003, 2048)\n"
        "print([p.window(j, (11, 1)) for j in (0, 1, 99_999, 100_003, 5_000_000)])\n"
    )
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            cwd=here,
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout
        for seed in ("1", "2")
    }
    part = part_of(100003, 2048)
    mine = str([part.window(j, (11, 1)) for j in (0, 1, 99_999, 100_003, 5_000_000)]) + "\n"
    assert runs == {mine}  # another process, another hash seed: the same windows


class Preempted(int):
    """A seed whose hashing lets the other thread run: the threads then interleave at every
    look-up of a key, as preemption can make them anywhere (and do, without a GIL)."""

    def __hash__(self) -> int:
        time.sleep(0)
        return int.__hash__(self)


def race(part: Part, key: tuple) -> tuple[list[str], dict]:
    """Two threads, one an epoch ahead of the other, each going back and forth between two
    epochs (the read-ahead thread and the training thread around epoch ends, on a small part):
    what they raised, and the windows they got."""
    errors, got = [], {}

    def read(ahead: int) -> None:
        try:
            for epoch in range(1, 300):
                for e in (epoch + ahead, epoch + ahead - 1):
                    j = e * part.windows + e % part.windows
                    got[j] = part.window(j, key)
        except Exception as err:  # noqa: BLE001 - what the test looks for
            errors.append(repr(err))

    threads = [threading.Thread(target=read, args=(ahead,)) for ahead in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors, got


def test_two_threads_computing_the_windows_of_alternating_epochs():
    """Neither thread may lose what it asked for to the other (an order cache evicted an epoch
    between one thread's look-up and its read of it: KeyError)."""
    expected = {j: part_of(5, seq_len=4).window(j, (1, 0)) for j in range(5 * 302)}
    for _ in range(20):  # the interleaving is up to the scheduler: a few tries
        errors, got = race(part_of(5, seq_len=4), (Preempted(1), Preempted(0)))
        assert errors == []
        assert len(got) == 301 and all(got[j] == expected[j] for j in got)


def test_the_order_of_a_trillion_tokens_takes_no_memory():
    """About 4.9e8 windows of 2048 tokens per epoch: a permutation held whole would be 3.9 GB a
    rank and an epoch. Ordering, packing and mixing such a part stays under 50 MB. (The corpus
    here is three documents: what grows with the number of documents, 16 bytes each for their
    lengths and offsets, and the held-out choice, is not the order's and is not measured.)"""
    seq_len, lengths = 2048, [400_000_000_000, 350_000_000_000, 250_000_000_000]
    tracemalloc.start()
    try:
        parts = [Part(Stream(lengths), None, seq_len), Part(Stream(lengths), np.array([0, 2]), seq_len)]
        mixture = Mixture([0.7, 0.3])
        for d, part in enumerate(parts):
            n = part.windows
            for epoch in (0, 1, 2, 9):
                positions = [*range(1000), *range(n - 1000, n)]
                read = [part.window(epoch * n + p, (5, d)) for p in positions]
                assert {e for e, _ in read} == {epoch}
                starts = {s for _, s in read}
                assert len(starts) == len(positions)  # distinct windows
                assert all(0 <= s <= part.tokens - seq_len - 1 and s % seq_len == 0 for s in starts)
        for i in (0, 10**9 + 7, 10**12, 3 * 10**12 + 5):  # a long run of the mixture
            d, j = mixture.locate(i)
            assert parts[d].window(j, (5, d))[0] == j // parts[d].windows
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert parts[0].tokens == 10**12 and parts[1].tokens == 650_000_000_000
    assert parts[0].windows == (10**12 - 1) // seq_len
    assert peak < 50 * 2**20, f"{peak / 2**20:.1f} MiB"
