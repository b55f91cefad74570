"""The TTFT cost, workers' load reports and the request life cycle, on the core."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from kvstore.router import LoadReport
from kvstore.router.admission import WorkerRef
from kvstore.router.core import Router, RouterConfig
from kvstore.router.load import LoadTracker, TrackedRequest
from kvstore.router.scoring import ScoringConfig
from kvstore.router.vllm_events import BlockEvent
from kvstore.wire import limits
from kvstore.wire.errors import KVError
from kvstore.wire.hashing import block_hashes
from tests.router.conftest import Clock, card

PROMPT = list(range(16 * 8))  # 8 blocks of 16 tokens
HASHES = block_hashes(PROMPT, 16)
MS_PER_TOKEN = 0.04  # ScoringConfig's defaults, spelled out for the arithmetic below
DECODE_MS = 1.0


def make_router(clock: Clock | None = None, **scoring) -> Router:
    """A seeded router ranking by ttft alone unless ``scoring`` says otherwise."""
    scoring = {"seed": 1, "recompute_weight": 0.0, **scoring}
    return Router(RouterConfig(scoring=ScoringConfig(**scoring)), clock=clock or Clock())


def hot_and_cold(router: Router, cached_blocks: int = 8):
    """Worker "hot" holds the first ``cached_blocks`` of HASHES on its GPU; "cold" none."""
    hot = router.register_worker("hot", card())
    router.register_worker("cold", card())
    router.apply_worker_events(hot.ref, [BlockEvent("stored", HASHES[:cached_blocks])])
    return hot


def test_defaults_are_the_documented_ones():
    cfg = ScoringConfig()
    assert (cfg.prefill_ms_per_token, cfg.decode_interference_ms) == (MS_PER_TOKEN, DECODE_MS)
    assert (cfg.load_staleness_s, cfg.recompute_weight) == (2.0, 1.0)


@pytest.mark.parametrize(
    "queued, winner",
    [(0, "hot"), (127, "hot"), (128, "cold"), (129, "cold"), (10_000, "cold")],
)
def test_a_cached_worker_with_a_long_queue_loses_exactly_when_the_formula_says(queued, winner):
    # hot: (queued + 0 uncached) x p; cold: (0 + 128 uncached) x p. At 128 the
    # estimates tie and the shorter queue (cold) wins.
    router = make_router()
    hot_and_cold(router)
    router.report_load("hot", LoadReport(queued, 0))
    r = router.route("llama-8b", hashes=HASHES, track=False)
    assert r.worker.name == winner
    expected = (queued if winner == "hot" else 128) * MS_PER_TOKEN
    assert r.ttft.ttft_ms == pytest.approx(expected)


@pytest.mark.parametrize("running, winner", [(5, "hot"), (6, "cold")])
def test_decoding_requests_cost_their_interference_not_their_blocks(running, winner):
    # hot: running x 1 ms; cold: 128 uncached x 0.04 = 5.12 ms.
    router = make_router()
    hot_and_cold(router)
    router.report_load("hot", LoadReport(0, running))
    assert router.route("llama-8b", hashes=HASHES, track=False).worker.name == winner


@pytest.mark.parametrize("queued, winner", [(100, "hot"), (191, "hot"), (192, "cold")])
def test_recompute_weight_charges_the_prefill_a_choice_adds(queued, winner):
    # Weight 1: hot scores (queued + 32) p + 32 p, cold (0 + 128) p + 128 p, so
    # hot wins while queued < 192 (at 192 they tie and the shorter queue wins).
    # By ttft alone cold would win from queued = 97 on.
    router = make_router(recompute_weight=1.0)
    hot_and_cold(router, cached_blocks=6)
    router.report_load("hot", LoadReport(queued, 0))
    r = router.route("llama-8b", hashes=HASHES, track=False)
    assert r.worker.name == winner
    assert r.ttft.recompute_ms == pytest.approx(r.ttft.uncached_tokens * MS_PER_TOKEN)
    assert "ms recompute" in r.reason and "lowest score" in r.reason


def test_started_requests_run_and_no_longer_queue():
    """Own accounting: a long request routed to "hot" queues its uncached
    tokens there; once started it is one decoding request, whatever its size,
    and hot's longer prefix wins again."""
    router = make_router()
    hot_and_cold(router, cached_blocks=6)
    long_prompt = [*HASHES[:6], *range(10**6, 10**6 + 500)]  # hot holds its first 6 blocks
    assert router.route("llama-8b", hashes=long_prompt, request_id="big").worker.name == "hot"
    r = router.route("llama-8b", hashes=HASHES, track=False)
    assert (r.worker.name, r.ttft.queued_tokens) == ("cold", 0)  # hot has 500 x 16 queued
    router.request_started("big")
    r = router.route("llama-8b", hashes=HASHES, track=False)
    # hot: 32 uncached x 0.04 + 1 decoding x 1.0 = 2.28 ms < cold's 128 x 0.04 = 5.12 ms.
    assert (r.worker.name, r.ttft.running_requests, r.ttft.queued_tokens) == ("hot", 1, 0)
    assert r.ttft.ttft_ms == pytest.approx(32 * MS_PER_TOKEN + DECODE_MS)
    router.request_finished("big")
    assert router.stats().active_requests == 0


