// deltanet_general.cu: the Gated DeltaNet for head dims the compiled kernels do not cover (Dk not in
// {32, 64, 128, 256}, or a Dv beyond deltanet.cu's 256; on the prompt path Dk > 128 or a Dk/Dv not a
// multiple of 4), so every checkpoint the CPU engine runs also runs here. Correct for any
// 1 ≤ Dk, Dv ≤ 512 and 1 to 8 conv taps (the launchers check: deltanet_general.rs MAX_DIM); speed
// is secondary (the real models' dims keep deltanet.cu and deltanet_prefill.cu). Dims are read from
// the parameters; key entries are strided over the lanes (entry e on lane e mod 32, bound-checked),
// so no dim needs to be a multiple of anything.
//
// Math: as deltanet.cu (decode) and deltanet_prefill.cu (prompt); CPU reference
// calla_cpu::deltanet (`deltanet_decode_step`, Rule::Recurrent). Per value head h, key head
// kh = h / (Hv/Hk), value column j:  S_j ← α S_j;  δ_j = β (v_j − S_j·k);  S_j ← S_j + δ_j k;
// o_j = S_j·q; α = exp(−exp(A_log)·softplus(a + dt_bias)), β = sigmoid(b). State S [Hv, Dv, Dk] f32
// (the decode layout), conv ring [K, C] f32 (slot p mod K holds x[p]).
//
// Kernels (module "deltanet_general"; the launcher is deltanet_general.rs):
//   dngen_decode        grid Hv, block 256: one decode step, one block per value head, the gated
//                       RMSNorm in the block (what deltanet_decode_kplN computes).
//   dngen_decode_parts  grid Hv·8, block 256: block b owns value columns [r·Dv/8, (r+1)·Dv/8) of head
//                       b/8 (r = b mod 8) and leaves w·o·silu(z) in y and its Σo² at y[Hv·Dv + b]:
//                       the out-projection finishes the norm (deltanet.cu's DN_OUT_PARTS layout).
// Dynamic shared memory (the launchers size it): 2·Dk + 2·Dv + 64 floats.

#define DNG_THREADS 256
#define DNG_WARPS (DNG_THREADS / 32)
#define DNG_SPLIT 8   // blocks per value head of dngen_decode_parts (= deltanet.cu's DN_SPLIT)

// The same bytes as deltanet.cu's DeltaNetParams (the Rust twin is deltanet::DeltaNetParams).
struct DngParams {
    u64 qkv;     // [C] projection output, pre-conv
    u64 z;       // [Hv·Dv]
    u64 b;       // [Hv]
    u64 a;       // [Hv]
    u64 conv_w;  // [C, K] f32
    u64 a_log;   // [Hv] f32
    u64 dt_bias; // [Hv] f32
    u64 norm_w;  // [Dv] f32
    u64 cursor;  // Cursor*
    i64 conv_off;  // bytes from state_base to this layer's conv ring
    i64 state_off; // bytes from state_base to this layer's S
    u64 y;       // [Hv·Dv] out (then the parts, dngen_decode_parts)
    int Hk, Hv, Dk, Dv, K;
    float eps;
    float q_scale; // Dk^−½, computed on the host as the CPU does
    int pad;
};

extern __shared__ float dng_sm[]; // every kernel's dynamic shared memory (layouts below)

