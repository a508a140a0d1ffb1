// deltanet_prefill.cu: the Gated DeltaNet core for a prompt of T tokens at positions p0..p0+T, in
// the chunked (UT/WY) form, f32 or near-f32 throughout (the state must agree with the decode
// kernel's): the chunk transform and the recurrence on tensor cores in 3xbf16 (mma.cuh) where
// Dk % 16 == 0, Dv % 8 == 0 and Dk + Dv ≤ 256 (prefill_dn_chunk_tc, prefill_dn_states,
// prefill_dn_out), else on CUDA cores in f32 (prefill_dn_chunk,
// prefill_dn_scan).
//
// Math (CPU reference: calla_cpu::deltanet, `DeltaNet::forward` with Rule::Chunked, and
// `deltanet_chunked`); the projections come from gemm.cu:
//   u_c[t] = Σ_{j<K} conv_w[c, j] · x_c[t−K+1+j]   (x = pre-conv qkv; before p0 from the conv ring)
//   q, k, v = silu(u) split [q (Hk·Dk) | k (Hk·Dk) | v (Hv·Dv)];  q, k ← x·(Σx² + 1e-6)^−½, q ← q·Dk^−½
//   g = −exp(A_log[h])·softplus(a + dt_bias[h]);  β = sigmoid(b)      (value head h, key head h/(Hv/Hk))
//   per chunk of L ≤ 64 tokens, c_i = Σ_{j≤i} g_j:
//     A_ij = β_i (k_i·k_j) e^{c_i−c_j} (j < i);  U = (I + A)⁻¹ β v;  W = (I + A)⁻¹ β k e^{c}
//     v'_i = U_i − W_i S;  o_i = e^{c_i} q_i S + Σ_{j≤i} (q_i·k_j) e^{c_i−c_j} v'_j
//     S ← e^{c_L} S + Σ_i e^{c_L−c_i} k_i v'_iᵀ
//   y = norm_w · o · (mean(o²) + eps)^−½ · silu(z)  per (token, value head)
// Layouts: qkv, conv output [T, C]; z, o [T, Hv·Dv]; a, b, gcum [T, Hv]; W [T, Hv, Dk];
//   U [T, Hv, Dv]; Aqk [⌈T/64⌉, Hv, 64, 64]; the decode state: conv ring [K, C] (slot p mod K holds
//   x[p]) and S [Hv, Dv, Dk] ("K-last"), both f32.
// Kernels, in order (one stream):
//   prefill_dn_conv   grid (⌈T/64⌉, 2Hk + Hv), block 128: one head's channels × 64 tokens, the
//                     window in registers; then the L2 norm per token row (smem [64, width+1]).
//   prefill_dn_ring   grid (⌈C/256⌉, K): the last K positions into the ring (after conv: no race).
//   prefill_dn_chunk  grid (⌈T/64⌉, Hv), block 256: A and Aqk (4×4 register tiles), then forward
//                     substitution with one thread per column of [U | W] (no barriers; four partial
//                     sums per row); parallel over chunks. smem max(2·64·(Dk+4), 64·(Dv+Dk)) + 64·68
//                     + 128 floats.
//   prefill_dn_scan   grid (⌈Dv/32⌉, Hv), block 256: the only sequential part — the state tile
//                     S [32, Dk] in smem, chunk after chunk: v', o, S update, the next chunk's tiles
//                     copied (cp.async) into each buffer once it is free; smem (3·64 + 32)·(Dk+4)
//                     + 64·(33 + 36 + 65) + 128 floats (153 KiB at Dk 128).
//   prefill_dn_norm   grid ⌈T·Hv/8⌉, block 256: gated RMSNorm, one warp per (token, head) → bf16
//                     planes for out_proj.
//   On tensor cores, chunk and scan are replaced by (sections below): prefill_dn_chunk_tc (same grid,
//   outputs), prefill_dn_states (grid (⌈Dv/32⌉, Hv), the sequential part: v' over U, the state before
//   each chunk into h [NC, Hv, Dv, Dk]) and prefill_dn_out (grid (NC, Hv, ⌈Dv/64⌉): o from q, h, Aqk, v').
// FLOPs per (chunk, head) ≈ 2·64·64·Dk·2 (A, Aqk) + 64²·(Dv+Dk) (solve) + 3·2·64·Dk·Dv (scan).
// Bytes: qkv and conv output read ~3×, W/U/Aqk written once and read once (f32).

#define DN_CHUNK 64
#define DN_MAX_K 8
#define DN_BV 32

__device__ __forceinline__ float dn_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }
__device__ __forceinline__ int dn_slot(int pos, int K) { return ((pos % K) + K) % K; }
// Pitch (floats) of rows whose mma fragments read pairs along the row (mma.cuh: ≡ 8 mod 32).
__host__ __device__ __forceinline__ int dn_pair_pitch(int n) { return ((n + 31) & ~31) + 8; }

// Copy a [rows, width] f32 tile (row r at src + r·stride; rows ≥ valid become zeros) into shared rows
// of `pitch` floats with 16-byte loads, eight in flight per thread before any is stored (the loads
// come from L2; one at a time they would serialise on its latency). width % 4 == 0, src 16-byte aligned.
__device__ __forceinline__ void dn_load_tile(float* dst, int pitch, const float* src, i64 stride, int rows, int valid,
                                             int width) {
    const int w4 = width >> 2, total = rows * w4;
    for (int base = threadIdx.x; base < total; base += blockDim.x * 8) {
        float4 v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int e = base + u * blockDim.x;
            v[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (e < total) {
                const int r = e / w4;
                if (r < valid) v[u] = *(const float4*)(src + r * stride + (e - r * w4) * 4);
            }
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int e = base + u * blockDim.x;
            if (e < total) {
                const int r = e / w4;
                float* d = dst + r * pitch + (e - r * w4) * 4;
                d[0] = v[u].x; d[1] = v[u].y; d[2] = v[u].z; d[3] = v[u].w;
            }
        }
    }
}

// dn_load_tile by cp.async (nothing waits here: the caller commits and waits): 16-byte pieces when
// VEC (dst pitch and source rows 16-byte aligned, width % 4 == 0), else single floats (any pitch).
template <bool VEC>
__device__ __forceinline__ void dn_copy_tile(float* dst, int pitch, const float* src, i64 stride, int rows, int valid,
                                             int width) {
    const int per = VEC ? 4 : 1, wp = width / per, total = rows * wp;
    for (int e = threadIdx.x; e < total; e += blockDim.x) {
        const int r = e / wp, c = (e - r * wp) * per;
        const u32 d = smem_addr(dst + r * pitch + c);
        const float* g = src + (i64)min(r, max(valid - 1, 0)) * stride + c;
        if (VEC) cp_async16(d, g, r < valid ? 16 : 0);
        else cp_async4(d, g, r < valid ? 4 : 0);
    }
}

// ---------------------------------------------------------------- conv + silu + q/k L2 norm
struct DnConvParams {
    u64 qkv;    // [T, C] f32, pre-conv
    u64 conv_w; // [C, K] f32
    u64 ring;   // [K, C] f32 (read only here)
    u64 out;    // [T, C] f32
    int T, p0, C, K, Hk, Hv, Dk, Dv;
    float q_scale;
    int pad;
};

