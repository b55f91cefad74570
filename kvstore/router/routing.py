"""One route, step by step: draw a WorkerSet, measure each member's prefix, answer.

The router core calls these under its lock, in this order:

    token_takers      token ids: the sets that can hash them, else the refusal
    hash_takers       block hashes: the sets they can mean, else the refusal
    draw_worker_set   among the sets a model name resolves to, by member count
    hash_tokens       token ids -> block hashes (native hash format only)
    candidates        per member: prefix depth on its GPU, in its own store, at a peer
    (scoring.py)      expected ttft of each candidate, then the lowest or a softmax draw
    route_result      the answer, with each block counted in the best tier holding it

Everything that can refuse a route is judged before the draw, on every set
the name resolves to, so a refused Route draws nothing (the router's seeded
random stream moves only for routes that are answered) and whether a request
is refused never depends on which set a draw picks.

A member's depths come from two kinds of index: its own events, in its
indexer domain (gpu and offload tiers, domains.py), and the store peers of
its card's final namespace (its node's store, and the deepest other holder,
peers.py). One prefix walk per domain and per namespace serves every member.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import eq

import numpy as np

from kvstore.router.admission import Worker, WorkerRef, WorkerSet, WorkerSetKey
from kvstore.router.domains import LOCAL_TIERS, DomainIndexes
from kvstore.router.peers import Peers
from kvstore.router.requests import check_token_blocks
from kvstore.router.scoring import Candidate, Candidates, ScoringConfig, TtftEstimate, explain
from kvstore.wire.errors import KVError, invalid, precondition
from kvstore.wire.events import GPU_TIER, STORE_TIER
from kvstore.wire.hashing import HASH_FORMAT, block_hashes


@dataclass
class RouteResult:
    worker: Worker
    request_id: str
    total_blocks: int
    overlap_blocks: int
    gpu_blocks: int
    store_blocks: int
    remote_blocks: int
    ttft: TtftEstimate  # the chosen worker's expected time to first token, and its parts
    reason: str
    worker_set: WorkerSetKey
    worker_sets: int


def token_takers(sets: list[WorkerSet], tokens: int, decode_tokens: int = 0) -> list[WorkerSet]:
    """The sets among ``sets`` that can take a prompt of ``tokens`` token ids and
    ``decode_tokens`` more (see :func:`check_tokens`), to draw among. When none
    can, the refusal: the one set's, or for several the first set's code and
    every set's reason."""
    return _takers(sets, lambda wset: check_tokens(wset, tokens, decode_tokens))


def hash_takers(sets: list[WorkerSet], blocks: int, decode_tokens: int = 0) -> list[WorkerSet]:
    """The sets among ``sets`` that can take ``blocks`` block hashes and
    ``decode_tokens`` more (see :func:`check_hashed`), to draw among.

    Block hashes name blocks of one block size in one hash format: in a set of
    another, they match nothing, and the prompt they stand for has another
    length. When the sets differ in either, which one the caller hashed for is
    unknown: FAILED_PRECONDITION (name the namespace or role of one, or send
    token ids, which the router hashes for each set)."""
    formats = sorted({(s.reference.kv_block_size, s.reference.hash_format) for s in sets})
    if len(formats) > 1:
        named = ", ".join(
            f"{s.key} ({s.reference.kv_block_size}-token blocks, {s.reference.hash_format})"
            for s in sets
        )
        raise precondition(
            f"block_hashes: the WorkerSets of this model hash blocks differently ({named}); "
            "name the namespace or role of the one they were hashed for, or send token_ids"
        )
    return _takers(sets, lambda wset: check_hashed(wset, blocks, decode_tokens))


def _takers(sets: list[WorkerSet], check: Callable[[WorkerSet], None]) -> list[WorkerSet]:
    """The sets ``check`` passes; when none, the refusal (see :func:`token_takers`)."""
    takers, refusals = [], []
    for wset in sets:
        try:
            check(wset)
        except KVError as exc:
            refusals.append(exc)
        else:
            takers.append(wset)
    if takers:
        return takers
    if len(refusals) == 1:
        raise refusals[0]
    raise KVError(refusals[0].code, "; ".join(e.message for e in refusals))


def check_tokens(wset: WorkerSet, tokens: int, decode_tokens: int = 0) -> None:
    """INVALID_ARGUMENT when ``tokens`` make more than MAX_BLOCK_HASHES blocks of
    the set's size, or with ``decode_tokens`` exceed the context length its
    card states (its engine would refuse the request: no worker of it can take
    it); FAILED_PRECONDITION when the set's hash format is not the native one,
    the only one the router hashes tokens in."""
    check_token_blocks(tokens, wset.reference.kv_block_size)
    context = wset.reference.context_length  # 0: the card does not say
    if context and tokens + decode_tokens > context:
        raise invalid(
            f"token_ids: {tokens} prompt tokens and decode_tokens {decode_tokens} exceed "
            f"the context_length {context} of WorkerSet {wset.key}"
        )
    if wset.reference.hash_format != HASH_FORMAT:
        raise precondition(
            f"token_ids: WorkerSet {wset.key} uses hash format "
            f"{wset.reference.hash_format!r}; send block_hashes"
        )


