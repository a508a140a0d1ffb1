// select.cu: choosing the next token on the device, exactly as calla_engine::sampling::select_token.
//
// Rules (the CPU reference's header, verbatim in effect):
//   lse = log Σ exp(raw);  logprob(id) = raw[id] − lse;  top logprobs = the n best raw (value ↓, id ↑)
//   z = raw (NaN → −∞) + logit_bias;  seen ids (prompt ∪ output): z ← z>0 ? z/rep : z·rep;
//   z ← z − (presence + frequency·count) for ids in the output
//   greedy (T = 0): argmax z (ties: lowest id)
//   sampling: z ← z/T; kept = finite; top-k by (z ↓, id ↑); top-p: p = softmax over kept, walk by
//     (p ↓, id ↑) keeping ids whose preceding cumulative p < top_p; min-p: exp(z − z_max) ≥ min_p;
//     w = exp(z − z_max) over kept; target = u·Σw with
//     u = philox4x32_10([step, step>>32, 0, 0], [seed, seed>>32])[0] >> 8 · 2⁻²⁴;
//     the sums a pairwise tree over the id space (weight_tree), the draw its descent (tree_draw).
// The tree's nodes are the reference's exactly, so the same token is drawn; the top-p boundary of a
// nucleus beyond the 64 candidates is found by mass in another summation order (identical except
// within rounding of the boundary; docs/cuda-parity.md).
//
// Launch: select_token: grid NB = ⌈V/chunk⌉ blocks × 256 threads. Each block reduces its chunk (raw
//   max/sum, z max/argmax/sum, its best SEL_MAX_LOGPROBS raw and, for top-k / top-p, SEL_MAX_CAND z
//   candidates) into a partial; the last block (atomic ticket) merges them, writes the SelectResult,
//   advances the cursor (token ← chosen, pos ← pos + 1) and the draw step, and counts the token for
//   the penalties. A sampled token is drawn by the whole grid (sub_log2 > 0: each chunk one subtree
//   of the weight tree, its blocks all resident; "sampling on the whole grid" below), or else by the
//   last block alone. Everything it reads that changes per request or per step is in device memory
//   (SelectConfig, Cursor), so the launch can live in the decode graph.
//   Dynamic smem: two arrays of `arr` floats.
// Bytes per call: V·4 (logits) + V·(4 + 1 + 4) with bias/penalty tables.


// The parts, compiled before this file in this order (runtime/kernels.rs): select_rules.cuh
// (parameters, Philox, radix select), select_sampling.cuh (the weight tree and the grid draw).

// ---------------------------------------------------------------- plain greedy
// T = 0 with no logit bias, no penalties and no top logprobs (z = raw, nothing ranked): the argmax and
// the log-sum-exp of the raw logits, in registers. Each thread keeps (max, Σ exp(raw − max)) and its
// best (value ↓, id ↑); warps and then warp 0 merge them into the block's partial; warp 0 of the
// ticket's last block merges the partials (each lane two, loaded together: ≤ 64 blocks) and
// publishes. The general path computes the same through its shared-memory arrays, a second pass for
// the sum, block barriers for the lists it would rank, and a 256-thread last block reading the
// partials field by field: 15.0 µs from the first warp's entry to the result at V = 248,320 (clock
// stamps), 11.6 µs per launch in the no-graph profile, against 6.7 for this path (docs/experiments.md). The token is the general path's (the same total order); the log-probability's sum is
// in another order (rounding). (GreedyAcc and its merges: common.cuh. Where lm_head runs on the
// tensor cores, the decode graph for plain greedy has no selection launch at all: lm_head takes the
// same path itself, matvec_tc.cu `matvec_tc_q4_c2_s1_greedy`.)
// lv: this thread's first SEL_PER_THREAD logits of the block's chunk [lo, lo + n), requested by the
// caller (k = threadIdx.x + j·blockDim.x; values past n unused).
__device__ __forceinline__ void select_greedy(const SelectParams& p, const SelectConfig& c, float (&lv)[SEL_PER_THREAD],
                                              int lo, int n) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    const float* logits = (const float*)p.logits;
    // the cursor's position, for the last block's host copy: requested now, not after the merge
    const int pos = p.result_host && tid == 0 ? ((const Cursor*)p.cursor)->pos : 0;
    GreedyAcc a = {NEG_INF, 0.0f, NEG_INF, 0x7fffffff};
    const int batch = SEL_PER_THREAD * blockDim.x;
    for (int base = 0; base < n; base += batch) {
        if (base > 0) {
#pragma unroll
            for (int j = 0; j < SEL_PER_THREAD; ++j) {
                const int k = base + tid + j * blockDim.x;
                lv[j] = k < n ? __ldcg(logits + lo + k) : 0.0f;
            }
        }
        float bm = a.m;
#pragma unroll
        for (int j = 0; j < SEL_PER_THREAD; ++j) {
            const int k = base + tid + j * blockDim.x;
            const float r = k < n ? sanitise(lv[j]) : NEG_INF;
            lv[j] = r;
            bm = fmaxf(bm, r);
            if (r > a.v) { a.v = r; a.i = lo + k; } // ids rise with j: the first of equals is kept
        }
        if (bm > NEG_INF) {
            float sum = a.m > NEG_INF ? a.s * expf(a.m - bm) : 0.0f;
#pragma unroll
            for (int j = 0; j < SEL_PER_THREAD; ++j) sum += expf(lv[j] - bm);
            a.s = sum;
            a.m = bm;
        }
    }
    a = greedy_warp_merge(a);
    __shared__ GreedyAcc w_acc[32];
    if (lane == 0) w_acc[warp] = a;
    __syncthreads();
    if (warp != 0) return;
    a = greedy_warp_merge(lane < nw ? w_acc[lane] : GreedyAcc{NEG_INF, 0.0f, NEG_INF, 0x7fffffff});
    SelectPartial* parts = (SelectPartial*)p.partials;
    int last = 0;
    if (lane == 0) {
        SelectPartial* part = parts + blockIdx.x;
        part->raw_max = a.m;
        part->raw_sum = a.s;
        part->z_max = a.v;
        part->z_arg = a.i;
        __threadfence();
        last = atomicAdd((unsigned*)p.counter, 1u) + 1 == gridDim.x;
    }
    if (!__shfl_sync(0xffffffffu, last, 0)) return;
    __threadfence();
    // the partials, two per lane in flight at once (NB ≤ 64: select.rs MAX_BLOCKS)
    const int NB = gridDim.x;
    float pm[2], ps[2], pv[2];
    int pi[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int b = lane + 32 * h;
        const bool ok = b < NB;
        pm[h] = ok ? __ldcg(&parts[b].raw_max) : NEG_INF;
        ps[h] = ok ? __ldcg(&parts[b].raw_sum) : 0.0f;
        pv[h] = ok ? __ldcg(&parts[b].z_max) : NEG_INF;
        pi[h] = ok ? __ldcg(&parts[b].z_arg) : 0x7fffffff;
    }
    a = greedy_merge(GreedyAcc{pm[0], ps[0], pv[0], pi[0]}, GreedyAcc{pm[1], ps[1], pv[1], pi[1]});
    a = greedy_warp_merge(a);
    if (lane == 0) {
        // as the general path: no finite logit at all → token 0 (the lowest id of equals)
        const int token = a.v > NEG_INF || a.i != 0x7fffffff ? a.i : 0;
        const float lse = a.m > NEG_INF ? a.m + logf(a.s) : NEG_INF;
        const float raw_tok = token == a.i ? a.v : sanitise(__ldcg(logits + token));
        ((SelectResult*)p.result)->n_top = 0;
        publish_choice(p, c, token, raw_tok - lse, 0, pos);
    }
}

