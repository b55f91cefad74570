"""One-sided peer reads (RMA) through NIXL: a pool registered once, slot runs
read straight from a peer's pool into reserved local slots (docs/design.md §4).

The two-sided protocol (REQUEST, REPLY, GO, one tag message per segment) needs
the serving peer's event loop for every byte. Here the serving side only
registers its pool with the transport once and hands out a :class:`PeerCard`
(NIXL agent metadata plus where its registered region lies); the fetching side
loads the card once per peer and then reads any runs of the peer's region into
its own registered region with no work on the peer: one NIXL READ request per
chunk of runs, all posted at once so later chunks' descriptors are built while
earlier chunks move.

The serving side calls :meth:`RmaEndpoint.progress` every millisecond or so: a
peer's first read sets up its connection through it, and it hands over the
peers' notices (one-way messages such as "done reading lease N"). Reads over a
transport that needs no peer work (cma between processes on one host, RDMA,
cuda_ipc) then go on without it; over tcp every read waits for it.

What stays with the caller (the store): which runs to read (a lease on the
peer pins them, and the peer's reply says where they lie), reserving the local
slots, committing them once :meth:`RmaEndpoint.read` returned, and aborting
the reservation when it raised. A failed read drops the peer (its endpoint
closes, so nothing of the read lands later); connect again with its card. A
read that raised :class:`ReadUnsettled` may still write into local memory: its
reservation must never be reused.

Bounds: a card is at most MAX_CARD_BYTES and parsed without pickle (NIXL's own
``get_serialized_descs`` pickles, so it is not used); a read holds at most
MAX_RUNS_PER_READ runs, each inside both registered regions. Everything is
checked before anything is posted.

NIXL is optional: without it :func:`available` says why, and the two-sided
path is the only one. One endpoint is used from one thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import itertools
import logging
import os
import struct
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from typing import Any, NamedTuple

import numpy as np

from kvstore.transfer.errors import PeerTimeout, PeerUnavailable
from kvstore.transfer.wire import MAX_SLOTS_PER_FETCH
from kvstore.wire.devices import Device
from kvstore.wire.errors import Code, KVError, invalid

log = logging.getLogger(__name__)

MAX_RUNS_PER_READ = MAX_SLOTS_PER_FETCH  # a read never holds more runs than a fetch has slots
MAX_METADATA_BYTES = 256 << 10  # one agent's NIXL metadata (about 0.5 KiB with one region)
MAX_AGENT_NAME_LEN = 256
MAX_NOTICE_BYTES = 4 << 10  # a notice names a lease, nothing more
DEFAULT_CHUNK_BYTES = 32 << 20  # bytes per NIXL request of a read; later ones prepare meanwhile
FEW_RUNS = 16  # up to this many, a bounds check runs on Python ints (numpy costs more)
SETTLE_S = 5.0  # after a failure, how long released-but-busy requests get to settle
MEMORY_KINDS = ("DRAM", "VRAM")
# UCX settings ucxx puts in the environment for the two-sided path that NIXL's
# UCX must not see: with UCX_RNDV_THRESH set, UCX reads host memory of a peer on
# this host by software emulation over tcp (the peer's progress answers each
# read, ~1 ms a read) instead of with cma (process_vm_readv, no peer work).
TWO_SIDED_ONLY_ENV = ("UCX_RNDV_THRESH",)

_CARD = struct.Struct("<4sBBHQQII")  # magic, version, memory kind, reserved, addr, nbytes,
# device, metadata length; then the metadata
_CARD_MAGIC = b"KVRM"
_CARD_VERSION = 1
MAX_CARD_BYTES = _CARD.size + MAX_METADATA_BYTES


@contextlib.contextmanager
def _without(names: tuple[str, ...]) -> Iterator[None]:
    """The environment without ``names`` while NIXL's UCX reads its configuration."""
    saved = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


@dataclass(frozen=True)
class Availability:
    """Whether one-sided reads can be used here, and if not, why."""

    ok: bool
    reason: str

    def __bool__(self) -> bool:
        return self.ok


class NixlWheel(NamedTuple):
    """One wheel NIXL's Python API comes in."""

    distribution: str  # what pip installs
    module: str  # where its Python API is
    cuda: str  # the CUDA major it is built for ('': the meta-package, any)


