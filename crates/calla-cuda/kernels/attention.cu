// attention.cu: gated full attention for one decode token, in one launch.
//
// Math (CPU reference: calla_cpu::attention::Attention::forward), token at position p:
//   per q head: [q | gate] = q_proj rows;  q ← rmsnorm₀(q)·(1 + q_norm);  k ← rmsnorm₀(k)·(1 + k_norm)
//   q, k ← NeoX RoPE on dims [0, R): (x_i, x_{i+R/2}) rotated by p·inv_freq[i]
//   K[p], V[p] ← k, v  (cache);  o_h = Σ_{t≤p} softmax_t(q_h·K[t]·Dh^−½) V[t]   (GQA: kv head h/(Hq/Hkv))
//   o_h ← o_h ⊙ sigmoid(gate_h)
// KV cache (per sequence, at cursor.state_base + k_off / v_off): [Hkv, max_ctx, Dh], bf16 or f32.
//
// attn_decode_*: split-KV ("flash decoding"), grid (nsplit, Hkv), block 32·G threads (G = Hq/Hkv q
// heads share one K/V tile: warp g is q head kvh·G + g).
//   Live splits (from the cursor, so one captured graph serves every position): the p+1 positions
//   are T = ⌈(p+1)/TILE⌉ tiles; S = min(nsplit, ⌈T/min_tiles⌉) ≤ T splits, split s takes tiles
//   [⌊s·T/S⌋, ⌊(s+1)·T/S⌋) (none empty, sizes within one tile). Blocks with split ≥ S exit at once.
//   Prologue (was attn_prep): every block normalises and rotates the q of its G heads into shared
//   memory (warp g, head g; pre-scaled by Dh^−½). The block whose range holds p (the last live
//   split; no other block reads position p) also normalises and rotates k, writes K[p], V[p] to the
//   cache, and uses those values (rounded to the cache type) for row p of its last tile instead of
//   reading the cache back.
//   Tiles of 32 positions: lane t scores position t, the warp updates its online softmax, then
//   accumulates P·V with lane owning dims lane + 32e. Each split writes unnormalised partials
//   (m, l, acc[Dh]) per (q head, split).
//   Merge (was attn_combine), by log-sum-exp in a fixed order, so the result does not depend on
//   which block merges: splits form groups of ATTN_GROUP; the last block of a group to finish
//   (atomic ticket per (kv head, group), reset by that block) merges the group's splits in split
//   order into the group's first slot; the last group merger of the kv head (ticket per kv head)
//   merges the groups in group order, divides by Σl, applies the output gate and writes y. With
//   one group the group merger writes y directly. Each warp merges its own q head.
// Dynamic smem: G·Dh·4 (q) + 2·Dh·4 (k, v of p) + max(TILE·(Dh+pad)·elt (K) + TILE·Dh·elt (V),
// G·ATTN_MAX_MERGE·4 (merge weights, after the tiles are done)).
// Bytes per token: K and V of p positions (2·Hkv·Dh·elt each) + partials (2× S·Hq·Dh·4, L2).

#define ATTN_TILE 32
#define ATTN_MAX_DPL 8     // Dh ≤ 256
#define ATTN_GROUP 16      // splits per first-level merge
#define ATTN_MAX_MERGE 64  // inputs of one merge: ≤ ATTN_GROUP splits or ≤ 1024 / ATTN_GROUP groups

struct AttnDecodeParams {
    u64 qg;       // [Hq, Dh·(gated ? 2 : 1)]: per head [q | gate]
    u64 k;        // [Hkv·Dh] this token's k (before norm and RoPE)
    u64 v;        // [Hkv·Dh]
    u64 q_gain;   // [Dh] = 1 + q_norm
    u64 k_gain;   // [Dh] = 1 + k_norm
    u64 inv_freq; // [R/2]
    u64 cursor;
    i64 k_off, v_off;
    u64 part_m;   // [Hq, nsplit]
    u64 part_l;   // [Hq, nsplit]
    u64 part_acc; // [Hq, nsplit, Dh]
    u64 tickets;  // u32 [Hkv, 1 + ⌈nsplit / ATTN_GROUP⌉], zero between launches
    u64 y;        // [Hq·Dh] f32
    int Hq, Hkv, Dh, rot, max_ctx, nsplit, min_tiles, gated;
    float eps, scale;
};

