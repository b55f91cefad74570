"""CPU copy path: run a plan's byte copies with memcpy on a few threads.

Why not torch: a Python loop of per-piece torch copies costs several
microseconds a piece, and torch has no batched copy between arbitrary
addresses. Why not only ctypes.memmove: measured on a 2-core host, a Python
loop of memmove reaches about half of a contiguous torch copy at 32 KiB
pieces (~1 us of call overhead per piece, and the GIL serialises threads).
So the inner loop is a tiny C function (compiled once with the system C
compiler, cached on disk, called through ctypes with the GIL released), and
large requests are split across threads by bytes. Requests much larger than
the cache use streaming (non-temporal) stores on x86, which skip reading each
destination line before overwriting it; a contiguous torch copy does not, so
this is where the gather/scatter catches up with it. Without a C compiler the
same code path runs a Python memmove loop: same results, slower.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvstore.copy.plan import Pieces, check_disjoint, split_pieces
from kvstore.copy.table import BlockArgs, RegionTable
from kvstore.private_dir import is_private, private_cache_dir

log = logging.getLogger(__name__)

_C_SOURCE = r"""
#include <setjmp.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* memcpy whose stores bypass the cache (x86 SSE2). For copies far larger than
   the cache this skips reading every destination line before overwriting it,
   about a third of the memory traffic of a plain copy. */
static void copy_streaming(unsigned char *dst, const unsigned char *src, size_t n) {
#if defined(__SSE2__)
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head; src += head; n -= head;
    size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + body, src + body, n - body);
#else
    memcpy(dst, src, n);
#endif
}

/* A worker may shrink the shared-memory object it registered while a copy reads
   or writes it: touching a page past the object's end raises SIGBUS. A copy runs
   under a per-thread guard; the handler jumps back out of a guarded copy (which
   then reports the fault) and hands any other SIGBUS to the previous handler. */
static __thread sigjmp_buf *guard;
static struct sigaction previous;

static void on_sigbus(int sig, siginfo_t *info, void *ctx) {
    sigjmp_buf *env = guard;
    (void)sig; (void)info; (void)ctx;
    if (env) {
        guard = NULL;
        siglongjmp(*env, 1);
    }
    sigaction(SIGBUS, &previous, NULL); /* not ours: the fault repeats under it */
}

int kvstore_guard_install(void) {
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = on_sigbus;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    return sigaction(SIGBUS, &action, &previous);
}

/* Copy count pieces: nbytes[i] bytes from src[i] to dst[i]. Returns 0, or 1 when
   a page vanished under the copy (SIGBUS); the pieces are then partly copied. */
int kvstore_copy_pieces(const uint64_t *src, const uint64_t *dst, const uint64_t *nbytes,
                        size_t count, int streaming) {
    sigjmp_buf env;
    if (sigsetjmp(env, 1)) return 1;
    guard = &env;
    if (!streaming) {
        for (size_t i = 0; i < count; ++i)
            memcpy((void *)(uintptr_t)dst[i], (const void *)(uintptr_t)src[i], (size_t)nbytes[i]);
    } else {
        for (size_t i = 0; i < count; ++i)
            copy_streaming((unsigned char *)(uintptr_t)dst[i],
                           (const unsigned char *)(uintptr_t)src[i], (size_t)nbytes[i]);
#if defined(__SSE2__)
        _mm_sfence(); /* streaming stores are weakly ordered: publish them before returning */
#endif
    }
    guard = NULL;
    return 0;
}

/* One layer of a registration: the rows of kvstore/copy/table.py's descriptors. */
typedef struct {
    uint64_t base, block_stride, segment_stride, segment_bytes, segments, num_blocks;
} kv_layer;

/* A run of bytes adjacent on both sides, copied in one call once it stops growing. */
typedef struct {
    uint64_t src, dst, n;
    int streaming;
} kv_run;

static void run_flush(kv_run *r) {
    if (!r->n) return;
    if (r->streaming)
        copy_streaming((unsigned char *)(uintptr_t)r->dst, (const unsigned char *)(uintptr_t)r->src,
                       (size_t)r->n);
    else
        memcpy((void *)(uintptr_t)r->dst, (const void *)(uintptr_t)r->src, (size_t)r->n);
    r->n = 0;
}

