// matvec_tc.cuh: the tensor-core body of the q4 decode products (group 64, bf16 scale and bias),
// shared by matvec_tc.cu (the projections and lm_head) and moe_tc.cu (the MoE's gate/up and down):
// runtime/kernels.rs compiles it before each of them.
//
// The decode matrix-vector products for q4 weights (group 64, bf16 scale and bias) on the
// tensor cores, with the optional zero-centred RMSNorm of x fused in front:
//   matvec_tc_q4_c*:         y (+)= W·x̂, matvec.cu's contract (same parameter struct);
//   matvec_tc_gate_up_q4_c*: the MoE's act = silu(gate·x̂)·(up·x̂) for every slot, moe.cu's gate/up
//                            contract (same parameter struct, GateUpParams);
//   matvec_tc_down_q4:       the MoE's h += Σ_slots w·down·act, moe.cu's down contract (DownParams).
// matvec.cu's and moe.cu's kernels stay for the other formats, for widths these do not take, and as
// the reference they are tested against. One body (tc_body) serves the first two: a "map" says where
// a tile's rows are and what happens to its sums; down has its own (tc_down_body), on the same
// helpers (an encoding policy, TcBf16 or TcInt8: how x̂ is staged as the mma's B and how a chunk's
// products are taken). The Math and Layout below are TcBf16's, the form every product used up to
// session 17; all now run TcInt8 (its own comment: the same tiles and lanes, codes as int8, x̂ as
// three int8 planes).
//
// Why: matvec.cu's CUDA-core dot products cost ~3 instructions per weight (shift, mask, FMA), and a
// block's rows came in passes that each waited for their own DRAM round trip after the x̂ prologue.
// Measured on the real in-projection (12,352 × 2048, 14.2 MB): 14.8 µs,
// of which ~5 µs arithmetic, against 4.4 µs for a kernel that only streams the same bytes
// (docs/experiments.md). Here the products are mma.sync m16n8k16 (~1 instruction per
// weight, the dequantisation), and each warp issues the loads of its first NB tiles at once (and
// refills a tile's registers as soon as it is done), right after x has arrived and Σx² is reduced:
// issued before x, they made x's L2 requests wait ~4 µs behind ~100 KB of weight requests per SM
// (measured with per-warp stamps).
//
// Math (CPU reference: calla_cpu::linear::Linear::matvec on x̂; as matvec.cu):
//   y[r] = Σ_groups s·Σ_k q·x̂ + b·Σ_k x̂
//   A code q becomes the bf16 1 + q/16 (exact: the nibble placed in the top mantissa bits under
//   the exponent of 1.0, two instructions per pair), so the tensor cores give T = Σ (1 + q/16)·x̂
//   and Σ q·x̂ = 16·(T − Σx̂): y += 16s·T + (b − 16s)·Σx̂. x̂ goes in as bf16 hi + lo (x̂ − hi), two
//   columns of B, so the products keep ~16 bits of x̂ and accumulate in f32; the offset of 1 costs
//   about as many bits as the +16 of matvec.cu's q4 path.
//
// Layout (no repacking of the stored codes; a dot product's k order is free as long as A and B
// follow the same one): a tile is 16 rows; the block's 8 warps split K, warp w taking the CW chunks
// of 128 columns [w·CW, w·CW + CW). In a chunk, lane (g = lane/4, c = lane%4) loads the 16 bytes at
// 16c of rows g and g + 8: 32 codes = columns 32c..32c + 31 of the chunk, so lanes c = 0, 1 hold
// group 2·chunk and lanes c = 2, 3 group 2·chunk + 1. Word w of those 16 bytes feeds mmas 2w, 2w+1:
// the pair (nibble p, nibble p + 4) is one bf16x2 register (p = 0, 1 for mma 2w; 2, 3 for 2w + 1),
// standing for the mma's k (2c, 2c+1) (p = 0 or 2) or (2c+8, 2c+9) (p = 1 or 3). B (k × n) takes
// x̂ at the same columns: n = 0, 1 the hi and lo parts restricted to the chunk's first group, n =
// 2, 3 to its second, n ≥ 4 zero; so the accumulator's columns (0, 1) in lane c = 0 are group
// 2·chunk's (hi, lo) sums and columns (2, 3) in lane c = 1 the next group's. The B registers are
// built once per block in shared memory (bfrag) in the order the lanes read them (one 16-byte load
// per lane and word); Σx̂ per group (gsum) is Σ(hi + lo), the values the products saw.
// The 8 warps' partial sums of a tile meet in shared memory and are added in warp order.
//
// Shapes: x [K] f32, K = 1024·CW (CW = 1, 2, 4); W_seg [rows_seg, K] q4 g64, bf16 params; y_seg f32.
// Launch: grid ≤ the blocks that fit at once (grid-stride over tiles), block 256, dynamic smem
//   4·K + K/16 bytes. Bytes per call: Σ rows·K/2 of codes + rows·K/16 of params, x (K·4) per block.

#define MTC_THREADS 256
#define MTC_WARPS 8

// The bf16 pair (1 + q_p/16, 1 + q_{p+4}/16) of nibbles p and p + 4 of `word` (p = 0..3).
// (at3 & mask) | one in a single LOP3 with both constants in registers: written plainly, the compiler
// emits two (a LOP3 takes one immediate), three instructions per A register instead of two.
__device__ __forceinline__ u32 q4_pair_one_plus(u32 word, int p) {
    const u32 at3 = p == 0 ? word << 3 : word >> (4 * p - 3); // nibble p at bits 3..6, p + 4 at 19..22
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(at3), "r"(0x00780078u), "r"(0x3F803F80u)); // (a & b) | c
    return r;
}

