// moe_prefill.cu: routing for a prompt of T tokens, entirely on the device: top-A per token, a
// counting sort of the (token, slot) pairs by expert, the grouped-GEMM tile map, and the final
// weighted combine. The expert products themselves are gemm.cu launches (grouped gate/up with the
// SwiGLU epilogue, grouped down), so the whole block is 8 launches and no host round trip.
//
// Math (CPU reference: calla_cpu::moe::Moe::forward, `route`):
//   p = softmax(logits[t]) over E;  top-A by p (ties: lowest id);  w = p / Σ_sel p (norm_topk) or p
//   sg[t] = sigmoid(shared_gate · x̂[t])  (1 without a gate)
//   h[t] += Σ_k w[t,k] · down_{e(t,k)}(silu(gate_e x̂) ⊙ up_e x̂) + sg[t] · shared(x̂[t])
// Layouts: logits [T, E] f32; ids, weights [T, A]; counts/offsets/cursor [E(+1)]; tile_map int4
//   {expert, m0, m1, 0}; sorted_token [T·A] (token of each sorted slot); slot_of [T·A] (sorted slot
//   of (t, k)); y_slot [T·A, D] f32 (down output per slot, unweighted).
// prefill_moe_topk:    grid ⌈T/8⌉, block 256, one warp per token; smem 8·E floats. Counts
//                      experts with atomics into `counts` (zero on entry; the scan re-zeroes it).
// prefill_moe_scan:    grid 1, block 1024 (E ≤ 1024): exclusive scans of counts and of tiles per
//                      expert (⌈count/BM⌉), the tile map, cursors; resets counts to 0.
// prefill_moe_scatter: grid ⌈T·A/256⌉: slot = atomicAdd(cursor[e]); order inside an expert is
//                      arbitrary but each row's arithmetic is independent of it.
// prefill_moe_combine: grid T, block 256: fixed order over k, so the sum is deterministic.

#define MOEP_TOKENS_PER_BLOCK 8

struct MoepTopkParams {
    u64 logits;        // [T, E]
    u64 xn_hi, xn_lo;  // [T, D] bf16 planes (x̂, for the shared gate)
    u64 shared_gate;   // [D] f32 or 0
    u64 ids;           // i32 [T, A]
    u64 weights;       // f32 [T, A]
    u64 shared_w;      // f32 [T]
    u64 counts;        // u32 [E]
    int T, E, A, D, norm_topk, pad;
};

extern "C" __global__ void __launch_bounds__(256) prefill_moe_topk(const MoepTopkParams p) {
    extern __shared__ float ex_all[]; // [8, E]: e^{l − max}, selected entries set to −1
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int t = blockIdx.x * MOEP_TOKENS_PER_BLOCK + warp;
    if (t >= p.T) return;
    float* ex = ex_all + warp * p.E;
    const float* l = (const float*)p.logits + (i64)t * p.E;
    float mx = NEG_INF;
    for (int e = lane; e < p.E; e += 32) mx = fmaxf(mx, l[e]);
    mx = warp_max(mx);
    float z = 0.0f;
    for (int e = lane; e < p.E; e += 32) {
        const float v = expf(l[e] - mx);
        ex[e] = v;
        z += v;
    }
    z = warp_sum(z);
    __syncwarp();
    int* ids = (int*)p.ids + (i64)t * p.A;
    float* ws = (float*)p.weights + (i64)t * p.A;
    float sel_sum = 0.0f;
    for (int k = 0; k < p.A; ++k) {
        float best = -1.0f;
        int best_id = 0x7fffffff;
        for (int e = lane; e < p.E; e += 32) {
            const float v = ex[e];
            if (v > best || (v == best && e < best_id)) { best = v; best_id = e; }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, best_id, o);
            if (ov > best || (ov == best && oi < best_id)) { best = ov; best_id = oi; }
        }
        const float pk = best / z; // softmax probability
        sel_sum += pk;
        if (lane == 0) {
            ids[k] = best_id;
            ws[k] = pk;
            ex[best_id] = -1.0f;
            atomicAdd((u32*)p.counts + best_id, 1u);
        }
        __syncwarp();
    }
    if (p.norm_topk && lane == 0)
        for (int k = 0; k < p.A; ++k) ws[k] = ws[k] / sel_sum;
    float sg = 1.0f;
    if (p.shared_gate) {
        const u16* hi = (const u16*)p.xn_hi + (i64)t * p.D;
        const u16* lo = p.xn_lo ? (const u16*)p.xn_lo + (i64)t * p.D : (const u16*)0;
        const float* w = (const float*)p.shared_gate;
        float acc = 0.0f;
        for (int i = lane; i < p.D; i += 32) acc = fmaf(w[i], load_planes(hi, lo, i), acc);
        sg = sigmoid_f(warp_sum(acc));
    }
    if (lane == 0) ((float*)p.shared_w)[t] = sg;
}

