"""One-sided peer reads (kvstore.transfer.rma, docs/design.md §4) between two real
processes, each with its own NIXL agent over host memory.

The serving node's pool holds slots of 16 KiB .. 4 MiB, every 8-byte word distinct
(``pattern``); the fetching node's pool is poisoned, reads random slot runs out of
the serving pool, and compares every byte of its pool: the runs' bytes equal the
pattern at their remote offsets, every other byte is still poison.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.transfer import SlotTable, rma
from kvstore.transfer.server import readable
from kvstore.wire.errors import Code, KVError
from tests.conftest import need_nixl

CTX = mp.get_context("spawn")
KIB, MIB = 1 << 10, 1 << 20
SLOT_SIZES = (16 * KIB, 64 * KIB, 256 * KIB, MIB, 4 * MIB)
POISON = 0xEE
CALL_SLACK_S = 30.0  # a node that does not answer within a call's deadline plus this hangs


def pattern(offsets: np.ndarray) -> np.ndarray:
    """The serving pool's word at each 8-byte-aligned byte offset: distinct everywhere."""
    return (offsets // 8).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(1)


def slot_layout(seed: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, sizes) of ``count`` slots of mixed sizes, back to back."""
    sizes = np.random.default_rng(seed).choice(SLOT_SIZES, size=count).astype(np.int64)
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    return offsets, sizes


# ---- a node: a spawned process with a pool and an RmaEndpoint, driven over a pipe ----


def node_main(conn: Any, env: dict, pool_bytes: int, serving: bool) -> None:
    os.environ.update(env)
    try:
        pool = np.full(pool_bytes, POISON, dtype=np.uint8)
        if serving:
            pool.view(np.uint64)[:] = pattern(np.arange(0, pool_bytes, 8))
        base = pool.ctypes.data
        endpoint = rma.RmaEndpoint(rma.Region(base, pool_bytes))
        conn.send(("ok", endpoint.card().encode()))
    except Exception:
        conn.send(("crash", traceback.format_exc()))
        os._exit(1)
    Node.serve(conn, endpoint, pool, base)


class Node:
    """The test's handle on a node process."""

    def __init__(self, pool_bytes: int, serving: bool, env: dict | None = None):
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=node_main, args=(child, env or {}, pool_bytes, serving))
        self.proc.start()
        self.card = self._answer(60.0)
        self.peer: rma.Peer | None = None

    def call(self, command: str, *args: Any, within: float = 0.0) -> Any:
        self.conn.send((command, args))
        return self._answer(within + CALL_SLACK_S)

    def _answer(self, limit: float) -> Any:
        if not self.conn.poll(limit):
            raise AssertionError(f"node did not answer within {limit} s")
        status, value = self.conn.recv()
        if status == "crash":
            raise AssertionError(f"node crashed:\n{value}")
        return value

    def kill(self, sig: int = signal.SIGKILL) -> None:
        os.kill(self.proc.pid, sig)

    def close(self) -> None:
        if self.proc.is_alive():
            self.kill(signal.SIGKILL)
        self.proc.join(10)

    @staticmethod
    def serve(conn: Any, endpoint: rma.RmaEndpoint, pool: np.ndarray, base: int) -> None:
        """Answer commands; progress the endpoint (and keep its notices) between them."""
        state: dict = {"peer": None}
        notices: list[rma.Notice] = []

        def take_notices() -> list[tuple[str, bytes]]:
            taken = [tuple(n) for n in notices]
            notices.clear()
            return taken

        handlers = {
            "connect": lambda card: Node._connect(endpoint, state, card),
            "read": lambda *a: Node._read(endpoint, state, base, *a),
            "read_unreleasable": lambda *a: Node._read_unreleasable(endpoint, state, base, *a),
            "check": lambda *a: Node._check(pool, *a),
            "poison": lambda: pool.fill(POISON),
            "notify": lambda message: endpoint.notify(state["peer"], message),
            "notices": take_notices,
            "ping": lambda: "pong",
        }
        while True:
            notices.extend(endpoint.progress())
            while not conn.poll(0.001):
                notices.extend(endpoint.progress())
            command, args = conn.recv()
            if command == "stop":
                os._exit(0)
            try:
                conn.send(("ok", handlers[command](*args)))
            except KVError as err:
                conn.send(("ok", ("error", err.code.name, type(err).__name__, err.message)))
            except Exception:
                conn.send(("crash", traceback.format_exc()))

    @staticmethod
    def _connect(endpoint: rma.RmaEndpoint, state: dict, card: bytes) -> str:
        state["peer"] = endpoint.connect(rma.PeerCard.decode(card))
        return state["peer"].name

    @staticmethod
    def _runs(state, base, remote_off, local_off, sizes) -> rma.SlotRuns:
        return rma.SlotRuns.of(
            np.asarray(remote_off, dtype=np.uint64) + np.uint64(state["peer"].region.addr),
            np.asarray(local_off, dtype=np.uint64) + np.uint64(base),
            sizes,
        )

    @staticmethod
    def _read_unreleasable(endpoint, state, base, remote_off, local_off, sizes, timeout_s) -> Any:
        """An async read that fails while NIXL refuses to release any request
        (for a SETTLE_S cut to 0.3 s): its error's name, and the event loop's
        ticks counted at each refused release."""
        runs = Node._runs(state, base, remote_off, local_off, sizes)
        rma.SETTLE_S = 0.3
        agent, ticks, seen = endpoint.agent, [0], []
        release = agent.release_xfer_handle

        def refuse(_handle: Any) -> None:
            seen.append(ticks[0])
            raise RuntimeError("release refused by the test")

        async def read() -> str:
            async def tick() -> None:
                while True:
                    ticks[0] += 1
                    await asyncio.sleep(0.001)

            ticker = asyncio.ensure_future(tick())
            try:
                pending = endpoint.start_read(state["peer"], runs, MIB)
                await pending.wait_async(time.monotonic() + timeout_s)
            except KVError as err:
                return type(err).__name__
            finally:
                ticker.cancel()
            return "done"

        agent.release_xfer_handle = refuse
        try:
            return asyncio.run(read()), seen
        finally:
            agent.release_xfer_handle = release

    @staticmethod
    def _read(endpoint, state, base, remote_off, local_off, sizes, timeout_s, chunk) -> Any:
        peer = state["peer"]
        runs = Node._runs(state, base, remote_off, local_off, sizes)
        start = time.monotonic()
        try:
            stats = endpoint.read(peer, runs, timeout_s, chunk_bytes=chunk)
        except KVError as err:
            return (
                "error",
                err.code.name,
                type(err).__name__,
                err.message,
                time.monotonic() - start,
            )
        return ("done", stats.nbytes, stats.runs, stats.chunks)

    @staticmethod
    def _check(pool: np.ndarray, remote_off, local_off, sizes) -> dict:
        """Every byte: the runs hold the pattern of their remote offsets, the rest is poison."""
        expected = np.full(len(pool), POISON, dtype=np.uint8)
        for r, loc, n in zip(remote_off, local_off, sizes, strict=True):
            words = pattern(np.arange(r, r + n, 8, dtype=np.int64))
            expected[loc : loc + n] = words.view(np.uint8)
        wrong = np.flatnonzero(pool != expected)
        return {"wrong": len(wrong), "first": int(wrong[0]) if len(wrong) else -1}


