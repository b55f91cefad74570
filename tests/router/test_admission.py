"""Admission: first-wins per WorkerSet, refusals that disturb nothing, order
independence under concurrency, generations, and name resolution."""

from __future__ import annotations

import itertools
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.router.admission import WorkerRef, WorkerSetKey
from kvstore.router.core import Router
from kvstore.router.vllm_events import BlockEvent
from kvstore.wire import limits
from kvstore.wire.card import card_checksum
from kvstore.wire.errors import KVError
from kvstore.wire.events import STORE_TIER
from kvstore.wire.principal import Principal
from tests.router.conftest import card

HASHES = [11, 22, 33, 44]


def snapshot(router: Router):
    """Everything a refusal must leave alone."""
    return (
        {k: (s.checksum, sorted(s.members)) for k, s in router.admission.sets.items()},
        {n: w.ref for n, w in router.admission.workers.items()},
        {d: dict(i.masks) for d, i in router.domains.indexes.items()},
        {r: dict(vars(v)) for r, v in router.loads.workers.items()},
    )


def test_path_only_difference_joins(router):
    a = router.register_worker("a", card(source_path="/models/llama"))
    b = router.register_worker(
        "b",
        card(
            source_path="/mnt/other/llama",
            extra_files={"/mnt/other/llama/preprocessor_config.json": "pp-1"},
        ),
    )
    assert a.key == b.key and a.domain == b.domain
    assert sorted(router.admission.sets[a.key].members) == ["a", "b"]


@pytest.mark.parametrize(
    "change, field",
    [
        ({"model_config_checksum": "cfg-2"}, "model_config_checksum"),
        ({"tokenizer_checksum": "tok-2"}, "tokenizer_checksum"),
        ({"extra_files": {"/m/preprocessor_config.json": "pp-2"}}, "extra_files"),
        ({"extra_files": {}}, "extra_files"),
        ({"context_length": 8192}, "context_length"),
        ({"kv_block_size": 32}, "kv_block_size"),
        ({"chat_template_checksum": "tpl-2"}, "chat_template_checksum"),
        ({"generation_config_checksum": "gen-2"}, "generation_config_checksum"),
        ({"aliases": ["llama"]}, "aliases"),
        ({"hash_format": "vllm-sha256"}, "hash_format"),
    ],
)
def test_mismatch_is_refused_naming_the_field_and_disturbs_nothing(router, change, field):
    healthy = router.register_worker("healthy", card())
    router.apply_worker_events(healthy.ref, [BlockEvent("stored", HASHES)])
    routed = router.route("llama-8b", hashes=HASHES)
    before = snapshot(router)
    with pytest.raises(KVError) as err:
        router.register_worker("misfit", card(**change))
    assert err.value.code.name == "FAILED_PRECONDITION"
    assert field in err.value.message and "misfit" in err.value.message
    assert "unaffected" in err.value.message
    assert snapshot(router) == before
    assert router.stats().rejected_registrations == 1
    # The healthy member keeps serving and keeps its blocks.
    again = router.route("llama-8b", hashes=HASHES)
    assert again.worker.name == "healthy" and again.overlap_blocks == len(HASHES)
    assert routed.worker.name == "healthy"


def test_rejected_worker_never_reaches_the_index(router):
    router.register_worker("healthy", card())
    with pytest.raises(KVError):
        router.register_worker("misfit", card(tokenizer_checksum="tok-2"))
    # Neither its own (never issued) generation nor any guess is accepted.
    for gen in range(0, 5):
        assert (
            router.apply_worker_events(WorkerRef("misfit", gen), [BlockEvent("stored", HASHES)])
            == 0
        )
    assert all(
        ("misfit" not in {h[0].name for h in i.holders()}) for i in router.domains.indexes.values()
    )
    assert router.stats().indexed_blocks == 0
    assert router.route("llama-8b", hashes=HASHES).worker.name == "healthy"


def test_empty_set_forgets_its_checksum(router):
    router.register_worker("a", card())
    router.remove_worker("a")
    b = router.register_worker("b", card(tokenizer_checksum="tok-2"))  # a new first card
    assert router.admission.sets[b.key].checksum == card_checksum(card(tokenizer_checksum="tok-2"))