def test_a_started_request_moves_from_queue_to_running():
    router = make_router()
    router.register_worker("w", card())
    router.route("llama-8b", hashes=HASHES, request_id="a")
    r = router.route("llama-8b", hashes=HASHES, track=False)
    assert (r.ttft.queued_tokens, r.ttft.running_requests) == (128, 0)
    router.request_started("a")
    router.request_started("a")  # twice: counted once
    r = router.route("llama-8b", hashes=HASHES, track=False)
    assert (r.ttft.queued_tokens, r.ttft.running_requests) == (0, 1)
    router.request_finished("a")
    r = router.route("llama-8b", hashes=HASHES, track=False)
    assert (r.ttft.queued_tokens, r.ttft.running_requests) == (0, 0)


def test_stale_reports_are_ignored_and_own_accounting_takes_over():
    clock = Clock()
    router = make_router(clock)
    hot_and_cold(router)
    router.report_load("hot", LoadReport(10_000, 50, 0.9))
    r = router.route("llama-8b", hashes=HASHES, track=False)
    assert r.worker.name == "cold"
    clock.now += 2.0  # exactly the window: still used
    r = router.route("llama-8b", hashes=HASHES, track=False)
    assert r.worker.name == "cold"
    clock.now += 0.5
    r = router.route("llama-8b", hashes=HASHES, track=False)
    assert (r.worker.name, r.ttft.queued_tokens, r.ttft.report_age_s) == ("hot", 0, None)
    assert "own accounting" in r.reason


def test_a_report_is_moved_on_by_what_was_routed_started_and_finished_since():
    clock = Clock()
    router = make_router(clock)
    router.register_worker("w", card())
    router.route("llama-8b", hashes=HASHES, request_id="before")
    router.report_load("w", LoadReport(1000, 2))  # "before" is in these 1000 tokens

    def load():
        t = router.route("llama-8b", hashes=HASHES, track=False).ttft
        return (t.queued_tokens, t.running_requests)

    router.route("llama-8b", hashes=HASHES, request_id="after")
    clock.now += 0.5
    assert load() == (1000 + 128, 2)
    r = router.route("llama-8b", hashes=HASHES, track=False)
    assert r.ttft.report_age_s == 0.5 and "load reported 0.5 s ago" in r.reason
    router.request_started("before")  # the worker's queue drained by its 128 tokens
    assert load() == (1000, 3)
    router.request_started("after")
    assert load() == (1000 - 128, 4)
    router.request_finished("before")
    assert load() == (872, 3)
    router.report_load("w", LoadReport(0, 1))  # the next report replaces the estimate
    assert load() == (0, 1)
    router.request_finished("after")
    router.request_finished("gone")
    assert load() == (0, 0)
    clock.now += 3  # stale: own accounting, which has nothing left
    assert load() == (0, 0)


def test_ties_go_to_the_shorter_queue():
    # a: 4 cached blocks, 64 queued tokens -> (64 + 64) x p; b: nothing -> (0 + 128) x p.
    for seed in range(20):
        router = make_router(seed=seed)
        a = router.register_worker("a", card())
        router.register_worker("b", card())
        router.apply_worker_events(a.ref, [BlockEvent("stored", HASHES[:4])])
        router.report_load("a", LoadReport(64, 0))
        r = router.route("llama-8b", hashes=HASHES, track=False)
        assert r.worker.name == "b", seed
        assert "next a ttft" in r.reason and "tied" not in r.reason


