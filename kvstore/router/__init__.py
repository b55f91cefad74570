"""The KV-aware router core: admission, identity, prefix indexes, scoring, peers.

Plain Python behind one lock: no grpc, no zmq (those edges live in
``kvstore.service``), and nothing of the store, transfer or copy rooms. See
README.md in this folder for identifiers, operations and their cost.

    core.py          Router: the one entry point, its lock, its records
      admission.py   first-wins WorkerSets, generations, name resolution
      identity.py    cache semantics (R2 default / R1), routing scope, indexer domain
      holders.py     HolderIndex: block hash -> holder bitmask, prefix walk
      domains.py     workers' own blocks, one HolderIndex per indexer domain
      peers.py       store peers, one HolderIndex per final namespace, QueryPrefix
      routing.py     one route: WorkerSet draw, per-tier depths, the answer
      scoring.py     expected time to first token, lowest / softmax choice
      load.py        per-worker load: LoadReports and routed requests
      requests.py    bounds and formats of every request, checked up front
      endpoints.py   which kv_events_endpoint a card may name (--events-allow)
      drops.py       events not indexed, counted by cause
      vllm_events.py vLLM KVEventBatch decoding (no vLLM needed)

Elsewhere: the card format in ``kvstore.wire.card`` (and its proto codec in
``kvstore.wire.card_proto``), the gRPC handlers in
``kvstore.service.router_service``, the event feeds in ``kvstore.service.feeds``,
server assembly in ``kvstore.service.router_server``, the client in
``kvstore.client.router_client`` and the command in ``kvstore.cli.router``.
"""

from kvstore.router.admission import WorkerRef, WorkerSetKey
from kvstore.router.core import EventsApplied, Router, RouterConfig, RouterStats
from kvstore.router.identity import Domain, IdentityAlgorithm
from kvstore.router.load import LoadReport
from kvstore.router.routing import RouteResult
from kvstore.router.scoring import ScoringConfig, TtftEstimate

__all__ = [
    "Domain",
    "EventsApplied",
    "IdentityAlgorithm",
    "LoadReport",
    "RouteResult",
    "Router",
    "RouterConfig",
    "RouterStats",
    "ScoringConfig",
    "TtftEstimate",
    "WorkerRef",
    "WorkerSetKey",
]
