"""Bounds on every size and count a router request may carry.

A request past a bound is refused with INVALID_ARGUMENT naming the field;
nothing in it is acted on. The bounds sit far above real deployments (a 1M-
token prompt at block size 16, hundreds of workers per model) and far below
what would let one request tie up the router's memory or event loop.
"""

MAX_NAME_LEN = 256            # display names, aliases, worker names, node ids
MAX_NAMESPACE_LEN = 128
MAX_ALIASES = 64
MAX_LIST_ITEMS = 64           # needs, multimodal contracts
MAX_EXTRA_FILES = 256
MAX_TEXT_LEN = 64 * 1024      # prompt_context, router_config
MAX_CHECKSUM_LEN = 256
MAX_ADDRESS_LEN = 512
MAX_BLOCK_SIZE = 1 << 16      # tokens per block
MAX_CONTEXT_LENGTH = 1 << 31
MAX_BLOCK_HASHES = 1 << 16    # hashes in one Route / QueryPrefix
MAX_TOKEN_IDS = 1 << 20       # tokens in one Route
MAX_DECODE_TOKENS = 1 << 24
MAX_EVENTS_PER_PUBLISH = 4096
MAX_EVENT_BYTES = 4 << 20     # one msgpack event / one vLLM batch
MAX_HASHES_PER_EVENT = 1 << 16
MAX_WORKERS_PER_DOMAIN = 4096  # bits in one index mask
MAX_PEERS = 4096
MAX_NAMESPACES_PER_PEER = 256
MAX_LEASE_MS = 10 * 60 * 1000
MAX_REQUEST_ID_LEN = 256
MAX_ACTIVE_REQUESTS = 1 << 20  # tracked loads; the oldest are dropped past it