static void run_add(kv_run *r, uint64_t src, uint64_t dst, uint64_t n) {
    if (r->n && r->src + r->n == src && r->dst + r->n == dst) {
        r->n += n;
        return;
    }
    run_flush(r);
    r->src = src;
    r->dst = dst;
    r->n = n;
}

/* Bytes [lo, hi) of a request laid out layer by layer, block by block, segment by
   segment (plan.py's piece order), every piece's addresses computed here: ids[b]
   is block b's id in the paged cache, slots[l * num_blocks + b] its slot of layer l.
   save copies paged -> slot, else slot -> paged. Returns 0, or 1 on SIGBUS. */
int kvstore_copy_blocks(const kv_layer *layers, size_t num_layers, const int64_t *ids,
                        const uint64_t *slots, size_t num_blocks, uint64_t lo, uint64_t hi,
                        int save, int streaming) {
    sigjmp_buf env;
    kv_run run = {0, 0, 0, streaming};
    uint64_t pos = 0; /* request offset of the current layer's first byte */
    if (sigsetjmp(env, 1)) return 1;
    guard = &env;
    for (size_t l = 0; l < num_layers && pos < hi; ++l) {
        const kv_layer *L = &layers[l];
        const uint64_t seg = L->segment_bytes, slot_bytes = L->segments * seg;
        const uint64_t layer_end = pos + slot_bytes * num_blocks;
        size_t b = lo > pos ? (size_t)((lo - pos) / slot_bytes) : 0;
        for (; b < num_blocks && layer_end > lo; ++b) {
            const uint64_t start = pos + b * slot_bytes;
            if (start >= hi) break;
            const uint64_t paged = L->base + (uint64_t)ids[b] * L->block_stride;
            const uint64_t slot = slots[l * num_blocks + b];
            for (uint64_t s = 0; s < L->segments; ++s) {
                const uint64_t a = start + s * seg, e = a + seg;
                const uint64_t from = a > lo ? a : lo, to = e < hi ? e : hi;
                if (from >= to) continue;
                const uint64_t p = paged + s * L->segment_stride + (from - a);
                const uint64_t q = slot + s * seg + (from - a);
                if (save) run_add(&run, p, q, to - from);
                else run_add(&run, q, p, to - from);
            }
        }
        pos = layer_end;
    }
    run_flush(&run);
#if defined(__SSE2__)
    if (streaming) _mm_sfence();
#endif
    guard = NULL;
    return 0;
}
"""

BACKENDS = ("auto", "native", "python")
UNGUARDED = (
    "using a Python memmove loop: slower, and unguarded, so a worker that shrinks its "
    "registered shared memory during a copy crashes this process (SIGBUS) instead of "
    "failing that request; install a C compiler (cc) to get the native copy"
)
SAVE = "save"  # paged cache -> slots
LOAD = "load"  # slots -> paged cache
SPLIT_ALIGN = 4096  # threads of a blocks copy start on multiples of this request offset

# Run fn(table, lo, hi, streaming): copy rows [lo, hi) of a (3, n) uint64 table of
# src, dst, nbytes; streaming asks for cache-bypassing stores (a hint).
RangeCopy = Callable[[np.ndarray, int, int, bool], None]
# Run fn(descriptors, args, lo, hi, save, streaming): copy bytes [lo, hi) of a blocks request.
BlocksCopy = Callable[[np.ndarray, BlockArgs, int, int, bool, bool], None]


@dataclass(frozen=True)
class HostJob:
    """One call's copy, planned: the bytes it moves and one share of the work per thread."""

    nbytes: int
    shares: tuple[Callable[[], None], ...]


