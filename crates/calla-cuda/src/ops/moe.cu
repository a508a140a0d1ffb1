// moe.cu: the sparse MoE block for one decode token, in three launches, routing on the device.
// (Where the formats allow, the engine runs the router inside the out-projection instead: the
// fused routing, common.cuh and matvec_tc.cu; these kernels then serve the other formats, the
// dense MLP and as the reference.)
//
// Math (CPU reference: calla_cpu::moe; HF Qwen3_5MoeSparseMoeBlock):
//   x̂ = rmsnorm₀(h)·(1 + post_attention_layernorm)
//   logits = router·x̂ [E];  p = softmax(logits);  top-A by p (ties: lowest expert id)
//   w_k = p_k / Σ_sel p (norm_topk_prob) or p_k;   sg = sigmoid(shared_expert_gate·x̂) (1 without a gate)
//   act_k = silu(gate_k·x̂) ⊙ (up_k·x̂)                   for the A routed experts and the shared one
//   h ← h + Σ_k w_k · down_k·act_k + sg · down_shared·act_shared
// A dense SwiGLU MLP (Qwen3.5 dense) is the same with only the "shared" slot, weight 1.
//
// All three use the dot-product engine of common.cuh (rows_dot: R rows share each x̂ read, R·U
// 16-byte weight loads in flight per lane, Σx̂ per unit precomputed for the affine bias term).
// moe_router_*:  grid ⌈E/(rows per block)⌉ (+1 block for the shared-expert gate row) × 256 threads,
//                2 router rows per lane group; each block normalises h itself (D·4 bytes from L2).
//                The last block to finish (atomic ticket) does softmax + top-A with all its threads
//                (route) and resets the ticket: no host round trip. Without a ticket (counter 0)
//                only the logits are left: the tensor-core gate/up selects in every block.
// moe_gate_up_*: grid (⌈n/(2·groups)⌉, slots), 256 threads; a lane group takes rows j, j+1 of one
//                slot: gate_j, gate_j+1, up_j, up_j+1 in one rows_dot (R = 4), then
//                act[slot, j] = silu(gate_j)·up_j. Expert ids are read from the device top-A list.
// moe_down_*:    grid ⌈D/16⌉, 256 threads, smem: the slots' activations (padded) and their Σ per
//                unit; a warp takes 2 output rows r: Σ over slots and units (flattened, so I = 512
//                still keeps 32 lanes busy), weighted per slot; h[r] += result.
// Bytes per token (real shape, q4): router E·D·(8 bits) + 9·3·I·D·4.5 bits ≈ 15.9 MB per layer.

#define MOE_THREADS 256
#define ROUTER_ROWS 2 // router rows per lane group

struct RouterParams {
    u64 h;           // [D]
    u64 norm_gain;   // [D] = 1 + post_attention_layernorm
    MatrixRef router;// [E, D]
    u64 shared_gate; // [D] f32, or 0
    u64 xn;          // out [D]: x̂ for the expert kernels
    u64 logits;      // scratch [E + 1]: router logits, then the shared-expert gate's
    u64 topk_ids;    // out [A] i32
    u64 topk_w;      // out [A] f32
    u64 shared_w;    // out [1] f32: sigmoid(shared gate logit), 1 without a gate
    u64 counter;     // u32 ticket, 0 between launches; or 0: no selection here (moe_tc.cu's gate/up selects)
    int D, E, A, norm_topk, group_size;
    float eps;
};

// Where the router's selection goes (the ticket kernel's last block, or every block of the
// tensor-core gate/up: common.cuh route_select).
__device__ __forceinline__ RouteParams route_of(const RouterParams& p) {
    RouteParams r;
    r.logits = p.logits;
    r.topk_ids = p.topk_ids;
    r.topk_w = p.topk_w;
    r.shared_w = p.shared_w;
    r.E = p.E;
    r.A = p.A;
    r.norm_topk = p.norm_topk;
    r.shared_gate = p.shared_gate != 0;
    r.fixed = 0; // float logits from router_rows
    r.D = p.D;
    r.eps = p.eps;
    r.pad = 0;
    return r;
}

