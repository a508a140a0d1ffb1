// common.cuh: prepended to every kernel source by nvrtc.rs. No CUDA toolkit header is needed at run
// time: the bf16/f16 conversions, the vector loads, the reductions and the weight formats are here.
//
// Conventions shared by all kernels
// - Activations are f32. Weights are one of the formats below. KV cache entries are bf16.
// - Every kernel takes one #[repr(C)] parameter struct by value; its Rust twin lives in the kernel
//   family's launcher (src/<family>.rs). Pointers are u64, sizes i32, so both sides agree on layout.
// - A "unit" is 16 bytes of weight codes: one 128-bit load per thread, coalesced across a warp.
//
// Weight formats (row-major [rows, cols], rows = out features; see calla_model::matrix):
//   FMT_F32   4 weights/unit            FMT_BF16  8 weights/unit        FMT_F16  8 weights/unit
//   FMT_Q4    32 weights/unit, MLX affine: w = scale·q + bias per group of G columns, codes packed
//             low nibble first in little-endian u32 words; (scale, bias) interleaved per group as
//             two bf16 in one u32 (PARAM_BF16) or as float2 (PARAM_F32).
//   FMT_Q8    16 weights/unit, same with bytes.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned long long u64;
typedef long long i64;

#define FMT_F32 0
#define FMT_BF16 1
#define FMT_F16 2
#define FMT_Q4 3
#define FMT_Q8 4
#define PARAM_BF16 0
#define PARAM_F32 1
#define NEG_INF (__int_as_float(0xff800000))

// ---------------------------------------------------------------- scalar conversions
__device__ __forceinline__ float bf16_to_f32(u32 bits16) { return __uint_as_float(bits16 << 16); }
__device__ __forceinline__ float bf16_lo(u32 pair) { return __uint_as_float(pair << 16); }
__device__ __forceinline__ float bf16_hi(u32 pair) { return __uint_as_float(pair & 0xffff0000u); }
// Round to nearest even, NaN kept quiet (the hardware's canonical 0x7fff; torch writes 0x7fc0), one
// conversion instruction. The integer form (x + 0x7fff + lsb, NaN tested first) rounds every other
// value to the same bits but cost ~6 instructions per value, which made the decode kernels' input
// staging a third of some kernels' instructions (Nsight Compute, docs/performance.md "Session 16");
// GPUs before sm_80 lack the instruction and keep the integer form.
__device__ __forceinline__ u16 f32_to_bf16(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)0x7fc0;
    x += 0x7fffu + ((x >> 16) & 1u);
    return (u16)(x >> 16);
