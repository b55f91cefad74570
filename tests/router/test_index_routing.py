"""Prefix index, scoring and routing on the plain-Python core."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.router.core import Router, RouterConfig
from kvstore.router.holders import HolderIndex
from kvstore.router.scoring import ScoringConfig
from kvstore.router.vllm_events import BlockEvent
from kvstore.wire import limits
from kvstore.wire.errors import KVError
from kvstore.wire.hashing import block_hashes
from tests.router.conftest import Clock, card

PROMPT = list(range(16 * 8))  # 8 blocks of 16 tokens
HASHES = block_hashes(PROMPT, 16)


def stored(hashes):
    return [BlockEvent("stored", list(hashes))]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.lists(st.booleans(), min_size=6, max_size=6), min_size=1, max_size=6),
    st.integers(0, 63),
)
def test_prefix_depths_match_a_direct_walk(holdings, active_bits):
    hashes = list(range(1000, 1006))
    index = HolderIndex()
    for b, held in enumerate(holdings):
        index.assign(("h", b))
        index.store(b, [h for h, keep in zip(hashes, held, strict=True) if keep])
    active = active_bits & ((1 << len(holdings)) - 1)
    expected = {b: walk(index, hashes, b) for b in range(len(holdings)) if active >> b & 1}
    expected = {b: d for b, d in expected.items() if d}  # a miss has no entry
    assert index.prefix_depths(hashes, active) == expected
    holders = [("h", b) for b in range(len(holdings)) if active >> b & 1]
    assert index.holder_depths(hashes, holders) == {("h", b): d for b, d in expected.items()}


def walk(index: HolderIndex, hashes: list[int], bit: int) -> int:
    """Leading ``hashes`` whose mask carries ``bit``: the prefix depth, one block at a time."""
    for i, h in enumerate(hashes):
        if not index.masks.get(h, 0) >> bit & 1:
            return i
    return len(hashes)


def test_remove_clear_and_release():
    index = HolderIndex()
    a, b = index.assign("a"), index.assign("b")
    index.store(a, [1, 2, 3])
    index.store(b, [2, 3, 4])
    index.remove(a, [3, 99])
    assert index.masks == {1: 1, 2: 3, 3: 2, 4: 2}
    assert index.clear(b) == 3
    assert index.masks == {1: 1, 2: 1}
    index.release("a")
    assert index.masks == {} and index.holders() == ["b"]
    assert index.assign("c") == a  # the freed bit is reused, with no stale entries


def test_route_follows_the_longest_prefix(router):
    ws = [router.register_worker(f"w{i}", card()) for i in range(3)]
    router.apply_worker_events(ws[0].ref, stored(HASHES[:2]))
    router.apply_worker_events(ws[1].ref, stored(HASHES[:6]))
    router.apply_worker_events(ws[2].ref, stored(HASHES[3:]))  # no first block: no prefix
    r = router.route("llama-8b", token_ids=PROMPT, track=False)
    assert (r.worker.name, r.overlap_blocks, r.gpu_blocks, r.total_blocks) == ("w1", 6, 6, 8)
    assert "6/8 blocks cached (gpu 6" in r.reason and "next" in r.reason
    assert r.ttft.uncached_tokens == 2 * 16


def test_partial_block_is_not_hashed(router):
    router.register_worker("w", card())
    r = router.route("llama-8b", token_ids=[*PROMPT, 1, 2, 3], track=False)
    assert r.total_blocks == 8


def test_load_spreads_requests_and_is_freed_when_finished(router):
    for i in range(2):
        router.register_worker(f"w{i}", card())
    first = router.route("llama-8b", hashes=HASHES, request_id="r1")
    second = router.route("llama-8b", hashes=HASHES, request_id="r2")
    assert first.worker.name != second.worker.name  # equal caches: the queue decides
    assert second.ttft.queued_tokens == 0
    router.request_finished("r1")
    router.request_finished("r2")
    router.request_finished("r1")  # unknown now: nothing happens
    assert router.stats().active_requests == 0
    third = router.route("llama-8b", hashes=HASHES, track=False)
    assert (third.ttft.queued_tokens, third.ttft.running_requests) == (0, 0)


def test_untracked_requests_expire_after_the_timeout():
    clock = Clock()
    router = Router(RouterConfig(scoring=ScoringConfig(request_timeout_s=60)), clock=clock)
    router.register_worker("w", card())
    router.route("llama-8b", hashes=HASHES, request_id="lost")
    clock.now += 59
    assert router.route("llama-8b", hashes=[], track=False).ttft.queued_tokens == 128
    clock.now += 2
    assert router.route("llama-8b", hashes=[], track=False).ttft.queued_tokens == 0
    assert router.stats().active_requests == 0


def test_tier_weights_rank_gpu_over_offloaded(router):
    g = router.register_worker("g", card())
    s = router.register_worker("s", card())
    router.apply_worker_events(g.ref, stored(HASHES[:4]))
    router.apply_worker_events(s.ref, [BlockEvent("stored", HASHES, tier="store")])
    r = router.route("llama-8b", hashes=[*HASHES[:5], 1], track=False)
    # 4 GPU blocks (64 tokens saved) beat 5 offloaded ones (5 x 0.75 x 16 = 60 saved).
    assert (r.worker.name, r.gpu_blocks, r.ttft.uncached_tokens) == ("g", 4, 96 - 64)
    # Offloaded blocks credited in full: the longer offloaded prefix wins.
    router.config.scoring.store_weight = 1.0
    r = router.route("llama-8b", hashes=HASHES, track=False)
    assert (r.worker.name, r.overlap_blocks, r.store_blocks, r.gpu_blocks) == ("s", 8, 8, 0)
    assert r.ttft.ttft_ms == 0.0  # nothing to prefill, nothing queued


def test_softmax_sampling_is_seeded_and_prefers_cheap_workers():
    def picks(seed):
        router = Router(RouterConfig(scoring=ScoringConfig(temperature=0.5, seed=seed)))
        hot = router.register_worker("hot", card())
        router.register_worker("cold", card())
        router.apply_worker_events(hot.ref, stored(HASHES))
        return [
            router.route("llama-8b", hashes=HASHES, track=False).worker.name for _ in range(200)
        ]

    a = picks(7)
    assert a == picks(7)
    counts = Counter(a)
    assert counts["hot"] > counts["cold"] > 0


def test_rolling_upgrade_draws_worker_sets_by_worker_count():
    router = Router(RouterConfig(scoring=ScoringConfig(seed=3)))
    for i in range(3):
        router.register_worker(f"old{i}", card(namespace="v1"))
    router.register_worker("new0", card(namespace="v2", tokenizer_checksum="tok-2"))
    got = Counter(router.route("llama-8b", track=False).worker_set.namespace for _ in range(400))
    assert set(got) == {"v1", "v2"} and got["v1"] > got["v2"]
    r = router.route("llama-8b", namespace="v2", track=False)
    assert r.worker.name == "new0" and r.worker_sets == 1
    assert "drawn by worker count" in router.route("llama-8b", track=False).reason


def test_workers_in_other_domains_do_not_lend_their_cache(router):
    a = router.register_worker("a", card(display_name="other-model"))
    router.register_worker("b", card())
    router.apply_worker_events(a.ref, stored(HASHES))
    assert router.route("llama-8b", hashes=HASHES, track=False).overlap_blocks == 0


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"token_ids": [1] * 16, "hashes": [1]}, "token_ids and block_hashes"),
        ({"hashes": [-1]}, "block_hashes"),
        ({"hashes": [1 << 64]}, "block_hashes"),
        ({"hashes": [1] * (1 << 16 + 1)}, "block_hashes"),
        ({"request_id": "r" * 300}, "request_id"),
        ({"decode_tokens": -1}, "decode_tokens"),
        # echoed whole in a NOT_FOUND, 20 KB overflowed gRPC's trailer (found by review)
        ({"namespace": "n" * 20000}, "namespace"),
        ({"namespace": "tenant.0123456789abcdef"}, "namespace"),  # a final one
        ({"role": "r" * 20000}, "role"),
        ({"role": "pre fill"}, "role"),
    ],
)
def test_bad_route_input_names_the_field_and_changes_nothing(router, kwargs, field):
    router.register_worker("w", card())
    with pytest.raises(KVError) as err:
        router.route("llama-8b", **kwargs)
    assert err.value.code.name == "INVALID_ARGUMENT" and field in err.value.message
    assert router.stats().active_requests == 0


def test_token_ids_need_the_native_hash_format(router):
    router.register_worker("w", card(hash_format="vllm-sha256"))
    with pytest.raises(KVError) as err:
        router.route("llama-8b", token_ids=PROMPT)
    assert err.value.code.name == "FAILED_PRECONDITION" and "block_hashes" in err.value.message
    assert router.route("llama-8b", hashes=[1, 2], track=False).total_blocks == 2


def test_token_ids_of_more_blocks_than_block_hashes_allows_are_refused(router):
    """2^20 tokens of a 1-token block were a million hashes, seconds of the
    router's loop; token_ids now make at most MAX_BLOCK_HASHES blocks."""
    from kvstore.wire import limits

    router.register_worker("w", card(kv_block_size=1, context_length=1 << 20))
    tokens = [1] * (limits.MAX_BLOCK_HASHES + 1)
    with pytest.raises(KVError) as err:
        router.route("llama-8b", token_ids=tokens)
    assert err.value.code.name == "INVALID_ARGUMENT" and "token_ids" in err.value.message
    assert router.stats().active_requests == 0
    assert (
        router.route("llama-8b", token_ids=tokens[:-1], track=False).total_blocks == len(tokens) - 1
    )


