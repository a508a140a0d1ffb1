// gemm.cu: Y = X·Wᵀ for prompts (T tokens at once) on the tensor cores, with W in any engine
// format dequantised tile by tile into shared memory; plus the row kernels that feed it (RMSNorm →
// bf16 planes, embedding rows).
//
// Math (CPU reference: calla_cpu::linear::Linear::matmul):  Y[m, n] = Σ_k X[m, k] · W[n, k]
//   X arrives as bf16 "planes": hi = bf16(x), lo = bf16(x − hi) (lo only in split precision).
//   W [N, K] in FMT (common.cuh), dequantised w = scale·q + bias in f32, then split the same way.
//   precision "fast":  Y ≈ Σ hi(x)·hi(w)                         (bf16 products, f32 accumulate)
//   precision "split": Y ≈ Σ hi·hi + lo(x)·hi(w) + hi(x)·lo(w)   (~f32 accuracy; 3 mma per step;
//                       bf16 weights are exact in hi, so their lo term is skipped)
// Epilogues (one per launch): store f32 · accumulate f32 (residual add) · bf16 planes (the next
// GEMM's input); optional per-row scale (sigmoid shared-expert gate); optional SwiGLU, where the
// tile's W rows alternate gate row j / up row N/2 + j so each thread holds (gate_j, up_j) in
// (c0, c1) and writes silu(gate)·up to output column j (N/2 output columns).
// Row gather (a_rows): output row m reads X row a_rows[m] (MoE: tokens sorted by expert).
// Grouped (tile_map): blockIdx.y indexes device-built tiles {expert, m0, m1}: rows [m0, min(m0+BM,
//   m1)) against W rows expert·expert_rows + n — all experts in one launch, no host round trip.
//
// Shapes: X [rows, lda] bf16 planes; W [N (per expert), K], K % 64 == 0; Y [M, ldo].
// Launch: grid (⌈N/128⌉, ⌈M/128⌉ or max tiles), block 256 (8 warps as 2 (M) × 4 (N), warp tile
//   64×32 = 4×4 mma tiles), dynamic smem 2 stages × planes × 16 KiB (64 KiB fast, 128 KiB split);
//   two blocks per SM for fast q4/q8/bf16 (≤ 128 registers), one otherwise.
//   Per k-tile of 64: A by cp.async (zero-filled past the end), B by 16-byte register loads issued
//   before the current tile's mma and dequantised into the other stage after them.
// FLOPs 2·M·N·K (×3 split). Bytes: W once per M-tile (L2 serves repeats), X once per N-tile.

#define GEMM_BM 128
#define GEMM_BN 128
#define GEMM_BK 64
#define GEMM_THREADS 256
#define GEMM_TILE_BYTES (GEMM_BM * GEMM_BK * 2) // one plane of one stage: 128 rows × 128 bytes

#define GEMM_OUT_F32 0
#define GEMM_OUT_F32_ACC 1
#define GEMM_OUT_BF16 2
#define GEMM_OUT_F16 3 // one f16 plane (the input of a Half-precision GEMM)

struct GemmParams {
    u64 a_hi;       // bf16 [rows, lda]
    u64 a_lo;       // bf16 [rows, lda], split precision only
    u64 a_rows;     // i32 [M] gather, or 0
    MatrixRef w;    // [N (· experts), K]
    u64 out;        // f32 [M, ldo], or the bf16 hi plane
    u64 out_lo;     // bf16 lo plane or 0
    u64 row_scale;  // f32 [M] or 0
    u64 tile_map;   // grouped: int4 {expert, m0, m1, 0} per tile, or 0
    u64 tile_count; // grouped: i32 number of valid tiles
    i64 expert_rows;// grouped: W rows per expert
    int M, N, K, lda, ldo, group_size, mode, swiglu;
};

// Tile byte offset of (row r, 16-byte chunk c) with the XOR swizzle.
__device__ __forceinline__ u32 gemm_swz(int r, int c) { return (u32)(r * 128 + ((c ^ (r & 7)) << 4)); }

// W row of tile row r in the N tile at n0 (rows of expert w_base; gate/up interleaved under SwiGLU:
// tile row 2j is gate row j, 2j + 1 up row n_out + j), −1 past the end.
__device__ __forceinline__ i64 gemm_w_row(const GemmParams& p, int n0, int n_out, i64 w_base, int r) {
    if (p.swiglu) {
        const int j = n0 / 2 + r / 2;
        return j < n_out ? w_base + ((r & 1) ? n_out + j : j) : -1;
    }
    return n0 + r < p.N ? w_base + n0 + r : -1;
}

// Codes 2e and 2e + 1 of a q4 word (low nibble first) as a bf16 pair, exactly: the bits 0x4300 | q
// are 128 + q, minus 128 is q.
__device__ __forceinline__ u32 q4_code_pair_bf16(u32 word, int e) {
    const u32 pr = ((word >> (8 * e)) & 0xFu) | (((word >> (8 * e + 4)) & 0xFu) << 16) | 0x43004300u;
    return cvt_bf16x2(__uint_as_float(pr << 16) - 128.0f, __uint_as_float(pr & 0xffff0000u) - 128.0f);
}

// Store one accumulator fragment: c0, c1 = (row ma, columns col, col + 1), c2, c3 = (row ma + 8,
// same columns), through the launch's epilogue (row scale, SwiGLU pair, f32 / f32 += / planes).
// A persistent kernel's tile (M rows m0..m_end of W rows from w_base, N columns from n0), tile t of
// the (M tile, N tile) space, N fastest; grouped GEMMs take their M tiles from the device-built map.
// (w_base is left as it was for ungrouped GEMMs: 0.)
__device__ __forceinline__ int gemm_m_tiles(const GemmParams& p) {
    return p.tile_map ? *(const int*)p.tile_count : (p.M + GEMM_BM - 1) / GEMM_BM;
}
__device__ __forceinline__ void gemm_locate(const GemmParams& p, int n_tiles, int bn, int t, int& m0, int& m_end,
                                            int& n0, i64& w_base) {
    const int mt = t / n_tiles;
    n0 = (t - mt * n_tiles) * bn;
    if (p.tile_map) {
        const int4 e = ((const int4*)p.tile_map)[mt];
        m0 = e.y;
        m_end = min(e.z, e.y + GEMM_BM);
        w_base = (i64)e.x * p.expert_rows;
    } else {
        m0 = mt * GEMM_BM;
        m_end = min(p.M, m0 + GEMM_BM);
    }
}

// One output value through the launch's epilogue, for an output mode known at compile time.
template <int MODE>
__device__ __forceinline__ void gemm_store(const GemmParams& p, int m, int n, float v) {
    const i64 idx = (i64)m * p.ldo + n;
    if (MODE == GEMM_OUT_F32 || MODE == GEMM_OUT_F32_ACC) ((float*)p.out)[idx] = v;
    else if (MODE == GEMM_OUT_F16) ((u16*)p.out)[idx] = f32_to_f16(v);
    else store_planes((u16*)p.out, (u16*)p.out_lo, idx, v);
}