def test_other_keys_never_constrain_each_other(router):
    router.register_worker("d", card())
    router.register_worker("p", card(worker_type="prefill", tokenizer_checksum="tok-2"))
    router.register_worker("n", card(namespace="ns2", context_length=1))
    assert len(router.admission.sets) == 3


def test_replacement_gets_new_generation_and_old_events_are_dropped(router):
    old = router.register_worker("w", card())
    router.apply_worker_events(old.ref, [BlockEvent("stored", HASHES)])
    new = router.register_worker("w", card(source_path="/elsewhere"))
    assert new.ref.generation > old.ref.generation
    # The old generation's blocks are gone and its late events are dropped.
    assert router.stats().indexed_blocks == 0
    assert router.apply_worker_events(old.ref, [BlockEvent("stored", HASHES)]) == 0
    assert router.stats().indexed_blocks == 0
    assert router.route("llama-8b", hashes=HASHES).overlap_blocks == 0
    assert router.apply_worker_events(new.ref, [BlockEvent("stored", HASHES[:2])]) == 1
    assert router.route("llama-8b", hashes=HASHES).overlap_blocks == 2


def test_refused_replacement_leaves_the_old_generation_serving(router):
    router.register_worker("peer", card())
    old = router.register_worker("w", card())
    router.apply_worker_events(old.ref, [BlockEvent("stored", HASHES)])
    with pytest.raises(KVError):
        router.register_worker("w", card(tokenizer_checksum="tok-2"))
    assert router.worker(old.ref) is not None
    assert router.route("llama-8b", hashes=HASHES).worker.name == "w"


def test_sole_member_may_replace_itself_with_a_new_card(router):
    old = router.register_worker("w", card())
    new = router.register_worker("w", card(tokenizer_checksum="tok-2"))
    assert router.worker(old.ref) is None and router.worker(new.ref) is not None


def test_removal_clears_index_and_load(router):
    w = router.register_worker("w", card())
    router.apply_worker_events(w.ref, [BlockEvent("stored", HASHES)])
    router.route("llama-8b", hashes=HASHES)
    router.remove_worker("w")
    assert router.stats().indexed_blocks == 0 and not router.loads.workers
    with pytest.raises(KVError) as err:
        router.remove_worker("w")
    assert err.value.code.name == "NOT_FOUND"


# -- aliases and name resolution --

A = dict(display_name="x", source_path="/S")  # base A
L = dict(display_name="x-lora", lora=True, lora_base="x", source_path="/S")  # LoRA on A's source
B = dict(display_name="y", source_path="/S")  # base B, same source


def admitted_view(router: Router):
    return sorted((k.model, tuple(sorted(s.members))) for k, s in router.admission.sets.items())


EXPECTED_ALB = [("x", ("A",)), ("x-lora", ("L",)), ("y", ("B",))]


@pytest.mark.parametrize("order", list(itertools.permutations("ALB")))
def test_base_lora_base_in_every_order(order):
    router = Router()
    specs = {"A": A, "L": L, "B": B}
    for name in order:
        router.register_worker(name, card(**specs[name]))
    assert admitted_view(router) == EXPECTED_ALB
    assert router.route("x").worker.name == "A"
    assert router.route("x-lora").worker.name == "L"
    assert router.route("y").worker.name == "B"


def run_concurrently(router: Router, arrivals: list[tuple[str, dict]]) -> dict[str, str]:
    """Register all arrivals from separate threads released at once."""
    barrier = threading.Barrier(len(arrivals))
    outcome: dict[str, str] = {}

    def go(name: str, spec: dict) -> None:
        barrier.wait()
        try:
            router.register_worker(name, card(**spec))
            outcome[name] = "admitted"
        except KVError as exc:
            outcome[name] = exc.code.name

    threads = [threading.Thread(target=go, args=a) for a in arrivals]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcome


