// matvec.cu: y = W·x for one activation vector (decode), with an optional fused zero-centred RMSNorm
// prologue and an optional accumulate epilogue (residual add).
//
// Math (CPU reference: calla_cpu::linear::Linear::matvec, calla_cpu::norm::rms_norm_zero_centred):
//   x̂ = x · (1/√(mean(x²) + eps)) · gain        if norm_gain (gain = 1 + w, precomputed at load)
//   y_seg[r] (+)= Σ_c W_seg[r, c] · x̂[c]          for each of up to 4 segments (stacked projections
//                                                  that share the input, each with its own output)
// Shapes: x [K] f32; W_seg [rows_seg, K] in one format (common.cuh); y_seg [rows_seg] f32.
// Launch: grid ≤ the blocks that fit on the GPU at once (grid-stride over rows, so the x prologue
//   runs once per block), block 256, dynamic smem (xpad_len(K) + K/W)·4 bytes (x̂ in the padded layout
//   of common.cuh, then Σx̂ per unit).
//   `width` = lanes per row = lanes_per_row(K / W): 32 for K ≥ 1024 in q4, so a warp reads a row as
//   16-byte loads, 512 contiguous bytes per instruction. Each lane group takes R consecutive rows and
//   keeps R·U loads in flight (rows_dot); R rows share every x̂ read from shared memory.
//   Two shapes: _r4 (R 4, U 2: K/W ≤ 2·width, the in-projections) and _r2 (R 2, U 4: longer rows).
// Why not one row per warp: at K = 2048 a warp's row is 2 loads per lane, so the block's prologue
// (x̂ from L2, norm, barriers) outweighed its weight traffic and the kernel ran at ~15% of the copy
// bandwidth (docs/performance.md).
// Bytes per call: Σ_seg rows·K·bits/8 (+ group params) of weights, K·4 of x per block (from L2).

#define MATVEC_THREADS 256
// MatvecParams (the launch parameters, shared with matvec_tc.cu): common.cuh.

// How many passes ahead a block asks L2 for its rows (0 = none).
#define MATVEC_PREFETCH_PASSES 1

// L2 prefetch of rows [first, first + n) of the stacked segments.
__device__ __forceinline__ void matvec_prefetch_pass(const MatvecParams& p, int first, int n) {
    int start = 0;
    for (int s = 0; s < p.nseg; ++s) {
        const int lo = max(first, start), hi = min(first + n, start + p.seg[s].rows);
        if (lo < hi) prefetch_rows(p.seg[s].m, lo - start, hi - lo);
        start += p.seg[s].rows;
    }
}

// The rows of every segment, grid-strided over the blocks, from x̂ (padded) and its unit sums in
// shared memory (staged by the caller).
template <int FMT, int R, int U>
__device__ __forceinline__ void matvec_rows(const MatvecParams& p, const float* xs, const float* usum) {
    typedef Fmt<FMT> F;
    const int units = p.K / F::W;
    const int width = lanes_per_row(units);
    const int rows_per_pass = blockDim.x / width * R;
    const int group = threadIdx.x / width, lane = threadIdx.x % width;
    const int units_per_group = F::AFFINE ? p.group_size / F::W : 1;
    // Every thread runs the same number of passes so the shuffles in group_sum see full warps.
    for (int base = blockIdx.x * rows_per_pass; base < p.total_rows; base += gridDim.x * rows_per_pass) {
        // Each pass asks L2 for the block's rows MATVEC_PREFETCH_PASSES passes ahead (the in-projection's
        // second pass, the lm_head's ~30). Not the first pass's own rows: measured, prefetching rows that
        // are loaded right after cost more than it saved (+1.7 µs per in-projection, docs/performance.md).
        if (MATVEC_PREFETCH_PASSES > 0)
            matvec_prefetch_pass(p, base + MATVEC_PREFETCH_PASSES * gridDim.x * rows_per_pass, rows_per_pass);
        RowPtr rows[R];
        int seg_of[R], local[R];
#pragma unroll
        for (int i = 0; i < R; ++i) {
            // past the end: re-read the last row
            matvec_locate(p, min(base + group * R + i, p.total_rows - 1), seg_of[i], local[i]);
            rows[i] = row_ptr(p.seg[seg_of[i]].m, local[i]);
        }
        float acc[R];
#pragma unroll
        for (int i = 0; i < R; ++i) acc[i] = 0.0f;
        rows_dot<FMT, R, U>(rows, xs, usum, units, lane, width, units_per_group, acc);
#pragma unroll
        for (int i = 0; i < R; ++i) {
            const float v = group_sum(acc[i], width);
            if (lane == 0 && base + group * R + i < p.total_rows) {
                float* y = (float*)p.seg[seg_of[i]].out;
                y[local[i]] = p.accumulate ? ldcg_f32(y + local[i]) + v : v;
            }
        }
    }
}

