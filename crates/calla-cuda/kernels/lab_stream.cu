// lab_stream.cu: the streaming floor a decode kernel is measured against (lab only, loaded on
// demand). stream_read_u<U> reads `bytes` from `src` as 16-byte loads, consecutive threads on
// consecutive chunks (fully coalesced), U loads in flight per thread, grid-strided; the values are
// folded by XOR and written only if they hit a magic word, so the loads stay live but nothing is
// stored. What it measures: how long a kernel that does nothing but read N bytes from DRAM takes
// inside a CUDA graph (launch, ramp-up, the bytes, the drain), by grid size and loads in flight
// (tests/gpu/stream_floor.rs, docs/performance.md "Session 5").

struct StreamParams {
    u64 src;
    u64 bytes; // multiple of 16
    u64 out;   // u32, written only on a (never expected) magic value
};

// XOR of every 16-byte chunk i0, i0 + stride, … < n of src, U loads in flight per thread.
template <int U>
__device__ __forceinline__ u32 stream_fold(const uint4* src, i64 n, i64 i0, i64 stride) {
    u32 acc = 0;
    for (; i0 < n; i0 += U * stride) {
        uint4 v[U];
#pragma unroll
        for (int k = 0; k < U; ++k) {
            const i64 i = i0 + k * stride;
            v[k] = i < n ? ldg16(src + i) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int k = 0; k < U; ++k) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
    }
    return acc;
}

template <int U>
__device__ __forceinline__ void stream_body(const StreamParams& p) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    const u32 acc = stream_fold<U>((const uint4*)p.src, (i64)(p.bytes / 16), (i64)blockIdx.x * blockDim.x + threadIdx.x, stride);
    if (acc == 0x9e3779b9u) *(u32*)p.out = acc;
}

#define STREAM_KERNEL(U) \
    extern "C" __global__ void __launch_bounds__(256) stream_read_u##U(const StreamParams p) { stream_body<U>(p); }
STREAM_KERNEL(1)
STREAM_KERNEL(2)
STREAM_KERNEL(4)
STREAM_KERNEL(8)

static_assert(sizeof(StreamParams) == 24, "StreamParams layout differs from its Rust twin");

// stream_chain_link: one link of a synthetic decode step (tests/gpu/stream_floor.rs
// decode_chain_against_its_floor): the floor of a chain of dependent kernels with the step's bytes
// and grids. Each link streams its own `bytes` as stream_read_u4 does and writes x_out (xn floats,
// grid-strided), which the next link reads as its x_in (from L2, as a decode kernel reads its input):
//   mode 0  the stream only (x_out still written);
//   mode 1  x_in read and summed over the block before the stream is issued (the decode kernels'
//           order: their weights are requested once x has arrived);
//   mode 2  x_in requested, the stream issued at once behind it, the block sum after;
//   mode 3  as mode 1, each block reading its own copy: x_in + blockIdx.x·xn (hot lines or volume?).
struct ChainParams {
    u64 src;
    u64 bytes; // multiple of 16
    u64 x_in;  // f32 [xn]
    u64 x_out; // f32 [xn]
    u64 out;   // u32, written only on a (never expected) magic value
    int xn, mode;
};

// x's Σx², every load of the thread issued at once as float4 (as the decode kernels load their
// input; a scalar loop waited for its loads in turn); xn a multiple of 4, ≤ 8·blockDim.
__device__ __forceinline__ float chain_input_sumsq(const float* x, int xn) {
    constexpr int XV = 2;
    float4 v[XV];
#pragma unroll
    for (int j = 0; j < XV; ++j) {
        const int q = threadIdx.x + j * blockDim.x;
        v[j] = 4 * q < xn ? ldcg_f4((const float4*)x + q) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < XV; ++j) ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
    return ss;
}

