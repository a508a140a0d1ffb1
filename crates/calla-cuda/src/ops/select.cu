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

#define SEL_THREADS 256
#define SEL_MAX_CAND 64
#define SEL_PER_THREAD 16 // logits a thread loads at once (chunk ≤ 16·256: V ≤ 262,144 with 64 blocks)

struct SelectPartial {
    float raw_max, raw_sum, z_max, z_sum;
    int z_arg, n_raw, n_cand, n_finite;
    float raw_at_arg; // the raw logit of z_arg (the greedy token's log-probability without a reload)
    int raw_ids[SEL_MAX_LOGPROBS];
    float raw_vals[SEL_MAX_LOGPROBS];
    int cand_ids[SEL_MAX_CAND];
    float cand_vals[SEL_MAX_CAND];
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
    u64 grid;        // sub_log2 > 0: u64 barrier arrivals (monotonic), then SEL_GRID_ROWS rows of gridDim.x
                     // floats from byte 16 (the sampling phases' per-block values)
    int V, chunk, advance;
    int sub_log2;    // > 0: a sampled token is drawn by the whole grid, subtrees of 2^sub_log2 ids (256 ≤
                     // 2^sub_log2 ≤ 16·256, the subtrees ≤ gridDim.x; every block resident at once)
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

// z for one id: penalties and bias (steps 1–3), then /T when sampling.
// adjust() with id i's table entries given (read only where the configuration uses them).
__device__ __forceinline__ float adjust_with(const SelectConfig& c, float raw, float bias, bool seen, u32 count,
                                             bool sampling) {
    float z = sanitise(raw);
    if (c.use_bias) z += bias;
    if (c.use_seen && seen) z = z > 0.0f ? z / c.rep_penalty : z * c.rep_penalty;
    if (c.use_counts && count) z -= c.presence + c.frequency * (float)count;
    return sampling ? z / c.temperature : z;
}
__device__ __forceinline__ float adjust(const SelectParams& p, const SelectConfig& c, int i, float raw, bool sampling) {
    return adjust_with(c, raw, c.use_bias ? ((const float*)p.bias)[i] : 0.0f, c.use_seen && ((const u8*)p.seen)[i],
                       c.use_counts ? ((const u32*)p.counts)[i] : 0u, sampling);
}

// (value ↓, id ↑), NaN = already taken (never better).
__device__ __forceinline__ bool better(float v1, int i1, float v2, int i2) {
    if (v1 != v1) return false;
    if (v2 != v2) return true;
    return v1 > v2 || (v1 == v2 && i1 < i2);
}

struct Best { float v; int i; };

// ---------------------------------------------------------------- the best W by radix select
// A key per (value, id) that orders as (value ↓, id ↑) and is distinct for distinct ids: the value's
// order-preserving bits above, the id's complement below.
__device__ __forceinline__ u64 rank_key(float v, int id) {
    const u32 b = __float_as_uint(v);
    const u32 o = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)o << 32) | (u64)(0xFFFFFFFFu - (u32)id);
}

// One radix-select pass's decision, shared by block_top_radix and grid_top_candidates: the 256 bins
// `hist` count the keys that match st.prefix under st.mask by their digit at `shift`; warp 0 takes
// the digit d with above(d) < st.need ≤ above(d) + hist[d] (above: the keys in higher digits) into
// the prefix, and st.done when that bucket is taken whole. Every thread calls; ends with a barrier.
struct RadixState {
    u64 prefix, mask;
    int need, done;
};
__device__ __forceinline__ void radix_choose_digit(const int* hist, int shift, RadixState& st) {
    const int lane = threadIdx.x & 31;
    if (threadIdx.x < 32) { // lane l holds digits 8l..8l+7
        int h[8], sum = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) { h[j] = hist[8 * lane + j]; sum += h[j]; }
        int incl = sum; // Σ over lanes ≥ this one
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_down_sync(0xffffffffu, incl, o);
            if (lane + o < 32) incl += v;
        }
        int above = incl - sum;
        const int need = st.need;
        const u64 prefix = st.prefix, mask = st.mask;
        __syncwarp(); // every lane has read st before the one that chooses writes it
#pragma unroll
        for (int j = 7; j >= 0; --j) {
            if (above < need && need <= above + h[j]) {
                st.prefix = prefix | ((u64)(8 * lane + j) << shift);
                st.mask = mask | (255ull << shift);
                st.need = need - above;
                st.done = h[j] == need - above;
            }
            above += h[j];
        }
    }
    __syncthreads();
}