__device__ __forceinline__ void kv_store(float* base, i64 i, float v) { base[i] = v; }
__device__ __forceinline__ void kv_store(u16* base, i64 i, float v) { base[i] = f32_to_bf16(v); }
__device__ __forceinline__ float kv_load(const float* base, i64 i) { return base[i]; }
__device__ __forceinline__ float kv_load(const u16* base, i64 i) { return bf16_to_f32(base[i]); }

// One head row by one warp: dst = rope(rmsnorm₀(src)·gain)·scale, dst in shared memory [Dh].
// Same arithmetic per element as the prefill prep (x·inv·gain, f32 angle p·inv_freq[i]).
__device__ __forceinline__ void norm_rope_row(const float* src, const float* gain, const float* inv_freq,
                                              float* dst, int Dh, int rot, int pos, float eps, float scale) {
    const int lane = threadIdx.x & 31, dpl = Dh / 32;
    float x[ATTN_MAX_DPL];
    float ss = 0.0f;
#pragma unroll
    for (int e = 0; e < ATTN_MAX_DPL; ++e)
        if (e < dpl) { x[e] = src[lane + 32 * e]; ss += x[e] * x[e]; }
    const float inv = 1.0f / sqrtf(warp_sum(ss) / (float)Dh + eps);
#pragma unroll
    for (int e = 0; e < ATTN_MAX_DPL; ++e)
        if (e < dpl) dst[lane + 32 * e] = x[e] * inv * gain[lane + 32 * e];
    __syncwarp();
    // NeoX half split: pair (i, i + R/2) belongs to one lane, so no pair is read after another
    // lane wrote it.
    const int half = rot / 2;
    for (int i = lane; i < half; i += 32) {
        const float angle = (float)pos * inv_freq[i];
        const float c = cosf(angle), s = sinf(angle);
        const float x1 = dst[i], x2 = dst[i + half];
        dst[i] = x1 * c - x2 * s;
        dst[i + half] = x2 * c + x1 * s;
    }
    __syncwarp();
#pragma unroll
    for (int e = 0; e < ATTN_MAX_DPL; ++e)
        if (e < dpl) dst[lane + 32 * e] *= scale;
    __syncwarp();
}
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

// Live splits at position `pos` (the Rust twin attention::live_splits agrees): the pos + 1
// positions are T tiles; S = min(nsplit, ⌈T / min_tiles⌉) ≤ T splits, split s takes tiles
// [⌊s·T/S⌋, ⌊(s+1)·T/S⌋) (≥ 1 each). Returns (S, T).
__device__ __forceinline__ int2 attn_live_splits(int pos, int nsplit, int min_tiles) {
    const int tiles = (pos + ATTN_TILE) / ATTN_TILE; // ⌈(pos + 1) / TILE⌉
    return make_int2(min(nsplit, (tiles + min_tiles - 1) / min_tiles), tiles);
}

// Block-wide arrival at `ticket`, which `count` blocks reach in this launch: true in the last one
// (which resets the ticket for the next launch). Writes before the call are visible to that block.
__device__ __forceinline__ bool arrive_last(unsigned* ticket, unsigned count, int* flag_s) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned t = atomicAdd(ticket, 1u);
        const int last = t + 1 == count;
        if (last) atomicExch(ticket, 0u);
        *flag_s = last;
    }
    __syncthreads();
    const bool last = *flag_s != 0;
    if (last) __threadfence();
    return last;
}