// The weight loads of common.cuh (ldg16, ldg8), but `volatile`: they stay after the x loads that
// precede them in program order, instead of being scheduled wherever the compiler likes.
__device__ __forceinline__ uint4 ldg16_in_order(const void* p) {
    uint4 v;
    asm volatile(WEIGHT_LD_STR(WEIGHT_LD) ".v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ uint2 ldg8_in_order(const void* p) {
    uint2 v;
    asm volatile(WEIGHT_LD_STR(WEIGHT_LD) ".v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

// One lane's share of row g + 8h of a tile: the codes of its warp's CW chunks of 128 columns from
// `data` (the row's first code byte) and the (scale, bias) words of their 2·CW groups from `prm` (the
// row's first pair), read by ld16 (16 bytes) and ld8 (8 bytes): from global memory or from a stage.
template <int CW, typename Ld16, typename Ld8>
__device__ __forceinline__ void tc_row_fragments(const u8* data, const u8* prm, int warp, int c, int h,
                                                 uint4 (&cd)[CW][2], u32 (&pr)[2 * CW], const Ld16& ld16,
                                                 const Ld8& ld8) {
    // unsigned offsets: added without sign extension
    prm += (u32)(2 * warp * CW * 4);
#pragma unroll
    for (int ch = 0; ch < CW; ++ch) cd[ch][h] = ld16(data + (u32)((warp * CW + ch) * 64 + c * 16));
    if (CW == 1) {
        const uint2 v = ld8(prm);
        pr[0] = v.x;
        pr[1] = v.y;
    } else {
#pragma unroll
        for (int q = 0; q < CW / 2; ++q) {
            const uint4 v = ld16(prm + 16 * q);
            pr[4 * q + 0] = v.x;
            pr[4 * q + 1] = v.y;
            pr[4 * q + 2] = v.z;
            pr[4 * q + 3] = v.w;
        }
    }
}

// The x̂ encodings (B operand) and the per-chunk products, as policies of the bodies below:
//   TcBf16: x̂ as bf16 hi + lo on m16n8k16 bf16 mmas, codes as 1 + q/16;
//   TcInt8: x̂ as three int8 planes on m16n8k32 s8 mmas, codes as they are.
// stage_word(wi, valid, x, bfrag, gsum): word wi of x̂ into the B registers (bfrag, BFRAG_U4 uint4 per
// chunk) and the group terms (gsum); chunk(...): one chunk of a lane's rows g, g + 8 into acc0, acc1;
// b_live(g, c): whether lane (g, c) carries B; lane_sum(v): a row's share of the warp from its lanes.
struct TcBf16 {
    static constexpr int BFRAG_U4 = 32;
    // Word wi of the input (columns 8wi..8wi+7, values x) into the B registers and group sums: chunk wi/16,
    // lane c = (wi/4)%4, word w = wi%4 of that lane's 16 bytes; hi = bf16(x), lo = bf16(x − hi). A group
    // is 8 consecutive words held by 8 consecutive lanes, so every lane of the warp must call this
    // (`valid` false: the word does not exist, nothing is written).
    __device__ static __forceinline__ void stage_word(int wi, bool valid, const float (&x)[8], uint4* bfrag, float* gsum) {
        // hp[j], lp[j]: the bf16 pairs (value j, value j + 4), as mma 2w and 2w + 1 read them
        u32 hp[4], lp[4];
        float hi[8], lo[8], sum = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            hp[j] = pack_bf16(x[j], x[j + 4]);
            hi[j] = bf16_lo(hp[j]);
            hi[j + 4] = bf16_hi(hp[j]);
            lp[j] = pack_bf16(x[j] - hi[j], x[j + 4] - hi[j + 4]);
            lo[j] = bf16_lo(lp[j]);
            lo[j + 4] = bf16_hi(lp[j]);
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) sum += hi[i] + lo[i];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        sum += __shfl_xor_sync(0xffffffffu, sum, 4);
        if (valid) {
            const int slot = ((wi >> 4) * 4 + (wi & 3)) * 4 + ((wi >> 2) & 3);
            // mma 2w: (p0, p4), (p1, p5); mma 2w + 1: (p2, p6), (p3, p7)
            bfrag[slot * 2 + 0] = make_uint4(hp[0], hp[1], hp[2], hp[3]);
            bfrag[slot * 2 + 1] = make_uint4(lp[0], lp[1], lp[2], lp[3]);
            if ((wi & 7) == 0) gsum[wi >> 3] = sum;
        }
    }

    // One chunk (128 columns, chunk kc of the B registers) of rows g and g + 8: 8 mmas from their codes
    // (r0, r8) and the fold into acc0, acc1 with the lane's group's (scale, bias) words from p0, p8 (the
    // chunk's two groups' words of rows g, g + 8; lanes c = 0, 1 hold the two groups, lanes c = 2, 3
    // compute values nobody reads), times `scale` (the chunk's input scale: 1, or the DeltaNet head
    // norm's).
    __device__ static __forceinline__ void chunk(const uint4& r0, const uint4& r8, uint2 p0, uint2 p8, const uint4* bfrag,
                                             const float* gsum, int kc, bool b_live, int g, int c, float& acc0,
                                             float& acc1, float scale = 1.0f) {
        const bool odd = c & 1; // the lane's group
        const u32 sb0 = odd ? p0.y : p0.x, sb1 = odd ? p8.y : p8.x;
        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const u32 wg[4] = {r0.x, r0.y, r0.z, r0.w};
        const u32 wg8[4] = {r8.x, r8.y, r8.z, r8.w};
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            uint4 bv = make_uint4(0u, 0u, 0u, 0u);
            if (b_live) bv = bfrag[((kc * 4 + w) * 4 + c) * 2 + (g & 1)];
            const u32 a0[4] = {q4_pair_one_plus(wg[w], 0), q4_pair_one_plus(wg8[w], 0), q4_pair_one_plus(wg[w], 1),
                               q4_pair_one_plus(wg8[w], 1)};
            mma_bf16(d, a0, bv.x, bv.y);
            const u32 a1[4] = {q4_pair_one_plus(wg[w], 2), q4_pair_one_plus(wg8[w], 2), q4_pair_one_plus(wg[w], 3),
                               q4_pair_one_plus(wg8[w], 3)};
            mma_bf16(d, a1, bv.z, bv.w);
        }
        const float sx = gsum[2 * kc + (c & 1)];
        const float s0 = 16.0f * bf16_lo(sb0), s1 = 16.0f * bf16_lo(sb1);
        acc0 += scale * fmaf(s0, d[0] + d[1], (bf16_hi(sb0) - s0) * sx);
        acc1 += scale * fmaf(s1, d[2] + d[3], (bf16_hi(sb1) - s1) * sx);
    }
    // Lanes g < 4 carry B's columns: g = 0, 1 the hi and lo parts of the chunk's first group (lanes
    // c = 0, 1 hold its columns), g = 2, 3 of the second (c = 2, 3); every other lane gives zeros.
    __device__ static __forceinline__ bool b_live(int g, int c) { return g < 4 && (c >> 1) == (g >> 1); }
    // A row's share of the warp from its lanes' accumulators: lanes c = 0 and 1 hold the chunks' two groups.
    __device__ static __forceinline__ float lane_sum(float v) { return v + __shfl_xor_sync(0xffffffffu, v, 1); }
};

// TcInt8 (the default): the products on the integer tensor cores (mma m16n8k32 s8): one mma per 512 weights
// instead of two, and per A register of 4 codes one LOP3 (even nibbles) or a shift and a LOP3 (odd
// nibbles) instead of a shift and a LOP3 per 2 codes: the inner loop takes half the instructions.
// x̂ goes in as three int8 planes per group of 64, one B column each (the bf16 form left four of B's
// eight columns zero): with σ'' = max|x̂|/(127·2^16), X = rint(x̂/σ'') = 2^16·a_0 + 2^8·a_1 + a_2 in
// balanced base-256 digits (a_1, a_2 in [−128, 127], |a_0| ≤ 127), so the products see x̃ = σ''·X:
// ~23 bits of the group's largest value (the bf16 hi + lo form: ~16 bits of each value), so a group
// with one large value keeps ~16 bits of the others. The integer sums are exact.
// Layout: lane (g, c) of a chunk's mma w (word w of its 16 bytes, columns 32c + 8w .. + 7) gives A
// a0 = the even nibbles (columns 32c + 8w + 2i, i = 0..3) and a2 the odd ones (+1) of row g, a1 and
// a3 of row g + 8; B (k = 4c + i and 16 + 4c + i, n = g) holds the same columns of plane g & 3 of
// the chunk's group g >> 2 (n = 3, 7 zero, and only in lanes whose columns are in that group). So a
// lane's accumulator columns n = 2c, 2c + 1 are of its own group: planes 0, 1 for c even, plane 2 and
// a zero column for c odd. bfrag (uint2 units): [chunk][c][plane][w] = (b0, b1); gsum (float2
// units): [group] = (Σx̃, σ'').
// Byte k of each of a, b, c, d, packed (a's lowest): 2 permutes.
__device__ __forceinline__ u32 tc_pick_bytes(u32 a, u32 b, u32 c, u32 d, int k) {
    const u32 ab = __byte_perm(a, b, k | (k + 4) << 4);
    const u32 cd = __byte_perm(c, d, k | (k + 4) << 4);
    return __byte_perm(ab, cd, 0x5410);
}
struct TcInt8 {
    static constexpr int BFRAG_U4 = 24;
    // Word wi (TcBf16::stage_word's contract): the group's max|x̂| from its 8 lanes, then each value as
    // X = rint(x̂/σ''), whose three balanced base-256 digits are the planes: the low byte of X, of
    // X + 0x80 >> 8 and of X + 0x8080 >> 16, picked by byte permutes (no shifts). A NaN or infinite x̂
    // makes σ'' NaN or infinite and Σx̃ NaN: the products' outputs are NaN, as in the bf16 form.
    __device__ static __forceinline__ void stage_word(int wi, bool valid, const float (&x)[8], uint4* bfrag4, float* gsum) {
        // max|x̂| as the integer max of the magnitudes' bits (the same order for floats ≥ 0), so a NaN,
        // whose bits exceed infinity's, becomes the group's max
        u32 mb = 0u;
#pragma unroll
        for (int j = 0; j < 8; ++j) mb = max(mb, __float_as_uint(x[j]) & 0x7fffffffu);
        mb = max(mb, __shfl_xor_sync(0xffffffffu, mb, 1));
        mb = max(mb, __shfl_xor_sync(0xffffffffu, mb, 2));
        mb = max(mb, __shfl_xor_sync(0xffffffffu, mb, 4));
        const float m = __uint_as_float(mb);
        // |X| ≤ 127·65536 < 2^23: σ'' = σ/65536, σ = max|x̂|/127 (groups below 1e-30 are zeros: their
        // reciprocal would overflow; a NaN max gives X = 0 and σ'' = NaN). The reciprocal needs no
        // correct rounding: x̃ = σ''·X uses σ'', and X's top digit stays ≤ 127 for |X| < 127.5·65536.
        const float inv = m > 1e-30f ? __fdividef(127.0f * 65536.0f, m) : 0.0f, sig = m * (1.0f / (127.0f * 65536.0f));
        u32 lo[8], mid[8], hi[8]; // X, X + 0x80, X + 0x8080: planes 2, 1, 0 in bytes 0, 1, 2
        int sum = 0;              // ΣX over the group: |ΣX| < 64·2^23 = 2^29
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int X = __float2int_rn(x[j] * inv);
            lo[j] = (u32)X;
            mid[j] = (u32)X + 0x80u;
            hi[j] = (u32)X + 0x8080u;
            sum += X;
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        sum += __shfl_xor_sync(0xffffffffu, sum, 4);
        if (valid) {
            uint2* b = (uint2*)bfrag4 + (((wi >> 4) * 4 + ((wi >> 2) & 3)) * 3) * 4 + (wi & 3); // [chunk][c][plane][w]
            b[0] = make_uint2(tc_pick_bytes(hi[0], hi[2], hi[4], hi[6], 2), tc_pick_bytes(hi[1], hi[3], hi[5], hi[7], 2));
            b[4] = make_uint2(tc_pick_bytes(mid[0], mid[2], mid[4], mid[6], 1), tc_pick_bytes(mid[1], mid[3], mid[5], mid[7], 1));
            b[8] = make_uint2(tc_pick_bytes(lo[0], lo[2], lo[4], lo[6], 0), tc_pick_bytes(lo[1], lo[3], lo[5], lo[7], 0));
            if ((wi & 7) == 0) ((float2*)gsum)[wi >> 3] = make_float2((float)sum * sig, sig);
        }
    }

    // One chunk of rows g and g + 8 (TcBf16::chunk's contract; p0, p8: the rows' (scale, bias) words
    // of the chunk's two groups): 4 integer mmas, then the fold. Lane c's two columns are of one group,
    // c >> 1: c even holds planes 0 and 1 (x̃'s part σ''·256·(256·D_0 + D_1)), c odd plane 2 and a zero
    // column (σ''·D_2), and the even lane adds the group's bias term (lane_sum adds the four lanes).
    __device__ static __forceinline__ void chunk(const uint4& r0, const uint4& r8, uint2 p0, uint2 p8, const uint4* bfrag4,
                                             const float* gsum, int kc, bool b_live, int g, int c, float& acc0,
                                             float& acc1, float scale = 1.0f) {
        int d[4] = {0, 0, 0, 0};
        const u32 wg[4] = {r0.x, r0.y, r0.z, r0.w};
        const u32 wg8[4] = {r8.x, r8.y, r8.z, r8.w};
        uint4 bv[2] = {make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u)};
        if (b_live) {
            const uint4* src = bfrag4 + ((kc * 4 + c) * 3 + (g & 3)) * 2; // 4 uint2 (w = 0..3) = 2 uint4
            bv[0] = src[0];
            bv[1] = src[1];
        }
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const u32 a[4] = {wg[w] & 0x0F0F0F0Fu, wg8[w] & 0x0F0F0F0Fu, (wg[w] >> 4) & 0x0F0F0F0Fu, (wg8[w] >> 4) & 0x0F0F0F0Fu};
            const uint4& b = bv[w >> 1];
            mma_s8(d, a, (w & 1) ? b.z : b.x, (w & 1) ? b.w : b.y);
        }
        const bool hi_planes = !(c & 1), second = c & 2; // planes 0, 1 (else 2); the chunk's second group
        const float2 gs = ((const float2*)gsum)[2 * kc + (second ? 1 : 0)]; // (Σx̃, σ'')
        const float w = hi_planes ? 256.0f * gs.y : gs.y;
        const int m = hi_planes ? 256 : 1;
        const u32 sb0 = second ? p0.y : p0.x, sb1 = second ? p8.y : p8.x;
        acc0 += scale * fmaf(bf16_lo(sb0) * w, (float)(m * d[0] + d[1]), hi_planes ? bf16_hi(sb0) * gs.x : 0.0f);
        acc1 += scale * fmaf(bf16_lo(sb1) * w, (float)(m * d[2] + d[3]), hi_planes ? bf16_hi(sb1) * gs.x : 0.0f);
    }
    // B's column n = g: plane n & 3 (n & 3 < 3; n = 3, 7 zero) of the chunk's group n >> 2, in the lanes
    // whose columns are that group's.
    __device__ static __forceinline__ bool b_live(int g, int c) { return (g & 3) != 3 && (g >> 2) == (c >> 1); }
    // A row's share of the warp: lanes c = 0, 1 hold its first group, c = 2, 3 its second.
    __device__ static __forceinline__ float lane_sum(float v) {
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        return v + __shfl_xor_sync(0xffffffffu, v, 2);
    }
};
// The decode products' encoding (int8 planes of x̂; the bf16 form, TcBf16, measured slower).
typedef TcInt8 TcDot;

