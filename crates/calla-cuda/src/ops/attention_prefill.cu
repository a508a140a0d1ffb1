// attention_prefill.cu: gated full attention for a prompt of T tokens at positions p0..p0+T, in two
// launches: prep (q/k norm + partial RoPE + KV-cache append) and causal flash attention on the
// tensor cores (+ the sigmoid output gate), reading the decode kernel's KV cache.
//
// Math (CPU reference: calla_cpu::attention::Attention::forward), token t at position p = p0 + t:
//   q ← rmsnorm₀(q)·(1 + q_norm);  k ← rmsnorm₀(k)·(1 + k_norm)     per head of Dh
//   q, k ← NeoX RoPE on dims [0, R): (x_i, x_{i+R/2}) rotated by p·inv_freq[i]
//   K[p], V[p] ← k, v;  o_h = Σ_{s≤p} softmax_s(q_h·K[s]·Dh^−½) V[s]    (q head h → KV head h/(Hq/Hkv))
//   o_h ← o_h ⊙ sigmoid(gate_h)
// Layouts: qg [T, Hq·(2)Dh] (per head [q | gate]); k, v [T, Hkv·Dh] f32 (projections); KV cache
//   [Hkv, max_ctx, Dh] in bf16 or f32 (attention.cu's layout); Q [T, Hq, Dh] as bf16 planes
//   (pre-scaled by Dh^−½ in f32 before the split); output planes [T, Hq·Dh] bf16 (o_proj's input).
// prefill_attn_prep_{bf16,f32}: grid (T, Hq + Hkv), block 128, smem Dh floats.
// prefill_attn_flash_d{32,64,128,256}_{bf16,f32}: FlashAttention-2 style. grid (⌈T/64⌉, Hq), block
//   128 (4 warps × 16 query rows); per KV tile of 64 positions: S = Q·Kᵀ (mma, K rows as the "col"
//   operand), online softmax in base 2 (f32), P → bf16 A fragments in registers, O += P·V (V through
//   ldmatrix.trans). Longest query tiles are scheduled first.
//   bf16 cache: plain bf16 products; smem 3 × 64·Dh·2 bytes (96 KiB at Dh 256).
//   f32 cache ("split"): Q, K, V, P as bf16 hi + lo, products hi·hi + lo·hi + hi·lo, so the prompt
//   agrees with the f32 decode path to ~f32 rounding; smem 6 × 64·Dh·2 bytes (192 KiB at Dh 256).
// FLOPs ≈ 4·Hq·Dh·Σ_t (p0 + t + 1) (×3 split); bytes: Q, O once, K/V once per (query tile, q head),
//   mostly from L2.

#define AP_BQ 64
#define AP_BKV 64
#define AP_LOG2E 1.4426950408889634f

struct AttnpPrepParams {
    u64 qg;        // [T, qg_ld] f32
    u64 k, v;      // [T, Hkv·Dh] f32
    u64 q_gain, k_gain; // [Dh] = 1 + norm weight
    u64 inv_freq;  // [R/2]
    u64 k_cache, v_cache; // [Hkv, max_ctx, Dh]
    u64 q_hi, q_lo;// [T, Hq, Dh] bf16 planes (lo: f32 caches only)
    int T, p0, Hq, Hkv, Dh, rot, max_ctx, gated;
    float eps, scale;
};

__device__ __forceinline__ void ap_store(float* base, i64 i, float v) { base[i] = v; }
__device__ __forceinline__ void ap_store(u16* base, i64 i, float v) { base[i] = f32_to_bf16(v); }