@pytest.fixture
def pair():
    """``pair(env)``: a serving node and a fetching node connected to it."""
    made: list[Node] = []

    def make(env: dict | None = None, pool_bytes: int = 96 * MIB) -> tuple[Node, Node]:
        need_nixl()
        server = Node(pool_bytes, serving=True, env=env)
        made.append(server)
        fetcher = Node(pool_bytes, serving=False, env=env)
        made.append(fetcher)
        fetcher.call("connect", server.card)
        return server, fetcher

    yield make
    for node in made:
        node.close()


def random_runs(seed: int, pool_bytes: int) -> tuple[list[int], list[int], list[int]]:
    """Slots of mixed sizes on both sides; a random subset of the serving pool's
    slots mapped to random slots of the same size in the fetching pool, with
    some stretches of consecutive slots kept together as one multi-slot run."""
    rng = np.random.default_rng(seed)
    count = 8 * len(SLOT_SIZES)
    offsets, sizes = slot_layout(seed, count)
    assert offsets[-1] + sizes[-1] <= pool_bytes
    remote, local, nbytes = [], [], []
    for size in SLOT_SIZES:
        same = np.flatnonzero(sizes == size)
        picked = rng.permutation(same)[: max(1, len(same) * 3 // 4)]
        targets = rng.permutation(same)[: len(picked)]
        remote += offsets[picked].tolist()
        local += offsets[targets].tolist()
        nbytes += [int(size)] * len(picked)
    first = int(rng.integers(0, count - 4))  # plus one run of 4 consecutive slots, in place
    span = int(offsets[first + 3] + sizes[first + 3] - offsets[first])
    lo, hi = int(offsets[first]), int(offsets[first]) + span
    keep = [i for i, (o, n) in enumerate(zip(local, nbytes, strict=True)) if o + n <= lo or o >= hi]
    assert keep  # the random part is not empty
    remote = [remote[i] for i in keep] + [lo]
    local = [local[i] for i in keep] + [lo]
    nbytes = [nbytes[i] for i in keep] + [span]
    return remote, local, nbytes


# ---- tests ----------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [rma.DEFAULT_CHUNK_BYTES, 3 * MIB + 4 * KIB])
def test_random_slot_runs_arrive_byte_exact(pair, chunk):
    """Mixed slot sizes, random placement, whole reads and reads cut into chunks
    (a chunk size that splits 4 MiB runs): every byte of the fetching pool checked."""
    _, fetcher = pair()
    for seed in (1, 2):
        remote, local, nbytes = random_runs(seed, 96 * MIB)
        fetcher.call("poison")  # the second read must land on its own
        done = fetcher.call("read", remote, local, nbytes, 20.0, chunk, within=20.0)
        assert done[0] == "done", done
        assert done[1] == sum(nbytes) and done[2] == len(nbytes)
        if chunk < 4 * MIB:
            assert done[3] > 1  # really cut into several NIXL requests
        assert fetcher.call("check", remote, local, nbytes) == {"wrong": 0, "first": -1}


def test_read_from_a_killed_peer_fails_within_the_deadline(pair):
    server, fetcher = pair()
    remote, local, nbytes = random_runs(3, 96 * MIB)
    assert fetcher.call("read", remote, local, nbytes, 20.0, rma.DEFAULT_CHUNK_BYTES)[0] == "done"
    server.kill()
    server.proc.join(10)
    result = fetcher.call("read", remote, local, nbytes, 5.0, rma.DEFAULT_CHUNK_BYTES, within=5.0)
    assert result[0] == "error", result
    assert result[1] in ("UNAVAILABLE", "DEADLINE_EXCEEDED"), result
    assert result[2] != "ReadUnsettled", result
    assert fetcher.call("ping") == "pong"  # the fetching process goes on


def test_a_read_whose_requests_will_not_release_settles_without_blocking_the_loop(pair):
    """A read times out (the peer is stopped, over tcp) and NIXL refuses to
    release its requests: the read waits SETTLE_S for them, then is
    ReadUnsettled. Before, that wait slept on the event loop (5 s of a store
    server doing nothing else); now the loop runs between the tries."""
    server, fetcher = pair(env={"UCX_TLS": "tcp,self"}, pool_bytes=32 * MIB)
    server.kill(signal.SIGSTOP)
    try:
        name, seen = fetcher.call("read_unreleasable", [0], [8 * MIB], [4 * MIB], 0.5, within=5.0)
    finally:
        server.kill(signal.SIGCONT)
    assert name == "ReadUnsettled", (name, seen)
    assert len(seen) >= 3 and seen[-1] > seen[1], seen  # the loop ticked between tries


def test_a_stalled_peer_times_out_and_nothing_lands_afterwards(pair):
    """Over tcp a read needs the peer to answer: a SIGSTOPped peer times the read
    out; once it runs again, nothing of the failed read is written (the peer was
    dropped), and connecting again reads normally."""
    server, fetcher = pair(env={"UCX_TLS": "tcp,self"}, pool_bytes=32 * MIB)
    remote, local, nbytes = [0, 4 * MIB], [8 * MIB, 16 * MIB], [4 * MIB, 4 * MIB]
    server.kill(signal.SIGSTOP)
    try:
        result = fetcher.call("read", remote, local, nbytes, 1.0, MIB, within=1.0)
    finally:
        server.kill(signal.SIGCONT)
    assert result[:3] == ("error", "DEADLINE_EXCEEDED", "PeerTimeout"), result
    assert server.call("ping") == "pong"  # the peer runs (and progresses) again
    assert fetcher.call("check", [], [], []) == {"wrong": 0, "first": -1}  # all poison
    fetcher.call("connect", server.card)
    assert fetcher.call("read", remote, local, nbytes, 20.0, MIB, within=20.0)[0] == "done"
    assert fetcher.call("check", remote, local, nbytes) == {"wrong": 0, "first": -1}


def test_bad_runs_are_refused_before_anything_moves(pair):
    _, fetcher = pair(pool_bytes=8 * MIB)
    cases = [
        ([8 * MIB - 4 * KIB], [0], [8 * KIB], "runs.remote[0]"),  # past the peer's region
        ([0, 0], [0, 8 * MIB], [4 * KIB, 4 * KIB], "runs.local[1]"),  # past ours
        ([0], [0], [0], "runs.remote[0]"),  # empty run
        ([], [], [], "runs: 0 runs"),
        ([0, 0], [0], [4 * KIB, 4 * KIB], "columns disagree"),
    ]
    for remote, local, nbytes, field in cases:
        result = fetcher.call("read", remote, local, nbytes, 5.0, MIB)
        assert result[:2] == ("error", "INVALID_ARGUMENT"), (field, result)
        assert field in result[3], (field, result)
    assert fetcher.call("check", [], [], []) == {"wrong": 0, "first": -1}  # nothing moved
    assert fetcher.call("read", [0], [0], [MIB], 5.0, MIB, within=5.0)[0] == "done"


def test_a_notice_reaches_the_serving_side(pair):
    """How a fetcher says "done reading lease N" without a round trip."""
    server, fetcher = pair(pool_bytes=MIB)
    assert fetcher.call("read", [0], [0], [MIB], 5.0, MIB, within=5.0)[0] == "done"
    fetcher.call("notify", b"lease 42")
    notices: list = []
    for _ in range(1000):  # a one-way message: it arrives when it arrives
        notices += server.call("notices")
        if notices:
            break
        time.sleep(0.005)
    assert [n[1] for n in notices] == [b"lease 42"]


# ---- bounds, without processes ------------------------------------------------------


def region(addr: int = 1 << 20, nbytes: int = 1 << 20) -> rma.Region:
    return rma.Region(addr, nbytes)


@pytest.mark.parametrize(
    ("remote", "local", "nbytes", "field"),
    [
        ([(1 << 64) - 8], [1 << 20], [16], "runs.remote[0]"),  # would wrap around 2^64
        ([1 << 20], [(1 << 20) - 1], [16], "runs.local[0]"),  # starts below the region
        ([1 << 20], [1 << 20], [(1 << 20) + 1], "runs.remote[0]"),  # longer than the region
        ([1 << 20, (2 << 20) - 8], [1 << 20] * 2, [8, 16], "runs.remote[1]"),
    ],
)
def test_runs_outside_a_region_name_the_run(remote, local, nbytes, field):
    with pytest.raises(KVError) as err:
        rma.check_runs(rma.SlotRuns.of(remote, local, nbytes), region(), region())
    assert err.value.code == Code.INVALID_ARGUMENT and field in err.value.message


EDGES = [0, 1, 8, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, 2 << 20, (1 << 63), (1 << 64) - 8]


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.one_of(st.sampled_from(EDGES), st.integers(0, (1 << 64) - 1)),
            st.one_of(st.sampled_from(EDGES), st.integers(0, 3 << 20)),
        ),
        max_size=6,
    )
)
def test_inside_agrees_with_outside(runs):
    """The quick bounds check says yes exactly when no run is outside (edges: the
    region's ends, empty runs, sizes past the region, sums past 2^64), on few runs
    (checked on Python ints) and on many (the same runs repeated: numpy)."""
    addrs = np.array([a for a, _ in runs], dtype=np.uint64)
    nbytes = np.array([n for _, n in runs], dtype=np.uint64)
    for repeats in (1, rma.FEW_RUNS + 1):
        a, n = np.tile(addrs, repeats), np.tile(nbytes, repeats)
        assert rma.inside(a, n, region()) == (not len(rma.outside(a, n, region())))