NIXL_WHEELS = (
    NixlWheel("nixl-cu12", "nixl_cu12", "12"),
    NixlWheel("nixl-cu13", "nixl_cu13", "13"),  # e.g. a torch cu130 GPU host
    NixlWheel("nixl", "nixl._api", ""),
)


def _nixl() -> Any:
    """The NIXL Python API, from whichever wheel is installed (NIXL_WHEELS)."""
    return _loaded()[1]


def _loaded() -> tuple[NixlWheel, Any]:
    """The first wheel of :func:`_nixl_order` whose module imports, and that module.

    NIXL logs at INFO to stdout by default (its Python and C++ halves both read
    NIXL_LOG_LEVEL): a server's output keeps to its own log unless asked."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    errors = []
    for wheel in _nixl_order():
        try:
            return wheel, importlib.import_module(wheel.module)
        except ImportError as err:
            errors.append(f"{wheel.module}: {err}")
    raise ImportError("; ".join(errors))


def _nixl_order() -> list[NixlWheel]:
    """NIXL_WHEELS, the one for the CUDA major of the loaded torch first (a CUDA 13
    host with nixl-cu12 installed too must not register VRAM through a CUDA 12 UCX)."""
    torch = sys.modules.get("torch")
    cuda = getattr(getattr(torch, "version", None), "cuda", None)
    major = str(cuda).partition(".")[0] if cuda else None
    return sorted(NIXL_WHEELS, key=lambda wheel: wheel.cuda != major)


def nixl_module() -> str:
    """The module NIXL's Python API is loaded from here (ImportError without one)."""
    return _loaded()[0].module


def nixl_version() -> str:
    """The name and version of the NIXL wheel one-sided reads load ('' without one)."""
    try:
        wheel, _ = _loaded()
    except ImportError:
        return ""
    try:
        return f"{wheel.distribution} {metadata.version(wheel.distribution)}"
    except metadata.PackageNotFoundError:  # importable, not installed by pip
        return wheel.distribution


def nixl_errors() -> tuple[type[Exception], ...]:
    """What NIXL raises: its binding's error types, plus RuntimeError from its wrapper."""
    package = _nixl().__name__.removesuffix("._api")
    bindings = importlib.import_module(f"{package}._bindings")
    found = [getattr(bindings, n) for n in dir(bindings) if n.endswith("Error")]
    return (RuntimeError, *(e for e in found if isinstance(e, type) and issubclass(e, Exception)))


def available() -> Availability:
    """Whether NIXL imports; the reason when it does not."""
    try:
        _nixl()
    except ImportError as err:
        return Availability(
            False, f"nixl is not importable ({err}): pip install nixl-cu12 (nixl-cu13 on CUDA 13)"
        )
    return Availability(True, "nixl imports")


class Region(NamedTuple):
    """A registered stretch of memory: host memory (DRAM) or one GPU's (VRAM)."""

    addr: int
    nbytes: int
    mem: str = "DRAM"
    device: int = 0  # the CUDA device for VRAM; 0 for DRAM


def pool_region(device: str, addr: int, nbytes: int) -> Region:
    """The region of a pool on ``device`` (a :class:`~kvstore.wire.devices.Device`
    name: "cpu" is host memory, "cuda" or "cuda:N" a GPU's); ValueError for another."""
    where = Device.parse(device)
    if where.is_host:
        return Region(addr, nbytes)
    return Region(addr, nbytes, "VRAM", where.gpu)


class PeerCard(NamedTuple):
    """What a peer hands out when peers meet: its agent and its registered region."""

    metadata: bytes  # NIXL agent metadata, parsed by NIXL
    region: Region

    def encode(self) -> bytes:
        kind = MEMORY_KINDS.index(self.region.mem)
        head = _CARD.pack(
            _CARD_MAGIC,
            _CARD_VERSION,
            kind,
            0,
            self.region.addr,
            self.region.nbytes,
            self.region.device,
            len(self.metadata),
        )
        return head + self.metadata

    @staticmethod
    def decode(blob: bytes) -> PeerCard:
        """Parse a card from a peer; refuse anything malformed or past the bounds."""
        if not _CARD.size <= len(blob) <= MAX_CARD_BYTES:
            raise invalid(f"peer card: {len(blob)} bytes, need {_CARD.size}..{MAX_CARD_BYTES}")
        magic, version, kind, _, addr, nbytes, device, length = _CARD.unpack_from(blob)
        if magic != _CARD_MAGIC or version != _CARD_VERSION:
            raise invalid(f"peer card: magic/version {magic!r}/{version}, want {_CARD_MAGIC!r}/1")
        if kind >= len(MEMORY_KINDS):
            raise invalid(f"peer card: memory kind {kind} unknown")
        if length != len(blob) - _CARD.size or not 0 < length <= MAX_METADATA_BYTES:
            raise invalid(f"peer card: metadata length {length} disagrees with the card")
        if not 0 < nbytes <= (1 << 64) - 1 - addr:
            raise invalid(f"peer card: region.nbytes {nbytes} at {addr:#x} out of range")
        region = Region(addr, nbytes, MEMORY_KINDS[kind], device)
        return PeerCard(bytes(blob[_CARD.size :]), region)


