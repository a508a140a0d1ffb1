// dot.cuh: the decode dot-product engine (rows of any format against x̂ in shared memory) and the
// waits on device counters. Compiled after common.cuh, before every kernel family (runtime/kernels.rs).

// ---------------------------------------------------------------- the decode dot-product engine
// Activations in shared memory are stored with 4 pad floats after every 32 ("padded index" xpad):
// a unit's values (W = 4, 8, 16 or 32 floats) stay contiguous and 16-byte aligned, so they are read
// as float4, and the 8 lanes of one LDS.128 phase — each reading its own unit — hit 8 different
// bank quads for every format (lane L's unit starts at bank quad L mod 8 for q4, etc.).
__host__ __device__ __forceinline__ int xpad(int i) { return i + ((i >> 5) << 2); }
__host__ __device__ __forceinline__ int xpad_len(int n) { return n + (((n + 31) >> 5) << 2); }

// 16-byte read-only load the compiler may schedule freely (no `volatile`), so a batch of them is
// issued back to back before the first use.
// Weights are read once per step and never reused by the SM that reads them, so their lines are
// not kept in L1 (no_allocate): measured +3% decode at 4K against plain ld.global.nc (329.7 → 339.9
// tok/s, docs/experiments.md); ld.global.cg (L2 only) measured no better than .nc.
#define WEIGHT_LD ld.global.nc.L1::no_allocate
#define WEIGHT_LD_STR2(x) #x
#define WEIGHT_LD_STR(x) WEIGHT_LD_STR2(x)
__device__ __forceinline__ uint4 ldg16(const void* p) {
    uint4 v;
    asm(WEIGHT_LD_STR(WEIGHT_LD) ".v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ u32 ldg_u32(const void* p) {
    u32 v;
    asm(WEIGHT_LD_STR(WEIGHT_LD) ".u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ float2 ldg_f2(const void* p) {
    float2 v;
    asm(WEIGHT_LD_STR(WEIGHT_LD) ".v2.f32 {%0,%1}, [%2];" : "=f"(v.x), "=f"(v.y) : "l"(p));
    return v;
}

// Loads of activations through L2 only (ld.global.cg): where another block of the same launch may
// have rewritten the line since this SM last read it (L1 is not coherent between SMs).
__device__ __forceinline__ float4 ldcg_f4(const float4* p) {
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ float ldcg_f32(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

// q / d for 0 ≤ q < 2^21 and d ≥ 1 (tile and chunk indices), without the ~25-instruction integer
// division (IABS, I2F.RP, …) that Nsight Compute counted in the decode products' index arithmetic:
// the f32 quotient by an approximate reciprocal is within one of the true one (relative error
// < 2^-21 against a quotient < 2^21), then corrected.
__device__ __forceinline__ int div_small(int q, int d) {
    float rcp;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(rcp) : "f"((float)d));
    int s = __float2int_rz((float)q * rcp);
    s -= s * d > q;
    s += (s + 1) * d <= q;
    return s;
}

// a·b for a row index and a row's bytes (both < 2^32, non-negative): one 32 × 32 → 64-bit multiply
// (IMAD.WIDE.U32), where an i64 product of sign-extended ints takes three or more.
__device__ __forceinline__ u64 wide_mul(u32 a, u32 b) { return (u64)a * b; }

// The code q (0..15 or 0..255) as a float without the quarter-rate integer conversion: the bits
// 0x4B000000 | q are the float 2^23 + q exactly, and subtracting 2^23 leaves q exactly.
__device__ __forceinline__ float code_to_f32(u32 q) { return __uint_as_float(0x4B000000u | q) - 8388608.0f; }

// Σ code·x (affine formats) or Σ w·x (float formats) over one 16-byte unit, for R rows that share
// the same activations x (16-byte aligned, shared memory): each x value is read once for R rows.
template <int FMT, int R> struct UnitDot;

template <int R> struct UnitDot<FMT_F32, R> {
    __device__ static __forceinline__ void run(const uint4 (&w)[R], const float* x, float (&q)[R]) {
        const float4 a = *(const float4*)x;
#pragma unroll
        for (int r = 0; r < R; ++r)
            q[r] = fmaf(__uint_as_float(w[r].w), a.w, fmaf(__uint_as_float(w[r].z), a.z,
                   fmaf(__uint_as_float(w[r].y), a.y, __uint_as_float(w[r].x) * a.x)));
    }
};

template <int FMT, int R> struct UnitDotHalf {
    __device__ static __forceinline__ void run(const uint4 (&w)[R], const float* x, float (&q)[R]) {
        typedef HalfPair<FMT> H;
        const float4 a = *(const float4*)x, b = *(const float4*)(x + 4);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float acc = H::lo(w[r].x) * a.x;
            acc = fmaf(H::hi(w[r].x), a.y, acc);
            acc = fmaf(H::lo(w[r].y), a.z, acc);
            acc = fmaf(H::hi(w[r].y), a.w, acc);
            acc = fmaf(H::lo(w[r].z), b.x, acc);
            acc = fmaf(H::hi(w[r].z), b.y, acc);
            acc = fmaf(H::lo(w[r].w), b.z, acc);
            q[r] = fmaf(H::hi(w[r].w), b.w, acc);
        }
    }
};
template <int R> struct UnitDot<FMT_BF16, R> : UnitDotHalf<FMT_BF16, R> {};
template <int R> struct UnitDot<FMT_F16, R> : UnitDotHalf<FMT_F16, R> {};

// q4: 8 codes per u32 word, low nibble first. Returns Σ (16 + q)·x: the nibble shifted to mantissa
// bits 19..22 under the exponent of 16.0 is the float 16 + q exactly (one shift and one LOP3, no
// subtraction: 3 instructions per weight instead of 4); the caller removes 16·Σx (Q4_OFFSET) with the
// unit sum it already has. The offset costs ~1.5 bits of f32 accumulation accuracy (|16 + q| ≈ 3·|q|).
#define Q4_OFFSET 16.0f
__device__ __forceinline__ float q4_plus16(u32 word, int j) {
    const u32 at19 = 4 * j <= 19 ? word << (19 - 4 * j) : word >> (4 * j - 19);
    return __uint_as_float((at19 & 0x00780000u) | 0x41800000u);
}
template <int R> struct UnitDot<FMT_Q4, R> {
    __device__ static __forceinline__ void run(const uint4 (&w)[R], const float* x, float (&q)[R]) {
#pragma unroll
        for (int r = 0; r < R; ++r) q[r] = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float4 a = *(const float4*)(x + 8 * i), b = *(const float4*)(x + 8 * i + 4);
            const float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const u32 word = i == 0 ? w[r].x : i == 1 ? w[r].y : i == 2 ? w[r].z : w[r].w;
#pragma unroll
                for (int j = 0; j < 8; ++j) q[r] = fmaf(q4_plus16(word, j), xv[j], q[r]);
            }
        }
    }
};

