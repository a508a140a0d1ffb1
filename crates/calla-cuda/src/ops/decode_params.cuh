// decode_params.cuh: the decode launches' shared parameter structs (the cursor, matvec segments).

// ---------------------------------------------------------------- decode launch parameters
// Shared by two kernel families each (the CUDA-core kernels and matvec_tc.cu); the Rust twins
// live in matvec.rs and moe.rs.
#define MAX_SEGMENTS 4
#define MOE_MAX_A 32

struct MatvecSegment {
    MatrixRef m;
    u64 out;
    int rows;
    int pad;
};

// matvec: y_seg (+)= W_seg·x̂ for up to 4 stacked segments that share the input
struct MatvecParams {
    u64 x;         // [K] f32
    u64 norm_gain; // [K] f32 or 0
    MatvecSegment seg[MAX_SEGMENTS];
    int K;
    int nseg;
    int group_size;
    float eps;
    int accumulate; // 1: y += W·x (residual add)
    int total_rows;
};

// Row `row` of the stacked segments: its segment and the row inside it.
__device__ __forceinline__ void matvec_locate(const MatvecParams& p, int row, int& seg, int& local) {
    int r = row, s = 0;
    while (s < p.nseg - 1 && r >= p.seg[s].rows) {
        r -= p.seg[s].rows;
        ++s;
    }
    seg = s;
    local = r;
}

// MoE gate/up: act[slot] = silu(gate·x̂)·(up·x̂) for the routed slots and the shared one
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

// MoE down: h += Σ_slots w·down·act
struct DownParams {
    u64 act;           // [slots, act_stride]
    MatrixRef experts; // [E·D, I]: expert e's rows at e·D
    MatrixRef shared;  // [D, Is]
    u64 topk_ids, topk_w, shared_w;
    u64 h;             // [D] in/out
    int D, I, Is, A, group_size, act_stride, slot_begin, slot_end;
    u64 route_acc;     // or 0: the fused routing's accumulators (below), zeroed here for the next layer
    int route_acc_len; // i64 words
    int pad;
};
