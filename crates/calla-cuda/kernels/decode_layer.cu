// decode_layer.cu: one decoder layer's decode step as one persistent launch (docs/persistent-decode.md).
// Compiled after matvec.cu, deltanet.cu and moe.cu (kernels.rs): its phases are their device
// functions, so the arithmetic is the chain's, phase by phase. Kernel boundaries become grid barriers
// (common.cuh, ~1.4 µs). Opt-in (CALLA_DECODE=layer): measured slower than the chain of launches
// (226 vs 333 tok/s; an empty launch costs only ~0.8 µs in the graph, and the phases kept every
// dependent chain of the kernels they replace: docs/performance.md, "Session 3").
//
// Phases (a grid barrier after each but the last):
//   1. in-projections: qkv|z|b|a = W_in · rmsnorm(h)·gain                      (DeltaNet layers only)
//   2. the DeltaNet recurrence, (value head, column block) items; y ← o, not yet normalised
//   3. out-projection: h += W_out · x3, where x3 = the gated RMSNorm of (o, z) staged by every block
//      (DeltaNet), or the attention output (attention layers: their in-projection and attention ran
//      as the launches before this one, so the kernel starts here)
//   4. x̂ = rmsnorm(h)·post_gain; router rows (+ the shared-expert gate row) → logits; the last block
//      to arrive at the barrier routes (softmax + top-A, moe.cu `route`) and publishes the list
//      before it opens the barrier
//   5. gate/up rows of every slot (A routed + the shared expert) → act
//   6. down rows with the weighted combine: h += Σ w_s · down_s · act_s
// Data one block wrote and another reads inside the launch is read through L2 (ld.global.cg,
// volatile): L1 is not coherent between SMs.
// Launch: grid = every block resident at once (the launcher sizes it from the occupancy query;
//   otherwise the barrier never opens), block 256, dynamic smem = the largest phase's x̂ (padded)
//   and unit sums (see the launcher).

#define LAYER_THREADS 256
#define LAYER_DN_SPLIT 4 // DeltaNet column blocks per value head: 32 heads × 4 = 128 items ≤ 132 SMs

struct LayerParams {
    MatvecParams in;         // phase 1: x = h, norm gain = the input norm's, segments qkv|z|b|a
    DeltaNetParams dn;       // phase 2: y = o (unnormalised); z, norm_w, eps for phase 3's prologue
    MatvecParams out;        // phase 3: x = o (DeltaNet) or the attention output; accumulate into h
    MoePersistentParams moe; // phases 4–6; moe.sync is the barrier of every phase
    int first_phase;         // 1 (DeltaNet layer) or 3 (attention layer)
    int gated;               // phase 3 stages gated_rmsnorm(o, z) (DeltaNet) instead of x as it is
    int last_phase;          // 6; less only to time the phases (CALLA_LAYER_LAST_PHASE, wrong results)
    int pad;
    u64 timing;              // 0, or (lab, CALLA_LAYER_TIMING) u64 [LAYER_EVENTS][2][LAYER_TIMED_BLOCKS]
};

// Lab timing (CALLA_LAYER_TIMING=layer): thread 0 of each block stamps the SM clock at each event
// (and the global timer at the start only: reading it costs microseconds): 0 start, then per phase
// "work done" and "barrier passed" (1–2 in-proj, 3–4 DeltaNet, 5–6 out-proj, 7–8 router / routing,
// 9–10 gate/up, 11 down).
#define LAYER_EVENTS 12
#define LAYER_TIMED_BLOCKS 1024 // the buffer's width (decode_layer.rs MAX_TIMED_BLOCKS)
__device__ __forceinline__ void layer_stamp(const LayerParams& p, int event) {
    if (p.timing == 0 || threadIdx.x != 0) return;
    u64 clk, glob = 1;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(clk));
    if (event == 0) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(glob)); // slow: only at the start
    u64* t = (u64*)p.timing + (i64)event * 2 * LAYER_TIMED_BLOCKS;
    t[blockIdx.x] = clk;
    t[LAYER_TIMED_BLOCKS + blockIdx.x] = glob;
}

