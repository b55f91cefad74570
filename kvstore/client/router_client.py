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
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from kvstore._proto import router_pb2, router_pb2_grpc
from kvstore.wire.card import WorkerCard
from kvstore.wire.card_proto import card_to_proto
from kvstore.wire.errors import Code, KVError
from kvstore.wire.events import StoreEvent
from kvstore.wire.peers import PeerPrefix


class RouterClient:
    def __init__(self, address: str, timeout_s: float = 10.0):
        self.address = address
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(address)
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self.node_id = ""
        self.generation = 0

    def close(self) -> None:
        self._channel.close()

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
        :meth:`publish` then uses."""
        reply = self._call(
            self._stub.AdvertisePeer,
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
        return reply.generation

    def publish(
        self, events: Sequence[StoreEvent | bytes], node_id: str = "", generation: int = 0
    ) -> router_pb2.PublishEventsResponse:
        """Push store events (StoreEvent or its msgpack); the reply counts
        ``applied`` and ``dropped`` ones."""
        payloads = [e.encode() if isinstance(e, StoreEvent) else e for e in events]
        return self._call(
            self._stub.PublishEvents,
            router_pb2.PublishEventsRequest(
                node_id=node_id or self.node_id,
                generation=generation or self.generation,
                events=payloads,
            ),
        )

    def query_prefix(
        self, final_namespace: str, hashes: Sequence[int], exclude_node_id: str = ""
    ) -> list[PeerPrefix]:
        """Peers with sealed blocks of exactly ``final_namespace``, longest prefix first."""
        reply = self._call(
            self._stub.QueryPrefix,
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
            self._stub.RegisterWorker,
            router_pb2.RegisterWorkerRequest(name=name, card=card_to_proto(card)),
        )

    def remove_worker(self, name: str, generation: int = 0) -> bool:
        return self._call(
            self._stub.RemoveWorker,
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
            self._stub.Route,
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
            self._stub.ReportLoad,
            router_pb2.ReportLoadRequest(
                worker=worker,
                queued_prefill_tokens=queued_prefill_tokens,
                running_requests=running_requests,
                kv_usage=kv_usage,
            ),
        )

    def request_started(self, request_id: str) -> None:
        """The routed request's prefill began."""
        self._call(
            self._stub.RequestStarted, router_pb2.RequestStartedRequest(request_id=request_id)
        )

    def request_finished(self, request_id: str, cached_blocks: int | None = None) -> None:
        """The routed request is done; ``cached_blocks``: prefix blocks it really hit."""
        self._call(
            self._stub.RequestFinished,
            router_pb2.RequestFinishedRequest(request_id=request_id, cached_blocks=cached_blocks),
        )

    def stats(self) -> router_pb2.RouterStatsResponse:
        return self._call(self._stub.RouterStats, router_pb2.RouterStatsRequest())

    def _call(self, method, request):
        """One unary call; a gRPC status becomes a KVError with the same code."""
        try:
            return method(request, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise KVError(
                Code.from_name(exc.code().name), exc.details() or str(exc.code())
            ) from None
