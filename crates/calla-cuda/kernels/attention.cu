// attention.cu: gated full attention for one decode token, in three launches.
//
// Math (CPU reference: calla_cpu::attention::Attention::forward), token at position p:
//   per q head: [q | gate] = q_proj rows;  q ← rmsnorm₀(q)·(1 + q_norm);  k ← rmsnorm₀(k)·(1 + k_norm)
//   q, k ← NeoX RoPE on dims [0, R): (x_i, x_{i+R/2}) rotated by p·inv_freq[i]
//   K[p], V[p] ← k, v  (cache);  o_h = Σ_{t≤p} softmax_t(q_h·K[t]·Dh^−½) V[t]   (GQA: kv head h/(Hq/Hkv))
//   o_h ← o_h ⊙ sigmoid(gate_h)
// KV cache (per sequence, at cursor.state_base + k_off / v_off): [Hkv, max_ctx, Dh], bf16 or f32.
//
// attn_prep_*:    grid Hq + Hkv (one head each), block 128. Norm + RoPE; q (pre-scaled by Dh^−½) to
//                 q_out, k and v appended to the cache at p.
// attn_decode_*:  split-KV ("flash decoding"): grid (nsplit, Hkv), block 32·G threads (G = Hq/Hkv q
//                 heads share one K/V tile: warp g is q head kvh·G + g). Positions [0, p] are cut into
//                 nsplit chunks (multiples of TILE); per tile of 32 positions: lane t scores position
//                 t, the warp updates its online softmax, then accumulates P·V with lane owning dims
//                 lane + 32e. Writes unnormalised partials (m, l, acc[Dh]) per (q head, split).
//                 Dynamic smem: G·Dh·4 (q) + TILE·(Dh+pad)·elt (K) + TILE·Dh·elt (V).
// attn_combine:   grid Hq, block min(Dh, 256): merges the splits by log-sum-exp (split weights once in
//                 shared memory), applies the output gate.
// Bytes per token: K and V of p+1 positions (2·Hkv·Dh·elt each) + partials.

#define ATTN_TILE 32
#define ATTN_MAX_DPL 8 // Dh ≤ 256

struct AttnPrepParams {
    u64 qg;       // [Hq, Dh·(gated ? 2 : 1)]: per head [q | gate]
    u64 k;        // [Hkv·Dh]
    u64 v;        // [Hkv·Dh]
    u64 q_gain;   // [Dh] = 1 + q_norm
    u64 k_gain;   // [Dh] = 1 + k_norm
    u64 inv_freq; // [R/2]
    u64 cursor;
    i64 k_off, v_off;
    u64 q_out;    // [Hq, Dh] f32
    int Hq, Hkv, Dh, rot, max_ctx, gated;
    float eps, scale;
};

__device__ __forceinline__ void kv_store(float* base, i64 i, float v) { base[i] = v; }
__device__ __forceinline__ void kv_store(u16* base, i64 i, float v) { base[i] = f32_to_bf16(v); }
__device__ __forceinline__ float kv_load(const float* base, i64 i) { return base[i]; }
__device__ __forceinline__ float kv_load(const u16* base, i64 i) { return bf16_to_f32(base[i]); }

