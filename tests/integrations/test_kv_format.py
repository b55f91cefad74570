"""fp8 KV of every variant lives in uint8 tensors, in vLLM and SGLang alike: the
connectors name the format, so e4m3 and e5m2 engines never share blocks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvstore.integrations.sglang.layers import UnsupportedPool, kv_format
from kvstore.integrations.vllm.worker import paged_layers


@pytest.mark.parametrize("cache_dtype,want", [("auto", ""), ("fp8_e5m2", "fp8_e5m2")])
def test_vllm_layers_carry_the_kv_cache_dtype(cache_dtype, want):
    """vLLM's "auto" is the model's dtype, which the tensors carry."""
    views = {f"model.layers.{i}.attn": torch.zeros(4, 2, 16, 8, dtype=torch.int8) for i in (0, 1)}
    layers = paged_layers(views, 16, "LBHNC", None, cache_dtype)
    assert [layer.kv_dtype for layer in layers] == [want, want]


def test_an_sglang_fp8_pool_names_its_format_or_is_refused():
    fp8 = SimpleNamespace(kv_buffer=torch.zeros(8, dtype=torch.uint8))
    assert kv_format(fp8, lambda: "fp8_e5m2") == "fp8_e5m2"
    for unknown in (None, "", "auto"):
        with pytest.raises(UnsupportedPool, match='add "kv_cache_dtype"'):
            kv_format(fp8, lambda: unknown)  # noqa: B023 -- called at once
    bf16 = SimpleNamespace(kv_buffer=torch.zeros(8, dtype=torch.bfloat16))
    assert kv_format(bf16, lambda: pytest.fail("asked")) == ""  # the tensor's dtype says it
