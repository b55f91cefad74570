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
from kvstore.wire.names import NAMESPACE_RE, is_client_namespace, is_name


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


def set_taken(key: object) -> KVError:
    """PERMISSION_DENIED: the WorkerSet ``key`` has members and another owner.
    The owner is not named: a Route hides another's sets, and a refusal need
    not tell more than that the set is taken."""
    return denied(
        f"WorkerSet {key} has members another certificate admitted: only it (or an "
        "admin) may join the set; admit your workers under a namespace of your own"
    )


def check_owner(what: str, owner: str, caller: Principal) -> None:
    """PERMISSION_DENIED unless ``caller`` may act on ``what``, claimed by ``owner``.
    The owner is not named: one tenant's refusal does not tell it another's
    identity (an admin, who could read it, is never refused)."""
    if not caller.may_act_for(owner):
        raise denied(f"{what} belongs to another identity, not to {caller}")


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
        cn, node_id = _split_binding(value, "NODE_ID")
        if not is_name(node_id):
            raise ValueError(
                f"node id {node_id[:64]!r}: must be 1-{limits.MAX_NAME_LEN} printable characters"
            )
        return cls(cn, node_id)


def _split_binding(value: str, what: str) -> tuple[str, str]:
    """``CN=<what>`` split at the last ``=`` (a CN may hold one, what is bound
    not); ValueError when either side is missing."""
    cn, sep, bound = value.rpartition("=")
    if not sep or not cn or not bound:
        raise ValueError(f"expected CN={what}, got {value!r}")
    return cn, bound


class TenantBinding(NamedTuple):
    """A tenant's certificate bound to a client namespace (``--tenant
    CN=NAMESPACE``); see :class:`Tenancy`."""

    cn: str
    namespace: str

    @classmethod
    def parse(cls, value: str) -> TenantBinding:
        """``CN=NAMESPACE``, split at the last ``=``; ValueError naming what is wrong."""
        cn, namespace = _split_binding(value, "NAMESPACE")
        if not is_client_namespace(namespace):
            raise ValueError(
                f"namespace {namespace[:64]!r}: must match {NAMESPACE_RE.pattern} "
                "(a client namespace)"
            )
        return cls(cn, namespace)


class Tenancy:
    """The ``--tenant`` bindings, checked wherever a principal claims a client
    namespace (a store registration, a router admission): a bound namespace is
    its CN's alone, whoever comes first, and a bound CN claims no namespace
    but its own; an admin may act in any. Without bindings a namespace is its
    first claimer's (first come, so a stranger can take a tenant's namespace
    before the tenant does: binding it is the operator's remedy)."""

    def __init__(self, bindings: Iterable[TenantBinding] = ()):
        self.bindings = tuple(bindings)
        self._owners: dict[str, str] = {}  # namespace -> the CN bound to it
        self._namespaces: dict[str, list[str]] = {}  # CN -> the namespaces bound to it
        for cn, namespace in self.bindings:
            if self._owners.setdefault(namespace, cn) != cn:
                raise ValueError(
                    f"namespace {namespace!r} is bound to two certificates: "
                    f"{self._owners[namespace]!r} and {cn!r}"
                )
            self._namespaces.setdefault(cn, []).append(namespace)

    def owner(self, namespace: str) -> str | None:
        """The CN ``namespace`` is bound to, or None."""
        return self._owners.get(namespace)

    def claim(self, namespace: str, caller: Principal) -> None:
        """``caller`` was admitted into client namespace ``namespace`` (after
        :meth:`check` passed): bindings claim nothing; a store's claims do."""

    def check(self, field_name: str, namespace: str, caller: Principal) -> None:
        """PERMISSION_DENIED, naming ``field_name``, when ``caller`` may not
        claim client namespace ``namespace``. Another tenant's CN is not named
        (see :func:`check_owner`); the caller's own bindings are."""
        if caller.admin:
            return
        owner = self._owners.get(namespace)
        if owner is not None and owner != caller.name:
            raise denied(
                f"{field_name} {namespace!r} is bound to another certificate (--tenant), "
                f"not to {caller}"
            )
        mine = self._namespaces.get(caller.name)
        if owner is None and mine:
            raise denied(
                f"{field_name} {namespace!r}: {caller} is bound to client namespace(s) "
                f"{sorted(mine)} (--tenant), not to this one"
            )


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