@pytest.mark.parametrize("round_", range(20))
def test_base_lora_base_concurrently(round_):
    router = Router()
    arrivals = [("A", A), ("L", L), ("B", B)]
    # Replicas of each, from other directories: all compatible with their own kind.
    arrivals += [(f"A{i}", {**A, "source_path": f"/pool{i}/x"}) for i in range(4)]
    arrivals += [(f"B{i}", {**B, "source_path": f"/pool{i}/y"}) for i in range(4)]
    arrivals += [(f"L{i}", L) for i in range(4)]
    arrivals = arrivals[round_ % len(arrivals) :] + arrivals[: round_ % len(arrivals)]
    outcome = run_concurrently(router, arrivals)
    assert set(outcome.values()) == {"admitted"}
    assert admitted_view(router) == [
        ("x", tuple(sorted(["A", *[f"A{i}" for i in range(4)]]))),
        ("x-lora", tuple(sorted(["L", *[f"L{i}" for i in range(4)]]))),
        ("y", tuple(sorted(["B", *[f"B{i}" for i in range(4)]]))),
    ]


@pytest.mark.parametrize("round_", range(10))
def test_concurrent_conflicts_keep_exactly_one_class_per_key(round_):
    """Compatible and incompatible cards racing for the same keys: per key,
    exactly the arrivals of one checksum class are admitted; no newcomer is
    rolled back and no key ends up empty."""
    router = Router()
    arrivals = []
    for i in range(6):
        arrivals.append((f"x-tok1-{i}", {**A, "tokenizer_checksum": "t1", "source_path": f"/p{i}"}))
        arrivals.append((f"x-tok2-{i}", {**A, "tokenizer_checksum": "t2"}))
        arrivals.append((f"y-{i}", B))
    outcome = run_concurrently(router, arrivals)
    x_members = sorted(router.admission.sets[WorkerSetKey("x", "default", "decode")].members)
    winners = {n.rsplit("-", 1)[0] for n in x_members}
    assert len(winners) == 1
    winner = winners.pop()
    assert x_members == sorted(n for n, _ in arrivals if n.startswith(winner + "-"))
    assert all(
        outcome[n] == "FAILED_PRECONDITION"
        for n, _ in arrivals
        if n.startswith("x-") and not n.startswith(winner + "-")
    )
    assert len(router.admission.sets[WorkerSetKey("y", "default", "decode")].members) == 6


CLASSES = [
    {"display_name": "x"},
    {"display_name": "x", "source_path": "/other"},  # same class
    {"display_name": "y"},
    {"display_name": "x", "aliases": ["xx"]},
    {"display_name": "x", "worker_type": "prefill"},
    {"display_name": "x-lora", "lora": True, "lora_base": "x"},
]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(range(len(CLASSES))), min_size=1, max_size=8), st.randoms())
def test_admitted_set_is_a_function_of_first_arrivals(kinds, rnd):
    """For any arrival sequence: the admitted set equals 'per key, every
    arrival whose checksum equals the key's first arrival's'. Compatible
    arrivals are therefore never affected by order."""
    arrivals = [(f"w{i}", CLASSES[k]) for i, k in enumerate(kinds)]
    rnd.shuffle(arrivals)
    router = Router()
    for name, spec in arrivals:
        try:
            router.register_worker(name, card(**spec))
        except KVError:
            pass
    first: dict[tuple, str] = {}
    expected: set[str] = set()
    for name, spec in arrivals:
        c = card(**spec)
        key = (c.display_name, c.namespace, c.worker_type)
        first.setdefault(key, card_checksum(c))
        if first[key] == card_checksum(c):
            expected.add(name)
    assert set(router.admission.workers) == expected


def test_shared_alias_is_ambiguous_but_blocks_nobody(router):
    router.register_worker("a", card(display_name="x", aliases=["shared"]))
    router.register_worker("b", card(display_name="y", aliases=["shared"]))
    assert router.route("x").worker.name == "a"
    assert router.route("y").worker.name == "b"
    with pytest.raises(KVError) as err:
        router.route("shared")
    assert err.value.code.name == "FAILED_PRECONDITION" and "several models" in err.value.message