extern "C" __global__ void __launch_bounds__(128) prefill_dn_conv(const DnConvParams p) {
    extern __shared__ float tile[]; // [64, width + 1]
    const int s = blockIdx.y;
    const bool is_q = s < p.Hk, is_k = !is_q && s < 2 * p.Hk;
    int base, width;
    if (is_q) { base = s * p.Dk; width = p.Dk; }
    else if (is_k) { base = p.Hk * p.Dk + (s - p.Hk) * p.Dk; width = p.Dk; }
    else { base = 2 * p.Hk * p.Dk + (s - 2 * p.Hk) * p.Dv; width = p.Dv; }
    const int t0 = blockIdx.x * DN_CHUNK, L = min(DN_CHUNK, p.T - t0);
    const int pitch = width + 1, K = p.K;
    const float* qkv = (const float*)p.qkv;
    const float* ring = (const float*)p.ring;

    for (int j = threadIdx.x; j < width; j += blockDim.x) {
        const int c = base + j;
        // win[DN_MAX_K−1] is the newest input; tap t (< K) multiplies x[pos−K+1+t] = win[MAX−K+t].
        float w[DN_MAX_K], win[DN_MAX_K];
#pragma unroll
        for (int u = 0; u < DN_MAX_K; ++u) {
            const int tap = u - (DN_MAX_K - K);
            w[u] = tap >= 0 ? ((const float*)p.conv_w)[(i64)c * K + tap] : 0.0f;
            win[u] = 0.0f;
            if (tap >= 0 && u < DN_MAX_K - 1) {
                const int tt = t0 - (DN_MAX_K - 1) + u; // token index of this history entry
                win[u] = tt >= 0 ? qkv[(i64)tt * p.C + c] : ring[(i64)dn_slot(p.p0 + tt, K) * p.C + c];
            }
        }
        for (int i0 = 0; i0 < L; i0 += 8) { // eight inputs in flight, then the window slides over them
            float in[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) in[e] = i0 + e < L ? qkv[(i64)(t0 + i0 + e) * p.C + c] : 0.0f;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                if (i0 + e >= L) break;
                win[DN_MAX_K - 1] = in[e];
                float acc = 0.0f;
#pragma unroll
                for (int u = 0; u < DN_MAX_K; ++u) acc += w[u] * win[u];
                tile[(i0 + e) * pitch + j] = silu_f(acc);
#pragma unroll
                for (int u = 0; u < DN_MAX_K - 1; ++u) win[u] = win[u + 1];
            }
        }
    }
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    float* out = (float*)p.out;
    for (int i = warp; i < L; i += nwarps) {
        float inv = 1.0f;
        if (is_q || is_k) {
            float ss = 0.0f;
            for (int j = lane; j < width; j += 32) ss += tile[i * pitch + j] * tile[i * pitch + j];
            inv = 1.0f / sqrtf(warp_sum(ss) + 1e-6f);
        }
        for (int j = lane; j < width; j += 32) {
            float v = tile[i * pitch + j];
            if (is_q) v = v * inv * p.q_scale;
            else if (is_k) v = v * inv;
            out[(i64)(t0 + i) * p.C + base + j] = v;
        }
    }
}

// ---------------------------------------------------------------- conv ring update
struct DnRingParams {
    u64 qkv;  // [T, C]
    u64 ring; // [K, C]
    int T, p0, C, K;
};

extern "C" __global__ void __launch_bounds__(256) prefill_dn_ring(const DnRingParams p) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int t = p.T - p.K + (int)blockIdx.y; // token index; positions before the prompt stay
    if (c >= p.C || t < 0) return;
    ((float*)p.ring)[(i64)dn_slot(p.p0 + t, p.K) * p.C + c] = ((const float*)p.qkv)[(i64)t * p.C + c];
}

// ---------------------------------------------------------------- per-chunk UT transform
struct DnChunkParams {
    u64 qkvc;          // [T, C] conv output
    u64 a, b;          // [T, Hv] f32
    u64 a_log, dt_bias;// [Hv] f32
    u64 w_out;         // [T, Hv, Dk]
    u64 u_out;         // [T, Hv, Dv]
    u64 aqk_out;       // [NC, Hv, 64, 64]
    u64 gcum_out;      // [T, Hv]
    int T, C, Hk, Hv, Dk, Dv;
};

// Threads 0..63: the chunk's log decays g_i = −e^{A_log}·softplus(a_i + dt_bias) into cum (summed by
// dn_cumulate after a barrier) and β_i = sigmoid(b_i); rows ≥ L get zeros.
__device__ __forceinline__ void dn_chunk_gates(const DnChunkParams& p, int t0, int L, int h, float* cum, float* beta) {
    const int tid = threadIdx.x;
    if (tid >= DN_CHUNK) return;
    float g = 0.0f, bt = 0.0f;
    if (tid < L) {
        const i64 r = (i64)(t0 + tid) * p.Hv + h;
        const float a = ((const float*)p.a)[r] + ((const float*)p.dt_bias)[h];
        g = -expf(((const float*)p.a_log)[h]) * dn_softplus(a);
        bt = sigmoid_f(((const float*)p.b)[r]);
    }
    cum[tid] = g;
    beta[tid] = bt;
}
// Thread 0: c_i = Σ_{j≤i} g_j, in order (as the CPU).
__device__ __forceinline__ void dn_cumulate(float* cum) {
    if (threadIdx.x != 0) return;
    float run = 0.0f;
    for (int i = 0; i < DN_CHUNK; ++i) { run += cum[i]; cum[i] = run; }
}

