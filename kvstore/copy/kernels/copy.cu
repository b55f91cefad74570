// kvstore copy engine: move KV bytes between a worker's paged KV cache and the
// store's slots in ONE launch per request (docs/design.md §3).
//
// Two entry points share the copy loop:
// - kvstore_copy_blocks (the hot path): the per-layer geometry lives on the
//   device, uploaded once per registration; per request only the block ids and
//   the slot addresses travel, and every piece's addresses are computed here.
//   A persistent grid (sized on the host from the measured occupancy) walks
//   work items of at most `chunk` bytes; a group of `group` threads (a warp up
//   to the whole CTA, a power of two) copies one item, each thread keeping
//   eight 16-byte loads in flight.
// - kvstore_copy_chunks (the fallback for plans the first cannot take): the
//   host plans the copies (kvstore/copy/plan.py), cuts them into chunks and
//   uploads one table of (src, dst, nbytes); one CUDA block per chunk.
//
// Loaded at run time by CuPy through NVRTC, so no includes: NVRTC provides the
// built-in vector types (uint2, uint4) used for the wide loads and stores.
// Everything below the entry points is __host__ __device__ so a host-only
// harness can run it, thread by thread, on machines without a GPU.

typedef unsigned long long u64;

// Widest unit (16, 8, 4, 2 or 1 bytes) in which src and dst can both be
// aligned: they need the same address modulo the unit.
__host__ __device__ inline unsigned copy_unit(u64 dst, u64 src) {
    const u64 diff = dst ^ src;
    if ((diff & 15) == 0) return 16;
    if ((diff & 7) == 0) return 8;
    if ((diff & 3) == 0) return 4;
    if ((diff & 1) == 0) return 2;
    return 1;
}

// Thread `tid` of `nthreads` copies its share of `count` units of type T.
// DEPTH loads are issued before their stores to keep that many memory
// requests in flight per thread.
template <typename T, unsigned DEPTH>
__host__ __device__ inline void copy_units(unsigned char* __restrict__ dst,
                                           const unsigned char* __restrict__ src,
                                           u64 count, unsigned tid, unsigned nthreads) {
    T* __restrict__ d = reinterpret_cast<T*>(dst);
    const T* __restrict__ s = reinterpret_cast<const T*>(src);
    const u64 n = nthreads;
    u64 i = tid;
    for (; i + (DEPTH - 1) * n < count; i += DEPTH * n) {
        T v[DEPTH];
#pragma unroll
        for (unsigned k = 0; k < DEPTH; ++k) v[k] = s[i + k * n];
#pragma unroll
        for (unsigned k = 0; k < DEPTH; ++k) d[i + k * n] = v[k];
    }
    for (; i < count; i += n) d[i] = s[i];
}

// Copy `nbytes` bytes: single bytes up to the first aligned address, a body
// of the widest common unit, then the remaining tail bytes. When src, dst and
// nbytes are 16-byte aligned (the usual case) this is all 16-byte moves.
template <unsigned DEPTH = 4>
__host__ __device__ inline void copy_range(unsigned char* dst, const unsigned char* src,
                                           u64 nbytes, unsigned tid, unsigned nthreads) {
    const unsigned unit = copy_unit(reinterpret_cast<u64>(dst), reinterpret_cast<u64>(src));
    u64 head = (unit - (reinterpret_cast<u64>(dst) & (unit - 1))) & (unit - 1);
    if (head > nbytes) head = nbytes;
    copy_units<unsigned char, 1>(dst, src, head, tid, nthreads);
    dst += head;
    src += head;
    nbytes -= head;

    const u64 units = nbytes / unit;
    switch (unit) {
        case 16: copy_units<uint4, DEPTH>(dst, src, units, tid, nthreads); break;
        case 8: copy_units<uint2, DEPTH>(dst, src, units, tid, nthreads); break;
        case 4: copy_units<unsigned int, DEPTH>(dst, src, units, tid, nthreads); break;
        case 2: copy_units<unsigned short, DEPTH>(dst, src, units, tid, nthreads); break;
        default: copy_units<unsigned char, DEPTH>(dst, src, units, tid, nthreads); break;
    }
    const u64 body = units * unit;
    copy_units<unsigned char, 1>(dst + body, src + body, nbytes - body, tid, nthreads);
}

// ---------------------------------------------------------------- blocks path

// One layer's geometry, 8 x u64 (kvstore/copy/table.py builds the rows).
// A layer's items per block are segments * items_per_segment; first_item is
// the sum of items per block of the layers before it, so layer l's items of
// a request of B blocks are [B * first_item, B * (first_item + its own)).
struct LayerDesc {
    u64 base;               // address of block 0, segment 0
    u64 block_stride;       // bytes between block b and b + 1
    u64 segment_stride;     // bytes between segment 0 and 1 of a block
    u64 segment_bytes;      // bytes of one segment (one piece)
    u64 segments;           // 1 or 2
    u64 items_per_segment;  // ceil(segment_bytes / chunk)
    u64 first_item;         // items per block of the layers before this one
    u64 reserved;
};