def test_alias_resolves_and_primary_name_wins(router):
    router.register_worker("a", card(display_name="x", aliases=["chat"]))
    assert router.route("chat").worker.name == "a"
    router.register_worker("c", card(display_name="chat"))
    assert router.route("chat").worker.name == "c"  # a display name beats an alias
    with pytest.raises(KVError) as err:
        router.route("nobody")
    assert err.value.code.name == "NOT_FOUND"


# -- one tenant's share of a domain's holder slots --

TENANT_A = Principal("tenant-a")
TENANT_B = Principal("tenant-b")


ADMIN = Principal("ops", admin=True)


def test_a_worker_set_with_members_is_its_owners(router):
    """Before: under mutual TLS tenant-b registered a copy of tenant-a's card
    under a name of its own, joined tenant-a's WorkerSet and took a share of
    the Routes meant for tenant-a (with their prompts). Now a set with members
    belongs to the principal that admitted its first member: another non-admin
    is PERMISSION_DENIED, judged before the checksum (a differing card learns
    nothing of the set's card), and nothing changes. An admin may join; an
    emptied set is anyone's."""
    a0 = router.register_worker("a0", card(), caller=TENANT_A)
    before = snapshot(router)
    for copied in (card(), card(kv_block_size=32)):
        with pytest.raises(KVError) as info:
            router.register_worker("b0", copied, caller=TENANT_B)
        err = info.value
        assert err.code.name == "PERMISSION_DENIED", err
        assert "WorkerSet llama-8b/default/decode has members another" in err.message
        assert "tenant-a" not in err.message  # a stranger learns nothing of the owner
        assert "kv_block_size" not in err.message
        assert snapshot(router) == before
    router.register_worker("ops0", card(), caller=ADMIN)
    assert sorted(router.admission.sets[a0.key].members) == ["a0", "ops0"]
    assert router.admission.sets[a0.key].owner == "tenant-a"
    router.remove_worker("a0", caller=TENANT_A)
    router.remove_worker("ops0", caller=ADMIN)
    b0 = router.register_worker("b0", card(kv_block_size=32), caller=TENANT_B)
    assert b0.key == a0.key and router.admission.sets[b0.key].owner == "tenant-b"


def test_a_route_resolves_only_the_callers_worker_sets(router):
    """Before: every certificate's Route resolved every tenant's WorkerSets:
    tenant-b learnt from overlap_blocks which prefixes tenant-a's workers hold,
    and an alias tenant-b declared could capture (or make ambiguous) the name
    tenant-a's clients route by. Now a non-admin caller resolves its own sets
    only, and an admin every set."""
    a0 = router.register_worker("a0", card(aliases=["chat"]), caller=TENANT_A)
    router.apply_worker_events(a0.ref, [BlockEvent("stored", HASHES)])
    with pytest.raises(KVError) as info:
        router.route("llama-8b", hashes=HASHES, caller=TENANT_B)
    unknown = "no admitted worker serves model 'llama-8b'"
    assert info.value.code.name == "NOT_FOUND" and info.value.message == unknown
    # tenant-b's set of the same model in its own namespace takes tenant-b's routes only
    router.register_worker("b0", card(namespace="b-ns"), caller=TENANT_B)
    router.register_worker("b1", card(display_name="other", aliases=["chat"]), caller=TENANT_B)
    for _ in range(8):  # two sets of llama-8b: each tenant draws its own only
        mine = router.route("llama-8b", hashes=HASHES, track=False, caller=TENANT_B)
        assert (mine.worker.name, mine.overlap_blocks) == ("b0", 0)
        theirs = router.route("llama-8b", hashes=HASHES, track=False, caller=TENANT_A)
        assert (theirs.worker.name, theirs.overlap_blocks) == ("a0", len(HASHES))
    assert router.route("chat", track=False, caller=TENANT_A).worker.name == "a0"
    assert router.route("chat", track=False, caller=TENANT_B).worker.name == "b1"
    with pytest.raises(KVError) as info:  # an admin sees both models' alias
        router.route("chat", track=False, caller=ADMIN)
    assert info.value.code.name == "FAILED_PRECONDITION"