// One output value through the launch's epilogue: row scale, then f32 / f32 += / bf16 planes / f16.
__device__ __forceinline__ void gemm_emit(const GemmParams& p, int m, int n, float v) {
    if (p.row_scale) v *= ((const float*)p.row_scale)[m];
    const i64 idx = (i64)m * p.ldo + n;
    if (p.mode == GEMM_OUT_F32) ((float*)p.out)[idx] = v;
    else if (p.mode == GEMM_OUT_F32_ACC) ((float*)p.out)[idx] += v;
    else if (p.mode == GEMM_OUT_F16) ((u16*)p.out)[idx] = f32_to_f16(v);
    else store_planes((u16*)p.out, (u16*)p.out_lo, idx, v);
}

__device__ __forceinline__ void gemm_store_frag(const GemmParams& p, int ma, int m_end, int col, int n_out, const float* c) {
    auto emit = [&](int m, int n, float v) { gemm_emit(p, m, n, v); };
    const int mb = ma + 8;
    if (p.swiglu) {
        const int jo = col >> 1; // (gate, up) of output column jo sit in (c0, c1)
        if (jo < n_out) {
            if (ma < m_end) emit(ma, jo, silu_f(c[0]) * c[1]);
            if (mb < m_end) emit(mb, jo, silu_f(c[2]) * c[3]);
        }
    } else {
        if (ma < m_end) {
            if (col < p.N) emit(ma, col, c[0]);
            if (col + 1 < p.N) emit(ma, col + 1, c[1]);
        }
        if (mb < m_end) {
            if (col < p.N) emit(mb, col, c[2]);
            if (col + 1 < p.N) emit(mb, col + 1, c[3]);
        }
    }
}

// XQ (q4, split, group size 64 = BK: one group per k-tile and W row): exact weights. The tile holds
// the codes q (exact in bf16); per k-tile T = hi(x)·q + lo(x)·q and Σx (one mma of each plane
// against a column of ones) are folded as acc += s·T + b·Σx with the tile's (scale, bias) per
// output column: 2 products of exact operands instead of 3 of split ones, and no per-weight
// dequantise-and-split.
template <int FMT, int SPLIT, int XQ>
__device__ __forceinline__ void gemm_body(const GemmParams& p) {
    typedef Fmt<FMT> F;
    constexpr int UPR = GEMM_BK / F::W;               // 16-byte weight units per tile row
    constexpr int UPT = GEMM_BN * UPR / GEMM_THREADS; // units per thread per k-tile
    static_assert(!XQ || (FMT == FMT_Q4 && SPLIT), "XQ: q4 split only");
    constexpr bool B_LO = SPLIT && FMT != FMT_BF16 && !XQ;
    constexpr int PLANES = 2 + (SPLIT ? 1 : 0) + (B_LO ? 1 : 0);
    extern __shared__ __align__(128) u8 smem[];
    // stage s, plane: A_hi, A_lo?, B_hi, B_lo?
    const u32 sbase = smem_addr(smem);
    auto plane = [&](int stage, int which) -> u32 { return sbase + (u32)((stage * PLANES + which) * GEMM_TILE_BYTES); };
    constexpr int P_AHI = 0, P_ALO = 1, P_BHI = SPLIT ? 2 : 1, P_BLO = P_BHI + 1;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 2, wn = warp & 3;

    int m0, m_end;
    i64 w_base = 0;
    if (p.tile_map) {
        if ((int)blockIdx.y >= *(const int*)p.tile_count) return;
        const int4 t = ((const int4*)p.tile_map)[blockIdx.y];
        m0 = t.y;
        m_end = min(t.z, t.y + GEMM_BM);
        w_base = (i64)t.x * p.expert_rows;
    } else {
        m0 = blockIdx.y * GEMM_BM;
        m_end = min(p.M, m0 + GEMM_BM);
    }
    const int n0 = blockIdx.x * GEMM_BN; // tile rows (W rows, interleaved gate/up under SwiGLU)
    const int n_out = p.swiglu ? p.N / 2 : p.N;

    // A: 4 chunks per thread per plane (128 rows × 8 chunks); source rows fixed for the whole K loop.
    const u8* a_src[4];
    int a_bytes[4];
    u32 a_dst[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int c = tid + i * GEMM_THREADS, r = c >> 3, ch = c & 7;
        const int m = m0 + r;
        const bool valid = m < m_end;
        const int src_row = valid ? (p.a_rows ? ((const int*)p.a_rows)[m] : m) : 0;
        a_src[i] = (const u8*)p.a_hi + ((i64)src_row * p.lda + ch * 8) * 2;
        a_bytes[i] = valid ? 16 : 0;
        a_dst[i] = gemm_swz(r, ch);
    }
    const i64 lo_delta = SPLIT ? (i64)(p.a_lo - p.a_hi) : 0;

    // B: unit u = tid + i·256 → tile row u / UPR, unit-in-row u % UPR; W row (−1: past the end).
    i64 b_row[UPT];
#pragma unroll
    for (int i = 0; i < UPT; ++i) {
        const int u = tid + i * GEMM_THREADS, r = u / UPR;
        b_row[i] = gemm_w_row(p, n0, n_out, w_base, r);
    }
    uint4 b_raw[UPT];
    float2 b_par[UPT];
    // XQ: the W rows of this thread's 8 output columns (tile rows wn·32 + 8j + 2(lane&3) + c), −1 past N
    int col_row[4][2];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const int r = wn * 32 + j * 8 + 2 * (lane & 3) + c;
            col_row[j][c] = XQ ? (int)gemm_w_row(p, n0, n_out, w_base, r) : -1;
        }

    auto load_a = [&](int stage, int kt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u8* src = a_src[i] + (i64)kt * GEMM_BK * 2;
            cp_async16(plane(stage, P_AHI) + a_dst[i], src, a_bytes[i]);
            if (SPLIT) cp_async16(plane(stage, P_ALO) + a_dst[i], src + lo_delta, a_bytes[i]);
        }
        cp_async_commit();
    };
    auto load_b = [&](int kt) {
#pragma unroll
        for (int i = 0; i < UPT; ++i) {
            const int uu = (tid + i * GEMM_THREADS) % UPR;
            const int k = kt * GEMM_BK + uu * F::W;
            if (b_row[i] >= 0) {
                b_raw[i] = ld_nc_16((const u8*)p.w.data + b_row[i] * p.w.row_bytes + (i64)(k / F::W) * 16);
                if (F::AFFINE && !XQ) b_par[i] = load_group_params(p.w, b_row[i], k / p.group_size);
            } else {
                b_raw[i] = make_uint4(0u, 0u, 0u, 0u);
                b_par[i] = make_float2(0.0f, 0.0f);
            }
        }
    };
    auto store_b = [&](int stage) {
        u8* hi_tile = smem + (plane(stage, P_BHI) - sbase);
        u8* lo_tile = smem + (plane(stage, P_BLO) - sbase);
#pragma unroll
        for (int i = 0; i < UPT; ++i) {
            const int u = tid + i * GEMM_THREADS, r = u / UPR, uu = u % UPR;
            if (FMT == FMT_BF16) {
                *(uint4*)(hi_tile + gemm_swz(r, uu)) = b_raw[i]; // exact: no conversion, no lo plane
                continue;
            }
            if (FMT == FMT_Q4 && XQ) {
                // the codes themselves: bf16 bits 0x4300 | q = 128 + q, minus 128 = q (exact)
                const u32 words[4] = {b_raw[i].x, b_raw[i].y, b_raw[i].z, b_raw[i].w};
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    u32 out[4];
#pragma unroll
                    for (int e = 0; e < 4; ++e) out[e] = q4_code_pair_bf16(words[q], e);
                    *(uint4*)(hi_tile + gemm_swz(r, uu * 4 + q)) = make_uint4(out[0], out[1], out[2], out[3]);
                }
                continue;
            }
            if (FMT == FMT_Q4 && !SPLIT) {
                // bf16 bits 0x4300 | q = 128 + q exactly, so w = s·(128 + q) + (b − 128·s): no
                // integer→float conversion, and two weights rounded to bf16 per instruction.
                const float s = b_par[i].x, b = b_par[i].y - 128.0f * s;
                const u32 words[4] = {b_raw[i].x, b_raw[i].y, b_raw[i].z, b_raw[i].w};
#pragma unroll
                for (int q = 0; q < 4; ++q) { // word q = weights 8q..8q+7 = one 16-byte chunk
                    u32 out[4];
#pragma unroll
                    for (int e = 0; e < 4; ++e) { // weights 2e, 2e+1 of the word (low nibble first)
                        const u32 pr = ((words[q] >> (8 * e)) & 0xFu) | (((words[q] >> (8 * e + 4)) & 0xFu) << 16) | 0x43004300u;
                        const float w0 = fmaf(s, __uint_as_float(pr << 16), b);
                        const float w1 = fmaf(s, __uint_as_float(pr & 0xffff0000u), b);
                        out[e] = cvt_bf16x2(w0, w1);
                    }
                    *(uint4*)(hi_tile + gemm_swz(r, uu * 4 + q)) = make_uint4(out[0], out[1], out[2], out[3]);
                }
                continue;
            }
            float v[F::W];
            F::decode(b_raw[i], v, b_par[i].x, b_par[i].y);
            // groups of 4 weights → 8 bytes of bf16 at k = uu·W + 4q
#pragma unroll
            for (int q = 0; q < F::W / 4; ++q) {
                const int k = uu * F::W + 4 * q;
                const u32 off = gemm_swz(r, k >> 3) + ((k & 4) ? 8 : 0);
                u16 h[4], l[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) split_bf16(v[4 * q + e], h[e], l[e]);
                *(uint2*)(hi_tile + off) = make_uint2((u32)h[0] | ((u32)h[1] << 16), (u32)h[2] | ((u32)h[3] << 16));
                if (B_LO)
                    *(uint2*)(lo_tile + off) = make_uint2((u32)l[0] | ((u32)l[1] << 16), (u32)l[2] | ((u32)l[3] << 16));
            }
        }
    };

    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

    const int KT = p.K / GEMM_BK;
    load_a(0, 0);
    load_b(0);
    store_b(0);
    cp_async_wait_all();
    __syncthreads();

    // XQ per k-tile: T (exact-code products), row sums of x, the tile's (scale, bias) per column
    float tq[4][4][4], rs[4][4]; // registers only in XQ instantiations
    float2 cpar[4][2];
    constexpr u32 ONES = 0x3F803F80u; // bf16 1.0 pair
    for (int kt = 0; kt < KT; ++kt) {
        const int cur = kt & 1;
        const bool more = kt + 1 < KT;
        if (XQ) {
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int c = 0; c < 2; ++c)
                    cpar[j][c] = col_row[j][c] >= 0 ? load_group_params(p.w, col_row[j][c], kt) : make_float2(0.0f, 0.0f);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
#pragma unroll
                for (int e = 0; e < 4; ++e) rs[i][e] = 0.0f;
#pragma unroll
                for (int j = 0; j < 4; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) tq[i][j][e] = 0.0f;
            }
        }
        if (more) {
            load_a(cur ^ 1, kt + 1);
            load_b(kt + 1); // in flight during the mma below
        }
