"""SGLang's instance id: every rank of an engine computes it alike, other engines differ."""

from __future__ import annotations

import os

from kvstore.integrations.sglang.identity import instance_id


def test_two_engines_of_one_process_get_other_ids():
    """Both engines' scheduler processes have this process as parent: the NCCL
    port, one per engine, tells them apart (before, the second engine's ranks
    were refused for good and it ran without the store)."""
    a = instance_id("mha-page_first", engine_port=30011)
    b = instance_id("mha-page_first", engine_port=30012)
    assert a != b and a == instance_id("mha-page_first", engine_port=30011)
    assert f"-{os.getppid()}-p30011-mha-page_first" in a
    assert instance_id("mha-page_first").endswith(f"-{os.getppid()}-mha-page_first")


def test_one_served_name_over_two_checkpoints_gets_two_namespaces(tmp_path):
    """Two SGLang engines serving other weights under one --served-model-name
    (a canary) shared pages: the namespace named the model, not its weights."""
    from kvstore.integrations.checkpoint import checkpoint_digest
    from kvstore.integrations.sglang.identity import client_namespace

    digests = []
    for name, last in (("a", b"\0"), ("b", b"\1"), ("c", b"\0")):
        root = tmp_path / name
        root.mkdir()
        (root / "config.json").write_text('{"hidden_size": 64}')
        (root / "model.safetensors").write_bytes(bytes(3 << 20)[:-1] + last)
        digests.append(checkpoint_digest(str(root)))
    a, b, c = (client_namespace("llama", "page_first", model_digest=d) for d in digests)
    assert a == c and a != b  # c is a copy of a elsewhere: the same weights
    assert a.startswith("llama-") and a.endswith("-page_first")
    assert client_namespace("llama", "page_first") not in (a, b)  # the name alone
    assert client_namespace("llama", "layer_first", model_digest=digests[0]) != a
    assert client_namespace("llama", "page_first", "mine", digests[0]) == "mine"
