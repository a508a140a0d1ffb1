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
//
// Launch: grid Hv·SPLIT blocks of DN_THREADS = 256 (8 warps). Block b serves value head
//   h = b / SPLIT and owns value columns [r·Dv/SPLIT, (r+1)·Dv/SPLIT) of it, r = b mod SPLIT (sizes
//   differ by at most one when SPLIT ∤ Dv; a block may own none when Dv < SPLIT).
//   - SPLIT = 8 on sm_90+ (`deltanet_decode_kplN_split8`): the head's 8 blocks form one thread-block
//     cluster (__cluster_dims__), so the gated RMSNorm's Σo² over all Dv columns is summed through
//     distributed shared memory: each block publishes its partial, and after a cluster barrier every
//     block adds the 8 partials in rank order (identical total in every block, deterministic).
//   - SPLIT = 1 elsewhere (`deltanet_decode_kplN`): one block per head, no cluster.
//   - `deltanet_decode_kplN_split8_parts` (the default where the out-projection runs on the tensor
//     cores): 8 blocks per head and no cluster; y ← w·o·silu(z) and each block's Σo², and the
//     out-projection finishes the norm (DN_OUT_PARTS below, matvec_tc.cu TcMatvecParams).
//   Every block recomputes the head's cheap prologue (conv of the key head's q/k channels, L2 norms,
//   gates) and convolves only its own v channels. Warp w takes local columns w, w+8, …; the first
//   DN_PREFETCH_COLS of them are read into registers (16-byte loads) right after the cursor, before
//   the prologue, so the state read overlaps it (8 warps × 4 = 32 ≥ ⌈256/8⌉: every column when
//   SPLIT = 8). Lane holds Dk/32 = KPL consecutive key entries of a column.
// Bytes per call: S read + written (Hv·Dv·Dk·4·2 = 4 MiB at the real shape), conv ring K·C·4 read
//   (the q/k part once per block that needs it, mostly from L2), C·4 written, projections
//   (C + 2·Hv + Hv·Dv)·4.
// Races: the ring slot written (p mod K) is never read in the same step. Every channel's new x is
//   written by exactly one block: q/k channels by rank 0 of the head with h mod (Hv/Hk) == 0, v
//   channels by the block owning that column; the other blocks only read the K−1 older slots.

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

#define DN_THREADS 256
#define DN_WARPS (DN_THREADS / 32)
#define DN_SPLIT 8           // blocks (one cluster) per value head on sm_90+
#define DN_MAX_DK 256
#define DN_MAX_DV 256
#define DN_MAX_K 8           // conv taps (the launcher checks)
#define DN_PREFETCH_COLS 4   // value columns per warp read into registers first thing
// Conv channels per thread: 2·Dk + (owned columns ≤ ⌈Dv/SPLIT⌉) over DN_THREADS, at the largest
// Dk = 32·KPL and Dv = 256 of the kernel (2 at the real shape, 3 at most).
template <int KPL, int SPLIT>
struct DnConv {
    static constexpr int PER_THREAD = (64 * KPL + (DN_MAX_DV + SPLIT - 1) / SPLIT + DN_THREADS - 1) / DN_THREADS;
};
// Blocks per SM the register budget must allow. Split kernels with Dk ≤ 128: 3 (≤ 80 registers, no
// spill), so the 256 blocks of the real shape's cluster launch fit at once even where a GPC's free
// SMs pack clusters of 8 imperfectly (2 per SM would leave no slack: 264 slots). Dk = 256 and the
// one-block-per-head kernels: 2 (their state columns need the registers; ≤ 128, no spill).
#define DN_MIN_BLOCKS_SPLIT(KPL) ((KPL) <= 4 ? 3 : 2)
#define DN_MIN_BLOCKS_SINGLE 2

// Two block-wide sums at once (one pair of barriers); every thread gets both. `scratch` ≥ 2·32.
__device__ __forceinline__ float2 dn_block_sum2(float a, float b, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    a = warp_sum(a);
    b = warp_sum(b);
    __syncthreads();
    if (lane == 0) { scratch[warp] = a; scratch[32 + warp] = b; }
    __syncthreads();
    float2 t = make_float2(0.0f, 0.0f);
    for (int w = 0; w < DN_WARPS; ++w) { t.x += scratch[w]; t.y += scratch[32 + w]; }
    return t;
}

