"""Every bad registration gets a precise status, changes nothing, and a
corrected registration still seals."""

from __future__ import annotations

import pytest
import torch

from kvstore._proto import store_pb2 as pb
from kvstore.client.store_client import KVLayer, StoreClient, call, kv_cache_shm
from kvstore.testing.raw_client import register_raw
from kvstore.wire.errors import Code, KVError

LAYERS = 2


@pytest.fixture
def kit(server):
    """Shared-memory KV caches for two ranks plus a request builder."""
    caches = {
        r: [kv_cache_shm("kv_first", 8, 4, 2, 16, torch.float16) for _ in range(LAYERS)]
        for r in range(2)
    }
    client = StoreClient(server.address)

    def request(rank=0, tp_rank=None, instance="inst", **fields) -> pb.RegisterLayersRequest:
        layers = [
            KVLayer(f"layer.{i}", shm.tensor, "kv_first", "NHD", shm)
            for i, shm in enumerate(caches[rank])
        ]
        req = pb.RegisterLayersRequest(
            instance_id=instance,
            client_namespace="llama",
            rank=rank,
            tp_rank=rank if tp_rank is None else tp_rank,
            tp_size=2,
            world_size=2,
            block_size=4,
            hash_format="kvstore-blake3-v1",
            layers=[x.spec() for x in layers],
        )
        for key, value in fields.items():
            setattr(req, key, value)
        return req

    sessions = []

    def register(req):
        sess = register_raw(client, req)
        sessions.append(sess)
        return sess

    yield request, register, server
    for sess in sessions:
        sess.close()
    for shms in caches.values():
        for shm in shms:
            shm.close()


def refused(register, req, code, *words):
    with pytest.raises(KVError) as info:
        register(req)
    assert info.value.code == code, info.value
    for word in words:
        assert word in info.value.message, info.value.message
    return info.value


def still_waiting_then_seals(register, request, server, fix=None):
    inst = server.call(lambda: server.server.registry.instances.get("inst"))
    assert inst is None or inst.seal is None
    sess = register(fix or request(rank=1))
    assert sess.wait_sealed(10).final_namespace.startswith("llama.")


def test_two_owners_for_one_cell(kit):
    request, register, server = kit
    register(request(rank=0))
    refused(
        register, request(rank=1, tp_rank=0), Code.ALREADY_EXISTS, "layer.0", "tp_rank 0", "rank 1"
    )
    still_waiting_then_seals(register, request, server)


def test_same_rank_twice(kit):
    request, register, server = kit
    register(request(rank=0))
    refused(register, request(rank=0), Code.ALREADY_EXISTS, "rank 0")
    still_waiting_then_seals(register, request, server)


@pytest.mark.parametrize("shift", [2, 3, 5], ids=["V at next K", "V across two K", "V further"])
def test_strides_that_put_one_blocks_v_onto_another_blocks_k(kit, shift):
    """A kv_first layer whose segment 1 of a block lands on segment 0 of another
    (blocks packed one segment apart, V ``shift`` half-segments after K) seals
    nothing: before, it sealed (it fits its memory), and a one-block Load wrote
    over its neighbour."""
    request, register, server = kit
    bad = request(rank=0)
    layer = bad.layers[1]
    n = layer.bytes_per_block // 2
    layer.block_stride = n
    layer.segment_stride = shift * n // 2
    refused(register, bad, Code.INVALID_ARGUMENT, "layer.1", "segment_stride", "block_stride")
    register(request(rank=0))
    still_waiting_then_seals(register, request, server)


@pytest.mark.parametrize(
    "field,value",
    [
        ("dtype", "bfloat16"),
        ("bytes_per_block", 1024),
        ("kv_layout", "HND"),
    ],
)
def test_geometry_disagreeing_across_ranks(kit, field, value):
    request, register, server = kit
    register(request(rank=0))
    bad = request(rank=1)
    setattr(bad.layers[1], field, value)
    if field == "bytes_per_block":  # 512 bytes a segment: K of 8 blocks, then V
        bad.layers[1].block_stride = 512
        bad.layers[1].segment_stride = 8 * 512
    refused(register, bad, Code.INVALID_ARGUMENT, "layer.1", field, "rank 1")
    still_waiting_then_seals(register, request, server)