extern "C" __global__ void __launch_bounds__(256) stream_chain_link(const ChainParams p) {
    __shared__ float red[32];
    griddep_enter(); // CALLA_PDL=1: the link before has finished once this returns
    const float* x_in = (const float*)p.x_in + (p.mode == 3 ? (i64)blockIdx.x * p.xn : 0);
    float ss = p.mode != 0 ? chain_input_sumsq(x_in, p.xn) : 0.0f;
    if (p.mode == 1 || p.mode == 3) ss = block_sum(ss, red);
    const i64 stride = (i64)gridDim.x * blockDim.x;
    const u32 acc = stream_fold<4>((const uint4*)p.src, (i64)(p.bytes / 16), (i64)blockIdx.x * blockDim.x + threadIdx.x, stride);
    if (p.mode == 2) ss = block_sum(ss, red);
    if (acc == 0x9e3779b9u) *(u32*)p.out = acc;
    float* x_out = (float*)p.x_out;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < p.xn; i += gridDim.x * blockDim.x)
        x_out[i] = 0.5f + 1e-30f * ss; // bounded: the chain's values never grow
}
static_assert(sizeof(ChainParams) == 48, "ChainParams layout differs from its Rust twin");

// stream_chain_bulk: a link of the same chain whose bytes reach shared memory by bulk copies (the TMA
// engine) that thread 0 issues, instead of 16-byte loads into registers. What it asks: can a decode
// kernel request its weights at entry, before its input has arrived, without the input's L2 read
// waiting behind them? Loads into registers (session 5) and L2 prefetches by TMA (session 12) made it
// wait. Block b copies its span of the link's bytes (a contiguous 1/grid of them) through a ring of
// BULK_STAGES stages of BULK_CHUNK bytes (dynamic shared memory, BULK_STAGES·BULK_CHUNK bytes); every
// thread folds one 16-byte word of each landed chunk, so the copies are used.
//   mode 0  the copies only (x_out still written);
//   mode 1  x read and summed over the block, then the copies issued (today's order);
//   mode 2  the copies issued at entry, x read and summed while they land.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) // mma.cuh's mbarrier helpers; bulk copies need sm_90
#define BULK_STAGES 4
#define BULK_CHUNK 16384
extern "C" __global__ void __launch_bounds__(256) stream_chain_bulk(const ChainParams p) {
    extern __shared__ float4 ring4[];
    __shared__ __align__(8) u64 bars[BULK_STAGES];
    __shared__ float red[32];
    const u8* ring = (const u8*)ring4;
    const i64 span = (((i64)p.bytes / 16 + gridDim.x - 1) / gridDim.x) * 16;
    const i64 begin = min((i64)p.bytes, (i64)blockIdx.x * span), end = min((i64)p.bytes, begin + span);
    const int nchunks = (int)((end - begin + BULK_CHUNK - 1) / BULK_CHUNK);
    const u32 ring_s = smem_addr(ring4), bars_s = smem_addr(bars);
    if (threadIdx.x == 0) {
        for (int s = 0; s < BULK_STAGES; ++s) mbar_init(bars_s + 8 * s, 1);
        fence_mbar_init();
    }
    __syncthreads();
    auto issue = [&](int k) { // thread 0: chunk k into stage k % BULK_STAGES
        const int s = k % BULK_STAGES;
        const i64 off = begin + (i64)k * BULK_CHUNK;
        const u32 bytes = (u32)min((i64)BULK_CHUNK, end - off);
        mbar_arrive_expect_tx(bars_s + 8 * s, bytes);
        bulk_copy_g2s(ring_s + s * BULK_CHUNK, (const void*)(p.src + off), bytes, bars_s + 8 * s);
    };
    float ss = 0.0f;
    // CALLA_PDL=1: mode 2's copies go out before the wait (its bytes do not depend on the link
    // before, so they can stream while that link still runs), the other modes' after it.
    if (p.mode != 2) griddep_enter();
    if (p.mode == 1) ss = block_sum(chain_input_sumsq((const float*)p.x_in, p.xn), red);
    if (threadIdx.x == 0)
        for (int k = 0; k < min(nchunks, BULK_STAGES); ++k) issue(k);
    if (p.mode == 2) {
        griddep_enter();
        ss = block_sum(chain_input_sumsq((const float*)p.x_in, p.xn), red);
    }
    u32 acc = 0;
    for (int k = 0; k < nchunks; ++k) {
        const int s = k % BULK_STAGES;
        mbar_wait(bars_s + 8 * s, (k / BULK_STAGES) & 1);
        const i64 n = min((i64)BULK_CHUNK, end - (begin + (i64)k * BULK_CHUNK));
        if (16 * (i64)threadIdx.x < n) {
            const uint4 v = *(const uint4*)(ring + s * BULK_CHUNK + 16 * threadIdx.x);
            acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
        if (k + BULK_STAGES < nchunks) {
            __syncthreads(); // every thread has read stage s before it is refilled
            if (threadIdx.x == 0) {
                fence_proxy_async_smem(); // those generic reads before the async proxy's writes
                issue(k + BULK_STAGES);
            }
        }
    }
    if (acc == 0x9e3779b9u) *(u32*)p.out = acc;
    float* x_out = (float*)p.x_out;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < p.xn; i += gridDim.x * blockDim.x)
        x_out[i] = 0.5f + 1e-30f * ss;
}
#endif