template <int KPL>
__device__ __forceinline__ void dn_load_column(const float* col, float* s) {
    if (KPL % 4 == 0) {
#pragma unroll
        for (int e = 0; e < KPL; e += 4) {
            const float4 v4 = *(const float4*)(col + e);
            s[e] = v4.x; s[e + 1] = v4.y; s[e + 2] = v4.z; s[e + 3] = v4.w;
        }
    } else if (KPL == 2) {
        const float2 v2 = *(const float2*)col;
        s[0] = v2.x; s[KPL - 1] = v2.y;
    } else {
#pragma unroll
        for (int e = 0; e < KPL; ++e) s[e] = col[e];
    }
}

template <int KPL>
__device__ __forceinline__ void dn_store_column(float* col, const float* s) {
    if (KPL % 4 == 0) {
#pragma unroll
        for (int e = 0; e < KPL; e += 4) *(float4*)(col + e) = make_float4(s[e], s[e + 1], s[e + 2], s[e + 3]);
    } else if (KPL == 2) {
        *(float2*)col = make_float2(s[0], s[KPL - 1]);
    } else {
#pragma unroll
        for (int e = 0; e < KPL; ++e) col[e] = s[e];
    }
}

// NC value columns of one warp in lockstep (so their warp reductions overlap); column c is local
// column js[c] (valid when < n; an invalid one computes on zeros and stores nothing), with this
// lane's KPL key entries in s[c]. Per column j: S ← αS; δ = β(v_j − Sᵀk); S += kδ; o_j = Sᵀq
// (lane 0 stores o_j in o_s[j]); S written back to `S + j·Dk`.
template <int KPL, int NC>
__device__ __forceinline__ void dn_columns(float* S, int Dk, const int* js, int n, float (*s)[KPL],
                                           const float* kr, const float* qr, float alpha, float beta,
                                           const float* v_s, float* o_s, int lane) {
    float kv[NC], o[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        kv[c] = 0.0f;
#pragma unroll
        for (int e = 0; e < KPL; ++e) { s[c][e] *= alpha; kv[c] = fmaf(s[c][e], kr[e], kv[c]); } // S ← αS; Sᵀk
    }
#pragma unroll
    for (int c = 0; c < NC; ++c) kv[c] = warp_sum(kv[c]);
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        const float v = js[c] < n ? v_s[js[c]] : 0.0f;
        const float delta = (v - kv[c]) * beta; // δ = β(v − Sᵀk)
        o[c] = 0.0f;
#pragma unroll
        for (int e = 0; e < KPL; ++e) { s[c][e] = fmaf(kr[e], delta, s[c][e]); o[c] = fmaf(s[c][e], qr[e], o[c]); } // S += kδ; Sᵀq
    }
#pragma unroll
    for (int c = 0; c < NC; ++c) o[c] = warp_sum(o[c]);
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        if (js[c] < n) {
            dn_store_column<KPL>(S + (i64)js[c] * Dk, s[c]);
            if (lane == 0) o_s[js[c]] = o[c];
        }
    }
}