// The best W (≤ SEL_MAX_CAND) of vals[k] for k < count (id ids[k], or id_base + k; NaN never) by
// (value ↓, id ↑), ranked into out_ids / out_vals; returns how many (W, or fewer non-NaN). Every
// thread of the block calls. A radix select on rank_key, 8 bits per pass from the top, ends at the
// first pass whose chosen bucket is taken whole (distinct keys: ≤ 8 passes, ~3 for real values);
// the chosen are those whose key, masked to the digits decided, is ≥ the decided prefix, and a rank
// count orders them. The same set and order as W rounds of a block-wide best, which this replaced
// (a block reduction per round: ~0.3 ms per token for the blocks' lists and their merge, session 14).
__device__ __noinline__ int block_top_radix(const float* vals, const int* ids, int id_base, int count, int W, int* out_ids,
                                           float* out_vals) {
    __shared__ int hist[256];
    __shared__ RadixState st;
    __shared__ int s_n;
    __shared__ u64 c_key[SEL_MAX_CAND];
    __shared__ float c_val[SEL_MAX_CAND];
    __shared__ int c_id[SEL_MAX_CAND];
    const int tid = threadIdx.x;
    W = min(W, SEL_MAX_CAND);
    if (W <= 0 || count <= 0) return 0; // uniform
    __syncthreads(); // the shared state below may still be read from a previous call
    if (tid == 0) s_n = 0;
    __syncthreads();
    int nv = 0;
    for (int k = tid; k < count; k += blockDim.x) nv += vals[k] == vals[k] ? 1 : 0;
    if (nv) atomicAdd(&s_n, nv);
    __syncthreads();
    if (tid == 0) st = RadixState{0ull, 0ull, min(W, s_n), s_n <= W};
    __syncthreads();
    for (int shift = 56; shift >= 0 && !st.done; shift -= 8) {
        for (int i = tid; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        const u64 prefix = st.prefix, mask = st.mask;
        for (int k = tid; k < count; k += blockDim.x) {
            const float v = vals[k];
            if (v != v) continue;
            const u64 key = rank_key(v, ids ? ids[k] : id_base + k);
            if ((key & mask) == prefix) atomicAdd(&hist[(int)(key >> shift) & 255], 1);
        }
        __syncthreads();
        radix_choose_digit(hist, shift, st);
    }
    const u64 prefix = st.prefix, mask = st.mask;
    __syncthreads();
    if (tid == 0) s_n = 0;
    __syncthreads();
    for (int k = tid; k < count; k += blockDim.x) {
        const float v = vals[k];
        if (v != v) continue;
        const int id = ids ? ids[k] : id_base + k;
        const u64 key = rank_key(v, id);
        if ((key & mask) >= prefix) {
            const int slot = atomicAdd(&s_n, 1);
            if (slot < SEL_MAX_CAND) { c_key[slot] = key; c_val[slot] = v; c_id[slot] = id; }
        }
    }
    __syncthreads();
    const int m = min(s_n, W);
    for (int j = tid; j < m; j += blockDim.x) {
        int rank = 0;
        for (int i = 0; i < m; ++i) rank += c_key[i] > c_key[j] ? 1 : 0;
        out_ids[rank] = c_id[j];
        out_vals[rank] = c_val[j];
    }
    __syncthreads();
    return m;
}

// ---------------------------------------------------------------- sampling: the weight tree
// calla_engine::sampling::weight_tree and tree_draw, on the block: leaf i = w_i = exp(z_i − zmax) for
// the kept ids, 0 for the others and past V, padded to a power of two N; each node = left + right
// (f32). Kept: finite z > vstar; of the ids with z == vstar the first tie_room in id order; with
// min_p, w ≥ min_p (ties are ranked before min-p, as in the reference: a tie group shares one z).
// Groups of GS = 32·G consecutive ids: lane l of a warp holds ids [l·G, l·G + G) of its group and sums
// them pairwise, and the xor shuffles add the lanes pairwise (f32 addition commutes, so every lane
// gets the same value), so a group's sum is its subtree's node. Shared memory (`words` floats, the
// candidates' arrays, free by then): heap [2·NG] (heap[NG + g] = group g's sum, heap[k] = heap[2k] +
// heap[2k + 1], heap[1] the root), ties [NG] (ids at vstar before group g), mini [2·GS] (one group's
// subtree for the descent). Before (session 13 and earlier) the sums were sequential in id order, one
// thread over the whole vocabulary: ~28 ms per sampled token at V = 248K (docs/performance.md,
// session 14).
#define TREE_MAX_G 8
#define TREE_BATCH 4 // groups whose logits a warp requests at once (the loads are L2 round trips)
struct TreeShape { int G, GS, NG; };
__device__ __forceinline__ TreeShape tree_shape(int V, int words) {
    int N = 1;
    while (N < V) N <<= 1;
    TreeShape t;
    for (t.G = 1;; t.G <<= 1) {
        t.GS = 32 * t.G;
        t.NG = max(1, N / t.GS);
        if ((3 * t.NG + 2 * t.GS <= words && t.G <= TREE_MAX_G) || t.NG == 1) break;
    }
    return t;
}

// kept = the first n of the ranked candidates (z ↓, id ↑) in the (vstar, tie_room) form.
__device__ __forceinline__ void ranked_prefix(const float* vals, int n, float& vstar, int& tie_room) {
    vstar = vals[n - 1];
    int above = 0;
    for (int k = 0; k < n; ++k) above += vals[k] > vstar ? 1 : 0;
    tie_room = n - above;
}

// This lane's G leaves of group g (every lane of the warp calls: the tie ranks are a warp scan);
// ties_before: ids at vstar in the groups before g (0 without ties).
__device__ __forceinline__ void tree_leaves(const SelectParams& p, const SelectConfig& c, float zmax, float vstar,
                                            int tie_room, bool min_p, int g, const TreeShape& t, int ties_before,
                                            const float (&raw)[TREE_MAX_G], float (&w)[TREE_MAX_G]) {
    const int lane = threadIdx.x & 31, first = g * t.GS + lane * t.G;
    bool tie[TREE_MAX_G];
    int my_ties = 0;
#pragma unroll
    for (int j = 0; j < TREE_MAX_G; ++j) {
        w[j] = 0.0f;
        tie[j] = false;
        const int id = first + j;
        if (j < t.G && id < p.V) {
            const float z = adjust(p, c, id, raw[j], true);
            if (z > NEG_INF && z < __int_as_float(0x7f800000) && z >= vstar) {
                w[j] = expf(z - zmax);
                tie[j] = z == vstar;
                my_ties += tie[j] ? 1 : 0;
            }
        }
    }
    // this lane's first tie's rank among the ids at vstar (id order)
    int rank = my_ties;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, rank, o);
        if (lane >= o) rank += v;
    }
    rank = ties_before + rank - my_ties;