// usum[u] = Σ of the 32 floats of unit u of x (padded layout), u < n / 32, by the block's threads.
__device__ __forceinline__ void unit_sums32(const float* xs, int n, float* usum) {
    for (int u = threadIdx.x; u < n / 32; u += blockDim.x) {
        const float4* v = (const float4*)(xs + xpad(32 * u));
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const float4 a = v[i];
            sum += a.x + a.y + a.z + a.w;
        }
        usum[u] = sum;
    }
}

// x3[h·Dv + j] = norm_w[j] · o_hj / √(mean_j(o_h²) + eps) · silu(z_hj) into xs (padded), and Σ per
// 32-float unit (q4) into usum. A warp takes LAYER_NORM_HEADS heads at once, each lane one or two
// float4 of o and z per head, every load issued before any is used (one L2 round trip per batch; o
// and z were written in this launch: ld.cg). Needs Dv % 4 == 0 and Dv ≤ 256 (the launcher checks).
#define LAYER_NORM_HEADS 4
__device__ __forceinline__ void stage_gated_norm(const DeltaNetParams& p, float* xs, float* usum) {
    const float* o = (const float*)p.y;
    const float* z = (const float*)p.z;
    const float* w = (const float*)p.norm_w;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int quads = p.Dv / 4; // float4 per head
    const bool unit_sums_here = p.Dv % 32 == 0; // a unit's 8 float4 sit in 8 neighbouring lanes
    for (int h0 = warp * LAYER_NORM_HEADS; h0 < p.Hv; h0 += nwarps * LAYER_NORM_HEADS) {
        float4 ov[LAYER_NORM_HEADS][2], zv[LAYER_NORM_HEADS][2];
#pragma unroll
        for (int b = 0; b < LAYER_NORM_HEADS; ++b)
#pragma unroll
            for (int t = 0; t < 2; ++t) {
                const int q = lane + 32 * t;
                ov[b][t] = zv[b][t] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (h0 + b < p.Hv && q < quads) {
                    ov[b][t] = ldcg_f4((const float4*)(o + (i64)(h0 + b) * p.Dv) + q);
                    zv[b][t] = ldcg_f4((const float4*)(z + (i64)(h0 + b) * p.Dv) + q);
                }
            }
#pragma unroll
        for (int b = 0; b < LAYER_NORM_HEADS; ++b) {
            float ss = 0.0f;
#pragma unroll
            for (int t = 0; t < 2; ++t)
                ss += ov[b][t].x * ov[b][t].x + ov[b][t].y * ov[b][t].y + ov[b][t].z * ov[b][t].z + ov[b][t].w * ov[b][t].w;
            ss = warp_sum(ss);
            const float inv = 1.0f / sqrtf(ss / (float)p.Dv + p.eps);
#pragma unroll
            for (int t = 0; t < 2; ++t) {
                const int q = lane + 32 * t;
                const bool live = h0 + b < p.Hv && q < quads;
                float4 y = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (live) {
                    const float4 g = *(const float4*)(w + 4 * q);
                    y.x = g.x * (ov[b][t].x * inv) * silu_f(zv[b][t].x);
                    y.y = g.y * (ov[b][t].y * inv) * silu_f(zv[b][t].y);
                    y.z = g.z * (ov[b][t].z * inv) * silu_f(zv[b][t].z);
                    y.w = g.w * (ov[b][t].w * inv) * silu_f(zv[b][t].w);
                    *(float4*)(xs + xpad((h0 + b) * p.Dv + 4 * q)) = y;
                }
                if (unit_sums_here && t * 32 < quads) { // uniform over the warp
                    const float sum = group_sum(y.x + y.y + y.z + y.w, 8);
                    if (live && q % 8 == 0) usum[((h0 + b) * p.Dv + 4 * q) / 32] = sum;
                }
            }
        }
    }
    __syncthreads();
    if (!unit_sums_here) {
        unit_sums32(xs, p.Hv * p.Dv, usum); // Hv·Dv: a multiple of 32 (the launcher checks)
        __syncthreads();
    }
}