#pragma unroll
        for (int ks = 0; ks < GEMM_BK / 16; ++ks) {
            u32 af[4][4], al[4][4], bf[4][2], bl[4][2];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = wm * 64 + i * 16 + (lane & 15), ch = ks * 2 + (lane >> 4);
                ldsm_x4(plane(cur, P_AHI) + gemm_swz(r, ch), af[i][0], af[i][1], af[i][2], af[i][3]);
                if (SPLIT) ldsm_x4(plane(cur, P_ALO) + gemm_swz(r, ch), al[i][0], al[i][1], al[i][2], al[i][3]);
            }
#pragma unroll
            for (int pr = 0; pr < 2; ++pr) {
                const int n = wn * 32 + pr * 16 + (lane & 7) + ((lane >> 4) << 3);
                const int ch = ks * 2 + ((lane >> 3) & 1);
                ldsm_x4(plane(cur, P_BHI) + gemm_swz(n, ch), bf[2 * pr][0], bf[2 * pr][1], bf[2 * pr + 1][0],
                        bf[2 * pr + 1][1]);
                if (B_LO)
                    ldsm_x4(plane(cur, P_BLO) + gemm_swz(n, ch), bl[2 * pr][0], bl[2 * pr][1], bl[2 * pr + 1][0],
                            bl[2 * pr + 1][1]);
            }
            if (XQ) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    mma_bf16(rs[i], af[i], ONES, ONES);
                    mma_bf16(rs[i], al[i], ONES, ONES);
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        mma_bf16(tq[i][j], af[i], bf[j][0], bf[j][1]);
                        mma_bf16(tq[i][j], al[i], bf[j][0], bf[j][1]);
                    }
                }
            } else {
#pragma unroll
                for (int i = 0; i < 4; ++i)
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        mma_bf16(acc[i][j], af[i], bf[j][0], bf[j][1]);
                        if (SPLIT) mma_bf16(acc[i][j], al[i], bf[j][0], bf[j][1]);
                        if (B_LO) mma_bf16(acc[i][j], af[i], bl[j][0], bl[j][1]);
                    }
            }
        }
        if (XQ) { // C fragment: (c0, c1) row g, columns 2(lane&3) + 0/1; (c2, c3) row g + 8
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const float2 sb = cpar[j][e & 1];
                        acc[i][j][e] = fmaf(sb.x, tq[i][j][e], fmaf(sb.y, rs[i][e & 2], acc[i][j][e]));
                    }
        }
        if (more) store_b(cur ^ 1);
        cp_async_wait_all();
        __syncthreads();
    }

    // Epilogue.
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int ma = m0 + wm * 64 + i * 16 + (lane >> 2);
#pragma unroll
        for (int j = 0; j < 4; ++j) gemm_store_frag(p, ma, m_end, n0 + wn * 32 + j * 8 + 2 * (lane & 3), n_out, acc[i][j]);
    }
}