#else
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
#endif
}
__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
// Round to nearest even, saturating: beyond f16's range an activation becomes ±65504, not ±inf
// (a product of it then stays finite); NaN stays NaN.
__device__ __forceinline__ u16 f32_to_f16(float f) {
    if (fabsf(f) > 65504.0f) f = copysignf(65504.0f, f);
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float f16_lo(u32 pair) { return f16_to_f32((u16)(pair & 0xffffu)); }
__device__ __forceinline__ float f16_hi(u32 pair) { return f16_to_f32((u16)(pair >> 16)); }

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

// ---------------------------------------------------------------- loads
// 16-byte read-only load (weights never change while a kernel runs).
__device__ __forceinline__ uint4 ld_nc_16(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}
__device__ __forceinline__ u32 ld_nc_u32(const void* p) {
    u32 v;
    asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ float2 ld_nc_f2(const void* p) {
    float2 v;
    asm volatile("ld.global.nc.v2.f32 {%0,%1}, [%2];" : "=f"(v.x), "=f"(v.y) : "l"(p));
    return v;
}

// ---------------------------------------------------------------- reductions
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// Sum over aligned groups of `width` lanes (a power of two ≤ 32); every lane gets its group's sum.
__device__ __forceinline__ float group_sum(float v, int width) {
    for (int o = width >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
// Block-wide sum; `scratch` holds ≥ 32 floats; every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < nwarps; ++w) total += scratch[w];
    return total;
}
// block_sum in two halves, for a caller whose own barrier comes between them, or whose scratch has
// not been used before (block_sum's first barrier only guards a scratch in use): post (each warp's
// sum into scratch[warp]; lane and warp are the thread's), a barrier, collect (the NW warps' sums
// added in warp order).
__device__ __forceinline__ void block_sum_post(float v, float* scratch, int lane, int warp) {
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
}
template <int NW>
__device__ __forceinline__ float block_sum_collect(const float* scratch) {
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < NW; ++w) total += scratch[w];
    return total;
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float m = NEG_INF;
    for (int w = 0; w < nwarps; ++w) m = fmaxf(m, scratch[w]);
    return m;
}

// ---------------------------------------------------------------- weight formats
// One format = how many weights 16 bytes of codes (`w`) hold (W), whether they are affine codes, and
// how they decode to f32 with their group's (scale, bias). The decode dot products are UnitDot below.
template <int FMT> struct Fmt;

template <> struct Fmt<FMT_F32> {
    static constexpr int W = 4;
    static constexpr bool AFFINE = false;
    __device__ static __forceinline__ void decode(uint4 w, float* out, float, float) {
        out[0] = __uint_as_float(w.x); out[1] = __uint_as_float(w.y);
        out[2] = __uint_as_float(w.z); out[3] = __uint_as_float(w.w);
    }
};

// bf16 and f16: two values per u32 word, low half first, unpacked by the format's converters.
template <int FMT> struct HalfPair;
template <> struct HalfPair<FMT_BF16> {
    __device__ static __forceinline__ float lo(u32 p) { return bf16_lo(p); }
    __device__ static __forceinline__ float hi(u32 p) { return bf16_hi(p); }
};
template <> struct HalfPair<FMT_F16> {
    __device__ static __forceinline__ float lo(u32 p) { return f16_lo(p); }
    __device__ static __forceinline__ float hi(u32 p) { return f16_hi(p); }
};
template <int FMT> struct FmtHalf {
    static constexpr int W = 8;
    static constexpr bool AFFINE = false;
    __device__ static __forceinline__ void decode(uint4 w, float* out, float, float) {
        typedef HalfPair<FMT> H;
        out[0] = H::lo(w.x); out[1] = H::hi(w.x); out[2] = H::lo(w.y); out[3] = H::hi(w.y);
        out[4] = H::lo(w.z); out[5] = H::hi(w.z); out[6] = H::lo(w.w); out[7] = H::hi(w.w);
    }
};
template <> struct Fmt<FMT_BF16> : FmtHalf<FMT_BF16> {};
template <> struct Fmt<FMT_F16> : FmtHalf<FMT_F16> {};

template <> struct Fmt<FMT_Q4> {
    static constexpr int W = 32;
    static constexpr bool AFFINE = true;
    __device__ static __forceinline__ void decode(uint4 w, float* out, float scale, float bias) {
        const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 8; ++j) out[i * 8 + j] = scale * (float)((words[i] >> (4 * j)) & 15u) + bias;
    }
};

template <> struct Fmt<FMT_Q8> {
    static constexpr int W = 16;
    static constexpr bool AFFINE = true;
    __device__ static __forceinline__ void decode(uint4 w, float* out, float scale, float bias) {
        const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) out[i * 4 + j] = scale * (float)((words[i] >> (8 * j)) & 255u) + bias;
    }
};

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
// tok/s, docs/performance.md "Session 3"); ld.global.cg (L2 only) measured no better than .nc.
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

// Programmatic dependent launch (graph.rs, CALLA_PDL): a kernel launched with it may start while
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
// groups' grid-sync pattern; a fence in every thread measured 0.4 µs slower per launch, session 9).
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

// ---------------------------------------------------------------- the token selection's results
// Shared by select.cu (every mode) and matvec_tc.cu (lm_head with plain greedy fused
// in); the Rust twins live in select.rs.
#define SEL_MAX_LOGPROBS 20

struct SelectConfig {
    float temperature, top_p, min_p, rep_penalty, presence, frequency;
    int top_k, n_logprobs;
    u32 seed_lo, seed_hi, step_lo, step_hi;
    int use_bias, use_seen, use_counts, pad;
};

struct SelectResult {
    int token;
    float logprob;
    int n_top;
    int sampled; // 1 when drawn, 0 when argmax
    int top_ids[SEL_MAX_LOGPROBS];
    float top_logprobs[SEL_MAX_LOGPROBS];
};

__device__ __forceinline__ float sanitise(float x) { return x != x ? NEG_INF : x; }