// What a decode item leaves in y:
//   DN_OUT_NORMED  the gated RMSNorm of o (Σo² over the head through the cluster when SPLIT > 1);
//   DN_OUT_PARTS   w·o·silu(z), and after y's Hv·Dv values the block's Σo² over its own columns at
//                  Hv·Dv + item: the out-projection (matvec_tc.cu, TcMatvecParams) sums a head's SPLIT
//                  parts and scales. No cluster: its barrier cost 1.8 µs of the kernel's 6.8 (measured).
#define DN_OUT_NORMED 0
#define DN_OUT_PARTS 2
// Work item `item` = (value head item / SPLIT, column block item % SPLIT).
// CK, DV, RATIO: the conv taps, the value head dim and Hv / Hk as compile-time constants (a
// specialised kernel: the ring-slot modulos, the column split and the key head fold away), or 0 for
// p.K, p.Dv and p.Hv / p.Hk. Dk is 32·KPL in every kernel (the launchers pick KPL = Dk / 32). The
// arithmetic on values is the same either way.
template <int KPL, int SPLIT, int OUT, int CK = 0, int DV = 0, int RATIO = 0>
__device__ __forceinline__ void deltanet_decode_item(const DeltaNetParams& p, int item) {
    __shared__ float q_s[DN_MAX_DK], k_s[DN_MAX_DK], v_s[DN_MAX_DV], o_s[DN_MAX_DV];
    __shared__ float red[64];
    __shared__ float sumsq_part; // this block's Σ o_j² over its own columns (read by the cluster)
    const int h = item / SPLIT, rank = item % SPLIT; // = %cluster_ctarank (1-D clusters)
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    constexpr int Dk = 32 * KPL;
    const int Dv = DV ? DV : p.Dv;
    const int ratio = RATIO ? RATIO : p.Hv / p.Hk, kh = h / ratio;
    const int C = 2 * p.Hk * Dk + p.Hv * Dv;
    // This block's value columns [j0, j0 + n) of head h.
    const int j0 = rank * Dv / SPLIT, n = (rank + 1) * Dv / SPLIT - j0;
    const Cursor cur = *(const Cursor*)p.cursor;
    const int pos = cur.pos, K = CK ? CK : p.K;

    // 0. The block's state columns, loaded now (in flight during steps 1–3).
    float* S = (float*)(cur.state_base + p.state_off) + ((i64)h * Dv + j0) * Dk + lane * KPL;
    // columns per warp in registers: DN_PREFETCH_COLS, or with DV known exactly the block's share
    // (2 at Dv 128 over 8 blocks: the other 2 would run the delta rule on zeros)
    constexpr int NCOL = DV ? (DV / SPLIT + DN_WARPS - 1) / DN_WARPS : DN_PREFETCH_COLS;
    static_assert(!DV || (DV % SPLIT == 0 && NCOL <= DN_PREFETCH_COLS), "a block's columns fit the prefetch");
    float sp[NCOL][KPL];
    int js[NCOL];
#pragma unroll
    for (int c = 0; c < NCOL; ++c) {
        js[c] = warp + c * DN_WARPS;
        if (js[c] < n) dn_load_column<KPL>(S + (i64)js[c] * Dk, sp[c]);
        else {
#pragma unroll
            for (int e = 0; e < KPL; ++e) sp[c][e] = 0.0f;
        }
    }
    // Scalars and the output's operands: independent of the conv, issued before it.
    const float a_raw = ((const float*)p.a)[h], dt_bias = ((const float*)p.dt_bias)[h];
    const float a_log = ((const float*)p.a_log)[h], b_raw = ((const float*)p.b)[h];
    float z_t = 0.0f, w_t = 0.0f; // thread t < n writes output column j0 + t
    if (tid < n) { z_t = ((const float*)p.z)[(i64)h * Dv + j0 + tid]; w_t = ((const float*)p.norm_w)[j0 + tid]; }

    // 1. conv over the head's q (Dk), k (Dk) and this block's v (n) channels → silu → shared memory.
    //    All loads of a thread's ≤ 3 channels are issued before any use (fixed trip counts).
    float* ring = (float*)(cur.state_base + p.conv_off);
    const float* qkv = (const float*)p.qkv;
    const float* conv_w = (const float*)p.conv_w;
    const bool writes_qk = (h % ratio) == 0 && rank == 0;
    const int nch = 2 * Dk + n;
    constexpr int CPT = DnConv<KPL, SPLIT>::PER_THREAD;
    int slot[DN_MAX_K - 1]; // ring slot of x[p−K+1+t], t < K−1 (the same for every channel)
    {
        int sl = ((pos - (K - 1)) % K + K) % K;
#pragma unroll
        for (int t = 0; t < DN_MAX_K - 1; ++t) { slot[t] = sl; sl = sl + 1 == K ? 0 : sl + 1; }
    }
    const int own_slot = pos % K; // x[p]: written here, read by none of this step's blocks
    float x_new[CPT], tap_new[CPT];
    float hist[CPT][DN_MAX_K - 1], taps[CPT][DN_MAX_K - 1];
    int chan[CPT];
#pragma unroll
    for (int u = 0; u < CPT; ++u) {
        const int i = tid + u * DN_THREADS;
        int c = 0;
        if (i < Dk) c = kh * Dk + i;
        else if (i < 2 * Dk) c = p.Hk * Dk + kh * Dk + (i - Dk);
        else c = 2 * p.Hk * Dk + h * Dv + j0 + (i - 2 * Dk);
        chan[u] = c;
        if (i < nch) {
            x_new[u] = qkv[c];
            tap_new[u] = conv_w[(i64)c * K + K - 1];
#pragma unroll
            for (int t = 0; t < DN_MAX_K - 1; ++t) {
                if (t < K - 1) {
                    taps[u][t] = conv_w[(i64)c * K + t];
                    hist[u][t] = ring[(i64)slot[t] * C + c];
                }
            }
        }
    }
#pragma unroll
    for (int u = 0; u < CPT; ++u) {
        const int i = tid + u * DN_THREADS;
        if (i < nch) {
            float acc = 0.0f;
#pragma unroll
            for (int t = 0; t < DN_MAX_K - 1; ++t)
                if (t < K - 1) acc += taps[u][t] * hist[u][t];
            acc += tap_new[u] * x_new[u]; // tap K−1 multiplies the newest input
            const float u_silu = silu_f(acc);
            if (i < Dk) q_s[i] = u_silu;
            else if (i < 2 * Dk) k_s[i - Dk] = u_silu;
            else v_s[i - 2 * Dk] = u_silu;
            if (i >= 2 * Dk || writes_qk) ring[(i64)own_slot * C + chan[u]] = x_new[u];
        }
    }
    __syncthreads();

    // 2. L2-normalise q and k (q also scaled by Dk^−½).
    float sq = 0.0f, sk = 0.0f;
    for (int i = tid; i < Dk; i += DN_THREADS) { sq += q_s[i] * q_s[i]; sk += k_s[i] * k_s[i]; }
    const float2 sums = dn_block_sum2(sq, sk, red);
    const float q_inv = 1.0f / sqrtf(sums.x + 1e-6f);
    const float k_inv = 1.0f / sqrtf(sums.y + 1e-6f);
    // 3. gates
    const float g = -expf(a_log) * softplus_f(a_raw + dt_bias);
    const float alpha = expf(g);
    const float beta = sigmoid_f(b_raw);

    // 4. the delta rule: warp w's prefetched columns in lockstep (then, only when SPLIT = 1 and
    //    Dv > 32, the rest one at a time); lane holds k/q/S entries [lane·KPL, lane·KPL + KPL),
    //    normalised here from the raw shared values.
    float kr[KPL], qr[KPL];
#pragma unroll
    for (int e = 0; e < KPL; ++e) {
        kr[e] = k_s[lane * KPL + e] * k_inv;
        qr[e] = q_s[lane * KPL + e] * q_inv * p.q_scale;
    }
    dn_columns<KPL, NCOL>(S, Dk, js, n, sp, kr, qr, alpha, beta, v_s, o_s, lane);
    for (int j = warp + NCOL * DN_WARPS; j < n; j += DN_WARPS) { // SPLIT = 1 with Dv > 32
        float s1[1][KPL];
        dn_load_column<KPL>(S + (i64)j * Dk, s1[0]);
        dn_columns<KPL, 1>(S, Dk, &j, n, s1, kr, qr, alpha, beta, v_s, o_s, lane);
    }
    __syncthreads();
    // 5. gated RMSNorm: y = w · o/√(mean(o²) + eps) · silu(z), Σo² over all Dv columns of the head.
    const float o_t = tid < n ? o_s[tid] : 0.0f;
    float sumsq = block_sum(o_t * o_t, red); // n ≤ DN_THREADS: one column per thread
    if (OUT == DN_OUT_PARTS) {
        if (tid < n) ((float*)p.y)[(i64)h * Dv + j0 + tid] = w_t * o_t * silu_f(z_t);
        if (tid == 0) ((float*)p.y)[(i64)p.Hv * Dv + item] = sumsq;
        return;
    }
#if __CUDA_ARCH__ >= 900
    if (SPLIT > 1) {
        if (tid == 0) sumsq_part = sumsq;
        cluster_arrive(); // release: sumsq_part visible to the cluster
        cluster_wait();
        sumsq = 0.0f;
#pragma unroll
        for (int r = 0; r < SPLIT; ++r) sumsq += cluster_load_f32(&sumsq_part, r); // fixed order
        cluster_arrive(); // this block is done reading the others' shared memory
    }
#endif
    const float o_inv = 1.0f / sqrtf(sumsq / (float)Dv + p.eps);
    if (tid < n) ((float*)p.y)[(i64)h * Dv + j0 + tid] = w_t * (o_t * o_inv) * silu_f(z_t);
#if __CUDA_ARCH__ >= 900
    if (SPLIT > 1) cluster_wait(); // keep sumsq_part alive until every block has read it
#endif
}