extern "C" __global__ void __launch_bounds__(256) prefill_dn_chunk(const DnChunkParams p) {
    extern __shared__ __align__(16) float sm[];
    const int chunk = blockIdx.x, h = blockIdx.y, kh = h / (p.Hv / p.Hk);
    const int t0 = chunk * DN_CHUNK, L = min(DN_CHUNK, p.T - t0);
    const int Dk = p.Dk, Dv = p.Dv, kp = Dk + 4, cols = Dv + Dk; // rows of Dk + 4: 16-byte aligned,
    const int region = max(2 * DN_CHUNK * kp, DN_CHUNK * cols);      // 8 rows hit 8 distinct 16 B slots
    float* qs = sm;                     // phase 1: [64, Dk+4]
    float* ks = sm + DN_CHUNK * kp;     // phase 1: [64, Dk+4]
    float* uw = sm;                     // phase 2: [64, Dv+Dk] (aliases qs, ks)
    float* As = sm + region;            // [64, 68] (16-byte rows)
    float* cum = As + DN_CHUNK * 68;    // [64]
    float* beta = cum + DN_CHUNK;       // [64]
    const int tid = threadIdx.x;
    const float* x = (const float*)p.qkvc;
    const i64 q_col = (i64)kh * Dk, k_col = (i64)p.Hk * Dk + (i64)kh * Dk, v_col = 2 * (i64)p.Hk * Dk + (i64)h * Dv;

    dn_chunk_gates(p, t0, L, h, cum, beta);
    dn_load_tile(qs, kp, x + (i64)t0 * p.C + q_col, p.C, DN_CHUNK, L, Dk);
    dn_load_tile(ks, kp, x + (i64)t0 * p.C + k_col, p.C, DN_CHUNK, L, Dk);
    __syncthreads();
    dn_cumulate(cum);
    // A and Aqk: thread (ti, tj) owns rows ti + 16a, columns tj + 16b (a, b < 4).
    const int ti = tid >> 4, tj = tid & 15;
    float accA[4][4], accQ[4][4];
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b) { accA[a][b] = 0.0f; accQ[a][b] = 0.0f; }
    for (int d = 0; d < Dk; d += 4) { // 16-byte reads: (ti) rows broadcast, (tj) rows conflict-free
        float4 ki[4], qi[4], kj[4];
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            ki[a] = *(const float4*)&ks[(ti + 16 * a) * kp + d];
            qi[a] = *(const float4*)&qs[(ti + 16 * a) * kp + d];
            kj[a] = *(const float4*)&ks[(tj + 16 * a) * kp + d];
        }
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                accA[a][b] = fmaf(ki[a].x, kj[b].x, accA[a][b]);
                accA[a][b] = fmaf(ki[a].y, kj[b].y, accA[a][b]);
                accA[a][b] = fmaf(ki[a].z, kj[b].z, accA[a][b]);
                accA[a][b] = fmaf(ki[a].w, kj[b].w, accA[a][b]);
                accQ[a][b] = fmaf(qi[a].x, kj[b].x, accQ[a][b]);
                accQ[a][b] = fmaf(qi[a].y, kj[b].y, accQ[a][b]);
                accQ[a][b] = fmaf(qi[a].z, kj[b].z, accQ[a][b]);
                accQ[a][b] = fmaf(qi[a].w, kj[b].w, accQ[a][b]);
            }
    }
    __syncthreads(); // cum ready; qs/ks may be overwritten from here on
    float* aqk = (float*)p.aqk_out + ((i64)chunk * p.Hv + h) * DN_CHUNK * DN_CHUNK;
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            const int i = ti + 16 * a, j = tj + 16 * b;
            const bool in = i < L && j < L;
            const float decay = in && j <= i ? expf(cum[i] - cum[j]) : 0.0f;
            As[i * 68 + j] = (in && j < i) ? beta[i] * accA[a][b] * decay : 0.0f; // A_ij = β_i (k_i·k_j) e^{c_i−c_j}
            aqk[i * DN_CHUNK + j] = (in && j <= i) ? accQ[a][b] * decay : 0.0f;   // (q_i·k_j) e^{c_i−c_j}
        }
    // [U | W] rows: v_i and k_i (zeros past L), scaled below
    dn_load_tile(uw, cols, x + (i64)t0 * p.C + v_col, p.C, DN_CHUNK, L, Dv);
    dn_load_tile(uw + Dv, cols, x + (i64)t0 * p.C + k_col, p.C, DN_CHUNK, L, Dk);
    __syncthreads(); // As and the rows complete
    // One thread per column: U_i = β_i v_i, W_i = β_i k_i e^{c_i}, then forward substitution on
    // (I + A): row i −= Σ_{j<i} A_ij row j. Each thread touches only its column: no barrier.
    for (int col = tid; col < cols; col += blockDim.x) {
        for (int i = 0; i < L; ++i) {
            const float v = uw[i * cols + col];
            uw[i * cols + col] = col < Dv ? beta[i] * v : beta[i] * v * expf(cum[i]);
        }
        for (int i = 1; i < L; ++i) {
            // four partial sums (j mod 4): four independent FMA chains instead of one of length i
            float v0 = uw[i * cols + col], v1 = 0.0f, v2 = 0.0f, v3 = 0.0f;
            int j = 0;
            for (; j + 4 <= i; j += 4) {
                const float4 a = *(const float4*)&As[i * 68 + j];
                v0 = fmaf(-a.x, uw[j * cols + col], v0);
                v1 = fmaf(-a.y, uw[(j + 1) * cols + col], v1);
                v2 = fmaf(-a.z, uw[(j + 2) * cols + col], v2);
                v3 = fmaf(-a.w, uw[(j + 3) * cols + col], v3);
            }
            for (; j < i; ++j) v0 = fmaf(-As[i * 68 + j], uw[j * cols + col], v0);
            uw[i * cols + col] = (v0 + v1) + (v2 + v3);
        }
        for (int i = 0; i < L; ++i) {
            const i64 r = (i64)(t0 + i) * p.Hv + h;
            if (col < Dv) ((float*)p.u_out)[r * Dv + col] = uw[i * cols + col];
            else ((float*)p.w_out)[r * Dk + (col - Dv)] = uw[i * cols + col];
        }
    }
    if (tid < L) ((float*)p.gcum_out)[(i64)(t0 + tid) * p.Hv + h] = cum[tid];
}

// ---------------------------------------------------------------- per-chunk UT transform on tensor cores
// prefill_dn_chunk's work in 3xbf16 products (mma.cuh), grid (⌈T/64⌉, Hv), block 256, the same
// params and outputs, for Dk % 16 == 0, Dv % 8 == 0 and Dk + Dv ≤ 256 (8 warps × 4 column tiles):
//   1. K·Kᵀ and Q·Kᵀ (warp → one product's 16 rows × the 64 columns up to the diagonal), masked and
//      decayed in registers: A into shared memory, Aqk to global.
//   2. The UT solve (I + A)·X = [β v | β k e^c] by 16-row blocks: the four 16×16 diagonal blocks
//      inverted on CUDA cores (one thread per column, into A's diagonal), then per block b
//      X_b = (I + A_bb)⁻¹ (RHS_b − Σ_{c<b} A_bc X_c) as products, each warp on its own columns of X
//      (no barriers between blocks), and X_b written to U and W straight from the registers.
// smem: max(2·64·wp, 64·(Dv + Dk + 4)) + 64·72 + 128 floats (87 KiB at Dk = Dv = 128: two blocks/SM).
#define DN_CH_AP 72 // A rows

