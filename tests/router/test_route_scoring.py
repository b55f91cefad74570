"""Array scoring against the per-candidate reference it replaced, on random states.

A route scores every member of a WorkerSet with array operations
(``scoring.Candidates``, ``score_all``) and measures prefixes with one walk per
index that costs nothing per member that misses (``routing.candidates``). The
reference below is the per-member code that came before, kept here verbatim
in spirit: every prefix by a direct walk of the masks, one ``Candidate`` and
one ``TtftEstimate`` per member, ``min`` over rank tuples. On random routers
(several domains, namespaces and nodes, holes in prefixes, reported, stale
and routed loads, ties, softmax) both must answer the same worker, tiers,
estimate and reason, and leave the seeded random stream in the same state.
"""

from __future__ import annotations

import math
import random

import pytest

from kvstore.router.core import Router, RouterConfig
from kvstore.router.load import LoadReport, WorkerLoad
from kvstore.router.scoring import Candidate, ScoringConfig, TtftEstimate
from kvstore.router.vllm_events import BlockEvent
from kvstore.wire.events import GPU_TIER, STORE_TIER, StoreEvent
from tests.router.conftest import Clock, card

NAMESPACES = ("", "tenant.0123456789abcdef", "tenant.fedcba9876543210")
NODES = ("", "n0", "n1", "n2")

# -- the reference: one Python step per member -----------------------------------


def walked(index, holder, hashes) -> int:
    """Leading ``hashes`` whose mask carries ``holder``'s bit, by a direct walk."""
    bit = index.bit_of(holder) if index is not None else None
    if bit is None:
        return 0
    masks, depth = index.masks, 0
    for h in hashes:
        if not masks.get(h, 0) >> bit & 1:
            break
        depth += 1
    return depth


def reference_candidates(router: Router, wset, hashes) -> list[Candidate]:
    cands = []
    for w in wset.members.values():
        index = router.domains.indexes.get(w.domain)
        c = Candidate(w.ref, walked(index, (w.ref, GPU_TIER), hashes), 0, 0)
        c.store = walked(index, (w.ref, STORE_TIER), hashes)
        ns = w.card.final_namespace
        if ns:
            peers = router.peers.indexes.get(ns)
            stores = [h for h in (peers.holders() if peers else []) if h[1] == STORE_TIER]
            depth = {h: walked(peers, h, hashes) for h in stores}
            mine = (w.card.node_id, STORE_TIER)
            c.store = max(c.store, depth.get(mine, 0))
            c.remote = max((d for h, d in depth.items() if h != mine), default=0)
        cands.append(c)
    return cands


def reference_cached(c: Candidate, block_size: int, cfg: ScoringConfig) -> int:
    local = max(c.gpu, c.store)
    blocks = (
        cfg.gpu_weight * c.gpu
        + cfg.store_weight * max(0, c.store - c.gpu)
        + cfg.remote_weight * max(0, c.remote - local)
    )
    return round(blocks * block_size)


def reference_estimate(prompt_tokens, cached, load: WorkerLoad, cfg) -> TtftEstimate:
    uncached = max(0, prompt_tokens - cached)
    ttft = (load.queued_tokens + uncached) * cfg.prefill_ms_per_token
    ttft += load.running_requests * cfg.decode_interference_ms
    recompute = cfg.recompute_weight * uncached * cfg.prefill_ms_per_token
    return TtftEstimate(
        ttft,
        load.queued_tokens,
        uncached,
        load.running_requests,
        cfg.prefill_ms_per_token,
        cfg.decode_interference_ms,
        load.report_age_s,
        recompute,
    )


def rank(c: Candidate) -> tuple[float, int]:
    return (c.score_ms, c.queued_tokens)


def reference_choose(cands, cfg: ScoringConfig, rng: random.Random) -> Candidate:
    if cfg.temperature > 0 and len(cands) > 1:
        top = max(c.score_ms for c in cands) or 1.0
        lo = min(c.score_ms for c in cands)
        weights = [math.exp(-(c.score_ms - lo) / (cfg.temperature * top)) for c in cands]
        return rng.choices(cands, weights=weights, k=1)[0]
    best = min(rank(c) for c in cands)
    tied = [c for c in cands if rank(c) == best]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def reference_explain(best: Candidate, cands, total: int, cfg: ScoringConfig) -> str:
    est = best.estimate
    source = (
        "own accounting of routed requests"
        if est.report_age_s is None
        else f"load reported {est.report_age_s:.1f} s ago"
    )
    text = (
        f"{best.ref.name}: {est.formula()}; {best.overlap}/{total} blocks cached "
        f"(gpu {best.gpu}, store {best.store}, remote {best.remote}); {source}"
    )
    others = [c for c in cands if c is not best]
    if not others:
        return text
    runner = min(others, key=rank)
    if cfg.temperature > 0:
        how = f"sampled at temperature {cfg.temperature:g}"
    elif rank(runner) == rank(best):
        how = "tied on ttft and queue, drawn at random"
    else:
        how = "lowest score" if cfg.recompute_weight else "lowest ttft"
    runner_up = f"next {runner.ref.name} ttft {runner.ttft_ms:.1f} ms"
    if cfg.recompute_weight:
        runner_up += f" (score {runner.score_ms:.1f} ms)"
    return f"{text}; {how} of {len(cands)} workers, {runner_up}"


