// attention.cu: gated full attention for one decode token, in one launch.
//
// Math (CPU reference: calla_cpu::attention::Attention::forward), token at position p:
//   per q head: [q | gate] = q_proj rows;  q ← rmsnorm₀(q)·(1 + q_norm);  k ← rmsnorm₀(k)·(1 + k_norm)
//   q, k ← NeoX RoPE on dims [0, R): (x_i, x_{i+R/2}) rotated by p·inv_freq[i]
//   K[p], V[p] ← k, v  (cache);  o_h = Σ_{t≤p} softmax_t(q_h·K[t]·Dh^−½) V[t]   (GQA: kv head h/(Hq/Hkv))
//   o_h ← o_h ⊙ sigmoid(gate_h)
// KV cache (per sequence, at cursor.state_base + k_off / v_off): [Hkv, max_ctx, Dh], bf16 or f32.
//
// attn_decode_*: split-KV ("flash decoding"), grid (nsplit, Hkv). Described here for
// attn_decode_f32: block 32·G threads (G = Hq/Hkv q heads share one K/V tile: warp g is q head
// kvh·G + g). attn_decode_bf16 (the default cache; after the merge code) keeps the splits, the
// prologue, the partials and the merge, and runs the tiles on the tensor cores.
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
//   attn_decode_bf16_bar (the default for the bf16 cache when the whole grid fits at once) merges
//   after one barrier among a kv head's splits instead, each split a slice (attn_barrier_merge).
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
// Split in two so that every global load of the row (x, gain, inv_freq) is in flight at once, and
// the weights (gain, inv_freq) can be requested before griddep_wait: one memory latency per row,
// not one per dependent load (a store to dst between loads kept them serial before).
struct RopeRowIn {
    float x[ATTN_MAX_DPL], gain[ATTN_MAX_DPL], inv_freq[ATTN_MAX_DPL / 2];
};
// The weights: gain[Dh], inv_freq[R/2] (R/2 ≤ Dh/2: at most dpl/2 per lane).
__device__ __forceinline__ void rope_row_load_weights(RopeRowIn& in, const float* gain, const float* inv_freq,
                                                      int Dh, int rot) {
    const int lane = threadIdx.x & 31, dpl = Dh / 32, half = rot / 2;
#pragma unroll
    for (int e = 0; e < ATTN_MAX_DPL; ++e)
        if (e < dpl) in.gain[e] = gain[lane + 32 * e];
#pragma unroll
    for (int j = 0; j < ATTN_MAX_DPL / 2; ++j)
        if (lane + 32 * j < half) in.inv_freq[j] = inv_freq[lane + 32 * j];
}
__device__ __forceinline__ void rope_row_load_x(RopeRowIn& in, const float* src, int Dh) {
    const int lane = threadIdx.x & 31, dpl = Dh / 32;
#pragma unroll
    for (int e = 0; e < ATTN_MAX_DPL; ++e)
        if (e < dpl) in.x[e] = src[lane + 32 * e];
}
__device__ __forceinline__ void rope_row_finish(const RopeRowIn& in, float* dst, int Dh, int rot, int pos,
                                                float eps, float scale) {
    const int lane = threadIdx.x & 31, dpl = Dh / 32;
    float ss = 0.0f;
#pragma unroll
    for (int e = 0; e < ATTN_MAX_DPL; ++e)
        if (e < dpl) ss += in.x[e] * in.x[e];
    const float inv = 1.0f / sqrtf(warp_sum(ss) / (float)Dh + eps);
#pragma unroll
    for (int e = 0; e < ATTN_MAX_DPL; ++e)
        if (e < dpl) dst[lane + 32 * e] = in.x[e] * inv * in.gain[e];
    __syncwarp();
    // NeoX half split: pair (i, i + R/2) belongs to one lane, so no pair is read after another
    // lane wrote it.
    const int half = rot / 2;
#pragma unroll
    for (int j = 0; j < ATTN_MAX_DPL / 2; ++j) {
        const int i = lane + 32 * j;
        if (i < half) {
            const float angle = (float)pos * in.inv_freq[j];
            const float c = cosf(angle), s = sinf(angle);
            const float x1 = dst[i], x2 = dst[i + half];
            dst[i] = x1 * c - x2 * s;
            dst[i + half] = x2 * c + x1 * s;
        }
    }
    __syncwarp();
#pragma unroll
    for (int e = 0; e < ATTN_MAX_DPL; ++e)
        if (e < dpl) dst[lane + 32 * e] *= scale;
    __syncwarp();
}
__device__ __forceinline__ void norm_rope_row(const float* src, const float* gain, const float* inv_freq,
                                              float* dst, int Dh, int rot, int pos, float eps, float scale) {
    RopeRowIn in;
    rope_row_load_weights(in, gain, inv_freq, Dh, rot);
    rope_row_load_x(in, src, Dh);
    rope_row_finish(in, dst, Dh, rot, pos, eps, scale);
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
    return make_int2(min(nsplit, div_small(tiles + min_tiles - 1, min_tiles)), tiles); // tiles < 2^21
}