// Each phase is its own (not inlined) function, so ptxas allocates its registers alone: inlined
// into one body, values hoisted across phases pushed the kernel past 128 registers (spills at 2
// blocks per SM). The parameters stay where the launch put them (__grid_constant__: no local copy).
// Every phase ends with the block's threads in step (its last barrier or the grid's).

// Lab switches (CALLA_NVRTC_DEFINES): LAYER_INLINE inlines the phases and reads the launch's
// parameters directly; LAYER_MIN_BLOCKS sets the launch bounds' blocks per SM (register cap).
#if defined(LAYER_INLINE)
#define LAYER_PHASE __forceinline__
#else
#define LAYER_PHASE __noinline__
#endif
#ifndef LAYER_MIN_BLOCKS
#define LAYER_MIN_BLOCKS 2
#endif

// ---- phase 1: in-projections of rmsnorm(h)·gain
__device__ LAYER_PHASE void layer_in_proj(const LayerParams& p) {
    extern __shared__ float4 smem4[];
    float* xs = (float*)smem4;
    float* usum = xs + xpad_len(p.in.K);
    __shared__ float red[32];
    stage_input<32>((const float*)p.in.x, (const float*)p.in.norm_gain, p.in.eps, p.in.K, xs, usum, red);
    matvec_rows<FMT_Q4, 4, 2>(p.in, xs, usum);
}

// ---- phase 2: the recurrence, (value head, column block) items
template <int KPL>
__device__ LAYER_PHASE void layer_deltanet(const LayerParams& p) {
    for (int item = blockIdx.x; item < p.dn.Hv * LAYER_DN_SPLIT; item += gridDim.x)
        deltanet_decode_item<KPL, LAYER_DN_SPLIT, DN_OUT_RAW>(p.dn, item);
}

// ---- phase 3: out-projection (+ residual into h)
__device__ LAYER_PHASE void layer_out_proj(const LayerParams& p) {
    extern __shared__ float4 smem4[];
    float* xs = (float*)smem4;
    float* usum = xs + xpad_len(p.out.K);
    if (p.gated) stage_gated_norm(p.dn, xs, usum);
    else stage_input<32>((const float*)p.out.x, nullptr, 0.0f, p.out.K, xs, usum, nullptr);
    matvec_rows<FMT_Q4, 2, 4>(p.out, xs, usum);
}

// Shared memory of the MoE phases: x̂ and its unit sums (dynamic) stay from phase 4 to 5.
struct MoeShared {
    int slot_expert[MOE_MAX_A + 1];
    float slot_weight[MOE_MAX_A + 1];
};

// ---- phase 4: x̂ = rmsnorm(h)·post_gain, router rows → logits; then the last block to arrive routes
template <int RFMT>
__device__ LAYER_PHASE void layer_router(const LayerParams& p) {
    typedef Fmt<RFMT> FR;
    extern __shared__ float4 smem4[];
    float* xs = (float*)smem4;
    __shared__ float red[32];
    __shared__ float4 sl4[MOE_MAX_E / 4];
    __shared__ int sel_id[MOE_MAX_A];
    __shared__ float sel_p[MOE_MAX_A];
    const RouterParams& r = p.moe.r;
    const int D = r.D;
    float* usum_r = xs + xpad_len(D);
    stage_input<FR::AFFINE ? FR::W : 0>((const float*)r.h, (const float*)r.norm_gain, r.eps, D, xs, usum_r, red);
    if (FR::W != 32) unit_sums32(xs, D, usum_r + D / FR::W); // the experts' (q4) unit sums, after the router's
    const int width = lanes_per_row(D / FR::W);
    const int per_item = blockDim.x / width * ROUTER_ROWS;
    const int row_items = (r.E + per_item - 1) / per_item;
    const int items = row_items + (r.shared_gate ? 1 : 0);
    for (int item = blockIdx.x; item < items; item += gridDim.x)
        router_rows<RFMT>(r, xs, usum_r, item, item == row_items);
    layer_stamp(p, 7);
    u64 target = 0;
    if (grid_arrive(p.moe.sync, &target)) {
        route(r, sl4, sel_id, sel_p, red, true); // ends with a barrier after thread 0's stores
        grid_open(p.moe.sync, target);
    } else {
        grid_wait(p.moe.sync, target);
    }
}