__device__ __forceinline__ float dng_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// One decode item: value head item / SPLIT, its value columns [j0, j0 + n) with
// j0 = r·Dv/SPLIT, r = item mod SPLIT. PARTS: y ← w·o·silu(z) and the block's Σo² at y[Hv·Dv + item];
// else (SPLIT = 1) y ← the gated RMSNorm of o.
template <int SPLIT, bool PARTS>
__device__ __forceinline__ void dngen_decode_item(const DngParams& p, int item) {
    const int Dk = p.Dk, Dv = p.Dv;
    float* q_s = dng_sm;         // [Dk]
    float* k_s = q_s + Dk;       // [Dk]
    float* v_s = k_s + Dk;       // [Dv] (the block's n columns)
    float* o_s = v_s + Dv;       // [Dv]
    float* red = o_s + Dv;       // [64]
    const int h = item / SPLIT, rank = item % SPLIT;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int ratio = p.Hv / p.Hk, kh = h / ratio;
    const int C = 2 * p.Hk * Dk + p.Hv * Dv;
    const int j0 = rank * Dv / SPLIT, n = (rank + 1) * Dv / SPLIT - j0;
    const Cursor cur = *(const Cursor*)p.cursor;
    const int pos = cur.pos, K = p.K;

    // 1. conv over the head's q (Dk), k (Dk) and this block's v (n) channels → silu → shared memory.
    //    The ring slot of x[pos] is written (q/k channels by one block of the key head, v channels by
    //    their owner) and read by no block of this step.
    float* ring = (float*)(cur.state_base + p.conv_off);
    const float* qkv = (const float*)p.qkv;
    const float* conv_w = (const float*)p.conv_w;
    const bool writes_qk = (h % ratio) == 0 && rank == 0;
    const int own_slot = pos % K;
    for (int i = tid; i < 2 * Dk + n; i += DNG_THREADS) {
        int c;
        if (i < Dk) c = kh * Dk + i;
        else if (i < 2 * Dk) c = p.Hk * Dk + kh * Dk + (i - Dk);
        else c = 2 * p.Hk * Dk + h * Dv + j0 + (i - 2 * Dk);
        const float x_new = qkv[c];
        float acc = 0.0f;
        int sl = ((pos - (K - 1)) % K + K) % K; // ring slot of x[pos − K + 1 + t], t = 0
        for (int t = 0; t < K - 1; ++t) {
            acc += conv_w[(i64)c * K + t] * ring[(i64)sl * C + c];
            sl = sl + 1 == K ? 0 : sl + 1;
        }
        acc += conv_w[(i64)c * K + K - 1] * x_new; // tap K−1 multiplies the newest input
        const float u = silu_f(acc);
        if (i < Dk) q_s[i] = u;
        else if (i < 2 * Dk) k_s[i - Dk] = u;
        else v_s[i - 2 * Dk] = u;
        if (i >= 2 * Dk || writes_qk) ring[(i64)own_slot * C + c] = x_new;
    }
    __syncthreads();

    // 2. L2-normalise q and k (q also scaled by Dk^−½), in shared memory.
    float sq = 0.0f, sk = 0.0f;
    for (int i = tid; i < Dk; i += DNG_THREADS) { sq += q_s[i] * q_s[i]; sk += k_s[i] * k_s[i]; }
    sq = warp_sum(sq);
    sk = warp_sum(sk);
    if (lane == 0) { red[warp] = sq; red[32 + warp] = sk; }
    __syncthreads();
    float tq = 0.0f, tk = 0.0f;
    for (int w = 0; w < DNG_WARPS; ++w) { tq += red[w]; tk += red[32 + w]; }
    const float q_inv = 1.0f / sqrtf(tq + 1e-6f), k_inv = 1.0f / sqrtf(tk + 1e-6f);
    __syncthreads(); // every thread has read q_s/k_s's raw values and red
    for (int i = tid; i < Dk; i += DNG_THREADS) { q_s[i] = q_s[i] * q_inv * p.q_scale; k_s[i] = k_s[i] * k_inv; }
    // 3. gates
    const float g = -expf(((const float*)p.a_log)[h]) * dng_softplus(((const float*)p.a)[h] + ((const float*)p.dt_bias)[h]);
    const float alpha = expf(g), beta = sigmoid_f(((const float*)p.b)[h]);
    __syncthreads();

    // 4. the delta rule: warp w takes local columns w, w + 8, …; lane holds key entries lane + 32i.
    float* S = (float*)(cur.state_base + p.state_off) + ((i64)h * Dv + j0) * Dk;
    for (int j = warp; j < n; j += DNG_WARPS) {
        float* col = S + (i64)j * Dk;
        float kv = 0.0f;
        for (int e = lane; e < Dk; e += 32) kv = fmaf(col[e] * alpha, k_s[e], kv); // (αS)ᵀk
        kv = warp_sum(kv);
        const float delta = (v_s[j] - kv) * beta; // δ = β(v − Sᵀk)
        float o = 0.0f;
        for (int e = lane; e < Dk; e += 32) {
            const float s = fmaf(k_s[e], delta, col[e] * alpha); // S ← αS + kδ
            col[e] = s;
            o = fmaf(s, q_s[e], o);
        }
        o = warp_sum(o);
        if (lane == 0) o_s[j] = o;
    }
    __syncthreads();

    // 5. the gated RMSNorm (or its parts): y = w · o/√(mean(o²) + eps) · silu(z).
    float ss = 0.0f;
    for (int j = tid; j < n; j += DNG_THREADS) ss += o_s[j] * o_s[j];
    const float sumsq = block_sum(ss, red);
    const float* z = (const float*)p.z + (i64)h * Dv + j0;
    const float* nw = (const float*)p.norm_w + j0;
    float* y = (float*)p.y + (i64)h * Dv + j0;
    if (PARTS) {
        for (int j = tid; j < n; j += DNG_THREADS) y[j] = nw[j] * o_s[j] * silu_f(z[j]);
        if (tid == 0) ((float*)p.y)[(i64)p.Hv * Dv + item] = sumsq;
    } else {
        const float o_inv = 1.0f / sqrtf(sumsq / (float)Dv + p.eps);
        for (int j = tid; j < n; j += DNG_THREADS) y[j] = nw[j] * (o_s[j] * o_inv) * silu_f(z[j]);
    }
}

extern "C" __global__ void __launch_bounds__(DNG_THREADS) dngen_decode(const DngParams p) {
    griddep_enter(); // cursor, projections and state come from earlier kernels
    dngen_decode_item<1, false>(p, blockIdx.x);
}

extern "C" __global__ void __launch_bounds__(DNG_THREADS) dngen_decode_parts(const DngParams p) {
    griddep_enter();
    dngen_decode_item<DNG_SPLIT, true>(p, blockIdx.x);
}


// Layouts shared with the Rust launchers.
static_assert(sizeof(DngParams) == 128, "DngParams layout differs from its Rust twin (deltanet::DeltaNetParams)");
