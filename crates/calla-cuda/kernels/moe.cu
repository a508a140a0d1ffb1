// moe.cu: the sparse MoE block for one decode token, in three launches, routing on the device.
//
// Math (CPU reference: calla_cpu::moe; HF Qwen3_5MoeSparseMoeBlock):
//   x̂ = rmsnorm₀(h)·(1 + post_attention_layernorm)
//   logits = router·x̂ [E];  p = softmax(logits);  top-A by p (ties: lowest expert id)
//   w_k = p_k / Σ_sel p (norm_topk_prob) or p_k;   sg = sigmoid(shared_expert_gate·x̂) (1 without a gate)
//   act_k = silu(gate_k·x̂) ⊙ (up_k·x̂)                   for the A routed experts and the shared one
//   h ← h + Σ_k w_k · down_k·act_k + sg · down_shared·act_shared
// A dense SwiGLU MLP (Qwen3.5 dense) is the same with only the "shared" slot, weight 1.
//
// moe_router_*:  grid ⌈(E+1)/8⌉ blocks × 256 threads, one warp per router row (+ the shared-gate row);
//                each block normalises h itself (D·4 bytes from L2). The last block to finish (atomic
//                ticket) does softmax + top-A in one warp and resets the ticket: no host round trip.
// moe_gate_up_*: grid (⌈I/8⌉, slots), 256 threads; warp = one row j of one slot: gate_j and up_j dots,
//                act[slot, j] = silu(gate_j)·up_j. Expert ids are read from the device top-A list.
// moe_down_*:    grid ⌈D/8⌉, 256 threads, smem slots·xpad_len(act_stride) floats; warp = one output row r: Σ over slots and units (flattened,
//                so K = I = 512 still keeps 32 lanes busy), weighted per slot; h[r] += result.
// Bytes per token (real shape, q4): router E·D·(8 bits) + 9·3·I·D·4.5 bits ≈ 15.9 MB per layer.

#define MOE_THREADS 256
#define MOE_MAX_E 1024
#define MOE_MAX_A 32

struct RouterParams {
    u64 h;           // [D]
    u64 norm_gain;   // [D] = 1 + post_attention_layernorm
    MatrixRef router;// [E, D]
    u64 shared_gate; // [D] f32, or 0
    u64 xn;          // out [D]: x̂ for the expert kernels
    u64 logits;      // scratch [E + 1]
    u64 topk_ids;    // out [A] i32
    u64 topk_w;      // out [A] f32
    u64 shared_w;    // out [1] f32
    u64 counter;     // u32 ticket, 0 between launches
    int D, E, A, norm_topk, group_size;
    float eps;
};