template <typename KV>
__device__ __forceinline__ void attn_prep_body(const AttnPrepParams& p) {
    extern __shared__ float x[]; // [Dh]
    __shared__ float red[32];
    griddep_launch_dependents();
    griddep_wait();
    const int b = blockIdx.x, tid = threadIdx.x, Dh = p.Dh;
    const Cursor cur = *(const Cursor*)p.cursor;
    const bool is_q = b < p.Hq;
    const int kvh = b - p.Hq;
    const float* src = is_q ? (const float*)p.qg + (i64)b * Dh * (p.gated ? 2 : 1) : (const float*)p.k + (i64)kvh * Dh;
    const float* gain = (const float*)(is_q ? p.q_gain : p.k_gain);

    float ss = 0.0f;
    for (int d = tid; d < Dh; d += blockDim.x) { const float v = src[d]; x[d] = v; ss += v * v; }
    const float inv = 1.0f / sqrtf(block_sum(ss, red) / (float)Dh + p.eps);
    for (int d = tid; d < Dh; d += blockDim.x) x[d] = x[d] * inv * gain[d];
    __syncthreads();
    // RoPE, NeoX half split: pairs (i, i + R/2); angle = p·inv_freq[i] in f32 (as HF).
    const int half = p.rot / 2;
    float rot_a = 0.0f, rot_b = 0.0f;
    if (tid < half) {
        const float angle = (float)cur.pos * ((const float*)p.inv_freq)[tid];
        const float c = cosf(angle), s = sinf(angle);
        const float x1 = x[tid], x2 = x[tid + half];
        rot_a = x1 * c - x2 * s;
        rot_b = x2 * c + x1 * s;
    }
    __syncthreads();
    if (tid < half) { x[tid] = rot_a; x[tid + half] = rot_b; }
    __syncthreads();
    if (is_q) {
        float* q = (float*)p.q_out + (i64)b * Dh;
        for (int d = tid; d < Dh; d += blockDim.x) q[d] = x[d] * p.scale;
    } else {
        const i64 row = ((i64)kvh * p.max_ctx + cur.pos) * Dh;
        KV* kc = (KV*)(cur.state_base + p.k_off);
        KV* vc = (KV*)(cur.state_base + p.v_off);
        const float* v = (const float*)p.v + (i64)kvh * Dh;
        for (int d = tid; d < Dh; d += blockDim.x) {
            kv_store(kc, row + d, x[d]);
            kv_store(vc, row + d, v[d]);
        }
    }
}

struct AttnDecodeParams {
    u64 q;        // [Hq, Dh] f32, pre-scaled
    u64 cursor;
    i64 k_off, v_off;
    u64 part_m;   // [Hq, nsplit]
    u64 part_l;   // [Hq, nsplit]
    u64 part_acc; // [Hq, nsplit, Dh]
    int Hq, Hkv, Dh, max_ctx, nsplit;
    int pad;
};

// K tile row pitch in elements: 16-byte aligned rows, 4 words past a multiple of 32 words, so the 8
// lanes of each quarter-warp phase of a 16-byte read (rows t..t+7, one column) hit disjoint banks.
template <typename KV> __host__ __device__ __forceinline__ int k_pitch(int Dh);
template <> __host__ __device__ __forceinline__ int k_pitch<float>(int Dh) { return Dh + 4; }
template <> __host__ __device__ __forceinline__ int k_pitch<u16>(int Dh) { return Dh + 8; }

// q·K[t] over Dh in order d = 0, 1, …: 16-byte reads of the K row and of q (broadcast).
__device__ __forceinline__ float score_dot(const float* q, const float* k, int Dh) {
    float dot = 0.0f;
#pragma unroll 4
    for (int d = 0; d < Dh; d += 4) {
        const float4 qq = *(const float4*)(q + d), kk = *(const float4*)(k + d);
        dot = fmaf(qq.x, kk.x, dot);
        dot = fmaf(qq.y, kk.y, dot);
        dot = fmaf(qq.z, kk.z, dot);
        dot = fmaf(qq.w, kk.w, dot);
    }
    return dot;
}
__device__ __forceinline__ float score_dot(const float* q, const u16* k, int Dh) {
    float dot = 0.0f;
#pragma unroll 2
    for (int d = 0; d < Dh; d += 8) {
        const float4 qa = *(const float4*)(q + d), qb = *(const float4*)(q + d + 4);
        const uint4 kk = *(const uint4*)(k + d);
        dot = fmaf(qa.x, bf16_lo(kk.x), dot);
        dot = fmaf(qa.y, bf16_hi(kk.x), dot);
        dot = fmaf(qa.z, bf16_lo(kk.y), dot);
        dot = fmaf(qa.w, bf16_hi(kk.y), dot);
        dot = fmaf(qb.x, bf16_lo(kk.z), dot);
        dot = fmaf(qb.y, bf16_hi(kk.z), dot);
        dot = fmaf(qb.z, bf16_lo(kk.w), dot);
        dot = fmaf(qb.w, bf16_hi(kk.w), dot);
    }
    return dot;
}

