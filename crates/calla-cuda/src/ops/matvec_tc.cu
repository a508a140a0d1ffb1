// matvec_tc.cu: the q4 decode projections on the tensor cores (the in- and out-projections, the
// DeltaNet head norm and the fused routing in the out-projections, lm_head and lm_head with plain
// greedy selection), on matvec_tc.cuh's body (its header comment has the math and the layout).

#define MTC_KERNELS(CW, NB) \
    extern "C" __global__ void __launch_bounds__(MTC_THREADS, 2) matvec_tc_q4_c##CW(const MatvecParams p) { \
        const TcMatvecParams none{}; \
        tc_body<CW, NB>(MatvecMapT<false>{p, none}); \
    } \
    extern "C" __global__ void __launch_bounds__(MTC_THREADS, 2) matvec_tc_headnorm_q4_c##CW(const TcMatvecParams p) { \
        tc_body<CW, NB>(MatvecMapT<true>{p.m, p}); \
    } \
    extern "C" __global__ void __launch_bounds__(MTC_THREADS, 2) matvec_tc_route_q4_c##CW(const TcMatvecParams p) { \
        tc_body<CW, NB>(MatvecMapT<false, true>{p.m, p}); \
    } \
    extern "C" __global__ void __launch_bounds__(MTC_THREADS, 2) matvec_tc_headnorm_route_q4_c##CW(const TcMatvecParams p) { \
        tc_body<CW, NB>(MatvecMapT<true, true>{p.m, p}); \
    }
