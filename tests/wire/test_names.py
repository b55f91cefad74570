"""The one home of each name rule, and the error codes' one mapping to gRPC."""

from __future__ import annotations

import grpc
import pytest

from kvstore.service.status import to_grpc
from kvstore.wire import limits
from kvstore.wire.errors import Code, KVError
from kvstore.wire.kv_layout import LayoutKind
from kvstore.wire.names import (
    MAX_FINAL_NAMESPACE_LEN,
    U64_MAX,
    check_final_namespace,
    check_name,
    device_uuid,
    final_namespace,
    is_client_namespace,
    is_final_namespace,
    is_u64,
)


def test_a_final_namespace_is_a_client_namespace_and_a_fingerprint():
    ns = final_namespace("llama-3_8b", "0123456789abcdef")
    assert is_final_namespace(ns) and len(ns) <= MAX_FINAL_NAMESPACE_LEN
    longest = final_namespace("n" * limits.MAX_NAMESPACE_LEN, "f" * 16)
    assert is_final_namespace(longest) and len(longest) == MAX_FINAL_NAMESPACE_LEN
    for bad in ["llama", "llama.0123", "llama.0123456789ABCDEF", "a.b.0123456789abcdef", ""]:
        assert not is_final_namespace(bad), bad
        with pytest.raises(KVError) as err:
            check_final_namespace("namespace", bad)
        assert err.value.code is Code.INVALID_ARGUMENT and "namespace" in err.value.message
    assert is_client_namespace("llama-3_8b") and not is_client_namespace("llama.3")


def test_names_are_printable_and_bounded():
    check_name("card.display_name", "Llama 3 8B")
    for bad in ["", "x" * (limits.MAX_NAME_LEN + 1), "tab\there"]:
        with pytest.raises(KVError, match=r"card\.display_name"):
            check_name("card.display_name", bad)


def test_u64_excludes_bools_negatives_and_overflow():
    assert is_u64(0) and is_u64(U64_MAX)
    assert not any(is_u64(v) for v in (-1, U64_MAX + 1, True, 1.0, "1"))


def test_device_uuid_spelling_is_shared():
    assert device_uuid("5f2a") == "GPU-5f2a"


def test_every_code_maps_to_the_grpc_status_of_its_name_and_back():
    for code in Code:
        status = to_grpc(code)
        assert isinstance(status, grpc.StatusCode) and status.name == code.name
        assert Code.from_name(status.name) is code
    assert Code.from_name("DATA_LOSS") is Code.UNKNOWN


def test_layout_kind_shapes_match_the_tensor_layouts():
    nhd = LayoutKind.KV_FIRST.shape(10, 16, 4, 128)
    assert nhd == (2, 10, 16, 4, 128)
    assert LayoutKind.BLOCKS_FIRST.shape(10, 16, 4, 128, "HND") == (10, 2, 4, 16, 128)
    assert LayoutKind.MLA.shape(10, 16, 4, 576) == (10, 16, 576)
    assert LayoutKind.PAGED.shape(10, 32, 2, 64, "LBHNC/1") == (10, 2, 32, 128)
    assert LayoutKind.PAGED.shape(10, 32, 2, 64, "LBNHC/1") == (10, 32, 2, 128)
    assert [k.segments for k in LayoutKind] == [2, 1, 1, 1]
