"""Bounds on every size and count a request may carry: the one bounds file.

A request past a bound is refused with INVALID_ARGUMENT naming the field;
nothing in it is acted on. The bounds sit far above any real deployment (a
1k-layer model at TP64, a 1M-token prompt, hundreds of workers per model) and
far below what would let one request exhaust a server's memory or CPU. The
transfer protocol derives its own frame bounds from these
(``kvstore.transfer.wire``).
"""

# ---- names, shared by store and router
MAX_NAME_LEN = 256  # layer names, instance ids, dtypes, display names, worker names, node ids
MAX_NAMESPACE_LEN = 128  # client namespace (docs/design.md §1)
MAX_SHM_NAME_LEN = 200
MAX_LEASE_MS = 10 * 60 * 1000
DEFAULT_LEASE_MS = 30_000  # a Query's lease when it asks for one with lease_ms 0
MAX_LEASES_PER_PRINCIPAL = 16384  # query leases one (non-admin) certificate may hold
# of a store's pool bytes, what one (non-admin) certificate's query leases may pin together:
# the rest stays evictable, so no tenant can leave another's saves no room
MAX_LEASED_POOL_FRACTION = 0.5
MAX_EVENT_STREAMS_PER_PRINCIPAL = 64  # Events streams one (non-admin) certificate may hold
MAX_WAIT_MS = 60 * 1000  # GetInstance waits for a seal at most this long

# Tokens per block. The store and the router once disagreed (4096 vs 65536);
# 65536 is the one bound because memory is bounded by MAX_BYTES_PER_BLOCK, not
# by tokens, and hybrid attention/state-space models raise the attention block
# size into the thousands to align with their state pages. A card the router
# admits must also be registrable at the store.
MAX_BLOCK_SIZE = 1 << 16

# ---- a store server's registration and block requests
MAX_LAYERS = 1024  # layers one rank registers
MAX_TP_SIZE = 64
MAX_WORLD_SIZE = 1024
MAX_NUM_BLOCKS = 1 << 24  # blocks in one rank's paged cache
MAX_BYTES_PER_BLOCK = 64 << 20  # one rank's bytes of one block of one layer
MAX_BLOCKS_PER_REQUEST = 8192  # (hash, block_id) pairs in one Save/Load/Query
# One registered allocation (64 TiB): bounds a memory handle's size and offset and
# a layer's strides, so no address a registration implies overflows 64 bits.
MAX_MAPPING_BYTES = 1 << 46
# Worker memory one (non-admin) certificate's registrations map together (16 TiB):
# a sparse memfd costs its worker nothing, and the server's address space is 128 TiB
MAX_MAPPED_BYTES_PER_PRINCIPAL = 1 << 44

# ---- the router's cards, routes and events
MAX_ALIASES = 64
MAX_LIST_ITEMS = 64  # needs, multimodal contracts
MAX_EXTRA_FILES = 256
MAX_TEXT_LEN = 64 * 1024  # prompt_context, router_config
MAX_CHECKSUM_LEN = 256
MAX_ADDRESS_LEN = 512
MAX_CONTEXT_LENGTH = 1 << 31
MAX_BLOCK_HASHES = 1 << 16  # hashes in one Route / QueryPrefix
MAX_TOKEN_IDS = 1 << 20  # tokens in one Route
MAX_DECODE_TOKENS = 1 << 24
MAX_EVENTS_PER_PUBLISH = 4096
MAX_EVENT_BYTES = 4 << 20  # one msgpack event / one vLLM batch
MAX_HASHES_PER_EVENT = 1 << 16
MAX_WORKERS_PER_DOMAIN = 4096  # bits in one holder mask
MAX_WORKERS_PER_PRINCIPAL = 4096  # workers one (non-admin) certificate may have admitted
# Workers one non-admin certificate may have admitted into one indexer domain.
# Every tenant whose cards name the same model and routing scope (or the same
# indexer overrides) shares that domain's prefix index, and each of its workers
# takes up to two of the index's MAX_WORKERS_PER_DOMAIN holder bits (gpu and
# store tier): one certificate gets at most a quarter of them, so it cannot fill
# the index and leave other tenants' workers there unindexed (their batches
# refused, no_room).
MAX_WORKERS_PER_DOMAIN_PER_PRINCIPAL = MAX_WORKERS_PER_DOMAIN // 8
MAX_PEERS = 4096
MAX_PEERS_PER_PRINCIPAL = 64  # store nodes one (non-admin) certificate may advertise
MAX_NAMESPACES_PER_PEER = 256
MAX_REQUEST_ID_LEN = 256
MAX_ACTIVE_REQUESTS = 1 << 20  # tracked loads; the oldest are dropped past it
MAX_ACTIVE_REQUESTS_PER_PRINCIPAL = 1 << 16  # tracked loads one (non-admin) certificate holds
MAX_QUEUED_PREFILL_TOKENS = 1 << 40  # one worker's reported prefill queue
MAX_RUNNING_REQUESTS = 1 << 20  # one worker's reported running requests