// One warp merges `count` partials of q head `hq` (slots first + i·stride, i in order) by
// log-sum-exp. final: y = (Σ w_i acc_i / Σ w_i l_i) ⊙ sigmoid(gate); else the unnormalised merge
// (M, Σ w_i l_i, Σ w_i acc_i) replaces slot `first`. Partials are read through L2 (other blocks
// wrote them). Every input has l ≥ 1 and a finite m: no live split is empty.
__device__ __forceinline__ void merge_partials(const AttnDecodeParams& p, int hq, int first, int stride,
                                               int count, float* w_s, bool final) {
    const int lane = threadIdx.x & 31, Dh = p.Dh, dpl = Dh / 32;
    const i64 slot0 = (i64)hq * p.nsplit + first;
    float* pm = (float*)p.part_m + slot0;
    float* pl = (float*)p.part_l + slot0;
    float* acc = (float*)p.part_acc + slot0 * Dh;
    float M = NEG_INF;
    for (int i = lane; i < count; i += 32) M = fmaxf(M, __ldcg(pm + (i64)i * stride));
    M = warp_max(M);
    float L = 0.0f;
    for (int i = lane; i < count; i += 32) {
        const float w = expf(__ldcg(pm + (i64)i * stride) - M);
        w_s[i] = w;
        L += __ldcg(pl + (i64)i * stride) * w;
    }
    L = warp_sum(L);
    __syncwarp(); // w_s complete; every lane has read pm / pl (slot `first` may be overwritten below)
    float o[ATTN_MAX_DPL];
#pragma unroll
    for (int e = 0; e < ATTN_MAX_DPL; ++e) o[e] = 0.0f;
#pragma unroll 4
    for (int i = 0; i < count; ++i) {
        const float w = w_s[i];
        const float* a = acc + (i64)i * stride * Dh + lane;
#pragma unroll
        for (int e = 0; e < ATTN_MAX_DPL; ++e)
            if (e < dpl) o[e] = fmaf(__ldcg(a + 32 * e), w, o[e]);
    }
    if (final) {
        const float inv_l = 1.0f / L;
        const float* gate = (const float*)p.qg + (i64)hq * 2 * Dh + Dh;
        float* y = (float*)p.y + (i64)hq * Dh;
#pragma unroll
        for (int e = 0; e < ATTN_MAX_DPL; ++e)
            if (e < dpl) {
                const int d = lane + 32 * e;
                float r = o[e] * inv_l;
                if (p.gated) r *= sigmoid_f(gate[d]);
                y[d] = r;
            }
    } else {
#pragma unroll
        for (int e = 0; e < ATTN_MAX_DPL; ++e)
            if (e < dpl) acc[lane + 32 * e] = o[e];
        if (lane == 0) { *pm = M; *pl = L; }
    }
}

