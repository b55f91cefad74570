"""vLLM's standardised KV views (the ``paged`` kind) and GetInstance, over a real server.

vLLM >= 0.32 hands a connector one ``[num_blocks, heads, block_size, 2 * head_dim]``
view per layer, all of them inside one int8 buffer at different storage
offsets. These tests lay memory out exactly that way in shared memory.
"""

from __future__ import annotations

import threading

import pytest
import torch

from kvstore.client.shared_memory import ShmTensor, shm_empty
from kvstore.client.store_client import KVLayer, StoreClient
from kvstore.wire.errors import Code, KVError
from kvstore.wire.kv_layout import LayoutKind, paged_layout

NUM_BLOCKS, HEADS, BLOCK, HEAD_DIM, LAYERS = 16, 2, 32, 64, 2
CELL = (HEADS, BLOCK, 2 * HEAD_DIM)
LAYER_BYTES = NUM_BLOCKS * HEADS * BLOCK * 2 * HEAD_DIM * 2  # bfloat16


def vllm_like_cache(gap: int = 4096) -> tuple[ShmTensor, dict[str, torch.Tensor]]:
    """One int8 buffer; layer i is a bf16 [nb, H, N, C] view at a non-zero offset."""
    buf = shm_empty((gap + LAYERS * (LAYER_BYTES + gap),), torch.int8)
    views = {}
    for i in range(LAYERS):
        start = gap + i * (LAYER_BYTES + gap)
        raw = buf.tensor[start : start + LAYER_BYTES]
        views[f"model.layers.{i}.self_attn.attn"] = raw.view(torch.bfloat16).view(NUM_BLOCKS, *CELL)
    return buf, views


def layers_of(buf: ShmTensor, views: dict[str, torch.Tensor], layout: str = "LBHNC/1"):
    return [KVLayer(n, t, LayoutKind.PAGED, layout, buf) for n, t in views.items()]


def register(client, instance, buf, views, *, layout="LBHNC/1", tp_rank=0, tp_size=1):
    return client.register(
        instance,
        "tiny-llama",
        layers_of(buf, views, layout),
        tp_rank=tp_rank,
        tp_size=tp_size,
        block_size=BLOCK,
        hash_format="vllm-sha256-lo64-test",
    )


def test_paged_views_at_offsets_round_trip_every_byte(server):
    client = StoreClient(server.address)
    src_buf, src = vllm_like_cache()
    dst_buf, dst = vllm_like_cache(gap=8192)
    a = register(client, "engine-a", src_buf, src)
    b = register(client, "engine-b", dst_buf, dst)
    try:
        assert a.wait_sealed(10).final_namespace == b.wait_sealed(10).final_namespace
        g = torch.Generator().manual_seed(0)
        src_buf.tensor.copy_(torch.randint(-128, 128, src_buf.tensor.shape, generator=g))
        pairs = [(1000 + i, i) for i in range(0, NUM_BLOCKS, 2)]
        assert a.save(pairs).sealed == len(pairs)
        loads = [(h, NUM_BLOCKS - 1 - i) for h, i in pairs]
        assert b.load(loads).loaded == len(loads)
        for name in src:
            for (_, i), (_, j) in zip(pairs, loads):
                assert torch.equal(src[name][i].view(torch.int16), dst[name][j].view(torch.int16))
        untouched = sorted(set(range(NUM_BLOCKS)) - {j for _, j in loads})
        for name in dst:
            assert not dst[name][untouched].view(torch.int16).any()
    finally:
        a.close()
        b.close()
        for buf in (src_buf, dst_buf):
            buf.close()


@pytest.mark.parametrize("layout", ["LBHNC/2", "LBNHC/1"])
def test_layout_name_and_block_ratio_are_in_the_namespace(server, layout):
    client = StoreClient(server.address)
    one_buf, one = vllm_like_cache()
    two_buf, two = vllm_like_cache()
    a = register(client, "a", one_buf, one)
    b = register(client, "b", two_buf, two, layout=layout)
    try:
        assert a.wait_sealed(10).final_namespace != b.wait_sealed(10).final_namespace
    finally:
        a.close()
        b.close()
        one_buf.close()
        two_buf.close()


@pytest.mark.parametrize("layout", ["NHD", "LBHNC", "LBHNC/0", "LBHNC/65", "XXXXX/1", "LBHNC/1x"])
def test_bad_paged_layout_is_refused_naming_kv_layout(server, layout):
    client = StoreClient(server.address)
    buf, views = vllm_like_cache()
    try:
        with pytest.raises(KVError) as err:
            register(client, "bad", buf, views, layout=layout)
        assert err.value.code is Code.INVALID_ARGUMENT
        assert "kv_layout" in str(err.value)
        assert client.stats().instances == 0
    finally:
        buf.close()


def test_paged_layout_helper_checks_its_parts():
    assert paged_layout("LBNHC", 4) == "LBNHC/4"
    with pytest.raises(ValueError, match="block_ratio"):
        paged_layout("LBHNC", 0)
    with pytest.raises(ValueError, match="layout"):
        paged_layout("NHD")


def test_get_instance_waits_for_the_seal_of_every_rank(server):
    client = StoreClient(server.address)
    with pytest.raises(KVError) as err:
        client.instance("engine-x")
    assert err.value.code is Code.NOT_FOUND
    bufs = [vllm_like_cache() for _ in range(2)]
    r0 = register(client, "engine-x", *bufs[0], tp_size=2)
    try:
        info = client.instance("engine-x")
        assert (info.sealed, info.ranks_registered, info.world_size) == (False, 1, 2)
        assert info.final_namespace == "" and info.block_size == BLOCK
        late: list = []
        timer = threading.Timer(
            0.5, lambda: late.append(register(client, "engine-x", *bufs[1], tp_rank=1, tp_size=2))
        )
        timer.start()
        info = client.instance("engine-x", wait=10)
        timer.join()
        assert info.sealed and info.final_namespace == r0.wait_sealed(5).final_namespace
        assert info.hash_format == "vllm-sha256-lo64-test"
        late[0].close()
        info = client.instance("engine-x", wait=0.3)  # the seal is gone again
        assert not info.sealed and info.ranks_registered == 1
    finally:
        r0.close()
        for buf, _ in bufs:
            buf.close()


@pytest.mark.parametrize(("instance_id", "wait_ms"), [("", 0), ("a/b", 0), ("ok", 60_001)])
def test_get_instance_bad_requests_are_invalid_argument(server, instance_id, wait_ms):
    from kvstore._proto import store_pb2 as pb
    from kvstore.client.store_client import call

    client = StoreClient(server.address)
    with pytest.raises(KVError) as err:
        call(
            client.stub.GetInstance,
            pb.GetInstanceRequest(instance_id=instance_id, wait_ms=wait_ms),
            5,
        )
    assert err.value.code is Code.INVALID_ARGUMENT
    assert ("wait_ms" if wait_ms else "instance_id") in str(err.value)