def test_too_many_runs_are_refused():
    n = rma.MAX_RUNS_PER_READ + 1
    runs = rma.SlotRuns.of(np.full(n, 1 << 20), np.full(n, 1 << 20), np.ones(n))
    with pytest.raises(KVError, match="runs: 1048577 runs"):
        rma.check_runs(runs, region(), region())


def test_chunks_cover_every_byte_once_and_stay_near_their_size():
    rng = np.random.default_rng(7)
    sizes = rng.choice(SLOT_SIZES, size=300).astype(np.uint64)
    remote = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.uint64) + np.uint64(1 << 30)
    local = rng.permutation(remote) + np.uint64(1 << 20)  # any placement: chunks only cut
    runs = rma.SlotRuns.of(remote, local, sizes)
    for chunk in (5 * MIB - 1, 16 * KIB, 64 * MIB):
        chunks = rma.plan_chunks(runs, chunk, 0, 0)
        remote_descs = np.concatenate([c.remote for c in chunks])
        local_descs = np.concatenate([c.local for c in chunks])
        assert int(remote_descs[:, 1].sum()) == int(sizes.sum())
        # pieces in order rebuild each run: remote and local shifted by the same amount
        assert np.array_equal(remote_descs[:, 1], local_descs[:, 1])
        shift = remote_descs[:, 0].astype(np.int64) - local_descs[:, 0].astype(np.int64)
        run_of = np.searchsorted(remote, remote_descs[:, 0], side="right") - 1
        assert np.array_equal(shift, (remote - local).astype(np.int64)[run_of])
        assert all(int(c.remote[:, 1].sum()) < 2 * chunk for c in chunks)
        assert int(remote_descs[:, 1].max()) <= chunk


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda b: b[:10], "bytes"),
        (lambda b: b"XXXX" + b[4:], "magic"),
        (lambda b: b[:5] + b"\x07" + b[6:], "memory kind"),
        (lambda b: b + b"x", "metadata length"),
        (lambda b: b + b"x" * (rma.MAX_CARD_BYTES), "bytes"),
    ],
)
def test_malformed_cards_are_refused(mutate, field):
    card = rma.PeerCard(b"metadata", rma.Region(4096, 1 << 20)).encode()
    assert rma.PeerCard.decode(card) == rma.PeerCard(b"metadata", rma.Region(4096, 1 << 20))
    with pytest.raises(KVError) as err:
        rma.PeerCard.decode(mutate(card))
    assert err.value.code == Code.INVALID_ARGUMENT and field in err.value.message