template <typename KV>
__device__ __forceinline__ void attn_decode_body(const AttnDecodeParams& p) {
    extern __shared__ float smem[];
    griddep_launch_dependents();
    griddep_wait();
    const int G = p.Hq / p.Hkv, Dh = p.Dh, kvh = blockIdx.y, split = blockIdx.x;
    const int tid = threadIdx.x, lane = tid & 31, g = tid >> 5;
    const int hq = kvh * G + g;
    float* q_s = smem;                                     // [G, Dh]
    KV* k_s = (KV*)(smem + G * Dh);                        // [TILE, k_pitch]
    KV* v_s = k_s + ATTN_TILE * k_pitch<KV>(Dh);            // [TILE, Dh]
    const Cursor cur = *(const Cursor*)p.cursor;
    const int len = cur.pos + 1;
    int chunk = (len + p.nsplit - 1) / p.nsplit;
    chunk = (chunk + ATTN_TILE - 1) / ATTN_TILE * ATTN_TILE;
    const int t0 = split * chunk, t1 = min(len, t0 + chunk);

    for (int i = tid; i < G * Dh; i += blockDim.x) q_s[i] = ((const float*)p.q)[(i64)kvh * G * Dh + i];
    const KV* kc = (const KV*)(cur.state_base + p.k_off) + (i64)kvh * p.max_ctx * Dh;
    const KV* vc = (const KV*)(cur.state_base + p.v_off) + (i64)kvh * p.max_ctx * Dh;
    const int dpl = Dh / 32;
    float m = NEG_INF, l = 0.0f, acc[ATTN_MAX_DPL];
#pragma unroll
    for (int e = 0; e < ATTN_MAX_DPL; ++e) acc[e] = 0.0f;
    const int kp = k_pitch<KV>(Dh);

    for (int base = t0; base < t1; base += ATTN_TILE) {
        const int n = min(ATTN_TILE, t1 - base);
        __syncthreads(); // previous tile fully consumed (and q_s written, first time)
        // The tile's K and V rows are contiguous in the cache: 16-byte loads, four per thread issued
        // before any store (one memory latency per tile, not one per element); V rows keep their
        // 16-byte alignment in shared memory, K rows go to the padded pitch as 4-byte words.
        {
            constexpr int EPV = 16 / sizeof(KV);
            const int vecs = n * Dh / EPV;
            const KV* kt = kc + (i64)base * Dh;
            const KV* vt = vc + (i64)base * Dh;
            for (int i0 = tid; i0 < vecs; i0 += blockDim.x * 4) {
                uint4 kr[4], vr[4];
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const int i = i0 + u * blockDim.x;
                    if (i < vecs) {
                        kr[u] = *(const uint4*)(kt + (i64)i * EPV);
                        vr[u] = *(const uint4*)(vt + (i64)i * EPV);
                    }
                }
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const int i = i0 + u * blockDim.x;
                    if (i < vecs) {
                        const int e = i * EPV, t = e / Dh, d = e - t * Dh;
                        *(uint4*)(k_s + t * kp + d) = kr[u];
                        *(uint4*)(v_s + t * Dh + d) = vr[u];
                    }
                }
            }
        }
        __syncthreads();
        // scores: lane t ↔ position base + t
        float s = NEG_INF;
        if (lane < n) s = score_dot(q_s + g * Dh, k_s + lane * kp, Dh);
        const float m_new = fmaxf(m, warp_max(s));
        const float pr = lane < n ? expf(s - m_new) : 0.0f;
        const float corr = expf(m - m_new); // 0 on the first tile (m = −inf)
        l = l * corr + warp_sum(pr);
        m = m_new;
