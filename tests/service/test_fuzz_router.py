"""Fuzz every RPC of the router (hypothesis) against a real loopback server.

Properties, for any request however malformed:
1. it is answered with a precise status, never UNKNOWN or INTERNAL, and a
   refusal carries a message naming a field of the request;
2. a refused request changes nothing: the RouterStats counters, the peers'
   index (QueryPrefix over the golden blocks) and what a route over them sees
   (cached tiers, queued and running load) are equal before and after;
3. a PublishEvents batch holding a malformed event (judged here from the
   msgpack, not by the router's decoder) is INVALID_ARGUMENT naming the first
   such event, and one without any is accepted;
4. the server is alive at the end.
An accepted request that changed anything is undone by rebuilding the router
at its golden state before the next one. Raw bytes that are not the method's
message are fuzzed too. Examples are derandomized for CI; KV_FUZZ_EXAMPLES=N
and KV_FUZZ_RANDOM=1 hunt further.
"""

from __future__ import annotations

import math
import os

import grpc
import msgpack
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvstore._proto import router_pb2 as pb
from kvstore._proto import router_pb2_grpc
from kvstore.client.router_client import RouterClient
from kvstore.client.store_client import call
from kvstore.router.core import Router, RouterConfig
from kvstore.wire import limits
from kvstore.wire.card_proto import card_to_proto
from kvstore.wire.errors import Code, KVError
from kvstore.wire.events import EVENT_TYPES, STORED, TIERS, StoreEvent
from kvstore.wire.names import U64_MAX, is_u64
from tests.conftest import wait_for
from tests.router.conftest import Clock, ServerThread, card

pytestmark = pytest.mark.slow

NS = "tenant.0123456789abcdef"
OTHER_NS = "tenant.fedcba9876543210"
MODEL = "llama-8b"
NODE = "node-a"
GOLDEN = [0xA000 + i for i in range(4)]  # the peer's store holds all, w0's GPU the first 2
BAD_CODES = {Code.UNKNOWN, Code.INTERNAL}
ROUTE_FIELDS = (
    "worker",
    "generation",
    "total_blocks",
    "overlap_blocks",
    "gpu_blocks",
    "store_blocks",
    "remote_blocks",
    "ttft_ms",
    "queued_tokens",
    "uncached_tokens",
    "running_requests",
    "load_reported",
)
FUZZ = settings(
    max_examples=int(os.environ.get("KV_FUZZ_EXAMPLES", "100")),
    deadline=None,
    derandomize=os.environ.get("KV_FUZZ_RANDOM") is None,
    suppress_health_check=list(HealthCheck),
    database=None,
)

# ------------------------------------------------------------------ the harness


