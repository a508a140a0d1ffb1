// moe_tc.cu: the MoE's q4 decode products on the tensor cores (gate/up with the top-k selection,
// down + combine + residual), on matvec_tc.cuh's body (its header comment has the math and the
// layout); moe.cu's kernels stay for the other formats and as the reference.

// MoE gate/up (moe.cu's contract, GateUpParams): slot s (routed experts' ids from topk_ids, then the
// shared expert) gets act[s, j] = silu(gate_j·x̂)·(up_j·x̂). A tile is gate rows j0..j0+7 (tile rows
// 0–7) and the up rows j0..j0+7 (rows 8–15) of one slot, so row sums r and r + 8 make act[j0 + r].
// With r.logits set, each block first takes the top-A of the router logits itself (common.cuh
// route_select; block 0 also publishes the ids and combine weights for the down kernel), so the router
// kernel needs no ticket and no last block. Measured at 4K (docs/experiments.md): router
// 7.9 → 5.2 µs (ticket path with the same selection), this kernel 8.1 → 10.2 µs; −0.6 µs per layer.
struct __align__(16) GateUpSelect { // shared memory of the selection (sl read as float4)
    float sl[MOE_MAX_E];
    u64 cand[SEL_CAND_LEN]; // 16-byte aligned: sl's size is a multiple of 16 bytes
    int id[MOE_MAX_A];
    float w[MOE_MAX_A];
    float red[32];
};
struct TcGateUpParams {
    GateUpParams g;
    RouteParams r; // r.logits 0: the slots' experts are in g.topk_ids already
    MatrixRef down_e, down_s; // the down launch's routed and shared matrices (prefetched into L2), or zero
};
// FE, FA, FI, FIS: the router's experts, the routed slots (top-k), the expert and shared-expert
// intermediate sizes as compile-time constants (a specialised kernel: the selection's loops get fixed
// trip counts and the tile's slot and row fold to shifts), or 0 for the parameters' values.
template <int FE = 0, int FA = 0, int FI = 0, int FIS = 0>
struct GateUpMapT {
    const GateUpParams& p;
    int* expert; // shared [MOE_MAX_A + 1]: the slots' experts
    const RouteParams& r;
    GateUpSelect* sel;
    const MatrixRef& down_e; // the down launch's matrices (prefetch_down), or zero
    const MatrixRef& down_s;
    __device__ int A() const { return FA ? FA : p.A; }
    __device__ int I() const { return FI ? FI : p.I; }
    __device__ int Is() const { return FIS ? FIS : p.Is; }
    __device__ int n_max() const { return FI && FI == FIS ? FI : max(A() > p.slot_offset ? I() : 0, Is()); }
    __device__ int per_slot() const { return (n_max() + 7) >> 3; }
    __device__ int slots() const { return (int)gridDim.y; }
    __device__ int tiles() const { return per_slot() * slots(); }
    __device__ u64 x() const { return p.x; }
    __device__ u64 norm_gain() const { return p.norm_gain; }
    __device__ float eps() const { return p.eps; }
    static constexpr bool HEAD_NORM = false;
    static constexpr bool STATIC_ROWS = false; // the routed slots' rows follow the selection (prologue_staged)
    template <int CW>
    __device__ void chunk_scales(int, int, float (&)[CW]) const {}
    // The slots' experts given in topk_ids (no selection here) into shared memory; with a selection
    // row() reads sel->id.
    __device__ void fill_experts() const {
        if (r.logits) return;
        for (int s = threadIdx.x; s < slots(); s += blockDim.x) {
            const int slot = s + p.slot_offset;
            expert[s] = slot >= A() ? 0 : ((const int*)p.topk_ids)[slot];
        }
    }
    // The routing with the caller's hooks between its barriers (select_top: `pre` before the
    // candidates' barrier, `mid` after it); ends with a barrier that publishes the selected experts
    // and what `mid` wrote. Without a selection here: pre, barrier, mid, barrier. The body stages x̂
    // in the hooks rather than after the selection with barriers of its own: 7 block barriers between
    // the routing sums and the weight loads became 2 (docs/experiments.md).
    template <typename Pre, typename Mid>
    __device__ void prologue_staged(const Pre& pre, const Mid& mid) const {
        if (r.logits) {
            const float gate_logit = route_load_logits<FE, MTC_THREADS>(r, sel->sl);
            route_select<false, FE, FA, MTC_THREADS>(r, sel->sl, gate_logit, sel->id, sel->w, sel->red, sel->cand,
                                                     blockIdx.x == 0 && blockIdx.y == 0, pre, mid);
        } else {
            pre();
            fill_experts();
            __syncthreads();
            mid();
            __syncthreads();
        }
    }
    // Rows g and g + 8 of tile t: gate row j and up row j of its slot's expert, n rows apart. The slot
    // by div_small, the row as a 32-bit index (< E·2I) and each address by one 32 × 32 → 64-bit
    // multiply-add: the i64 row products, the integer division and the indexed parameter loads of
    // the general form were ~120 instructions per tile (Nsight Compute).
    __device__ void tile_rows(int t, int g, const u8* (&data)[2], const u8* (&prm)[2]) const {
        const int s = FI && FI == FIS ? t / per_slot() : div_small(t, per_slot()), slot = s + p.slot_offset;
        const bool routed = slot < A();
        const int n = routed ? I() : Is();
        const int j = min((t - s * per_slot()) * 8 + g, n - 1);
        const int e = routed ? (r.logits ? sel->id[slot] : expert[s]) : 0;
        const int row = (routed ? e * 2 * I() : 0) + j;
        const u8* const codes = (const u8*)(routed ? p.experts.data : p.shared.data);
        const u8* const params = (const u8*)(routed ? p.experts.params : p.shared.params);
        const u32 row_bytes = (u32)(routed ? p.experts.row_bytes : p.shared.row_bytes); // K/2 for q4
        const u32 prm_bytes = 4 * (routed ? p.experts.groups_per_row : p.shared.groups_per_row);
        data[0] = codes + wide_mul(row, row_bytes);
        prm[0] = params + wide_mul(row, prm_bytes);
        data[1] = data[0] + wide_mul(n, row_bytes);
        prm[1] = prm[0] + wide_mul(n, prm_bytes);
    }
    // The down launch's weights for this step's experts (and the shared expert's), asked of L2 by
    // every block for its share of the lines (~160 at the real shape: 5.2 MB per layer), after the
    // block's first tile (every slot in this launch, I == Is: one line count per slot). Step at 4K
    // −9 µs (docs/experiments.md), though MoE down itself is no faster one launch at a
    // time; at the blocks' end instead: the same step.
    __device__ void prefetch_down() const {
        if (!down_e.data || !r.logits || p.slot_offset != 0 || I() != Is() || slots() != A() + (down_s.data ? 1 : 0)) return;
        const i64 D = p.D;
        const u32 code_lines = (u32)((D * down_e.row_bytes) >> 7), prm_lines = (u32)((D * down_e.groups_per_row * 4) >> 7);
        const u32 per_slot = code_lines + prm_lines, total = per_slot * (u32)slots();
        const u32 nb = gridDim.x * gridDim.y, b = blockIdx.x + blockIdx.y * gridDim.x, share = (total + nb - 1) / nb;
        const u32 end = min(total, (b + 1) * share);
        for (u32 l = b * share + threadIdx.x; l < end; l += blockDim.x) {
            const u32 s = l / per_slot, k = l - s * per_slot;
            const bool routed = (int)s < A();
            const MatrixRef& m = routed ? down_e : down_s;
            const i64 row0 = routed ? (i64)sel->id[s] * D : 0;
            if (k < code_lines) prefetch_l2((const u8*)m.data + row0 * m.row_bytes + 128 * (i64)k);
            else prefetch_l2((const u8*)m.params + row0 * m.groups_per_row * 4 + 128 * (i64)(k - code_lines));
        }
    }
    __device__ float old_value(int, int) const { return 0.0f; } // act is written, not added to
    typedef NoTail Tail;
    __device__ Tail tail_load(int) const { return Tail{}; }
    __device__ void tail(int, float, const Tail&, bool, float*) const {}
    __device__ float finish(int t, int tid, const float (*red)[16], bool, float) const {
        const int s = FI && FI == FIS ? t / per_slot() : div_small(t, per_slot()), slot = s + p.slot_offset;
        const int n = slot < A() ? I() : Is();
        const int j = (t - s * per_slot()) * 8 + tid;
        if (tid >= 8 || j >= n) return 0.0f;
        float gate = 0.0f, up = 0.0f;
#pragma unroll
        for (int w = 0; w < MTC_WARPS; ++w) {
            gate += red[w][tid];
            up += red[w][tid + 8];
        }
        ((float*)p.act)[(i64)slot * p.act_stride + j] = silu_f(gate) * up;
        return 0.0f;
    }
};

