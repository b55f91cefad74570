"""The workers a store relays GPU-tier events for, and their admissions in etcd.

    relayed = RelayedWorkers(etcd, layout, on_readmitted, "store a")
    relayed.add("w0")    # on the first GPU-tier event relayed for w0: follows workers/
    await relayed.close()

A replica indexes the GPU-tier blocks a store relays for a worker under the
worker's current generation, and a new generation starts empty (the worker may
be a new process). When a worker this store relays for is admitted again (its
lease was lost and its replica re-admitted it, or it registered again through
another replica), or is admitted only after the store relayed for it (the
replicas dropped those events: unknown worker), ``on_readmitted`` runs and the
store sends every replica its snapshot again, relayed blocks included. A
replica applies a snapshot only once it has applied every admission etcd
holds (``RouterReplica.workers_settled``), so the blocks land on the new
generation whichever of the two hears of it first. The name claims
(``workers/<name>``) are followed, their mod revision being the generation.
docs/design.md §5 (On etcd), §6.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvstore.membership.directory import Directory
from kvstore.membership.etcd import Change, Entry, Etcd
from kvstore.membership.layout import Layout

log = logging.getLogger(__name__)


class RelayedWorkers:
    def __init__(self, etcd: Etcd, layout: Layout, on_readmitted: Callable[[], None], what: str):
        self.layout = layout
        self.on_readmitted = on_readmitted
        self.what = what
        self.generations: dict[str, int] = {}  # relayed worker -> its claim's revision (0: none)
        self._listed = False
        self._directory = Directory(etcd, layout.workers, self, f"{what}: relayed workers")

    def add(self, name: str) -> None:
        """Follow ``name``'s admissions from now on (starts following etcd)."""
        if name not in self.generations:
            self.generations[name] = 0
            self._directory.start()

    def _name(self, entry: Entry) -> str:
        return self.layout.name_under(self.layout.workers, entry.key)

    def reset(self, entries: list[Entry]) -> None:
        listed = {self._name(e): e.mod_revision for e in entries}
        moved = [
            name
            for name, known in self.generations.items()
            if listed.get(name, 0) not in (0, known)
        ]
        self.generations = {name: listed.get(name, 0) for name in self.generations}
        if moved and self._listed:  # the first listing is what the feeds just sent against
            self._readmitted(moved)
        self._listed = True

    def changed(self, change: Change) -> None:
        name = self._name(change.entry)
        known = self.generations.get(name)
        if known is None:
            return
        if change.deleted:
            self.generations[name] = 0
        elif change.entry.mod_revision != known:
            self.generations[name] = change.entry.mod_revision
            self._readmitted([name])

    def _readmitted(self, names: list[str]) -> None:
        log.info(
            "%s: %s admitted again; sending every replica our snapshot again",
            self.what,
            ", ".join(sorted(names)[:4]) + (" ..." if len(names) > 4 else ""),
        )
        self.on_readmitted()

    async def close(self) -> None:
        await self._directory.close()