def test_one_tenant_cannot_fill_the_holder_slots_of_a_domain_others_share(router):
    """A domain is not per tenant: every card of one model and routing scope
    joins it, whoever admits it (here tenant-b's prefill workers join tenant-a's
    decode worker), and each worker may take two of its MAX_WORKERS_PER_DOMAIN
    holder bits. Before, tenant-b could admit MAX_WORKERS_PER_DOMAIN / 2 workers
    there, fill every bit, and tenant-a's worker's batches were refused (no_room).
    Now a non-admin certificate has MAX_WORKERS_PER_DOMAIN_PER_PRINCIPAL workers
    in one domain: past it RESOURCE_EXHAUSTED naming the limit, nothing changed."""
    a0 = router.register_worker("a0", card(), caller=TENANT_A)
    greedy, refusals = [], []
    for i in range(limits.MAX_WORKERS_PER_DOMAIN // 2):  # enough to take every bit
        before = snapshot(router)
        try:
            greedy.append(
                router.register_worker(f"b{i}", card(worker_type="prefill"), caller=TENANT_B)
            )
        except KVError as exc:
            refusals.append(exc)
            assert snapshot(router) == before
    assert {w.domain for w in greedy} == {a0.domain} and greedy[0].key != a0.key
    for w in greedy:  # every one of them takes both of its bits
        router.apply_worker_events(w.ref, [BlockEvent("stored", [1]), stored_offloaded([2])])
    assert router.apply_worker_events(a0.ref, [BlockEvent("stored", HASHES)]) == 1
    assert router.route("llama-8b", role="decode", hashes=HASHES).overlap_blocks == 4
    assert router.stats().dropped_by.no_room == 0
    share = len(greedy)
    assert refusals and 0 < 2 * share < limits.MAX_WORKERS_PER_DOMAIN
    message = refusals[0].message
    assert {e.code.name for e in refusals} == {"RESOURCE_EXHAUSTED"}
    assert f"'tenant-b' already holds {share} workers in indexer domain {a0.domain}" in message
    assert f"at most {share}" in message


def test_the_domain_share_counts_one_tenants_workers_in_that_domain_only(router, monkeypatch):
    monkeypatch.setattr(limits, "MAX_WORKERS_PER_DOMAIN_PER_PRINCIPAL", 2)
    router.register_worker("a0", card(), caller=TENANT_A)
    router.register_worker("a1", card(), caller=TENANT_A)
    with pytest.raises(KVError) as err:
        router.register_worker("a2", card(), caller=TENANT_A)
    assert err.value.code.name == "RESOURCE_EXHAUSTED"
    router.register_worker("a1", card(address="10.0.0.9:8000"), caller=TENANT_A)  # a restart
    router.register_worker("a2", card(display_name="other"), caller=TENANT_A)  # another domain
    with pytest.raises(KVError):  # nor may a name move into the full domain
        router.register_worker("a2", card(), caller=TENANT_A)
    assert router.admission.workers["a2"].card.display_name == "other"
    router.register_worker("b0", card(worker_type="prefill"), caller=TENANT_B)  # b's own share
    for i in range(3):  # an admin's are not counted
        router.register_worker(f"admin{i}", card())
    router.remove_worker("a0", caller=TENANT_A)
    router.register_worker("a3", card(), caller=TENANT_A)


def test_a_replica_asks_for_the_domain_share_before_etcd_admits(router, monkeypatch):
    """On etcd a replica judges a card before etcd takes it (the admission
    applied from etcd comes as an admin's): check_worker_quota with the card."""
    monkeypatch.setattr(limits, "MAX_WORKERS_PER_DOMAIN_PER_PRINCIPAL", 1)
    router.register_worker("a0", card(), caller=TENANT_A)
    router.check_worker_quota("a0", TENANT_A, card())  # its own again
    router.check_worker_quota("a1", TENANT_A, card(display_name="other"))
    with pytest.raises(KVError) as err:
        router.check_worker_quota("a1", TENANT_A, card())
    assert err.value.code.name == "RESOURCE_EXHAUSTED" and "indexer domain" in err.value.message


def stored_offloaded(hashes):
    return BlockEvent("stored", list(hashes), tier=STORE_TIER)
