// routing.cuh: the MoE routing — the top-A of the router logits, and the fused routing that runs
// the router inside the out-projection (matvec_tc.cu) with gate/up selecting (moe_tc.cu).

// ---------------------------------------------------------------- MoE routing (top-A of the router logits)
// Shared by moe.cu's ticket router (its last block selects) and moe_tc.cu's gate/up (every block
// selects for itself, so the router needs no ticket).
#define MOE_MAX_E 1024
#define ROUTE_MAX_CAND (MOE_MAX_E / 32 * MOE_MAX_A) // candidates of select_top's second round

// Where a selection goes.
struct RouteParams {
    u64 logits;   // [E + 1]: the router logits, then the shared-expert gate's (with shared_gate);
                  // with `fixed`, the fused routing's accumulators (below)
    u64 topk_ids; // out [A] i32
    u64 topk_w;   // out [A] f32
    u64 shared_w; // out [1] f32: sigmoid(shared gate logit), 1 without a gate
    int E, A, norm_topk, shared_gate;
    int fixed;    // 1: logits are the accumulators, normalised by their Σh² (D, eps)
    int D;
    float eps;
    int pad;
};

// ---------------------------------------------------------------- fused routing (the router in the out-projection)
// The router's logits are linear in the residual h apart from the norm's scalar:
//   logit_e = router_e·x̂ = inv · Σ_k router[e, k]·gain_k·h_k,   inv = 1/√(Σh²/D + eps)
// so each block of the out-projection that finishes rows [16t, 16t + 16) of h adds its columns' share
// of every router row (and of the shared-expert gate row, and of Σh²) into accumulators, and the
// router needs no launch of its own: the gate/up kernel reads the sums and scales them by inv
// (docs/experiments.md). The sums are integers (fixed point: logits·2^32, Σh²·2^20) so
// that they are exact and independent of the order the blocks arrive in — the same logits every
// run, ties included. Tile t adds into copy t % ROUTE_COPIES (fewer atomics per address).
//   acc: i64 [ROUTE_COPIES][route_acc_stride(E)]: [0, E) logits, E the shared-expert gate, E + 1 Σh².
#define ROUTE_COPIES 4 // the buffers hold 4; 1, 2 and 8 measured no better
#define ROUTE_LOGIT_UNIT 4294967296.0f // 2^32
#define ROUTE_SQ_UNIT 1048576.0f       // 2^20
__device__ __forceinline__ int route_acc_stride(int E) { return (E + 2 + 15) & ~15; }
// A NaN share converts to 0 (cvt.rni.s64.f32), where the float router's NaN logit would rank last;
// a NaN residual has broken the step either way.
__device__ __forceinline__ void route_acc_add(i64* at, float v, float unit) {
    atomicAdd((unsigned long long*)at, (unsigned long long)__float2ll_rn(v * unit)); // a red: result unused
}
__device__ __forceinline__ i64 route_acc_sum(const i64* acc, int stride, int i) {
    i64 s = 0;
#pragma unroll
    for (int c = 0; c < ROUTE_COPIES; ++c) {
        i64 v;
        asm volatile("ld.global.cg.s64 %0, [%1];" : "=l"(v) : "l"(acc + c * stride + i));
        s += v;
    }
    return s;
}
// The accumulators back to zero once their layer's gate/up has read them (the MoE down kernel, one
// block; the next writer is the next layer's out-projection).
__device__ __forceinline__ void route_acc_clear(const DownParams& p) {
    if (p.route_acc && blockIdx.x == gridDim.x - 1)
        for (int i = threadIdx.x; i < p.route_acc_len; i += blockDim.x) ((i64*)p.route_acc)[i] = 0;
}