def test_a_prompt_past_the_cards_context_length_is_refused_before_the_draw(router):
    """Before: routed, and the chosen worker's engine refused it (a prompt longer
    than its max_model_len). A set that can take it is still drawn."""
    router.register_worker("short", card(context_length=64))
    with pytest.raises(KVError) as err:
        router.route("llama-8b", token_ids=list(range(60)), decode_tokens=8)
    assert err.value.code.name == "INVALID_ARGUMENT", err.value
    for words in ("token_ids", "60 prompt tokens", "decode_tokens 8", "context_length 64"):
        assert words in err.value.message, err.value.message
    assert router.stats().active_requests == 0
    assert router.route("llama-8b", token_ids=list(range(60)), decode_tokens=4).total_blocks
    router.register_worker("long", card(context_length=4096, namespace="b"))
    routed = router.route("llama-8b", token_ids=list(range(100)), track=False)
    assert routed.worker.ref.name == "long"  # the short set cannot take it


def test_a_generated_request_id_never_takes_a_tracked_one(router):
    """Tenant A tracks its request "r2"; tenant B routes twice without an id.
    Before, B's second request was numbered "r2" and silently finished A's:
    A's queued load vanished and A's RequestStarted/Finished did nothing."""
    from kvstore.wire.principal import Principal

    a, b = Principal("tenant-a"), Principal("tenant-b")
    router.register_worker("w", card(), caller=a)
    router.register_worker("wb", card(namespace="b-ns"), caller=b)
    router.route("llama-8b", hashes=HASHES, request_id="r2", caller=a)
    ids = [router.route("llama-8b", hashes=HASHES, caller=b).request_id for _ in range(2)]
    assert "r2" not in ids and len(set(ids)) == 2
    assert router.stats().active_requests == 3
    queued = router.route("llama-8b", hashes=[], track=False, caller=a).ttft.queued_tokens
    router.request_finished("r2", caller=a)  # still A's: its load leaves the queue
    assert router.route("llama-8b", hashes=[], track=False, caller=a).ttft.queued_tokens < queued