struct MoepScanParams {
    u64 counts;     // u32 [E], reset to 0 here
    u64 offsets;    // i32 [E + 1]
    u64 cursor;     // i32 [E]
    u64 tile_map;   // int4 [max_tiles]
    u64 tile_count; // i32
    int E, bm, max_tiles, pad;
};

// Exclusive scan over the block (blockDim.x ≤ 1024); returns the prefix, `total` gets the sum.
__device__ __forceinline__ int block_exclusive_scan(int v, int* warp_sums, int& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    int inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int n = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += n;
    }
    __syncthreads();
    if (lane == 31) warp_sums[warp] = inc;
    __syncthreads();
    int before = 0, all = 0;
    for (int w = 0; w < nwarps; ++w) {
        if (w < warp) before += warp_sums[w];
        all += warp_sums[w];
    }
    total = all;
    return before + inc - v;
}

extern "C" __global__ void __launch_bounds__(1024) prefill_moe_scan(const MoepScanParams p) {
    __shared__ int warp_sums[32];
    const int e = threadIdx.x;
    const int count = e < p.E ? (int)((u32*)p.counts)[e] : 0;
    const int ntiles = (count + p.bm - 1) / p.bm;
    int total_rows, total_tiles;
    const int off = block_exclusive_scan(count, warp_sums, total_rows);
    const int toff = block_exclusive_scan(ntiles, warp_sums, total_tiles);
    if (e < p.E) {
        ((int*)p.offsets)[e] = off;
        ((int*)p.cursor)[e] = off;
        ((u32*)p.counts)[e] = 0u;
        for (int i = 0; i < ntiles && toff + i < p.max_tiles; ++i)
            ((int4*)p.tile_map)[toff + i] = make_int4(e, off + i * p.bm, off + count, 0);
    }
    if (e == 0) {
        ((int*)p.offsets)[p.E] = total_rows;
        *(int*)p.tile_count = min(total_tiles, p.max_tiles);
    }
}

struct MoepScatterParams {
    u64 ids;          // i32 [T, A]
    u64 cursor;       // i32 [E]
    u64 sorted_token; // i32 [T·A]
    u64 slot_of;      // i32 [T·A]
    int T, A;
};

extern "C" __global__ void __launch_bounds__(256) prefill_moe_scatter(const MoepScatterParams p) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= p.T * p.A) return;
    const int e = ((const int*)p.ids)[i];
    const int slot = atomicAdd((int*)p.cursor + e, 1);
    ((int*)p.sorted_token)[slot] = i / p.A;
    ((int*)p.slot_of)[i] = slot;
}

struct MoepCombineParams {
    u64 h;        // [T, D] f32, in/out
    u64 y_slot;   // [T·A, D] f32, or f16 when y_f16 (the down product in half precision)
    u64 slot_of;  // i32 [T, A]
    u64 weights;  // f32 [T, A]
    int T, A, D, y_f16;
};

// Four values of slot row `row` from column d (f32 or f16 rows).
__device__ __forceinline__ float4 moep_slot4(const MoepCombineParams& p, i64 row, int d) {
    if (!p.y_f16) return *(const float4*)((const float*)p.y_slot + row * p.D + d);
    const uint2 v = *(const uint2*)((const u16*)p.y_slot + row * p.D + d);
    return make_float4(f16_lo(v.x), f16_hi(v.x), f16_lo(v.y), f16_hi(v.y));
}

extern "C" __global__ void __launch_bounds__(256) prefill_moe_combine(const MoepCombineParams p) {
    const int t = blockIdx.x;
    const int* slots = (const int*)p.slot_of + (i64)t * p.A;
    const float* w = (const float*)p.weights + (i64)t * p.A;
    float* h = (float*)p.h + (i64)t * p.D;
    // four columns per thread (D % 4 == 0, checked by the launcher); k in fixed order: deterministic
    for (int d = threadIdx.x * 4; d < p.D; d += blockDim.x * 4) {
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int k = 0; k < p.A; ++k) {
            const float4 y = moep_slot4(p, slots[k], d);
            acc.x = fmaf(w[k], y.x, acc.x);
            acc.y = fmaf(w[k], y.y, acc.y);
            acc.z = fmaf(w[k], y.z, acc.z);
            acc.w = fmaf(w[k], y.w, acc.w);
        }
        float4 hv = *(float4*)(h + d);
        hv.x += acc.x;
        hv.y += acc.y;
        hv.z += acc.z;
        hv.w += acc.w;
        *(float4*)(h + d) = hv;
    }
}