// Fast q4/q8/bf16 fit in 128 registers without spills (ptxas -v), so two blocks share an SM (16 warps
// to hide the weight loads); f32/f16 fast and every split variant need more and run one per SM.
#define GEMM_KERNELS(suffix, FMT, FAST_BLOCKS)                                                          \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS, FAST_BLOCKS) gemm_##suffix##_fast(const GemmParams p) { \
        gemm_body<FMT, 0, 0>(p);                                                                       \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1) gemm_##suffix##_split(const GemmParams p) { \
        gemm_body<FMT, 1, 0>(p);                                                                       \
    }
GEMM_KERNELS(f32, FMT_F32, 1)
GEMM_KERNELS(bf16, FMT_BF16, 2)
GEMM_KERNELS(f16, FMT_F16, 1)
GEMM_KERNELS(q4, FMT_Q4, 2)
GEMM_KERNELS(q8, FMT_Q8, 2)
// q4, split, group size 64 (the launcher picks it): exact codes, per-k-tile scale and bias (XQ above)
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1) gemm_q4_splitx(const GemmParams p) {
    gemm_body<FMT_Q4, 1, 1>(p);
}

// ---------------------------------------------------------------- q4 on Hopper warpgroup MMA
// gemm_q4_wgx_split (sm_90a; the launcher picks it there for q4 in groups of 64, split): the XQ
// product above — exact codes, per k-tile T = Σ_planes x·q, acc += s·T + b·Σx — on wgmma instead of
// mma.sync, warp-specialised. Block 384 = 3 warpgroups, tile 128 (M) × 128 (N) × 64 (K):
//   consumers (warpgroups 0, 1): warpgroup w owns rows 64w..64w+63 and all 128 columns; per k-tile
//     8 wgmma m64n136k16 (4 k-slices × hi, lo), wait, fold the 68 T values into 64 accumulators.
//     B carries 8 extra rows, the first all ones, so column 128 of T is Σx of the A rows over the
//     k-tile: the bias term needs no separate reduction.
//   producer (warpgroup 2): A (row gather for the MoE), the codes and their (scale, bias) by
//     cp.async into the stage, all in flight for WGX_LAG tiles; once a tile's copies landed it
//     converts the codes to bf16 in place (exact: 0x4300 | q − 128) and publishes the stage.
// Stages (WGX_STAGES = 4) are handed over by mbarriers: full[s] (128 producer arrivals) and
// empty[s] (one arrival per consumer warp, after its fold). Nothing else synchronises the warps,
// so one warpgroup's fold overlaps the other's wgmma, and the producer's ALU work overlaps both.
// Shared memory per stage (each part 1024-aligned, the 128-byte swizzle of gemm_swz): A hi, A lo
// 16 KiB each, B 136 rows × 128 B, (scale, bias) of the 128 tile rows 1 KiB, the codes and
// parameters as stored 5 KiB; then the barriers (221 KiB in all).
// FLOPs 2·M·(N + 8)·K per plane. One block per SM (≤ 168 registers per thread), persistent: grid =
// min(tiles, SMs), each block loops over tiles.
#define WGX_STAGES 4
#define WGX_LAG 2 // tiles between the producer issuing a tile's copies and publishing it
#define WGX_THREADS 384
#define WGX_BN 136
#define WGX_B_BYTES (WGX_BN * 128)
#define WGX_PAR_BYTES (GEMM_BN * 8)
#define WGX_RAW_BYTES (GEMM_BN * 32 + GEMM_BN * 8) // the tile's codes and (scale, bias) as stored
#define WGX_STAGE_BYTES (2 * GEMM_TILE_BYTES + WGX_B_BYTES + WGX_PAR_BYTES + WGX_RAW_BYTES)

// The tile's stores (fragment j: rows ma, ma + 8, columns col0 + 8j, +1), one instantiation per
// output mode, as gemm_q4_wgh's (wgh_epilogue: one body branching on the mode per value overflows
// the instruction cache); the accumulating mode loads 16 old values at a time before adding.
template <int MODE>
__device__ __forceinline__ void wgx_epilogue(const GemmParams& p, int ma, int m_end, int col0, int n_out, const float* acc) {
    const int mb = ma + 8;
    const float* scale = (const float*)p.row_scale;
    const float sa = scale && ma < m_end ? scale[ma] : 1.0f, sb = scale && mb < m_end ? scale[mb] : 1.0f;
    auto store = [&](int m, int n, float v) { gemm_store<MODE>(p, m, n, v); };
    if (p.swiglu) {
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const int jo = (col0 + 8 * j) >> 1; // (gate, up) of output column jo sit in (c0, c1)
            if (jo >= n_out) continue;
            if (ma < m_end) store(ma, jo, silu_f(acc[4 * j]) * acc[4 * j + 1] * sa);
            if (mb < m_end) store(mb, jo, silu_f(acc[4 * j + 2]) * acc[4 * j + 3] * sb);
        }
        return;
    }