class Env:
    """A router on a real server, at its golden state: worker w0 (GPU blocks,
    a load report, one queued and one running request) and peer node-a
    (store blocks), on a clock that never moves (no lease or load expires)."""

    def __init__(self):
        self.server: ServerThread | None = None
        self.rebuild()

    def rebuild(self) -> None:
        """A new router and server, set up at the golden state; the baseline taken."""
        if self.server is not None:
            self.close()
        self.server = ServerThread(Router(RouterConfig(), clock=Clock()))
        self.client = RouterClient(self.server.address)
        self.channel = grpc.insecure_channel(self.server.address)
        self.stub = router_pb2_grpc.RouterStub(self.channel)
        c = self.client
        self.w0 = c.register_worker("w0", card(address="10.0.0.1:8000", node_id=NODE)).generation
        self.peer = c.advertise_peer(NODE, "127.0.0.1:50051", "127.0.0.1:13337", [NS])
        reply = c.publish(
            [
                StoreEvent(STORED, NS, GOLDEN, NODE),
                StoreEvent(STORED, NS, GOLDEN[:2], "w0", tier="gpu"),
            ]
        )
        assert (reply.applied, reply.dropped) == (2, 0)
        c.report_load("w0", 100, 2, 0.5)
        c.route(MODEL, hashes=GOLDEN, request_id="req-0")
        c.route(MODEL, hashes=GOLDEN[:1], request_id="req-1")
        c.request_started("req-1")
        self.base = self.state()

    def state(self) -> dict:
        """Every counter but those of refusals (rejected_registrations, and the
        events of publishes refused as not from the advertised generation), the
        peers' prefixes of GOLDEN and what a route over GOLDEN sees."""
        reply = self.client.stats()
        stats = {f.name: getattr(reply, f.name) for f in reply.DESCRIPTOR.fields}
        del stats["rejected_registrations"]
        drops = reply.dropped_by
        stats["events_dropped"] -= drops.stale_generation
        stats["dropped_by"] = {
            f.name: getattr(drops, f.name)
            for f in drops.DESCRIPTOR.fields
            if f.name != "stale_generation"
        }
        peers = [(p.node_id, p.prefix_blocks) for p in self.client.query_prefix(NS, GOLDEN)]
        try:
            reply = self.client.route(MODEL, hashes=GOLDEN, track=False)
        except KVError as err:  # no worker left to route to
            route = {"refused": err.code}
        else:
            route = {f: getattr(reply, f) for f in ROUTE_FIELDS}
        return {"stats": stats, "peers": peers, "route": route}

    def check(self, method: str, request, fields: tuple[str, ...] = ()):
        """Call ``method``; a refusal must be precise, name one of ``fields`` and
        change nothing; after an accepted call that changed anything, rebuild."""
        try:
            answer = self.invoke(method, request)
        except KVError as err:
            event(f"{method}: {err.code.name}")  # --hypothesis-show-statistics
            self.refused(err, request, fields)
            return err
        event(f"{method}: accepted")
        if self.state() != self.base:
            self.rebuild()
        return answer

    def invoke(self, method: str, request):
        stub_method = getattr(self.stub, method)
        if method == "WorkerSession":
            return first_answer(stub_method, request)
        return call(stub_method, request, 10.0)

    def refused(self, err: KVError, request, fields: tuple[str, ...]) -> None:
        assert err.code not in BAD_CODES, f"{err} for {request!r:.400}"
        assert err.message, f"{err.code} without a message for {request!r:.400}"
        if fields:
            assert any(f in err.message for f in fields), f"{err} names none of {fields}"
        assert self.state() == self.base, f"refused {request!r:.400} changed state ({err})"

    def close(self) -> None:
        self.channel.close()
        self.client.close()
        self.server.stop()


def first_answer(method, request, timeout: float = 10.0):
    """The first answer of a server-streaming call, which is then cancelled."""
    stream = method(request, timeout=timeout)
    try:
        return next(stream)
    except grpc.RpcError as exc:
        raise KVError(Code.from_name(exc.code().name), exc.details() or "") from None
    finally:
        stream.cancel()


@pytest.fixture(scope="module")
def env():
    e = Env()
    yield e
    assert e.state() == e.base  # property 4: alive, answering, at its golden state
    e.close()


# ------------------------------------------------------------------ strategies

U32 = st.one_of(st.integers(0, 40), st.integers(0, 2**32 - 1), st.sampled_from([2**32 - 1, 2**31]))
U64 = st.one_of(
    st.integers(0, U64_MAX), st.sampled_from([0, 1, 2**63, U64_MAX]), st.integers(0, 64)
)
HASH = st.one_of(st.sampled_from(GOLDEN), U64)
NAME = st.one_of(
    st.text(max_size=12),
    st.text(max_size=300),
    st.sampled_from(["", "w0", NODE, MODEL, "a" * 300, "x\x00y", "\n", " ", NS, OTHER_NS]),
)
DOUBLE = st.one_of(
    st.floats(), st.sampled_from([0.0, 1.0, -0.0, math.nan, math.inf, -math.inf, 1e308, -1.0])
)


@st.composite
def hash_lists(draw, largest: int = limits.MAX_BLOCK_HASHES):
    if draw(st.integers(0, 15)) == 0:
        return [draw(HASH)] * (largest + draw(st.integers(1, 3)))
    return draw(st.lists(HASH, max_size=8))


@st.composite
def namespaces(draw):
    good = st.sampled_from([NS, OTHER_NS])
    return draw(st.one_of(good, good, st.sampled_from([NS + "x", "tenant", NS[:-1]]), NAME))


