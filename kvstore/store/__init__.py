"""One node's core: registration and seal, memory mapping, slot pool, block
index, the node's use cases and peer fetch. Plain Python, testable without grpc
or ucx; see README.md in this folder."""
