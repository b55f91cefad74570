"""Cache semantics, routing scope and the indexer domain (docs/design.md §5).

The prefix index is partitioned into *indexer domains*: two workers share a
domain, and so share prefix-hit accounting, exactly when their block hashes
mean the same KV for the same routing scope.

    semantics_id = blake3(frame([material, block_size, hash_format]))[:16]
        R2 (default) material = ["kvstore/model-name/v1", display_name]
        R1           material = ["kvstore/card-checksum/v1", card_checksum]
        explicit     material = ["kvstore/explicit-semantics/v1", override]
    scope_id     = blake3(frame([namespace, component, endpoint]))[:16]
        explicit   = blake3(frame(["kvstore/explicit-scope/v1", override]))[:16]
    domain       = (semantics_id, scope_id)

Why R2 (the display name) is the default: the card checksum covers many
things that do not change what a KV block means — the worker's role
(prefill vs decode), its aliases, its router settings, context limit,
generation defaults, a LICENSE among its extra files. Under R1 each of those
splits the domain, so the prefill and decode halves of one model, or the old
and new halves of an alias or config edit, stop seeing each other's prefixes.
R2 keys the domain to the logical model instead. That is safe because
admission already keeps incompatible cards out of a WorkerSet (first-wins on
the full checksum), block size and hash format are still in the id, and
same-name replacements get a new generation whose predecessor's events are
dropped. R1 remains selectable for deployments that want the conservative
partition. Neither verifies weights, and domain equality never authorises a
KV transfer: that also needs the same final namespace (layout fingerprint).
"""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple

import blake3

from kvstore.wire.card import WorkerCard
from kvstore.wire.framing import frame

R2_MARKER = "kvstore/model-name/v1"
R1_MARKER = "kvstore/card-checksum/v1"
EXPLICIT_SEMANTICS_MARKER = "kvstore/explicit-semantics/v1"
EXPLICIT_SCOPE_MARKER = "kvstore/explicit-scope/v1"
ID_BYTES = 16


class IdentityAlgorithm(StrEnum):
    """Which material names a cache domain: the display name or the checksum."""

    R2 = "r2"  # display name (default)
    R1 = "r1"  # card checksum


class Domain(NamedTuple):
    """An indexer domain; hashable, so it keys the per-domain indexes."""

    semantics_id: bytes
    scope_id: bytes

    def __str__(self) -> str:
        return f"{self.semantics_id.hex()[:8]}/{self.scope_id.hex()[:8]}"


def semantics_material(
    algorithm: IdentityAlgorithm, display_name: str, card_checksum: str, override: str = ""
) -> list[str]:
    """The material list; an explicit override replaces it, nothing else."""
    if override:
        return [EXPLICIT_SEMANTICS_MARKER, override]
    if algorithm is IdentityAlgorithm.R1:
        return [R1_MARKER, card_checksum]
    return [R2_MARKER, display_name]


def cache_semantics_id(material: list[str], block_size: int, hash_format: str) -> bytes:
    """First 16 bytes of blake3 over framed (material, block_size, hash_format)."""
    return blake3.blake3(frame([material, block_size, hash_format])).digest()[:ID_BYTES]


def routing_scope_id(namespace: str, component: str, endpoint: str, override: str = "") -> bytes:
    """16 bytes naming where requests go; an explicit override replaces it."""
    if override:
        return blake3.blake3(frame([EXPLICIT_SCOPE_MARKER, override])).digest()[:ID_BYTES]
    return blake3.blake3(frame([namespace, component, endpoint])).digest()[:ID_BYTES]


def domain_of(card: WorkerCard, checksum: str, algorithm: IdentityAlgorithm) -> Domain:
    """The indexer domain of an admitted card under the router's algorithm."""
    material = semantics_material(
        algorithm, card.display_name, checksum, card.indexer_semantics_override
    )
    return Domain(
        cache_semantics_id(material, card.kv_block_size, card.hash_format),
        routing_scope_id(
            card.namespace, card.component, card.endpoint, card.indexer_scope_override
        ),
    )
