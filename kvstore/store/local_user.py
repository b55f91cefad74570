"""Whose host memory a registration may name: the node's user behind the caller.

The store opens a rank's host memory (a ``/dev/shm`` object, or a worker's
descriptor through ``/proc/<pid>/fd``) with its own rights, often root's. A
rank may register only what its own user could open read-write itself, or
any local user could read another's KV cache out through Save and Load, and
overwrite it through Load (docs/design.md §1). The user is looked up once a
registration, only when it names host memory: the service edge reads it off
the caller's socket (``kvstore.service.peer_cred``); in-process callers are
this process's user. CUDA IPC handles are not checked here: a handle is a
capability its exporter hands out.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore.store.memory import os_shortage, thread_group
from kvstore.wire.errors import invalid, precondition
from kvstore.wire.principal import denied

ROOT = 0
ANYONE_RW = 0o006  # other users may read and write the object


@dataclass
class CallerUser:
    """The node user whose process sent one registration.

    ``lookup`` gives that user's uid, None for a caller not on this node (or
    not in its network namespace), and may raise OSError (the store short of
    descriptors); it is asked at most once. ``anyone`` (``kvstore serve
    --host-memory any``): no check, the store maps whatever it can open.
    """

    lookup: Callable[[], int | None]
    anyone: bool = False
    _uid: int | None = field(default=None, init=False, repr=False)
    _known: bool = field(default=False, init=False, repr=False)

    @classmethod
    def this_process(cls) -> CallerUser:
        """A caller in this process (tests, an embedded use): its user."""
        return cls(os.geteuid)

    @classmethod
    def unchecked(cls) -> CallerUser:
        return cls(lambda: None, anyone=True)

    def check_may_open(self, info: os.stat_result, what: str) -> None:
        """The caller's user could open the object ``info`` describes read-write:
        it owns it, is root, or the object is open to every user."""
        if self.anyone:
            return
        uid = self._user(what)
        if uid in (ROOT, info.st_uid) or info.st_mode & ANYONE_RW == ANYONE_RW:
            return
        raise denied(
            f"{what} belongs to uid {info.st_uid} (mode {stat.S_IMODE(info.st_mode):o}) "
            f"and the caller runs as uid {uid}: a rank registers host memory its own "
            "user may read and write"
        )

    def check_process(self, proc: int, pid: int, what: str) -> None:
        """The caller's user runs process ``pid`` (or is root): only they may open
        its descriptors through ``/proc``. ``proc``: ``/proc/<pid>`` open as a
        directory, which stays that process's (a pid reused meanwhile is not)."""
        if self.anyone:
            return
        uid = self._user(what)
        try:
            owner = os.fstat(proc).st_uid
            if owner == uid:  # a thread's own user: its process's too (they share fds)
                owner = os.stat(f"/proc/{thread_group(pid, proc)}").st_uid
        except FileNotFoundError:
            raise invalid(f"{what}: no such process on this node") from None
        if uid not in (ROOT, owner):
            raise denied(
                f"{what}: process {pid} runs as uid {owner} and the caller as uid {uid}: "
                "a rank registers descriptors of its own user's processes"
            )

    def check_descriptor(self, proc: int, fd: int, handle: int, what: str) -> None:
        """The process ``proc`` (``/proc/<pid>`` open as a directory) holds ``fd``
        open read-write, ``fd`` being the file this store opened as ``handle``
        through it. The store reopens ``/proc/<pid>/fd/<fd>`` with its own rights,
        not the descriptor's: one a process holds read-only (root's 0644 object,
        a memfd handed out read-only) would otherwise be mapped writable. Read off
        ``fdinfo`` in one read (access mode, mount and inode together), so a
        descriptor swapped meanwhile is refused, not mistaken."""
        if self.anyone or self._user(what) == ROOT:
            return
        try:
            theirs = _fdinfo(f"fdinfo/{fd}", proc)
            ours = _fdinfo(f"/proc/self/fdinfo/{handle}")
        except OSError as exc:
            doing = f"{what}: cannot read its fdinfo"
            raise os_shortage(exc, doing) or invalid(f"{doing}: {exc.strerror}") from exc
        if theirs is None or ours is None:
            raise invalid(f"{what} is not open in that process")
        file_, mine = theirs[1:], ours[1:]
        if None in file_ or file_ != mine:
            raise invalid(f"{what} changed while the store opened it; register again")
        if theirs[0] & os.O_ACCMODE != os.O_RDWR:
            raise denied(
                f"{what} is open read-only (flags {theirs[0]:o}) and the caller runs as uid "
                f"{self._uid}: a rank registers memory its descriptor may write"
            )

    def _user(self, what: str) -> int:
        if not self._known:
            try:
                self._uid = self.lookup()
            except OSError as exc:
                doing = f"{what}: cannot tell which user sent it"
                raise os_shortage(exc, doing) or precondition(f"{doing}: {exc.strerror}") from exc
            self._known = True
        if self._uid is None:
            raise precondition(
                f"{what}: host memory is registered only by a process of this node, in the "
                "store's network namespace (the caller's socket is not one); register GPU "
                "memory, connect from this node, or run the store with --host-memory any "
                "when every local user is trusted"
            )
        return self._uid


def _fdinfo(path: str, dir_fd: int | None = None) -> tuple[int, int | None, int | None] | None:
    """A descriptor's ``(flags, mnt_id, ino)`` from its ``fdinfo`` file (None for
    a field the kernel does not give), or None when it is not open."""
    try:
        with open(path, opener=lambda p, f: os.open(p, f | os.O_CLOEXEC, dir_fd=dir_fd)) as info:
            text = info.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)

    def number(name: str, base: int) -> int | None:
        value = fields.get(name, "").strip()
        return int(value, base) if value else None

    flags = number("flags", 8)
    return None if flags is None else (flags, number("mnt_id", 10), number("ino", 10))
