//! calla-cuda: the NVIDIA engine. Kernels are `.cu` sources compiled at start-up by NVRTC
//! (`nvrtc.rs`); the whole decode step is a fixed chain of fused kernels captured as one CUDA graph.

pub mod kernels;
pub mod nvrtc;
pub mod probe;
pub mod gpu;
pub mod graph;
pub mod pool;
pub mod weights;
pub mod attention;
pub mod deltanet;
pub mod matvec;
pub mod moe;
pub mod select;
pub mod forward;
pub mod backend;
pub mod prefill;
pub mod sequence;
// The prompt (prefill) path: batched kernels (second CUDA engineer).
pub mod attention_prefill;
pub mod deltanet_prefill;
pub mod gemm;
pub mod moe_prefill;
pub mod prefill_layer;

pub use attention::KvDtype;
pub use backend::{CudaBackend, CudaLoadReport, CudaOptions};
pub mod synthetic;
