"""Fuzz every RPC of the store server (hypothesis) against a real server.

Properties, for any request however malformed:
1. it is answered with a precise status, never UNKNOWN or INTERNAL, and a
   refusal carries a message;
2. a refused request changes nothing: the Stats counters of state are equal
   before and after, and the sealed blocks saved first still load byte-exact;
3. the server is alive at the end.
An accepted request (a fuzzed one can be valid) is undone before the next.
Raw bytes that are not the method's message are fuzzed too. Examples are
derandomized for CI; KV_FUZZ_EXAMPLES=N and KV_FUZZ_RANDOM=1 hunt further.
"""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore._proto import store_pb2 as pb
from kvstore.client.store_client import KVLayer, StoreClient, call, kv_cache_shm
from kvstore.wire.errors import Code, KVError
from kvstore.wire.limits import MAX_BLOCKS_PER_REQUEST
from kvstore.wire.names import is_final_namespace
from tests.conftest import ServerThread, wait_for

NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, LAYERS = 16, 4, 2, 16, 2
GOLDEN = [(0xA000 + i, i) for i in range(4)]  # (hash, source block id)
TARGETS = [8, 9, 10, 11]  # where the golden blocks are loaded back
BAD_CODES = {Code.UNKNOWN, Code.INTERNAL}
STATE_FIELDS = (
    "used_bytes",
    "sealed_blocks",
    "inflight_blocks",
    "instances",
    "sealed_instances",
    "leases",
)
BLOCK_FIELDS = (
    "instance",
    "rank",
    "session",
    "block_hashes",
    "block_ids",
    "block_id",
    "block_hash",
)
FUZZ = settings(
    max_examples=int(os.environ.get("KV_FUZZ_EXAMPLES", "100")),
    deadline=None,
    derandomize=os.environ.get("KV_FUZZ_RANDOM") is None,
    suppress_health_check=list(HealthCheck),
    database=None,
)

# ------------------------------------------------------------------ the harness


def block_view(tensor: torch.Tensor, block_id: int) -> np.ndarray:
    return tensor[:, block_id].contiguous().view(torch.uint8).numpy()


def fill_block(tensor: torch.Tensor, block_id: int, seed: int) -> None:
    shape = tensor[:, block_id].shape
    raw = np.random.default_rng(seed).integers(0, 256, size=block_view(tensor, 0).size)
    data = torch.from_numpy(raw.astype(np.uint8)).view(tensor.dtype).reshape(shape)
    tensor[:, block_id] = data


class Env:
    """A server, one sealed single-rank instance and its golden blocks."""

    def __init__(self):
        self.server = ServerThread(pool_size=8 << 20, device="cpu", slab_bytes=1 << 20)
        self.client = StoreClient(self.server.address)
        self.stub = self.client.stub
        self.shms = [
            kv_cache_shm("kv_first", NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM) for _ in range(LAYERS)
        ]
        self.layers = [
            KVLayer(f"layer.{i}", shm.tensor, "kv_first", "NHD", shm)
            for i, shm in enumerate(self.shms)
        ]
        self.session = self.client.register("fz", "fuzz", self.layers, block_size=BLOCK_SIZE)
        self.ns = self.session.wait_sealed(10).final_namespace
        self.restore()

    def restore(self) -> None:
        """Clear everything, save the golden blocks again, take the baseline."""
        self.client.clear()
        for shm in self.shms:
            for h, b in GOLDEN:
                fill_block(shm.tensor, b, h)
        self.expected = [[block_view(shm.tensor, b).copy() for _, b in GOLDEN] for shm in self.shms]
        self.session.save(GOLDEN)
        self.base = self.state()

    def state(self) -> dict:
        stats = self.client.stats()
        return {f: getattr(stats, f) for f in STATE_FIELDS}

    def golden_loads(self) -> bool:
        for shm in self.shms:
            for b in TARGETS:
                shm.tensor[:, b] = 0
        self.session.load([(h, t) for (h, _), t in zip(GOLDEN, TARGETS)])
        return all(
            np.array_equal(block_view(shm.tensor, t), want)
            for shm, wants in zip(self.shms, self.expected)
            for t, want in zip(TARGETS, wants)
        )

    def check(self, method, request, fields: tuple[str, ...] = (), undo=None):
        """Call; a refusal must be precise, name one of ``fields`` and change
        nothing; an accepted request is undone (``undo(answer)``, then a restore)."""
        try:
            answer = call(method, request, 10.0)
        except KVError as err:
            assert err.code not in BAD_CODES, f"{err} for {request!r:.400}"
            assert err.message, f"{err.code} without a message for {request!r:.400}"
            if fields:
                assert any(f in err.message for f in fields), f"{err} names none of {fields}"
            assert self.state() == self.base, f"refused {request!r:.400} changed state ({err})"
            assert self.golden_loads()
            return err
        if undo is not None:
            undo(answer)
        if self.state() != self.base:
            self.restore()
        return answer

    def release_lease(self, answer) -> None:
        """Undo an accepted Query (a response, or its bytes from a raw call)."""
        if isinstance(answer, bytes):
            answer = pb.QueryResponse.FromString(answer)
        if answer.lease_id:
            self.client.release(answer.lease_id)

    def close(self) -> None:
        self.session.close()
        self.client.close()
        self.server.stop()
        for shm in self.shms:
            shm.close()