extern "C" __global__ void __launch_bounds__(256, 2) prefill_dn_chunk_tc(const DnChunkParams p) {
    extern __shared__ __align__(16) float sm[];
    const int chunk = blockIdx.x, h = blockIdx.y, kh = h / (p.Hv / p.Hk);
    const int t0 = chunk * DN_CHUNK, L = min(DN_CHUNK, p.T - t0);
    const int Dk = p.Dk, Dv = p.Dv, wp = dn_pair_pitch(Dk), cols = Dv + Dk, xp = cols + 4;
    const int region = max(2 * DN_CHUNK * wp, DN_CHUNK * xp);
    float* qs = sm;                  // phase 1: [64, wp]
    float* ks = sm + DN_CHUNK * wp;  // phase 1: [64, wp]
    float* X = sm;                   // phase 2: [64, xp] = [v | k] rows, then the solution (aliases qs, ks)
    float* As = sm + region;         // [64, 72]
    float* cum = As + DN_CHUNK * DN_CH_AP; // [64]
    float* beta = cum + DN_CHUNK;    // [64]
    const int tid = threadIdx.x, warp = tid >> 5, g = (tid & 31) >> 2, q = tid & 3;
    const float* x = (const float*)p.qkvc;
    const i64 q_col = (i64)kh * Dk, k_col = (i64)p.Hk * Dk + (i64)kh * Dk, v_col = 2 * (i64)p.Hk * Dk + (i64)h * Dv;

    dn_copy_tile<true>(qs, wp, x + (i64)t0 * p.C + q_col, p.C, DN_CHUNK, L, Dk);
    dn_copy_tile<true>(ks, wp, x + (i64)t0 * p.C + k_col, p.C, DN_CHUNK, L, Dk);
    cp_async_commit();
    dn_chunk_gates(p, t0, L, h, cum, beta);
    __syncthreads();
    dn_cumulate(cum);
    cp_async_wait<0>();
    __syncthreads(); // q, k rows and the cumulative gates

    { // 1. warps 0–3: A = β_i (k_i·k_j) e^{c_i−c_j} (j < i); warps 4–7: Aqk = (q_i·k_j) e^{c_i−c_j} (j ≤ i)
        const bool is_a = warp < 4;
        const int m0 = 16 * (warp & 3), ntl = 2 * (warp & 3) + 2; // n-tiles up to the diagonal block
        const float* Am = is_a ? ks : qs;
        float acc[8][4];
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;
        for (int k0 = 0; k0 < Dk; k0 += 16) {
            const Bf3A a = bf3_frag_a(Am, wp, m0, k0, g, q);
#pragma unroll
            for (int n = 0; n < 8; ++n)
                if (n < ntl) mma_3xbf16(acc[n], a, bf3_frag_b_nk(ks, wp, k0, 8 * n, g, q));
        }
        float* aqk = (float*)p.aqk_out + ((i64)chunk * p.Hv + h) * DN_CHUNK * DN_CHUNK;
#pragma unroll
        for (int n = 0; n < 8; ++n) {
            if (n >= ntl) continue;
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int i = m0 + g + 8 * hf, j = 8 * n + 2 * q;
                float v[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int jj = j + e;
                    const bool in = i < L && jj < L && (is_a ? jj < i : jj <= i);
                    v[e] = in ? acc[n][2 * hf + e] * expf(cum[i] - cum[jj]) * (is_a ? beta[i] : 1.0f) : 0.0f;
                }
                if (is_a) *(float2*)&As[i * DN_CH_AP + j] = make_float2(v[0], v[1]);
                else *(float2*)&aqk[i * DN_CHUNK + j] = make_float2(v[0], v[1]);
            }
        }
    }
    __syncthreads(); // A complete; q, k free

    // the right-hand sides' raw rows [v | k] (scaled when they are read), while the diagonal blocks invert
    dn_copy_tile<true>(X, xp, x + (i64)t0 * p.C + v_col, p.C, DN_CHUNK, L, Dv);
    dn_copy_tile<true>(X + Dv, xp, x + (i64)t0 * p.C + k_col, p.C, DN_CHUNK, L, Dk);
    cp_async_commit();
    if (tid < DN_CHUNK) { // (I + A_bb)⁻¹, column c of block b: x_c = 1, x_i = −Σ_{c≤j<i} A_ij x_j
        const int b = tid >> 4, c = tid & 15;
        const float* Ab = As + (16 * b) * DN_CH_AP + 16 * b;
        float xc[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            float v = i == c ? 1.0f : 0.0f;
            if (i > c) {
#pragma unroll
                for (int j = 0; j < i; ++j)
                    if (j >= c) v = fmaf(-Ab[i * DN_CH_AP + j], xc[j], v);
            }
            xc[i] = v;
        }
        __syncwarp(); // (threads 0–63: warps 0–1) every read of this block's A done before the writes
        float* Ib = As + (16 * b) * DN_CH_AP + 16 * b;
#pragma unroll
        for (int i = 0; i < 16; ++i) Ib[i * DN_CH_AP + c] = xc[i];
    }
    cp_async_wait<0>();
    __syncthreads(); // the inverses and the raw rows

    // 2. each warp its n-tiles of 8 columns of X: nt = warp + 8r
    const int ncols8 = cols >> 3, nblocks = (L + 15) >> 4;
    for (int b = 0; b < nblocks; ++b) {
        float acc[4][4];
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[r][e] = 0.0f;
        for (int c = 0; c < b; ++c) { // Σ_{c<b} A_bc X_c
            const Bf3A a = bf3_frag_a(As, DN_CH_AP, 16 * b, 16 * c, g, q);
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int nt = warp + 8 * r;
                if (nt < ncols8) mma_3xbf16(acc[r], a, bf3_frag_b_kn(X, xp, 16 * c, 8 * nt, g, q));
            }
        }
        // R_b = RHS_b − Σ, over the raw rows of block b (each warp only touches its own columns)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int nt = warp + 8 * r;
            if (nt >= ncols8) continue;
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int i = 16 * b + g + 8 * hf, j = 8 * nt + 2 * q; // j, j + 1 on the same side of Dv
                const float sc = beta[i] * (j < Dv ? 1.0f : expf(cum[i]));
                float2* px = (float2*)&X[i * xp + j];
                const float2 raw = *px;
                *px = make_float2(sc * raw.x - acc[r][2 * hf], sc * raw.y - acc[r][2 * hf + 1]);
            }
        }
        __syncwarp();
        const Bf3A ainv = bf3_frag_a(As, DN_CH_AP, 16 * b, 16 * b, g, q);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int nt = warp + 8 * r;
            if (nt >= ncols8) continue;
            float xb[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mma_3xbf16(xb, ainv, bf3_frag_b_kn(X, xp, 16 * b, 8 * nt, g, q));
            acc[r][0] = xb[0]; acc[r][1] = xb[1]; acc[r][2] = xb[2]; acc[r][3] = xb[3];
        }
        __syncwarp(); // every lane's reads of R_b done
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int nt = warp + 8 * r;
            if (nt >= ncols8) continue;
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int i = 16 * b + g + 8 * hf, j = 8 * nt + 2 * q;
                const float2 v = make_float2(acc[r][2 * hf], acc[r][2 * hf + 1]);
                *(float2*)&X[i * xp + j] = v;
                if (i < L) {
                    const i64 row = (i64)(t0 + i) * p.Hv + h;
                    if (j < Dv) *(float2*)&((float*)p.u_out)[row * Dv + j] = v;
                    else *(float2*)&((float*)p.w_out)[row * Dk + (j - Dv)] = v;
                }
            }
        }
        __syncwarp();
    }
    if (tid < L) ((float*)p.gcum_out)[(i64)(t0 + tid) * p.Hv + h] = cum[tid];
}

// ---------------------------------------------------------------- sequential scan over chunks
struct DnScanParams {
    u64 qkvc;      // [T, C] conv output (q, k)
    u64 w_in;      // [T, Hv, Dk]
    u64 u_in;      // [T, Hv, Dv]
    u64 aqk_in;    // [NC, Hv, 64, 64]
    u64 gcum_in;   // [T, Hv]
    u64 state;     // [Hv, Dv, Dk] f32, in/out
    u64 o_out;     // [T, Hv, Dv]
    int T, C, Hk, Hv, Dk, Dv;
};