// What the body below needs to know about one kind of product (a "map"): how many 16-row tiles,
// where tile row r's codes and (scale, bias) start, the input vector (and its norm gain, or 0), and
// what to do with the 16 row sums of a tile (`finish`, threads tid < 16 of the block: red[w][r] is
// warp w's share of row r). Maps whose rows are not STATIC_ROWS (gate/up) select them in
// `prologue_staged`, with the body's Σx² and x̂ staging as hooks between its barriers. HEAD_NORM and
// `chunk_scales`: a scale per chunk of 128 columns on its products (the DeltaNet head norm).

// The fused routing's producer side (common.cuh, "fused routing"): an out-projection y = h += W·x
// whose blocks, once a tile's 16 rows of h are final, add those columns' share of every router row,
// of the shared-expert gate row and of Σh² into the accumulators. Thread e takes router row e (and
// e + 256, …): 16 codes, one 16-byte (q8) or 8-byte (q4) load, requested at the kernel's start for the
// block's first tile. Shape: y has D = total_rows rows (one segment), D % 16 == 0.
struct RouteTail {
    MatrixRef router; // [E, D] q8 or q4, affine, bf16 (scale, bias) per group of group_size ≥ 16
    u64 gain;         // [D] the post-attention norm's gain (1 + w)
    u64 shared_gate;  // [D] f32, or 0
    u64 acc;          // i64 [ROUTE_COPIES][route_acc_stride(E)], zero on entry
    int E, bits, group_size, pad;
};
struct RouteRegs { // one thread's share of a tile's routing, loaded early
    uint4 codes;
    u32 prm;
    float gain, sg; // threads < 16: the gain and shared-gate weight of row 16t + tid
};
struct NoTail {};
template <bool B, typename T, typename F> struct PickType { typedef T type; }; // std::conditional (NVRTC has no <type_traits>)
template <typename T, typename F> struct PickType<false, T, F> { typedef F type; };