// Where a chosen token goes: the configuration (its draw step), the result and its host mirror
// ([2] SelectResult in mapped page-locked host memory, slot pos & 1, or 0), the cursor (advanced when
// `advance`), the penalty tables (counts [V] u32, seen [V] u8, used as the configuration says).
struct TokenOut {
    u64 config, result, result_host, cursor, counts, seen;
    int advance, pad;
};

// Thread 0, once the token is chosen: the SelectResult (res->n_top and the top lists already written)
// and its host mirror at slot pos & 1, the draw step, the penalty tables' count of the token, and the
// cursor's advance (token ← chosen, pos ← pos + 1).
__device__ __forceinline__ void publish_token(const TokenOut& o, const SelectConfig& c, int token, float logprob,
                                              int sampled, int pos) {
    SelectResult* res = (SelectResult*)o.result;
    res->token = token;
    res->logprob = logprob;
    res->sampled = sampled;
    SelectConfig* cfg = (SelectConfig*)o.config;
    const u64 step = (((u64)c.step_hi) << 32 | c.step_lo) + 1;
    cfg->step_lo = (u32)step;
    cfg->step_hi = (u32)(step >> 32);
    if (c.use_counts) ((u32*)o.counts)[token] += 1;
    if (c.use_seen) ((u8*)o.seen)[token] = 1;
    if (o.result_host) { // thread 0 wrote every field of res itself; pos: the cursor's, before the advance below
        SelectResult* h = (SelectResult*)o.result_host + (pos & 1);
        const int n_top = res->n_top;
        for (int k = 0; k < n_top; ++k) {
            h->top_ids[k] = res->top_ids[k];
            h->top_logprobs[k] = res->top_logprobs[k];
        }
        h->n_top = n_top;
        h->sampled = sampled;
        h->logprob = logprob;
        h->token = token;
    }
    if (o.advance) {
        Cursor* cur = (Cursor*)o.cursor;
        cur->token = token;
        cur->pos += 1;
    }
}

// Plain greedy's running state (T = 0 without bias, penalties or top logprobs: the argmax and the
// log-sum-exp of the raw logits): (max, Σ exp(raw − max)) and the best (value ↓, id ↑), merged in any
// order (the token is the same; the sum's rounding is the order's).
struct GreedyAcc {
    float m, s; // max raw, Σ exp(raw − m)
    float v;    // best value (NEG_INF with id INT_MAX: none)
    int i;
};
__device__ __forceinline__ GreedyAcc greedy_merge(GreedyAcc a, GreedyAcc b) {
    const float M = fmaxf(a.m, b.m);
    if (M > NEG_INF) a.s = (a.m > NEG_INF ? a.s * expf(a.m - M) : 0.0f) + (b.m > NEG_INF ? b.s * expf(b.m - M) : 0.0f);
    a.m = M;
    if (b.v > a.v || (b.v == a.v && b.i < a.i)) { a.v = b.v; a.i = b.i; }
    return a;
}
__device__ __forceinline__ GreedyAcc greedy_warp_merge(GreedyAcc a) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        a = greedy_merge(a, GreedyAcc{__shfl_xor_sync(0xffffffffu, a.m, o), __shfl_xor_sync(0xffffffffu, a.s, o),
                                      __shfl_xor_sync(0xffffffffu, a.v, o), __shfl_xor_sync(0xffffffffu, a.i, o)});
    return a;
}

// ---------------------------------------------------------------- decode launch parameters
// Shared by two kernel families each (the CUDA-core kernels and matvec_tc.cu); the Rust twins
// live in matvec.rs and moe.rs.
#define MAX_SEGMENTS 4
#define MOE_MAX_A 32

struct MatvecSegment {
    MatrixRef m;
    u64 out;
    int rows;
    int pad;
};

// matvec: y_seg (+)= W_seg·x̂ for up to 4 stacked segments that share the input
struct MatvecParams {
    u64 x;         // [K] f32
    u64 norm_gain; // [K] f32 or 0
    MatvecSegment seg[MAX_SEGMENTS];
    int K;
    int nseg;
    int group_size;
    float eps;
    int accumulate; // 1: y += W·x (residual add)
    int total_rows;
};

