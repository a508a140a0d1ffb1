// matvec.cu: y = W·x for one activation vector (decode), with an optional fused zero-centred RMSNorm
// prologue and an optional accumulate epilogue (residual add).
//
// Math (CPU reference: calla_cpu::linear::Linear::matvec, calla_cpu::norm::rms_norm_zero_centred):
//   x̂ = x · (1/√(mean(x²) + eps)) · gain        if norm_gain (gain = 1 + w, precomputed at load)
//   y_seg[r] (+)= Σ_c W_seg[r, c] · x̂[c]          for each of up to 4 segments (stacked projections
//                                                  that share the input, each with its own output)
// Shapes: x [K] f32; W_seg [rows_seg, K] in one format (common.cuh); y_seg [rows_seg] f32.
// Launch: grid ≤ rows/(256/width) blocks (grid-stride over rows), block 256, dynamic smem
//   xpad_len(K)·4 bytes (x in the padded layout of common.cuh).
//   `width` = lanes per row = lanes_per_row(K / weights-per-unit): 32 for K ≥ 1024 in q4, so a warp
//   reads one row as 16-byte loads, 512 contiguous bytes per instruction.
// Bytes per call: Σ_seg rows·K·bits/8 (+ group params) of weights, K·4 of x per block (from L2).

#define MATVEC_THREADS 256
#define MAX_SEGMENTS 4

struct MatvecSegment {
    MatrixRef m;
    u64 out;
    int rows;
    int pad;
};

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

template <int FMT>
__device__ __forceinline__ void matvec_body(const MatvecParams& p) {
    extern __shared__ float xs[];
    __shared__ float red[32];
    griddep_launch_dependents();
    griddep_wait();
    load_input((const float*)p.x, (const float*)p.norm_gain, p.eps, p.K, xs, red);

    const int width = lanes_per_row(p.K / Fmt<FMT>::W);
    const int rows_per_pass = blockDim.x / width;
    const int group = threadIdx.x / width, lane = threadIdx.x % width;
    // Every thread runs the same number of passes so the shuffles in group_sum see full warps.
    for (int base = blockIdx.x * rows_per_pass; base < p.total_rows; base += gridDim.x * rows_per_pass) {
        const int row = base + group;
        const bool valid = row < p.total_rows;
        int s = 0, r = row;
        while (s < p.nseg - 1 && r >= p.seg[s].rows) {
            r -= p.seg[s].rows;
            ++s;
        }
        float acc = valid ? row_dot_partial<FMT>(p.seg[s].m, r, xs, p.K, lane, width, p.group_size) : 0.0f;
        acc = group_sum(acc, width);
        if (valid && lane == 0) {
            float* y = (float*)p.seg[s].out;
            y[r] = p.accumulate ? y[r] + acc : acc;
        }
    }
}

#define MATVEC_KERNEL(name, FMT) \
    extern "C" __global__ void __launch_bounds__(MATVEC_THREADS) name(const MatvecParams p) { matvec_body<FMT>(p); }
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
    typedef Fmt<FMT> F;
    int token = ((const Cursor*)p.cursor)->token;
    token = token < 0 ? 0 : (token >= p.rows ? p.rows - 1 : token);
    const u8* row = (const u8*)p.m.data + (i64)token * p.m.row_bytes;
    float* out = (float*)p.out;
    float vals[F::W];
    for (int u = threadIdx.x; u < p.D / F::W; u += blockDim.x) {
        const uint4 w = ld_nc_16(row + (i64)u * 16);
        float scale = 1.0f, bias = 0.0f;
        if (F::AFFINE) {
            const float2 g = load_group_params(p.m, token, (u * F::W) / p.group_size);
            scale = g.x;
            bias = g.y;
        }
        F::decode(w, vals, scale, bias);
#pragma unroll
        for (int j = 0; j < F::W; ++j) out[u * F::W + j] = vals[j];
    }
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
