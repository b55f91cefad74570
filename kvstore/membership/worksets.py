"""First-wins WorkerSet admission as etcd transactions, shared by every router replica.

The embedded router decides admission under its lock (``kvstore/router/
admission.py``); replicas on etcd decide it here, with the same rule: a
WorkerSet's first admitted card fixes its checksum and hash format while the
set has members, and a card that differs is refused without disturbing them.

``admit`` reads the set's card, the worker's name claim and the set's members
in one transaction, decides, then writes in one transaction that holds only if
nothing it read has changed:

    compare  card key mod_revision == as read      (0: absent)
             name claim mod_revision == as read    (0: absent)
             and, when fixing the checksum or owner, no member but this worker:
             version([members/, members/<worker>)) == 0 and
             version((members/<worker>, end of members/)) == 0
    success  [delete the worker's member key in the set it leaves]
             [put card]                            when fixing the checksum or owner
             put name claim, put member key        both under the worker's lease

A name claimed for another principal (the claim names its owner), or a set
with members whose card names another owner, is refused with
PERMISSION_DENIED before anything is written, unless the caller is an admin;
the compares on the claim's and the card's revisions make those checks part
of the transaction. A set with no member is anyone's: the card is written
anew, with the caller as owner, by the first member to join it. A
transaction that fails because something changed is read and decided again.
So at every revision all members of a set carry the set's checksum; two
replicas admitting cards of different checksums concurrently get exactly one
winner, in every order. ``dissolve`` deletes the card only while the members
range is empty (``version == 0`` over the range), so it can never remove the
card of a set another replica has just joined.

A worker's generation is the revision of the transaction that admitted it (its
member key's mod_revision, which only an admission writes): every replica
agrees on it, and a re-registration gets a new one.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.membership.etcd import (
    Entry,
    Etcd,
    delete,
    get,
    keys_of,
    modified_at,
    prefix_end,
    put,
    version_is,
)
from kvstore.membership.layout import Layout, MemberRecord, NameClaim, SetCard, SetId
from kvstore.wire.card import WorkerCard
from kvstore.wire.errors import precondition, unavailable
from kvstore.wire.principal import LOCAL, Principal, check_owner, set_taken

MAX_ATTEMPTS = 32


@dataclass(frozen=True)
class Admitted:
    generation: int


@dataclass(frozen=True)
class Refused:
    """The set holds another checksum and has ``others`` members."""

    reference: WorkerCard  # the set's first admitted card
    checksum: str
    others: int


@dataclass(frozen=True)
class _SetView:
    """A set and a worker's claim as read at one revision."""

    card: Entry | None
    claim: Entry | None
    members: list[Entry]  # keys only: a set may have thousands of members of large cards