extern "C" __global__ void __launch_bounds__(256, 1) prefill_dn_scan(const DnScanParams p) {
    extern __shared__ __align__(16) float sm[];
    const int h = blockIdx.y, kh = h / (p.Hv / p.Hk), j0 = blockIdx.x * DN_BV;
    const int Dk = p.Dk, Dv = p.Dv, kp = Dk + 4, bv = min(DN_BV, Dv - j0); // rows of Dk + 4 floats:
    float* Ws = sm;                        // [64, Dk+4]    16-byte aligned, and the 8 rows of one
    float* qs = Ws + DN_CHUNK * kp;        // [64, Dk+4]    16-byte read phase fall in distinct slots
    float* ks = qs + DN_CHUNK * kp;        // [64, Dk+4]
    float* S = ks + DN_CHUNK * kp;         // [32, Dk+4]: S[j][d] = state column j0+j
    float* Us = S + DN_BV * kp;            // [64, 33]
    float* vn = Us + DN_CHUNK * 33;        // [64, 36]
    float* Aq = vn + DN_CHUNK * 36;        // [64, 65]
    float* cum = Aq + DN_CHUNK * 65;       // [64]
    float* ek = cum + DN_CHUNK;            // [64] e^{c_L − c_i}
    const int tid = threadIdx.x;
    const float* x = (const float*)p.qkvc;
    float* state = (float*)p.state + ((i64)h * Dv + j0) * Dk;
    const i64 q_col = (i64)kh * Dk, k_col = (i64)p.Hk * Dk + (i64)kh * Dk;

    for (int i = tid; i < DN_BV * Dk; i += blockDim.x) {
        const int j = i / Dk, d = i - j * Dk;
        S[j * kp + d] = j < bv ? state[(i64)j * Dk + d] : 0.0f;
    }
    for (int i = tid; i < DN_CHUNK * 33; i += blockDim.x) Us[i] = 0.0f; // columns ≥ bv stay zero
    const int ti = tid >> 4, tj = tid & 15;  // (v', o): rows ti + 16a, columns tj + 16b
    const int jg = tid >> 5, dl = tid & 31;  // (S): columns 4·jg + e, key dims dl + 32f
    const int nchunks = (p.T + DN_CHUNK - 1) / DN_CHUNK;
    // The next chunk's tiles are copied while this one computes (no second buffer: each tile is
    // refilled once its last reader of this chunk has passed a barrier): W, q, U after the v' phase
    // (cp.async group 1), k and Aqk after the state update (group 2, waited for only before the o phase).
    auto copy_wqu = [&](int chunk) {
        if (chunk < nchunks) {
            const int t0 = chunk * DN_CHUNK, L = min(DN_CHUNK, p.T - t0);
            dn_copy_tile<true>(Ws, kp, (const float*)p.w_in + ((i64)t0 * p.Hv + h) * Dk, (i64)p.Hv * Dk, DN_CHUNK, L, Dk);
            dn_copy_tile<true>(qs, kp, x + (i64)t0 * p.C + q_col, p.C, DN_CHUNK, L, Dk);
            dn_copy_tile<false>(Us, 33, (const float*)p.u_in + ((i64)t0 * p.Hv + h) * Dv + j0, (i64)p.Hv * Dv, DN_CHUNK, L, bv);
        }
        cp_async_commit();
    };
    auto copy_k_aqk = [&](int chunk) {
        if (chunk < nchunks) {
            const int t0 = chunk * DN_CHUNK, L = min(DN_CHUNK, p.T - t0);
            dn_copy_tile<true>(ks, kp, x + (i64)t0 * p.C + k_col, p.C, DN_CHUNK, L, Dk);
            dn_copy_tile<false>(Aq, 65, (const float*)p.aqk_in + ((i64)chunk * p.Hv + h) * DN_CHUNK * DN_CHUNK, DN_CHUNK,
                                DN_CHUNK, DN_CHUNK, DN_CHUNK);
        }
        cp_async_commit();
    };
    __syncthreads(); // Us zeroed before its copies land
    copy_wqu(0);
    copy_k_aqk(0);
    for (int chunk = 0; chunk < nchunks; ++chunk) {
        const int t0 = chunk * DN_CHUNK, L = min(DN_CHUNK, p.T - t0);
        if (tid < DN_CHUNK) cum[tid] = tid < L ? ((const float*)p.gcum_in)[(i64)(t0 + tid) * p.Hv + h] : 0.0f;
        cp_async_wait<1>(); // this chunk's W, q, U (k and Aqk may still be in flight)
        __syncthreads();
        const float c_last = cum[L - 1];
        if (tid < DN_CHUNK) ek[tid] = tid < L ? expf(c_last - cum[tid]) : 0.0f;

        // v'_ij = U_ij − Σ_d W_id S_jd, and q_i·S_j (old state, for o), four key dims per step
        float acc[4][2], qsum[4][2];
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int b = 0; b < 2; ++b) { acc[a][b] = 0.0f; qsum[a][b] = 0.0f; }
        for (int d = 0; d < Dk; d += 4) {
            float4 wv[4], qv[4], sv[2];
#pragma unroll
            for (int a = 0; a < 4; ++a) {
                wv[a] = *(const float4*)&Ws[(ti + 16 * a) * kp + d];
                qv[a] = *(const float4*)&qs[(ti + 16 * a) * kp + d];
            }
#pragma unroll
            for (int b = 0; b < 2; ++b) sv[b] = *(const float4*)&S[(tj + 16 * b) * kp + d];
#pragma unroll
            for (int a = 0; a < 4; ++a)
#pragma unroll
                for (int b = 0; b < 2; ++b) {
                    acc[a][b] = fmaf(wv[a].x, sv[b].x, acc[a][b]);
                    acc[a][b] = fmaf(wv[a].y, sv[b].y, acc[a][b]);
                    acc[a][b] = fmaf(wv[a].z, sv[b].z, acc[a][b]);
                    acc[a][b] = fmaf(wv[a].w, sv[b].w, acc[a][b]);
                    qsum[a][b] = fmaf(qv[a].x, sv[b].x, qsum[a][b]);
                    qsum[a][b] = fmaf(qv[a].y, sv[b].y, qsum[a][b]);
                    qsum[a][b] = fmaf(qv[a].z, sv[b].z, qsum[a][b]);
                    qsum[a][b] = fmaf(qv[a].w, sv[b].w, qsum[a][b]);
                }
        }
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int b = 0; b < 2; ++b) {
                const int i = ti + 16 * a, j = tj + 16 * b;
                vn[i * 36 + j] = Us[i * 33 + j] - acc[a][b];
            }
        cp_async_wait<0>(); // this chunk's k and Aqk
        __syncthreads();    // v' complete; W, q, U free
        copy_wqu(chunk + 1);
        // o_ij = e^{c_i} q_i·S_j + Σ_l Aqk_il v'_lj  (Aqk is zero above the diagonal and past L)
        float o[4][2];
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            const float ec = expf(cum[ti + 16 * a]);
            o[a][0] = ec * qsum[a][0];
            o[a][1] = ec * qsum[a][1];
        }
        for (int l = 0; l < L; ++l) {
            const float v0 = vn[l * 36 + tj], v1 = vn[l * 36 + tj + 16];
#pragma unroll
            for (int a = 0; a < 4; ++a) {
                const float aq = Aq[(ti + 16 * a) * 65 + l];
                o[a][0] = fmaf(aq, v0, o[a][0]);
                o[a][1] = fmaf(aq, v1, o[a][1]);
            }
        }
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            const int i = ti + 16 * a;
#pragma unroll
            for (int b = 0; b < 2; ++b) {
                const int j = tj + 16 * b;
                if (i < L && j < bv) ((float*)p.o_out)[((i64)(t0 + i) * p.Hv + h) * Dv + j0 + j] = o[a][b];
            }
        }
        // S_jd ← e^{c_L} S_jd + Σ_i (e^{c_L−c_i} k_id) v'_ij   (every read of S above finished before
        // the last barrier)
        const float decay = expf(c_last);
        float sa[4][4]; // [f][e]: key dim dl + 32f, column 4·jg + e
