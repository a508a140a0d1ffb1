// select_sampling.cuh: sampling — the weight tree over the id space, its descent, and the draw on
// the whole grid; select.cu's header comment has the rules.

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
// thread over the whole vocabulary: ~28 ms per sampled token at V = 248K (docs/experiments.md).
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
// the candidates: docs/experiments.md). The weight tree's N leaves are NSUB = N / S
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
// own top 64 and every block's merge of the 61 lists (~35 µs at top-k 40: docs/experiments.md).
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

