// grid_sync.cu: a grid-wide barrier for persistent kernels (docs/persistent-decode.md), and the kernel
// that checks and times it.
//
// grid_barrier: every block's thread 0 reads the generation, arrives on the counter (atomicAdd) and,
// unless it is the last to arrive, spins until the generation moves; the last one resets the counter
// and advances the generation. Fences on both sides publish each block's writes before the barrier
// to every block after it. Needs every block of the grid resident at once (the launcher sizes the
// grid from the occupancy query) — otherwise the spinning blocks wait for blocks that never start.
//
// grid_sync_check: `phases` barriers in a row. Before barrier k each block writes k into its slot of
// `slots` [gridDim.x]; after it, every block checks that every slot holds k (a barrier that lets a
// block through early shows up as a stale slot) and counts failures into `errors`. Grid: one or more
// blocks per SM, all resident; block 256.

struct GridSync {
    u64 counter;    // u32, 0 between uses
    u64 generation; // u32, any value
};

__device__ __forceinline__ void grid_barrier(const GridSync& s) {
    __syncthreads();
    if (threadIdx.x == 0) {
        volatile u32* gen = (volatile u32*)s.generation;
        const u32 seen = *gen;
        __threadfence(); // this block's writes before its arrival
        if (atomicAdd((u32*)s.counter, 1u) == gridDim.x - 1) {
            *(volatile u32*)s.counter = 0u;
            __threadfence();
            atomicAdd((u32*)s.generation, 1u);
        } else {
            while (*gen == seen) {
            }
        }
        __threadfence(); // every block's writes before anything after the barrier
    }
    __syncthreads();
}

struct GridSyncCheckParams {
    GridSync sync;
    u64 slots;  // [gridDim.x] u32
    u64 errors; // u32
    int phases;
    int pad;
};

extern "C" __global__ void grid_sync_check(const GridSyncCheckParams p) {
    volatile u32* slots = (volatile u32*)p.slots;
    u32 bad = 0;
    for (int k = 1; k <= p.phases; ++k) {
        if (threadIdx.x == 0) slots[blockIdx.x] = (u32)k;
        grid_barrier(p.sync);
        for (int b = threadIdx.x; b < gridDim.x; b += blockDim.x) bad += slots[b] != (u32)k;
        grid_barrier(p.sync); // nobody writes phase k + 1 before everyone has read phase k
    }
    if (bad) atomicAdd((u32*)p.errors, bad);
}

static_assert(sizeof(GridSyncCheckParams) == 40, "GridSyncCheckParams layout differs from its Rust twin");
