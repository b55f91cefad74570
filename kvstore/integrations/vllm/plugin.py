"""vLLM plugin entry point: registers ``KVStoreConnector`` by name.

pyproject.toml declares it under ``vllm.general_plugins``; vLLM runs it in
every process it starts, so with kvstore installed
``"kv_connector": "KVStoreConnector"`` needs no ``kv_connector_module_path``.
"""

from __future__ import annotations

NAME = "KVStoreConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(
            NAME, "kvstore.integrations.vllm.connector", "KVStoreConnector"
        )
    except ValueError:  # already registered in this process
        pass
