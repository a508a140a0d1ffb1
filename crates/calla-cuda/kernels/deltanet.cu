// deltanet.cu: one Gated DeltaNet decode step (one token), fused: causal conv update + SiLU, q/k L2
// norm, gates, the delta rule on the f32 state, and the gated RMSNorm.
//
// Math (CPU reference: calla_cpu::deltanet, `DeltaNet::forward` with Rule::Recurrent and
// `deltanet_decode_step`), per value head h, key head kh = h / (Hv/Hk), position p:
//   u_c   = Σ_{t<K} conv_w[c, t] · x_c[p−K+1+t]          x = the pre-conv projection (ring of K slots)
//   q, k, v = silu(u) split [q (Hk·Dk) | k (Hk·Dk) | v (Hv·Dv)]
//   q ← q · (Σq² + 1e-6)^−½ · Dk^−½;  k ← k · (Σk² + 1e-6)^−½
//   g = −exp(A_log[h]) · softplus(a[h] + dt_bias[h]);  α = exp(g);  β = sigmoid(b[h])
//   for every value column j:  S_j ← α S_j;  δ_j = β (v_j − S_j·k);  S_j ← S_j + δ_j k;  o_j = S_j·q
//   y_h = norm_w · o · (mean(o²) + eps)^−½ · silu(z_h)
// State layout (per sequence, at cursor.state_base):
//   conv ring  [K, C] f32: slot p mod K holds x[p]; a step reads the K−1 older slots and writes its own
//   S          [Hv, Dv, Dk] f32 ("K-last": one value column's key vector is contiguous)
// Launch: grid Hv blocks (one value head each), block 512 threads (16 warps; warp w owns columns
//   w, w+16, …; lane holds Dk/32 consecutive key entries = KPL), static smem (2·Dk + 2·Dv) floats.
//   When Dv ≤ 16·DN_PREFETCH_COLS the warp's state columns are read into registers first thing.
// Bytes per call: S read + written (Hv·Dv·Dk·4·2 = 4 MiB at the real shape), conv ring K·C·4 read,
//   C·4 written, projections (C + 2·Hv + Hv·Dv)·4.
// Races: the ring slot written (p mod K) is never read in the same step, so value heads that share
//   a key head can read its q/k history while the head with h mod (Hv/Hk) == 0 writes the new x.

#define DN_THREADS 512
#define DN_MAX_DK 256
#define DN_MAX_DV 256

struct DeltaNetParams {
    u64 qkv;     // [C] projection output, pre-conv
    u64 z;       // [Hv·Dv]
    u64 b;       // [Hv]
    u64 a;       // [Hv]
    u64 conv_w;  // [C, K] f32
    u64 a_log;   // [Hv] f32
    u64 dt_bias; // [Hv] f32
    u64 norm_w;  // [Dv] f32
    u64 cursor;  // Cursor*
    i64 conv_off;  // bytes from state_base to this layer's conv ring
    i64 state_off; // bytes from state_base to this layer's S
    u64 y;       // [Hv·Dv] out
    int Hk, Hv, Dk, Dv, K;
    float eps;
    float q_scale; // Dk^−½, computed on the host as the CPU does
    int pad;
};

