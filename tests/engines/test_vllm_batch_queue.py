"""A failed load under vLLM's batch queue (async scheduling, the GPU default, or
pipeline parallelism): the steps vLLM planned before it learned of the failure
may compute KV on the stale blocks, and must not seal it in the store.

Before: only the failed step's save was skipped; the next step (planned before
the failure came back) saved blocks computed on the stale prefix, and a later
engine loaded them: wrong KV under valid hashes."""

from __future__ import annotations

import random

import pytest

from kvstore.client.store_client import StoreClient
from tests.conftest import ServerThread
from tests.engines.vllm_scheduler import BS, Harness, chain


@pytest.fixture
def store():
    s = ServerThread(pool_size=64 << 20, device="cpu", slab_bytes=4 << 20)
    yield s
    s.stop()


@pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "batch-queue"])
def test_a_failed_load_never_seals_kv_computed_on_its_stale_blocks(vllm_ready, store, async_sched):
    rng = random.Random(0)
    tokens = [rng.randrange(3, 1000) for _ in range(161)]  # 10 blocks a later request may load
    h = Harness(store.address, async_sched=async_sched, budget=64)
    try:
        h.add("a", tokens[:65])  # stores blocks 0..3
        h.run()
        h.reset_local_cache()
        h.fail_loads = 1  # b hits 0..3 in the store, and that load fails
        h.add("b", tokens)  # prefilled 64 tokens a step
        h.run()
        h.reset_local_cache()
        h.add("c", tokens[:129])  # stores what b did not (4..7)
        h.run()
        h.reset_local_cache()
        h.add("d", tokens)  # loads what the store holds of the chain
        h.run()
        want = chain(tokens)
        table = h.tables["d"]
        got = [h.cell(table[p // BS], p % BS) for p in range(10 * BS)]
        wrong = sorted({p // BS for p in range(10 * BS) if got[p] != want[p]})
        assert wrong == [], (
            f"blocks of wrong KV after a load from the store: {wrong}\n" + "\n".join(h.log)
        )
        # and the rank saves again once the scheduler heard: every block ends stored
        assert StoreClient(store.address).stats().sealed_blocks == 10, "\n".join(h.log)
    finally:
        h.close()


def wrong_blocks(h: Harness, req_id: str, tokens: list[int]) -> list[int]:
    n = len(tokens) // BS
    want, table = chain(tokens), h.tables[req_id]
    got = [h.cell(table[p // BS], p % BS) for p in range(n * BS)]
    return sorted({p // BS for p in range(n * BS) if got[p] != want[p]})


def loads_right_after_failures(h: Harness, seeds, failing, then_add, fails, probe) -> None:
    """Store ``seeds``; run ``failing`` with its next ``fails`` loads failing and
    ``then_add`` added after the first of them; then ``probe`` loads what the
    store holds of its chain, which must be the right KV."""
    try:
        for request in seeds:
            h.add(*request)
        h.run()
        h.reset_local_cache()
        h.fail_loads = fails
        h.then_add = then_add
        h.add(*failing)
        h.run()
        h.reset_local_cache()
        h.add(*probe)
        h.run()
        wrong = wrong_blocks(h, *probe)
        assert wrong == [], f"wrong blocks {wrong}\n" + "\n".join(h.log)
    finally:
        h.close()


def test_two_failed_loads_in_flight_never_seal_stale_kv(vllm_ready, store):
    """Loads fail in two plans in a row (b's, then e's, added after it): the
    scheduler hears of the first before it plans the step after the second.
    Found by review of a count of failures heard, which let that step save KV
    computed on the second load's stale blocks."""
    rng = random.Random(1)
    tb = [rng.randrange(3, 1000) for _ in range(81)]
    te = [rng.randrange(3, 1000) for _ in range(321)]
    h = Harness(store.address, async_sched=True, budget=128)
    seeds = [("a1", tb[:65]), ("a2", te[:65])]
    loads_right_after_failures(h, seeds, ("b", tb), ("e", te), 2, ("de", te))


def test_a_request_sharing_the_failed_blocks_never_seals_stale_kv(vllm_ready, store):
    """b's load fails; q, planned before that was heard, hits b's blocks in vLLM's
    prefix cache and computes its own on their stale KV. vLLM rewinds only b (it
    recomputes the shared blocks), so q's blocks are never recomputed: they must
    never be saved. Found by review: re-planned, they were sealed stale."""
    rng = random.Random(2)
    prefix = [rng.randrange(3, 1000) for _ in range(64)]
    tb = prefix + [rng.randrange(3, 1000) for _ in range(17)]
    tq = prefix + [rng.randrange(3, 1000) for _ in range(65)]
    h = Harness(store.address, async_sched=True, budget=64)
    loads_right_after_failures(h, [("a", [*prefix, 1])], ("b", tb), ("q", tq), 1, ("d", tq))
