"""The layout fingerprint: a fixed vector and what separates namespaces."""

import blake3
import msgpack
import pytest

from kvstore.wire.fingerprint import LayerGeometry, fingerprint
from kvstore.wire.names import final_namespace, is_client_namespace


def layers(n=2, bpb=65536, segments=2, kv_layout="NHD", dtype="float16", prefix="model"):
    return [
        LayerGeometry(f"{prefix}.layers.{i}.self_attn", dtype, bpb, segments, kv_layout)
        for i in range(n)
    ]


def test_fixed_vector_matches_design_definition():
    ls = layers()
    by_hand = blake3.blake3(
        msgpack.packb(
            [
                "kvstore/layout/v1",
                16,
                "kvstore-blake3-v1",
                2,
                [
                    ["model.layers.0.self_attn", "float16", 65536, 2, "NHD"],
                    ["model.layers.1.self_attn", "float16", 65536, 2, "NHD"],
                ],
            ]
        )
    ).hexdigest()[:16]
    assert fingerprint(16, "kvstore-blake3-v1", 2, ls) == by_hand == "2af30a1369d94940"


def test_layer_order_does_not_matter():
    ls = layers(5)
    assert fingerprint(16, "h", 1, ls) == fingerprint(16, "h", 1, list(reversed(ls)))


@pytest.mark.parametrize(
    "other",
    [
        dict(ls=layers(3)),  # MTP on: one extra layer
        dict(ls=layers(bpb=32768)),  # another quantisation
        dict(block_size=32),
        dict(tp_size=4),
        dict(ls=layers(kv_layout="HND")),  # same bytes, another order
        dict(hash_format="vllm-sha256"),
        dict(ls=layers(dtype="bfloat16")),
        dict(ls=layers(segments=1)),
    ],
)
def test_every_layout_difference_separates(other):
    base = dict(block_size=16, hash_format="kvstore-blake3-v1", tp_size=2, ls=layers())
    changed = {**base, **other}
    a = fingerprint(base["block_size"], base["hash_format"], base["tp_size"], base["ls"])
    b = fingerprint(
        changed["block_size"], changed["hash_format"], changed["tp_size"], changed["ls"]
    )
    assert a != b
    assert final_namespace("llama", a) != final_namespace("llama", b)


def test_final_namespace_format():
    assert final_namespace("llama-3_8b", "0123456789abcdef") == "llama-3_8b.0123456789abcdef"


@pytest.mark.parametrize(
    "ns,ok",
    [
        ("llama", True),
        ("a" * 128, True),
        ("A-b_9", True),
        ("", False),
        ("a" * 129, False),
        ("llama.v2", False),
        ("lla ma", False),
        ("ns/x", False),
    ],
)
def test_client_namespace_pattern(ns, ok):
    assert is_client_namespace(ns) is ok


def test_layout_kind_numbers_match_the_proto_enum():
    from kvstore._proto import store_pb2 as pb
    from kvstore.wire.kv_layout import LayoutKind

    for kind in LayoutKind:
        assert kind.proto == pb.KVLayoutKind.Value(kind.name)
        assert LayoutKind.from_proto(kind.proto) is kind
    assert LayoutKind.from_proto(0) is None
