"""Worker admission: first-wins per WorkerSet, as one atomic decision.

A WorkerSet is keyed by ``(model, namespace, role)`` with model = the card's
display name and role = its worker type. Its first admitted card fixes the
checksum (and hash format); a later card with another checksum is refused
with FAILED_PRECONDITION naming the fields that differ. A refusal changes
nothing: no member is evicted, blocked or re-checked.

Registration compatibility, the relation admission enforces, is

    c ~ d  <=>  key(c) == key(d) and checksum(c) == checksum(d)
                and hash_format(c) == hash_format(d)

Equality of a function of the card, hence an equivalence relation (reflexive,
symmetric, transitive). Cards with different keys never constrain each other:
source paths are not identity, and name sharing is settled when a name is
*resolved*, not when a worker registers (see :meth:`Admission.resolve`). So
the admitted set is a function of the arrivals and, per key, of which class
arrived first; among compatible workers it never depends on arrival order,
and there is no check-register-recheck-rollback step that two concurrent
newcomers could both fail (the decision is made under the router's lock).

Each admission gets a new generation from one router-wide counter. A
re-registration under a known worker name replaces the old generation in the
same step (or, if refused, leaves it untouched); anything still arriving for
the old generation is dropped by the router.

This is the embedded default. Router replicas on etcd make the same decision
in etcd transactions (``kvstore/membership/worksets.py``) and apply what etcd
admitted here with the generation etcd gave it (``admit(..., decided=)``),
refusing with :func:`refusal`'s words.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from kvstore.router.identity import Domain, IdentityAlgorithm, domain_of
from kvstore.wire import limits
from kvstore.wire.card import WorkerCard, card_checksum, describe_difference, differences
from kvstore.wire.errors import KVError, not_found, precondition
from kvstore.wire.names import check_name
from kvstore.wire.principal import (
    LOCAL,
    Principal,
    check_owner,
    check_quota,
    owned_by,
    set_taken,
)


@dataclass(frozen=True, order=True)
class WorkerSetKey:
    model: str
    namespace: str
    role: str

    def __str__(self) -> str:
        return f"{self.model}/{self.namespace}/{self.role}"


class WorkerRef(NamedTuple):
    """One generation of one named worker: what events and loads refer to.
    (A NamedTuple: it keys hot dicts, and tuples hash in C.)"""

    name: str
    generation: int


class Decided(NamedTuple):
    """An admission etcd decided: the generation it gave, and the owner the
    set's card names (None when no card was seen)."""

    generation: int
    set_owner: str | None = None


@dataclass
class Worker:
    """An admitted worker."""

    ref: WorkerRef
    card: WorkerCard
    checksum: str
    key: WorkerSetKey
    domain: Domain
    owner: str = ""  # the principal that admitted it ("" = anonymous local)

    @property
    def name(self) -> str:
        return self.ref.name


@dataclass
class WorkerSet:
    key: WorkerSetKey
    checksum: str
    reference: WorkerCard  # the first admitted card: names what a misfit differs in
    owner: str = ""  # who admitted its first member, or its namespace's --tenant CN ("" = local)
    members: dict[str, Worker] = field(default_factory=dict)

    @property
    def aliases(self) -> list[str]:
        return self.reference.aliases


def key_of(card: WorkerCard) -> WorkerSetKey:
    return WorkerSetKey(card.display_name, card.namespace, card.worker_type)