// Top-A of the router logits sl[0, E) (shared memory, 16-byte aligned, E ≤ MOE_MAX_E, A ≤ MOE_MAX_A)
// with all of a block's threads, by ranks: a logit's rank is how many logits beat it (ties: the lower
// id wins); ranks < A are the top-A in order. NaN logits become −∞ (never selected while A finite
// logits exist); sl is padded with −∞ to a multiple of 32 (ids ≥ E lose every tie).
// Two rounds, so no thread compares against all E logits: each segment of 32 keeps its local top
// min(A, 32) as candidates (a top-A logit is beaten by fewer than A logits anywhere, so within its
// segment too), then a candidate's rank among the candidates is its rank among all E (every logit
// that beats a top-A logit is itself top-A, so a candidate). The second round gives each candidate 4
// threads, a quarter of the candidates each, summed by shuffles. At E 256, A 8: 32 + 16 compares per
// thread, where one round of ranks over all E took 256 (~2 µs of the router's 9, docs/performance.md).
// cand: shared [SEL_CAND_LEN] keys (sel_key), 16-byte aligned. Ends with a barrier.
//   sel_id[k], sel_l[k] = the k-th expert and its logit.
// Thread t reads and writes only the logits e ≡ t (mod blockDim) before the first round, so a segment
// of 32 is a warp's own (blockDim % 32 == 0): the first round needs no block barrier.
// Hooks for a caller's own work between the barriers (gate/up stages x̂ there, so that its products
// need no barriers of their own): `pre` runs in every thread before the candidates' barrier (what it
// writes to shared memory is published by it), `mid` after it, before the last barrier.
// The second round compares (logit, id) keys: 4 instructions per compare where the float compare
// with the id's tie-break took 6 (Nsight Compute). The first round keeps its float compares
// with the lane's tie-break: counting by compare masks with the ties from one warp match was slower
// (gate/up +0.5 µs per launch, measured; that MATCH.ANY is the slow part is our reading).
#define SEL_CAND_LEN (ROUTE_MAX_CAND + 8)
// A (logit, id) as one u64 that orders as the ranks do: the larger logit first, then the lower id. The
// float's bits made monotone (non-negative: sign bit set; negative: every bit flipped); select_top
// makes −0 into +0 and NaN into −∞ first, so equal keys are equal logits and ids.
__device__ __forceinline__ u64 sel_key(float v, int id) {
    const u32 b = __float_as_uint(v);
    return ((u64)(b ^ ((u32)((int)b >> 31) | 0x80000000u)) << 32) | (u32)~id;
}
__device__ __forceinline__ float sel_key_logit(u64 k) {
    const u32 ord = (u32)(k >> 32);
    return __uint_as_float(ord & 0x80000000u ? ord ^ 0x80000000u : ~ord);
}
__device__ __forceinline__ int sel_key_id(u64 k) { return (int)~(u32)k; }
struct NoHook {
    __device__ void operator()() const {}
};
// NT: the block's threads as a compile-time constant (0: blockDim.x); with E and A constants at the
// call site too (a specialised gate/up kernel) the loops below have fixed trip counts.
template <int NT = 0, typename Pre = NoHook, typename Mid = NoHook>
__device__ __forceinline__ void select_top(float* sl, int E, int A, u64* cand, int* sel_id, float* sel_l,
                                           const Pre& pre = Pre{}, const Mid& mid = Mid{}) {
    const int nthreads = NT ? NT : blockDim.x;
    const int Es = (E + 31) & ~31, keep = min(A, 32);
    for (int e = threadIdx.x; e < Es; e += nthreads) {
        const float v = e < E ? sl[e] : NEG_INF;
        sl[e] = v == v ? v + 0.0f : NEG_INF; // + 0: −0 becomes +0, so equal logits have equal keys
    }
    const int C = (Es >> 5) * keep, C8 = (C + 7) & ~7; // candidates, padded to a multiple of 8
    const u64 nobody = sel_key(NEG_INF, 0x7fffffff);   // beats no one (ids ≥ 0 win its ties)
    if (threadIdx.x < C8 - C) cand[C + threadIdx.x] = nobody;
    __syncwarp();
    for (int e = threadIdx.x; e < Es; e += nthreads) { // a warp takes whole segments (blockDim % 32 == 0)
        const float v = sl[e];
        const float4* seg = (const float4*)(sl + (e & ~31));
        const int i = e & 31;
        int r0 = 0, r1 = 0, r2 = 0, r3 = 0;
#pragma unroll
        for (int o4 = 0; o4 < 8; ++o4) {
            const float4 w = seg[o4];
            const int o = 4 * o4;
            r0 += (w.x > v) | ((w.x == v) & (o < i));
            r1 += (w.y > v) | ((w.y == v) & (o + 1 < i));
            r2 += (w.z > v) | ((w.z == v) & (o + 2 < i));
            r3 += (w.w > v) | ((w.w == v) & (o + 3 < i));
        }
        const int r = r0 + r1 + r2 + r3;
        if (r < keep) cand[(e >> 5) * keep + r] = sel_key(v, e);
    }
    pre();
    __syncthreads();
    mid();
    const int quarter = C8 / 4; // even: two candidates per 16-byte load
    for (int c0 = 0; c0 < C; c0 += nthreads / 4) { // uniform: every lane reaches the shuffles
        const int c = c0 + threadIdx.x / 4, part = threadIdx.x & 3;
        const u64 me = c < C ? cand[c] : nobody;
        const ulonglong2* q = (const ulonglong2*)(cand + part * quarter);
        int r0 = 0, r1 = 0;
#pragma unroll 4
        for (int o = 0; o < quarter / 2; ++o) {
            const ulonglong2 w = q[o];
            r0 += w.x > me;
            r1 += w.y > me;
        }
        int rank = r0 + r1;
        rank += __shfl_xor_sync(0xffffffffu, rank, 1);
        rank += __shfl_xor_sync(0xffffffffu, rank, 2);
        if (part == 0 && c < C && rank < A) {
            sel_id[rank] = sel_key_id(me);
            sel_l[rank] = sel_key_logit(me);
        }
    }
    __syncthreads();
}