template <int KPL, int SPLIT>
__device__ __forceinline__ void deltanet_decode_body(const DeltaNetParams& p) {
    griddep_enter(); // cursor, projections and state come from earlier kernels
    deltanet_decode_item<KPL, SPLIT, DN_OUT_NORMED>(p, blockIdx.x);
}

#define DN_KERNEL(KPL) \
    extern "C" __global__ void __launch_bounds__(DN_THREADS, DN_MIN_BLOCKS_SINGLE) deltanet_decode_kpl##KPL(const DeltaNetParams p) { \
        deltanet_decode_body<KPL, 1>(p); \
    }
DN_KERNEL(1)
DN_KERNEL(2)
DN_KERNEL(4)
DN_KERNEL(8)

#if __CUDA_ARCH__ >= 900
#define DN_KERNEL_SPLIT(KPL) \
    extern "C" __global__ void __cluster_dims__(DN_SPLIT, 1, 1) __launch_bounds__(DN_THREADS, DN_MIN_BLOCKS_SPLIT(KPL)) \
        deltanet_decode_kpl##KPL##_split8(const DeltaNetParams p) { \
        deltanet_decode_body<KPL, DN_SPLIT>(p); \
    }
DN_KERNEL_SPLIT(1)
DN_KERNEL_SPLIT(2)
DN_KERNEL_SPLIT(4)
DN_KERNEL_SPLIT(8)
static_assert(DN_SPLIT == 8, "the kernel names say split8");
#endif
// deltanet_decode_kplN_split8_parts: the same 8 blocks per head, no cluster (any device): y ←
// w·o·silu(z) and the blocks' Σo² parts (DN_OUT_PARTS); the out-projection finishes the norm.
template <int KPL, int CK = 0, int DV = 0, int RATIO = 0> // the compiled-in dims: deltanet_decode_item
__device__ __forceinline__ void deltanet_decode_parts_body(const DeltaNetParams& p) {
    griddep_enter(); // cursor, projections and state come from earlier kernels
    deltanet_decode_item<KPL, DN_SPLIT, DN_OUT_PARTS, CK, DV, RATIO>(p, blockIdx.x);
}
#define DN_KERNEL_PARTS(KPL) \
    extern "C" __global__ void __launch_bounds__(DN_THREADS, DN_MIN_BLOCKS_SPLIT(KPL)) \
        deltanet_decode_kpl##KPL##_split8_parts(const DeltaNetParams p) { \
        deltanet_decode_parts_body<KPL>(p); \
    }
DN_KERNEL_PARTS(1)
DN_KERNEL_PARTS(2)
DN_KERNEL_PARTS(4)
DN_KERNEL_PARTS(8)
// The same for Qwen3.5/3.6's DeltaNet (Dk = Dv = 128, 4 conv taps, 2 value heads per key head: the
// 35B-A3B's 32 over 16), its dims compiled in; deltanet::parts_kernel picks it where they match.
extern "C" __global__ void __launch_bounds__(DN_THREADS, DN_MIN_BLOCKS_SPLIT(4))
    deltanet_decode_kpl4_split8_parts_k4_v128_r2(const DeltaNetParams p) {
    deltanet_decode_parts_body<4, 4, 128, 2>(p);
}
static_assert(DN_WARPS * DN_PREFETCH_COLS >= (DN_MAX_DV + DN_SPLIT - 1) / DN_SPLIT,
              "with SPLIT = 8 every owned column is prefetched");

// Layouts shared with the Rust launchers (tests/layouts.rs checks the same sizes).
static_assert(sizeof(DeltaNetParams) == 128, "DeltaNetParams layout differs from its Rust twin");
