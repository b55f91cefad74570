"""The vLLM connector's plain-Python halves, against a real store server (no vLLM needed).

The scheduler half is driven with objects shaped like vLLM's (a request with
``request_id``, ``block_hashes``, ``num_tokens``; a scheduler output with new
and cached requests); the store is real. End-to-end tests with real vLLM are
in ``tests/engines``.
"""

from __future__ import annotations

import json
import logging
import threading
from types import SimpleNamespace

import pytest
import torch

from kvstore.client.store_client import RankSpec, StoreClient
from kvstore.integrations.vllm.identity import block_key, client_namespace, hash_format
from kvstore.integrations.vllm.scheduler import BlockPair, SchedulerSide
from kvstore.integrations.vllm.worker import SharedMemoryKVPool, WorkerSide, paged_layers

BS, NB = 32, 64
HF = hash_format("sha256", "vllm-none-hash")


def vllm_hash(i: int) -> bytes:
    return (0xABCD0000 + i).to_bytes(32, "big")  # low 64 bits: 0xABCD0000 + i


def request(req_id: str, blocks: int, extra_tokens: int = 5):
    return SimpleNamespace(
        request_id=req_id,
        block_hashes=[vllm_hash(i) for i in range(blocks)],
        num_tokens=blocks * BS + extra_tokens,
    )


def new_req(req_id, block_ids, computed):
    return SimpleNamespace(req_id=req_id, block_ids=(block_ids,), num_computed_tokens=computed)


def step(new=(), cached=None, scheduled=None):
    cached = cached or SimpleNamespace(
        req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
    )
    return SimpleNamespace(
        scheduled_new_reqs=list(new), scheduled_cached_reqs=cached, num_scheduled_tokens=scheduled
    )


def engine_rank(server, tp_rank=0, tp_size=1, tls=None, **timing):
    """An engine rank whose KV cache vLLM allocated through the connector's pool, registered."""
    pool = SharedMemoryKVPool()
    with pool:
        buf = torch.zeros(2 * NB * 2 * BS * 128 * 2, dtype=torch.int8)
    views = {
        f"model.layers.{i}.self_attn.attn": buf[i * NB * 16384 : (i + 1) * NB * 16384]
        .view(torch.bfloat16)
        .view(NB, 2, BS, 128)
        for i in range(2)
    }
    identity = RankSpec(
        "vllm-engine-1", "tiny-0123456789abcdef", HF, BS, tp_rank, tp_size, tp_rank, tp_size
    )
    worker = WorkerSide(StoreClient(server.address, tls=tls), identity, **timing)
    worker.register(paged_layers(views, BS, "LBHNC", pool))
    return worker, views, buf, pool


