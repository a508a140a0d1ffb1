// selection.cuh: the token selection's result contract (SelectConfig, SelectResult, GreedyAcc,
// publish_token), shared by select.cu and lm_head's greedy kernel in matvec_tc.cu.

// ---------------------------------------------------------------- the token selection's results
// Shared by select.cu (every mode) and matvec_tc.cu (lm_head with plain greedy fused
// in); the Rust twins live in select.rs.
#define SEL_MAX_LOGPROBS 20

struct SelectConfig {
    float temperature, top_p, min_p, rep_penalty, presence, frequency;
    int top_k, n_logprobs;
    u32 seed_lo, seed_hi, step_lo, step_hi;
    int use_bias, use_seen, use_counts, pad;
};

struct SelectResult {
    int token;
    float logprob;
    int n_top;
    int sampled; // 1 when drawn, 0 when argmax
    int top_ids[SEL_MAX_LOGPROBS];
    float top_logprobs[SEL_MAX_LOGPROBS];
};

__device__ __forceinline__ float sanitise(float x) { return x != x ? NEG_INF : x; }

// Where a chosen token goes: the configuration (its draw step), the result and its host mirror
// ([2] SelectResult in mapped page-locked host memory, slot pos & 1, or 0), the cursor (advanced when
// `advance`), the penalty tables (counts [V] u32, seen [V] u8, used as the configuration says).
struct TokenOut {
    u64 config, result, result_host, cursor, counts, seen;
    int advance, pad;
};

// Thread 0, once the token is chosen: the SelectResult (res->n_top and the top lists already written)
// and its host mirror at slot pos & 1, the draw step, the penalty tables' count of the token, and the
// cursor's advance (token ← chosen, pos ← pos + 1).
__device__ __forceinline__ void publish_token(const TokenOut& o, const SelectConfig& c, int token, float logprob,
                                              int sampled, int pos) {
    SelectResult* res = (SelectResult*)o.result;
    res->token = token;
    res->logprob = logprob;
    res->sampled = sampled;
    SelectConfig* cfg = (SelectConfig*)o.config;
    const u64 step = (((u64)c.step_hi) << 32 | c.step_lo) + 1;
    cfg->step_lo = (u32)step;
    cfg->step_hi = (u32)(step >> 32);
    if (c.use_counts) ((u32*)o.counts)[token] += 1;
    if (c.use_seen) ((u8*)o.seen)[token] = 1;
    if (o.result_host) { // thread 0 wrote every field of res itself; pos: the cursor's, before the advance below
        SelectResult* h = (SelectResult*)o.result_host + (pos & 1);
        const int n_top = res->n_top;
        for (int k = 0; k < n_top; ++k) {
            h->top_ids[k] = res->top_ids[k];
            h->top_logprobs[k] = res->top_logprobs[k];
        }
        h->n_top = n_top;
        h->sampled = sampled;
        h->logprob = logprob;
        h->token = token;
    }
    if (o.advance) {
        Cursor* cur = (Cursor*)o.cursor;
        cur->token = token;
        cur->pos += 1;
    }
}

// Plain greedy's running state (T = 0 without bias, penalties or top logprobs: the argmax and the
// log-sum-exp of the raw logits): (max, Σ exp(raw − max)) and the best (value ↓, id ↑), merged in any
// order (the token is the same; the sum's rounding is the order's).
struct GreedyAcc {
    float m, s; // max raw, Σ exp(raw − m)
    float v;    // best value (NEG_INF with id INT_MAX: none)
    int i;
};
__device__ __forceinline__ GreedyAcc greedy_merge(GreedyAcc a, GreedyAcc b) {
    const float M = fmaxf(a.m, b.m);
    if (M > NEG_INF) a.s = (a.m > NEG_INF ? a.s * expf(a.m - M) : 0.0f) + (b.m > NEG_INF ? b.s * expf(b.m - M) : 0.0f);
    a.m = M;
    if (b.v > a.v || (b.v == a.v && b.i < a.i)) { a.v = b.v; a.i = b.i; }
    return a;
}
__device__ __forceinline__ GreedyAcc greedy_warp_merge(GreedyAcc a) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        a = greedy_merge(a, GreedyAcc{__shfl_xor_sync(0xffffffffu, a.m, o), __shfl_xor_sync(0xffffffffu, a.s, o),
                                      __shfl_xor_sync(0xffffffffu, a.v, o), __shfl_xor_sync(0xffffffffu, a.i, o)});
    return a;
}
