// select.cu: choosing the next token on the device, exactly as calla_engine::sampling::select_token.
//
// Rules (the CPU reference's header, verbatim in effect):
//   lse = log Σ exp(raw);  logprob(id) = raw[id] − lse;  top logprobs = the n best raw (value ↓, id ↑)
//   z = raw (NaN → −∞) + logit_bias;  seen ids (prompt ∪ output): z ← z>0 ? z/rep : z·rep;
//   z ← z − (presence + frequency·count) for ids in the output
//   greedy (T = 0): argmax z (ties: lowest id)
//   sampling: z ← z/T; kept = finite; top-k by (z ↓, id ↑); top-p: p = softmax over kept, walk by
//     (p ↓, id ↑) keeping ids whose preceding cumulative p < top_p; min-p: exp(z − z_max) ≥ min_p;
//     w = exp(z − z_max) over kept in ascending id order; target = u·Σw with
//     u = philox4x32_10([step, step>>32, 0, 0], [seed, seed>>32])[0] >> 8 · 2⁻²⁴;
//     the first id whose running sum exceeds target (the last kept id if none).
// Sums in the reference are sequential in id order; here they are per-thread chunks in id order
// (identical tokens except when a draw lands within rounding of a boundary).
//
// Launch: select_token: grid NB = ⌈V/chunk⌉ blocks × 256 threads, dynamic smem chunk·4·2. Each block
//   reduces its chunk (raw max/sum, z max/argmax/sum, its best SEL_MAX_LOGPROBS raw and
//   SEL_MAX_CAND z candidates) into a partial; the last block (atomic ticket) merges them, draws,
//   writes the SelectResult, advances the cursor (token ← chosen, pos ← pos + 1) and the draw step,
//   and counts the token for the penalties. Everything it reads that changes per request or per step
//   is in device memory (SelectConfig, Cursor), so the launch can live in the decode graph.
// Bytes per call: V·4 (logits) + V·(4 + 1 + 4) with bias/penalty tables.

#define SEL_THREADS 256
#define SEL_MAX_LOGPROBS 20
#define SEL_MAX_CAND 64
#define SEL_PER_THREAD 16 // logits a thread loads at once (chunk ≤ 16·256: V ≤ 262,144 with 64 blocks)

struct SelectConfig {
    float temperature, top_p, min_p, rep_penalty, presence, frequency;
    int top_k, n_logprobs;
    u32 seed_lo, seed_hi, step_lo, step_hi;
    int use_bias, use_seen, use_counts, pad;
};

struct SelectPartial {
    float raw_max, raw_sum, z_max, z_sum;
    int z_arg, n_raw, n_cand, n_finite;
    float raw_at_arg; // the raw logit of z_arg (the greedy token's log-probability without a reload)
    int raw_ids[SEL_MAX_LOGPROBS];
    float raw_vals[SEL_MAX_LOGPROBS];
    int cand_ids[SEL_MAX_CAND];
    float cand_vals[SEL_MAX_CAND];
};

struct SelectResult {
    int token;
    float logprob;
    int n_top;
    int sampled; // 1 when drawn, 0 when argmax
    int top_ids[SEL_MAX_LOGPROBS];
    float top_logprobs[SEL_MAX_LOGPROBS];
};

struct SelectParams {
    u64 logits;   // [V] f32
    u64 config;   // SelectConfig*
    u64 partials; // [NB] SelectPartial
    u64 counter;  // u32 ticket
    u64 result;   // SelectResult*
    u64 cursor;   // Cursor*
    u64 bias;     // [V] f32 (config.use_bias)
    u64 seen;     // [V] u8: in prompt or output (config.use_seen)
    u64 counts;   // [V] u32: occurrences in the output (config.use_counts)
    u64 result_host; // [2] SelectResult in page-locked host memory mapped for the device, or 0: the
                     // result is also written to slot pos & 1 (the position the token was chosen at),
                     // so the host reads it when the step's event completes, with no copy queued
                     // between two decode steps in flight
    int V, chunk, advance, pad;
};