#pragma unroll
    for (int j = 0; j < TREE_MAX_G; ++j) {
        if (tie[j]) w[j] = rank++ < tie_room ? w[j] : 0.0f;
        if (min_p && w[j] > 0.0f && !(w[j] >= c.min_p)) w[j] = 0.0f;
    }
}

// This lane's logits of group g (its ids g·GS + lane·G + j, j < G; past V: 0, never used).
__device__ __forceinline__ void tree_raw(const SelectParams& p, int g, const TreeShape& t, float (&raw)[TREE_MAX_G]) {
    const float* logits = (const float*)p.logits;
    const int first = g * t.GS + (threadIdx.x & 31) * t.G;
#pragma unroll
    for (int j = 0; j < TREE_MAX_G; ++j) raw[j] = j < t.G && first + j < p.V && g < t.NG ? __ldcg(logits + first + j) : 0.0f;
}

// f(g, raw) for this warp's groups g = warp, warp + nw, … < NG with their logits raw (tree_raw),
// TREE_BATCH groups' logits requested at once (the loads are L2 round trips). Every lane calls.
template <typename F>
__device__ __forceinline__ void tree_for_each_group(const SelectParams& p, const TreeShape& t, const F& f) {
    const int warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int g0 = warp; g0 < t.NG; g0 += nw * TREE_BATCH) {
        float raw[TREE_BATCH][TREE_MAX_G];
#pragma unroll
        for (int b = 0; b < TREE_BATCH; ++b) tree_raw(p, g0 + b * nw, t, raw[b]);
#pragma unroll
        for (int b = 0; b < TREE_BATCH; ++b) {
            const int g = g0 + b * nw;
            if (g >= t.NG) break; // warp-uniform
            f(g, raw[b]);
        }
    }
}

// The lane's leaves summed pairwise, then the lanes' sums pairwise: group g's node.
__device__ __forceinline__ float tree_group_sum(float (&w)[TREE_MAX_G], int G) {
#pragma unroll
    for (int s = 1; s < TREE_MAX_G; s <<= 1)
#pragma unroll
        for (int j = 0; j + s < TREE_MAX_G; j += 2 * s)
            if (s < G) w[j] += w[j + s];
    float sum = w[0];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    return sum;
}

