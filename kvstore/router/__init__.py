"""The KV-aware router: admission, identity, prefix index, scoring, peers.

Layers, one concept per module:

    proto/router.proto   the wire contract
    service.py           thin gRPC handlers (KVError -> status)
    router.py            the core, plain Python, one lock
      card.py            worker cards, card_checksum (source_path excluded)
      admission.py       first-wins WorkerSets, generations, name resolution
      identity.py        cache semantics (R2 default / R1), scope, domain
      index.py           hash -> holder bitmask, prefix walk
      peers.py           store peers, one index per final namespace, QueryPrefix
      scoring.py         cost, argmin / softmax, active load
      vllm_events.py     vLLM KVEventBatch decoding (no vLLM needed)
    subscribers.py       ZMQ and store Events feeds
    client.py            RouterClient for store servers and tools
    cli.py               `kvstore router`, and the hooks `kvstore serve` embeds
"""

from kvstore.router.admission import WorkerRef, WorkerSetKey
from kvstore.router.card import WorkerCard, card_checksum
from kvstore.router.core import Router, RouterConfig, RouteResult
from kvstore.router.identity import Domain, IdentityAlgorithm
from kvstore.router.scoring import ScoringConfig
from kvstore.wire.peers import PeerPrefix

__all__ = [
    "Domain",
    "IdentityAlgorithm",
    "PeerPrefix",
    "Router",
    "RouterConfig",
    "RouteResult",
    "ScoringConfig",
    "WorkerCard",
    "WorkerRef",
    "WorkerSetKey",
    "card_checksum",
]