# ------------------------------------------------------------------ workers

CARD = card_to_proto(card(address="10.0.0.2:8000"))
CARD_WORDS = tuple(f.name for f in pb.WorkerCard.DESCRIPTOR.fields)
REGISTRATION_WORDS = (*CARD_WORDS, "name", "card")


def card_value(field):
    """A strategy for one WorkerCard field, by its protobuf type."""
    if field.message_type is not None:  # map<string, string> extra_files
        return st.one_of(
            st.dictionaries(NAME, NAME, max_size=3),
            st.just({f"f{i}": "x" for i in range(limits.MAX_EXTRA_FILES + 1)}),
        )
    if field.is_repeated:
        return st.one_of(st.lists(NAME, max_size=3), st.just(["a"] * 65))
    if field.type == field.TYPE_BOOL:
        return st.booleans()
    if field.type == field.TYPE_UINT32:
        return U32
    if field.type == field.TYPE_UINT64:
        return U64
    return st.one_of(NAME, st.just("x" * (limits.MAX_TEXT_LEN + 1)))


CARD_FIELDS = {f.name: f for f in pb.WorkerCard.DESCRIPTOR.fields}


@st.composite
def registrations(draw):
    msg = pb.WorkerCard()
    msg.CopyFrom(CARD)
    for name in draw(st.sets(st.sampled_from(sorted(CARD_FIELDS)), max_size=3)):
        value = draw(card_value(CARD_FIELDS[name]))
        if name == "extra_files":
            msg.extra_files.clear()
            msg.extra_files.update(value)
        elif isinstance(value, list):
            del getattr(msg, name)[:]
            getattr(msg, name).extend(value)
        else:
            setattr(msg, name, value)
    name = draw(st.one_of(st.sampled_from(["w0", "w-new"]), NAME))
    return pb.RegisterWorkerRequest(name=name, card=msg)


def test_register_worker_fuzz(env):
    @FUZZ
    @given(req=registrations())
    def run(req):
        env.check("RegisterWorker", req, REGISTRATION_WORDS)

    run()


def test_worker_session_fuzz(env):
    """Accepted or refused, once the session's call ends its worker is gone."""

    @FUZZ
    @given(req=registrations())
    def run(req):
        try:
            answer = env.invoke("WorkerSession", req)
        except KVError as err:
            env.refused(err, req, REGISTRATION_WORDS)
            return
        if answer.name == "w0":  # replaced the golden worker: its blocks went with it
            env.rebuild()
            return
        assert wait_for(lambda: env.state() == env.base, timeout=10), f"{req!r:.400}"

    run()


def test_remove_worker_fuzz(env):
    @FUZZ
    @given(
        name=st.one_of(st.just("w0"), NAME),
        generation=st.one_of(st.sampled_from([0, env.w0]), U64),
    )
    def run(name, generation):
        req = pb.RemoveWorkerRequest(name=name, generation=generation)
        answer = env.check("RemoveWorker", req, ("worker", "name", "generation"))
        if isinstance(answer, KVError):
            valid = 0 < len(name) <= limits.MAX_NAME_LEN and name.isprintable()
            assert answer.code == (Code.NOT_FOUND if valid else Code.INVALID_ARGUMENT), answer
        else:
            assert name == "w0" and generation in (0, env.w0)

    run()


# ------------------------------------------------------------------ routes and load


@st.composite
def routes(draw):
    tokens = st.one_of(
        st.lists(U32, max_size=70),
        st.just([]),
        st.builds(lambda n: [1] * n, st.sampled_from([limits.MAX_TOKEN_IDS + 1])),
    )
    token_ids = draw(tokens) if draw(st.integers(0, 3)) == 0 else []
    hashes = draw(hash_lists()) if draw(st.booleans()) else []
    return pb.RouteRequest(
        model=draw(st.one_of(st.just(MODEL), NAME)),
        namespace=draw(st.one_of(st.just(""), st.just(""), st.just("default"), NAME)),
        role=draw(st.one_of(st.just(""), st.just(""), st.just("decode"), NAME)),
        token_ids=token_ids,
        block_hashes=hashes,
        request_id=draw(st.one_of(st.just(""), st.just("req-0"), NAME)),
        track=draw(st.booleans()),
        decode_tokens=draw(U32),
    )


