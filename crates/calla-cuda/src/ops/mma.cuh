// mma.cuh: tensor-core and async-copy helpers, as inline PTX (no toolkit header). Prepended (after
// common.cuh) by kernels.rs to the modules that use them: the prompt (prefill) kernels and decode
// attention.
//
// Fragments of mma.sync.m16n8k16 (bf16 in, f32 accumulate), lane = 4·g + q (g = lane/4, q = lane%4):
//   A 16×16 row-major: a0 = (row g,   k 2q..2q+1)   a1 = (row g+8, k 2q..2q+1)
//                      a2 = (row g,   k 8+2q..)     a3 = (row g+8, k 8+2q..)
//   B 16×8 (k × n):    b0 = (k 2q..2q+1, n g)       b1 = (k 8+2q.., n g)
//   C 16×8 f32:        c0,c1 = (row g, n 2q, 2q+1)  c2,c3 = (row g+8, n 2q, 2q+1)
// ldmatrix.x4 loads four 8×8 bf16 matrices; lanes 8i..8i+7 give the row addresses of matrix i.
// Shared-memory tiles are rows of 16-byte chunks, chunk c of row r stored at chunk c ^ (r & swz) so
// that the 8 rows one ldmatrix phase reads fall in different banks.

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}

// 16-byte global → shared copy; `src_bytes` = 0 writes zeros (rows past the end).
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
// The same with an L2 cache policy (`l2_evict_first`: lines of data read once go first).
__device__ __forceinline__ void cp_async16_policy(u32 dst, const void* src, int src_bytes, u64 policy) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes), "l"(policy));
}
__device__ __forceinline__ u64 l2_evict_first() {
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}
// 4- and 8-byte global → shared copies (through L1), `src_bytes` = 0 writes zeros.
__device__ __forceinline__ void cp_async4(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async8(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }
// Wait until at most N of this thread's committed groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

// c += a·b (16×16 · 16×8, bf16 operands, f32 accumulators)
__device__ __forceinline__ void mma_bf16(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// D (16×8 s32) += A (16×32 s8, row) · B (32×8 s8, col): the fragments as mma_bf16's, four values per
// register (PTX ISA, mma.m16n8k32).
__device__ __forceinline__ void mma_s8(int* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two f32 → packed bf16 pair (low half = lo), one hardware conversion (round to nearest even).
__device__ __forceinline__ u32 cvt_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); // first source → upper half
    return r;
}

// Two f32 → packed bf16 pair (low half = first), round to nearest even (f32_to_bf16's bits).
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    return cvt_bf16x2(lo, hi);
}

// The split of an f32 into bf16 hi + bf16 lo (v ≈ hi + lo to ~16 bits of mantissa): "split"
// precision runs the products hi·hi + lo·hi (+ hi·lo) on the tensor cores.
__device__ __forceinline__ void split_bf16(float v, u16& hi, u16& lo) {
    hi = f32_to_bf16(v);
    lo = f32_to_bf16(v - bf16_to_f32(hi));
}

// Store one activation value into bf16 planes (`lo` may be null).
__device__ __forceinline__ void store_planes(u16* hi, u16* lo, i64 i, float v) {
    u16 h, l;
    split_bf16(v, h, l);
    hi[i] = h;
    if (lo) lo[i] = l;
}

// Store one activation value into whichever planes a consumer reads (each may be null): bf16 hi
// (+ lo) for fast and split products, f16 for half ones.
__device__ __forceinline__ void store_act(u16* hi, u16* lo, u16* h16, i64 i, float v) {
    if (hi) store_planes(hi, lo, i, v);
    if (h16) h16[i] = f32_to_f16(v);
}

// Exact f32 from the planes (lo may be null).
__device__ __forceinline__ float load_planes(const u16* hi, const u16* lo, i64 i) {
    float v = bf16_to_f32(hi[i]);
    if (lo) v += bf16_to_f32(lo[i]);
    return v;
}