extern "C" __global__ void __launch_bounds__(SEL_THREADS) select_token(const SelectParams p) {
// Labs pricing the launch itself in the decode graph (docs/experiments.md):
    extern __shared__ float sm[];
    // two arrays of `arr` floats: a block's values, then the merged candidates / draw tiles
    const int arr = max(max(p.chunk, (int)gridDim.x * SEL_MAX_CAND), max((int)gridDim.x * SEL_MAX_LOGPROBS, (int)blockDim.x + 1));
    float* raw = sm;       // [arr]
    float* zv = sm + arr;  // [arr]
    __shared__ float red[32];
    const SelectConfig c = *(const SelectConfig*)p.config;
    const bool sampling = c.temperature > 0.0f;
    const int lo = blockIdx.x * p.chunk, n = max(0, min(p.V, lo + p.chunk) - lo);
    const float* logits = (const float*)p.logits;
    SelectPartial* part = (SelectPartial*)p.partials + blockIdx.x;
    // Every logit of the thread requested at once, before the configuration decides the path: one
    // loop iteration per load waited ~0.6 µs for each in turn (the lm_head's logits come from L2).
    // (A chunk beyond one batch, V > 262,144: the general path's loop reads them again.)
    const bool one_batch = n <= SEL_PER_THREAD * (int)blockDim.x;
    float lv[SEL_PER_THREAD];
#pragma unroll
    for (int j = 0; j < SEL_PER_THREAD; ++j) {
        const int k = threadIdx.x + j * blockDim.x;
        lv[j] = k < n ? __ldcg(logits + lo + k) : 0.0f;
    }
    if (!sampling && c.n_logprobs <= 0 && !c.use_bias && !c.use_seen && !c.use_counts && gridDim.x <= 64) {
        select_greedy(p, c, lv, lo, n);
        return;
    }

    // ---- per-block partials
    float rmax = NEG_INF;
    Best zb = {__int_as_float(0x7fc00000), 0x7fffffff}; // this thread's best z, in k order
    int nfin = 0;
    auto take = [&](int k, float logit) {
        const float r = sanitise(logit);
        raw[k] = r;
        rmax = fmaxf(rmax, r);
        const float z = adjust(p, c, lo + k, r, sampling);
        zv[k] = z;
        if (better(z, lo + k, zb.v, zb.i)) { zb.v = z; zb.i = lo + k; }
        nfin += (z > NEG_INF && z < __int_as_float(0x7f800000)) ? 1 : 0;
    };
    if (one_batch) {
#pragma unroll
        for (int j = 0; j < SEL_PER_THREAD; ++j) {
            const int k = threadIdx.x + j * blockDim.x;
            if (k < n) take(k, lv[j]);
        }
    } else {
        for (int k = threadIdx.x; k < n; k += blockDim.x) take(k, logits[lo + k]);
    }
    // The grid draw (sampling, sub_log2 > 0): this block's chunk is its subtree, zv its z values, the
    // ids past V −inf (zero leaves).
    if (sampling && p.sub_log2 > 0)
        for (int k = n + threadIdx.x; k < p.chunk; k += blockDim.x) zv[k] = NEG_INF;
    // The raw maximum, the best z and the finite count in one block reduction (each is exact in any
    // order), then Σ exp(raw − max) (and Σ exp(z − zmax) when sampling) as block_sum always did.
    {
        __shared__ float w_rmax[32];
        __shared__ Best w_zb[32];
        __shared__ int w_nf[32];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            rmax = fmaxf(rmax, __shfl_xor_sync(0xffffffffu, rmax, o));
            const float ov = __shfl_xor_sync(0xffffffffu, zb.v, o);
            const int oi = __shfl_xor_sync(0xffffffffu, zb.i, o);
            if (better(ov, oi, zb.v, zb.i)) { zb.v = ov; zb.i = oi; }
            nfin += __shfl_xor_sync(0xffffffffu, nfin, o);
        }
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
        if (lane == 0) { w_rmax[warp] = rmax; w_zb[warp] = zb; w_nf[warp] = nfin; }
        __syncthreads();
        rmax = w_rmax[0];
        zb = w_zb[0];
        nfin = w_nf[0];
        for (int w = 1; w < nw; ++w) {
            rmax = fmaxf(rmax, w_rmax[w]);
            if (better(w_zb[w].v, w_zb[w].i, zb.v, zb.i)) zb = w_zb[w];
            nfin += w_nf[w];
        }
    }
    float rs = 0.0f;
    if (rmax > NEG_INF)
        for (int k = threadIdx.x; k < n; k += blockDim.x) rs += expf(raw[k] - rmax);
    rs = block_sum(rs, red);
    float zs = 0.0f;
    if (sampling) {
        if (zb.v > NEG_INF)
            for (int k = threadIdx.x; k < n; k += blockDim.x)
                if (zv[k] > NEG_INF) zs += expf(zv[k] - zb.v);
        zs = block_sum(zs, red);
    }
    if (threadIdx.x == 0) {
        part->raw_max = rmax; part->raw_sum = rs; part->z_max = zb.v; part->z_arg = zb.i; part->z_sum = zs;
        part->n_finite = nfin;
        part->raw_at_arg = zb.i >= lo && zb.i < lo + n ? raw[zb.i - lo] : __int_as_float(0x7fc00000);
    }
    const int nl = min(c.n_logprobs, SEL_MAX_LOGPROBS);
    int got = block_top_radix(raw, nullptr, lo, n, nl, part->raw_ids, part->raw_vals);
    if (threadIdx.x == 0) part->n_raw = got;
    // Candidates (the best z) only for top-k and top-p: plain temperature sampling draws from the
    // weight tree alone, and the candidates' k block reductions cost ~0.6 ms per token.
    const bool need_cands = sampling && (c.top_k > 0 || c.top_p < 1.0f);
    if ((!need_cands || p.sub_log2 > 0) && threadIdx.x == 0) part->n_cand = 0;
    if (need_cands && p.sub_log2 <= 0) { // the grid draw takes them from the whole grid (grid_top_candidates)
        const int kc = (c.top_k > 0 && c.top_k < SEL_MAX_CAND) ? c.top_k : SEL_MAX_CAND;
        got = block_top_radix(zv, nullptr, lo, n, kc, part->cand_ids, part->cand_vals);
        if (threadIdx.x == 0) part->n_cand = got;
    }

    // ---- sampling on the whole grid (see "sampling on the whole grid" above): every block
    const bool grid = sampling && p.sub_log2 > 0;
    __shared__ int gs_mode, gs_nfin, gs_drawn; // gs_mode 0: draw; 3: nothing to draw (argmax)
    __shared__ float gs_zmax;
    __shared__ int gk_ids[SEL_MAX_CAND];
    __shared__ float gk_vals[SEL_MAX_CAND];
    __shared__ KeepRule gs_rule;
    int sub_l = 0, nsub = 0;
    if (grid) {
        sub_l = (1 << p.sub_log2) / (int)blockDim.x;
        int pow2 = 1;
        while (pow2 < p.V) pow2 <<= 1;
        nsub = pow2 >> p.sub_log2;
        sel_grid_sync(p); // 1: every partial written
        const volatile SelectPartial* gparts = (const volatile SelectPartial*)p.partials;
        const int NB = gridDim.x;
        if (threadIdx.x < 32) { // z max and the finite count: exact in any order
            float zm = NEG_INF;
            int nf = 0;
            for (int b = threadIdx.x; b < NB; b += 32) {
                zm = fmaxf(zm, gparts[b].z_max);
                nf += gparts[b].n_finite;
            }
            zm = warp_max(zm);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) nf += __shfl_xor_sync(0xffffffffu, nf, o);
            if (threadIdx.x == 0) {
                gs_zmax = zm;
                gs_nfin = nf;
                gs_mode = nf > 0 ? 0 : 3;
            }
        }
        __syncthreads();
        const float zmax = gs_zmax;
        const int nfin = gs_nfin;
        // 2: the candidates, ranked, from the whole grid (the same list in every block)
        int nk = 0;
        if (need_cands && gs_mode == 0) {
            const int want = (c.top_k > 0 && c.top_k < SEL_MAX_CAND) ? c.top_k : SEL_MAX_CAND;
            nk = grid_top_candidates(p, zv, sub_l, blockIdx.x * (1 << p.sub_log2), nfin, want, gk_ids, gk_vals);
        }
        const bool topk_mode = c.top_k > 0 && c.top_k < nfin && c.top_k <= SEL_MAX_CAND;
        if (threadIdx.x == 0) {
            KeepRule r;
            r.zmax = zmax;
            r.vstar = NEG_INF;
            r.min_p = 0.0f;
            r.tie_mode = 0;
            r.tie_room = 0x7fffffff;
            r.ties_before = 0;
            r.listed = gk_ids;
            r.n_listed = 0;
            if (topk_mode && nk > 0) {
                r.n_listed = min(c.top_k, nk);
                r.vstar = gk_vals[r.n_listed - 1];
                r.tie_mode = 1;
            }
            gs_rule = r;
        }
        __syncthreads();
        // this block's subtree: its ids from first, its z values phase 1's (its chunk), −inf past V
        const int first = blockIdx.x * (1 << p.sub_log2) + threadIdx.x * sub_l;
        float* zs = zv;
        // 3: top-p
        if (c.top_p < 1.0f && gs_mode == 0) {
            const float root = sub_tree_root(zs, first, sub_l, gs_rule, nullptr);
            if (threadIdx.x == 0) sel_grid_row(p, SEL_GRID_ROW_TOTAL)[blockIdx.x] = root;
            sel_grid_sync(p); // 2
            const float total = grid_top(p, SEL_GRID_ROW_TOTAL, nsub, sm);
            __shared__ int s_big;
            if (threadIdx.x == 0) { // the reference's walk over the ranked candidates
                const int kept = topk_mode ? min(c.top_k, nk) : nfin;
                const int walk = min(kept, nk);
                float cum = 0.0f;
                int m2 = 0;
                for (; m2 < walk; ++m2) {
                    if (cum >= c.top_p) break;
                    cum += expf(gk_vals[m2] - zmax) / total;
                }
                s_big = 0;
                if (m2 == 0) gs_mode = 3; // top_p ≤ 0 keeps nothing: the reference falls back to argmax
                else if (cum >= c.top_p || m2 == kept) {
                    gs_rule.n_listed = m2;
                    gs_rule.vstar = gk_vals[m2 - 1];
                    gs_rule.tie_mode = 1;
                } else {
                    s_big = 1; // the nucleus is larger than the candidates
                }
            }
            __syncthreads();
            if (s_big) {
                // v* = the smallest finite z with mass(z' > v*) < top_p: the smallest ordered key in
                // (lo, hi] whose mass is below top_p, searched 16 ways per step (one barrier each; ~8
                // steps over 2³² keys). Every block evaluates the same mass function (the subtrees'
                // sums in block order; non-increasing in the key: f32 sums of fewer non-negative terms
                // in a fixed order), so all find the same key, the one a bisection finds.
                const float lo_v = -3.0e38f, hi_v = gk_vals[nk - 1];
                int lo_k = __float_as_int(lo_v) < 0 ? (int)(0x80000000u - (u32)__float_as_int(lo_v)) : __float_as_int(lo_v);
                int hi_k = __float_as_int(hi_v) < 0 ? (int)(0x80000000u - (u32)__float_as_int(hi_v)) : __float_as_int(hi_v);
                float zr[SEL_SUB_L_MAX], e[SEL_SUB_L_MAX]; // this thread's z values and weights (0: not finite)
#pragma unroll
                for (int j = 0; j < SEL_SUB_L_MAX; ++j) {
                    zr[j] = j < sub_l ? zs[threadIdx.x * sub_l + j] : NEG_INF;
                    e[j] = zr[j] > NEG_INF && zr[j] < __int_as_float(0x7f800000) ? expf(zr[j] - zmax) : 0.0f;
                }
                __shared__ float s_wsum[SEL_SEARCH_POINTS][SEL_THREADS / 32];
                __shared__ float s_mass[SEL_SEARCH_POINTS];
                for (int it = 0; (i64)hi_k - (i64)lo_k > 1; ++it) {
                    const i64 span = (i64)hi_k - (i64)lo_k;
                    const int q = (int)min((i64)SEL_SEARCH_POINTS, span - 1); // points strictly inside
                    float* rows = sel_grid_row(p, SEL_GRID_ROW_SEARCH + (it & 1) * SEL_SEARCH_POINTS);
#pragma unroll 1
                    for (int i = 0; i < q; ++i) {
                        const int key = (int)((i64)lo_k + span * (i + 1) / (q + 1));
                        const float v = key < 0 ? __int_as_float((int)(0x80000000u - (u32)key)) : __int_as_float(key);
                        float mass = 0.0f;
#pragma unroll
                        for (int j = 0; j < SEL_SUB_L_MAX; ++j)
                            if (j < sub_l && zr[j] > v) mass += e[j];
                        mass = warp_sum(mass);
                        if ((threadIdx.x & 31) == 0) s_wsum[i][threadIdx.x >> 5] = mass;
                    }
                    __syncthreads();
                    if (threadIdx.x < q) { // block_sum's order: the warps' sums in warp order
                        float m = 0.0f;
#pragma unroll
                        for (int w = 0; w < SEL_THREADS / 32; ++w) m += s_wsum[threadIdx.x][w];
                        rows[(i64)threadIdx.x * gridDim.x + blockIdx.x] = m;
                    }
                    sel_grid_sync(p);
                    { // warp i % 8 adds point i's row in block order
                        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
                        for (int i = warp; i < q; i += SEL_THREADS / 32) {
                            float v = 0.0f;
                            for (int b = lane; b < NB; b += 32) v += __ldcg(rows + (i64)i * gridDim.x + b);
                            v = warp_sum(v);
                            if (lane == 0) s_mass[i] = v;
                        }
                    }
                    __syncthreads();
                    int first_below = q; // the first point whose mass is below top_p
                    for (int i = q - 1; i >= 0; --i)
                        if (s_mass[i] / total < c.top_p) first_below = i;
                    const int lo_new = first_below == 0 ? lo_k : (int)((i64)lo_k + span * first_below / (q + 1));
                    if (first_below < q) hi_k = (int)((i64)lo_k + span * (first_below + 1) / (q + 1));
                    lo_k = lo_new;
                    __syncthreads(); // s_wsum, s_mass reused
                }
                const float thr = hi_k < 0 ? __int_as_float((int)(0x80000000u - (u32)hi_k)) : __int_as_float(hi_k);
                float vmin = __int_as_float(0x7f800000);
#pragma unroll
                for (int j = 0; j < SEL_SUB_L_MAX; ++j)
                    if (j < sub_l && zr[j] >= thr && zr[j] < vmin) vmin = zr[j];
                vmin = -block_max(-vmin, red);
                if (threadIdx.x == 0) sel_grid_row(p, SEL_GRID_ROW_VMIN)[blockIdx.x] = vmin;
                sel_grid_sync(p);
                __shared__ float s_vmin;
                if (threadIdx.x < 32) {
                    const float* r = sel_grid_row(p, SEL_GRID_ROW_VMIN);
                    float m = __int_as_float(0x7f800000);
                    for (int b = threadIdx.x; b < NB; b += 32) m = fminf(m, __ldcg(r + b));
                    m = -warp_max(-m);
                    if (threadIdx.x == 0) s_vmin = m;
                }
                __syncthreads();
                vmin = s_vmin;
                float above = 0.0f;
                int ties = 0;
#pragma unroll
                for (int j = 0; j < SEL_SUB_L_MAX; ++j)
                    if (j < sub_l && zr[j] < __int_as_float(0x7f800000)) {
                        if (zr[j] > vmin) above += expf(zr[j] - zmax);
                        ties += zr[j] == vmin ? 1 : 0;
                    }
                above = block_sum(above, red);
                const float ties_f = block_sum((float)ties, red); // exact: < 2²⁴
                if (threadIdx.x == 0) {
                    sel_grid_row(p, SEL_GRID_ROW_ABOVE)[blockIdx.x] = above;
                    sel_grid_row(p, SEL_GRID_ROW_TIES)[blockIdx.x] = ties_f;
                }
                sel_grid_sync(p);
                above = grid_row_sum(p, SEL_GRID_ROW_ABOVE, gridDim.x) / total;
                if (threadIdx.x == 0) {
                    const float pv = expf(vmin - zmax) / total;
                    const float room = (c.top_p - above) / pv;
                    int tie_room = room > 2.0e9f ? 0x7fffffff : (int)ceilf(room);
                    if (tie_room < 1) tie_room = 1;
                    gs_rule.vstar = vmin;
                    gs_rule.tie_mode = 2;
                    gs_rule.tie_room = tie_room;
                }
                __syncthreads();
            }
        }
        // 4: each subtree's root over the final kept set (the ticket below publishes it)
        if (threadIdx.x == 0) gs_rule.min_p = c.min_p;
        __syncthreads();
        if (gs_mode == 0) {
            if (gs_rule.tie_mode == 2) {
                const int before = sel_ties_before(p, blockIdx.x);
                if (threadIdx.x == 0) gs_rule.ties_before = before;
                __syncthreads();
            }
            float* leaves = zs; // [S] this subtree's leaves, in place of its z values (each thread its own)
            const float root = sub_tree_root(zs, first, sub_l, gs_rule, leaves);
            if (threadIdx.x == 0) sel_grid_row(p, SEL_GRID_ROW_FINAL)[blockIdx.x] = root;
            sel_grid_sync(p);
            // 5: every block descends the top of the tree to the same subtree; that block descends
            // its own leaves and publishes the id (before the ticket, which orders it for the last block)
            const float u = philox_uniform(c.seed_lo, c.seed_hi, c.step_lo, c.step_hi);
            const float total = grid_top(p, SEL_GRID_ROW_FINAL, nsub, sm);
            __shared__ int s_sub;
            __shared__ float s_target;
            if (threadIdx.x == 0) {
                int node = 1;
                float tg = u * total;
                while (node < nsub) {
                    const float left = sm[2 * node], right = sm[2 * node + 1];
                    if (tg < left || right == 0.0f) node = 2 * node;
                    else { tg -= left; node = 2 * node + 1; }
                }
                s_sub = node - nsub;
                s_target = tg;
                gs_drawn = total > 0.0f; // nothing kept (min_p > 1): argmax, as the reference
            }
            __syncthreads();
            if (gs_drawn && s_sub == (int)blockIdx.x) {
                // heap node k: the leaves (k ≥ S) in `leaves`, the inner nodes in sm[k]
                const int S = 1 << p.sub_log2;
                auto node = [&](int k) { return k >= S ? leaves[k - S] : sm[k]; };
                for (int half = S / 2; half >= 1; half >>= 1) {
                    for (int k = half + threadIdx.x; k < 2 * half; k += blockDim.x) sm[k] = node(2 * k) + node(2 * k + 1);
                    __syncthreads();
                }
                if (threadIdx.x == 0) {
                    int nd = 1;
                    float tg = s_target;
                    while (nd < S) {
                        const float left = node(2 * nd), right = node(2 * nd + 1);
                        if (tg < left || right == 0.0f) nd = 2 * nd;
                        else { tg -= left; nd = 2 * nd + 1; }
                    }
                    *(int*)(p.grid + 8) = blockIdx.x * S + nd - S;
                }
            }
        }
    }

    // ---- the last block merges
    if (!block_arrive_last((unsigned*)p.counter, gridDim.x)) return;
    __shared__ int s_grid_token;
    if (threadIdx.x == 0) s_grid_token = grid && gs_mode == 0 && gs_drawn ? __ldcg((const int*)(p.grid + 8)) : -1;
    __syncthreads();
    const int NB = gridDim.x;
    const volatile SelectPartial* parts = (const volatile SelectPartial*)p.partials;
    __shared__ float g_lse, g_zmax, g_ztotal;
    __shared__ int g_arg, g_nfin;
    // Every partial's scalars into shared memory with all threads at once (one L2 round trip), then
    // thread 0 merges them in block order as before: its loops read shared memory, not one dependent
    // L2 load per partial (that chain was ~40 µs of the ~57 µs this kernel took at V = 248,320).
    float* p_raw_max = raw; // raw's block values are no longer needed
    float* p_raw_sum = raw + NB;
    float* p_z_max = raw + 2 * NB;
    float* p_z_sum = raw + 3 * NB;
    int* p_z_arg = (int*)(raw + 4 * NB);
    int* p_nfin = (int*)(raw + 5 * NB);
    float* p_raw_at = raw + 6 * NB;
    for (int b = threadIdx.x; b < NB; b += blockDim.x) {
        p_raw_max[b] = parts[b].raw_max;
        p_raw_sum[b] = parts[b].raw_sum;
        p_z_max[b] = parts[b].z_max;
        p_z_sum[b] = parts[b].z_sum;
        p_z_arg[b] = parts[b].z_arg;
        p_nfin[b] = parts[b].n_finite;
        p_raw_at[b] = parts[b].raw_at_arg;
    }
    __syncthreads();
    __shared__ float g_raw_at_arg;
    // One warp merges: lane l takes partials l, l + 32, … and the lanes combine by shuffles (a fixed
    // tree: the same sums every time; a thread-0 loop over the partials took microseconds).
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        float M = NEG_INF, ZM = NEG_INF, at = __int_as_float(0x7fc00000);
        int arg = 0x7fffffff, nfin_all = 0;
        for (int b = lane; b < NB; b += 32) {
            M = fmaxf(M, p_raw_max[b]);
            if (better(p_z_max[b], p_z_arg[b], ZM, arg)) { ZM = p_z_max[b]; arg = p_z_arg[b]; at = p_raw_at[b]; }
            nfin_all += p_nfin[b];
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
            const float ov = __shfl_xor_sync(0xffffffffu, ZM, o), oa = __shfl_xor_sync(0xffffffffu, at, o);
            const int oi = __shfl_xor_sync(0xffffffffu, arg, o);
            if (better(ov, oi, ZM, arg)) { ZM = ov; arg = oi; at = oa; }
            nfin_all += __shfl_xor_sync(0xffffffffu, nfin_all, o);
        }
        float S = 0.0f, ZS = 0.0f;
        for (int b = lane; b < NB; b += 32) {
            if (p_raw_max[b] > NEG_INF) S += p_raw_sum[b] * expf(p_raw_max[b] - M);
            if (p_z_max[b] > NEG_INF && ZM > NEG_INF) ZS += p_z_sum[b] * expf(p_z_max[b] - ZM);
        }
        S = warp_sum(S);
        ZS = warp_sum(ZS);
        if (lane == 0) {
            g_lse = M > NEG_INF ? M + logf(S) : NEG_INF;
            g_zmax = ZM;
            g_ztotal = ZS;
            g_arg = (ZM > NEG_INF || arg != 0x7fffffff) ? arg : 0;
            g_nfin = nfin_all;
            g_raw_at_arg = arg == g_arg ? at : __int_as_float(0x7fc00000);
        }
    }
    __syncthreads();
    // merged top logprobs: NB·nl candidates → best nl
    SelectResult* res = (SelectResult*)p.result;
    float* cv = raw; // reuse shared memory: candidates
    int* ci = (int*)zv;
    int ncand = 0;
    if (nl > 0) {
        ncand = NB * SEL_MAX_LOGPROBS;
        gather_lists<false>(p, cv, ci);
        __shared__ int t_ids[SEL_MAX_LOGPROBS];
        __shared__ float t_vals[SEL_MAX_LOGPROBS];
        const int got2 = block_top_radix(cv, ci, 0, ncand, nl, t_ids, t_vals);
        if (threadIdx.x == 0) {
            res->n_top = got2;
            for (int k = 0; k < got2; ++k) { res->top_ids[k] = t_ids[k]; res->top_logprobs[k] = t_vals[k] - g_lse; }
        }
    } else if (threadIdx.x == 0) {
        res->n_top = 0;
    }
    __syncthreads();

    int token = g_arg;
    int sampled = 0;
    if (grid && s_grid_token >= 0) {
        token = s_grid_token;
        sampled = 1;
    }
    if (sampling && g_nfin > 0 && !grid) {
        const float u = philox_uniform(c.seed_lo, c.seed_hi, c.step_lo, c.step_hi);
        // merged z candidates (best SEL_MAX_CAND, or top_k)
        const int want = (c.top_k > 0 && c.top_k < SEL_MAX_CAND) ? c.top_k : SEL_MAX_CAND;
        __shared__ int k_ids[SEL_MAX_CAND];
        __shared__ float k_vals[SEL_MAX_CAND];
        int nk = 0;
        if (need_cands) {
            ncand = NB * SEL_MAX_CAND;
            gather_lists<true>(p, cv, ci);
            nk = block_top_radix(cv, ci, 0, ncand, want, k_ids, k_vals); // ranked (z ↓, id ↑)
        }
        // From here the candidates' shared memory (raw, zv) is the weight tree's.
        const TreeShape shape = tree_shape(p.V, 2 * arr);
        // kept = finite z > s_vstar, and of the ids at s_vstar the first s_tie_room in id order: every
        // finite z, then the top-k (a ranked prefix of the candidates), then the nucleus.
        __shared__ int s_token, s_mode, s_tie_room, s_prefix;
        __shared__ float s_vstar;
        // A kept set that is a ranked prefix of the candidates (s_prefix ids) is summed sparsely by
        // thread 0 when its levels fit the shared memory; otherwise with the whole block.
        int levels = 0;
        while ((1 << levels) < p.V) ++levels;
        const bool sparse_fits = levels <= SPARSE_MAX_LEVELS && 2 * (levels + 1) * SEL_MAX_CAND <= 2 * arr;
        const bool topk_mode = c.top_k > 0 && c.top_k < g_nfin && c.top_k <= SEL_MAX_CAND;
        if (threadIdx.x == 0) {
            int m = 0;
            for (int k = 0; k < nk; ++k)
                if (k_vals[k] > NEG_INF && k_vals[k] < __int_as_float(0x7f800000)) { k_vals[m] = k_vals[k]; k_ids[m] = k_ids[k]; ++m; }
            nk = m;
            s_mode = 0; // 0: draw; 2: the nucleus is larger than the candidates; 3: nothing kept (argmax)
            s_token = -1;
            s_vstar = NEG_INF;
            s_tie_room = 0x7fffffff;
            s_prefix = 0;
            if (topk_mode) {
                s_prefix = min(c.top_k, nk);
                ranked_prefix(k_vals, s_prefix, s_vstar, s_tie_room);
            }
        }
        __syncthreads();
        if (c.top_p < 1.0f) {
            // p = softmax over kept (the reference's normaliser: the weight tree's root), walked by rank
            float total = 0.0f;
            if (s_prefix > 0 && sparse_fits) {
                if (threadIdx.x == 0) {
                    int unused;
                    total = sparse_tree(k_ids, k_vals, s_prefix, g_zmax, 0.0f, p.V, sm, 0.0f, &unused);
                }
            } else {
                total = tree_build(p, c, g_zmax, s_vstar, s_tie_room, false, sm, shape);
            }
            if (threadIdx.x == 0) {
                g_ztotal = total;
                const int kept = topk_mode ? min(c.top_k, nk) : g_nfin;
                const int walk = min(kept, nk);
                float cum = 0.0f;
                int m2 = 0;
                for (; m2 < walk; ++m2) {
                    if (cum >= c.top_p) break;
                    cum += expf(k_vals[m2] - g_zmax) / total;
                }
                if (m2 == 0) s_mode = 3; // top_p ≤ 0 keeps nothing: the reference falls back to argmax
                else if (cum >= c.top_p || m2 == kept) {
                    s_prefix = m2;
                    ranked_prefix(k_vals, m2, s_vstar, s_tie_room);
                } else {
                    s_prefix = 0;
                    s_mode = 2; // nucleus larger than the candidates: bisection below
                }
            }
            __syncthreads();
            if (s_mode == 2) {
                // Find v* = the smallest finite z with mass(z' > v*) < top_p by bisection on ordered keys.
                __shared__ int s_lo, s_hi;
                if (threadIdx.x == 0) {
                    const float lo_v = -3.0e38f;
                    const float hi_v = k_vals[nk - 1];
                    s_lo = __float_as_int(lo_v) < 0 ? (int)(0x80000000u - (u32)__float_as_int(lo_v)) : __float_as_int(lo_v);
                    s_hi = __float_as_int(hi_v) < 0 ? (int)(0x80000000u - (u32)__float_as_int(hi_v)) : __float_as_int(hi_v);
                }
                __syncthreads();
                for (int it = 0; it < 40; ++it) {
                    const int lo_k = s_lo, hi_k = s_hi;
                    if ((i64)hi_k - (i64)lo_k <= 1) break;
                    const int mid = (int)(((i64)lo_k + (i64)hi_k) >> 1);
                    const float v = mid < 0 ? __int_as_float((int)(0x80000000u - (u32)mid)) : __int_as_float(mid);
                    float mass = 0.0f;
#pragma unroll 8
                    for (int i = threadIdx.x; i < p.V; i += blockDim.x) {
                        const float z = adjust(p, c, i, logits[i], true);
                        if (z > v && z < __int_as_float(0x7f800000)) mass += expf(z - g_zmax);
                    }
                    mass = block_sum(mass, red) / g_ztotal;
                    if (threadIdx.x == 0) { if (mass < c.top_p) s_hi = mid; else s_lo = mid; }
                    __syncthreads();
                }
                // v* = the smallest z ≥ key(s_hi)
                const float thr = s_hi < 0 ? __int_as_float((int)(0x80000000u - (u32)s_hi)) : __int_as_float(s_hi);
                float vmin = __int_as_float(0x7f800000);
#pragma unroll 8
                for (int i = threadIdx.x; i < p.V; i += blockDim.x) {
                    const float z = adjust(p, c, i, logits[i], true);
                    if (z >= thr && z < vmin) vmin = z;
                }
                vmin = -block_max(-vmin, red);
                float above = 0.0f;
#pragma unroll 8
                for (int i = threadIdx.x; i < p.V; i += blockDim.x) {
                    const float z = adjust(p, c, i, logits[i], true);
                    if (z > vmin && z < __int_as_float(0x7f800000)) above += expf(z - g_zmax);
                }
                above = block_sum(above, red) / g_ztotal;
                if (threadIdx.x == 0) {
                    const float pv = expf(vmin - g_zmax) / g_ztotal;
                    const float room = (c.top_p - above) / pv;
                    s_vstar = vmin;
                    s_tie_room = room > 2.0e9f ? 0x7fffffff : (int)ceilf(room);
                    if (s_tie_room < 1) s_tie_room = 1;
                    s_mode = 0;
                }
                __syncthreads();
            }
        }
        __syncthreads();
        if (s_mode == 0 && s_prefix > 0 && sparse_fits) {
            if (threadIdx.x == 0) {
                int r;
                sparse_tree(k_ids, k_vals, s_prefix, g_zmax, c.min_p, p.V, sm, u, &r);
                s_token = r;
            }
        } else if (s_mode == 0) {
            const float total = tree_build(p, c, g_zmax, s_vstar, s_tie_room, c.min_p > 0.0f, sm, shape);
            const int r = tree_descend(p, c, g_zmax, s_vstar, s_tie_room, c.min_p > 0.0f, u * total, sm, shape);
            if (threadIdx.x == 0) s_token = r;
        }
        __syncthreads();
        if (s_token >= 0) { token = s_token; sampled = 1; }
    }
    if (threadIdx.x == 0) {
        // the greedy token's raw logit came with its partial; a drawn token's is read here
        const float raw_tok = token == g_arg && g_raw_at_arg == g_raw_at_arg ? g_raw_at_arg : sanitise(logits[token]);
        publish_choice(p, c, token, raw_tok - g_lse, sampled, p.result_host ? ((const Cursor*)p.cursor)->pos : 0);
    }
}

