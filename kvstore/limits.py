"""Bounds on every size and count a request may carry.

A request past a bound is refused with a message naming the field; nothing
in it is acted on. The bounds are far above any real deployment (a 1k-layer
model at TP64 fits) and far below what would let one request exhaust the
server's memory or CPU.
"""

MAX_NAME_LEN = 256             # layer names, instance ids, dtype strings
MAX_NAMESPACE_LEN = 128        # client namespace (DESIGN.md section 1)
MAX_LAYERS = 1024              # layers one rank registers
MAX_TP_SIZE = 64
MAX_WORLD_SIZE = 1024
MAX_BLOCK_SIZE = 4096          # tokens per block
MAX_NUM_BLOCKS = 1 << 24       # blocks in one rank's paged cache
MAX_BYTES_PER_BLOCK = 64 << 20  # one rank's bytes of one block of one layer
MAX_BLOCKS_PER_REQUEST = 8192  # (hash, block_id) pairs in one Save/Load/Query
MAX_LEASE_MS = 10 * 60 * 1000
MAX_SHM_NAME_LEN = 200