#pragma unroll
    for (int jb = 0; jb < 16; jb += 4) {
        float old[4][4];
        if (MODE == GEMM_OUT_F32_ACC) {
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int m = e < 2 ? ma : mb, n = col0 + 8 * (jb + j) + (e & 1);
                    old[j][e] = m < m_end && n < p.N ? ((const float*)p.out)[(i64)m * p.ldo + n] : 0.0f;
                }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int m = e < 2 ? ma : mb, n = col0 + 8 * (jb + j) + (e & 1);
                if (m >= m_end || n >= p.N) continue;
                float v = acc[4 * (jb + j) + e] * (e < 2 ? sa : sb);
                if (MODE == GEMM_OUT_F32_ACC) v += old[j][e];
                store(m, n, v);
            }
    }
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void gemm_wgx_body(const GemmParams& p) {
    constexpr u32 STAGE = WGX_STAGE_BYTES;
    static_assert(STAGE % 1024 == 0, "stage parts must stay 1024-aligned");
    extern __shared__ __align__(1024) u8 smem[];
    // the 128-byte swizzle is anchored to 1024-byte boundaries; dynamic shared memory only promises 16
    const u32 raw = smem_addr(smem);
    const u32 sbase = (raw + 1023u) & ~1023u;
    u8* const sgen = smem + (sbase - raw);
    auto a_plane = [&](int s, int pl) -> u32 { return sbase + (u32)s * STAGE + (u32)pl * GEMM_TILE_BYTES; };
    auto b_off = [&](int s) -> u32 { return (u32)s * STAGE + 2 * GEMM_TILE_BYTES; };
    auto par_off = [&](int s) -> u32 { return b_off(s) + WGX_B_BYTES; };
    const u32 full = sbase + WGX_STAGES * STAGE, empty = full + WGX_STAGES * 8; // u64 each

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    // Persistent: the block takes tiles blockIdx.x, + gridDim.x, … of the (M tile, N tile) space, N
    // fastest (as the grid of the other kernels); the pipeline runs on across tile boundaries, so one
    // tile's epilogue overlaps the next tile's first copies.
    const int n_tiles = (p.N + GEMM_BN - 1) / GEMM_BN;
    const int tiles = n_tiles * gemm_m_tiles(p);
    int m0 = 0, m_end = 0, n0 = 0;
    i64 w_base = 0;
    auto locate = [&](int t) { gemm_locate(p, n_tiles, GEMM_BN, t, m0, m_end, n0, w_base); };
    const int n_out = p.swiglu ? p.N / 2 : p.N;
    const int KT = p.K / GEMM_BK;

    // B rows 128..135 of every stage: a row of ones, then zeros (written once, never overwritten)
    for (int i = tid; i < WGX_STAGES * 64; i += WGX_THREADS) {
        const int s = i / 64, c = i % 64; // chunk c of the 8 rows (swizzle is moot for uniform rows)
        const u32 v = c < 8 ? 0x3F803F80u : 0u;
        *(uint4*)(sgen + b_off(s) + GEMM_BN * 128 + c * 16) = make_uint4(v, v, v, v);
    }
    if (tid == 0) {
        for (int s = 0; s < WGX_STAGES; ++s) {
            mbar_init(full + 8 * s, 128);
            mbar_init(empty + 8 * s, 8);
        }
    }
    fence_proxy_async_smem();
    __syncthreads();

    if (warp >= 8) {
        // ---------------- producer warpgroup
        const int ptid = tid - 256;
        // A: chunk ch = ptid & 7 of tile rows (ptid >> 3) + 16i, i < 8, in both planes
        const int ch = ptid & 7;
        int a_row[8];
        // B: units (tile row (ptid >> 1) + 64j, 32 codes at column 32·(ptid & 1)), j < 2, and tile
        // row ptid's (scale, bias): copied as stored into the stage's raw area with the A tile,
        // converted there once the copies landed (each thread converts what it copied)
        const int b_u = ptid & 1;
        i64 b_row0 = -1, b_row1 = -1, par_row = -1;
        const int par_bytes = p.w.param_f32 ? 8 : 4;
        auto raw_codes = [&](int s) -> u32 { return par_off(s) + WGX_PAR_BYTES; };
        auto raw_par = [&](int s) -> u32 { return raw_codes(s) + GEMM_BN * 32; };
        auto load_b = [&](int stage, int kt) {
            const u8* base = (const u8*)p.w.data + (i64)kt * 32 + b_u * 16;
            const u32 dst = sbase + raw_codes(stage) + (ptid >> 1) * 32 + b_u * 16;
            cp_async16(dst, base + max(b_row0, (i64)0) * p.w.row_bytes, b_row0 >= 0 ? 16 : 0);
            cp_async16(dst + 64 * 32, base + max(b_row1, (i64)0) * p.w.row_bytes, b_row1 >= 0 ? 16 : 0);
            const u8* par = (const u8*)p.w.params + (max(par_row, (i64)0) * p.w.groups_per_row + kt) * par_bytes;
            if (p.w.param_f32) cp_async8(sbase + raw_par(stage) + ptid * 8, par, par_row >= 0 ? 8 : 0);
            else cp_async4(sbase + raw_par(stage) + ptid * 8, par, par_row >= 0 ? 4 : 0);
        };
        auto convert_b = [&](int stage) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const uint4 raw = *(const uint4*)(sgen + raw_codes(stage) + ((ptid >> 1) + 64 * j) * 32 + b_u * 16);
                // bf16 bits 0x4300 | q = 128 + q, minus 128 = q (exact); word w = codes 8w..8w+7, low nibble first
                const u32 words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
                for (int w = 0; w < 4; ++w) {
                    u32 out[4];
#pragma unroll
                    for (int e = 0; e < 4; ++e) out[e] = q4_code_pair_bf16(words[w], e);
                    *(uint4*)(sgen + b_off(stage) + gemm_swz((ptid >> 1) + 64 * j, b_u * 4 + w)) = make_uint4(out[0], out[1], out[2], out[3]);
                }
            }
            const u8* rp = sgen + raw_par(stage) + ptid * 8;
            float2 sb;
            if (p.w.param_f32) {
                sb = *(const float2*)rp;
            } else {
                const u32 pair = *(const u32*)rp;
                sb = make_float2(bf16_lo(pair), bf16_hi(pair));
            }
            *(float2*)(sgen + par_off(stage) + ptid * 8) = sb;
        };
        const i64 lo_delta = (i64)(p.a_lo - p.a_hi);
        auto load_a = [&](int stage, int kt) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const u8* src = (const u8*)p.a_hi + ((i64)max(a_row[i], 0) * p.lda + kt * GEMM_BK + ch * 8) * 2;
                const u32 dst = gemm_swz((ptid >> 3) + 16 * i, ch);
                const int bytes = a_row[i] >= 0 ? 16 : 0;
                cp_async16(a_plane(stage, 0) + dst, src, bytes);
                cp_async16(a_plane(stage, 1) + dst, src + lo_delta, bytes);
            }
        };
        auto publish = [&](int g) {
            convert_b(g % WGX_STAGES);
            fence_proxy_async_smem();
            mbar_arrive(full + 8 * (g % WGX_STAGES));
        };

        int g = 0; // k-tiles this block has issued, over all its tiles: stage g % STAGES
        for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
            locate(t);
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int m = m0 + (ptid >> 3) + 16 * i;
                a_row[i] = m < m_end ? (p.a_rows ? ((const int*)p.a_rows)[m] : m) : -1;
            }
            b_row0 = gemm_w_row(p, n0, n_out, w_base, ptid >> 1);
            b_row1 = gemm_w_row(p, n0, n_out, w_base, (ptid >> 1) + 64);
            par_row = gemm_w_row(p, n0, n_out, w_base, ptid);
            for (int kt = 0; kt < KT; ++kt, ++g) {
                const int s = g % WGX_STAGES;
                if (g >= WGX_STAGES) mbar_wait(empty + 8 * s, ((g / WGX_STAGES) + 1) & 1);
                load_a(s, kt);
                load_b(s, kt);
                cp_async_commit();
                // publish k-tile g − LAG once its copies landed (the later ones' are still in flight:
                // the wait is for copies issued LAG iterations ago, longer than their latency from L2)
                if (g >= WGX_LAG) {
                    cp_async_wait<WGX_LAG>();
                    publish(g - WGX_LAG);
                }
            }
        }
        cp_async_wait_all();
        for (int gg = max(g - WGX_LAG, 0); gg < g; ++gg) publish(gg);
        return;
    }

    // ---------------- consumer warpgroups
    const int wg = warp >> 2, wi = warp & 3;
    float acc[64], tq[68];
