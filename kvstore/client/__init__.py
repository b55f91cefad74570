"""What a worker process imports: the store client and shared-memory KV caches.

No server code lives here; see README.md in this folder.
"""

from kvstore.client.shared_memory import ShmTensor
from kvstore.client.store_client import KVLayer, RankSession, StoreClient, kv_cache_shm

__all__ = ["KVLayer", "RankSession", "ShmTensor", "StoreClient", "kv_cache_shm"]