// stream_chain_persistent: the same chain as one resident grid (a persistent decode kernel's
// floor): link l reads x[l % 2], sums it over the block, streams its bytes over the whole grid,
// writes x[(l + 1) % 2], then a grid barrier (common.cuh grid_barrier). mode 3 also requests the
// next link's first loads (4 per thread) before the barrier: the weights of a phase do not depend
// on the one before, so their first DRAM round trip can overlap the barrier.
struct ChainLink {
    u64 src;
    u64 bytes; // multiple of 16
};
struct PersistentChainParams {
    u64 links; // ChainLink [nlinks]
    u64 x;     // f32 [2][xn]
    GridSync sync;
    u64 out; // u32, written only on a (never expected) magic value
    int nlinks, xn, mode, pad;
};

extern "C" __global__ void __launch_bounds__(256) stream_chain_persistent(const PersistentChainParams p) {
    __shared__ float red[32];
    const ChainLink* links = (const ChainLink*)p.links;
    const i64 stride = (i64)gridDim.x * blockDim.x, tid0 = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    u32 acc = 0;
    uint4 pre[4];
    bool have_pre = false;
    for (int l = 0; l < p.nlinks; ++l) {
        const ChainLink L = links[l];
        const float* x_in = (const float*)p.x + (l & 1) * p.xn;
        float* x_out = (float*)p.x + ((l + 1) & 1) * p.xn;
        const float ss = block_sum(chain_input_sumsq(x_in, p.xn), red);
        const uint4* src = (const uint4*)L.src;
        const i64 n = (i64)(L.bytes / 16);
        i64 i0 = tid0;
        if (have_pre) {
#pragma unroll
            for (int k = 0; k < 4; ++k) acc ^= pre[k].x ^ pre[k].y ^ pre[k].z ^ pre[k].w;
            i0 += 4 * stride;
        }
        acc ^= stream_fold<4>(src, n, i0, stride);
        for (i64 i = tid0; i < p.xn; i += stride) x_out[i] = 0.5f + 1e-30f * ss;
        have_pre = false;
        if (p.mode == 3 && l + 1 < p.nlinks) {
            const ChainLink N = links[l + 1];
            const uint4* nsrc = (const uint4*)N.src;
            const i64 nn = (i64)(N.bytes / 16);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const i64 i = tid0 + k * stride;
                pre[k] = i < nn ? ldg16(nsrc + i) : make_uint4(0, 0, 0, 0);
            }
            have_pre = true;
        }
        grid_barrier(p.sync);
    }
    if (acc == 0x9e3779b9u) *(u32*)p.out = acc;
}
static_assert(sizeof(PersistentChainParams) == 56, "PersistentChainParams layout differs from its Rust twin");
// stream_red_link: a link of the synthetic chain (stream_chain_link's mode 1: x read and summed,
// then the bytes) that ends with every block adding `nred` values into an accumulator, as a fused
// MoE kernel (gate/up and a split-K down in one launch) would add its down partials into h: what
// those reductions cost at the step's grids (tests/gpu/stream_floor.rs moe_link_with_reductions).
//   mode 0  no reductions;  1  red.add.u64 (fixed point);  2  red.add.f32;  3  red.add.v4.f32
//   (nred/4 of them). Block b adds into copy b % copies of acc ([copies][nred] words).
struct RedLinkParams {
    u64 src;
    u64 bytes; // multiple of 16
    u64 x_in;  // f32 [xn]
    u64 x_out; // f32 [xn]
    u64 acc;   // [copies][nred] i64 or f32
    u64 out;   // u32, written only on a (never expected) magic value
    int xn, nred, mode, copies;
};