class HostCopier:
    """Moves a request's bytes between host memory ranges (CPU path).

    Two ways in (docs/design.md §3): ``save_blocks``/``load_blocks`` take a
    `RegionTable` built once per registration plus the request's block ids and
    slot addresses, check them in O(blocks) and let the native helper compute
    every piece; ``save``/``load`` take planned `Pieces` and prove their
    destinations apart by sorting them (the older path, kept for callers that
    plan themselves). save copies paged -> slot, load slot -> paged; all return
    the bytes moved and finish before returning. `stream` is accepted and
    ignored so host and CUDA copiers are interchangeable.

    Requests of at least `parallel_min_bytes` are split over `num_threads`
    threads; requests of at least `streaming_min_bytes` use cache-bypassing
    stores (their destination would not stay cached anyway).
    """

    def __init__(
        self,
        num_threads: int | None = None,
        backend: str = "auto",
        parallel_min_bytes: int = 1 << 20,
        streaming_min_bytes: int = 8 << 20,
        check_overlap: bool = True,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.num_threads = max(1, num_threads or min(4, os.cpu_count() or 1))
        self.parallel_min_bytes = parallel_min_bytes
        self.streaming_min_bytes = streaming_min_bytes
        self.check_overlap = check_overlap
        self._range_copy, self._blocks_copy, self.backend = _pick_backend(backend)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def save(self, pieces: Pieces, stream: object | None = None) -> int:  # noqa: ARG002
        """Paged KV -> slots. ``stream`` is CudaCopier's; host copies are synchronous."""
        return self.run(self.prepare(pieces, SAVE))

    def load(self, pieces: Pieces, stream: object | None = None) -> int:  # noqa: ARG002
        """Slots -> paged KV (see save)."""
        return self.run(self.prepare(pieces, LOAD))

    def save_blocks(
        self,
        table: RegionTable,
        block_ids: Sequence[int] | np.ndarray,
        slot_addrs: np.ndarray,
        stream: object | None = None,  # noqa: ARG002
        *,
        wait: bool = True,  # noqa: ARG002
    ) -> int:
        """Paged KV -> slots for `block_ids`; `slot_addrs[l, i]` is block i's slot of layer l.

        Raises KVError INVALID_ARGUMENT (nothing copied) for ids out of range or
        repeated, or slots of the wrong shape. `stream` and `wait` are
        CudaCopier's; a host copy is done when this returns.
        """
        return self.run(self.prepare_blocks(table, block_ids, slot_addrs, SAVE))

    def load_blocks(
        self,
        table: RegionTable,
        block_ids: Sequence[int] | np.ndarray,
        slot_addrs: np.ndarray,
        stream: object | None = None,  # noqa: ARG002
        *,
        wait: bool = True,  # noqa: ARG002
    ) -> int:
        """Slots -> paged KV (see save_blocks)."""
        return self.run(self.prepare_blocks(table, block_ids, slot_addrs, LOAD))

    def prepare(self, pieces: Pieces, op: str) -> HostJob:
        """Plan a copy of `pieces` (the sorting path): the host-side cost before any byte moves."""
        return self._prepare_pieces(pieces, op, check=self.check_overlap)

    def _prepare_pieces(self, pieces: Pieces, op: str, *, check: bool) -> HostJob:
        src, dst = _ends(pieces.paged_addr, pieces.slot_addr, op)
        nbytes = pieces.nbytes
        if len(nbytes) == 0:
            return HostJob(0, ())
        if check:
            check_disjoint(dst, nbytes, "slot" if op == SAVE else "paged")
        total = int(nbytes.sum(dtype=np.uint64))
        threads, streaming = self._threads(total), total >= self.streaming_min_bytes
        if threads > 1:  # cut big pieces so every thread gets a fair share
            src, dst, nbytes = split_pieces(src, dst, nbytes, _share_bytes(total, threads))
        rows = np.ascontiguousarray(np.stack([src, dst, nbytes]), dtype=np.uint64)
        bounds = _balanced_bounds(nbytes, threads)
        run = self._range_copy
        shares = tuple(
            functools.partial(run, rows, lo, hi, streaming)
            for lo, hi in itertools.pairwise(bounds)
            if hi > lo
        )
        return HostJob(total, shares)

    def prepare_blocks(
        self, table: RegionTable, block_ids: Sequence[int] | np.ndarray, slot_addrs: np.ndarray,
        op: str,
    ) -> HostJob:  # fmt: skip
        """Plan a blocks copy in O(blocks): check the request, cut its bytes among threads."""
        _direction(op)
        args = table.check(block_ids, slot_addrs, distinct=op == LOAD)
        if op == LOAD and not table.paged_disjoint:  # not proven apart: sort the pieces
            return self.prepare(table.pieces(args), op)
        total = args.num_blocks * table.bytes_per_block
        if self._blocks_copy is None:  # no native helper: the same pieces, planned in numpy
            return self._prepare_pieces(table.pieces(args), op, check=False)
        if total == 0:
            return HostJob(0, ())
        streaming = total >= self.streaming_min_bytes
        run = self._blocks_copy
        shares = tuple(
            functools.partial(run, table.descriptors, args, lo, hi, op == SAVE, streaming)
            for lo, hi in itertools.pairwise(_byte_bounds(total, self._threads(total)))
        )
        return HostJob(total, shares)

    def run(self, job: HostJob) -> int:
        """Copy a planned job on the calling thread and the pool; returns its bytes."""
        if not job.shares:
            return job.nbytes
        if len(job.shares) == 1:  # a small job, or one thread: no pool, nothing to wait for
            job.shares[0]()
            return job.nbytes
        futures = []
        try:
            pool = self._executor()
            for share in job.shares[1:]:  # a submit that raises still waits for those before
                futures.append(pool.submit(share))
            job.shares[0]()  # the calling thread takes the first share
        finally:
            wait(futures)  # no thread may still touch these bytes once this returns or raises
        for f in futures:
            f.result()
        return job.nbytes

    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _threads(self, total: int) -> int:
        return self.num_threads if total >= self.parallel_min_bytes else 1

    def _executor(self) -> ThreadPoolExecutor:
        """The pool, made once (the copier is shared by the store's copy threads)."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self.num_threads - 1, thread_name_prefix="kvstore-copy"
                )
            return self._pool


def _ends(paged: np.ndarray, slot: np.ndarray, op: str) -> tuple[np.ndarray, np.ndarray]:
    """(source, destination) addresses of `op`."""
    return (paged, slot) if _direction(op) == SAVE else (slot, paged)


def _direction(op: str) -> str:
    """``op`` itself, if it is SAVE or LOAD (anything else would copy one way unasked)."""
    if op not in (SAVE, LOAD):
        raise ValueError(f"op must be {SAVE!r} or {LOAD!r}, got {op!r}")
    return op


def _share_bytes(total: int, threads: int) -> int:
    """Largest chunk for a threaded copy: about a quarter of a thread's share, 64 KiB aligned."""
    share = -(-total // (threads * 4))
    return max(64 << 10, -(-share // (64 << 10)) * (64 << 10))


def _balanced_bounds(nbytes: np.ndarray, parts: int) -> list[int]:
    """Row boundaries that give each of `parts` ranges about the same number of bytes."""
    if parts == 1:
        return [0, len(nbytes)]
    ends = np.cumsum(nbytes, dtype=np.uint64)
    targets = ends[-1] * np.arange(1, parts, dtype=np.uint64) // np.uint64(parts)
    cuts = np.searchsorted(ends, targets, side="right")
    return [0, *(int(c) for c in cuts), len(nbytes)]


def _byte_bounds(total: int, parts: int) -> list[int]:
    """Request offsets cutting `total` bytes into `parts` about equal, aligned ranges."""
    if parts == 1:
        return [0, total]
    cuts = {total * k // parts // SPLIT_ALIGN * SPLIT_ALIGN for k in range(1, parts)}
    return [0, *sorted(c for c in cuts if 0 < c < total), total]


def _pick_backend(backend: str) -> tuple[RangeCopy, BlocksCopy | None, str]:
    if backend in ("auto", "native"):
        fn = native_copy_function()
        blocks = native_blocks_function()
        if fn is not None and blocks is not None:
            return _native_range_copy(fn), _native_blocks_copy(blocks), "native"
        if backend == "native":
            raise RuntimeError("native host copy unavailable (no working C compiler)")
    return _python_range_copy, None, "python"


def _python_range_copy(table: np.ndarray, lo: int, hi: int, streaming: bool) -> None:  # noqa: ARG001
    """The native helper's signature; memmove has no cache-bypassing variant."""
    memmove = ctypes.memmove  # releases the GIL during the copy
    rows = table[:, lo:hi].T.tolist()
    for src, dst, n in rows:
        memmove(dst, src, n)


class MemoryFault(OSError):
    """Memory under a copy vanished (a shared-memory object shrank): SIGBUS, caught."""


def _native_range_copy(fn: Callable[..., int]) -> RangeCopy:
    def run(table: np.ndarray, lo: int, hi: int, streaming: bool) -> None:
        base, row = table.ctypes.data, table.strides[0]
        rows = (base + lo * 8, base + row + lo * 8, base + 2 * row + lo * 8)
        if fn(*rows, hi - lo, int(streaming)):
            raise MemoryFault("a page under the copy vanished (its memory object shrank)")

    return run


def _native_blocks_copy(fn: Callable[..., int]) -> BlocksCopy:
    def run(desc: np.ndarray, args: BlockArgs, lo: int, hi: int, save: bool, streaming: bool):
        rc = fn(desc.ctypes.data, len(desc), args.ids.ctypes.data, args.slots.ctypes.data,
                args.num_blocks, lo, hi, int(save), int(streaming))  # fmt: skip
        if rc:
            raise MemoryFault("a page under the copy vanished (its memory object shrank)")

    return run


@functools.cache
def _native_library() -> ctypes.CDLL | None:
    """The compiled helper with its SIGBUS guard installed; None if it cannot be built.

    KVSTORE_NATIVE_COPY=0 disables it (forces the Python loop).
    """
    if os.environ.get("KVSTORE_NATIVE_COPY", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(str(_build_native()))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("kvstore: native host copy unavailable (%s); %s", e, UNGUARDED)
        return None
    if lib.kvstore_guard_install() != 0:
        log.warning("kvstore: cannot install the SIGBUS guard; %s", UNGUARDED)
        return None
    return lib


@functools.cache
def native_copy_function() -> Callable[..., int] | None:
    """ctypes handle on kvstore_copy_pieces (built on first use); None if it cannot be built."""
    lib = _native_library()
    if lib is None:
        return None
    fn = lib.kvstore_copy_pieces
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def native_blocks_function() -> Callable[..., int] | None:
    """ctypes handle on kvstore_copy_blocks (pieces computed in C); None without the helper."""
    lib = _native_library()
    if lib is None:
        return None
    fn = lib.kvstore_copy_blocks
    ptr, size, u64, flag = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_int
    fn.argtypes = [ptr, size, ptr, ptr, size, u64, u64, flag, flag]
    fn.restype = ctypes.c_int
    return fn


def _build_native() -> Path:
    """Compile the C helper into a private cache directory (once per source and compiler).

    Code loaded into the server must be ours: the directory and the library are
    used only when this user owns them and nobody else can write them
    (:func:`is_private`); a planted or tampered file is rebuilt, never loaded.
    """
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise OSError("no C compiler on PATH")
    digest = hashlib.sha256(f"{cc}\n{_C_SOURCE}".encode()).hexdigest()[:16]
    out_dir = private_cache_dir("the host copy helper")
    target = out_dir / f"hostcopy-{digest}.so"
    if target.exists() or target.is_symlink():
        if is_private(target, directory=False):
            return target
        log.warning("kvstore: %s is not this user's private file; rebuilding it", target)
        target.unlink()
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        src = Path(tmp) / "hostcopy.c"
        src.write_text(_C_SOURCE)
        built = Path(tmp) / target.name
        cmd = [cc, "-O2", "-shared", "-fPIC", "-o", str(built), str(src)]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        os.chmod(built, 0o700)
        os.replace(built, target)  # atomic: concurrent builders all end with a whole file
    return target