// Where one work item lies: `nbytes` bytes at `paged` and at `slot`.
struct Item {
    u64 paged;
    u64 slot;
    u64 nbytes;
};

// The layer holding item `w`: the last layer whose first item is <= w (binary search).
__host__ __device__ inline unsigned layer_of(const LayerDesc* layers, unsigned num_layers,
                                             u64 blocks, u64 w) {
    unsigned lo = 0, hi = num_layers;  // answer in [lo, hi)
    while (hi - lo > 1) {
        const unsigned mid = (lo + hi) / 2;
        if (layers[mid].first_item * blocks <= w) lo = mid; else hi = mid;
    }
    return lo;
}

// Item `w` of a request: layer-major, then block, then segment, then chunk
// (the order of kvstore/copy/plan.py's pieces, each cut into chunks).
__host__ __device__ inline Item locate(const LayerDesc* layers, unsigned num_layers,
                                       const long long* ids, const u64* slots, u64 blocks,
                                       u64 chunk, u64 w) {
    const unsigned l = layer_of(layers, num_layers, blocks, w);
    const LayerDesc L = layers[l];
    const u64 per_block = L.segments * L.items_per_segment;
    const u64 r = w - L.first_item * blocks;
    const u64 b = r / per_block;
    const u64 in_block = r - b * per_block;
    const u64 s = in_block / L.items_per_segment;
    const u64 offset = (in_block - s * L.items_per_segment) * chunk;
    const u64 left = L.segment_bytes - offset;
    Item it;
    it.paged = L.base + static_cast<u64>(ids[b]) * L.block_stride + s * L.segment_stride + offset;
    it.slot = slots[l * blocks + b] + s * L.segment_bytes + offset;
    it.nbytes = left < chunk ? left : chunk;
    return it;
}

// The work of thread `tid` of a grid of `grid` CTAs of `nthreads` threads,
// in CTA `cta`: its group takes items gid, gid + groups, ... of `total`.
__host__ __device__ inline void copy_blocks_thread(const LayerDesc* layers, unsigned num_layers,
                                                   const long long* ids, const u64* slots,
                                                   u64 blocks, u64 total, u64 chunk,
                                                   unsigned group, unsigned save, unsigned cta,
                                                   unsigned grid, unsigned tid,
                                                   unsigned nthreads) {
    const unsigned per_cta = nthreads / group;
    const u64 groups = static_cast<u64>(grid) * per_cta;
    const unsigned lane = tid % group;
    for (u64 w = static_cast<u64>(cta) * per_cta + tid / group; w < total; w += groups) {
        const Item it = locate(layers, num_layers, ids, slots, blocks, chunk, w);
        unsigned char* paged = reinterpret_cast<unsigned char*>(it.paged);
        unsigned char* slot = reinterpret_cast<unsigned char*>(it.slot);
        if (save) copy_range<8>(slot, paged, it.nbytes, lane, group);
        else copy_range<8>(paged, slot, it.nbytes, lane, group);
    }
}

// inputs = [ids[0..blocks) as int64, slots[0..layers * blocks) layer-major]: one
// upload per request. Items never overlap on the destination side: the host
// checked that block ids are distinct and slots come distinct from the pool.
extern "C" __global__ void kvstore_copy_blocks(const LayerDesc* __restrict__ layers,
                                               unsigned num_layers,
                                               const u64* __restrict__ inputs, u64 blocks,
                                               u64 total, u64 chunk, unsigned group,
                                               unsigned save) {
    const long long* ids = reinterpret_cast<const long long*>(inputs);
    copy_blocks_thread(layers, num_layers, ids, inputs + blocks, blocks, total, chunk, group,
                       save, blockIdx.x, gridDim.x, threadIdx.x, blockDim.x);
}

// ---------------------------------------------------------------- table path

// table = [src[0..count), dst[0..count), nbytes[0..count)]: one upload per request.
// Blocks stride over the chunks; chunks never overlap on the destination side.
extern "C" __global__ void kvstore_copy_chunks(const u64* __restrict__ table, u64 count) {
    for (u64 c = blockIdx.x; c < count; c += gridDim.x) {
        copy_range(reinterpret_cast<unsigned char*>(table[count + c]),
                   reinterpret_cast<const unsigned char*>(table[c]),
                   table[2 * count + c], threadIdx.x, blockDim.x);
    }
}