// common.cuh block_arrive_last, the last block resetting the ticket for the next launch.
__device__ __forceinline__ bool arrive_last(unsigned* ticket, unsigned count) {
    const bool last = block_arrive_last(ticket, count);
    if (last && threadIdx.x == 0) atomicExch(ticket, 0u);
    return last;
}

// One warp merges `count` ≤ ATTN_MAX_MERGE partials of q head `hq` (slots first + i·stride, i in
// order) by log-sum-exp. final: y = (Σ w_i acc_i / Σ w_i l_i) ⊙ sigmoid(gate); else the
// unnormalised merge (M, Σ w_i l_i, Σ w_i acc_i) replaces slot `first`. Partials are read through
// L2 (other blocks wrote them). Every input has l ≥ 1 and a finite m: no live split is empty.
// Latency: m, l (lane i holds inputs i and i + 32), the gate and the first ATTN_MERGE_BATCH acc rows
// are requested together, so a merge of ≤ ATTN_MERGE_BATCH inputs costs one L2 round trip (two for
// a group of 16); the weights travel by shuffle. Sum order i = 0, 1, … whichever block merges.
#define ATTN_MERGE_BATCH 8
template <int BATCH = ATTN_MERGE_BATCH>
__device__ __forceinline__ void merge_partials(const AttnDecodeParams& p, int hq, int first, int stride,
                                               int count, bool final) {
    const int lane = threadIdx.x & 31, Dh = p.Dh, dpl = Dh / 32;
    const i64 slot0 = (i64)hq * p.nsplit + first;
    float* pm = (float*)p.part_m + slot0;
    float* pl = (float*)p.part_l + slot0;
    float* acc = (float*)p.part_acc + slot0 * Dh;
    float mv[2] = {NEG_INF, NEG_INF}, lv[2] = {0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = lane + 32 * r;
        if (i < count) {
            mv[r] = __ldcg(pm + (i64)i * stride);
            lv[r] = __ldcg(pl + (i64)i * stride);
        }
    }
    float gate[ATTN_MAX_DPL];
    if (final && p.gated) {
        const float* g = (const float*)p.qg + (i64)hq * 2 * Dh + Dh;
#pragma unroll
        for (int e = 0; e < ATTN_MAX_DPL; ++e)
            if (e < dpl) gate[e] = g[lane + 32 * e];
    }
    float a[BATCH][ATTN_MAX_DPL];
    auto load_batch = [&](int i0) {
#pragma unroll
        for (int j = 0; j < BATCH; ++j)
            if (i0 + j < count) {
                const float* row = acc + (i64)(i0 + j) * stride * Dh + lane;
#pragma unroll
                for (int e = 0; e < ATTN_MAX_DPL; ++e)
                    if (e < dpl) a[j][e] = __ldcg(row + 32 * e);
            }
    };
    load_batch(0);
    const float M = warp_max(fmaxf(mv[0], mv[1]));
    float wv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) wv[r] = lane + 32 * r < count ? expf(mv[r] - M) : 0.0f;
    float L = lv[0] * wv[0];
    L += lv[1] * wv[1];
    L = warp_sum(L);
    float o[ATTN_MAX_DPL];
