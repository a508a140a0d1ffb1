// deltanet_prefill.cu: the Gated DeltaNet core for a prompt of T tokens at positions p0..p0+T, in
// the chunked (UT/WY) form, f32 throughout (the state must agree with the decode kernel's).
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
//                     substitution with one thread per column of [U | W] (no barriers); parallel
//                     over chunks. smem max(2·64·(Dk+1), 64·(Dv+Dk)) + 64·65 + 128 floats.
//   prefill_dn_scan   grid (⌈Dv/32⌉, Hv), block 256: the only sequential part — the state tile
//                     S [32, Dk] in smem, chunk after chunk: v', o, S update.
//   prefill_dn_norm   grid ⌈T·Hv/8⌉, block 256: gated RMSNorm, one warp per (token, head) → bf16
//                     planes for out_proj.
// FLOPs per (chunk, head) ≈ 2·64·64·Dk·2 (A, Aqk) + 64²·(Dv+Dk) (solve) + 3·2·64·Dk·Dv (scan).
// Bytes: qkv and conv output read ~3×, W/U/Aqk written once and read once (f32).

#define DN_CHUNK 64
#define DN_MAX_K 8
#define DN_BV 32

__device__ __forceinline__ float dn_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }
__device__ __forceinline__ int dn_slot(int pos, int K) { return ((pos % K) + K) % K; }

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
        for (int i = 0; i < L; ++i) {
            win[DN_MAX_K - 1] = qkv[(i64)(t0 + i) * p.C + c];
            float acc = 0.0f;
#pragma unroll
            for (int u = 0; u < DN_MAX_K; ++u) acc += w[u] * win[u];
            tile[i * pitch + j] = silu_f(acc);
#pragma unroll
            for (int u = 0; u < DN_MAX_K - 1; ++u) win[u] = win[u + 1];
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

extern "C" __global__ void __launch_bounds__(256) prefill_dn_chunk(const DnChunkParams p) {
    extern __shared__ float sm[];
    const int chunk = blockIdx.x, h = blockIdx.y, kh = h / (p.Hv / p.Hk);
    const int t0 = chunk * DN_CHUNK, L = min(DN_CHUNK, p.T - t0);
    const int Dk = p.Dk, Dv = p.Dv, kp = Dk + 1, cols = Dv + Dk;
    const int region = max(2 * DN_CHUNK * kp, DN_CHUNK * cols);
    float* qs = sm;                     // phase 1: [64, Dk+1]
    float* ks = sm + DN_CHUNK * kp;     // phase 1: [64, Dk+1]
    float* uw = sm;                     // phase 2: [64, Dv+Dk] (aliases qs, ks)
    float* As = sm + region;            // [64, 65]
    float* cum = As + DN_CHUNK * 65;    // [64]
    float* beta = cum + DN_CHUNK;       // [64]
    const int tid = threadIdx.x;
    const float* x = (const float*)p.qkvc;
    const i64 q_col = (i64)kh * Dk, k_col = (i64)p.Hk * Dk + (i64)kh * Dk, v_col = 2 * (i64)p.Hk * Dk + (i64)h * Dv;

    if (tid < DN_CHUNK) {
        float g = 0.0f, bt = 0.0f;
        if (tid < L) {
            const i64 r = (i64)(t0 + tid) * p.Hv + h;
            const float a = ((const float*)p.a)[r] + ((const float*)p.dt_bias)[h];
            g = -expf(((const float*)p.a_log)[h]) * dn_softplus(a);
            bt = sigmoid_f(((const float*)p.b)[r]);
        }
        cum[tid] = g; // log decay, summed below
        beta[tid] = bt;
    }
    for (int i = tid; i < DN_CHUNK * Dk; i += blockDim.x) {
        const int r = i / Dk, d = i - r * Dk;
        const bool valid = r < L;
        qs[r * kp + d] = valid ? x[(i64)(t0 + r) * p.C + q_col + d] : 0.0f;
        ks[r * kp + d] = valid ? x[(i64)(t0 + r) * p.C + k_col + d] : 0.0f;
    }
    __syncthreads();
    if (tid == 0) { // c_i = Σ_{j≤i} g_j, in order (as the CPU)
        float run = 0.0f;
        for (int i = 0; i < DN_CHUNK; ++i) { run += cum[i]; cum[i] = run; }
    }
    // A and Aqk: thread (ti, tj) owns rows ti + 16a, columns tj + 16b (a, b < 4).
    const int ti = tid >> 4, tj = tid & 15;
    float accA[4][4], accQ[4][4];
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b) { accA[a][b] = 0.0f; accQ[a][b] = 0.0f; }
    for (int d = 0; d < Dk; ++d) {
        float ki[4], qi[4], kj[4];
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            ki[a] = ks[(ti + 16 * a) * kp + d];
            qi[a] = qs[(ti + 16 * a) * kp + d];
            kj[a] = ks[(tj + 16 * a) * kp + d];
        }
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                accA[a][b] = fmaf(ki[a], kj[b], accA[a][b]);
                accQ[a][b] = fmaf(qi[a], kj[b], accQ[a][b]);
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
            As[i * 65 + j] = (in && j < i) ? beta[i] * accA[a][b] * decay : 0.0f; // A_ij = β_i (k_i·k_j) e^{c_i−c_j}
            aqk[i * DN_CHUNK + j] = (in && j <= i) ? accQ[a][b] * decay : 0.0f;   // (q_i·k_j) e^{c_i−c_j}
        }
    // [U | W] initial rows: U_i = β_i v_i, W_i = β_i k_i e^{c_i}; one thread per column.
    for (int col = tid; col < cols; col += blockDim.x) {
        for (int i = 0; i < DN_CHUNK; ++i) {
            float v = 0.0f;
            if (i < L) {
                const float* row = x + (i64)(t0 + i) * p.C;
                v = col < Dv ? beta[i] * row[v_col + col] : beta[i] * row[k_col + (col - Dv)] * expf(cum[i]);
            }
            uw[i * cols + col] = v;
        }
    }
    __syncthreads(); // As complete
    // Forward substitution on (I + A): row i −= Σ_{j<i} A_ij row j. Each thread touches only its column.
    for (int col = tid; col < cols; col += blockDim.x) {
        for (int i = 1; i < L; ++i) {
            float v = uw[i * cols + col];
            for (int j = 0; j < i; ++j) v = fmaf(-As[i * 65 + j], uw[j * cols + col], v);
            uw[i * cols + col] = v;
        }
        for (int i = 0; i < L; ++i) {
            const i64 r = (i64)(t0 + i) * p.Hv + h;
            if (col < Dv) ((float*)p.u_out)[r * Dv + col] = uw[i * cols + col];
            else ((float*)p.w_out)[r * Dk + (col - Dv)] = uw[i * cols + col];
        }
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
    extern __shared__ float sm[];
    const int h = blockIdx.y, kh = h / (p.Hv / p.Hk), j0 = blockIdx.x * DN_BV;
    const int Dk = p.Dk, Dv = p.Dv, kp = Dk + 1, bv = min(DN_BV, Dv - j0);
    float* Ws = sm;                        // [64, Dk+1]
    float* qs = Ws + DN_CHUNK * kp;        // [64, Dk+1]
    float* ks = qs + DN_CHUNK * kp;        // [64, Dk+1]
    float* S = ks + DN_CHUNK * kp;         // [32, Dk+1]: S[j][d] = state column j0+j
    float* Us = S + DN_BV * kp;            // [64, 33]
    float* vn = Us + DN_CHUNK * 33;        // [64, 33]
    float* Aq = vn + DN_CHUNK * 33;        // [64, 65]
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
    const int ti = tid >> 4, tj = tid & 15;  // (v', o): rows ti + 16a, columns tj + 16b
    const int jg = tid >> 5, dl = tid & 31;  // (S): columns 4·jg + e, key dims dl + 32f
    const int nchunks = (p.T + DN_CHUNK - 1) / DN_CHUNK;
    for (int chunk = 0; chunk < nchunks; ++chunk) {
        const int t0 = chunk * DN_CHUNK, L = min(DN_CHUNK, p.T - t0);
        __syncthreads(); // previous chunk done with every buffer
        for (int i = tid; i < DN_CHUNK * Dk; i += blockDim.x) {
            const int r = i / Dk, d = i - r * Dk;
            const bool valid = r < L;
            const i64 tr = (i64)(t0 + r);
            Ws[r * kp + d] = valid ? ((const float*)p.w_in)[(tr * p.Hv + h) * Dk + d] : 0.0f;
            qs[r * kp + d] = valid ? x[tr * p.C + q_col + d] : 0.0f;
            ks[r * kp + d] = valid ? x[tr * p.C + k_col + d] : 0.0f;
        }
        for (int i = tid; i < DN_CHUNK * DN_BV; i += blockDim.x) {
            const int r = i / DN_BV, j = i - r * DN_BV;
            Us[r * 33 + j] = (r < L && j < bv) ? ((const float*)p.u_in)[((i64)(t0 + r) * p.Hv + h) * Dv + j0 + j] : 0.0f;
        }
        const float* aqk = (const float*)p.aqk_in + ((i64)chunk * p.Hv + h) * DN_CHUNK * DN_CHUNK;
        for (int i = tid; i < DN_CHUNK * DN_CHUNK; i += blockDim.x) Aq[(i >> 6) * 65 + (i & 63)] = aqk[i];
        if (tid < DN_CHUNK) cum[tid] = tid < L ? ((const float*)p.gcum_in)[(i64)(t0 + tid) * p.Hv + h] : 0.0f;
        __syncthreads();
        const float c_last = cum[L - 1];
        if (tid < DN_CHUNK) ek[tid] = tid < L ? expf(c_last - cum[tid]) : 0.0f;

        // v'_ij = U_ij − Σ_d W_id S_jd
        float qsum[4][2];
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int b = 0; b < 2; ++b) qsum[a][b] = 0.0f;
        {
            float acc[4][2];
#pragma unroll
            for (int a = 0; a < 4; ++a)
#pragma unroll
                for (int b = 0; b < 2; ++b) acc[a][b] = 0.0f;
            for (int d = 0; d < Dk; ++d) {
                float wv[4], qv[4], sv[2];
#pragma unroll
                for (int a = 0; a < 4; ++a) { wv[a] = Ws[(ti + 16 * a) * kp + d]; qv[a] = qs[(ti + 16 * a) * kp + d]; }
#pragma unroll
                for (int b = 0; b < 2; ++b) sv[b] = S[(tj + 16 * b) * kp + d];
#pragma unroll
                for (int a = 0; a < 4; ++a)
#pragma unroll
                    for (int b = 0; b < 2; ++b) {
                        acc[a][b] = fmaf(wv[a], sv[b], acc[a][b]);
                        qsum[a][b] = fmaf(qv[a], sv[b], qsum[a][b]); // q_i·S_j (old state, for o)
                    }
            }
#pragma unroll
            for (int a = 0; a < 4; ++a)
#pragma unroll
                for (int b = 0; b < 2; ++b) {
                    const int i = ti + 16 * a, j = tj + 16 * b;
                    vn[i * 33 + j] = Us[i * 33 + j] - acc[a][b];
                }
        }
        __syncthreads(); // v' complete
        // o_ij = e^{c_i} q_i·S_j + Σ_{l≤i} Aqk_il v'_lj
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            const int i = ti + 16 * a;
            if (i >= L) continue;
            const float ec = expf(cum[i]);
#pragma unroll
            for (int b = 0; b < 2; ++b) {
                const int j = tj + 16 * b;
                float o = ec * qsum[a][b];
                for (int l = 0; l <= i; ++l) o = fmaf(Aq[i * 65 + l], vn[l * 33 + j], o);
                if (j < bv) ((float*)p.o_out)[((i64)(t0 + i) * p.Hv + h) * Dv + j0 + j] = o;
            }
        }
        // S_jd ← e^{c_L} S_jd + Σ_i (e^{c_L−c_i} k_id) v'_ij   (every thread finished reading S above:
        // qsum/acc were consumed before the barrier)
        const float decay = expf(c_last);
        for (int f = 0; f * 32 + dl < Dk; ++f) {
            const int d = f * 32 + dl;
            float s[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) s[e] = S[(4 * jg + e) * kp + d] * decay;
            for (int i = 0; i < L; ++i) {
                const float kd = ks[i * kp + d] * ek[i];
#pragma unroll
                for (int e = 0; e < 4; ++e) s[e] = fmaf(kd, vn[i * 33 + 4 * jg + e], s[e]);
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) S[(4 * jg + e) * kp + d] = s[e];
        }
    }
    __syncthreads();
    for (int i = tid; i < bv * Dk; i += blockDim.x) {
        const int j = i / Dk, d = i - j * Dk;
        state[(i64)j * Dk + d] = S[j * kp + d];
    }
}

// ---------------------------------------------------------------- gated RMSNorm → planes
struct DnNormParams {
    u64 o;       // [T, Hv, Dv]
    u64 z;       // [T, Hv·Dv]
    u64 norm_w;  // [Dv]
    u64 out_hi, out_lo; // [T, Hv·Dv] bf16 planes
    int T, Hv, Dv;
    float eps;
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
        store_planes((u16*)p.out_hi, (u16*)p.out_lo, row * p.Dv + j, w[j] * (o[j] * inv) * silu_f(z[j]));
}