// Softmax + top-A over the logits written by router_rows (read back through L2 into sl4), with
// `publish` also written out for the expert kernels (common.cuh route_select). Ends with a barrier.
__device__ __forceinline__ void route(const RouterParams& p, float4* sl4, int* sel_id, float* sel_p, float* red,
                                      bool publish) {
    __shared__ float4 cand4[SEL_CAND_LEN / 2];
    const RouteParams r = route_of(p);
    const float gate_logit = route_load_logits(r, (float*)sl4);
    route_select(r, (float*)sl4, gate_logit, sel_id, sel_p, red, (u64*)cand4, publish);
}

// Router rows [item·rows_per_block, …) of this block's lane groups into logits (or, for the gate block,
// the shared-expert gate row into logits[E]), from x̂ in shared memory.
template <int FMT>
__device__ __forceinline__ void router_rows(const RouterParams& p, const float* xs, const float* usum, int item,
                                            bool gate_block) {
    typedef Fmt<FMT> F;
    const int units = p.D / F::W, width = lanes_per_row(units);
    const int group = threadIdx.x / width, lane = threadIdx.x % width;
    const int rows_per_block = blockDim.x / width * ROUTER_ROWS;
    float* logits = (float*)p.logits;
    if (!gate_block) {
        const int row0 = item * rows_per_block + group * ROUTER_ROWS;
        RowPtr rows[ROUTER_ROWS];
#pragma unroll
        for (int i = 0; i < ROUTER_ROWS; ++i) rows[i] = row_ptr(p.router, min(row0 + i, p.E - 1));
        float acc[ROUTER_ROWS] = {};
        if (row0 < p.E) // uniform across the lane group
            rows_dot<FMT, ROUTER_ROWS, 4>(rows, xs, usum, units, lane, width,
                                          F::AFFINE ? p.group_size / F::W : 1, acc);
#pragma unroll
        for (int i = 0; i < ROUTER_ROWS; ++i) {
            const float v = group_sum(acc[i], width);
            if (lane == 0 && row0 + i < p.E) logits[row0 + i] = v;
        }
    } else if (threadIdx.x < 32) { // the shared-expert gate row (f32), one warp
        const float* sg = (const float*)p.shared_gate;
        float acc = 0.0f;
        for (int i = threadIdx.x; i < p.D; i += 32) acc = fmaf(sg[i], xs[xpad(i)], acc);
        acc = warp_sum(acc);
        if (threadIdx.x == 0) logits[p.E] = acc;
    }
}

template <int FMT>
__device__ __forceinline__ void router_body(const RouterParams& p) {
    typedef Fmt<FMT> F;
    extern __shared__ float4 smem4[];
    float* xs = (float*)smem4;
    float* usum = xs + xpad_len(p.D);
    __shared__ float red[32];
    const bool gate_block = p.shared_gate && blockIdx.x == gridDim.x - 1;
    griddep_enter();
    stage_input<F::AFFINE ? F::W : 0>((const float*)p.h, (const float*)p.norm_gain, p.eps, p.D, xs, usum, red);
    if (blockIdx.x == 0)
        for (int i = threadIdx.x; i < p.D; i += blockDim.x) ((float*)p.xn)[i] = xs[xpad(i)];
    router_rows<FMT>(p, xs, usum, blockIdx.x, gate_block);
    // Without a ticket the tensor-core gate/up selects, in every block (moe_tc.cu): the logits
    // are all this kernel leaves.
    if (!p.counter) return;
    // The last block to finish selects (one block of 256 threads).
    if (!block_arrive_last((unsigned*)p.counter, gridDim.x)) return;
    __shared__ float4 sl4[MOE_MAX_E / 4];
    __shared__ int sel_id[MOE_MAX_A];
    __shared__ float sel_p[MOE_MAX_A];
    route(p, sl4, sel_id, sel_p, red, true);
    if (threadIdx.x == 0) *(u32*)p.counter = 0u;
}

// GateUpParams (shared with matvec_tc.cu): common.cuh.

// One lane group's rows j0, j0 + 1 of a gate/up matrix (gate rows at row0, up rows at row0 + n):
// act[j] = silu(gate_j)·up_j. Every lane of the warp must call it (group_sum), j0 past n or not.
template <int FMT>
__device__ __forceinline__ void gate_up_pair(const MatrixRef& m, i64 row0, int n, int j0, const float* xs,
                                             const float* usum, int units, int lane, int width, int upg, float* act) {
    const int j1 = j0 + 1;
    const int c0 = min(j0, n - 1), c1 = min(j1, n - 1);
    const RowPtr rows[4] = {row_ptr(m, row0 + c0), row_ptr(m, row0 + c1), row_ptr(m, row0 + n + c0),
                            row_ptr(m, row0 + n + c1)};
    float acc[4] = {};
    rows_dot<FMT, 4, 2>(rows, xs, usum, units, lane, width, upg, acc);
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] = group_sum(acc[i], width);
    if (lane == 0 && j0 < n) act[j0] = silu_f(acc[0]) * acc[2];
    if (lane == 0 && j1 < n) act[j1] = silu_f(acc[1]) * acc[3];
}