// Row `row` of the stacked segments: its segment and the row inside it.
__device__ __forceinline__ void matvec_locate(const MatvecParams& p, int row, int& seg, int& local) {
    int r = row, s = 0;
    while (s < p.nseg - 1 && r >= p.seg[s].rows) {
        r -= p.seg[s].rows;
        ++s;
    }
    seg = s;
    local = r;
}

// MoE gate/up: act[slot] = silu(gate·x̂)·(up·x̂) for the routed slots and the shared one
struct GateUpParams {
    u64 x;             // [D] x̂ (or h when norm_gain is set)
    u64 norm_gain;     // [D] or 0: normalise x in the prologue (dense MLP path)
    MatrixRef experts; // [E·2I, D]: expert e's gate rows at e·2I, up rows at e·2I + I
    MatrixRef shared;  // [2Is, D]: gate rows then up rows
    u64 topk_ids;      // [A]
    u64 act;           // out [slots, act_stride]
    int D, I, Is, A, group_size, act_stride, slot_offset;
    float eps;
};

// MoE down: h += Σ_slots w·down·act
struct DownParams {
    u64 act;           // [slots, act_stride]
    MatrixRef experts; // [E·D, I]: expert e's rows at e·D
    MatrixRef shared;  // [D, Is]
    u64 topk_ids, topk_w, shared_w;
    u64 h;             // [D] in/out
    int D, I, Is, A, group_size, act_stride, slot_begin, slot_end;
    u64 route_acc;     // or 0: the fused routing's accumulators (below), zeroed here for the next layer
    int route_acc_len; // i64 words
    int pad;
};

// ---------------------------------------------------------------- MoE routing (top-A of the router logits)
// Shared by moe.cu's ticket router (its last block selects) and matvec_tc.cu's gate/up (every block
// selects for itself, so the router needs no ticket).
#define MOE_MAX_E 1024
#define ROUTE_MAX_CAND (MOE_MAX_E / 32 * MOE_MAX_A) // candidates of select_top's second round

// Where a selection goes.
struct RouteParams {
    u64 logits;   // [E + 1]: the router logits, then the shared-expert gate's (with shared_gate);
                  // with `fixed`, the fused routing's accumulators (below)
    u64 topk_ids; // out [A] i32
    u64 topk_w;   // out [A] f32
    u64 shared_w; // out [1] f32: sigmoid(shared gate logit), 1 without a gate
    int E, A, norm_topk, shared_gate;
    int fixed;    // 1: logits are the accumulators, normalised by their Σh² (D, eps)
    int D;
    float eps;
    int pad;
};

// ---------------------------------------------------------------- fused routing (the router in the out-projection)
// The router's logits are linear in the residual h apart from the norm's scalar:
//   logit_e = router_e·x̂ = inv · Σ_k router[e, k]·gain_k·h_k,   inv = 1/√(Σh²/D + eps)
// so each block of the out-projection that finishes rows [16t, 16t + 16) of h adds its columns' share
// of every router row (and of the shared-expert gate row, and of Σh²) into accumulators, and the
// router needs no launch of its own: the gate/up kernel reads the sums and scales them by inv
// (docs/performance.md, session 8). The sums are integers (fixed point: logits·2^32, Σh²·2^20) so
// that they are exact and independent of the order the blocks arrive in — the same logits every
// run, ties included. Tile t adds into copy t % ROUTE_COPIES (fewer atomics per address).
//   acc: i64 [ROUTE_COPIES][route_acc_stride(E)]: [0, E) logits, E the shared-expert gate, E + 1 Σh².
#define ROUTE_COPIES 4 // the buffers hold 4; 1, 2 and 8 measured no better
#define ROUTE_LOGIT_UNIT 4294967296.0f // 2^32
#define ROUTE_SQ_UNIT 1048576.0f       // 2^20
__device__ __forceinline__ int route_acc_stride(int E) { return (E + 2 + 15) & ~15; }
// A NaN share converts to 0 (cvt.rni.s64.f32), where the float router's NaN logit would rank last;
// a NaN residual has broken the step either way.
__device__ __forceinline__ void route_acc_add(i64* at, float v, float unit) {
    atomicAdd((unsigned long long*)at, (unsigned long long)__float2ll_rn(v * unit)); // a red: result unused
}
__device__ __forceinline__ i64 route_acc_sum(const i64* acc, int stride, int i) {
    i64 s = 0;
#pragma unroll
    for (int c = 0; c < ROUTE_COPIES; ++c) {
        i64 v;
        asm volatile("ld.global.cg.s64 %0, [%1];" : "=l"(v) : "l"(acc + c * stride + i));
        s += v;
    }
    return s;
}
// The accumulators back to zero once their layer's gate/up has read them (the MoE down kernel, one
// block; the next writer is the next layer's out-projection).
__device__ __forceinline__ void route_acc_clear(const DownParams& p) {
    if (p.route_acc && blockIdx.x == gridDim.x - 1)
        for (int i = threadIdx.x; i < p.route_acc_len; i += blockDim.x) ((i64*)p.route_acc)[i] = 0;
}