ROUTE_WORDS = (
    "model",
    "namespace",
    "role",
    "token_ids",
    "block_hashes",
    "request_id",
    "decode_tokens",
)


def test_route_fuzz(env):
    @FUZZ
    @given(req=routes())
    def run(req):
        answer = env.check("Route", req, ROUTE_WORDS)
        if isinstance(answer, pb.RouteResponse):
            assert answer.worker == "w0" and answer.total_blocks <= len(req.block_hashes) + (
                len(req.token_ids) // 16
            )

    run()


def test_report_load_fuzz(env):
    @FUZZ
    @given(
        worker=st.one_of(st.just("w0"), st.just("w0"), NAME),
        queued=st.one_of(st.integers(0, limits.MAX_QUEUED_PREFILL_TOKENS), U64),
        running=st.one_of(st.integers(0, limits.MAX_RUNNING_REQUESTS), U32),
        usage=st.one_of(st.floats(0.0, 1.0), DOUBLE),
    )
    def run(worker, queued, running, usage):
        req = pb.ReportLoadRequest(
            worker=worker, queued_prefill_tokens=queued, running_requests=running, kv_usage=usage
        )
        fields = ("worker", "queued_prefill_tokens", "running_requests", "kv_usage")
        answer = env.check("ReportLoad", req, fields)
        ok = (
            worker == "w0"
            and queued <= limits.MAX_QUEUED_PREFILL_TOKENS
            and running <= limits.MAX_RUNNING_REQUESTS
            and 0.0 <= usage <= 1.0
        )
        assert isinstance(answer, KVError) != ok, (req, answer)

    run()


def test_request_life_cycle_fuzz(env):
    request_ids = st.one_of(st.sampled_from(["req-0", "req-1"]), NAME)

    @FUZZ
    @given(
        started=st.booleans(),
        request_id=request_ids,
        cached=st.one_of(st.none(), U32),
    )
    def run(started, request_id, cached):
        if started:
            req = pb.RequestStartedRequest(request_id=request_id)
            env.check("RequestStarted", req, ("request_id",))
        else:
            req = pb.RequestFinishedRequest(request_id=request_id, cached_blocks=cached)
            env.check("RequestFinished", req, ("request_id", "cached_blocks"))

    run()


# ------------------------------------------------------------------ peers

PEER_WORDS = (
    "node_id",
    "store_address",
    "ucx_address",
    "final_namespaces",
    "generation",
    "lease_ms",
)


def test_advertise_peer_fuzz(env):
    @FUZZ
    @given(data=st.data())
    def run(data):
        many = [f"t{i}.0123456789abcdef" for i in range(limits.MAX_NAMESPACES_PER_PEER + 1)]
        req = pb.AdvertisePeerRequest(
            node_id=data.draw(st.one_of(st.sampled_from([NODE, "node-b"]), NAME)),
            store_address=data.draw(st.one_of(st.just("h:1"), NAME, st.just("h" * 600))),
            ucx_address=data.draw(st.one_of(st.just(""), NAME, st.just("h" * 600))),
            final_namespaces=data.draw(
                st.one_of(
                    st.lists(st.sampled_from([NS, OTHER_NS]), max_size=3),
                    st.lists(namespaces(), max_size=4),
                    st.just(many),
                )
            ),
            generation=data.draw(st.one_of(st.just(0), st.just(env.peer), U64)),
            lease_ms=data.draw(st.one_of(st.just(0), U32)),
        )
        env.check("AdvertisePeer", req, PEER_WORDS)

    run()


def test_query_prefix_fuzz(env):
    @FUZZ
    @given(
        ns=namespaces(), hashes=hash_lists(), exclude=st.one_of(st.sampled_from(["", NODE]), NAME)
    )
    def run(ns, hashes, exclude):
        req = pb.QueryPrefixRequest(
            final_namespace=ns, block_hashes=hashes, exclude_node_id=exclude
        )
        answer = env.check("QueryPrefix", req, ("final_namespace", "block_hashes"))
        if isinstance(answer, pb.QueryPrefixResponse):
            want = ns == NS and exclude != NODE and bool(hashes) and hashes[0] in GOLDEN
            assert bool(answer.peers) == want, (req, answer)

    run()