@pytest.fixture(scope="module")
def env():
    e = Env()
    yield e
    assert e.golden_loads(), "golden blocks no longer load byte-exact"
    assert e.client.stats().sealed_instances == 1  # property 3: alive and sane
    e.close()


# ------------------------------------------------------------------ strategies

U32 = st.one_of(st.integers(0, 40), st.integers(0, 2**32 - 1), st.sampled_from([2**32 - 1, 2**31]))
U64 = st.one_of(
    st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 2**63, 2**64 - 1]), st.integers(0, 64)
)
HASH = st.one_of(st.sampled_from([h for h, _ in GOLDEN]), U64)
NAME = st.one_of(
    st.text(max_size=12),
    st.text(max_size=400),
    st.sampled_from(["", "fz", "fuzz", "a" * 300, "../x", "/dev/shm", "x\x00y", ".", ".."]),
)


@st.composite
def hash_lists(draw, allow_oversize=True):
    if allow_oversize and draw(st.integers(0, 15)) == 0:
        return [draw(HASH)] * (MAX_BLOCKS_PER_REQUEST + draw(st.integers(1, 3)))
    hashes = draw(st.lists(HASH, max_size=12))
    if hashes and draw(st.booleans()):
        hashes.append(draw(st.sampled_from(hashes)))  # a duplicate
    return hashes


@st.composite
def namespaces(draw, env_ns: str):
    return draw(st.one_of(st.just(env_ns), st.just(env_ns + "x"), NAME, st.just("fuzz")))


@st.composite
def block_refs(draw) -> dict:
    """A Save's or Load's block_hashes and block_ids: mostly valid, so real saves
    and loads happen; some too many, with a pair twice, out of range or of two lengths."""
    if draw(st.integers(0, 15)) == 0:
        n = MAX_BLOCKS_PER_REQUEST + 1
        return dict(block_hashes=list(range(n)), block_ids=[0] * n)
    ids = st.integers(0, NUM_BLOCKS - 1)
    if draw(st.integers(0, 2)) == 0:
        ids = st.one_of(ids, st.integers(0, NUM_BLOCKS + 2), U32)
    refs = draw(st.lists(st.tuples(HASH, ids), max_size=10))
    if refs and draw(st.integers(0, 3)) == 0:
        refs.append(draw(st.sampled_from(refs)))
    hashes, block_ids = [h for h, _ in refs], [b for _, b in refs]
    if draw(st.integers(0, 7)) == 0:  # one array longer than the other
        if draw(st.booleans()):
            block_ids.append(draw(ids))
        else:
            hashes.append(draw(HASH))
    return dict(block_hashes=hashes, block_ids=block_ids)


