// fill.cu: seeded random tensors made directly on the GPU (synthetic benchmark weights: no host
// arrays of tens of GB). Every element is a pure function of (seed, index): splitmix64.
//
// fill_u32:        ptr[i] = random bits                        (4-bit / 8-bit codes)
// fill_f32:        ptr[i] = a + (b − a)·U                       (U uniform in [0, 1))
// fill_bf16:       ptr[i] = bf16(a + (b − a)·U)
// fill_affine_bf16: group parameters: scale = a + (b − a)·U, bias = −scale·c (centred codes), stored
//                  as the (scale, bias) bf16 pair of one u32 (common.cuh PARAM_BF16)
// grid-stride, block 256. Bytes per call: the tensor, written once.

struct FillParams {
    u64 ptr;
    u64 n;     // elements (pairs for fill_affine_bf16)
    u64 seed;
    float a, b, c;
    int pad;
};

__device__ __forceinline__ u64 splitmix(u64 z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
__device__ __forceinline__ float unit_rand(u64 seed, u64 i) {
    return (float)(splitmix(seed * 0x2545F4914F6CDD1Dull + i) >> 40) * (1.0f / 16777216.0f);
}

extern "C" __global__ void fill_u32(const FillParams p) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < p.n; i += (u64)gridDim.x * blockDim.x)
        ((u32*)p.ptr)[i] = (u32)splitmix(p.seed * 0x2545F4914F6CDD1Dull + i);
}
extern "C" __global__ void fill_f32(const FillParams p) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < p.n; i += (u64)gridDim.x * blockDim.x)
        ((float*)p.ptr)[i] = p.a + (p.b - p.a) * unit_rand(p.seed, i);
}
extern "C" __global__ void fill_bf16(const FillParams p) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < p.n; i += (u64)gridDim.x * blockDim.x)
        ((u16*)p.ptr)[i] = f32_to_bf16(p.a + (p.b - p.a) * unit_rand(p.seed, i));
}
extern "C" __global__ void fill_affine_bf16(const FillParams p) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < p.n; i += (u64)gridDim.x * blockDim.x) {
        const float scale = p.a + (p.b - p.a) * unit_rand(p.seed, i);
        const u32 s = f32_to_bf16(scale), b = f32_to_bf16(-scale * p.c);
        ((u32*)p.ptr)[i] = s | (b << 16);
    }
}

// Layouts shared with the Rust launchers (tests/layouts.rs checks the same sizes).
static_assert(sizeof(FillParams) == 40, "FillParams layout differs from its Rust twin");