template <int FMT>
__device__ __forceinline__ void router_body(const RouterParams& p) {
    extern __shared__ float xs[];
    __shared__ float red[32];
    __shared__ int is_last;
    griddep_launch_dependents();
    griddep_wait();
    load_input((const float*)p.h, (const float*)p.norm_gain, p.eps, p.D, xs, red);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    float* logits = (float*)p.logits;
    if (blockIdx.x == 0)
        for (int i = threadIdx.x; i < p.D; i += blockDim.x) ((float*)p.xn)[i] = xs[xpad(i)];
    const int row = blockIdx.x * nwarps + warp;
    if (row < p.E) {
        const float acc = warp_sum(row_dot_partial<FMT>(p.router, row, xs, p.D, lane, 32, p.group_size));
        if (lane == 0) logits[row] = acc;
    } else if (row == p.E && p.shared_gate) {
        const float* sg = (const float*)p.shared_gate;
        float acc = 0.0f;
        for (int i = lane; i < p.D; i += 32) acc = fmaf(sg[i], xs[xpad(i)], acc);
        acc = warp_sum(acc);
        if (lane == 0) logits[row] = acc;
    }
    // Last block to finish selects.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd((u32*)p.counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    if (warp != 0) return;
    volatile float* vl = logits;
    __shared__ float sl[MOE_MAX_E];
    float mx = NEG_INF;
    for (int e = lane; e < p.E; e += 32) { sl[e] = vl[e]; mx = fmaxf(mx, sl[e]); }
    mx = warp_max(mx);
    float z = 0.0f;
    for (int e = lane; e < p.E; e += 32) z += expf(sl[e] - mx);
    z = warp_sum(z);
    __syncwarp();
    // top-A by repeated argmax (ties: lowest id)
    float sel_p[MOE_MAX_A];
    int sel_id[MOE_MAX_A];
    float sel_sum = 0.0f;
    for (int k = 0; k < p.A; ++k) {
        float best = NEG_INF;
        int best_id = 0x7fffffff;
        for (int e = lane; e < p.E; e += 32) {
            const float v = sl[e];
            if (v > best || (v == best && e < best_id)) { best = v; best_id = e; }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, best_id, o);
            if (ov > best || (ov == best && oi < best_id)) { best = ov; best_id = oi; }
        }
        const float pk = expf(best - mx) / z; // softmax probability of the selected expert
        if (k < MOE_MAX_A) { sel_p[k] = pk; sel_id[k] = best_id; }
        sel_sum += pk;
        if (lane == 0) sl[best_id] = NEG_INF;
        __syncwarp();
    }
    if (lane == 0) {
        for (int k = 0; k < p.A; ++k) {
            ((int*)p.topk_ids)[k] = sel_id[k];
            ((float*)p.topk_w)[k] = p.norm_topk ? sel_p[k] / sel_sum : sel_p[k];
        }
        *(float*)p.shared_w = p.shared_gate ? sigmoid_f(vl[p.E]) : 1.0f;
        *(u32*)p.counter = 0u;
    }
}

struct GateUpParams {
    u64 x;             // [D] x̂ (or h when norm_gain is set)
    u64 norm_gain;     // [D] or 0: normalise x in the prologue (dense MLP path)
    MatrixRef experts; // [E·2I, D]: expert e's gate rows at e·2I, up rows at e·2I + I
    MatrixRef shared;  // [2Is, D]: gate rows then up rows
    u64 topk_ids;      // [A]
    u64 act;           // out [slots, act_stride]
    int D, I, Is, A, group_size, act_stride, slot_offset;
    float eps;
};

template <int FMT>
__device__ __forceinline__ void gate_up_body(const GateUpParams& p) {
    extern __shared__ float xs[];
    __shared__ float red[32];
    griddep_launch_dependents();
    griddep_wait();
    load_input((const float*)p.x, (const float*)p.norm_gain, p.eps, p.D, xs, red);
    const int slot = blockIdx.y + p.slot_offset;
    const bool routed = slot < p.A;
    const int n = routed ? p.I : p.Is;
    const MatrixRef m = routed ? p.experts : p.shared; // by value: stays in registers
    const i64 row0 = routed ? (i64)((const int*)p.topk_ids)[slot] * 2 * p.I : 0;
    const int width = lanes_per_row(p.D / Fmt<FMT>::W);
    const int rows_per_pass = blockDim.x / width;
    const int group = threadIdx.x / width, lane = threadIdx.x % width;
    for (int base = blockIdx.x * rows_per_pass; base < n; base += gridDim.x * rows_per_pass) {
        const int j = base + group;
        const bool valid = j < n;
        float g = valid ? row_dot_partial<FMT>(m, row0 + j, xs, p.D, lane, width, p.group_size) : 0.0f;
        float u = valid ? row_dot_partial<FMT>(m, row0 + n + j, xs, p.D, lane, width, p.group_size) : 0.0f;
        g = group_sum(g, width);
        u = group_sum(u, width);
        if (valid && lane == 0) ((float*)p.act)[(i64)slot * p.act_stride + j] = silu_f(g) * u;
    }
}