class Peer(NamedTuple):
    """A peer whose card was loaded: reads name it."""

    name: str
    region: Region


class SlotRuns(NamedTuple):
    """Runs to read: run i is ``nbytes[i]`` bytes at ``remote[i]`` in the peer's
    region, landing at ``local[i]`` in ours. Columns are uint64 arrays."""

    remote: np.ndarray
    local: np.ndarray
    nbytes: np.ndarray

    @staticmethod
    def of(remote: Any, local: Any, nbytes: Any) -> SlotRuns:
        cols = (np.asarray(c, dtype=np.uint64).reshape(-1) for c in (remote, local, nbytes))
        return SlotRuns(*cols)

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum(dtype=np.uint64))


class ReadStats(NamedTuple):
    """What one read did: bytes, runs, NIXL requests, host time building them, wall time."""

    nbytes: int
    runs: int
    chunks: int
    prep_s: float
    wall_s: float


class Notice(NamedTuple):
    """A peer's one-way message, e.g. "done reading lease 42"."""

    peer: str
    message: bytes


class ReadUnsettled(PeerUnavailable):
    """A read failed and a request of it could not be cancelled: it may still
    write into the local runs, which must never be reused."""


def check_runs(runs: SlotRuns, local: Region, remote: Region) -> None:
    """Refuse runs that are too many, empty, or outside either region (vectorised)."""
    n = len(runs.nbytes)
    if not (len(runs.remote) == len(runs.local) == n):
        raise invalid(f"runs: columns disagree ({len(runs.remote)}, {len(runs.local)}, {n})")
    if not 0 < n <= MAX_RUNS_PER_READ:
        raise invalid(f"runs: {n} runs, need 1..{MAX_RUNS_PER_READ}")
    for field, addrs, region in (("remote", runs.remote, remote), ("local", runs.local, local)):
        if inside(addrs, runs.nbytes, region):
            continue
        bad = outside(addrs, runs.nbytes, region)
        if len(bad):
            i = int(bad[0])
            raise invalid(
                f"runs.{field}[{i}]: {int(runs.nbytes[i])} bytes at {int(addrs[i]):#x} "
                f"not inside the {field} region {region.addr:#x}+{region.nbytes}"
            )


def inside(addrs: np.ndarray, nbytes: np.ndarray, region: Region) -> bool:
    """Whether every run (uint64 columns) lies wholly inside ``region``: what
    :func:`outside` finds empty, in a few reductions (no uint64 overflow)."""
    if not len(addrs):
        return True
    if len(addrs) <= FEW_RUNS:  # Python ints: no overflow, no numpy call per reduction
        lo, hi = region.addr, region.addr + region.nbytes
        return all(
            n > 0 and lo <= a and a + n <= hi
            for a, n in zip(addrs.tolist(), nbytes.tolist(), strict=True)
        )
    base, size = np.uint64(region.addr), np.uint64(region.nbytes)
    if int(nbytes.min()) == 0 or int(nbytes.max()) > region.nbytes or addrs.min() < base:
        return False
    return bool(np.all(addrs - base <= size - nbytes))


def outside(addrs: np.ndarray, nbytes: np.ndarray, region: Region) -> np.ndarray:
    """Indices of runs not wholly inside ``region`` (no uint64 overflow: offsets first)."""
    base, size = np.uint64(region.addr), np.uint64(region.nbytes)
    below = addrs < base
    offset = np.where(below, np.uint64(0), addrs - base)
    past = (nbytes == 0) | (nbytes > size) | (offset > size - np.minimum(nbytes, size))
    return np.flatnonzero(below | past)