#pragma unroll
    for (int i = 0; i < 68; ++i) tq[i] = 0.0f;
    int g = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        locate(t);
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
        for (int kt = 0; kt < KT; ++kt, ++g) {
            const int st = g % WGX_STAGES;
            mbar_wait(full + 8 * st, (g / WGX_STAGES) & 1);

            const u64 db = wgmma_desc_sw128(sbase + b_off(st));
            const u64 dh = wgmma_desc_sw128(a_plane(st, 0) + wg * 64 * 128);
            const u64 dl = wgmma_desc_sw128(a_plane(st, 1) + wg * 64 * 128);
#pragma unroll
            for (int i = 0; i < 68; ++i) wgmma_pin(tq[i]);
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < GEMM_BK / 16; ++ks) {
                wgmma_m64n136k16_bf16(tq, dh + 2 * ks, db + 2 * ks, ks > 0);
                wgmma_m64n136k16_bf16(tq, dl + 2 * ks, db + 2 * ks, 1);
            }
            wgmma_commit();
            wgmma_wait_all();
#pragma unroll
            for (int i = 0; i < 68; ++i) wgmma_pin(tq[i]);

            // fold: column 128 of T (lane 4g) is Σx of rows g and g + 8
            const float sx0 = __shfl_sync(0xffffffffu, tq[64], lane & ~3);
            const float sx1 = __shfl_sync(0xffffffffu, tq[66], lane & ~3);
            const u8* par = sgen + par_off(st) + (lane & 3) * 16;
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const float4 sb = *(const float4*)(par + j * 64); // (s, b) of columns 8j + 2q, 8j + 2q + 1
                acc[4 * j + 0] = fmaf(sb.x, tq[4 * j + 0], fmaf(sb.y, sx0, acc[4 * j + 0]));
                acc[4 * j + 1] = fmaf(sb.z, tq[4 * j + 1], fmaf(sb.w, sx0, acc[4 * j + 1]));
                acc[4 * j + 2] = fmaf(sb.x, tq[4 * j + 2], fmaf(sb.y, sx1, acc[4 * j + 2]));
                acc[4 * j + 3] = fmaf(sb.z, tq[4 * j + 3], fmaf(sb.w, sx1, acc[4 * j + 3]));
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(empty + 8 * st); // this warp is done with the stage
        }

        const int ma = m0 + wg * 64 + wi * 16 + (lane >> 2), col0 = n0 + 2 * (lane & 3);
        switch (p.mode) {
            case GEMM_OUT_F32: wgx_epilogue<GEMM_OUT_F32>(p, ma, m_end, col0, n_out, acc); break;
            case GEMM_OUT_F32_ACC: wgx_epilogue<GEMM_OUT_F32_ACC>(p, ma, m_end, col0, n_out, acc); break;
            case GEMM_OUT_F16: wgx_epilogue<GEMM_OUT_F16>(p, ma, m_end, col0, n_out, acc); break;
            default: wgx_epilogue<GEMM_OUT_BF16>(p, ma, m_end, col0, n_out, acc); break;
        }
    }
}
#endif

// The launcher asks for it on sm_90a only; elsewhere it compiles to an empty kernel.
extern "C" __global__ void __launch_bounds__(WGX_THREADS, 1) gemm_q4_wgx_split(const GemmParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    gemm_wgx_body(p);
#endif
}

// ---------------------------------------------------------------- q4 × f16 activations on wgmma
// gemm_q4_wgh (sm_90a; Precision::Half, q4 in groups of 64): Y = X·Wᵀ with X one f16 plane (a_hi)
// and each weight dequantised to f16 in registers (w = s·q + b: q − 1024 exact, one rounding in the
// FMA), f32 accumulation. Error per product ~2⁻¹² relative from each operand (bf16 fast: 2⁻⁹).
// Roles swapped against gemm_q4_wgx_split: W is wgmma's A operand, straight from registers (the
// consumers turn the codes they need into fragments: no converted tile, no producer wait, no
// per-k-tile fold), X the B operand, K-major in shared memory in the 128-byte swizzle as copied.
// Block 384 = 3 warpgroups, tile 128 tokens (M) × 256 features (N, WGH_BN; gemm.rs has its twin)
// × 64 k:
//   consumers (warpgroups 0, 1): warpgroup w owns features 128w.. (WGH_SLABS = 2 slabs of 64); per
//     k-tile 2 × 4 wgmma m64n128k16, wait, release the stage.
//   producer (warpgroup 2): X rows (gathered for the MoE), the codes and their (scale, bias) by
//     cp.async; each thread's copies arrive on the stage's full barrier when they land
//     (cp.async.mbarrier.arrive.noinc), so it only ever waits for a free stage.
// Fragment of lane 4g + q, k16 slice ks: a0/a2 take k pair (2q, 2q+1) of 8-code chunks 2ks / 2ks+1,
// i.e. byte q of the row's words 2ks and 2ks + 1 (a1, a3: the same for row g + 8).
// Under SwiGLU, tile rows 16i + j (j < 8) are gate rows and 16i + 8 + j the up rows of the same
// output column: both sit in one thread (fragment rows g and g + 8).
#define WGH_SLABS 2
#define WGH_STAGES 8
// Registers per thread after setmaxnreg: the producer's copies need ~96 (fewer spill), the consumers'
// 128 accumulators and 32 fragment registers the rest. Asking for more than the register file holds
// makes setmaxnreg.inc wait forever.
#define WGH_PRODUCER_REGS 96
#define WGH_CONSUMER_REGS 200
static_assert(128 * WGH_PRODUCER_REGS + 256 * WGH_CONSUMER_REGS <= 64512, "setmaxnreg beyond the register file");
#define WGH_BN (128 * WGH_SLABS)
#define WGH_X_BYTES (GEMM_BM * 128)
#define WGH_CODE_BYTES (WGH_BN * 32)
#define WGH_PAR_BYTES (WGH_BN * 8)
#define WGH_STAGE_BYTES (WGH_X_BYTES + WGH_CODE_BYTES + WGH_PAR_BYTES)