# vLLM's KVCacheLayout (vllm/v1/kv_cache_layout.py): memory order of the logical
# [L, B, H, N, C] dims of the cache, C the K+V cell
VLLM_ORDERS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def vllm_views(buf, layout, layers, heads=2, ratio=1):
    """The per-layer [B, H, N, C] views vLLM 0.32 hands register_kv_caches for
    ``layout`` (allocate_kv_cache: one dense int8 buffer, bf16 views; checked equal
    to vLLM's own for every layout and ratio it allows), ``ratio`` kernel blocks a block."""
    shape = (layers, NB * ratio, heads, BS // ratio, 128)
    strides = [0] * 5
    step = 1
    for dim in reversed(VLLM_ORDERS[layout]):
        strides[dim] = step
        step *= shape[dim]
    cache = torch.as_strided(buf.view(torch.bfloat16), shape, strides)
    return {f"model.layers.{i}.self_attn.attn": cache[i] for i in range(layers)}


@pytest.mark.parametrize(("layout", "layers", "heads"), [("LHBNC", 2, 2), ("BHLNC", 2, 2)])
def test_a_layout_that_splits_a_layers_block_is_refused_at_registration(layout, layers, heads):
    """Before: paged_layers took these layouts by name, so register_kv_caches went
    through and the registration failed later, in the background (the client's
    geometry check), retried every retry_s as if the store were down. Now the
    engine fails at start, naming the layout and the ones that work."""
    views = vllm_views(
        torch.zeros(layers * NB * heads * BS * 128 * 2, dtype=torch.int8), layout, layers, heads
    )
    with pytest.raises(ValueError, match=layout) as err:
        paged_layers(views, BS, layout, None)
    assert "LBHNC, LBNHC, BLHNC, BLNHC" in str(err.value)
    assert "VLLM_KV_CACHE_LAYOUT" in str(err.value)


@pytest.mark.parametrize(
    ("layout", "layers", "heads", "ratio"),
    [
        ("LBNHC", 2, 2, 2),
        ("BLHNC", 2, 2, 1),
        ("BLNHC", 1, 2, 2),  # vLLM splits a block-outermost cache only with one layer
        ("LHBNC", 2, 1, 1),  # one KV head a rank: the bytes of LBHNC
    ],
)
def test_layouts_whose_blocks_are_one_run_register_and_seal(server, layout, layers, heads, ratio):
    pool = SharedMemoryKVPool()
    with pool:
        buf = torch.zeros(max(layers * NB * heads * BS * 128 * 2, 1 << 20), dtype=torch.int8)
    views = vllm_views(buf, layout, layers, heads, ratio)
    identity = RankSpec(f"vllm-{layout}", "tiny-0123456789abcdef", HF, BS, 0, 1, 0, 1)
    worker = WorkerSide(StoreClient(server.address), identity, seal_timeout=10, retry_s=0.2)
    try:
        worker.register(paged_layers(views, BS, layout, pool))
        assert worker.wait_ready(10)
        worker.save([BlockPair(block_key(vllm_hash(i)), i) for i in range(2)])
        assert StoreClient(server.address).stats().sealed_blocks == 2
    finally:
        worker.close([pool])


@pytest.fixture
def rank(server):
    """A sealed engine rank."""
    worker, views, buf, pool = engine_rank(server, seal_timeout=10, retry_s=0.2)
    yield worker, views, buf
    worker.close([pool])


def test_a_rank_that_waited_for_the_others_saves_the_moment_they_seal(server, caplog):
    """The seal arriving between two retry ticks makes the rank live as soon as its
    stream brings it, not at the next tick (retry_s is a minute here)."""
    first, *_, pool0 = engine_rank(server, 0, 2, seal_timeout=0.2, retry_s=60)
    try:
        assert not first.wait_ready(0)  # waited 0.2 s for rank 1, then went on
        with caplog.at_level(logging.INFO):
            second, *_, pool1 = engine_rank(server, 1, 2, seal_timeout=10, retry_s=60)
            try:
                assert first.wait_ready(10)
                pairs = [BlockPair(block_key(vllm_hash(i)), i) for i in range(3)]
                first.save(pairs)
                second.save(pairs)
                stats = StoreClient(server.address).stats()
                assert stats.sealed_instances == 1 and stats.sealed_blocks == 3
            finally:
                second.close([pool1])
        sealed = [m for m in caplog.messages if "rank 0 of vllm-engine-1 sealed" in m]
        assert len(sealed) == 1, sealed
    finally:
        first.close([pool0])


def test_the_kv_pool_allocates_vllm_buffer_in_shared_memory_only():
    pool = SharedMemoryKVPool()
    with pool:
        kv = torch.zeros(4 << 20, dtype=torch.int8, device="cpu")
        small = torch.zeros(100, dtype=torch.int8)
        other = torch.zeros(4 << 20, dtype=torch.float16)
    assert len(pool.buffers) == 1 and pool.owner_of(kv[1024:2048].view(2, 512)) is pool.buffers[0]
    with pytest.raises(ValueError, match="get_mem_pool_context"):
        pool.owner_of(other.view(-1, 64))
    assert small.numel() == 100
    pool.close()


def test_lookups_are_idempotent_leased_once_and_never_claim_the_last_token(server, rank):
    worker = rank[0]
    client = StoreClient(server.address)
    sched = SchedulerSide(client, "vllm-engine-1", BS, expected_hash_format=lambda: HF)
    # save blocks 0..3 through the worker, as a step after a forward would
    worker.save([BlockPair(block_key(vllm_hash(i)), i) for i in range(4)])
    exact = request("r1", 4, extra_tokens=0)  # 128 tokens: block 3 holds the last token
    assert sched.matched_tokens(exact, 0) == 3 * BS
    assert sched.matched_tokens(exact, 0) == 3 * BS  # asked again: same answer
    assert sched.matched_tokens(exact, BS) == 2 * BS  # a longer local hit
    assert client.stats().leases == 1
    longer = request("r2", 6)
    assert sched.matched_tokens(longer, 0) == 4 * BS
    sched.finished("r1")
    sched.finished("r2")
    assert client.stats().leases == 0


def test_plan_loads_the_external_part_and_saves_each_full_block_once(server, rank):
    worker, views, buf = rank
    sched = SchedulerSide(StoreClient(server.address), "vllm-engine-1", BS)
    g = torch.Generator().manual_seed(1)
    buf.copy_(torch.randint(-128, 128, buf.shape, generator=g, dtype=torch.int8))
    r = request("r", 5)
    assert sched.matched_tokens(r, 0) == 0
    plan = sched.build_plan(
        step([new_req("r", [9, 8, 7, 6, 5, 4], 0)], scheduled={"r": 100}), {"r": r}
    )
    assert plan.saves == [BlockPair(block_key(vllm_hash(i)), b) for i, b in enumerate([9, 8, 7])]
    cached = SimpleNamespace(
        req_ids=["r"], resumed_req_ids=set(), new_block_ids=[None], num_computed_tokens=[100]
    )
    plan = sched.build_plan(step(cached=cached, scheduled={"r": 70}), {"r": r})
    assert plan.saves == [BlockPair(block_key(vllm_hash(i)), b) for i, b in [(3, 6), (4, 5)]]
    worker.save(plan.saves)
    sched.finished("r")
    # a second request with the same prefix: blocks 0..4 are external beyond a local hit of 1
    before = {n: v[[8, 7, 6, 5]].clone() for n, v in views.items()}
    r2 = request("r2", 5)
    worker.save([BlockPair(block_key(vllm_hash(i)), b) for i, b in enumerate([9, 8, 7])])
    assert sched.matched_tokens(r2, BS) == 4 * BS
    sched.after_alloc(r2, [9, 0, 1, 2, 3, 10], 4 * BS)
    plan = sched.build_plan(step(), {})
    assert plan.loads == [
        BlockPair(block_key(vllm_hash(i)), b) for i, b in zip(range(1, 5), range(4))
    ]
    worker.load(plan.loads)
    assert worker.take_load_errors() == set()
    for n, v in views.items():
        assert torch.equal(v[[0, 1, 2, 3]].view(torch.int16), before[n].view(torch.int16))


def test_requests_sharing_a_prefix_in_one_step_save_each_block_once(server, rank):
    """Two new requests with a common prefix (vLLM caches its blocks once) named
    the same blocks twice in one step: the store refused the whole Save."""
    worker, _, _ = rank
    sched = SchedulerSide(StoreClient(server.address), "vllm-engine-1", BS)
    a, b = request("a", 3), request("b", 3)  # the same three block hashes
    plan = sched.build_plan(
        step(
            [new_req("a", [0, 1, 2], 0), new_req("b", [0, 1, 2], 0)], scheduled={"a": 96, "b": 96}
        ),
        {"a": a, "b": b},
    )
    assert plan.saves == [BlockPair(block_key(vllm_hash(i)), i) for i in range(3)]
    worker.save(plan.saves)
    assert StoreClient(server.address).stats().sealed_blocks == 3


def test_requests_sharing_a_stored_prefix_in_one_step_both_load_it(server, rank):
    """Without vLLM's prefix caching, two new requests of one step with a prefix
    in the store each load it into their own blocks: the one Load named each
    hash twice, the store refused it, and every load of the step failed."""
    worker, views, buf = rank
    sched = SchedulerSide(StoreClient(server.address), "vllm-engine-1", BS)
    g = torch.Generator().manual_seed(2)
    buf.copy_(torch.randint(-128, 128, buf.shape, generator=g, dtype=torch.int8))
    worker.save([BlockPair(block_key(vllm_hash(i)), b) for i, b in enumerate([20, 21, 22])])
    saved = {n: v[[20, 21, 22]].clone() for n, v in views.items()}
    a, b = request("a", 4), request("b", 4)  # the same four hashes, three of them stored
    for req, ids in ((a, [0, 1, 2, 3]), (b, [4, 5, 6, 7])):
        assert sched.matched_tokens(req, 0) == 3 * BS
        sched.after_alloc(req, ids, 3 * BS)
    plan = sched.build_plan(step(), {})
    assert len(plan.loads) == 6 and len({p.key for p in plan.loads}) == 3
    worker.load(plan.loads)
    assert worker.take_load_errors() == set()
    for n, v in views.items():
        for ids in ([0, 1, 2], [4, 5, 6]):
            assert torch.equal(v[ids].view(torch.int16), saved[n].view(torch.int16))


def test_a_step_whose_load_failed_saves_nothing(server, rank):
    """Before: the step's Save went ahead and sealed, under valid hashes, blocks
    whose Load had just failed (stale KV) and blocks computed on top of them."""
    worker, _, _ = rank
    client = StoreClient(server.address)
    pairs = [BlockPair(block_key(vllm_hash(i)), i) for i in range(3)]
    worker.load(pairs[:2])  # never saved: NOT_FOUND
    worker.save(pairs)
    assert client.stats().sealed_blocks == 0
    assert worker.take_load_errors() == {0, 1}
    worker.load([], step=1)  # the next step, planned once the scheduler heard
    worker.save(pairs, step=1)
    assert client.stats().sealed_blocks == 3


def test_steps_planned_before_the_scheduler_heard_of_a_failed_load_save_nothing(server, rank):
    """A batch queue (vLLM's async scheduling, the GPU default, or pipeline
    parallelism) plans step N+1 before step N's output says N's load failed, so
    N+1 may compute blocks on that load's stale KV. Before: only step N's save was
    skipped, and N+1's sealed KV computed on stale blocks under valid hashes. Two
    failed loads in flight at once (steps 1 and 2) keep the saves off until the
    later one was heard (review: a count of failures heard unlocked step 3)."""
    worker, _, _ = rank
    worker.plans_in_flight = 2  # vLLM's async scheduling
    client = StoreClient(server.address)
    pairs = [BlockPair(block_key(vllm_hash(i)), i) for i in range(3)]
    worker.load(pairs[:2], step=1)  # never saved: NOT_FOUND
    worker.save(pairs[:1], step=1)
    worker.load(pairs[2:], step=2)  # planned before step 1's output came back; fails too
    worker.save(pairs[1:], step=2)
    worker.load([], step=3)  # planned once step 1's failure was heard, not step 2's
    worker.save(pairs, step=3)
    assert client.stats().sealed_blocks == 0
    assert worker.take_load_errors() == {0, 1, 2}
    worker.load([], step=4)  # planned once both were heard
    worker.save(pairs, step=4)
    assert client.stats().sealed_blocks == 3


def test_a_failure_heard_plans_again_what_a_rank_may_have_skipped(server, monkeypatch):
    """Once a step's output reports a failed load, the saves of the last
    RESAVE_PLANS plans are planned again (the failed rank skipped those planned
    before it heard), a request vLLM rewound saves again from its first failed
    block on (vLLM recomputes it), and a request that shares a failed block but
    was not rewound never saves from that block on: it computed on the stale KV
    (found by review: vLLM makes only one of the sharers recompute). Before,
    such blocks were never saved again, or were sealed stale."""
    monkeypatch.setattr("kvstore.integrations.vllm.scheduler.RESAVE_PLANS", 2)
    sched = SchedulerSide(StoreClient(server.address), "vllm-engine-1", BS)
    r, q, s = request("r", 6), request("q", 3), request("s", 4)
    one = sched.build_plan(
        step([new_req("r", [10, 11, 12, 13, 14, 15], 0)], scheduled={"r": 2 * BS}), {"r": r}
    )
    two = sched.build_plan(
        step([new_req("s", [10, 11, 30, 31], 0)], scheduled={"s": 3 * BS}), {"s": s}
    )  # s shares r's blocks 0-1 (vLLM's prefix cache)
    three = sched.build_plan(
        step([new_req("q", [20, 21, 22], 0)], scheduled={"q": 3 * BS}), {"q": q}
    )
    saves = one.saves + two.saves + three.saves
    assert [p.block_id for p in saves] == [10, 11, 10, 11, 30, 20, 21, 22]
    r.num_computed_tokens = BS  # vLLM rewound r to its failed block 1 ...
    s.num_computed_tokens = 3 * BS  # ... and left s, which shares it, as it was
    sched.load_failed({11})

    def cached(req_id, computed):
        return SimpleNamespace(
            req_ids=[req_id],
            resumed_req_ids=set(),
            new_block_ids=[None],
            num_computed_tokens=[computed],
        )

    four = sched.build_plan(step(cached=cached("r", BS), scheduled={"r": BS}), {"r": r})
    # r: from its failed block on (block 0, planned before the last 2 plans, stands)
    assert [p.block_id for p in four.saves] == [11]
    five = sched.build_plan(step(cached=cached("q", 3 * BS), scheduled={"q": 1}), {"q": q})
    assert [p.block_id for p in five.saves] == [20, 21, 22]  # planned in the last 2 plans
    six = sched.build_plan(step(cached=cached("s", 3 * BS), scheduled={"s": BS}), {"s": s})
    assert six.saves == []  # s: nothing from the stale block on (its block 0 stands)
    seven = sched.build_plan(step(cached=cached("s", 4 * BS), scheduled={"s": 1}), {"s": s})
    assert seven.saves == []


def test_a_load_failed_on_one_rank_never_seals_the_others_stale_kv(server):
    """TP 2, step 1: rank 1's load fails, so it skips its save; rank 0's load went
    through, and it saves blocks computed (through the all-reduce) on rank 1's
    stale KV. Before: when a later step saved the same blocks, rank 0 was
    skipped (its slots were in) and rank 1's completed the seal: every engine
    then loaded rank 0's stale slots. The plans' step numbers prevent it."""
    sched = SchedulerSide(StoreClient(server.address), "vllm-engine-1", BS)
    one, two = (sched.build_plan(step(), {}).step for _ in range(2))
    assert (one, two) == (1, 2)  # every plan numbered: what each rank saves under
    ranks = [engine_rank(server, r, 2, seal_timeout=10, retry_s=0.2) for r in range(2)]
    (w0, views0, _, pool0), (w1, views1, _, pool1) = ranks
    try:
        assert w0.wait_ready(10) and w1.wait_ready(10)
        pairs = [BlockPair(block_key(vllm_hash(i)), i) for i in range(3)]
        w0.load([], one)
        w1.load([BlockPair(12345, 3)], one)  # never saved: this rank's load fails
        assert w1.take_load_errors() == {3}
        for v in views0.values():
            v[:3] = 66  # rank 0's KV of step 1: computed on rank 1's stale KV
        w0.save(pairs, one)
        w1.save(pairs, one)  # skipped
        for w in (w0, w1):
            w.load([], two)  # step 2: nothing fails
        for views in (views0, views1):
            for v in views.values():
                v[:3] = 5
        w0.save(pairs, two)
        w1.save(pairs, two)
        assert StoreClient(server.address).stats().sealed_blocks == 3
        later = [BlockPair(p.key, 10 + p.block_id) for p in pairs]
        for w in (w0, w1):
            w.load(later)
            assert w.take_load_errors() == set()
        for views in (views0, views1):
            assert all(bool((v[10:13] == 5).all()) for v in views.values())
    finally:
        w0.close([pool0])
        w1.close([pool1])


def test_an_unreachable_store_is_a_miss_logged_once(caplog):
    client = StoreClient("127.0.0.1:1", timeout=0.5)
    sched = SchedulerSide(client, "vllm-x", BS, retry_s=60)
    with caplog.at_level(logging.WARNING):
        assert sched.matched_tokens(request("a", 4), 0) == 0
        assert sched.matched_tokens(request("b", 4), 0) == 0
    lines = [r.message for r in caplog.records if "unreachable" in r.message]
    assert len(lines) == 1 and "recomputed" in lines[0]
    sched.after_alloc(request("a", 4), [0, 1, 2, 3], 0)
    assert sched.build_plan(step(), {}).loads == []


def test_a_store_that_went_down_is_not_called_again_until_the_retry_is_due():
    """Before: once the namespace was known, every new request's Query and every
    finished request's Release still went to the store while it was down, each
    costing the client's timeout (2 s for a hung store) on the engine's loop."""
    from tests.conftest import ServerThread

    server = ServerThread(pool_size=64 << 20, device="cpu", slab_bytes=4 << 20)
    try:
        worker, _, _, pool = engine_rank(server, seal_timeout=10, retry_s=0.2)
        sched = SchedulerSide(
            StoreClient(server.address, timeout=2), "vllm-engine-1", BS, retry_s=60
        )
        worker.save([BlockPair(block_key(vllm_hash(i)), i) for i in range(4)])
        assert sched.matched_tokens(request("held", 4), 0) == 4 * BS  # leased
    finally:
        server.stop()
    for i in range(5):
        assert sched.matched_tokens(request(f"r{i}", 4), 0) == 0  # a miss
    sched.finished("held")  # its lease expires by itself
    assert sched.stats.store_errors == 1  # the first failure only
    worker.close()
    pool.close()


def test_no_prefetch_is_started_for_a_store_that_did_not_answer():
    """With prefetch on, a Query that failed still started a prefetch against the
    store that had not answered: the request waited out its timeout (60 s)."""
    from tests.conftest import ServerThread

    server = ServerThread(pool_size=64 << 20, device="cpu", slab_bytes=4 << 20)
    try:
        worker, _, _, pool = engine_rank(server, seal_timeout=10, retry_s=0.2)
        sched = SchedulerSide(
            StoreClient(server.address, timeout=2), "vllm-engine-1", BS, prefetch=True
        )
        worker.save([BlockPair(block_key(vllm_hash(i)), i) for i in range(4)])
        assert sched.matched_tokens(request("whole", 4), 0) == 4 * BS  # nothing to fetch
    finally:
        server.stop()
    assert sched.matched_tokens(request("longer", 8), 0) == 0  # a miss, not "ask again"
    assert sched.stats.prefetches == 0 and sched.stats.store_errors == 1
    worker.close()
    pool.close()


def test_an_answer_half_its_lease_old_is_asked_again(server, rank):
    """A request preempted, or waiting long at the head of the queue, reused its
    first answer for its whole life: its Load could rely on a lapsed lease and
    find the blocks evicted (NOT_FOUND fails every load of that step)."""
    worker = rank[0]
    client = StoreClient(server.address)
    now = [0.0]
    sched = SchedulerSide(client, "vllm-engine-1", BS, lease_ms=10_000, clock=lambda: now[0])
    worker.save([BlockPair(block_key(vllm_hash(i)), i) for i in range(2)])
    r = request("r", 5)
    assert sched.matched_tokens(r, 0) == 2 * BS
    worker.save([BlockPair(block_key(vllm_hash(i)), i) for i in range(2, 4)])
    now[0] = 4.9
    assert sched.matched_tokens(r, 0) == 2 * BS and sched.stats.queries == 1
    now[0] = 5.0
    assert sched.matched_tokens(r, 0) == 4 * BS and sched.stats.queries == 2
    assert client.stats().leases == 1  # the first lease went back
    sched.finished("r")
    assert client.stats().leases == 0


def test_a_store_that_stops_answering_costs_one_deadline_not_one_a_step(server, monkeypatch):
    """A store holding its connections but answering nothing (its loop stuck):
    every step's Load and Save waited out the worker's deadline (60 s each).
    After one timeout the rank leaves the store alone for retry_s. (A Load
    waits LATE_COPY_S past its deadline for a copy the store may have begun:
    0.5 s here, where the store stays stuck for 30.)"""
    from kvstore.client import store_client

    monkeypatch.setattr(store_client, "LATE_COPY_S", 0.5)
    worker, _, _, pool = engine_rank(server, seal_timeout=10, retry_s=60, rpc_timeout=0.5)
    stuck = threading.Event()
    try:
        pairs = [BlockPair(block_key(vllm_hash(i)), i) for i in range(2)]
        worker.save(pairs)
        server.loop.call_soon_threadsafe(stuck.wait, 30)  # the store's loop stops
        worker.load(pairs)  # waits out its deadline once
        assert worker.take_load_errors() == {0, 1} and worker.skipped == 0
        worker.load(pairs)  # the next steps: not sent, recomputed
        assert worker.take_load_errors() == {0, 1} and worker.skipped == 1
        worker.load([], step=1)  # planned once the scheduler heard of it
        worker.save(pairs, step=1)
        assert worker.skipped == 2
    finally:
        stuck.set()
        worker.close([pool])


def test_an_error_the_store_answers_in_time_leaves_it_in_use(server, rank):
    """Only a call that waits out its whole deadline stops the rank's calls: a
    store answering DEADLINE_EXCEEDED or UNAVAILABLE itself (a copy it cannot
    end in time, a dead peer it fetched from) is there, and the next step uses it."""
    worker = rank[0]
    pairs = [BlockPair(block_key(vllm_hash(i)), i) for i in range(2)]
    worker.save(pairs)
    worker.rpc_timeout = 0.03  # the store wants 50 ms + the bytes at 1 GB/s left to begin a copy
    worker.load(pairs)  # refused at once: DEADLINE_EXCEEDED, answered by the store
    assert worker.take_load_errors() == {0, 1}
    worker.rpc_timeout = 60.0
    worker.load(pairs)
    assert worker.take_load_errors() == set() and worker.skipped == 0


def test_a_lease_quota_refusal_is_a_miss_of_that_lookup_only(tmp_path, monkeypatch, caplog):
    """Before: a Query refused RESOURCE_EXHAUSTED (the tenant's lease quota full)
    took the store for down for retry_s: no request was looked up, and leases of
    requests finishing meanwhile were not given back, which kept the quota full.
    Now that lookup misses, a renewal that is refused gives the old lease back,
    and the next request asks again; one warning per episode."""
    from kvstore.testing.pki import Pki
    from kvstore.wire import limits
    from tests.conftest import ServerThread

    monkeypatch.setattr(limits, "MAX_LEASES_PER_PRINCIPAL", 1)  # the server runs in this process
    pki = Pki(tmp_path)
    server = ServerThread(
        pool_size=64 << 20,
        device="cpu",
        slab_bytes=4 << 20,
        transfer=False,
        tls=pki.server,
        admins=("ops",),
    )
    tenant, admin = pki.issue("tenant-a"), StoreClient(server.address, tls=pki.issue("ops"))
    worker, _, _, pool = engine_rank(server, tls=tenant, seal_timeout=10, retry_s=0.2)
    now = [0.0]
    sched = SchedulerSide(
        StoreClient(server.address, tls=tenant),
        "vllm-engine-1",
        BS,
        lease_ms=10_000,
        retry_s=60,
        clock=lambda: now[0],
    )
    try:
        worker.save([BlockPair(block_key(vllm_hash(i)), i) for i in range(4)])
        with caplog.at_level(logging.INFO):
            assert sched.matched_tokens(request("a", 4), 0) == 4 * BS  # the tenant's one lease
            assert sched.matched_tokens(request("b", 4), 0) == 0  # refused: a miss
            assert sched.matched_tokens(request("c", 4), 0) == 0  # asked again, refused again
            sched.finished("b")
            now[0] = 5.0  # a's answer is half its lease old: renewed, which is refused
            assert sched.matched_tokens(request("a", 4), 0) == 0
            assert admin.stats().leases == 0  # its old lease went back all the same
            assert sched.matched_tokens(request("d", 4), 0) == 4 * BS  # the store is in use
        assert sched.stats.lease_refusals == 3 and sched.stats.store_errors == 0
        assert admin.stats().leases == 1
        refused = [m for m in caplog.messages if "refused a lease" in m]
        assert len(refused) == 1 and "query leases" in refused[0]
        assert len([m for m in caplog.messages if "grants leases again after" in m]) == 1
        assert not [m for m in caplog.messages if "unreachable" in m]
    finally:
        worker.close([pool])
        server.stop()


def test_a_hash_scheme_mismatch_disables_the_cache(server, rank, caplog):
    sched = SchedulerSide(
        StoreClient(server.address), "vllm-engine-1", BS, expected_hash_format=lambda: "vllm-xxhash"
    )
    with caplog.at_level(logging.ERROR):
        assert sched.matched_tokens(request("a", 4), 0) == 0
    assert any("hash_format" in r.message for r in caplog.records)


def test_load_failures_name_the_blocks_and_never_raise(server, rank):
    worker, _, _ = rank
    worker.load([BlockPair(12345, 3), BlockPair(12346, 4)])  # never saved
    assert worker.take_load_errors() == {3, 4}
    assert worker.take_load_errors() == set()


def checkpoint(path, weights: bytes, config: dict | None = None):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config or {"hidden_size": 128}))
    (path / "model.safetensors").write_bytes(weights)
    return str(path)


def test_namespaces_tell_weights_apart_and_nothing_else(tmp_path):
    a = checkpoint(tmp_path / "a", bytes(3 << 20))
    b = checkpoint(tmp_path / "b", bytes(3 << 20)[:-1] + b"\1")  # one byte at the end
    c = checkpoint(tmp_path / "c", bytes(3 << 20))  # a copy of a elsewhere
    d = checkpoint(tmp_path / "d", bytes(3 << 20), {"hidden_size": 129})
    ns = {k: client_namespace("org/Tiny.Llama", p) for k, p in dict(a=a, b=b, c=c, d=d).items()}
    assert ns["a"] == ns["c"] and len({ns["a"], ns["b"], ns["d"]}) == 3
    assert ns["a"].startswith("Tiny-Llama-")
    assert client_namespace("m", a, revision="v2") != ns["a"].replace("Tiny-Llama", "m")
    assert client_namespace("m", a, override="mine") == "mine"
    assert client_namespace("m", a, model_digest="abc") == "m-abc"
    assert hash_format("sha256", "s1") != hash_format("sha256", "s2") != hash_format("xxhash", "s2")
