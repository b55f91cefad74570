"""kvstore as vLLM's KV connector (``KVStoreConnector``; see ``connector.py``).

``kv_connector_module_path: "kvstore.integrations.vllm"`` names this package;
vLLM then looks up ``KVStoreConnector`` here. vLLM is imported only then, so
the package's plain-Python halves import without it.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name in ("KVStoreConnector", "KVStoreConnectorMetadata"):
        from kvstore.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