// Router row e's 16 codes and (scale, bias) over columns [16t, 16t + 16), and for threads < 16 their
// column's gain and shared-gate weight.
// FE, FBITS: the router's rows and code width as compile-time constants (a specialised kernel), or 0
// for rt.E and rt.bits.
template <int FE = 0, int FBITS = 0>
__device__ __forceinline__ RouteRegs route_tail_load(const RouteTail& rt, int t, int e) {
    const int E = FE ? FE : rt.E, bits = FBITS ? FBITS : rt.bits;
    RouteRegs r;
    r.codes = make_uint4(0u, 0u, 0u, 0u);
    r.prm = 0u;
    r.gain = r.sg = 0.0f;
    if (e < E) {
        const u8* row = (const u8*)rt.router.data + (i64)e * rt.router.row_bytes;
        if (bits == 8) {
            r.codes = ldg16(row + 16 * t);
        } else {
            const uint2 v = *(const uint2*)(row + 8 * t);
            r.codes = make_uint4(v.x, v.y, 0u, 0u);
        }
        r.prm = *(const u32*)((const u8*)rt.router.params +
                              ((i64)e * rt.router.groups_per_row + div_small(16 * t, rt.group_size)) * 4);
    }
    if (threadIdx.x < 16) {
        r.gain = ((const float*)rt.gain)[16 * t + threadIdx.x];
        r.sg = rt.shared_gate ? ((const float*)rt.shared_gate)[16 * t + threadIdx.x] : 0.0f;
    }
    return r;
}