// ---------------------------------------------------------------- philox4x32-10
__device__ __forceinline__ float philox_uniform(u32 seed_lo, u32 seed_hi, u32 step_lo, u32 step_hi) {
    u32 c0 = step_lo, c1 = step_hi, c2 = 0, c3 = 0, k0 = seed_lo, k1 = seed_hi;
    for (int round = 0; round < 10; ++round) {
        if (round > 0) { k0 += 0x9E3779B9u; k1 += 0xBB67AE85u; }
        const u64 p0 = (u64)0xD2511F53u * c0, p1 = (u64)0xCD9E8D57u * c2;
        const u32 hi0 = (u32)(p0 >> 32), lo0 = (u32)p0, hi1 = (u32)(p1 >> 32), lo1 = (u32)p1;
        const u32 n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
    }
    return (float)(c0 >> 8) * (1.0f / 16777216.0f);
}

__device__ __forceinline__ float sanitise(float x) { return x != x ? NEG_INF : x; }

// z for one id: penalties and bias (steps 1–3), then /T when sampling.
__device__ __forceinline__ float adjust(const SelectParams& p, const SelectConfig& c, int i, float raw, bool sampling) {
    float z = sanitise(raw);
    if (c.use_bias) z += ((const float*)p.bias)[i];
    if (c.use_seen && ((const u8*)p.seen)[i]) z = z > 0.0f ? z / c.rep_penalty : z * c.rep_penalty;
    if (c.use_counts) {
        const u32 n = ((const u32*)p.counts)[i];
        if (n) z -= c.presence + c.frequency * (float)n;
    }
    return sampling ? z / c.temperature : z;
}

// (value ↓, id ↑), NaN = already taken (never better).
__device__ __forceinline__ bool better(float v1, int i1, float v2, int i2) {
    if (v1 != v1) return false;
    if (v2 != v2) return true;
    return v1 > v2 || (v1 == v2 && i1 < i2);
}

struct Best { float v; int i; };

// Block-wide best of (vals[k], ids[k]) for k = tid, tid + blockDim, … < n; all threads get it.
__device__ __forceinline__ Best block_best(const float* vals, const int* ids, int id_base, int n, Best* scratch) {
    Best b = {__int_as_float(0x7fc00000), 0x7fffffff};
    for (int k = threadIdx.x; k < n; k += blockDim.x) {
        const int id = ids ? ids[k] : id_base + k;
        if (better(vals[k], id, b.v, b.i)) { b.v = vals[k]; b.i = id; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, b.v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, b.i, o);
        if (better(ov, oi, b.v, b.i)) { b.v = ov; b.i = oi; }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) scratch[warp] = b;
    __syncthreads();
    Best r = scratch[0];
    for (int w = 1; w < nw; ++w)
        if (better(scratch[w].v, scratch[w].i, r.v, r.i)) r = scratch[w];
    return r;
}

// Take the best n of vals (marking them NaN); write ids/values to out. Returns how many were found.
__device__ int block_top(float* vals, const int* ids, int id_base, int count, int n, int* out_ids, float* out_vals,
                         Best* scratch) {
    int taken = 0;
    for (int k = 0; k < n && k < count; ++k) {
        const Best b = block_best(vals, ids, id_base, count, scratch);
        if (b.v != b.v) break;
        if (threadIdx.x == 0) { out_ids[k] = b.i; out_vals[k] = b.v; }
        // mark it taken (the thread that owns it)
        for (int j = threadIdx.x; j < count; j += blockDim.x)
            if ((ids ? ids[j] : id_base + j) == b.i) vals[j] = __int_as_float(0x7fc00000);
        ++taken;
        __syncthreads();
    }
    return taken;
}

