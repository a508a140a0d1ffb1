// grid_sync.cu: the check and timing of common.cuh's grid-wide barrier (grid_barrier), which the
// persistent decode layer uses between its phases (decode_layer.cu, docs/persistent-decode.md).
//
// grid_sync_check: `phases` barriers in a row. Before barrier k each block writes k into its slot of
// `slots` [gridDim.x]; after it, every block checks that every slot holds k (a barrier that lets a
// block through early shows up as a stale slot) and counts failures into `errors`. Grid: one or more
// blocks per SM, all resident; block 256.

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