// Tile t's share of the routing: h_new is row 16t + tid's final value (threads < 16); every thread of
// the block calls this (one barrier). hs: shared [16].
template <int FE = 0, int FBITS = 0>
__device__ __forceinline__ void route_tail(const RouteTail& rt, int t, float h_new, const RouteRegs& first,
                                           bool is_first, float* hs) {
    const int tid = threadIdx.x, E = FE ? FE : rt.E, bits = FBITS ? FBITS : rt.bits;
    i64* acc = (i64*)rt.acc + (t & (ROUTE_COPIES - 1)) * route_acc_stride(E);
    const RouteRegs mine = is_first ? first : route_tail_load<FE, FBITS>(rt, t, tid);
    if (tid < 32) { // warp 0: x̂'s numerator g·h, Σh² and the shared gate's share
        const float hg = tid < 16 ? h_new * mine.gain : 0.0f;
        if (tid < 16) hs[tid] = hg;
        float sq = tid < 16 ? h_new * h_new : 0.0f, gp = hg * mine.sg;
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) {
            sq += __shfl_xor_sync(0xffffffffu, sq, o);
            gp += __shfl_xor_sync(0xffffffffu, gp, o);
        }
        if (tid == 0) {
            route_acc_add(acc + E + 1, sq, ROUTE_SQ_UNIT);
            if (rt.shared_gate) route_acc_add(acc + E, gp, ROUTE_LOGIT_UNIT);
        }
    }
    __syncthreads();
    float hv[16], hsum = 0.0f;
#pragma unroll
    for (int k = 0; k < 16; ++k) {
        hv[k] = hs[k];
        hsum += hv[k];
    }
    for (int e = tid; e < E; e += MTC_THREADS) {
        const RouteRegs r = e == tid ? mine : route_tail_load<FE, FBITS>(rt, t, e);
        const u32 words[4] = {r.codes.x, r.codes.y, r.codes.z, r.codes.w};
        float dot = 0.0f; // Σ q·(g·h)
#pragma unroll
        for (int k = 0; k < 16; ++k) {
            const u32 q = bits == 8 ? (words[k >> 2] >> (8 * (k & 3))) & 255u : (words[k >> 3] >> (4 * (k & 7))) & 15u;
            dot = fmaf((float)q, hv[k], dot);
        }
        route_acc_add(acc + e, fmaf(bf16_lo(r.prm), dot, bf16_hi(r.prm) * hsum), ROUTE_LOGIT_UNIT);
    }
}

// The plain matvec's parameters: matvec.cu's, and for matvec_tc_headnorm_q4_c* the end of the Gated
// DeltaNet's output norm (the DeltaNet out-projection): deltanet.cu's `_parts` kernels leave x =
// w·o·silu(z) and, after its K values, `nparts` sums of o² per head (one per block of the head); here
// W·x̂ with x̂[i] = x_i/√(Σ parts of i's head / head_dim + eps) is Σ over chunks of 128 columns (each
// inside one head: head_dim % 128 == 0) of the chunk's scale times its products. The head's blocks
// there could only add their parts through a thread-block cluster (its barrier cost 1.8 µs of the
// kernel's 6.8 per launch, measured). The parts are read per warp (its CW chunks' heads, one 128-byte
// line) after the weights are on their way, not in the x prologue: read there, by every thread, they
// cost the kernel 2.5 µs (measured), and z with the norm weight there 1.8 µs.
struct TcMatvecParams {
    MatvecParams m;
    u64 head_parts; // [K / head_dim, nparts] Σo² parts
    u64 pad0;
    int head_dim;   // Dv, a multiple of 128
    int nparts;     // ≤ 8
    RouteTail route; // matvec_tc_*route_q4_c*: the MoE router over y (common.cuh, fused routing)
};