# -- a refused Route draws nothing --


def seeded_router() -> Router:
    return Router(RouterConfig(scoring=ScoringConfig(seed=11)))


@pytest.mark.parametrize(
    "cards, tokens, code",
    [
        # two sets that cannot hash token ids at all
        (
            [
                card(hash_format="vllm-sha256"),
                card(hash_format="vllm-sha256", worker_type="prefill"),
            ],
            PROMPT,
            "FAILED_PRECONDITION",
        ),
        # two sets of 1-token blocks: more blocks than a route may carry
        (
            [card(kv_block_size=1), card(kv_block_size=1, worker_type="prefill")],
            [1] * (limits.MAX_BLOCK_HASHES + 1),
            "INVALID_ARGUMENT",
        ),
    ],
)
def test_a_refused_route_draws_no_worker_set(cards, tokens, code):
    """Before, Route drew one of a model's WorkerSets (a step of the router's
    seeded random stream) and only then found that it could not take the token
    ids: the refused request had moved every later draw. Now the sets are judged
    first, and a refusal changes nothing, the random stream included."""
    router, twin = seeded_router(), seeded_router()
    for r in (router, twin):
        for i, c in enumerate(cards):
            r.register_worker(f"w{i}", c)
    state = router.rng.getstate()
    with pytest.raises(KVError) as err:
        router.route("llama-8b", token_ids=tokens)
    assert err.value.code.name == code and "token_ids" in err.value.message
    assert router.rng.getstate() == state and router.stats().active_requests == 0

    def picks(r: Router) -> list[str]:
        return [r.route("llama-8b", hashes=HASHES, track=False).worker.name for _ in range(50)]

    assert picks(router) == picks(twin)