// Draw over the whole vocabulary exactly as the reference does: kept = finite z passing the top-p
// threshold (z > vstar, and of the ids with z == vstar the first tie_room in id order; vstar = −inf
// keeps every finite z) and min-p; total = Σ w over kept in ascending id order and the running sum
// are sequential f32 sums, like the reference's, so the same draws come out (a parallel sum rounds
// differently: at V = 248k the reference's sequential total is off by ~4e-4 relative, which moves
// draws). The block computes w in tiles of `tile` ids into shared memory; thread 0 accumulates.
// ~0.7 ms per pass at V = 248k: used only when sampling without top-k. Returns −1 if nothing is kept.
__device__ int draw_exact(const SelectParams& p, const SelectConfig& c, float zmax, float vstar, int tie_room, float u,
                          float* w, u8* flag, int tile) {
    const float* logits = (const float*)p.logits;
    __shared__ float total_s, run_s;
    __shared__ int ties_s, chosen_s, last_s, done_s;
    if (threadIdx.x == 0) { total_s = 0.0f; ties_s = 0; last_s = -1; chosen_s = -1; done_s = 0; run_s = 0.0f; }
    for (int pass = 0; pass < 2; ++pass) {
        if (threadIdx.x == 0) ties_s = 0;
        __syncthreads();
        const float target = u * total_s;
        for (int base = 0; base < p.V; base += tile) {
            const int n = min(tile, p.V - base);
            for (int k = threadIdx.x; k < n; k += blockDim.x) {
                const float z = adjust(p, c, base + k, logits[base + k], true);
                u8 f = 0; // 0 drop, 1 keep, 2 tie at the top-p boundary
                float wk = 0.0f;
                if (z > NEG_INF && z < __int_as_float(0x7f800000) && z >= vstar) {
                    wk = expf(z - zmax);
                    f = z > vstar ? 1 : 2;
                    if (c.min_p > 0.0f && !(wk >= c.min_p)) f = 0;
                }
                w[k] = wk;
                flag[k] = f;
            }
            __syncthreads();
            if (threadIdx.x == 0 && !done_s) {
                float acc = pass == 0 ? total_s : run_s;
                int ties = ties_s;
                for (int k = 0; k < n; ++k) {
                    const u8 f = flag[k];
                    if (f == 0) continue;
                    // ties are counted before min-p in the reference (top-p, then min-p), but a
                    // tie group shares one z, so min-p keeps all of it or none
                    if (f == 2 && ties++ >= tie_room) continue;
                    acc += w[k];
                    if (pass == 0) {
                        last_s = base + k;
                    } else if (acc > target) {
                        chosen_s = base + k;
                        done_s = 1;
                        break;
                    }
                }
                ties_s = ties;
                if (pass == 0) total_s = acc; else run_s = acc;
            }
            __syncthreads();
            if (done_s) break;
        }
        if (pass == 0 && last_s < 0) break; // nothing kept
    }
    __syncthreads();
    return chosen_s >= 0 ? chosen_s : last_s;
}

// The reference's last steps on a small kept set given in rank order (ids[k], z[k]), k < n ≤
// SEL_MAX_CAND: ascending id order, min-p, sequential total, the first id whose running sum
// exceeds u·total (the last kept id if none). One thread.
__device__ int draw_ranked(const int* ids, const float* z, int n, float zmax, float min_p, float u) {
    int order[SEL_MAX_CAND];
    for (int k = 0; k < n; ++k) order[k] = k;
    for (int a = 1; a < n; ++a) {
        const int t = order[a];
        int b = a - 1;
        while (b >= 0 && ids[order[b]] > ids[t]) { order[b + 1] = order[b]; --b; }
        order[b + 1] = t;
    }
    float total = 0.0f;
    int last = -1;
    for (int k = 0; k < n; ++k) {
        const float w = expf(z[order[k]] - zmax);
        if (min_p > 0.0f && !(w >= min_p)) continue;
        total += w;
        last = ids[order[k]];
    }
    const float target = u * total;
    float run = 0.0f;
    for (int k = 0; k < n; ++k) {
        const float w = expf(z[order[k]] - zmax);
        if (min_p > 0.0f && !(w >= min_p)) continue;
        run += w;
        if (run > target) return ids[order[k]];
    }
    return last;
}