class WorkerSets:
    def __init__(self, etcd: Etcd, layout: Layout):
        self.etcd = etcd
        self.layout = layout

    async def _read(self, set_id: SetId, name: str) -> _SetView:
        members = self.layout.members(set_id)
        result = await self.etcd.txn(
            [],
            [
                get(self.layout.card(set_id)),
                get(self.layout.worker(name)),
                keys_of(members, prefix_end(members)),  # counted, never decoded
            ],
        )
        card, claim, listed = result.reads
        return _SetView(card[0] if card else None, claim[0] if claim else None, listed)

    async def admit(
        self,
        name: str,
        card: WorkerCard,
        checksum: str,
        lease: int,
        caller: Principal = LOCAL,
        *,
        set_owner: str | None = None,
        unclaimed_only: bool = False,
    ) -> Admitted | Refused:
        """Admit ``card`` (checksum ``checksum``, validated) as worker ``name``
        under ``lease`` for ``caller``, replacing its earlier admission.
        PERMISSION_DENIED, nothing written, when ``name`` is admitted for
        another principal, or the set has members and belongs to another
        principal, and ``caller`` is not an admin. ``set_owner``: whom a set
        this admission makes (or takes over empty) belongs to, when not
        ``caller`` (the CN a ``--tenant`` binding names for its namespace). ``unclaimed_only`` (a
        replica admitting again what its lost lease held): FAILED_PRECONDITION,
        nothing written, when the name was admitted again meanwhile."""
        set_id = SetId.of(card)
        layout = self.layout
        mine = layout.member(set_id, name)
        for _ in range(MAX_ATTEMPTS):
            view = await self._read(set_id, name)
            if unclaimed_only and view.claim is not None:
                raise precondition(f"worker {name!r} was admitted again while its lease was lost")
            claim = _record(NameClaim.decode, view.claim)
            if claim is not None:
                check_owner(f"worker name {name!r}", claim.owner, caller)
            others = [m for m in view.members if m.key != mine]
            # a card that does not decode fixes nothing an empty set must keep:
            # it is written anew; with members it is refused, naming the key
            fixed = _record(SetCard.decode, view.card, strict=bool(others))
            if fixed is not None and others and not caller.may_act_for(fixed.owner):
                raise set_taken(set_id)
            differs = fixed is None or (fixed.checksum, fixed.hash_format) != (
                checksum,
                card.hash_format,
            )
            if fixed is not None and others and differs:
                return Refused(fixed.card, fixed.checksum, len(others))
            # An empty set is anyone's: its card (checksum and owner) is written anew.
            owner = set_owner or caller.name
            refix = differs or (not others and fixed.owner != owner)
            compare = [
                modified_at(layout.card(set_id), view.card.mod_revision if view.card else 0),
                modified_at(layout.worker(name), view.claim.mod_revision if view.claim else 0),
            ]
            ops = []
            if claim is not None:
                before = claim.set_id
                if before != set_id:
                    ops.append(delete(layout.member(before, name)))
            if refix:  # fix (or re-fix) the set's checksum and owner: only with no other member
                members = layout.members(set_id)
                compare.append(version_is(members, 0, mine))
                compare.append(version_is(mine + "\0", 0, prefix_end(members)))
                ops.append(
                    put(
                        layout.card(set_id),
                        SetCard(checksum, card.hash_format, card, owner).encode(),
                    )
                )
            ops.append(put(layout.worker(name), NameClaim(set_id, caller.name).encode(), lease))
            ops.append(put(mine, MemberRecord(card, caller.name).encode(), lease))
            result = await self.etcd.txn(compare, ops)
            if result.succeeded:
                return Admitted(result.revision)
        raise unavailable(
            f"WorkerSet {set_id} changed {MAX_ATTEMPTS} times while admitting {name!r}"
        )

    async def remove(self, name: str, generation: int = 0, caller: Principal = LOCAL) -> int:
        """Remove worker ``name`` (that generation only, when given); the
        generation removed, or 0 when it is not admitted (as that generation).
        PERMISSION_DENIED, nothing deleted, unless ``caller`` admitted it or is
        an admin (the claim's revision is compared, so its owner cannot change
        between the check and the delete)."""
        for _ in range(MAX_ATTEMPTS):
            claim = await self.etcd.get(self.layout.worker(name))
            if claim is None:
                return 0
            held = _record(NameClaim.decode, claim)
            member = await self.etcd.get(self.layout.member(held.set_id, name))
            if member is None or (generation and member.mod_revision != generation):
                return 0
            check_owner(f"worker {name!r}", held.owner, caller)
            result = await self.etcd.txn(
                [
                    modified_at(claim.key, claim.mod_revision),
                    modified_at(member.key, member.mod_revision),
                ],
                [delete(claim.key), delete(member.key)],
            )
            if result.succeeded:
                return member.mod_revision
        raise unavailable(f"worker {name!r} changed {MAX_ATTEMPTS} times while removing it")

    async def dissolve(self, set_id: SetId) -> bool:
        """Delete the set's card if, and only if, the set has no member now."""
        members = self.layout.members(set_id)
        result = await self.etcd.txn(
            [version_is(members, 0, prefix_end(members))], [delete(self.layout.card(set_id))]
        )
        return result.succeeded


def _record(decode, entry: Entry | None, strict: bool = True):
    """``entry``'s record (None for no entry). One that does not decode (another
    tool wrote it, or another kvstore version) is FAILED_PRECONDITION naming the
    key, or None when not ``strict``: never a ValueError out of admission."""
    if entry is None:
        return None
    try:
        return decode(entry.value)
    except ValueError as exc:
        if not strict:
            return None
        raise precondition(
            f"etcd key {entry.key} holds a record this replica cannot read ({exc}); "
            "delete it or fix it (etcdctl) to admit or remove this worker"
        ) from None
