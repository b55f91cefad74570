"""A small synchronous client for the router, as store servers and tools use it.

    client = RouterClient("127.0.0.1:50061")
    gen = client.advertise_peer("node-a", "10.0.0.1:50051", "10.0.0.1:13337",
                                ["tenant.0123456789abcdef"])
    client.publish([event.encode() for event in events], node_id="node-a", generation=gen)
    client.query_prefix("tenant.0123456789abcdef", hashes, exclude_node_id="node-a")
    # -> [PeerPrefix(node_id, store_address, ucx_address, prefix_blocks), ...]
    client.report_load("w0", queued_prefill_tokens=4096, running_requests=12, kv_usage=0.7)
    r = client.route("llama-8b", token_ids=prompt)   # r.ttft_ms, r.reason
    client.request_started(r.request_id)
    client.request_finished(r.request_id, cached_blocks=6)

Errors surface as :class:`KVError` carrying the router's status as a
:class:`Code` and its message, as the store client's do.

Several routers (replicas on etcd, or standbys) may be given, as a list or
comma-separated: ``RouterClient("10.0.0.1:50061,10.0.0.2:50061")``. Calls go
to one at a time; a call that finds it UNAVAILABLE or past its deadline is
tried on the next one, and that one stays current. A call that timed out may
still have been applied by the router that timed out (a Route then counts its
request there until the router's request timeout frees it). A store
advertisement is per router: after a move, ``advertise_peer`` again.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import grpc

from kvstore._proto import router_pb2, router_pb2_grpc
from kvstore.client.tls import RECONNECT_OPTIONS, open_channel
from kvstore.wire.card import WorkerCard
from kvstore.wire.card_proto import card_to_proto
from kvstore.wire.errors import Code, KVError
from kvstore.wire.events import StoreEvent
from kvstore.wire.peers import PeerPrefix
from kvstore.wire.tls import TlsFiles

# A router that answers these is gone or hung: the next one may answer.
FAILOVER_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class RouterClient:
    def __init__(
        self, address: str | Sequence[str], timeout_s: float = 10.0, tls: TlsFiles | None = None
    ):
        """``tls``: mutual TLS to every router (plaintext when None)."""
        self.tls = tls
        items = address.split(",") if isinstance(address, str) else list(address)
        self.addresses = [a.strip() for a in items if a.strip()]
        if not self.addresses:
            raise ValueError("RouterClient: no router address given")
        self.timeout_s = timeout_s
        self._active = 0
        self._lock = threading.Lock()
        self._channels: dict[int, grpc.Channel] = {}
        self._stubs: dict[int, router_pb2_grpc.RouterStub] = {}
        self.node_id = ""
        self.generation = 0
        self.owes_snapshot = False  # the last advertisement's answer: send a snapshot

    @property
    def address(self) -> str:
        """The router calls go to now."""
        return self.addresses[self._active]

    def _stub(self, i: int) -> router_pb2_grpc.RouterStub:
        with self._lock:
            if i not in self._stubs:
                self._channels[i] = open_channel(self.addresses[i], self.tls, RECONNECT_OPTIONS)
                self._stubs[i] = router_pb2_grpc.RouterStub(self._channels[i])
            return self._stubs[i]

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
            self._stubs.clear()

    def __enter__(self) -> RouterClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- store servers -----------------------------------------------------

    def advertise_peer(
        self,
        node_id: str,
        store_address: str,
        ucx_address: str,
        final_namespaces: Sequence[str],
        lease_ms: int = 0,
        refresh: bool = False,
    ) -> int:
        """Announce this store (or, with ``refresh``, renew the last
        advertisement and add namespaces); returns the peer generation, which
        :meth:`publish` then uses. ``owes_snapshot`` then says whether the
        router asked (on a refresh) for this node's snapshot."""
        reply = self._call(
            "AdvertisePeer",
            router_pb2.AdvertisePeerRequest(
                node_id=node_id,
                store_address=store_address,
                ucx_address=ucx_address,
                final_namespaces=list(final_namespaces),
                lease_ms=lease_ms,
                generation=self.generation if refresh and node_id == self.node_id else 0,
            ),
        )
        self.node_id, self.generation = node_id, reply.generation
        self.owes_snapshot = reply.resync
        return reply.generation

    def publish(
        self,
        events: Sequence[StoreEvent | bytes],
        node_id: str = "",
        generation: int = 0,
        seq: int = 0,
        snapshot: bool = False,
    ) -> router_pb2.PublishEventsResponse:
        """Push store events (StoreEvent or its msgpack); the reply counts
        ``applied`` and ``dropped`` ones. ``seq`` numbers the batch (0:
        unsequenced), ``snapshot`` makes it replace the node's indexed blocks;
        ``resync`` in the reply asks for a snapshot (docs/design.md §6)."""
        payloads = [e.encode() if isinstance(e, StoreEvent) else e for e in events]
        return self._call(
            "PublishEvents",
            router_pb2.PublishEventsRequest(
                node_id=node_id or self.node_id,
                generation=generation or self.generation,
                events=payloads,
                seq=seq,
                snapshot=snapshot,
            ),
        )

    def query_prefix(
        self, final_namespace: str, hashes: Sequence[int], exclude_node_id: str = ""
    ) -> list[PeerPrefix]:
        """Peers with sealed blocks of exactly ``final_namespace``, longest prefix first."""
        reply = self._call(
            "QueryPrefix",
            router_pb2.QueryPrefixRequest(
                final_namespace=final_namespace,
                block_hashes=list(hashes),
                exclude_node_id=exclude_node_id,
            ),
        )
        return [
            PeerPrefix(p.node_id, p.store_address, p.ucx_address, p.prefix_blocks)
            for p in reply.peers
        ]

    # -- workers and frontends ---------------------------------------------

    def register_worker(self, name: str, card: WorkerCard) -> router_pb2.RegisterWorkerResponse:
        return self._call(
            "RegisterWorker",
            router_pb2.RegisterWorkerRequest(name=name, card=card_to_proto(card)),
        )

    def remove_worker(self, name: str, generation: int = 0) -> bool:
        return self._call(
            "RemoveWorker",
            router_pb2.RemoveWorkerRequest(name=name, generation=generation),
        ).removed

    def route(
        self,
        model: str,
        *,
        token_ids: Sequence[int] = (),
        hashes: Sequence[int] = (),
        namespace: str = "",
        role: str = "",
        request_id: str = "",
        track: bool = True,
        decode_tokens: int = 0,
    ) -> router_pb2.RouteResponse:
        return self._call(
            "Route",
            router_pb2.RouteRequest(
                model=model,
                namespace=namespace,
                role=role,
                token_ids=list(token_ids),
                block_hashes=list(hashes),
                request_id=request_id,
                track=track,
                decode_tokens=decode_tokens,
            ),
        )

    def report_load(
        self,
        worker: str,
        queued_prefill_tokens: int,
        running_requests: int,
        kv_usage: float = 0.0,
    ) -> None:
        """Worker ``worker``'s load now, for the engine or the store server on its behalf."""
        self._call(
            "ReportLoad",
            router_pb2.ReportLoadRequest(
                worker=worker,
                queued_prefill_tokens=queued_prefill_tokens,
                running_requests=running_requests,
                kv_usage=kv_usage,
            ),
        )

    def request_started(self, request_id: str) -> None:
        """The routed request's prefill began."""
        self._call("RequestStarted", router_pb2.RequestStartedRequest(request_id=request_id))

    def request_finished(self, request_id: str, cached_blocks: int | None = None) -> None:
        """The routed request is done; ``cached_blocks``: prefix blocks it really hit."""
        self._call(
            "RequestFinished",
            router_pb2.RequestFinishedRequest(request_id=request_id, cached_blocks=cached_blocks),
        )

    def stats(self) -> router_pb2.RouterStatsResponse:
        return self._call("RouterStats", router_pb2.RouterStatsRequest())

    def _call(self, name: str, request):
        """One unary call of the Router method ``name`` (on the next router when
        this one is gone); a gRPC status becomes a KVError with the same code."""
        first, count = self._active, len(self.addresses)
        for attempt in range(count):
            i = (first + attempt) % count
            try:
                reply = getattr(self._stub(i), name)(request, timeout=self.timeout_s)
            except grpc.RpcError as exc:
                if exc.code() in FAILOVER_CODES and attempt + 1 < count:
                    continue
                if exc.code() not in FAILOVER_CODES:
                    self._active = i  # it answered: it is alive
                raise KVError(
                    Code.from_name(exc.code().name), exc.details() or str(exc.code())
                ) from None
            self._active = i
            return reply
        raise AssertionError("unreachable")