def reference_route(router: Router, hashes: list[int], rng: random.Random) -> tuple:
    """What a route of ``hashes`` (block hashes, one WorkerSet) answers: the
    worker, its tiers, its estimate and the reason line."""
    cfg, now = router.config.scoring, router.clock()
    (wset,) = router.admission.resolve("llama-8b", role="decode")
    block_size = wset.reference.kv_block_size
    cands = reference_candidates(router, wset, hashes)
    for c in cands:
        load = router.loads.load(c.ref, now, cfg.load_staleness_s)
        cached = reference_cached(c, block_size, cfg)
        c.estimate = reference_estimate(len(hashes) * block_size, cached, load, cfg)
    best = reference_choose(cands, cfg, rng)
    local = max(best.gpu, best.store)
    tiers = (best.overlap, best.gpu, max(0, best.store - best.gpu), max(0, best.remote - local))
    return best.ref, tiers, best.estimate, reference_explain(best, cands, len(hashes), cfg)


# -- random routers ----------------------------------------------------------------


def random_router(seed: int) -> tuple[Router, list[int], random.Random]:
    """A router of up to 12 decode workers over two domains, three namespaces
    and three nodes (and a prefill worker sharing a domain), their GPU and
    offload blocks and their nodes' stores being random prefixes of one
    chain, some with holes; loads reported (some huge), stale or routed."""
    rnd = random.Random(seed)
    cfg = ScoringConfig(
        prefill_ms_per_token=rnd.choice((0.04, 0.1, 1.0)),
        decode_interference_ms=rnd.choice((0.0, 1.0, 2.5)),
        recompute_weight=rnd.choice((0.0, 0.5, 1.0)),
        temperature=rnd.choice((0.0, 0.0, 0.0, 0.3)),
        gpu_weight=rnd.choice((1.0, 0.9)),
        store_weight=rnd.choice((0.75, 0.5, 0.3)),
        remote_weight=rnd.choice((0.5, 0.25, 0.0)),
        seed=seed,
    )
    clock = Clock()
    router = Router(RouterConfig(scoring=cfg), clock=clock)
    chain = [rnd.getrandbits(63) for _ in range(24)]
    workers = []
    for i in range(rnd.randint(1, 12)):
        c = card(
            namespace="tenant",
            component=rnd.choice(("backend", "other")),
            node_id=rnd.choice(NODES),
            final_namespace=rnd.choice(NAMESPACES),
        )
        workers.append(router.register_worker(f"w{i}", c))
    router.register_worker(
        "p", card(namespace="tenant", worker_type="prefill", component="backend")
    )
    for w in [*workers, router.worker(router.admission.workers["p"].ref)]:
        for tier in (GPU_TIER, STORE_TIER):
            if rnd.random() < 0.6:
                held = chain[: rnd.randint(0, len(chain))]
                router.apply_worker_events(w.ref, [BlockEvent("stored", held, tier)])
                if held and rnd.random() < 0.2:  # a hole
                    gone = [rnd.choice(held)]
                    router.apply_worker_events(w.ref, [BlockEvent("removed", gone, tier)])
    for node in NODES[1:]:
        namespaces = [ns for ns in NAMESPACES[1:] if rnd.random() < 0.7]
        if not namespaces:
            continue
        peer = router.advertise_peer(node, f"{node}:1", f"{node}:2", namespaces)
        events = [
            StoreEvent("stored", ns, chain[: rnd.randint(0, len(chain))], node, STORE_TIER)
            for ns in namespaces
        ]
        router.apply_store_events(node, peer.generation, events)
    for w in workers:
        if rnd.random() < 0.5:
            queued = rnd.choice((0, 16, 32, 48, 2**40 - 1, 2**40))
            router.report_load(w.name, LoadReport(queued, rnd.choice((0, 1, 2))))
    clock.now += rnd.choice((0.0, 1.0, 3.0))  # 3 s: every report is stale
    for _ in range(rnd.randint(0, 4)):  # routed, tracked requests
        router.route("llama-8b", role="decode", hashes=chain[: rnd.randint(1, 24)])
    return router, chain, rnd


@pytest.mark.parametrize("seed", range(300))
def test_routes_answer_what_the_per_member_reference_answers(seed):
    router, chain, rnd = random_router(seed)
    for _ in range(4):
        hashes = chain[: rnd.randint(1, len(chain))] + [rnd.getrandbits(63)] * rnd.randint(0, 2)
        ref_rng = random.Random()
        ref_rng.setstate(router.rng.getstate())
        want = reference_route(router, hashes, ref_rng)
        r = router.route("llama-8b", role="decode", hashes=hashes, track=False)
        tiers = (r.overlap_blocks, r.gpu_blocks, r.store_blocks, r.remote_blocks)
        assert (r.worker.ref, tiers, r.ttft, r.reason) == want
        assert router.rng.getstate() == ref_rng.getstate()  # the same draws, no more


@pytest.mark.parametrize("seed", range(40))
def test_every_array_score_is_the_one_its_estimate_gives(seed):
    from kvstore.router.routing import candidates
    from kvstore.router.scoring import score_all

    router, chain, rnd = random_router(seed)
    cfg, now = router.config.scoring, router.clock()
    (wset,) = router.admission.resolve("llama-8b", role="decode")
    cands = candidates(wset, chain[: rnd.randint(1, 24)], router.domains, router.peers)
    loads = {c.ref: router.loads.load(c.ref, now, cfg.load_staleness_s) for c in cands}
    score_all(cands, 24 * 16, 16, loads, cfg)
    for i, c in enumerate(cands):
        assert (c.score_ms, c.ttft_ms) == (cands.scores.score_ms[i], cands.scores.ttft_ms[i])