// The router logits (written by an earlier kernel, or by other blocks before a ticket: read through
// L2) into sl [E], and the shared-expert gate's logit (thread 0's return value; requested with the
// others rather than after the selection). No barrier.
// FE, NT: E and the block's threads as compile-time constants, or 0 (r.E, blockDim.x).
template <int FE = 0, int NT = 0>
__device__ __forceinline__ float route_load_logits(const RouteParams& r, float* sl) {
    const int E = FE ? FE : r.E, nthreads = NT ? NT : blockDim.x;
    if (r.fixed) { // the fused routing's sums: every logit scaled by the norm's inv (from Σh²)
        const i64* acc = (const i64*)r.logits;
        const int stride = route_acc_stride(E);
        // The thread's first logit, the gate's (thread 0) and Σh² requested together: one L2 round
        // trip (the code had Σh²'s loads, then inv, then the logits' loads: two; gate/up 10.9 → 10.5
        // µs). More logits per thread than one (E > blockDim) follow in a loop.
        const int e0 = threadIdx.x;
        const i64 first = e0 < E ? route_acc_sum(acc, stride, e0) : 0;
        const i64 gate = r.shared_gate && threadIdx.x == 0 ? route_acc_sum(acc, stride, E) : 0;
        const float ss = __ll2float_rn(route_acc_sum(acc, stride, E + 1)) * (1.0f / ROUTE_SQ_UNIT);
        const float inv = 1.0f / sqrtf(ss / (float)r.D + r.eps);
        if (e0 < E) sl[e0] = __ll2float_rn(first) * (1.0f / ROUTE_LOGIT_UNIT) * inv;
        for (int e = e0 + nthreads; e < E; e += nthreads)
            sl[e] = __ll2float_rn(route_acc_sum(acc, stride, e)) * (1.0f / ROUTE_LOGIT_UNIT) * inv;
        return r.shared_gate && threadIdx.x == 0 ? __ll2float_rn(gate) * (1.0f / ROUTE_LOGIT_UNIT) * inv : 0.0f;
    }
    const volatile float* logits = (const volatile float*)r.logits;
    for (int e = threadIdx.x; e < E; e += nthreads) sl[e] = logits[e];
    return r.shared_gate && threadIdx.x == 0 ? logits[E] : 0.0f;
}

