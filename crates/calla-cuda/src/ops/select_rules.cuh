// select_rules.cuh: the selection launch's parameters, the counter-based RNG (Philox) and the
// radix select of the best W; select.cu's header comment has the rules and the launch.

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
// (a block reduction per round: ~0.3 ms per token for the blocks' lists and their merge).
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