// Plain matvec: y_seg (+)= W_seg·x̂ over up to 4 stacked segments; HEAD_NORM: the DeltaNet head norm.
// FE, FBITS: the fused routing's router rows and code width, FHD, FNP: the head norm's head_dim and
// parts per head, as compile-time constants (a specialised kernel), or 0 for tp's. NS > 0: the
// segments' count, and R0, R1, R2 the rows of all but the last, compiled in (each a multiple of 16,
// as the launcher checks for the last: a tile never straddles two segments), so a row's segment is
// three compares with constants instead of matvec_locate's search over indexed parameter loads.
template <bool HN, bool ROUTE = false, int FE = 0, int FBITS = 0, int FHD = 0, int FNP = 0, int NS = 0, int R0 = 0,
          int R1 = 0, int R2 = 0>
struct MatvecMapT {
    static_assert(NS <= MAX_SEGMENTS && R0 % 16 == 0 && R1 % 16 == 0 && R2 % 16 == 0, "segments of whole tiles");
    static constexpr bool HEAD_NORM = HN;
    typedef typename PickType<ROUTE, RouteRegs, NoTail>::type Tail;
    static constexpr bool STATIC_ROWS = true; // row() depends on the parameters only
    const MatvecParams& p;
    const TcMatvecParams& tp;
    __device__ int tiles() const { return (p.total_rows + 15) >> 4; }
    __device__ u64 x() const { return p.x; }
    __device__ u64 norm_gain() const { return p.norm_gain; }
    __device__ float eps() const { return p.eps; }
    // The input scales of this warp's CW chunks (HEAD_NORM): lane 8·ch + q reads part q of chunk ch's
    // head, the 8 lanes add them in a fixed tree (the same sum in every warp and block).
    template <int CW>
    __device__ void chunk_scales(int warp, int lane, float (&sc)[CW]) const {
        const int ch = lane >> 3, q = lane & 7;
        const int head_dim = FHD ? FHD : tp.head_dim, nparts = FNP ? FNP : tp.nparts;
        float v = 0.0f;
        if (ch < CW && q < nparts)
            v = ldcg_f32((const float*)tp.head_parts + (i64)((warp * CW + ch) * 128 / head_dim) * nparts + q);
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        v += __shfl_xor_sync(0xffffffffu, v, 4);
#pragma unroll
        for (int c = 0; c < CW; ++c)
            sc[c] = 1.0f / sqrtf(__shfl_sync(0xffffffffu, v, 8 * c) / (float)head_dim + p.eps);
    }
    // Row r of tile t. Addresses by 32 × 32 → 64-bit multiply-adds (a row's bytes, K/2, and its index
    // fit 32 bits): the i64 products were ~9 instructions per address (Nsight Compute).
    __device__ void locate(int row, int& seg, int& local) const {
        if constexpr (NS > 0) {
            constexpr int B1 = R0, B2 = R0 + R1, B3 = R0 + R1 + R2;
            seg = (NS > 1 && row >= B1) + (NS > 2 && row >= B2) + (NS > 3 && row >= B3);
            local = row - (seg == 0 ? 0 : seg == 1 ? B1 : seg == 2 ? B2 : B3);
        } else {
            matvec_locate(p, row, seg, local);
        }
    }
    __device__ void row(int t, int r, const u8*& data, const u8*& prm) const {
        int seg, local;
        locate(min(16 * t + r, p.total_rows - 1), seg, local); // past the end: the last row again
        const MatrixRef& m = p.seg[seg].m;
        data = (const u8*)m.data + wide_mul(local, (u32)m.row_bytes);
        prm = (const u8*)m.params + wide_mul(local, 4 * m.groups_per_row);
    }
    // Rows g and g + 8 of tile t (a lane's two rows): one segment search when both are in one segment
    // (always when the segments' rows are multiples of 16, as in every real model).
    __device__ void tile_rows(int t, int g, const u8* (&data)[2], const u8* (&prm)[2]) const {
        int seg, local;
        locate(min(16 * t + g, p.total_rows - 1), seg, local);
        const MatrixRef& m = p.seg[seg].m;
        const u32 row_bytes = (u32)m.row_bytes, prm_bytes = 4 * m.groups_per_row;
        data[0] = (const u8*)m.data + wide_mul(local, row_bytes);
        prm[0] = (const u8*)m.params + wide_mul(local, prm_bytes);
        if (NS > 0 || (local + 8 < p.seg[seg].rows && 16 * t + g + 8 < p.total_rows)) { // NS: whole tiles
            data[1] = data[0] + 8 * row_bytes;
            prm[1] = prm[0] + 8 * prm_bytes;
        } else {
            row(t, g + 8, data[1], prm[1]);
        }
    }
    // The value an accumulating product adds to, for thread tid < 16 of tile t: requested at the
    // start (nothing else writes these rows meanwhile), not as a dependent load after the reduction.
    __device__ float old_value(int t, int tid) const {
        if (!p.accumulate || tid >= 16 || 16 * t + tid >= p.total_rows) return 0.0f;
        int seg, local;
        locate(16 * t + tid, seg, local);
        return ldcg_f32((const float*)p.seg[seg].out + local);
    }
    // Threads tid < 16 of tile t: the row's sum into y; returns the value written.
    __device__ float finish(int t, int tid, const float (*red)[16], bool has_old, float old) const {
        if (tid >= 16 || 16 * t + tid >= p.total_rows) return 0.0f;
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < MTC_WARPS; ++w) v += red[w][tid];
        int seg, local;
        locate(16 * t + tid, seg, local);
        float* y = (float*)p.seg[seg].out;
        const float out = p.accumulate ? (has_old ? old : ldcg_f32(y + local)) + v : v;
        y[local] = out;
        return out;
    }
    // The fused routing (ROUTE): its loads for the block's first tile t, and each tile's share after
    // its rows are final (every thread; y_t = finish's value).
    __device__ Tail tail_load(int t) const {
        if constexpr (ROUTE) return route_tail_load<FE, FBITS>(tp.route, t, threadIdx.x);
        else return Tail{};
    }
    __device__ void tail(int t, float y_t, const Tail& first, bool is_first, float* hs) const {
        if constexpr (ROUTE) route_tail<FE, FBITS>(tp.route, t, y_t, first, is_first, hs);
    }
};

