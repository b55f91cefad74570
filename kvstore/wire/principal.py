"""Who a call comes from, as the cores see it.

With mutual TLS a caller is the subject CN of its client certificate (a
tenant, a store node, a router: whatever the certificate authority named),
and an admin when that CN is one the server was told to trust as admin
(``--admin CN``). Without TLS (the loopback default) every caller is
:data:`LOCAL`: anonymous and trusted with everything, exactly as before
authentication existed, so a single-node deployment needs no configuration.
That default trusts every local process; multi-tenant deployments use TLS.

Ownership rules (docs/design.md, "Authentication and ownership"): a worker
name, a peer node id and a client namespace belong to the principal that
first claimed them; another non-admin principal is PERMISSION_DENIED. A
router told its store nodes' CNs lets only those (and admins) act as stores.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from kvstore.wire import limits
from kvstore.wire.errors import Code, KVError, exhausted
from kvstore.wire.names import is_name


@dataclass(frozen=True)
class Principal:
    """An authenticated caller: ``name`` is its certificate CN ("" = anonymous local).
    ``store``: it may act as a store node towards a router (advertise, publish
    events, ask which peers hold a prefix); every caller may unless the router
    names its store CNs (``--store-cn``)."""

    name: str
    admin: bool = False
    store: bool = True

    def may_act_for(self, owner: str) -> bool:
        """May this caller act on something ``owner`` claimed?"""
        return self.admin or self.name == owner

    def __str__(self) -> str:
        return repr(self.name) if self.name else "the anonymous local caller"


LOCAL = Principal("", admin=True)  # no TLS: every caller, as trusted as before


def denied(message: str) -> KVError:
    return KVError(Code.PERMISSION_DENIED, message)


def check_owner(what: str, owner: str, caller: Principal) -> None:
    """PERMISSION_DENIED unless ``caller`` may act on ``what``, claimed by ``owner``."""
    if not caller.may_act_for(owner):
        raise denied(f"{what} belongs to {Principal(owner)}, not to {caller}")


class NodeBinding(NamedTuple):
    """A store certificate bound to the node id it publishes as (``--store-node
    CN=NODE_ID``): that certificate may act only as the node ids bound to it, and
    no other certificate but an admin's as them."""

    cn: str
    node_id: str

    @classmethod
    def parse(cls, value: str) -> NodeBinding:
        """``CN=NODE_ID``, split at the last ``=`` (a CN may hold one, a node id
        not); ValueError naming what is wrong."""
        cn, sep, node_id = value.rpartition("=")
        if not sep or not cn or not node_id:
            raise ValueError(f"expected CN=NODE_ID, got {value!r}")
        if not is_name(node_id):
            raise ValueError(
                f"node id {node_id[:64]!r}: must be 1-{limits.MAX_NAME_LEN} printable characters"
            )
        return cls(cn, node_id)


def node_owners(bindings: Iterable[NodeBinding]) -> dict[str, str]:
    """node id -> the CN bound to it; ValueError when one is bound to two CNs."""
    owners: dict[str, str] = {}
    for cn, node_id in bindings:
        if owners.setdefault(node_id, cn) != cn:
            raise ValueError(
                f"node id {node_id!r} is bound to two certificates: {owners[node_id]!r} and {cn!r}"
            )
    return owners


def check_store(call: str, caller: Principal) -> None:
    """PERMISSION_DENIED unless ``caller`` may act as a store node (or is an admin)."""
    if not (caller.admin or caller.store):
        raise denied(f"{call} is for store nodes: {caller} is not one of this router's --store-cn")


def owned_by(caller: Principal, owners: Iterable[str]) -> int:
    """How many of ``owners`` (the owner of each thing held) are ``caller``."""
    return sum(1 for owner in owners if owner == caller.name)


def check_quota(what: str, owned: int, limit: int, caller: Principal) -> None:
    """RESOURCE_EXHAUSTED when ``caller`` (not an admin) already owns ``limit``
    (``owned``) of ``what``."""
    if caller.admin:
        return
    if owned >= limit:
        raise exhausted(f"{caller} already holds {owned} {what}, at most {limit}")