def test_a_pool_region_names_its_memory_and_a_gpu_card_round_trips():
    assert rma.pool_region("cpu", 4096, 1 << 20) == rma.Region(4096, 1 << 20, "DRAM", 0)
    gpu = rma.pool_region("cuda:3", 1 << 40, 1 << 30)
    assert gpu == rma.Region(1 << 40, 1 << 30, "VRAM", 3)
    assert rma.PeerCard.decode(rma.PeerCard(b"m", gpu).encode()).region == gpu
    assert rma.pool_region("cuda", 4096, 1 << 20) == rma.Region(4096, 1 << 20, "VRAM", 0)
    for bad in ("cuda:x", "gpu:0", ""):
        with pytest.raises(ValueError, match="device"):
            rma.pool_region(bad, 4096, 1 << 20)


def test_a_grant_is_readable_only_in_the_registered_memory():
    """The serving side grants one-sided reads of slots inside its region and of its
    kind: host slots (memory key 0) for a DRAM pool, slots of that one GPU allocation
    (key = its base) for a VRAM pool; anything else goes two-sided."""

    def table(ptr, memory):
        n = len(ptr)
        return SlotTable(
            np.array(ptr, dtype=np.uint64),
            np.full(n, 4096, dtype=np.int64),
            np.array(memory, dtype=np.int64),
            np.array([n], dtype=np.int64),
        )

    host = rma.pool_region("cpu", 1 << 20, 1 << 20)
    gpu = rma.pool_region("cuda:0", 1 << 40, 1 << 20)
    inside_host, inside_gpu = [(1 << 20) + 4096 * i for i in range(3)], [(1 << 40) + 8192]
    assert readable(table(inside_host, [0, 0, 0]), host)
    assert readable(table(inside_gpu, [1 << 40]), gpu)
    assert not readable(table(inside_gpu, [0]), gpu)  # host memory claimed inside a GPU's
    assert not readable(table(inside_host, [0, 0, 1 << 20]), host)  # one slot on a GPU
    assert not readable(table(inside_host, [1 << 40] * 3), gpu)  # outside the region
    assert not readable(table([(2 << 20) - 2048], [0]), host)  # runs past its end


