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

// Two f32 → packed bf16 pair (low half = first), round to nearest even.
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    return (u32)f32_to_bf16(lo) | ((u32)f32_to_bf16(hi) << 16);
}

// Two f32 → packed bf16 pair (low half = lo), one hardware conversion (round to nearest even).
__device__ __forceinline__ u32 cvt_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); // first source → upper half
    return r;
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

// Exact f32 from the planes (lo may be null).
__device__ __forceinline__ float load_planes(const u16* hi, const u16* lo, i64 i) {
    float v = bf16_to_f32(hi[i]);
    if (lo) v += bf16_to_f32(lo[i]);
    return v;
}