#define MTC_GATE_UP_KERNEL(CW, NB) \
    extern "C" __global__ void __launch_bounds__(MTC_THREADS, 2) matvec_tc_gate_up_q4_c##CW(const TcGateUpParams p) { \
        __shared__ int expert[MOE_MAX_A + 1]; \
        __shared__ GateUpSelect sel; \
        tc_body<CW, NB>(GateUpMapT<>{p.g, expert, p.r, &sel, p.down_e, p.down_s}); \
    }
MTC_GATE_UP_KERNEL(1, MTC_NB_C1)
MTC_GATE_UP_KERNEL(2, MTC_NB_C2)
MTC_GATE_UP_KERNEL(4, MTC_NB_C4)
// Gate/up for Qwen3.5/3.6's MoE (D 2048, 256 experts, top-8, expert and shared intermediate 512: the
// 35B-A3B), its dims compiled in; moe::gate_up_kernel picks it where they match.
// (Three blocks per SM, ≤ 80 registers, so the 576 tiles spread over 396 blocks at ≤ 2 each: step
// −1.5 µs, within the runs' spread, and the kernel +23 µs in the no-graph profile; not kept.)
extern "C" __global__ void __launch_bounds__(MTC_THREADS, 2) matvec_tc_gate_up_q4_c2_e256_a8_i512(const TcGateUpParams p) {
    __shared__ int expert[MOE_MAX_A + 1];
    __shared__ GateUpSelect sel;
    tc_body<2, MTC_NB_C2>(GateUpMapT<256, 8, 512, 512>{p.g, expert, p.r, &sel, p.down_e, p.down_s});
}