template <int FMT, int R, int U>
__device__ __forceinline__ void matvec_body(const MatvecParams& p) {
    typedef Fmt<FMT> F;
    extern __shared__ float4 smem4[];
    float* xs = (float*)smem4;
    float* usum = xs + xpad_len(p.K);
    __shared__ float red[32];
    griddep_enter();
    stage_input<F::AFFINE ? F::W : 0>((const float*)p.x, (const float*)p.norm_gain, p.eps, p.K, xs, usum, red);
    matvec_rows<FMT, R, U>(p, xs, usum);
}

// The explicit minimum of 1 block per SM on _r4 is what the measured and parity-checked code was
// compiled with; ptxas allocates registers differently without it (scripts/kernel-diff.py).
#define MATVEC_KERNEL(name, FMT) \
    extern "C" __global__ void __launch_bounds__(MATVEC_THREADS, 1) name##_r4(const MatvecParams p) { matvec_body<FMT, 4, 2>(p); } \
    extern "C" __global__ void __launch_bounds__(MATVEC_THREADS) name##_r2(const MatvecParams p) { matvec_body<FMT, 2, 4>(p); }
MATVEC_KERNEL(matvec_f32, FMT_F32)
MATVEC_KERNEL(matvec_bf16, FMT_BF16)
MATVEC_KERNEL(matvec_f16, FMT_F16)
MATVEC_KERNEL(matvec_q4, FMT_Q4)
MATVEC_KERNEL(matvec_q8, FMT_Q8)

// ---------------------------------------------------------------- embedding gather
// h[c] = E[token, c] (dequantised), token = cursor.token. grid 1, block 256.
struct EmbedParams {
    MatrixRef m;
    u64 cursor; // Cursor*
    u64 out;    // [D] f32
    int D;
    int group_size;
    int rows; // V, to clamp a bad token id instead of reading out of bounds
    int pad;
};

template <int FMT>
__device__ __forceinline__ void embed_body(const EmbedParams& p) {
    int token = ((const Cursor*)p.cursor)->token;
    token = token < 0 ? 0 : (token >= p.rows ? p.rows - 1 : token);
    dequant_row<FMT>(p.m, token, p.D, p.group_size, (float*)p.out);
}

#define EMBED_KERNEL(name, FMT) \
    extern "C" __global__ void __launch_bounds__(256) name(const EmbedParams p) { embed_body<FMT>(p); }
EMBED_KERNEL(embed_f32, FMT_F32)
EMBED_KERNEL(embed_bf16, FMT_BF16)
EMBED_KERNEL(embed_f16, FMT_F16)
EMBED_KERNEL(embed_q4, FMT_Q4)
EMBED_KERNEL(embed_q8, FMT_Q8)

// Layouts shared with the Rust launchers (tests/layouts.rs checks the same sizes).
static_assert(sizeof(MatvecParams) == 232, "MatvecParams layout differs from its Rust twin");
static_assert(sizeof(EmbedParams) == 64, "EmbedParams layout differs from its Rust twin");