#pragma unroll
    for (int e = 0; e < ATTN_MAX_DPL; ++e) o[e] = 0.0f;
    for (int i0 = 0; i0 < count; i0 += BATCH) {
        if (i0 > 0) load_batch(i0);
#pragma unroll
        for (int j = 0; j < BATCH; ++j)
            if (i0 + j < count) {
                const int i = i0 + j;
                const float w = __shfl_sync(0xffffffffu, i < 32 ? wv[0] : wv[1], i & 31);
#pragma unroll
                for (int e = 0; e < ATTN_MAX_DPL; ++e)
                    if (e < dpl) o[e] = fmaf(a[j][e], w, o[e]);
            }
    }
    __syncwarp(); // every lane has read its inputs (slot `first` is overwritten below)
    if (final) {
        const float inv_l = 1.0f / L;
        float* y = (float*)p.y + (i64)hq * Dh;
#pragma unroll
        for (int e = 0; e < ATTN_MAX_DPL; ++e)
            if (e < dpl) {
                float r = o[e] * inv_l;
                if (p.gated) r *= sigmoid_f(gate[e]);
                y[lane + 32 * e] = r;
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
    griddep_enter();
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
    if (!arrive_last(tickets + 1 + group, min(ATTN_GROUP, nsp - first))) return;
    merge_partials<4>(p, hq, first, 1, min(ATTN_GROUP, nsp - first), ngroups == 1);
    if (ngroups == 1) return;
    if (!arrive_last(tickets, ngroups)) return;
    merge_partials<4>(p, hq, 0, ATTN_GROUP, ngroups, true);
}

// ---------------------------------------------------------------- bf16 cache on the tensor cores
// attn_decode_bf16: the same splits, prologue, partials and merge as above; 256 threads whatever
// G; the tiles of a split stream through an ATTN_STAGES-deep cp.async ring (the first ones issued
// before the prologue), and both products run on mma.sync m16n8k16 (bf16 in, f32 accumulate) with
// the positions / dims as M and the ≤ 16 q heads of the group as N (one or two n-tiles of 8):
//   scores  Sᵀ[t, h] = Σ_d K[t, d]·q_h[d]     A = K tile (row-major in shared memory, ldmatrix),
//           B = qᵀ from registers; warp w: positions 16·(w & 1)…, d-chunks of 16: w>>1, +4, +8, +12;
//           the 4 partial sums per (t, h) are added in chunk-group order through shared memory.
//   softmax every warp, redundantly and identically, for all heads in the B-fragment layout of
//           P (lane: head gq, positions 16kk + 2qd, +1, +8, +9): P, the running max / sum and
//           the rescale factors stay in registers, so a tile costs two barriers (tile landed,
//           score partials complete), not three plus a P round trip through shared memory.
//   output  Oᵀ[d, h] += Σ_t V[t, d]·P[h, t]   A = Vᵀ (ldmatrix.trans of the V tile), B = Pᵀ;
//           warp w owns the d-tiles w, w + 8 (accumulators stay in registers over the tiles).
// q and P are f32 values split into bf16 hi + lo (two mmas each): products exact, residue ~2⁻¹⁷
// relative, so the result stays at f32 accuracy over the bf16 cache (K and V are bf16 already).
// Rows past p are zero-filled (zero V rows: 0·garbage never makes NaN); row p comes from the
// prologue (shared memory), not the cache.
// Dynamic smem (bytes): STAGES·2·TILE·(Dh+8)·2 (K, V ring)
//   + max((G+1)·Dh, KGROUPS·16·RED_PITCH)·4 (q rows and the k row, then the score partials)
//   + 2·Dh·2 (K[p], V[p] bf16).
#define ATTN_WARPS 8
#define ATTN_STAGES 3
#define ATTN_KGROUPS 4    // score partial sums per (position, head)
#define ATTN_RED_PITCH 40 // f32 per score-partial row [kgroup][head][position]: float2 reads conflict-free

// (x0, x1) → packed bf16 hi pair and lo pair (x ≈ hi + lo), low half = x0.
__device__ __forceinline__ void attn_split_pair(float x0, float x1, u32& hi, u32& lo) {
    const u16 h0 = f32_to_bf16(x0), h1 = f32_to_bf16(x1);
    hi = (u32)h0 | ((u32)h1 << 16);
    lo = (u32)f32_to_bf16(x0 - bf16_to_f32(h0)) | ((u32)f32_to_bf16(x1 - bf16_to_f32(h1)) << 16);
}

// Issue the cp.asyncs of one tile (positions base…base + n − 1; rows ≥ n zero-filled; row
// `skip_row` left alone: the caller writes it) into the K and V halves of a ring stage.
__device__ __forceinline__ void attn_issue_tile(u16* stage, const u16* kc, const u16* vc, int base, int n,
                                                int skip_row, int Dh) {
    const int kp = k_pitch<u16>(Dh), cpr = Dh / 8; // 16-byte chunks per row
    const u32 ks = smem_addr(stage), vs = ks + ATTN_TILE * kp * 2;
    // K and V stream once per step and, past ~16K positions, exceed L2: their lines go first, so the
    // partials, the activations and the next kernels' inputs stay (32K: step 2,052 → 2,026 µs,
    // docs/experiments.md).
    const u64 policy = l2_evict_first();
    for (int i = threadIdx.x; i < ATTN_TILE * cpr; i += ATTN_WARPS * 32) { // the bf16 kernels' 256 threads
        const int r = i / cpr, c = i - r * cpr; // a shift where Dh is a compile-time constant
        if (r == skip_row) continue;
        const bool live = r < n;
        const i64 src = (i64)(base + (live ? r : 0)) * Dh + c * 8;
        const u32 dst = (u32)(r * kp + c * 8) * 2;
        cp_async16_policy(ks + dst, kc + src, live ? 16 : 0, policy);
        cp_async16_policy(vs + dst, vc + src, live ? 16 : 0, policy);
    }
}

// attn_decode_bf16_bar: the splits' merge after a barrier among the splits of a kv head instead of
// two ticketed levels (measured with per-warp clock stamps, the ticketed merge took ~11.7 µs of the kernel's
// ~21.8 at 4K and ~19 µs at 32K: a fence and an atomic per level, then one block per group reading
// 16 partials of G·Dh floats through L2, one warp per head). Here every live split writes its
// partial (as the ticketed kernel does), all p.nsplit blocks of the kv head arrive at a monotonic
// counter (dead splits arrive and leave), and then live split s merges outputs [s·per, (s+1)·per)
// of the head group's G·Dh (per = ⌈G·Dh / live splits⌉: 16 at the real shape) over every live
// partial, with the loads of a whole slice in flight at once: one L2 round trip for the m, l of its
// head and one for its acc column. Summation order is fixed by thread index (deterministic).
// Every block of the grid must be resident at once (the launcher checks the occupancy, else it
// runs the ticketed kernel): blocks wait for each other.
#define ATTN_BAR_MAX_SPLITS 128 // live splits the merge takes (4 per lane for M and L)
// The kv head's arrival counter (u64, monotonic: exactly p.nsplit arrivals per launch), after the
// ticketed kernel's tickets in the same buffer.
__device__ __forceinline__ u64 attn_bar_counter(const AttnDecodeParams& p, int kvh) {
    const int words = p.Hkv * (1 + (p.nsplit + ATTN_GROUP - 1) / ATTN_GROUP);
    return (u64)((unsigned*)p.tickets + ((words + 1) & ~1)) + 8ull * kvh;
}
// This block's arrival; returns the count at which every split of the launch has arrived.
__device__ __forceinline__ u64 attn_bar_arrive(const AttnDecodeParams& p, int kvh) {
    u64 old;
    asm volatile("atom.add.acq_rel.gpu.u64 %0, [%1], 1;" : "=l"(old) : "l"(attn_bar_counter(p, kvh)) : "memory");
    return (old / p.nsplit + 1) * p.nsplit;
}
// Dh: p.Dh, or the compile-time constant of a specialised kernel. The slice arithmetic divides by
// div_small (common.cuh: exact for these small operands) instead of ~25-instruction integer divisions.
__device__ __forceinline__ void attn_barrier_merge(const AttnDecodeParams& p, int G, int Dh, int kvh, int split,
                                                   int nsp) {
    constexpr int NT = ATTN_WARPS * 32; // the bf16 kernels' threads
    __shared__ float part_s[NT];
    const int tid = threadIdx.x, lane = tid & 31;
    // The block's partial stores before its arrival: the barrier orders them before thread 0's fence
    // and acq_rel arrival, which publish them (as block_arrive_last, common.cuh).
    __syncthreads();
    if (tid == 0) {
        __threadfence();
        wait_until_at_least(attn_bar_counter(p, kvh), attn_bar_arrive(p, kvh));
    }
    __syncthreads();
    const int total = G * Dh, per = div_small(total + nsp - 1, nsp);
    const int o0 = min(total, split * per), o1 = min(total, o0 + per);
    const float* pm = (const float*)p.part_m;
    const float* pl = (const float*)p.part_l;
    const float* pa = (const float*)p.part_acc;
    for (int h = o0 / Dh; h * Dh < o1; ++h) {
        const int hq = kvh * G + h;
        const i64 base = (i64)hq * p.nsplit;
        const int d0 = max(o0 - h * Dh, 0), d1 = min(o1 - h * Dh, Dh);
        for (int c0 = d0; c0 < d1; c0 += NT) {
            // thread t: output d = c0 + t % nd, inputs r, r + R, … (R = 256 / nd threads per output);
            // its acc column and those inputs' m, and (every warp, for M and L) lane + 32j's m and l,
            // all requested at once: one L2 round trip
            const int nd = min(d1 - c0, NT), R = div_small(NT, nd);
            const int r = div_small(tid, nd), d = c0 + tid - r * nd;
            const int nload = r < R ? div_small(nsp - r + R - 1, R) : 0;
            float a[ATTN_BAR_MAX_SPLITS / 16], am[ATTN_BAR_MAX_SPLITS / 16];
#pragma unroll
            for (int k = 0; k < ATTN_BAR_MAX_SPLITS / 16; ++k) {
                a[k] = am[k] = 0.0f;
                if (k < nload) {
                    a[k] = __ldcg(pa + (base + r + (i64)k * R) * Dh + d);
                    am[k] = __ldcg(pm + base + r + k * R);
                }
            }
            float mv[ATTN_BAR_MAX_SPLITS / 32], lv[ATTN_BAR_MAX_SPLITS / 32];
#pragma unroll
            for (int j = 0; j < ATTN_BAR_MAX_SPLITS / 32; ++j) {
                const int i = lane + 32 * j;
                mv[j] = i < nsp ? __ldcg(pm + base + i) : NEG_INF;
                lv[j] = i < nsp ? __ldcg(pl + base + i) : 0.0f;
            }
            // M = max m, L = Σ exp(m − M)·l over the live splits, in every warp alike (no barrier)
            float M = mv[0];
#pragma unroll
            for (int j = 1; j < ATTN_BAR_MAX_SPLITS / 32; ++j) M = fmaxf(M, mv[j]);
            M = warp_max(M); // finite: split 0 is live
            float L = 0.0f;
#pragma unroll
            for (int j = 0; j < ATTN_BAR_MAX_SPLITS / 32; ++j) L = fmaf(expf(mv[j] - M), lv[j], L);
            L = warp_sum(L);
            float A = 0.0f;
#pragma unroll
            for (int k = 0; k < ATTN_BAR_MAX_SPLITS / 16; ++k)
                if (k < nload) A = fmaf(expf(am[k] - M), a[k], A);
            // more than 8 inputs per thread (R < nsp / 8; not at the real shape) continue here
            for (int k = ATTN_BAR_MAX_SPLITS / 16; k < nload; ++k) {
                const i64 i = base + r + (i64)k * R;
                A = fmaf(expf(__ldcg(pm + i) - M), __ldcg(pa + i * Dh + d), A);
            }
            if (r < R) part_s[tid] = A;
            __syncthreads();
            if (tid < nd) {
                float sum = 0.0f;
                for (int q = 0; q < R; ++q) sum += part_s[q * nd + tid];
                float y = sum / L;
                if (p.gated) y *= sigmoid_f(((const float*)p.qg)[(i64)hq * 2 * Dh + Dh + c0 + tid]);
                ((float*)p.y)[(i64)hq * Dh + c0 + tid] = y;
            }
            __syncthreads(); // part_s is reused by the next chunk or head
        }
    }
}

// DH, GG: the head dim and the q heads per kv head as compile-time constants (a specialised kernel,
// below: the index arithmetic folds to shifts and the per-lane loops unroll exactly), or 0 for
// p.Dh and p.Hq / p.Hkv. The arithmetic on values is the same either way.
template <bool BARRIER, int DH = 0, int GG = 0>
__device__ __forceinline__ void attn_decode_bf16_body(const AttnDecodeParams& p) {
    extern __shared__ __align__(16) unsigned char attn_smem[];
    const int G = GG ? GG : p.Hq / p.Hkv, Dh = DH ? DH : p.Dh, kvh = blockIdx.y, split = blockIdx.x;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gq = lane >> 2, qd = lane & 3; // mma fragment: row group, column pair
    const int NT = G > 8 ? 2 : 1;            // n-tiles of 8 heads
    // Rows this warp normalises: q heads warp, warp + 8 (< G); warp G % 8 also the k row (used
    // only by the block that holds p, loaded by every block: all loads leave at once).
    const bool k_warp = warp == G % ATTN_WARPS;
    RopeRowIn q_in[2], k_in;
    float v_in[ATTN_MAX_DPL];
#pragma unroll
    for (int r = 0; r < 2; ++r)
        if (warp + ATTN_WARPS * r < G)
            rope_row_load_weights(q_in[r], (const float*)p.q_gain, (const float*)p.inv_freq, Dh, p.rot);
    if (k_warp) rope_row_load_weights(k_in, (const float*)p.k_gain, (const float*)p.inv_freq, Dh, p.rot);
    griddep_enter();
    const Cursor cur = *(const Cursor*)p.cursor;
#pragma unroll
    for (int r = 0; r < 2; ++r)
        if (warp + ATTN_WARPS * r < G)
            rope_row_load_x(q_in[r], (const float*)p.qg + (i64)(kvh * G + warp + ATTN_WARPS * r) * Dh * (p.gated ? 2 : 1),
                            Dh);
    if (k_warp) {
        rope_row_load_x(k_in, (const float*)p.k + (i64)kvh * Dh, Dh);
#pragma unroll
        for (int e = 0; e < ATTN_MAX_DPL; ++e)
            if (e < Dh / 32) v_in[e] = ((const float*)p.v)[(i64)kvh * Dh + lane + 32 * e];
    }
    const int len = cur.pos + 1;
    const int2 live = attn_live_splits(cur.pos, p.nsplit, p.min_tiles);
    const int nsp = live.x, tiles = live.y;
    if (split >= nsp) { // beyond the live splits at this position (whole block)
        if (BARRIER && threadIdx.x == 0) attn_bar_arrive(p, kvh); // every split arrives, once
        return;
    }
    // 32-bit quotients (split·tiles < 2^31 for any cache that fits on a GPU; an i64 division is a
    // ~70-instruction subroutine)
    const int t0 = (int)((u32)split * (u32)tiles / (u32)nsp) * ATTN_TILE;
    const int t1 = min(len, (int)((u32)(split + 1) * (u32)tiles / (u32)nsp) * ATTN_TILE);
    const int ntiles = (t1 - t0 + ATTN_TILE - 1) / ATTN_TILE;
    const int kp = k_pitch<u16>(Dh), stage_elems = 2 * ATTN_TILE * kp;
    u16* kv_s = (u16*)attn_smem;                              // [STAGES][K, V][TILE, kp]
    float* q_s = (float*)(kv_s + ATTN_STAGES * stage_elems); // [G, Dh] q, [Dh] k; then red
    float* red_s = q_s;                                      // [KGROUPS, 16 heads, RED_PITCH] score partials
    u16* kvp_s = (u16*)(q_s + max((G + 1) * Dh, ATTN_KGROUPS * 16 * ATTN_RED_PITCH)); // [2, Dh]
    u16* kc = (u16*)(cur.state_base + p.k_off) + (i64)kvh * p.max_ctx * Dh;
    u16* vc = (u16*)(cur.state_base + p.v_off) + (i64)kvh * p.max_ctx * Dh;
    const bool block_holds_p = t1 == len;
    auto tile_rows = [&](int i, int& base, int& n, int& p_row) {
        base = t0 + i * ATTN_TILE;
        n = min(ATTN_TILE, t1 - base);
        p_row = block_holds_p && i == ntiles - 1 ? n - 1 : -1;
    };

    // The cache rows do not depend on the prologue: the first tiles are on their way meanwhile.
#pragma unroll
    for (int i = 0; i < ATTN_STAGES - 1; ++i) {
        if (i < ntiles) {
            int base, n, p_row;
            tile_rows(i, base, n, p_row);
            attn_issue_tile(kv_s + i * stage_elems, kc, vc, base, n, p_row, Dh);
        }
        cp_async_commit();
    }
#pragma unroll
    for (int r = 0; r < 2; ++r)
        if (warp + ATTN_WARPS * r < G)
            rope_row_finish(q_in[r], q_s + (warp + ATTN_WARPS * r) * Dh, Dh, p.rot, cur.pos, p.eps, p.scale);
    if (block_holds_p && k_warp) {
        float* k_row = q_s + G * Dh;
        rope_row_finish(k_in, k_row, Dh, p.rot, cur.pos, p.eps, 1.0f);
        const i64 row = (i64)cur.pos * Dh;
#pragma unroll
        for (int e = 0; e < ATTN_MAX_DPL; ++e)
            if (e < Dh / 32) {
                const int d = lane + 32 * e;
                const u16 kb = f32_to_bf16(k_row[d]), vb = f32_to_bf16(v_in[e]);
                kc[row + d] = kb;
                vc[row + d] = vb;
                kvp_s[d] = kb;
                kvp_s[Dh + d] = vb;
            }
    }
    __syncthreads(); // q_s, k row

    // qᵀ as B fragments, split hi + lo: b0 = (d 16c + 2qd, +1; head 8nt + gq), b1 = d + 8.
    const int mt = warp & 1, kg = warp >> 1, nchunks = Dh / 16;
    u32 qb[4][2][4]; // [chunk kg + 4j][n-tile][b0 hi, b1 hi, b0 lo, b1 lo]
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            const int c = kg + 4 * j, h = nt * 8 + gq;
            float x[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            if (c < nchunks && h < G) {
                const float* q = q_s + h * Dh + c * 16 + 2 * qd;
                x[0] = q[0];
                x[1] = q[1];
                x[2] = q[8];
                x[3] = q[9];
            }
            attn_split_pair(x[0], x[1], qb[j][nt][0], qb[j][nt][2]);
            attn_split_pair(x[2], x[3], qb[j][nt][1], qb[j][nt][3]);
        }

    // Softmax state of head 8nt + gq (the same in every lane of the quad and in every warp).
    float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.0f, 0.0f};
    float o[2][2][4]; // [d-tile warp + 8j][n-tile][c]
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[j][nt][e] = 0.0f;

    for (int i = 0; i < ntiles; ++i) {
        int base, n, p_row;
        tile_rows(i, base, n, p_row);
        u16* ks = kv_s + (i % ATTN_STAGES) * stage_elems;
        u16* vs = ks + ATTN_TILE * kp;
        cp_async_wait<ATTN_STAGES - 2>(); // this thread's copies of tile i have landed
        if (p_row >= 0)
            for (int d = tid; d < Dh; d += ATTN_WARPS * 32) {
                ks[p_row * kp + d] = kvp_s[d];
                vs[p_row * kp + d] = kvp_s[Dh + d];
            }
        __syncthreads(); // tile i complete; every warp is past tile i − 1 (scores, softmax, P·V)
        {
            const int next = i + ATTN_STAGES - 1; // into the stage tile i − 1 used
            if (next < ntiles) {
                int nb, nn, np;
                tile_rows(next, nb, nn, np);
                attn_issue_tile(kv_s + (next % ATTN_STAGES) * stage_elems, kc, vc, nb, nn, np, Dh);
            }
            cp_async_commit();
        }
        // scores: this warp's 16 positions × its d-chunks; hi and lo products in two chains
        float sh[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
        float sl[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int c = kg + 4 * j;
            if (c < nchunks) {
                u32 a[4];
                const int row = mt * 16 + (lane & 7) + 8 * ((lane >> 3) & 1);
                ldsm_x4(smem_addr(ks + row * kp + c * 16 + 8 * (lane >> 4)), a[0], a[1], a[2], a[3]);
#pragma unroll
                for (int nt = 0; nt < 2; ++nt)
                    if (nt < NT) {
                        mma_bf16(sh[nt], a, qb[j][nt][0], qb[j][nt][1]);
                        mma_bf16(sl[nt], a, qb[j][nt][2], qb[j][nt][3]);
                    }
            }
        }
        // partials [kg][head][position]: rows t, t + 8 of the C fragment, heads 2qd, 2qd + 1
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
            if (nt < NT) {
                const int t = mt * 16 + gq, h = nt * 8 + 2 * qd;
                float* r0 = red_s + (kg * 16 + h) * ATTN_RED_PITCH + t;
                r0[0] = sh[nt][0] + sl[nt][0];
                r0[ATTN_RED_PITCH] = sh[nt][1] + sl[nt][1];
                r0[8] = sh[nt][2] + sl[nt][2];
                r0[ATTN_RED_PITCH + 8] = sh[nt][3] + sl[nt][3];
            }
        __syncthreads(); // score partials complete
        // Online softmax of head h = 8nt + gq over the tile, in every warp: this lane's positions
        // 16kk + 8hf + 2qd + {0, 1} (kk, hf ∈ {0, 1}); the quad (xor 1, 2) covers all 32.
        u32 pb[2][2][4]; // [n-tile][kk][b0 hi, b1 hi, b0 lo, b1 lo]
        float corr[2];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
            if (nt < NT) {
                const int h = nt * 8 + gq;
                float sv[2][2][2];
                float mx = NEG_INF;
#pragma unroll
                for (int kk = 0; kk < 2; ++kk)
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf) {
                        const int t = kk * 16 + hf * 8 + 2 * qd;
                        float2 v = *(const float2*)(red_s + h * ATTN_RED_PITCH + t);
#pragma unroll
                        for (int k = 1; k < ATTN_KGROUPS; ++k) {
                            const float2 w = *(const float2*)(red_s + (k * 16 + h) * ATTN_RED_PITCH + t);
                            v.x += w.x;
                            v.y += w.y;
                        }
                        sv[kk][hf][0] = t < n ? v.x : NEG_INF;
                        sv[kk][hf][1] = t + 1 < n ? v.y : NEG_INF;
                        mx = fmaxf(mx, fmaxf(sv[kk][hf][0], sv[kk][hf][1]));
                    }
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float m_new = fmaxf(m_run[nt], mx); // finite: position base is live
                float sum = 0.0f;
#pragma unroll
                for (int kk = 0; kk < 2; ++kk) {
                    float pr[2][2];
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf)
#pragma unroll
                        for (int x = 0; x < 2; ++x) {
                            pr[hf][x] = expf(sv[kk][hf][x] - m_new); // 0 past the live rows
                            sum += pr[hf][x];
                        }
                    attn_split_pair(pr[0][0], pr[0][1], pb[nt][kk][0], pb[nt][kk][2]);
                    attn_split_pair(pr[1][0], pr[1][1], pb[nt][kk][1], pb[nt][kk][3]);
                }
                sum += __shfl_xor_sync(0xffffffffu, sum, 1);
                sum += __shfl_xor_sync(0xffffffffu, sum, 2);
                corr[nt] = expf(m_run[nt] - m_new); // 0 on the first tile (m = −inf)
                l_run[nt] = l_run[nt] * corr[nt] + sum;
                m_run[nt] = m_new;
            }
        // Oᵀ[d, h] = corr_h·Oᵀ[d, h] + Σ_t V[t, d]·P[h, t]; corr of heads 2qd, 2qd + 1 from the
        // quads that hold them.
        float c_col[2][2];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
            if (nt < NT) {
                c_col[nt][0] = __shfl_sync(0xffffffffu, corr[nt], 8 * qd);
                c_col[nt][1] = __shfl_sync(0xffffffffu, corr[nt], 8 * qd + 4);
            }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int md = warp + ATTN_WARPS * j;
            if (md < Dh / 16) {
#pragma unroll
                for (int nt = 0; nt < 2; ++nt)
                    if (nt < NT) {
                        o[j][nt][0] *= c_col[nt][0];
                        o[j][nt][1] *= c_col[nt][1];
                        o[j][nt][2] *= c_col[nt][0];
                        o[j][nt][3] *= c_col[nt][1];
                    }
#pragma unroll
                for (int kk = 0; kk < ATTN_TILE / 16; ++kk) {
                    u32 a[4];
                    const int row = kk * 16 + (lane & 7) + 8 * (lane >> 4);
                    ldsm_x4_trans(smem_addr(vs + row * kp + md * 16 + 8 * ((lane >> 3) & 1)), a[0], a[1], a[2], a[3]);
#pragma unroll
                    for (int nt = 0; nt < 2; ++nt)
                        if (nt < NT) {
                            mma_bf16(o[j][nt], a, pb[nt][kk][0], pb[nt][kk][1]);
                            mma_bf16(o[j][nt], a, pb[nt][kk][2], pb[nt][kk][3]);
                        }
                }
            }
        }
    }
    cp_async_wait<0>(); // only empty groups remain; nothing in flight at exit

    // Partials: m, l from warp 0 (lane 4·gq holds head 8nt + gq); acc from the C fragments
    // (d 16·md + gq (+8), head 2qd (+1)).
    if (warp == 0 && qd == 0)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            const int h = nt * 8 + gq;
            if (nt < NT && h < G) {
                const i64 slot = (i64)(kvh * G + h) * p.nsplit + split;
                ((float*)p.part_m)[slot] = m_run[nt];
                ((float*)p.part_l)[slot] = l_run[nt];
            }
        }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int md = warp + ATTN_WARPS * j;
        if (md < Dh / 16)
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int h = nt * 8 + 2 * qd + (e & 1), d = md * 16 + gq + 8 * (e >> 1);
                    if (nt < NT && h < G)
                        ((float*)p.part_acc)[((i64)(kvh * G + h) * p.nsplit + split) * Dh + d] = o[j][nt][e];
                }
    }

    if (BARRIER) {
        attn_barrier_merge(p, G, Dh, kvh, split, nsp);
        return;
    }
    // Merge as in the f32 kernel; warp w merges heads w, w + 8.
    const int group = split / ATTN_GROUP, first = group * ATTN_GROUP;
    const int ngroups = (nsp + ATTN_GROUP - 1) / ATTN_GROUP;
    unsigned* tickets = (unsigned*)p.tickets + (i64)kvh * (1 + (p.nsplit + ATTN_GROUP - 1) / ATTN_GROUP);
    if (!arrive_last(tickets + 1 + group, min(ATTN_GROUP, nsp - first))) return;
    for (int h = warp; h < G; h += ATTN_WARPS)
        merge_partials(p, kvh * G + h, first, 1, min(ATTN_GROUP, nsp - first), ngroups == 1);
    __syncwarp();
    if (ngroups == 1) return;
    if (!arrive_last(tickets, ngroups)) return;
    for (int h = warp; h < G; h += ATTN_WARPS) merge_partials(p, kvh * G + h, 0, ATTN_GROUP, ngroups, true);
    __syncwarp();
}

extern "C" __global__ void __launch_bounds__(256, 2) attn_decode_bf16(const AttnDecodeParams p) {
    attn_decode_bf16_body<false>(p);
}
extern "C" __global__ void __launch_bounds__(512) attn_decode_f32(const AttnDecodeParams p) { attn_decode_body<float>(p); }
extern "C" __global__ void __launch_bounds__(256, 2) attn_decode_bf16_bar(const AttnDecodeParams p) {
    attn_decode_bf16_body<true>(p);
}
// The barrier kernel for Qwen3.5/3.6's attention (head dim 256, 8 q heads per kv head: the 35B-A3B's
// 16 over 2); attention::barrier_kernel picks it where the dims match.
extern "C" __global__ void __launch_bounds__(256, 2) attn_decode_bf16_bar_dh256_g8(const AttnDecodeParams p) {
    attn_decode_bf16_body<true, 256, 8>(p);
}

// Layouts shared with the Rust launchers (tests/layouts.rs checks the same sizes).
static_assert(sizeof(AttnDecodeParams) == 152, "AttnDecodeParams layout differs from its Rust twin");