@st.composite
def callers(draw, env: Env):
    """instance_id, rank, session: the real ones, each possibly replaced."""
    real = st.sampled_from([True, True, True, False])
    return (
        "fz" if draw(real) else draw(NAME),
        0 if draw(real) else draw(U32),
        env.session.session if draw(real) else draw(NAME),
    )


# ------------------------------------------------------------------ block RPCs


def test_save_and_load_fuzz(env):
    @FUZZ
    @given(data=st.data())
    def run(data):
        instance_id, rank, session = data.draw(callers(env))
        blocks = data.draw(block_refs())
        kind = data.draw(st.sampled_from(["Save", "Load"]))
        cls = pb.SaveRequest if kind == "Save" else pb.LoadRequest
        req = cls(instance_id=instance_id, rank=rank, session=session, **blocks)
        env.check(getattr(env.stub, kind), req, BLOCK_FIELDS)

    run()


def test_query_release_fuzz(env):
    @FUZZ
    @given(data=st.data())
    def run(data):
        req = pb.QueryRequest(
            namespace=data.draw(namespaces(env.ns)),
            block_hashes=data.draw(hash_lists()),
            lease=data.draw(st.booleans()),
            lease_ms=data.draw(st.one_of(st.integers(0, 100), U32)),
        )
        fields = ("namespace", "block_hashes", "lease_ms")
        answer = env.check(env.stub.Query, req, fields, undo=env.release_lease)
        if len(req.block_hashes) <= MAX_BLOCKS_PER_REQUEST and not is_final_namespace(
            req.namespace
        ):
            assert isinstance(answer, KVError) and answer.code == Code.INVALID_ARGUMENT
        held = answer.lease_id if isinstance(answer, pb.QueryResponse) else ""
        lease_id = data.draw(st.one_of(NAME, st.just(held)))
        err = env.check(env.stub.Release, pb.ReleaseRequest(lease_id=lease_id), ("lease_id",))
        assert isinstance(err, KVError) and err.code == Code.NOT_FOUND

    run()


def test_prefetch_without_transfer_fuzz(env):
    @FUZZ
    @given(ns=namespaces(env.ns), hashes=hash_lists())
    def run(ns, hashes):
        req = pb.PrefetchRequest(namespace=ns, block_hashes=hashes)
        err = env.check(env.stub.Prefetch, req, ("namespace", "block_hashes", "transfer"))
        assert isinstance(err, KVError), "Prefetch without transfer cannot succeed"
        if len(hashes) > MAX_BLOCKS_PER_REQUEST:
            assert err.code == Code.INVALID_ARGUMENT and "block_hashes" in err.message
        elif not is_final_namespace(ns):
            assert err.code == Code.INVALID_ARGUMENT and "namespace" in err.message
        elif len(set(hashes)) < len(hashes):  # looked for once the caller may see ns
            assert err.code == Code.INVALID_ARGUMENT and "block_hashes" in err.message
        else:
            assert err.code in (Code.FAILED_PRECONDITION, Code.UNAVAILABLE)

    run()


