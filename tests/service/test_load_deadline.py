"""A Load whose copy might outlive the caller's deadline is not begun: a copy goes
on once started, and one the caller stopped waiting for would write into pages
its engine has reused."""

from __future__ import annotations

import pytest

import kvstore.store.node as store_node
from kvstore.testing.worker import WorkerRank, WorkerSpec
from kvstore.wire.errors import Code, KVError


@pytest.fixture
def rank(server):
    spec = WorkerSpec(server.address, "i", "m", 0, 1, layers=2, heads=2, head_dim=16,
                      block_size=4, num_blocks=8)  # fmt: skip
    r = WorkerRank(spec)
    r.wait_sealed(10)
    yield r
    r.close()


def test_a_load_without_time_for_its_copy_copies_nothing(rank, monkeypatch):
    rank.fill([(7, 0), (8, 1)])
    rank.save([(70, 0), (80, 1)])
    want = rank.digest([0, 1])
    rank.clear([4, 5])
    before = rank.digest([4, 5])
    # as if the copier moved 1 byte a second: this copy would take hours, its caller waits 60 s
    monkeypatch.setattr(store_node, "MIN_COPY_BYTES_PER_S", 1.0)
    with pytest.raises(KVError, match=r"deadline left, and copying .* nothing copied") as err:
        rank.session.load([(70, 4), (80, 5)], timeout=60)
    assert err.value.code is Code.DEADLINE_EXCEEDED
    assert rank.digest([4, 5]) == before
    monkeypatch.undo()
    rank.session.load([(70, 4), (80, 5)], timeout=60)
    assert rank.digest([4, 5]) == want