#pragma unroll
        for (int f = 0; f < 4; ++f)
#pragma unroll
            for (int e = 0; e < 4; ++e) sa[f][e] = (f * 32 + dl < Dk) ? S[(4 * jg + e) * kp + f * 32 + dl] * decay : 0.0f;
        for (int i = 0; i < L; ++i) {
            const float4 v4 = *(const float4*)&vn[i * 36 + 4 * jg]; // broadcast within the warp
            const float e_i = ek[i];
#pragma unroll
            for (int f = 0; f < 4; ++f) {
                if (f * 32 + dl < Dk) {
                    const float kd = ks[i * kp + f * 32 + dl] * e_i;
                    sa[f][0] = fmaf(kd, v4.x, sa[f][0]);
                    sa[f][1] = fmaf(kd, v4.y, sa[f][1]);
                    sa[f][2] = fmaf(kd, v4.z, sa[f][2]);
                    sa[f][3] = fmaf(kd, v4.w, sa[f][3]);
                }
            }
        }
#pragma unroll
        for (int f = 0; f < 4; ++f)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (f * 32 + dl < Dk) S[(4 * jg + e) * kp + f * 32 + dl] = sa[f][e];
        __syncthreads(); // o and the update done with k, Aqk, v', cum
        copy_k_aqk(chunk + 1);
    }
    cp_async_wait<0>();
    __syncthreads();
    for (int i = tid; i < bv * Dk; i += blockDim.x) {
        const int j = i / Dk, d = i - j * Dk;
        state[(i64)j * Dk + d] = S[j * kp + d];
    }
}

// ---------------------------------------------------------------- the scan on tensor cores
// prefill_dn_scan's work split as FLA's chunked kernels split it, on tensor cores in 3xbf16 (mma.cuh:
// ~2⁻¹⁷ relative per product, near f32; the state must agree with the decode kernel's):
//   prefill_dn_states  the sequential part only: per chunk v' = U − W·Sᵀ (written over U) and
//                      S ← e^{c_L} S + (v'·e^{c_L−c})ᵀ k, and the state before each chunk (h) saved.
//   prefill_dn_out     parallel over (chunk, head, 64 value columns): o = e^{c} ⊙ q·hᵀ + Aqk·v'.
// Pitches (floats) as mma.cuh's fragment loaders want them: rows read in pairs along k (W, q, h,
// Aqk) ⌈·/32⌉·32 + 8; tiles read down columns (k, v') ≡ 4 mod 8. Both need Dk % 16 == 0, Dk ≤ 128.
#define DN_ST_WARPS 16 // prefill_dn_states' warps, 8 or 16 (deltanet_prefill.rs STATES_THREADS)
#define DN_TC_UP 40  // U rows (16-byte copies)
#define DN_TC_VP 36  // v' rows in prefill_dn_states
#define DN_OUT_BV 64
#define DN_OUT_AP 72 // Aqk rows
#define DN_OUT_VP 68 // v' rows in prefill_dn_out


struct DnStatesParams {
    u64 qkvc;    // [T, C] conv output (k)
    u64 w_in;    // [T, Hv, Dk]
    u64 u_io;    // [T, Hv, Dv]: U in, v' out
    u64 gcum_in; // [T, Hv]
    u64 state;   // [Hv, Dv, Dk] f32, in/out
    u64 h_out;   // [NC, Hv, Dv, Dk]: the state before each chunk
    int T, C, Hk, Hv, Dk, Dv;
};

// grid (⌈Dv/32⌉, Hv), block 32·DN_ST_WARPS (16 warps, lane = 4g + q), one block per SM. Per chunk,
// between two barriers: phase A, v' (warp → 16 token rows × 8 columns, K = Dk), then phase B, the
// state update (the S tiles live in registers as f32: warp → 16 columns j × 2 n-tiles of 8 key
// dims, n-tile (warp/2) + 8r), after which S is published to shared memory as packed bf16 hi and
// lo pairs (the B fragments of the next chunk's phase A). 16 warps instead of 8 halve each warp's
// chain of dependent products: the recurrence is latency-bound (one block per head slice, one chunk
// after another). The next chunk's W, k, U and gates are copied into the other buffer while this
// one computes. smem: 2·64·(wp + Dk + 4 + 40) + 64·36 + 192 floats + 2·32·(⌈Dk/16⌉·8 + 4) words,
// wp = ⌈Dk/32⌉·32 + 8 (181 KiB at Dk 128).
extern "C" __global__ void __launch_bounds__(32 * DN_ST_WARPS, 1) prefill_dn_states(const DnStatesParams p) {
    extern __shared__ __align__(16) float sm[];
    const int h = blockIdx.y, kh = h / (p.Hv / p.Hk), j0 = blockIdx.x * DN_BV;
    const int Dk = p.Dk, Dv = p.Dv, bv = min(DN_BV, Dv - j0);
    const int wp = dn_pair_pitch(Dk), kp = Dk + 4, sp = ((Dk / 2 + 7) & ~7) + 4, ntiles = Dk >> 3;
    float* Ws = sm;                            // [2][64, wp]
    float* ks = Ws + 2 * DN_CHUNK * wp;        // [2][64, kp]
    float* Us = ks + 2 * DN_CHUNK * kp;        // [2][64, 40]
    float* vn = Us + 2 * DN_CHUNK * DN_TC_UP;  // [64, 36]  v'
    float* cum = vn + DN_CHUNK * DN_TC_VP;     // [2][64]
    float* ek = cum + 2 * DN_CHUNK;            // [64] e^{c_L − c_i}
    u32* Shi = (u32*)(ek + DN_CHUNK);          // [32, sp]  (S[j][d], S[j][d+1]) bf16 hi pair
    u32* Slo = Shi + DN_BV * sp;               // [32, sp]  … lo pair
    const int tid = threadIdx.x, warp = tid >> 5, g = (tid & 31) >> 2, q = tid & 3;
    const float* x = (const float*)p.qkvc;
    float* u_io = (float*)p.u_io;
    float* state = (float*)p.state + ((i64)h * Dv + j0) * Dk;
    const i64 k_col = (i64)p.Hk * Dk + (i64)kh * Dk;

    // This warp's S tiles: columns j = 16·(warp & 1) + g (+8), key dims d = 8·nt + 2q (+1),
    // nt = (warp >> 1) + (NW/2)·r. Element e of tile r: j + 8·(e >> 1), d + (e & 1).
    constexpr int NW = DN_ST_WARPS, ST = 32 / NW, AT = 16 / NW; // S tiles, v' tiles per warp
    const int s_m0 = 16 * (warp & 1);
    float s_reg[ST][4];
    auto publish_s = [&]() {
#pragma unroll
        for (int r = 0; r < ST; ++r) {
            const int nt = (warp >> 1) + (NW / 2) * r;
            if (nt < ntiles)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int j = s_m0 + g + 8 * hf, dp = 4 * nt + q; // pair (d, d + 1) = 2·dp
                    bf3_split(s_reg[r][2 * hf], s_reg[r][2 * hf + 1], Shi[j * sp + dp], Slo[j * sp + dp]);
                }
        }
    };