def test_prefetch_with_transfer_fuzz():
    """Transfer on, no peer: a bad request is refused precisely, a good one fetches
    nothing and changes nothing; a namespace no local instance serves is refused."""
    server = ServerThread(
        pool_size=4 << 20, device="cpu", slab_bytes=1 << 20, transfer=True, fetch_timeout_s=2
    )
    client = StoreClient(server.address)
    shms = [kv_cache_shm("kv_first", 8, BLOCK_SIZE, HEADS, HEAD_DIM) for _ in range(LAYERS)]
    layers = [KVLayer(f"layer.{i}", s.tensor, "kv_first", "NHD", s) for i, s in enumerate(shms)]
    session = client.register("pf", "fuzz", layers, block_size=BLOCK_SIZE)
    ns = session.wait_sealed(10).final_namespace
    before = client.stats()

    @FUZZ
    @given(namespace=namespaces(ns), hashes=hash_lists())
    def run(namespace, hashes):
        req = pb.PrefetchRequest(namespace=namespace, block_hashes=hashes)
        try:
            answer = call(client.stub.Prefetch, req, 10)
        except KVError as err:
            assert err.code in (Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION), err
            assert "namespace" in err.message or "block_hashes" in err.message, err
            assert namespace != ns or len(set(hashes)) < len(hashes) or len(hashes) > 8192
        else:
            assert namespace == ns and answer.fetched_blocks == 0
        after = client.stats()
        assert [getattr(after, f) for f in STATE_FIELDS] == [
            getattr(before, f) for f in STATE_FIELDS
        ]

    try:
        run()
    finally:
        session.close()
        client.close()
        server.stop()
        for s in shms:
            s.close()


def test_clear_stats_events_fuzz(env):
    events = env.stub.Events(pb.EventsRequest(), timeout=60)

    @FUZZ
    @given(ns=namespaces(env.ns))
    def run(ns):
        answer = env.check(env.stub.Clear, pb.ClearRequest(namespace=ns), ("namespace",))
        assert isinstance(answer, KVError) == bool(ns and not is_final_namespace(ns)), ns
        env.check(env.stub.Stats, pb.StatsRequest())

    try:
        run()
        env.restore()
        first = next(events)  # the stream survived and still delivers
        assert first.payload
    finally:
        events.cancel()


@pytest.mark.parametrize("kind", ["Save", "Load"])
def test_block_arrays_of_two_lengths_are_refused(env, kind):
    """A block_id a block_hash: arrays of two lengths name both, and change nothing."""
    cls = pb.SaveRequest if kind == "Save" else pb.LoadRequest
    caller = dict(instance_id="fz", rank=0, session=env.session.session)
    for hashes, block_ids in [([0xB001, 0xB002], [0]), ([0xB001], [0, 1]), ([], [0])]:
        req = cls(**caller, block_hashes=hashes, block_ids=block_ids)
        err = env.check(getattr(env.stub, kind), req)
        assert err.code == Code.INVALID_ARGUMENT
        assert f"block_ids has {len(block_ids)} entries and block_hashes {len(hashes)}" in (
            err.message
        )


@pytest.mark.parametrize("kind", ["Save", "Load"])
def test_an_old_clients_blocks_field_is_refused_by_name(env, kind):
    """A client older than the packed arrays sends field 4 (a BlockRef a block):
    it parsed as no block at all ("block_hashes is empty"), though it sent some.
    Now the retired field is named, and nothing changes."""
    cls = pb.SaveRequest if kind == "Save" else pb.LoadRequest
    old_ref = b"\x09" + struct.pack("<Q", 0xA000) + b"\x10\x00"  # block_hash, block_id
    caller = cls(instance_id="fz", rank=0, session=env.session.session).SerializeToString()
    body = caller + b"\x22" + bytes([len(old_ref)]) + old_ref
    err = env.check(getattr(env.stub, kind), cls.FromString(body))
    assert err.code == Code.INVALID_ARGUMENT
    assert "blocks (field 4, a message a block) is retired" in err.message


def test_requests_from_an_unsealed_instance_are_precondition(env):
    """A rank of a two-rank instance is in but the instance is not sealed."""
    shms = [kv_cache_shm("kv_first", 8, BLOCK_SIZE, HEADS, HEAD_DIM) for _ in range(LAYERS)]
    layers = [KVLayer(f"layer.{i}", s.tensor, "kv_first", "NHD", s) for i, s in enumerate(shms)]
    sess = env.client.register("half", "fuzz", layers, tp_size=2, block_size=BLOCK_SIZE)
    try:
        base, env.base = env.base, env.state()
        req = pb.SaveRequest(
            instance_id="half", rank=0, session=sess.session, block_hashes=[1], block_ids=[0]
        )
        err = env.check(env.stub.Save, req)
        assert err.code == Code.FAILED_PRECONDITION
        err = env.check(env.stub.Load, pb.LoadRequest(**_fields(req)))
        assert err.code == Code.FAILED_PRECONDITION
    finally:
        sess.close()
        for s in shms:
            s.close()
        env.base = base
        assert wait_for(lambda: env.state() == env.base)


