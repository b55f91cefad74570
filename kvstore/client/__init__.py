"""What a worker process imports: the store and router clients, shared-memory KV.

No server code lives here.
"""

from kvstore.client.store_client import KVLayer, RankSession, StoreClient, kv_cache_shm

__all__ = ["KVLayer", "RankSession", "StoreClient", "kv_cache_shm"]