// Top-A and combine weights from the logits in shared memory sl (select_top's input; the gate logit
// in thread 0) into sel_id / sel_p, and with `publish` (warp 0) into topk_ids / topk_w / shared_w for
// the down kernel. cand: shared [SEL_CAND_LEN], 16-byte aligned. Ends with a barrier, or with TAIL_SYNC
// false (sel_p is then warp 0's until the caller's next barrier; sel_id is published) with none.
//   norm_topk: w_k = p_k / Σ_sel p = exp(l_k − l_top) / Σ_sel exp(l_j − l_top): the softmax's
//   normaliser cancels, so beyond the ranks only the A selected logits are needed (one warp). Before,
//   a block max, a block sum of E exponentials and a serial renormalisation took ~1.5 µs of the
//   router's 3.4 µs of selection (measured by removing the selection, docs/performance.md).
//   otherwise: w_k = p_k = exp(l_k − max) / Σ_e exp(l_e − max) over all E; max = the top logit.
// FE, FA, NT: E, A and the block's threads as compile-time constants, or 0 (r.E, r.A, blockDim.x).
template <bool TAIL_SYNC = true, int FE = 0, int FA = 0, int NT = 0, typename Pre = NoHook, typename Mid = NoHook>
__device__ __forceinline__ void route_select(const RouteParams& r, float* sl, float gate_logit, int* sel_id,
                                             float* sel_p, float* red, u64* cand, bool publish,
                                             const Pre& pre = Pre{}, const Mid& mid = Mid{}) {
    const int E = FE ? FE : r.E, A = FA ? FA : r.A, nthreads = NT ? NT : blockDim.x;
    select_top<NT>(sl, E, A, cand, sel_id, sel_p, pre, mid); // sel_p holds the selected logits for now
    if (r.norm_topk) {
        if (threadIdx.x < 32) { // A ≤ MOE_MAX_A = 32: one lane per selected expert
            const int k = threadIdx.x;
            const float w = k < A ? expf(sel_p[k] - sel_p[0]) : 0.0f;
            const float sum = warp_sum(w);
            if (k < A) sel_p[k] = w / sum;
        }
    } else {
        const float mx = sel_p[0]; // the top logit
        float z = 0.0f;
        for (int e = threadIdx.x; e < E; e += nthreads) z += expf(sl[e] - mx); // NaN: −∞ by now
        z = block_sum(z, red);
        if (threadIdx.x < A) sel_p[threadIdx.x] = expf(sel_p[threadIdx.x] - mx) / z;
    }
    __syncwarp();
    if (publish && threadIdx.x < 32) {
        for (int k = threadIdx.x; k < A; k += 32) {
            ((int*)r.topk_ids)[k] = sel_id[k];
            ((float*)r.topk_w)[k] = sel_p[k];
        }
        if (threadIdx.x == 0) *(float*)r.shared_w = r.shared_gate ? sigmoid_f(gate_logit) : 1.0f;
    }
    if (TAIL_SYNC) __syncthreads();
}

// Layouts shared with the Rust launchers (tests/layouts.rs checks the same sizes).
static_assert(sizeof(MatrixRef) == 32, "MatrixRef layout differs from its Rust twin");
static_assert(sizeof(RouteParams) == 64, "RouteParams layout differs from its Rust twin");
static_assert(sizeof(Cursor) == 16, "Cursor layout differs from its Rust twin");
static_assert(sizeof(SelectConfig) == 64, "SelectConfig layout differs from its Rust twin");
static_assert(sizeof(SelectResult) == 176, "SelectResult layout differs from its Rust twin");
