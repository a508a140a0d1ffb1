//! calla-cuda: the NVIDIA engine. The whole forward pass runs in calla's own kernels, compiled at
//! start-up by NVRTC for the device's architecture; the decode step is a fixed chain of fused
//! kernels captured as one CUDA graph. docs/architecture.md ("Inside calla-cuda") has the map.
//!
//! - [`runtime`]: the device, NVRTC and its kernel cache, graphs, device memory, the kernel
//!   variants the launchers pick ([`KernelChoices`]).
//! - [`ops`]: one kernel family per `.cu` file beside its launcher (`attention.cu` /
//!   `attention.rs`, …), the device weight layouts and the prompt precisions.
//! - [`engine`]: the [`CudaBackend`] (the `calla_engine::Backend`), the decode step's launch
//!   chain, the batched prompt path, sequence state.
//! - [`bench`], [`synthetic`]: `calla bench` and its random models made on the device.
//!
//! Layers: `engine` uses `ops` uses `runtime`; nothing points back up.

pub mod engine;
pub mod ops;
pub mod runtime;

pub mod bench;
pub mod synthetic;

pub use engine::backend::{CudaBackend, CudaLoadReport, CudaOptions};
pub use ops::attention::KvDtype;
pub use ops::prompt_precision::PromptPrecision;
pub use runtime::choices::{DotEngine, KernelChoices, RouterPlacement};