// ---- phase 5: gate/up rows of every slot → act
template <int RFMT>
__device__ LAYER_PHASE void layer_gate_up(const LayerParams& p, MoeShared& sh) {
    extern __shared__ float4 smem4[];
    float* xs = (float*)smem4;
    const RouterParams& r = p.moe.r;
    const GateUpParams& g = p.moe.g;
    const int D = r.D;
    const float* usum_e = xs + xpad_len(D) + (Fmt<RFMT>::W != 32 ? D / Fmt<RFMT>::W : 0);
    const int nslots = p.moe.d.slot_end;
    for (int s = threadIdx.x; s < nslots; s += blockDim.x) {
        const bool routed = s < r.A;
        sh.slot_expert[s] = routed ? ((const volatile int*)r.topk_ids)[s] : 0;
        sh.slot_weight[s] = routed ? ((const volatile float*)r.topk_w)[s] : ((const volatile float*)r.shared_w)[0];
    }
    __syncthreads();
    const int units = D / 32, width = lanes_per_row(units);
    const int group = threadIdx.x / width, lane = threadIdx.x % width;
    const int pairs_per_pass = blockDim.x / width * 2;
    const int passes = (max(g.I, g.Is) + pairs_per_pass - 1) / pairs_per_pass;
    for (int item = blockIdx.x; item < nslots * passes; item += gridDim.x) {
        const int slot = item / passes, pass = item - slot * passes;
        const bool routed = slot < r.A;
        const int n = routed ? g.I : g.Is;
        if (pass * pairs_per_pass >= n) continue; // uniform across the block
        const MatrixRef m = routed ? g.experts : g.shared;
        const i64 row0 = routed ? (i64)sh.slot_expert[slot] * 2 * g.I : 0;
        gate_up_pair<FMT_Q4>(m, row0, n, pass * pairs_per_pass + group * 2, xs, usum_e, units, lane, width,
                             g.group_size / 32, (float*)g.act + (i64)slot * g.act_stride);
    }
}

// ---- phase 6: down rows, weighted combine, residual
__device__ LAYER_PHASE void layer_down(const LayerParams& p, const MoeShared& sh) {
    extern __shared__ float4 smem4[];
    float* xs = (float*)smem4;
    const DownParams& d = p.moe.d;
    const int nslots = d.slot_end;
    float* usum_d = xs + nslots * xpad_len(d.act_stride);
    stage_input<32>((const float*)d.act, nullptr, 0.0f, nslots * d.act_stride, xs, usum_d, nullptr);
    const int nwarps = blockDim.x >> 5, warp = threadIdx.x >> 5;
    const int items = (d.D + nwarps * DOWN_ROWS - 1) / (nwarps * DOWN_ROWS);
    for (int item = blockIdx.x; item < items; item += gridDim.x)
        down_rows<FMT_Q4>(d, xs, usum_d, sh.slot_expert, sh.slot_weight, (item * nwarps + warp) * DOWN_ROWS);
}