template <int R> struct UnitDot<FMT_Q8, R> {
    __device__ static __forceinline__ void run(const uint4 (&w)[R], const float* x, float (&q)[R]) {
#pragma unroll
        for (int r = 0; r < R; ++r) q[r] = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float4 a = *(const float4*)(x + 4 * i);
            const float xv[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const u32 word = i == 0 ? w[r].x : i == 1 ? w[r].y : i == 2 ? w[r].z : w[r].w;
#pragma unroll
                for (int j = 0; j < 4; ++j) q[r] = fmaf(code_to_f32((word >> (8 * j)) & 255u), xv[j], q[r]);
            }
        }
    }
};

// A matrix as kernels see it: codes/values and (for affine formats) interleaved group parameters.
struct MatrixRef {
    u64 data;      // codes or values, row-major
    u64 params;    // affine only: [rows, cols/G] (scale, bias) pairs
    i64 row_bytes; // bytes of one row of `data`
    int groups_per_row;
    int param_f32; // PARAM_BF16 or PARAM_F32
};

// Group parameters of (row, group g).
__device__ __forceinline__ float2 load_group_params(const MatrixRef& m, i64 row, int g) {
    const i64 idx = row * (i64)m.groups_per_row + g;
    if (m.param_f32) return ld_nc_f2((const float2*)m.params + idx);
    const u32 pair = ld_nc_u32((const u32*)m.params + idx);
    float2 r;
    r.x = bf16_lo(pair);
    r.y = bf16_hi(pair);
    return r;
}