#pragma unroll
        for (int e = 0; e < ATTN_MAX_DPL; ++e) acc[e] *= corr;
        for (int t = 0; t < n; ++t) {
            const float pt = __shfl_sync(0xffffffffu, pr, t);
#pragma unroll
            for (int e = 0; e < ATTN_MAX_DPL; ++e)
                if (e < dpl) acc[e] = fmaf(pt, kv_load(v_s, t * Dh + lane + 32 * e), acc[e]);
        }
    }
    const i64 slot = (i64)hq * p.nsplit + split;
    if (lane == 0) {
        ((float*)p.part_m)[slot] = m;
        ((float*)p.part_l)[slot] = l;
    }
    float* out = (float*)p.part_acc + slot * Dh;
#pragma unroll
    for (int e = 0; e < ATTN_MAX_DPL; ++e)
        if (e < dpl) out[lane + 32 * e] = acc[e];
}

struct AttnCombineParams {
    u64 part_m, part_l, part_acc;
    u64 qg;  // for the gate: [Hq, 2·Dh]
    u64 y;   // [Hq·Dh]
    int Hq, Dh, nsplit, gated;
};

// Each split's weight exp(m_s − M) is computed once into shared memory (nsplit ≤ ATTN_MAX_SPLITS);
// thread d then sums the splits' partials with independent loads.
#define ATTN_MAX_SPLITS 1024
extern "C" __global__ void __launch_bounds__(256) attn_combine(const AttnCombineParams p) {
    __shared__ float w_s[ATTN_MAX_SPLITS];
    __shared__ float red[32];
    griddep_launch_dependents();
    griddep_wait();
    const int h = blockIdx.x;
    const float* pm = (const float*)p.part_m + (i64)h * p.nsplit;
    const float* pl = (const float*)p.part_l + (i64)h * p.nsplit;
    float M = NEG_INF;
    for (int s = threadIdx.x; s < p.nsplit; s += blockDim.x)
        if (pl[s] > 0.0f) M = fmaxf(M, pm[s]);
    M = block_max(M, red);
    float L = 0.0f;
    for (int s = threadIdx.x; s < p.nsplit; s += blockDim.x) {
        const float l = pl[s];
        const float w = l > 0.0f ? expf(pm[s] - M) : 0.0f;
        w_s[s] = w;
        L += l * w;
    }
    L = block_sum(L, red); // ends with a barrier: w_s is complete
    const float* acc = (const float*)p.part_acc + (i64)h * p.nsplit * p.Dh;
    for (int d = threadIdx.x; d < p.Dh; d += blockDim.x) {
        float o = 0.0f;
#pragma unroll 8
        for (int s = 0; s < p.nsplit; ++s) {
            const float w = w_s[s];
            if (w != 0.0f) o += acc[(i64)s * p.Dh + d] * w;
        }
        o /= L;
        if (p.gated) o *= sigmoid_f(((const float*)p.qg)[(i64)h * 2 * p.Dh + p.Dh + d]);
        ((float*)p.y)[(i64)h * p.Dh + d] = o;
    }
}

extern "C" __global__ void __launch_bounds__(128) attn_prep_bf16(const AttnPrepParams p) { attn_prep_body<u16>(p); }
extern "C" __global__ void __launch_bounds__(128) attn_prep_f32(const AttnPrepParams p) { attn_prep_body<float>(p); }
extern "C" __global__ void __launch_bounds__(512) attn_decode_bf16(const AttnDecodeParams p) { attn_decode_body<u16>(p); }
extern "C" __global__ void __launch_bounds__(512) attn_decode_f32(const AttnDecodeParams p) { attn_decode_body<float>(p); }

// Layouts shared with the Rust launchers (tests/layouts.rs checks the same sizes).
static_assert(sizeof(AttnPrepParams) == 112, "AttnPrepParams layout differs from its Rust twin");
static_assert(sizeof(AttnDecodeParams) == 80, "AttnDecodeParams layout differs from its Rust twin");
static_assert(sizeof(AttnCombineParams) == 56, "AttnCombineParams layout differs from its Rust twin");