#pragma unroll
    for (int r = 0; r < ST; ++r) {
        const int nt = (warp >> 1) + (NW / 2) * r;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int j = s_m0 + g + 8 * (e >> 1), d = 8 * nt + 2 * q + (e & 1);
            s_reg[r][e] = (nt < ntiles && j < bv) ? state[(i64)j * Dk + d] : 0.0f;
        }
    }
    publish_s();
    for (int i = tid; i < 2 * DN_CHUNK * DN_TC_UP; i += blockDim.x) Us[i] = 0.0f; // columns ≥ bv stay zero
    const int nchunks = (p.T + DN_CHUNK - 1) / DN_CHUNK;
    auto copy_chunk = [&](int chunk) {
        if (chunk < nchunks) {
            const int b = chunk & 1, t0 = chunk * DN_CHUNK, L = min(DN_CHUNK, p.T - t0);
            dn_copy_tile<true>(Ws + b * DN_CHUNK * wp, wp, (const float*)p.w_in + ((i64)t0 * p.Hv + h) * Dk,
                               (i64)p.Hv * Dk, DN_CHUNK, L, Dk);
            dn_copy_tile<true>(ks + b * DN_CHUNK * kp, kp, x + (i64)t0 * p.C + k_col, p.C, DN_CHUNK, L, Dk);
            dn_copy_tile<true>(Us + b * DN_CHUNK * DN_TC_UP, DN_TC_UP, u_io + ((i64)t0 * p.Hv + h) * Dv + j0,
                               (i64)p.Hv * Dv, DN_CHUNK, L, bv);
            if (tid < DN_CHUNK)
                cp_async4(smem_addr(cum + b * DN_CHUNK + tid),
                          (const float*)p.gcum_in + (i64)(t0 + min(tid, L - 1)) * p.Hv + h, tid < L ? 4 : 0);
        }
        cp_async_commit();
    };
    __syncthreads(); // Us zeroed before its copies land
    copy_chunk(0);
    for (int chunk = 0; chunk < nchunks; ++chunk) {
        const int b = chunk & 1, t0 = chunk * DN_CHUNK, L = min(DN_CHUNK, p.T - t0);
        const float* W = Ws + b * DN_CHUNK * wp;
        const float* K = ks + b * DN_CHUNK * kp;
        const float* U = Us + b * DN_CHUNK * DN_TC_UP;
        const float* cm = cum + b * DN_CHUNK;
        cp_async_wait<0>(); // this chunk's tiles (the only group in flight)
        __syncthreads();    // … landed for every thread; the last chunk's phase B is done with the other buffer
        copy_chunk(chunk + 1);
        { // the state before this chunk, for prefill_dn_out
            float* hs = (float*)p.h_out + (((i64)chunk * p.Hv + h) * Dv + j0) * Dk;
#pragma unroll
            for (int r = 0; r < ST; ++r) {
                const int nt = (warp >> 1) + (NW / 2) * r;
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int j = s_m0 + g + 8 * hf, d = 8 * nt + 2 * q;
                    if (nt < ntiles && j < bv) *(float2*)&hs[(i64)j * Dk + d] = make_float2(s_reg[r][2 * hf], s_reg[r][2 * hf + 1]);
                }
            }
        }
        const float c_last = cm[L - 1];
        if (tid < DN_CHUNK) ek[tid] = tid < L ? expf(c_last - cm[tid]) : 0.0f;

        { // phase A: v' = U − W·Sᵀ, rows 16·(warp / (NW/4)), columns n0 + 8n (n < AT)
            const int m0 = 16 * (warp / (NW / 4)), n0 = 8 * AT * (warp % (NW / 4));
            float acc[AT][4];
#pragma unroll
            for (int n = 0; n < AT; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;
#pragma unroll 2
            for (int k0 = 0; k0 < Dk; k0 += 16) {
                const Bf3A a = bf3_frag_a(W, wp, m0, k0, g, q);
#pragma unroll
                for (int n = 0; n < AT; ++n) {
                    const int o = (n0 + 8 * n + g) * sp + k0 / 2 + q; // Sᵀ as B: B[d][j] = S[j][d]
                    Bf3B bf;
                    bf.hi[0] = Shi[o];
                    bf.hi[1] = Shi[o + 4];
                    bf.lo[0] = Slo[o];
                    bf.lo[1] = Slo[o + 4];
                    mma_3xbf16(acc[n], a, bf);
                }
            }
#pragma unroll
            for (int n = 0; n < AT; ++n)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int i = m0 + g + 8 * hf, j = n0 + 8 * n + 2 * q;
                    const float2 u = *(const float2*)&U[i * DN_TC_UP + j];
                    const float2 v = make_float2(u.x - acc[n][2 * hf], u.y - acc[n][2 * hf + 1]);
                    *(float2*)&vn[i * DN_TC_VP + j] = v;
                    if (i < L && j < bv) *(float2*)&u_io[((i64)(t0 + i) * p.Hv + h) * Dv + j0 + j] = v;
                }
        }
        __syncthreads(); // v' and ek complete; the S planes free

        { // phase B: S ← e^{c_L} S + Σ_i (v'_ij e^{c_L−c_i}) k_id; rows ≥ L of v' are zero (so is ek)
            const float decay = expf(c_last);
#pragma unroll
            for (int r = 0; r < ST; ++r)
#pragma unroll
                for (int e = 0; e < 4; ++e) s_reg[r][e] *= decay;
#pragma unroll 2
            for (int k0 = 0; k0 < L; k0 += 16) {
                const Bf3A a = bf3_frag_at(vn, DN_TC_VP, ek, s_m0, k0, g, q);
#pragma unroll
                for (int r = 0; r < ST; ++r) {
                    const int nt = (warp >> 1) + (NW / 2) * r;
                    if (nt < ntiles) mma_3xbf16(s_reg[r], a, bf3_frag_b_kn(K, kp, k0, 8 * nt, g, q));
                }
            }
        }
        publish_s(); // phase A's reads of the planes finished before the last barrier
    }
    cp_async_wait<0>();
#pragma unroll
    for (int r = 0; r < ST; ++r) {
        const int nt = (warp >> 1) + (NW / 2) * r;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int j = s_m0 + g + 8 * (e >> 1), d = 8 * nt + 2 * q + (e & 1);
            if (nt < ntiles && j < bv) state[(i64)j * Dk + d] = s_reg[r][e];
        }
    }
}

