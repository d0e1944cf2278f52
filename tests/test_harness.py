"""The test harness itself (tests/distributed.py): a gloo world whose port another process took
before rank 0's store bound it starts again on another port, instead of failing the tests that
share its fixture (seen once in a full run: two errors, EADDRINUSE)."""

from __future__ import annotations

import socket

import pytest

from tests import distributed

pytestmark = pytest.mark.slow  # several processes


def rank_of(rank: int) -> int:
    return rank


def test_a_world_whose_port_was_taken_starts_again(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("", 0))
        taken.listen()
        handed = [taken.getsockname()[1]]
        real = distributed.free_port

        def free_port() -> int:  # the taken port first, as when another process wins the race
            port = handed.pop() if handed else real()
            ports.append(port)
            return port

        ports: list[int] = []
        monkeypatch.setattr(distributed, "free_port", free_port)
        assert distributed.run_ranks(rank_of, 2, timeout=120) == [0, 1]
    assert len(ports) == 2 and ports[0] != ports[1]  # the taken one, then another
