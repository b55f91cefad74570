"""One node's core: registry and seal, memory mapping, slot pool, block index,
and peer-fetch policy. Plain Python, testable without grpc or ucx."""