template <typename KV>
__device__ __forceinline__ void attn_decode_body(const AttnDecodeParams& p) {
    extern __shared__ float smem[];
    __shared__ int last_s;
    griddep_launch_dependents();
    griddep_wait();
    const int G = p.Hq / p.Hkv, Dh = p.Dh, kvh = blockIdx.y, split = blockIdx.x;
    const int tid = threadIdx.x, lane = tid & 31, g = tid >> 5;
    const int hq = kvh * G + g;
    const Cursor cur = *(const Cursor*)p.cursor;
    const int len = cur.pos + 1;
    const int2 live = attn_live_splits(cur.pos, p.nsplit, p.min_tiles);
    const int nsp = live.x, tiles = live.y;
    if (split >= nsp) return; // beyond the live splits at this position (whole block)
    const int t0 = (int)((i64)split * tiles / nsp) * ATTN_TILE;
    const int t1 = min(len, (int)((i64)(split + 1) * tiles / nsp) * ATTN_TILE);
    const int kp = k_pitch<KV>(Dh);
    float* q_s = smem;                        // [G, Dh]
    float* kp_s = q_s + G * Dh;               // [Dh] k of position p (normed, rotated)
    float* vp_s = kp_s + Dh;                  // [Dh] v of position p
    KV* k_s = (KV*)(vp_s + Dh);               // [TILE, kp]
    KV* v_s = k_s + ATTN_TILE * kp;           // [TILE, Dh]
    KV* kc = (KV*)(cur.state_base + p.k_off) + (i64)kvh * p.max_ctx * Dh;
    KV* vc = (KV*)(cur.state_base + p.v_off) + (i64)kvh * p.max_ctx * Dh;

    norm_rope_row((const float*)p.qg + (i64)hq * Dh * (p.gated ? 2 : 1), (const float*)p.q_gain,
                  (const float*)p.inv_freq, q_s + g * Dh, Dh, p.rot, cur.pos, p.eps, p.scale);
    if (t1 == len && g == 0) { // this block's range holds p
        norm_rope_row((const float*)p.k + (i64)kvh * Dh, (const float*)p.k_gain, (const float*)p.inv_freq,
                      kp_s, Dh, p.rot, cur.pos, p.eps, 1.0f);
        const float* v = (const float*)p.v + (i64)kvh * Dh;
        const i64 row = (i64)cur.pos * Dh;
        for (int d = lane; d < Dh; d += 32) {
            const float vd = v[d];
            vp_s[d] = vd;
            kv_store(kc, row + d, kp_s[d]);
            kv_store(vc, row + d, vd);
        }
    }

    const int dpl = Dh / 32;
    float m = NEG_INF, l = 0.0f, acc[ATTN_MAX_DPL];
#pragma unroll
    for (int e = 0; e < ATTN_MAX_DPL; ++e) acc[e] = 0.0f;

    for (int base = t0; base < t1; base += ATTN_TILE) {
        const int n = min(ATTN_TILE, t1 - base);
        const bool holds_p = base + n == len; // row n − 1 is position p: from kp_s / vp_s
        __syncthreads(); // previous tile fully consumed (q_s, kp_s, vp_s written, first time)
        // The tile's K and V rows are contiguous in the cache: 16-byte loads, four per thread issued
        // before any store (one memory latency per tile, not one per element); V rows keep their
        // 16-byte alignment in shared memory, K rows go to the padded pitch.
        {
            constexpr int EPV = 16 / sizeof(KV);
            const int vecs = (holds_p ? n - 1 : n) * Dh / EPV;
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
            if (holds_p)
                for (int d = tid; d < Dh; d += blockDim.x) {
                    kv_store(k_s, (n - 1) * kp + d, kp_s[d]);
                    kv_store(v_s, (n - 1) * Dh + d, vp_s[d]);
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

    // Merge: first the group's splits, then (more than one group) the groups.
    const int group = split / ATTN_GROUP, first = group * ATTN_GROUP;
    const int ngroups = (nsp + ATTN_GROUP - 1) / ATTN_GROUP;
    unsigned* tickets = (unsigned*)p.tickets + (i64)kvh * (1 + (p.nsplit + ATTN_GROUP - 1) / ATTN_GROUP);
    if (!arrive_last(tickets + 1 + group, min(ATTN_GROUP, nsp - first), &last_s)) return;
    float* w_s = (float*)k_s + g * ATTN_MAX_MERGE; // the tiles are done (arrive_last synchronised)
    merge_partials(p, hq, first, 1, min(ATTN_GROUP, nsp - first), w_s, ngroups == 1);
    if (ngroups == 1) return;
    if (!arrive_last(tickets, ngroups, &last_s)) return;
    merge_partials(p, hq, 0, ATTN_GROUP, ngroups, w_s, true);
}

extern "C" __global__ void __launch_bounds__(512) attn_decode_bf16(const AttnDecodeParams p) { attn_decode_body<u16>(p); }
extern "C" __global__ void __launch_bounds__(512) attn_decode_f32(const AttnDecodeParams p) { attn_decode_body<float>(p); }

// Layouts shared with the Rust launchers (tests/layouts.rs checks the same sizes).
static_assert(sizeof(AttnDecodeParams) == 152, "AttnDecodeParams layout differs from its Rust twin");