def _fields(req) -> dict:
    return {f.name: v for f, v in req.ListFields()}


# ------------------------------------------------------------------ RegisterLayers

LAYER_FIELDS = {
    "name": NAME,
    "dtype": st.one_of(NAME, st.sampled_from(["float16", "bfloat16", "int8", "float64"])),
    "bytes_per_block": U64,
    "segments": U32,
    "kv_layout": st.one_of(NAME, st.sampled_from(["NHD", "HND", "MLA"])),
    "layout_kind": st.integers(0, 7),
    "num_blocks": U32,
    "block_stride": U64,
    "segment_stride": U64,
    "replicated": st.booleans(),
}
REQUEST_FIELDS = {
    "instance_id": NAME,
    "client_namespace": NAME,
    "rank": U32,
    "tp_rank": U32,
    "tp_size": U32,
    "world_size": U32,
    "block_size": U32,
    "hash_format": NAME,
}

REGISTRATION_WORDS = (*REQUEST_FIELDS, *LAYER_FIELDS, "layer", "memory", "instance")


@st.composite
def memories(draw, good: pb.MemoryHandle):
    which = draw(st.sampled_from(["keep", "none", "host", "cuda"]))
    memory = pb.MemoryHandle()
    if which == "keep":
        memory.CopyFrom(good)
    elif which == "host":
        memory.host.name = draw(st.one_of(st.just(good.host.name), NAME))
        memory.host.size = draw(st.one_of(st.just(good.host.size), U64))
        memory.host.offset = draw(st.one_of(st.just(good.host.offset), U64))
    elif which == "cuda":
        memory.cuda.handle = draw(
            st.one_of(st.binary(max_size=80), st.binary(min_size=64, max_size=64))
        )
        memory.cuda.device_uuid = draw(NAME)
        memory.cuda.size = draw(U64)
        memory.cuda.offset = draw(U64)
    return memory


@st.composite
def registrations(draw, good: pb.RegisterLayersRequest):
    req = pb.RegisterLayersRequest()
    req.CopyFrom(good)
    for key in draw(st.sets(st.sampled_from(sorted(REQUEST_FIELDS)), max_size=3)):
        setattr(req, key, draw(REQUEST_FIELDS[key]))
    action = draw(st.sampled_from(["mutate", "mutate", "drop", "dup", "none", "many"]))
    if action == "mutate":
        layer = req.layers[draw(st.integers(0, len(req.layers) - 1))]
        for key in draw(st.sets(st.sampled_from(sorted(LAYER_FIELDS)), max_size=3)):
            setattr(layer, key, draw(LAYER_FIELDS[key]))
        layer.memory.CopyFrom(draw(memories(layer.memory)))
    elif action == "drop":
        del req.layers[0]
    elif action == "dup":
        req.layers.append(req.layers[0])
    elif action == "none":
        del req.layers[:]
    else:
        req.layers.extend([req.layers[0]] * 1100)
    return req


def register_once(env: Env, req: pb.RegisterLayersRequest):
    """The first answer of a RegisterLayers call; a refusal as a KVError."""
    stream = env.stub.RegisterLayers(req, timeout=20)
    try:
        return next(stream)
    except Exception as exc:  # grpc.RpcError
        return KVError(Code.from_name(exc.code().name), exc.details() or "")
    finally:
        stream.cancel()