// ---------------------------------------------------------------- f32 products as three bf16 ones
// "3xbf16": each f32 operand x = hi + lo, both bf16 (hi = rn(x), lo = rn(x − hi): ~16 bits of
// mantissa between them), and a·b ≈ lo·hi + hi·lo + hi·hi on mma.sync.m16n8k16 (fragments at the
// top of this file; each register holds two consecutive k). The dropped lo·lo and lo's own rounding
// leave ~2⁻¹⁷ relative per product: near-f32 results for a third of f32 FMA's cost per MAC on the
// tensor cores. (3xTF32 on m16n8k8 is more exact, but Hopper runs tf32 mma.sync at ~130 TFLOP/s,
// measured in the DeltaNet scan: less than half the bf16 rate per MAC.)
struct Bf3A { u32 hi[4], lo[4]; };
struct Bf3B { u32 hi[2], lo[2]; };
// (x0, x1) → packed hi pair and lo pair (low half = x0).
__device__ __forceinline__ void bf3_split(float x0, float x1, u32& hi, u32& lo) {
    hi = cvt_bf16x2(x0, x1);
    lo = cvt_bf16x2(x0 - bf16_lo(hi), x1 - bf16_hi(hi));
}
__device__ __forceinline__ void bf3_split(float2 v, u32& hi, u32& lo) { bf3_split(v.x, v.y, hi, lo); }
// c += a·b in three passes (small terms first).
__device__ __forceinline__ void mma_3xbf16(float* c, const Bf3A& a, const Bf3B& b) {
    mma_bf16(c, a.lo, b.hi[0], b.hi[1]);
    mma_bf16(c, a.hi, b.lo[0], b.lo[1]);
    mma_bf16(c, a.hi, b.hi[0], b.hi[1]);
}
// Conflict-free pitches (floats): a fragment that reads pairs along rows (bf3_frag_a, bf3_frag_b_nk)
// wants P ≡ 8 mod 32; one that reads pairs down columns (bf3_frag_at, bf3_frag_b_kn) wants P ≡ 4 mod 8.
// A: the 16×16 block at (row m0, column k0) of a row-major f32 tile of pitch P.
__device__ __forceinline__ Bf3A bf3_frag_a(const float* t, int P, int m0, int k0, int g, int q) {
    Bf3A a;
    const float* r0 = t + (m0 + g) * P + k0 + 2 * q;
    const float* r1 = r0 + 8 * P;
    bf3_split(*(const float2*)r0, a.hi[0], a.lo[0]);
    bf3_split(*(const float2*)r1, a.hi[1], a.lo[1]);
    bf3_split(*(const float2*)(r0 + 8), a.hi[2], a.lo[2]);
    bf3_split(*(const float2*)(r1 + 8), a.hi[3], a.lo[3]);
    return a;
}
// A: the block at (m0, k0) of A[m][k] = t[k·P + m] · s[k] (a tile stored transposed, rows k scaled).
__device__ __forceinline__ Bf3A bf3_frag_at(const float* t, int P, const float* s, int m0, int k0, int g, int q) {
    Bf3A a;
#pragma unroll
    for (int kh = 0; kh < 2; ++kh) {
        const int k = k0 + 8 * kh + 2 * q;
        const float s0 = s[k], s1 = s[k + 1];
        const float* c0 = t + k * P + m0 + g;
        const float* c1 = c0 + P;
        bf3_split(c0[0] * s0, c1[0] * s1, a.hi[2 * kh], a.lo[2 * kh]);
        bf3_split(c0[8] * s0, c1[8] * s1, a.hi[2 * kh + 1], a.lo[2 * kh + 1]);
    }
    return a;
}
// B: the 16×8 block at (k0, n0) of B[k][n] = t[n·P + k] (rows of n, k contiguous).
__device__ __forceinline__ Bf3B bf3_frag_b_nk(const float* t, int P, int k0, int n0, int g, int q) {
    Bf3B b;
    const float* r = t + (n0 + g) * P + k0 + 2 * q;
    bf3_split(*(const float2*)r, b.hi[0], b.lo[0]);
    bf3_split(*(const float2*)(r + 8), b.hi[1], b.lo[1]);
    return b;
}
// B: the block at (k0, n0) of B[k][n] = t[k·P + n] (rows of k, n contiguous).
__device__ __forceinline__ Bf3B bf3_frag_b_kn(const float* t, int P, int k0, int n0, int g, int q) {
    Bf3B b;
    const float* c = t + (k0 + 2 * q) * P + n0 + g;
    bf3_split(c[0], c[P], b.hi[0], b.lo[0]);
    bf3_split(c[8 * P], c[9 * P], b.hi[1], b.lo[1]);
    return b;
}