// The whole tree into heap (and the ties' group prefix into ties); returns the root (the total).
// Every thread of the block calls.
__device__ __noinline__ float tree_build(const SelectParams& p, const SelectConfig& c, float zmax, float vstar, int tie_room,
                            bool min_p, float* smem, const TreeShape& t) {
    float* heap = smem;
    int* ties = (int*)(smem + 2 * t.NG);
    const int lane = threadIdx.x & 31;
    const bool any_ties = vstar > NEG_INF && tie_room < 0x7fffffff;
    if (any_ties) { // ids at vstar per group, then the exclusive prefix over the groups
        tree_for_each_group(p, t, [&](int g, const float (&raw)[TREE_MAX_G]) {
            int n = 0;
#pragma unroll
            for (int j = 0; j < TREE_MAX_G; ++j) {
                const int id = g * t.GS + lane * t.G + j;
                if (j < t.G && id < p.V && adjust(p, c, id, raw[j], true) == vstar) ++n;
            }
            n = __reduce_add_sync(0xffffffffu, n);
            if (lane == 0) ties[g] = n;
        });
        __syncthreads();
        if (threadIdx.x == 0) {
            int run = 0;
            for (int g = 0; g < t.NG; ++g) { const int n = ties[g]; ties[g] = run; run += n; }
        }
        __syncthreads();
    }
    tree_for_each_group(p, t, [&](int g, const float (&raw)[TREE_MAX_G]) {
        float w[TREE_MAX_G];
        tree_leaves(p, c, zmax, vstar, tie_room, min_p, g, t, any_ties ? ties[g] : 0, raw, w);
        const float sum = tree_group_sum(w, t.G);
        if (lane == 0) heap[t.NG + g] = sum;
    });
    __syncthreads();
    for (int half = t.NG / 2; half >= 1; half >>= 1) {
        for (int k = half + threadIdx.x; k < 2 * half; k += blockDim.x) heap[k] = heap[2 * k] + heap[2 * k + 1];
        __syncthreads();
    }
    const float root = heap[1];
    __syncthreads();
    return root;
}

// tree_draw on the tree tree_build left (same arguments): thread 0 descends the groups' heap, warp 0
// recomputes the chosen group's leaves into `mini`, thread 0 sums its subtree and descends it.
// Returns the id (every thread).
__device__ __noinline__ int tree_descend(const SelectParams& p, const SelectConfig& c, float zmax, float vstar, int tie_room,
                            bool min_p, float target, float* smem, const TreeShape& t) {
    const float* heap = smem;
    const int* ties = (const int*)(smem + 2 * t.NG);
    float* mini = smem + 3 * t.NG; // [2·GS]
    __shared__ int s_group, s_id;
    __shared__ float s_target;
    if (threadIdx.x == 0) {
        int node = 1;
        float tg = target;
        while (node < t.NG) {
            const float left = heap[2 * node], right = heap[2 * node + 1];
            if (tg < left || right == 0.0f) node = 2 * node;
            else { tg -= left; node = 2 * node + 1; }
        }
        s_group = node - t.NG;
        s_target = tg;
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        const bool any_ties = vstar > NEG_INF && tie_room < 0x7fffffff;
        float raw[TREE_MAX_G], w[TREE_MAX_G];
        tree_raw(p, s_group, t, raw);
        tree_leaves(p, c, zmax, vstar, tie_room, min_p, s_group, t, any_ties ? ties[s_group] : 0, raw, w);
#pragma unroll
        for (int j = 0; j < TREE_MAX_G; ++j)
            if (j < t.G) mini[t.GS + threadIdx.x * t.G + j] = w[j];
        __syncwarp();
        if (threadIdx.x == 0) {
            for (int k = t.GS - 1; k >= 1; --k) mini[k] = mini[2 * k] + mini[2 * k + 1];
            int node = 1;
            float tg = s_target;
            while (node < t.GS) {
                const float left = mini[2 * node], right = mini[2 * node + 1];
                if (tg < left || right == 0.0f) node = 2 * node;
                else { tg -= left; node = 2 * node + 1; }
            }
            s_id = s_group * t.GS + node - t.GS;
        }
    }
    __syncthreads();
    return s_id;
}

