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
// staging a third of some kernels' instructions (Nsight Compute, docs/experiments.md);
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
