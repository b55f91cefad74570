"""The holder index under churn: always the answers of a naive reference.

The reference keeps, per holder, a plain set of the hashes it holds and
walks prefixes one block at a time; the index must agree after any sequence of
stores, removals, ordered updates, clears and releases, and its bookkeeping
must never lose or duplicate a holder's block. vLLM batches decoded on the
fast path must leave the same index as their events applied one by one.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.router.core import Router
from kvstore.router.holders import HolderIndex
from kvstore.router.vllm_events import decode_batch, decode_events
from kvstore.testing.vllm_events import churn_batches, encode_batch, removed_event, stored_event
from tests.router.conftest import card

HASHES = list(range(100, 112))  # few distinct hashes, so holders overlap and re-store often


def reference_depth(held: set[int], hashes: list[int]) -> int:
    for i, h in enumerate(hashes):
        if h not in held:
            return i
    return len(hashes)


def check_against(index: HolderIndex, ref: dict[str, set[int]]) -> None:
    """Masks, per-holder counts and prefix depths all match the reference sets."""
    expected_masks: dict[int, int] = {}
    for holder, held in ref.items():
        bit = index.bit_of(holder)
        assert index.held(bit) == len(held)
        for h in held:
            expected_masks[h] = expected_masks.get(h, 0) | 1 << bit
    assert index.masks == expected_masks
    for start in range(0, len(HASHES), 3):
        request = HASHES[start:] + HASHES[:start]
        expected = {holder: reference_depth(held, request) for holder, held in ref.items()}
        expected = {holder: d for holder, d in expected.items() if d}  # a miss has no entry
        assert index.holder_depths(request, list(ref)) == expected


OPS = st.lists(
    st.tuples(
        st.sampled_from(["store", "remove", "update", "clear", "release"]),
        st.sampled_from(["a", "b", "c"]),
        st.lists(st.sampled_from(HASHES), max_size=6),
        st.lists(st.booleans(), min_size=6, max_size=6),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_index_under_random_churn_answers_like_the_reference(ops):
    index = HolderIndex()
    ref: dict[str, set[int]] = {}
    for op, holder, hashes, keeps in ops:
        if op == "release":
            assert index.release(holder) == len(ref.pop(holder, set()))
            continue
        bit = index.assign(holder)
        held = ref.setdefault(holder, set())
        if op == "store":
            index.store(bit, hashes)
            held.update(hashes)
        elif op == "remove":
            assert index.remove(bit, hashes) == len(held & set(hashes))
            held.difference_update(hashes)
        elif op == "update":
            keeps = keeps[: len(hashes)]
            index.update(bit, hashes, keeps)
            for h, keep in zip(hashes, keeps, strict=True):  # in order: a hash may repeat
                if keep:
                    held.add(h)
                else:
                    held.discard(h)
        else:
            assert index.clear(bit) == len(held)
            held.clear()
        check_against(index, ref)


def test_a_long_churn_keeps_every_holder_exact():
    """Far more stores and removals than a holder ever holds: nothing lost or doubled."""
    rng = random.Random(7)
    index = HolderIndex()
    ref = {holder: set() for holder in "abcd"}
    pool = list(range(5000))
    for _ in range(20_000):
        holder = rng.choice("abcd")
        bit = index.assign(holder)
        h = rng.choice(pool)
        if rng.random() < 0.5:
            index.update(bit, [h], [True])
            ref[holder].add(h)
        else:
            index.update(bit, [h], [False])
            ref[holder].discard(h)
    for holder, held in ref.items():
        assert index.held(index.bit_of(holder)) == len(held)
        assert index.release(holder) == len(held)
    assert index.masks == {}


# -- decoded vLLM batches: the fast path leaves what one-by-one events leave --


def odd_event(rng: random.Random, hashes: list[int]) -> list:
    """Shapes the fast path hands to the full decoder."""
    kind = rng.randrange(5)
    if kind == 0:
        return ["BlockStored", hashes, None, [], 16, None]  # no medium
    if kind == 1:
        return ["BlockStored", hashes, None, [], 16, None, "CPU"]  # offloaded tier
    if kind == 2:
        return ["BlockRemoved", hashes]
    if kind == 3:
        return ["BlockStored", [h - (1 << 63) for h in hashes], -5, [], 16, None, "GPU"]
    return ["AllBlocksCleared"]


def random_batch(rng: random.Random) -> list[list]:
    events = []
    for _ in range(rng.randrange(1, 40)):
        hashes = rng.sample(HASHES, rng.choice([1, 1, 1, 2, 4]))
        roll = rng.random()
        if roll < 0.45:
            events.append(stored_event(hashes, rng.choice([None, 3])))
        elif roll < 0.9:
            events.append(removed_event(hashes))
        else:
            events.append(odd_event(rng, hashes))
    return events


def holdings(router: Router) -> dict:
    """Holder -> the hashes it holds (bit numbers may differ between equal indexes)."""
    out = {}
    for index in router.domains.indexes.values():
        for holder in index.holders():
            bit = index.bit_of(holder)
            held = {h for h, m in index.masks.items() if m >> bit & 1}
            assert index.held(bit) == len(held)
            if held:
                out[holder] = held
    return out


def replay_one_by_one(router: Router, ref, events: list[list]) -> None:
    for event in decode_events(encode_batch(events)):
        router.apply_worker_events(ref, [event])


@pytest.mark.parametrize("seed", range(30))
def test_fast_decoded_batches_index_like_events_one_by_one(seed):
    rng = random.Random(seed)
    fast, slow = Router(), Router()
    fast_ref = fast.register_worker("w", card()).ref
    slow_ref = slow.register_worker("w", card()).ref
    for _ in range(20):
        events = random_batch(rng)
        batch = decode_batch(encode_batch(events))
        assert fast.apply_vllm_batch(fast_ref, batch) == len(events)
        replay_one_by_one(slow, slow_ref, events)
        assert holdings(fast) == holdings(slow)
    assert fast.stats().blocks_ingested == slow.stats().blocks_ingested


@pytest.mark.parametrize(
    "event, message",
    [
        (["BlockStored", [1.5], None, [], 16, None, "GPU"], "hash of type float"),
        (["BlockStored", [1], "x", [], 16, None, "GPU"], "hash of type str"),
        (["BlockRemoved", [True], "GPU"], "hash of type bool"),
        (["BlockRemoved", 7, "GPU"], "must be an array"),
    ],
)
def test_fast_path_shapes_with_bad_fields_are_refused(event, message):
    with pytest.raises(ValueError, match=message):
        decode_batch(encode_batch([stored_event([1]), event]))


@pytest.mark.parametrize("per_event", [1, 4])
def test_steady_state_churn_keeps_exactly_the_newest_blocks(per_event):
    router = Router()
    ref = router.register_worker("w", card()).ref
    held = list(range(1, 33))
    router.apply_vllm_batch(ref, decode_batch(encode_batch([stored_event(held)])))
    for turn in range(3):  # more than the whole cache turns over
        fresh = list(range(1000 * (turn + 1), 1000 * (turn + 1) + 40))
        for payload in churn_batches(held, fresh, per_event, 8):
            router.apply_vllm_batch(ref, decode_batch(payload))
        assert holdings(router) == {(ref, "gpu"): set(held)} and len(held) == 32
