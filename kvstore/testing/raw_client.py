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