// MoE down + combine + residual (moe.cu's contract, DownParams): h[r] += Σ_slots w_s·down_s[r]·act_s.
// The slots' rows are one virtual row of Σ I columns (chunk q of it: slot s's chunk kc), and the
// combine weight goes into B (B = w_s·act_s), so the mma sums the slots too. A block takes one tile of
// 16 output rows; warp w takes chunks w, w + 8, …; grid ⌈D/16⌉ × 256 threads, dynamic smem
// 4·Σ I + Σ I/16 bytes.

// FA, FI, FIS, FD: top-k, the expert and shared-expert intermediate sizes and D as compile-time
// constants (a specialised kernel: the chunk → slot arithmetic folds to shifts), or 0 for p's.
template <int CWMAX, int FA = 0, int FI = 0, int FIS = 0, int FD = 0>
__device__ __forceinline__ void tc_down_body(const DownParams& p) {
    extern __shared__ float4 smem4[];
    __shared__ int slot_expert[MOE_MAX_A + 1];
    __shared__ float slot_weight[MOE_MAX_A + 1];
    __shared__ float red[MTC_WARPS][16];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, c = lane & 3;
    const int A = FA ? FA : p.A, I = FI ? FI : p.I, Is = FIS ? FIS : p.Is, D = FD ? FD : p.D;
    const int nslots = p.slot_end - p.slot_begin;
    const int n_routed = max(0, min(p.slot_end, A) - p.slot_begin);
    griddep_enter();
    route_acc_clear(p);
    const int cr = I / 128, cs = Is / 128; // chunks of a routed and of the shared slot
    const int chunks = n_routed * cr + (p.slot_end > A ? cs : 0);
    uint4* bfrag = (uint4*)smem4;                     // w·act as B registers, TcDot::BFRAG_U4 per chunk
    float* gsum = (float*)(bfrag + chunks * TcDot::BFRAG_U4); // per group of 64 (2·chunks): TcDot's terms
    // chunk q: its slot (index from slot_begin) and its chunk inside the slot's row (q / cr by
    // div_small: the integer division was in every staged word's and chunk's slot_of. Taken only
    // below n_routed·cr, so cr ≥ 1 there: a dense MLP has no routed slots and cr = 0.)
    auto slot_of = [&](int q, int& s, int& kc) {
        s = q < n_routed * cr ? (FI ? q / cr : div_small(q, cr)) : n_routed; // a shift when cr is constant
        kc = q - s * cr;
    };
    // The slots' activations (from L2), every load of the thread at once, with the slots' experts and
    // weights (their addresses depend on the slot index only) and the residual; weighted once the
    // slots are in. The old loop weighted each iteration's values before the next iteration's loads
    // were issued (nvdisasm): three serial L2 round trips. Down 7.0 → 6.5 µs.
    constexpr int WPT = (CWMAX * 8 * 16 + MTC_THREADS - 1) / MTC_THREADS;
    const int words = chunks * 16;
    float4 act[WPT][2];
#pragma unroll
    for (int m = 0; m < WPT; ++m) {
        const int wi = tid + MTC_THREADS * m;
        act[m][0] = act[m][1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (wi < words) {
            int s, kc;
            slot_of(wi >> 4, s, kc);
            const float4* src = (const float4*)((const float*)p.act + (i64)(p.slot_begin + s) * p.act_stride +
                                                kc * 128 + (wi & 15) * 8);
            act[m][0] = ldcg_f4(src);
            act[m][1] = ldcg_f4(src + 1);
        }
    }
    for (int s = tid; s < nslots; s += blockDim.x) {
        const int slot = p.slot_begin + s;
        slot_expert[s] = slot < A ? ((const int*)p.topk_ids)[slot] : 0;
        slot_weight[s] = slot < A ? ((const float*)p.topk_w)[slot] : *(const float*)p.shared_w;
    }
    // the residual this block adds to, requested now rather than after the reduction
    const int t = blockIdx.x;
    const float h_old = MTC_EARLY_OLD && tid < 16 && 16 * t + tid < D ? ldcg_f32((const float*)p.h + 16 * t + tid) : 0.0f;
    __syncthreads();

    // the activations times their slots' weights, before any weight load is issued
    float xv[WPT][8];
#pragma unroll
    for (int m = 0; m < WPT; ++m) {
        const int wi = tid + MTC_THREADS * m;
        int s, kc;
        slot_of(min(wi, words - 1) >> 4, s, kc);
        const float wgt = wi < words ? slot_weight[s] : 0.0f;
        const float4 a = act[m][0], b = act[m][1];
        const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int i = 0; i < 8; ++i) xv[m][i] = v[i] * wgt;
    }
    __syncthreads(); // every warp's activations are in: the weight loads go after them

    uint4 cd[CWMAX][2];
    uint2 pr[CWMAX][2];
#pragma unroll
    for (int i = 0; i < CWMAX; ++i) {
        const int q = warp + MTC_WARPS * i;
        if (q >= chunks) break;
        int s, kc;
        slot_of(q, s, kc);
        // The row as a 32-bit index (< E·D) and each address by one 32 × 32 → 64-bit multiply-add: the
        // i64 products were ~9 instructions per address, 18 addresses per warp (Nsight Compute).
        const bool routed = s < n_routed;
        const u8* const codes = (const u8*)(routed ? p.experts.data : p.shared.data) + kc * 64 + c * 16;
        const u8* const params = (const u8*)(routed ? p.experts.params : p.shared.params) + kc * 8;
        const u32 row_bytes = (u32)(routed ? p.experts.row_bytes : p.shared.row_bytes); // I/2 for q4
        const u32 prm_bytes = 4 * (routed ? p.experts.groups_per_row : p.shared.groups_per_row);
        const int row0 = routed ? slot_expert[s] * D : 0;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + min(16 * t + g + 8 * h, D - 1);
            cd[i][h] = ldg16_in_order(codes + wide_mul(row, row_bytes));
            pr[i][h] = ldg8_in_order(params + wide_mul(row, prm_bytes));
        }
    }