MTC_KERNELS(1, MTC_NB_C1)
MTC_KERNELS(2, MTC_NB_C2)
MTC_KERNELS(4, MTC_NB_C4)
// The out-projections for Qwen3.5/3.6 (K 4096; a q8 router over 256 experts; the DeltaNet's head norm
// over heads of 128 with 8 parts each: the 35B-A3B), their dims compiled in; matvec::routed_kernel
// picks them where they match. (Their one segment compiled in as well, NS = 1, as for lm_head: the
// out-projections 204 → 213 µs per step, the step +5 µs; not kept, session 19.)
extern "C" __global__ void __launch_bounds__(MTC_THREADS, 2) matvec_tc_headnorm_route_q4_c4_e256_q8_hd128(const TcMatvecParams p) {
    tc_body<4, MTC_NB_C4>(MatvecMapT<true, true, 256, 8, 128, 8>{p.m, p});
}
extern "C" __global__ void __launch_bounds__(MTC_THREADS, 2) matvec_tc_route_q4_c4_e256_q8(const TcMatvecParams p) {
    tc_body<4, MTC_NB_C4>(MatvecMapT<false, true, 256, 8>{p.m, p});
}
// The in-projections for Qwen3.5/3.6 (K 2048): the DeltaNet's q|k|v (8192 rows), z (4096), b and a
// (32 each), and attention's q+gate (8192), k and v (512 each), their segments compiled in; and any
// one segment of whole tiles (lm_head); matvec::fixed_rows_kernel picks them where the segments match.
extern "C" __global__ void __launch_bounds__(MTC_THREADS, 2) matvec_tc_q4_c2_s8192_4096_32_32(const MatvecParams p) {
    const TcMatvecParams none{};
    tc_body<2, MTC_NB_C2>(MatvecMapT<false, false, 0, 0, 0, 0, 4, 8192, 4096, 32>{p, none});
}
extern "C" __global__ void __launch_bounds__(MTC_THREADS, 2) matvec_tc_q4_c2_s8192_512_512(const MatvecParams p) {
    const TcMatvecParams none{};
    tc_body<2, MTC_NB_C2>(MatvecMapT<false, false, 0, 0, 0, 0, 3, 8192, 512>{p, none});
}
// (lm_head, ~59 tiles per block, with 3 or 4 tiles in flight per warp: 75 → 77.3 and 75.3 µs; session 19.)
extern "C" __global__ void __launch_bounds__(MTC_THREADS, 2) matvec_tc_q4_c2_s1(const MatvecParams p) {
    const TcMatvecParams none{};
    tc_body<2, MTC_NB_C2>(MatvecMapT<false, false, 0, 0, 0, 0, 1>{p, none});
}
// lm_head with plain greedy selection fused in (T = 0 without bias, penalties or top logprobs: the
// usual request): the logits are written as by matvec_tc_q4_c2_s1, and each block also keeps select.cu's
// greedy state (GreedyAcc) of its rows (thread tid < 16 folds row 16t + tid of each tile, in tile order,
// so the first of equal values is kept), leaves its warp-0 merge as a partial and takes a ticket; the
// last block merges the partials and publishes the token as select_token would (publish_token), so the
// decode graph for plain greedy needs no selection launch (its boundary and its 6.7 µs, of which 3.3
// before the logits arrive: docs/experiments.md). The token is select_token's (the same total
// order over the same logits); the log-probability's sum is in another order (rounding).
#define GREEDY_HEAD_MAX_BLOCKS 1024
struct GreedyHeadParams {
    MatvecParams m;
    TokenOut out;     // where the token goes (select.rs sets it as for select_token)
    u64 partials;     // f32 m[MAX], f32 s[MAX], f32 v[MAX], i32 i[MAX] (MAX = GREEDY_HEAD_MAX_BLOCKS)
    u64 counter;      // u32 ticket, zero between launches
};
struct GreedyHeadMap : MatvecMapT<false, false, 0, 0, 0, 0, 1> {
    mutable GreedyAcc acc; // thread tid < 16: its rows so far
    __device__ void tail(int t, float y_t, const Tail&, bool, float*) const {
        const int row = 16 * t + (int)threadIdx.x;
        if (threadIdx.x >= 16 || row >= p.total_rows) return;
        const float r = sanitise(y_t);
        if (r > acc.v) { acc.v = r; acc.i = row; } // rows rise with t: the first of equals is kept
        if (r > NEG_INF) {
            if (r > acc.m) {
                acc.s = (acc.m > NEG_INF ? acc.s * expf(acc.m - r) : 0.0f) + 1.0f;
                acc.m = r;
            } else {
                acc.s += expf(r - acc.m);
            }
        }
    }
};
extern "C" __global__ void __launch_bounds__(MTC_THREADS, 2) matvec_tc_q4_c2_s1_greedy(const GreedyHeadParams p) {
    const TcMatvecParams none{};
    const GreedyHeadMap map{{p.m, none}, GreedyAcc{NEG_INF, 0.0f, NEG_INF, 0x7fffffff}};
    tc_body<2, MTC_NB_C2>(map);
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x, nb = gridDim.x;
    float* pm = (float*)p.partials;
    float* ps = pm + GREEDY_HEAD_MAX_BLOCKS;
    float* pv = ps + GREEDY_HEAD_MAX_BLOCKS;
    int* pi = (int*)(pv + GREEDY_HEAD_MAX_BLOCKS);
    GreedyAcc a = greedy_warp_merge(map.acc); // lanes ≥ 16 hold none
    int last = 0;
    if (lane == 0) {
        pm[blockIdx.x] = a.m;
        ps[blockIdx.x] = a.s;
        pv[blockIdx.x] = a.v;
        pi[blockIdx.x] = a.i;
        __threadfence();
        last = atomicAdd((unsigned*)p.counter, 1u) + 1 == (unsigned)nb;
    }
    if (!__shfl_sync(0xffffffffu, last, 0)) return;
    __threadfence();
    // The last block's warp 0: the position (for the host slot) and the configuration (the draw step)
    // requested with the partials, PER per lane in flight at once.
    const int pos = lane == 0 && p.out.result_host ? __ldcg(&((const Cursor*)p.out.cursor)->pos) : 0;
    const SelectConfig c = *(const SelectConfig*)p.out.config;
    constexpr int PER = 12;
    a = GreedyAcc{NEG_INF, 0.0f, NEG_INF, 0x7fffffff};
    for (int base = 0; base < nb; base += 32 * PER) {
        GreedyAcc q[PER];
#pragma unroll
        for (int h = 0; h < PER; ++h) {
            const int b = base + lane + 32 * h;
            q[h] = b < nb ? GreedyAcc{__ldcg(pm + b), __ldcg(ps + b), __ldcg(pv + b), __ldcg(pi + b)}
                          : GreedyAcc{NEG_INF, 0.0f, NEG_INF, 0x7fffffff};
        }
#pragma unroll
        for (int w = 1; w < PER; w *= 2) // a pairwise tree: independent merges side by side
#pragma unroll
            for (int h = 0; h + w < PER; h += 2 * w) q[h] = greedy_merge(q[h], q[h + w]);
        a = greedy_merge(a, q[0]);
    }
    a = greedy_warp_merge(a);
    if (lane == 0) {
        // as select_token: no finite logit at all → token 0 (the lowest id of equals)
        const int token = a.v > NEG_INF || a.i != 0x7fffffff ? a.i : 0;
        const float lse = a.m > NEG_INF ? a.m + logf(a.s) : NEG_INF;
        const float raw_tok = token == a.i ? a.v : sanitise(__ldcg((const float*)p.m.seg[0].out + token));
        ((SelectResult*)p.out.result)->n_top = 0;
        publish_token(p.out, c, token, raw_tok - lse, 0, pos);
        *(u32*)p.counter = 0u;
    }
}
static_assert(sizeof(MatvecParams) == 232, "MatvecParams layout differs from its Rust twin");
static_assert(sizeof(TcMatvecParams) == 328, "TcMatvecParams layout differs from its Rust twin");
static_assert(sizeof(TokenOut) == 56 && sizeof(GreedyHeadParams) == 304, "GreedyHeadParams layout differs from its Rust twin");