// ---------------------------------------------------------------- penalty tables
// seen[id] = 1 for every listed id; counts[id] += 1 for the output ids. grid ⌈n/256⌉, block 256.
// The tables are zeroed (memset) before; afterwards select_token keeps them current on its own.
struct PenaltyParams {
    u64 prompt_ids; // [n_prompt] i32
    u64 output_ids; // [n_output] i32
    u64 seen;       // [V] u8
    u64 counts;     // [V] u32
    int n_prompt, n_output, V, pad;
};

extern "C" __global__ void __launch_bounds__(256) penalty_tables(const PenaltyParams p) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < p.n_prompt) {
        const int id = ((const int*)p.prompt_ids)[i];
        if (id >= 0 && id < p.V) ((u8*)p.seen)[id] = 1;
    } else if (i < p.n_prompt + p.n_output) {
        const int id = ((const int*)p.output_ids)[i - p.n_prompt];
        if (id >= 0 && id < p.V) {
            ((u8*)p.seen)[id] = 1;
            atomicAdd((u32*)p.counts + id, 1u);
        }
    }
}

// Layouts shared with the Rust launchers (tests/layouts.rs checks the same sizes).

static_assert(sizeof(SelectParams) == 104, "SelectParams layout differs from its Rust twin");
static_assert(sizeof(PenaltyParams) == 48, "PenaltyParams layout differs from its Rust twin");
static_assert(sizeof(SelectPartial) == 708, "SelectPartial layout differs from its Rust twin");
