"""What the router answers when a store asks who holds a prefix (docs/design.md §4)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PeerPrefix:
    """A peer that holds ``prefix_blocks`` leading blocks of the asked hashes."""

    node_id: str
    store_address: str
    ucx_address: str
    prefix_blocks: int