template <int FMT>
__device__ __forceinline__ void gate_up_body(const GateUpParams& p) {
    typedef Fmt<FMT> F;
    extern __shared__ float4 smem4[];
    float* xs = (float*)smem4;
    float* usum = xs + xpad_len(p.D);
    __shared__ float red[32];
    griddep_enter();
    stage_input<F::AFFINE ? F::W : 0>((const float*)p.x, (const float*)p.norm_gain, p.eps, p.D, xs, usum, red);
    const int slot = blockIdx.y + p.slot_offset;
    const bool routed = slot < p.A;
    const int n = routed ? p.I : p.Is;
    const MatrixRef m = routed ? p.experts : p.shared; // by value: stays in registers
    const i64 row0 = routed ? (i64)((const int*)p.topk_ids)[slot] * 2 * p.I : 0;
    const int units = p.D / F::W, width = lanes_per_row(units);
    const int group = threadIdx.x / width, lane = threadIdx.x % width;
    const int pairs_per_pass = blockDim.x / width * 2;
    for (int base = blockIdx.x * pairs_per_pass; base < n; base += gridDim.x * pairs_per_pass)
        gate_up_pair<FMT>(m, row0, n, base + group * 2, xs, usum, units, lane, width,
                          F::AFFINE ? p.group_size / F::W : 1, (float*)p.act + (i64)slot * p.act_stride);
}

// DownParams (shared with moe_tc.cu): common.cuh.

#define DOWN_ROWS 2 // output rows per warp
#define DOWN_UNITS 5 // units per row in flight per lane: 9 slots × 16 q4 units fit one pass of 32 lanes