class Admission:
    """The admitted workers and their WorkerSets. Not thread-safe on its own:
    the router calls it under its lock so each decision is atomic."""

    def __init__(
        self,
        algorithm: IdentityAlgorithm = IdentityAlgorithm.R2,
        bound_owner: Callable[[str], str | None] = lambda _namespace: None,
    ):
        """``bound_owner``: the CN a client namespace is bound to (``--tenant``),
        or None; a set made there is that CN's, whoever admits its first member."""
        self.algorithm = algorithm
        self.bound_owner = bound_owner
        self.sets: dict[WorkerSetKey, WorkerSet] = {}
        self.workers: dict[str, Worker] = {}
        self.rejected = 0
        self._next_generation = 1

    def admit(
        self, name: str, card: WorkerCard, caller: Principal = LOCAL, decided: Decided | None = None
    ) -> tuple[Worker, Worker | None]:
        """Admit ``card`` as worker ``name`` for ``caller``; return (new worker, replaced one).

        ``card`` must be validated already. Raises FAILED_PRECONDITION, with
        nothing changed, when the WorkerSet holds another checksum, and
        PERMISSION_DENIED when ``name`` is admitted for another principal
        (only its owner or an admin may replace it) or the WorkerSet has
        members and belongs to another principal (only its owner or an admin
        may join it; judged before the checksum, so a stranger learns nothing
        of the set's card).
        ``decided``: what etcd decided (replicas on etcd): the generation, else
        the next of this router's counter, and the set's owner, else the set's
        first member's owner (``caller``'s when it makes the set).
        """
        generation = decided.generation if decided is not None else 0
        checksum = card_checksum(card)
        key = key_of(card)
        domain = domain_of(card, checksum, self.algorithm)
        old = self.workers.get(name)
        if old is not None:
            check_owner(f"worker name {name!r}", old.owner, caller)
        if not generation:  # etcd's were checked before etcd took them
            self.check_quota(name, caller, domain)
        wset = self.sets.get(key)
        # Judge against the set as it would be without the generation we replace.
        others = 0 if wset is None else len(wset.members) - (old is not None and old.key == key)
        if wset is not None and others > 0 and not caller.may_act_for(wset.owner):
            raise set_taken(key)
        if (
            wset is not None
            and others > 0
            and (wset.checksum != checksum or wset.reference.hash_format != card.hash_format)
        ):
            self.rejected += 1
            raise refusal(name, wset.key, wset.checksum, wset.reference, card, others)
        # Decision made: apply it.
        if old is not None:
            self._drop(old)
        if not generation:
            generation = self._next_generation
            self._next_generation += 1
        worker = Worker(
            WorkerRef(name, generation),
            card,
            checksum,
            key,
            domain,
            caller.name,
        )
        wset = self.sets.get(key)
        if wset is None:
            owner = self.bound_owner(card.namespace) or caller.name
            wset = self.sets[key] = WorkerSet(key, checksum, card, owner)
        if decided is not None and decided.set_owner is not None:
            wset.owner = decided.set_owner
        wset.members[name] = worker
        self.workers[name] = worker
        return worker, old

    def check_quota(self, name: str, caller: Principal, domain: Domain | None = None) -> None:
        """RESOURCE_EXHAUSTED when ``caller`` (not an admin) already has
        MAX_WORKERS_PER_PRINCIPAL workers admitted and ``name`` is new (each may
        cost the router an event feed: a task, two ZMQ sockets), or, with the
        ``domain`` the card would join, already has
        MAX_WORKERS_PER_DOMAIN_PER_PRINCIPAL workers there besides ``name`` (a
        re-registration replaces its own generation; it adds none)."""
        if caller.admin:
            return
        if name not in self.workers:
            owned = owned_by(caller, (worker.owner for worker in self.workers.values()))
            check_quota("workers admitted", owned, limits.MAX_WORKERS_PER_PRINCIPAL, caller)
        if domain is not None:
            there = (w for w in self.workers.values() if w.domain == domain and w.name != name)
            owned = owned_by(caller, (worker.owner for worker in there))
            check_quota(
                f"workers in indexer domain {domain} (whose holder slots every tenant shares)",
                owned,
                limits.MAX_WORKERS_PER_DOMAIN_PER_PRINCIPAL,
                caller,
            )

    def remove(self, name: str, generation: int = 0, caller: Principal = LOCAL) -> Worker:
        """Remove worker ``name`` (that generation only, when given); PERMISSION_DENIED
        unless ``caller`` admitted it or is an admin."""
        check_name("name", name)
        worker = self.workers.get(name)
        if worker is None or (generation and worker.ref.generation != generation):
            raise not_found(f"worker {name!r} generation {generation or 'any'} is not admitted")
        check_owner(f"worker {name!r}", worker.owner, caller)
        self._drop(worker)
        return worker

    def current(self, ref: WorkerRef) -> Worker | None:
        """The admitted worker for ``ref``, or None when it is stale or gone."""
        worker = self.workers.get(ref.name)
        if worker is None or worker.ref.generation != ref.generation:
            return None
        return worker

    def _drop(self, worker: Worker) -> None:
        del self.workers[worker.name]
        wset = self.sets[worker.key]
        del wset.members[worker.name]
        if not wset.members:  # an empty set forgets its checksum: next card fixes it anew
            del self.sets[worker.key]

    def resolve(
        self, model: str, namespace: str = "", role: str = "", caller: Principal = LOCAL
    ) -> list[WorkerSet]:
        """WorkerSets that serve the name ``model`` for ``caller``, in key order.

        ``caller`` sees only the sets it owns (an admin sees every set): one
        tenant's Route never reaches, probes the cached prefixes of, or is
        captured by the name or alias of another tenant's set. A name resolves
        to the sets whose display name it is; failing that, to the sets that
        list it as an alias, provided they are all one model.
        An alias shared by different models is ambiguous and refused (nothing
        is blocked: each model keeps serving its own name). The answer is a
        function of the admitted set alone, never of arrival order.
        """

        def wanted(k: WorkerSetKey) -> bool:
            return (not namespace or k.namespace == namespace) and (not role or k.role == role)

        visible = [
            s for k, s in sorted(self.sets.items()) if wanted(k) and caller.may_act_for(s.owner)
        ]
        primary = [s for s in visible if s.key.model == model]
        if primary:
            return primary
        by_alias = [s for s in visible if model in s.aliases]
        models = sorted({s.key.model for s in by_alias})
        if len(models) > 1:
            raise precondition(
                f"model name {model!r} is an alias of several models {models}; "
                "ask for one of them by its display name"
            )
        if not by_alias:
            raise not_found(
                f"no admitted worker serves model {model!r}"
                + (f" in namespace {namespace!r}" if namespace else "")
                + (f" with role {role!r}" if role else "")
            )
        return by_alias


def refusal(
    name: str,
    key: WorkerSetKey,
    checksum: str,
    reference: WorkerCard,
    card: WorkerCard,
    others: int,
) -> KVError:
    """FAILED_PRECONDITION naming every field in which ``card`` differs from
    ``reference``, the first admitted card of the set ``key`` (checksum ``checksum``)."""
    diffs = differences(reference, card) or ["card_checksum"]
    detail = "; ".join(
        describe_difference(reference, card, d) if d != "card_checksum" else d for d in diffs
    )
    return precondition(
        f"worker {name!r} rejected from WorkerSet {key}: card differs from the admitted "
        f"card ({checksum[:12]}) in {detail}; the {others} admitted member(s) are "
        "unaffected"
    )