def test_segments_disagreeing_across_ranks(kit):
    request, register, server = kit
    register(request(rank=0))
    bad = request(rank=1)
    bad.layers[0].segments = 1
    bad.layers[0].layout_kind = pb.BLOCKS_FIRST
    bad.layers[0].block_stride = bad.layers[0].bytes_per_block
    bad.layers[0].segment_stride = 0
    refused(register, bad, Code.INVALID_ARGUMENT, "layer.0", "segments", "rank 1")
    still_waiting_then_seals(register, request, server)


def test_a_segment_stride_on_a_one_segment_layout(kit):
    """Before: the mapped region refused it with a ValueError, so the caller got
    UNKNOWN and a CUDA mapping stayed open. Now INVALID_ARGUMENT naming it."""
    request, register, server = kit
    bad = request(rank=0)
    for layer in bad.layers:
        layer.segments = 1
        layer.layout_kind = pb.BLOCKS_FIRST
        layer.block_stride = layer.bytes_per_block
        layer.segment_stride = 1
    refused(register, bad, Code.INVALID_ARGUMENT, "layer.0", "segment_stride 1", "blocks_first")
    register(request(rank=0))
    still_waiting_then_seals(register, request, server)


@pytest.mark.parametrize(
    "field,value",
    [
        ("block_size", 8),
        ("hash_format", "vllm-sha256"),
        ("world_size", 4),
        ("client_namespace", "other"),
    ],
)
def test_instance_fields_disagreeing(kit, field, value):
    request, register, server = kit
    register(request(rank=0))
    refused(register, request(rank=1, **{field: value}), Code.INVALID_ARGUMENT, field, "rank 1")
    still_waiting_then_seals(register, request, server)


def test_tp_rank_outside_tp_size(kit):
    request, register, server = kit
    register(request(rank=0))
    refused(register, request(rank=1, tp_rank=2), Code.INVALID_ARGUMENT, "tp_rank 2", "tp_size=2")
    still_waiting_then_seals(register, request, server)


def test_world_size_not_multiple_of_tp(kit):
    request, register, server = kit
    refused(register, request(rank=0, world_size=3), Code.INVALID_ARGUMENT, "world_size 3")
    register(request(rank=0))
    still_waiting_then_seals(register, request, server)


@pytest.mark.parametrize("ns", ["llama.v2", "", "a" * 129, "sp ace"])
def test_bad_client_namespace(kit, ns):
    request, register, server = kit
    refused(
        register, request(rank=0, client_namespace=ns), Code.INVALID_ARGUMENT, "client_namespace"
    )
    register(request(rank=0))
    still_waiting_then_seals(register, request, server)


def test_empty_layer_list(kit):
    request, register, server = kit
    bad = request(rank=0)
    del bad.layers[:]
    refused(register, bad, Code.INVALID_ARGUMENT, "layers is empty", "rank 0")
    register(request(rank=0))
    still_waiting_then_seals(register, request, server)


def test_missing_layer_would_fail_the_seal(kit):
    request, register, server = kit
    register(request(rank=0))
    bad = request(rank=1)
    del bad.layers[1]
    refused(register, bad, Code.FAILED_PRECONDITION, "layer.1", "tp_rank 1")
    still_waiting_then_seals(register, request, server)


def _long_id_and_huge_slots(r) -> None:
    """A 20,000-character instance id was echoed whole by the first refusal (the
    slot-size check), which the reply then exceeded: RESOURCE_EXHAUSTED."""
    r.instance_id = "i" * 20_000
    r.layers[0].bytes_per_block = 16 << 20