def check_hashed(wset: WorkerSet, blocks: int, decode_tokens: int = 0) -> None:
    """INVALID_ARGUMENT when ``blocks`` full blocks of the set's size (the prompt
    has at least those tokens) and ``decode_tokens`` exceed the context length
    its card states: its engine would refuse the request, as for token ids."""
    size, context = wset.reference.kv_block_size, wset.reference.context_length
    if context and blocks * size + decode_tokens > context:
        raise invalid(
            f"block_hashes: {blocks} blocks of {size} tokens ({blocks * size} prompt tokens "
            f"at least) and decode_tokens {decode_tokens} exceed the context_length {context} "
            f"of WorkerSet {wset.key}"
        )


def draw_worker_set(sets: list[WorkerSet], rng: random.Random) -> WorkerSet:
    """One of the matching WorkerSets, drawn by member count (a rolling upgrade)."""
    if len(sets) == 1:
        return sets[0]
    return rng.choices(sets, weights=[len(s.members) for s in sets], k=1)[0]


def hash_tokens(wset: WorkerSet, token_ids: Sequence[int]) -> list[int]:
    """Block hashes of ``token_ids`` for a set :func:`token_takers` let through."""
    return block_hashes(token_ids, wset.reference.kv_block_size)


def candidates(
    wset: WorkerSet, hashes: list[int], domains: DomainIndexes, peers: Peers
) -> Candidates:
    """Per member: its gpu / local store / remote prefix lengths of ``hashes``.

    Every walk answers for all holders at once, and only the holders that have
    the request's first block cost a Python step: the members without one
    cost a few array entries, not a step each.
    """
    members = list(wset.members.values())
    refs = [w.ref for w in members]
    gpu, store, remote = (np.zeros(len(members), dtype=np.int64) for _ in range(3))
    if hashes:
        _own_depths(members, refs, gpu, store, hashes, domains)
        _store_depths(members, store, remote, hashes, peers)
    return Candidates(refs, gpu, store, remote)


def _own_depths(
    members: list[Worker],
    refs: list[WorkerRef],
    gpu: np.ndarray,
    store: np.ndarray,
    hashes: list[int],
    domains: DomainIndexes,
) -> None:
    """GPU and own-offload depths, from the workers' own events in their domains."""
    hits = domains.hits({w.domain for w in members}, hashes)
    if not hits:
        return
    at = dict(zip(refs, range(len(refs)), strict=True))
    for (ref, tier), depth in hits.items():
        i = at.get(ref)
        if i is not None and tier in LOCAL_TIERS:
            (gpu if tier == GPU_TIER else store)[i] = depth


def _store_depths(
    members: list[Worker], store: np.ndarray, remote: np.ndarray, hashes: list[int], peers: Peers
) -> None:
    """Depths in the store peers of each member's final namespace: its own node's
    store (local) and the deepest other holder (remote)."""
    cards = [w.card for w in members]
    namespaces = [card.final_namespace for card in cards]
    nodes = [card.node_id for card in cards]
    for ns in set(namespaces) - {""}:
        deepest_first = peers.store_depths(ns, hashes).deepest_first
        if not deepest_first:
            continue
        here = np.array(list(map(eq, namespaces, repeat(ns))), dtype=bool)
        own = {node: d for d, (node, tier) in reversed(deepest_first) if tier == STORE_TIER}
        own_depths = np.array(list(map(own.get, nodes, repeat(0))), dtype=np.int64)
        store[here] = np.maximum(store, own_depths)[here]
        # Elsewhere: the deepest holder, or for a worker whose own store it is, the next.
        deepest, top = deepest_first[0]
        second = deepest_first[1][0] if len(deepest_first) > 1 else 0
        on_top = list(map(eq, nodes, repeat(top[0] if top[1] == STORE_TIER else None)))
        remote[here] = np.where(on_top, second, deepest)[here]


def route_result(
    wset: WorkerSet,
    sets: list[WorkerSet],
    best: Candidate,
    cands: Candidates,
    request_id: str,
    total: int,
    cfg: ScoringConfig,
) -> RouteResult:
    """The answer: each block is counted in the best tier that holds it."""
    reason = explain(best, cands, total, cfg)
    if len(sets) > 1:
        n = sum(len(s.members) for s in sets)
        reason += f"; WorkerSet {wset.key} drawn by worker count ({len(wset.members)}/{n})"
    local = max(best.gpu, best.store)
    return RouteResult(
        wset.members[best.ref.name],
        request_id,
        total,
        best.overlap,
        best.gpu,
        max(0, best.store - best.gpu),
        max(0, best.remote - local),
        best.estimate,
        reason,
        wset.key,
        len(sets),
    )