struct DownParams {
    u64 act;           // [slots, act_stride]
    MatrixRef experts; // [E·D, I]: expert e's rows at e·D
    MatrixRef shared;  // [D, Is]
    u64 topk_ids, topk_w, shared_w;
    u64 h;             // [D] in/out
    int D, I, Is, A, group_size, act_stride, slot_begin, slot_end;
};

template <int FMT>
__device__ __forceinline__ void down_body(const DownParams& p) {
    typedef Fmt<FMT> F;
    extern __shared__ float acts[]; // [slots, xpad_len(act_stride)] for slots [slot_begin, slot_end)
    griddep_launch_dependents();
    griddep_wait();
    const int nslots = p.slot_end - p.slot_begin, pitch = xpad_len(p.act_stride);
    for (int i = threadIdx.x; i < nslots * p.act_stride; i += blockDim.x) {
        const int s = i / p.act_stride, j = i - s * p.act_stride;
        acts[s * pitch + xpad(j)] = ((const float*)p.act)[(i64)p.slot_begin * p.act_stride + i];
    }
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    const int r = blockIdx.x * nwarps + warp;
    if (r >= p.D) return;
    const int units_r = p.I / F::W, units_s = p.Is / F::W;
    const int routed_end = min(p.slot_end, p.A);
    const int n_routed = max(0, routed_end - p.slot_begin);
    const int total = n_routed * units_r + (p.slot_end > p.A ? units_s : 0);
    const float sw = p.slot_end > p.A ? *(const float*)p.shared_w : 0.0f;
    float acc = 0.0f;
    const MatrixRef ex = p.experts, sh = p.shared; // by value: no local-memory copies in the loop
    for (int u = lane; u < total; u += 32) {
        const bool is_routed = u < n_routed * units_r;
        const int k = is_routed ? u / units_r : 0;
        const int slot = is_routed ? p.slot_begin + k : p.A;
        const int unit = is_routed ? u - k * units_r : u - n_routed * units_r;
        const i64 row = is_routed ? (i64)((const int*)p.topk_ids)[slot] * p.D + r : (i64)r;
        const float w = is_routed ? ((const float*)p.topk_w)[slot] : sw;
        const u64 data = is_routed ? ex.data : sh.data;
        const i64 row_bytes = is_routed ? ex.row_bytes : sh.row_bytes;
        const uint4 wq = ld_nc_16((const u8*)data + row * row_bytes + (i64)unit * 16);
        float scale = 1.0f, bias = 0.0f;
        if (F::AFFINE) {
            const float2 g = load_group_params(is_routed ? ex : sh, row, (unit * F::W) / p.group_size);
            scale = g.x;
            bias = g.y;
        }
        acc = fmaf(w, F::dot(wq, acts + (slot - p.slot_begin) * pitch + xpad(unit * F::W), scale, bias), acc);
    }
    acc = warp_sum(acc);
    if (lane == 0) ((float*)p.h)[r] += acc;
}

#define MOE_KERNELS(suffix, FMT) \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS) moe_router_##suffix(const RouterParams p) { router_body<FMT>(p); } \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS) moe_gate_up_##suffix(const GateUpParams p) { gate_up_body<FMT>(p); } \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS) moe_down_##suffix(const DownParams p) { down_body<FMT>(p); }
MOE_KERNELS(f32, FMT_F32)
MOE_KERNELS(bf16, FMT_BF16)
MOE_KERNELS(f16, FMT_F16)
MOE_KERNELS(q4, FMT_Q4)
MOE_KERNELS(q8, FMT_Q8)

// Layouts shared with the Rust launchers (tests/layouts.rs checks the same sizes).
static_assert(sizeof(RouterParams) == 128, "RouterParams layout differs from its Rust twin");
static_assert(sizeof(GateUpParams) == 128, "GateUpParams layout differs from its Rust twin");
static_assert(sizeof(DownParams) == 136, "DownParams layout differs from its Rust twin");
