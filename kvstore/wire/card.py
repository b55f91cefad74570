"""Worker cards, the card checksum and card validation (docs/design.md §5).

Every worker and every router agree on this format: a worker sends its card
when it registers, and the router admits, checksums and compares cards with
the functions here. A worker describes what it serves in a :class:`WorkerCard`. Two kinds of
fields live on it:

* checksum inputs: everything that changes which prompts a worker accepts,
  how it renders and tokenises them, or how its KV blocks are cut (names,
  config / tokenizer / template checksums, context length, block size, role,
  LoRA and multimodal contracts, explicit indexer identity);
* per-worker facts that replicas legitimately differ in: ``source_path`` (one
  model served from ``/models/x`` and ``/mnt/x`` is one model; a directory
  never proved weight identity), address, capacity, node, store namespace
  (TP degree is topology), events endpoint. These are never inputs.

``card_checksum`` is BLAKE3 over the length-framed encoding of the inputs in
a fixed order, extra files sorted by basename so directory traversal order
cannot change it.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable
from dataclasses import dataclass, field

import blake3

from kvstore.wire import limits
from kvstore.wire.errors import invalid
from kvstore.wire.framing import frame
from kvstore.wire.names import (
    check_final_namespace,
    check_name,
    check_token,
    client_namespace_of,
    is_client_namespace,
)

CARD_MARKER = "kvstore/card/v1"


@dataclass
class WorkerCard:
    """What one worker serves, as it registers it with the router."""

    display_name: str
    kv_block_size: int
    hash_format: str = "kvstore-blake3-v1"
    aliases: list[str] = field(default_factory=list)
    source_path: str = ""
    model_config_checksum: str = ""
    tokenizer_checksum: str = ""
    prompt_formatter_checksum: str = ""
    chat_template_checksum: str = ""
    generation_config_checksum: str = ""
    extra_files: dict[str, str] = field(default_factory=dict)  # name or path -> checksum
    prompt_context: str = ""
    context_length: int = 0
    worker_type: str = "aggregated"
    needs: list[str] = field(default_factory=list)
    router_config: str = ""
    indexer_semantics_override: str = ""
    indexer_scope_override: str = ""
    lora: bool = False
    lora_base: str = ""
    multimodal: list[str] = field(default_factory=list)
    # Per-worker facts: never checksum inputs.
    namespace: str = "default"
    component: str = "backend"
    endpoint: str = "generate"
    address: str = ""
    capacity_blocks: int = 0
    node_id: str = ""
    final_namespace: str = ""
    kv_events_endpoint: str = ""


# Fields that are NOT checksum inputs, and why (kept next to the list above so
# a new field has to be sorted into one side or the other).
NON_INPUTS = frozenset(
    {
        "source_path",  # one model may live in several directories
        "hash_format",  # an admission field of its own (see admission.py)
        "namespace",
        "component",
        "endpoint",  # WorkerSet key and routing scope
        "address",
        "capacity_blocks",
        "node_id",
        "final_namespace",
        "kv_events_endpoint",
    }
)


def extra_file_pairs(extra_files: dict[str, str]) -> list[list[str]]:
    """``[[basename, checksum], ...]`` sorted by basename: path and order free."""
    return sorted([posixpath.basename(k.replace("\\", "/")), v] for k, v in extra_files.items())


def checksum_inputs(card: WorkerCard) -> list[tuple[str, object]]:
    """The checksum inputs of ``card`` in their fixed order, normalised."""
    return [
        ("display_name", card.display_name),
        ("aliases", list(card.aliases)),
        ("model_config_checksum", card.model_config_checksum),
        ("tokenizer_checksum", card.tokenizer_checksum),
        ("prompt_formatter_checksum", card.prompt_formatter_checksum),
        ("chat_template_checksum", card.chat_template_checksum),
        ("generation_config_checksum", card.generation_config_checksum),
        ("extra_files", extra_file_pairs(card.extra_files)),
        ("prompt_context", card.prompt_context),
        ("context_length", card.context_length),
        ("kv_block_size", card.kv_block_size),
        ("worker_type", card.worker_type),
        ("needs", sorted(card.needs)),
        ("router_config", card.router_config),
        ("indexer_identity", [card.indexer_semantics_override, card.indexer_scope_override]),
        ("lora", [card.lora, card.lora_base]),
        ("multimodal", sorted(card.multimodal)),
    ]


def card_checksum(card: WorkerCard) -> str:
    """BLAKE3 hex of the framed, ordered checksum inputs (source_path excluded)."""
    material = [CARD_MARKER, *[value for _, value in checksum_inputs(card)]]
    return blake3.blake3(frame(material)).hexdigest()


def differences(admitted: WorkerCard, other: WorkerCard) -> list[str]:
    """Names of the checksum inputs (and hash_format) on which two cards differ."""
    diffs = [
        name
        for (name, a), (_, b) in zip(checksum_inputs(admitted), checksum_inputs(other), strict=True)
        if a != b
    ]
    if admitted.hash_format != other.hash_format:
        diffs.append("hash_format")
    return diffs


def describe_difference(admitted: WorkerCard, other: WorkerCard, name: str) -> str:
    """``name: admitted X, got Y`` with long values cut short."""
    if name == "hash_format":
        a, b = admitted.hash_format, other.hash_format
    else:
        a = dict(checksum_inputs(admitted))[name]
        b = dict(checksum_inputs(other))[name]
    return f"{name} (admitted {_short(a)}, got {_short(b)})"


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 48 else text[:45] + "..."


# -- validation: one table per rule, checked in this order --------------------

# (field, lowest, highest) for the integer fields.
_RANGES = (
    ("kv_block_size", 1, limits.MAX_BLOCK_SIZE),
    ("context_length", 0, limits.MAX_CONTEXT_LENGTH),
    ("capacity_blocks", 0, (1 << 63) - 1),
)
# Single tokens ([A-Za-z0-9_.:-]{1,64}) and lists of them.
_TOKENS = ("hash_format", "worker_type", "component", "endpoint")
_TOKEN_LISTS = ("needs", "multimodal")
# (longest allowed, fields) for free text.
_MAX_LENGTHS = (
    (
        limits.MAX_CHECKSUM_LEN,
        (
            "model_config_checksum",
            "tokenizer_checksum",
            "prompt_formatter_checksum",
            "chat_template_checksum",
            "generation_config_checksum",
        ),
    ),
    (
        limits.MAX_TEXT_LEN,
        (
            "prompt_context",
            "router_config",
            "indexer_semantics_override",
            "indexer_scope_override",
            "source_path",
        ),
    ),
    (limits.MAX_ADDRESS_LEN, ("address", "node_id", "kv_events_endpoint")),
)


def validate_card(card: WorkerCard) -> None:
    """Raise INVALID_ARGUMENT naming the first bad field; change nothing."""
    for check in _CHECKS:
        check(card)


def _check_names(card: WorkerCard) -> None:
    check_name("card.display_name", card.display_name)
    aliases = card.aliases
    if len(aliases) > limits.MAX_ALIASES:
        raise invalid(f"card.aliases: {len(aliases)} aliases, at most {limits.MAX_ALIASES}")
    for i, alias in enumerate(aliases):
        check_name(f"card.aliases[{i}]", alias)
    if len(set(aliases)) != len(aliases):
        raise invalid("card.aliases: duplicate alias")
    if card.display_name in aliases:
        raise invalid(f"card.aliases: contains the display name {card.display_name!r}")


def _check_ranges(card: WorkerCard) -> None:
    for name, lowest, highest in _RANGES:
        value = getattr(card, name)
        if not lowest <= value <= highest:
            raise invalid(f"card.{name}: {value} not in [{lowest}, {highest}]")


def _check_tokens(card: WorkerCard) -> None:
    for name in _TOKENS:
        check_token(f"card.{name}", getattr(card, name))
    for name in _TOKEN_LISTS:
        items = getattr(card, name)
        if len(items) > limits.MAX_LIST_ITEMS:
            raise invalid(f"card.{name}: {len(items)} items, at most {limits.MAX_LIST_ITEMS}")
        for i, item in enumerate(items):
            check_token(f"card.{name}[{i}]", item)


def _check_lengths(card: WorkerCard) -> None:
    for longest, names in _MAX_LENGTHS:
        for name in names:
            if len(getattr(card, name)) > longest:
                raise invalid(f"card.{name}: longer than {longest}")


def _check_extra_files(card: WorkerCard) -> None:
    files = card.extra_files
    if len(files) > limits.MAX_EXTRA_FILES:
        raise invalid(f"card.extra_files: {len(files)} files, at most {limits.MAX_EXTRA_FILES}")
    for name, checksum in files.items():
        if len(name) > limits.MAX_ADDRESS_LEN or len(checksum) > limits.MAX_CHECKSUM_LEN:
            raise invalid(f"card.extra_files[{name[:64]!r}]: name or checksum too long")
    basenames = [pair[0] for pair in extra_file_pairs(files)]
    if not all(basenames):
        raise invalid("card.extra_files: a file name has an empty basename")
    if len(set(basenames)) != len(basenames):
        raise invalid("card.extra_files: two files share a basename")


def _check_lora(card: WorkerCard) -> None:
    if card.lora and not card.lora_base:
        raise invalid("card.lora_base: a LoRA card must name its base model")
    if card.lora_base and not card.lora:
        raise invalid("card.lora_base: set on a card that is not a LoRA")
    if card.lora_base:
        check_name("card.lora_base", card.lora_base)


def _check_namespaces(card: WorkerCard) -> None:
    if not is_client_namespace(card.namespace):
        raise invalid(
            f"card.namespace: {card.namespace[:64]!r} does not match "
            f"[A-Za-z0-9_-]{{1,{limits.MAX_NAMESPACE_LEN}}}"
        )
    if card.final_namespace:
        check_final_namespace("card.final_namespace", card.final_namespace)
        if client_namespace_of(card.final_namespace) != card.namespace:
            # the router looks the worker's store blocks up by it: another client
            # namespace's would show its tenant's cached prefixes in this card's routes
            raise invalid(
                f"card.final_namespace: {card.final_namespace!r} is not of card.namespace "
                f"{card.namespace!r} (a final namespace is '<namespace>.<fingerprint>')"
            )


_CHECKS: tuple[Callable[[WorkerCard], None], ...] = (
    _check_names,
    _check_ranges,
    _check_tokens,
    _check_lengths,
    _check_extra_files,
    _check_lora,
    _check_namespaces,
)