extern "C" __global__ void __launch_bounds__(256) stream_red_link(const RedLinkParams p) {
    __shared__ float red[32];
    const float ss = block_sum(chain_input_sumsq((const float*)p.x_in, p.xn), red);
    const i64 stride = (i64)gridDim.x * blockDim.x;
    const u32 acc = stream_fold<4>((const uint4*)p.src, (i64)(p.bytes / 16), (i64)blockIdx.x * blockDim.x + threadIdx.x, stride);
    if (acc == 0x9e3779b9u) *(u32*)p.out = acc;
    const int copy = blockIdx.x % p.copies;
    const float v = 1e-3f * (float)(threadIdx.x & 7) + 1e-30f * ss;
    if (p.mode == 1) {
        i64* a = (i64*)p.acc + (i64)copy * p.nred;
        for (int i = threadIdx.x; i < p.nred; i += blockDim.x)
            atomicAdd((unsigned long long*)(a + i), (unsigned long long)__float2ll_rn(v * 4294967296.0f));
    } else if (p.mode == 2) {
        float* a = (float*)p.acc + (i64)copy * p.nred;
        for (int i = threadIdx.x; i < p.nred; i += blockDim.x) atomicAdd(a + i, v);
    } else if (p.mode == 3) {
        float* a = (float*)p.acc + (i64)copy * p.nred;
        for (int i = 4 * threadIdx.x; i < p.nred; i += 4 * blockDim.x)
            asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(a + i), "f"(v), "f"(v), "f"(v), "f"(v)
                         : "memory");
    }
    float* x_out = (float*)p.x_out;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < p.xn; i += gridDim.x * blockDim.x)
        x_out[i] = 0.5f + 1e-30f * ss;
}
static_assert(sizeof(RedLinkParams) == 64, "RedLinkParams layout differs from its Rust twin");

