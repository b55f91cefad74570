"""kvstore as SGLang's HiCache storage backend (``KVStoreHiCacheStorage``; see ``storage.py``).

``"module_path": "kvstore.integrations.sglang"`` in the dynamic backend's
extra config names this package; SGLang then looks up
``KVStoreHiCacheStorage`` here. SGLang is imported only then, so the
package's plain-Python parts (``identity``, ``layers``, ``link``) import
without it.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name == "KVStoreHiCacheStorage":
        from kvstore.integrations.sglang import storage

        return storage.KVStoreHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