__device__ __forceinline__ float softplus_f(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// Value columns per warp whose state is loaded into registers at kernel start (before the conv,
// norms and gates), so the 64 KiB per head of state read overlaps that prologue.
#define DN_PREFETCH_COLS 8

template <int KPL>
__device__ __forceinline__ void dn_load_column(const float* col, float* s) {
    if (KPL % 4 == 0) {
#pragma unroll
        for (int e = 0; e < KPL; e += 4) {
            const float4 v4 = *(const float4*)(col + e);
            s[e] = v4.x; s[e + 1] = v4.y; s[e + 2] = v4.z; s[e + 3] = v4.w;
        }
    } else {
#pragma unroll
        for (int e = 0; e < KPL; ++e) s[e] = col[e];
    }
}

// One value column j (this lane's KPL key entries `s`, written back to `col`): S ← αS; δ = β(v − Sᵀk);
// S += kδ; o_j = Sᵀq (lane 0 stores it).
template <int KPL>
__device__ __forceinline__ void dn_column(float* col, float* s, const float* kr, const float* qr, float alpha,
                                          float beta, float v, float* o_out, int lane) {
    float kv = 0.0f;
#pragma unroll
    for (int e = 0; e < KPL; ++e) { s[e] *= alpha; kv = fmaf(s[e], kr[e], kv); } // S ← αS; Sᵀk
    kv = warp_sum(kv);
    const float delta = (v - kv) * beta;                                          // δ = β(v − Sᵀk)
    float o = 0.0f;
#pragma unroll
    for (int e = 0; e < KPL; ++e) { s[e] = fmaf(kr[e], delta, s[e]); o = fmaf(s[e], qr[e], o); } // S += kδ; Sᵀq
    o = warp_sum(o);
    if (KPL % 4 == 0) {
#pragma unroll
        for (int e = 0; e < KPL; e += 4) *(float4*)(col + e) = make_float4(s[e], s[e + 1], s[e + 2], s[e + 3]);
    } else {
#pragma unroll
        for (int e = 0; e < KPL; ++e) col[e] = s[e];
    }
    if (lane == 0) *o_out = o;
}

template <int KPL>
__device__ __forceinline__ void deltanet_decode_body(const DeltaNetParams& p) {
    __shared__ float q_s[DN_MAX_DK], k_s[DN_MAX_DK], v_s[DN_MAX_DV], o_s[DN_MAX_DV];
    __shared__ float red[32];
    griddep_launch_dependents();
    griddep_wait(); // cursor, projections and state come from earlier kernels
    const int h = blockIdx.x, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    const int ratio = p.Hv / p.Hk, kh = h / ratio;
    const int C = 2 * p.Hk * p.Dk + p.Hv * p.Dv;
    const Cursor cur = *(const Cursor*)p.cursor;
    const int pos = cur.pos, K = p.K;
    float* ring = (float*)(cur.state_base + p.conv_off);
    const float* qkv = (const float*)p.qkv;
    const float* conv_w = (const float*)p.conv_w;
    const bool writes_qk = (h % ratio) == 0;
    // The head's state columns, loaded now (in flight during steps 1–3).
    float* S = (float*)(cur.state_base + p.state_off) + (i64)h * p.Dv * p.Dk;
    const bool prefetched = p.Dv <= nwarps * DN_PREFETCH_COLS;
    float sp[DN_PREFETCH_COLS][KPL];
    if (prefetched) {
#pragma unroll
        for (int c = 0; c < DN_PREFETCH_COLS; ++c) {
            const int j = warp + c * nwarps;
            if (j < p.Dv) dn_load_column<KPL>(S + (i64)j * p.Dk + lane * KPL, sp[c]);
        }
    }

    // 1. conv over this head's channels: q (Dk), k (Dk), v (Dv) → silu → shared memory.
    for (int i = tid; i < 2 * p.Dk + p.Dv; i += blockDim.x) {
        int c;
        float* dst;
        bool write;
        if (i < p.Dk) { c = kh * p.Dk + i; dst = &q_s[i]; write = writes_qk; }
        else if (i < 2 * p.Dk) { c = p.Hk * p.Dk + kh * p.Dk + (i - p.Dk); dst = &k_s[i - p.Dk]; write = writes_qk; }
        else { c = 2 * p.Hk * p.Dk + h * p.Dv + (i - 2 * p.Dk); dst = &v_s[i - 2 * p.Dk]; write = true; }
        const float x_new = qkv[c];
        float acc = 0.0f;
        for (int t = 0; t < K - 1; ++t) {
            const int slot = ((pos - (K - 1) + t) % K + K) % K; // x[p−K+1+t]
            acc += conv_w[(i64)c * K + t] * ring[(i64)slot * C + c];
        }
        acc += conv_w[(i64)c * K + K - 1] * x_new; // tap K−1 multiplies the newest input
        *dst = silu_f(acc);
        if (write) ring[(i64)(pos % K) * C + c] = x_new;
    }
    __syncthreads();

    // 2. L2-normalise q and k (q also scaled by Dk^−½).
    float sq = 0.0f, sk = 0.0f;
    for (int i = tid; i < p.Dk; i += blockDim.x) { sq += q_s[i] * q_s[i]; sk += k_s[i] * k_s[i]; }
    const float q_inv = 1.0f / sqrtf(block_sum(sq, red) + 1e-6f);
    const float k_inv = 1.0f / sqrtf(block_sum(sk, red) + 1e-6f);
    __syncthreads();
    for (int i = tid; i < p.Dk; i += blockDim.x) { q_s[i] = q_s[i] * q_inv * p.q_scale; k_s[i] *= k_inv; }

    // 3. gates
    const float a = ((const float*)p.a)[h] + ((const float*)p.dt_bias)[h];
    const float g = -expf(((const float*)p.a_log)[h]) * softplus_f(a);
    const float alpha = expf(g);
    const float beta = sigmoid_f(((const float*)p.b)[h]);
    __syncthreads();

    // 4. the delta rule, one value column per warp iteration; lane holds k/q/S entries
    //    [lane·KPL, lane·KPL + KPL).
    float kr[KPL], qr[KPL];
#pragma unroll
    for (int e = 0; e < KPL; ++e) { kr[e] = k_s[lane * KPL + e]; qr[e] = q_s[lane * KPL + e]; }
    if (prefetched) {
#pragma unroll
        for (int c = 0; c < DN_PREFETCH_COLS; ++c) {
            const int j = warp + c * nwarps;
            if (j < p.Dv) dn_column<KPL>(S + (i64)j * p.Dk + lane * KPL, sp[c], kr, qr, alpha, beta, v_s[j], &o_s[j], lane);
        }
    } else {
        for (int j = warp; j < p.Dv; j += nwarps) {
            float* col = S + (i64)j * p.Dk + lane * KPL;
            float s[KPL];
            dn_load_column<KPL>(col, s);
            dn_column<KPL>(col, s, kr, qr, alpha, beta, v_s[j], &o_s[j], lane);
        }
    }
    __syncthreads();

    // 5. gated RMSNorm: y = w · o/√(mean(o²) + eps) · silu(z)
    float so = 0.0f;
    for (int j = tid; j < p.Dv; j += blockDim.x) so += o_s[j] * o_s[j];
    const float o_inv = 1.0f / sqrtf(block_sum(so, red) / (float)p.Dv + p.eps);
    const float* z = (const float*)p.z + (i64)h * p.Dv;
    const float* w = (const float*)p.norm_w;
    float* y = (float*)p.y + (i64)h * p.Dv;
    for (int j = tid; j < p.Dv; j += blockDim.x) y[j] = w[j] * (o_s[j] * o_inv) * silu_f(z[j]);
}

#define DN_KERNEL(KPL) \
    extern "C" __global__ void __launch_bounds__(DN_THREADS, 1) deltanet_decode_kpl##KPL(const DeltaNetParams p) { \
        deltanet_decode_body<KPL>(p); \
    }
DN_KERNEL(1)
DN_KERNEL(2)
DN_KERNEL(4)
DN_KERNEL(8)

// Layouts shared with the Rust launchers (tests/layouts.rs checks the same sizes).
static_assert(sizeof(DeltaNetParams) == 128, "DeltaNetParams layout differs from its Rust twin");
