//! Which of several equivalent kernels the launchers pick.
//!
//! The defaults are the measured fastest (docs/performance.md). The other variants stay in the
//! product for two reasons only: a device setting needs them (a GPU shared with other processes,
//! where a grid's blocks cannot count on running at the same time), or the tests hold a fast
//! variant against the general one it was derived from. The choices reach the launchers through
//! the `Gpu` (set once from `CudaOptions`; tests may switch them between launches).

/// Which dot-product engine a q4 matvec runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DotEngine {
    /// matvec.cu: CUDA-core dot products, every format and width
    Rows,
    /// matvec_tc.cu: q4 (group 64, bf16 parameters) on the tensor cores, K = 1024·{1, 2, 4}
    TensorCores,
}

/// Where the MoE router's top-k is taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouterPlacement {
    /// inside the out-projection before it where the formats allow (moe::fused_route_tail), with
    /// gate/up taking the top-k from its sums; else as `InGateUp`
    Fused,
    /// a router launch of its own; every gate/up block selects
    InGateUp,
    /// a router launch of its own whose last block (after a ticket) selects
    Ticket,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelChoices {
    /// The kernels compiled for Qwen3.5/3.6's dims where they apply (segments, heads and experts as
    /// constants), else the general kernels they were made from.
    pub compiled_copies: bool,
    /// Kernels whose blocks wait for each other (attention's barrier merge, the selection's grid
    /// draw) where every block of the grid fits on the device at once. Off on a GPU whose SMs are
    /// partitioned among processes (MPS): co-residency cannot be checked there.
    pub co_resident_grids: bool,
    pub dot_engine: DotEngine,
    pub router: RouterPlacement,
    /// Fewest KV tiles per live split of decode attention.
    pub attn_min_tiles_per_split: usize,
    /// The DeltaNet output norm finished in the out-projection (else in the DeltaNet kernel).
    pub deltanet_norm_in_out_projection: bool,
    /// For plain greedy, lm_head chooses the token itself where it runs on the tensor cores (no
    /// selection launch).
    pub greedy_head: bool,
}

impl Default for KernelChoices {
    fn default() -> Self {
        KernelChoices {
            compiled_copies: true,
            co_resident_grids: true,
            dot_engine: DotEngine::TensorCores,
            router: RouterPlacement::Fused,
            attn_min_tiles_per_split: 1,
            deltanet_norm_in_out_projection: true,
            greedy_head: true,
        }
    }
}

impl KernelChoices {
    /// The general kernels everywhere the launchers would pick a compiled copy.
    pub fn general() -> Self {
        KernelChoices {
            compiled_copies: false,
            ..Self::default()
        }
    }
    /// For a GPU shared with other processes through MPS.
    pub fn shared_gpu() -> Self {
        KernelChoices {
            co_resident_grids: false,
            ..Self::default()
        }
    }
}