#pragma unroll
    for (int m = 0; m < WPT; ++m) {
        const int wi = tid + MTC_THREADS * m;
        TcDot::stage_word(wi, wi < words, xv[m], bfrag, gsum);
    }
    __syncthreads();

    const bool b_live = TcDot::b_live(g, c);
    float acc0 = 0.0f, acc1 = 0.0f;
#pragma unroll
    for (int i = 0; i < CWMAX; ++i) {
        const int q = warp + MTC_WARPS * i;
        if (q >= chunks) break;
        TcDot::chunk(cd[i][0], cd[i][1], pr[i][0], pr[i][1], bfrag, gsum, q, b_live, g, c, acc0, acc1);
    }
    acc0 = TcDot::lane_sum(acc0);
    acc1 = TcDot::lane_sum(acc1);
    if (c == 0) {
        red[warp][g] = acc0;
        red[warp][g + 8] = acc1;
    }
    __syncthreads();
    const int r = 16 * t + tid;
    if (tid < 16 && r < D) {
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < MTC_WARPS; ++w) v += red[w][tid];
        ((float*)p.h)[r] = (MTC_EARLY_OLD ? h_old : ldcg_f32((const float*)p.h + r)) + v;
    }
}

// Up to 8·5 = 40 chunks of 128 columns: 9 slots of I = 512 (the real model: 36).
#define MTC_DOWN_CHUNKS 5
extern "C" __global__ void __launch_bounds__(MTC_THREADS, 2) matvec_tc_down_q4(const DownParams p) {
    tc_down_body<MTC_DOWN_CHUNKS>(p);
}
// Down for Qwen3.5/3.6's MoE (top-8, expert and shared intermediate 512, D 2048: the 35B-A3B), its dims
// compiled in; moe::down_kernel picks it where they match.
extern "C" __global__ void __launch_bounds__(MTC_THREADS, 2) matvec_tc_down_q4_a8_i512_d2048(const DownParams p) {
    tc_down_body<MTC_DOWN_CHUNKS, 8, 512, 512, 2048>(p);
}


static_assert(sizeof(GateUpParams) == 128, "GateUpParams layout differs from its Rust twin");
static_assert(sizeof(TcGateUpParams) == 256, "TcGateUpParams layout differs from its Rust twin");
static_assert(sizeof(DownParams) == 152, "DownParams layout differs from its Rust twin");