// One warp's DOWN_ROWS output rows from r0: h[r] += Σ over the slots [slot_begin, slot_end) of
// w_s · down_s[r]·act_s, with the activations and their unit sums staged in shared memory and the
// slots' experts and weights in slot_expert / slot_weight.
template <int FMT>
__device__ __forceinline__ void down_rows(const DownParams& p, const float* acts, const float* usum,
                                          const int* slot_expert, const float* slot_weight, int r0) {
    typedef Fmt<FMT> F;
    const int lane = threadIdx.x & 31;
    if (r0 >= p.D) return;
    const int pitch = xpad_len(p.act_stride);
    const int upr = p.act_stride / F::W; // units per activation row
    int r[DOWN_ROWS];
#pragma unroll
    for (int i = 0; i < DOWN_ROWS; ++i) r[i] = min(r0 + i, p.D - 1);
    const int units_r = p.I / F::W, units_s = p.Is / F::W;
    const int routed_end = min(p.slot_end, p.A);
    const int n_routed = max(0, routed_end - p.slot_begin);
    const int total = n_routed * units_r + (p.slot_end > p.A ? units_s : 0);
    const int upg_r = F::AFFINE ? p.group_size / F::W : 1;
    const MatrixRef ex = p.experts, sh = p.shared; // by value: no local-memory copies in the loop
    float acc[DOWN_ROWS] = {};
    for (int f0 = lane; f0 < total; f0 += DOWN_UNITS * 32) {
        uint4 w[DOWN_UNITS][DOWN_ROWS];
        float2 sb[DOWN_UNITS][DOWN_ROWS];
#pragma unroll
        for (int k = 0; k < DOWN_UNITS; ++k) {
            const int f = f0 + k * 32;
            if (f < total) {
                const bool is_routed = f < n_routed * units_r;
                const int s = is_routed ? f / units_r : n_routed;
                const int unit = is_routed ? f - s * units_r : f - n_routed * units_r;
#pragma unroll
                for (int i = 0; i < DOWN_ROWS; ++i) {
                    const RowPtr row = is_routed ? row_ptr(ex, (i64)slot_expert[s] * p.D + r[i]) : row_ptr(sh, r[i]);
                    w[k][i] = ldg16(row.data + (i64)unit * 16);
                    if (F::AFFINE) sb[k][i] = row_group_params(row, unit / upg_r);
                }
            }
        }
#pragma unroll
        for (int k = 0; k < DOWN_UNITS; ++k) {
            const int f = f0 + k * 32;
            if (f < total) {
                const bool is_routed = f < n_routed * units_r;
                const int s = is_routed ? f / units_r : n_routed;
                const int unit = is_routed ? f - s * units_r : f - n_routed * units_r;
                float q[DOWN_ROWS];
                UnitDot<FMT, DOWN_ROWS>::run(w[k], acts + s * pitch + xpad(unit * F::W), q);
                if (FMT == FMT_Q4) // UnitDot<Q4> returned Σ (16 + q)·x
#pragma unroll
                    for (int i = 0; i < DOWN_ROWS; ++i) q[i] = fmaf(-Q4_OFFSET, usum[s * upr + unit], q[i]);
                const float sw = slot_weight[s];
#pragma unroll
                for (int i = 0; i < DOWN_ROWS; ++i) {
                    const float dot = F::AFFINE ? fmaf(sb[k][i].x, q[i], sb[k][i].y * usum[s * upr + unit]) : q[i];
                    acc[i] = fmaf(sw, dot, acc[i]);
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < DOWN_ROWS; ++i) {
        const float v = warp_sum(acc[i]);
        if (lane == 0 && r0 + i < p.D) ((float*)p.h)[r0 + i] = ldcg_f32((const float*)p.h + r0 + i) + v;
    }
}

template <int FMT>
__device__ __forceinline__ void down_body(const DownParams& p) {
    typedef Fmt<FMT> F;
    // [slots, xpad_len(act_stride)] activations for slots [slot_begin, slot_end), then their Σ per
    // unit [slots, act_stride / W]
    extern __shared__ float4 smem4[];
    float* acts = (float*)smem4;
    __shared__ int slot_expert[MOE_MAX_A + 1];
    __shared__ float slot_weight[MOE_MAX_A + 1];
    griddep_enter();
    route_acc_clear(p);
    const int nslots = p.slot_end - p.slot_begin, pitch = xpad_len(p.act_stride);
    float* usum = acts + nslots * pitch;
    for (int s = threadIdx.x; s < nslots; s += blockDim.x) {
        const int slot = p.slot_begin + s;
        slot_expert[s] = slot < p.A ? ((const int*)p.topk_ids)[slot] : 0;
        slot_weight[s] = slot < p.A ? ((const float*)p.topk_w)[slot] : *(const float*)p.shared_w;
    }
    // act_stride % 32 == 0 (the launcher checks), so the flat padded layout puts slot s's row at
    // s·pitch and its unit sums at s·upr; its closing barrier also publishes slot_expert/weight
    stage_input<F::AFFINE ? F::W : 0>((const float*)p.act + (i64)p.slot_begin * p.act_stride, nullptr, 0.0f,
                                      nslots * p.act_stride, acts, usum, nullptr);
    const int warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    down_rows<FMT>(p, acts, usum, slot_expert, slot_weight, (blockIdx.x * nwarps + warp) * DOWN_ROWS);
}

// gate/up keeps the explicit minimum of 1 block per SM it was measured and parity-checked with
// (ptxas allocates differently without it: scripts/kernel-diff.py).
#define MOE_KERNELS(suffix, FMT) \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS) moe_router_##suffix(const RouterParams p) { router_body<FMT>(p); } \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS, 1) moe_gate_up_##suffix(const GateUpParams p) { gate_up_body<FMT>(p); } \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS) moe_down_##suffix(const DownParams p) { down_body<FMT>(p); }
MOE_KERNELS(f32, FMT_F32)
MOE_KERNELS(bf16, FMT_BF16)
MOE_KERNELS(f16, FMT_F16)
MOE_KERNELS(q4, FMT_Q4)
MOE_KERNELS(q8, FMT_Q8)

// Layouts shared with the Rust launchers (tests/layouts.rs checks the same sizes).
static_assert(sizeof(RouterParams) == 128, "RouterParams layout differs from its Rust twin");
static_assert(sizeof(GateUpParams) == 128, "GateUpParams layout differs from its Rust twin");
static_assert(sizeof(DownParams) == 152, "DownParams layout differs from its Rust twin");