// The same tree over a kept set of at most SEL_MAX_CAND ids given in rank order (z ↓, id ↑): the
// top-k, or a nucleus inside the candidates. Adding an exact zero changes nothing, so a node with one
// kept subtree has that subtree's value and the sparse tree's sums are the dense tree's. Thread 0:
// the kept (id, w) sorted by id, then each level's nodes bottom-up, (node, sum) pairs in `ws`
// (levels·n pairs: the caller checks it fits). Returns the root; `draw` ≥ 0: the id tree_draw lands
// on for target u·root in *drawn.
#define SPARSE_MAX_LEVELS 24
__device__ __noinline__ float sparse_tree(const int* ids, const float* z, int n, float zmax, float min_p, int V, float* ws,
                             float u, int* drawn) {
    int levels = 0;
    while ((1 << levels) < V) ++levels;
    int* node = (int*)ws;
    float* sum = ws + (levels + 1) * SEL_MAX_CAND;
    // level 0: the kept ids ascending, with their weights (min-p drops, as a zero leaf would)
    int m = 0;
    for (int k = 0; k < n; ++k) {
        const float w = expf(z[k] - zmax);
        if (min_p > 0.0f && !(w >= min_p)) continue;
        int at = m++;
        while (at > 0 && node[at - 1] > ids[k]) { node[at] = node[at - 1]; sum[at] = sum[at - 1]; --at; }
        node[at] = ids[k];
        sum[at] = w;
    }
    if (m == 0) { *drawn = -1; return 0.0f; }
    int off[SPARSE_MAX_LEVELS + 1], cnt[SPARSE_MAX_LEVELS + 1];
    off[0] = 0;
    cnt[0] = m;
    for (int l = 0; l < levels; ++l) { // parents of level l's nodes
        const int o = off[l], c = cnt[l], po = o + SEL_MAX_CAND;
        int pc = 0;
        for (int k = 0; k < c; ++k) {
            const int parent = node[o + k] >> 1;
            if (pc > 0 && node[po + pc - 1] == parent) sum[po + pc - 1] = sum[po + pc - 1] + sum[o + k]; // left + right
            else { node[po + pc] = parent; sum[po + pc] = sum[o + k]; ++pc; }
        }
        off[l + 1] = po;
        cnt[l + 1] = pc;
    }
    const float root = sum[off[levels]];
    float t = u * root;
    int nd = 0;
    for (int l = levels; l > 0; --l) { // children of nd at level l − 1
        float left = 0.0f, right = 0.0f;
        for (int k = 0; k < cnt[l - 1]; ++k) {
            const int ch = node[off[l - 1] + k];
            if (ch == 2 * nd) left = sum[off[l - 1] + k];
            else if (ch == 2 * nd + 1) right = sum[off[l - 1] + k];
        }
        if (t < left || right == 0.0f) nd = 2 * nd;
        else { t -= left; nd = 2 * nd + 1; }
    }
    *drawn = nd;
    return root;
}

// Every partial's ranked list (top logprobs, or with CAND the z candidates) into shared vals / ids,
// entry b·W + j (absent entries NaN, id 0x7fffffff; ids may be null); every thread calls. The counts first, then all
// of a thread's entries requested at once: one L2 round trip each, where a loop of volatile reads
// made one per entry. ld.cg: the partials come from other blocks.
template <bool CAND>
__device__ __noinline__ void gather_lists(const SelectParams& p, float* vals, int* ids) {
    constexpr int W = CAND ? SEL_MAX_CAND : SEL_MAX_LOGPROBS;
    constexpr int PER = 64 * SEL_MAX_CAND / SEL_THREADS; // entries per thread: gridDim.x ≤ 64 (select.rs MAX_BLOCKS)
    __shared__ int counts[64];
    const SelectPartial* parts = (const SelectPartial*)p.partials;
    const int NB = gridDim.x, total = NB * W;
    for (int b = threadIdx.x; b < NB; b += blockDim.x) counts[b] = __ldcg(CAND ? &parts[b].n_cand : &parts[b].n_raw);
    float v[PER];
    int id[PER];
#pragma unroll
    for (int r = 0; r < PER; ++r) {
        const int k = threadIdx.x + r * SEL_THREADS, b = k / W, j = k - b * W;
        if (k < total) {
            v[r] = __ldcg(CAND ? &parts[b].cand_vals[j] : &parts[b].raw_vals[j]);
            id[r] = ids ? __ldcg(CAND ? &parts[b].cand_ids[j] : &parts[b].raw_ids[j]) : 0;
        }
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < PER; ++r) {
        const int k = threadIdx.x + r * SEL_THREADS, b = k / W, j = k - b * W;
        if (k < total) {
            const bool ok = j < counts[b];
            vals[k] = ok ? v[r] : __int_as_float(0x7fc00000);
            if (ids) ids[k] = ok ? id[r] : 0x7fffffff;
        }
    }
    __syncthreads();
}

// ---------------------------------------------------------------- sampling on the whole grid
// With SelectParams.sub_log2 > 0 a sampled token is drawn by every block of the launch, not by the
// last one alone (which took ~0.35 ms over the 248K ids at temperature 1, ~10 ms for a nucleus beyond
// the candidates: docs/performance.md, session 15). The weight tree's N leaves are NSUB = N / S
// subtrees of S = 2^sub_log2 ids; block b < NSUB owns subtree b, its thread t the SUB_L = S / 256
// consecutive ids from b·S + t·SUB_L (so a subtree's pairwise sums are: in the thread, across lanes
// by xor shuffles, across the 8 warps in shared memory: the reference's nodes exactly). The phases,
// separated by grid barriers (every block of the launch is resident: the launcher checks):
//   1. every block has written its partial (as without); each reads every partial's z max;
//   2. top-k / top-p: the best 64 (or k) by a radix select over the whole grid, one barrier per pass
//      (the same ranked list in every block);
//   3. top-p: each subtree's root over the kept set → the total (the top of the tree, in every block),
//      the walk over the ranked candidates; beyond them the nucleus's bound by a 16-way search, one barrier
//      per step (each block sums its subtree, the sums added in block order);
//   4. each subtree's root over the final kept set; the last block to arrive (the ticket of the
//      selection) descends the top of the tree to a subtree, recomputes that subtree's leaves and
//      descends it.
// Every block takes every decision from the same values, so all take the same path and barriers.
#define SEL_SUB_L_MAX 16 // leaves per thread: S ≤ 16·256
#define SEL_GRID_ROW_TOTAL 0
#define SEL_GRID_ROW_SEARCH 1 // 2 × SEL_SEARCH_POINTS rows (double-buffered: a block writes step i + 2's
                              // after every block has passed step i + 1's barrier, so has read step i's)