def test_refusals_before_the_draw_leave_the_random_stream_alone():
    router = seeded_router()
    router.register_worker("w0", card())
    router.register_worker("w1", card(worker_type="prefill"))
    state = router.rng.getstate()
    for kwargs in (
        {"model": "nobody"},
        {"model": "llama-8b", "hashes": [1 << 64]},
        {"model": "llama-8b", "token_ids": [1] * 16, "hashes": [1]},
    ):
        with pytest.raises(KVError):
            router.route(**kwargs)
    assert router.rng.getstate() == state


def test_token_ids_go_to_a_set_that_can_hash_them_whatever_the_draw():
    """Before, token ids for a model whose sets differ in hash format were
    refused whenever the draw (by member count) picked a set of another format,
    so one request was refused or answered by chance. Now the draw is among the
    sets that can take them."""
    router = seeded_router()
    router.register_worker("native", card())
    for i in range(3):
        router.register_worker(
            f"foreign{i}", card(hash_format="vllm-sha256", worker_type="prefill")
        )
    results = [router.route("llama-8b", token_ids=PROMPT, track=False) for _ in range(40)]
    assert {r.worker.name for r in results} == {"native"}
    assert {r.worker_sets for r in results} == {1}
    # block_hashes mean one format: the role names which (see the test below)
    got = Counter(
        router.route("llama-8b", role="prefill", hashes=HASHES, track=False).worker.name
        for _ in range(20)
    )
    assert set(got) == {"foreign0", "foreign1", "foreign2"}


@pytest.mark.parametrize(
    "other", [card(kv_block_size=32, namespace="b"), card(hash_format="vllm-sha256", namespace="b")]
)
def test_block_hashes_for_sets_that_hash_differently_are_refused_before_the_draw(other):
    """Found by review: a model served by a set of 16-token blocks (holding the
    whole prefix) and one of 32-token blocks (or another hash format). Before,
    block_hashes of 16-token blocks were drawn to either set by member count:
    in the other they matched nothing and stood for a prompt of another length
    (12 of 20 routes went there, 0/16 cached, 512 uncached tokens, instead of
    16/16 on the worker that held it). Which set hashes were made for is
    unknown: FAILED_PRECONDITION naming both, nothing drawn; a namespace picks."""
    router = seeded_router()
    w = router.register_worker("b16", card(namespace="a"))
    router.register_worker("other", other)
    hashes = block_hashes(list(range(256)), 16)
    router.apply_worker_events(w.ref, stored(hashes))
    state = router.rng.getstate()
    with pytest.raises(KVError) as err:
        router.route("llama-8b", hashes=hashes)
    assert err.value.code.name == "FAILED_PRECONDITION", err.value
    for words in ("block_hashes", "llama-8b/a/decode", "llama-8b/b/decode", "namespace"):
        assert words in err.value.message, err.value.message
    assert router.rng.getstate() == state and router.stats().active_requests == 0
    routed = router.route("llama-8b", namespace="a", hashes=hashes, track=False)
    assert (routed.worker.name, routed.overlap_blocks) == ("b16", 16)
    # token ids are hashed for each set: no ambiguity
    assert router.route("llama-8b", token_ids=list(range(256)), track=False).total_blocks


def test_block_hashes_past_the_cards_context_length_are_refused_before_the_draw(router):
    """Found by review: the context check held for token ids only, so 99 block
    hashes of 16 tokens (1,584 prompt tokens at least) were routed to a worker
    whose card says 64, which its engine refuses. Now INVALID_ARGUMENT, as for
    token ids, and a set that can take them is still drawn."""
    router.register_worker("short", card(context_length=64))
    with pytest.raises(KVError) as err:
        router.route("llama-8b", hashes=HASHES[:3], decode_tokens=32)
    assert err.value.code.name == "INVALID_ARGUMENT", err.value
    for words in ("block_hashes", "48 prompt tokens", "decode_tokens 32", "context_length 64"):
        assert words in err.value.message, err.value.message
    assert router.stats().active_requests == 0
    assert router.route("llama-8b", hashes=HASHES[:4], track=False).total_blocks == 4
    router.register_worker("long", card(context_length=4096, namespace="b"))
    routed = router.route("llama-8b", hashes=HASHES, decode_tokens=100, track=False)
    assert routed.worker.name == "long"  # the short set cannot take it