class Chunk(NamedTuple):
    """One NIXL request's descriptors: Nx3 uint64 (addr, len, device) per side."""

    local: np.ndarray
    remote: np.ndarray


def plan_chunks(runs: SlotRuns, chunk_bytes: int, local_dev: int, remote_dev: int) -> list[Chunk]:
    """Split runs longer than ``chunk_bytes``, then group them by their start
    offset into chunks of about ``chunk_bytes`` (at most twice that). Vectorised."""
    if chunk_bytes <= 0:
        raise invalid(f"chunk_bytes: {chunk_bytes}, need > 0")
    step = np.uint64(chunk_bytes)
    remote, local, nbytes = runs.remote, runs.local, runs.nbytes
    if runs.total_bytes <= chunk_bytes:  # one request: nothing to split or group
        return [Chunk(_descs(local, nbytes, local_dev), _descs(remote, nbytes, remote_dev))]
    pieces = ((nbytes + step - np.uint64(1)) // step).astype(np.int64)
    if bool(np.any(pieces > 1)):
        run = np.repeat(np.arange(len(nbytes)), pieces)
        first = np.concatenate(([0], np.cumsum(pieces)[:-1])).astype(np.int64)
        skip = (np.arange(len(run)) - np.repeat(first, pieces)).astype(np.uint64) * step
        remote, local = remote[run] + skip, local[run] + skip
        nbytes = np.minimum(step, nbytes[run] - skip)
    starts = np.cumsum(nbytes, dtype=np.uint64) - nbytes
    group = starts // step
    edges = np.concatenate(([0], np.flatnonzero(np.diff(group)) + 1, [len(nbytes)]))
    lo, ro = _descs(local, nbytes, local_dev), _descs(remote, nbytes, remote_dev)
    return [Chunk(lo[a:b], ro[a:b]) for a, b in itertools.pairwise(edges.tolist())]


def _descs(addrs: np.ndarray, nbytes: np.ndarray, device: int) -> np.ndarray:
    out = np.empty((len(addrs), 3), dtype=np.uint64)
    out[:, 0], out[:, 1], out[:, 2] = addrs, nbytes, device
    return out


class _Failure(Exception):
    """A request of a read failed (not raised past PendingRead: the read is
    settled first, then PeerUnavailable, PeerTimeout or ReadUnsettled)."""

    def __init__(self, message: str, timeout: bool = False):
        super().__init__(message)
        self.message, self.timeout = message, timeout

    def error(self, settled: bool) -> KVError:
        if not settled:
            return ReadUnsettled(f"{self.message}; a request could not be cancelled")
        return PeerTimeout(self.message) if self.timeout else PeerUnavailable(self.message)


class PendingRead:
    """The NIXL requests of one read, posted; wait for them, or cancel them."""

    def __init__(self, endpoint: RmaEndpoint, peer: Peer, runs: SlotRuns, chunk_bytes: int):
        self._endpoint, self._peer = endpoint, peer
        self._started = time.perf_counter()
        chunks = plan_chunks(runs, chunk_bytes, endpoint.region.device, peer.region.device)
        self._handles: list[Any] = []
        self._failure: _Failure | None = None  # posting failed: raised by the wait
        for chunk in chunks:
            try:
                self._handles.append(endpoint.post(peer, chunk))
            except (KVError, *endpoint.errors) as err:
                message = f"read from {peer.name}: posting: {type(err).__name__}: {err}"
                self._failure = _Failure(message)
                break
        self._done = [False] * len(self._handles)
        prep = time.perf_counter() - self._started
        self._stats = ReadStats(runs.total_bytes, len(runs.nbytes), len(chunks), prep, 0.0)

    def poll(self) -> bool:
        """True once every request is done; raises (the read settled) on a failed one."""
        try:
            return self._poll()
        except _Failure as failure:
            raise failure.error(self.cancel_now() or self._settle()) from None

    def _poll(self) -> bool:
        if self._failure is not None:
            raise self._failure
        agent = self._endpoint.agent
        for i, handle in enumerate(self._handles):
            if self._done[i]:
                continue
            try:
                state = agent.check_xfer_state(handle)
            except self._endpoint.errors as err:  # the remote gone, ...
                raise _Failure(f"read from {self._peer.name}: {type(err).__name__}: {err}") from err
            if state == "ERR":
                raise _Failure(f"read from {self._peer.name}: request {i} failed")
            if state != "DONE":
                return False
            self._done[i] = True
        return True

    def wait(self, deadline: float) -> ReadStats:
        """Block until done or ``deadline`` (time.monotonic()) passes."""
        try:
            for pause in _pauses():
                if self._poll():
                    return self._finish()
                self._check_deadline(deadline)
                if pause:
                    time.sleep(pause)
        except _Failure as failure:
            raise failure.error(self.cancel_now() or self._settle()) from None
        raise AssertionError("unreachable")

    async def wait_async(self, deadline: float) -> ReadStats:
        """As :meth:`wait`, yielding to the event loop between polls, and while a
        failed read settles."""
        try:
            for pause in _pauses():
                if self._poll():
                    return self._finish()
                self._check_deadline(deadline)
                await asyncio.sleep(pause)
        except _Failure as failure:
            raise failure.error(self.cancel_now() or await self._settle_async()) from None
        raise AssertionError("unreachable")

    def _check_deadline(self, deadline: float) -> None:
        if time.monotonic() >= deadline:
            raise _Failure(f"read from {self._peer.name}: deadline passed", timeout=True)

    def cancel(self) -> bool:
        """Release every request (NIXL cancels one in flight); True once none can still write."""
        settled = True
        for handle in self._handles:
            try:
                self._endpoint.agent.release_xfer_handle(handle)
            except self._endpoint.errors as err:  # NIXL could not cancel it (yet)
                log.warning("rma: request to %s not released: %s", self._peer.name, err)
                settled = False
        return settled

    def _finish(self) -> ReadStats:
        self.cancel()
        return self._stats._replace(wall_s=time.perf_counter() - self._started)

    def cancel_now(self) -> bool:
        """Cancel every request and drop the peer: its endpoint closes, so no
        request of this read can write any more (a cancelled request over a
        software-emulated transport may otherwise still be answered). True when
        every request was released."""
        settled = self.cancel()
        self._endpoint.forget(self._peer)
        return settled

    def _settle(self) -> bool:
        """After :meth:`cancel_now` left a request NIXL would not release: try
        again for SETTLE_S (blocking: the synchronous wait's)."""
        end, settled = time.monotonic() + SETTLE_S, False
        while not settled and time.monotonic() < end:
            time.sleep(0.01)
            settled = self.cancel()
        return settled

    async def _settle_async(self) -> bool:
        """As :meth:`_settle`, sleeping on the loop."""
        end, settled = time.monotonic() + SETTLE_S, False
        while not settled and time.monotonic() < end:
            await asyncio.sleep(0.01)
            settled = self.cancel()
        return settled


def _pauses() -> Iterator[float]:
    """Poll pauses: a few immediate re-polls, then sleeps growing to 1 ms."""
    yield from (0.0,) * 64
    pause = 20e-6
    while True:
        yield pause
        pause = min(pause * 2, 1e-3)


class RmaEndpoint:
    """This process's NIXL agent with one registered region (a store's pool).

    ``progress_thread`` moves UCX progress to NIXL's thread; without it the
    waits progress the requests (which costs no extra core on a small host).
    """

    def __init__(
        self,
        region: Region,
        name: str = "",
        progress_thread: bool = False,
        backend: str = "UCX",
    ):
        if region.mem not in MEMORY_KINDS:
            raise invalid(f"region.mem: {region.mem!r}, need one of {MEMORY_KINDS}")
        if region.nbytes <= 0:
            raise invalid(f"region.nbytes: {region.nbytes}, need > 0")
        nixl = _nixl()
        self.errors = nixl_errors()
        self.name = name or f"kvstore-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        if len(self.name) > MAX_AGENT_NAME_LEN:
            raise invalid(f"name: {len(self.name)} characters, at most {MAX_AGENT_NAME_LEN}")
        config = nixl.nixl_agent_config(enable_prog_thread=progress_thread, backends=[backend])
        with _without(TWO_SIDED_ONLY_ENV):
            self.agent = nixl.nixl_agent(self.name, config)
        if backend not in self.agent.backends:
            raise KVError(Code.UNAVAILABLE, f"backend: NIXL has no {backend} backend here")
        self.region, self.backend = region, backend
        self._registered = self.agent.register_memory(
            [(region.addr, region.nbytes, region.device, "")], region.mem
        )
        self._peers: dict[str, bytes] = {}  # name -> the metadata loaded for it

    def card(self) -> PeerCard:
        """What to hand a peer so it can read this endpoint's region."""
        return PeerCard(self.agent.get_agent_metadata(), self.region)

    def connect(self, card: PeerCard) -> Peer:
        """Load a peer's card (once; again only if it changed, e.g. the peer restarted)."""
        if len(card.metadata) > MAX_METADATA_BYTES:
            raise invalid(f"card.metadata: {len(card.metadata)} bytes > {MAX_METADATA_BYTES}")
        try:
            name = self.agent.add_remote_agent(card.metadata)
        except self.errors as err:
            raise PeerUnavailable(f"peer card not loadable: {type(err).__name__}: {err}") from err
        try:
            name = name.decode() if isinstance(name, bytes) else str(name)
        except UnicodeDecodeError:  # NIXL loaded it under a name no read can give
            with contextlib.suppress(*self.errors):
                self.agent.remove_remote_agent(name)
            raise PeerUnavailable(f"peer card: agent name {name[:64]!r} is not UTF-8") from None
        self._peers[name] = card.metadata
        return Peer(name, card.region)

    def forget(self, peer: Peer) -> None:
        """Drop a peer (disconnects; its requests in flight fail)."""
        if self._peers.pop(peer.name, None) is None:
            return
        try:
            self.agent.remove_remote_agent(peer.name)
        except self.errors as err:
            log.warning("rma: dropping peer %s: %s", peer.name, err)

    def start_read(
        self, peer: Peer, runs: SlotRuns, chunk_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> PendingRead:
        """Check ``runs``, then post one READ request per chunk of them."""
        if peer.name not in self._peers:
            raise KVError(Code.FAILED_PRECONDITION, f"peer {peer.name}: not connected")
        check_runs(runs, self.region, peer.region)
        return PendingRead(self, peer, runs, chunk_bytes)

    def read(
        self,
        peer: Peer,
        runs: SlotRuns,
        timeout_s: float,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> ReadStats:
        """Read every run from ``peer`` into local memory within ``timeout_s``.

        Raises INVALID_ARGUMENT (nothing posted) for bad runs,
        :class:`PeerUnavailable` / :class:`PeerTimeout` once nothing can still
        write locally, :class:`ReadUnsettled` when that cannot be ensured.
        """
        deadline = time.monotonic() + timeout_s
        return self.start_read(peer, runs, chunk_bytes).wait(deadline)

    def post(self, peer: Peer, chunk: Chunk) -> Any:
        """Post one READ request for ``chunk``; its NIXL handle."""
        agent, mem_local, mem_remote = self.agent, self.region.mem, peer.region.mem
        local = agent.get_xfer_descs(chunk.local, mem_local)
        remote = agent.get_xfer_descs(chunk.remote, mem_remote)
        handle = agent.initialize_xfer("READ", local, remote, peer.name)
        state = agent.transfer(handle)
        if state == "ERR":
            agent.release_xfer_handle(handle)
            raise PeerUnavailable(f"read from {peer.name}: NIXL refused the request")
        return handle

    def notify(self, peer: Peer, message: bytes) -> None:
        """Send ``peer`` a one-way notice (it sees it in :meth:`progress`)."""
        if len(message) > MAX_NOTICE_BYTES:
            raise invalid(f"message: {len(message)} bytes > {MAX_NOTICE_BYTES}")
        try:
            self.agent.send_notif(peer.name, message)
        except self.errors as err:
            raise PeerUnavailable(f"notice to {peer.name}: {type(err).__name__}: {err}") from err

    def progress(self) -> list[Notice]:
        """Progress the transport and take the notices that arrived.

        A serving endpoint calls this every millisecond or so: a peer's first
        read waits for it (the connection is set up through it), later reads
        over RMA-capable transports (cma, RDMA, cuda_ipc) do not. Notices past
        MAX_NOTICE_BYTES are dropped.
        """
        notices = []
        for name, messages in self.agent.get_new_notifs().items():
            # a name is only logged: one that is not UTF-8 must not end the progress loop
            peer = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
            for message in messages:
                if len(message) <= MAX_NOTICE_BYTES:
                    notices.append(Notice(peer, bytes(message)))
                else:
                    log.warning("rma: a %d-byte notice from %s dropped", len(message), peer)
        return notices

    def close(self) -> None:
        """Drop every peer and unregister the region (no read may be in flight)."""
        for name in list(self._peers):
            self.forget(Peer(name, self.region))
        self.agent.deregister_memory(self._registered)