#define SEL_SEARCH_POINTS 15
#define SEL_GRID_ROW_VMIN 41
#define SEL_GRID_ROW_ABOVE 42
#define SEL_GRID_ROW_TIES 43
#define SEL_GRID_ROW_FINAL 44
#define SEL_GRID_ROWS 45 // rows of gridDim.x floats after the barrier's counter (select.rs GRID_ROWS)

__device__ __forceinline__ float* sel_grid_row(const SelectParams& p, int row) {
    return (float*)(p.grid + 16) + (i64)row * gridDim.x;
}
// After the rows (from a 16-byte boundary): two histogram buffers of [256 bins][64 blocks] ints (the
// candidates' radix passes, alternating; a bin's 64 counts one run of 16-byte loads), then the chosen
// candidates' count (u32, reset by the last block) and their keys (u64 [SEL_MAX_CAND]). select.rs
// `grid_bytes` sizes the whole.
__device__ __forceinline__ int* sel_grid_hist(const SelectParams& p, int buf) {
    return (int*)(p.grid + ((16 + (u64)SEL_GRID_ROWS * gridDim.x * 4 + 15) & ~15ull)) + (i64)buf * 256 * 64;
}
__device__ __forceinline__ u32* sel_grid_list_count(const SelectParams& p) { return (u32*)sel_grid_hist(p, 2); }
__device__ __forceinline__ u64* sel_grid_list(const SelectParams& p) { return (u64*)(sel_grid_list_count(p) + 4); }
// Every block of the launch: the writes before it are visible to every block after it (read them
// with ld.cg: L1 is not coherent). The counter is monotonic: exactly gridDim.x arrivals per barrier.
__device__ __forceinline__ void sel_grid_sync(const SelectParams& p) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        u64 old;
        asm volatile("atom.add.acq_rel.gpu.u64 %0, [%1], 1;" : "=l"(old) : "l"(p.grid) : "memory");
        wait_until_at_least(p.grid, (old / gridDim.x + 1) * gridDim.x);
    }
    __syncthreads();
}

// Which ids are kept, as tree_leaves decides: finite z ≥ vstar, where of the ids at vstar
//   tie_mode 0: all; 1: those listed (the ranked prefix's ids at vstar); 2: the first tie_room in id
//   order (ties_before of them in the subtrees before this one);
// then with min_p > 0 only w = exp(z − zmax) ≥ min_p.
struct KeepRule {
    float zmax, vstar, min_p;
    int tie_mode, tie_room, ties_before;
    const int* listed; // tie_mode 1: n_listed ids (shared memory)
    int n_listed;
};

// Block-wide exclusive prefix of v in thread order; `tot` gets the block's total.
__device__ __forceinline__ int block_exclusive_scan(int v, int& tot) {
    __shared__ int warp_tot[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int u = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += u;
    }
    __syncthreads();
    if (lane == 31) warp_tot[warp] = incl;
    __syncthreads();
    int before = 0;
    tot = 0;
    for (int w = 0; w < nw; ++w) {
        before += w < warp ? warp_tot[w] : 0;
        tot += warp_tot[w];
    }
    return before + incl - v;
}

__device__ __noinline__ bool keep_listed(const KeepRule& r, int id) {
    for (int k = 0; k < r.n_listed; ++k)
        if (r.listed[k] == id) return true;
    return false;
}

