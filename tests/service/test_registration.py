"""Seal-based registration over a real gRPC server, with real worker processes."""

from __future__ import annotations

import pytest

from kvstore.client.store_client import StoreClient
from kvstore.testing.worker import WorkerProcess, WorkerSpec
from kvstore.wire.fingerprint import LayerGeometry, fingerprint
from kvstore.wire.names import final_namespace
from tests.conftest import wait_for


def spec(server, instance, tp_rank, tp_size=2, **kw):
    base = dict(layers=3, heads=4, head_dim=16, block_size=4, num_blocks=8)
    return WorkerSpec(server.address, instance, "llama", tp_rank, tp_size, **{**base, **kw})


def start_instance(server, instance, tp_size=2, order=None, **kw):
    """The ranks of one instance: registered in ``order``, else started at once."""
    if order is None:
        specs = [spec(server, instance, r, tp_size, **kw) for r in range(tp_size)]
        workers = dict(enumerate(WorkerProcess.start_all(specs)))
    else:
        workers = {r: WorkerProcess(spec(server, instance, r, tp_size, **kw)) for r in order}
    seals = {r: w.call("wait_sealed", 20) for r, w in workers.items()}
    return workers, seals


def close_all(workers):
    for w in workers.values():
        w.close()


def test_two_ranks_in_two_processes_seal_with_one_namespace(server):
    workers, seals = start_instance(server, "a")
    try:
        assert seals[0] == seals[1]
        expected = fingerprint(
            4,
            "kvstore-blake3-v1",
            2,
            [
                LayerGeometry(
                    f"model.layers.{i}.self_attn", "float16", 2 * 4 * 2 * 16 * 2, 2, "NHD"
                )
                for i in range(3)
            ],
        )
        assert seals[0]["final_namespace"] == final_namespace("llama", expected)
        assert seals[0]["layer_ids"] == {f"model.layers.{i}.self_attn": i for i in range(3)}
    finally:
        close_all(workers)


def test_fingerprint_independent_of_registration_order(server):
    first, s1 = start_instance(server, "a", order=[0, 1])
    second, s2 = start_instance(server, "b", order=[1, 0])
    try:
        assert s1[0]["final_namespace"] == s2[0]["final_namespace"]
    finally:
        close_all(first)
        close_all(second)


@pytest.mark.parametrize(
    "change",
    [
        dict(extra_layers=1),  # MTP on
        dict(dtype="bfloat16", head_dim=16),
        dict(head_dim=32),  # another bytes_per_block
        dict(block_size=8),
        dict(tp_size=1),
        dict(kv_layout="HND"),
    ],
)
def test_layout_changes_give_another_namespace(server, change):
    base, s1 = start_instance(server, "base")
    tp = change.pop("tp_size", 2)
    other, s2 = start_instance(server, "other", tp_size=tp, **change)
    try:
        assert s1[0]["final_namespace"] != s2[0]["final_namespace"]
        assert s1[0]["final_namespace"].split(".")[0] == s2[0]["final_namespace"].split(".")[0]
    finally:
        close_all(base)
        close_all(other)


def test_fp8_formats_held_in_uint8_get_other_namespaces(server):
    """Engines keep fp8 KV of every variant in uint8 tensors; the layer's kv_dtype
    (vLLM's and SGLang's --kv-cache-dtype) keeps e4m3 and e5m2 caches apart."""
    e4m3, s1 = start_instance(server, "e4m3", tp_size=1, dtype="uint8", kv_dtype="fp8_e4m3")
    e5m2, s2 = start_instance(server, "e5m2", tp_size=1, dtype="uint8", kv_dtype="fp8_e5m2")
    try:
        assert s1[0]["final_namespace"] != s2[0]["final_namespace"]
    finally:
        close_all(e4m3)
        close_all(e5m2)


def test_killing_a_rank_unseals_the_instance(server):
    workers, _ = start_instance(server, "a")
    try:
        sealed = server.call(lambda: server.server.registry.instances["a"].seal)
        assert sealed is not None
        workers[1].kill()
        assert wait_for(
            lambda: server.call(lambda: len(server.server.registry.instances["a"].ranks) == 1),
            timeout=10,
        )
        assert server.call(lambda: server.server.registry.instances["a"].seal) is None
        assert wait_for(lambda: workers[0].call("state")["state"] == 3)  # UNSEALED
        # a replacement rank re-seals the instance with the same namespace
        workers[1] = WorkerProcess(spec(server, "a", 1))
        assert workers[1].call("wait_sealed", 20) == workers[0].call("wait_sealed", 20)
    finally:
        close_all(workers)


def test_closing_every_rank_forgets_the_instance(server):
    workers, _ = start_instance(server, "a")
    close_all(workers)
    assert wait_for(lambda: server.call(lambda: "a" not in server.server.registry.instances))
    assert StoreClient(server.address).stats().instances == 0


def test_save_before_seal_is_failed_precondition(server):
    w = WorkerProcess(spec(server, "a", 0))
    try:
        with pytest.raises(RuntimeError, match="FAILED_PRECONDITION"):
            w.call("save", [(1, 0)])
    finally:
        w.close()