// Top-A of the router logits sl[0, E) (shared memory, 16-byte aligned, E ≤ MOE_MAX_E, A ≤ MOE_MAX_A)
// with all of a block's threads, by ranks: a logit's rank is how many logits beat it (ties: the lower
// id wins); ranks < A are the top-A in order. NaN logits become −∞ (never selected while A finite
// logits exist); sl is padded with −∞ to a multiple of 32 (ids ≥ E lose every tie).
// Two rounds, so no thread compares against all E logits: each segment of 32 keeps its local top
// min(A, 32) as candidates (a top-A logit is beaten by fewer than A logits anywhere, so within its
// segment too), then a candidate's rank among the candidates is its rank among all E (every logit
// that beats a top-A logit is itself top-A, so a candidate). The second round gives each candidate 4
// threads, a quarter of the candidates each, summed by shuffles. At E 256, A 8: 32 + 16 compares per
// thread, where one round of ranks over all E took 256 (~2 µs of the router's 9, docs/performance.md).
// cand: shared [SEL_CAND_LEN] keys (sel_key), 16-byte aligned. Ends with a barrier.
//   sel_id[k], sel_l[k] = the k-th expert and its logit.
// Thread t reads and writes only the logits e ≡ t (mod blockDim) before the first round, so a segment
// of 32 is a warp's own (blockDim % 32 == 0): the first round needs no block barrier (session 12).
// Hooks for a caller's own work between the barriers (gate/up stages x̂ there, so that its products
// need no barriers of their own): `pre` runs in every thread before the candidates' barrier (what it
// writes to shared memory is published by it), `mid` after it, before the last barrier.
// The second round compares (logit, id) keys: 4 instructions per compare where the float compare
// with the id's tie-break took 6 (Nsight Compute, session 17). The first round keeps its float compares
// with the lane's tie-break: counting by compare masks with the ties from one warp match was slower
// (gate/up +0.5 µs per launch, measured; that MATCH.ANY is the slow part is our reading).
#define SEL_CAND_LEN (ROUTE_MAX_CAND + 8)
// A (logit, id) as one u64 that orders as the ranks do: the larger logit first, then the lower id. The
// float's bits made monotone (non-negative: sign bit set; negative: every bit flipped); select_top
// makes −0 into +0 and NaN into −∞ first, so equal keys are equal logits and ids.
__device__ __forceinline__ u64 sel_key(float v, int id) {
    const u32 b = __float_as_uint(v);
    return ((u64)(b ^ ((u32)((int)b >> 31) | 0x80000000u)) << 32) | (u32)~id;
}
__device__ __forceinline__ float sel_key_logit(u64 k) {
    const u32 ord = (u32)(k >> 32);
    return __uint_as_float(ord & 0x80000000u ? ord ^ 0x80000000u : ~ord);
}
__device__ __forceinline__ int sel_key_id(u64 k) { return (int)~(u32)k; }
struct NoHook {
    __device__ void operator()() const {}
};
// NT: the block's threads as a compile-time constant (0: blockDim.x); with E and A constants at the
// call site too (a specialised gate/up kernel) the loops below have fixed trip counts.
template <int NT = 0, typename Pre = NoHook, typename Mid = NoHook>
__device__ __forceinline__ void select_top(float* sl, int E, int A, u64* cand, int* sel_id, float* sel_l,
                                           const Pre& pre = Pre{}, const Mid& mid = Mid{}) {
    const int nthreads = NT ? NT : blockDim.x;
    const int Es = (E + 31) & ~31, keep = min(A, 32);
    for (int e = threadIdx.x; e < Es; e += nthreads) {
        const float v = e < E ? sl[e] : NEG_INF;
        sl[e] = v == v ? v + 0.0f : NEG_INF; // + 0: −0 becomes +0, so equal logits have equal keys
    }
    const int C = (Es >> 5) * keep, C8 = (C + 7) & ~7; // candidates, padded to a multiple of 8
    const u64 nobody = sel_key(NEG_INF, 0x7fffffff);   // beats no one (ids ≥ 0 win its ties)
    if (threadIdx.x < C8 - C) cand[C + threadIdx.x] = nobody;
    __syncwarp();
    for (int e = threadIdx.x; e < Es; e += nthreads) { // a warp takes whole segments (blockDim % 32 == 0)
        const float v = sl[e];
        const float4* seg = (const float4*)(sl + (e & ~31));
        const int i = e & 31;
        int r0 = 0, r1 = 0, r2 = 0, r3 = 0;
#pragma unroll
        for (int o4 = 0; o4 < 8; ++o4) {
            const float4 w = seg[o4];
            const int o = 4 * o4;
            r0 += (w.x > v) | ((w.x == v) & (o < i));
            r1 += (w.y > v) | ((w.y == v) & (o + 1 < i));
            r2 += (w.z > v) | ((w.z == v) & (o + 2 < i));
            r3 += (w.w > v) | ((w.w == v) & (o + 3 < i));
        }
        const int r = r0 + r1 + r2 + r3;
        if (r < keep) cand[(e >> 5) * keep + r] = sel_key(v, e);
    }
    pre();
    __syncthreads();
    mid();
    const int quarter = C8 / 4; // even: two candidates per 16-byte load
    for (int c0 = 0; c0 < C; c0 += nthreads / 4) { // uniform: every lane reaches the shuffles
        const int c = c0 + threadIdx.x / 4, part = threadIdx.x & 3;
        const u64 me = c < C ? cand[c] : nobody;
        const ulonglong2* q = (const ulonglong2*)(cand + part * quarter);
        int r0 = 0, r1 = 0;
#pragma unroll 4
        for (int o = 0; o < quarter / 2; ++o) {
            const ulonglong2 w = q[o];
            r0 += w.x > me;
            r1 += w.y > me;
        }
        int rank = r0 + r1;
        rank += __shfl_xor_sync(0xffffffffu, rank, 1);
        rank += __shfl_xor_sync(0xffffffffu, rank, 2);
        if (part == 0 && c < C && rank < A) {
            sel_id[rank] = sel_key_id(me);
            sel_l[rank] = sel_key_logit(me);
        }
    }
    __syncthreads();
}