// The subtree's root under rule r from the block's z values in zs (id order: thread t takes ids
// first + j = b·S + t·L + j, j < L); every thread calls (tie ranks) and gets the root. With leaves_out,
// the leaves too (leaves_out[t·L + j]). Looped, not unrolled: the kernel runs once per launch and is
// a third of its unrolled size so (no time measured either way).
// The sums are the reference's nodes: the thread's leaves pairwise, the lanes by xor shuffles (f32
// addition commutes: both lanes of a pair hold left + right), the 8 warps' nodes pairwise.
__device__ __noinline__ float sub_tree_root(const float* zs, int first, int L, const KeepRule& r, float* leaves_out) {
    __shared__ float warp_node[SEL_THREADS / 32];
    float w[SEL_SUB_L_MAX];
    unsigned tie = 0u;      // bit j: id first + j is at vstar
#pragma unroll 1
    for (int j = 0; j < L; ++j) {
        const float z = zs[threadIdx.x * L + j];
        float v = 0.0f;
        if (z > NEG_INF && z < __int_as_float(0x7f800000) && z >= r.vstar) {
            v = expf(z - r.zmax);
            if (z == r.vstar) tie |= 1u << j;
        }
        w[j] = v;
    }
    if (r.tie_mode == 2) { // the first tie_room ids at vstar in id order
        int tot;
        int rank = r.ties_before + block_exclusive_scan(__popc(tie), tot);
        for (unsigned t = tie; t; t &= t - 1u) {
            const int j = __ffs(t) - 1;
            if (rank++ >= r.tie_room) w[j] = 0.0f;
        }
    } else if (r.tie_mode == 1) { // those in the ranked prefix
        for (unsigned t = tie; t; t &= t - 1u) {
            const int j = __ffs(t) - 1;
            if (!keep_listed(r, first + j)) w[j] = 0.0f;
        }
    }
#pragma unroll 1
    for (int j = 0; j < L; ++j) {
        if (r.min_p > 0.0f && w[j] > 0.0f && !(w[j] >= r.min_p)) w[j] = 0.0f;
        if (leaves_out) leaves_out[threadIdx.x * L + j] = w[j];
    }
#pragma unroll 1
    for (int s = 1; s < L; s <<= 1)
#pragma unroll 1
        for (int j = 0; j + s < L; j += 2 * s) w[j] += w[j + s];
    float v = w[0];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) warp_node[threadIdx.x >> 5] = v;
    __syncthreads();
    return ((warp_node[0] + warp_node[1]) + (warp_node[2] + warp_node[3])) +
           ((warp_node[4] + warp_node[5]) + (warp_node[6] + warp_node[7]));
}

// The top of the tree over the NSUB subtree roots in row `row`, into heap[1 .. 2·NSUB) (heap[NSUB + b]
// = root b; shared memory); returns the total (every thread).
__device__ __forceinline__ float grid_top(const SelectParams& p, int row, int nsub, float* heap) {
    const float* roots = sel_grid_row(p, row);
    for (int b = threadIdx.x; b < nsub; b += blockDim.x) heap[nsub + b] = b < (int)gridDim.x ? __ldcg(roots + b) : 0.0f;
    __syncthreads();
    for (int half = nsub / 2; half >= 1; half >>= 1) {
        for (int k = half + threadIdx.x; k < 2 * half; k += blockDim.x) heap[k] = heap[2 * k] + heap[2 * k + 1];
        __syncthreads();
    }
    const float total = heap[1];
    __syncthreads();
    return total;
}

// Σ over the blocks b < n of row[b] in a fixed order (warp 0: lane-strided, then xor shuffles);
// every thread gets it.
__device__ __forceinline__ float grid_row_sum(const SelectParams& p, int row, int n) {
    __shared__ float s_sum;
    if (threadIdx.x < 32) {
        const float* r = sel_grid_row(p, row);
        float v = 0.0f;
        for (int b = threadIdx.x; b < n; b += 32) v += __ldcg(r + b);
        v = warp_sum(v);
        if (threadIdx.x == 0) s_sum = v;
    }
    __syncthreads();
    const float s = s_sum;
    __syncthreads();
    return s;
}

