"""The transfer tests' harness: "nodes", each a spawned process with its own UCX
context, driven over a pipe, serving a numpy-pool SlotSource (or a real store
node) or fetching into a numpy-pool SlotSink that checks every byte; and
misbehaving peers, PeerServer subclasses that fail at a chosen point.

Both pools place slots back to back, so runs of slots coalesce into one UCX
message; ``gap_every=k`` leaves a gap after every k-th slot on that side, which
splits runs there, and ``lanes=L`` allocates like the store does with tp_size L
(slot s of every block belongs to lane s % L; a lane's slots of all blocks
come first, then the next lane's).
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing as mp
import os
import signal
import time
from typing import Any

import msgpack
import numpy as np

from kvstore.transfer.testing import (
    GAP,
    AheadMemorySink,
    MemorySink,
    MemorySource,
    Pool,
    slot_content,
)

CTX = mp.get_context("spawn")
NS = "model-a.0123456789abcdef"
CALL_TIMEOUT = 20.0


def torch_from(a: np.ndarray):
    import torch

    return torch.from_numpy(a)


# ---- misbehaving peers --------------------------------------------------------------


def peer_secret(secret: str) -> Any:
    """The PeerSecret of a test string ("" = none)."""
    from kvstore.transfer.handshake import PeerSecret

    return PeerSecret(secret.encode()) if secret else None


def make_server(
    behaviour: str,
    source: MemorySource,
    timeout_s: float,
    limits: dict | None = None,
    secret: str = "",
    rma: Any = None,
) -> Any:
    from kvstore.transfer import server as peer_server
    from kvstore.transfer import ucx, wire

    class Server(peer_server.PeerServer):
        sent_half = False
        requests = 0  # fetch requests it began to serve
        grants = 0  # one-sided reads it granted
        segments: list[int] = []  # bytes of each segment message sent

        async def _send_slots(self, conn, views, deadline, first=0):
            self.segments.extend(v.nbytes for v in views)
            if behaviour == "die_writing":  # half the slots, then die inside a send
                from tests.transfer.ucp_kill import die_in_send

                await super()._send_slots(conn, views[: len(views) // 2], deadline)
                self.sent_half = True
                die_in_send(conn.ep.ucp_endpoint)
            if behaviour not in ("die_half", "hang_half", "pause_half", "pause_long"):
                return await super()._send_slots(conn, _resized(behaviour, views), deadline)
            half = len(views) // 2
            assert half > 0, "serve with gap_every so that there is a half to send"
            await super()._send_slots(conn, views[:half], deadline)
            self.sent_half = True
            if behaviour == "die_half":
                os.kill(os.getpid(), signal.SIGKILL)
            await asyncio.sleep({"hang_half": 3600, "pause_long": 3.0}.get(behaviour, 1.0))
            await super()._send_slots(conn, views[half:], deadline, first=half)

        async def _progress_rma(self):
            if behaviour != "wedged_rma":  # its NIXL agent never progresses (tcp reads stall)
                await super()._progress_rma()

        async def _grant(self, conn, table, offer, granted):
            self.grants += 1
            _after_grant(conn, behaviour, self.grants)
            if behaviour == "bad_grant":  # addresses past the registered region
                offer = functools.partial(_shifted_grant, offer, np.uint64(1 << 40))
            return await super()._grant(conn, table, offer, granted)

        async def _serve(self, conn, body):
            self.requests += 1
            if behaviour == "mute" or (behaviour == "slow_first" and self.requests == 1):
                await asyncio.sleep(3600 if behaviour == "mute" else 3.0)  # slow_first: 3 s
            lie = _lying_offer(behaviour)
            if lie is not None:
                return await ucx.send_frame(conn, wire.Kind.REPLY, None, body=lie)
            return await super()._serve(conn, body)

    return Server(
        source,
        timeout_s=timeout_s,
        limits=peer_server.PortLimits(**(limits or {})),
        secret=peer_secret(secret),
        rma=rma,
    )


def _resized(behaviour: str, views: list[Any]) -> list[Any]:
    """``oversend`` / ``undersend``: every segment one byte longer / shorter than
    announced (zeros); else ``views``."""
    if behaviour not in ("oversend", "undersend"):
        return views
    grow = 1 if behaviour == "oversend" else -1
    return [np.zeros(v.nbytes + grow, np.uint8) for v in views]


def _lying_offer(behaviour: str) -> bytes | None:
    """The REPLY a lying peer sends instead of serving (None: it serves):
    ``evil_offer``, more blocks than asked of absurd sizes; ``bad_runs_*``, sane
    sizes with malformed run starts."""
    from kvstore.transfer import wire

    if behaviour == "evil_offer":
        return wire.encode_offer([[1 << 40]] * 9000)
    starts = {
        "bad_runs_unsorted": [3, 1],
        "bad_runs_range": [1, 99],
        "bad_runs_dup": [2, 2],
        "bad_runs_zero": [0],
        "bad_runs_lanes": [],
    }
    if behaviour not in starts:
        return None
    lanes = 3 if behaviour == "bad_runs_lanes" else 1
    return wire.encode_offer([[4096] * 4] * 2, starts[behaviour], lanes)


def _after_grant(conn: Any, behaviour: str, grants: int) -> None:
    """``cut_after_grant``: 50 ms after a grant, cut ``conn`` (from the second grant
    on, as a worker recreation would)."""
    if behaviour == "cut_after_grant" and grants > 1:
        asyncio.get_running_loop().call_later(0.05, conn.abort)


def _shifted_grant(offer: Any, shift: np.uint64, grant: Any) -> bytes:
    return offer(grant=grant._replace(addresses=grant.addresses + shift))


def rma_endpoint(mem: np.ndarray) -> Any:
    """A NIXL endpoint with ``mem`` (a test pool) registered."""
    from kvstore.transfer import rma

    return rma.RmaEndpoint(rma.Region(mem.ctypes.data, mem.nbytes))


def forged_metadata(metadata: bytes, agent_name: str, forgery: str) -> bytes:
    """An agent's NIXL metadata, forged: ``agent_name_not_utf8`` (NIXL loads it under
    a name that is not UTF-8) or ``ucx_address_ff`` (every length well-formed, its UCX
    worker address begins with 16 bytes of 0xff: UCX asserts on it and the process
    that loads it aborts)."""
    if forgery == "agent_name_not_utf8":
        name = agent_name.encode()
        assert metadata.count(name) == 1
        return metadata.replace(name, b"\xff" + name[1:])
    if forgery == "ucx_address_ff":
        at = metadata.index(b"UCX|c") + 5 + 8  # past the UCX section's 8-byte length
        return metadata[:at] + b"\xff" * 16 + metadata[at + 16 :]
    raise ValueError(f"forgery: {forgery!r}")


def forge_card(server: Any, forgery: str) -> None:
    """Make a started PeerServer with NIXL hand out a forged card."""
    from kvstore.transfer.rma import PeerCard

    if forgery:
        card = server.rma.card()
        metadata = forged_metadata(card.metadata, server.rma.name, forgery)
        server._card = PeerCard(metadata, card.region).encode()


OWN_BLOCK = 1 << 40  # the fetching store's own blocks: hashes from here


# ---- a node: one spawned process driven over a pipe ------------------------------------


class NodeState:
    def __init__(self):
        self.source: MemorySource | None = None
        self.server: Any = None

    async def serve(
        self,
        blocks: dict[int, list[int]],
        behaviour: str = "normal",
        timeout_s: float = 30.0,
        gap_every: int = 0,
        lanes: int = 1,
        limits: dict | None = None,
        secret: str = "",
        rma: bool = False,
        forgery: str = "",
    ) -> str:
        """``rma``: register the pool with NIXL and grant one-sided reads; ``forgery``:
        hand out a forged card (:func:`forged_metadata`)."""
        slots = sum(len(s) for s in blocks.values())
        pool_bytes = sum(sum(s) for s in blocks.values()) + GAP * slots + 1
        self.source = MemorySource(NS, blocks, pool_bytes, gap_every, lanes)
        self.source.reuse_on_release = behaviour == "cut_after_grant"
        endpoint = rma_endpoint(self.source.pool.mem) if rma else None
        self.server = make_server(behaviour, self.source, timeout_s, limits, secret, endpoint)
        await self.server.start()
        forge_card(self.server, forgery)
        return self.server.address

    async def serve_store(
        self,
        hashes: list[int],
        behaviour: str = "normal",
        slot_bytes: int = 4096,
        pool_blocks: int = 32,
        rma: bool = False,
        forgery: str = "",
    ) -> tuple[str, str]:
        """Serve from a real store node (TP1, two layers) whose sealed blocks hold
        slot_content bytes, in a pool of about ``pool_blocks`` blocks; ``rma``: its
        pool registered with NIXL, one-sided reads granted."""
        from kvstore.store.fetch import StoreSource
        from kvstore.testing.store import make_instance, make_store

        self.node = make_store(pool_bytes=pool_blocks * 2 * slot_bytes, slab_bytes=8 * slot_bytes)
        self.ranks = make_instance(
            self.node.registry, "peer", tp_size=1, layers=2, num_blocks=16, block_bytes=slot_bytes
        )
        self.seal = self.node.registry.instances["peer"].seal
        await self._save_store(hashes)
        endpoint = rma_endpoint(self.node.index.pool("cpu").buffer.numpy()) if rma else None
        source = StoreSource(self.node.index)
        self.server = make_server(behaviour, source, 30.0, rma=endpoint)
        await self.server.start()
        forge_card(self.server, forgery)
        return self.server.address, self.seal.final_namespace

    async def store_fetch(
        self,
        addresses: list[str],
        hashes: list[int],
        slot_bytes: int,
        prefix_blocks: int = 0,
        own_blocks: int = 0,
        callers: int = 1,
        cancel_first_after: float | None = None,
        saved_meanwhile: int = 0,
    ) -> dict:
        """A real store node (the serving one's layout) whose Fetcher, one-sided where
        allowed, asks ``addresses`` in turn; what it fetched, its stats, bad bytes.
        ``prefix_blocks``: what a router says each peer holds (0: unknown, a --peer);
        ``own_blocks``: blocks of its own sealed first (32 fill its pool);
        ``callers``: prefetches of ``hashes`` at once, the first cancelled after
        ``cancel_first_after`` seconds when given (each one's prefix, or its error's
        name, in ``prefixes``; ``fetched`` and ``error`` are the last one's);
        ``saved_meanwhile``: the first that many of ``hashes`` are saved here (the
        peer's bytes) while the peers are looked up, after the fetch chose them."""
        import dataclasses

        from kvstore.store.fetch import Fetcher, StoreSink, slot_table
        from kvstore.testing.store import make_instance, make_store
        from kvstore.transfer.onesided import RmaReader
        from kvstore.wire.peers import PeerPrefix

        node = make_store(pool_bytes=64 * slot_bytes, slab_bytes=8 * slot_bytes)
        self.fetching = (
            node,
            make_instance(  # the ranks' memory stays alive
                node.registry, "peer", tp_size=1, layers=2, num_blocks=16, block_bytes=slot_bytes
            ),
        )
        namespace = node.registry.instances["peer"].seal.final_namespace
        pool = node.index.pool("cpu")
        caller = self.fetching[1][0].reg.caller_id
        for first in range(0, own_blocks, 16):
            own = range(first, min(own_blocks, first + 16))
            await node.save(caller, [(OWN_BLOCK + h, h - first) for h in own])
        peers = [PeerPrefix(a, f"node{i}", a, prefix_blocks) for i, a in enumerate(addresses)]

        async def find_peers(_namespace: str, _hashes: list[int]) -> list[PeerPrefix]:
            if saved_meanwhile:
                await self._save_into(node, self.fetching[1][0], hashes[:saved_meanwhile])
            return peers

        reader = RmaReader(rma_endpoint(pool.buffer.numpy()))
        sink = StoreSink(node.index, node.registry)
        fetcher = Fetcher(node.index, sink, find_peers, timeout_s=5.0, rma=reader)
        calls = [asyncio.ensure_future(fetcher.prefetch(namespace, hashes)) for _ in range(callers)]
        if cancel_first_after is not None:
            asyncio.get_running_loop().call_later(cancel_first_after, calls[0].cancel)
        results = await asyncio.gather(*calls, return_exceptions=True)
        result = results[-1]
        error = type(result).__name__ if isinstance(result, BaseException) else None
        blocks = node.index.sealed_prefix(namespace, hashes)
        table = slot_table(node.index, blocks)
        mem = pool.buffer.numpy()
        starts = (table.ptr - np.uint64(pool.base)).astype(np.int64).tolist()
        sizes = table.nbytes.tolist()
        bad = [
            i
            for i, (start, size) in enumerate(zip(starts, sizes, strict=True))
            if not np.array_equal(
                mem[start : start + size], slot_content(hashes[i // 2], i % 2, size)
            )
        ]
        stats = dataclasses.asdict(fetcher.stats())
        used = pool.used_bytes  # the aborted reservation's slots are free again
        index = node.index
        own = sum(bool(index.sealed_prefix(namespace, [OWN_BLOCK + h])) for h in range(own_blocks))
        return {
            "fetched": 0 if error else result.fetched_blocks,
            "error": error,
            "prefixes": [
                type(r).__name__ if isinstance(r, BaseException) else r.prefix_blocks
                for r in results
            ],
            "bad": bad,
            "used_bytes": used,
            "own_blocks": own,  # of own_blocks, still sealed
            "evictions": index.stats().evictions,
            **stats,
        }

    async def _save_store(self, hashes: list[int]) -> None:
        await self._save_into(self.node, self.ranks[0], hashes)

    @staticmethod
    async def _save_into(node: Any, rank: Any, hashes: list[int]) -> None:
        """Save ``hashes`` holding slot_content bytes into ``node`` as TP1 ``rank``."""
        for start in range(0, len(hashes), 16):
            batch = hashes[start : start + 16]
            for i, h in enumerate(batch):
                for s, t in enumerate(rank.tensors):  # slot s = layer s (TP1)
                    t[:, i] = torch_from(slot_content(h, s, t[:, i].numel())).view(2, -1)
            await node.save(rank.reg.caller_id, [(h, i) for i, h in enumerate(batch)])

    async def evict_with(self, hashes: list[int]) -> dict:
        """Save ``hashes`` too, pushing older unpinned blocks out of the pool."""
        await self._save_store(hashes)
        return await self.store_state()

    async def store_state(self) -> dict:
        return {
            "evictions": self.node.index.stats().evictions,
            "sent_half": self.server.sent_half,
            "held": [k[1] for k, b in self.node.index.blocks.items() if b.sealed and b.pins],
        }

    async def leases(self) -> dict:
        return {
            "active": self.source.active,
            "released": self.source.released,
            "sent_half": self.server.sent_half,
            "segments": list(self.server.segments),
        }

    async def stop_serving(self) -> dict:
        """Stop the peer port; the leases still active and its pinned blocks after."""
        await self.server.stop()
        return {"active": self.source.active, "pinned_blocks": self.server.stats().pinned_blocks}

    async def watch_logs(self) -> None:
        """From now on, keep this node's kvstore.transfer WARNING (and worse) lines."""
        import logging

        self.warned: list[str] = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda record: self.warned.append(record.getMessage())
        logging.getLogger("kvstore.transfer").addHandler(handler)

    async def warnings(self) -> list[str]:
        return list(self.warned)

    async def port_stats(self) -> dict:
        import dataclasses

        return {**dataclasses.asdict(self.server.stats()), "requests": self.server.requests}

    async def open_idle(self, address: str, n: int) -> int:
        """Open ``n`` connections to ``address`` and keep them, sending nothing."""
        from kvstore.transfer import ucx

        self.idle = getattr(self, "idle", [])
        for _ in range(n):
            self.idle.append(await ucx.connect(address, asyncio.get_running_loop().time() + 5))
        return len(self.idle)

    async def ucx_state(self) -> dict:
        """Open descriptors, and what the process's UCX worker health says."""
        from kvstore.transfer.ucx import worker_health

        health = worker_health()
        return {
            "fds": len(os.listdir("/proc/self/fd")),
            "recreations": health.recreations,
            "recreating": health.recreating,
        }

    async def idle_cpu(self, seconds: float) -> dict:
        """CPU seconds this process used while its loop waited ``seconds``, and how
        often its UCX progress went to sleep meanwhile."""
        from kvstore.transfer.ucx import loop_progress

        progress = loop_progress()
        sleeps = progress.sleeps if progress is not None else 0
        start = time.process_time()
        await asyncio.sleep(seconds)
        return {
            "cpu_s": time.process_time() - start,
            "sleeps": (progress.sleeps - sleeps) if progress is not None else None,
        }

    async def freeze(self, seconds: float) -> None:
        """Block this node's event loop (and so its UCX progress) for ``seconds``."""
        asyncio.get_running_loop().call_soon(time.sleep, seconds)

    async def set_max_segment_bytes(self, nbytes: int) -> None:
        import kvstore.transfer.slots

        kvstore.transfer.slots.MAX_SEGMENT_BYTES = nbytes

    async def fetch(
        self,
        address: str,
        hashes: list[int],
        timeout_s: float = 10.0,
        on_reserve: str = "",
        on_commit: str = "",
        repeat: int = 1,
        pool_bytes: int = 64 << 20,
        gap_every: int = 0,
        lanes: int = 1,
        namespace: str = NS,
        fresh: bool = False,
        secret: str = "",
        rma: bool = False,
        ahead: list[int] | None = None,
        cancel_after: float = 0.0,
        then: list[int] | None = None,
    ) -> dict:
        """``on_reserve`` / ``on_commit``: the sink's faults (MemorySink);
        ``fresh``: drop pooled endpoints first, so that the fetch connects;
        ``rma``: register the sink's pool with NIXL and read one-sided where granted;
        ``ahead``: the sink knows every block has these slot sizes and reserves
        before the offer (as the store's sink does); ``cancel_after``: cancel
        the fetch's task after that many seconds (error "Cancelled"); ``then``: the
        hashes of the repeats after the first (the same sink and reader)."""
        from kvstore.transfer import close_endpoints, fetch
        from kvstore.transfer.onesided import RmaReader
        from kvstore.wire.errors import KVError

        if fresh or rma:  # a new sink pool, a new NIXL agent: connect afresh
            await close_endpoints()
        pool = Pool(pool_bytes, gap_every)
        if ahead is None:
            sink = MemorySink(pool, on_reserve=on_reserve, lanes=lanes)
        else:
            sink = AheadMemorySink(pool, on_reserve=on_reserve, lanes=lanes, layout=ahead)
        sink.on_commit = on_commit
        reader = RmaReader(rma_endpoint(sink.pool.mem)) if rma else None
        out: dict[str, Any] = {"n": [], "error": None}
        start = time.monotonic()
        key = peer_secret(secret)
        reserve_ahead = ahead is not None
        try:
            for i in range(repeat):
                asked = hashes if i == 0 or then is None else then
                ask = fetch(address, namespace, asked, sink, timeout_s, key, reader, reserve_ahead)
                one = asyncio.ensure_future(ask)
                if cancel_after:
                    asyncio.get_running_loop().call_later(cancel_after, one.cancel)
                out["n"].append(await one)
        except asyncio.CancelledError:
            out["error"] = "Cancelled"
        except KVError as e:
            out["error"] = type(e).__name__
            out["code"] = e.code.name
            out["message"] = e.message
        out["elapsed"] = time.monotonic() - start
        out["rma_reads"] = reader.reads if reader is not None else 0
        self.readers = [*getattr(self, "readers", []), reader]  # its agent outlives the fetch
        return out | sink.report()

    async def litter(self, nbytes: int) -> None:
        """Leave ``nbytes`` of b"Z" in this process's freed heap (where a buffer
        allocated next without zeroing would find it)."""
        mess = np.full(nbytes, ord("Z"), dtype=np.uint8)
        del mess

    async def raw(
        self, address: str, frames: list[bytes], replies: int, keep: bool = False
    ) -> list:
        """Send hand-made control frames; collect [kind, arg, body] replies or the error;
        ``keep`` leaves the connection open afterwards."""
        from kvstore.transfer import ucx, wire

        conn = await ucx.connect(address, asyncio.get_running_loop().time() + 5)
        for f in frames:
            await conn.ep.send(np.frombuffer(f, np.uint8), tag=ucx.CONTROL_TAG)
        out = []
        for _ in range(replies):
            deadline = asyncio.get_running_loop().time() + 3
            try:
                kind, arg, body = await ucx.recv_frame(conn, list(wire.Kind), deadline)
                out.append([kind.name, arg, msgpack.unpackb(body) if body else None])
            except Exception as e:
                out.append(["failed", type(e).__name__])
                break
        if keep:
            self.idle = [*getattr(self, "idle", []), conn]
        else:
            conn.abort()
        return out


def node_main(pipe: Any) -> None:
    asyncio.run(_node_loop(pipe))


async def _node_loop(pipe: Any) -> None:
    state = NodeState()
    loop = asyncio.get_running_loop()
    tasks = set()

    async def run(rid: int, name: str, kwargs: dict) -> None:
        try:
            result = (True, await getattr(state, name)(**kwargs))
        except BaseException as e:  # report, never kill the node
            result = (False, f"{type(e).__name__}: {e}")
        pipe.send((rid, *result))

    while True:
        rid, name, kwargs = await loop.run_in_executor(None, pipe.recv)
        if name == "exit":
            return
        task = asyncio.ensure_future(run(rid, name, kwargs))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


class Node:
    """A process with its own UCX context; ``call`` runs a NodeState method there."""

    def __init__(self, env: dict[str, str] | None = None):
        """``env``: set in the node's environment (UCX reads it when it starts there)."""
        self.pipe, child = CTX.Pipe()
        self.proc = CTX.Process(target=node_main, args=(child,), daemon=True)
        saved = dict(os.environ)
        try:
            os.environ.update(env or {})
            self.proc.start()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        self._next = 0
        self._results: dict[int, tuple] = {}

    def submit(self, name: str, **kwargs) -> int:
        self._next += 1
        self.pipe.send((self._next, name, kwargs))
        return self._next

    def result(self, rid: int, timeout: float = CALL_TIMEOUT) -> Any:
        deadline = time.monotonic() + timeout
        while rid not in self._results:
            left = deadline - time.monotonic()
            if left <= 0 or not self.pipe.poll(left):
                raise TimeoutError(f"node did not answer call {rid} in {timeout}s")
            got, ok, value = self.pipe.recv()
            self._results[got] = (ok, value)
        ok, value = self._results.pop(rid)
        if not ok:
            raise RuntimeError(value)
        return value

    def call(self, name: str, timeout: float = CALL_TIMEOUT, **kwargs) -> Any:
        return self.result(self.submit(name, **kwargs), timeout)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)

    def close(self) -> None:
        close_all([self])


def close_all(nodes: list[Node], grace_s: float = 5.0) -> None:
    """Ask every node to exit, give them ``grace_s`` together, kill the rest."""
    for node in nodes:
        if node.proc.is_alive():
            try:
                node.pipe.send((0, "exit", {}))
            except OSError:
                pass
    deadline = time.monotonic() + grace_s
    for node in nodes:
        node.proc.join(max(0.0, deadline - time.monotonic()))
        node.kill()


def wait_until(predicate, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


HASHES = [(0x9E3779B97F4A7C15 * (i + 1)) & ((1 << 64) - 1) for i in range(12)]


def blocks_of(hashes: list[int], layout: list[int]) -> dict[int, list[int]]:
    return {h: list(layout) for h in hashes}
