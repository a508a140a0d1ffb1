//! calla-cuda: the NVIDIA engine. Kernels are `.cu` sources compiled at start-up by NVRTC
//! (`nvrtc.rs`); the whole decode step is a fixed chain of fused kernels captured as one CUDA graph.

pub mod attention;
pub mod backend;
pub mod decode_layer;
pub mod deltanet;
pub mod forward;
pub mod gpu;
pub mod graph;
pub mod grid_sync;
pub mod kernels;
pub mod lab_stream;
pub mod matvec;
pub mod moe;
pub mod nvrtc;
pub mod pool;
pub mod prefill;
pub mod probe;
pub mod select;
pub mod sequence;
pub mod usable_gpu;
pub mod weights;
// The prompt (prefill) path: batched kernels (second CUDA engineer).
pub mod attention_prefill;
pub mod deltanet_prefill;
pub mod gemm;
pub mod moe_prefill;
pub mod prefill_layer;
pub mod prefill_scratch;
pub mod prompt_precision;

pub use attention::KvDtype;
pub use backend::{CudaBackend, CudaLoadReport, CudaOptions};
pub use prompt_precision::PromptPrecision;
pub mod bench;
pub mod synthetic;