// The router logits (written by an earlier kernel, or by other blocks before a ticket: read through
// L2) into sl [E], and the shared-expert gate's logit (thread 0's return value; requested with the
// others rather than after the selection). No barrier.
// FE, NT: E and the block's threads as compile-time constants, or 0 (r.E, blockDim.x).
template <int FE = 0, int NT = 0>
__device__ __forceinline__ float route_load_logits(const RouteParams& r, float* sl) {
    const int E = FE ? FE : r.E, nthreads = NT ? NT : blockDim.x;
    if (r.fixed) { // the fused routing's sums: every logit scaled by the norm's inv (from Σh²)
        const i64* acc = (const i64*)r.logits;
        const int stride = route_acc_stride(E);
        // The thread's first logit, the gate's (thread 0) and Σh² requested together: one L2 round
        // trip (the code had Σh²'s loads, then inv, then the logits' loads: two; gate/up 10.9 → 10.5
        // µs, session 9). More logits per thread than one (E > blockDim) follow in a loop.
        const int e0 = threadIdx.x;
        const i64 first = e0 < E ? route_acc_sum(acc, stride, e0) : 0;
        const i64 gate = r.shared_gate && threadIdx.x == 0 ? route_acc_sum(acc, stride, E) : 0;
        const float ss = __ll2float_rn(route_acc_sum(acc, stride, E + 1)) * (1.0f / ROUTE_SQ_UNIT);
        const float inv = 1.0f / sqrtf(ss / (float)r.D + r.eps);
        if (e0 < E) sl[e0] = __ll2float_rn(first) * (1.0f / ROUTE_LOGIT_UNIT) * inv;
        for (int e = e0 + nthreads; e < E; e += nthreads)
            sl[e] = __ll2float_rn(route_acc_sum(acc, stride, e)) * (1.0f / ROUTE_LOGIT_UNIT) * inv;
        return r.shared_gate && threadIdx.x == 0 ? __ll2float_rn(gate) * (1.0f / ROUTE_LOGIT_UNIT) * inv : 0.0f;
    }
    const volatile float* logits = (const volatile float*)r.logits;
    for (int e = threadIdx.x; e < E; e += nthreads) sl[e] = logits[e];
    return r.shared_gate && threadIdx.x == 0 ? logits[E] : 0.0f;
}