// out[c] = row `row` of m dequantised to f32, c < D (the embedding gathers of both paths), with the
// block's threads, one 16-byte unit each.
template <int FMT>
__device__ __forceinline__ void dequant_row(const MatrixRef& m, i64 row, int D, int group_size, float* out) {
    typedef Fmt<FMT> F;
    const u8* codes = (const u8*)m.data + row * m.row_bytes;
    float vals[F::W];
    for (int u = threadIdx.x; u < D / F::W; u += blockDim.x) {
        const uint4 w = ld_nc_16(codes + (i64)u * 16);
        float scale = 1.0f, bias = 0.0f;
        if (F::AFFINE) {
            const float2 g = load_group_params(m, row, (u * F::W) / group_size);
            scale = g.x;
            bias = g.y;
        }
        F::decode(w, vals, scale, bias);
#pragma unroll
        for (int j = 0; j < F::W; ++j) out[u * F::W + j] = vals[j];
    }
}

// Where one row's codes and group parameters start.
struct RowPtr {
    const u8* data;
    const u8* params; // affine only
    int param_f32;
};
__device__ __forceinline__ RowPtr row_ptr(const MatrixRef& m, i64 row) {
    RowPtr r;
    r.data = (const u8*)m.data + row * m.row_bytes;
    r.params = (const u8*)m.params + row * (i64)m.groups_per_row * (m.param_f32 ? 8 : 4);
    r.param_f32 = m.param_f32;
    return r;
}
__device__ __forceinline__ float2 row_group_params(const RowPtr& r, int g) {
    if (r.param_f32) return ldg_f2(r.params + (i64)g * 8);
    const u32 pair = ldg_u32(r.params + (i64)g * 4);
    return make_float2(bf16_lo(pair), bf16_hi(pair));
}

// Ask L2 to fetch the 128-byte line holding p (fire and forget: no register waits on it). A kernel
// prefetches its own weights first thing, so DRAM streams them while the block loads and normalises
// x̂; the loads that follow then hit L2 or merge with the request in flight.
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// Prefetch rows [row0, row0 + nrows) of m (codes and group parameters) with the block's threads.
__device__ __forceinline__ void prefetch_rows(const MatrixRef& m, i64 row0, int nrows) {
    const i64 code_bytes = (i64)nrows * m.row_bytes;
    const u8* data = (const u8*)m.data + row0 * m.row_bytes;
    for (i64 off = (i64)threadIdx.x * 128; off < code_bytes; off += (i64)blockDim.x * 128) prefetch_l2(data + off);
    if (m.params) {
        const i64 pitch = (i64)m.groups_per_row * (m.param_f32 ? 8 : 4);
        const u8* params = (const u8*)m.params + row0 * pitch;
        for (i64 off = (i64)threadIdx.x * 128; off < (i64)nrows * pitch; off += (i64)blockDim.x * 128)
            prefetch_l2(params + off);
    }
}

// Partial dot products of R rows with x (shared memory, padded layout xpad) over the units lane,
// lane + width, …; the caller reduces over its `width` lanes. U units per row are loaded before any
// is used, so R·U 16-byte loads per lane are in flight at once. `usum` [units] holds Σx over each
// unit (affine formats: Σ (s·q + b)·x = s·Σ q·x + b·Σ x). `units_per_group` = G / W.
template <int FMT, int R, int U>
__device__ __forceinline__ void rows_dot(const RowPtr (&rows)[R], const float* x, const float* usum, int units,
                                         int lane, int width, int units_per_group, float (&acc)[R]) {
    typedef Fmt<FMT> F;
    for (int u0 = lane; u0 < units; u0 += U * width) {
        uint4 w[U][R];
        float2 sb[U][R];
#pragma unroll
        for (int k = 0; k < U; ++k) {
            const int u = u0 + k * width;
            if (u < units) {
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    w[k][r] = ldg16(rows[r].data + (i64)u * 16);
                    if (F::AFFINE) sb[k][r] = row_group_params(rows[r], u / units_per_group);
                }
            }
        }
#pragma unroll
        for (int k = 0; k < U; ++k) {
            const int u = u0 + k * width;
            if (u < units) {
                float q[R];
                UnitDot<FMT, R>::run(w[k], x + xpad(u * F::W), q);
                if (FMT == FMT_Q4) { // UnitDot<Q4> returned Σ (16 + q)·x
#pragma unroll
                    for (int r = 0; r < R; ++r) q[r] = fmaf(-Q4_OFFSET, usum[u], q[r]);
                }
#pragma unroll
                for (int r = 0; r < R; ++r)
                    acc[r] += F::AFFINE ? fmaf(sb[k][r].x, q[r], sb[k][r].y * usum[u]) : q[r];
            }
        }
    }
}

