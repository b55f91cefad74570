"""WorkerCard <-> ``kvstore.v1.WorkerCard`` proto (docs/design.md §5).

The router service decodes cards with :func:`card_from_proto` and the router
client encodes them with :func:`card_to_proto`, so both ends share one
field list. Only the generated message module is imported, never grpc.
"""

from __future__ import annotations

from kvstore._proto import router_pb2
from kvstore.wire.card import WorkerCard

_SCALARS = (
    "display_name",
    "source_path",
    "model_config_checksum",
    "tokenizer_checksum",
    "prompt_formatter_checksum",
    "chat_template_checksum",
    "generation_config_checksum",
    "prompt_context",
    "context_length",
    "kv_block_size",
    "worker_type",
    "router_config",
    "indexer_semantics_override",
    "indexer_scope_override",
    "lora",
    "lora_base",
    "hash_format",
    "namespace",
    "component",
    "endpoint",
    "address",
    "capacity_blocks",
    "node_id",
    "final_namespace",
    "kv_events_endpoint",
)
_LISTS = ("aliases", "needs", "multimodal")
# Proto3 cannot tell "unset" from "": these take the card's defaults when empty.
_DEFAULTED = frozenset({"hash_format", "worker_type", "namespace", "component", "endpoint"})
_DEFAULTS = WorkerCard("x", 1)


def card_from_proto(msg: router_pb2.WorkerCard) -> WorkerCard:
    kwargs: dict[str, object] = {}
    for name in _SCALARS:
        value = getattr(msg, name)
        kwargs[name] = value if (value or name not in _DEFAULTED) else getattr(_DEFAULTS, name)
    for name in _LISTS:
        kwargs[name] = list(getattr(msg, name))
    kwargs["extra_files"] = dict(msg.extra_files)
    return WorkerCard(**kwargs)


def card_to_proto(card: WorkerCard) -> router_pb2.WorkerCard:
    msg = router_pb2.WorkerCard(**{name: getattr(card, name) for name in _SCALARS})
    for name in _LISTS:
        getattr(msg, name).extend(getattr(card, name))
    msg.extra_files.update(card.extra_files)
    return msg