// The best W (≤ SEL_MAX_CAND) finite z of the whole vocabulary by (z ↓, id ↑), ranked into out_ids /
// out_vals (every block gets the same list); returns how many (W, or the nfin finite ones if fewer).
// Every block calls with its subtree's z values (zs, id order from first_id). block_top_radix over
// the grid: each 8-bit pass histograms every block's keys, the histograms meet in global memory and
// every block adds them (bin t by thread t, in block order) after a barrier; then each block appends
// its chosen keys to one list, and after a barrier every block rank-sorts it. It replaced each block's
// own top 64 and every block's merge of the 61 lists (~35 µs at top-k 40: docs/performance.md,
// session 15).
__device__ __noinline__ int grid_top_candidates(const SelectParams& p, const float* zs, int L, int first_id, int nfin,
                                                int W, int* out_ids, float* out_vals) {
    __shared__ int hist[256];
    __shared__ RadixState st;
    __shared__ u64 c_key[SEL_MAX_CAND];
    const int tid = threadIdx.x, NB = gridDim.x;
    W = min(W, SEL_MAX_CAND);
    if (W <= 0 || nfin <= 0) return 0; // uniform over the grid
    if (tid == 0) st = RadixState{0ull, 0ull, min(W, nfin), nfin <= W};
    __syncthreads();
    auto finite = [](float z) { return z > NEG_INF && z < __int_as_float(0x7f800000); };
    for (int shift = 56, pass = 0; shift >= 0 && !st.done; shift -= 8, ++pass) {
        const u64 prefix = st.prefix, mask = st.mask;
        hist[tid] = 0; // blockDim.x == 256 bins
        __syncthreads();
#pragma unroll 1
        for (int j = 0; j < L; ++j) {
            const float z = zs[tid * L + j];
            if (!finite(z)) continue;
            const u64 key = rank_key(z, first_id + tid * L + j);
            if ((key & mask) == prefix) atomicAdd(&hist[(int)(key >> shift) & 255], 1);
        }
        __syncthreads();
        int* rows = sel_grid_hist(p, pass & 1); // [bin][64 blocks]; alternating: see SEL_GRID_ROW_SEARCH
        rows[tid * 64 + blockIdx.x] = hist[tid];
        sel_grid_sync(p);
        int4 q[16]; // bin tid of every block, requested at once (one L2 round trip)
#pragma unroll
        for (int i = 0; i < 16; ++i) q[i] = __ldcg((const int4*)(rows + tid * 64) + i);
        int h = 0;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            h += 4 * i + 0 < NB ? q[i].x : 0;
            h += 4 * i + 1 < NB ? q[i].y : 0;
            h += 4 * i + 2 < NB ? q[i].z : 0;
            h += 4 * i + 3 < NB ? q[i].w : 0;
        }
        hist[tid] = h;
        __syncthreads();
        radix_choose_digit(hist, shift, st);
    }
    const u64 prefix = st.prefix, mask = st.mask;
    u32* count = sel_grid_list_count(p);
    u64* list = sel_grid_list(p);
#pragma unroll 1
    for (int j = 0; j < L; ++j) {
        const float z = zs[tid * L + j];
        if (!finite(z)) continue;
        const u64 key = rank_key(z, first_id + tid * L + j);
        if ((key & mask) >= prefix) {
            const u32 slot = atomicAdd(count, 1u);
            if (slot < SEL_MAX_CAND) list[slot] = key;
        }
    }
    sel_grid_sync(p);
    const int m = min((int)__ldcg(count), min(W, nfin));
    if (tid < m) c_key[tid] = __ldcg(list + tid);
    __syncthreads();
    if (tid < m) {
        const u64 key = c_key[tid];
        int rank = 0;
        for (int i = 0; i < m; ++i) rank += c_key[i] > key ? 1 : 0;
        const u32 o = (u32)(key >> 32);
        out_vals[rank] = __uint_as_float((o & 0x80000000u) ? (o & 0x7FFFFFFFu) : ~o);
        out_ids[rank] = (int)(0xFFFFFFFFu - (u32)key);
    }
    __syncthreads();
    return m;
}

// The ids at the nucleus's bound in the subtrees before sb (row SEL_GRID_ROW_TIES: counts, exact in
// f32 below 2²⁴).
__device__ __forceinline__ int sel_ties_before(const SelectParams& p, int sb) {
    return (int)grid_row_sum(p, SEL_GRID_ROW_TIES, sb);
}

// Thread 0, once the token is chosen: publish_token (common.cuh), then the ticket reset for the next
// launch.
__device__ __forceinline__ void publish_choice(const SelectParams& p, const SelectConfig& c, int token, float logprob,
                                               int sampled, int pos) {
    const TokenOut out = {p.config, p.result, p.result_host, p.cursor, p.counts, p.seen, p.advance};
    publish_token(out, c, token, logprob, sampled, pos);
    *(u32*)p.counter = 0u;
    if (p.sub_log2 > 0) *sel_grid_list_count(p) = 0u; // every block has read the candidates' list
}

// ---------------------------------------------------------------- plain greedy
// T = 0 with no logit bias, no penalties and no top logprobs (z = raw, nothing ranked): the argmax and
// the log-sum-exp of the raw logits, in registers. Each thread keeps (max, Σ exp(raw − max)) and its
// best (value ↓, id ↑); warps and then warp 0 merge them into the block's partial; warp 0 of the
// ticket's last block merges the partials (each lane two, loaded together: ≤ 64 blocks) and
// publishes. The general path computes the same through its shared-memory arrays, a second pass for
// the sum, block barriers for the lists it would rank, and a 256-thread last block reading the
// partials field by field: 15.0 µs from the first warp's entry to the result at V = 248,320 (clock
// stamps), 11.6 µs per launch in the no-graph profile, against 6.7 for this path (docs/performance.md,
// session 19). The token is the general path's (the same total order); the log-probability's sum is
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
// Labs pricing the launch itself in the decode graph (docs/performance.md, session 20):
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