def test_equal_workers_share_routes_evenly_not_by_name():
    router = make_router()
    for name in ("w0", "w1", "w2", "w3"):
        router.register_worker(name, card())
    got = Counter(
        router.route("llama-8b", hashes=HASHES, track=False).worker.name for _ in range(4000)
    )
    assert set(got) == {"w0", "w1", "w2", "w3"}
    assert all(900 <= n <= 1100 for n in got.values()), got
    assert (
        "tied on ttft and queue, drawn at random"
        in router.route("llama-8b", hashes=HASHES, track=False).reason
    )


def test_the_reason_states_the_formula_with_its_numbers():
    router = make_router()
    hot_and_cold(router, cached_blocks=6)
    router.report_load("hot", LoadReport(100, 2))
    r = router.route("llama-8b", hashes=HASHES, track=False)
    # hot: (100 + 32) x 0.04 + 2 x 1 = 7.28 ms; cold: 128 x 0.04 = 5.12 ms.
    assert r.worker.name == "cold"
    assert r.reason.startswith(
        "cold: ttft 5.1 ms = (0 queued + 128 uncached) x 0.04 ms/token + 0 decoding x 1 ms; "
        "0/8 blocks cached (gpu 0, store 0, remote 0); own accounting of routed requests; "
    )
    assert r.reason.endswith("lowest ttft of 2 workers, next hot ttft 7.3 ms")
    t = r.ttft
    assert (t.queued_tokens, t.uncached_tokens, t.running_requests) == (0, 128, 0)
    assert (t.prefill_ms_per_token, t.decode_interference_ms) == (MS_PER_TOKEN, DECODE_MS)


def test_partial_last_block_counts_as_uncached_prefill():
    router = make_router()
    hot_and_cold(router)
    r = router.route("llama-8b", token_ids=[*PROMPT, 1, 2, 3], track=False)
    assert (r.worker.name, r.ttft.uncached_tokens) == ("hot", 3)


def test_finished_requests_report_what_they_hit():
    router = make_router()
    hot_and_cold(router, cached_blocks=6)
    r = router.route("llama-8b", hashes=HASHES, request_id="q")
    assert (r.worker.name, r.overlap_blocks) == ("hot", 6)
    router.request_finished("q", cached_blocks=4)  # its events were ahead of the truth
    router.request_finished("q", cached_blocks=4)  # unknown now: not counted again
    s = router.stats()
    assert (s.hit_reports, s.hit_blocks_predicted, s.hit_blocks_reported) == (1, 6, 4)
    assert s.active_requests == 0


def test_a_replaced_generations_report_is_dropped():
    router = make_router()
    hot_and_cold(router)
    router.report_load("hot", LoadReport(10_000, 0))
    assert router.route("llama-8b", hashes=HASHES, track=False).worker.name == "cold"
    router.register_worker("hot", card())  # a restart: no report, no cached blocks
    r = router.route("llama-8b", hashes=HASHES, track=False)
    assert r.ttft.queued_tokens == 0 and r.ttft.report_age_s is None


def test_a_dropped_workers_requests_leave_with_it_and_no_one_elses_do():
    """Each worker knows its own requests: one routed again elsewhere under the
    same id, or finished, is no longer the dropped worker's."""
    tracker, w1, w2 = LoadTracker(), WorkerRef("w1", 1), WorkerRef("w2", 1)
    tracker.add("a", TrackedRequest(w1, 10, 0, 100.0))
    tracker.add("b", TrackedRequest(w1, 10, 0, 100.0))
    tracker.start("b")
    tracker.add("a", TrackedRequest(w2, 20, 0, 100.0))  # the same id routed again, to w2
    tracker.add("c", TrackedRequest(w1, 5, 0, 100.0))
    tracker.finish("c")
    tracker.drop_worker(w1)
    assert set(tracker.requests) == {"a"}
    assert tracker.load(w2, 0.0, 1.0).queued_tokens == 20
    assert tracker.load(w1, 0.0, 1.0) == tracker.load(WorkerRef("none", 1), 0.0, 1.0)
    assert not tracker.finish("b") and tracker.finish("a")
    tracker.add("b", TrackedRequest(w2, 1, 0, 100.0))
    tracker.drop_worker(w2)
    tracker.drop_worker(w2)  # twice: nothing left to drop
    assert tracker.requests == {} and tracker.expire(math.inf) == 0


