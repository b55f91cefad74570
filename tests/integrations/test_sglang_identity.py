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