def _one_block_of_huge_stride(r) -> None:
    """A one-block layer's stride reaches no byte, but enters every address: 2**63
    registered, and the first copy's address arrays overflowed (OverflowError)."""
    r.layers[0].num_blocks = 1
    r.layers[0].block_stride = 1 << 63


@pytest.mark.parametrize(
    "mutate,words",
    [
        (lambda r: r.layers.extend([r.layers[0]] * 1100), ["layers has", "1024"]),
        (lambda r: setattr(r.layers[0], "name", "x" * 300), ["layers.name"]),
        (lambda r: setattr(r, "instance_id", "i" * 300), ["instance_id"]),
        (_long_id_and_huge_slots, ["bytes_per_block", "instance 'iii"]),  # a bounded echo
        (lambda r: setattr(r.layers[0], "num_blocks", 1 << 30), ["num_blocks"]),
        (lambda r: setattr(r.layers[0], "bytes_per_block", 1 << 40), ["bytes_per_block"]),
        (lambda r: setattr(r, "tp_size", 1000), ["tp_size 1000"]),
        (lambda r: setattr(r, "block_size", 0), ["block_size 0"]),
        (lambda r: setattr(r.layers[0], "segments", 3), ["segments 3"]),
        (lambda r: setattr(r.layers[0], "kv_layout", "XYZ"), ["kv_layout"]),
        (lambda r: setattr(r.layers[1], "name", "layer.0"), ["appears twice"]),
        (_one_block_of_huge_stride, ["block_stride 9223372036854775808 is beyond"]),
        (lambda r: setattr(r.layers[0].memory.host, "offset", 1 << 60), ["memory.offset"]),
    ],
)
def test_out_of_bounds_fields(kit, mutate, words):
    request, register, server = kit
    bad = request(rank=0)
    mutate(bad)
    refused(register, bad, Code.INVALID_ARGUMENT, *words)
    register(request(rank=0))
    still_waiting_then_seals(register, request, server)


def test_unmappable_shared_memory(kit):
    request, register, server = kit
    bad = request(rank=0)
    bad.layers[0].memory.host.name = "kvstore-no-such-object"
    refused(register, bad, Code.FAILED_PRECONDITION, "layer.0", "cannot open shared memory")
    bad = request(rank=0)
    bad.layers[1].memory.host.name = "../etc/passwd"
    refused(register, bad, Code.INVALID_ARGUMENT, "not a valid shared-memory name")
    register(request(rank=0))
    still_waiting_then_seals(register, request, server)


def test_layer_larger_than_its_memory(kit):
    request, register, server = kit
    bad = request(rank=0)
    bad.layers[0].memory.host.offset = 4096
    refused(register, bad, Code.INVALID_ARGUMENT, "layer.0", "exceed")
    bad = request(rank=0)
    bad.layers[0].memory.host.size = 1 << 40
    refused(register, bad, Code.INVALID_ARGUMENT, "size")
    register(request(rank=0))
    still_waiting_then_seals(register, request, server)


def test_missing_memory_handle(kit):
    request, register, server = kit
    bad = request(rank=0)
    bad.layers[0].ClearField("memory")
    refused(register, bad, Code.INVALID_ARGUMENT, "layers[0].memory")
    register(request(rank=0))
    still_waiting_then_seals(register, request, server)


@pytest.mark.parametrize("instance", ["ghost", "g" * 20_000])
def test_unknown_instance(kit, instance):
    """A long unknown id used to be echoed whole: the status outgrew gRPC's
    metadata limit and came back RESOURCE_EXHAUSTED, naming nothing."""
    _request, _register, server = kit
    client = StoreClient(server.address)
    with pytest.raises(KVError) as info:
        call(
            client.stub.Save,
            pb.SaveRequest(
                instance_id=instance,
                rank=0,
                session="x",
                block_hashes=[1],
                block_ids=[0],
            ),
            5,
        )
    assert info.value.code == Code.NOT_FOUND and "instance_id" in info.value.message