# ------------------------------------------------------------------ PublishEvents

REQUIRED = ("type", "namespace", "block_hashes", "worker")
WRONG = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), U64_MAX),
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.lists(st.one_of(st.integers(-5, 5), st.none(), st.text(max_size=2)), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(0, 9), max_size=2),
)


def is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def valid_value(key: str, v: object) -> bool:
    """The reference judgement of one field of a store event (docs/design.md §6)."""
    if key in ("type", "tier"):
        return isinstance(v, str) and v in (EVENT_TYPES if key == "type" else TIERS)
    if key in ("namespace", "worker"):
        return isinstance(v, str)
    if key == "block_hashes":
        return isinstance(v, list) and len(v) <= limits.MAX_HASHES_PER_EVENT and all(map(is_u64, v))
    if key == "parent_hash":
        return v is None or is_u64(v)
    if key == "token_ids":
        return isinstance(v, list) and all(is_u64(t) and t < 2**32 for t in v)
    if key == "seq":
        return is_u64(v)
    if key == "ts":
        return is_number(v)
    return False  # an unknown key


def valid_event(payload: bytes) -> bool:
    """Judge a payload from its msgpack alone."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception:  # msgpack raises several types: any makes it invalid
        return False
    if not isinstance(raw, dict) or not all(isinstance(k, str) for k in raw):
        return False
    if not all(k in raw for k in REQUIRED) or not all(valid_value(k, v) for k, v in raw.items()):
        return False
    if raw["type"] == "cleared" and raw["block_hashes"]:
        return False
    return raw["type"] == STORED or raw.get("parent_hash") is None


@st.composite
def good_events(draw) -> dict:
    kind = draw(st.sampled_from(EVENT_TYPES))
    return {
        "type": kind,
        "namespace": draw(st.sampled_from([NS, OTHER_NS, "not-final", ""])),
        "block_hashes": [] if kind == "cleared" else draw(st.lists(HASH, max_size=6)),
        "parent_hash": draw(st.one_of(st.none(), U64)) if kind == STORED else None,
        "token_ids": draw(st.lists(st.integers(0, 2**32 - 1), max_size=3)),
        "worker": draw(st.sampled_from([NODE, "w0", "node-b", ""])),
        "tier": draw(st.sampled_from(TIERS)),
        "seq": draw(U64),
        "ts": draw(st.one_of(st.floats(allow_nan=False, allow_infinity=False), U64)),
    }


@st.composite
def event_payloads(draw) -> bytes:
    raw = draw(good_events())
    how = draw(st.sampled_from(["good", "good", "field", "field", "item", "key", "whole"]))
    if how == "field":
        key = draw(st.sampled_from(sorted(raw)))
        raw[key] = draw(WRONG)
    elif how == "item":
        key = draw(st.sampled_from(["block_hashes", "token_ids"]))
        raw[key] = [*raw[key], draw(WRONG)]
    elif how == "key":
        which = draw(st.sampled_from(["missing", "unknown", "binary"]))
        if which == "missing":
            del raw[draw(st.sampled_from(sorted(raw)))]
        elif which == "unknown":
            raw[draw(st.text(max_size=8))] = draw(WRONG)
        else:
            raw[draw(st.binary(min_size=1, max_size=8))] = 1
    elif how == "whole":
        return draw(st.one_of(st.binary(max_size=40), st.builds(msgpack.packb, WRONG)))
    return msgpack.packb(raw, use_bin_type=True)


def test_publish_events_fuzz(env):
    @FUZZ
    @given(data=st.data())
    def run(data):
        if data.draw(st.integers(0, 20)) == 0:
            payloads = [b""] * (limits.MAX_EVENTS_PER_PUBLISH + 1)
        else:
            payloads = data.draw(st.lists(event_payloads(), max_size=4))
        node_id = data.draw(st.one_of(st.just(NODE), st.just(NODE), NAME))
        generation = data.draw(st.one_of(st.just(env.peer), st.just(env.peer), U64))
        req = pb.PublishEventsRequest(node_id=node_id, generation=generation, events=payloads)
        answer = env.check("PublishEvents", req, ("node_id", "events"))
        bad = [i for i, p in enumerate(payloads) if not valid_event(p)]
        node_ok = 0 < len(node_id) <= limits.MAX_NAME_LEN and node_id.isprintable()
        if not node_ok:
            assert isinstance(answer, KVError) and "node_id" in answer.message, answer
        elif len(payloads) > limits.MAX_EVENTS_PER_PUBLISH:
            assert isinstance(answer, KVError) and answer.code == Code.INVALID_ARGUMENT
        elif bad:
            assert isinstance(answer, KVError), f"accepted malformed events {bad}: {req!r:.600}"
            assert answer.code == Code.INVALID_ARGUMENT, answer
            assert f"events[{bad[0]}]" in answer.message, (answer, bad)
        elif (node_id, generation) == (NODE, env.peer):
            assert isinstance(answer, pb.PublishEventsResponse), answer
            assert answer.applied + answer.dropped == len(payloads)
        else:  # not the peer advertised: said (the store advertises again), not dropped silently
            assert isinstance(answer, KVError) and answer.code == Code.NOT_FOUND, answer

    run()


# ------------------------------------------------------------------ raw bytes

SERVICE = pb.DESCRIPTOR.services_by_name["Router"]


def valid_requests(env: Env) -> dict:
    return {
        "RegisterWorker": pb.RegisterWorkerRequest(name="w-raw", card=CARD),
        "WorkerSession": pb.RegisterWorkerRequest(name="w-raw", card=CARD),
        "RemoveWorker": pb.RemoveWorkerRequest(name="w0", generation=env.w0),
        "Route": pb.RouteRequest(model=MODEL, block_hashes=GOLDEN, request_id="req-0"),
        "ReportLoad": pb.ReportLoadRequest(worker="w0", queued_prefill_tokens=5),
        "RequestStarted": pb.RequestStartedRequest(request_id="req-0"),
        "RequestFinished": pb.RequestFinishedRequest(request_id="req-0", cached_blocks=1),
        "AdvertisePeer": pb.AdvertisePeerRequest(
            node_id=NODE, store_address="h:1", final_namespaces=[NS], generation=env.peer
        ),
        "QueryPrefix": pb.QueryPrefixRequest(final_namespace=NS, block_hashes=GOLDEN),
        "PublishEvents": pb.PublishEventsRequest(
            node_id=NODE,
            generation=env.peer,
            events=[StoreEvent(STORED, NS, GOLDEN, NODE).encode()],
        ),
        "RouterStats": pb.RouterStatsRequest(),
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


def raw_method(channel: grpc.Channel, name: str):
    """Router method ``name`` on ``channel``, called with raw bytes."""
    method = SERVICE.methods_by_name[name]
    make = channel.unary_stream if method.server_streaming else channel.unary_unary
    return make(f"/{SERVICE.full_name}/{name}")


def test_raw_bytes_fuzz(env):
    """Bytes that are not the method's message: INVALID_ARGUMENT, never UNKNOWN."""
    assert {m.name for m in SERVICE.methods} == set(valid_requests(env))  # every RPC covered

    @FUZZ
    @given(data=st.data())
    def run(data):
        name = data.draw(st.sampled_from(sorted(valid_requests(env))))
        valid = valid_requests(env)[name].SerializeToString()
        payload = data.draw(payloads(valid))
        method = raw_method(env.channel, name)
        try:
            if name == "WorkerSession":
                answer = first_answer(method, payload)
            else:
                answer = call(method, payload, 10.0)
        except KVError as err:
            env.refused(err, payload, ())
            return
        if name == "WorkerSession" and pb.RegisterWorkerResponse.FromString(answer).name != "w0":
            wait_for(lambda: env.state() == env.base, timeout=10)
        if env.state() != env.base:
            env.rebuild()

    run()
