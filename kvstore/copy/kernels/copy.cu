// kvstore copy engine: move KV bytes between a worker's paged KV cache and the
// store's slots in ONE launch per request.
//
// The host plans the copies (kvstore/copy/plan.py) and cuts them into chunks
// of at most a few tens of KiB, so every CUDA block gets about the same work.
// Each block copies one chunk at a time with all its threads.
//
// Loaded at run time by CuPy through NVRTC, so no includes: NVRTC provides the
// built-in vector types (uint2, uint4) used for the wide loads and stores.
// The helpers are __host__ __device__ so a host-only harness can check the
// head / body / tail arithmetic on machines without a GPU.

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
// Four loads are issued before their stores to keep more memory requests
// in flight per thread.
template <typename T>
__host__ __device__ inline void copy_units(unsigned char* __restrict__ dst,
                                           const unsigned char* __restrict__ src,
                                           u64 count, unsigned tid, unsigned nthreads) {
    T* __restrict__ d = reinterpret_cast<T*>(dst);
    const T* __restrict__ s = reinterpret_cast<const T*>(src);
    const u64 n = nthreads;
    u64 i = tid;
    for (; i + 3 * n < count; i += 4 * n) {
        const T a = s[i];
        const T b = s[i + n];
        const T c = s[i + 2 * n];
        const T e = s[i + 3 * n];
        d[i] = a;
        d[i + n] = b;
        d[i + 2 * n] = c;
        d[i + 3 * n] = e;
    }
    for (; i < count; i += n) d[i] = s[i];
}

// Copy `nbytes` bytes: single bytes up to the first aligned address, a body
// of the widest common unit, then the remaining tail bytes. When src, dst and
// nbytes are 16-byte aligned (the usual case) this is all 16-byte moves.
__host__ __device__ inline void copy_range(unsigned char* dst, const unsigned char* src,
                                           u64 nbytes, unsigned tid, unsigned nthreads) {
    const unsigned unit = copy_unit(reinterpret_cast<u64>(dst), reinterpret_cast<u64>(src));
    u64 head = (unit - (reinterpret_cast<u64>(dst) & (unit - 1))) & (unit - 1);
    if (head > nbytes) head = nbytes;
    copy_units<unsigned char>(dst, src, head, tid, nthreads);
    dst += head;
    src += head;
    nbytes -= head;

    const u64 units = nbytes / unit;
    switch (unit) {
        case 16: copy_units<uint4>(dst, src, units, tid, nthreads); break;
        case 8: copy_units<uint2>(dst, src, units, tid, nthreads); break;
        case 4: copy_units<unsigned int>(dst, src, units, tid, nthreads); break;
        case 2: copy_units<unsigned short>(dst, src, units, tid, nthreads); break;
        default: copy_units<unsigned char>(dst, src, units, tid, nthreads); break;
    }
    const u64 body = units * unit;
    copy_units<unsigned char>(dst + body, src + body, nbytes - body, tid, nthreads);
}

// table = [src[0..count), dst[0..count), nbytes[0..count)]: one upload per request.
// Blocks stride over the chunks; chunks never overlap on the destination side.
extern "C" __global__ void kvstore_copy_chunks(const u64* __restrict__ table, u64 count) {
    for (u64 c = blockIdx.x; c < count; c += gridDim.x) {
        copy_range(reinterpret_cast<unsigned char*>(table[count + c]),
                   reinterpret_cast<const unsigned char*>(table[c]),
                   table[2 * count + c], threadIdx.x, blockDim.x);
    }
}