def test_one_principal_cannot_crowd_out_anothers_tracked_requests(monkeypatch):
    """Tracked requests had one global bound, the oldest dropped past it: tenant
    b routing without end dropped tenant a's requests (their finish then counted
    nothing). Each non-admin principal now holds at most its quota."""
    from kvstore.wire.principal import Principal

    monkeypatch.setattr(limits, "MAX_ACTIVE_REQUESTS_PER_PRINCIPAL", 5)
    monkeypatch.setattr(limits, "MAX_ACTIVE_REQUESTS", 8)
    router = make_router()
    a, b = Principal("tenant-a"), Principal("tenant-b")
    router.register_worker("w", card(), caller=a)
    router.register_worker("wb", card(namespace="b-ns"), caller=b)
    router.route("llama-8b", hashes=HASHES, request_id="a-req", caller=a)
    for i in range(5):
        router.route("llama-8b", hashes=HASHES, request_id=f"b{i}", caller=b)
    with pytest.raises(KVError) as info:
        router.route("llama-8b", hashes=HASHES, request_id="b5", caller=b)
    assert info.value.code.name == "RESOURCE_EXHAUSTED" and "tracked requests" in info.value.message
    router.route("llama-8b", hashes=HASHES, request_id="b0", caller=b)  # its own id again: ok
    router.route("llama-8b", hashes=HASHES, track=False, caller=b)  # untracked: ok
    router.request_finished("b1", caller=b)
    router.route("llama-8b", hashes=HASHES, request_id="b5", caller=b)  # a slot came free
    assert router.stats().active_requests == 6
    router.request_finished("a-req", cached_blocks=8, caller=a)  # still a's to finish
    assert router.stats().active_requests == 5


@pytest.mark.parametrize(
    "report, field",
    [
        (LoadReport(-1, 0), "queued_prefill_tokens"),
        (LoadReport(limits.MAX_QUEUED_PREFILL_TOKENS + 1, 0), "queued_prefill_tokens"),
        (LoadReport(1.5, 0), "queued_prefill_tokens"),
        (LoadReport(0, -1), "running_requests"),
        (LoadReport(0, limits.MAX_RUNNING_REQUESTS + 1), "running_requests"),
        (LoadReport(0, True), "running_requests"),
        (LoadReport(0, 0, 1.5), "kv_usage"),
        (LoadReport(0, 0, -0.1), "kv_usage"),
        (LoadReport(0, 0, math.nan), "kv_usage"),
        (LoadReport(0, 0, "full"), "kv_usage"),
    ],
)
def test_bad_load_reports_name_the_field_and_change_nothing(report, field):
    router = make_router()
    router.register_worker("w", card())
    with pytest.raises(KVError) as err:
        router.report_load("w", report)
    assert err.value.code.name == "INVALID_ARGUMENT" and field in err.value.message
    assert router.stats().load_reports == 0
    assert router.route("llama-8b", hashes=HASHES, track=False).ttft.report_age_s is None


def test_reports_and_life_cycle_calls_check_names_and_ids():
    router = make_router()
    router.register_worker("w", card())
    with pytest.raises(KVError) as err:
        router.report_load("ghost", LoadReport(0, 0))
    assert err.value.code.name == "NOT_FOUND" and "worker" in err.value.message
    with pytest.raises(KVError) as err:
        router.report_load("", LoadReport(0, 0))
    assert err.value.code.name == "INVALID_ARGUMENT" and "worker" in err.value.message
    router.route("llama-8b", hashes=HASHES, request_id="r")
    for call in (
        lambda: router.request_started("r" * 300),
        lambda: router.request_finished("r" * 300),
    ):
        with pytest.raises(KVError) as err:
            call()
        assert err.value.code.name == "INVALID_ARGUMENT" and "request_id" in err.value.message
    for bad in (-1, limits.MAX_BLOCK_HASHES + 1):
        with pytest.raises(KVError) as err:
            router.request_finished("r", cached_blocks=bad)
        assert err.value.code.name == "INVALID_ARGUMENT" and "cached_blocks" in err.value.message
    assert router.stats().active_requests == 1  # nothing was finished
    router.request_started("nobody")  # an unknown id is not an error
    router.request_finished("nobody", cached_blocks=3)
    assert router.stats().hit_reports == 0
