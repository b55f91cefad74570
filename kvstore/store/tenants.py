"""Which principal owns each client namespace: the store's tenant scoping.

The first principal to register an instance in a client namespace owns it,
for the life of the server; a namespace bound by ``--tenant CN=NAMESPACE``
is that certificate's alone from the start (``Tenancy``). Another principal
(not admin) may not register there (it would read and overwrite the owner's
blocks), nor query, prefetch, clear or watch events of its final namespaces.
The anonymous local caller (no TLS) is an admin: without TLS nothing is
scoped, as before.
"""

from __future__ import annotations

from kvstore.wire.names import client_namespace_of
from kvstore.wire.principal import Principal, Tenancy, check_owner, denied


class Tenants:
    def __init__(self, tenancy: Tenancy | None = None):
        """``tenancy``: the ``--tenant`` bindings, judged before first claims."""
        self.tenancy = tenancy or Tenancy()
        self._owners: dict[str, str] = {}  # client namespace -> principal name

    def check_register(
        self, client_namespace: str, caller: Principal, field_name: str = "client_namespace"
    ) -> None:
        """PERMISSION_DENIED, naming ``field_name``, when ``client_namespace`` is
        bound (``--tenant``) to, or was claimed by, another principal."""
        self.tenancy.check(field_name, client_namespace, caller)
        owner = self._owners.get(client_namespace)
        if owner is not None:
            check_owner(f"{field_name} {client_namespace!r}", owner, caller)

    def owner(self, client_namespace: str) -> str | None:
        """The principal ``client_namespace`` is bound to or was first claimed by."""
        return self.tenancy.owner(client_namespace) or self._owners.get(client_namespace)

    def claim(self, client_namespace: str, caller: Principal) -> None:
        """``caller`` registered in ``client_namespace``: it owns it if nobody did
        (a bound namespace is its binding's CN's). An admin claims nothing: it
        may act anywhere, and its registration must not lock the namespace's
        tenant out."""
        owner = self.tenancy.owner(client_namespace)
        if owner is None and not caller.admin:
            owner = caller.name
        if owner:
            self._owners.setdefault(client_namespace, owner)

    def owner_of(self, final_namespace: str) -> str:
        """The principal owning final namespace ``final_namespace``'s client
        namespace ("" when none does: no TLS, or only an admin registered there)."""
        return self._owners.get(client_namespace_of(final_namespace), "")

    def may_see(self, final_namespace: str, caller: Principal) -> bool:
        """May ``caller`` see (query, clear, watch) final namespace ``final_namespace``?"""
        return caller.admin or self._owners.get(client_namespace_of(final_namespace)) == (
            caller.name
        )

    def check_see(self, field_name: str, final_namespace: str, caller: Principal) -> None:
        if not final_namespace:
            if not caller.admin:
                raise denied(f"{field_name}: every namespace is for an admin only, not {caller}")
            return
        if not self.may_see(final_namespace, caller):
            raise denied(
                f"{field_name} {final_namespace!r}: {caller} has registered no instance "
                "in its client namespace"
            )


class NodeClaims(Tenancy):
    """A store's client namespace claims as its embedded router sees them.

    The router alone knows only ``--tenant`` bindings, so over mutual TLS a
    tenant could admit a worker whose card names another tenant's client
    namespace (and that tenant's final namespace) and learn from its Routes
    which of the other's prefixes the store holds. Through this, a card's
    namespace is checked against the store's first claims as a rank's
    registration is, and an admission claims it when nobody has: one claim a namespace on
    the node, whichever of a rank and a worker comes first (binding it with
    ``--tenant`` is still the operator's remedy against a stranger first).
    """

    def __init__(self, tenants: Tenants):
        super().__init__(tenants.tenancy.bindings)
        self.tenants = tenants

    def owner(self, namespace: str) -> str | None:
        return self.tenants.owner(namespace)

    def check(self, field_name: str, namespace: str, caller: Principal) -> None:
        self.tenants.check_register(namespace, caller, field_name)

    def claim(self, namespace: str, caller: Principal) -> None:
        self.tenants.claim(namespace, caller)  # once admitted: a refusal claims nothing