// Σ exp(z − zmax) over the finite z in ascending id order, as one sequential f32 sum (the
// reference's top-p normaliser). Tiles of w in shared memory, thread 0 accumulates.
__device__ float exact_total(const SelectParams& p, const SelectConfig& c, float zmax, float* w, int tile) {
    const float* logits = (const float*)p.logits;
    __shared__ float total_s;
    if (threadIdx.x == 0) total_s = 0.0f;
    for (int base = 0; base < p.V; base += tile) {
        const int n = min(tile, p.V - base);
        __syncthreads();
        for (int k = threadIdx.x; k < n; k += blockDim.x) {
            const float z = adjust(p, c, base + k, logits[base + k], true);
            w[k] = (z > NEG_INF && z < __int_as_float(0x7f800000)) ? expf(z - zmax) : -1.0f;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            float acc = total_s;
            for (int k = 0; k < n; ++k)
                if (w[k] >= 0.0f) acc += w[k];
            total_s = acc;
        }
    }
    __syncthreads();
    return total_s;
}

extern "C" __global__ void __launch_bounds__(SEL_THREADS) select_token(const SelectParams p) {
    extern __shared__ float sm[];
    // two arrays of `arr` floats: a block's values, then the merged candidates / draw tiles
    const int arr = max(max(p.chunk, (int)gridDim.x * SEL_MAX_CAND), max((int)gridDim.x * SEL_MAX_LOGPROBS, (int)blockDim.x + 1));
    float* raw = sm;       // [arr]
    float* zv = sm + arr;  // [arr]
    __shared__ Best scratch[32];
    __shared__ float red[32];
    const SelectConfig c = *(const SelectConfig*)p.config;
    const bool sampling = c.temperature > 0.0f;
    const int lo = blockIdx.x * p.chunk, n = max(0, min(p.V, lo + p.chunk) - lo);
    const float* logits = (const float*)p.logits;
    SelectPartial* part = (SelectPartial*)p.partials + blockIdx.x;

    // ---- per-block partials
    float rmax = NEG_INF;
    Best zb = {__int_as_float(0x7fc00000), 0x7fffffff}; // this thread's best z, in k order (as block_best)
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
    if (n <= SEL_PER_THREAD * (int)blockDim.x) {
        // Every logit of the thread requested at once: one loop iteration per load waited ~0.6 µs
        // for each in turn (the lm_head's logits come from L2), the ~15 of them most of this kernel.
        float lv[SEL_PER_THREAD];
#pragma unroll
        for (int j = 0; j < SEL_PER_THREAD; ++j) {
            const int k = threadIdx.x + j * blockDim.x;
            lv[j] = k < n ? __ldcg(logits + lo + k) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < SEL_PER_THREAD; ++j) {
            const int k = threadIdx.x + j * blockDim.x;
            if (k < n) take(k, lv[j]);
        }
    } else {
        for (int k = threadIdx.x; k < n; k += blockDim.x) take(k, logits[lo + k]);
    }
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
    int got = block_top(raw, nullptr, lo, n, nl, part->raw_ids, part->raw_vals, scratch);
    if (threadIdx.x == 0) part->n_raw = got;
    if (sampling) {
        const int kc = (c.top_k > 0 && c.top_k < SEL_MAX_CAND) ? c.top_k : SEL_MAX_CAND;
        got = block_top(zv, nullptr, lo, n, kc, part->cand_ids, part->cand_vals, scratch);
        if (threadIdx.x == 0) part->n_cand = got;
    }

    // ---- the last block merges
    if (!block_arrive_last((unsigned*)p.counter, gridDim.x)) return;
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
        for (int k = threadIdx.x; k < ncand; k += blockDim.x) {
            const int b = k / SEL_MAX_LOGPROBS, j = k - b * SEL_MAX_LOGPROBS;
            const bool ok = j < parts[b].n_raw;
            cv[k] = ok ? parts[b].raw_vals[j] : __int_as_float(0x7fc00000);
            ci[k] = ok ? parts[b].raw_ids[j] : 0x7fffffff;
        }
        __syncthreads();
        __shared__ int t_ids[SEL_MAX_LOGPROBS];
        __shared__ float t_vals[SEL_MAX_LOGPROBS];
        const int got2 = block_top(cv, ci, 0, ncand, nl, t_ids, t_vals, scratch);
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
    if (sampling && g_nfin > 0) {
        const float u = philox_uniform(c.seed_lo, c.seed_hi, c.step_lo, c.step_hi);
        // merged z candidates (best SEL_MAX_CAND, or top_k)
        const int want = (c.top_k > 0 && c.top_k < SEL_MAX_CAND) ? c.top_k : SEL_MAX_CAND;
        ncand = NB * SEL_MAX_CAND;
        for (int k = threadIdx.x; k < ncand; k += blockDim.x) {
            const int b = k / SEL_MAX_CAND, j = k - b * SEL_MAX_CAND;
            const bool ok = j < parts[b].n_cand;
            cv[k] = ok ? parts[b].cand_vals[j] : __int_as_float(0x7fc00000);
            ci[k] = ok ? parts[b].cand_ids[j] : 0x7fffffff;
        }
        __syncthreads();
        __shared__ int k_ids[SEL_MAX_CAND];
        __shared__ float k_vals[SEL_MAX_CAND];
        int nk = block_top(cv, ci, 0, ncand, want, k_ids, k_vals, scratch); // ranked (z ↓, id ↑)
        // Full-vocabulary top-p needs the reference's own (sequential) normaliser.
        const bool topk_mode_all = c.top_k > 0 && c.top_k < g_nfin && c.top_k <= SEL_MAX_CAND;
        if (!topk_mode_all && c.top_p < 1.0f) {
            const float t = exact_total(p, c, g_zmax, raw, arr);
            if (threadIdx.x == 0) g_ztotal = t;
            __syncthreads();
        }
        // drop non-finite candidates (kept = finite z)
        __shared__ int s_token, s_mode;
        __shared__ float s_vstar;
        __shared__ int s_tie_room;
        if (threadIdx.x == 0) {
            int m = 0;
            for (int k = 0; k < nk; ++k)
                if (k_vals[k] > NEG_INF && k_vals[k] < __int_as_float(0x7f800000)) { k_vals[m] = k_vals[k]; k_ids[m] = k_ids[k]; ++m; }
            nk = m;
            const bool topk_mode = c.top_k > 0 && c.top_k < g_nfin && c.top_k <= SEL_MAX_CAND;
            s_mode = 0;
            s_token = -1;
            if (topk_mode) {
                // kept = the top_k candidates: replicate the reference exactly on them.
                const float zmax = k_vals[0];
                float ids_keep_v[SEL_MAX_CAND];
                int ids_keep[SEL_MAX_CAND];
                int nkeep = nk;
                for (int k = 0; k < nk; ++k) { ids_keep[k] = k_ids[k]; ids_keep_v[k] = k_vals[k]; }
                if (c.top_p < 1.0f) {
                    // total in ascending id order
                    int order[SEL_MAX_CAND];
                    for (int k = 0; k < nk; ++k) order[k] = k;
                    for (int a = 1; a < nk; ++a) { int t = order[a], b = a - 1; while (b >= 0 && ids_keep[order[b]] > ids_keep[t]) { order[b + 1] = order[b]; --b; } order[b + 1] = t; }
                    float total = 0.0f;
                    for (int k = 0; k < nk; ++k) total += expf(ids_keep_v[order[k]] - zmax);
                    float cum = 0.0f;
                    int m2 = 0;
                    for (int k = 0; k < nk; ++k) { // ranked order
                        if (cum >= c.top_p) break;
                        cum += expf(ids_keep_v[k] - zmax) / total;
                        ++m2;
                    }
                    nkeep = m2;
                }
                s_token = draw_ranked(ids_keep, ids_keep_v, nkeep, zmax, c.min_p, u);
            } else {
                // full vocabulary: top-p threshold from the ranked candidates when the nucleus fits in them
                s_mode = 1;
                s_vstar = NEG_INF;
                s_tie_room = 0x7fffffff;
                if (c.top_p < 1.0f) {
                    float cum = 0.0f;
                    int m2 = 0;
                    for (; m2 < nk; ++m2) {
                        if (cum >= c.top_p) break;
                        cum += expf(k_vals[m2] - g_zmax) / g_ztotal;
                    }
                    if (m2 == 0) {
                        s_mode = 3; // top_p ≤ 0 keeps nothing: the reference falls back to argmax
                    } else if (cum >= c.top_p || m2 == g_nfin) {
                        // kept = the ranked prefix of length m2 (all within the candidates)
                        s_mode = 0;
                        s_token = draw_ranked(k_ids, k_vals, m2, g_zmax, c.min_p, u);
                    } else {
                        s_mode = 2; // nucleus larger than the candidates: bisection below
                    }
                }
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
            for (int i = threadIdx.x; i < p.V; i += blockDim.x) {
                const float z = adjust(p, c, i, logits[i], true);
                if (z >= thr && z < vmin) vmin = z;
            }
            vmin = -block_max(-vmin, red);
            float above = 0.0f;
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
                s_mode = 1;
            }
            __syncthreads();
        }
        if (s_mode == 1) {
            const int r = draw_exact(p, c, g_zmax, s_vstar, s_tie_room, u, raw, (u8*)zv, arr);
            if (threadIdx.x == 0) s_token = r;
            __syncthreads();
        }
        __syncthreads();
        if (s_token >= 0) { token = s_token; sampled = 1; }
    }
    if (threadIdx.x == 0) {
        res->token = token;
        // the greedy token's raw logit came with its partial; a drawn token's is read here
        const float raw_tok = token == g_arg && g_raw_at_arg == g_raw_at_arg ? g_raw_at_arg : sanitise(logits[token]);
        res->logprob = raw_tok - g_lse;
        res->sampled = sampled;
        SelectConfig* cfg = (SelectConfig*)p.config;
        const u64 step = (((u64)c.step_hi) << 32 | c.step_lo) + 1;
        cfg->step_lo = (u32)step;
        cfg->step_hi = (u32)(step >> 32);
        if (c.use_counts) ((u32*)p.counts)[token] += 1;
        if (c.use_seen) ((u8*)p.seen)[token] = 1;
        if (p.result_host) { // thread 0 wrote every field of res itself
            const int pos = ((const Cursor*)p.cursor)->pos; // before the advance below
            SelectResult* h = (SelectResult*)p.result_host + (pos & 1);
            const int n_top = res->n_top;
            for (int k = 0; k < n_top; ++k) {
                h->top_ids[k] = res->top_ids[k];
                h->top_logprobs[k] = res->top_logprobs[k];
            }
            h->n_top = n_top;
            h->sampled = sampled;
            h->logprob = res->logprob;
            h->token = token;
        }
        if (p.advance) {
            Cursor* cur = (Cursor*)p.cursor;
            cur->token = token;
            cur->pos += 1;
        }
        *(u32*)p.counter = 0u;
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
static_assert(sizeof(SelectConfig) == 64, "SelectConfig layout differs from its Rust twin");
static_assert(sizeof(SelectResult) == 176, "SelectResult layout differs from its Rust twin");
static_assert(sizeof(SelectParams) == 96, "SelectParams layout differs from its Rust twin");
static_assert(sizeof(PenaltyParams) == 48, "PenaltyParams layout differs from its Rust twin");
static_assert(sizeof(SelectPartial) == 708, "SelectPartial layout differs from its Rust twin");