def test_register_layers_fuzz(env):
    shms = [kv_cache_shm("kv_first", 8, BLOCK_SIZE, HEADS, HEAD_DIM) for _ in range(LAYERS)]
    layers = [KVLayer(f"layer.{i}", s.tensor, "kv_first", "NHD", s) for i, s in enumerate(shms)]
    good = pb.RegisterLayersRequest(
        instance_id="reg",
        client_namespace="fuzz",
        tp_size=2,
        world_size=2,
        block_size=BLOCK_SIZE,
        hash_format="kvstore-blake3-v1",
        layers=[layer.spec() for layer in layers],
    )

    @FUZZ
    @given(req=registrations(good))
    def run(req):
        answer = register_once(env, req)
        if isinstance(answer, KVError):
            assert answer.code not in BAD_CODES, f"{answer} for {req!r:.600}"
            assert any(f in answer.message for f in REGISTRATION_WORDS), answer
        # accepted or refused, once the call ended nothing may be left
        assert wait_for(lambda: env.state() == env.base, timeout=10), f"{req!r:.600}"

    try:
        run()
        assert env.golden_loads()
    finally:
        for s in shms:
            s.close()


# ------------------------------------------------------------------ raw bytes

UNARY = ["Save", "Load", "Query", "Prefetch", "Release", "Clear", "Stats"]


def valid_requests(env: Env) -> dict:
    hashes = [h for h, _ in GOLDEN]
    caller = dict(
        instance_id="fz",
        rank=0,
        session=env.session.session,
        block_hashes=hashes,
        block_ids=TARGETS,
    )
    return {
        "Save": pb.SaveRequest(**caller),
        "Load": pb.LoadRequest(**caller),
        "Query": pb.QueryRequest(namespace=env.ns, block_hashes=hashes, lease=True),
        "Prefetch": pb.PrefetchRequest(namespace=env.ns, block_hashes=hashes),
        "Release": pb.ReleaseRequest(lease_id="0" * 24),
        "Clear": pb.ClearRequest(namespace=env.ns),
        "Stats": pb.StatsRequest(),
        "RegisterLayers": pb.RegisterLayersRequest(instance_id="raw", client_namespace="fuzz"),
    }


@st.composite
def payloads(draw, valid: bytes):
    """Random bytes, or a valid encoding truncated, with a byte changed, or with
    bytes that are not UTF-8 in its first string field."""
    how = draw(st.sampled_from(["random", "truncate", "flip", "utf8"]))
    if how == "random" or not valid:
        return draw(st.binary(max_size=64))
    if how == "truncate":
        return valid[: draw(st.integers(0, len(valid) - 1))]
    if how == "flip":
        at = draw(st.integers(0, len(valid) - 1))
        return valid[:at] + bytes([draw(st.integers(0, 255))]) + valid[at + 1 :]
    return b"\x0a\x02\xff\xfe" + valid  # field 1, 2 bytes that are not UTF-8


class RawStream:
    """A server-streaming method called with raw bytes: its first answer."""

    def __init__(self, method):
        self.method = method

    def __call__(self, data: bytes, timeout: float):
        stream = self.method(data, timeout=timeout)
        try:
            return next(stream)
        finally:
            stream.cancel()


def test_raw_bytes_fuzz(env):
    """Bytes that are not the method's message: INVALID_ARGUMENT, never UNKNOWN."""
    valid = {k: v.SerializeToString() for k, v in valid_requests(env).items()}
    channel = env.client.channel
    methods = {name: channel.unary_unary(f"/kvstore.v1.KVStore/{name}") for name in UNARY}
    methods["RegisterLayers"] = RawStream(
        channel.unary_stream("/kvstore.v1.KVStore/RegisterLayers")
    )

    @FUZZ
    @given(data=st.data())
    def run(data):
        name = data.draw(st.sampled_from(sorted(methods)))
        payload = data.draw(payloads(valid[name]))
        env.check(methods[name], payload, undo=env.release_lease if name == "Query" else None)
        assert wait_for(lambda: env.state() == env.base, timeout=10), (name, payload)

    run()
