"""Send requests that a well-behaved client never builds, to test the store's refusals.

:class:`kvstore.client.StoreClient` only sends registrations it derives from
real tensors. Tests of validation (docs/design.md §1) need the opposite: a
request with one field made wrong on purpose.
"""

from __future__ import annotations

from kvstore._proto import store_pb2 as pb
from kvstore.client.store_client import RankSession, StoreClient


def register_raw(client: StoreClient, request: pb.RegisterLayersRequest) -> RankSession:
    """Register from a prepared request; raises KVError as ``StoreClient.register`` does."""
    stream = client.stub.RegisterLayers(request)
    session = RankSession(request.instance_id, request.rank, client.stub, stream)
    session.start()
    return session


def one_rank_request(
    instance: str, namespace: str, layers: list[pb.LayerSpec], block_size: int = 16
) -> pb.RegisterLayersRequest:
    """The registration of a one-rank (TP1) instance with ``layers`` as given."""
    one_rank = {"rank": 0, "tp_rank": 0, "tp_size": 1, "world_size": 1}
    return pb.RegisterLayersRequest(
        instance_id=instance, client_namespace=namespace, block_size=block_size,
        hash_format="kvstore-blake3-v1", layers=layers, **one_rank,
    )  # fmt: skip