// Lanes that share one row: the largest power of two ≤ min(32, units per row).
__host__ __device__ __forceinline__ int lanes_per_row(int units) {
    int w = 1;
    while (w * 2 <= units && w < 32) w *= 2;
    return w;
}

// Stage n floats (n % 8 == 0) of x from global memory into shared memory (padded layout xpad over the
// flat index), applying the zero-centred RMSNorm when `gain` (= 1 + w) is given:
// x̂ = x · (1/√(mean(x²) + eps)) · gain (calla_cpu::norm::rms_norm_zero_centred). With UNIT (16 or 32)
// also writes usum[u] = Σ x̂ over unit u (UNIT floats from u·UNIT). Ends with a barrier.
// Each thread owns chunks of 8 consecutive floats and issues all its 16-byte loads (x and gain) before
// it uses any: the prologue costs one memory round trip, not one per element (the loop it replaced
// waited on K/blockDim serial loads). With `gain`, n ≤ 8·STAGE_BATCH·blockDim (the launchers check).
#define STAGE_BATCH 4
template <int UNIT>
__device__ __forceinline__ void stage_input(const float* src, const float* gain, float eps, int n, float* xs,
                                            float* usum, float* red) {
    const int nchunks = n >> 3;
    for (int base = 0; base < nchunks; base += STAGE_BATCH * blockDim.x) {
        float4 v[STAGE_BATCH][2], g[STAGE_BATCH][2];
#pragma unroll
        for (int b = 0; b < STAGE_BATCH; ++b) {
            const int q = base + b * blockDim.x + threadIdx.x;
            const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            v[b][0] = v[b][1] = g[b][0] = g[b][1] = zero;
            if (q < nchunks) {
                v[b][0] = ldcg_f4((const float4*)src + 2 * q);
                v[b][1] = ldcg_f4((const float4*)src + 2 * q + 1);
                if (gain) {
                    g[b][0] = ((const float4*)gain)[2 * q];
                    g[b][1] = ((const float4*)gain)[2 * q + 1];
                }
            }
        }
        float inv = 1.0f;
        if (gain) {
            float ss = 0.0f;
#pragma unroll
            for (int b = 0; b < STAGE_BATCH; ++b)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    ss += v[b][h].x * v[b][h].x + v[b][h].y * v[b][h].y + v[b][h].z * v[b][h].z + v[b][h].w * v[b][h].w;
            const float total = block_sum(ss, red);
            inv = 1.0f / sqrtf(total / (float)n + eps); // x̂ = x / √(mean(x²) + eps)
        }
#pragma unroll
        for (int b = 0; b < STAGE_BATCH; ++b) {
            const int q = base + b * blockDim.x + threadIdx.x;
            float x8[8] = {v[b][0].x, v[b][0].y, v[b][0].z, v[b][0].w, v[b][1].x, v[b][1].y, v[b][1].z, v[b][1].w};
            if (gain) {
                const float g8[8] = {g[b][0].x, g[b][0].y, g[b][0].z, g[b][0].w,
                                     g[b][1].x, g[b][1].y, g[b][1].z, g[b][1].w};
#pragma unroll
                for (int i = 0; i < 8; ++i) x8[i] = x8[i] * inv * g8[i];
            }
            if (q < nchunks) {
                float4* d = (float4*)(xs + xpad(8 * q));
                d[0] = make_float4(x8[0], x8[1], x8[2], x8[3]);
                d[1] = make_float4(x8[4], x8[5], x8[6], x8[7]);
            }
            if (UNIT > 0) { // a unit is UNIT/8 consecutive chunks = that many consecutive lanes
                float sum = 0.0f;
#pragma unroll
                for (int i = 0; i < 8; ++i) sum += x8[i];
                sum += __shfl_xor_sync(0xffffffffu, sum, 1);
                if (UNIT == 32) sum += __shfl_xor_sync(0xffffffffu, sum, 2);
                if (q < nchunks && q % (UNIT / 8) == 0) usum[q / (UNIT / 8)] = sum;
            }
        }
    }
    __syncthreads();
}

