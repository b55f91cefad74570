"""The trace-replay simulator behind bench/router_trace.py: its invariants on tiny traces."""

from __future__ import annotations

import random

import pytest

from kvstore.testing import cluster_policies as pol
from kvstore.testing.cluster_metrics import summarise
from kvstore.testing.cluster_sim import CostModel, LruBlocks, TraceRequest, replay
from kvstore.testing.cluster_traces import MultiTurnShape, multi_turn, rearrive

# 4-token blocks, 1 token per ms, no fixed cost: TTFTs are easy to compute by hand.
HAND = CostModel(
    block_tokens=4,
    cache_blocks=100,
    prefill_tokens_per_ms=1.0,
    prefill_overhead_ms=0.0,
    decode_interference=0.0,
)
SMALL = CostModel(block_tokens=512, cache_blocks=40, prefill_tokens_per_ms=25.0)


def req(t: float, tokens: int, ids: tuple[int, ...], output: int = 1) -> TraceRequest:
    return TraceRequest(t, tokens, output, ids)


def small_trace() -> list[TraceRequest]:
    return rearrive(multi_turn(MultiTurnShape(sessions=40, systems=5), seed=7), 0.02)


def all_policies(workers: int, model: CostModel) -> list:
    return [
        pol.KvRouterPolicy(workers, model, event_lag_ms=50.0, report_every_ms=100.0, seed=1),
        pol.RoundRobin(),
        pol.RandomPolicy(seed=1),
        pol.LeastLoaded(seed=1),
        pol.PrefixHash(depth=1),
        pol.PrefixHash(depth=2),
        pol.SessionAffinity(),
        pol.OraclePolicy(seed=1),
    ]


def test_hits_and_ttft_match_a_hand_computed_example():
    trace = [
        req(0, 12, (1, 2, 3)),  # cold: 12 tokens
        req(100, 10, (1, 2, 9)),  # 2 blocks cached: 8 tokens, 2 to compute
        req(200, 12, (1, 2, 3)),  # all cached, but the last token is always computed
        req(300, 8, (20, 21)),  # cold: 8 tokens
        req(300, 12, (20, 21, 22)),  # waits 8 ms, then finds the 2 blocks the last one stored
    ]
    run = replay(trace, pol.RoundRobin(), HAND, workers=1)
    assert [r.cached_tokens for r in run.records] == [0, 8, 11, 0, 8]
    assert [r.ttft_ms for r in run.records] == [12, 2, 1, 8, 12]
    assert [r.queue_ms for r in run.records] == [0, 0, 0, 0, 8]
    assert summarise("rr", run).hit_rate == pytest.approx(27 / 54)


def test_ttft_is_never_below_the_prefill_of_uncached_tokens():
    trace = small_trace()
    for policy in all_policies(3, SMALL):
        for r in replay(trace, policy, SMALL, workers=3).records:
            uncached = r.input_tokens - r.cached_tokens
            assert uncached >= 1
            assert r.ttft_ms >= r.queue_ms + SMALL.prefill_ms(uncached, 0) - 1e-9, policy.name
            assert r.queue_ms >= 0


def test_the_oracle_predicts_each_ttft_exactly():
    """What makes the oracle a true-TTFT reference: its forecast is what happens."""

    class Recording(pol.OraclePolicy):
        def choose(self, request, request_id, now, workers):
            w = super().choose(request, request_id, now, workers)
            forecast[request_id] = workers[w].ttft_if_added(request, now)
            return w

    forecast: dict[str, float] = {}
    run = replay(small_trace(), Recording(seed=2), SMALL, workers=3)
    assert len(forecast) == len(run.records)
    for r in run.records:
        assert r.ttft_ms == pytest.approx(forecast[r.request_id])


def test_the_oracle_has_the_lowest_mean_ttft_on_a_small_case():
    trace = small_trace()
    means = {
        p.name: summarise(p.name, replay(trace, p, SMALL, workers=3)).ttft_mean_ms
        for p in all_policies(3, SMALL)
    }
    assert means["oracle"] == min(means.values()), means


def test_caches_never_exceed_their_capacity():
    class Checking(pol.RoundRobin):
        def choose(self, request, request_id, now, workers):
            assert all(w.cached_blocks() <= SMALL.cache_blocks for w in workers)
            return super().choose(request, request_id, now, workers)

    run = replay(small_trace(), Checking(), SMALL, workers=2)
    assert summarise("rr", run).hit_rate > 0


def test_lru_reports_exactly_what_it_stored_and_evicted():
    rng = random.Random(5)
    cache = LruBlocks(10)
    for _ in range(200):
        ids = [rng.randrange(30) for _ in range(rng.randint(1, 6))]
        ids = list(dict.fromkeys(ids))
        before = set(cache.blocks)
        change = cache.insert(ids)
        after = set(cache.blocks)
        assert len(cache) <= 10
        assert set(change.stored) == after - before
        assert set(change.evicted) == before - after
        assert cache.prefix(ids) == len(ids)  # a prefix just inserted is the last evicted


def test_router_policy_feeds_the_router_through_the_vllm_decoder():
    policy = pol.KvRouterPolicy(3, SMALL, event_lag_ms=50.0, report_every_ms=100.0)
    replay(small_trace(), policy, SMALL, workers=3)
    stats = policy.router.stats()
    assert stats.blocks_ingested > 0
    assert stats.events_dropped == 0


def test_multi_turn_prompts_extend_the_previous_turn():
    trace = multi_turn(MultiTurnShape(sessions=20, block_tokens=16), seed=1)
    last: dict[int, TraceRequest] = {}
    for r in trace:
        prev = last.get(r.session)
        if prev is not None:
            full = prev.input_tokens // 16
            assert r.block_ids[: full + len(prev.output_ids)] == (
                prev.block_ids[:full] + prev.output_ids
            )
        assert len(r.block_ids) == -(-r.input_tokens // 16)
        last[r.session] = r