struct DnOutParams {
    u64 qkvc;    // [T, C] conv output (q)
    u64 v_in;    // [T, Hv, Dv] v'
    u64 aqk_in;  // [NC, Hv, 64, 64]
    u64 gcum_in; // [T, Hv]
    u64 h_in;    // [NC, Hv, Dv, Dk]
    u64 o_out;   // [T, Hv, Dv]
    int T, C, Hk, Hv, Dk, Dv;
};

// grid (NC, Hv, ⌈Dv/64⌉), block 256: o_ij = e^{c_i} q_i·h_j + Σ_l Aqk_il v'_lj for one chunk, one
// head and 64 value columns; warp → 16 token rows × 32 columns. Columns ≥ Dv of h and v' are not
// loaded: they only reach output columns that are not stored. smem: 2·64·wp + 64·(72 + 68) + 64
// floats (103 KiB at Dk 128: two blocks per SM).
extern "C" __global__ void __launch_bounds__(256) prefill_dn_out(const DnOutParams p) {
    extern __shared__ __align__(16) float sm[];
    const int chunk = blockIdx.x, h = blockIdx.y, kh = h / (p.Hv / p.Hk), j0 = blockIdx.z * DN_OUT_BV;
    const int Dk = p.Dk, Dv = p.Dv, bv = min(DN_OUT_BV, Dv - j0), wp = dn_pair_pitch(Dk);
    const int t0 = chunk * DN_CHUNK, L = min(DN_CHUNK, p.T - t0);
    float* qs = sm;                         // [64, wp]
    float* hs = qs + DN_CHUNK * wp;         // [64, wp]: h[j][d]
    float* Aq = hs + DN_OUT_BV * wp;        // [64, 72]
    float* vs = Aq + DN_CHUNK * DN_OUT_AP;  // [64, 68]
    float* cum = vs + DN_CHUNK * DN_OUT_VP; // [64]
    const int tid = threadIdx.x, warp = tid >> 5, g = (tid & 31) >> 2, q = tid & 3;
    dn_copy_tile<true>(qs, wp, (const float*)p.qkvc + (i64)t0 * p.C + (i64)kh * Dk, p.C, DN_CHUNK, L, Dk);
    dn_copy_tile<true>(hs, wp, (const float*)p.h_in + (((i64)chunk * p.Hv + h) * Dv + j0) * Dk, Dk, DN_OUT_BV, bv, Dk);
    dn_copy_tile<true>(Aq, DN_OUT_AP, (const float*)p.aqk_in + ((i64)chunk * p.Hv + h) * DN_CHUNK * DN_CHUNK, DN_CHUNK,
                       DN_CHUNK, DN_CHUNK, DN_CHUNK);
    dn_copy_tile<true>(vs, DN_OUT_VP, (const float*)p.v_in + ((i64)t0 * p.Hv + h) * Dv + j0, (i64)p.Hv * Dv, DN_CHUNK,
                       L, bv);
    cp_async_commit();
    if (tid < DN_CHUNK) cum[tid] = tid < L ? ((const float*)p.gcum_in)[(i64)(t0 + tid) * p.Hv + h] : 0.0f;
    cp_async_wait<0>();
    __syncthreads();

    const int m0 = 16 * (warp >> 1), n0 = 32 * (warp & 1);
    float o[4][4];
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[n][e] = 0.0f;
#pragma unroll 2
    for (int k0 = 0; k0 < Dk; k0 += 16) {
        const Bf3A a = bf3_frag_a(qs, wp, m0, k0, g, q);
#pragma unroll
        for (int n = 0; n < 4; ++n) mma_3xbf16(o[n], a, bf3_frag_b_nk(hs, wp, k0, n0 + 8 * n, g, q));
    }
    const float ec0 = expf(cum[m0 + g]), ec1 = expf(cum[m0 + g + 8]);
#pragma unroll
    for (int n = 0; n < 4; ++n) {
        o[n][0] *= ec0; o[n][1] *= ec0;
        o[n][2] *= ec1; o[n][3] *= ec1;
    }
    const int kend = min(m0 + 16, L); // Aqk is zero above the diagonal and past L
    for (int k0 = 0; k0 < kend; k0 += 16) {
        const Bf3A a = bf3_frag_a(Aq, DN_OUT_AP, m0, k0, g, q);
#pragma unroll
        for (int n = 0; n < 4; ++n) mma_3xbf16(o[n], a, bf3_frag_b_kn(vs, DN_OUT_VP, k0, n0 + 8 * n, g, q));
    }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int i = m0 + g + 8 * hf;
        if (i >= L) continue;
        float* orow = (float*)p.o_out + ((i64)(t0 + i) * p.Hv + h) * Dv + j0;
#pragma unroll
        for (int n = 0; n < 4; ++n) {
            const int j = n0 + 8 * n + 2 * q;
            if (j < bv) *(float2*)&orow[j] = make_float2(o[n][2 * hf], o[n][2 * hf + 1]);
        }
    }
}

// ---------------------------------------------------------------- gated RMSNorm → planes
struct DnNormParams {
    u64 o;       // [T, Hv, Dv]
    u64 z;       // [T, Hv·Dv]
    u64 norm_w;  // [Dv]
    u64 out_hi, out_lo; // [T, Hv·Dv] bf16 planes (either may be 0)
    int T, Hv, Dv;
    float eps;
    u64 out_f16;        // [T, Hv·Dv] f16 or 0
};

extern "C" __global__ void __launch_bounds__(256) prefill_dn_norm(const DnNormParams p) {
    const int lane = threadIdx.x & 31;
    const i64 row = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); // (token, head)
    if (row >= (i64)p.T * p.Hv) return;
    const float* o = (const float*)p.o + row * p.Dv;
    const float* z = (const float*)p.z + row * p.Dv;
    float ss = 0.0f;
    for (int j = lane; j < p.Dv; j += 32) ss += o[j] * o[j];
    const float inv = 1.0f / sqrtf(warp_sum(ss) / (float)p.Dv + p.eps);
    const float* w = (const float*)p.norm_w;
    for (int j = lane; j < p.Dv; j += 32)
        store_act((u16*)p.out_hi, (u16*)p.out_lo, (u16*)p.out_f16, row * p.Dv + j, w[j] * (o[j] * inv) * silu_f(z[j]));
}

static_assert(sizeof(DnConvParams) == 72, "DnConvParams layout differs from its Rust twin");
static_assert(sizeof(DnRingParams) == 32, "DnRingParams layout differs from its Rust twin");
static_assert(sizeof(DnChunkParams) == 96, "DnChunkParams layout differs from its Rust twin");
static_assert(sizeof(DnScanParams) == 80, "DnScanParams layout differs from its Rust twin");
static_assert(sizeof(DnStatesParams) == 72, "DnStatesParams layout differs from its Rust twin");
static_assert(sizeof(DnOutParams) == 72, "DnOutParams layout differs from its Rust twin");
static_assert(sizeof(DnNormParams) == 64, "DnNormParams layout differs from its Rust twin");