// Thread-block clusters (sm_90+): a block's shared memory seen from the other blocks of its cluster
// (distributed shared memory), and the cluster-wide barrier. Each barrier.cluster phase is an arrive
// then a wait by every thread of every block (.aligned: the whole warp executes it together).
#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
// `local` (a __shared__ address of this block) as seen in the cluster block of rank `rank`.
__device__ __forceinline__ u32 cluster_map(const void* local, u32 rank) {
    u32 addr, remote;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(addr) : "l"(local));
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
    return remote;
}
__device__ __forceinline__ float cluster_load_f32(const float* local, u32 rank) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(cluster_map(local, rank)) : "memory");
    return v;
}
#endif

// Programmatic dependent launch (graph.rs): a kernel launched with it may start while
// the previous kernel in the stream still runs. griddep_wait() returns once that kernel (and so,
// transitively, every earlier one) has finished and its writes are visible: call it before reading
// or writing anything the previous kernel touches. griddep_launch_dependents() lets the next kernel
// start launching. Both are no-ops for an ordinary launch.
__device__ __forceinline__ void griddep_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void griddep_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// The wait, then the trigger: at most two kernels of a chain are in flight, and when a kernel's first
// block starts, every kernel before its predecessor has finished (the predecessor's blocks have all
// passed their own wait). So what a kernel reads before griddep_enter() may come from any kernel but
// its predecessor. Triggered at entry instead, every kernel of the graph launched at once and their
// waiting blocks took the SMs from the running one (session 5: 442 → 372 tok/s).
__device__ __forceinline__ void griddep_enter() {
    griddep_wait();
    griddep_launch_dependents();
}

// ---------------------------------------------------------------- waiting for a device counter
// Polls with relaxed loads and acquires once, after the wait: an acquire load at GPU scope also
// invalidates the SM's L1, and a block spinning with it would do so continuously under the block
// that shares its SM and is still working.
__device__ __forceinline__ u64 ld_relaxed_u64(u64 addr) {
    u64 v;
    asm volatile("ld.relaxed.gpu.u64 %0, [%1];" : "=l"(v) : "l"(addr) : "memory");
    return v;
}
__device__ __forceinline__ void wait_until_at_least(u64 addr, u64 target) {
    while (ld_relaxed_u64(addr) < target) {
    }
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
}

// Block-wide arrival at a u32 ticket that `count` blocks reach in this launch: true, in every thread,
// in the last block to arrive, which then sees the writes every block made before its arrival. The
// barrier orders the block's writes before thread 0's fence, which publishes them (cooperative
// groups' grid-sync pattern; a fence in every thread measured 0.4 µs slower per launch).
// The caller resets the ticket for the next launch.
__device__ __forceinline__ bool block_arrive_last(unsigned* ticket, unsigned count) {
    __shared__ int last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(ticket, 1u) + 1 == count;
    }
    __syncthreads();
    const bool is_last = last != 0;
    if (is_last) __threadfence();
    return is_last;
}

// The per-step cursor, written by the host when it changes and advanced on the device by the token
// selection kernel: the decode graph reads everything sequence-dependent through it.
struct Cursor {
    u64 state_base; // the sequence's state arena (conv rings, recurrent states, KV caches)
    int pos;        // position of the token being processed
    int token;      // the token being processed
};