template <int KPL, int RFMT>
__device__ __forceinline__ void decode_layer_body(const LayerParams& param) {
    __shared__ MoeShared sh;
    // The phases read their parameters from a copy in shared memory: from the (non-inlined) phase
    // functions, the launch's parameter space is reachable only through generic loads.
#if defined(LAYER_INLINE)
    const LayerParams& p = param;
#else
    __shared__ LayerParams p;
    for (int i = threadIdx.x; i < (int)(sizeof(LayerParams) / 4); i += blockDim.x)
        ((u32*)&p)[i] = ((const u32*)&param)[i];
    __syncthreads();
#endif
    griddep_wait();
    layer_stamp(p, 0);
    // phase k runs when first_phase ≤ k ≤ last_phase (lab: CALLA_LAYER_FIRST_PHASE / _LAST_PHASE
    // time phases alone; the results are then wrong); a barrier separates each from the next
    const int first = p.first_phase, last = p.last_phase;
    if (first <= 1 && last >= 1) {
        layer_in_proj(p);
        layer_stamp(p, 1);
        if (last > 1) grid_barrier(p.moe.sync);
        layer_stamp(p, 2);
    }
    if (first <= 2 && last >= 2) {
        layer_deltanet<KPL>(p);
        layer_stamp(p, 3);
        if (last > 2) grid_barrier(p.moe.sync);
        layer_stamp(p, 4);
    }
    if (first <= 3 && last >= 3) {
        layer_out_proj(p);
        layer_stamp(p, 5);
        if (last > 3) grid_barrier(p.moe.sync);
        layer_stamp(p, 6);
    }
    if (first <= 4 && last >= 4) {
        layer_router<RFMT>(p);
        layer_stamp(p, 8);
    }
    if (first <= 5 && last >= 5) {
        layer_gate_up<RFMT>(p, sh);
        layer_stamp(p, 9);
        if (last > 5) grid_barrier(p.moe.sync);
        layer_stamp(p, 10);
    }
    if (first <= 6 && last >= 6) {
        if (first == 6) { // lab: the slots as the last routing left them
            for (int i = threadIdx.x; i < p.moe.d.slot_end; i += blockDim.x) {
                sh.slot_expert[i] = i < p.moe.r.A ? ((const volatile int*)p.moe.r.topk_ids)[i] : 0;
                sh.slot_weight[i] = 0.0f;
            }
            __syncthreads();
        }
        layer_down(p, sh);
        layer_stamp(p, 11);
    }
}

// decode_layer_kpl<Dk/32>_<router format>: q4 projections and experts (MLX 4-bit checkpoints and the
// synthetic q4 model), the router q8 or q4.
#define DECODE_LAYER_KERNEL(KPL, rs, RFMT) \
    extern "C" __global__ void __launch_bounds__(LAYER_THREADS, LAYER_MIN_BLOCKS) decode_layer_kpl##KPL##_##rs(const __grid_constant__ LayerParams p) { \
        decode_layer_body<KPL, RFMT>(p); \
    }
DECODE_LAYER_KERNEL(1, q8, FMT_Q8)
DECODE_LAYER_KERNEL(2, q8, FMT_Q8)
DECODE_LAYER_KERNEL(4, q8, FMT_Q8)
DECODE_LAYER_KERNEL(8, q8, FMT_Q8)
DECODE_LAYER_KERNEL(1, q4, FMT_Q4)
DECODE_LAYER_KERNEL(2, q4, FMT_Q4)
DECODE_LAYER_KERNEL(4, q4, FMT_Q4)
DECODE_LAYER_KERNEL(8, q4, FMT_Q4)

static_assert(LAYER_THREADS == MATVEC_THREADS && LAYER_THREADS == DN_THREADS && LAYER_THREADS == MOE_THREADS,
              "the phases' device functions assume one block shape");
// Layouts shared with the Rust launchers (tests/layouts.rs checks the same sizes).
static_assert(sizeof(LayerParams) == 1040, "LayerParams layout differs from its Rust twin");