// ---------------------------------------------------------------- Hopper warpgroup MMA (sm_90a only)
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Shared-memory matrix descriptor of a K-major bf16 tile in the 128-byte swizzle: rows of 64 values
// (128 bytes), 16-byte chunk c of row r at chunk c ^ (r & 7) — the gemm_swz layout — in 8-row atoms
// of 1024 bytes (the tile must start 1024-aligned). Bits: start address >> 4 [0, 14), leading byte
// offset >> 4 [16, 30) (unused by swizzled K-major tiles), stride byte offset >> 4 [32, 46) = one
// atom, swizzle mode [62, 64) = 1 (128 B). The k16 slice s of the tile starts 32·s bytes in.
__device__ __forceinline__ u64 wgmma_desc_sw128(u32 smem_addr) {
    return (u64)((smem_addr & 0x3FFFFu) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Generic-proxy writes to shared memory (st.shared, cp.async) made visible to the async proxy that
// wgmma reads operands through; each writing thread runs it before the barrier that publishes them.
__device__ __forceinline__ void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Shared-memory mbarriers (one u64 each): init with the arrivals a phase needs, arrive, and wait
// until the phase of the given parity has completed.
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile("{\n .reg .pred p;\n WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra WAIT_%=;\n}" ::"r"(bar),
                 "r"(parity)
                 : "memory");
}
// Bulk copies (the TMA engine) from global into shared memory, completing on an mbarrier: one thread
// announces a phase's bytes (its arrival), and any threads issue copies of 16-byte multiples between
// 16-byte-aligned addresses whose bytes count against that phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_copy_g2s(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
// Makes mbarrier inits visible to the async proxy (the bulk copies' complete_tx) and other threads.
__device__ __forceinline__ void fence_mbar_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// Pins accumulator registers at this point of the program (the compiler must not move their reads
// above a wgmma wait or their writes below a wgmma issue).
__device__ __forceinline__ void wgmma_pin(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// d (64 × 136 per warpgroup, f32) = (accumulate ? d : 0) + A·Bᵀ, A [64 × 16] and B [136 × 16] bf16,
// both K-major in shared memory (descriptors). Fragment of warp w, lane 4g + q:
// d[4j + 0, 1] = (row 16w + g, columns 8j + 2q, +1), d[4j + 2, 3] = (row 16w + g + 8, same columns).
__device__ __forceinline__ void wgmma_m64n136k16_bf16(float* d, u64 desc_a, u64 desc_b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %70, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n136k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67}, %68, %69, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}
// d (64 × 128 per warpgroup, f32) += A·Bᵀ with A [64 × 16] f16 from registers (the mma.sync
// m16n8k16 A fragment of warp w's rows 16w..16w+15: a0 = (row g, k 2q..), a1 = (row g + 8, k 2q..),
// a2 = (row g, k 8 + 2q..), a3 = (row g + 8, k 8 + 2q..)) and B [128 × 16] f16, K-major in shared
// memory (descriptor). d's fragment as wgmma_m64n136k16_bf16's. The registers of A are read
// asynchronously: they must stay unchanged until the wgmma wait (pin them after it).
__device__ __forceinline__ void wgmma_m64n128k16_f16_rs(float* d, const u32* a, u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}
#endif