// W row of tile row r in the N tile at n0 (see above for SwiGLU), −1 past the end.
__device__ __forceinline__ i64 wgh_w_row(const GemmParams& p, int n0, int n_out, i64 w_base, int r) {
    if (p.swiglu) {
        const int j = n0 / 2 + (r >> 4) * 8 + (r & 7);
        return j < n_out ? w_base + ((r & 8) ? n_out + j : j) : -1;
    }
    return n0 + r < p.N ? w_base + n0 + r : -1;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void cp_async_mbar_arrive(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
// The f16 pair (s·q_lo + b, s·q_hi + b) of byte `sel`'s two codes; `word_hi4` = word >> 4.
__device__ __forceinline__ u32 wgh_dequant(u32 word, u32 word_hi4, u32 sel, u32 s2, u32 b2) {
    u32 x;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(x) : "r"(word), "r"(word_hi4), "r"(sel));
    x &= 0x000F000Fu; // (q_lo, q_hi) in the low nibbles
    u32 v = x | 0x64006400u, q, w;                                 // f16 1024 + q
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(q) : "r"(v), "r"(0x64006400u)); // q, exact
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(w) : "r"(q), "r"(s2), "r"(b2));
    return w;
}
__device__ __forceinline__ u32 f16x2_of(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// The tile's stores, one instantiation per output mode (and SwiGLU): a single straight-line body
// per launch. (One body branching on the mode per value was ~18K instructions, far beyond the
// instruction cache, and made the kernel 2.6× slower.) The accumulating mode loads its old values
// 8 at a time (JB token columns; more spill) before adding, instead of one round trip per value.
template <int MODE, int SWIGLU>
__device__ __forceinline__ void wgh_epilogue(const GemmParams& p, float (&acc)[WGH_SLABS][64], int m0, int m_end,
                                             int n0, int rbase, int q, int n_out) {
    constexpr int JB = 2; // token columns j per batch: their row scales and old values load together
    auto store = [&](int m, int n, float v) { gemm_store<MODE>(p, m, n, v); };
#pragma unroll
    for (int sl = 0; sl < WGH_SLABS; ++sl) {
        const int r0 = rbase + 64 * sl;
#pragma unroll
        for (int jb = 0; jb < 16; jb += JB) {
            float sc[JB][2], old[JB][2][2];
#pragma unroll
            for (int j = 0; j < JB; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int m = m0 + 8 * (jb + j) + 2 * q + e;
                    sc[j][e] = p.row_scale && m < m_end ? ((const float*)p.row_scale)[m] : 1.0f;
                    if (MODE == GEMM_OUT_F32_ACC && !SWIGLU) {
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const int n = n0 + r0 + 8 * h;
                            old[j][e][h] = m < m_end && n < p.N ? ((const float*)p.out)[(i64)m * p.ldo + n] : 0.0f;
                        }
                    }
                }
#pragma unroll
            for (int j = 0; j < JB; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int m = m0 + 8 * (jb + j) + 2 * q + e;
                    if (m >= m_end) continue;
                    const float* c = &acc[sl][4 * (jb + j)];
                    if (SWIGLU) {
                        const int jo = n0 / 2 + (r0 >> 4) * 8 + (r0 & 7);
                        if (jo < n_out) store(m, jo, silu_f(c[e]) * c[2 + e] * sc[j][e]);
                    } else {
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const int n = n0 + r0 + 8 * h;
                            if (n >= p.N) continue;
                            float v = c[2 * h + e] * sc[j][e];
                            if (MODE == GEMM_OUT_F32_ACC) v += old[j][e][h];
                            store(m, n, v);
                        }
                    }
                }
        }
    }
}

__device__ __forceinline__ void gemm_wgh_body(const GemmParams& p) {
    constexpr u32 STAGE = WGH_STAGE_BYTES;
    static_assert(STAGE % 1024 == 0, "stage parts must stay 1024-aligned");
    extern __shared__ __align__(1024) u8 smem[];
    const u32 raw = smem_addr(smem);
    const u32 sbase = (raw + 1023u) & ~1023u;
    const u8* const sgen = smem + (sbase - raw);
    auto x_off = [&](int s) -> u32 { return (u32)s * STAGE; };
    auto code_off = [&](int s) -> u32 { return (u32)s * STAGE + WGH_X_BYTES; };
    auto par_off = [&](int s) -> u32 { return code_off(s) + WGH_CODE_BYTES; };
    const u32 full = sbase + WGH_STAGES * STAGE, empty = full + WGH_STAGES * 8; // u64 each

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int n_tiles = (p.N + WGH_BN - 1) / WGH_BN;
    const int tiles = n_tiles * gemm_m_tiles(p);
    int m0 = 0, m_end = 0, n0 = 0;
    i64 w_base = 0;
    auto locate = [&](int t) { gemm_locate(p, n_tiles, WGH_BN, t, m0, m_end, n0, w_base); };
    const int n_out = p.swiglu ? p.N / 2 : p.N;
    const int KT = p.K / GEMM_BK;

    if (tid == 0) {
        for (int s = 0; s < WGH_STAGES; ++s) {
            mbar_init(full + 8 * s, 128);
            mbar_init(empty + 8 * s, 8);
        }
    }
    fence_proxy_async_smem();
    __syncthreads();

    if (warp >= 8) {
        // ---------------- producer warpgroup
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(WGH_PRODUCER_REGS) : "memory");
        const int ptid = tid - 256;
        const int ch = ptid & 7; // X: chunk ch of tile rows (ptid >> 3) + 16i, i < 8
        int x_row[8];
        constexpr int CODE_UNITS = WGH_BN * 2 / 128; // 16-byte code units per thread: (row u >> 1, half u & 1)
        constexpr int PAR_ROWS = WGH_BN / 128;
        i64 w_row[CODE_UNITS], p_row[PAR_ROWS];
        const int par_bytes = p.w.param_f32 ? 8 : 4;
        int g = 0;
        for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
            locate(t);
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int m = m0 + (ptid >> 3) + 16 * i;
                x_row[i] = m < m_end ? (p.a_rows ? ((const int*)p.a_rows)[m] : m) : -1;
            }
#pragma unroll
            for (int i = 0; i < CODE_UNITS; ++i) w_row[i] = wgh_w_row(p, n0, n_out, w_base, (ptid + 128 * i) >> 1);
#pragma unroll
            for (int i = 0; i < PAR_ROWS; ++i) p_row[i] = wgh_w_row(p, n0, n_out, w_base, ptid + 128 * i);
            for (int kt = 0; kt < KT; ++kt, ++g) {
                const int s = g % WGH_STAGES;
                if (g >= WGH_STAGES) mbar_wait(empty + 8 * s, ((g / WGH_STAGES) + 1) & 1);
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const u8* src = (const u8*)p.a_hi + ((i64)max(x_row[i], 0) * p.lda + kt * GEMM_BK + ch * 8) * 2;
                    cp_async16(sbase + x_off(s) + gemm_swz((ptid >> 3) + 16 * i, ch), src, x_row[i] >= 0 ? 16 : 0);
                }
#pragma unroll
                for (int i = 0; i < CODE_UNITS; ++i) {
                    const int u = ptid + 128 * i;
                    const u8* src = (const u8*)p.w.data + max(w_row[i], (i64)0) * p.w.row_bytes + kt * 32 + (u & 1) * 16;
                    cp_async16(sbase + code_off(s) + u * 16, src, w_row[i] >= 0 ? 16 : 0);
                }
#pragma unroll
                for (int i = 0; i < PAR_ROWS; ++i) {
                    const int r = ptid + 128 * i;
                    const u8* par = (const u8*)p.w.params + (max(p_row[i], (i64)0) * p.w.groups_per_row + kt) * par_bytes;
                    if (p.w.param_f32) cp_async8(sbase + par_off(s) + r * 8, par, p_row[i] >= 0 ? 8 : 0);
                    else cp_async4(sbase + par_off(s) + r * 8, par, p_row[i] >= 0 ? 4 : 0);
                }
                cp_async_mbar_arrive(full + 8 * s);
            }
        }
        cp_async_wait_all(); // the block must not exit with copies in flight
        return;
    }

    // ---------------- consumer warpgroups
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(WGH_CONSUMER_REGS) : "memory");
    const int wg = warp >> 2, wi = warp & 3, gq = lane >> 2, q = lane & 3;
    const u32 sel = (u32)q | (4u + q) << 8 | 0x7070u;  // bytes: q of word, 0, q of word >> 4, 0 ... (masked after)
    float acc[WGH_SLABS][64];
    int g = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        locate(t);