template <typename KV>
__device__ __forceinline__ void attnp_prep_body(const AttnpPrepParams& p) {
    extern __shared__ float x[]; // [Dh]
    __shared__ float red[32];
    const int t = blockIdx.x, b = blockIdx.y, tid = threadIdx.x, Dh = p.Dh;
    const int pos = p.p0 + t;
    const bool is_q = b < p.Hq;
    const int kvh = b - p.Hq;
    const int qg_ld = p.Hq * Dh * (p.gated ? 2 : 1);
    const float* src = is_q ? (const float*)p.qg + (i64)t * qg_ld + (i64)b * Dh * (p.gated ? 2 : 1)
                            : (const float*)p.k + ((i64)t * p.Hkv + kvh) * Dh;
    const float* gain = (const float*)(is_q ? p.q_gain : p.k_gain);
    float ss = 0.0f;
    for (int d = tid; d < Dh; d += blockDim.x) { const float v = src[d]; x[d] = v; ss += v * v; }
    const float inv = 1.0f / sqrtf(block_sum(ss, red) / (float)Dh + p.eps);
    for (int d = tid; d < Dh; d += blockDim.x) x[d] = x[d] * inv * gain[d];
    __syncthreads();
    const int half = p.rot / 2;
    float ra = 0.0f, rb = 0.0f;
    for (int i = tid; i < half; i += blockDim.x) {
        const float angle = (float)pos * ((const float*)p.inv_freq)[i];
        const float c = cosf(angle), s = sinf(angle);
        const float x1 = x[i], x2 = x[i + half];
        ra = x1 * c - x2 * s;
        rb = x2 * c + x1 * s;
    }
    __syncthreads();
    for (int i = tid; i < half; i += blockDim.x) { x[i] = ra; x[i + half] = rb; } // half ≤ blockDim
    __syncthreads();
    if (is_q) {
        const i64 q0 = ((i64)t * p.Hq + b) * Dh;
        for (int d = tid; d < Dh; d += blockDim.x) store_planes((u16*)p.q_hi, (u16*)p.q_lo, q0 + d, x[d] * p.scale);
    } else {
        const i64 row = ((i64)kvh * p.max_ctx + pos) * Dh;
        const float* v = (const float*)p.v + ((i64)t * p.Hkv + kvh) * Dh;
        for (int d = tid; d < Dh; d += blockDim.x) {
            ap_store((KV*)p.k_cache, row + d, x[d]);
            ap_store((KV*)p.v_cache, row + d, v[d]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(128) prefill_attn_prep_bf16(const AttnpPrepParams p) { attnp_prep_body<u16>(p); }
extern "C" __global__ void __launch_bounds__(128) prefill_attn_prep_f32(const AttnpPrepParams p) { attnp_prep_body<float>(p); }

struct AttnpFlashParams {
    u64 q_hi, q_lo;       // [T, Hq, Dh] bf16 planes (lo: split only)
    u64 k_cache, v_cache; // [Hkv, max_ctx, Dh]
    u64 qg;               // gate source [T, qg_ld] f32
    u64 out_hi, out_lo;   // [T, Hq·Dh] bf16 planes (either may be 0)
    int T, p0, Hq, Hkv, max_ctx, gated, qg_ld, pad;
    u64 out_f16;          // [T, Hq·Dh] f16 or 0
};

// Tile byte offset of (row r, chunk c) for rows of DH bf16.
template <int DH>
__device__ __forceinline__ u32 ap_swz(int r, int c) {
    constexpr int NCH = DH / 8;
    constexpr int MASK = NCH >= 8 ? 7 : NCH - 1;
    return (u32)(r * DH * 2 + ((c ^ (r & MASK)) << 4));
}

// Rows [0, 64) of a KV tile (positions past `len` are zeros) into bf16 tiles: a bf16 cache by
// cp.async; an f32 cache (F32) rounded to bf16 hi tiles, and with SPLIT also the lo tiles.
template <int DH, bool F32, bool SPLIT>
__device__ __forceinline__ void ap_load_kv(u8* hi, u8* lo, const void* cache, int len) {
    constexpr int NCH = DH / 8;
    for (int c = threadIdx.x; c < AP_BKV * NCH; c += blockDim.x) {
        const int r = c / NCH, ch = c - r * NCH;
        const bool valid = r < len;
        if (!F32) {
            const u16* src = (const u16*)cache + (i64)(valid ? r : 0) * DH + ch * 8;
            cp_async16(smem_addr(hi + ap_swz<DH>(r, ch)), src, valid ? 16 : 0);
        } else {
            float v[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) v[e] = 0.0f;
            if (valid) {
                const float* src = (const float*)cache + (i64)r * DH + ch * 8;
                const float4 a = *(const float4*)src, b = *(const float4*)(src + 4);
                v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
            }
            u32 wh[4], wl[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                u16 h0, l0, h1, l1;
                split_bf16(v[2 * e], h0, l0);
                split_bf16(v[2 * e + 1], h1, l1);
                wh[e] = (u32)h0 | ((u32)h1 << 16);
                wl[e] = (u32)l0 | ((u32)l1 << 16);
            }
            *(uint4*)(hi + ap_swz<DH>(r, ch)) = make_uint4(wh[0], wh[1], wh[2], wh[3]);
            if (SPLIT) *(uint4*)(lo + ap_swz<DH>(r, ch)) = make_uint4(wl[0], wl[1], wl[2], wl[3]);
        }
    }
}

__device__ __forceinline__ float ap_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// F32: the cache holds f32 K/V (else bf16). SPLIT (f32 caches, split-precision prompts): every
// product as hi·hi + lo·hi + hi·lo, so prompts match the f32 decode path to ~f32 rounding; otherwise
// plain bf16 products (an f32 cache is rounded to bf16 as its tiles are loaded: fast-precision
// prompts, whose o_proj input is bf16 anyway).
template <int DH, bool F32, bool SPLIT>
__device__ __forceinline__ void attnp_flash_body(const AttnpFlashParams& p) {
    constexpr int NCH = DH / 8, NT = DH / 8; // 16-byte chunks per row; n-tiles of O
    constexpr int TILE = AP_BQ * DH * 2;
    extern __shared__ __align__(128) u8 smem[];
    u8* Qh = smem;
    u8* Kh = Qh + TILE;
    u8* Vh = Kh + TILE;
    u8* Ql = Vh + TILE; // split only
    u8* Kl = Ql + TILE;
    u8* Vl = Kl + TILE;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int qt = gridDim.x - 1 - blockIdx.x; // longest tiles first
    const int h = blockIdx.y, kvh = h / (p.Hq / p.Hkv);
    const int t0 = qt * AP_BQ;
    const int kv_len = p.p0 + min(t0 + AP_BQ, p.T); // positions this tile's queries may see
    const int elt = F32 ? 4 : 2;
    const u8* kc = (const u8*)p.k_cache + (i64)kvh * p.max_ctx * DH * elt;
    const u8* vc = (const u8*)p.v_cache + (i64)kvh * p.max_ctx * DH * elt;

    for (int c = tid; c < AP_BQ * NCH; c += blockDim.x) {
        const int r = c / NCH, ch = c - r * NCH, t = t0 + r;
        const bool valid = t < p.T;
        const i64 off = (((i64)(valid ? t : 0) * p.Hq + h) * DH + ch * 8) * 2;
        cp_async16(smem_addr(Qh + ap_swz<DH>(r, ch)), (const u8*)p.q_hi + off, valid ? 16 : 0);
        if (SPLIT) cp_async16(smem_addr(Ql + ap_swz<DH>(r, ch)), (const u8*)p.q_lo + off, valid ? 16 : 0);
    }
    cp_async_commit();

    float o[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[j][e] = 0.0f;
    float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.0f, 0.0f};
    const int g = lane >> 2, qd = lane & 3;
    const int qpos[2] = {p.p0 + t0 + warp * 16 + g, p.p0 + t0 + warp * 16 + g + 8};

    const int ntiles = (kv_len + AP_BKV - 1) / AP_BKV;
    for (int kt = 0; kt < ntiles; ++kt) {
        const int kv0 = kt * AP_BKV;
        __syncthreads(); // previous K/V tile consumed
        ap_load_kv<DH, F32, SPLIT>(Kh, Kl, kc + (i64)kv0 * DH * elt, kv_len - kv0);
        ap_load_kv<DH, F32, SPLIT>(Vh, Vl, vc + (i64)kv0 * DH * elt, kv_len - kv0);
        cp_async_commit();
        cp_async_wait_all();
        __syncthreads();

        // S = Q·Kᵀ for this warp's 16 rows × 64 positions (8 n-tiles)
        float s[8][4];
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] = 0.0f;
#pragma unroll 4
        for (int ks = 0; ks < DH / 16; ++ks) {
            const u32 qa = ap_swz<DH>(warp * 16 + (lane & 15), ks * 2 + (lane >> 4));
            u32 a[4], al[4];
            ldsm_x4(smem_addr(Qh + qa), a[0], a[1], a[2], a[3]);
            if (SPLIT) ldsm_x4(smem_addr(Ql + qa), al[0], al[1], al[2], al[3]);
#pragma unroll
            for (int np = 0; np < 4; ++np) {
                const u32 ka = ap_swz<DH>(np * 16 + (lane & 7) + ((lane >> 4) << 3), ks * 2 + ((lane >> 3) & 1));
                u32 b0, b1, b2, b3;
                ldsm_x4(smem_addr(Kh + ka), b0, b1, b2, b3);
                mma_bf16(s[2 * np], a, b0, b1);
                mma_bf16(s[2 * np + 1], a, b2, b3);
                if (SPLIT) {
                    mma_bf16(s[2 * np], al, b0, b1);
                    mma_bf16(s[2 * np + 1], al, b2, b3);
                    ldsm_x4(smem_addr(Kl + ka), b0, b1, b2, b3);
                    mma_bf16(s[2 * np], a, b0, b1);
                    mma_bf16(s[2 * np + 1], a, b2, b3);
                }
            }
        }
        // causal mask, online softmax (base 2)
        float corr[2];
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            float mx = NEG_INF;
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int kpos = kv0 + j * 8 + 2 * qd + e;
                    float v = s[j][2 * hr + e] * AP_LOG2E;
                    if (kpos > qpos[hr] || kpos >= kv_len) v = NEG_INF;
                    s[j][2 * hr + e] = v;
                    mx = fmaxf(mx, v);
                }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(m_run[hr], mx);
            const float m_use = m_new == NEG_INF ? 0.0f : m_new;
            corr[hr] = ap_exp2(m_run[hr] - m_use); // 0 on the first tile
            m_run[hr] = m_new;
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float pr = ap_exp2(s[j][2 * hr + e] - m_use);
                    s[j][2 * hr + e] = pr;
                    sum += pr;
                }
            l_run[hr] = l_run[hr] * corr[hr] + sum; // per-lane partial; reduced over the quad at the end
        }
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            o[j][0] *= corr[0]; o[j][1] *= corr[0];
            o[j][2] *= corr[1]; o[j][3] *= corr[1];
        }
        // O += P·V: P's C fragments are the A fragments of the next mma (16 positions per k-step)
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            u32 a[4], al[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) { // a0..a3 = (n-tile 2kk | 2kk+1) × (row g | g+8)
                const int nt = 2 * kk + (r >> 1), e = 2 * (r & 1);
                u16 h0, l0, h1, l1;
                split_bf16(s[nt][e], h0, l0);
                split_bf16(s[nt][e + 1], h1, l1);
                a[r] = (u32)h0 | ((u32)h1 << 16);
                al[r] = (u32)l0 | ((u32)l1 << 16);
            }
            const int row = kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
#pragma unroll
            for (int dp = 0; dp < DH / 16; ++dp) {
                const u32 va = ap_swz<DH>(row, dp * 2 + (lane >> 4));
                u32 b0, b1, b2, b3;
                ldsm_x4_trans(smem_addr(Vh + va), b0, b1, b2, b3);
                mma_bf16(o[2 * dp], a, b0, b1);
                mma_bf16(o[2 * dp + 1], a, b2, b3);
                if (SPLIT) {
                    mma_bf16(o[2 * dp], al, b0, b1);
                    mma_bf16(o[2 * dp + 1], al, b2, b3);
                    ldsm_x4_trans(smem_addr(Vl + va), b0, b1, b2, b3);
                    mma_bf16(o[2 * dp], a, b0, b1);
                    mma_bf16(o[2 * dp + 1], a, b2, b3);
                }
            }
        }
    }

    // normalise, gate, write planes
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        float l = l_run[hr];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        const int t = t0 + warp * 16 + g + 8 * hr;
        if (t >= p.T) continue;
        const float* gate = (const float*)p.qg + (i64)t * p.qg_ld + (i64)h * 2 * DH + DH;
        const i64 orow = ((i64)t * p.Hq + h) * DH;
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int d = j * 8 + 2 * qd + e;
                float v = o[j][2 * hr + e] * inv;
                if (p.gated) v *= sigmoid_f(gate[d]);
                store_act((u16*)p.out_hi, (u16*)p.out_lo, (u16*)p.out_f16, orow + d, v);
            }
    }
}

#define AP_FLASH(DH)                                                                                   \
    extern "C" __global__ void __launch_bounds__(128) prefill_attn_flash_d##DH##_bf16(const AttnpFlashParams p) { \
        attnp_flash_body<DH, false, false>(p);                                                         \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(128) prefill_attn_flash_d##DH##_f32(const AttnpFlashParams p) {  \
        attnp_flash_body<DH, true, true>(p);                                                           \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(128) prefill_attn_flash_d##DH##_f32fast(const AttnpFlashParams p) { \
        attnp_flash_body<DH, true, false>(p);                                                          \
    }
AP_FLASH(32)
AP_FLASH(64)
AP_FLASH(128)
AP_FLASH(256)
