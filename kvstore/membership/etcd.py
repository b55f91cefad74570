"""A thin asyncio client for etcd v3: the one module that knows the client library.

    etcd = Etcd(EtcdConfig.parse("http://127.0.0.1:2379"))   # or https://, with EtcdTls
    lease = await etcd.grant(10)
    revision = await etcd.recreate("/kvstore/v1/stores/a", b"...", lease)
    revision = await etcd.recreate(key, value, lease, refuse=held_by_another)  # or its KVError
    entries, revision = await etcd.list_prefix("/kvstore/v1/stores/")
    async for change in etcd.watch_prefix("/kvstore/v1/stores/", revision + 1): ...
    result = await etcd.txn([version_is(key, 0)], [put(key, value, lease)])
    await etcd.close()

Keys are ``str`` (kvstore's are ASCII: see ``layout.py``), values ``bytes``.
Every call is bounded by ``EtcdConfig.timeout_s``; not reaching etcd, or etcd
failing a call, is a :class:`KVError` UNAVAILABLE naming the endpoint, except
a call naming a lease etcd no longer holds (it expired before the call ran):
NOT_FOUND (:func:`is_lease_gone`), so its caller can grant a fresh one. With
several endpoints a failed call moves the client to the next one.

The library is aetcd (asyncio, works with kvstore's grpcio and protobuf;
python-etcd3 does not import with them). Compares and operations for
:meth:`Etcd.txn` are built with the functions below, so no other module
imports it and another client could replace it here alone. aetcd 1.0 opens
plaintext channels only: :class:`_Client` opens the channel itself, over TLS
for ``https://`` endpoints (:class:`EtcdTls`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import aetcd
import aetcd.transactions as tx
import grpc
from aetcd import rpc, watcher

from kvstore.wire.errors import Code, KVError, unavailable

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "/kvstore/v1/"
DEFAULT_TTL_S = 10
MIN_TTL_S = 2  # etcd refuses shorter leases with its default election timeout
REQUIRE_LEADER = (("hasleader", "true"),)  # etcd's gRPC metadata, as etcd's own clients send
LEASE_NOT_FOUND = "requested lease not found"  # etcd's answer naming a lease it does not hold
# The channel notices a hung etcd by keepalive pings (etcd refuses pings more
# often than every 5 s) and redials a restarted one within about a second.
CHANNEL_OPTIONS = {
    "grpc.keepalive_time_ms": 5000,
    "grpc.keepalive_timeout_ms": 3000,
    "grpc.keepalive_permit_without_calls": 1,
    "grpc.initial_reconnect_backoff_ms": 200,
    "grpc.min_reconnect_backoff_ms": 200,
    "grpc.max_reconnect_backoff_ms": 1000,
}
# Keys one listing read asks etcd for at first: a listing of any size is pages,
# all read at the revision of the first. A page over gRPC's 4 MiB answer limit
# (a few dozen member records of large cards) is asked again with half the keys,
# and the client keeps the smaller size; one key (etcd holds values of 1.5 MiB
# at most) always fits.
LIST_PAGE_KEYS = 64
KEEPALIVE_STREAM_LEASES = 512  # leases refreshed over one LeaseKeepAlive stream


@dataclass(frozen=True)
class EtcdTls:
    """TLS to etcd (``https://`` endpoints): PEM files of the CA that signed etcd's
    certificate ("" for the system's roots), and of this process's client
    certificate and key, both or neither. etcd run with ``--client-cert-auth``
    wants them, and with its auth enabled takes the certificate's CN as the
    etcd user whose roles decide what this process may read and write."""

    ca: str = ""
    cert: str = ""
    key: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("--etcd-cert and --etcd-key go together; one is missing")

    def credentials(self) -> grpc.ChannelCredentials:
        """The channel credentials, the files read now (a rotated certificate is
        taken at the next connection); ValueError names a file that cannot be read."""
        ca, cert, key = (self._read(flag, path) for flag, path in self._files())
        return grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )

    def signature(self) -> tuple:
        """What changes when a file is replaced (a rotation): each file's size and
        modification time (None for one that cannot be read now)."""
        out = []
        for _, path in self._files():
            try:
                info = os.stat(path) if path else None
            except OSError:
                info = None
            out.append((info.st_mtime_ns, info.st_size) if info is not None else None)
        return tuple(out)

    def _files(self) -> tuple[tuple[str, str], ...]:
        return (("--etcd-ca", self.ca), ("--etcd-cert", self.cert), ("--etcd-key", self.key))

    @staticmethod
    def _read(flag: str, path: str) -> bytes | None:
        if not path:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise ValueError(f"{flag} {path!r}: {exc.strerror or exc}") from None


@dataclass(frozen=True)
class EtcdConfig:
    """Where etcd is and how kvstore uses it."""

    endpoints: tuple[str, ...]  # host:port, tried in order
    ttl_s: int = DEFAULT_TTL_S  # lease of every registration; kept alive every ttl_s / 3
    prefix: str = DEFAULT_PREFIX  # every kvstore key lies under it
    timeout_s: float = 2.0  # one etcd call at most
    tls: EtcdTls | None = None  # None: plaintext (http://)

    @classmethod
    def parse(
        cls,
        urls: str,
        ttl_s: int = DEFAULT_TTL_S,
        prefix: str = DEFAULT_PREFIX,
        tls: EtcdTls | None = None,
    ) -> EtcdConfig:
        """``"http://h1:2379,h2:2379"`` (scheme optional: plaintext), or every
        endpoint ``https://`` (TLS, with ``tls`` or the system's roots; its files
        are checked here). ValueError names what is wrong."""
        endpoints, schemes = [], set()
        for url in urls.split(","):
            url = url.strip()
            scheme, sep, rest = url.partition("://")
            if not sep:
                scheme, rest = "http", url
            if scheme not in ("http", "https"):
                raise ValueError(f"--etcd {url!r}: the scheme is http:// or https://")
            schemes.add(scheme)
            host, sep, port = rest.rstrip("/").rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"--etcd {url!r}: expected HOST:PORT or http(s)://HOST:PORT")
            endpoints.append(f"{host}:{port}")
        if len(schemes) > 1:
            raise ValueError(f"--etcd {urls!r}: every endpoint http://, or every one https://")
        if "https" in schemes:
            tls = tls or EtcdTls()
            tls.credentials()  # a file that cannot be read is refused at start
        elif tls is not None:
            raise ValueError(
                "--etcd-ca, --etcd-cert and --etcd-key are for TLS: give https:// endpoints"
            )
        if not ttl_s >= MIN_TTL_S:
            raise ValueError(f"--etcd-ttl must be at least {MIN_TTL_S} s, got {ttl_s}")
        if not (prefix.startswith("/") and prefix.isascii() and prefix.isprintable()):
            raise ValueError(
                f"--etcd-prefix must be printable ASCII starting with '/', got {prefix!r}"
            )
        prefix = prefix if prefix.endswith("/") else prefix + "/"
        return cls(tuple(endpoints), ttl_s, prefix, tls=tls)


@dataclass(frozen=True)
class Entry:
    """One key as etcd holds it."""

    key: str
    value: bytes
    create_revision: int  # the revision that created this incarnation of the key
    mod_revision: int  # the revision that last wrote it
    lease: int  # 0 when the key lives without a lease


@dataclass(frozen=True)
class Change:
    """One watched change: a put (``entry`` is the new value) or a delete
    (``entry`` is the value before it, when etcd still had it)."""

    deleted: bool
    entry: Entry


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int  # the store's revision after the transaction (0 when unknown)
    reads: list[list[Entry]]  # one list per get of the branch that ran


def prefix_end(prefix: str) -> str:
    """The range end that covers every key starting with ``prefix`` (an ASCII key)."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


def version_is(key: str, version: int, range_end: str | None = None) -> tx.BaseCompare:
    """True when the key's version is ``version`` (0: absent); with ``range_end``
    for every key in ``[key, range_end)`` (an empty range is version 0)."""
    return tx.Version(key.encode(), range_end.encode() if range_end else None) == version


def modified_at(key: str, revision: int) -> tx.BaseCompare:
    """True when the key was last written at ``revision`` (0: absent)."""
    return tx.Mod(key.encode()) == revision


def put(key: str, value: bytes, lease: int = 0) -> tx.Put:
    return tx.Put(key.encode(), value, lease=lease)


def delete(key: str) -> tx.Delete:
    return tx.Delete(key.encode())


def get(key: str, range_end: str | None = None) -> tx.Get:
    return tx.Get(key.encode(), range_end.encode() if range_end else None)


class _KeysOnly(tx.Get):
    """A get whose entries come without their values (``keys_of``)."""


def keys_of(key: str, range_end: str) -> tx.Get:
    """The keys in ``[key, range_end)`` with their revisions and leases, their
    values left out (``Entry.value`` is b""): what a transaction needs to count
    or name keys without reading records of any size."""
    return _KeysOnly(key.encode(), range_end.encode())


def _entry(kv) -> Entry:
    # a key no kvstore wrote may not be UTF-8 (ours are percent-encoded): it
    # reads as one no layout parses, never as an error that stops a follower
    key = kv.key.decode(errors="replace")
    return Entry(key, kv.value, kv.create_revision, kv.mod_revision, kv.lease)


class _Client(aetcd.Client):
    """aetcd's client over a channel of our making: TLS with ``credentials``,
    else plaintext (aetcd 1.0's own ``connect`` opens plaintext channels only).
    The rest is aetcd's; no user name and password (etcd's tokens die with a
    restarted member): etcd authenticates a client by its certificate's CN."""

    def __init__(self, host: str, port: int, credentials: grpc.ChannelCredentials | None, **kw):
        super().__init__(host, port, **kw)
        self._credentials = credentials
        self.page_keys = LIST_PAGE_KEYS  # keys a listing page asks for (range_page)

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        target, options = f"{self._host}:{self._port}", list(self._options.items())
        if self._credentials is None:
            self.channel = rpc.insecure_channel(target, options=options)
        else:
            self.channel = rpc.secure_channel(target, self._credentials, options=options)
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self._watcher = watcher.Watcher(
            rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
        )
        self._connected.set()

    def _ops_to_requests(self, ops):
        # aetcd's transaction ops carry no keys_only: set it on ours
        requests = super()._ops_to_requests(ops)
        for op, request in zip(ops, requests, strict=True):
            if isinstance(op, _KeysOnly):
                request.request_range.keys_only = True
        return requests

    async def latest_page(self, key: bytes, range_end: bytes):
        """The key of ``[key, range_end)`` written last, without its value."""
        await self.connect()
        request = rpc.RangeRequest(
            key=key,
            range_end=range_end,
            limit=1,
            keys_only=True,
            sort_order=rpc.RangeRequest.DESCEND,
            sort_target=rpc.RangeRequest.MOD,
        )
        try:
            return await self.kvstub.Range(request, timeout=self._timeout, metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            raise aetcd.ClientError(exc.details() or exc.code().name) from None

    async def refresh_leases(self, leases: Sequence[int]) -> dict[int, int]:
        """Keep each of ``leases`` alive once, over one LeaseKeepAlive stream (one
        stream a lease cost a round of a few thousand leases more than 2 s); each
        answered lease's TTL (0: gone). A lease the stream ended before answering
        is missing."""
        await self.connect()
        call = self.leasestub.LeaseKeepAlive(
            (rpc.LeaseKeepAliveRequest(ID=lease) for lease in leases),
            timeout=self._timeout,
            metadata=self.metadata,
        )
        ttls: dict[int, int] = {}
        wanted = len(set(leases))
        try:
            async for reply in call:
                ttls[reply.ID] = reply.TTL
                if len(ttls) == wanted:
                    break
        except grpc.aio.AioRpcError as exc:  # reported as aetcd's own calls report it
            raise aetcd.ClientError(exc.details() or exc.code().name) from None
        finally:
            call.cancel()
        return ttls

    async def range_page(self, key: bytes, range_end: bytes, revision: int):
        """The first keys of ``[key, range_end)`` at ``revision`` (0: the latest), in
        key order, as many as fit one answer (``page_keys`` at most); etcd's
        RangeResponse (``more``: keys remain)."""
        await self.connect()
        while True:
            request = rpc.RangeRequest(
                key=key, range_end=range_end, revision=revision, limit=self.page_keys
            )
            try:
                return await self.kvstub.Range(
                    request, timeout=self._timeout, metadata=self.metadata
                )
            except grpc.aio.AioRpcError as exc:  # reported as aetcd's own calls report it
                code = exc.code()
                if code is grpc.StatusCode.RESOURCE_EXHAUSTED and self.page_keys > 1:
                    self.page_keys //= 2  # over the answer limit: fewer keys a page
                    continue
                if code is grpc.StatusCode.OUT_OF_RANGE:  # that revision was compacted
                    raise aetcd.RevisionCompactedError(revision) from None
                raise aetcd.ClientError(exc.details() or code.name) from None


@dataclass(frozen=True)
class Refreshed:
    """One round of lease keepalives: each answered lease's TTL (0: gone), and
    why some went unanswered (the first failed stream's error), if any did."""

    ttls: dict[int, int]
    failure: KVError | None = None


class Etcd:
    """One connection to an etcd cluster, shared by a process's users of it."""

    def __init__(self, config: EtcdConfig):
        self.config = config
        self._endpoint = 0
        self._client: aetcd.Client | None = None
        self._tls_signature: tuple | None = None  # the TLS files' when the client was made
        self._closing: set[asyncio.Task] = set()

    @property
    def endpoint(self) -> str:
        return self.config.endpoints[self._endpoint]

    def _connected(self) -> aetcd.Client:
        if self._client is None:
            host, _, port = self.endpoint.rpartition(":")
            tls = self.config.tls
            try:
                self._tls_signature = None if tls is None else tls.signature()
                credentials = None if tls is None else tls.credentials()
            except ValueError as exc:  # a TLS file gone since the start
                raise unavailable(f"etcd {self.endpoint}: {exc}") from None
            self._client = _Client(
                host, int(port), credentials, timeout=self.config.timeout_s, options=CHANNEL_OPTIONS
            )
            # every call and watch asks for a member with a leader: a member cut off
            # from its cluster answers "no leader" (we move to the next endpoint) and
            # cancels our watches (we list again), instead of serving a frozen view
            # and a watch that never fires. aetcd sends the metadata it holds when it
            # connects, on every call and on its watch stream.
            self._client.metadata = REQUIRE_LEADER
        return self._client

    def _failed(self, client: aetcd.Client) -> None:
        """A call on ``client`` failed: with several endpoints, move to the next;
        with one, a new client only when TLS files were replaced since it was
        made (gRPC reconnects a channel with the credentials it was made with;
        closing it would also end every call and watch on it)."""
        if client is not self._client:
            return
        if len(self.config.endpoints) > 1:
            self._endpoint = (self._endpoint + 1) % len(self.config.endpoints)
        elif self.config.tls is None or self.config.tls.signature() == self._tls_signature:
            return
        self._client = None
        task = asyncio.get_running_loop().create_task(client.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _call(self, what: str, fn):
        """``fn(client)``, bounded; tried once on each endpoint until one answers."""
        for attempt in range(len(self.config.endpoints)):
            client, endpoint = self._connected(), self.endpoint
            try:
                async with bounded(self.config.timeout_s):
                    return await fn(client)
            except aetcd.ClientError as exc:
                if LEASE_NOT_FOUND in str(exc):  # etcd answered: no other endpoint would differ
                    raise lease_gone(endpoint, what) from None
                if isinstance(exc, aetcd.RevisionCompactedError):  # etcd answered, too
                    raise _compacted(endpoint, what, exc.compacted_revision) from None
                self._failed(client)
                if attempt + 1 == len(self.config.endpoints):
                    raise _unreachable(endpoint, what, exc) from None
            except (TimeoutError, OSError) as exc:
                self._failed(client)
                if attempt + 1 == len(self.config.endpoints):
                    raise _unreachable(endpoint, what, exc) from None
        raise AssertionError("unreachable")

    # -- keys --------------------------------------------------------------

    async def get(self, key: str) -> Entry | None:
        kv = await self._call(f"get {key}", lambda c: c.get(key.encode()))
        return None if kv is None else _entry(kv)

    async def list_prefix(self, prefix: str) -> tuple[list[Entry], int]:
        """Every key under ``prefix`` and the revision they were read at: in pages
        (``LIST_PAGE_KEYS``), each read at the first one's revision (compacted
        meanwhile: UNAVAILABLE, the caller lists again)."""
        start, end = prefix.encode(), prefix_end(prefix).encode()
        entries: list[Entry] = []
        revision = 0
        while True:
            page = await self._call(
                f"list {prefix}",
                lambda c, start=start, at=revision: c.range_page(start, end, at),
            )
            revision = revision or page.header.revision
            entries += [_entry(kv) for kv in page.kvs]
            if not page.more or not page.kvs:
                return entries, revision
            start = page.kvs[-1].key + b"\0"

    async def last_modified(self, prefix: str) -> int:
        """The revision of the latest write still held under ``prefix`` (0: no key),
        read as one key without its value, however many keys there are."""
        start, end = prefix.encode(), prefix_end(prefix).encode()
        page = await self._call(f"latest of {prefix}", lambda c: c.latest_page(start, end))
        return page.kvs[0].mod_revision if page.kvs else 0

    async def txn(self, compare: Sequence, success: Sequence, failure: Sequence = ()) -> TxnResult:
        """One transaction: ``success`` runs when every compare holds, else ``failure``."""
        ok, responses = await self._call(
            "transaction",
            lambda c: c.transaction(
                compare=list(compare), success=list(success), failure=list(failure)
            ),
        )
        revision, reads = 0, []
        for response in responses:
            if isinstance(response, list):  # a get: [(value, Get), ...]
                reads.append([_entry(kv) for _, kv in response])
                revision = max([revision] + [kv.header.revision for _, kv in response])
            else:
                kind = response.WhichOneof("response")
                revision = max(revision, getattr(response, kind).header.revision)
        return TxnResult(ok, revision, reads)

    async def recreate(
        self,
        key: str,
        value: bytes,
        lease: int,
        refuse: Callable[[Entry], KVError | None] | None = None,
    ) -> int:
        """Put ``key`` as a new key (deleting an earlier incarnation first), so its
        create revision is new; returns that revision. With ``refuse``, an
        incarnation found is deleted only when ``refuse(entry)`` is None; else
        what it returned is raised and the key is left as it is (the create
        and the read happen in one transaction, the delete only while the key
        is still the one ``refuse`` was shown)."""
        for _ in range(8):
            result = await self.txn([version_is(key, 0)], [put(key, value, lease)], [get(key)])
            if result.succeeded:
                return result.revision
            held = result.reads[0] if result.reads else []
            if not held:
                continue  # deleted meanwhile: create it
            refusal = None if refuse is None else refuse(held[0])
            if refusal is not None:
                raise refusal
            await self.txn([modified_at(key, held[0].mod_revision)], [delete(key)])
        raise unavailable(f"etcd {self.endpoint}: {key} is rewritten by someone else meanwhile")

    # -- leases ------------------------------------------------------------

    async def grant(self, ttl_s: int) -> int:
        lease = await self._call("lease grant", lambda c: c.lease(ttl_s))
        return lease.id

    async def refresh(self, lease: int) -> int:
        """Keep ``lease`` alive once; its TTL in seconds, 0 when it is gone."""
        reply = await self._call("lease keepalive", lambda c: c.refresh_lease(lease))
        return reply.TTL if reply is not None else 0

    async def refresh_all(self, leases: Sequence[int]) -> Refreshed:
        """Keep every one of ``leases`` alive once: each answered lease's TTL in
        seconds (0: gone); a lease left unanswered is missing, and the first
        failed stream's error says why. Streams of ``KEEPALIVE_STREAM_LEASES``
        run side by side (10,000 leases on a local etcd: ~0.35 s; one stream:
        1.1 s; a stream a lease: 1.5 s for 4,096). Every stream failing raises
        the first one's error."""
        chunks = [
            leases[i : i + KEEPALIVE_STREAM_LEASES]
            for i in range(0, len(leases), KEEPALIVE_STREAM_LEASES)
        ]
        answers = await asyncio.gather(
            *(
                self._call("lease keepalives", lambda c, chunk=chunk: c.refresh_leases(chunk))
                for chunk in chunks
            ),
            return_exceptions=True,
        )
        ttls: dict[int, int] = {}
        failure: KVError | None = None
        for answer in answers:
            if isinstance(answer, KVError):
                failure = failure or answer
                continue
            if isinstance(answer, BaseException):
                raise answer
            ttls.update(answer)
        if failure is not None and not ttls:
            raise failure
        return Refreshed(ttls, failure)

    async def revoke(self, lease: int) -> None:
        """End ``lease`` now, deleting its keys in one revision (a gone lease is no error)."""
        try:
            await self._call("lease revoke", lambda c: c.revoke_lease(lease))
        except KVError as exc:
            if not is_lease_gone(exc):
                raise

    # -- watches -----------------------------------------------------------

    async def watch_prefix(self, prefix: str, start_revision: int) -> AsyncIterator[Change]:
        """Every change under ``prefix`` from ``start_revision`` on, in revision order.

        Ends only by raising UNAVAILABLE (etcd gone, the stream broken, or the
        revision compacted): the caller lists again and watches anew.
        """
        client, endpoint, what = self._connected(), self.endpoint, f"watch {prefix}"
        try:
            async with bounded(self.config.timeout_s):
                watch = await client.watch_prefix(
                    prefix.encode(), start_revision=start_revision, prev_kv=True
                )
        except aetcd.RevisionCompactedError:  # etcd answered: list again, same endpoint
            raise _compacted(endpoint, what, start_revision) from None
        except (aetcd.ClientError, TimeoutError, OSError) as exc:
            self._failed(client)
            raise _unreachable(endpoint, what, exc) from None
        try:
            async for event in watch:
                if event.kind != "DELETE":
                    yield Change(False, _entry(event.kv))
                elif event.prev_kv is not None and event.prev_kv.key:
                    yield Change(True, _entry(event.prev_kv))
                else:  # its value before was compacted away: who held it is unknown
                    raise unavailable(
                        f"etcd {endpoint}: {what}: a delete came without the value it "
                        "deleted (compacted meanwhile); listing again"
                    )
        except aetcd.RevisionCompactedError:
            raise _compacted(endpoint, what, start_revision) from None
        except (aetcd.ClientError, OSError) as exc:
            self._failed(client)
            raise _unreachable(endpoint, what, exc) from None
        finally:
            with contextlib.suppress(Exception):  # the stream may be gone already
                async with asyncio.timeout(1.0):
                    await watch.cancel()
        raise unavailable(f"etcd {endpoint}: {what} ended")

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):  # closing a dead channel may fail: it is closed
                async with bounded(self.config.timeout_s):
                    await client.close()
        for task in list(self._closing):
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.config.timeout_s):
                    await task


@contextlib.asynccontextmanager
async def bounded(seconds: float) -> AsyncIterator[None]:
    """``asyncio.timeout(seconds)`` around an aetcd call, and a cancel it dropped
    raised after all. aetcd waits with Python 3.11's ``asyncio.wait_for``, which
    returns the inner result when the cancel comes in the very loop pass that
    result arrives: the cancel is lost, though the task still counts it."""
    task = asyncio.current_task()
    asked = task.cancelling() if task is not None else 0
    async with asyncio.timeout(seconds):
        yield
    if task is not None and task.cancelling() > asked:
        raise asyncio.CancelledError


async def cancel_task(task: asyncio.Task, again_s: float = 5.0) -> None:
    """Cancel ``task`` and wait for it to end: a CancelledError of its own is
    swallowed, any other exception raised; a cancel of the caller is passed on
    to ``task`` and raised. :func:`bounded` catches the cancels aetcd drops; as a
    backstop a task still running after ``again_s`` is cancelled again (longer
    than any cleanup a cancel starts: an etcd call is bounded by its timeout)."""
    try:
        while not task.done():
            task.cancel()
            await asyncio.wait([task], timeout=again_s)
            if not task.done():
                log.warning("a task dropped a cancel; cancelling it again: %r", task)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not task.cancelled():
        task.result()  # what it raised on the way out


def lease_gone(endpoint: str, what: str) -> KVError:
    return KVError(
        Code.NOT_FOUND, f"etcd {endpoint}: {what}: the lease is gone (expired or revoked)"
    )


def is_lease_gone(exc: BaseException) -> bool:
    """Whether ``exc`` says a lease named in the call no longer exists in etcd
    (the only NOT_FOUND this module raises)."""
    return isinstance(exc, KVError) and exc.code is Code.NOT_FOUND


def _compacted(endpoint: str, what: str, revision: int) -> KVError:
    return unavailable(f"etcd {endpoint}: {what}: revision {revision} was compacted; listing again")


def _unreachable(endpoint: str, what: str, exc: BaseException) -> KVError:
    detail = str(exc) or type(exc).__name__
    return unavailable(f"etcd {endpoint}: {what} failed: {detail}")