#pragma unroll
        for (int sl = 0; sl < WGH_SLABS; ++sl)
#pragma unroll
            for (int i = 0; i < 64; ++i) acc[sl][i] = 0.0f;
        for (int kt = 0; kt < KT; ++kt, ++g) {
            const int st = g % WGH_STAGES;
            mbar_wait(full + 8 * st, (g / WGH_STAGES) & 1);
            fence_proxy_async_smem(); // the copies landed through the generic proxy; wgmma reads via the async one
            u32 af[WGH_SLABS][4][4];
#pragma unroll
            for (int sl = 0; sl < WGH_SLABS; ++sl) {
                const int r0 = wg * 64 * WGH_SLABS + sl * 64 + wi * 16 + gq; // tile rows r0, r0 + 8
                u32 sb2[2][2];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const u8* rp = sgen + par_off(st) + (r0 + 8 * h) * 8;
                    float2 sb;
                    if (p.w.param_f32) sb = *(const float2*)rp;
                    else {
                        const u32 pair = *(const u32*)rp;
                        sb = make_float2(bf16_lo(pair), bf16_hi(pair));
                    }
                    sb2[h][0] = f16x2_of(sb.x, sb.x);
                    sb2[h][1] = f16x2_of(sb.y, sb.y);
                }
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const uint4 c0 = *(const uint4*)(sgen + code_off(st) + (r0 + 8 * h) * 32);
                    const uint4 c1 = *(const uint4*)(sgen + code_off(st) + (r0 + 8 * h) * 32 + 16);
                    const u32 wd[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
#pragma unroll
                    for (int ks = 0; ks < 4; ++ks) {
                        af[sl][ks][h] = wgh_dequant(wd[2 * ks], wd[2 * ks] >> 4, sel, sb2[h][0], sb2[h][1]);
                        af[sl][ks][2 + h] = wgh_dequant(wd[2 * ks + 1], wd[2 * ks + 1] >> 4, sel, sb2[h][0], sb2[h][1]);
                    }
                }
            }
            const u64 dx = wgmma_desc_sw128(sbase + x_off(st));
#pragma unroll
            for (int sl = 0; sl < WGH_SLABS; ++sl)
#pragma unroll
                for (int i = 0; i < 64; ++i) wgmma_pin(acc[sl][i]);
            wgmma_fence();
#pragma unroll
            for (int sl = 0; sl < WGH_SLABS; ++sl)
#pragma unroll
                for (int ks = 0; ks < 4; ++ks) wgmma_m64n128k16_f16_rs(acc[sl], af[sl][ks], dx + 2 * ks);
            wgmma_commit();
            wgmma_wait_all();
#pragma unroll
            for (int sl = 0; sl < WGH_SLABS; ++sl) {
#pragma unroll
                for (int i = 0; i < 64; ++i) wgmma_pin(acc[sl][i]);
#pragma unroll
                for (int ks = 0; ks < 4; ++ks)
#pragma unroll
                    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(af[sl][ks][e])::"memory");
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(empty + 8 * st);
        }

        // epilogue: fragment (row r0 + 8h, token 8j + 2q + e) of slab sl is acc[sl][4j + 2h + e]
        const int rbase = wg * 64 * WGH_SLABS + wi * 16 + gq;
#define WGH_EPILOGUE(MODE)                                                                  \
    case MODE:                                                                              \
        if (p.swiglu) wgh_epilogue<MODE, 1>(p, acc, m0, m_end, n0, rbase, q, n_out);        \
        else wgh_epilogue<MODE, 0>(p, acc, m0, m_end, n0, rbase, q, n_out);                 \
        break;
        switch (p.mode) {
            WGH_EPILOGUE(GEMM_OUT_F32)
            WGH_EPILOGUE(GEMM_OUT_F32_ACC)
            WGH_EPILOGUE(GEMM_OUT_F16)
            default: WGH_EPILOGUE(GEMM_OUT_BF16)
        }
#undef WGH_EPILOGUE
    }
}
#endif

extern "C" __global__ void __launch_bounds__(WGX_THREADS, 1) gemm_q4_wgh(const GemmParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    gemm_wgh_body(p);
#endif
}

// ---------------------------------------------------------------- RMSNorm rows → bf16 planes
// x̂[t] = x[t]·(1/√(mean(x[t]²) + eps))·gain   (gain = 1 + w; no norm when gain is null: a plain
// conversion). Output planes hi/lo [T, D] (lo may be null). grid T, block 256, static smem.
// CPU reference: calla_cpu::norm::rms_norm_zero_centred. Bytes: T·D·(4 in + 2–4 out).
struct RowNormParams {
    u64 x;     // [T, D] f32
    u64 gain;  // [D] f32 or 0
    u64 hi, lo;// [T, D] bf16 (either may be 0)
    int T, D;
    float eps;
    int pad;
    u64 f16;   // [T, D] f16 or 0
};

extern "C" __global__ void __launch_bounds__(256) gemm_rmsnorm_planes(const RowNormParams p) {
    __shared__ float red[32];
    const int t = blockIdx.x;
    const float* x = (const float*)p.x + (i64)t * p.D;
    float inv = 1.0f;
    if (p.gain) {
        float ss = 0.0f;
        for (int i = threadIdx.x; i < p.D; i += blockDim.x) ss += x[i] * x[i];
        inv = 1.0f / sqrtf(block_sum(ss, red) / (float)p.D + p.eps);
    }
    const float* g = (const float*)p.gain;
    for (int i = threadIdx.x; i < p.D; i += blockDim.x) {
        const float v = g ? x[i] * inv * g[i] : x[i];
        store_act((u16*)p.hi, (u16*)p.lo, (u16*)p.f16, (i64)t * p.D + i, v);
    }
}

// ---------------------------------------------------------------- embedding rows
// h[t] = E[tokens[t]] (dequantised), ids clamped to the table. grid T, block 256.
struct EmbedRowsParams {
    MatrixRef m;
    u64 tokens; // i32 [T]
    u64 out;    // [T, D] f32
    int T, D, group_size, rows;
};

template <int FMT>
__device__ __forceinline__ void embed_rows_body(const EmbedRowsParams& p) {
    const int t = blockIdx.x;
    int token = ((const int*)p.tokens)[t];
    token = token < 0 ? 0 : (token >= p.rows ? p.rows - 1 : token);
    dequant_row<FMT>(p.m, token, p.D, p.group_size, (float*)p.out + (i64)t * p.D);
}

#define EMBED_ROWS_KERNEL(suffix, FMT) \
    extern "C" __global__ void __launch_bounds__(256) gemm_embed_rows_##suffix(const EmbedRowsParams p) { embed_rows_body<FMT>(p); }
EMBED_ROWS_KERNEL(f32, FMT_F32)
EMBED_ROWS_KERNEL(bf16, FMT_BF16)
EMBED_ROWS_KERNEL(f16, FMT_F16)
EMBED_ROWS_KERNEL(q4, FMT_Q4)
EMBED_ROWS_KERNEL(q8, FMT_Q8)