// stream_chain_producer: the same chain as one resident grid of one block per SM whose last warp only
// streams: it copies the block's span of every link's bytes, link after link, into a ring of
// `stages` × `chunk` bytes of shared memory by bulk copies, waiting only for a free stage,
// never for the links' barriers. The other 8 warps run the links: wait for the previous link's grid
// barrier, read x and sum it, fold the link's chunks as they land (with `work` FMAs per 32-bit word,
// the arithmetic a q4 product spends on dequantising and multiplying), write x_out, arrive at the
// barrier. What it asks: with weights that stream ahead across link boundaries (a persistent decode
// kernel with a producer warp, as the megakernels of the Llama-1B "no bubbles" work), what does the
// step cost? A link whose bytes depend on an earlier one (the routed experts depend on the router)
// names it in `dep`: the producer waits for that link's barrier before copying them.
struct ProducerLink {
    u64 src;
    u64 bytes; // multiple of 16
    int dep;   // the link whose barrier must have passed before these bytes are copied; -1: none
    int pad;
};
struct ProducerChainParams {
    u64 links; // ProducerLink [nlinks]
    u64 x;     // f32 [2][xn]
    GridSync sync;
    u64 out;    // u32, written only on a (never expected) magic value
    u64 stamps; // 0, or u64 [nlinks][6]: block 0's %globaltimer per link (below), then
                // u64 [nlinks][grid]: every block's arrival at each link's barrier
    int nlinks, xn, stages, work;
    int chunk; // bytes per stage, a multiple of 16
    int flags; // PRODUCER_NO_CHAIN: the links fold their chunks with no x and no barriers (the stream alone)
};
#define PRODUCER_MAX_STAGES 16
#define PRODUCER_NO_CHAIN 1
#define PRODUCER_POLL_SLEEP 2 // the barrier's poll sleeps 100 ns between loads (less traffic on its line)
#define PRODUCER_CONSUMERS 256 // 8 warps; warp 8 is the producer

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(PRODUCER_CONSUMERS) : "memory"); }

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
extern "C" __global__ void __launch_bounds__(PRODUCER_CONSUMERS + 32, 1) stream_chain_producer(const ProducerChainParams p) {
    extern __shared__ float4 pring4[];
    __shared__ __align__(8) u64 full[PRODUCER_MAX_STAGES], empty[PRODUCER_MAX_STAGES];
    __shared__ float red[PRODUCER_CONSUMERS / 32];
    __shared__ volatile int passed; // the last link whose grid barrier this block has passed
    const ProducerLink* links = (const ProducerLink*)p.links;
    const u8* ring = (const u8*)pring4;
    const u32 ring_s = smem_addr(pring4), full_s = smem_addr(full), empty_s = smem_addr(empty);
    const int S = p.stages;
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; ++s) {
            mbar_init(full_s + 8 * s, 1);
            mbar_init(empty_s + 8 * s, PRODUCER_CONSUMERS / 32);
        }
        passed = -1;
        fence_mbar_init();
    }
    __syncthreads();
    // the block's span of link l: a contiguous 1/grid of its bytes, in chunks of p.chunk
    auto span = [&](const ProducerLink& L, i64* begin, i64* end) {
        const i64 per = (((i64)L.bytes / 16 + gridDim.x - 1) / gridDim.x) * 16;
        *begin = min((i64)L.bytes, (i64)blockIdx.x * per);
        *end = min((i64)L.bytes, *begin + per);
    };
    auto now = []() {
        u64 t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        return t;
    };
    if (threadIdx.x >= PRODUCER_CONSUMERS) { // the producer warp: lane 0 copies, the others idle
        if (threadIdx.x != PRODUCER_CONSUMERS) return;
        // block 0: when the link's first and last chunks were issued
        u64* pstamp = p.stamps != 0 && blockIdx.x == 0 ? (u64*)p.stamps : nullptr;
        u32 c = 0; // chunks issued so far
        for (int l = 0; l < p.nlinks; ++l) {
            const ProducerLink L = links[l];
            if (L.dep >= 0)
                while (passed < L.dep) {
                }
            i64 begin, end;
            span(L, &begin, &end);
            for (i64 off = begin; off < end; off += p.chunk, ++c) {
                const u32 s = c % S, round = c / S;
                if (round > 0) mbar_wait(empty_s + 8 * s, (round - 1) & 1);
                const u32 bytes = (u32)min((i64)p.chunk, end - off);
                mbar_arrive_expect_tx(full_s + 8 * s, bytes);
                bulk_copy_g2s(ring_s + s * p.chunk, (const void*)(L.src + off), bytes, full_s + 8 * s);
                if (pstamp && off == begin) pstamp[6 * l + 4] = now();
                if (pstamp && off + p.chunk >= end) pstamp[6 * l + 5] = now();
            }
        }
        return;
    }
    u32 c = 0, acc = 0;
    float fa = 1.0f, fb = 1.0f, fc = 1.0f, fd = 1.0f;
    const i64 stride = (i64)gridDim.x * PRODUCER_CONSUMERS, tid0 = (i64)blockIdx.x * PRODUCER_CONSUMERS + threadIdx.x;
    // block 0, thread 0: the link's start, x summed, its chunks folded, its barrier passed
    u64* stamp = p.stamps != 0 && blockIdx.x == 0 && threadIdx.x == 0 ? (u64*)p.stamps : nullptr;
    for (int l = 0; l < p.nlinks; ++l) {
        const float* x_in = (const float*)p.x + (l & 1) * p.xn;
        float* x_out = (float*)p.x + ((l + 1) & 1) * p.xn;
        if (stamp) stamp[6 * l] = now();
        const bool chain = (p.flags & PRODUCER_NO_CHAIN) == 0;
        float ss = chain ? chain_input_sumsq(x_in, p.xn) : 0.0f;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (chain) {
            if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
            consumers_sync();
            ss = 0.0f;
#pragma unroll
            for (int w = 0; w < PRODUCER_CONSUMERS / 32; ++w) ss += red[w];
        }
        if (stamp) stamp[6 * l + 1] = now();
        i64 begin, end;
        span(links[l], &begin, &end);
        for (i64 off = begin; off < end; off += p.chunk, ++c) {
            const u32 s = c % S;
            mbar_wait(full_s + 8 * s, (c / S) & 1);
            const i64 n = min((i64)p.chunk, end - off);
            for (i64 i = 16 * (i64)threadIdx.x; i < n; i += 16 * PRODUCER_CONSUMERS) {
                const uint4 v = *(const uint4*)(ring + (i64)s * p.chunk + i);
                acc ^= v.x ^ v.y ^ v.z ^ v.w;
                for (int k = 0; k < p.work; ++k) { // independent chains, as a dequantise-and-multiply is
                    fa = fmaf(fa, __uint_as_float((v.x & 0x007fffffu) | 0x3f000000u), 1e-3f);
                    fb = fmaf(fb, __uint_as_float((v.y & 0x007fffffu) | 0x3f000000u), 1e-3f);
                    fc = fmaf(fc, __uint_as_float((v.z & 0x007fffffu) | 0x3f000000u), 1e-3f);
                    fd = fmaf(fd, __uint_as_float((v.w & 0x007fffffu) | 0x3f000000u), 1e-3f);
                }
            }
            __syncwarp();
            if ((threadIdx.x & 31) == 0) mbar_arrive(empty_s + 8 * s); // this warp has read stage s
        }
        for (i64 i = tid0; i < p.xn; i += stride) x_out[i] = 0.5f + 1e-30f * ss;
        if (stamp) stamp[6 * l + 2] = now();
        if (!chain) {
            if (stamp) stamp[6 * l + 3] = now();
            continue;
        }
        // the grid barrier over the consumers (grid_barrier's, with a named barrier of 8 warps)
        consumers_sync();
        if (threadIdx.x == 0) {
            if (p.stamps != 0) ((u64*)p.stamps)[6 * p.nlinks + (i64)l * gridDim.x + blockIdx.x] = now();
            const u64 target = grid_target(grid_arrive_count(p.sync));
            if (p.flags & PRODUCER_POLL_SLEEP) {
                while (ld_relaxed_u64(p.sync.counter) < target) __nanosleep(100);
                asm volatile("fence.acq_rel.gpu;" ::: "memory");
            } else {
                wait_until_at_least(p.sync.counter, target);
            }
            passed = l;
            if (stamp) stamp[6 * l + 3] = now();
        }
        consumers_sync();
    }
    if (acc == 0x9e3779b9u || fa + fb + fc + fd == 0.123f) *(u32*)p.out = acc;
}
#endif
static_assert(sizeof(ProducerLink) == 24, "ProducerLink layout differs from its Rust twin");
static_assert(sizeof(ProducerChainParams) == 72, "ProducerChainParams layout differs from its Rust twin");