// An accumulating product (the out-projections and down, y += W·x) requests the values it adds to at
// its start, not as a dependent L2 load after its reduction.
#define MTC_EARLY_OLD 1

template <int CW, int NB, typename Map>
__device__ __forceinline__ void tc_body(const Map& map) {
    extern __shared__ float4 smem4[];
    // K = 1024·CW in every launch (the launchers name the kernel by K / 1024): a compile-time
    // constant, so the staging's bounds and the norm's mean fold (the maps' p.K, p.D are the same value).
    constexpr int K = 1024 * CW;
    uint4* bfrag = (uint4*)smem4;                 // x̂ as B registers, TcDot::BFRAG_U4 per chunk of 128
    float* gsum = (float*)(bfrag + (K / 128) * TcDot::BFRAG_U4); // per group of 64: TcDot's terms
    __shared__ float red[2][MTC_WARPS][16];
    __shared__ float scratch[32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, c = lane & 3;
    const int tiles = map.tiles();
    // the grid may be 2-D (gate/up: (blocks, slots)); the tiles are spread over all its blocks
    const int block = blockIdx.x + blockIdx.y * gridDim.x, nblocks = gridDim.x * gridDim.y;
    const u64 px = map.x(), pgain = map.norm_gain();
    griddep_enter(); // programmatic dependent launch (graph.rs); no-ops otherwise
    // The fixed-row products with a refill tile and few tiles per block (the in-projections: at the
    // real shape 244 of the DeltaNet's 264 blocks and 48 of attention's have a third tile; not
    // lm_head's ~59) ask L2 for it at entry, one thread per 128-byte line (row tid / 16, line tid % 16:
    // 4·CW lines of codes, then the row's parameters); its load, issued once the first tile is
    // computed, then finds it there. Step at 4K −7…−14 µs (docs/experiments.md), where
    // the same prefetch issued with the first tiles' loads had measured +0.4 µs per in-projection
    //. Measured and not kept: gate/up's shared-expert refill tiles (known
    // before the routing) prefetched at entry (gate/up +3.5 µs, the step within noise) or after the
    // routing (+1.7 µs; lab code in 9d30573); lm_head's refill tile too (−0.3 µs) and the second
    // tile too (+15.6 µs; lab code in b0c5a84).
    if constexpr (Map::STATIC_ROWS && CW == 2) {
        const int t3 = block + NB * nblocks;
        if (t3 < tiles && tiles <= (NB + 1) * nblocks) {
            const int r = tid >> 4, line = tid & 15;
            const u8 *d, *q;
            map.row(t3, r, d, q);
            if (line < 4 * CW) prefetch_l2(d + 128 * line);
            else if (line == 4 * CW) prefetch_l2(q);
        }
    }

    // x and its norm gain first (from L2): the weight loads are issued only once they have arrived.
    constexpr int WPT = (CW + 1) / 2; // words of 8 columns per thread
    const int words = K / 8;
    float4 xin[WPT][2], gin[WPT][2];
#pragma unroll
    for (int m = 0; m < WPT; ++m) {
        const int wi = tid + MTC_THREADS * m;
        xin[m][0] = xin[m][1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        gin[m][0] = gin[m][1] = make_float4(1.0f, 1.0f, 1.0f, 1.0f);
        if (wi < words) {
            xin[m][0] = ldcg_f4((const float4*)px + 2 * wi);
            xin[m][1] = ldcg_f4((const float4*)px + 2 * wi + 1);
            if (pgain) {
                gin[m][0] = ((const float4*)pgain)[2 * wi];
                gin[m][1] = ((const float4*)pgain)[2 * wi + 1];
            }
        }
    }

    const float y_old = MTC_EARLY_OLD && block < tiles ? map.old_value(block, tid) : 0.0f;
    const typename Map::Tail tail_first = map.tail_load(min(block, tiles - 1)); // fused routing's loads

    // The loads of one tile for this lane: codes of rows g, g + 8 in the warp's CW chunks, and the
    // (scale, bias) pairs of the 2·CW groups they span (one 8·CW-byte load per row; TcDot::chunk
    // takes both of a chunk's and uses its lane's group).
    auto issue = [&](int t, uint4 (&cd)[CW][2], u32 (&pr)[2][2 * CW]) {
        const u8 *data[2], *prm[2];
        map.tile_rows(t, g, data, prm);
#pragma unroll
        for (int h = 0; h < 2; ++h)
            tc_row_fragments<CW>(data[h], prm[h], warp, c, h, cd, pr[h], [](const void* a) { return ldg16_in_order(a); },
                                 [](const void* a) { return ldg8_in_order(a); });
    };

    uint4 codes[NB][CW][2];
    u32 par[NB][2][2 * CW];

    auto issue_first = [&] {
#pragma unroll
        for (int s = 0; s < NB; ++s) {
            const int t = block + s * nblocks;
            if (t < tiles) issue(t, codes[s], par[s]);
        }
    };
    // x·gain and Σx² from the loaded x (thread tid owns the words tid, tid + 256, …).
    float xv[WPT][8];
    auto x_times_gain = [&] {
        float ss = 0.0f;
#pragma unroll
        for (int m = 0; m < WPT; ++m) {
            const float4 a = xin[m][0], b = xin[m][1], ga = gin[m][0], gb = gin[m][1];
            const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
            const float gn[8] = {ga.x, ga.y, ga.z, ga.w, gb.x, gb.y, gb.z, gb.w};
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                ss += v[i] * v[i];
                xv[m][i] = v[i] * gn[i];
            }
        }
        return ss;
    };
    // x̂ = x·gain·inv (with the norm), split into hi + lo and laid out as B registers: word wi =
    // columns 8wi.., chunk wi/16, lane c = (wi/4)%4, word w = wi%4 of that lane's 16 bytes.
    auto stage = [&](float total) {
        const float inv = pgain ? 1.0f / sqrtf(total / (float)K + map.eps()) : 1.0f; // x̂ = x / √(mean(x²) + eps)
#pragma unroll
        for (int m = 0; m < WPT; ++m) {
            float x[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) x[i] = pgain ? xv[m][i] * inv : xv[m][i];
            const int wi = tid + MTC_THREADS * m;
            TcDot::stage_word(wi, wi < words, x, bfrag, gsum);
        }
    };

    if constexpr (!Map::STATIC_ROWS) {
        // The block's Σx² and x̂'s staging ride on the selection's barriers, whose last one
        // publishes both: the weights go out right after.
        auto pre = [&] { block_sum_post(x_times_gain(), scratch, lane, warp); };
        auto mid = [&] { stage(block_sum_collect<MTC_WARPS>(scratch)); };
        map.prologue_staged(pre, mid);
        issue_first();
    } else {
        const float ss = x_times_gain();
        // When the weight loads are issued. The K = 2048 products with fixed rows (in-projections,
        // lm_head): by each thread once its own x has arrived (Σx² depends on it; an empty volatile
        // asm keeps the loads after it), the block's Σx² after — step −21 µs. The others
        // (the K = 4096 out-projections): after the block's Σx², whose barrier also waits for
        // every warp's x — issued per thread they took 0.3–0.4 µs longer. Never before x has arrived:
        // behind ~100 KB of weight requests per SM, x took ~4.5 µs to arrive; issued right
        // behind x's requests without waiting for them, the in-projections took 10.7 → 11.9 µs and the
        // out-projections 6.5 → 7.7.
        constexpr bool warp_issue = CW == 2;
        if constexpr (warp_issue) {
            asm volatile("" ::"f"(ss));
            issue_first();
        }
        // block_sum with one barrier, not two: scratch is unused before this point.
        block_sum_post(ss, scratch, lane, warp);
        __syncthreads();
        const float total = block_sum_collect<MTC_WARPS>(scratch);
        if constexpr (!warp_issue) issue_first();
        stage(total);
        // With CW = 2 a warp stages exactly the words of its own chunks (word tid: chunk tid/16,
        // warp w's chunks 2w, 2w + 1), which are all its products read: no block barrier.
        if constexpr (CW == 2) __syncwarp();
        else __syncthreads();
    }
    float chunk_scale[CW]; // 1, or the DeltaNet head norm's (read while the first tiles load)
#pragma unroll
    for (int ch = 0; ch < CW; ++ch) chunk_scale[ch] = 1.0f;
    if constexpr (Map::HEAD_NORM) map.template chunk_scales<CW>(warp, lane, chunk_scale);

    const bool b_live = TcDot::b_live(g, c);
    auto compute = [&](int t, const uint4 (&cd)[CW][2], const u32 (&pr)[2][2 * CW], int j) { // block's tile j
        const int buf = j & 1;
        float acc0 = 0.0f, acc1 = 0.0f; // rows g, g + 8 (their lanes' shares)
#pragma unroll
        for (int ch = 0; ch < CW; ++ch)
            TcDot::chunk(cd[ch][0], cd[ch][1], make_uint2(pr[0][2 * ch], pr[0][2 * ch + 1]),
                     make_uint2(pr[1][2 * ch], pr[1][2 * ch + 1]), bfrag, gsum, warp * CW + ch, b_live, g, c, acc0, acc1,
                     chunk_scale[ch]);
        acc0 = TcDot::lane_sum(acc0); // the warp's share
        acc1 = TcDot::lane_sum(acc1);
        if (c == 0) {
            red[buf][warp][g] = acc0;
            red[buf][warp][g + 8] = acc1;
        }
        __syncthreads();
        const float y_t = map.finish(t, tid, red[buf], MTC_EARLY_OLD && t == block, y_old);
        map.tail(t, y_t, tail_first, t == block, scratch);
    };

    // Tile j of this block is block + j·nblocks, held in register slot j % NB; its slot is
    // refilled with tile j + NB as soon as it has been used.
    for (int j0 = 0; block + j0 * nblocks < tiles; j0 += NB) {
#pragma unroll
        for (int s = 0; s < NB; ++s) {
            const int t = block + (j0 + s) * nblocks;
            if (t >= tiles) break;
            compute(t, codes[s], par[s], j0 + s);
            const int tn = t + NB * nblocks;
            if (tn < tiles) issue(tn, codes[s], par[s]);
            if constexpr (!Map::STATIC_ROWS) // gate/up: MoE down's weights into L2 (GateUpMapT::prefetch_down)
                if (j0 + s == 0) map.prefetch_down();
        }
    }
}

// CW = K / 1024 chunks per warp; NB tiles in flight per warp (~64 registers of loads).
#define MTC_NB_C1 4
#define MTC_NB_C2 2
#define MTC_NB_C4 1 // the K = 4096 products (out-projections) have ≤ 1 tile per block
