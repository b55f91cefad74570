"""The committed gRPC stubs match the proto files."""

import importlib.util
from pathlib import Path

import pytest

from kvstore import protogen


def test_committed_stubs_are_fresh(tmp_path: Path):
    if importlib.util.find_spec("grpc_tools") is None:  # not imported: protoc runs apart
        pytest.skip("grpcio-tools is not installed")
    generated = protogen.generate(tmp_path)
    assert generated, "no proto files found"
    for path in generated:
        committed = protogen.OUT_DIR / path.name
        assert committed.exists(), f"{committed} is missing: run `make protos`"
        assert committed.read_text() == path.read_text(), (
            f"{committed} is stale: run `make protos` and commit the result"
        )