// Top-A and combine weights from the logits in shared memory sl (select_top's input; the gate logit
// in thread 0) into sel_id / sel_p, and with `publish` (warp 0) into topk_ids / topk_w / shared_w for
// the down kernel. cand: shared [SEL_CAND_LEN], 16-byte aligned. Ends with a barrier, or with TAIL_SYNC
// false (sel_p is then warp 0's until the caller's next barrier; sel_id is published) with none.
//   norm_topk: w_k = p_k / Σ_sel p = exp(l_k − l_top) / Σ_sel exp(l_j − l_top): the softmax's
//   normaliser cancels, so beyond the ranks only the A selected logits are needed (one warp). Before,
//   a block max, a block sum of E exponentials and a serial renormalisation took ~1.5 µs of the
//   router's 3.4 µs of selection (measured by removing the selection, docs/performance.md).
//   otherwise: w_k = p_k = exp(l_k − max) / Σ_e exp(l_e − max) over all E; max = the top logit.
// FE, FA, NT: E, A and the block's threads as compile-time constants, or 0 (r.E, r.A, blockDim.x).
template <bool TAIL_SYNC = true, int FE = 0, int FA = 0, int NT = 0, typename Pre = NoHook, typename Mid = NoHook>
__device__ __forceinline__ void route_select(const RouteParams& r, float* sl, float gate_logit, int* sel_id,
                                             float* sel_p, float* red, u64* cand, bool publish,
                                             const Pre& pre = Pre{}, const Mid& mid = Mid{}) {
    const int E = FE ? FE : r.E, A = FA ? FA : r.A, nthreads = NT ? NT : blockDim.x;
    select_top<NT>(sl, E, A, cand, sel_id, sel_p, pre, mid); // sel_p holds the selected logits for now
    if (r.norm_topk) {
        if (threadIdx.x < 32) { // A ≤ MOE_MAX_A = 32: one lane per selected expert
            const int k = threadIdx.x;
            const float w = k < A ? expf(sel_p[k] - sel_p[0]) : 0.0f;
            const float sum = warp_sum(w);
            if (k < A) sel_p[k] = w / sum;
        }
    } else {
        const float mx = sel_p[0]; // the top logit
        float z = 0.0f;
        for (int e = threadIdx.x; e < E; e += nthreads) z += expf(sl[e] - mx); // NaN: −∞ by now
        z = block_sum(z, red);
        if (threadIdx.x < A) sel_p[threadIdx.x] = expf(sel_p[threadIdx.x] - mx) / z;
    }
    __syncwarp();
    if (publish && threadIdx.x < 32) {
        for (int k = threadIdx.x; k < A; k += 32) {
            ((int*)r.topk_ids)[k] = sel_id[k];
            ((float*)r.topk_w)[k] = sel_p[k];
        }
        if (threadIdx.x == 0) *(float*)r.shared_w = r.shared_gate ? sigmoid_f(gate_logit) : 1.0f;
    }
    if (TAIL_SYNC) __syncthreads();
}

// Layouts shared with the Rust launchers (tests/layouts.rs checks the same sizes).
static_assert(sizeof(MatrixRef) == 32, "MatrixRef layout differs from its Rust twin");
static_assert(sizeof(RouteParams) == 64, "RouteParams layout differs from its Rust twin");
static_assert(sizeof(Cursor) == 16, "Cursor layout differs from its Rust twin");
static_assert(sizeof(SelectConfig) == 64, "SelectConfig layout differs from its Rust twin");
static_assert(sizeof(SelectResult) == 176, "SelectResult layout differs from its Rust twin");