def test_without_nixl_available_says_why(monkeypatch):
    for name in ("nixl_cu12", "nixl_cu13", "nixl", "nixl._api"):
        monkeypatch.setitem(sys.modules, name, None)
    ok = rma.available()
    assert not ok and "nixl_cu12" in ok.reason and "nixl_cu13" in ok.reason


def test_the_cuda_13_wheel_is_found_too(monkeypatch):
    """A CUDA 13 host has nixl-cu13, whose module is nixl_cu13."""
    import types

    fake = types.ModuleType("nixl_cu13")
    monkeypatch.setitem(sys.modules, "nixl_cu12", None)
    monkeypatch.setitem(sys.modules, "nixl_cu13", fake)
    assert rma.available() and rma._nixl() is fake


def test_the_wheel_of_torchs_cuda_major_comes_first(monkeypatch):
    """A CUDA 13 torch with both wheels installed loads nixl_cu13."""
    import types

    cu12, cu13 = types.ModuleType("nixl_cu12"), types.ModuleType("nixl_cu13")
    fake_torch = types.SimpleNamespace(version=types.SimpleNamespace(cuda="13.0"))
    monkeypatch.setitem(sys.modules, "nixl_cu12", cu12)
    monkeypatch.setitem(sys.modules, "nixl_cu13", cu13)
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    assert rma._nixl() is cu13
    fake_torch.version.cuda = None  # a CPU build: the listed order
    assert rma._nixl() is cu12


def test_the_nixl_version_names_the_wheel_that_loads(monkeypatch):
    """Not the first installed: the first whose module imports."""
    import types

    monkeypatch.setitem(sys.modules, "nixl_cu12", None)  # installed, broken
    monkeypatch.setitem(sys.modules, "nixl_cu13", types.ModuleType("nixl_cu13"))
    assert rma.nixl_version().split()[0] == "nixl-cu13"
    monkeypatch.setitem(sys.modules, "nixl_cu13", None)
    monkeypatch.setitem(sys.modules, "nixl._api", None)
    assert rma.nixl_version() == ""
